//! One door to the `gemm` crate: single-threaded f32 products of strided matrices (callers
//! parallelise over blocks themselves). Attention (a page's strided key and value rows) and the
//! delta rule's chunks call [`product`], which checks its views and also runs on wasm32, where
//! there is no `gemm` crate; matmul, whose tasks write disjoint columns of one output, calls
//! the raw form.

/// An f32 matrix inside some buffer: element `(r, c)` at `ptr + r * rs + c * cs`.
#[cfg(not(target_arch = "wasm32"))]
#[derive(Clone, Copy)]
pub(crate) struct View {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}

/// `dst[m, n] = lhs[m, k] * rhs[k, n]` (or `+=` with `accumulate`), `dst` row-major with row
/// stride `dst_rs`.
///
/// # Safety
/// Every element the three views address for these shapes must lie inside live buffers, and
/// no one else may read or write `dst`'s elements during the call.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) unsafe fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    lhs: View,
    rhs: View,
    accumulate: bool,
) {
    // SAFETY: forwarded from this function's contract; without `accumulate` (read_dst false,
    // alpha 0) dst is only written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.ptr,
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.ptr,
            rhs.cs as isize,
            rhs.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// A matrix inside a slice: element `(r, c)` at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// `rows` rows of `cols` values, each `stride` after the one before.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize, stride: usize) -> Mat<'a> {
        Mat {
            data,
            rows,
            cols,
            rs: stride,
            cs: 1,
        }
    }

    /// The transpose, as a view.
    pub fn t(self) -> Mat<'a> {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element lies inside `data`.
    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }
}

/// `dst = lhs * rhs` (or `+=` with `accumulate`), `dst` row-major `[lhs.rows, rhs.cols]`.
pub(crate) fn product(dst: &mut [f32], lhs: Mat, rhs: Mat, accumulate: bool) {
    assert!(lhs.cols == rhs.rows && lhs.fits() && rhs.fits());
    assert_eq!(dst.len(), lhs.rows * rhs.cols);
    if dst.is_empty() || lhs.cols == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let view = |m: Mat| View {
            ptr: m.data.as_ptr(),
            rs: m.rs,
            cs: m.cs,
        };
        let shape = (lhs.rows, rhs.cols, lhs.cols);
        // SAFETY: both views lie inside their slices (asserted above), `dst` is exactly
        // `[lhs.rows, rhs.cols]` and borrowed mutably, so nothing else touches it.
        unsafe {
            gemm_f32(
                shape,
                dst.as_mut_ptr(),
                rhs.cols,
                view(lhs),
                view(rhs),
                accumulate,
            )
        }
    }
    #[cfg(target_arch = "wasm32")]
    for (i, row) in dst.chunks_exact_mut(rhs.cols).enumerate() {
        if !accumulate {
            row.fill(0.0);
        }
        for p in 0..lhs.cols {
            let a = lhs.data[i * lhs.rs + p * lhs.cs];
            for (j, d) in row.iter_mut().enumerate() {
                *d += a * rhs.data[p * rhs.rs + j * rhs.cs];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{product, Mat};

    /// Strided and transposed views, with and without accumulating, against the plain sums.
    #[test]
    fn product_matches_the_sums() {
        let (m, k, n) = (5, 7, 3);
        // lhs: [m, k] as rows of a wider buffer (stride 9); rhs: [k, n] stored transposed.
        let a: Vec<f32> = (0..m * 9).map(|i| (i % 11) as f32 - 5.0).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
        let lhs = Mat::rows(&a, m, k, 9);
        let rhs = Mat::rows(&bt, n, k, k).t();
        let want: Vec<f32> = (0..m * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                (0..k).map(|p| a[i * 9 + p] * bt[j * k + p]).sum()
            })
            .collect();
        let mut dst = vec![f32::NAN; m * n];
        product(&mut dst, lhs, rhs, false);
        assert_eq!(dst, want);
        product(&mut dst, lhs, rhs, true);
        assert_eq!(dst, want.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
    }
}
