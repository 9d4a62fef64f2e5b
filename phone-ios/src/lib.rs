//! The phone's library: the C ABI an iOS app starts, watches and stops a helper through
//! (ffi.rs, include/tether_helper.h), built as a static library for the phone; the Swift app
//! that links it is app/. What runs is engine-core's helper runner
//! (`engine_core::helper::runner`), the same one `tether-helper` (host-native) runs from a
//! command line.

pub mod ffi;
