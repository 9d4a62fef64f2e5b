//! Weights copied out of their file mapping into memory that asks for transparent huge pages.
//!
//! Decode reads every weight once per token. Read through a file mapping, the weights sit in
//! the page cache's 4 KiB pages: a 250 MB matrix spans 61000 of them, every one a TLB miss, and
//! the CPU's prefetchers stop at each page's end. In anonymous memory advised for huge pages
//! (2 MiB) the same matrix is 120 pages. Measured on a 2-vCPU Xeon (AVX-512), Qwen3.5-0.8B at
//! Q4_K_M, `tether bench --threads 2 --prompt-tokens 1 --gen 64`: decode 26.5 -> 33.9 tok/s,
//! its Q6_K output matrix read at 17.4 -> 26.8 GB/s (the machine's read bandwidth is about
//! 24 GB/s). Prefill, bound by arithmetic, did not move.
//!
//! The copy is resident memory the OS cannot drop and read back as it can a mapping's pages,
//! so it is made only on Linux (where `madvise` asks for huge pages; elsewhere it would buy
//! nothing measured), only when it fits in the memory available ([`fits`]), and never with
//! `--mmap`. llama.cpp's `--no-mmap` makes the same trade.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::interleaved;
use crate::tensor::{Data, Elems, QK};
use crate::weights::TensorMap;
use crate::{Error, Result};

/// Every tensor starts on this boundary in the copy: the widest load the kernels make, and a
/// multiple of every element's and block's alignment.
const ALIGN: usize = 64;

/// Bytes copied so far by this process (for [`available_memory`]).
static COPIED: AtomicU64 = AtomicU64::new(0);

/// Copies the mapped tensors of `tensors` that `wanted` names into one anonymous mapping
/// advised for huge pages, and points them at it. Returns the bytes copied: 0 where it is not
/// done (not Linux, nothing mapped, or more than [`fits`] allows). Owned tensors (converted or
/// reordered at load) stay where they are. Q8_0 matrices go in with eight rows interleaved
/// where the CPU's decode takes them so ([`crate::interleaved`]); every other tensor as is.
pub fn settle(tensors: &mut TensorMap, wanted: impl Fn(&str) -> bool) -> Result<u64> {
    let mut chosen: Vec<(&String, &mut crate::tensor::Tensor)> = tensors
        .iter_mut()
        .filter(|(name, t)| wanted(name) && t.data.mapped().is_some())
        .collect();
    // A stable order, so the copy's layout does not depend on the map's hashing.
    chosen.sort_by(|a, b| a.0.cmp(b.0));
    // Each tensor's place in the copy.
    let mut places = Vec::with_capacity(chosen.len());
    let mut total = 0usize;
    for (_, t) in &chosen {
        let start = total.next_multiple_of(ALIGN);
        total = start + t.data.mapped().map_or(0, <[u8]>::len);
        places.push(start..total);
    }
    if total == 0 || !cfg!(target_os = "linux") || !fits(total as u64, available_memory()) {
        return Ok(0);
    }
    let mut copy = memmap2::MmapOptions::new()
        .len(total)
        .map_anon()
        .map_err(|e| Error::Weights(format!("{total} bytes for the weights: {e}")))?;
    #[cfg(target_os = "linux")]
    // Only advice: without huge pages the copy is still correct, merely no faster.
    let _ = copy.advise(memmap2::Advice::HugePage);
    let interleave = crate::backend::cpu::matmul::interleaves_q8_0();
    let mut per_rows = Vec::with_capacity(chosen.len());
    for ((_, t), place) in chosen.iter().zip(&places) {
        let per_row = interleaved_rows(t, interleave);
        match (&t.data, per_row) {
            (Data::Q8_0(blocks), Some(per_row)) => interleaved::interleave_into(
                blocks,
                per_row,
                bytemuck::cast_slice_mut(&mut copy[place.clone()]),
            ),
            // As they lie: another layout, or weights this copy interleaved before.
            (data, _) => copy[place.clone()].copy_from_slice(data.stored()),
        }
        per_rows.push(per_row);
    }
    let copy: crate::tensor::SharedBytes = Arc::new(
        copy.make_read_only()
            .map_err(|e| Error::Weights(format!("sealing the weights' copy: {e}")))?,
    );
    for (((_, t), place), per_row) in chosen.iter_mut().zip(places).zip(per_rows) {
        t.data = match per_row {
            Some(per_row) => Data::Q8_0x8 {
                blocks: Elems::from_bytes(&copy, place),
                per_row,
            },
            None => Data::from_bytes(t.data.dtype(), &copy, place),
        };
    }
    COPIED.fetch_add(total as u64, Ordering::Relaxed);
    Ok(total as u64)
}

/// Blocks per row of `t` if it goes into the copy interleaved: a Q8_0 matrix of whole groups
/// of eight rows ([`crate::interleaved::fits`]) where the CPU's decode takes that
/// (`interleave`), or weights already interleaved (a second copy keeps their layout).
fn interleaved_rows(t: &crate::tensor::Tensor, interleave: bool) -> Option<usize> {
    match (&t.data, t.shape.as_slice()) {
        (Data::Q8_0x8 { per_row, .. }, _) => Some(*per_row),
        (Data::Q8_0(_), &[rows, cols]) if interleave && interleaved::fits(rows, cols) => {
            Some(cols / QK)
        }
        _ => None,
    }
}

/// Bytes of weights this process copied into huge pages so far (0: they stay mapped).
pub fn copied() -> u64 {
    COPIED.load(Ordering::Relaxed)
}

/// Whether `bytes` may be copied given `available` (unknown: no): at most 7/8 of it, which
/// leaves the rest for the KV cache, activations and the machine.
pub fn fits(bytes: u64, available: Option<u64>) -> bool {
    available.is_some_and(|a| bytes <= room(a))
}

/// What weights may take of `available` bytes: seven eighths, the rest for the KV cache,
/// activations and the machine.
pub fn room(available: u64) -> u64 {
    available / 8 * 7
}

/// Memory the system can give now without swapping (`MemAvailable` on Linux, which counts
/// reclaimable cache such as a mapped model's pages; `None` elsewhere), plus the weights this
/// process copied, which a plan counts as weights, so that they are not subtracted twice.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    Some(mem_available(&meminfo)? + copied())
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{SharedBytes, Tensor};

    #[test]
    fn meminfo() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:         9000000 kB\nMemAvailable:   15728640 kB\n";
        assert_eq!(mem_available(meminfo), Some(15 << 30));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert!(fits(7 << 30, Some(8 << 30)) && !fits(8 << 30, Some(8 << 30)));
        assert!(!fits(1, None));
    }

    /// Mapped tensors that are wanted move to the copy with the same values; the others and
    /// owned ones stay.
    #[cfg(target_os = "linux")]
    #[test]
    fn wanted_mapped_tensors_move_with_their_values() {
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25 - 7.0).collect();
        let file: SharedBytes = Arc::new(bytemuck::cast_slice::<f32, u8>(&values).to_vec());
        let mapped = |r: std::ops::Range<usize>| Tensor {
            shape: vec![r.len()],
            data: Data::from_bytes(crate::tensor::DType::F32, &file, 4 * r.start..4 * r.end),
        };
        let mut tensors = TensorMap::new();
        tensors.insert("a".into(), mapped(0..3));
        tensors.insert("b".into(), mapped(3..1000));
        tensors.insert("skip".into(), mapped(10..20));
        let owned = Tensor {
            shape: vec![2],
            data: Data::F32(crate::tensor::Elems::Owned(vec![1.0, 2.0].into())),
        };
        tensors.insert("owned".into(), owned);
        let copied = settle(&mut tensors, |n| n != "skip").unwrap();
        assert_eq!(copied, (64 + 997 * 4) as u64);
        let at = |n: &str| tensors[n].data.mapped().map(|b| b.as_ptr());
        let file_range = file.as_ref().as_ref().as_ptr_range();
        assert!(!file_range.contains(&at("a").unwrap()));
        assert!(!file_range.contains(&at("b").unwrap()));
        assert!(file_range.contains(&at("skip").unwrap()));
        assert_eq!(at("owned"), None);
        assert_eq!(tensors["a"].data.to_f32_vec(), values[0..3]);
        assert_eq!(tensors["b"].data.to_f32_vec(), values[3..1000]);
        assert_eq!(tensors["skip"].data.to_f32_vec(), values[10..20]);
    }

    /// A Q8_0 matrix copied in keeps its values and gives the file's bytes back, interleaved
    /// by eight rows exactly where the CPU's decode takes that (and only whole groups of eight
    /// rows are).
    #[test]
    fn q8_0_matrices_are_interleaved_where_the_cpu_takes_them() {
        use crate::tensor::DType;
        let values: Vec<f32> = (0..24 * 64).map(|i| (i % 53) as f32 * 0.1 - 2.0).collect();
        let q = Data::from_f32(&values, DType::Q8_0);
        let file: SharedBytes = Arc::new(q.as_bytes().to_vec());
        let matrix = |rows: usize| Tensor {
            shape: vec![rows, 64],
            data: Data::from_bytes(DType::Q8_0, &file, 0..rows * 2 * 34),
        };
        let mut tensors = TensorMap::new();
        tensors.insert("whole".into(), matrix(24));
        tensors.insert("ragged".into(), matrix(20));
        settle(&mut tensors, |_| true).unwrap();
        let cpu = crate::backend::cpu::matmul::interleaves_q8_0();
        // A second copy (of what the first made) keeps each layout.
        settle(&mut tensors, |_| true).unwrap();
        for (name, rows, fits) in [("whole", 24, true), ("ragged", 20, false)] {
            let data = &tensors[name].data;
            let layout = matches!(data, Data::Q8_0x8 { .. });
            assert_eq!(layout, cpu && fits, "{name}");
            assert_eq!(data.dtype(), DType::Q8_0);
            assert_eq!(data.to_f32_vec(), q.to_f32_vec()[..rows * 64]);
            assert_eq!(*data.as_bytes(), file.as_ref().as_ref()[..rows * 2 * 34]);
        }
    }
}
