//! The helper's device side. The runtime every helper runs is engine-core's `helper` module
//! (the same code in a browser tab); this crate holds the `tether-helper` binary that serves it
//! over WebSocket, and the iOS shell with its Metal / Core ML paths when the phone issue comes.
