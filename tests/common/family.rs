//! The Mamba-1, Mamba-2 and MIMO goldens through the engine on a device (the CPU tests
//! and the GPU ones share it).
use super::*;
use mamba3::{DType, Device, LogitsWant, MixerKind, Model};
use std::path::PathBuf;

/// The fixtures' README and the issues: f32 within 1e-5 relative L2, f16 within 5e-3,
/// bf16 within 1e-2.
pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

/// With bf16 weights the states drift more than the logits (the deep layers' inputs carry
/// every earlier layer's rounding); f32 states meet the logits' tolerance.
pub fn state_tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 6e-2,
    }
}

/// Fixture `name` from each of its `folders` on `device`, in f32, f16 and bf16: full
/// prefill, continued windows, the states after the prefix, a saved state loaded back,
/// decode from the prefix, a packed batch and a batched decode step against the goldens.
pub fn goldens_through_the_engine(
    name: &str,
    folders: &[PathBuf],
    kind: MixerKind,
    device: Device,
) {
    let tmp = tempfile::tempdir().unwrap();
    {
        let g = Golden::load(name);
        let gold = g.logits.as_slice();
        let t = g.input_ids.len();
        for folder in folders {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let what = format!("{name} {} {dtype} {device}", folder.display());
                let m = Model::load(folder, device, dtype).unwrap();
                assert_eq!(m.kind(), kind, "{what}");
                let tol = tol(dtype);

                let mut st = m.new_state();
                let full = m.prefill(&g.input_ids, &mut st, LogitsWant::All).unwrap();
                let e = rel_l2(&to_f64(&full.data), gold);
                eprintln!("{what}: prefill rel L2 {e:.2e}");
                assert!(e <= tol, "{what}: prefill rel L2 {e:e}");

                for ends in [vec![1, 17, g.prefix, t - 1, t], vec![2, 3, 4, 5, 50, t]] {
                    let e = rel_l2(&to_f64(&windows(&m, &g.input_ids, &ends)), gold);
                    assert!(e <= tol, "{what}: windows {ends:?} rel L2 {e:e}");
                }

                let mut st = m.new_state();
                let mut got = m
                    .prefill(&g.input_ids[..g.prefix], &mut st, LogitsWant::All)
                    .unwrap()
                    .data;
                check_states(&g, &st, state_tol(dtype), &what);
                // A saved state loads back into the same model and is refused by another.
                let file = tmp.path().join("state.safetensors");
                st.save(&file).unwrap();
                let mut back = m.load_state(&file).unwrap();
                assert_eq!(back.position(), g.prefix as u64);
                // Decode the rest: half from the state, half from the loaded copy.
                let half = g.prefix + (t - g.prefix) / 2;
                for &tok in &g.input_ids[g.prefix..half] {
                    got.extend(m.decode(&[tok], &mut [&mut st]).unwrap().data);
                    m.decode(&[tok], &mut [&mut back]).unwrap();
                }
                for &tok in &g.input_ids[half..] {
                    got.extend(m.decode(&[tok], &mut [&mut back]).unwrap().data);
                }
                let e = rel_l2(&to_f64(&got), gold);
                assert!(e <= tol, "{what}: decode from the prefix rel L2 {e:e}");

                // A packed batch: the whole input beside a shorter piece of it, then a
                // batched decode step; each row equals its sequence alone.
                if dtype == DType::F32 {
                    let short = &g.input_ids[..23];
                    let mut sts = [m.new_state(), m.new_state()];
                    let [a, b] = &mut sts;
                    let out = m
                        .prefill_batch(&[&g.input_ids, short], &mut [a, b], LogitsWant::Last)
                        .unwrap();
                    let vp = g.vocab_padded;
                    let e = rel_l2(&to_f64(&out[0].data), &gold[(t - 1) * vp..t * vp]);
                    assert!(e <= tol, "{what}: batch row 0 rel L2 {e:e}");
                    let e = rel_l2(&to_f64(&out[1].data), &gold[22 * vp..23 * vp]);
                    assert!(e <= tol, "{what}: batch row 1 rel L2 {e:e}");
                    let [a, b] = &mut sts;
                    let step = m.decode(&[5, g.input_ids[23]], &mut [a, b]).unwrap();
                    let e = rel_l2(&to_f64(step.row(1)), &gold[23 * vp..24 * vp]);
                    assert!(e <= tol, "{what}: batched decode row 1 rel L2 {e:e}");
                }
            }
        }
    }
}
