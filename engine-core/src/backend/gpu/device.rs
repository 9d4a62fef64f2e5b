//! The device under the op layer: what an op needs from a GPU API, and nothing more. The ops
//! (`ops.rs`), the backend (`backend.rs`), the pool and the tensors are written once over this
//! trait; each API implements it once: wgpu (`wgpu_device.rs`: Vulkan, Metal, DX12, a
//! browser's WebGPU) and, on Apple devices, Metal itself (`metal_device.rs`), which runs the
//! `shaders` crate's MSL of the same kernels.
//!
//! A device records work into one batch at a time, which [`Device::submit`] sends to its one
//! queue. [`Gpu`](super::Gpu) above it keeps every pooled buffer a batch binds alive until the
//! batch is submitted, and serialises dispatches, copies, submissions and reads under one lock.
//! Buffers are made and written (`buffer`, `weights`, `write`) outside that lock, from any
//! thread: each implementation orders a write itself.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;

use shaders::{Kernel, Spec};

use super::context::GpuError;

/// A buffer of one device (each implementation makes and takes only its own kind).
pub(super) enum Buffer {
    Wgpu(wgpu::Buffer),
    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    Metal(super::metal_device::MetalBuffer),
}

impl Buffer {
    /// Its size in bytes.
    pub(super) fn size(&self) -> u64 {
        match self {
            Buffer::Wgpu(b) => b.size(),
            #[cfg(all(feature = "metal", target_vendor = "apple"))]
            Buffer::Metal(b) => b.size(),
        }
    }
}

/// One binding of a dispatch: the WGSL binding index, the buffer and the bytes bound (from 0).
pub(super) type Binding<'a> = (u32, &'a Buffer, u64);

/// A read-back in flight: the bytes of the ranges asked for, concatenated.
pub(super) type Reading = Pin<Box<dyn Future<Output = Result<Vec<u8>, GpuError>>>>;

pub(super) trait Device: Send + Sync {
    /// For the user: adapter or device name and API.
    fn name(&self) -> String;

    /// Native f16 arithmetic in kernels (WGSL `enable f16`).
    fn has_f16(&self) -> bool;

    /// A software rasteriser posing as a GPU (SwiftShader, lavapipe): correct, but slower than
    /// the CPU backend on the same cores, so nothing should pick it unasked.
    fn is_software(&self) -> bool;

    /// Bytes one storage binding may span.
    fn max_binding(&self) -> u64;

    /// A storage buffer of `bytes` (ops read and write it, copies go to and from it); its
    /// contents are undefined.
    fn buffer(&self, bytes: u64) -> Buffer;

    /// A read-only storage buffer holding `bytes` (weights), ready for any batch.
    fn weights(&self, bytes: &[u8]) -> Buffer;

    /// Writes `bytes` at the start of `buffer`, ordered before every command recorded after
    /// this call. `buffer` may have been bound by batches already submitted (it came back to
    /// the pool), which must still read its old contents.
    fn write(&self, buffer: &Buffer, bytes: &[u8]);

    /// Records one dispatch of `kernel`'s `entry` (specialised by `spec`) on a grid of
    /// `groups` workgroups, with `params` (the kernel's `Params` struct as 32-bit words) at
    /// binding 0 and `binds` at theirs.
    fn dispatch(
        &self,
        kernel: &'static Kernel,
        entry: &'static str,
        spec: &Spec,
        params: &[u32],
        binds: &[Binding],
        groups: [u32; 2],
    );

    /// Records a copy of `bytes` from `src` at `src_offset` to `dst` at `dst_offset` (offsets
    /// and length multiples of 4).
    fn copy(&self, src: &Buffer, src_offset: u64, dst: &Buffer, dst_offset: u64, bytes: u64);

    /// Submits what was recorded, if anything; says whether it submitted.
    fn submit(&self) -> bool;

    /// Records copies of byte ranges of buffers after everything recorded so far and submits
    /// them with the batch now (so what is recorded later cannot change what is read); the
    /// future gives their bytes. Natively its first poll waits for the device; in a browser it
    /// completes on the page's event loop.
    fn read(&self, parts: &[(&Buffer, Range<u64>)]) -> Reading;
}
