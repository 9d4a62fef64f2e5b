//! The disk tier of the KV cache: every page that leaves the host for a helper is also
//! written here, so a helper lost mid-sequence costs time, never tokens. The host then attends
//! those pages from this file, in their page order and with their page boundaries, which is
//! the computation it would have run on them in memory.
//!
//! One file per sequence, append-only: a page is written once as a record (a header naming
//! the layer, the first position, the rows, the row width and the types K and V are stored
//! in, then a blake3 checksum of all of that and the rows, then K and V as the page stored
//! them: little-endian f32, or the compact types' bytes, never widened). The index of records is kept in
//! memory and the checksum is checked on every read, so a page that changed on disk is an
//! error, never a different token. A rewind forgets records; a page written again after a
//! rewind is a new record. On Unix the file is unlinked as soon as it is created, so nothing
//! is left behind even when the process is killed; elsewhere it is removed on drop.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::cache_types::{CacheTypes, Encoded, KvType};
use crate::error::{Error, Result};

/// The first bytes of every record: a file read by hand shows where records start.
const MAGIC: &[u8; 4] = b"TKVP";
/// Magic, layer (u32), start (u64), rows (u32), width (u32), K and V types (a byte each:
/// [`type_code`]), checksum (32 bytes).
const HEADER: usize = 4 + 4 + 8 + 4 + 4 + 2 + 32;

/// Where one page's record lives and what its bytes must hash to.
#[derive(Clone, Copy, Debug)]
struct Record {
    /// Offset of the record's rows (just past its header).
    rows_at: u64,
    rows: usize,
    width: usize,
    types: CacheTypes,
    checksum: [u8; 32],
}

impl Record {
    /// Bytes of K then V.
    fn body(&self) -> (usize, usize) {
        let row = |ty: KvType| self.rows * ty.row_bytes(self.width);
        (row(self.types.k), row(self.types.v))
    }
}

/// A sequence's page file. Records are found by (layer, first position).
#[derive(Debug)]
pub struct PageFile {
    path: PathBuf,
    file: Mutex<File>,
    /// Bytes written so far: where the next record goes.
    end: u64,
    records: BTreeMap<(usize, usize), Record>,
    /// The file is already gone from its directory (Unix): nothing to remove on drop.
    unlinked: bool,
}

impl PageFile {
    /// A new, empty page file in `dir` (made if missing), readable by this user only.
    pub fn create(dir: &Path) -> Result<PageFile> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let name = format!(
            "pages-{}-{}.tkv",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let mut open = OpenOptions::new();
        open.read(true).write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
        let file = open.open(&path).map_err(|e| Error::io(&path, e))?;
        let unlinked = cfg!(unix) && std::fs::remove_file(&path).is_ok();
        Ok(PageFile {
            path,
            file: Mutex::new(file),
            end: 0,
            records: BTreeMap::new(),
            unlinked,
        })
    }

    /// Append the page of `layer` starting at `start`: `k`, `v` hold its rows `[rows, width]`
    /// as the page stores them. A page already here at that place is replaced (a rewind cut
    /// it, the sequence went on).
    pub fn write(
        &mut self,
        layer: usize,
        start: usize,
        width: usize,
        (k, v): (&Encoded, &Encoded),
    ) -> Result<()> {
        let rows = match (k.rows(width), v.rows(width)) {
            (Some(a), Some(b)) if a == b => a,
            _ => {
                return Err(Error::Invalid(format!(
                    "a KV page of {} K bytes ({}) and {} V bytes ({}) is not whole rows of {width}",
                    k.bytes.len(),
                    k.ty.name(),
                    v.bytes.len(),
                    v.ty.name()
                )))
            }
        };
        let types = CacheTypes { k: k.ty, v: v.ty };
        let mut head = header(layer, start, rows, width, types);
        let mut h = blake3::Hasher::new();
        h.update(&head).update(&k.bytes).update(&v.bytes);
        let checksum = *h.finalize().as_bytes();
        head.extend_from_slice(&checksum);
        let at = self.end;
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        file.seek(SeekFrom::Start(at))
            .and_then(|_| file.write_all(&head))
            .and_then(|_| file.write_all(&k.bytes))
            .and_then(|_| file.write_all(&v.bytes))
            .map_err(|e| self.io(e))?;
        drop(file);
        self.end = at + (head.len() + k.bytes.len() + v.bytes.len()) as u64;
        self.records.insert(
            (layer, start),
            Record {
                rows_at: at + HEADER as u64,
                rows,
                width,
                types,
                checksum,
            },
        );
        Ok(())
    }

    /// The rows `(k, v)` of the page of `layer` starting at `start`, as written, checked
    /// against the checksum taken when it was written.
    pub fn read(&self, layer: usize, start: usize) -> Result<(Encoded, Encoded)> {
        let r = *self.records.get(&(layer, start)).ok_or_else(|| {
            Error::Invalid(format!(
                "the page file holds no KV page of layer {layer} at position {start}"
            ))
        })?;
        let (k_len, v_len) = r.body();
        let mut body = vec![0u8; k_len + v_len];
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        file.seek(SeekFrom::Start(r.rows_at))
            .and_then(|_| file.read_exact(&mut body))
            .map_err(|e| self.io(e))?;
        drop(file);
        let mut h = blake3::Hasher::new();
        h.update(&header(layer, start, r.rows, r.width, r.types));
        if *h.update(&body).finalize().as_bytes() != r.checksum {
            return Err(Error::Invalid(format!(
                "{}: the KV page of layer {layer} at position {start} changed on disk (checksum mismatch)",
                self.path.display()
            )));
        }
        let v = body.split_off(k_len);
        Ok((
            Encoded {
                ty: r.types.k,
                bytes: body,
            },
            Encoded {
                ty: r.types.v,
                bytes: v,
            },
        ))
    }

    /// Whether the page of `layer` starting at `start` is here.
    pub fn holds(&self, layer: usize, start: usize) -> bool {
        self.records.contains_key(&(layer, start))
    }

    /// Forget every page starting at or past `pos` (a rewind to a page boundary below it), and
    /// give back the file's tail past the last record kept, so a long-lived sequence that
    /// rewinds again and again (a server's conversation cache) does not grow its file for good.
    pub fn forget_from(&mut self, pos: usize) -> Result<()> {
        self.records.retain(|&(_, start), _| start < pos);
        let end = self
            .records
            .values()
            .map(|r| {
                let (k, v) = r.body();
                r.rows_at + (k + v) as u64
            })
            .max()
            .unwrap_or(0);
        if end < self.end {
            let file = self.file.lock().unwrap_or_else(|p| p.into_inner());
            file.set_len(end).map_err(|e| self.io(e))?;
            self.end = end;
        }
        Ok(())
    }

    /// Bytes the file holds: every record up to the last one kept.
    pub fn bytes(&self) -> u64 {
        self.end
    }

    fn io(&self, e: std::io::Error) -> Error {
        Error::io(&self.path, e)
    }
}

impl Drop for PageFile {
    fn drop(&mut self) {
        if !self.unlinked {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A record's header up to its checksum, which covers it.
fn header(layer: usize, start: usize, rows: usize, width: usize, types: CacheTypes) -> Vec<u8> {
    let mut head = Vec::with_capacity(HEADER);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&(layer as u32).to_le_bytes());
    head.extend_from_slice(&(start as u64).to_le_bytes());
    head.extend_from_slice(&(rows as u32).to_le_bytes());
    head.extend_from_slice(&(width as u32).to_le_bytes());
    head.extend_from_slice(&[type_code(types.k), type_code(types.v)]);
    head
}

/// A type's byte in a record's header, for a person reading the file: its place in
/// [`KvType::ALL`].
fn type_code(ty: KvType) -> u8 {
    KvType::ALL
        .iter()
        .position(|&t| t == ty)
        .expect("every type is in ALL") as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("tether-page-file-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn f32(x: &[f32]) -> Encoded {
        Encoded::f32(x)
    }

    #[test]
    fn pages_come_back_as_written_and_rewrites_replace() {
        let mut f = PageFile::create(&dir()).unwrap();
        let k = f32(&(0..12).map(|x| x as f32 * 0.5).collect::<Vec<_>>());
        let v = f32(&(0..12).map(|x| -(x as f32)).collect::<Vec<_>>());
        f.write(3, 0, 4, (&k, &v)).unwrap();
        f.write(3, 3, 4, (&v, &k)).unwrap();
        f.write(7, 0, 6, (&k, &v)).unwrap();
        assert_eq!(f.read(3, 0).unwrap(), (k.clone(), v.clone()));
        assert_eq!(f.read(3, 3).unwrap(), (v.clone(), k.clone()));
        assert_eq!(f.read(7, 0).unwrap(), (k.clone(), v.clone()));
        let before = f.bytes();
        f.forget_from(3).unwrap();
        assert!(f.holds(3, 0) && !f.holds(3, 3));
        assert_eq!(f.bytes(), before, "the last record, (7, 0), is kept");
        f.forget_from(0).unwrap();
        assert_eq!(f.bytes(), 0, "nothing kept, nothing held");
        f.write(3, 0, 4, (&k, &v)).unwrap();
        f.write(7, 0, 6, (&k, &v)).unwrap();
        assert!(f.read(3, 3).is_err());
        f.write(3, 3, 4, (&k, &k)).unwrap();
        assert_eq!(f.read(3, 3).unwrap(), (k.clone(), k.clone()));
        assert!(
            f.write(0, 0, 5, (&k, &v)).is_err(),
            "12 values are not rows of 5"
        );
    }

    /// Compact pages are written and read back as the bytes they are stored in, each side in
    /// its own type, and the file holds those bytes (not f32).
    #[test]
    fn compact_pages_round_trip_byte_exact() {
        let mut f = PageFile::create(&dir()).unwrap();
        let x: Vec<f32> = (0..3 * 64).map(|i| (i as f32 * 0.61).cos() * 3.0).collect();
        let mut written = 0;
        for (i, ty) in KvType::ALL.into_iter().enumerate() {
            let k = Encoded::of(ty, &x);
            let v = Encoded::of(KvType::Q4_0, &x);
            f.write(i, 0, 64, (&k, &v)).unwrap();
            written += HEADER + k.bytes.len() + v.bytes.len();
            assert_eq!(f.read(i, 0).unwrap(), (k, v), "{}", ty.name());
        }
        assert_eq!(f.bytes(), written as u64);
        let q8 = Encoded::of(KvType::Q8_0, &x);
        let e = f.write(9, 0, 48, (&q8, &q8)).unwrap_err().to_string();
        assert!(e.contains("not whole rows of 48"), "{e}");
    }

    #[test]
    fn a_page_changed_on_disk_is_an_error() {
        let mut f = PageFile::create(&dir()).unwrap();
        let k = f32(&[1.0f32; 8]);
        f.write(0, 0, 4, (&k, &k)).unwrap();
        f.write(0, 2, 4, (&k, &k)).unwrap();
        {
            let mut file = f.file.lock().unwrap();
            file.seek(SeekFrom::Start(HEADER as u64 + 5)).unwrap();
            file.write_all(&[0x40]).unwrap();
        }
        let e = f.read(0, 0).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
        assert_eq!(f.read(0, 2).unwrap().0, k, "the next record is intact");
    }

    #[cfg(unix)]
    #[test]
    fn nothing_is_left_in_the_directory() {
        let d = dir().join("left");
        let mut f = PageFile::create(&d).unwrap();
        f.write(0, 0, 1, (&f32(&[1.0]), &f32(&[2.0]))).unwrap();
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        assert_eq!(f.read(0, 0).unwrap(), (f32(&[1.0]), f32(&[2.0])));
    }
}
