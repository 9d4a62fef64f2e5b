//! The GPU op layer: every kernel of the `shaders` crate as a function on device buffers
//! (`ops`), over a `device::Device` (wgpu in `wgpu_device`; Metal itself in `metal_device`,
//! Apple builds with the `metal` feature), held with its recording batch by `Gpu` (`context`),
//! pooled activations and row-blocked weights (`tensor`, `pool`; quantised blocks in their
//! device layouts, `packing`), and `GpuBackend`, the
//! `Backend` trait on these ops (`backend`; see docs/GPU.md for what it does not do yet).

mod backend;
mod context;
mod device;
#[cfg(all(feature = "metal", target_vendor = "apple"))]
mod metal_device;
pub mod ops;
mod packing;
mod pool;
mod tensor;
mod wgpu_device;

pub use backend::GpuBackend;
pub use context::{Gpu, GpuError, GpuOptions};
pub use shaders::WeightFormat;
pub use tensor::{GpuMatrix, GpuTensor};
