//! The helper's device side. The runtime every helper runs is engine-core's `helper` module
//! (the same code in a browser tab); this crate holds the runner that serves it over the
//! network (listening for hosts, or joining one), which the `tether-helper` binary
//! (host-native) runs, and the iOS shell with its Metal / Core ML paths when the phone issue
//! comes.

pub mod runner;
