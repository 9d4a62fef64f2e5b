//! tether's WGSL kernels: every op of the Qwen3.5 hybrid on a GPU, each tested against the CPU
//! reference op (`engine-core::backend::cpu`) by `tests/tests/gpu_ops.rs` through the wgpu op
//! layer (`engine-core::backend::gpu`).
//!
//! - `wgsl/*.wgsl`: the sources (`include_str!`), one file per family of kernels.
//! - [`KERNELS`]: every kernel, its entry points, the binding layout of each entry point
//!   (binding index -> name, uniform / read / read_write, all in group 0) and the defines it
//!   takes, with a canonical set of values. The op layer builds its bind group layouts and the
//!   MSL export its binding map from this one description; [`translate::check_layout`] checks
//!   it against naga's analysis of each module.
//! - Specialisation is a small preprocessor ([`preprocess`]), not WGSL `override`s: a
//!   specialisation changes types (f32 / packed f16 / native f16 weights, see
//!   [`WeightFormat`]) and array sizes (`HEAD_DIM`, `CHUNK`), and the result needs no
//!   override pass before MSL or SPIR-V export.
//! - [`translate`]: naga validation and MSL / SPIR-V translation; the `export-msl` binary
//!   writes one `.metal` per kernel and specialisation plus `bindings.json` for the phone's
//!   Metal path.
//!
//! f16 without the `shader-f16` feature: weights are stored as f16 pairs in `u32` and widened
//! with `unpack2x16float`; arithmetic and all state (the delta rule's included) are f32.

pub mod preprocess;
mod registry;
pub mod translate;

pub use preprocess::Spec;
pub use registry::{
    kernel, Access, Binding, Entry, Kernel, Param, SpecError, WeightFormat, KERNELS,
};
