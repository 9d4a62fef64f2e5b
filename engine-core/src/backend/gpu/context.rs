//! The device: adapter and device acquisition, the pipeline cache, and the batch every op
//! records into (one command encoder, submitted by `flush`, so a whole forward pass can be one
//! submission).

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use shaders::{Access, Kernel, Spec};

use super::pool::{BufferPool, Pooled};
use super::tensor::GpuTensor;

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

/// Params of one dispatch live in a 256-byte slot (the usual uniform offset alignment) of a
/// chunk of this many bytes; a batch takes more chunks as it needs them.
const UNIFORM_CHUNK: u64 = 64 << 10;

/// The largest `params` struct of any kernel, in bytes.
const MAX_PARAMS: usize = 64;

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
    Buffer(&'a wgpu::Buffer),
}

/// Kernel name, entry point, spec key.
type PipelineKey = (&'static str, &'static str, String);

struct Pipeline {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

struct UniformChunk {
    buffer: Pooled,
    data: Vec<u8>,
}

/// What is recorded but not yet submitted.
#[derive(Default)]
struct Batch {
    encoder: Option<wgpu::CommandEncoder>,
    uniforms: Vec<UniformChunk>,
    /// Every pooled buffer the batch binds, kept out of the pool until submission.
    keep: Vec<Arc<Pooled>>,
}

pub struct Gpu {
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    f16: bool,
    max_binding: u64,
    uniform_align: u64,
    pub(super) pool: Arc<BufferPool>,
    pipelines: Mutex<HashMap<PipelineKey, Arc<Pipeline>>>,
    batch: Mutex<Batch>,
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
        #[cfg(not(target_arch = "wasm32"))]
        let backends = opts.backends.with_env();
        // The only backend of a wasm32 build (wgpu's `webgpu` feature; there is no environment
        // to read).
        #[cfg(target_arch = "wasm32")]
        let backends = wgpu::Backends::BROWSER_WEBGPU;
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            flags: wgpu::InstanceFlags::from_build_config().with_env(),
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let mut adapter = None;
        for fallback in [opts.force_fallback, true] {
            let request = wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: fallback,
                ..Default::default()
            };
            if let Ok(a) = instance.request_adapter(&request).await {
                adapter = Some(a);
                break;
            }
        }
        let adapter = adapter.ok_or_else(|| GpuError::NoAdapter(format!("{backends:?}")))?;
        let info = adapter.get_info();
        let f16 = opts.allow_f16 && adapter.features().contains(wgpu::Features::SHADER_F16);
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("tether"),
                required_features: if f16 {
                    wgpu::Features::SHADER_F16
                } else {
                    wgpu::Features::empty()
                },
                required_limits: limits.clone(),
                experimental_features: wgpu::ExperimentalFeatures::disabled(),
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| GpuError::Device {
                adapter: info.name.clone(),
                message: e.to_string(),
            })?;
        Ok(Gpu {
            pool: BufferPool::new(device.clone()),
            device,
            queue,
            f16,
            max_binding: limits
                .max_storage_buffer_binding_size
                .min(limits.max_buffer_size),
            uniform_align: u64::from(limits.min_uniform_buffer_offset_alignment).max(16),
            info,
            pipelines: Mutex::new(HashMap::new()),
            batch: Mutex::new(Batch::default()),
            submits: AtomicU64::new(0),
            uploaded: AtomicU64::new(0),
        })
    }

    /// "name (backend, device type)", e.g. "llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, Cpu)".
    pub fn adapter_name(&self) -> String {
        format!(
            "{} ({:?}, {:?})",
            self.info.name, self.info.backend, self.info.device_type
        )
    }

    /// Native f16 (`shader-f16`) is enabled on this device.
    pub fn has_f16(&self) -> bool {
        self.f16
    }

    /// Bytes one storage binding may span: larger weights are split into row blocks.
    pub fn max_binding(&self) -> u64 {
        self.max_binding
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

    fn pipeline(&self, kernel: &'static Kernel, entry: &'static str, spec: &Spec) -> Arc<Pipeline> {
        let key = (kernel.name, entry, spec.key());
        let mut cache = self.pipelines.lock().expect("pipeline cache lock");
        if let Some(p) = cache.get(&key) {
            return p.clone();
        }
        let source = kernel
            .source(spec)
            .unwrap_or_else(|e| panic!("kernel {}: {e}", kernel.name));
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(kernel.name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let entries: Vec<wgpu::BindGroupLayoutEntry> = kernel
            .entry(entry)
            .unwrap_or_else(|| panic!("kernel {} has no entry {entry}", kernel.name))
            .bindings
            .iter()
            .map(|b| wgpu::BindGroupLayoutEntry {
                binding: b.index,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match b.access {
                        Access::Uniform => wgpu::BufferBindingType::Uniform,
                        Access::Read => wgpu::BufferBindingType::Storage { read_only: true },
                        Access::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(entry),
                entries: &entries,
            });
        let pipeline_layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(entry),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
        let p = Arc::new(Pipeline { pipeline, layout });
        cache.insert(key, p.clone());
        p
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
        let pipeline = self.pipeline(kernel, entry, spec);
        let mut batch = self.batch.lock().expect("batch lock");
        let batch = &mut *batch;
        // The params' slot: 16-byte padded (a uniform binding's size granularity).
        let bytes: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert!(bytes.len() <= MAX_PARAMS, "params of {entry} too large");
        let size = bytes.len().next_multiple_of(16).max(16) as u64;
        let fits = batch
            .uniforms
            .last()
            .is_some_and(|c| c.data.len() as u64 + size <= UNIFORM_CHUNK);
        if !fits {
            batch.uniforms.push(UniformChunk {
                buffer: self.pool.take(
                    UNIFORM_CHUNK,
                    wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                ),
                data: Vec::with_capacity(UNIFORM_CHUNK as usize),
            });
        }
        let chunk = batch.uniforms.last_mut().expect("a uniform chunk");
        let offset = chunk.data.len() as u64;
        chunk.data.extend_from_slice(&bytes);
        chunk.data.resize((offset + size) as usize, 0);
        let aligned = chunk
            .data
            .len()
            .next_multiple_of(self.uniform_align as usize);
        chunk.data.resize(aligned.min(UNIFORM_CHUNK as usize), 0);

        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &chunk.buffer,
                offset,
                size: NonZeroU64::new(size),
            }),
        }];
        for (binding, b) in binds {
            let (buffer, size): (&wgpu::Buffer, u64) = match b {
                Bind::Tensor(t) => {
                    batch.keep.push(t.pooled().clone());
                    (t.buffer(), t.bytes().max(4))
                }
                Bind::Buffer(buf) => (buf, buf.size()),
            };
            entries.push(wgpu::BindGroupEntry {
                binding: *binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: 0,
                    size: NonZeroU64::new(size),
                }),
            });
        }
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipeline.layout,
            entries: &entries,
        });
        let mut pass = self
            .encoder(batch)
            .begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(entry),
                timestamp_writes: None,
            });
        pass.set_pipeline(&pipeline.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], 1);
    }

    /// Records `f` (transfer commands) into the current batch, which keeps `tensors` alive.
    pub(super) fn record(&self, tensors: &[&GpuTensor], f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut batch = self.batch.lock().expect("batch lock");
        batch
            .keep
            .extend(tensors.iter().map(|t| t.pooled().clone()));
        f(self.encoder(&mut batch));
    }

    /// The batch's command encoder, made on first use.
    fn encoder<'b>(&self, batch: &'b mut Batch) -> &'b mut wgpu::CommandEncoder {
        batch.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("tether batch"),
                })
        })
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
        self.record(&[src, dst], |e| {
            e.copy_buffer_to_buffer(
                src.buffer(),
                src_offset as u64 * 4,
                dst.buffer(),
                dst_offset as u64 * 4,
                len as u64 * 4,
            )
        });
    }

    /// Submits everything recorded since the last flush. The batch lock is held until the
    /// submission is made, so work recorded by any thread before a flush returns is on the
    /// queue ahead of anything submitted after it.
    pub fn flush(&self) {
        let mut guard = self.batch.lock().expect("batch lock");
        let batch = std::mem::take(&mut *guard);
        let Some(encoder) = batch.encoder else {
            return;
        };
        for chunk in &batch.uniforms {
            self.queue.write_buffer(&chunk.buffer, 0, &chunk.data);
        }
        self.queue.submit([encoder.finish()]);
        self.submits.fetch_add(1, Ordering::Relaxed);
        drop(guard);
        // `batch.keep` and the uniform chunks drop here: their buffers may be reused by work
        // recorded from now on, which the queue orders after this submission.
    }
}
