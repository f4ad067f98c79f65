//! Matrix products on the CPU.
//!
//! Prefill multiplies many rows at once: that is a GEMM, done by the `gemm` crate on
//! strided views (bf16 weights on a CPU with AVX-512 BF16: [`super::gemm_bf16`]). Decode
//! multiplies one row (or a few) by a weight matrix: that is bound by reading the
//! weights, so it gets its own kernel that reads each weight row once, straight from its
//! storage dtype (bf16 widening is a shift), for every sequence of the batch.

use super::gemm_bf16;
use super::real::Real;
use super::simd::{
    dot_each_row, dot_wrows, dots_for_row, kernel_order, kernel_order_into, needs_kernel_order,
    Widen,
};
use super::team::SharedBuf;
use crate::model::dtype::{Element, TensorData};
use crate::model::weights::Matrix;
use crate::with_data;
use rayon::prelude::*;

/// A strided read-only matrix view: element `(i, j)` is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct View<'a, F> {
    pub data: &'a [F],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, F> View<'a, F> {
    /// Row-major contiguous `[rows, cols]`.
    pub fn new(data: &'a [F], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }
    pub fn strided(data: &'a [F], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        if rows > 0 && cols > 0 {
            assert!(
                (rows - 1) * rs + (cols - 1) * cs < data.len(),
                "view out of bounds"
            );
        }
        View {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }
    /// Rows `start..end`.
    pub fn rows(self, start: usize, end: usize) -> Self {
        assert!(start <= end && end <= self.rows, "rows out of range");
        let off = if start < end { start * self.rs } else { 0 };
        View {
            data: &self.data[off..],
            rows: end - start,
            ..self
        }
    }
    /// Columns `start..end`.
    pub fn cols(self, start: usize, end: usize) -> Self {
        assert!(start <= end && end <= self.cols, "cols out of range");
        let off = if start < end { start * self.cs } else { 0 };
        View {
            data: &self.data[off..],
            cols: end - start,
            ..self
        }
    }
    pub fn t(self) -> Self {
        View {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// A strided mutable view.
pub struct ViewMut<'a, F> {
    pub data: &'a mut [F],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, F> ViewMut<'a, F> {
    pub fn new(data: &'a mut [F], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }
    pub fn strided(data: &'a mut [F], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        if rows > 0 && cols > 0 {
            assert!(
                (rows - 1) * rs + (cols - 1) * cs < data.len(),
                "view out of bounds"
            );
        }
        ViewMut {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }
}

/// `dst ← keep·dst + scale·(a·b)`, or `dst ← scale·(a·b)` when `keep` is `None`.
/// `threads > 1` lets the gemm crate split the work over rayon.
pub fn gemm<F: Real>(
    dst: ViewMut<F>,
    keep: Option<F>,
    a: View<F>,
    b: View<F>,
    scale: F,
    threads: usize,
) {
    assert!(
        a.cols == b.rows && dst.rows == a.rows && dst.cols == b.cols,
        "gemm shape mismatch"
    );
    let (m, n, k) = (dst.rows, dst.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let d = &mut dst.data[i * dst.rs + j * dst.cs];
                *d = keep.map_or(F::zero(), |c| c * *d);
            }
        }
        return;
    }
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the views were bounds-checked at construction for every index the
    // product touches; dst does not alias a or b (it is a unique borrow).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            dst.cs as isize,
            dst.rs as isize,
            keep.is_some(),
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            keep.unwrap_or(F::zero()),
            scale,
            false,
            false,
            false,
            par,
        )
    }
}

/// Up to this many rows (a decode batch), `x·Wᵀ` runs on the weight-streaming kernel: each
/// weight row is read from memory once and dotted with every input row from L1, where a
/// GEMM would first pack (copy) the whole weight matrix.
pub const STREAM_MAX_ROWS: usize = 64;

/// `out[rows, W.rows] = x[rows, W.cols] · Wᵀ` for a weight matrix in any storage dtype.
pub fn matmul_t<F: Real>(x: &[F], rows: usize, w: &Matrix, out: &mut [F]) {
    assert_eq!(x.len(), rows * w.cols, "matmul_t: x has the wrong length");
    assert_eq!(
        out.len(),
        rows * w.rows,
        "matmul_t: out has the wrong length"
    );
    if rows == 0 {
        return;
    }
    if rows <= STREAM_MAX_ROWS {
        if let Some(x32) = as_f32(x) {
            let out32: &mut [f32] = bytemuck::cast_slice_mut(out);
            return match &w.data {
                TensorData::F32(v) => stream_rows_f32(x32, rows, v, w.rows, w.cols, out32),
                TensorData::BF16(v) => stream_rows_f32(x32, rows, v, w.rows, w.cols, out32),
                TensorData::F16(v) => stream_rows_f32(x32, rows, v, w.rows, w.cols, out32),
                TensorData::F64(v) => stream_rows(x, rows, v, w.rows, w.cols, out),
            };
        }
        return with_data!(&w.data, v => stream_rows(x, rows, v, w.rows, w.cols, out));
    }
    let threads = rayon::current_num_threads();
    let xv = View::new(x, rows, w.cols);
    match as_real::<F>(&w.data) {
        Some(wd) => gemm(
            ViewMut::new(out, rows, w.rows),
            None,
            xv,
            View::new(wd, w.rows, w.cols).t(),
            F::one(),
            threads,
        ),
        None => {
            if let (Some(x32), TensorData::BF16(v)) = (as_f32(x), &w.data) {
                let out32: &mut [f32] = bytemuck::cast_slice_mut(out);
                let split = !crate::options::cpu_fast();
                if gemm_bf16::matmul_t_bf16(x32, rows, (v, w.rows, w.cols), out32, split) {
                    return;
                }
            }
            matmul_t_widened(x, rows, w, out)
        }
    }
}

/// [`matmul_t`] of many rows by 16-bit weights on the `gemm` crate: the weights widened a
/// panel of rows at a time into one buffer, each panel's columns of the output one
/// product. (A fresh copy of the whole matrix per product spent ~12 % of a bf16 prefill at
/// the mamba2-780m shape in page faults and clearing.) The path of f16 weights, and of bf16
/// ones where [`gemm_bf16`] does not apply.
pub fn matmul_t_widened<F: Real>(x: &[F], rows: usize, w: &Matrix, out: &mut [F]) {
    let (n, k) = (w.rows, w.cols);
    let xv = View::new(x, rows, k);
    let panel = WIDEN_PANEL_ROWS.min(n);
    let mut wide = vec![F::zero(); panel * k];
    for j0 in (0..n).step_by(panel) {
        let j1 = (j0 + panel).min(n);
        let part = &mut wide[..(j1 - j0) * k];
        with_data!(&w.data, v => widen_into(&v[j0 * k..j1 * k], part));
        gemm(
            ViewMut::strided(&mut out[j0..], rows, j1 - j0, n, 1),
            None,
            xv,
            View::new(part, j1 - j0, k).t(),
            F::one(),
            rayon::current_num_threads(),
        );
    }
}

/// `x` as `&[f32]` when `F` is f32.
fn as_f32<F: Real>(x: &[F]) -> Option<&[f32]> {
    (std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>()).then(|| bytemuck::cast_slice(x))
}

/// Weight rows widened at a time by [`matmul_t`] for 16-bit weights.
const WIDEN_PANEL_ROWS: usize = 512;

/// The weights as `&[F]` when they are already stored in the arithmetic type.
fn as_real<F: Real>(data: &TensorData) -> Option<&[F]> {
    let any: &dyn std::any::Any = match data {
        TensorData::F32(v) => v,
        TensorData::F64(v) => v,
        _ => return None,
    };
    any.downcast_ref::<Vec<F>>().map(|v| v.as_slice())
}

fn widen_into<F: Real, W: Element>(v: &[W], out: &mut [F]) {
    out.par_chunks_mut(1 << 14)
        .zip(v.par_chunks(1 << 14))
        .for_each(|(o, i)| o.iter_mut().zip(i).for_each(|(o, &i)| *o = F::from_elem(i)));
}

/// Weight-streaming product for a few rows: every weight row is read from memory once and
/// dotted with each of the `rows` inputs while it sits in L1.
fn stream_rows<F: Real, W: Element>(
    x: &[F],
    rows: usize,
    w: &[W],
    n: usize,
    k: usize,
    out: &mut [F],
) {
    let block = stream_block(n, k, rows);
    // tmp is [n, rows] so each task owns a contiguous block; transposed into out after.
    let mut tmp = vec![F::zero(); n * rows];
    tmp.par_chunks_mut(block * rows)
        .enumerate()
        .for_each(|(blk, t)| {
            let r0 = blk * block;
            let wb = &w[r0 * k..(r0 + t.len() / rows) * k];
            dot_block(x, rows, wb, k, t);
        });
    for r in 0..rows {
        for j in 0..n {
            out[r * n + j] = tmp[j * rows + r];
        }
    }
}

/// Weight rows per task: a few tasks per thread, so that scheduling costs stay far below
/// the time to stream the rows (a task per 16 rows cost ~10% of a decode step).
/// Each task also gets at least ~64k multiply-adds, so small models do not pay more for
/// waking threads than they save.
fn stream_block(n: usize, k: usize, rows: usize) -> usize {
    let by_threads = n.div_ceil(4 * rayon::current_num_threads());
    let by_work = (1usize << 16).div_ceil(k * rows);
    by_threads.max(by_work).max(16)
}

/// The f32 case of [`stream_rows`], on the hand-vectorised dot products.
fn stream_rows_f32<W: Widen>(x: &[f32], rows: usize, w: &[W], n: usize, k: usize, out: &mut [f32]) {
    let block = stream_block(n, k, rows);
    let x = &*kernel_order::<W>(x, rows, k);
    let mut tmp = vec![0f32; n * rows];
    tmp.par_chunks_mut(block * rows)
        .enumerate()
        .for_each(|(blk, t)| {
            let r0 = blk * block;
            dots_f32::<W, 8>(x, rows, &w[r0 * k..(r0 + t.len() / rows) * k], k, t);
        });
    for r in 0..rows {
        for j in 0..n {
            out[r * n + j] = tmp[j * rows + r];
        }
    }
}

/// `t[j·rows + r] = ⟨x_r, w_j⟩` for the weight rows `w` (`[t.len() / rows, k]`), `x` in
/// the kernels' [`kernel_order`]: one task's share of a streamed product. A single input
/// row takes f32 weight rows `J` at a time ([`dot_wrows`], the same bits as one at a
/// time); 16-bit rows stay one at a time
/// (four at a time made d_model 768 bf16 decode slower, 14.7 → 17 ms/token; eight, with
/// the prefetch, the mamba-130m bf16 weight stream 14.5–15.4 → 15.7–16.3 ms). `J` = 8
/// where the weights stream from memory (the pool's path, models over 32 MB: d_model 768
/// f32 decode 28 → 20 ms/token at 4, 20 → 18.5 at 8), 4 where they stay in cache (the
/// small step: 8 was 4 % slower at d_model 256). One input row's remaining rows go through
/// [`dot_each_row`], which picks the instruction set once for the share (bf16 stream
/// 27.2–30.1 → 29.5–33.4 GB/s, the two alternated in one process on the EPYC).
fn dots_f32<W: Widen, const J: usize>(x: &[f32], rows: usize, w: &[W], k: usize, t: &mut [f32]) {
    let n = t.len() / rows;
    let mut j = 0;
    if rows == 1 && std::any::TypeId::of::<W>() == std::any::TypeId::of::<f32>() {
        while j + J <= n {
            let mut o = [0f32; J];
            dot_wrows::<W, J>(x, k, &w[j * k..(j + J) * k], &mut o);
            t[j..j + J].copy_from_slice(&o);
            j += J;
        }
    }
    if rows == 1 {
        return dot_each_row(x, k, &w[j * k..], &mut t[j..]);
    }
    for (jj, tj) in t.chunks_mut(rows).enumerate().skip(j) {
        dots_for_row(x, rows, k, &w[jj * k..(jj + 1) * k], tj);
    }
}

/// The input `x` (`rows` rows) of streamed products with `w`, in the kernels' order
/// ([`kernel_order`]): `x` itself, or its reordering in `buf`, a buffer the caller keeps.
/// Reordered once per product and handed to each share's [`stream_part`], nothing is
/// allocated per product or per share.
pub fn stream_input<'a, F: Real>(
    x: &'a [F],
    rows: usize,
    w: &Matrix,
    buf: &'a mut Vec<F>,
) -> &'a [F] {
    let is_f32 = std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>();
    let reorder = is_f32
        && match &w.data {
            TensorData::F32(_) => needs_kernel_order::<f32>(),
            TensorData::BF16(_) => needs_kernel_order::<half::bf16>(),
            TensorData::F16(_) => needs_kernel_order::<half::f16>(),
            TensorData::F64(_) => false,
        };
    if !reorder {
        return x;
    }
    kernel_order_into(x, rows, w.cols, buf);
    buf
}

/// Weight rows `j0..j0 + t.len() / rows` of `w` against the `rows` inputs `xk` (from
/// [`stream_input`] for `w`): `t[(j − j0)·rows + r] = ⟨x_r, w_j⟩`, on the arithmetic of
/// [`matmul_t`]'s weight-streaming path (the same bits). A share of one product, for
/// callers that split the weight rows themselves. `wide`: f32 weight rows 8 at a time
/// rather than 4 (for weights streaming from memory; [`dots_f32`]).
pub fn stream_part<F: Real>(xk: &[F], rows: usize, w: &Matrix, j0: usize, t: &mut [F], wide: bool) {
    let k = w.cols;
    let j1 = j0 + t.len() / rows;
    assert!(
        t.len().is_multiple_of(rows) && j1 <= w.rows && xk.len() == rows * k,
        "stream_part: shapes"
    );
    if std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>() {
        let x32: &[f32] = bytemuck::cast_slice(xk);
        let t32: &mut [f32] = bytemuck::cast_slice_mut(t);
        fn part<W: Widen>(x: &[f32], rows: usize, w: &[W], k: usize, t: &mut [f32], wide: bool) {
            if wide {
                dots_f32::<W, 8>(x, rows, w, k, t)
            } else {
                dots_f32::<W, 4>(x, rows, w, k, t)
            }
        }
        match &w.data {
            TensorData::F32(v) => return part(x32, rows, &v[j0 * k..j1 * k], k, t32, wide),
            TensorData::BF16(v) => return part(x32, rows, &v[j0 * k..j1 * k], k, t32, wide),
            TensorData::F16(v) => return part(x32, rows, &v[j0 * k..j1 * k], k, t32, wide),
            TensorData::F64(_) => {}
        }
    }
    with_data!(&w.data, v => dot_block(xk, rows, &v[j0 * k..j1 * k], k, t))
}

/// Weight rows per piece when a team's members take a product's rows piece by piece
/// ([`crate::cpu::team::Member::chunks`]): about 128 KB of weights (~10 µs to stream; a
/// piece costs an atomic add on a line the members share), a multiple of 16 rows.
pub fn piece_rows(w: &Matrix) -> usize {
    let row_bytes = (w.cols * w.data.dtype().size()).max(1);
    ((128 << 10) / row_bytes).next_multiple_of(16).max(16)
}

/// Columns `js` of `out[rows, W.rows] = x·Wᵀ` (every input row against the weight rows
/// `js`) on the weight-streaming kernel, `xk` from [`stream_input`]: the bits of
/// [`matmul_t`]. A member of a thread team's share of a product; with several rows the
/// share goes through `tmp` (`[W.rows, rows]`) to be transposed.
///
/// # Safety
/// No one else reads or writes `out`'s columns `js` (in any row) or `tmp`'s entries
/// `js.start·rows .. js.end·rows` until the next barrier of the team.
pub unsafe fn product_cols<F: Real>(
    xk: &[F],
    rows: usize,
    w: &Matrix,
    js: std::ops::Range<usize>,
    (out, tmp): (&SharedBuf<F>, &SharedBuf<F>),
    wide: bool,
) {
    let n = w.rows;
    if js.is_empty() {
        return;
    }
    if rows == 1 {
        return stream_part(xk, 1, w, js.start, out.part(js), wide);
    }
    let t = tmp.part(js.start * rows..js.end * rows);
    stream_part(xk, rows, w, js.start, t, wide);
    for b in 0..rows {
        let o = out.part(b * n + js.start..b * n + js.end);
        for (jj, o) in o.iter_mut().enumerate() {
            *o = t[jj * rows + b];
        }
    }
}

fn dot_block<F: Real, W: Element>(x: &[F], rows: usize, w: &[W], k: usize, t: &mut [F]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected on this CPU.
        return unsafe { dot_block_avx2(x, rows, w, k, t) };
    }
    dot_block_impl::<F, W, false>(x, rows, w, k, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_block_avx2<F: Real, W: Element>(
    x: &[F],
    rows: usize,
    w: &[W],
    k: usize,
    t: &mut [F],
) {
    dot_block_impl::<F, W, true>(x, rows, w, k, t)
}

#[inline(always)]
fn dot_block_impl<F: Real, W: Element, const FMA: bool>(
    x: &[F],
    rows: usize,
    w: &[W],
    k: usize,
    t: &mut [F],
) {
    for (j, wr) in w.chunks_exact(k).enumerate() {
        for r in 0..rows {
            t[j * rows + r] = dot::<F, W, FMA>(&x[r * k..(r + 1) * k], wr);
        }
    }
}

/// `Σ x_i·w_i` with 16 independent accumulators (so the loop vectorises and pipelines).
#[inline(always)]
pub fn dot<F: Real, W: Element, const FMA: bool>(x: &[F], w: &[W]) -> F {
    const L: usize = 16;
    let mut acc = [F::zero(); L];
    let n = x.len() / L * L;
    for (xc, wc) in x[..n].chunks_exact(L).zip(w[..n].chunks_exact(L)) {
        for i in 0..L {
            let wv = F::from_elem(wc[i]);
            acc[i] = if FMA {
                xc[i].mul_add(wv, acc[i])
            } else {
                acc[i] + xc[i] * wv
            };
        }
    }
    let mut s = F::zero();
    for (&xv, &wv) in x[n..].iter().zip(&w[n..]) {
        s = s + xv * F::from_elem(wv);
    }
    let mut width = L;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] = acc[i] + acc[i + width];
        }
    }
    acc[0] + s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dtype::DType;
    use crate::model::rng::Rng;

    fn naive(x: &[f64], rows: usize, w: &Matrix) -> Vec<f64> {
        let mut out = vec![0.0; rows * w.rows];
        for r in 0..rows {
            for j in 0..w.rows {
                out[r * w.rows + j] = (0..w.cols)
                    .map(|c| x[r * w.cols + c] * w.data.get_f64(j * w.cols + c))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn matmul_t_of_many_rows_widens_16_bit_weights_panel_by_panel() {
        // Over STREAM_MAX_ROWS rows: the GEMM path; over two panels of weight rows, the
        // last one partial.
        let mut rng = Rng::new(2);
        let (rows, n, k) = (STREAM_MAX_ROWS + 6, 2 * WIDEN_PANEL_ROWS + 37, 24);
        for dtype in [DType::BF16, DType::F16] {
            let w = Matrix {
                rows: n,
                cols: k,
                data: TensorData::F64((0..n * k).map(|_| rng.normal()).collect()).convert(dtype),
            };
            let x: Vec<f64> = (0..rows * k).map(|_| rng.normal()).collect();
            let want = naive(&x, rows, &w);
            let mut got = vec![0.0f64; rows * n];
            matmul_t(&x, rows, &w, &mut got);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-9, "{dtype}: worst difference {worst}");
        }
    }

    #[test]
    fn matmul_t_matches_naive_for_every_dtype_and_row_count() {
        let mut rng = Rng::new(1);
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            for rows in [1, 3, 8, 9, 40] {
                let (n, k) = (37, 53);
                let w = Matrix {
                    rows: n,
                    cols: k,
                    data: TensorData::F64((0..n * k).map(|_| rng.normal()).collect())
                        .convert(dtype),
                };
                let x: Vec<f64> = (0..rows * k).map(|_| rng.normal()).collect();
                let want = naive(&x, rows, &w);
                let mut got = vec![0.0f64; rows * n];
                matmul_t(&x, rows, &w, &mut got);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-9, "{dtype} rows {rows}: {a} vs {b}");
                }
                let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
                let mut got32 = vec![0.0f32; rows * n];
                matmul_t(&x32, rows, &w, &mut got32);
                for (a, b) in got32.iter().zip(&want) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-4,
                        "{dtype} rows {rows} f32: {a} vs {b}"
                    );
                }
            }
        }
    }
}
