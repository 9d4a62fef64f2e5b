//! The ops the model is written in. `model/` says *what* a layer computes, in this vocabulary;
//! a backend says *how* on its hardware. The CPU backend is the reference every other backend
//! (wgpu, issue 4) is tested against, op by op.
//!
//! Values live where the backend keeps them: an [`Act`] is a host vector on the CPU and a
//! device buffer on the GPU, so the model can hand activations, DeltaNet state and KV pages
//! from op to op without reading them back. Values cross to the host only through
//! [`Backend::download`] and friends, which the model calls where values must leave the backend
//! (logits, and whatever crosses the link: KV rows, a state, a helper's attention partials).

pub mod cpu;
pub mod frozen;
#[cfg(feature = "gpu")]
pub mod gpu;
pub(crate) mod page_rows;
mod pages;

pub use crate::cache_types::{CacheTypes, KvType};
pub use cpu::CpuBackend;
pub use page_rows::PageRows;
pub use pages::{KvPage, Merger, Partials};

/// A forward pass of fewer rows than this computes each row exactly as a one-row decode step
/// would: the same kernels in the same reduction order, whatever the other rows (the CPU's
/// matrix products below `gemm`, attention streamed row by row, the delta rule's recurrent
/// form). So a speculative verify of up to 15 drafted rows gives each row, bit for bit, the
/// logits plain decoding gives it (docs/EXACTNESS.md); from this many rows on, prefill's
/// faster forms (gemm, the chunked delta rule) take over.
pub const STEP_ROWS: usize = 16;

/// The backend called `name` (`cpu`; `gpu` in builds with the `gpu` feature; `metal` in Apple
/// builds with the `metal` feature), and a line saying what it runs on.
pub fn select(name: &str) -> crate::Result<(Box<dyn Backend>, String)> {
    match name {
        "cpu" => Ok((
            Box::new(CpuBackend),
            format!("cpu ({} threads)", rayon::current_num_threads()),
        )),
        #[cfg(feature = "gpu")]
        "gpu" => {
            let be = gpu::GpuBackend::new(&gpu::GpuOptions::default())
                .map_err(|e| crate::Error::Invalid(format!("--backend gpu: {e}")))?;
            let what = format!("gpu ({})", be.adapter_name());
            Ok((Box::new(be), what))
        }
        #[cfg(not(feature = "gpu"))]
        "gpu" => Err(crate::Error::Invalid(
            "--backend gpu: this build has no GPU backend (engine-core's `gpu` feature)".into(),
        )),
        #[cfg(all(feature = "metal", target_vendor = "apple"))]
        "metal" => {
            let be = gpu::GpuBackend::metal()
                .map_err(|e| crate::Error::Invalid(format!("--backend metal: {e}")))?;
            let what = format!("metal ({})", be.adapter_name());
            Ok((Box::new(be), what))
        }
        #[cfg(not(all(feature = "metal", target_vendor = "apple")))]
        "metal" => Err(crate::Error::Invalid(
            "--backend metal: Metal itself runs only in macOS and iOS builds (engine-core's \
             `metal` feature); elsewhere --backend gpu runs the same kernels through wgpu"
                .into(),
        )),
        other => Err(crate::Error::Invalid(format!(
            "--backend {other}: expected cpu, gpu or metal"
        ))),
    }
}

use std::future::Future;
use std::ops::{Deref, Range};
use std::pin::Pin;
use std::sync::Arc;

use crate::tensor::Matrix;

/// A value the model computes with (activations, DeltaNet state, KV rows), row-major f32, where
/// its backend keeps it: a host vector for the CPU backend, a device buffer for the GPU backend
/// (which also holds compact KV rows as their bytes in 32-bit words: [`PageRows::Device`]).
/// Only the backend reads or writes the elements; the model sees lengths. There is no `Clone`:
/// a device value is a shared handle, so copying one is [`Backend::duplicate`].
pub enum Act {
    Host(Vec<f32>),
    #[cfg(feature = "gpu")]
    Device(gpu::GpuTensor),
}

impl Act {
    /// Elements held (for a KV page buffer: its capacity on a device, the rows written on the
    /// host; the page tracks its own length).
    pub fn len(&self) -> usize {
        match self {
            Act::Host(v) => v.len(),
            #[cfg(feature = "gpu")]
            Act::Device(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Act {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Act::Host(v) => write!(f, "Act::Host({} values)", v.len()),
            #[cfg(feature = "gpu")]
            Act::Device(t) => write!(f, "Act::Device({} values)", t.len()),
        }
    }
}

/// A small f32 parameter of a layer (a norm scale, conv taps, DeltaNet gate constants), shared
/// so a device backend can key its copy by the allocation and keep that allocation alive while
/// the copy is cached (an address reused by another model's parameter would otherwise hit it).
#[derive(Clone, Debug)]
pub struct Param(Arc<[f32]>);

impl Param {
    /// The allocation's address: the same for every clone, different for every live `Param`.
    pub fn key(&self) -> usize {
        self.0.as_ptr() as usize
    }
}

impl From<Vec<f32>> for Param {
    fn from(v: Vec<f32>) -> Self {
        Param(v.into())
    }
}

impl Deref for Param {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

/// Attention partials ([`Partials`]) where a backend keeps them: what
/// [`Backend::attend_pages`] makes for each page, and what [`Backend::merge_partials`] merges.
/// A helper's partials arrive as host values ([`From<Partials>`]).
#[derive(Debug)]
pub struct ActPartials {
    pub rows: usize,
    pub head_dim: usize,
    /// `[rows, head_dim]`, normalised by `l`.
    pub o: Act,
    /// `[rows]`: the max scaled score.
    pub m: Act,
    /// `[rows]`: the sum of `exp(score - m)`.
    pub l: Act,
}

impl From<Partials> for ActPartials {
    fn from(p: Partials) -> Self {
        ActPartials {
            rows: p.rows(),
            head_dim: p.head_dim,
            o: Act::Host(p.o),
            m: Act::Host(p.m),
            l: Act::Host(p.l),
        }
    }
}

/// A read-back in flight ([`Backend::read_ranges`]). Not `Send`: in a browser it waits on
/// the page's event loop.
pub type Readback = Pin<Box<dyn Future<Output = Vec<f32>>>>;

/// Head layout of a full-attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Head layout of a Gated DeltaNet layer. Value head `j` reads key head `j / (v_heads / k_heads)`.
#[derive(Clone, Copy, Debug)]
pub struct DeltaShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    /// How value heads share key heads when there are more of them. Grouped (Hugging Face's
    /// order): value head `h` reads key head `h / (v_heads / k_heads)`. Tiled (llama.cpp's GGUF
    /// order, whose converter permutes every value-head-indexed weight so that ggml can
    /// broadcast): key head `h % k_heads`. Only this mapping differs; every other value-head
    /// quantity is permuted consistently by the file.
    pub value_heads_tiled: bool,
}

impl DeltaShape {
    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        if self.value_heads_tiled {
            h % self.k_heads
        } else {
            h / (self.v_heads / self.k_heads)
        }
    }
}

/// Inputs of the gated delta rule for `t` tokens: `q, k` `[t, k_heads, dk]` (already
/// l2-normalised, q scaled), `v` `[t, v_heads, dv]`, log-decay `g` and `beta` `[t, v_heads]`.
/// `T` is where they live: host slices for the CPU kernels, [`Act`] for the trait, device
/// tensors for the GPU op layer.
pub struct DeltaInputs<'a, T: ?Sized = [f32]> {
    pub q: &'a T,
    pub k: &'a T,
    pub v: &'a T,
    pub g: &'a T,
    pub beta: &'a T,
}

/// The op vocabulary of `model/`. Ops that write a value in place take `&mut Act`; ops that
/// make a new value return it. A backend may accept a host value where it keeps values
/// elsewhere (the GPU backend moves it to the device on first use: a fresh state's zeros, a
/// state from the link), but never the reverse.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// Whether an op's work is done when it returns (the CPU), so its wall time is its cost;
    /// a GPU's ops return once recorded. The placement times this host's attention only then.
    fn timed_on_return(&self) -> bool {
        true
    }

    /// Whether fewer than [`STEP_ROWS`] rows of a pass get, bit for bit, what each gets as its
    /// own decode step: what speculative decoding needs to keep plain decoding's tokens. The
    /// CPU's and the GPU's kernels do (issue 36); a backend that has not shown it is refused
    /// drafts.
    fn rows_are_steps(&self) -> bool {
        false
    }

    /// Whether matrices stored as `dtype` can be used here (the GPU backend has no k-quant
    /// kernels yet).
    fn reads(&self, dtype: crate::tensor::DType) -> bool {
        let _ = dtype;
        true
    }

    /// Whether this backend holds and attends KV pages stored as `ty` with rows of `row`
    /// values (the GPU packs compact rows in whole 32-bit words: f16 rows of an even width,
    /// q8_0 and q4_0 rows of whole pairs of blocks).
    fn holds_kv(&self, ty: KvType, row: usize) -> bool {
        let _ = (ty, row);
        true
    }

    /// `page` (full, and read only from now on) packed for this backend's frozen-page decode
    /// kernel, if it has one and can take heads of `head_dim` (`--freeze-pages`).
    fn freeze_page(
        &self,
        kv_heads: usize,
        head_dim: usize,
        page: &KvPage,
    ) -> Option<frozen::FrozenPage> {
        let _ = (kv_heads, head_dim, page);
        None
    }

    /// Whether this backend keeps KV rows of compact type `ty` on its device, packed in
    /// 32-bit words as the host would store their bytes ([`PageRows::Device`], written by
    /// [`Self::write_packed`]); otherwise compact rows live on the host ([`PageRows::Packed`]).
    fn packs_kv(&self, ty: KvType) -> bool {
        let _ = ty;
        false
    }

    /// Values `span` of `src` written as `ty` into the packed device rows `dst` from value
    /// `at` on (whole words: `at` and the span fill whole 32-bit words). Only a backend whose
    /// [`Self::packs_kv`] says so is asked.
    fn write_packed(&self, ty: KvType, dst: &mut Act, at: usize, src: &Act, span: Range<usize>) {
        let _ = (dst, at, src, span);
        unreachable!("{} keeps no {} rows on a device", self.name(), ty.name())
    }

    /// Host values into the backend (the CPU keeps the vector as it is).
    fn upload(&self, x: Vec<f32>) -> Act;

    /// Host copies of the elements of `parts` (value, element range), concatenated: one read
    /// for many pieces (a device backend waits for its queue once).
    fn download_ranges(&self, parts: &[(&Act, Range<usize>)]) -> Vec<f32>;

    /// [`Self::download_ranges`] as a future, for a caller that must not block: in a browser a
    /// GPU read-back completes only after control returns to the event loop. The copies are
    /// recorded when this is called (so later ops do not change what is read); the future owns
    /// everything it needs. A backend that can read at once (the CPU; a native GPU, which
    /// waits for its queue) returns a future that is ready on its first poll.
    fn read_ranges(&self, parts: &[(&Act, Range<usize>)]) -> Readback {
        Box::pin(std::future::ready(self.download_ranges(parts)))
    }

    /// A host copy of `x`.
    fn download(&self, x: &Act) -> Vec<f32> {
        self.download_ranges(&[(x, 0..x.len())])
    }

    /// `x` on the host, consumed (the CPU hands its vector back without a copy).
    fn download_owned(&self, x: Act) -> Vec<f32> {
        self.download(&x)
    }

    /// A copy of `x` that evolves separately (a checkpoint of a DeltaNet state, the input of a
    /// norm that must leave the residual as it is).
    fn duplicate(&self, x: &Act) -> Act;

    /// Room for `capacity` values, filled by [`Self::write`] from the start (a KV page).
    fn alloc(&self, capacity: usize) -> Act;

    /// Elements `at .. at + len` of `dst` become `src[from .. from + len]`; every element below
    /// `at` must have been written before, and those past `at + len` are left unspecified (a KV
    /// page writes its rows in order and tracks its own length, so a truncated page is
    /// overwritten in place).
    fn write(&self, dst: &mut Act, at: usize, src: &Act, from: usize, len: usize);

    /// Rows `ids` of `table` as f32 `[ids.len(), table.cols]` (the caller checks the ids).
    fn embed(&self, table: &Matrix, ids: &[u32]) -> Act;

    /// `out[t, o] = sum_i x[t, i] * w[o, i]` (a Linear layer without bias).
    fn matmul(&self, x: &Act, w: &Matrix) -> Act;

    /// Each row of `x` (row length `scale.len()`) becomes `x * rsqrt(mean(x^2) + eps) * scale`.
    fn rms_norm(&self, x: &mut Act, scale: &Param, eps: f32);

    /// Each row of `dim` values becomes `x * rsqrt(sum(x^2) + eps) * scale`.
    fn l2_norm(&self, x: &mut Act, dim: usize, eps: f32, scale: f32);

    /// NeoX rotate-half RoPE on the first `inv_freq.len() * 2` dims of every head of `x`
    /// `[t, heads, head_dim]`; row `t` is at absolute position `positions[t]`.
    fn rope(&self, x: &mut Act, head_dim: usize, positions: &[usize], inv_freq: &[f32]);

    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut Act, up: &Act);

    /// `x = x * sigmoid(gate)`.
    fn sigmoid_mul(&self, x: &mut Act, gate: &Act);

    /// `x = x + y` (the residual).
    fn add(&self, x: &mut Act, y: &Act);

    /// `x = x * s`.
    fn scale(&self, x: &mut Act, s: f32);

    /// Columns `col0 .. col0 + width` of every row of `src` (rows of `stride` values), as a new
    /// `[rows, width]` value: q and its gate from the q projection, q/k/v from the conv output.
    fn copy_cols(&self, src: &Act, stride: usize, col0: usize, width: usize) -> Act;

    /// DeltaNet's gates, in place on rows of `heads` values: `a` becomes the log decay
    /// `g = neg_a * softplus(a + dt_bias)` and `b` becomes `beta = sigmoid(b)`; `params` is
    /// `[neg_a | dt_bias]` (`neg_a = -exp(A_log)`), `2 * heads` values.
    fn delta_gates(&self, a: &mut Act, b: &mut Act, params: &Param);

    /// Depthwise causal conv then SiLU, in place on `u` `[t, channels]`. `history` holds the
    /// previous `kernel - 1` input rows `[kernel - 1, channels]` and is advanced; `weight` is
    /// `[channels, kernel]` with tap `kernel - 1` on the current token.
    fn causal_conv_silu(&self, u: &mut Act, history: &mut Act, weight: &Param, kernel: usize);

    /// Attention partials of query rows `q` `[t, q_heads, head_dim]` (scaled by the caller)
    /// over each of `pages`, causal by absolute position (key `p` is visible to query row `t`
    /// iff `p <= q_pos[t]`), kept where the backend keeps values. A page's partials depend
    /// only on the page, the queries and the backend, never on where the other pages live.
    fn attend_pages(
        &self,
        shape: AttnShape,
        q: &Act,
        q_pos: &[usize],
        pages: &[&KvPage],
    ) -> Vec<ActPartials>;

    /// The attention output `[rows, head_dim]` of partials merged in the order given (page
    /// order: a helper's, the oldest, first), staying on the backend. Each backend has one
    /// merge (the CPU's is `backend::Merger`, in f64; the GPU's is `attn_merge`, in f32), used
    /// whether the pages were attended here or arrived from a helper, so moving a page
    /// never changes a bit.
    fn merge_partials(&self, rows: usize, head_dim: usize, parts: Vec<ActPartials>) -> Act;

    /// Gated delta rule over `t` tokens in the chunked (WY) form; `state` `[v_heads, dk, dv]`
    /// is read and advanced; returns the output `[t, v_heads, dv]`.
    fn delta_rule_chunked(
        &self,
        shape: DeltaShape,
        x: DeltaInputs<'_, Act>,
        state: &mut Act,
    ) -> Act;

    /// The same function, one token at a time (the decode form).
    fn delta_rule_recurrent(
        &self,
        shape: DeltaShape,
        x: DeltaInputs<'_, Act>,
        state: &mut Act,
    ) -> Act;

    /// Per row of `weight.len()` values: `weight * (o * rsqrt(mean(o^2) + eps)) * silu(z)`.
    fn gated_rms_norm(&self, o: &mut Act, z: &Act, weight: &Param, eps: f32);
}
