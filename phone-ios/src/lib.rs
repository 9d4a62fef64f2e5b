//! The helper side of tether: the portable runtime (`runtime`), and the `tether-helper`
//! binary that serves it over WebSocket. The iOS shell and the Metal / Core ML paths come with
//! later issues.

pub mod runtime;

pub use runtime::{prefill_bytes, Helper, HelperOptions, LoadLayers, SessionEnd, Weights};
