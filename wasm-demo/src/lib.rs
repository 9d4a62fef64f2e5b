//! The browser demo. Empty until the split and the wgpu backend exist; CI builds `engine-core`
//! for `wasm32-unknown-unknown` so the engine stays portable in the meantime.
