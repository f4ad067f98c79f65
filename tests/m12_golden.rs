//! The Mamba-1/Mamba-2 goldens (`../shared/fixtures/m1-tiny`, `m2-tiny`) through the public
//! fast CPU paths, as the engine will call them: every layout (official safetensors, the
//! official `.bin`, transformers' `hf/`), f32 and bf16 weights — full prefill, windows
//! continued from carried states, the states after the prefix, and the rest decoded by the
//! batched step (two copies of the sequence in one batch).

use mamba3::mixers::mamba1::lm::LogitRows;
use mamba3::mixers::{mamba1, mamba2};
use mamba3::model::family_weights::FamilyWeights;
use mamba3::model::tensor_file::TensorFile;
use mamba3::model::DType;
use std::path::PathBuf;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(rel)
}

struct Golden {
    ids: Vec<u32>,
    logits: Vec<f64>,
    prefix: usize,
    file: TensorFile,
}

impl Golden {
    fn load(name: &str) -> Golden {
        let file = TensorFile::open(&fixture(&format!("{name}/golden.safetensors"))).unwrap();
        let ids = file.get("input_ids").unwrap().to_i64("input_ids").unwrap();
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(&format!("{name}/golden.json"))).unwrap(),
        )
        .unwrap();
        let mut g = Golden {
            ids: ids.iter().map(|&i| i as u32).collect(),
            logits: vec![],
            prefix: meta["prefix_len"].as_u64().unwrap() as usize,
            file,
        };
        g.logits = g.tensor("logits");
        g
    }
    fn tensor(&self, name: &str) -> Vec<f64> {
        let t = self.file.get(name).unwrap();
        t.to_float(name, DType::F64).unwrap().to_f64_vec()
    }
}

fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(&x, y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    let r = (num / den).sqrt();
    if r.is_finite() {
        r
    } else {
        f64::INFINITY
    }
}

/// One family's fast paths behind one interface, so both run the same checks.
trait Fast {
    type State: Clone;
    fn fresh(&self) -> Self::State;
    fn prefill(&self, st: &mut Self::State, toks: &[u32]) -> Vec<f32>;
    fn step(&self, sts: &mut [&mut Self::State], toks: &[u32]) -> Vec<f32>;
    fn layers(&self, st: &Self::State) -> Vec<(Vec<f32>, Vec<f32>)>;
}

struct M1(mamba3::model::family_weights::Mamba1Weights);
struct M2(mamba3::model::family_weights::Mamba2Weights);

impl Fast for M1 {
    type State = mamba1::State<f32>;
    fn fresh(&self) -> Self::State {
        mamba1::zero_state(self.0.config.mamba1().unwrap(), self.0.config.n_layer)
    }
    fn prefill(&self, st: &mut Self::State, toks: &[u32]) -> Vec<f32> {
        mamba1::prefill::prefill(&self.0, st, toks, LogitRows::All).unwrap()
    }
    fn step(&self, sts: &mut [&mut Self::State], toks: &[u32]) -> Vec<f32> {
        mamba1::step::step(&self.0, sts, toks).unwrap()
    }
    fn layers(&self, st: &Self::State) -> Vec<(Vec<f32>, Vec<f32>)> {
        let c = self.0.config.mamba1().unwrap();
        let conv = c.d_inner * c.d_conv;
        st.data
            .chunks(st.layer_len)
            .map(|l| (l[..conv].to_vec(), l[conv..].to_vec()))
            .collect()
    }
}

impl Fast for M2 {
    type State = mamba2::State<f32>;
    fn fresh(&self) -> Self::State {
        mamba2::zero_state(self.0.config.mamba2().unwrap(), self.0.config.n_layer)
    }
    fn prefill(&self, st: &mut Self::State, toks: &[u32]) -> Vec<f32> {
        mamba2::prefill::prefill(&self.0, st, toks, LogitRows::All).unwrap()
    }
    fn step(&self, sts: &mut [&mut Self::State], toks: &[u32]) -> Vec<f32> {
        mamba2::step::step(&self.0, sts, toks).unwrap()
    }
    fn layers(&self, st: &Self::State) -> Vec<(Vec<f32>, Vec<f32>)> {
        let c = self.0.config.mamba2().unwrap();
        let conv = c.conv_dim() * c.d_conv;
        st.data
            .chunks(st.layer_len)
            .map(|l| (l[..conv].to_vec(), l[conv..].to_vec()))
            .collect()
    }
}

fn check<M: Fast>(m: &M, g: &Golden, what: &str, tol: f64, state_tol: f64) {
    let t = g.ids.len();
    let mut st = m.fresh();
    let full = m.prefill(&mut st, &g.ids);
    let e = rel_l2(&full, &g.logits);
    eprintln!("{what}: fast prefill logits rel L2 {e:.2e}");
    assert!(e <= tol, "{what}: prefill {e:e}");

    for ends in [vec![1, 17, g.prefix, t - 1, t], vec![2, 3, 4, 5, 50, t]] {
        let mut st = m.fresh();
        let mut got = Vec::new();
        let mut start = 0;
        for &end in &ends {
            got.extend(m.prefill(&mut st, &g.ids[start..end]));
            start = end;
        }
        let e = rel_l2(&got, &g.logits);
        assert!(e <= tol, "{what}: windows {ends:?} {e:e}");
    }

    let mut a = m.fresh();
    let mut got = m.prefill(&mut a, &g.ids[..g.prefix]);
    for (l, (conv, ssm)) in m.layers(&a).iter().enumerate() {
        let ec = rel_l2(conv, &g.tensor(&format!("state.{l}.conv")));
        let es = rel_l2(ssm, &g.tensor(&format!("state.{l}.ssm")));
        eprintln!("{what}: state.{l} after the prefix: conv {ec:.2e} ssm {es:.2e}");
        assert!(
            ec <= state_tol && es <= state_tol,
            "{what}: state.{l} {ec:e} {es:e}"
        );
    }
    let mut b = a.clone();
    let vocab = g.logits.len() / t;
    for &tok in &g.ids[g.prefix..] {
        let out = m.step(&mut [&mut a, &mut b], &[tok, tok]);
        assert_eq!(out[..vocab], out[vocab..], "{what}: the two copies differ");
        got.extend_from_slice(&out[..vocab]);
    }
    let e = rel_l2(&got, &g.logits);
    eprintln!("{what}: prefix + batched steps rel L2 {e:.2e}");
    assert!(e <= tol, "{what}: prefix + steps {e:e}");
}

const LAYOUTS: [&str; 3] = ["model.safetensors", "pytorch_model.bin", "hf"];

#[test]
fn goldens_through_the_fast_paths() {
    for name in ["m1-tiny", "m2-tiny"] {
        let g = Golden::load(name);
        for layout in LAYOUTS {
            for (dtype, tol, state_tol) in [(DType::F32, 1e-5, 1e-5), (DType::BF16, 1e-2, 1e-2)] {
                let what = format!("{name} {layout} {dtype}");
                let path = fixture(&format!("{name}/{layout}"));
                match FamilyWeights::load(&path, dtype).unwrap() {
                    FamilyWeights::Mamba1(w) => check(&M1(w), &g, &what, tol, state_tol),
                    FamilyWeights::Mamba2(w) => check(&M2(w), &g, &what, tol, state_tol),
                }
            }
        }
    }
}
