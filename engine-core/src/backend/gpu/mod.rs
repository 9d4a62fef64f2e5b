//! The wgpu op layer: every kernel of the `shaders` crate as a function on device buffers
//! (`ops`), the device with its pipeline cache and recording batch (`context`), pooled
//! activations and row-blocked weights (`tensor`, `pool`), and `GpuBackend`, the `Backend`
//! trait on these ops (`backend`; see docs/GPU.md for what it does not do yet).

mod backend;
mod context;
pub mod ops;
mod pool;
mod tensor;

pub use backend::GpuBackend;
pub use context::{Gpu, GpuError, GpuOptions};
pub use shaders::WeightFormat;
pub use tensor::{GpuMatrix, GpuTensor};
