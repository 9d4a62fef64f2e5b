//! Per-sequence state: a paged KV cache per full-attention layer, recurrent + conv state per
//! DeltaNet layer. The KV grows with the context; the DeltaNet state has a fixed size. Both live
//! in the backend that runs the sequence (on a GPU host, on the device): they leave it only
//! when they cross the link.

use std::ops::Range;

use crate::backend::{Act, Backend};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kv::PagedKv;
use crate::remote::HelperClient;

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

pub struct State {
    /// Positions consumed so far (the next token's position).
    pub pos: usize,
    pub layers: Vec<LayerState>,
    /// Where this sequence's oldest KV pages go once the host's budget is full.
    pub remote: Option<HelperClient>,
    /// KV positions per layer kept on this device when a remote is attached; whole pages past
    /// it move to the remote after every forward pass.
    pub host_kv_tokens: Option<usize>,
    /// The remote refused a page for lack of memory: pages now stay here, past the budget,
    /// rather than fail the sequence (and are not offered again, a round trip each).
    pub remote_full: bool,
}

impl State {
    pub fn new(c: &ModelConfig, page_size: usize) -> State {
        State::for_layers(c, page_size, 0..c.layer_types.len())
    }

    /// A state for a device that runs only `runs` of the layers: DeltaNet layers outside it
    /// are [`LayerState::Elsewhere`]. Every full-attention layer keeps a cache (a helper holds
    /// the pages of all of them).
    pub fn for_layers(c: &ModelConfig, page_size: usize, runs: Range<usize>) -> State {
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
                )),
                LayerKind::LinearAttention => LayerState::DeltaNet(DeltaState {
                    s: Act::Host(vec![0.0; c.delta_state_len().0]),
                    conv: Act::Host(vec![0.0; c.delta_state_len().1]),
                }),
            })
            .collect();
        State {
            pos: 0,
            layers,
            remote: None,
            host_kv_tokens: None,
            remote_full: false,
        }
    }

    /// Forget a helper that is gone: from now on this host keeps its whole KV (no budget), and
    /// any pages the helper held are lost (the caller has checked there were none, or fails
    /// the sequence).
    pub fn detach_helper(&mut self) {
        self.remote = None;
        self.host_kv_tokens = None;
        self.remote_full = false;
    }

    /// Positions of every full-attention layer whose KV lives on the helper (pages move for
    /// all layers together, so one number describes them all).
    pub fn remote_kv_len(&self) -> usize {
        self.layers
            .iter()
            .find_map(|l| match l {
                LayerState::Attention(kv) => Some(kv.remote_len()),
                LayerState::DeltaNet(_) | LayerState::Elsewhere => None,
            })
            .unwrap_or(0)
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

    /// Return to `cp` (an edited conversation): cut every KV cache (the helper's too) back to
    /// its position and restore the DeltaNet states. Pages the cut falls into come back from the
    /// helper whole, so page boundaries, and so results, stay those of an uncut run. On error
    /// nothing here has changed. `cp` stays valid for another rewind.
    pub fn rewind(&mut self, be: &dyn Backend, cp: &Checkpoint) -> Result<()> {
        if cp.pos > self.pos
            || cp.delta.len()
                != self
                    .layers
                    .iter()
                    .filter(|l| matches!(l, LayerState::DeltaNet(_)))
                    .count()
        {
            return Err(Error::Invalid(format!(
                "cannot rewind from position {} to a checkpoint at {} of another sequence or the future",
                self.pos, cp.pos
            )));
        }
        let len = cp.pos;
        let mut refills = Vec::new();
        let mut helper_len = len;
        for (i, l) in self.layers.iter().enumerate() {
            let LayerState::Attention(kv) = l else {
                continue;
            };
            if len < kv.remote_len() {
                let start = len / kv.page_size() * kv.page_size();
                helper_len = start;
                let remote = self.remote.as_mut().ok_or_else(|| {
                    Error::Invalid(
                        "the KV pages to rewind into are on a helper that is gone".into(),
                    )
                })?;
                let rows = if len > start {
                    Some(remote.fetch(i, start, len - start)?)
                } else {
                    None
                };
                // Check the rows before anything changes, here or on the helper.
                if let Some((k, v)) = &rows {
                    if k.len() != (len - start) * kv.row_width() || v.len() != k.len() {
                        return Err(Error::Remote(format!(
                            "layer {i}: the helper returned KV rows of the wrong size"
                        )));
                    }
                }
                refills.push((i, rows));
            }
        }
        if let Some(remote) = self.remote.as_mut() {
            remote.truncate(helper_len)?;
        }
        let mut refills = refills.into_iter().peekable();
        for (i, l) in self.layers.iter_mut().enumerate() {
            if let LayerState::Attention(kv) = l {
                let refill = match refills.peek() {
                    Some((j, _)) if *j == i => refills.next().and_then(|(_, r)| r),
                    _ => None,
                };
                kv.rewind(be, len, refill)?;
            }
        }
        for (i, d) in &cp.delta {
            self.layers[*i] = LayerState::DeltaNet(d.duplicate(be));
        }
        self.pos = len;
        Ok(())
    }

    /// Move the oldest whole KV pages of every full-attention layer to the remote until at most
    /// `host_kv_tokens` positions per layer stay here (a partial page never moves); `be` reads
    /// each page to the host for the link. Returns the number of pages moved per layer.
    pub fn offload(&mut self, be: &dyn Backend) -> Result<usize> {
        let Some(host_tokens) = self.host_kv_tokens.filter(|_| !self.remote_full) else {
            return Ok(0);
        };
        let Some(remote) = self.remote.as_mut() else {
            return Err(Error::Invalid(
                "a host KV budget is set but no helper is attached".into(),
            ));
        };
        let mut moved = 0;
        'layers: for (i, layer) in self.layers.iter_mut().enumerate() {
            let LayerState::Attention(kv) = layer else {
                continue;
            };
            let mut n = 0;
            // The page leaves only once the helper has acknowledged it: a refusal of its
            // memory budget keeps it here (each layer's pages are attended by where they are,
            // so layers may hold different numbers of them on the helper).
            while kv.local_len() > host_tokens {
                let Some(page) = kv.oldest_full_page() else {
                    break;
                };
                let (k, v) = kv.rows(be, page.start, page.len)?;
                match remote.store(i, page.start, kv.row_width(), k, v) {
                    Ok(()) => {}
                    Err(Error::Refused { code, .. }) if code == "memory" => {
                        self.remote_full = true;
                        break 'layers;
                    }
                    Err(e) => return Err(e),
                }
                kv.drop_oldest_page();
                n += 1;
                moved = moved.max(n);
            }
        }
        Ok(moved)
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
        let layers = c.layer_types[runs]
            .iter()
            .filter(|&&k| k == LayerKind::LinearAttention)
            .count();
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
