//! The helper side of tether: the portable runtime, the `tether-helper` binary and the iOS
//! shell. Empty until the split lands (issue 3); it already depends on `engine-core` so the
//! helper shares the host's model code from the first line it gets.
