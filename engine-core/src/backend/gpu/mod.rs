//! The wgpu op layer: every kernel of the `shaders` crate as a function on device buffers
//! (`ops`), the device with its pipeline cache and recording batch (`context`), pooled
//! activations and row-blocked weights (`tensor`, `pool`). It does not implement `Backend`
//! yet: a device-resident forward pass will be built on these functions (see docs/GPU.md).

mod context;
pub mod ops;
mod pool;
mod tensor;

pub use context::{Gpu, GpuError, GpuOptions};
pub use shaders::WeightFormat;
pub use tensor::{GpuMatrix, GpuTensor};
