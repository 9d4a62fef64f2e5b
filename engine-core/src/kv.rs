//! The paged KV cache of one full-attention layer, and attention over it page by page.
//!
//! Every page yields its partials (see [`crate::backend::Partials`]), merged in page order on
//! the backend that runs the layer, so the result does not depend on where a page was
//! attended. Pages that left this device are attended wherever a [`PageSource`] says (a
//! host's helpers and page file: `host::placement`); this module knows nothing of links.

use std::ops::Range;

use crate::backend::{Act, ActPartials, AttnShape, Backend, CacheTypes, KvPage, KvType, PageRows};
use crate::error::{Error, Result};

/// One layer's cache: pages of `page_size` positions, the last one possibly partial. The
/// oldest `remote_len` positions (whole pages) may have left this device; where each of those
/// pages is now (a helper, the page file) is the host's placement's to know. Pages keep their
/// boundaries wherever they live, so their partials, merged in page order, are the same
/// computation as on the host. Keys and values are stored as `types` say: f32 rows where the
/// backend keeps values, compact rows on the host (see [`PageRows`]); only f32 pages leave
/// this device so far.
#[derive(Debug)]
pub struct PagedKv {
    page_size: usize,
    row: usize,
    types: CacheTypes,
    pages: Vec<KvPage>,
    len: usize,
    remote_len: usize,
}

impl PagedKv {
    /// A cache of rows of `kv_heads * head_dim` values, stored as `types` (the caller has
    /// checked [`CacheTypes::check_head`]).
    pub fn new(page_size: usize, kv_heads: usize, head_dim: usize, types: CacheTypes) -> Self {
        assert!(page_size > 0, "page size must be positive");
        assert!(
            types.check_head(head_dim).is_ok(),
            "{types} cannot hold heads of {head_dim}"
        );
        PagedKv {
            page_size,
            row: kv_heads * head_dim,
            types,
            pages: Vec::new(),
            len: 0,
            remote_len: 0,
        }
    }

    /// Values per position: `kv_heads * head_dim`.
    pub fn row_width(&self) -> usize {
        self.row
    }

    /// How keys and values are stored.
    pub fn types(&self) -> CacheTypes {
        self.types
    }

    /// Positions `0 .. remote_len()` have left this device (for the helper or the disk).
    pub fn remote_len(&self) -> usize {
        self.remote_len
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
        self.check_values_leave()?;
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
            .map(|(rows, r)| (rows.values().expect("f32 pages (checked above)"), r))
            .collect())
    }

    /// Pages leave this device (for a helper, the page file, a rewind's refill) as f32 rows
    /// only, so far: compact pages stay here.
    fn check_values_leave(&self) -> Result<()> {
        if self.types.is_f32() {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "KV pages stored as {} cannot leave this device yet (helpers and the page file \
             hold f32 pages): use --cache-type-k f32 --cache-type-v f32",
            self.types
        )))
    }

    /// The oldest local page, if it is full (the next to move to the remote).
    pub fn oldest_full_page(&self) -> Option<&KvPage> {
        self.pages.first().filter(|p| p.len == self.page_size)
    }

    /// Forget the oldest local page once it is stored elsewhere (the caller records where).
    pub fn drop_oldest_page(&mut self) {
        let page = self.pages.remove(0);
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
        self.len * self.types.position_bytes(self.row)
    }

    /// A page's empty rows of type `ty`, with room for a whole page of them.
    fn new_rows(&self, be: &dyn Backend, ty: KvType) -> PageRows {
        match ty {
            KvType::F32 => PageRows::Values(be.alloc(self.page_size * self.row)),
            ty => PageRows::Packed {
                ty,
                bytes: Vec::with_capacity(self.page_size * ty.row_bytes(self.row)),
            },
        }
    }

    /// Append rows `[t, kv_heads, head_dim]` at positions `len .. len + t`: written into the
    /// pages where they live, a new page (room for `page_size` rows) when the last is full.
    pub fn append(&mut self, be: &dyn Backend, k: &Act, v: &Act) {
        assert_eq!(k.len(), v.len());
        assert_eq!(k.len() % self.row, 0);
        // Compact rows are encoded on the host: the rows of this step, read once.
        let host = |x: &Act, ty: KvType| (ty != KvType::F32).then(|| be.download(x));
        let (k_host, v_host) = (host(k, self.types.k), host(v, self.types.v));
        let mut done = 0;
        let total = k.len() / self.row;
        while done < total {
            if self.pages.last().is_none_or(|p| p.len == self.page_size) {
                let page = KvPage {
                    start: self.len,
                    len: 0,
                    k: self.new_rows(be, self.types.k),
                    v: self.new_rows(be, self.types.v),
                };
                self.pages.push(page);
            }
            let row = self.row;
            let page = self.pages.last_mut().expect("a page was just ensured");
            let take = (self.page_size - page.len).min(total - done);
            let rows = (page.len, done, take);
            write_rows(be, &mut page.k, row, rows, k, k_host.as_deref());
            write_rows(be, &mut page.v, row, rows, v, v_host.as_deref());
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
        self.check_values_leave()?;
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
            k: self.new_rows(be, KvType::F32),
            v: self.new_rows(be, KvType::F32),
        };
        write_rows(be, &mut page.k, self.row, (0, 0, rows), k, None);
        write_rows(be, &mut page.v, self.row, (0, 0, rows), v, None);
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

/// Rows `from .. from + n` of `src` (`(at, from, n)`, rows of `row` values) written at row
/// `at` of a page's `dst`: by the backend for f32 values, encoded from `host` (the same rows
/// on the host) for compact ones.
fn write_rows(
    be: &dyn Backend,
    dst: &mut PageRows,
    row: usize,
    (at, from, n): (usize, usize, usize),
    src: &Act,
    host: Option<&[f32]>,
) {
    match dst {
        PageRows::Values(d) => be.write(d, at * row, src, from * row, n * row),
        PageRows::Packed { .. } => {
            let host = host.expect("compact rows are encoded from host values");
            dst.write_packed(at, row, &host[from * row..(from + n) * row]);
        }
    }
}

/// Where the pages of a layer that left this device are attended: a host's helpers and page
/// file (`host::placement`). Attention asks for them first, attends this device's own pages
/// while they are under way, and collects them before the merge.
pub trait PageSource {
    /// Begin attention of scaled queries `q` `[t, q_heads, head_dim]` at `positions` over the
    /// pages of `layer` that left this device: `left` is (positions `0 .. n` left, in whole
    /// pages of this many). Returns the partials of pages attended at once, by page start, and a
    /// ticket for [`PageSource::finish`] if some are still under way.
    fn begin(
        &mut self,
        be: &dyn Backend,
        layer: usize,
        shape: AttnShape,
        q: &Act,
        positions: &[usize],
        left: (usize, usize),
    ) -> Result<(Vec<PagePartials>, Option<u64>)>;

    /// The partials of the pages under way for `ticket`, by page start.
    fn finish(&mut self, be: &dyn Backend, ticket: u64) -> Result<Vec<PagePartials>>;

    /// This device attended `pages` of its own in `took` while pages were under way
    /// elsewhere: its speed, for the placement to compare helpers with.
    fn attended_here(&mut self, pages: usize, took: std::time::Duration);
}

/// The source of a sequence whose pages never left this device.
pub struct NoPagesAway;

impl PageSource for NoPagesAway {
    fn begin(
        &mut self,
        _: &dyn Backend,
        layer: usize,
        _: AttnShape,
        _: &Act,
        _: &[usize],
        (left, _): (usize, usize),
    ) -> Result<(Vec<PagePartials>, Option<u64>)> {
        match left {
            0 => Ok((Vec::new(), None)),
            _ => Err(Error::Invalid(format!(
                "layer {layer}: positions below {left} left this device, and nothing says where"
            ))),
        }
    }

    fn finish(&mut self, _: &dyn Backend, ticket: u64) -> Result<Vec<PagePartials>> {
        Err(Error::Invalid(format!(
            "no attention {ticket} is under way"
        )))
    }

    fn attended_here(&mut self, _: usize, _: std::time::Duration) {}
}

/// A page's partials, by the page's start: merged in page order whatever finished first.
pub type PagePartials = (usize, ActPartials);

/// Attention under way: the pages that left asked of their [`PageSource`], this device's own
/// attended. Partials merge in page order (the oldest first), wherever each page was attended.
pub struct PendingAttention {
    shape: AttnShape,
    /// (query row, head) pairs.
    rows: usize,
    /// The source's pages still under way.
    away: Option<u64>,
    /// Partials of the pages attended so far.
    done: Vec<PagePartials>,
}

impl PendingAttention {
    /// Whether pages are still under way elsewhere.
    pub fn awaits_helper(&self) -> bool {
        self.away.is_some()
    }

    /// Collect the pages under way from `source` and merge on `be`: the attention output
    /// `[rows, head_dim]`.
    pub fn finish(self, be: &dyn Backend, source: &mut dyn PageSource) -> Result<Act> {
        let mut parts = self.done;
        if let Some(ticket) = self.away {
            parts.extend(source.finish(be, ticket)?);
        }
        parts.sort_by_key(|(start, _)| *start);
        let parts = parts.into_iter().map(|(_, p)| p).collect();
        Ok(be.merge_partials(self.rows, self.shape.head_dim, parts))
    }
}

/// Start attention of scaled queries `[t, q_heads, head_dim]` at absolute `positions` over
/// every page of `kv` that any of them can see: the pages that left first (asked of `source`,
/// which may attend some here, such as the page file's), then this device's own while the
/// rest are under way. The local pages are read now, so rows appended before
/// [`PendingAttention::finish`] (a later ubatch's) are not seen.
pub fn begin_attention(
    be: &dyn Backend,
    shape: AttnShape,
    q: &Act,
    positions: &[usize],
    (layer, kv): (usize, &PagedKv),
    source: &mut dyn PageSource,
) -> Result<PendingAttention> {
    let last = positions.iter().copied().max().unwrap_or(0);
    let (mut done, away) = source.begin(
        be,
        layer,
        shape,
        q,
        positions,
        (kv.remote_len, kv.page_size),
    )?;
    let pages: Vec<&KvPage> = kv.pages().iter().filter(|p| p.start <= last).collect();
    let began = web_time::Instant::now();
    let own = be.attend_pages(shape, q, positions, &pages);
    if be.timed_on_return() && away.is_some() {
        source.attended_here(pages.len(), began.elapsed());
    }
    done.extend(pages.iter().map(|p| p.start).zip(own));
    Ok(PendingAttention {
        shape,
        rows: positions.len() * shape.q_heads,
        away,
        done,
    })
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
        let mut kv = PagedKv::new(3, 1, 2, CacheTypes::F32);
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

    /// Compact pages take rows across page boundaries and rewinds as f32 pages do: each row
    /// holds the encoding of the row last written at its position.
    #[test]
    fn compact_pages_append_and_rewind_in_place() {
        let be = &CpuBackend;
        let row = 32;
        let rows: Vec<f32> = (0..7 * row).map(|x| (x as f32 * 0.37).sin()).collect();
        let part = |r: std::ops::Range<usize>| Act::Host(rows[r.start * row..r.end * row].to_vec());
        for ty in [KvType::F16, KvType::Q8_0, KvType::Q4_0] {
            let types = CacheTypes {
                k: ty,
                v: KvType::F16,
            };
            let mut kv = PagedKv::new(3, 1, row, types);
            kv.append(be, &part(0..4), &part(0..4));
            kv.truncate(2).unwrap();
            kv.append(be, &part(4..7), &part(4..7));
            assert_eq!(kv.len(), 5);
            assert_eq!(kv.bytes(), 5 * (ty.row_bytes(row) + 2 * row));
            // What the pages hold is what `bytes` counts.
            let held: usize = (kv.pages().iter())
                .flat_map(|p| [&p.k, &p.v])
                .map(|r| match r {
                    PageRows::Packed { bytes, .. } => bytes.len(),
                    PageRows::Values(_) => unreachable!("every page is compact"),
                })
                .sum();
            assert_eq!(held, kv.bytes());
            // Positions 0, 1 hold rows 0, 1; positions 2, 3, 4 hold rows 4, 5, 6.
            let want = [0, 1, 4, 5, 6];
            for (pos, &r) in want.iter().enumerate() {
                let page = &kv.pages()[pos / 3];
                let mut got = vec![0.0f32; row];
                page.k.row_into(pos % 3, row, &mut got);
                let mut expect = vec![0.0f32; row];
                PageRows::packed(ty, &rows[r * row..(r + 1) * row]).row_into(0, row, &mut expect);
                assert_eq!(got, expect, "{} at {pos}", ty.name());
            }
            let e = kv.row_parts(0, 3).unwrap_err().to_string();
            assert!(e.contains("cannot leave this device"), "{e}");
        }
    }
}
