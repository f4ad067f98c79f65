//! The MIMO reference against the official goldens (`shared/fixtures/mimo-*`), from both
//! checkpoint formats, in f64 and f32; continued windows; R = 1 MIMO against SISO.

use super::reference::{layer, MimoLayerState, MimoReference, MimoSeqState};
use super::weights::{mimo_config_from_json_str, MimoDims, MimoWeights};
use crate::cpu::Real;
use crate::model::tensor_file::TensorFile;
use crate::model::DType;
use std::path::PathBuf;

pub(crate) const MIMO_FIXTURES: [&str; 2] = ["mimo-tiny", "mimo-mlp-norm"];
const FORMATS: [&str; 2] = ["model.safetensors", "pytorch_model.bin"];

pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(name)
}

pub(crate) struct Golden {
    pub input_ids: Vec<u32>,
    pub prefix: usize,
    file: TensorFile,
}

impl Golden {
    pub fn load(name: &str) -> Golden {
        let dir = fixture(name);
        let file = TensorFile::open(&dir.join("golden.safetensors")).unwrap();
        let ids = file.get("input_ids").unwrap().to_i64("input_ids").unwrap();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        Golden {
            input_ids: ids.iter().map(|&i| i as u32).collect(),
            prefix: meta["prefix_len"].as_u64().expect("prefix_len") as usize,
            file,
        }
    }
    pub fn tensor(&self, name: &str) -> Vec<f64> {
        self.file
            .get(name)
            .unwrap_or_else(|| panic!("golden has no {name}"))
            .to_float(name, DType::F64)
            .unwrap()
            .to_f64_vec()
    }
    pub fn shape(&self, name: &str) -> Vec<usize> {
        self.file.get(name).unwrap().shape
    }
}

/// ‖a − b‖ / ‖b‖; NaN or a length mismatch is infinity, so it never passes.
pub(crate) fn rel_l2<F: Real>(a: &[F], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.to_f64().unwrap() - y).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    let r = (num / den).sqrt();
    if r.is_finite() {
        r
    } else {
        f64::INFINITY
    }
}

/// Relative L2 of angles, each difference folded into (−π, π].
fn rel_l2_angles<F: Real>(a: &[F], b: &[f64]) -> f64 {
    let two_pi = 2.0 * std::f64::consts::PI;
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| {
            let d = (x.to_f64().unwrap() - y).rem_euclid(two_pi);
            let d = if d > std::f64::consts::PI {
                d - two_pi
            } else {
                d
            };
            d * d
        })
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    let r = (num / den.max(1e-30)).sqrt();
    if r.is_finite() && a.len() == b.len() {
        r
    } else {
        f64::INFINITY
    }
}

/// Worst relative L2 over every layer's four state tensors after the prefix.
fn state_errors<F: Real>(g: &Golden, st: &MimoSeqState<F>, d: &MimoDims) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for l in 0..d.n_layer {
        let ls = MimoLayerState::copy_of(st, l, d);
        let gold = |f: &str| g.tensor(&format!("state.{l}.{f}"));
        out.push((
            format!("state.{l}.angle"),
            rel_l2_angles(&ls.angle, &gold("angle")),
        ));
        out.push((format!("state.{l}.ssm"), rel_l2(&ls.ssm, &gold("ssm"))));
        out.push((format!("state.{l}.k"), rel_l2(&ls.k, &gold("k"))));
        out.push((format!("state.{l}.v"), rel_l2(&ls.v, &gold("v"))));
    }
    out
}

/// Logits, hidden states and the states after the prefix, against the goldens.
fn check_goldens<F: Real>(dtype: DType, tol: f64, state_tol: f64) {
    for name in MIMO_FIXTURES {
        let g = Golden::load(name);
        for file in FORMATS {
            let w = MimoWeights::load(&fixture(name).join(file), dtype).unwrap();
            let d = w.dims;
            let gk = g.shape("state.0.k");
            assert_eq!(
                gk,
                vec![d.rank, d.nheads, d.d_state],
                "{name}: golden k layout"
            );
            let r = MimoReference::<F>::new(&w);
            let mut st = r.new_state();
            let (hidden, logits) = r.forward_hidden(&g.input_ids, &mut st).unwrap();
            let e_logits = rel_l2(&logits, &g.tensor("logits"));
            let e_hidden = rel_l2(&hidden, &g.tensor("hidden"));
            eprintln!("{name} {file} {dtype}: logits {e_logits:.2e} hidden {e_hidden:.2e}");
            assert!(
                e_logits <= tol,
                "{name} {file} {dtype}: logits {e_logits:e}"
            );
            assert!(
                e_hidden <= tol,
                "{name} {file} {dtype}: hidden {e_hidden:e}"
            );

            let mut st = r.new_state();
            r.forward(&g.input_ids[..g.prefix], &mut st).unwrap();
            let errs = state_errors(&g, &st, &w.dims);
            let worst = errs.iter().map(|e| e.1).fold(0.0, f64::max);
            eprintln!("{name} {file} {dtype}: worst state {worst:.2e}");
            for (what, e) in errs {
                assert!(e <= state_tol, "{name} {file} {dtype}: {what} {e:e}");
            }
        }
    }
}

#[test]
fn reference_matches_goldens_in_f64() {
    check_goldens::<f64>(DType::F64, 1e-7, 1e-7);
}

#[test]
fn reference_matches_goldens_in_f32() {
    check_goldens::<f32>(DType::F32, 1e-5, 1e-5);
}

#[test]
fn both_formats_give_the_same_model() {
    for name in MIMO_FIXTURES {
        let a = MimoWeights::load(&fixture(name).join(FORMATS[0]), DType::F32).unwrap();
        let b = MimoWeights::load(&fixture(name).join(FORMATS[1]), DType::F32).unwrap();
        assert_eq!(a, b, "{name}: safetensors and .bin differ");
    }
}

/// Windows that continue a state, split anywhere (on and off chunk boundaries, length 1),
/// and prefix + one token at a time, all give the one-pass logits and final state.
#[test]
fn continued_windows_equal_one_pass() {
    for name in MIMO_FIXTURES {
        let g = Golden::load(name);
        let w = MimoWeights::load(&fixture(name), DType::F64).unwrap();
        let r = MimoReference::<f64>::new(&w);
        let t = g.input_ids.len();
        let chunk = w.dims.chunk_len;
        let mut st_full = r.new_state();
        let full = r.forward(&g.input_ids, &mut st_full).unwrap();
        for ends in [
            vec![chunk, 2 * chunk, t],
            vec![1, chunk + 1, chunk + 2, t - 1, t],
            vec![g.prefix, t],
            vec![3, 4, 5, chunk - 1, 2 * chunk + 5, t],
        ] {
            let mut st = r.new_state();
            let mut got = Vec::new();
            let mut start = 0;
            for &e in &ends {
                got.extend(r.forward(&g.input_ids[start..e], &mut st).unwrap());
                start = e;
            }
            assert_eq!(got, full, "{name}: windows {ends:?}");
            assert_eq!(st, st_full, "{name}: state after windows {ends:?}");
            let e = rel_l2(&got, &g.tensor("logits"));
            assert!(e <= 1e-6, "{name}: windows {ends:?} vs golden {e:e}");
        }
        let mut st = r.new_state();
        let mut got = r.forward(&g.input_ids[..g.prefix], &mut st).unwrap();
        for &tok in &g.input_ids[g.prefix..] {
            got.extend(r.step(tok, &mut st).unwrap());
        }
        assert_eq!(got, full, "{name}: prefix + steps");
    }
}

/// The fold is needed: dropping the carried key and value at a seam changes the first
/// token after it (and so the goldens' continued-window requirement tests it).
#[test]
fn dropping_the_carried_key_and_value_breaks_the_seam() {
    let name = MIMO_FIXTURES[0];
    let g = Golden::load(name);
    let w = MimoWeights::load(&fixture(name), DType::F64).unwrap();
    let r = MimoReference::<f64>::new(&w);
    let mut st = r.new_state();
    r.forward(&g.input_ids[..g.prefix], &mut st).unwrap();
    for l in 0..w.dims.n_layer {
        let ls = layer(&mut st, l, &w.dims);
        ls.k.iter_mut().for_each(|v| *v = 0.0);
        ls.v.iter_mut().for_each(|v| *v = 0.0);
    }
    let got = r.forward(&g.input_ids[g.prefix..], &mut st).unwrap();
    let vp = w.dims.vocab_padded;
    let gold = g.tensor("logits");
    let e = rel_l2(&got[..vp], &gold[g.prefix * vp..(g.prefix + 1) * vp]);
    assert!(e > 1e-3, "seam token unchanged without k/v: {e:e}");
}

#[test]
fn bad_tokens_and_states_are_errors_that_touch_nothing() {
    let w = MimoWeights::load(&fixture(MIMO_FIXTURES[0]), DType::F32).unwrap();
    let r = MimoReference::<f32>::new(&w);
    let mut st = r.new_state();
    let before = st.clone();
    let e = r.forward(&[1, 2, 256], &mut st).unwrap_err();
    assert!(e.to_string().contains("256"), "{e}");
    assert_eq!(st, before);
    st.data.pop();
    let e = r.step(1, &mut st).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    let mut short = r.new_state();
    short.data.truncate(short.layer_len);
    assert!(r.step(1, &mut short).is_err());
}

/// Spec-MIMO §2.9: with `mimo_x = mimo_z = mimo_o = 1` an R = 1 MIMO model equals a SISO
/// model whose d_state axis (B/C rows of in_proj, biases, B/C norms) is permuted by
/// `n_SISO = 2i ↔ n_MIMO = i`, `n_SISO = 2i+1 ↔ n_MIMO = i + N/2`: the pair layouts map onto
/// each other and RMSNorm and inner products do not see the order. Both rope fractions,
/// ngroups 2, output norm on and off.
#[test]
fn rank_one_equals_siso_up_to_the_pair_relabelling() {
    use crate::mixers::mamba3::state::{layers, zero_state};
    use crate::mixers::mamba3::Reference;
    use crate::mixers::mamba3::Weights;
    use crate::model::Config;
    for (rope, outproj_norm, d_int) in [(0.5, false, 0), (1.0, true, 64)] {
        let mut siso_cfg = Config::synthetic(32, 2, 16, 8, 2, 2, 50);
        siso_cfg.ssm_cfg.rope_fraction = rope;
        siso_cfg.ssm_cfg.is_outproj_norm = outproj_norm;
        siso_cfg.d_intermediate = d_int;
        let siso = Weights::synthetic(siso_cfg.clone(), DType::F64, 7).unwrap();
        let mut mimo_json: serde_json::Value = serde_json::to_value(&siso_cfg).unwrap();
        mimo_json["ssm_cfg"]["is_mimo"] = true.into();
        mimo_json["ssm_cfg"]["mimo_rank"] = 1.into();
        let mimo_cfg = mimo_config_from_json_str(&mimo_json.to_string(), "t").unwrap();
        // Start from any MIMO model of this shape and overwrite every tensor from SISO.
        let mut mimo = MimoWeights::synthetic(mimo_cfg, DType::F64, 1).unwrap();
        let d = mimo.dims;
        let n = d.d_state;
        let siso_n = |m: usize| {
            if m < n / 2 {
                2 * m
            } else {
                2 * (m - n / 2) + 1
            }
        };
        let sd = siso.dims;
        assert_eq!(d.d_in_proj, sd.d_in_proj);
        mimo.embedding = siso.embedding.clone();
        mimo.lm_head = siso.lm_head.clone();
        mimo.norm_f = siso.norm_f.clone();
        for (ml, sl) in mimo.layers.iter_mut().zip(&siso.layers) {
            let src = sl.in_proj.data.to_f64_vec();
            let cols = sd.d_model;
            let row_of = |mrow: usize| {
                let in_slice = |off: usize| mrow >= off && mrow < off + d.ngroups * n;
                if in_slice(d.b_off()) || in_slice(d.c_off()) {
                    let off = if in_slice(d.b_off()) {
                        d.b_off()
                    } else {
                        d.c_off()
                    };
                    let (g, m) = ((mrow - off) / n, (mrow - off) % n);
                    off + g * n + siso_n(m)
                } else {
                    mrow
                }
            };
            let vals: Vec<f64> = (0..d.d_in_proj * cols)
                .map(|i| src[row_of(i / cols) * cols + i % cols])
                .collect();
            ml.in_proj.data = crate::model::TensorData::F64(vals);
            let permute = |v: &[f32]| -> Vec<f32> {
                (0..v.len())
                    .map(|i| v[(i / n) * n + siso_n(i % n)])
                    .collect()
            };
            ml.b_bias = permute(&sl.b_bias);
            ml.c_bias = permute(&sl.c_bias);
            ml.b_norm = permute(&sl.b_norm);
            ml.c_norm = permute(&sl.c_norm);
            for v in [&mut ml.mimo_x, &mut ml.mimo_z, &mut ml.mimo_o] {
                v.iter_mut().for_each(|x| *x = 1.0);
            }
            ml.norm = sl.norm.clone();
            ml.dt_bias = sl.dt_bias.clone();
            ml.d = sl.d.clone();
            ml.out_norm = sl.out_norm.clone();
            ml.out_proj = sl.out_proj.clone();
            ml.mlp = sl.mlp.clone();
        }
        let tokens: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 50).collect();
        let sr = Reference::<f64>::new(&siso);
        let mut sst = zero_state::<f64>(&sd);
        let want: Vec<f64> = sr.run(&tokens, &mut sst).concat();
        let mr = MimoReference::<f64>::new(&mimo);
        let mut mst = mr.new_state();
        let got = mr.forward(&tokens, &mut mst).unwrap();
        let e = rel_l2(&got, &want);
        eprintln!("rope {rope}: R=1 MIMO vs SISO logits {e:.1e}");
        assert!(e < 1e-12, "rope {rope}: R=1 MIMO vs SISO logits {e:e}");
        let mimo_layers =
            (0..mimo.dims.n_layer).map(|l| MimoLayerState::copy_of(&mst, l, &mimo.dims));
        for (ms, ss) in mimo_layers.zip(layers(&sst, &sd)) {
            let k_siso: Vec<f64> = (0..ms.k.len())
                .map(|i| ss.k[(i / n) * n + siso_n(i % n)])
                .collect();
            let ssm_siso: Vec<f64> = (0..ms.ssm.len())
                .map(|i| ss.ssm[(i / n) * n + siso_n(i % n)])
                .collect();
            assert!(rel_l2(&ms.k, &k_siso) < 1e-12, "rope {rope}: k");
            assert!(rel_l2(&ms.ssm, &ssm_siso) < 1e-12, "rope {rope}: ssm");
            assert!(rel_l2(&ms.v, ss.v) < 1e-12, "rope {rope}: v");
            assert!(rel_l2(&ms.angle, ss.angle) < 1e-12, "rope {rope}: angle");
        }
        // Without the relabelling (the same in_proj in both) the two disagree: the pair
        // convention is the whole difference.
        let mut plain = mimo.clone();
        for (ml, sl) in plain.layers.iter_mut().zip(&siso.layers) {
            ml.in_proj = sl.in_proj.clone();
            ml.b_bias = sl.b_bias.clone();
            ml.c_bias = sl.c_bias.clone();
            ml.b_norm = sl.b_norm.clone();
            ml.c_norm = sl.c_norm.clone();
        }
        let pr = MimoReference::<f64>::new(&plain);
        let mut pst = pr.new_state();
        let e = rel_l2(&pr.forward(&tokens, &mut pst).unwrap(), &want);
        eprintln!("rope {rope}: unpermuted R=1 MIMO vs SISO logits {e:.1e}");
        assert!(
            e > 1e-4,
            "rope {rope}: unpermuted R=1 MIMO should differ, {e:e}"
        );
    }
}
