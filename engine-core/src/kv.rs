//! The paged KV cache of one full-attention layer, and the exact merge of per-page attention.
//!
//! Attention over a set of keys splits into pages: each page yields, per (query row, head), the
//! normalised partial output `o`, the max score `m` and the exp-sum `l`. Partials merge without
//! loss, always in page order, so the result does not depend on where a page was computed (host,
//! helper, GPU). This file is the one place that merge is written.

/// KV rows for positions `start .. start + len`, token-major: row `j` holds
/// `[kv_heads, head_dim]` keys (values likewise).
#[derive(Clone, Debug)]
pub struct KvPage {
    pub start: usize,
    pub len: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// One layer's cache: pages of `page_size` positions, the last one possibly partial.
#[derive(Clone, Debug)]
pub struct PagedKv {
    page_size: usize,
    row: usize,
    pages: Vec<KvPage>,
    len: usize,
}

impl PagedKv {
    pub fn new(page_size: usize, kv_heads: usize, head_dim: usize) -> Self {
        assert!(page_size > 0, "page size must be positive");
        PagedKv {
            page_size,
            row: kv_heads * head_dim,
            pages: Vec::new(),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn pages(&self) -> &[KvPage] {
        &self.pages
    }

    /// Bytes held by K and V rows (not counting spare capacity).
    pub fn bytes(&self) -> usize {
        self.len * self.row * 2 * std::mem::size_of::<f32>()
    }

    /// Append rows `[t, kv_heads, head_dim]` at positions `len .. len + t`.
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        assert_eq!(k.len(), v.len());
        assert_eq!(k.len() % self.row, 0);
        let mut done = 0;
        let total = k.len() / self.row;
        while done < total {
            if self.pages.last().is_none_or(|p| p.len == self.page_size) {
                self.pages.push(KvPage {
                    start: self.len,
                    len: 0,
                    k: Vec::new(),
                    v: Vec::new(),
                });
            }
            let page = self.pages.last_mut().expect("a page was just ensured");
            let take = (self.page_size - page.len).min(total - done);
            let range = done * self.row..(done + take) * self.row;
            page.k.extend_from_slice(&k[range.clone()]);
            page.v.extend_from_slice(&v[range]);
            page.len += take;
            self.len += take;
            done += take;
        }
    }

    /// Drop every position `>= len` (rewinding a sequence).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        self.pages.retain(|p| p.start < len);
        if let Some(p) = self.pages.last_mut() {
            p.len = len - p.start;
            p.k.truncate(p.len * self.row);
            p.v.truncate(p.len * self.row);
        }
        self.len = len;
    }
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

    /// Fold `next` (the following page) into `self`:
    /// `M = max(m_a, m_b); o = (o_a l_a e^(m_a-M) + o_b l_b e^(m_b-M)) / (l_a e^(m_a-M) + l_b e^(m_b-M))`.
    pub fn merge(&mut self, next: &Partials) {
        assert_eq!(self.rows(), next.rows());
        assert_eq!(self.head_dim, next.head_dim);
        let d = self.head_dim;
        for r in 0..self.rows() {
            if next.l[r] == 0.0 {
                continue;
            }
            if self.l[r] == 0.0 {
                self.m[r] = next.m[r];
                self.l[r] = next.l[r];
                self.o[r * d..(r + 1) * d].copy_from_slice(&next.o[r * d..(r + 1) * d]);
                continue;
            }
            let m = self.m[r].max(next.m[r]);
            let a = self.l[r] * (self.m[r] - m).exp();
            let b = next.l[r] * (next.m[r] - m).exp();
            let (wa, wb) = (a / (a + b), b / (a + b));
            for (x, y) in self.o[r * d..(r + 1) * d]
                .iter_mut()
                .zip(&next.o[r * d..(r + 1) * d])
            {
                *x = *x * wa + *y * wb;
            }
            self.m[r] = m;
            self.l[r] = a + b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_spans_pages_and_truncate_rewinds() {
        let mut kv = PagedKv::new(3, 1, 2);
        let rows: Vec<f32> = (0..14).map(|x| x as f32).collect(); // 7 rows of 2
        kv.append(&rows[..4], &rows[..4]);
        kv.append(&rows[4..], &rows[4..]);
        assert_eq!(kv.len(), 7);
        let starts: Vec<(usize, usize)> = kv.pages().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(starts, vec![(0, 3), (3, 3), (6, 1)]);
        assert_eq!(kv.pages()[1].k, rows[6..12].to_vec());
        kv.truncate(4);
        let starts: Vec<(usize, usize)> = kv.pages().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(starts, vec![(0, 3), (3, 1)]);
        kv.append(&rows[8..10], &rows[8..10]);
        assert_eq!(
            kv.pages()[1].k,
            [rows[6..8].to_vec(), rows[8..10].to_vec()].concat()
        );
    }
}
