//! [`Device`] on Metal itself (`objc2-metal`), for iOS, where the phone helper runs, and macOS
//! (`--backend metal`, beside wgpu's own Metal backend). It runs the `shaders` crate's MSL
//! of each kernel specialisation, the translation `export-msl` writes and CI checks: WGSL
//! binding `i` at `[[buffer(i)]]`, the params struct at buffer 0 (set as bytes), and naga's
//! buffer-sizes struct at `SIZES_SLOT`. The MSL is compiled from source when a pipeline is
//! first used (no `.metallib` is built ahead of time yet: that needs Xcode's `metal` tool).
//!
//! Buffers are shared (unified memory): weights are made from their bytes in place, with no
//! staging copy. An upload into a pooled buffer goes through a blit from a new shared buffer,
//! so that it is ordered after the batches that still use the buffer's old contents; a
//! read-back blits into a new shared buffer, read once its command buffer completes.
//!
//! Compile-checked for aarch64-apple-ios and aarch64-apple-darwin, not run: there is no Apple
//! device here (docs/PHONE.md).

use std::collections::HashMap;
use std::ffi::c_void;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use objc2::rc::{autoreleasepool, Retained};
use objc2::runtime::ProtocolObject;
use objc2_foundation::NSString;
use objc2_metal::{
    MTLBlitCommandEncoder, MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder,
    MTLCommandQueue, MTLComputeCommandEncoder, MTLComputePipelineState,
    MTLCreateSystemDefaultDevice, MTLDevice, MTLLibrary, MTLResourceOptions, MTLSize,
};
use shaders::translate::{self, SIZES_SLOT};
use shaders::{Kernel, Spec};

use super::context::GpuError;
use super::device::{Binding, Buffer, Device, Reading};

type Object<P> = Retained<ProtocolObject<P>>;

// A command-line tool's MTLCreateSystemDefaultDevice returns no device unless CoreGraphics is
// linked (objc2-metal's documentation); wgpu links it today, this does not rely on that.
#[cfg(target_os = "macos")]
#[link(name = "CoreGraphics", kind = "framework")]
extern "C" {}

/// A shared-storage Metal buffer.
pub(super) struct MetalBuffer(Object<dyn MTLBuffer>);

// SAFETY: Metal resources may be used from any thread (Apple's Metal threading guidance: a
// device, its queues and resources are thread-safe); the contents are only written through
// commands ordered on the one queue, or before the buffer is shared.
unsafe impl Send for MetalBuffer {}
unsafe impl Sync for MetalBuffer {}

impl MetalBuffer {
    pub(super) fn size(&self) -> u64 {
        self.0.length() as u64
    }
}

fn buffer(b: &Buffer) -> &ProtocolObject<dyn MTLBuffer> {
    match b {
        Buffer::Metal(b) => &b.0,
        #[allow(unreachable_patterns)]
        _ => unreachable!("a Metal device is given only its own buffers"),
    }
}

/// Kernel name, entry point, spec key.
type PipelineKey = (&'static str, &'static str, String);

struct Pipeline {
    state: Object<dyn MTLComputePipelineState>,
    /// The entry's workgroup size, which Metal takes at dispatch.
    threads: MTLSize,
    /// The WGSL binding whose byte size each field of the buffer-sizes struct holds.
    sizes_fields: Vec<u32>,
}

/// The open encoder of the batch being recorded: consecutive dispatches share one compute
/// encoder, consecutive copies one blit encoder.
enum Encoder {
    None,
    Compute(Object<dyn MTLComputeCommandEncoder>),
    Blit(Object<dyn MTLBlitCommandEncoder>),
}

struct Batch {
    commands: Object<dyn MTLCommandBuffer>,
    encoder: Encoder,
}

impl Batch {
    fn end_encoder(&mut self) {
        match std::mem::replace(&mut self.encoder, Encoder::None) {
            Encoder::None => {}
            Encoder::Compute(e) => e.endEncoding(),
            Encoder::Blit(e) => e.endEncoding(),
        }
    }

    fn compute(&mut self) -> &ProtocolObject<dyn MTLComputeCommandEncoder> {
        if !matches!(self.encoder, Encoder::Compute(_)) {
            self.end_encoder();
            let e = self
                .commands
                .computeCommandEncoder()
                .expect("a compute command encoder");
            self.encoder = Encoder::Compute(e);
        }
        match &self.encoder {
            Encoder::Compute(e) => e,
            _ => unreachable!("opened above"),
        }
    }

    fn blit(&mut self) -> &ProtocolObject<dyn MTLBlitCommandEncoder> {
        if !matches!(self.encoder, Encoder::Blit(_)) {
            self.end_encoder();
            let e = self
                .commands
                .blitCommandEncoder()
                .expect("a blit command encoder");
            self.encoder = Encoder::Blit(e);
        }
        match &self.encoder {
            Encoder::Blit(e) => e,
            _ => unreachable!("opened above"),
        }
    }

    /// Ends the encoder and commits the command buffer, which runs after every one committed
    /// before it on the queue.
    fn commit(mut self) -> Object<dyn MTLCommandBuffer> {
        self.end_encoder();
        self.commands.commit();
        self.commands.clone()
    }
}

/// An encoder released without `endEncoding` fails Metal's API validation (a batch left
/// unsubmitted when the device goes, or a panic while recording).
impl Drop for Batch {
    fn drop(&mut self) {
        self.end_encoder();
    }
}

pub(super) struct MetalDevice {
    device: Object<dyn MTLDevice>,
    queue: Object<dyn MTLCommandQueue>,
    pipelines: Mutex<HashMap<PipelineKey, Arc<Pipeline>>>,
    batch: Mutex<Option<Batch>>,
    /// Command buffers committed by flushes since the last read-back, whose errors that read
    /// reports (they completed before it: one queue runs them in order).
    flushed: Mutex<Vec<Object<dyn MTLCommandBuffer>>>,
}

// SAFETY: the device and queue are thread-safe (see `MetalBuffer`); the command buffer and
// encoders, which are not, are only touched under the `batch` lock.
unsafe impl Send for MetalDevice {}
unsafe impl Sync for MetalDevice {}

const SHARED: MTLResourceOptions = MTLResourceOptions::StorageModeShared;

impl MetalDevice {
    pub(super) fn system_default() -> Result<MetalDevice, GpuError> {
        let device = MTLCreateSystemDefaultDevice()
            .ok_or_else(|| GpuError::NoAdapter("Metal (no system default device)".into()))?;
        let queue = device.newCommandQueue().ok_or_else(|| GpuError::Device {
            adapter: device.name().to_string(),
            message: "no command queue".into(),
        })?;
        Ok(MetalDevice {
            device,
            queue,
            pipelines: Mutex::new(HashMap::new()),
            batch: Mutex::new(None),
            flushed: Mutex::new(Vec::new()),
        })
    }

    /// The pipeline of `kernel`'s `entry` under `spec`, compiled from its MSL on first use.
    /// A kernel that does not translate or compile is a build defect (CI translates every
    /// specialisation), so it panics, as wgpu does on an invalid shader.
    fn pipeline(&self, kernel: &'static Kernel, entry: &'static str, spec: &Spec) -> Arc<Pipeline> {
        autoreleasepool(|_| self.build_pipeline(kernel, entry, spec))
    }

    fn build_pipeline(
        &self,
        kernel: &'static Kernel,
        entry: &'static str,
        spec: &Spec,
    ) -> Arc<Pipeline> {
        let key = (kernel.name, entry, spec.key());
        let mut cache = self.pipelines.lock().expect("pipeline cache lock");
        if let Some(p) = cache.get(&key) {
            return p.clone();
        }
        let fail = |what: &str, e: &dyn std::fmt::Display| -> ! {
            panic!(
                "kernel {} [{}] entry {entry}: {what}: {e}",
                kernel.name,
                spec.key()
            )
        };
        let compiled = translate::compile(kernel, spec).unwrap_or_else(|e| fail("WGSL", &e));
        let msl = translate::to_msl(&compiled).unwrap_or_else(|e| fail("MSL", &e));
        let e = msl
            .entries
            .iter()
            .find(|e| e.name == entry)
            .unwrap_or_else(|| fail("MSL", &"no such entry"));
        let library = self
            .device
            .newLibraryWithSource_options_error(&NSString::from_str(&msl.source), None)
            .unwrap_or_else(|err| fail("Metal compiler", &err));
        let function = library
            .newFunctionWithName(&NSString::from_str(&e.metal_name))
            .unwrap_or_else(|| fail("Metal library", &"function not found"));
        let state = self
            .device
            .newComputePipelineStateWithFunction_error(&function)
            .unwrap_or_else(|err| fail("Metal pipeline", &err));
        let [x, y, z] = e.workgroup_size;
        let p = Arc::new(Pipeline {
            state,
            threads: MTLSize {
                width: x as usize,
                height: y as usize,
                depth: z as usize,
            },
            sizes_fields: msl.sizes_fields,
        });
        cache.insert(key, p.clone());
        p
    }

    /// A new shared buffer holding `bytes` (at least 4 bytes long).
    fn shared_with(&self, bytes: &[u8]) -> Object<dyn MTLBuffer> {
        if bytes.is_empty() {
            return self.shared(4);
        }
        let ptr = NonNull::new(bytes.as_ptr() as *mut c_void).expect("a slice's pointer");
        // SAFETY: `ptr` points at `bytes.len()` readable bytes, which Metal copies.
        unsafe {
            self.device
                .newBufferWithBytes_length_options(ptr, bytes.len(), SHARED)
        }
        .expect("a shared Metal buffer")
    }

    fn shared(&self, bytes: u64) -> Object<dyn MTLBuffer> {
        self.device
            .newBufferWithLength_options(bytes.max(4) as usize, SHARED)
            .expect("a shared Metal buffer")
    }

    /// `f` on the batch being recorded, begun on first use. Like every call into Metal here,
    /// in an autorelease pool: the helper's threads are long-lived Rust threads with none of
    /// their own, so objects Metal autoreleases would pile up until the thread ends.
    fn recording<R>(&self, f: impl FnOnce(&mut Batch) -> R) -> R {
        autoreleasepool(|_| {
            let mut batch = self.batch.lock().expect("batch lock");
            let batch = batch.get_or_insert_with(|| Batch {
                commands: self.queue.commandBuffer().expect("a Metal command buffer"),
                encoder: Encoder::None,
            });
            f(batch)
        })
    }
}

/// Sets `bytes` (at most 4 KiB, Metal's limit for inline constants) at buffer slot `index`.
fn set_bytes(e: &ProtocolObject<dyn MTLComputeCommandEncoder>, bytes: &[u8], index: usize) {
    let ptr = NonNull::new(bytes.as_ptr() as *mut c_void).expect("non-empty constants");
    // SAFETY: `ptr` points at `bytes.len()` readable bytes, which Metal copies.
    unsafe { e.setBytes_length_atIndex(ptr, bytes.len(), index) }
}

impl Device for MetalDevice {
    fn name(&self) -> String {
        format!("{} (native Metal)", self.device.name())
    }

    /// MSL has `half` on every Metal device.
    fn has_f16(&self) -> bool {
        true
    }

    /// Metal has no software device.
    fn is_software(&self) -> bool {
        false
    }

    /// Capped at what the kernels' u32 indices and the sizes struct's u32 fields can address.
    fn max_binding(&self) -> u64 {
        (self.device.maxBufferLength() as u64).min(u64::from(u32::MAX))
    }

    fn buffer(&self, bytes: u64) -> Buffer {
        Buffer::Metal(MetalBuffer(self.shared(bytes)))
    }

    fn weights(&self, bytes: &[u8]) -> Buffer {
        Buffer::Metal(MetalBuffer(self.shared_with(bytes)))
    }

    fn write(&self, b: &Buffer, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        // The command buffer retains the source buffer until it completes.
        let source = self.shared_with(bytes);
        self.recording(|batch| {
            // SAFETY: both ranges lie inside their buffers (the pool's buffer is at least as
            // large as what is written to it).
            unsafe {
                batch
                    .blit()
                    .copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size(
                        &source,
                        0,
                        buffer(b),
                        0,
                        bytes.len(),
                    )
            }
        });
    }

    fn dispatch(
        &self,
        kernel: &'static Kernel,
        entry: &'static str,
        spec: &Spec,
        params: &[u32],
        binds: &[Binding],
        groups: [u32; 2],
    ) {
        let p = self.pipeline(kernel, entry, spec);
        // The params struct, padded to 16 bytes as a uniform binding is.
        let mut constants: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
        constants.resize(constants.len().next_multiple_of(16).max(16), 0);
        let sizes: Vec<u8> = p
            .sizes_fields
            .iter()
            .map(|i| binds.iter().find(|b| b.0 == *i).map_or(0, |b| b.2 as u32))
            .flat_map(u32::to_le_bytes)
            .collect();
        self.recording(|batch| {
            let e = batch.compute();
            e.setComputePipelineState(&p.state);
            set_bytes(e, &constants, 0);
            for &(binding, b, _) in binds {
                // SAFETY: the buffer lives until the batch completes (Metal retains it; the
                // pool keeps it until the batch is submitted).
                unsafe { e.setBuffer_offset_atIndex(Some(buffer(b)), 0, binding as usize) }
            }
            if !sizes.is_empty() {
                set_bytes(e, &sizes, usize::from(SIZES_SLOT));
            }
            e.dispatchThreadgroups_threadsPerThreadgroup(
                MTLSize {
                    width: groups[0] as usize,
                    height: groups[1] as usize,
                    depth: 1,
                },
                p.threads,
            );
        });
    }

    fn copy(&self, src: &Buffer, src_offset: u64, dst: &Buffer, dst_offset: u64, bytes: u64) {
        self.recording(|batch| {
            // SAFETY: the caller checked both ranges against the tensors' lengths.
            unsafe {
                batch
                    .blit()
                    .copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size(
                        buffer(src),
                        src_offset as usize,
                        buffer(dst),
                        dst_offset as usize,
                        bytes as usize,
                    )
            }
        });
    }

    fn submit(&self) -> bool {
        autoreleasepool(|_| {
            let batch = self.batch.lock().expect("batch lock").take();
            let Some(commands) = batch.map(Batch::commit) else {
                return false;
            };
            self.flushed.lock().expect("flushed lock").push(commands);
            true
        })
    }

    fn read(&self, parts: &[(&Buffer, Range<u64>)]) -> Reading {
        autoreleasepool(|_| self.read_in_pool(parts))
    }
}

impl MetalDevice {
    fn read_in_pool(&self, parts: &[(&Buffer, Range<u64>)]) -> Reading {
        let total: u64 = parts
            .iter()
            .map(|(_, r)| r.end.saturating_sub(r.start))
            .sum();
        let staging = self.shared(total);
        let staged = Buffer::Metal(MetalBuffer(staging.clone()));
        let mut at = 0;
        for (b, r) in parts {
            let bytes = r.end.saturating_sub(r.start);
            if bytes > 0 {
                self.copy(b, r.start, &staged, at, bytes);
            }
            at += bytes;
        }
        let mut commands = std::mem::take(&mut *self.flushed.lock().expect("flushed lock"));
        commands.extend(
            self.batch
                .lock()
                .expect("batch lock")
                .take()
                .map(Batch::commit),
        );
        Box::pin(async move {
            // The last one completes after the others (one queue, in order).
            if let Some(last) = commands.last() {
                last.waitUntilCompleted();
            }
            for c in &commands {
                if c.status() == MTLCommandBufferStatus::Error {
                    let why = c
                        .error()
                        .map_or_else(|| "unknown".into(), |e| e.to_string());
                    return Err(GpuError::ReadBack(format!("Metal command buffer: {why}")));
                }
            }
            // SAFETY: the command buffer that wrote `staging` has completed, and nothing else
            // holds it; it is `total` bytes long (or 4 when empty).
            let bytes = unsafe {
                std::slice::from_raw_parts(staging.contents().as_ptr() as *const u8, total as usize)
            };
            Ok(bytes.to_vec())
        })
    }
}
