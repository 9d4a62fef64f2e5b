//! Causal attention of query rows over one KV page, as `(o, m, l)` partials.
//!
//! Pages of f32 rows are read in place. Compact pages (f16, q8_0, q4_0) are widened as they are
//! read: a decode row widens one key or value row at a time into a scratch row (as llama.cpp's
//! CPU attention widens a quantised V row), so the page is read once in its compact size,
//! except q8_0 keys on x86 with AVX2, which it scores with integer dots against the query rounded to
//! q8_0 as llama.cpp does ([`q8_0_scores`]); a few rows (a speculative verify) widen a block
//! of rows at a time, each for all of them; the `gemm` form for many query rows widens the
//! page's visible rows once per page, on every thread, into a transient buffer its products
//! read.

#[cfg(not(target_arch = "wasm32"))]
use super::gemm::{product, Mat};
#[cfg(target_arch = "wasm32")]
use super::matmul::dot;
use super::matmul::{axpy, axpys, dots_task};
use crate::backend::{AttnShape, STEP_ROWS};
use crate::backend::{KvPage, Merger, PageRows, Partials};

/// Keys per task of the streamed form: a task reads whole key and value rows (every KV head),
/// one after the other, so each thread streams contiguous memory. Split per KV head instead,
/// two threads each read every other 1 KiB of the same rows and reached 7 GiB/s each, against
/// 12 GiB/s for one thread on contiguous rows (Qwen3.5-0.8B's pages, this repository's Xeon).
/// A fixed span, so that the partials never depend on the thread count.
const SPAN: usize = 512;

/// Query rows per task of the `gemm` form. A task takes every query head of one KV head for
/// these rows, so each key and value row it loads serves `ROWS * group` queries while it is in
/// L1.
const ROWS: usize = 16;

/// The partials of one task: `rows * group` queries, ordered (row, head within the group).
#[derive(Default)]
struct Block {
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

pub fn attend_page(shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials {
    assert_eq!(q.len(), q_pos.len() * shape.q_heads * shape.head_dim);
    // One query row (a decode step) is streamed: its few queries per KV head cannot repay
    // `gemm`'s copy of every key and value row into its packed layout (1.0 against 1.27 ms
    // for a 4096-position page of Qwen3.5-0.8B). From two rows on, `gemm` is faster (1.57
    // against 1.76 ms).
    // Fewer rows than `STEP_ROWS` (a speculative verify) are streamed together, each row
    // computed as its own decode step computes it.
    match q_pos {
        &[pos] => streamed(shape, q, pos, page),
        _ if q_pos.len() < STEP_ROWS => streamed_rows(shape, q, q_pos, page),
        _ => blocked(shape, q, q_pos, page),
    }
}

/// Keys at positions `page.start + from .. page.start + to` visible to a query at `pos`,
/// counted from `from`.
fn visible(page: &KvPage, from: usize, to: usize, pos: usize) -> usize {
    let seen = pos
        .saturating_add(1)
        .saturating_sub(page.start)
        .min(page.len);
    seen.clamp(from, to) - from
}

/// One query row: tasks over spans of [`SPAN`] keys, each reading a key or value row once
/// and multiplying it into every query of its KV head; the spans' partials are merged in
/// order.
fn streamed(shape: AttnShape, q: &[f32], pos: usize, page: &KvPage) -> Partials {
    let (rows, d) = (shape.q_heads, shape.head_dim);
    let spans: Vec<usize> = (0..visible(page, 0, page.len, pos)).step_by(SPAN).collect();
    if spans.is_empty() {
        return Partials::empty(rows, d);
    }
    let mut parts: Vec<Partials> = spans.iter().map(|_| Partials::empty(0, d)).collect();
    super::spread(&mut parts, 1, |i, p| {
        p[0] = span(shape, q, page, spans[i], pos)
    });
    match parts.len() {
        1 => parts.pop().expect("one span"),
        _ => {
            let mut merger = Merger::new(rows, d);
            parts.iter().for_each(|p| merger.add(p));
            merger.finish()
        }
    }
}

/// The partials of the query heads `q` of a row at `pos` over the keys of `page` from `from`
/// to the span's end or the last visible key.
fn span(shape: AttnShape, q: &[f32], page: &KvPage, from: usize, pos: usize) -> Partials {
    let AttnShape {
        q_heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let (group, row) = (q_heads / kv_heads, kv_heads * d);
    let len = visible(page, from, (from + SPAN).min(page.len), pos);
    let (mut keys, mut values) = (RowReader::new(&page.k, row), RowReader::new(&page.v, row));
    let mut p = Partials::empty(q_heads, d);
    // scores[h, j]: query head `h` against key `from + j`; KV head `kvh`'s query heads are
    // `kvh * group ..`, contiguous in `q`.
    let mut scores = vec![0.0f32; q_heads * len];
    let mut dots = vec![0.0f32; group];
    if !q8_0_scores(shape, q, &page.k, (from, len), &mut scores) {
        for j in 0..len {
            let key = keys.row(from + j);
            for (kvh, k) in key.chunks_exact(d).enumerate() {
                dots_task::<f32>(&q[kvh * group * d..][..group * d], d, k, &mut dots);
                for (i, s) in dots.iter().enumerate() {
                    scores[(kvh * group + i) * len + j] = *s;
                }
            }
        }
    }
    for (h, s) in scores.chunks_exact_mut(len).enumerate() {
        let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        s.iter_mut().for_each(|x| *x = super::exp(*x - mx));
        p.m[h] = mx;
        p.l[h] = s.iter().sum();
    }
    for j in 0..len {
        let value = values.row(from + j);
        for (h, o) in p.o.chunks_exact_mut(d).enumerate() {
            axpy(scores[h * len + j], &value[h / group * d..][..d], o);
        }
    }
    for (o, &l) in p.o.chunks_exact_mut(d).zip(&p.l) {
        let inv = 1.0 / l;
        o.iter_mut().for_each(|a| *a *= inv);
    }
    p
}

/// Several query rows (a speculative verify, fewer than `STEP_ROWS`), each row's partials bit
/// for bit those [`streamed`] gives it alone: the same spans of [`SPAN`] keys (a row has those
/// up to the last key it sees), each computed by [`span_rows`] with the row's arithmetic of
/// [`span`], and merged per row as `streamed` merges them. What changes is that a task reads
/// and widens each key and value row once for every row that sees it. One row at a time, 1 + 4
/// rows over a 4096-key f16 page of Qwen3.5-0.8B took 5.9-6.1 ms on one thread (a decode row
/// 1.2), 3.5-3.8 ms this way, and a verify pass of 1 + 4 rows at context 4096 cost 1.53-1.59
/// decode steps, 1.39-1.41 this way (Zen 4, 2 threads).
fn streamed_rows(shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials {
    let (heads, d) = (shape.q_heads, shape.head_dim);
    let spans_of = |pos: usize| visible(page, 0, page.len, pos).div_ceil(SPAN);
    let spans = q_pos.iter().map(|&pos| spans_of(pos)).max().unwrap_or(0);
    let mut parts: Vec<Vec<Partials>> = (0..spans).map(|_| Vec::new()).collect();
    super::spread(&mut parts, 1, |i, p| {
        p[0] = span_rows(shape, q, q_pos, page, i * SPAN)
    });
    let mut all = Partials::empty(0, d);
    for (r, &pos) in q_pos.iter().enumerate() {
        let mut mine = parts[..spans_of(pos)].iter_mut().map(|p| &mut p[r]);
        let p = match spans_of(pos) {
            0 => Partials::empty(heads, d),
            1 => std::mem::replace(mine.next().expect("one span"), Partials::empty(0, d)),
            _ => {
                let mut merger = Merger::new(heads, d);
                mine.for_each(|p| merger.add(p));
                merger.finish()
            }
        };
        all.o.extend(p.o);
        all.m.extend(p.m);
        all.l.extend(p.l);
    }
    all
}

/// Key rows a task of [`span_rows`] widens at a time, each KV head's then multiplied into its
/// queries of every row in one `dots_task`: the AVX-512 kernel's tiles of four keys by three
/// queries load each chunk of a key or a query once for several products, where one key a
/// call takes its one-weight-row form (three products a chunk of the key). 32 rows measured
/// the same.
const KEY_ROWS: usize = 16;

/// Value rows a task of [`span_rows`] widens at a time (16 KiB of Qwen3.5-0.8B's rows as
/// f32, in L1 while every query row's heads take them) before it adds them into the outputs
/// with [`axpys`]. 16 rows measured the same.
const VALUE_ROWS: usize = 8;

/// The partials over the keys of `page` from `from` of every query row (rows of `q_heads`
/// heads in `q`, at `q_pos`), one `Partials` a row (empty for a row that sees none of them).
/// Each row's are bit for bit [`span`]'s for that row alone:
///
/// - scores: per block of [`KEY_ROWS`] keys and KV head, one `dots_task` of those keys
///   against that head's queries of every row, whose product of each (key, query) is the one
///   `span`'s call with one key and one row's queries gives (the float kernels' products
///   depend on neither the rows of `x` nor the weight rows beside them: matmul.rs
///   `each_row_gets_its_one_row_products`, `avx512_rows_match_avx2_one_row_bits`); or
///   [`q8_0_scores`] per row, as `span` calls it;
/// - each row and head's max, `exp` and sum over its own keys, as there;
/// - values: [`axpys`] over blocks of [`VALUE_ROWS`] keys in key order, `axpy`'s operations
///   for each output element in the same order.
fn span_rows(
    shape: AttnShape,
    q: &[f32],
    q_pos: &[usize],
    page: &KvPage,
    from: usize,
) -> Vec<Partials> {
    let AttnShape {
        q_heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let (group, row, width) = (q_heads / kv_heads, kv_heads * d, q_heads * d);
    let to = (from + SPAN).min(page.len);
    let lens: Vec<usize> = q_pos
        .iter()
        .map(|&pos| visible(page, from, to, pos))
        .collect();
    let seen = lens.iter().copied().max().unwrap_or(0);
    let query = |r: usize| &q[r * width..][..width];
    // scores[r][h, j]: row `r`'s query head `h` against key `from + j`, as in `span`.
    let mut scores: Vec<Vec<f32>> = lens.iter().map(|&len| vec![0.0; q_heads * len]).collect();
    let float: Vec<usize> = (0..lens.len())
        .filter(|&r| {
            lens[r] > 0 && !q8_0_scores(shape, query(r), &page.k, (from, lens[r]), &mut scores[r])
        })
        .collect();
    if let Some(keys_seen) = float.iter().map(|&r| lens[r]).max() {
        // Per KV head, its queries of every such row: `[float.len() * group, d]`.
        let per_head = float.len() * group * d;
        let mut stacked = Vec::with_capacity(kv_heads * per_head);
        for kvh in 0..kv_heads {
            for &r in &float {
                stacked.extend_from_slice(&query(r)[kvh * group * d..][..group * d]);
            }
        }
        let nq = float.len() * group;
        let mut keys = RowReader::new(&page.k, row);
        let mut heads = vec![0.0f32; kv_heads * KEY_ROWS * d];
        let mut dots = vec![0.0f32; KEY_ROWS * nq];
        for j0 in (0..keys_seen).step_by(KEY_ROWS) {
            let n = KEY_ROWS.min(keys_seen - j0);
            let heads = &mut heads[..kv_heads * n * d];
            keys.heads_into(from + j0, n, d, heads);
            for (kvh, head) in heads.chunks_exact(n * d).enumerate() {
                let dots = &mut dots[..n * nq];
                dots_task::<f32>(&stacked[kvh * per_head..][..per_head], d, head, dots);
                // `dots` is `[n keys, nq queries]`; each query's scores are a run of keys.
                for (x, &r) in float.iter().enumerate() {
                    let len = lens[r];
                    let seen = n.min(len.saturating_sub(j0));
                    if seen == 0 {
                        continue;
                    }
                    for i in 0..group {
                        let run = &mut scores[r][(kvh * group + i) * len + j0..][..seen];
                        for (s, dots) in run.iter_mut().zip(dots.chunks_exact(nq)) {
                            *s = dots[x * group + i];
                        }
                    }
                }
            }
        }
    }
    let mut parts: Vec<Partials> = lens.iter().map(|_| Partials::empty(q_heads, d)).collect();
    for ((p, s), &len) in parts.iter_mut().zip(&mut scores).zip(&lens) {
        if len == 0 {
            continue;
        }
        for (h, s) in s.chunks_exact_mut(len).enumerate() {
            let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            s.iter_mut().for_each(|x| *x = super::exp(*x - mx));
            p.m[h] = mx;
            p.l[h] = s.iter().sum();
        }
    }
    let mut values = RowReader::new(&page.v, row);
    let mut weights = vec![0.0f32; group * VALUE_ROWS];
    for j0 in (0..seen).step_by(VALUE_ROWS) {
        let block = values.rows(from + j0, VALUE_ROWS.min(seen - j0));
        for ((p, s), &len) in parts.iter_mut().zip(&scores).zip(&lens) {
            let keys = VALUE_ROWS.min(len.saturating_sub(j0));
            if keys == 0 {
                continue;
            }
            // The query heads of each KV head: their weights of these keys, `[group, keys]`,
            // into their outputs, `[group, d]`.
            let o = p.o.chunks_exact_mut(group * d);
            for ((kvh, o), s) in o.enumerate().zip(s.chunks_exact(group * len)) {
                let weights = &mut weights[..group * keys];
                for (w, s) in weights.chunks_exact_mut(keys).zip(s.chunks_exact(len)) {
                    w.copy_from_slice(&s[j0..][..keys]);
                }
                axpys(weights, &block[kvh * d..], row, o, d);
            }
        }
    }
    for (p, &len) in parts.iter_mut().zip(&lens) {
        if len == 0 {
            continue;
        }
        for (o, &l) in p.o.chunks_exact_mut(d).zip(&p.l) {
            let inv = 1.0 / l;
            o.iter_mut().for_each(|a| *a *= inv);
        }
    }
    parts
}

/// The scores of a decode row against q8_0 keys `from .. from + len` as llama.cpp's CPU
/// attention takes them: the queries rounded to q8_0 blocks (per head, the largest magnitude
/// of each 32 becoming 127), then integer dots with the keys' blocks, the weight kernels'
/// `dots_task`. The keys are read once, in their compact size, and never widened. False
/// (nothing written) where that does not apply: other key types, no AVX2, a query that is
/// not finite. The rounding of the query is the price (docs/EXACTNESS.md); it does not depend
/// on the span, so partials never depend on the thread count.
#[cfg(target_arch = "x86_64")]
fn q8_0_scores(
    shape: AttnShape,
    q: &[f32],
    keys: &PageRows,
    (from, len): (usize, usize),
    scores: &mut [f32],
) -> bool {
    use super::quant_dots::{strided_dots_task, Isa};
    use super::quant_rows::Rows8;
    use crate::backend::KvType;
    use crate::quant::{BlockQ8_0, QK};
    let PageRows::Packed {
        ty: KvType::Q8_0,
        bytes,
    } = keys
    else {
        return false;
    };
    let (Some(isa), Ok(blocks)) = (
        Isa::best(),
        bytemuck::try_cast_slice::<u8, BlockQ8_0>(bytes),
    ) else {
        return false;
    };
    if len == 0 {
        return true;
    }
    if !shape.head_dim.is_multiple_of(QK) {
        return false;
    }
    let AttnShape {
        q_heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let (group, per_head) = (q_heads / kv_heads, d / QK);
    let queries: Option<Vec<Rows8>> = q
        .chunks_exact(group * d)
        .map(|x| Rows8::quantise(x, d, QK))
        .collect();
    let Some(queries) = queries else {
        return false;
    };
    // Per KV head, its keys every `stride` blocks: [len, group] dots, one call a head.
    let stride = kv_heads * per_head;
    let mut dots = vec![0.0f32; len * group];
    for (kvh, x) in queries.iter().enumerate() {
        let first = from * stride + kvh * per_head;
        let keys = &blocks[first..first + (len - 1) * stride + per_head];
        // SAFETY: `Isa::best` found the instructions on this CPU.
        unsafe { strided_dots_task(isa, x, keys, stride, &mut dots) };
        for (j, row) in dots.chunks_exact(group).enumerate() {
            for (i, s) in row.iter().enumerate() {
                scores[(kvh * group + i) * len + j] = *s;
            }
        }
    }
    true
}

#[cfg(not(target_arch = "x86_64"))]
fn q8_0_scores(_: AttnShape, _: &[f32], _: &PageRows, _: (usize, usize), _: &mut [f32]) -> bool {
    false
}

/// Many queries: tasks over (KV head, [`ROWS`] query rows), each two `gemm` products.
fn blocked(shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials {
    let AttnShape {
        q_heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let group = q_heads / kv_heads;
    let kv_row = kv_heads * d;
    let t = q_pos.len();
    let seen = q_pos.iter().map(|&p| visible(page, 0, page.len, p));
    let seen = seen.max().unwrap_or(0);
    let (mut k_buf, mut v_buf) = (Vec::new(), Vec::new());
    let page_keys = rows_f32(&page.k, seen, kv_row, &mut k_buf);
    let page_values = rows_f32(&page.v, seen, kv_row, &mut v_buf);
    let tasks: Vec<(usize, usize)> = (0..kv_heads)
        .flat_map(|kvh| (0..t).step_by(ROWS).map(move |r0| (kvh, r0)))
        .collect();
    // One task: every query head of KV head `kvh` for rows `r0..r0 + ROWS`.
    let one = |(kvh, r0): (usize, usize)| {
        let rows = ROWS.min(t - r0);
        let nq = rows * group;
        let off = kvh * d;
        let query = |i: usize| {
            let (row, h) = (r0 + i / group, kvh * group + i % group);
            &q[(row * q_heads + h) * d..(row * q_heads + h + 1) * d]
        };
        let n_of: Vec<usize> = (0..nq)
            .map(|i| visible(page, 0, page.len, q_pos[r0 + i / group]))
            .collect();
        let n_max = n_of.iter().copied().max().unwrap_or(0);
        let mut b = Block {
            o: vec![0.0; nq * d],
            m: vec![f32::NEG_INFINITY; nq],
            l: vec![0.0; nq],
        };
        if n_max == 0 {
            return b;
        }
        let qb: Vec<f32> = (0..nq).flat_map(query).copied().collect();
        let keys = Strided {
            data: &page_keys[off..],
            row: kv_row,
            len: n_max,
            width: d,
        };
        let values = Strided {
            data: &page_values[off..],
            ..keys
        };
        // scores[i, j] = q_i . k_j, then softmax over each query's visible keys; the
        // weights of invisible keys are zero, so P V can run over all n_max keys.
        let mut scores = vec![0.0f32; nq * n_max];
        query_keys(&qb, keys, &mut scores);
        for i in 0..nq {
            let row = &mut scores[i * n_max..(i + 1) * n_max];
            let (seen, hidden) = row.split_at_mut(n_of[i]);
            hidden.iter_mut().for_each(|x| *x = 0.0);
            if seen.is_empty() {
                continue;
            }
            let mx = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            seen.iter_mut().for_each(|x| *x = super::exp(*x - mx));
            b.m[i] = mx;
            b.l[i] = seen.iter().sum();
        }
        weights_values(&scores, values, &mut b.o);
        for i in 0..nq {
            if b.l[i] > 0.0 {
                let inv = 1.0 / b.l[i];
                b.o[i * d..(i + 1) * d].iter_mut().for_each(|a| *a *= inv);
            }
        }
        b
    };
    let mut blocks: Vec<Block> = tasks.iter().map(|_| Block::default()).collect();
    super::spread(&mut blocks, 1, |i, b| b[0] = one(tasks[i]));
    let mut p = Partials::empty(t * q_heads, d);
    for (&(kvh, r0), b) in tasks.iter().zip(&blocks) {
        for (i, ((o, m), l)) in b.o.chunks(d).zip(&b.m).zip(&b.l).enumerate() {
            let idx = (r0 + i / group) * q_heads + kvh * group + i % group;
            p.o[idx * d..(idx + 1) * d].copy_from_slice(o);
            p.m[idx] = *m;
            p.l[idx] = *l;
        }
    }
    p
}

/// A page's K or V rows as a decode row reads them: f32 rows in place, compact rows widened
/// one at a time into a scratch row.
struct RowReader<'a> {
    rows: &'a PageRows,
    width: usize,
    scratch: Vec<f32>,
}

impl<'a> RowReader<'a> {
    fn new(rows: &'a PageRows, width: usize) -> Self {
        let scratch = match rows {
            PageRows::Values(_) => Vec::new(),
            // Compact rows on the host (the CPU packs none on a device).
            _ => vec![0.0; width],
        };
        RowReader {
            rows,
            width,
            scratch,
        }
    }

    /// Row `j`'s `width` values.
    fn row(&mut self, j: usize) -> &[f32] {
        match self.rows {
            PageRows::Values(a) => &super::host(a)[j * self.width..][..self.width],
            packed => {
                packed.row_into(j, self.width, &mut self.scratch);
                &self.scratch[..self.width]
            }
        }
    }

    /// Rows `j .. j + n` as heads of `d` values, head by head: `out` is `[width / d, n, d]`.
    /// Compact rows whose heads are whole blocks (as a cache's always are) are widened head by
    /// head straight into place.
    fn heads_into(&mut self, j: usize, n: usize, d: usize, out: &mut [f32]) {
        let (width, heads) = (self.width, self.width / d);
        assert_eq!(out.len(), heads * n * d);
        let rows = match self.rows {
            PageRows::Packed { ty, bytes } if d.is_multiple_of(ty.block()) => {
                let (row_bytes, head_bytes) = (ty.row_bytes(width), ty.row_bytes(d));
                let rows = bytes[j * row_bytes..][..n * row_bytes].chunks_exact(row_bytes);
                for (i, row) in rows.enumerate() {
                    for (h, head) in row.chunks_exact(head_bytes).enumerate() {
                        ty.decode_into(head, &mut out[(h * n + i) * d..][..d]);
                    }
                }
                return;
            }
            _ => self.rows(j, n),
        };
        for (i, row) in rows.chunks_exact(width).enumerate() {
            for (h, head) in row.chunks_exact(d).enumerate() {
                out[(h * n + i) * d..][..d].copy_from_slice(head);
            }
        }
    }

    /// Rows `j .. j + n`, `width` values each, one after the other.
    fn rows(&mut self, j: usize, n: usize) -> &[f32] {
        let len = n * self.width;
        match self.rows {
            PageRows::Values(a) => &super::host(a)[j * self.width..][..len],
            packed => {
                if self.scratch.len() < len {
                    self.scratch.resize(len, 0.0);
                }
                for (i, row) in self.scratch[..len].chunks_exact_mut(self.width).enumerate() {
                    packed.row_into(j + i, self.width, row);
                }
                &self.scratch[..len]
            }
        }
    }
}

/// Rows per task when a compact page is widened for the `gemm` form.
const WIDEN_ROWS: usize = 256;

/// The first `n` rows (of `width` values) of a page's K or V as f32: in place, or widened into
/// `buf` by every thread.
fn rows_f32<'a>(rows: &'a PageRows, n: usize, width: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
    match rows {
        PageRows::Values(a) => super::host(a),
        packed => {
            buf.resize(n * width, 0.0);
            super::spread(buf, WIDEN_ROWS * width, |i, chunk| {
                for (j, row) in chunk.chunks_exact_mut(width).enumerate() {
                    packed.row_into(i * WIDEN_ROWS + j, width, row);
                }
            });
            buf
        }
    }
}

/// `len` rows of `width` values, `row` apart (one KV head of a page's keys or values).
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    row: usize,
    len: usize,
    width: usize,
}

#[cfg(not(target_arch = "wasm32"))]
impl Strided<'_> {
    /// The rows as a `[len, width]` matrix.
    fn mat(&self) -> Mat<'_> {
        Mat::rows(self.data, self.len, self.width, self.row)
    }
}

/// `scores[i, j] = q[i] . keys[j]` for `q` `[nq, width]`.
#[cfg(not(target_arch = "wasm32"))]
fn query_keys(q: &[f32], keys: Strided, scores: &mut [f32]) {
    let nq = q.len() / keys.width;
    product(
        scores,
        Mat::rows(q, nq, keys.width, keys.width),
        keys.mat().t(),
        false,
    );
}

/// `out[i] = sum_j weights[i, j] values[j]` for `weights` `[nq, len]`.
#[cfg(not(target_arch = "wasm32"))]
fn weights_values(weights: &[f32], values: Strided, out: &mut [f32]) {
    let nq = weights.len() / values.len;
    product(
        out,
        Mat::rows(weights, nq, values.len, values.len),
        values.mat(),
        false,
    );
}

/// The portable forms (wasm32 has no `gemm`): one key or value row at a time against every
/// query, so each row is read once.
#[cfg(target_arch = "wasm32")]
fn query_keys(q: &[f32], keys: Strided, scores: &mut [f32]) {
    let d = keys.width;
    for j in 0..keys.len {
        let k = &keys.data[j * keys.row..j * keys.row + d];
        for (i, qi) in q.chunks(d).enumerate() {
            scores[i * keys.len + j] = dot(qi, k);
        }
    }
}

#[cfg(target_arch = "wasm32")]
fn weights_values(weights: &[f32], values: Strided, out: &mut [f32]) {
    let d = values.width;
    for j in 0..values.len {
        let v = &values.data[j * values.row..j * values.row + d];
        for (i, o) in out.chunks_mut(d).enumerate() {
            let w = weights[i * values.len + j];
            if w != 0.0 {
                for (a, x) in o.iter_mut().zip(v) {
                    *a += w * x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::matmul::tests::values;
    use super::{attend_page, SPAN};
    use crate::backend::{AttnShape, KvType, Partials};
    use crate::backend::{KvPage, PageRows};

    /// Attention of each query row's heads over the keys it sees, in f64, of the values `k`
    /// and `v` (rows `[len, kv_heads, head_dim]` from the page's start): (o, m, l) with `o`
    /// normalised and `l` relative to the largest score `m`.
    fn reference(
        shape: AttnShape,
        q: &[f32],
        pos: usize,
        (start, len): (usize, usize),
        (k, v): (&[f32], &[f32]),
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let d = shape.head_dim;
        let row = shape.kv_heads * d;
        let seen = (pos + 1).saturating_sub(start).min(len);
        let (mut o, mut m, mut l) = (vec![0.0; shape.q_heads * d], vec![], vec![]);
        for h in 0..shape.q_heads {
            let at = h / (shape.q_heads / shape.kv_heads) * d;
            let scores: Vec<f64> = (0..seen)
                .map(|j| {
                    let key = &k[j * row + at..][..d];
                    let qh = &q[h * d..][..d];
                    key.iter().zip(qh).map(|(a, b)| *a as f64 * *b as f64).sum()
                })
                .collect();
            let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (j, wj) in w.iter().enumerate() {
                for c in 0..d {
                    o[h * d + c] += wj * v[j * row + at + c] as f64 / sum;
                }
            }
            m.push(mx);
            l.push(sum);
        }
        (o, m, l)
    }

    /// A page of `k`, `v` stored as `ty`, and the values it holds (what a kernel must attend).
    fn page_of(ty: KvType, start: usize, row: usize, k: Vec<f32>, v: Vec<f32>) -> TypedPage {
        let len = k.len() / row;
        let stored = |x: Vec<f32>| {
            let rows = PageRows::host(ty, x.clone());
            let mut held = x;
            if let PageRows::Packed { .. } = rows {
                for (j, r) in held.chunks_exact_mut(row).enumerate() {
                    rows.row_into(j, row, r);
                }
            }
            (rows, held)
        };
        let ((k, k_held), (v, v_held)) = (stored(k), stored(v));
        TypedPage {
            page: KvPage {
                start,
                len,
                k,
                v,
                frozen: None,
            },
            held: (k_held, v_held),
        }
    }

    struct TypedPage {
        page: KvPage,
        held: (Vec<f32>, Vec<f32>),
    }

    /// Within f32 rounding (and the kernels' fast exp) of sums of a thousand terms.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 3e-5 * (1.0 + b.abs())
    }

    /// Query row `r` of `got` (rows of `q_heads`) against the f64 reference at `pos`.
    fn check_row(got: &Partials, r: usize, shape: AttnShape, q: &[f32], pos: usize, p: &TypedPage) {
        let (h, d) = (shape.q_heads, shape.head_dim);
        let page = (p.page.start, p.page.len);
        let (o, m, l) = reference(shape, q, pos, page, (&p.held.0, &p.held.1));
        for i in 0..h {
            let (gm, gl) = (got.m[r * h + i] as f64, got.l[r * h + i] as f64);
            assert!(
                close(gm, m[i]),
                "m at {pos}, head {i}: {gm} against {}",
                m[i]
            );
            assert!(
                close(gl, l[i]),
                "l at {pos}, head {i}: {gl} against {}",
                l[i]
            );
        }
        for (a, b) in got.o[r * h * d..(r + 1) * h * d].iter().zip(&o) {
            assert!(close(*a as f64, *b), "o at {pos}: {a} against {b}");
        }
    }

    /// The query a decode row scores `ty`'s keys with: rounded to q8_0 blocks per head where
    /// q8_0 keys take integer dots (x86 with AVX2), else as it is.
    fn as_scored(ty: KvType, q: &[f32], d: usize) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        if ty == KvType::Q8_0 && super::super::quant_dots::Isa::best().is_some() {
            let rounded = super::super::quant_rows::Rows8::quantise(q, d, crate::quant::QK);
            return rounded.unwrap().values();
        }
        let _ = (ty, d);
        q.to_vec()
    }

    /// One query row (the streamed form, over spans of keys merged in order) against f64
    /// attention of the values each cache type holds: before the page, inside its first span,
    /// and across several spans with the last one partly visible.
    #[test]
    fn a_decode_row_matches_f64_attention_at_every_cache_type() {
        let shape = AttnShape {
            q_heads: 6,
            kv_heads: 2,
            head_dim: 64,
        };
        let (start, len) = (100, 2 * SPAN + 300);
        let row = shape.kv_heads * shape.head_dim;
        let k: Vec<f32> = values(len * row, 1).iter().map(|x| 2.0 * x).collect();
        let q = values(shape.q_heads * shape.head_dim, 3);
        for ty in KvType::ALL {
            let p = page_of(ty, start, row, k.clone(), values(len * row, 2));
            let scored = as_scored(ty, &q, shape.head_dim);
            for pos in [50, start, start + 17, start + SPAN + 200, start + len + 9] {
                let got = attend_page(shape, &q, &[pos], &p.page);
                if pos < start {
                    assert!(got.l.iter().all(|&l| l == 0.0), "no key visible at {pos}");
                    continue;
                }
                check_row(&got, 0, shape, &scored, pos, &p);
            }
        }
    }

    /// Many query rows (the `gemm` form, `STEP_ROWS` of them or more) against the same
    /// reference, at every cache type: rows before, inside and past the page.
    #[test]
    fn query_rows_match_f64_attention_at_every_cache_type() {
        let shape = AttnShape {
            q_heads: 4,
            kv_heads: 2,
            head_dim: 32,
        };
        let (start, len) = (64, 150);
        let row = shape.kv_heads * shape.head_dim;
        let positions: Vec<usize> = (0..super::STEP_ROWS + 1)
            .map(|i| [10, 64, 65, 100, 150, 213, 300][i % 7] + i / 7)
            .collect();
        let q = values(positions.len() * shape.q_heads * shape.head_dim, 4);
        let qd = shape.q_heads * shape.head_dim;
        for ty in KvType::ALL {
            let p = page_of(ty, start, row, values(len * row, 5), values(len * row, 6));
            let got = attend_page(shape, &q, &positions, &p.page);
            for (r, &pos) in positions.iter().enumerate() {
                if pos < start {
                    assert!(got.l[r * 4..(r + 1) * 4].iter().all(|&l| l == 0.0));
                    continue;
                }
                check_row(&got, r, shape, &q[r * qd..(r + 1) * qd], pos, &p);
            }
        }
    }

    /// Fewer rows than `STEP_ROWS` (a speculative verify) get, bit for bit, the partials each
    /// row gets alone as a decode step, at every cache type, on a page that starts at neither
    /// 0 nor a span's multiple: rows before, inside and past the page; consecutive rows whose
    /// keys end on either side of a span's end (the last seeing one key of the next span);
    /// `STEP_ROWS - 1` rows at the page's end; a row with an infinite query. Two shapes: four query heads a KV head (one
    /// `dots_task` over more rows of `x` than a pass of the matmul tests), and one a head with
    /// `head_dim` not a multiple of 8 (decode's one row on the AVX2 kernel, several on the
    /// AVX-512 one; a scalar tail in `axpys`; q8_0 keys scored in floats).
    #[test]
    fn a_few_rows_are_their_decode_rows() {
        let shapes = [(8, 2, 64), (8, 8, 44)].map(|(q_heads, kv_heads, head_dim)| AttnShape {
            q_heads,
            kv_heads,
            head_dim,
        });
        let (start, len) = (300, 2 * SPAN + 150);
        let at_span_end = start + SPAN - 1;
        let sets: [Vec<usize>; 4] = [
            vec![
                10,
                start,
                start + 1,
                start + 40,
                start + SPAN + 150,
                start + len + 9,
            ],
            (at_span_end - 3..at_span_end + 2).collect(),
            (at_span_end + SPAN - 2..at_span_end + SPAN + 3)
                .rev()
                .collect(),
            (start + len - 10..start + len + 5).collect(),
        ];
        for shape in shapes {
            let row = shape.kv_heads * shape.head_dim;
            let qd = shape.q_heads * shape.head_dim;
            for ty in KvType::ALL {
                let p = page_of(ty, start, row, values(len * row, 5), values(len * row, 6));
                for (set, positions) in sets.iter().enumerate() {
                    assert!(positions.len() < super::STEP_ROWS);
                    let mut q = values(positions.len() * qd, positions[0] as u64);
                    if set == 0 {
                        // A query q8_0 cannot round: that row's keys take float dots, the
                        // others' integer ones.
                        q[4 * qd + 3] = f32::INFINITY;
                    }
                    let got = attend_page(shape, &q, positions, &p.page);
                    for (r, &pos) in positions.iter().enumerate() {
                        let one = attend_page(shape, &q[r * qd..][..qd], &[pos], &p.page);
                        let h = shape.q_heads;
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        let at = format!("{ty:?} {shape:?} row {r} at {pos}");
                        assert_eq!(bits(&got.o[r * qd..][..qd]), bits(&one.o), "o: {at}");
                        assert_eq!(bits(&got.m[r * h..][..h]), bits(&one.m), "m: {at}");
                        assert_eq!(bits(&got.l[r * h..][..h]), bits(&one.l), "l: {at}");
                    }
                }
            }
        }
    }
}
