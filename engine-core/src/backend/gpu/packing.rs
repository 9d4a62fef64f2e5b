//! Quantised weights in weights.wgsl's device layouts (`W = 3 ..= 8`): the blocks of a GGUF's
//! Q8_0, Q4_0, Q5_0, Q4_K, Q5_K and Q6_K matrices re-packed at upload into 4-byte words, never
//! widened to 16 or 32 bits a weight. f16 scales become f32 (exact), the k-quants' packed 6-bit
//! scales and mins become bytes, and each weight's level is split into its low four bits
//! (eight weights a word, weight `8k + n` in nibble `n` of word `k`) and its high bits (one a
//! weight for Q5_0 and Q5_K, 32 a word; two for Q6_K, 16 a word), so that the shader reads 8
//! consecutive weights from one nibble word and part of one high-bit word. The weights the
//! shader computes from these words are the blocks' own (`QuantBlock::dequantise_into`).
//! Q8_0 keeps its bytes in order (weight `i` in byte `i % 4` of word `i / 4`).

use std::ops::Range;

use shaders::WeightFormat;

use crate::interleaved;
use crate::quant::scale_min_k4;
use crate::tensor::{
    BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ5_0, BlockQ6K, BlockQ8_0, DType, Data, QuantBlock, QK,
    QK_K,
};

/// The device format of quantised `dtype`, for the types that have kernels; `None` for the
/// float types and the quantised types without kernels (Q4_1, Q5_1, IQ4_NL, Q2_K, Q3_K,
/// IQ4_XS).
pub(crate) fn quant_format(dtype: DType) -> Option<WeightFormat> {
    match dtype {
        DType::Q8_0 => Some(WeightFormat::Q8_0),
        DType::Q4_0 => Some(WeightFormat::Q4_0),
        DType::Q5_0 => Some(WeightFormat::Q5_0),
        DType::Q4K => Some(WeightFormat::Q4K),
        DType::Q5K => Some(WeightFormat::Q5K),
        DType::Q6K => Some(WeightFormat::Q6K),
        _ => None,
    }
}

/// A block type with a device layout: `WeightFormat::block()`'s words for it.
trait DeviceBlock: QuantBlock {
    const FORMAT: WeightFormat;
    /// Appends the block's words.
    fn pack(&self, out: &mut Vec<u32>);
}

/// Bytes `b` in one word, `b[0]` lowest.
fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("four bytes"))
}

/// The low four bits of `levels`, eight a word (level `8k + n` in bits `4n .. 4n + 4` of word
/// `k`).
fn nibble_words(levels: &[u8], out: &mut Vec<u32>) {
    out.extend(
        levels.chunks_exact(8).map(|c| {
            (c.iter().enumerate()).fold(0, |w, (n, &l)| w | (u32::from(l & 0xF) << (4 * n)))
        }),
    );
}

/// The `bits` bits of `levels` above the low four, `32 / bits` a word.
fn high_words(levels: &[u8], bits: usize, out: &mut Vec<u32>) {
    let mask = (1u8 << bits) - 1;
    out.extend(levels.chunks_exact(32 / bits).map(|c| {
        (c.iter().enumerate()).fold(0, |w, (n, &l)| {
            w | (u32::from((l >> 4) & mask) << (bits * n))
        })
    }));
}

/// The levels of a Q4_0/Q5_0 block's nibbles: weight `j` in the low nibble of byte `j`, weight
/// `j + 16` in its high nibble (quant.rs's `nibbles`).
fn q_0_nibbles(qs: &[u8; QK / 2]) -> [u8; QK] {
    std::array::from_fn(|i| {
        if i < QK / 2 {
            qs[i] & 0xF
        } else {
            qs[i - QK / 2] >> 4
        }
    })
}

impl DeviceBlock for BlockQ8_0 {
    const FORMAT: WeightFormat = WeightFormat::Q8_0;
    fn pack(&self, out: &mut Vec<u32>) {
        let bytes = self.qs.map(|q| q as u8);
        out.extend(bytes.chunks_exact(4).map(word));
        out.push(self.d.to_f32().to_bits());
    }
}

impl DeviceBlock for BlockQ4_0 {
    const FORMAT: WeightFormat = WeightFormat::Q4_0;
    fn pack(&self, out: &mut Vec<u32>) {
        out.push(self.d.to_f32().to_bits());
        nibble_words(&q_0_nibbles(&self.qs), out);
    }
}

impl DeviceBlock for BlockQ5_0 {
    const FORMAT: WeightFormat = WeightFormat::Q5_0;
    fn pack(&self, out: &mut Vec<u32>) {
        out.push(self.d.to_f32().to_bits());
        nibble_words(&q_0_nibbles(&self.qs), out);
        // Bit `i` of the little-endian `qh` is weight `i`'s fifth (quant.rs's `fives`): already
        // the device's order.
        out.push(u32::from_le_bytes(self.qh));
    }
}

/// A Q4_K/Q5_K block's header: `d`, `dmin`, then the eight sub-blocks' scales and mins
/// unpacked from their 12-byte packing (ggml's `get_scale_min_k4`), a byte each.
fn k4_header((d, dmin): (half::f16, half::f16), scales: &[u8; 12], out: &mut Vec<u32>) {
    out.push(d.to_f32().to_bits());
    out.push(dmin.to_f32().to_bits());
    let pairs: [(u8, u8); 8] = std::array::from_fn(|j| scale_min_k4(j, scales));
    let (sc, m): (Vec<u8>, Vec<u8>) = pairs.into_iter().unzip();
    out.extend(sc.chunks_exact(4).map(word));
    out.extend(m.chunks_exact(4).map(word));
}

/// A Q4_K/Q5_K block's levels' low four bits: sub-block `2j` in the low nibbles of bytes
/// `32j .. 32j + 32` of `qs`, sub-block `2j + 1` in their high nibbles.
fn k4_nibbles(qs: &[u8; QK_K / 2]) -> [u8; QK_K] {
    std::array::from_fn(|i| {
        let q = qs[32 * (i / 64) + i % 32];
        if i % 64 < 32 {
            q & 0xF
        } else {
            q >> 4
        }
    })
}

impl DeviceBlock for BlockQ4K {
    const FORMAT: WeightFormat = WeightFormat::Q4K;
    fn pack(&self, out: &mut Vec<u32>) {
        k4_header((self.d, self.dmin), &self.scales, out);
        nibble_words(&k4_nibbles(&self.qs), out);
    }
}

impl DeviceBlock for BlockQ5K {
    const FORMAT: WeightFormat = WeightFormat::Q5K;
    fn pack(&self, out: &mut Vec<u32>) {
        k4_header((self.d, self.dmin), &self.scales, out);
        let mut levels = k4_nibbles(&self.qs);
        // Bit `j` of `qh[l]` is weight `32j + l`'s fifth.
        for (i, l) in levels.iter_mut().enumerate() {
            *l |= ((self.qh[i % 32] >> (i / 32)) & 1) << 4;
        }
        nibble_words(&levels, out);
        high_words(&levels, 1, out);
    }
}

impl DeviceBlock for BlockQ6K {
    const FORMAT: WeightFormat = WeightFormat::Q6K;
    fn pack(&self, out: &mut Vec<u32>) {
        out.push(self.d.to_f32().to_bits());
        let scales = self.scales.map(|s| s as u8);
        out.extend(scales.chunks_exact(4).map(word));
        // Per half of 128 weights, weight `l + 32k` (l < 32): low four bits from byte `l` of
        // the half's 64 in `ql` (k even) or byte `l + 32` (k odd), low nibble for k < 2; top
        // two bits from bits `2k, 2k + 1` of the half's byte `l` of `qh`
        // (`BlockQ6K::dequantise_into`).
        let levels: [u8; QK_K] = std::array::from_fn(|i| {
            let (half, at) = (i / 128, i % 128);
            let (l, k) = (at % 32, at / 32);
            let ql = self.ql[64 * half + l + 32 * (k & 1)];
            let low = if k < 2 { ql & 0xF } else { ql >> 4 };
            let high = (self.qh[32 * half + l] >> (2 * k)) & 3;
            low | (high << 4)
        });
        nibble_words(&levels, out);
        high_words(&levels, 2, out);
    }
}

fn pack_rows<B: DeviceBlock>(blocks: &[B], cols: usize, rows: Range<usize>) -> Vec<u8> {
    let per_row = cols / B::LEN;
    let (_, words) = B::FORMAT.block().expect("a quantised format");
    let mut out = Vec::with_capacity(rows.len() * per_row * words);
    for b in &blocks[rows.start * per_row..rows.end * per_row] {
        b.pack(&mut out);
    }
    debug_assert_eq!(out.len(), rows.len() * per_row * words);
    out.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Rows `rows` of quantised `data` (`cols` wide, whole blocks) in the device layout of
/// weights.wgsl's format for its type (`quant_format`, which the caller checked).
pub(super) fn quant_rows(data: &Data, cols: usize, rows: Range<usize>) -> Vec<u8> {
    match data {
        Data::Q8_0(b) => pack_rows(b, cols, rows),
        Data::Q8_0x8 { blocks, per_row } => {
            let n = rows.len();
            pack_rows(&interleaved::row_blocks(blocks, *per_row, rows), cols, 0..n)
        }
        Data::Q4_0(b) => pack_rows(b, cols, rows),
        Data::Q5_0(b) => pack_rows(b, cols, rows),
        Data::Q4K(b) => pack_rows(b, cols, rows),
        Data::Q5K(b) => pack_rows(b, cols, rows),
        Data::Q6K(b) => pack_rows(b, cols, rows),
        _ => unreachable!(
            "upload_matrix_blocked checked that {} has a device format",
            data.dtype().name()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each packed block read back as the shader reads it (weights.wgsl, in Rust) gives the
    /// block's own weights bit for bit: the layouts without a device.
    #[test]
    fn packed_blocks_hold_the_blocks_weights() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let values: Vec<f32> = (0..4 * QK_K)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect();
        for dtype in [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q5_0,
            DType::Q4K,
            DType::Q5K,
            DType::Q6K,
        ] {
            let data = Data::from_f32(&values, dtype);
            let format = quant_format(dtype).unwrap();
            let (len, words) = format.block().unwrap();
            let bytes = quant_rows(&data, values.len(), 0..1);
            let w: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(w.len(), values.len() / len * words, "{dtype:?}");
            let want = data.to_f32_vec();
            for (e, want) in want.iter().enumerate() {
                let got = shader_weight(format, &w, e);
                assert_eq!(got.to_bits(), want.to_bits(), "{dtype:?} weight {e}");
            }
        }
    }

    /// weights.wgsl's `weight(e)`, operation for operation.
    fn shader_weight(format: WeightFormat, w: &[u32], e: usize) -> f32 {
        let (len, words) = format.block().unwrap();
        let base = e / len * words;
        let i = e % len;
        let f = |k: usize| f32::from_bits(w[base + k]);
        let bits = |word: u32, at: usize, n: usize| (word >> at) & ((1 << n) - 1);
        let byte = |k: usize, j: usize| bits(w[base + k + j / 4], 8 * (j % 4), 8);
        let nib = |k: usize| bits(w[base + k + i / 8], 4 * (i % 8), 4);
        match format {
            WeightFormat::Q8_0 => f(8) * f32::from(byte(0, i) as u8 as i8),
            WeightFormat::Q4_0 => f(0) * (nib(1) as f32 - 8.0),
            WeightFormat::Q5_0 => f(0) * ((nib(1) | bits(w[base + 5], i, 1) << 4) as f32 - 16.0),
            WeightFormat::Q4K | WeightFormat::Q5K => {
                let mut q = nib(6);
                if format == WeightFormat::Q5K {
                    q |= bits(w[base + 38 + i / 32], i % 32, 1) << 4;
                }
                let (sc, m) = (byte(2, i / 32), byte(4, i / 32));
                f(0) * sc as f32 * q as f32 - f(1) * m as f32
            }
            WeightFormat::Q6K => {
                let q = nib(5) | bits(w[base + 37 + i / 16], 2 * (i % 16), 2) << 4;
                let sc = byte(1, i / 16) as u8 as i8;
                f(0) * f32::from(sc) * (q as f32 - 32.0)
            }
            _ => unreachable!(),
        }
    }
}
