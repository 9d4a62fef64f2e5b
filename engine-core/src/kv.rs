//! The paged KV cache of one full-attention layer, and the exact merge of per-page attention.
//!
//! Attention over a set of keys splits into pages: each page yields, per (query row, head), the
//! normalised partial output `o`, the max score `m` and the exp-sum `l`. Partials merge without
//! loss, always in page order and on the backend that runs the layer (`Backend::
//! merge_partials`), so the result does not depend on where a page was computed (host or
//! helper). [`Merger`] is that merge on the host, in f64; the GPU's `attn_merge` kernel is the
//! same formula in f32.

use std::ops::Range;

use crate::backend::{Act, ActPartials, AttnShape, Backend};
use crate::error::{Error, Result};
use crate::host::page_file::PageFile;
use crate::host::remote::{AttendRate, HelperClient};

/// KV rows for positions `start .. start + len`, token-major: row `j` holds
/// `[kv_heads, head_dim]` keys (values likewise). `k` and `v` live in the backend that made
/// the page (on a GPU, buffers of a whole page's capacity written row by row); only the first
/// `len` rows mean anything.
#[derive(Debug)]
pub struct KvPage {
    pub start: usize,
    pub len: usize,
    pub k: Act,
    pub v: Act,
}

/// One layer's cache: pages of `page_size` positions, the last one possibly partial. The
/// oldest `remote_len` positions (whole pages) may have left this device: each of those pages
/// is on one helper (by its id, see `HelperClient::id`) or only in the sequence's page file
/// (the disk tier, which also holds a copy of every helper's). Pages keep their boundaries
/// wherever they live, so their partials, merged in page order, are the same computation as
/// on the host.
///
/// A helper's pages of one layer need not be contiguous: pages spread over several helpers
/// interleave.
#[derive(Debug)]
pub struct PagedKv {
    page_size: usize,
    row: usize,
    pages: Vec<KvPage>,
    len: usize,
    remote_len: usize,
    /// Who holds each page that left, in page order: a helper's id, or `None` for the page
    /// file alone.
    holders: Vec<Option<u32>>,
}

impl PagedKv {
    pub fn new(page_size: usize, kv_heads: usize, head_dim: usize) -> Self {
        assert!(page_size > 0, "page size must be positive");
        PagedKv {
            page_size,
            row: kv_heads * head_dim,
            pages: Vec::new(),
            len: 0,
            remote_len: 0,
            holders: Vec::new(),
        }
    }

    /// Values per position: `kv_heads * head_dim`.
    pub fn row_width(&self) -> usize {
        self.row
    }

    /// Positions `0 .. remote_len()` have left this device (for the helper or the disk).
    pub fn remote_len(&self) -> usize {
        self.remote_len
    }

    /// Who holds the page that left at `start`: a helper's id, or `None` for the page file
    /// alone (and for a page that did not leave).
    pub fn holder(&self, start: usize) -> Option<u32> {
        self.holders.get(start / self.page_size).copied().flatten()
    }

    /// Starts of the pages that left and are on helper `id`, oldest first.
    pub fn pages_on(&self, id: u32) -> Vec<usize> {
        self.holders
            .iter()
            .enumerate()
            .filter(|(_, h)| **h == Some(id))
            .map(|(i, _)| i * self.page_size)
            .collect()
    }

    /// Pages that left and are on a helper (not the page file alone).
    pub fn helper_pages(&self) -> usize {
        self.holders.iter().filter(|h| h.is_some()).count()
    }

    /// Pages that left and are on helper `id`.
    pub fn count_on(&self, id: u32) -> usize {
        self.holders.iter().filter(|h| **h == Some(id)).count()
    }

    /// Positions `0 .. n` all on helper `id` (a helper that mirrors this layer holds its
    /// pages as one prefix).
    pub fn prefix_on(&self, id: u32) -> usize {
        self.holders.iter().take_while(|h| **h == Some(id)).count() * self.page_size
    }

    /// Helper `id` is gone: its pages are on the disk only.
    pub fn lose_helper(&mut self, id: u32) {
        for h in self.holders.iter_mut().filter(|h| **h == Some(id)) {
            *h = None;
        }
    }

    /// Helper `id` now also holds the page at `start` (re-filled from the page file).
    pub fn helper_took(&mut self, start: usize, id: u32) {
        if let Some(h) = self.holders.get_mut(start / self.page_size) {
            *h = Some(id);
        }
    }

    /// The start of the oldest page that left this device and is on no helper: the next to
    /// re-fill a helper with.
    pub fn next_refill(&self) -> Option<usize> {
        self.holders
            .iter()
            .position(Option::is_none)
            .map(|i| i * self.page_size)
    }

    /// Whether every page that left is on a helper (none waits in the page file alone).
    pub fn all_on_helpers(&self) -> bool {
        self.holders.iter().all(Option::is_some)
    }

    /// Positions held on this device.
    pub fn local_len(&self) -> usize {
        self.len - self.remote_len
    }

    /// Forget positions `>= len`, the remote's too (the caller truncates the remote). When
    /// `len` falls inside a remote page, `refill` holds that page's rows below `len`, fetched
    /// back so the page lives here again with its boundaries unchanged.
    pub fn rewind(
        &mut self,
        be: &dyn Backend,
        len: usize,
        refill: Option<(Vec<f32>, Vec<f32>)>,
    ) -> Result<()> {
        if len >= self.remote_len {
            return self.truncate(len);
        }
        let start = len / self.page_size * self.page_size;
        let (k, v) = refill.unwrap_or_default();
        if k.len() != (len - start) * self.row || v.len() != k.len() {
            return Err(Error::Invalid(format!(
                "rewinding to {len} needs the rows {start}..{len} back, got {} values",
                k.len()
            )));
        }
        self.pages.clear();
        self.remote_len = start;
        self.holders.truncate(start / self.page_size);
        self.len = start;
        self.append(be, &be.upload(k), &be.upload(v));
        Ok(())
    }

    /// K and V rows of positions `start .. start + len` held here, copied to the host
    /// `[len, row]` in one read (they cross the link). The read is recorded before this
    /// returns; the future waits for it (see [`Backend::read_ranges`]).
    pub fn rows(
        &self,
        be: &dyn Backend,
        start: usize,
        len: usize,
    ) -> Result<impl std::future::Future<Output = (Vec<f32>, Vec<f32>)>> {
        let read = be.read_ranges(&self.row_parts(start, len)?);
        let row = self.row;
        Ok(async move {
            let mut k = read.await;
            let v = k.split_off(len * row);
            (k, v)
        })
    }

    /// Where the K rows then the V rows of positions `start .. start + len` live, as
    /// (value, element range) pieces for [`Backend::download_ranges`]: a caller gathering
    /// many layers' rows reads them all at once.
    pub fn row_parts(&self, start: usize, len: usize) -> Result<Vec<(&Act, Range<usize>)>> {
        if start < self.remote_len || start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::Invalid(format!(
                "KV rows {start}..{} are not all held here ({}..{})",
                start.saturating_add(len),
                self.remote_len,
                self.len
            )));
        }
        let pieces: Vec<(&KvPage, Range<usize>)> = self
            .pages
            .iter()
            .filter_map(|p| {
                let lo = start.max(p.start);
                let hi = (start + len).min(p.start + p.len);
                (lo < hi).then(|| (p, (lo - p.start) * self.row..(hi - p.start) * self.row))
            })
            .collect();
        let held: usize = pieces.iter().map(|(_, r)| r.len()).sum();
        if held != len * self.row {
            return Err(Error::Invalid(format!(
                "KV rows {start}..{} fall in a gap between the pages held here",
                start + len
            )));
        }
        Ok(pieces
            .iter()
            .map(|(p, r)| (&p.k, r.clone()))
            .chain(pieces.iter().map(|(p, r)| (&p.v, r.clone())))
            .collect())
    }

    /// The oldest local page, if it is full (the next to move to the remote).
    pub fn oldest_full_page(&self) -> Option<&KvPage> {
        self.pages.first().filter(|p| p.len == self.page_size)
    }

    /// Forget the oldest local page once it is stored elsewhere: on helper `holder`, or (for
    /// `None`) in the page file alone.
    pub fn drop_oldest_page(&mut self, holder: Option<u32>) {
        let page = self.pages.remove(0);
        self.holders.push(holder);
        self.remote_len += page.len;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pages(&self) -> &[KvPage] {
        &self.pages
    }

    /// Bytes held by K and V rows (not counting spare capacity).
    pub fn bytes(&self) -> usize {
        self.len * self.row * 2 * std::mem::size_of::<f32>()
    }

    /// Append rows `[t, kv_heads, head_dim]` at positions `len .. len + t`: written into the
    /// pages where they live, a new page (room for `page_size` rows) when the last is full.
    pub fn append(&mut self, be: &dyn Backend, k: &Act, v: &Act) {
        assert_eq!(k.len(), v.len());
        assert_eq!(k.len() % self.row, 0);
        let mut done = 0;
        let total = k.len() / self.row;
        while done < total {
            if self.pages.last().is_none_or(|p| p.len == self.page_size) {
                self.pages.push(KvPage {
                    start: self.len,
                    len: 0,
                    k: be.alloc(self.page_size * self.row),
                    v: be.alloc(self.page_size * self.row),
                });
            }
            let page = self.pages.last_mut().expect("a page was just ensured");
            let take = (self.page_size - page.len).min(total - done);
            let (at, from, n) = (page.len * self.row, done * self.row, take * self.row);
            be.write(&mut page.k, at, k, from, n);
            be.write(&mut page.v, at, v, from, n);
            page.len += take;
            self.len += take;
            done += take;
        }
    }

    /// Drop every position `>= len` (rewinding a sequence). Positions held remotely cannot be
    /// dropped here. Only lengths change: the next append overwrites the dropped rows in place.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len < self.remote_len {
            return Err(Error::Invalid(format!(
                "cannot rewind to {len}: positions below {} live on the helper",
                self.remote_len
            )));
        }
        if len >= self.len {
            return Ok(());
        }
        self.pages.retain(|p| p.start < len);
        // A cut inside a gap (a helper holding some pages) ends at the last page kept, so the
        // next rows start a page at its boundary.
        self.len = self.pages.last_mut().map_or(0, |p| {
            p.len = p.len.min(len - p.start);
            p.start + p.len
        });
        Ok(())
    }

    /// Whether a page starting at `start` is held here.
    pub fn has_page_at(&self, start: usize) -> bool {
        self.pages.binary_search_by_key(&start, |p| p.start).is_ok()
    }

    /// Put a whole page's rows `k`, `v` (at most `page_size` rows) at `start`, a page start in
    /// a gap left by [`Self::skip_to`]: a helper re-filled with a page another helper held.
    pub fn fill_gap(&mut self, be: &dyn Backend, start: usize, k: &Act, v: &Act) -> Result<()> {
        let rows = k.len() / self.row;
        let at = match self.pages.binary_search_by_key(&start, |p| p.start) {
            Err(at)
                if start.is_multiple_of(self.page_size)
                    && start < self.len
                    && rows <= self.page_size
                    && k.len() == v.len() =>
            {
                at
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "rows at {start} are not a page in a gap of the pages held here"
                )))
            }
        };
        let mut page = KvPage {
            start,
            len: rows,
            k: be.alloc(self.page_size * self.row),
            v: be.alloc(self.page_size * self.row),
        };
        be.write(&mut page.k, 0, k, 0, rows * self.row);
        be.write(&mut page.v, 0, v, 0, rows * self.row);
        self.pages.insert(at, page);
        Ok(())
    }

    /// Leave positions `len .. start` out: the next rows appended start a page at `start`. For
    /// a helper that holds some of a sequence's pages (others hold the rest); `start` must be a
    /// page start and the last page held whole.
    pub fn skip_to(&mut self, start: usize) -> Result<()> {
        if start < self.len
            || !start.is_multiple_of(self.page_size)
            || !self.len.is_multiple_of(self.page_size)
        {
            return Err(Error::Invalid(format!(
                "a gap from {} to {start} is not whole pages of {}",
                self.len, self.page_size
            )));
        }
        self.len = start;
        Ok(())
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

/// Where the pages of one layer that left this device are: each on one of `helpers` (the
/// layer's cache says which, by id) or in the sequence's page file, which holds a copy of
/// every one of them.
pub struct Away<'a> {
    pub layer: usize,
    pub helpers: &'a mut [HelperClient],
    pub disk: Option<&'a PageFile>,
    /// This host's own attention speed, measured here when the backend's ops are timed on
    /// return, for the placement to compare helpers with.
    pub host_rate: Option<&'a mut AttendRate>,
}

impl Away<'_> {
    /// A layer whose pages never left this device.
    pub fn none(layer: usize) -> Self {
        Away {
            layer,
            helpers: &mut [],
            disk: None,
            host_rate: None,
        }
    }
}

/// Pages read back from the disk at once at most, in bytes of K and V: a long sequence's
/// spilled pages are read and attended a group at a time, never all in memory together (their
/// partials are kept for the merge, as those of pages in memory are).
const DISK_GROUP_BYTES: usize = 64 << 20;

/// One helper's share of an attention under way: its request and the pages it was asked for.
struct HelperShare {
    id: u32,
    req: u32,
    starts: Vec<usize>,
}

/// A page's partials, by the page's start: merged in page order whatever finished first.
type PagePartials = (usize, ActPartials);

/// Attention under way: every helper holding pages asked for their partials, the rest done
/// here. Partials merge in page order (the oldest first), wherever each page was attended.
pub struct PendingAttention {
    shape: AttnShape,
    /// (query row, head) pairs.
    rows: usize,
    layer: usize,
    page_size: usize,
    shares: Vec<HelperShare>,
    /// The scaled queries as sent and their positions, kept only when a page file can stand
    /// in for a helper that never answers.
    asked: Option<(Vec<f32>, Vec<usize>)>,
    /// Partials of the pages attended here: those read back from the disk, and this device's
    /// own.
    local: Vec<PagePartials>,
}

impl PendingAttention {
    /// Whether a helper still owes its share.
    pub fn awaits_helper(&self) -> bool {
        !self.shares.is_empty()
    }

    /// Collect the helpers' partials and merge on `be`: the attention output
    /// `[rows, head_dim]`. A helper that fails to answer (lost, or refusing) is replaced by
    /// the page file: the same pages, attended here, give the same partials.
    pub fn finish(self, be: &dyn Backend, away: Away) -> Result<Act> {
        let (rows, d) = (self.rows, self.shape.head_dim);
        let mut parts = self.local;
        for share in self.shares {
            let starts: Vec<u64> = share.starts.iter().map(|&s| s as u64).collect();
            let answer = match away.helpers.iter_mut().find(|h| h.id == share.id) {
                Some(client) => client.attend_reply(share.req, rows, d, &starts),
                None => Err(Error::Remote(
                    "a helper attending this sequence's oldest pages is gone".into(),
                )),
            };
            match (answer, away.disk, &self.asked) {
                (Ok(theirs), _, _) => parts.extend(
                    share
                        .starts
                        .into_iter()
                        .zip(theirs.into_iter().map(ActPartials::from)),
                ),
                (Err(_), Some(disk), Some((q, positions))) => parts.extend(attend_from_disk(
                    be,
                    self.shape,
                    &be.upload(q.clone()),
                    positions,
                    (disk, self.layer, self.page_size),
                    &share.starts,
                )?),
                (Err(e), _, _) => return Err(e),
            }
        }
        parts.sort_by_key(|(start, _)| *start);
        let parts = parts.into_iter().map(|(_, p)| p).collect();
        Ok(be.merge_partials(rows, d, parts))
    }
}

/// Start attention of scaled queries `[t, q_heads, head_dim]` at absolute `positions` over
/// every page of `kv` that any of them can see: the queries for the helpers' pages go out
/// first (read to the host once, then), then this device attends the pages only the disk
/// holds and its own while the helpers work. The local pages are read now, so rows appended
/// before [`PendingAttention::finish`] (a later ubatch's) are not seen.
pub fn begin_attention(
    be: &dyn Backend,
    shape: AttnShape,
    q: &Act,
    positions: &[usize],
    kv: &PagedKv,
    away: Away,
) -> Result<PendingAttention> {
    let last = positions.iter().copied().max().unwrap_or(0);
    let mut sent: Option<Vec<f32>> = None;
    let mut shares = Vec::new();
    for client in away.helpers.iter_mut().filter(|c| !c.is_lost()) {
        let starts = kv.pages_on(client.id);
        let Some(&newest) = starts.last() else {
            continue;
        };
        let q_host = sent.get_or_insert_with(|| be.download(q)).clone();
        // The helper attends every page it holds below `end`: exactly these.
        let end = newest + kv.page_size;
        match client.attend_send(away.layer, shape, q_host, positions, end, starts.len()) {
            Ok(req) => shares.push(HelperShare {
                id: client.id,
                req,
                starts,
            }),
            // The disk holds the same pages; without it the error stands.
            Err(_) if away.disk.is_some() => {}
            Err(e) => return Err(e),
        }
    }
    let on_helpers: std::collections::BTreeSet<usize> =
        shares.iter().flat_map(|s| s.starts.clone()).collect();
    let from_disk: Vec<usize> = (0..kv.remote_len)
        .step_by(kv.page_size)
        .filter(|s| !on_helpers.contains(s))
        .collect();
    let mut local = Vec::new();
    if !from_disk.is_empty() {
        let disk = away.disk.ok_or_else(|| {
            Error::Remote(
                "this sequence's oldest KV pages were on a helper that is gone, and no page \
                 file holds them"
                    .into(),
            )
        })?;
        local = attend_from_disk(
            be,
            shape,
            q,
            positions,
            (disk, away.layer, kv.page_size),
            &from_disk,
        )?;
    }
    let pages: Vec<&KvPage> = kv.pages().iter().filter(|p| p.start <= last).collect();
    let began = web_time::Instant::now();
    let own = be.attend_pages(shape, q, positions, &pages);
    if let Some(rate) = away
        .host_rate
        .filter(|_| be.timed_on_return() && !shares.is_empty())
    {
        rate.add(pages.len(), began.elapsed());
    }
    local.extend(pages.iter().map(|p| p.start).zip(own));
    let asked = (away.disk.is_some() && !shares.is_empty())
        .then(|| (sent.unwrap_or_default(), positions.to_vec()));
    Ok(PendingAttention {
        shape,
        rows: positions.len() * shape.q_heads,
        layer: away.layer,
        page_size: kv.page_size,
        shares,
        asked,
        local,
    })
}

/// One partial per page of `layer` at `starts` (whole pages of `page_size`), read back from
/// the page file a group at a time and attended on `be` exactly as pages held in memory are.
fn attend_from_disk(
    be: &dyn Backend,
    shape: AttnShape,
    q: &Act,
    positions: &[usize],
    (disk, layer, page_size): (&PageFile, usize, usize),
    starts: &[usize],
) -> Result<Vec<PagePartials>> {
    let page_bytes = page_size * shape.kv_heads * shape.head_dim * 2 * 4;
    let per_group = (DISK_GROUP_BYTES / page_bytes.max(1)).max(1);
    let mut parts = Vec::with_capacity(starts.len());
    for group in starts.chunks(per_group) {
        let pages = group
            .iter()
            .map(|&start| {
                let (k, v) = disk.read(layer, start)?;
                let len = k.len() / (shape.kv_heads * shape.head_dim).max(1);
                if len != page_size {
                    return Err(Error::Invalid(format!(
                        "the page file's page of layer {layer} at {start} holds {len} rows, not {page_size}"
                    )));
                }
                Ok(KvPage {
                    start,
                    len,
                    k: be.upload(k),
                    v: be.upload(v),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&KvPage> = pages.iter().collect();
        let got = be.attend_pages(shape, q, positions, &refs);
        parts.extend(group.iter().copied().zip(got));
    }
    Ok(parts)
}

/// Host copies of `parts` (a helper's answer, which crosses the link) in one read, laid out
/// as the link carries them: every part's `o`, then every `m`, then every `l`.
pub async fn download_partials(
    be: &dyn Backend,
    parts: &[ActPartials],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let ranges: Vec<(&Act, Range<usize>)> = [0, 1, 2]
        .iter()
        .flat_map(|&i| parts.iter().map(move |p| [&p.o, &p.m, &p.l][i]))
        .map(|a| (a, 0..a.len()))
        .collect();
    let read = be.read_ranges(&ranges);
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    let mut o = read.await;
    let mut m = o.split_off(o.len() - 2 * rows);
    let l = m.split_off(rows);
    (o, m, l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;

    #[test]
    fn append_spans_pages_and_truncate_rewinds() {
        let be = &CpuBackend;
        let mut kv = PagedKv::new(3, 1, 2);
        let rows: Vec<f32> = (0..14).map(|x| x as f32).collect(); // 7 rows of 2
        let part = |r: std::ops::Range<usize>| Act::Host(rows[r].to_vec());
        kv.append(be, &part(0..4), &part(0..4));
        kv.append(be, &part(4..14), &part(4..14));
        assert_eq!(kv.len(), 7);
        let starts: Vec<(usize, usize)> = kv.pages().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(starts, vec![(0, 3), (3, 3), (6, 1)]);
        assert_eq!(
            pollster::block_on(kv.rows(be, 3, 3).unwrap()).0,
            rows[6..12].to_vec()
        );
        kv.truncate(4).unwrap();
        let starts: Vec<(usize, usize)> = kv.pages().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(starts, vec![(0, 3), (3, 1)]);
        kv.append(be, &part(8..10), &part(8..10));
        let (k, v) = pollster::block_on(kv.rows(be, 2, 3).unwrap());
        assert_eq!(k, [rows[4..8].to_vec(), rows[8..10].to_vec()].concat());
        assert_eq!(k, v);
    }
}
