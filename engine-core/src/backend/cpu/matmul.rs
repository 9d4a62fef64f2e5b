//! `out[t, o] = sum_i x[t, i] * w[o, i]`: every Linear layer of the model.

use rayon::prelude::*;

use crate::tensor::{Data, Matrix};

/// `x` is `[t, w.cols]`, `out` is `[t, w.rows]`, both row-major f32.
pub fn matmul(x: &[f32], w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len() % k, 0);
    let t = x.len() / k;
    assert_eq!(out.len(), t * n);
    // Reference implementation: one weight row converted to f32 at a time.
    let rows: Vec<usize> = (0..n).collect();
    let cols: Vec<Vec<f32>> = rows
        .par_iter()
        .map(|&o| {
            let mut wr = vec![0.0f32; k];
            match &w.data {
                Data::F32(e) => wr.copy_from_slice(&e[o * k..(o + 1) * k]),
                d => d.to_f32_into(o * k..(o + 1) * k, &mut wr),
            }
            (0..t).map(|r| dot(&x[r * k..(r + 1) * k], &wr)).collect()
        })
        .collect();
    for (o, col) in cols.iter().enumerate() {
        for r in 0..t {
            out[r * n + o] = col[r];
        }
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
