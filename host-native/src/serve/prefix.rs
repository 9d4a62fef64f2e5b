//! The prefix cache of `tether serve --parallel`: sequences forked where prompts break (a
//! chat's system prompt, the end of its previous turn) and where they end, so a request that
//! starts with a cached prefix prefills only the rest.
//!
//! A DeltaNet layer's state cannot be cut back to a position: a prefix is usable only where a
//! copy of the whole state was taken. And a prompt's prefill restarts its ubatches at its
//! breaks, so the state at a break is the same whether the prefill started from position 0
//! or from a cached prefix there: a request reuses a prefix only where it ends at one of the
//! request's own breaks (or is its whole prompt, with the logits saved), and only where the
//! request's breaks below that point are those the prefix was prefilled with (a chat's breaks
//! are its message ends, so they are, when the messages are). A hit then changes
//! no bit of the answer (see `engine_core::batch`). KV pages are shared with the sequences
//! forked from an entry, copied only where one writes (`PagedKv::share`); the DeltaNet states
//! are copies. The cache holds at most its budget of bytes (pages shared by several entries
//! counted once), evicting the entry used least recently.

use std::collections::HashSet;
use std::sync::Arc;

use engine_core::batch::Fork;
use engine_core::config::ModelConfig;
use engine_core::host::Sequence;
use engine_core::model::LayerState;
use engine_core::{Backend, Result};

pub struct PrefixCache {
    entries: Vec<Entry>,
    /// Most bytes held.
    budget: usize,
    /// Bumped on every use: an entry's `used` orders the evictions.
    clock: u64,
    bytes: usize,
    pub evicted: u64,
}

struct Entry {
    tokens: Vec<u32>,
    /// Where its prefill restarted on the way there: a request whose breaks below the same
    /// point differ would have other ubatches, and so another state, there.
    breaks: Vec<usize>,
    seq: Sequence,
    /// At a prompt's end, its last position's logits.
    logits: Option<Vec<f32>>,
    used: u64,
}

/// A sequence that holds a prompt's first `seq.state.pos` tokens.
pub struct Hit {
    pub seq: Sequence,
    /// Set when it holds the whole prompt: the logits of its last position.
    pub logits: Option<Vec<f32>>,
}

impl PrefixCache {
    pub fn new(budget: usize) -> PrefixCache {
        PrefixCache {
            entries: Vec::new(),
            budget,
            clock: 0,
            bytes: 0,
            evicted: 0,
        }
    }

    /// A fork of the longest cached prefix of `prompt` that ends at one of `breaks` or is
    /// the whole prompt with its logits, and was prefilled with the same breaks below its
    /// end; `None` when there is none.
    pub fn lookup(
        &mut self,
        c: &ModelConfig,
        be: &dyn Backend,
        prompt: &[u32],
        breaks: &[usize],
    ) -> Result<Option<Hit>> {
        let usable = |e: &&mut Entry| {
            let n = e.tokens.len();
            prompt.starts_with(&e.tokens)
                && (breaks.contains(&n) || (n == prompt.len() && e.logits.is_some()))
                && breaks.iter().take_while(|&&b| b < n).eq(&e.breaks)
        };
        let Some(e) = (self.entries.iter_mut())
            .filter(usable)
            .max_by_key(|e| e.tokens.len())
        else {
            return Ok(None);
        };
        self.clock += 1;
        e.used = self.clock;
        let whole = e.tokens.len() == prompt.len();
        Ok(Some(Hit {
            seq: e.seq.fork(c, be)?,
            logits: e.logits.clone().filter(|_| whole),
        }))
    }

    /// Keep `f` (the same prefix with the same breaks again only counts as a use: the logits
    /// of one are those of the other), then evict the least recently used entries until the
    /// cache is within its budget.
    pub fn insert(&mut self, f: Fork) {
        self.clock += 1;
        let same = |e: &&mut Entry| e.tokens == f.tokens && e.breaks == f.breaks;
        match self.entries.iter_mut().find(same) {
            Some(e) => {
                e.used = self.clock;
                if e.logits.is_none() {
                    e.logits = f.logits;
                }
            }
            None => self.entries.push(Entry {
                tokens: f.tokens,
                breaks: f.breaks,
                seq: f.seq,
                logits: f.logits,
                used: self.clock,
            }),
        }
        self.bytes = self.count_bytes();
        while self.bytes > self.budget {
            let oldest = (0..self.entries.len())
                .min_by_key(|&i| self.entries[i].used)
                .expect("a cache over its budget holds an entry");
            self.entries.swap_remove(oldest);
            self.evicted += 1;
            self.bytes = self.count_bytes();
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes the entries hold: their DeltaNet states, logits and KV pages, a page shared by
    /// several entries counted once, each at its capacity (a whole page is allocated, and
    /// copied on write, however few of its rows are used).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn count_bytes(&self) -> usize {
        let mut pages = HashSet::new();
        let mut bytes = 0;
        for e in &self.entries {
            let state = &e.seq.state;
            bytes += state.delta_bytes() + e.logits.as_ref().map_or(0, |l| l.len() * 4);
            for l in &state.layers {
                let LayerState::Attention(kv) = l else {
                    continue;
                };
                let page = kv.page_size() * kv.types().position_bytes(kv.row_width());
                for p in kv.pages() {
                    if pages.insert(Arc::as_ptr(p)) {
                        bytes += page;
                    }
                }
            }
        }
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_core::backend::Act;
    use engine_core::synth::preset;
    use engine_core::CpuBackend;

    /// A sequence that held `tokens` (positions only; `kv_rows` rows in every KV cache).
    fn fork(c: &ModelConfig, tokens: &[u32], kv_rows: usize, logits: bool) -> Fork {
        let mut seq = Sequence::new(c, 4);
        seq.state.pos = tokens.len();
        let row = c.num_key_value_heads * c.head_dim;
        for l in &mut seq.state.layers {
            if let LayerState::Attention(kv) = l {
                let rows = Act::Host(vec![0.5; kv_rows * row]);
                kv.append(&CpuBackend, &rows, &rows);
            }
        }
        Fork {
            id: 0,
            tokens: tokens.to_vec(),
            breaks: Vec::new(),
            seq,
            logits: logits.then(|| vec![0.25; c.vocab_size]),
        }
    }

    fn hit(cache: &mut PrefixCache, c: &ModelConfig, p: &[u32], b: &[usize]) -> Option<usize> {
        let h = cache.lookup(c, &CpuBackend, p, b).unwrap()?;
        assert_eq!(h.logits.is_some(), h.seq.state.pos == p.len());
        Some(h.seq.state.pos)
    }

    #[test]
    fn a_prefix_is_used_where_the_prompt_breaks_or_ends() {
        let c = preset("tiny").unwrap();
        let mut cache = PrefixCache::new(usize::MAX);
        cache.insert(fork(&c, &[1, 2, 3], 0, false));
        cache.insert(Fork {
            breaks: vec![3],
            ..fork(&c, &[1, 2, 3, 4, 5], 0, true)
        });
        // The longest prefix at one of the prompt's breaks.
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 5, 6], &[3, 5]), Some(5));
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 5, 6], &[3]), Some(3));
        // A prefix that is no break of this prompt changes its ubatches: not used.
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 5, 6], &[2]), None);
        // The whole prompt, with its logits (prefilled with the same breaks: the same ids
        // sent as a completion, with none, are not); at a break without logits, not the whole.
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 5], &[3]), Some(5));
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 5], &[]), None);
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3], &[]), None);
        assert_eq!(hit(&mut cache, &c, &[1, 2, 9, 4, 5, 6], &[3, 5]), None);
        // Prefilled with a break at 2 on the way: a prompt breaking elsewhere below 4 (or
        // not at all) would have other ubatches there.
        cache.insert(Fork {
            breaks: vec![2],
            ..fork(&c, &[1, 2, 3, 4], 0, false)
        });
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 7], &[2, 4]), Some(4));
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 7], &[3, 4]), Some(3));
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4, 7], &[4]), None);
        // The same ids prefilled without that break (a completion's): another entry, whose
        // logits never serve the prompt with the break.
        cache.insert(fork(&c, &[1, 2, 3, 4], 0, true));
        assert_eq!(cache.len(), 4);
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4], &[]), Some(4));
        assert_eq!(hit(&mut cache, &c, &[1, 2, 3, 4], &[2]), None);
    }

    #[test]
    fn the_least_recently_used_prefix_is_evicted_and_shared_pages_count_once() {
        let c = preset("tiny").unwrap();
        let one = {
            let mut cache = PrefixCache::new(usize::MAX);
            cache.insert(fork(&c, &[1], 6, false));
            cache.bytes()
        };
        let row_bytes = 2 * c.num_key_value_heads * c.head_dim * 4;
        let kv_layers = c.count_layers(
            0..c.num_hidden_layers,
            engine_core::config::LayerKind::FullAttention,
        );
        // Six rows take two pages of four, counted whole, beside the DeltaNet state.
        let delta = Sequence::new(&c, 4).state.delta_bytes();
        assert_eq!(one, delta + 8 * row_bytes * kv_layers);
        // A fork of a fork shares its pages: counted once.
        let mut cache = PrefixCache::new(usize::MAX);
        let a = fork(&c, &[1], 6, false);
        let b = Fork {
            tokens: vec![1, 2],
            seq: a.seq.fork(&c, &CpuBackend).unwrap(),
            ..fork(&c, &[], 0, false)
        };
        cache.insert(a);
        cache.insert(b);
        assert_eq!(cache.bytes(), one + delta);
        // Room for two of three: the one used least recently goes.
        let mut cache = PrefixCache::new(2 * one);
        cache.insert(fork(&c, &[1], 6, false));
        cache.insert(fork(&c, &[2], 6, false));
        assert_eq!(hit(&mut cache, &c, &[1, 5], &[1]), Some(1));
        cache.insert(fork(&c, &[3], 6, false));
        assert_eq!((cache.len(), cache.evicted), (2, 1));
        assert_eq!(hit(&mut cache, &c, &[2, 5], &[1]), None);
        assert_eq!(hit(&mut cache, &c, &[1, 5], &[1]), Some(1));
        assert_eq!(hit(&mut cache, &c, &[3, 5], &[1]), Some(1));
        assert!(cache.bytes() <= 2 * one);
    }
}
