//! What attention reads and yields, in every backend: a KV page, the partials of attention
//! over one page, and their exact merge.
//!
//! Attention over a set of keys splits into pages: each page yields, per (query row, head), the
//! normalised partial output `o`, the max score `m` and the exp-sum `l`. Partials merge without
//! loss, always in page order and on the backend that runs the layer
//! ([`super::Backend::merge_partials`]), so the result does not depend on where a page was
//! computed (host or helper). [`Merger`] is that merge on the host, in f64; the GPU's
//! `attn_merge` kernel is the same formula in f32.

use super::frozen::FrozenPage;
use super::PageRows;

/// KV rows for positions `start .. start + len`, token-major: row `j` holds
/// `[kv_heads, head_dim]` keys (values likewise). f32 rows live in the backend that made
/// the page (on a GPU, buffers of a whole page's capacity written row by row; only the first
/// `len` rows mean anything); compact rows on the host ([`PageRows::Packed`]).
#[derive(Debug)]
pub struct KvPage {
    pub start: usize,
    pub len: usize,
    pub k: PageRows,
    pub v: PageRows,
    /// The same full page packed for decode (`--freeze-pages`, on a backend with a frozen
    /// page kernel): decode rows read it, everything else the rows. Dropped before the page
    /// is written again (a rewind into it).
    pub frozen: Option<FrozenPage>,
}

/// Attention partials for `rows` (query row, head) pairs: `o` `[rows, head_dim]` normalised by
/// `l`; `m` the max scaled score, `l` the sum of `exp(score - m)`. A row that saw no key has
/// `m = -inf, l = 0, o = 0`.
#[derive(Clone, Debug, PartialEq)]
pub struct Partials {
    pub head_dim: usize,
    pub o: Vec<f32>,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
}

impl Partials {
    pub fn empty(rows: usize, head_dim: usize) -> Self {
        Partials {
            head_dim,
            o: vec![0.0; rows * head_dim],
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
        }
    }

    pub fn rows(&self) -> usize {
        self.m.len()
    }
}

/// Merges page partials, in the order they are given, into one. Accumulates in f64 without
/// renormalising at every step, so the result stays within ~1e-7 of attention over all keys
/// at once even for thousands of pages:
/// `M = max m_i; o = sum o_i l_i e^(m_i-M) / sum l_i e^(m_i-M)`.
pub struct Merger {
    head_dim: usize,
    m: Vec<f32>,
    l: Vec<f64>,
    /// Unnormalised output, relative to the current `m`.
    o: Vec<f64>,
}

impl Merger {
    pub fn new(rows: usize, head_dim: usize) -> Self {
        Merger {
            head_dim,
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            o: vec![0.0; rows * head_dim],
        }
    }

    pub fn add(&mut self, p: &Partials) {
        assert_eq!(self.m.len(), p.rows());
        assert_eq!(self.head_dim, p.head_dim);
        let d = self.head_dim;
        for r in 0..self.m.len() {
            if p.l[r] == 0.0 {
                continue;
            }
            let o = &mut self.o[r * d..(r + 1) * d];
            if p.m[r] > self.m[r] {
                let rescale = (self.m[r] as f64 - p.m[r] as f64).exp();
                o.iter_mut().for_each(|x| *x *= rescale);
                self.l[r] *= rescale;
                self.m[r] = p.m[r];
            }
            let w = p.l[r] as f64 * (p.m[r] as f64 - self.m[r] as f64).exp();
            for (x, y) in o.iter_mut().zip(&p.o[r * d..(r + 1) * d]) {
                *x += w * *y as f64;
            }
            self.l[r] += w;
        }
    }

    pub fn finish(self) -> Partials {
        let d = self.head_dim;
        let mut o = vec![0.0f32; self.o.len()];
        for (r, &l) in self.l.iter().enumerate() {
            if l > 0.0 {
                for (dst, src) in o[r * d..(r + 1) * d]
                    .iter_mut()
                    .zip(&self.o[r * d..(r + 1) * d])
                {
                    *dst = (src / l) as f32;
                }
            }
        }
        Partials {
            head_dim: d,
            o,
            m: self.m,
            l: self.l.iter().map(|&l| l as f32).collect(),
        }
    }
}
