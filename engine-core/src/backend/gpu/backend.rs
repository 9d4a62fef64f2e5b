//! The `Backend` trait on the GPU: each op uploads its inputs, runs its kernels and reads the
//! result back. Weights are uploaded once and kept on the device. This is the first, exact
//! step: the model runs unchanged on the GPU and every test that takes a backend can take this
//! one. It pays a read-back per op; the device-resident forward pass that reads back only
//! logits and link traffic needs activations that live on the device between ops, and the
//! `Backend` trait does not have them yet (docs/GPU.md, "What is left").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::ops::{self, GpuDeltaInputs, GpuKvPage};
use super::{Gpu, GpuError, GpuMatrix, GpuOptions, GpuTensor, WeightFormat};
use crate::backend::{AttnShape, Backend, DeltaInputs, DeltaShape};
use crate::kv::{KvPage, Partials};
use crate::tensor::{DType, Data, Matrix};

pub struct GpuBackend {
    gpu: Gpu,
    /// Device copies of weight matrices, keyed by the address and length of their bytes.
    weights: Mutex<HashMap<(usize, usize), Uploaded>>,
}

/// A weight on the device, with a handle on its host bytes so their address cannot be reused
/// by other weights while the copy is cached.
struct Uploaded {
    _host: Data,
    device: Arc<GpuMatrix>,
}

impl GpuBackend {
    pub fn new(opts: &GpuOptions) -> Result<GpuBackend, GpuError> {
        Ok(GpuBackend {
            gpu: Gpu::with_options(opts)?,
            weights: Mutex::new(HashMap::new()),
        })
    }

    /// The adapter in use, for the user (`tether --backend gpu` prints it).
    pub fn adapter_name(&self) -> String {
        self.gpu.adapter_name()
    }

    /// `w` on the device: f32 weights as f32; bf16 and f16 weights as f16 (bf16 to f16 is
    /// exact in f16's normal range), natively where the adapter has `shader-f16`.
    fn matrix(&self, w: &Matrix) -> Arc<GpuMatrix> {
        let bytes = w.data.as_bytes();
        let key = (bytes.as_ptr() as usize, bytes.len());
        let mut cache = self.weights.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(u) = cache.get(&key) {
            return u.device.clone();
        }
        let format = match (w.data.dtype(), self.gpu.has_f16()) {
            (DType::F32, _) => WeightFormat::F32,
            (_, true) => WeightFormat::F16,
            (_, false) => WeightFormat::F16Packed,
        };
        // Backend ops cannot fail; a weight that does not fit the device is a setup error the
        // caller could not recover from either.
        let m = Arc::new(
            self.gpu
                .upload_matrix(w, format)
                .unwrap_or_else(|e| panic!("uploading a {}x{} weight: {e}", w.rows, w.cols)),
        );
        cache.insert(
            key,
            Uploaded {
                _host: w.data.clone(),
                device: m.clone(),
            },
        );
        m
    }

    fn up(&self, x: &[f32]) -> GpuTensor {
        self.gpu.upload_f32(x)
    }

    fn positions(&self, p: &[usize]) -> GpuTensor {
        let p: Vec<u32> = p
            .iter()
            .map(|&p| u32::try_from(p).expect("positions fit u32"))
            .collect();
        self.gpu.upload_u32(&p)
    }

    /// Read `t` back into `out` (everything recorded so far runs first).
    fn down(&self, t: &GpuTensor, out: &mut [f32]) {
        let v = self
            .gpu
            .download_f32(t)
            .unwrap_or_else(|e| panic!("GPU read-back: {e}"));
        out.copy_from_slice(&v);
    }
}

impl Backend for GpuBackend {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn matmul(&self, x: &[f32], w: &Matrix, out: &mut [f32]) {
        let r = ops::matmul(&self.gpu, &self.up(x), &self.matrix(w));
        self.down(&r, out);
    }

    fn rms_norm(&self, x: &mut [f32], scale: &[f32], eps: f32) {
        let t = self.up(x);
        ops::rms_norm(&self.gpu, &t, &self.up(scale), eps, 0.0);
        self.down(&t, x);
    }

    fn l2_norm(&self, x: &mut [f32], dim: usize, eps: f32, scale: f32) {
        let t = self.up(x);
        ops::l2_norm(&self.gpu, &t, dim, eps, scale);
        self.down(&t, x);
    }

    fn rope(&self, x: &mut [f32], head_dim: usize, positions: &[usize], inv_freq: &[f32]) {
        let t = self.up(x);
        let table = self.up(&ops::rope_table(positions, inv_freq));
        ops::rope(&self.gpu, &t, head_dim, &table, positions.len());
        self.down(&t, x);
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        let g = self.up(gate);
        ops::silu_mul(&self.gpu, &g, &self.up(up));
        self.down(&g, gate);
    }

    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]) {
        let t = self.up(x);
        ops::sigmoid_mul(&self.gpu, &t, &self.up(gate));
        self.down(&t, x);
    }

    fn causal_conv_silu(&self, u: &mut [f32], history: &mut [f32], weight: &[f32], kernel: usize) {
        let h = self.up(history);
        let out = ops::causal_conv_silu(&self.gpu, &self.up(u), &h, &self.up(weight), kernel);
        self.down(&out, u);
        self.down(&h, history);
    }

    fn attend_page(&self, shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials {
        let page = GpuKvPage {
            start: page.start,
            len: page.len,
            k: self.up(&page.k),
            v: self.up(&page.v),
        };
        // The caller has scaled q.
        let p = ops::attend_page(
            &self.gpu,
            shape,
            &self.up(q),
            &self.positions(q_pos),
            &page,
            1.0,
        );
        let mut out = Partials::empty(p.rows, p.head_dim);
        self.down(&p.o, &mut out.o);
        self.down(&p.m, &mut out.m);
        self.down(&p.l, &mut out.l);
        out
    }

    fn delta_rule_chunked(
        &self,
        shape: DeltaShape,
        x: DeltaInputs,
        state: &mut [f32],
        out: &mut [f32],
    ) {
        self.delta(shape, x, state, out, ops::delta_rule_chunked);
    }

    fn delta_rule_recurrent(
        &self,
        shape: DeltaShape,
        x: DeltaInputs,
        state: &mut [f32],
        out: &mut [f32],
    ) {
        self.delta(shape, x, state, out, ops::delta_rule_recurrent);
    }

    fn gated_rms_norm(&self, o: &mut [f32], z: &[f32], weight: &[f32], eps: f32) {
        let t = self.up(o);
        ops::gated_rms_norm(&self.gpu, &t, &self.up(z), &self.up(weight), eps);
        self.down(&t, o);
    }
}

type DeltaKernel = fn(&Gpu, DeltaShape, GpuDeltaInputs, &GpuTensor) -> GpuTensor;

impl GpuBackend {
    fn delta(
        &self,
        shape: DeltaShape,
        x: DeltaInputs,
        state: &mut [f32],
        out: &mut [f32],
        kernel: DeltaKernel,
    ) {
        let (q, k, v, g, beta) = (
            self.up(x.q),
            self.up(x.k),
            self.up(x.v),
            self.up(x.g),
            self.up(x.beta),
        );
        let s = self.up(state);
        let inputs = GpuDeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        let o = kernel(&self.gpu, shape, inputs, &s);
        self.down(&o, out);
        self.down(&s, state);
    }
}
