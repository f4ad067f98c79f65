//! The golden fixtures (`../shared/fixtures/m1-tiny`, `m2-tiny`): loading helpers shared with
//! the Mamba-2 tests, and the Mamba-1 reference against `m1-tiny` in every layout.

use super::lm::TokenOut;
use super::reference::Reference;
use super::State;
use crate::cpu::Real;
use crate::mixers::family::FamilyWeights;
use crate::mixers::mamba1::weights::Mamba1Weights;
use crate::model::dtype::DType;
use crate::model::tensor_file::TensorFile;
use std::path::{Path, PathBuf};

/// Where each fixture's weights are loaded from: the official folder's two files, and the
/// transformers copy.
pub const LAYOUTS: [&str; 3] = ["model.safetensors", "pytorch_model.bin", "hf"];

pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(rel)
}

pub struct Golden {
    pub input_ids: Vec<u32>,
    /// `[T, vocab_padded]`
    pub logits: Vec<f64>,
    /// `[T, d_model]`
    pub hidden: Vec<f64>,
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
        let mut g = Golden {
            input_ids: ids.iter().map(|&i| i as u32).collect(),
            logits: vec![],
            hidden: vec![],
            prefix: meta["prefix_len"].as_u64().unwrap() as usize,
            file,
        };
        g.logits = g.tensor("logits");
        g.hidden = g.tensor("hidden");
        g
    }

    pub fn tensor(&self, name: &str) -> Vec<f64> {
        self.file
            .get(name)
            .unwrap_or_else(|| panic!("golden has no {name}"))
            .to_float(name, DType::F64)
            .unwrap()
            .to_f64_vec()
    }
}

/// `‖a − b‖ / ‖b‖`; NaN reads as infinity so it never passes.
pub fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    let r = (num / den).sqrt();
    if r.is_finite() {
        r
    } else {
        f64::INFINITY
    }
}

pub fn to64<F: Real>(v: &[F]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64().unwrap()).collect()
}

/// The tolerance of the fixtures' README for the CPU, in both precisions.
pub const TOL: f64 = 1e-5;

fn load_m1(layout: &str) -> Mamba1Weights {
    match FamilyWeights::load(&fixture(&format!("m1-tiny/{layout}")), DType::F32).unwrap() {
        FamilyWeights::Mamba1(w) => w,
        FamilyWeights::Mamba2(_) => panic!("m1-tiny read as Mamba-2"),
    }
}

/// `(conv, ssm)` of every layer of a flat Mamba-1/2 state whose conv part is `conv_len`
/// values long.
pub fn conv_ssm_parts<F: Copy>(st: &State<F>, conv_len: usize) -> Vec<(Vec<F>, Vec<F>)> {
    st.data
        .chunks(st.layer_len)
        .map(|l| (l[..conv_len].to_vec(), l[conv_len..].to_vec()))
        .collect()
}

/// What the golden checks need of a token-by-token model.
pub trait Oracle<F: Real> {
    type State;
    fn fresh(&self) -> Self::State;
    fn step_full(&self, st: &mut Self::State, token: u32) -> TokenOut<F>;
    /// `(conv, ssm)` per layer
    fn layer_states(&self, st: &Self::State) -> Vec<(Vec<F>, Vec<F>)>;
}

impl<F: Real> Oracle<F> for Reference<'_, F> {
    type State = State<F>;
    fn fresh(&self) -> State<F> {
        self.new_state()
    }
    fn step_full(&self, st: &mut State<F>, token: u32) -> TokenOut<F> {
        Reference::step_full(self, st, token).unwrap()
    }
    fn layer_states(&self, st: &State<F>) -> Vec<(Vec<F>, Vec<F>)> {
        let c = self.config();
        conv_ssm_parts(st, c.d_inner * c.d_conv)
    }
}

/// Every check of the fixtures' README on a token-by-token model: full logits and hidden,
/// the states after the prefix, prefix then steps, and windows from carried states.
pub fn against_golden<F: Real, O: Oracle<F>>(o: &O, g: &Golden, what: &str) {
    let t = g.input_ids.len();
    let run = |st: &mut O::State, toks: &[u32]| -> Vec<f64> {
        toks.iter()
            .flat_map(|&tok| to64(&o.step_full(st, tok).logits))
            .collect()
    };

    // One pass from token 0: logits and hidden.
    let mut st = o.fresh();
    let mut logits = Vec::new();
    let mut hidden = Vec::new();
    for &tok in &g.input_ids {
        let out = o.step_full(&mut st, tok);
        logits.extend(to64(&out.logits));
        hidden.extend(to64(&out.hidden));
    }
    let e = rel_l2(&logits, &g.logits);
    let eh = rel_l2(&hidden, &g.hidden);
    eprintln!("{what}: logits rel L2 {e:.2e}, hidden {eh:.2e}");
    assert!(e <= TOL, "{what}: logits rel L2 {e:e}");
    assert!(eh <= TOL, "{what}: hidden rel L2 {eh:e}");

    // Prefix, its states, then the rest one token at a time from the carried state.
    let mut st = o.fresh();
    let mut got = run(&mut st, &g.input_ids[..g.prefix]);
    for (l, (conv, ssm)) in o.layer_states(&st).iter().enumerate() {
        let ec = rel_l2(&to64(conv), &g.tensor(&format!("state.{l}.conv")));
        let es = rel_l2(&to64(ssm), &g.tensor(&format!("state.{l}.ssm")));
        eprintln!("{what}: state.{l} conv {ec:.2e} ssm {es:.2e}");
        assert!(
            ec <= TOL && es <= TOL,
            "{what}: state.{l} conv {ec:e} ssm {es:e}"
        );
    }
    got.extend(run(&mut st, &g.input_ids[g.prefix..]));
    let e = rel_l2(&got, &g.logits);
    assert!(e <= TOL, "{what}: prefix + steps rel L2 {e:e}");

    // Windows, each continuing from the state the previous one left, equal the one pass.
    for ends in [
        vec![1, 2, 3, 50, t],
        vec![4, 5, 61, t - 1, t],
        vec![17, 33, t],
    ] {
        let mut st = o.fresh();
        let mut got = Vec::new();
        let mut start = 0;
        for &end in &ends {
            got.extend(run(&mut st, &g.input_ids[start..end]));
            start = end;
        }
        let e = rel_l2(&got, &logits);
        assert!(e <= 1e-12, "{what}: windows {ends:?} vs one pass {e:e}");
    }
}

#[test]
fn m1_reference_matches_the_goldens_in_every_layout_f64_and_f32() {
    let g = Golden::load("m1-tiny");
    for layout in LAYOUTS {
        let w = load_m1(layout);
        against_golden(
            &Reference::<f64>::new(&w).unwrap(),
            &g,
            &format!("m1-tiny {layout} f64"),
        );
        against_golden(
            &Reference::<f32>::new(&w).unwrap(),
            &g,
            &format!("m1-tiny {layout} f32"),
        );
    }
}

#[test]
fn m1_layouts_hold_the_same_parameters() {
    let official = load_m1("model.safetensors");
    let hf = load_m1("hf");
    assert_eq!(official.layers, hf.layers);
    assert_eq!(official.embedding, hf.embedding);
    assert!(official.lm_head.is_none() && hf.lm_head.is_none());
    assert_eq!(load_m1("pytorch_model.bin").layers, official.layers);
}

#[test]
fn out_of_range_tokens_and_foreign_states_are_errors() {
    let w = load_m1("model.safetensors");
    let r = Reference::<f64>::new(&w).unwrap();
    let mut st = r.new_state();
    let e = r.step(&mut st, 256).unwrap_err().to_string();
    assert!(e.contains("256") && e.contains("out of range"), "{e}");
    st.data.truncate(st.layer_len);
    let e = r.step(&mut st, 1).unwrap_err().to_string();
    assert!(e.contains("1 layers"), "{e}");
    let mut st = r.new_state();
    st.data.pop();
    let e = r.step(&mut st, 1).unwrap_err().to_string();
    assert!(e.contains("does not fit"), "{e}");
}
