//! [`Device`] on wgpu: Vulkan, Metal and DX12 natively, WebGPU in a browser. One command
//! encoder records a batch; each dispatch's params take a 256-byte slot of a uniform chunk,
//! written to the device when the batch is submitted; a read-back copies into a staging buffer
//! and maps it.

use std::collections::HashMap;
use std::future::Future;
use std::num::NonZeroU64;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use shaders::{Access, Kernel, Spec};
use wgpu::util::DeviceExt;

use super::context::{GpuError, GpuOptions};
use super::device::{Binding, Buffer, Device, Reading};

/// Params of one dispatch live in a 256-byte slot (the usual uniform offset alignment) of a
/// chunk of this many bytes; a batch takes more chunks as it needs them.
const UNIFORM_CHUNK: u64 = 64 << 10;

/// The largest `params` struct of any kernel, in bytes.
const MAX_PARAMS: usize = 64;

/// Kernel name, entry point, spec key.
type PipelineKey = (&'static str, &'static str, String);

struct Pipeline {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

struct UniformChunk {
    buffer: wgpu::Buffer,
    data: Vec<u8>,
}

/// What is recorded but not yet submitted.
#[derive(Default)]
struct Batch {
    encoder: Option<wgpu::CommandEncoder>,
    uniforms: Vec<UniformChunk>,
}

pub(super) struct WgpuDevice {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    f16: bool,
    max_binding: u64,
    uniform_align: u64,
    pipelines: Mutex<HashMap<PipelineKey, Arc<Pipeline>>>,
    batch: Mutex<Batch>,
    /// Uniform chunks of submitted batches, for the next ones (what they write is queued
    /// after those submissions).
    spare_uniforms: Mutex<Vec<wgpu::Buffer>>,
}

fn buffer(b: &Buffer) -> &wgpu::Buffer {
    match b {
        Buffer::Wgpu(b) => b,
        #[allow(unreachable_patterns)]
        _ => unreachable!("a wgpu device is given only its own buffers"),
    }
}

impl WgpuDevice {
    /// The adapter `opts` picks and its device.
    pub(super) async fn acquire(opts: &GpuOptions) -> Result<WgpuDevice, GpuError> {
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
        Ok(WgpuDevice {
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
            spare_uniforms: Mutex::new(Vec::new()),
        })
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

    /// `params` in the batch's current uniform chunk (a new one when it is full): the chunk
    /// and the slot's offset and size.
    fn params_slot<'b>(
        &self,
        batch: &'b mut Batch,
        params: &[u32],
    ) -> (&'b wgpu::Buffer, u64, u64) {
        // The params' slot: 16-byte padded (a uniform binding's size granularity).
        let bytes: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert!(bytes.len() <= MAX_PARAMS, "params too large");
        let size = bytes.len().next_multiple_of(16).max(16) as u64;
        let fits = batch
            .uniforms
            .last()
            .is_some_and(|c| c.data.len() as u64 + size <= UNIFORM_CHUNK);
        if !fits {
            let spare = self.spare_uniforms.lock().expect("uniform lock").pop();
            let buffer = spare.unwrap_or_else(|| {
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("tether params"),
                    size: UNIFORM_CHUNK,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            });
            batch.uniforms.push(UniformChunk {
                buffer,
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
        (&chunk.buffer, offset, size)
    }

    /// The batch's command encoder, made on first use.
    fn encoder<'b>(
        &self,
        encoder: &'b mut Option<wgpu::CommandEncoder>,
    ) -> &'b mut wgpu::CommandEncoder {
        encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("tether batch"),
                })
        })
    }
}

impl Device for WgpuDevice {
    /// "name (backend, device type)", e.g. "llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, Cpu)".
    fn name(&self) -> String {
        format!(
            "{} ({:?}, {:?})",
            self.info.name, self.info.backend, self.info.device_type
        )
    }

    fn has_f16(&self) -> bool {
        self.f16
    }

    /// A CPU adapter (lavapipe natively; in a browser, the fallback adapter), or one whose
    /// name says it is a software one (Chromium's SwiftShader need not be marked fallback).
    fn is_software(&self) -> bool {
        let name = self.info.name.to_ascii_lowercase();
        self.info.device_type == wgpu::DeviceType::Cpu
            || ["swiftshader", "llvmpipe", "lavapipe", "software"]
                .iter()
                .any(|s| name.contains(s))
    }

    fn max_binding(&self) -> u64 {
        self.max_binding
    }

    fn buffer(&self, bytes: u64) -> Buffer {
        Buffer::Wgpu(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("tether pooled"),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    fn weights(&self, bytes: &[u8]) -> Buffer {
        Buffer::Wgpu(
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("tether weights"),
                    contents: bytes,
                    usage: wgpu::BufferUsages::STORAGE,
                }),
        )
    }

    /// Lands at the next submission, before its commands: the queue orders it after every
    /// batch submitted so far, and the caller's buffer is bound by no command recorded yet.
    fn write(&self, b: &Buffer, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.queue.write_buffer(buffer(b), 0, bytes);
        }
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
        let pipeline = self.pipeline(kernel, entry, spec);
        let mut batch = self.batch.lock().expect("batch lock");
        let batch = &mut *batch;
        let (chunk, offset, size) = self.params_slot(batch, params);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: chunk,
                offset,
                size: NonZeroU64::new(size),
            }),
        }];
        for &(binding, b, size) in binds {
            entries.push(wgpu::BindGroupEntry {
                binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: buffer(b),
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
        let mut pass =
            self.encoder(&mut batch.encoder)
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(entry),
                    timestamp_writes: None,
                });
        pass.set_pipeline(&pipeline.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], 1);
    }

    fn copy(&self, src: &Buffer, src_offset: u64, dst: &Buffer, dst_offset: u64, bytes: u64) {
        let mut batch = self.batch.lock().expect("batch lock");
        self.encoder(&mut batch.encoder).copy_buffer_to_buffer(
            buffer(src),
            src_offset,
            buffer(dst),
            dst_offset,
            bytes,
        );
    }

    fn submit(&self) -> bool {
        let batch = std::mem::take(&mut *self.batch.lock().expect("batch lock"));
        let Some(encoder) = batch.encoder else {
            return false;
        };
        for chunk in &batch.uniforms {
            self.queue.write_buffer(&chunk.buffer, 0, &chunk.data);
        }
        self.queue.submit([encoder.finish()]);
        self.spare_uniforms
            .lock()
            .expect("uniform lock")
            .extend(batch.uniforms.into_iter().map(|c| c.buffer));
        true
    }

    fn read(&self, parts: &[(&Buffer, Range<u64>)]) -> Reading {
        let total: u64 = parts.iter().map(|(_, r)| r.end - r.start).sum();
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("tether read-back"),
            size: total,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let staged = Buffer::Wgpu(staging.clone());
        let mut at = 0;
        for (b, r) in parts {
            let bytes = r.end - r.start;
            if bytes > 0 {
                self.copy(b, r.start, &staged, at, bytes);
            }
            at += bytes;
        }
        self.submit();
        let slot = Arc::new(Mutex::new(MapSlot::default()));
        let filled = slot.clone();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let waker = {
                let mut slot = filled.lock().expect("read-back slot lock");
                slot.done = Some(r);
                slot.waker.take()
            };
            if let Some(w) = waker {
                w.wake();
            }
        });
        Box::pin(ReadBack {
            staging,
            slot,
            #[cfg(not(target_arch = "wasm32"))]
            device: self.device.clone(),
            #[cfg(not(target_arch = "wasm32"))]
            waited: false,
        })
    }
}

/// What the staging buffer's map callback leaves for its [`ReadBack`].
#[derive(Default)]
struct MapSlot {
    /// The callback's result, once it has fired.
    done: Option<Result<(), wgpu::BufferAsyncError>>,
    /// The task to wake when it fires (the last one that polled the read too early).
    waker: Option<Waker>,
}

/// A read-back whose copies are submitted and whose staging buffer is being mapped; its
/// output is the buffer's bytes. It owns the buffer, so it outlives the call that started it.
struct ReadBack {
    staging: wgpu::Buffer,
    slot: Arc<Mutex<MapSlot>>,
    /// Natively the map callback runs only inside `device.poll`, which nothing else may call:
    /// the first poll of the read waits for the device. (A browser polls its device itself.)
    #[cfg(not(target_arch = "wasm32"))]
    device: wgpu::Device,
    #[cfg(not(target_arch = "wasm32"))]
    waited: bool,
}

impl Future for ReadBack {
    type Output = Result<Vec<u8>, GpuError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        #[cfg(not(target_arch = "wasm32"))]
        if !std::mem::replace(&mut this.waited, true) {
            if let Err(e) = this.device.poll(wgpu::PollType::wait_indefinitely()) {
                return Poll::Ready(Err(GpuError::ReadBack(e.to_string())));
            }
        }
        let mut slot = this.slot.lock().expect("read-back slot lock");
        let Some(done) = slot.done.take() else {
            slot.waker = Some(cx.waker().clone());
            return Poll::Pending;
        };
        drop(slot);
        done.map_err(|e| GpuError::ReadBack(e.to_string()))?;
        let bytes = this
            .staging
            .get_mapped_range(..)
            .map_err(|e| GpuError::ReadBack(e.to_string()))?
            .to_vec();
        Poll::Ready(Ok(bytes))
    }
}
