//! Q8_0 weights with eight rows interleaved: the layout the CPU's decode kernel reads fastest
//! where 256-bit multiplies are slow (AVX2-only CPUs such as AMD's Zen 1, docs/PERFORMANCE.md).
//!
//! Block `b` of rows `8 g .. 8 g + 8` becomes one [`BlockQ8_0x8`]: their eight scales together,
//! then their values four bytes of each row at a time, so that one 32-byte load holds four
//! weights of each of the eight rows and multiplies the same four activations. The bytes are
//! the file's, moved: every weight keeps its value, and [`file_bytes`] gives the file's order
//! back (for writers and the model's identity). Made once, when [`crate::resident`] copies
//! the weights into memory, only where the CPU backend asks for it
//! (`backend::cpu::matmul::interleaves_q8_0`).

use std::ops::Range;

use half::f16;

use crate::quant::{BlockQ8_0, QuantBlock, QK};

/// Rows per interleaved block.
pub const ROWS: usize = 8;

/// Block `b` of eight rows: `qs[32 j + 4 r .. 32 j + 4 r + 4]` are values `4 j .. 4 j + 4` of
/// row `r`, whose scale is `d[r]`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ8_0x8 {
    pub d: [f16; ROWS],
    pub qs: [i8; ROWS * QK],
}

impl BlockQ8_0x8 {
    /// Block `b` of eight rows, `blocks[r]` row `r`'s.
    fn of(blocks: [&BlockQ8_0; ROWS]) -> BlockQ8_0x8 {
        let mut x = BlockQ8_0x8 {
            d: blocks.map(|b| b.d),
            qs: [0; ROWS * QK],
        };
        for (r, b) in blocks.iter().enumerate() {
            for j in 0..QK / 4 {
                x.qs[32 * j + 4 * r..][..4].copy_from_slice(&b.qs[4 * j..][..4]);
            }
        }
        x
    }

    /// Row `r`'s block, as the file holds it.
    pub fn row(&self, r: usize) -> BlockQ8_0 {
        let mut qs = [0i8; QK];
        for j in 0..QK / 4 {
            qs[4 * j..][..4].copy_from_slice(&self.qs[32 * j + 4 * r..][..4]);
        }
        BlockQ8_0 { d: self.d[r], qs }
    }
}

/// Whether a `[rows, cols]` Q8_0 matrix can be interleaved: whole groups of eight rows.
pub fn fits(rows: usize, cols: usize) -> bool {
    rows > 0 && cols > 0 && rows.is_multiple_of(ROWS) && cols.is_multiple_of(QK)
}

/// `blocks` (a `[rows, per_row * 32]` matrix in the file's order, [`fits`]) interleaved, group
/// by group and block by block, into `out` (as many bytes).
pub fn interleave_into(blocks: &[BlockQ8_0], per_row: usize, out: &mut [BlockQ8_0x8]) {
    assert_eq!(blocks.len(), out.len() * ROWS);
    for (g, group) in out.chunks_exact_mut(per_row).enumerate() {
        let rows = &blocks[g * ROWS * per_row..][..ROWS * per_row];
        for (b, x) in group.iter_mut().enumerate() {
            *x = BlockQ8_0x8::of(std::array::from_fn(|r| &rows[r * per_row + b]));
        }
    }
}

/// Interleaved blocks' weight `range` (row-major over rows of `per_row` blocks, on block
/// boundaries) as f32 into `out`.
pub fn to_f32_into(x: &[BlockQ8_0x8], per_row: usize, range: Range<usize>, out: &mut [f32]) {
    assert!(range.start.is_multiple_of(QK) && range.end.is_multiple_of(QK));
    assert_eq!(out.len(), range.len());
    let blocks = range.start / QK..range.end / QK;
    for (i, o) in blocks.zip(out.chunks_exact_mut(QK)) {
        let (row, b) = (i / per_row, i % per_row);
        x[row / ROWS * per_row + b]
            .row(row % ROWS)
            .dequantise_into(o);
    }
}

/// Rows `rows` of interleaved blocks in the file's order.
pub fn row_blocks(x: &[BlockQ8_0x8], per_row: usize, rows: Range<usize>) -> Vec<BlockQ8_0> {
    let mut blocks = Vec::with_capacity(rows.len() * per_row);
    for row in rows {
        let group = &x[row / ROWS * per_row..][..per_row];
        blocks.extend(group.iter().map(|b| b.row(row % ROWS)));
    }
    blocks
}

/// The bytes of interleaved blocks in the file's order.
pub fn file_bytes(x: &[BlockQ8_0x8], per_row: usize) -> Vec<u8> {
    let rows = x.len() / per_row * ROWS;
    bytemuck::cast_slice(&row_blocks(x, per_row, 0..rows)).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Quantise;

    fn matrix(rows: usize, cols: usize) -> Vec<BlockQ8_0> {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
            .collect();
        values.chunks_exact(QK).map(BlockQ8_0::quantise).collect()
    }

    #[test]
    fn interleaving_keeps_every_weight_and_gives_the_file_back() {
        let (rows, cols) = (16, 96);
        let per_row = cols / QK;
        let blocks = matrix(rows, cols);
        let mut x = vec![bytemuck::Zeroable::zeroed(); blocks.len() / ROWS];
        interleave_into(&blocks, per_row, &mut x);
        assert_eq!(
            file_bytes(&x, per_row),
            bytemuck::cast_slice::<BlockQ8_0, u8>(&blocks)
        );
        let all: Vec<f32> = blocks.iter().flat_map(|b| b.dequantise()).collect();
        let mut out = vec![0.0; all.len()];
        to_f32_into(&x, per_row, 0..all.len(), &mut out);
        assert_eq!(out, all);
        // A range inside rows: row 9's second block to row 11's first.
        let range = 9 * cols + QK..11 * cols + QK;
        let mut part = vec![0.0; range.len()];
        to_f32_into(&x, per_row, range.clone(), &mut part);
        assert_eq!(part, all[range]);
        // Four values of each row in each 32-byte column.
        assert_eq!(
            x[per_row + 1].qs[32 * 2 + 4 * 3..][..4],
            blocks[11 * per_row + 1].qs[8..12]
        );
    }
}
