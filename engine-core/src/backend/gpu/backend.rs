//! The `Backend` trait on the GPU op layer. Values the model computes with are device tensors
//! ([`Act::Device`]): every op records into the device's one batch and nothing runs until a
//! value is read back, so a decode step on its own submits once, for the logits. DeltaNet
//! states, KV pages and attention partials (merged by `attn_merge`) stay on the device too;
//! only what crosses the link is read. Weights and layer parameters are uploaded once, on
//! first use, and kept.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::ops::{self, GpuDeltaInputs, GpuKvPage, GpuPartials};
use super::packing::quant_format;
use super::{Gpu, GpuError, GpuMatrix, GpuOptions, GpuTensor, WeightFormat};
use crate::backend::{
    Act, ActPartials, AttnShape, Backend, DeltaInputs, DeltaShape, Param, Readback,
};
use crate::backend::{CacheTypes, KvPage, KvType, PageRows, STEP_ROWS};
use crate::tensor::{DType, Data, Matrix};

pub struct GpuBackend {
    gpu: Gpu,
    /// `gpu` on wgpu, `metal` on Metal itself (what a helper's hello names).
    name: &'static str,
    /// Device copies of weight matrices, keyed by the address and length of their bytes.
    weights: Mutex<HashMap<(usize, usize), Uploaded>>,
    /// Device copies of layer parameters, keyed by [`Param::key`]; each holds a clone of its
    /// `Param` so the address stays taken while the copy is cached.
    params: Mutex<HashMap<usize, (Param, GpuTensor)>>,
}

/// A weight on the device, with a handle on its host bytes so their address cannot be reused
/// by other weights while the copy is cached.
struct Uploaded {
    _host: Data,
    device: Arc<GpuMatrix>,
}

impl GpuBackend {
    /// The backend on the device `opts` picks, waited for on this thread (in a browser this
    /// fails: await [`GpuBackend::new_async`] there).
    pub fn new(opts: &GpuOptions) -> Result<GpuBackend, GpuError> {
        Gpu::with_options(opts).map(|gpu| GpuBackend::on(gpu, "gpu"))
    }

    /// The backend on the system's Metal device, driven directly (no wgpu).
    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    pub fn metal() -> Result<GpuBackend, GpuError> {
        Gpu::metal().map(|gpu| GpuBackend::on(gpu, "metal"))
    }

    /// [`GpuBackend::new`] as a future, for a browser tab, where the device arrives through
    /// the page's event loop.
    pub async fn new_async(opts: &GpuOptions) -> Result<GpuBackend, GpuError> {
        Gpu::acquire(opts)
            .await
            .map(|gpu| GpuBackend::on(gpu, "gpu"))
    }

    fn on(gpu: Gpu, name: &'static str) -> GpuBackend {
        GpuBackend {
            gpu,
            name,
            weights: Mutex::new(HashMap::new()),
            params: Mutex::new(HashMap::new()),
        }
    }

    /// The adapter in use, for the user (`tether --backend gpu` prints it).
    pub fn adapter_name(&self) -> String {
        self.gpu.adapter_name()
    }

    /// The device (its submission and upload counters, for tests and benchmarks).
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// `w` on the device: f32 weights as f32; bf16 and f16 weights as f16 (bf16 to f16 is
    /// exact in f16's normal range), natively where the adapter has `shader-f16`; quantised
    /// blocks in their own type's device layout (packing.rs; only the types [`Self::reads`]).
    fn matrix(&self, w: &Matrix) -> Arc<GpuMatrix> {
        let bytes = w.data.stored();
        let key = (bytes.as_ptr() as usize, bytes.len());
        let mut cache = self.weights.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(u) = cache.get(&key) {
            return u.device.clone();
        }
        let format = match (w.data.dtype(), self.gpu.has_f16()) {
            (DType::F32, _) => WeightFormat::F32,
            (dtype, _) if dtype.is_quantised() => quant_format(dtype)
                .unwrap_or_else(|| panic!("no GPU kernels for {} weights", dtype.name())),
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

    /// `p` on the device, uploaded the first time.
    fn param(&self, p: &Param) -> GpuTensor {
        let mut cache = self.params.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(p.key())
            .or_insert_with(|| (p.clone(), self.gpu.upload_f32(p)))
            .1
            .clone()
    }

    /// `a` on the device: a host value (a fresh state's zeros, rows from the link) is uploaded.
    fn dev(&self, a: &Act) -> GpuTensor {
        match a {
            Act::Device(t) => t.clone(),
            Act::Host(v) => self.gpu.upload_f32(v),
        }
    }

    /// `a` on the device for an op that writes it in place: a host value moves to the device
    /// for good, so a state is uploaded once, the first time an op advances it.
    fn dev_mut(&self, a: &mut Act) -> GpuTensor {
        if let Act::Host(v) = a {
            *a = Act::Device(self.gpu.upload_f32(v));
        }
        match a {
            Act::Device(t) => t.clone(),
            Act::Host(_) => unreachable!("moved to the device above"),
        }
    }

    /// `f` on `parts` as device tensors (host values uploaded): the reads' common front.
    fn on_device<R>(
        &self,
        parts: &[(&Act, Range<usize>)],
        f: impl FnOnce(&[(&GpuTensor, Range<usize>)]) -> R,
    ) -> R {
        let dev: Vec<(GpuTensor, Range<usize>)> = parts
            .iter()
            .map(|(a, r)| (self.dev(a), r.clone()))
            .collect();
        let refs: Vec<(&GpuTensor, Range<usize>)> =
            dev.iter().map(|(t, r)| (t, r.clone())).collect();
        f(&refs)
    }

    fn positions(&self, p: &[usize]) -> GpuTensor {
        let p: Vec<u32> = p
            .iter()
            .map(|&p| u32::try_from(p).expect("positions fit u32"))
            .collect();
        self.gpu.upload_u32(&p)
    }

    fn delta(
        &self,
        shape: DeltaShape,
        x: DeltaInputs<'_, Act>,
        state: &mut Act,
        kernel: DeltaKernel,
    ) -> Act {
        let (q, k, v, g, beta) = (
            self.dev(x.q),
            self.dev(x.k),
            self.dev(x.v),
            self.dev(x.g),
            self.dev(x.beta),
        );
        let inputs = GpuDeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        Act::Device(kernel(&self.gpu, shape, inputs, &self.dev_mut(state)))
    }
}

type DeltaKernel = fn(&Gpu, DeltaShape, GpuDeltaInputs, &GpuTensor) -> GpuTensor;

impl Backend for GpuBackend {
    fn name(&self) -> &'static str {
        self.name
    }

    fn timed_on_return(&self) -> bool {
        false
    }

    /// Below `STEP_ROWS` rows every op computes each row as its decode step: `matvec` for the
    /// matrices, the split attention kernel (whose empty key ranges `attn_merge` skips), the
    /// recurrent delta rule; the rest work per row or per element.
    fn rows_are_steps(&self) -> bool {
        true
    }

    /// The float types, and the quantised types weights.wgsl dequantises as it reads: Q8_0,
    /// Q4_0, Q5_0, Q4_K, Q5_K and Q6_K (not Q4_1, Q5_1, IQ4_NL, Q2_K, Q3_K or IQ4_XS yet).
    fn reads(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::BF16 | DType::F16) || quant_format(dtype).is_some()
    }

    /// f32 pages, and compact pages packed on the device as ggml's rows, where a row is whole
    /// words of them ([`ops::pack_rows`]).
    fn holds_kv(&self, ty: KvType, row: usize) -> bool {
        ty == KvType::F32 || row.is_multiple_of(ops::packed_values(ty))
    }

    fn packs_kv(&self, ty: KvType) -> bool {
        ty != KvType::F32
    }

    fn write_packed(&self, ty: KvType, dst: &mut Act, at: usize, src: &Act, span: Range<usize>) {
        let dst = self.dev_mut(dst);
        ops::pack_rows(&self.gpu, ty, &self.dev(src), span, (&dst, at));
    }

    fn upload(&self, x: Vec<f32>) -> Act {
        Act::Device(self.gpu.upload_f32(&x))
    }

    /// Waits for the device, so in a browser it panics, saying to await [`Self::read_ranges`].
    fn download_ranges(&self, parts: &[(&Act, Range<usize>)]) -> Vec<f32> {
        self.on_device(parts, |parts| self.gpu.download_ranges(parts))
            .unwrap_or_else(|e| panic!("GPU read-back: {e}"))
    }

    /// The copies are submitted now and the returned future owns the staging buffer
    /// ([`Gpu::read_ranges`]): a browser awaits the map on its event loop; natively the first
    /// poll waits for the device.
    fn read_ranges(&self, parts: &[(&Act, Range<usize>)]) -> Readback {
        let read = self.on_device(parts, |parts| self.gpu.read_ranges(parts));
        Box::pin(async move { read.await.unwrap_or_else(|e| panic!("GPU read-back: {e}")) })
    }

    fn duplicate(&self, x: &Act) -> Act {
        let src = self.dev(x);
        let out = self.gpu.alloc(src.len());
        self.gpu.copy(&src, 0, &out, 0, src.len());
        Act::Device(out)
    }

    fn alloc(&self, capacity: usize) -> Act {
        Act::Device(self.gpu.alloc(capacity))
    }

    fn write(&self, dst: &mut Act, at: usize, src: &Act, from: usize, len: usize) {
        let dst = self.dev_mut(dst);
        self.gpu.copy(&self.dev(src), from, &dst, at, len);
    }

    fn embed(&self, table: &Matrix, ids: &[u32]) -> Act {
        let ids = self.gpu.upload_u32(ids);
        Act::Device(ops::embed(&self.gpu, &self.matrix(table), &ids))
    }

    fn matmul(&self, x: &Act, w: &Matrix) -> Act {
        Act::Device(ops::matmul(&self.gpu, &self.dev(x), &self.matrix(w)))
    }

    fn rms_norm(&self, x: &mut Act, scale: &Param, eps: f32) {
        ops::rms_norm(&self.gpu, &self.dev_mut(x), &self.param(scale), eps, 0.0);
    }

    fn l2_norm(&self, x: &mut Act, dim: usize, eps: f32, scale: f32) {
        ops::l2_norm(&self.gpu, &self.dev_mut(x), dim, eps, scale);
    }

    fn rope(&self, x: &mut Act, head_dim: usize, positions: &[usize], inv_freq: &[f32]) {
        let table = self.gpu.upload_f32(&ops::rope_table(positions, inv_freq));
        ops::rope(
            &self.gpu,
            &self.dev_mut(x),
            head_dim,
            &table,
            positions.len(),
        );
    }

    fn silu_mul(&self, gate: &mut Act, up: &Act) {
        ops::silu_mul(&self.gpu, &self.dev_mut(gate), &self.dev(up));
    }

    fn sigmoid_mul(&self, x: &mut Act, gate: &Act) {
        ops::sigmoid_mul(&self.gpu, &self.dev_mut(x), &self.dev(gate));
    }

    fn add(&self, x: &mut Act, y: &Act) {
        ops::add(&self.gpu, &self.dev_mut(x), &self.dev(y));
    }

    fn scale(&self, x: &mut Act, s: f32) {
        ops::scale(&self.gpu, &self.dev_mut(x), s);
    }

    fn copy_cols(&self, src: &Act, stride: usize, col0: usize, width: usize) -> Act {
        Act::Device(ops::copy_cols(
            &self.gpu,
            &self.dev(src),
            stride,
            col0,
            width,
        ))
    }

    fn delta_gates(&self, a: &mut Act, b: &mut Act, params: &Param) {
        let (a, b) = (self.dev_mut(a), self.dev_mut(b));
        ops::delta_gates(&self.gpu, &a, &b, &self.param(params));
    }

    fn causal_conv_silu(&self, u: &mut Act, history: &mut Act, weight: &Param, kernel: usize) {
        let out = ops::causal_conv_silu(
            &self.gpu,
            &self.dev(u),
            &self.dev_mut(history),
            &self.param(weight),
            kernel,
        );
        *u = Act::Device(out);
    }

    fn attend_pages(
        &self,
        shape: AttnShape,
        q: &Act,
        q_pos: &[usize],
        pages: &[&KvPage],
    ) -> Vec<ActPartials> {
        if pages.is_empty() {
            return Vec::new();
        }
        let (q, pos) = (self.dev(q), self.positions(q_pos));
        pages
            .iter()
            .map(|page| {
                // Pages of other types never reach this backend: `holds_kv` refuses them when
                // the sequence is made.
                let rows = |rows: &PageRows| match rows {
                    PageRows::Values(a) => (self.dev(a), KvType::F32),
                    PageRows::Device { ty, words } => (self.dev(words), *ty),
                    PageRows::Packed { ty, .. } => {
                        panic!("the GPU backend was handed a {} KV page", ty.name())
                    }
                };
                let ((k, k_type), (v, v_type)) = (rows(&page.k), rows(&page.v));
                let page = GpuKvPage {
                    start: page.start,
                    len: page.len,
                    k,
                    v,
                    types: CacheTypes {
                        k: k_type,
                        v: v_type,
                    },
                };
                // The caller has scaled q. Below `STEP_ROWS` rows (decode steps, verify
                // passes) the split form: a (row, head)'s partials depend on its own visible
                // keys only, not on the other rows, as `rows_are_steps` needs.
                let p = if q_pos.len() < STEP_ROWS {
                    ops::attend_page_split(
                        &self.gpu,
                        shape,
                        &q,
                        &pos,
                        &page,
                        1.0,
                        ops::DECODE_SPLIT,
                    )
                } else {
                    ops::attend_page(&self.gpu, shape, &q, &pos, &page, 1.0)
                };
                ActPartials {
                    rows: p.rows,
                    head_dim: p.head_dim,
                    o: Act::Device(p.o),
                    m: Act::Device(p.m),
                    l: Act::Device(p.l),
                }
            })
            .collect()
    }

    fn merge_partials(&self, rows: usize, head_dim: usize, parts: Vec<ActPartials>) -> Act {
        // A helper's partials arrive on the host: `dev` uploads them.
        let parts: Vec<GpuPartials> = parts
            .iter()
            .map(|p| GpuPartials {
                rows: p.rows,
                head_dim: p.head_dim,
                o: self.dev(&p.o),
                m: self.dev(&p.m),
                l: self.dev(&p.l),
            })
            .collect();
        let refs: Vec<&GpuPartials> = parts.iter().collect();
        Act::Device(ops::merge_partials(&self.gpu, rows, head_dim, &refs).o)
    }

    fn delta_rule_chunked(
        &self,
        shape: DeltaShape,
        x: DeltaInputs<'_, Act>,
        state: &mut Act,
    ) -> Act {
        self.delta(shape, x, state, ops::delta_rule_chunked)
    }

    fn delta_rule_recurrent(
        &self,
        shape: DeltaShape,
        x: DeltaInputs<'_, Act>,
        state: &mut Act,
    ) -> Act {
        self.delta(shape, x, state, ops::delta_rule_recurrent)
    }

    fn gated_rms_norm(&self, o: &mut Act, z: &Act, weight: &Param, eps: f32) {
        ops::gated_rms_norm(
            &self.gpu,
            &self.dev_mut(o),
            &self.dev(z),
            &self.param(weight),
            eps,
        );
    }
}
