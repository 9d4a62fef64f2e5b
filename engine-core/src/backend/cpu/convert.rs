//! Storage-dtype to f32 conversion, the inner loop of every bf16/f16 matmul.

use half::{bf16, f16};

/// bf16 is the top half of an f32: widening is a 16-bit shift, which vectorises cleanly.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// f16 widening; `half` uses F16C/NEON instructions where the target has them.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(dst);
}
