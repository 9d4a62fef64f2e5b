//! One door to the `gemm` crate: a single-threaded f32 product of strided matrices. Matmul
//! (widened weight blocks) and attention (a page's strided key and value rows) both go
//! through it, so its 19-argument, unsafe call is written once.

/// An f32 matrix inside some buffer: element `(r, c)` at `ptr + r * rs + c * cs`.
#[derive(Clone, Copy)]
pub(crate) struct View {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}

/// `dst[m, n] = lhs[m, k] * rhs[k, n]`, `dst` row-major with row stride `dst_rs`, on the
/// calling thread (callers parallelise over blocks themselves).
///
/// # Safety
/// Every element the three views address for these shapes must lie inside live buffers, and
/// no one else may read or write `dst`'s elements during the call.
pub(crate) unsafe fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: View,
    rhs: View,
) {
    // SAFETY: forwarded from this function's contract; read_dst = false, so dst is only
    // written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            lhs.ptr,
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.ptr,
            rhs.cs as isize,
            rhs.rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}
