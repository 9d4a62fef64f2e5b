//! The GGUF container (llama.cpp's model file): a header, typed metadata, tensor descriptions,
//! then aligned tensor data. This reads versions 2 and 3, little-endian, from a byte buffer
//! (a memory-mapped file), checking every count and offset against the bytes that are there
//! before allocating or slicing: a file is untrusted input.
//!
//! Written here rather than taken from a crate: `ggus` 0.5.1 (the maintained reader checked
//! with `cargo info`) sizes its maps by the header's counts before reading them and slices
//! data by unchecked sums, so a crafted header could abort the process.
//! `tests/fuzz_gguf.rs` throws random and mutated files at this parser.

pub mod quantize;
pub mod qwen35;
pub mod vocab;

use std::collections::BTreeMap;
use std::ops::Range;

use crate::tensor::DType;

const MAGIC: &[u8; 4] = b"GGUF";

/// `general.alignment` when a file does not set it.
const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml's most dimensions for a tensor.
const MAX_DIMS: u32 = 4;

/// Nesting of metadata arrays (llama.cpp writes none deeper than 1).
const MAX_DEPTH: u32 = 2;

/// Most array elements in a file's metadata, all arrays together: a [`Value`] takes 32 bytes
/// however few the file spends on it, so this count bounds memory (1 GiB) where the file's
/// length would not. Real files' largest arrays are vocabularies and merge lists of well under
/// a million each.
const MAX_ARRAY_ITEMS: usize = 1 << 25;

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct GgufError(pub String);

fn bad(msg: impl Into<String>) -> GgufError {
    GgufError(msg.into())
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// An integer value of any width, if it is one and is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's description.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape, outermost first (GGUF lists `ne[0]`, the contiguous one, first: this is
    /// that list reversed, as safetensors and torch write shapes).
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Its bytes within the whole buffer.
    pub range: Range<usize>,
}

/// A parsed file: its metadata and tensor descriptions (the data stays in the buffer).
#[derive(Debug)]
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
}

impl Gguf {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// Whether `bytes` starts like a GGUF file.
    pub fn sniff(bytes: &[u8]) -> bool {
        bytes.starts_with(MAGIC)
    }

    pub fn parse(bytes: &[u8]) -> Result<Gguf, GgufError> {
        let mut r = Reader {
            bytes,
            at: 0,
            items: 0,
        };
        if r.take(4)? != MAGIC {
            return Err(bad("not a GGUF file (no GGUF magic)"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(bad(format!(
                "GGUF version {version}: tether reads versions 2 and 3"
            )));
        }
        let tensor_count = r.u64()?;
        let kv_count = r.u64()?;
        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = r
                .string()
                .map_err(|e| bad(format!("metadata key {i}: {e}")))?;
            let ty = r.u32()?;
            let value = r
                .value(ty, 0)
                .map_err(|e| bad(format!("metadata `{key}`: {e}")))?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(bad(format!("metadata key `{key}` appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| bad(format!("general.alignment {v:?} is not a power of two")))?,
        };
        let mut infos = Vec::new();
        for i in 0..tensor_count {
            infos.push(
                r.tensor_info()
                    .map_err(|e| bad(format!("tensor {i}: {e}")))?,
            );
        }
        let data_start = (r.at as u64)
            .checked_next_multiple_of(alignment)
            .filter(|&s| s <= bytes.len() as u64 || infos.is_empty())
            .ok_or_else(|| bad("the file ends before its tensor data (truncated?)"))?;
        let data_len = (bytes.len() as u64).saturating_sub(data_start);
        let mut tensors = Vec::with_capacity(infos.len());
        let mut names = std::collections::HashSet::new();
        for (name, dims, dtype, offset) in infos {
            if !names.insert(name.clone()) {
                return Err(bad(format!("tensor `{name}` appears twice")));
            }
            let (block, block_bytes) = dtype.block();
            let (block, block_bytes) = (block as u64, block_bytes as u64);
            let elems = dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .ok_or_else(|| bad(format!("tensor `{name}`: shape {dims:?} overflows")))?;
            if dims.first().is_some_and(|&d| d % block != 0) {
                return Err(bad(format!(
                    "tensor `{name}`: rows of {} {} values are not whole blocks of {block}",
                    dims[0],
                    dtype.name()
                )));
            }
            let nbytes = (elems / block).checked_mul(block_bytes);
            let end = nbytes.and_then(|n| offset.checked_add(n));
            let Some(end) = end.filter(|&e| e <= data_len) else {
                return Err(bad(format!(
                    "tensor `{name}` ({} {:?}) at offset {offset} ends past the file's {data_len} \
                     bytes of data (truncated file?)",
                    dtype.name(),
                    dims
                )));
            };
            if offset % alignment != 0 {
                return Err(bad(format!(
                    "tensor `{name}` at offset {offset} is not aligned to {alignment}"
                )));
            }
            let shape = dims
                .iter()
                .rev()
                .map(|&d| usize::try_from(d).map_err(|_| bad("dimension too large")))
                .collect::<Result<Vec<usize>, GgufError>>()?;
            // Both ends are within the buffer, whose length is a usize.
            let range = (data_start + offset) as usize..(data_start + end) as usize;
            tensors.push(TensorInfo {
                name,
                shape,
                dtype,
                range,
            });
        }
        Ok(Gguf {
            version,
            metadata,
            tensors,
        })
    }
}

/// A GGUF file, memory-mapped and parsed (the tensor data stays in the mapping).
#[cfg(not(target_arch = "wasm32"))]
pub fn open(path: &std::path::Path) -> crate::Result<(Gguf, crate::tensor::SharedBytes)> {
    use crate::Error;
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only, as for safetensors (weights::load_dir).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let g = Gguf::parse(&map)
        .map_err(|e| Error::Weights(format!("{}: not a valid GGUF file: {e}", path.display())))?;
    Ok((g, std::sync::Arc::new(map)))
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Array items read so far (see [`MAX_ARRAY_ITEMS`]).
    items: usize,
}

/// A tensor's name, `ne` dimensions (contiguous first), type and data offset.
type RawInfo = (String, Vec<u64>, DType, u64);

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(bad(format!(
                "needs {n} bytes at byte {} of a {}-byte file (truncated?)",
                self.at,
                self.bytes.len()
            )));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        self.array().map(u64::from_le_bytes)
    }

    /// A count of items of at least `min_bytes` each, refused when they cannot all be there.
    fn count(&mut self, min_bytes: usize) -> Result<usize, GgufError> {
        let n = self.u64()?;
        match usize::try_from(n) {
            Ok(n) if n.saturating_mul(min_bytes.max(1)) <= self.remaining() => Ok(n),
            _ => Err(bad(format!(
                "a count of {n} items, with {} bytes left",
                self.remaining()
            ))),
        }
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.count(1)?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| bad("a string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(bad(format!("bool byte {b}"))),
            },
            8 => Value::Str(self.string()?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(bad("arrays nested too deep"));
                }
                let elem = self.u32()?;
                // Strings and arrays take at least 8 bytes (their length), others their size.
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                let n = self.count(min)?;
                self.items = self.items.saturating_add(n);
                if self.items > MAX_ARRAY_ITEMS {
                    return Err(bad(format!(
                        "more than {MAX_ARRAY_ITEMS} array items in the metadata"
                    )));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(bad(format!("unknown value type {other}"))),
        })
    }

    fn tensor_info(&mut self) -> Result<RawInfo, GgufError> {
        let name = self.string()?;
        let n_dims = self.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(bad(format!("`{name}` has {n_dims} dimensions")));
        }
        let dims = (0..n_dims)
            .map(|_| self.u64())
            .collect::<Result<Vec<u64>, _>>()?;
        let id = self.u32()?;
        let dtype = DType::from_ggml_id(id).ok_or_else(|| {
            bad(format!(
                "`{name}` has ggml type {id}, which tether does not read"
            ))
        })?;
        let offset = self.u64()?;
        Ok((name, dims, dtype, offset))
    }
}

/// Writes GGUF version 3: metadata, then tensors whose bytes are in their type's layout. The
/// bytes may be given with each tensor ([`Writer::tensor`], for tests) or produced one tensor
/// at a time while writing ([`Writer::describe`] and [`Writer::write`]), so a model larger
/// than memory can be written.
#[derive(Default)]
pub struct Writer {
    metadata: Vec<(String, Value)>,
    tensors: Vec<Described>,
    /// The bytes given with [`Writer::tensor`], by tensor index.
    given: Vec<Vec<u8>>,
}

struct Described {
    name: String,
    ne: Vec<u64>,
    dtype: DType,
    nbytes: u64,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    pub fn meta(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// A tensor of row-major `shape` (outermost first) in `dtype`, whose bytes
    /// [`Writer::write`] asks for by its index (the order of `describe` calls).
    pub fn describe(&mut self, name: &str, shape: &[usize], dtype: DType) {
        let (block, bytes) = dtype.block();
        let elems: u64 = shape.iter().map(|&d| d as u64).product();
        let (block, bytes) = (block as u64, bytes as u64);
        self.tensors.push(Described {
            name: name.to_string(),
            ne: shape.iter().rev().map(|&d| d as u64).collect(),
            dtype,
            nbytes: elems / block * bytes,
        });
    }

    /// A tensor with its bytes (ggml's layout).
    pub fn tensor(&mut self, name: &str, shape: &[usize], dtype: DType, bytes: Vec<u8>) {
        self.describe(name, shape, dtype);
        self.given.resize(self.tensors.len() - 1, Vec::new());
        self.given.push(bytes);
    }

    /// The whole file, from the bytes given with [`Writer::tensor`].
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(&mut out, |i| Ok(self.given[i].clone()))
            .expect("writing to memory");
        out
    }

    /// Writes the file to `out`, asking `bytes_of(i)` for tensor `i`'s bytes when it is its
    /// turn; each must be the length its type and shape give.
    pub fn write(
        &self,
        out: &mut impl std::io::Write,
        mut bytes_of: impl FnMut(usize) -> std::io::Result<Vec<u8>>,
    ) -> std::io::Result<()> {
        let mut head = Vec::new();
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut head, k);
            put_value(&mut head, v, true);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.dtype.ggml_id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.nbytes).next_multiple_of(DEFAULT_ALIGNMENT);
        }
        head.resize(head.len().next_multiple_of(DEFAULT_ALIGNMENT as usize), 0);
        out.write_all(&head)?;
        for (i, t) in self.tensors.iter().enumerate() {
            let bytes = bytes_of(i)?;
            if bytes.len() as u64 != t.nbytes {
                return Err(std::io::Error::other(format!(
                    "tensor `{}`: {} bytes, its type and shape take {}",
                    t.name,
                    bytes.len(),
                    t.nbytes
                )));
            }
            out.write_all(&bytes)?;
            let pad = t.nbytes.next_multiple_of(DEFAULT_ALIGNMENT) - t.nbytes;
            out.write_all(&vec![0; pad as usize])?;
        }
        Ok(())
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::Str(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value, with_type: bool) {
    if with_type {
        out.extend_from_slice(&type_id(v).to_le_bytes());
    }
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::Str(s) => put_str(out, s),
        Value::Array(items) => {
            // An empty array is written as an array of u8.
            let elem = items.first().map_or(0, type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item, false);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = Writer::new();
        w.meta("general.architecture", Value::Str("qwen35".into()))
            .meta("qwen35.block_count", Value::U32(4))
            .meta(
                "tokenizer.ggml.tokens",
                Value::Array(vec![Value::Str("a".into()), Value::Str("bc".into())]),
            );
        let v: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        // An empty tensor first: its range must stay inside a file cut short anywhere.
        w.tensor("empty", &[0, 32], DType::F32, Vec::new());
        w.tensor("t", &[2, 3], DType::F32, v);
        w.tensor("q", &[1, 32], DType::Q8_0, vec![7; 34]);
        w.to_bytes()
    }

    #[test]
    fn a_written_file_reads_back() {
        let bytes = sample();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.get("qwen35.block_count").unwrap().as_u64(), Some(4));
        assert_eq!(
            g.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap()[1],
            Value::Str("bc".into())
        );
        assert!(g.tensors[0].range.is_empty());
        let t = &g.tensors[1];
        assert_eq!((t.name.as_str(), t.shape.as_slice()), ("t", &[2, 3][..]));
        let floats: Vec<f32> = bytes[t.range.clone()]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(floats, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(g.tensors[2].range.len(), 34);
        assert_eq!(g.tensors[2].range.start % 32, 0);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample();
        for n in 0..bytes.len() - 1 {
            // Cutting into the last tensor's data or its padding: only the data's end matters.
            if let Ok(g) = Gguf::parse(&bytes[..n]) {
                assert!(g.tensors.iter().all(|t| t.range.end <= n), "cut at {n}");
                for t in &g.tensors {
                    let _ = &bytes[..n][t.range.clone()];
                }
            }
        }
        assert!(Gguf::parse(&bytes[..100]).is_err());
    }

    /// A file of empty tensors cut between its descriptions and its (aligned) data: no range
    /// may point past the end.
    #[test]
    fn empty_tensors_of_a_cut_file_stay_inside_it() {
        let mut w = Writer::new();
        w.meta("general.architecture", Value::Str("qwen35".into()));
        w.tensor("token_embd.weight", &[0, 32], DType::F32, Vec::new());
        let bytes = w.to_bytes();
        for n in 0..=bytes.len() {
            if let Ok(g) = Gguf::parse(&bytes[..n]) {
                assert!(g.tensors.iter().all(|t| t.range.end <= n), "cut at {n}");
            }
        }
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        let mut bytes = sample();
        // The metadata count (bytes 16..24) set near 2^64.
        bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = Gguf::parse(&bytes).unwrap_err().to_string();
        assert!(e.contains("metadata"), "{e}");
        let mut bytes = sample();
        bytes[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(Gguf::parse(&bytes).is_err());
    }
}
