//! Hand-vectorised dot products for the weight-streaming matmul (decode): f32 activations
//! against f32, bf16 or f16 weight rows, AVX-512 or AVX2+FMA picked at run time.
//!
//! The compiler does not vectorise a float reduction by itself (it may not reorder the
//! additions), and widening bf16 is a shift the autovectoriser handles poorly; both are
//! spelled out here. Each call computes `R` dot products of one weight row with `R`
//! activation rows, so a weight row is loaded from memory once for the whole batch.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::model::dtype::Element;
use half::{bf16, f16};

/// How far ahead of the element being read a weight row is prefetched. One core streams
/// bf16 rows at ~9.5 GB/s on its own and ~10.5 with this; the two cores of the 2-core Xeon
/// a batch-1 step's weights at 15 → 17–18 GB/s (`benches/decode_gemv.rs`).
const PREFETCH_BYTES: usize = 4096;

/// Ask for the cache line [`PREFETCH_BYTES`] past `p` into L2 (a hint: past the end is
/// harmless). Into L2, not L1: on the EPYC the step's bf16 stream read 20–24 → 25–27 GB/s
/// and the f32 one 21–28 → 23–34 (the hints alternated in one process, decisions.md).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch<W>(p: *const W) {
    _mm_prefetch::<_MM_HINT_T2>((p as *const i8).wrapping_add(PREFETCH_BYTES));
}

/// Which instruction set the host offers, detected once.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// A weight element that can be widened to f32 vectors.
///
/// # Safety
/// `load8`/`load16` read 8/16 elements starting at `p`: the caller guarantees they are in
/// bounds and that the CPU has the features the vector types need (AVX2/F16C, AVX-512).
pub trait Widen: Element {
    /// 8 elements at `p` as f32.
    ///
    /// # Safety
    /// `p..p+8` in bounds; AVX2 and F16C present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
    /// 16 elements at `p` as f32.
    ///
    /// # Safety
    /// `p..p+16` in bounds; AVX-512F/BW present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;
    /// 32 elements at `p` as two f32 vectors: elements 0..16 and 16..32, or for a type
    /// with [`Widen::PAIRED`] the even and the odd elements.
    ///
    /// # Safety
    /// `p..p+32` in bounds; AVX-512F/BW present.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load32(p: *const Self) -> (__m512, __m512) {
        (Self::load16(p), Self::load16(p.add(16)))
    }
    /// Whether [`Widen::load32`] splits even from odd elements, so that the activations
    /// must be in [`kernel_order`] on AVX-512.
    const PAIRED: bool = false;
}

/// `x` (`rows` rows of `k`) in the order the dot kernels read it for weights of type `W`:
/// as is, except for bf16 weights on AVX-512, where each whole block of 32 of a row holds
/// its 16 even entries, then its 16 odd ones (the tail past the last block stays as is).
/// bf16 widens to f32 by a shift of its bits; a 64-byte load of 32 bf16 then gives the
/// even elements by a shift and the odd ones by a mask, where widening in order costs a
/// shuffle per 16: the weight stream of a batch-1 step read 10.1–10.3 → 10.9–11.4 GB/s on
/// one core, 14.8–15.8 → 13.7–14.4 ms for the mamba-130m shape on two
/// (`benches/decode_gemv.rs`, 2-core Xeon, load ~2.5).
pub fn kernel_order<W: Widen>(x: &[f32], rows: usize, k: usize) -> std::borrow::Cow<'_, [f32]> {
    if !needs_kernel_order::<W>() {
        return std::borrow::Cow::Borrowed(x);
    }
    let mut o = Vec::new();
    kernel_order_into(x, rows, k, &mut o);
    std::borrow::Cow::Owned(o)
}

/// Whether [`kernel_order`] reorders the activations for weights of type `W` on this host.
pub fn needs_kernel_order<W: Widen>() -> bool {
    W::PAIRED && isa() == Isa::Avx512
}

/// The reordering of [`kernel_order`] (whether or not `W` needs it) into `o`, a buffer the
/// caller keeps: a decode step reorders an input per product, and a fresh vector each time
/// was an allocation per product.
pub fn kernel_order_into<T: Copy>(x: &[T], rows: usize, k: usize, o: &mut Vec<T>) {
    o.clear();
    o.extend_from_slice(&x[..rows * k]);
    for (orow, xrow) in o.chunks_exact_mut(k).zip(x.chunks_exact(k)) {
        for (ob, xb) in orow.chunks_exact_mut(32).zip(xrow.chunks_exact(32)) {
            for t in 0..16 {
                ob[t] = xb[2 * t];
                ob[16 + t] = xb[2 * t + 1];
            }
        }
    }
}

impl Widen for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Widen for bf16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load32(p: *const Self) -> (__m512, __m512) {
        let v = _mm512_loadu_si512(p as *const __m512i);
        let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
        (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)),
            _mm512_castsi512_ps(odd),
        )
    }
    const PAIRED: bool = true;
}

impl Widen for f16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// `out[r] = Σ_i x[r·k + i]·w[i]` for `r < R`, on the best ISA of this host; `x` in
/// [`kernel_order`].
#[inline]
pub fn dot_rows<W: Widen, const R: usize>(x: &[f32], k: usize, w: &[W], out: &mut [f32; R]) {
    assert!(x.len() >= R * k && w.len() >= k);
    #[cfg(target_arch = "x86_64")]
    match isa() {
        // SAFETY: the ISA was detected on this CPU; every load is within `k` of its row
        // start, checked by the assert above and the loop bounds below.
        Isa::Avx512 => return unsafe { dot_rows_avx512::<W, R>(x, k, w, out) },
        Isa::Avx2 => return unsafe { dot_rows_avx2::<W, R>(x, k, w, out) },
        Isa::Scalar => {}
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = x[r * k..(r + 1) * k]
            .iter()
            .zip(w)
            .map(|(&a, &b)| a * b.to_f32())
            .sum();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dot_rows_avx512<W: Widen, const R: usize>(
    x: &[f32],
    k: usize,
    w: &[W],
    out: &mut [f32; R],
) {
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    // Two tiles per iteration so each accumulator chain has two FMAs in flight.
    let mut a0 = [_mm512_setzero_ps(); R];
    let mut a1 = [_mm512_setzero_ps(); R];
    let mut i = 0;
    while i + 32 <= k {
        prefetch(wp.add(i));
        let (w0, w1) = W::load32(wp.add(i));
        for r in 0..R {
            a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(r * k + i)), w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(r * k + i + 16)), w1, a1[r]);
        }
        i += 32;
    }
    while i + 16 <= k {
        let w0 = W::load16(wp.add(i));
        for r in 0..R {
            a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(r * k + i)), w0, a0[r]);
        }
        i += 16;
    }
    for r in 0..R {
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
        for j in i..k {
            s += *xp.add(r * k + j) * (*wp.add(j)).to_f32();
        }
        out[r] = s;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows_avx2<W: Widen, const R: usize>(
    x: &[f32],
    k: usize,
    w: &[W],
    out: &mut [f32; R],
) {
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut a0 = [_mm256_setzero_ps(); R];
    let mut a1 = [_mm256_setzero_ps(); R];
    let mut i = 0;
    while i + 16 <= k {
        let w0 = W::load8(wp.add(i));
        let w1 = W::load8(wp.add(i + 8));
        for r in 0..R {
            a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(r * k + i)), w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(r * k + i + 8)), w1, a1[r]);
        }
        i += 16;
    }
    for r in 0..R {
        let v = _mm256_add_ps(a0[r], a1[r]);
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_shuffle_ps::<1>(h, h));
        let mut s = _mm_cvtss_f32(h);
        for j in i..k {
            s += *xp.add(r * k + j) * (*wp.add(j)).to_f32();
        }
        out[r] = s;
    }
}

/// `out[j] = Σ_i x[i]·w[j·k + i]` for `j < J`: one activation row (in [`kernel_order`])
/// against `J` consecutive weight rows. Each output is computed with exactly the operations of
/// `dot_rows::<W, 1>` on its weight row (the same bits); interleaving `J` independent
/// rows keeps more loads in flight, which is what a single-row product is bound by.
#[inline]
pub fn dot_wrows<W: Widen, const J: usize>(x: &[f32], k: usize, w: &[W], out: &mut [f32; J]) {
    assert!(x.len() >= k && w.len() >= J * k);
    #[cfg(target_arch = "x86_64")]
    match isa() {
        // SAFETY: the ISA was detected on this CPU; every load is within `k` of its row
        // start, checked by the assert above and the loop bounds below.
        Isa::Avx512 => return unsafe { dot_wrows_avx512::<W, J>(x, k, w, out) },
        Isa::Avx2 => return unsafe { dot_wrows_avx2::<W, J>(x, k, w, out) },
        Isa::Scalar => {}
    }
    for (j, o) in out.iter_mut().enumerate() {
        let mut one = [0f32; 1];
        dot_rows::<W, 1>(x, k, &w[j * k..(j + 1) * k], &mut one);
        *o = one[0];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dot_wrows_avx512<W: Widen, const J: usize>(
    x: &[f32],
    k: usize,
    w: &[W],
    out: &mut [f32; J],
) {
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut a0 = [_mm512_setzero_ps(); J];
    let mut a1 = [_mm512_setzero_ps(); J];
    let mut i = 0;
    while i + 32 <= k {
        let (x0, x1) = (_mm512_loadu_ps(xp.add(i)), _mm512_loadu_ps(xp.add(i + 16)));
        for j in 0..J {
            prefetch(wp.add(j * k + i));
            let (w0, w1) = W::load32(wp.add(j * k + i));
            a0[j] = _mm512_fmadd_ps(x0, w0, a0[j]);
            a1[j] = _mm512_fmadd_ps(x1, w1, a1[j]);
        }
        i += 32;
    }
    while i + 16 <= k {
        let x0 = _mm512_loadu_ps(xp.add(i));
        for j in 0..J {
            a0[j] = _mm512_fmadd_ps(x0, W::load16(wp.add(j * k + i)), a0[j]);
        }
        i += 16;
    }
    for j in 0..J {
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
        for t in i..k {
            s += *xp.add(t) * (*wp.add(j * k + t)).to_f32();
        }
        out[j] = s;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_wrows_avx2<W: Widen, const J: usize>(
    x: &[f32],
    k: usize,
    w: &[W],
    out: &mut [f32; J],
) {
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut a0 = [_mm256_setzero_ps(); J];
    let mut a1 = [_mm256_setzero_ps(); J];
    let mut i = 0;
    while i + 16 <= k {
        let (x0, x1) = (_mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(xp.add(i + 8)));
        for j in 0..J {
            a0[j] = _mm256_fmadd_ps(x0, W::load8(wp.add(j * k + i)), a0[j]);
            a1[j] = _mm256_fmadd_ps(x1, W::load8(wp.add(j * k + i + 8)), a1[j]);
        }
        i += 16;
    }
    for j in 0..J {
        let v = _mm256_add_ps(a0[j], a1[j]);
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_shuffle_ps::<1>(h, h));
        let mut s = _mm_cvtss_f32(h);
        for t in i..k {
            s += *xp.add(t) * (*wp.add(j * k + t)).to_f32();
        }
        out[j] = s;
    }
}

/// `t[j] = ⟨x, w_j⟩` for each weight row `w_j` of `w` (`[t.len(), k]`), one activation row
/// `x` in [`kernel_order`]: [`dot_rows`] with one row, its instruction set picked once for
/// all the rows rather than per row (the same bits).
pub fn dot_each_row<W: Widen>(x: &[f32], k: usize, w: &[W], t: &mut [f32]) {
    assert!(x.len() >= k && w.len() >= t.len() * k);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: AVX-512 was detected on this CPU; each row is `k` elements of `w`, in
        // bounds by the assert above.
        return unsafe { each_row_avx512(x, k, w, t) };
    }
    for (j, o) in t.iter_mut().enumerate() {
        let mut r = [0f32; 1];
        dot_rows::<W, 1>(x, k, &w[j * k..(j + 1) * k], &mut r);
        *o = r[0];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn each_row_avx512<W: Widen>(x: &[f32], k: usize, w: &[W], t: &mut [f32]) {
    for (j, o) in t.iter_mut().enumerate() {
        let mut r = [0f32; 1];
        dot_rows_avx512::<W, 1>(x, k, &w[j * k..(j + 1) * k], &mut r);
        *o = r[0];
    }
}

/// `t[r] = ⟨x_r, w⟩` for every one of `rows` activation rows (`x` is `[rows, k]`, in
/// [`kernel_order`]),
/// in groups of 8, 4, 2 and 1 rows.
pub fn dots_for_row<W: Widen>(x: &[f32], rows: usize, k: usize, w: &[W], t: &mut [f32]) {
    let mut r = 0;
    macro_rules! group {
        ($n:literal) => {
            while rows - r >= $n {
                let mut o = [0f32; $n];
                dot_rows::<W, $n>(&x[r * k..(r + $n) * k], k, w, &mut o);
                t[r..r + $n].copy_from_slice(&o);
                r += $n;
            }
        };
    }
    group!(8);
    group!(4);
    group!(2);
    group!(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rng::Rng;

    fn check<W: Widen>(conv: fn(f32) -> W) {
        let mut rng = Rng::new(3);
        for k in [1, 15, 16, 31, 32, 33, 100, 768] {
            let x: Vec<f32> = (0..4 * k).map(|_| rng.normal() as f32).collect();
            let w: Vec<W> = (0..k).map(|_| conv(rng.normal() as f32)).collect();
            let mut out = [0f32; 4];
            dot_rows::<W, 4>(&kernel_order::<W>(&x, 4, k), k, &w, &mut out);
            for r in 0..4 {
                let want: f64 = (0..k).map(|i| x[r * k + i] as f64 * w[i].to_f64()).sum();
                assert!(
                    (out[r] as f64 - want).abs() < 1e-4 * (k as f64).sqrt(),
                    "k {k} row {r}"
                );
            }
        }
    }

    /// The interleaved kernel and the per-share loop give each weight row the bits of the
    /// one-row kernel.
    fn check_wrows<W: Widen>(conv: fn(f32) -> W) {
        let mut rng = Rng::new(5);
        for k in [1, 15, 16, 31, 32, 33, 100, 768] {
            let x: Vec<f32> = (0..k).map(|_| rng.normal() as f32).collect();
            let w: Vec<W> = (0..8 * k).map(|_| conv(rng.normal() as f32)).collect();
            let x = kernel_order::<W>(&x, 1, k);
            let mut four = [0f32; 4];
            dot_wrows::<W, 4>(&x, k, &w, &mut four);
            let mut eight = [0f32; 8];
            dot_wrows::<W, 8>(&x, k, &w, &mut eight);
            let mut each = [0f32; 8];
            dot_each_row::<W>(&x, k, &w, &mut each);
            for j in 0..8 {
                let mut one = [0f32; 1];
                dot_rows::<W, 1>(&x, k, &w[j * k..(j + 1) * k], &mut one);
                assert_eq!(eight[j].to_bits(), one[0].to_bits(), "k {k} weight row {j}");
                assert_eq!(each[j].to_bits(), one[0].to_bits(), "k {k} weight row {j}");
                if j < 4 {
                    assert_eq!(four[j].to_bits(), one[0].to_bits(), "k {k} weight row {j}");
                }
            }
        }
    }

    #[test]
    fn dot_wrows_and_dot_each_row_give_the_bits_of_dot_rows() {
        check_wrows::<f32>(|v| v);
        check_wrows::<bf16>(bf16::from_f32);
        check_wrows::<f16>(f16::from_f32);
    }

    #[test]
    fn dot_rows_matches_f64_for_each_weight_type() {
        check::<f32>(|v| v);
        check::<bf16>(bf16::from_f32);
        check::<f16>(f16::from_f32);
    }
}
