//! tether's WGSL kernels live here, each with its naga validation and MSL export tests.
//! The crate is empty until the wgpu backend lands (issue 4); the CPU backend in
//! `engine-core::backend::cpu` is the reference those kernels will be tested against.
