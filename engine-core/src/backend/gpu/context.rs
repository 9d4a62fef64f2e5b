//! The device the ops run on ([`Gpu`]): one of the [`Device`] implementations, the buffer pool,
//! and the batch every op records into (submitted by `flush`, so a whole forward pass can be
//! one submission), with what it binds kept alive until then.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use shaders::{Kernel, Spec};

use super::device::{Binding, Buffer, Device, Reading};
#[cfg(all(feature = "metal", target_vendor = "apple"))]
use super::metal_device::MetalDevice;
use super::pool::{BufferPool, Pooled};
use super::tensor::GpuTensor;
use super::wgpu_device::WgpuDevice;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "no GPU adapter found for backends {0} (on Linux, install a Vulkan driver; the software \
         one is `apt-get install mesa-vulkan-drivers`)"
    )]
    NoAdapter(String),
    #[error("GPU device request failed on {adapter}: {message}")]
    Device { adapter: String, message: String },
    #[error("GPU: {0}")]
    Unsupported(String),
    #[error("GPU read-back failed: {0}")]
    ReadBack(String),
}

/// How to pick the device.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// Backends to try; `WGPU_BACKEND` (e.g. `vulkan`, `metal`) overrides them. Ignored in a
    /// browser (wasm32), where the page's WebGPU is the one backend this build has.
    pub backends: wgpu::Backends,
    /// Ask for the software adapter (lavapipe) even when a hardware one exists.
    pub force_fallback: bool,
    /// Use `shader-f16` (native f16 weights) when the adapter has it.
    pub allow_f16: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            backends: wgpu::Backends::PRIMARY,
            force_fallback: false,
            allow_f16: true,
        }
    }
}

/// Workgroups per grid dimension (WebGPU's minimum limit); larger grids wrap into y.
const MAX_GROUPS: u32 = 65535;

/// A workgroup grid of `workgroups` groups, as `[x, y]`: kernels linearise `x + y * nx`.
pub(super) fn grid(workgroups: usize) -> [u32; 2] {
    let n = u32::try_from(workgroups).expect("workgroup count fits u32");
    [n.clamp(1, MAX_GROUPS), n.div_ceil(MAX_GROUPS).max(1)]
}

/// A resource bound to one binding of a dispatch.
pub(super) enum Bind<'a> {
    Tensor(&'a GpuTensor),
    /// A weight block: the whole buffer.
    Buffer(&'a Buffer),
}

pub struct Gpu {
    device: Box<dyn Device>,
    pub(super) pool: Arc<BufferPool>,
    /// Every pooled buffer the batch being recorded binds, kept out of the pool until the
    /// batch is submitted. Its lock is held while recording and submitting, so the device sees
    /// one caller at a time.
    batch: Mutex<Vec<Arc<Pooled>>>,
    /// Submissions so far: every flush and every read-back (which flushes) counts one.
    submits: AtomicU64,
    /// Bytes written from the host so far: uploads of values and weights.
    pub(super) uploaded: AtomicU64,
}

impl Gpu {
    /// The default device: a hardware adapter if there is one, else the software fallback.
    pub fn new() -> Result<Gpu, GpuError> {
        Gpu::with_options(&GpuOptions::default())
    }

    /// The device `opts` picks, waited for on this thread ([`Gpu::acquire`] is the same without
    /// the wait).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn with_options(opts: &GpuOptions) -> Result<Gpu, GpuError> {
        pollster::block_on(Gpu::acquire(opts))
    }

    /// In a browser the adapter and device arrive through the page's event loop, which cannot
    /// run while this thread waits: this fails at once (rather than hanging the tab) and names
    /// the constructor to await instead.
    #[cfg(target_arch = "wasm32")]
    pub fn with_options(_opts: &GpuOptions) -> Result<Gpu, GpuError> {
        Err(GpuError::Unsupported(
            "a browser tab cannot wait for its GPU device: await `Gpu::acquire` (or \
             `GpuBackend::new_async`) instead"
                .into(),
        ))
    }

    /// The device `opts` picks, as a future: what a browser awaits (natively,
    /// [`Gpu::with_options`] waits for it).
    pub async fn acquire(opts: &GpuOptions) -> Result<Gpu, GpuError> {
        Ok(Gpu::on(Box::new(WgpuDevice::acquire(opts).await?)))
    }

    fn on(device: Box<dyn Device>) -> Gpu {
        Gpu {
            device,
            pool: BufferPool::new(),
            batch: Mutex::new(Vec::new()),
            submits: AtomicU64::new(0),
            uploaded: AtomicU64::new(0),
        }
    }

    /// The system's Metal device, driven directly (not through wgpu), running the `shaders`
    /// crate's MSL of the kernels.
    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    pub fn metal() -> Result<Gpu, GpuError> {
        Ok(Gpu::on(Box::new(MetalDevice::system_default()?)))
    }

    /// The device, for the user: e.g. "llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, Cpu)".
    pub fn adapter_name(&self) -> String {
        self.device.name()
    }

    /// Native f16 (`shader-f16`) is enabled on this device.
    pub fn has_f16(&self) -> bool {
        self.device.has_f16()
    }

    /// A software adapter (see `Device::is_software`).
    pub fn is_software(&self) -> bool {
        self.device.is_software()
    }

    /// Bytes one storage binding may span: larger weights are split into row blocks.
    pub fn max_binding(&self) -> u64 {
        self.device.max_binding()
    }

    /// Command submissions so far (each read-back is one): what a device-resident forward
    /// pass keeps small, and what tests count per decode step.
    pub fn submits(&self) -> u64 {
        self.submits.load(Ordering::Relaxed)
    }

    /// Bytes written from the host to the device so far (values and weights).
    pub fn uploaded_bytes(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }

    /// Records one dispatch of `kernel`'s `entry` into the current batch. `params` is the
    /// kernel's `Params` struct as 32-bit words.
    pub(super) fn dispatch(
        &self,
        kernel: &'static Kernel,
        entry: &'static str,
        spec: &Spec,
        params: &[u32],
        binds: &[(u32, Bind)],
        groups: [u32; 2],
    ) {
        let mut keep = self.batch.lock().expect("batch lock");
        let binds: Vec<Binding> = binds
            .iter()
            .map(|(binding, b)| match b {
                Bind::Tensor(t) => {
                    keep.push(t.pooled().clone());
                    (*binding, t.buffer(), t.bytes().max(4))
                }
                Bind::Buffer(buf) => (*binding, *buf, buf.size()),
            })
            .collect();
        self.device
            .dispatch(kernel, entry, spec, params, &binds, groups);
    }

    /// Records a copy of `len` elements of `src` from `src_offset` into `dst` at `dst_offset`
    /// (both tensors of 4-byte elements, so every offset meets the copy alignment).
    pub fn copy(
        &self,
        src: &GpuTensor,
        src_offset: usize,
        dst: &GpuTensor,
        dst_offset: usize,
        len: usize,
    ) {
        assert!(
            src_offset + len <= src.len() && dst_offset + len <= dst.len(),
            "copy out of bounds"
        );
        if len == 0 {
            return;
        }
        let mut keep = self.batch.lock().expect("batch lock");
        keep.extend([src.pooled().clone(), dst.pooled().clone()]);
        self.device.copy(
            src.buffer(),
            src_offset as u64 * 4,
            dst.buffer(),
            dst_offset as u64 * 4,
            len as u64 * 4,
        );
    }

    /// Writes `bytes` to `t` (fresh from the pool), ordered before everything recorded after.
    pub(super) fn write(&self, t: &GpuTensor, bytes: &[u8]) {
        self.uploaded
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.device.write(t.buffer(), bytes);
    }

    /// A weight buffer holding `bytes`.
    pub(super) fn weights(&self, bytes: &[u8]) -> Buffer {
        self.uploaded
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.device.weights(bytes)
    }

    /// A tensor buffer of `bytes` or more, for the pool.
    pub(super) fn new_buffer(&self, bytes: u64) -> Buffer {
        self.device.buffer(bytes)
    }

    /// Submits everything recorded since the last flush. The batch lock is held until the
    /// submission is made, so work recorded by any thread before a flush returns is on the
    /// queue ahead of anything submitted after it.
    pub fn flush(&self) {
        let mut keep = self.batch.lock().expect("batch lock");
        if self.device.submit() {
            self.submits.fetch_add(1, Ordering::Relaxed);
        }
        // The buffers go back to the pool here: they may be reused by work recorded from now
        // on, which the queue orders after this submission.
        keep.clear();
    }

    /// Copies of element ranges of tensors, concatenated, recorded after everything so far and
    /// submitted with the batch now: many pieces cost one submission, and ops recorded later
    /// cannot change what is read.
    pub(super) fn start_read(&self, parts: &[(&GpuTensor, Range<usize>)]) -> Reading {
        for (t, r) in parts {
            assert!(r.end <= t.len(), "read-back out of bounds");
        }
        if parts.iter().all(|(_, r)| r.is_empty()) {
            return Box::pin(std::future::ready(Ok(Vec::new())));
        }
        let ranges: Vec<(&Buffer, Range<u64>)> = parts
            .iter()
            .map(|(t, r)| (t.buffer(), r.start as u64 * 4..r.end as u64 * 4))
            .collect();
        let mut keep = self.batch.lock().expect("batch lock");
        let read = self.device.read(&ranges);
        self.submits.fetch_add(1, Ordering::Relaxed);
        keep.clear();
        read
    }
}
