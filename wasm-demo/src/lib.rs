//! tether in the browser: a tab that joins a host as a helper (www/helper.html), and the
//! simulator of the split page (src/sim.rs, www/sim.js).
//!
//! The helper tab dials the host's `--accept-helpers` address with the browser's WebSocket,
//! pairs with the code the host shows (then remembers the host's key), holds KV pages and
//! answers attention on the page's WebGPU (the CPU backend where there is none) and runs the tail layers of a split prefill,
//! all through engine-core's helper runtime.
//!
//! The model is the host's: the tab fetches the tensors of the layers it is assigned from the
//! host over HTTP, checks them and keeps them for its next visit (src/weights.rs); a preset's
//! weights it generates from the seed, as the host did.

pub mod pump;
pub mod sim;
#[cfg(target_arch = "wasm32")]
mod tab;
#[cfg(target_arch = "wasm32")]
mod weights;

#[cfg(target_arch = "wasm32")]
pub use tab::TabHelper;
