//! The many-row product `out = x·Wᵀ` of a bf16 weight matrix on AVX-512 BF16
//! (`vdpbf16ps`: 32 bf16 products summed pairwise into 16 f32 lanes per instruction).
//!
//! The activations become bf16 once per product, in one of two ways. Split (the default):
//! `x = hi + lo`, both bf16, each multiplied — 16 bits of each activation's mantissa, the
//! accuracy of widening the weights to f32, at twice the instructions. Rounded (`--fast`):
//! `hi` alone, as the GPU's tensor cores and llama.cpp multiply — twice as fast again,
//! and on the `mimo-mlp-norm` fixture 1.08e-2 from the goldens in bf16 against 8.7e-3
//! (docs/decisions.md, "bf16 products on AVX-512 BF16"). Every sum accumulates in f32.
//! Without the instructions a bf16 product widens its weights to f32 for the `gemm`
//! crate, which runs at f32's rate on twice the bytes.
//!
//! Layout. A weight row `W[j, ·]` is read in place: its elements `2p, 2p+1` are one 32-bit
//! word, broadcast to every lane. The activations are packed per tile of [`TILE`] rows:
//! `xp[p][part][i]` holds the pair `(x[i, 2p], x[i, 2p+1])` of the tile's row `i` (its
//! `hi`, then its `lo` when split), so one instruction multiplies a weight pair into 16
//! rows. A micro-kernel keeps `MR` weight rows × 48 activation rows of sums in 24
//! registers over the whole of `k`: each output's sum runs in one fixed order whatever the
//! number of rows, so a row's result does not depend on the rows beside it.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::team::SharedBuf;
use half::bf16;
use rayon::prelude::*;

/// Activation rows per tile: three vectors of 16 lanes.
const TILE: usize = 48;
/// Weight rows per micro-kernel: 8 × 3 accumulators + 3 activation vectors + 1 broadcast of
/// the 32 vector registers.
const MR: usize = 8;
/// Packed activations a thread works through per weight panel: tiles are grouped so that a
/// group (`k/2 · TILE · 4` bytes a tile) stays in the 1 MB L2 while each panel of `MR`
/// weight rows, read from memory once per group, is reused from L1 across its tiles.
const GROUP_BYTES: usize = 512 << 10;

/// Whether this CPU runs [`matmul_t_bf16`].
pub fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// `out[rows, n] = x[rows, k] · W[n, k]ᵀ`, f32 sums, `x` split into two bf16 parts or (not
/// `split`) rounded to one. Returns `false`, writing nothing, where it does not apply: a
/// CPU without AVX-512 BF16, or an odd `k` (a weight row's pairs would straddle rows).
pub fn matmul_t_bf16(
    x: &[f32],
    rows: usize,
    (w, n, k): (&[bf16], usize, usize),
    out: &mut [f32],
    split: bool,
) -> bool {
    assert!(
        x.len() == rows * k && w.len() == n * k && out.len() == rows * n,
        "matmul_t_bf16: shapes"
    );
    if !available() || !k.is_multiple_of(2) || rows == 0 || n == 0 {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let parts = if split { 2 } else { 1 };
        let tile_len = parts * (k / 2) * TILE;
        let tiles = rows.div_ceil(TILE);
        let mut xp = vec![0u32; tiles * tile_len];
        xp.par_chunks_mut(tile_len)
            .enumerate()
            .for_each(|(t, tile)| pack_tile(x, rows, k, t, tile, split));
        let group = (GROUP_BYTES / (tile_len * 4)).clamp(1, tiles);
        let panels = n.div_ceil(MR);
        // A few tasks per thread, whole panels each.
        let per_task = panels.div_ceil(4 * rayon::current_num_threads()).max(1);
        let shared = SharedBuf::new(out);
        for t0 in (0..tiles).step_by(group) {
            let t1 = (t0 + group).min(tiles);
            (0..panels.div_ceil(per_task))
                .into_par_iter()
                .for_each(|task| {
                    let p1 = ((task + 1) * per_task).min(panels);
                    for panel in task * per_task..p1 {
                        let j0 = panel * MR;
                        for t in t0..t1 {
                            let tile = &xp[t * tile_len..(t + 1) * tile_len];
                            // SAFETY: the features were detected; every task writes only its
                            // own panels' columns of `out`.
                            unsafe {
                                if split {
                                    panel_tile::<2>((w, n, k), j0, tile, (t, rows), &shared)
                                } else {
                                    panel_tile::<1>((w, n, k), j0, tile, (t, rows), &shared)
                                }
                            };
                        }
                    }
                });
        }
    }
    true
}

/// Packs tile `t` of `x` into `tile` (`[k/2][parts][TILE]` pairs: the high parts, then
/// when `split` the low parts), rows past `rows` left zero.
#[cfg(target_arch = "x86_64")]
fn pack_tile(x: &[f32], rows: usize, k: usize, t: usize, tile: &mut [u32], split: bool) {
    let (kp, parts) = (k / 2, if split { 2 } else { 1 });
    let mut pairs = vec![0u32; 2 * kp];
    for i in 0..TILE.min(rows - t * TILE) {
        let row = &x[(t * TILE + i) * k..(t * TILE + i + 1) * k];
        // SAFETY: `available()` was checked by the caller.
        unsafe { split_pairs(row, &mut pairs) };
        for p in 0..kp {
            tile[parts * p * TILE + i] = pairs[p];
            if split {
                tile[(2 * p + 1) * TILE + i] = pairs[kp + p];
            }
        }
    }
}

/// `row` (even length) split as `hi + lo`, both bf16 (`hi` rounded to nearest, `lo` the
/// rest rounded): `pairs[..k/2]` the pairs `(hi[2p], hi[2p+1])`, low element first,
/// `pairs[k/2..]` those of `lo`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn split_pairs(row: &[f32], pairs: &mut [u32]) {
    let kp = row.len() / 2;
    let mut p = 0;
    while 2 * p + 32 <= row.len() {
        let a = _mm512_loadu_ps(row.as_ptr().add(2 * p));
        let b = _mm512_loadu_ps(row.as_ptr().add(2 * p + 16));
        let bits = |h: __m256bh| std::mem::transmute::<__m256bh, __m256i>(h);
        let (ha, hb) = (bits(_mm512_cvtneps_pbh(a)), bits(_mm512_cvtneps_pbh(b)));
        let hi_bits = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ha), hb);
        // bf16 → f32 is a shift into the high half of a 32-bit lane.
        let widen =
            |h: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        // The second operand fills the low 16 halves: the elements stay in order.
        let lo: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(
            _mm512_sub_ps(b, widen(hb)),
            _mm512_sub_ps(a, widen(ha)),
        ));
        _mm512_storeu_si512(pairs.as_mut_ptr().add(p) as *mut _, hi_bits);
        _mm512_storeu_si512(pairs.as_mut_ptr().add(kp + p) as *mut _, lo);
        p += 16;
    }
    for q in p..kp {
        let split = |v: f32| {
            let hi = bf16::from_f32(v);
            (
                hi.to_bits() as u32,
                bf16::from_f32(v - hi.to_f32()).to_bits() as u32,
            )
        };
        let ((h0, l0), (h1, l1)) = (split(row[2 * q]), split(row[2 * q + 1]));
        pairs[q] = h0 | h1 << 16;
        pairs[kp + q] = l0 | l1 << 16;
    }
}

/// Weight rows `j0..j0 + MR` (fewer at the end) of `w` `[n, k]` against tile `t` of the
/// `rows`, packed in `PARTS` parts, into `out`.
///
/// # Safety
/// AVX-512F and BF16 present; no one else writes these columns of `out` meanwhile.
#[cfg(target_arch = "x86_64")]
unsafe fn panel_tile<const PARTS: usize>(
    (w, n, k): (&[bf16], usize, usize),
    j0: usize,
    tile: &[u32],
    (t, rows): (usize, usize),
    out: &SharedBuf<f32>,
) {
    let mut sums = [[0f32; TILE]; MR];
    let mr = MR.min(n - j0);
    let wp = w.as_ptr().add(j0 * k);
    match mr {
        MR => micro::<MR, PARTS>(wp, k, tile, &mut sums),
        _ => {
            for r in 0..mr {
                let mut one = [[0f32; TILE]; 1];
                micro::<1, PARTS>(wp.add(r * k), k, tile, &mut one);
                sums[r] = one[0];
            }
        }
    }
    for i in 0..TILE.min(rows - t * TILE) {
        let row = t * TILE + i;
        let dst = out.part(row * n + j0..row * n + j0 + mr);
        for (r, d) in dst.iter_mut().enumerate() {
            *d = sums[r][i];
        }
    }
}

/// `sums[r][i] = Σ_p Σ_part ⟨W[r, 2p..2p+2], tile[p][part][i]⟩` for `R` weight rows at `w`
/// (row stride `k`) over the whole tile, the sums in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro<const R: usize, const PARTS: usize>(
    w: *const bf16,
    k: usize,
    tile: &[u32],
    sums: &mut [[f32; TILE]; R],
) {
    let mut acc = [[_mm512_setzero_ps(); 3]; R];
    let xp = tile.as_ptr();
    let ld = |off: usize| -> __m512bh {
        std::mem::transmute(_mm512_loadu_si512(xp.add(off) as *const _))
    };
    for p in 0..k / 2 {
        let o = PARTS * p * TILE;
        let hi = [ld(o), ld(o + 16), ld(o + 32)];
        // (`lo` is read only when there are two parts; the compiler drops it otherwise)
        let lo = if PARTS == 2 {
            [ld(o + TILE), ld(o + TILE + 16), ld(o + TILE + 32)]
        } else {
            hi
        };
        for (r, a) in acc.iter_mut().enumerate() {
            let pair = (w.add(r * k + 2 * p) as *const i32).read_unaligned();
            let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
            for v in 0..3 {
                a[v] = _mm512_dpbf16_ps(a[v], b, hi[v]);
                if PARTS == 2 {
                    a[v] = _mm512_dpbf16_ps(a[v], b, lo[v]);
                }
            }
        }
    }
    for (s, a) in sums.iter_mut().zip(&acc) {
        for (v, &av) in a.iter().enumerate() {
            _mm512_storeu_ps(s.as_mut_ptr().add(16 * v), av);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rng::Rng;

    /// The same sums in f64 on the activations as the product sees them: `hi + lo` or `hi`.
    fn reference(x: &[f32], rows: usize, w: &[bf16], n: usize, split: bool) -> Vec<f64> {
        let k = x.len() / rows;
        let seen = |v: f32| {
            let hi = bf16::from_f32(v);
            let lo = bf16::from_f32(v - hi.to_f32());
            hi.to_f64() + if split { lo.to_f64() } else { 0.0 }
        };
        let mut out = vec![0f64; rows * n];
        for i in 0..rows {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|c| seen(x[i * k + c]) * w[j * k + c].to_f64())
                    .sum();
            }
        }
        out
    }

    #[test]
    fn matches_the_parts_product_for_ragged_shapes_and_rows_do_not_see_each_other() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        let mut rng = Rng::new(5);
        for split in [true, false] {
            for (rows, n, k) in [
                (1, 1, 2),
                (47, 9, 30),
                (97, 17, 66),
                (130, 40, 512),
                (50, 8, 34),
            ] {
                let x: Vec<f32> = (0..rows * k).map(|_| rng.normal() as f32).collect();
                let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f64(rng.normal())).collect();
                let mut out = vec![f32::NAN; rows * n];
                assert!(matmul_t_bf16(&x, rows, (&w, n, k), &mut out, split));
                let want = reference(&x, rows, &w, n, split);
                for (i, (&o, &r)) in out.iter().zip(&want).enumerate() {
                    // Exact products (bf16 × bf16 fits f32), f32 sums of k or 2k terms.
                    let tol = 2e-6 * k as f64 * (1.0 + r.abs());
                    assert!(
                        (o as f64 - r).abs() <= tol,
                        "{rows}×{n}×{k} at {i}: {o} vs {r}"
                    );
                }
                // The last row alone gives the same bits as beside the others.
                let last = &x[(rows - 1) * k..];
                let mut alone = vec![0f32; n];
                assert!(matmul_t_bf16(last, 1, (&w, n, k), &mut alone, split));
                assert_eq!(alone, out[(rows - 1) * n..], "{rows}×{n}×{k}");
            }
        }
        let mut out = vec![0f32; 3];
        let odd = matmul_t_bf16(&[0.0; 9], 3, (&[bf16::ZERO; 3], 1, 3), &mut out, true);
        assert!(!odd, "odd k");
    }

    #[test]
    fn split_activations_keep_sixteen_bits() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        // One weight of 1: the output is the activation as the product saw it.
        let x = [1.0 + 3.0 / 512.0 + 1.0 / 65536.0, 0.0];
        let w = [bf16::ONE, bf16::ZERO];
        let mut out = [0f32];
        assert!(matmul_t_bf16(&x, 1, (&w, 1, 2), &mut out, true));
        assert_eq!(out[0], x[0]);
        assert!(matmul_t_bf16(&x, 1, (&w, 1, 2), &mut out, false));
        assert_eq!(out[0], 1.0 + 1.0 / 128.0, "rounded to bf16's 8 bits");
    }
}
