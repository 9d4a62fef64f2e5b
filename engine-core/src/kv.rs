//! The paged KV cache of one full-attention layer, and attention over it page by page.
//!
//! Every page yields its partials (see [`crate::backend::Partials`]), merged in page order on
//! the backend that runs the layer, so the result does not depend on where a page was
//! attended. Pages that left this device are attended wherever a [`PageSource`] says (a
//! host's helpers and page file: `host::placement`); this module knows nothing of links.

use std::ops::Range;
use std::sync::Arc;

use crate::backend::page_rows::{bytes_of, words_of};
use crate::backend::{Act, ActPartials, AttnShape, Backend, CacheTypes, KvPage, KvType, PageRows};
use crate::cache_types::Encoded;
use crate::error::{Error, Result};

/// One layer's cache: pages of `page_size` positions, the last one possibly partial. The
/// oldest `remote_len` positions (whole pages) may have left this device; where each of those
/// pages is now (a helper, the page file) is the host's placement's to know. Pages keep their
/// boundaries wherever they live, so their partials, merged in page order, are the same
/// computation as on the host. Keys and values are stored as `types` say: f32 rows as the
/// backend's values, compact rows packed on the backend's device where it packs them, else on
/// the host (see [`PageRows`]); rows leave this device (and come back) as they are stored
/// ([`Encoded`]).
#[derive(Debug)]
pub struct PagedKv {
    page_size: usize,
    row: usize,
    types: CacheTypes,
    /// Shared with the caches [`Self::share`] made: a page is copied before it is written
    /// while another cache holds it (only the last page is ever written).
    pages: Vec<Arc<KvPage>>,
    len: usize,
    remote_len: usize,
    head_dim: usize,
    /// Pack each page as it fills for the backend's frozen-page decode kernel
    /// ([`Backend::freeze_page`]; `--freeze-pages`).
    freeze: bool,
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
            head_dim,
            freeze: false,
        }
    }

    /// From now on, pack every page that fills for the backend's frozen-page decode kernel,
    /// where it has one: a second, fp16 copy of each full page held here, which decode reads
    /// (`--freeze-pages`, opt-in: docs/FROZEN_PAGES.md).
    pub fn freeze_full_pages(&mut self) {
        self.freeze = true;
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
    /// `len` falls inside a remote page, `refill` holds that page's rows below `len` as it
    /// stored them, fetched back so the page lives here again with its boundaries unchanged.
    pub fn rewind(
        &mut self,
        be: &dyn Backend,
        len: usize,
        refill: Option<(Encoded, Encoded)>,
    ) -> Result<()> {
        if len >= self.remote_len {
            return self.truncate(be, len);
        }
        let start = len / self.page_size * self.page_size;
        let (k, v) = refill.unwrap_or_else(|| (self.empty(self.types.k), self.empty(self.types.v)));
        let rows = self.checked_rows(&k, &v)?;
        if rows != len - start {
            return Err(Error::Invalid(format!(
                "rewinding to {len} needs the rows {start}..{len} back, got {rows}"
            )));
        }
        self.pages.clear();
        self.remote_len = start;
        self.len = start;
        self.append_encoded(be, &k, &v)
    }

    fn empty(&self, ty: KvType) -> Encoded {
        Encoded {
            ty,
            bytes: Vec::new(),
        }
    }

    /// K and V rows of positions `start .. start + len` held here, copied to the host as the
    /// pages store them (they cross the link or go to disk as they are). The read is recorded
    /// before this returns; the future waits for it (see [`Backend::read_ranges`]).
    pub fn rows(
        &self,
        be: &dyn Backend,
        start: usize,
        len: usize,
    ) -> Result<impl std::future::Future<Output = (Encoded, Encoded)>> {
        let mut read = RowsRead::default();
        read.kv(self, start, len)?;
        let read = read.start(be);
        Ok(async move {
            let mut both = read.await.into_iter();
            let k = both.next().expect("K rows were asked for");
            (k, both.next().expect("V rows were asked for"))
        })
    }

    /// The pages holding positions `start .. start + len`, each with the range of its rows
    /// among them; an error unless they are all held here.
    fn pieces(&self, start: usize, len: usize) -> Result<Vec<(&KvPage, Range<usize>)>> {
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
                (lo < hi).then(|| (&**p, lo - p.start..hi - p.start))
            })
            .collect();
        let held: usize = pieces.iter().map(|(_, r)| r.len()).sum();
        if held != len {
            return Err(Error::Invalid(format!(
                "KV rows {start}..{} fall in a gap between the pages held here",
                start + len
            )));
        }
        Ok(pieces)
    }

    /// Rows `k`, `v` in this cache's types and whole rows of it: how many.
    pub fn checked_rows(&self, k: &Encoded, v: &Encoded) -> Result<usize> {
        let rows = k.rows(self.row).filter(|_| k.ty == self.types.k);
        match (rows, v.rows(self.row).filter(|_| v.ty == self.types.v)) {
            (Some(a), Some(b)) if a == b => Ok(a),
            _ => Err(Error::Invalid(format!(
                "KV rows of K {} ({} bytes) / V {} ({} bytes) are not whole rows of {} values \
                 of this cache's {}",
                k.ty.name(),
                k.bytes.len(),
                v.ty.name(),
                v.bytes.len(),
                self.row,
                self.types
            ))),
        }
    }

    /// The oldest local page, if it is full (the next to move to the remote).
    pub fn oldest_full_page(&self) -> Option<&KvPage> {
        self.pages
            .first()
            .map(|p| &**p)
            .filter(|p| p.len == self.page_size)
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

    pub fn pages(&self) -> &[Arc<KvPage>] {
        &self.pages
    }

    /// A cache holding the same rows that evolves separately (a prefix another sequence
    /// starts from): the pages are shared until one of the two writes to one, which then
    /// gets its own copy. Only a cache whose pages are all here can be shared.
    pub fn share(&self) -> Result<PagedKv> {
        if self.remote_len > 0 {
            return Err(Error::Invalid(format!(
                "positions below {} live elsewhere: only a cache held wholly here is shared",
                self.remote_len
            )));
        }
        Ok(PagedKv {
            pages: self.pages.clone(),
            ..*self
        })
    }

    /// The last page, to write to: copied first if another cache shares it, and no longer
    /// frozen (its packed copy would not see the write).
    fn last_page_mut(&mut self, be: &dyn Backend) -> Option<&mut KvPage> {
        let last = self.pages.last_mut()?;
        if Arc::get_mut(last).is_none() {
            *last = Arc::new(copy_page(be, last));
        }
        let page = Arc::get_mut(last)?;
        page.frozen = None;
        Some(page)
    }

    /// Bytes held by K and V rows (not counting spare capacity), and by frozen pages' packed
    /// copies.
    pub fn bytes(&self) -> usize {
        let frozen: usize = self
            .pages
            .iter()
            .filter_map(|p| p.frozen.as_ref())
            .map(|f| f.bytes())
            .sum();
        self.len * self.types.position_bytes(self.row) + frozen
    }

    /// A page's empty rows of type `ty`, with room for a whole page of them: on the backend's
    /// device for f32 values and for compact rows it packs there, else on the host.
    fn new_rows(&self, be: &dyn Backend, ty: KvType) -> PageRows {
        let capacity = self.page_size * self.row;
        match ty {
            KvType::F32 => PageRows::Values(be.alloc(capacity)),
            ty if be.packs_kv(ty) => PageRows::Device {
                ty,
                words: be.alloc(ty.row_bytes(capacity).div_ceil(4)),
            },
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
        // Compact rows the device does not pack are encoded on the host: the rows of this
        // step, read once.
        let source = |x, ty| match ty == KvType::F32 || be.packs_kv(ty) {
            true => Incoming::Device(x),
            false => Incoming::Encode(be.download(x)),
        };
        let (k_in, v_in) = (source(k, self.types.k), source(v, self.types.v));
        self.append_from(be, &k_in, &v_in, k.len() / self.row);
    }

    /// Append rows that arrive as a page stores them (from a link, the page file), in this
    /// cache's types: compact rows are copied in as they are.
    pub fn append_encoded(&mut self, be: &dyn Backend, k: &Encoded, v: &Encoded) -> Result<()> {
        let rows = self.checked_rows(k, v)?;
        let (k_in, v_in) = (Incoming::stored(be, k), Incoming::stored(be, v));
        self.append_from(be, &k_in.as_ref(), &v_in.as_ref(), rows);
        Ok(())
    }

    fn append_from(&mut self, be: &dyn Backend, k: &Incoming, v: &Incoming, total: usize) {
        let mut done = 0;
        while done < total {
            if self.pages.last().is_none_or(|p| p.len == self.page_size) {
                let page = KvPage {
                    start: self.len,
                    len: 0,
                    k: self.new_rows(be, self.types.k),
                    v: self.new_rows(be, self.types.v),
                    frozen: None,
                };
                self.pages.push(Arc::new(page));
            }
            let (row, page_size, freeze, d) =
                (self.row, self.page_size, self.freeze, self.head_dim);
            let page = self.last_page_mut(be).expect("a page was just ensured");
            let take = (page_size - page.len).min(total - done);
            let rows = (page.len, done, take);
            write_rows(be, &mut page.k, row, rows, k);
            write_rows(be, &mut page.v, row, rows, v);
            page.len += take;
            if freeze && page.len == page_size {
                page.frozen = be.freeze_page(row / d, d, page);
            }
            self.len += take;
            done += take;
        }
    }

    /// Drop every position `>= len` (rewinding a sequence). Positions held remotely cannot be
    /// dropped here. Only lengths change: the next append overwrites the dropped rows in place
    /// (a page another cache shares is copied first).
    pub fn truncate(&mut self, be: &dyn Backend, len: usize) -> Result<()> {
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
        self.len = self.last_page_mut(be).map_or(0, |p| {
            p.len = p.len.min(len - p.start);
            p.start + p.len
        });
        Ok(())
    }

    /// Whether a page starting at `start` is held here.
    pub fn has_page_at(&self, start: usize) -> bool {
        self.pages.binary_search_by_key(&start, |p| p.start).is_ok()
    }

    /// Put a whole page's rows `k`, `v` (at most `page_size` rows, as the page stores them)
    /// at `start`, a page start in a gap left by [`Self::skip_to`]: a helper re-filled with a
    /// page another helper held.
    pub fn fill_gap(
        &mut self,
        be: &dyn Backend,
        start: usize,
        (k, v): (Encoded, Encoded),
    ) -> Result<()> {
        let rows = self.checked_rows(&k, &v)?;
        let at = match self.pages.binary_search_by_key(&start, |p| p.start) {
            Err(at)
                if start.is_multiple_of(self.page_size)
                    && start < self.len
                    && rows <= self.page_size =>
            {
                at
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "rows at {start} are not a page in a gap of the pages held here"
                )))
            }
        };
        // Room for a whole page: a rewind into it later makes it the last page, appended to.
        let mut page = KvPage {
            start,
            len: rows,
            k: self.new_rows(be, self.types.k),
            v: self.new_rows(be, self.types.v),
            frozen: None,
        };
        let (k_in, v_in) = (Incoming::stored(be, &k), Incoming::stored(be, &v));
        write_rows(be, &mut page.k, self.row, (0, 0, rows), &k_in.as_ref());
        write_rows(be, &mut page.v, self.row, (0, 0, rows), &v_in.as_ref());
        self.pages.insert(at, Arc::new(page));
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

/// Where rows written into a page come from.
enum Incoming<'a> {
    /// f32 values on the backend (a page of values, or rows the device packs as it writes).
    Device(&'a Act),
    /// Rows already in the page's type, in words on the device (a page packed there).
    Words(&'a Act),
    /// f32 values on the host, to encode (a compact page on the host).
    Encode(Vec<f32>),
    /// Rows already in the page's type (a compact page on the host).
    Stored(&'a [u8]),
}

/// Rows that arrived encoded, ready to write: f32 rows uploaded as values, compact rows
/// uploaded as words where the backend packs them on its device, else as they are.
enum Arrived<'a> {
    Values(Act),
    Words(Act),
    Stored(&'a [u8]),
}

impl<'a> Incoming<'a> {
    fn stored(be: &dyn Backend, x: &'a Encoded) -> Arrived<'a> {
        match x.ty {
            KvType::F32 => Arrived::Values(be.upload(x.values())),
            ty if be.packs_kv(ty) => Arrived::Words(be.upload(words_of(&x.bytes))),
            _ => Arrived::Stored(&x.bytes),
        }
    }
}

impl Arrived<'_> {
    fn as_ref(&self) -> Incoming<'_> {
        match self {
            Arrived::Values(a) => Incoming::Device(a),
            Arrived::Words(a) => Incoming::Words(a),
            Arrived::Stored(b) => Incoming::Stored(b),
        }
    }
}

/// A page's rows in buffers of its own, for a cache that writes to a page it shares.
fn copy_page(be: &dyn Backend, p: &KvPage) -> KvPage {
    let rows = |r: &PageRows| match r {
        PageRows::Values(x) => PageRows::Values(be.duplicate(x)),
        PageRows::Device { ty, words } => PageRows::Device {
            ty: *ty,
            words: be.duplicate(words),
        },
        PageRows::Packed { ty, bytes } => PageRows::Packed {
            ty: *ty,
            bytes: bytes.clone(),
        },
    };
    KvPage {
        start: p.start,
        len: p.len,
        k: rows(&p.k),
        v: rows(&p.v),
        frozen: None,
    }
}

/// Rows `from .. from + n` of `src` (`(at, from, n)`, rows of `row` values) written at row
/// `at` of a page's `dst`: by the backend for f32 values and rows it packs, encoded or copied
/// for compact ones on the host.
fn write_rows(
    be: &dyn Backend,
    dst: &mut PageRows,
    row: usize,
    (at, from, n): (usize, usize, usize),
    src: &Incoming,
) {
    match (dst, src) {
        (PageRows::Values(d), Incoming::Device(s)) => be.write(d, at * row, s, from * row, n * row),
        (PageRows::Device { ty, words }, Incoming::Device(s)) => {
            be.write_packed(*ty, words, at * row, s, from * row..(from + n) * row);
        }
        (PageRows::Device { ty, words }, Incoming::Words(s)) => {
            let w = device_row_words(*ty, row);
            be.write(words, at * w, s, from * w, n * w);
        }
        (dst @ PageRows::Packed { .. }, Incoming::Encode(x)) => {
            dst.write_packed(at, row, &x[from * row..(from + n) * row]);
        }
        (dst @ PageRows::Packed { .. }, Incoming::Stored(b)) => {
            dst.write_encoded(at, row, b, from, n)
        }
        _ => unreachable!("rows come in the page's own form (types checked by the caller)"),
    }
}

/// Words of one row of `row` values packed on a device as `ty`: whole words, so rows start
/// at word boundaries (an f16 row of an even width).
fn device_row_words(ty: KvType, row: usize) -> usize {
    let bytes = ty.row_bytes(row);
    assert!(
        bytes.is_multiple_of(4),
        "{} rows of {row} values are not whole words",
        ty.name()
    );
    bytes / 4
}

/// Rows of pages (and other values) read off a device in one go, as they are stored: f32
/// values through one [`Backend::read_ranges`] (one wait on a GPU), compact rows copied as
/// they are. For rows that leave: a link, the page file, a rewind's refill.
#[derive(Default)]
pub struct RowsRead<'a> {
    parts: Vec<(&'a Act, Range<usize>)>,
    items: Vec<ReadItem>,
}

/// One piece of a [`RowsRead`]: words of the read holding `bytes` bytes of `ty` (f32 values
/// are their own words), or rows already here.
enum ReadItem {
    Read {
        words: usize,
        ty: KvType,
        bytes: usize,
    },
    Ready(Encoded),
}

impl<'a> RowsRead<'a> {
    /// The values `range` of `x`, as one f32 piece.
    pub fn values(&mut self, x: &'a Act, range: Range<usize>) {
        let (words, bytes) = (range.len(), 4 * range.len());
        self.items.push(ReadItem::Read {
            words,
            ty: KvType::F32,
            bytes,
        });
        self.parts.push((x, range));
    }

    /// The K rows, then the V rows, of positions `start .. start + len` of `kv`, two pieces;
    /// an error unless they are all held there.
    pub fn kv(&mut self, kv: &'a PagedKv, start: usize, len: usize) -> Result<()> {
        let pieces = kv.pieces(start, len)?;
        for (side, ty) in [(0, kv.types.k), (1, kv.types.v)] {
            let of = |p: &'a KvPage| if side == 0 { &p.k } else { &p.v };
            let bytes = len * ty.row_bytes(kv.row);
            let on_host = pieces
                .first()
                .is_none_or(|(p, _)| matches!(of(p), PageRows::Packed { .. }));
            if on_host {
                let n = ty.row_bytes(kv.row);
                let bytes = pieces
                    .iter()
                    .flat_map(|(p, r)| &of(p).packed_bytes()[r.start * n..r.end * n])
                    .copied()
                    .collect();
                self.items.push(ReadItem::Ready(Encoded { ty, bytes }));
                continue;
            }
            let w = match ty {
                KvType::F32 => kv.row,
                ty => device_row_words(ty, kv.row),
            };
            self.items.push(ReadItem::Read {
                words: len * w,
                ty,
                bytes,
            });
            self.parts.extend(pieces.iter().map(|(p, r)| {
                let words = match of(p) {
                    PageRows::Values(a) | PageRows::Device { words: a, .. } => a,
                    PageRows::Packed { .. } => unreachable!("a side's pages are all alike"),
                };
                (words, r.start * w..r.end * w)
            }));
        }
        Ok(())
    }

    /// Start the read: the future gives every piece in the order asked for.
    pub fn start(self, be: &dyn Backend) -> impl std::future::Future<Output = Vec<Encoded>> {
        let read = be.read_ranges(&self.parts);
        let items = self.items;
        async move {
            let values = read.await;
            let mut at = 0;
            items
                .into_iter()
                .map(|item| match item {
                    ReadItem::Read { words, ty, bytes } => {
                        at += words;
                        Encoded {
                            ty,
                            bytes: bytes_of(&values[at - words..at], bytes),
                        }
                    }
                    ReadItem::Ready(rows) => rows,
                })
                .collect()
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
    let pages: Vec<&KvPage> = (kv.pages().iter())
        .filter(|p| p.start <= last)
        .map(|p| &**p)
        .collect();
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
            Encoded::f32(&rows[6..12])
        );
        kv.truncate(be, 4).unwrap();
        let starts: Vec<(usize, usize)> = kv.pages().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(starts, vec![(0, 3), (3, 1)]);
        kv.append(be, &part(8..10), &part(8..10));
        let (k, v) = pollster::block_on(kv.rows(be, 2, 3).unwrap());
        assert_eq!(k, Encoded::f32(&[&rows[4..8], &rows[8..10]].concat()));
        assert_eq!(k, v);
    }

    /// A shared cache holds what the original held when it was shared, whatever either writes
    /// or cuts afterwards: full pages stay shared, the page written to is copied first.
    #[test]
    fn shared_pages_are_copied_on_write() {
        let be = &CpuBackend;
        let row = 32;
        let rows: Vec<f32> = (0..9 * row).map(|x| (x as f32 * 0.29).cos()).collect();
        let part = |r: std::ops::Range<usize>| Act::Host(rows[r.start * row..r.end * row].to_vec());
        let other = |r: std::ops::Range<usize>| {
            Act::Host(
                rows[r.start * row..r.end * row]
                    .iter()
                    .map(|x| -x)
                    .collect(),
            )
        };
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let types = CacheTypes { k: ty, v: ty };
            let mut a = PagedKv::new(3, 1, row, types);
            a.append(be, &part(0..5), &part(0..5));
            let before = pollster::block_on(a.rows(be, 0, 5).unwrap());
            let mut b = a.share().unwrap();
            assert!(Arc::ptr_eq(&a.pages()[0], &b.pages()[0]));
            // Each writes into the shared partial page, and one cuts into it.
            a.append(be, &part(5..9), &part(5..9));
            b.append(be, &other(5..7), &other(5..7));
            b.truncate(be, 4).unwrap();
            b.append(be, &other(7..8), &other(7..8));
            let mut c = a.share().unwrap();
            c.truncate(be, 2).unwrap();
            assert!(
                Arc::ptr_eq(&a.pages()[0], &b.pages()[0]),
                "a full page stays shared"
            );
            assert_eq!(pollster::block_on(a.rows(be, 0, 5).unwrap()), before);
            let (a_all, b_all) = (
                pollster::block_on(a.rows(be, 0, 9).unwrap()),
                pollster::block_on(b.rows(be, 0, 5).unwrap()),
            );
            let mut alone = PagedKv::new(3, 1, row, types);
            alone.append(be, &part(0..9), &part(0..9));
            assert_eq!(a_all, pollster::block_on(alone.rows(be, 0, 9).unwrap()));
            let mut alone = PagedKv::new(3, 1, row, types);
            alone.append(be, &part(0..4), &part(0..4));
            alone.append(be, &other(7..8), &other(7..8));
            assert_eq!(b_all, pollster::block_on(alone.rows(be, 0, 5).unwrap()));
        }
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
            kv.truncate(be, 2).unwrap();
            kv.append(be, &part(4..7), &part(4..7));
            assert_eq!(kv.len(), 5);
            assert_eq!(kv.bytes(), 5 * (ty.row_bytes(row) + 2 * row));
            // What the pages hold is what `bytes` counts.
            let held: usize = (kv.pages().iter())
                .flat_map(|p| [&p.k, &p.v])
                .map(|r| match r {
                    PageRows::Packed { bytes, .. } => bytes.len(),
                    _ => unreachable!("every page is compact, on the host"),
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
            // Rows leave as the pages store them, and come back into another cache of the
            // same types byte for byte (a helper's, a rewind's refill).
            let (k, v) = pollster::block_on(kv.rows(be, 0, 5).unwrap());
            assert_eq!((k.ty, v.ty), (ty, KvType::F16));
            assert_eq!(k.bytes.len(), 5 * ty.row_bytes(row));
            let mut copy = PagedKv::new(3, 1, row, types);
            copy.append_encoded(be, &k, &v).unwrap();
            assert_eq!(
                pollster::block_on(copy.rows(be, 0, 5).unwrap()),
                (k.clone(), v)
            );
            let mut f32_cache = PagedKv::new(3, 1, row, CacheTypes::F32);
            let e = f32_cache
                .append_encoded(be, &k, &k)
                .unwrap_err()
                .to_string();
            assert!(e.contains("of this cache's K f32 / V f32"), "{e}");
            assert_eq!(f32_cache.len(), 0, "a refused append changes nothing");
        }
    }

    /// A rewind into a page that left takes its rows back as stored, and a gap is filled
    /// with a page as stored: both read back byte for byte.
    #[test]
    fn pages_come_back_as_stored() {
        let be = &CpuBackend;
        let row = 32;
        let types = CacheTypes {
            k: KvType::Q8_0,
            v: KvType::Q4_0,
        };
        let x: Vec<f32> = (0..8 * row).map(|i| (i as f32 * 0.23).sin()).collect();
        let mut kv = PagedKv::new(4, 1, row, types);
        kv.append(be, &Act::Host(x.clone()), &Act::Host(x.clone()));
        let (k, v) = pollster::block_on(kv.rows(be, 4, 2).unwrap());
        kv.drop_oldest_page();
        kv.drop_oldest_page();
        assert_eq!(kv.remote_len(), 8);
        kv.rewind(be, 6, Some((k.clone(), v.clone()))).unwrap();
        assert_eq!((kv.len(), kv.remote_len()), (6, 4));
        assert_eq!(pollster::block_on(kv.rows(be, 4, 2).unwrap()), (k, v));

        let mut gap = PagedKv::new(4, 1, row, types);
        gap.skip_to(4).unwrap();
        gap.append(
            be,
            &Act::Host(x[..row].to_vec()),
            &Act::Host(x[..row].to_vec()),
        );
        let mut page = PagedKv::new(4, 1, row, types);
        page.append(
            be,
            &Act::Host(x[..4 * row].to_vec()),
            &Act::Host(x[..4 * row].to_vec()),
        );
        let whole = pollster::block_on(page.rows(be, 0, 4).unwrap());
        gap.fill_gap(be, 0, whole.clone()).unwrap();
        assert_eq!(pollster::block_on(gap.rows(be, 0, 4).unwrap()), whole);
    }
}
