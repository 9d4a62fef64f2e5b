//! The Qwen3.5 dense hybrid, written once in the backend's op vocabulary (see ../shared/MODEL.md):
//!
//! ```text
//! x = embed[ids]
//! for each layer:  h = x + mixer(norm_in(x));  x = h + mlp(norm_post(h))
//! logits = lm_head(norm_final(x))
//! ```
//! `attention.rs` and `deltanet.rs` hold the two mixers; `state.rs` the per-sequence state.

mod attention;
mod deltanet;
mod mtp;
mod state;

pub use state::{Checkpoint, DeltaState, LayerState, Refills, State};

use crate::backend::{Act, Backend, Param};
use crate::config::{LayerKind, ModelConfig, WeightLayout};
use crate::error::{Error, Result};
use crate::identity::ModelIdentity;
use crate::kv::{NoPagesAway, PageSource, PagedKv, PendingAttention};
use crate::tensor::{Matrix, Tensor};
use crate::weights::TensorMap;

use attention::Attention;
use deltanet::DeltaNet;
use mtp::Mtp;

/// Which rows of the batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every row (`tether eval`).
    All,
    /// The last row only (prefill before sampling).
    Last,
    /// None (a prefill chunk that is followed by more).
    None,
}

/// Residual rows on their way through a range of layers ([`Model::advance`]). A pass can
/// stop at a full-attention layer while the helper attends its pages, and resume later.
pub struct Pass {
    /// The residual rows `[tokens, hidden]`, in the backend.
    pub x: Act,
    pos: usize,
    next: usize,
    end: usize,
    waiting: Option<Waiting>,
}

/// A full-attention layer whose helper partials are still to come: each span's attention.
struct Waiting {
    attention: Vec<PendingAttention>,
    gate: Act,
}

/// One sequence's rows in a pass over several sequences ([`Model::advance_spans`]): `rows`
/// consecutive rows of the pass at positions `pos ..`, the sequence's state, and where its
/// pages that left this device are attended. The projections and the MLP take every span's
/// rows in one product; the conv, the delta rule and attention run span by span, each on its
/// own state, as they would for the sequence alone.
pub struct Span<'a> {
    pub rows: usize,
    pub pos: usize,
    pub state: &'a mut State,
    pub source: &'a mut dyn PageSource,
}

impl Span<'_> {
    /// Every span's positions, in row order: what RoPE rotates the pass's rows by.
    fn positions(spans: &[Span]) -> Vec<usize> {
        spans.iter().flat_map(|s| s.pos..s.pos + s.rows).collect()
    }
}

/// Rows `r0 .. r0 + rows` of `x` (rows of `width` values), copied out: one span's share of
/// a pass over several (a pass of one sequence takes its values whole).
fn span_rows(be: &dyn Backend, x: &Act, width: usize, r0: usize, rows: usize) -> Act {
    let mut part = be.alloc(rows * width);
    be.write(&mut part, 0, x, r0 * width, rows * width);
    part
}

/// The spans' outputs, one after another in row order.
fn join_rows(be: &dyn Backend, mut parts: Vec<Act>) -> Act {
    if parts.len() == 1 {
        return parts.pop().expect("one part");
    }
    let total: usize = parts.iter().map(Act::len).sum();
    let mut out = be.alloc(total);
    let mut at = 0;
    for p in &parts {
        be.write(&mut out, at, p, 0, p.len());
        at += p.len();
    }
    out
}

impl Pass {
    /// Rows `x` at positions `pos ..`, to run through `layers`.
    pub fn new(x: Act, pos: usize, layers: std::ops::Range<usize>) -> Pass {
        Pass {
            x,
            pos,
            next: layers.start,
            end: layers.end,
            waiting: None,
        }
    }

    /// Whether every layer has run.
    pub fn is_done(&self) -> bool {
        self.next >= self.end
    }

    /// Whether the pass stopped to let the helper attend.
    pub fn is_waiting(&self) -> bool {
        self.waiting.is_some()
    }
}

enum Mixer {
    Attention(Attention),
    DeltaNet(DeltaNet),
}

struct Mlp {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

struct Layer {
    /// `1 + w` of the input RMSNorm (Qwen3.5 stores norm weights as offsets).
    norm_in: Param,
    norm_post: Param,
    mixer: Mixer,
    mlp: Mlp,
}

pub struct Model {
    pub config: ModelConfig,
    /// Identity for the host-helper handshake, always of the whole model.
    pub identity: ModelIdentity,
    /// The embedding and the head; a helper that runs only middle or tail layers has neither.
    ends: Option<Ends>,
    /// Layers built on this device (all of them, or a helper's share).
    loaded: std::ops::Range<usize>,
    layers: Vec<Option<Layer>>,
}

struct Ends {
    embed: Matrix,
    lm_head: Matrix,
    norm_final: Param,
    /// The checkpoint's multi-token-prediction head, where it has one: it drafts with the
    /// embedding and the LM head.
    mtp: Option<Mtp>,
}

/// Looks tensors up by name and checks their shapes, so a wrong checkpoint fails with the name
/// and both shapes.
pub(crate) struct Loader<'a> {
    tensors: &'a TensorMap,
    layout: WeightLayout,
}

impl<'a> Loader<'a> {
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<&'a Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        if t.shape != shape {
            return Err(Error::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.tensor(name, &[rows, cols])?;
        let (block, _) = t.dtype().block();
        if !cols.is_multiple_of(block) {
            return Err(Error::Weights(format!(
                "{name}: rows of {cols} {} weights are not whole blocks of {block}",
                t.dtype().name()
            )));
        }
        Ok(Matrix {
            rows,
            cols,
            data: t.data.clone(),
        })
    }

    pub(crate) fn vector(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self.tensor(name, shape)?.data.to_f32_vec())
    }

    /// An RMSNorm's scale `1 + w`: a safetensors checkpoint stores the offset `w`, a GGUF
    /// the scale itself.
    pub(crate) fn offset_norm(&self, name: &str, dim: usize) -> Result<Param> {
        let stored = self.vector(name, &[dim])?;
        Ok(match self.layout {
            WeightLayout::HuggingFace => stored.into_iter().map(|w| 1.0 + w).collect(),
            WeightLayout::Gguf => stored,
        }
        .into())
    }
}

impl Model {
    /// Build the model from named tensors (text-only naming, see `weights::normalise_name`).
    /// Its identity is a digest of every tensor byte ([`ModelIdentity::of_tensors`]).
    pub fn from_tensors(config: ModelConfig, tensors: &TensorMap) -> Result<Model> {
        let identity = ModelIdentity::of_tensors("weights in memory", &config, tensors);
        Model::with_identity(config, tensors, identity)
    }

    /// The whole model, with an identity its source knows (a checkpoint's, a preset's).
    pub fn with_identity(
        config: ModelConfig,
        tensors: &TensorMap,
        identity: ModelIdentity,
    ) -> Result<Model> {
        let all = 0..config.num_hidden_layers;
        Model::build(config, tensors, all, true, identity)
    }

    /// Only `layers`, without embedding and head: what a helper runs. `tensors` need hold only
    /// those layers; `identity` is the whole model's, so the handshake still compares whole
    /// models.
    pub fn layers_only(
        config: ModelConfig,
        tensors: &TensorMap,
        layers: std::ops::Range<usize>,
        identity: ModelIdentity,
    ) -> Result<Model> {
        if layers.start > layers.end || layers.end > config.num_hidden_layers {
            return Err(Error::Invalid(format!(
                "layers {layers:?} of a {}-layer model",
                config.num_hidden_layers
            )));
        }
        Model::build(config, tensors, layers, false, identity)
    }

    /// Refuses `tensors` wherever building the whole model of `config` from them would (`run`,
    /// `eval`): by the same code, so that the tools that build no whole model (`tether
    /// quantize`, a helper at startup) refuse exactly what the engine refuses, in its words.
    /// Nothing is kept: of tensors mapped from a file only the vectors (norms, gates, conv
    /// kernels: well under a percent of the weights) are read; the matrices are looked at by
    /// name, shape and dtype.
    pub fn check_tensors(config: &ModelConfig, tensors: &TensorMap) -> Result<()> {
        let all = 0..config.num_hidden_layers;
        Model::parts(config, tensors, &all, true).map(drop)
    }

    fn build(
        config: ModelConfig,
        tensors: &TensorMap,
        loaded: std::ops::Range<usize>,
        with_ends: bool,
        identity: ModelIdentity,
    ) -> Result<Model> {
        let (ends, layers) = Model::parts(&config, tensors, &loaded, with_ends)?;
        Ok(Model {
            identity,
            ends,
            loaded,
            layers,
            config,
        })
    }

    /// The ends (`with_ends`, with the MTP head where there is one) and the `loaded`
    /// layers of `c` from `tensors`, after the config's own checks, each tensor checked
    /// against the config as it is taken ([`Loader`]): the one check of a checkpoint's tensors.
    fn parts(
        c: &ModelConfig,
        tensors: &TensorMap,
        loaded: &std::ops::Range<usize>,
        with_ends: bool,
    ) -> Result<(Option<Ends>, Vec<Option<Layer>>)> {
        c.validate()?;
        let ld = Loader {
            tensors,
            layout: c.layout,
        };
        let (h, v) = (c.hidden_size, c.vocab_size);
        let ends = if with_ends {
            let embed = ld.matrix("model.embed_tokens.weight", v, h)?;
            let lm_head = if c.tie_word_embeddings {
                embed.clone()
            } else {
                ld.matrix("lm_head.weight", v, h)?
            };
            let norm_final = ld.offset_norm("model.norm.weight", h)?;
            Some(Ends {
                embed,
                lm_head,
                norm_final,
                mtp: Mtp::load(c, &ld)?,
            })
        } else {
            None
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, kind) in c.layer_types.iter().enumerate() {
            layers.push(match loaded.contains(&i) {
                true => Some(Layer::load(c, &ld, &format!("model.layers.{i}."), *kind)?),
                false => None,
            });
        }
        Ok((ends, layers))
    }

    /// The layers built on this device.
    pub fn loaded_layers(&self) -> std::ops::Range<usize> {
        self.loaded.clone()
    }

    fn layer(&self, i: usize) -> Result<&Layer> {
        self.layers.get(i).and_then(|l| l.as_ref()).ok_or_else(|| {
            Error::Invalid(format!(
                "layer {i} is not loaded on this device (it holds layers {:?} of {})",
                self.loaded,
                self.layers.len()
            ))
        })
    }

    fn ends(&self) -> Result<&Ends> {
        self.ends.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "this device holds only layers {:?}: no embedding or output head",
                self.loaded
            ))
        })
    }

    /// Load `config.json` and the safetensors of a checkpoint directory.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load_dir(dir: &std::path::Path) -> Result<Model> {
        let config = Model::read_config(dir)?;
        let tensors = crate::weights::load_dir(dir)?;
        let identity = ModelIdentity::of_checkpoint(dir, &config)?;
        Model::with_identity(config, &tensors, identity)
    }

    /// A checkpoint directory's `config.json`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_config(dir: &std::path::Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        ModelConfig::from_json_str(&text)
    }

    /// A fresh per-sequence state (empty KV cache, zero recurrent and conv state).
    pub fn new_state(&self, page_size: usize) -> State {
        State::new(&self.config, page_size)
    }

    /// Bytes of weights as stored, per layer (0 for a layer not held here) and of the
    /// embedding, head and MTP head (tied embeddings counted once; the MTP head lives with the
    /// ends, on the host): what a plan divides among devices.
    pub fn weight_bytes_by_layer(&self) -> (Vec<usize>, usize) {
        let ends = self.ends.as_ref().map_or(0, |e| {
            let head = if self.config.tie_word_embeddings {
                0
            } else {
                e.lm_head.nbytes()
            };
            let mtp: usize = e
                .mtp
                .iter()
                .flat_map(Mtp::matrices)
                .map(Matrix::nbytes)
                .sum();
            e.embed.nbytes() + head + mtp
        });
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map_or(0, |l| l.matrices().map(Matrix::nbytes).sum())
            })
            .collect();
        (layers, ends)
    }

    /// Bytes of weights as stored (tied embeddings counted once).
    pub fn weight_bytes(&self) -> usize {
        let (layers, ends) = self.weight_bytes_by_layer();
        ends + layers.iter().sum::<usize>()
    }

    /// An error if `be` cannot use the weights as they are stored (k-quant matrices on the GPU
    /// backend, which has no kernels for them yet), before anything runs.
    pub fn check_backend(&self, be: &dyn Backend) -> Result<()> {
        let ends = self.ends.iter().flat_map(|e| [&e.embed, &e.lm_head]);
        match ends
            .chain(self.layers.iter().flatten().flat_map(Layer::matrices))
            .chain(self.mtp_head().into_iter().flat_map(Mtp::matrices))
            .find(|m| !be.reads(m.dtype()))
        {
            Some(m) => Err(Error::Invalid(format!(
                "the {} backend cannot compute with {} weights yet: use --backend cpu",
                be.name(),
                m.dtype().name()
            ))),
            None => Ok(()),
        }
    }

    /// How the weights are stored (the MLP's, which every layer has).
    pub fn weight_dtype(&self) -> Option<crate::tensor::DType> {
        self.layers
            .iter()
            .flatten()
            .next()
            .map(|l| l.mlp.gate.dtype())
    }

    /// Run `tokens` at positions `state.pos ..`, advancing `state` (a sequence whose pages all
    /// stay on this device: a host's distributed one runs through `host::Sequence::forward`);
    /// returns logits `[rows, vocab]` for the rows `logits` asks for (the only values read
    /// back). If `trace` is given, the residual after each layer is read back and pushed to it
    /// (`[tokens, hidden]` per layer) to find the first layer that diverges.
    pub fn forward(
        &self,
        be: &dyn Backend,
        state: &mut State,
        tokens: &[u32],
        logits: Logits,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let x = self.residual(be, state, tokens, trace)?;
        self.head(be, x, logits)
    }

    /// Every layer over `tokens` at `state.pos ..`, advancing `state`: the final residual rows.
    fn residual(
        &self,
        be: &dyn Backend,
        state: &mut State,
        tokens: &[u32],
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Act> {
        let mut x = self.embed(be, tokens)?;
        let (pos, layers) = (state.pos, 0..self.layers.len());
        self.run_layers(be, state, &mut NoPagesAway, &mut x, pos, layers, trace)?;
        state.pos += tokens.len();
        Ok(x)
    }

    /// Embedding rows `[tokens, hidden]` in the backend; rejects ids outside the vocabulary.
    pub fn embed(&self, be: &dyn Backend, tokens: &[u32]) -> Result<Act> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(Error::Invalid("forward needs at least one token".into()));
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(Error::TokenOutOfRange {
                id,
                vocab: c.vocab_size,
            });
        }
        Ok(be.embed(&self.ends()?.embed, tokens))
    }

    /// Advance the residual rows `x` (positions `pos ..`) through `layers`, updating those
    /// layers' state; pages that left this device are attended where `source` says. The seam
    /// of a split: host and helper each run a range of layers on the same rows. `state.pos` is
    /// left to the caller. On error `x` holds the rows as far as they got (the state has moved
    /// on too, so a caller cannot simply rerun them).
    #[allow(clippy::too_many_arguments)]
    pub fn run_layers(
        &self,
        be: &dyn Backend,
        state: &mut State,
        source: &mut dyn PageSource,
        x: &mut Act,
        pos: usize,
        layers: std::ops::Range<usize>,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        // The rows move into the pass and back: no copy.
        let mut pass = Pass::new(std::mem::replace(x, Act::Host(Vec::new())), pos, layers);
        let done = self.advance(be, state, source, &mut pass, false, trace);
        *x = pass.x;
        done
    }

    /// Run `pass` on through its layers. With `pause`, stop at a full-attention layer once
    /// the helper has been asked for its pages' share (the host's own pages are done by then),
    /// so the caller can advance another ubatch while the helper works; the next call collects
    /// the helper's partials and goes on. If `trace` is given, the residual after each layer is
    /// pushed to it (`[tokens, hidden]` per layer) to find the first layer that diverges.
    pub fn advance(
        &self,
        be: &dyn Backend,
        state: &mut State,
        source: &mut dyn PageSource,
        pass: &mut Pass,
        pause: bool,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        let rows = pass.x.len() / self.config.hidden_size;
        let pos = pass.pos;
        let span = Span {
            rows,
            pos,
            state,
            source,
        };
        self.advance_spans(be, &mut [span], pass, pause, trace)
    }

    /// [`Self::advance`] for the rows of several sequences, `spans` in row order (`pass.pos`
    /// unused: each span has its own). Each row's arithmetic is what it gets in a pass of its
    /// own sequence where the backend's products are batch-invariant, as the CPU's and the
    /// GPU's are for fewer than [`crate::backend::STEP_ROWS`] rows in all
    /// ([`Backend::rows_are_steps`]): every op besides the products, the conv, the delta rule
    /// and attention works row by row, and those three run span by span.
    pub fn advance_spans(
        &self,
        be: &dyn Backend,
        spans: &mut [Span],
        pass: &mut Pass,
        pause: bool,
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        let c = &self.config;
        for s in spans.iter() {
            s.state.check_matches(c)?;
        }
        let rows: usize = spans.iter().map(|s| s.rows).sum();
        if pass.end > self.layers.len() || pass.x.len() != rows * c.hidden_size {
            return Err(Error::Invalid(format!(
                "layers ..{} on {} values as {rows} rows: the model has {} layers of width {}",
                pass.end,
                pass.x.len(),
                self.layers.len(),
                c.hidden_size
            )));
        }
        if let Some(w) = pass.waiting.take() {
            let Mixer::Attention(a) = &self.layer(pass.next)?.mixer else {
                unreachable!("a pass waits only at full-attention layers")
            };
            let y = a.finish(be, Attention::collect(be, w.attention, spans)?, &w.gate);
            self.close_layer(be, pass, &y, trace.as_deref_mut())?;
        }
        while pass.next < pass.end {
            let i = pass.next;
            let layer = self.layer(i)?;
            let mut normed = be.duplicate(&pass.x);
            be.rms_norm(&mut normed, &layer.norm_in, c.rms_norm_eps);
            let y = match &layer.mixer {
                Mixer::Attention(a) => {
                    let (attention, gate) = a.begin(be, &normed, i, spans)?;
                    if pause && attention.iter().any(PendingAttention::awaits_helper) {
                        pass.waiting = Some(Waiting { attention, gate });
                        return Ok(());
                    }
                    a.finish(be, Attention::collect(be, attention, spans)?, &gate)
                }
                Mixer::DeltaNet(d) => d.forward(be, c, &normed, i, spans)?,
            };
            self.close_layer(be, pass, &y, trace.as_deref_mut())?;
        }
        Ok(())
    }

    /// Add the mixer's output `y` to the residual, then the MLP's; on to the next layer.
    fn close_layer(
        &self,
        be: &dyn Backend,
        pass: &mut Pass,
        y: &Act,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        let layer = self.layer(pass.next)?;
        be.add(&mut pass.x, y);
        layer.mlp_residual(be, &mut pass.x, self.config.rms_norm_eps);
        if let Some(tr) = trace {
            tr.push(be.download(&pass.x));
        }
        pass.next += 1;
        Ok(())
    }

    /// Final norm and output projection of the rows `logits` asks for, read to the host.
    pub fn head(&self, be: &dyn Backend, x: Act, logits: Logits) -> Result<Vec<f32>> {
        match self.final_rows(be, x, logits)? {
            Some(rows) => self.logits_of(be, &rows),
            None => Ok(Vec::new()),
        }
    }

    /// The LM head over normed rows, read to the host: `[rows, vocab]`.
    fn logits_of(&self, be: &dyn Backend, rows: &Act) -> Result<Vec<f32>> {
        Ok(be.download_owned(be.matmul(rows, &self.ends()?.lm_head)))
    }

    /// The rows `logits` asks for after the final norm: what the LM head multiplies, and the
    /// hidden rows the MTP head drafts from.
    fn final_rows(&self, be: &dyn Backend, x: Act, logits: Logits) -> Result<Option<Act>> {
        let c = &self.config;
        let h = c.hidden_size;
        let n = x.len();
        let mut rows = match logits {
            Logits::All => x,
            Logits::Last => {
                let mut last = be.alloc(h);
                be.write(&mut last, 0, &x, n - h, h);
                last
            }
            Logits::None => return Ok(None),
        };
        be.rms_norm(&mut rows, &self.ends()?.norm_final, c.rms_norm_eps);
        Ok(Some(rows))
    }

    /// Whether this model has a multi-token-prediction head to draft with.
    pub fn has_mtp(&self) -> bool {
        self.mtp_head().is_some()
    }

    fn mtp_head(&self) -> Option<&Mtp> {
        self.ends.as_ref()?.mtp.as_ref()
    }

    /// An empty KV cache for the MTP head's layer, of the main caches' page size and types.
    pub fn new_mtp_cache(
        &self,
        page_size: usize,
        types: crate::cache_types::CacheTypes,
    ) -> PagedKv {
        let c = &self.config;
        PagedKv::new(page_size, c.num_key_value_heads, c.head_dim, types)
    }

    /// [`Model::forward`] that also returns the rows after the final norm (`[tokens, hidden]`,
    /// on the host), every row's: what the MTP head drafts from.
    pub fn forward_hidden(
        &self,
        be: &dyn Backend,
        state: &mut State,
        tokens: &[u32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let x = self.residual(be, state, tokens, None)?;
        self.head_rows(be, x)
    }

    /// Every row of the final residual `x` after the final norm, on the host (`[rows,
    /// hidden]`): a prefill's rows for the MTP head, without their logits.
    pub fn final_norm_rows(&self, be: &dyn Backend, x: &Act) -> Result<Vec<f32>> {
        let rows = self.final_rows(be, be.duplicate(x), Logits::All)?;
        Ok(be.download_owned(rows.expect("every row asked")))
    }

    /// Every row of the final residual `x` after the final norm, and its logits, on the host:
    /// `([rows, hidden], [rows, vocab])`.
    pub fn head_rows(&self, be: &dyn Backend, x: Act) -> Result<(Vec<f32>, Vec<f32>)> {
        let rows = self
            .final_rows(be, x, Logits::All)?
            .expect("every row asked");
        let logits = self.logits_of(be, &rows)?;
        Ok((be.download_owned(rows), logits))
    }

    /// The MTP head over the pairs (`hidden` row `i`, `tokens[i]`) at positions `pos ..`
    /// (`hidden` `[n, H]` on the host: the main model's rows after its final norm, or the
    /// head's own output for a chained draft), appending to its cache `kv`. Returns the head's
    /// output rows (the next chained row's hidden) and their logits, `[n, vocab]`.
    pub fn mtp(
        &self,
        be: &dyn Backend,
        kv: &mut PagedKv,
        (hidden, tokens): (&[f32], &[u32]),
        pos: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mtp = self.mtp_head().ok_or_else(|| {
            Error::Invalid("this model has no multi-token-prediction head (mtp.* tensors)".into())
        })?;
        let embedded = self.embed(be, tokens)?;
        let hidden = be.upload(hidden.to_vec());
        let g = mtp.forward(be, &self.config, (embedded, &hidden), kv, pos)?;
        let logits = self.logits_of(be, &g)?;
        Ok((be.download_owned(g), logits))
    }
}

impl Layer {
    /// Layer `p` (its tensors' name prefix) of `kind`.
    fn load(c: &ModelConfig, ld: &Loader, p: &str, kind: LayerKind) -> Result<Layer> {
        let h = c.hidden_size;
        let mixer = match kind {
            LayerKind::FullAttention => {
                Mixer::Attention(Attention::load(c, ld, &format!("{p}self_attn."))?)
            }
            LayerKind::LinearAttention => {
                Mixer::DeltaNet(DeltaNet::load(c, ld, &format!("{p}linear_attn."))?)
            }
        };
        let m = format!("{p}mlp.");
        Ok(Layer {
            norm_in: ld.offset_norm(&format!("{p}input_layernorm.weight"), h)?,
            norm_post: ld.offset_norm(&format!("{p}post_attention_layernorm.weight"), h)?,
            mixer,
            mlp: Mlp {
                gate: ld.matrix(&format!("{m}gate_proj.weight"), c.intermediate_size, h)?,
                up: ld.matrix(&format!("{m}up_proj.weight"), c.intermediate_size, h)?,
                down: ld.matrix(&format!("{m}down_proj.weight"), h, c.intermediate_size)?,
            },
        })
    }

    /// Every matrix of the layer.
    fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        let mixer: Vec<&Matrix> = match &self.mixer {
            Mixer::Attention(a) => a.matrices().to_vec(),
            Mixer::DeltaNet(d) => d.matrices().to_vec(),
        };
        [&self.mlp.gate, &self.mlp.up, &self.mlp.down]
            .into_iter()
            .chain(mixer)
    }

    /// The layer's second half on the residual `x` (the mixer's output already added): `x +=
    /// mlp(norm_post(x))`.
    fn mlp_residual(&self, be: &dyn Backend, x: &mut Act, eps: f32) {
        let mut normed = be.duplicate(x);
        be.rms_norm(&mut normed, &self.norm_post, eps);
        let out = self.mlp.forward(be, &normed);
        be.add(x, &out);
    }
}

impl Mlp {
    fn forward(&self, be: &dyn Backend, x: &Act) -> Act {
        let mut gate = be.matmul(x, &self.gate);
        let up = be.matmul(x, &self.up);
        be.silu_mul(&mut gate, &up);
        be.matmul(&gate, &self.down)
    }
}
