//! Decode's products (one row of `x`) with Q4_0 weights on AVX-512 VNNI: sixteen weight rows at
//! a time, one i32 lane each, multiplied in place from the file's blocks (no panel: decode
//! reads each weight once, so unpacking into a panel first would cost what it saves).
//!
//! For each block the sixteen rows' 16 bytes are loaded four rows to a register and transposed
//! so that register `j` holds bytes `4 j .. 4 j + 4` of every row; one `vpdpbusd` multiplies
//! their nibbles (four weights of each row) by four activations, broadcast, and adds the
//! products into the rows' lanes. The offset of 8 comes off as `8 * sum(x)` (the lanes start
//! there), the sixteen scales come in with one gather, and each row's f32 sum takes its blocks
//! in order, as `quant_dots`' kernels do. Against AVX2's eight rows (`quant_dots`), this does
//! twice the rows per instruction and needs no instruction to widen the products.

use std::arch::x86_64::*;

use super::quant_rows::Rows8;
use crate::quant::{BlockQ4_0, QK};

/// Weight rows per group: one i32 lane each.
pub(super) const ROWS: usize = 16;

/// The `qs` of block `b` of sixteen rows, row `r`'s at `first + r * stride` bytes (`first` the
/// group's first row's block `b`), as four registers: register `j` holds bytes `4 j .. 4 j + 4`
/// of each row's 16 (lane `r` row `r`), the nibbles of weights `4 j ..` (low) and `16 + 4 j ..`
/// (high).
///
/// # Safety
/// The sixteen blocks must be readable, and the CPU must have AVX-512 F.
#[inline(always)]
unsafe fn columns(first: *const BlockQ4_0, stride: usize) -> [__m512i; 4] {
    // SAFETY: block `r` lies `r * stride` bytes after the first, as the caller says.
    let load = |r: usize| unsafe {
        let block = first.cast::<u8>().add(r * stride).cast::<BlockQ4_0>();
        _mm_loadu_si128(std::ptr::addr_of!((*block).qs).cast())
    };
    // Lane `l` (128 bits) of register `i` holds row `i + 4 l`.
    // SAFETY (the intrinsics): the caller has AVX-512 F.
    let quad = |i: usize| unsafe {
        let v = _mm512_castsi128_si512(load(i));
        let v = _mm512_inserti32x4::<1>(v, load(i + 4));
        let v = _mm512_inserti32x4::<2>(v, load(i + 8));
        _mm512_inserti32x4::<3>(v, load(i + 12))
    };
    // A 4x4 transpose of 32-bit words within each lane.
    let (y0, y1, y2, y3) = (quad(0), quad(1), quad(2), quad(3));
    // SAFETY: as above.
    unsafe {
        let (t0, t1) = (_mm512_unpacklo_epi32(y0, y1), _mm512_unpackhi_epi32(y0, y1));
        let (t2, t3) = (_mm512_unpacklo_epi32(y2, y3), _mm512_unpackhi_epi32(y2, y3));
        [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ]
    }
}

/// The f16 scales of sixteen blocks, `first`'s and those `stride`, `2 stride`, .. bytes after
/// it, widened to f32 lanes. (One `vpgatherdd` would read them in one instruction, but on the
/// AMD EPYC this was written on it took longer than the block's products.)
///
/// # Safety
/// As [`columns`].
#[inline(always)]
unsafe fn scales(first: *const BlockQ4_0, stride: usize) -> __m512 {
    // SAFETY: block `r` lies `r * stride` bytes after the first, as the caller says.
    let d = |r: usize| unsafe {
        let block = first.cast::<u8>().add(r * stride).cast::<BlockQ4_0>();
        (*block).d.to_bits() as i16
    };
    // SAFETY (the intrinsics): the caller has AVX-512 F and F16C.
    unsafe {
        _mm512_cvtph_ps(_mm256_setr_epi16(
            d(0),
            d(1),
            d(2),
            d(3),
            d(4),
            d(5),
            d(6),
            d(7),
            d(8),
            d(9),
            d(10),
            d(11),
            d(12),
            d(13),
            d(14),
            d(15),
        ))
    }
}

/// `quant_dots::Dot8::row_groups` for Q4_0 on AVX-512 VNNI: the leading whole groups of
/// sixteen rows of `w` (`[out.len(), x.k]`) against the one row of `x`, into the start of
/// `out`; returns how many rows that was (none where `x` has several rows).
///
/// A lane's integer sum is at most `8 * 32 * 127` below zero and `32 * 15 * 127` above it.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4_0_groups(w: &[BlockQ4_0], x: &Rows8, out: &mut [f32]) -> usize {
    if x.rows() != 1 {
        return 0;
    }
    let per_row = x.k / QK;
    let groups = out.len() / ROWS;
    assert!(w.len() >= groups * ROWS * per_row, "whole rows of blocks");
    let stride = per_row * size_of::<BlockQ4_0>();
    let nibbles = _mm512_set1_epi8(0x0f);
    for (g, dst) in out.chunks_exact_mut(ROWS).enumerate() {
        let group = &w[g * ROWS * per_row..][..ROWS * per_row];
        // The next group's bytes, spread over this group's blocks.
        let ahead = group.as_ptr_range().end.cast::<i8>();
        let mut acc = _mm512_setzero_ps();
        for b in 0..per_row {
            for line in (0..ROWS * size_of::<BlockQ4_0>()).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(
                    ahead.wrapping_add(ROWS * size_of::<BlockQ4_0>() * b + line),
                );
            }
            // Derived from the whole group (not one block's reference), which holds all sixteen.
            let first = group.as_ptr().wrapping_add(b);
            let xq: &[i8; QK] = x.q[QK * b..][..QK].try_into().expect("32 values");
            let word = |i: usize| {
                let bytes: &[i8; 4] = xq[4 * i..][..4].try_into().expect("4 values");
                _mm512_set1_epi32(i32::from_le_bytes(bytes.map(|v| v as u8)))
            };
            let sum = i32::from(x.sums[2 * b]) + i32::from(x.sums[2 * b + 1]);
            // Two chains of `vpdpbusd`, low nibbles and high, so that each waits on half as many.
            let mut low = _mm512_set1_epi32(-8 * sum);
            let mut high = _mm512_setzero_si512();
            // SAFETY: the group's sixteen rows of `per_row` blocks lie in `group`.
            for (j, &q) in unsafe { columns(first, stride) }.iter().enumerate() {
                let q_high = _mm512_and_si512(_mm512_srli_epi16::<4>(q), nibbles);
                low = _mm512_dpbusd_epi32(low, _mm512_and_si512(q, nibbles), word(j));
                high = _mm512_dpbusd_epi32(high, q_high, word(4 + j));
            }
            // SAFETY: the group's sixteen rows of `per_row` blocks lie in `group`.
            let d = unsafe { scales(first, stride) };
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(x.d[b]));
            let dots = _mm512_cvtepi32_ps(_mm512_add_epi32(low, high));
            acc = _mm512_fmadd_ps(dots, scale, acc);
        }
        // SAFETY: sixteen floats written to `dst`.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), acc) };
    }
    ROWS * groups
}
