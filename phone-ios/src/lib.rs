//! The helper's device side. The runtime every helper runs is engine-core's `helper` module
//! (the same code in a browser tab); this crate holds the runner that serves it over the
//! network (listening for hosts, or joining one), which the `tether-helper` binary
//! (host-native) runs, and the C ABI an iOS app calls it through (ffi.rs; built as a static
//! library for the phone).

pub mod ffi;
pub mod runner;
