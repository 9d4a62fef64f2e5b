//! Storage-dtype to f32 conversion: the inner loop of every bf16/f16 matmul, and of reading
//! a bf16/f16 tensor's rows to f32 (tensor.rs).

use half::{bf16, f16};

/// bf16 is the top half of an f32: widening is a 16-bit shift, which vectorises cleanly.
#[inline]
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// f16 widening. On x86 and aarch64 `half` uses the F16C/FP16 conversion instructions (chosen at
/// compile time when the target has them, else detected at run time); elsewhere (wasm) `half`
/// would convert one element at a time through branches, so a branch-free form that the
/// compiler vectorises is used instead.
#[inline]
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64"))]
    {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64")))]
    f16_to_f32_portable(src, dst);
}

/// Exact f16 -> f32 with selects instead of branches: rebias the exponent, then fix up the two
/// special exponents (all ones: inf/NaN; zero: zero/subnormal, renormalised by an exact float
/// subtraction). NaN payloads are kept but, unlike `half`, not forced quiet.
#[cfg(any(
    test,
    not(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64"))
))]
fn f16_to_f32_portable(src: &[f16], dst: &mut [f32]) {
    const EXP_MASK: u32 = 0x7c00 << 13;
    // 2^-14, the smallest normal f16.
    const MIN_NORMAL: f32 = 1.0 / 16384.0;
    for (d, s) in dst.iter_mut().zip(src) {
        let h = s.to_bits() as u32;
        let magnitude = (h & 0x7fff) << 13;
        let exp = magnitude & EXP_MASK;
        let rebiased = magnitude + ((127 - 15) << 23);
        let special = rebiased + ((128 - 16) << 23);
        let subnormal = (f32::from_bits(rebiased + (1 << 23)) - MIN_NORMAL).to_bits();
        let bits = if exp == EXP_MASK {
            special
        } else if exp == 0 {
            subnormal
        } else {
            rebiased
        };
        *d = f32::from_bits(bits | (h & 0x8000) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16/bf16 bit pattern whose value is not NaN.
    fn all_bits() -> impl Iterator<Item = u16> {
        (0..=u16::MAX).filter(|&b| !f16::from_bits(b).is_nan() && !bf16::from_bits(b).is_nan())
    }

    #[test]
    fn bf16_matches_half_for_every_value() {
        let src: Vec<bf16> = all_bits().map(bf16::from_bits).collect();
        let mut dst = vec![0.0; src.len()];
        bf16_to_f32(&src, &mut dst);
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(s.to_f32().to_bits(), d.to_bits(), "{:#06x}", s.to_bits());
        }
    }

    #[test]
    fn f16_matches_half_for_every_value() {
        let src: Vec<f16> = all_bits().map(f16::from_bits).collect();
        // Subnormals, infinities and both zeros are among them.
        assert!(
            src.iter()
                .any(|v| v.classify() == std::num::FpCategory::Subnormal)
                && src.iter().any(|v| v.is_infinite())
        );
        let mut fast = vec![0.0; src.len()];
        let mut portable = vec![0.0; src.len()];
        f16_to_f32(&src, &mut fast);
        f16_to_f32_portable(&src, &mut portable);
        for ((s, a), b) in src.iter().zip(&fast).zip(&portable) {
            let want = s.to_f32().to_bits();
            assert_eq!(want, a.to_bits(), "{:#06x}", s.to_bits());
            assert_eq!(want, b.to_bits(), "portable {:#06x}", s.to_bits());
        }
    }

    #[test]
    fn f16_portable_keeps_nan() {
        let src = [f16::NAN, -f16::NAN];
        let mut dst = [0.0; 2];
        f16_to_f32_portable(&src, &mut dst);
        assert!(dst.iter().all(|v| v.is_nan()));
    }
}
