//! Per-sequence state: a paged KV cache per full-attention layer, recurrent + conv state per
//! DeltaNet layer. The KV grows with the context; the DeltaNet state has a fixed size.

use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kv::PagedKv;
use crate::remote::HelperClient;

#[derive(Clone, Debug)]
pub struct DeltaState {
    /// Recurrent state `[v_heads, dk, dv]`.
    pub s: Vec<f32>,
    /// The last `kernel - 1` conv inputs `[kernel - 1, conv_dim]`.
    pub conv: Vec<f32>,
}

#[derive(Clone, Debug)]
pub enum LayerState {
    Attention(PagedKv),
    DeltaNet(DeltaState),
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
}

impl State {
    pub fn new(c: &ModelConfig, page_size: usize) -> State {
        let layers = c
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::FullAttention => LayerState::Attention(PagedKv::new(
                    page_size,
                    c.num_key_value_heads,
                    c.head_dim,
                )),
                LayerKind::LinearAttention => LayerState::DeltaNet(DeltaState {
                    s: vec![
                        0.0;
                        c.linear_num_value_heads
                            * c.linear_key_head_dim
                            * c.linear_value_head_dim
                    ],
                    conv: vec![0.0; (c.linear_conv_kernel_dim - 1) * c.conv_dim()],
                }),
            })
            .collect();
        State {
            pos: 0,
            layers,
            remote: None,
            host_kv_tokens: None,
        }
    }

    /// Move the oldest whole KV pages of every full-attention layer to the remote until at most
    /// `host_kv_tokens` positions per layer stay here (a partial page never moves). Returns the
    /// number of pages moved per layer.
    pub fn offload(&mut self) -> Result<usize> {
        let Some(host_tokens) = self.host_kv_tokens else {
            return Ok(0);
        };
        let Some(remote) = self.remote.as_mut() else {
            return Err(Error::Invalid(
                "a host KV budget is set but no helper is attached".into(),
            ));
        };
        let mut moved = 0;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let LayerState::Attention(kv) = layer else {
                continue;
            };
            let mut n = 0;
            while kv.local_len() > host_tokens {
                let Some(page) = kv.pop_full_page() else {
                    break;
                };
                remote.store(i, &page)?;
                n += 1;
            }
            moved = moved.max(n);
        }
        Ok(moved)
    }

    pub(crate) fn check_matches(&self, c: &ModelConfig) -> Result<()> {
        let ok = self.layers.len() == c.layer_types.len()
            && self.layers.iter().zip(&c.layer_types).all(|(s, k)| {
                matches!(
                    (s, k),
                    (LayerState::Attention(_), LayerKind::FullAttention)
                        | (LayerState::DeltaNet(_), LayerKind::LinearAttention)
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
                LayerState::DeltaNet(_) => 0,
            })
            .sum()
    }
}
