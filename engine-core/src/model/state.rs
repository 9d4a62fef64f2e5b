//! Per-sequence state: a paged KV cache per full-attention layer, recurrent + conv state per
//! DeltaNet layer. The KV grows with the context; the DeltaNet state has a fixed size. Both live
//! in the backend that runs the sequence (on a GPU host, on the device): they leave it only
//! when they cross the link.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::backend::{Act, Backend, CacheTypes};
use crate::cache_types::Encoded;
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kv::PagedKv;

/// Per full-attention layer, the K and V rows below a rewind's cut of the page the cut falls
/// into, where that page had left this device: they come back so the page lives here again.
pub type Refills = BTreeMap<usize, (Encoded, Encoded)>;

/// A fresh state is zeros on the host; a device backend moves it to the device the first time
/// an op advances it, and it stays there.
#[derive(Debug)]
pub struct DeltaState {
    /// Recurrent state `[v_heads, dk, dv]`.
    pub s: Act,
    /// The last `kernel - 1` conv inputs `[kernel - 1, conv_dim]`.
    pub conv: Act,
}

impl DeltaState {
    /// A copy that evolves separately, in the same backend.
    fn duplicate(&self, be: &dyn Backend) -> DeltaState {
        DeltaState {
            s: be.duplicate(&self.s),
            conv: be.duplicate(&self.conv),
        }
    }
}

/// A point a sequence can return to: the DeltaNet states at `pos` (KV rows are simply cut).
/// The recurrent state cannot be rewound by position, so a session takes one where a rewind
/// may land (the end of each turn). The copies stay in the backend that took them.
#[derive(Debug)]
pub struct Checkpoint {
    pub pos: usize,
    delta: Vec<(usize, DeltaState)>,
}

#[derive(Debug)]
pub enum LayerState {
    Attention(PagedKv),
    DeltaNet(DeltaState),
    /// A DeltaNet layer this device never runs (a helper's, outside the layers it is
    /// assigned): no state, so a helper that holds only KV pages spends no memory on
    /// recurrent state. Running the layer on this state is an error.
    Elsewhere,
}

/// One sequence: its position, and each layer's state. Pages that left this device are
/// counted here (each cache's `remote_len`); where they are is the host's placement's to know
/// (`host::Sequence` pairs the two).
pub struct State {
    /// Positions consumed so far (the next token's position).
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

impl State {
    /// A fresh sequence with exact (f32) KV pages.
    pub fn new(c: &ModelConfig, page_size: usize) -> State {
        State::for_layers(c, page_size, 0..c.layer_types.len(), CacheTypes::F32)
    }

    /// A fresh sequence whose KV pages are stored as `types`, refused where the model's KV
    /// heads are not whole blocks of them.
    pub fn typed(c: &ModelConfig, page_size: usize, types: CacheTypes) -> Result<State> {
        types.check_head(c.head_dim)?;
        Ok(State::for_layers(
            c,
            page_size,
            0..c.layer_types.len(),
            types,
        ))
    }

    /// A state for a device that runs only `runs` of the layers: DeltaNet layers outside it
    /// are [`LayerState::Elsewhere`]. Every full-attention layer keeps a cache (a helper holds
    /// the pages of all of them), stored as `types`.
    pub fn for_layers(
        c: &ModelConfig,
        page_size: usize,
        runs: Range<usize>,
        types: CacheTypes,
    ) -> State {
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, k)| match k {
                LayerKind::LinearAttention if !runs.contains(&i) => LayerState::Elsewhere,
                LayerKind::FullAttention => LayerState::Attention(PagedKv::new(
                    page_size,
                    c.num_key_value_heads,
                    c.head_dim,
                    types,
                )),
                LayerKind::LinearAttention => LayerState::DeltaNet(DeltaState {
                    s: Act::Host(vec![0.0; c.delta_state_len().0]),
                    conv: Act::Host(vec![0.0; c.delta_state_len().1]),
                }),
            })
            .collect();
        State { pos: 0, layers }
    }

    /// How the KV caches store keys and values (the same in every layer; f32 for a model
    /// without full-attention layers).
    pub fn kv_types(&self) -> CacheTypes {
        self.first_cache().map_or(CacheTypes::F32, PagedKv::types)
    }

    /// Positions per KV page (the same in every layer; `None` for a model without
    /// full-attention layers).
    pub fn page_size(&self) -> Option<usize> {
        self.first_cache().map(PagedKv::page_size)
    }

    /// Pack every KV page that fills from now on for the backend's frozen-page decode kernel,
    /// where it has one (`--freeze-pages`; docs/FROZEN_PAGES.md).
    pub fn freeze_pages(&mut self) {
        for l in &mut self.layers {
            if let LayerState::Attention(kv) = l {
                kv.freeze_full_pages();
            }
        }
    }

    /// The first full-attention layer's cache: what every layer's shares (types, pages moved).
    fn first_cache(&self) -> Option<&PagedKv> {
        self.layers.iter().find_map(|l| match l {
            LayerState::Attention(kv) => Some(kv),
            LayerState::DeltaNet(_) | LayerState::Elsewhere => None,
        })
    }

    /// Positions of every full-attention layer whose KV lives on the helper (pages move for
    /// all layers together, so one number describes them all).
    pub fn remote_kv_len(&self) -> usize {
        self.first_cache().map_or(0, PagedKv::remote_len)
    }

    /// A copy of every DeltaNet state, taken by `be` (the backend running this sequence).
    pub fn checkpoint(&self, be: &dyn Backend) -> Checkpoint {
        let delta = self
            .layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match l {
                LayerState::DeltaNet(d) => Some((i, d.duplicate(be))),
                LayerState::Attention(_) | LayerState::Elsewhere => None,
            })
            .collect();
        Checkpoint {
            pos: self.pos,
            delta,
        }
    }

    /// Whether `cp` is a point this sequence can return to (its own, not in its future).
    pub fn check_checkpoint(&self, cp: &Checkpoint) -> Result<()> {
        let deltas = self
            .layers
            .iter()
            .filter(|l| matches!(l, LayerState::DeltaNet(_)))
            .count();
        if cp.pos > self.pos || cp.delta.len() != deltas {
            return Err(Error::Invalid(format!(
                "cannot rewind from position {} to a checkpoint at {} of another sequence or the future",
                self.pos, cp.pos
            )));
        }
        Ok(())
    }

    /// Return to `cp` (an edited conversation): cut every KV cache back to its position and
    /// restore the DeltaNet states. Where the cut falls inside a page that left this device,
    /// `refills` holds that layer's rows of the page below the cut (`host::Placement::
    /// cut_pages` fetches them), so the page comes back whole and page boundaries, and so
    /// results, stay those of an uncut run. `cp` stays valid for another rewind.
    pub fn rewind(
        &mut self,
        be: &dyn Backend,
        cp: &Checkpoint,
        mut refills: Refills,
    ) -> Result<()> {
        self.check_checkpoint(cp)?;
        for (i, l) in self.layers.iter_mut().enumerate() {
            if let LayerState::Attention(kv) = l {
                kv.rewind(be, cp.pos, refills.remove(&i))?;
            }
        }
        for (i, d) in &cp.delta {
            self.layers[*i] = LayerState::DeltaNet(d.duplicate(be));
        }
        self.pos = cp.pos;
        Ok(())
    }

    /// Full-attention layer `i`'s cache ([`State::check_matches`] has checked the kinds).
    pub(crate) fn kv_mut(&mut self, i: usize) -> &mut PagedKv {
        match &mut self.layers[i] {
            LayerState::Attention(kv) => kv,
            _ => unreachable!("State::check_matches verified the layer kinds"),
        }
    }

    /// DeltaNet layer `i`'s state; an error where this device holds none of it.
    pub(crate) fn delta_mut(&mut self, i: usize) -> Result<&mut DeltaState> {
        match &mut self.layers[i] {
            LayerState::DeltaNet(d) => Ok(d),
            LayerState::Elsewhere => Err(Error::Invalid(format!(
                "layer {i} does not run on this device: its sequence state holds none of it"
            ))),
            LayerState::Attention(_) => {
                unreachable!("State::check_matches verified the layer kinds")
            }
        }
    }

    pub(crate) fn check_matches(&self, c: &ModelConfig) -> Result<()> {
        let ok = self.layers.len() == c.layer_types.len()
            && self.layers.iter().zip(&c.layer_types).all(|(s, k)| {
                matches!(
                    (s, k),
                    (LayerState::Attention(_), LayerKind::FullAttention)
                        | (
                            LayerState::DeltaNet(_) | LayerState::Elsewhere,
                            LayerKind::LinearAttention
                        )
                )
            });
        if ok {
            Ok(())
        } else {
            Err(Error::Invalid(
                "sequence state was made for a different model".into(),
            ))
        }
    }

    /// A copy that evolves separately, in the same backend (a prefix another sequence starts
    /// from): the KV pages shared until one of the two writes to one (see
    /// [`PagedKv::share`]), the DeltaNet states duplicated. Only a state whose pages are all
    /// on this device is forked.
    pub fn fork(&self, be: &dyn Backend) -> Result<State> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Attention(kv) => LayerState::Attention(kv.share()?),
                    LayerState::DeltaNet(d) => LayerState::DeltaNet(d.duplicate(be)),
                    LayerState::Elsewhere => LayerState::Elsewhere,
                })
            })
            .collect::<Result<_>>()?;
        Ok(State {
            pos: self.pos,
            layers,
        })
    }

    /// Bytes held by KV caches.
    pub fn kv_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attention(kv) => kv.bytes(),
                LayerState::DeltaNet(_) | LayerState::Elsewhere => 0,
            })
            .sum()
    }

    /// Bytes of DeltaNet state a [`State::for_layers`] with `runs` holds, known before making
    /// it (a helper checks its budget first).
    pub fn delta_bytes_for(c: &ModelConfig, runs: Range<usize>) -> usize {
        let (s, conv) = c.delta_state_len();
        let layers = c.count_layers(runs, LayerKind::LinearAttention);
        layers * (s + conv) * std::mem::size_of::<f32>()
    }

    /// Bytes held by DeltaNet states (recurrent and conv), a fixed amount per layer run here.
    pub fn delta_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::DeltaNet(d) => (d.s.len() + d.conv.len()) * std::mem::size_of::<f32>(),
                LayerState::Attention(_) | LayerState::Elsewhere => 0,
            })
            .sum()
    }
}
