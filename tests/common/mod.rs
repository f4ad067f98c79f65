//! Helpers shared by the integration tests: fixture paths, golden files, error metrics.
#![allow(dead_code)]

pub mod family;
pub mod grad;
pub mod state16;

use mamba3::model::tensor_file::TensorFile;
use std::path::PathBuf;

pub const FIXTURES: [&str; 2] = ["siso-tiny", "siso-mlp-norm"];

/// A fixture's directory: the repository's own copies (`tests/fixtures`: the SISO ones) or
/// the shared fixtures (`../shared/fixtures`: every mixer), beside the sources that built
/// the test or under the working directory (the GPU test binaries run on the GPU machine
/// from a copy of the repository, not where they were built).
pub fn fixture(name: &str) -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let bases = [
        manifest.join("tests/fixtures"),
        manifest.join("../shared/fixtures"),
        PathBuf::from("tests/fixtures"),
        PathBuf::from("../shared/fixtures"),
        PathBuf::from("shared/fixtures"),
    ];
    bases
        .iter()
        .map(|b| b.join(name))
        .find(|p| p.is_dir())
        .unwrap_or_else(|| bases[0].join(name))
}

pub struct Golden {
    pub input_ids: Vec<u32>,
    /// `[T, vocab_padded]`, as stored (f64)
    pub logits: Vec<f64>,
    pub vocab_padded: usize,
    pub prefix: usize,
    pub file: TensorFile,
}

impl Golden {
    pub fn load(name: &str) -> Golden {
        let dir = fixture(name);
        let file = TensorFile::open(&dir.join("golden.safetensors")).unwrap();
        let ids = file.get("input_ids").unwrap().to_i64("input_ids").unwrap();
        let lg = file.get("logits").unwrap();
        let vocab_padded = lg.shape[1];
        let logits = lg
            .to_float("logits", mamba3::model::DType::F64)
            .unwrap()
            .to_f64_vec();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let prefix = meta["prefix_len"].as_u64().expect("golden.json prefix_len") as usize;
        Golden {
            input_ids: ids.iter().map(|&i| i as u32).collect(),
            logits,
            vocab_padded,
            prefix,
            file,
        }
    }
    /// A golden tensor as f64.
    pub fn tensor(&self, name: &str) -> Vec<f64> {
        self.file
            .get(name)
            .unwrap_or_else(|| panic!("golden has no {name}"))
            .to_float(name, mamba3::model::DType::F64)
            .unwrap()
            .to_f64_vec()
    }
}

/// ‖a − b‖ / ‖b‖ (NaN never passes: it is returned as infinity).
pub fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    finite_or_inf((num / den).sqrt())
}

fn finite_or_inf(r: f64) -> f64 {
    if r.is_finite() {
        r
    } else {
        f64::INFINITY
    }
}

pub fn to_f64<T: Copy + Into<f64>>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

/// Relative L2 of angles compared modulo 2π: each difference is folded to (−π, π].
pub fn rel_l2_angles(a: &[f64], b: &[f64]) -> f64 {
    let two_pi = 2.0 * std::f64::consts::PI;
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| {
            let d = (x - y).rem_euclid(two_pi);
            let d = if d > std::f64::consts::PI {
                d - two_pi
            } else {
                d
            };
            d * d
        })
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    finite_or_inf((num / den.max(1e-30)).sqrt())
}

/// Text of `sentences` drawn at random (a fixed seed) until it is at least `len` bytes:
/// structure a small model can learn.
pub fn sentences_text(sentences: &[&str], len: usize) -> Vec<u8> {
    let mut rng = mamba3::model::rng::Rng::new(5);
    let mut t = Vec::new();
    while t.len() < len {
        t.extend_from_slice(sentences[rng.below(sentences.len() as u64) as usize].as_bytes());
    }
    t
}

/// A training batch of `b` random windows of `t` + 1 tokens below `vocab`.
pub fn random_batch(vocab: usize, b: usize, t: usize, seed: u64) -> mamba3::train::Batch {
    let mut rng = mamba3::model::rng::Rng::new(seed);
    let w: Vec<Vec<u32>> = (0..b)
        .map(|_| (0..=t).map(|_| rng.below(vocab as u64) as u32).collect())
        .collect();
    let refs: Vec<&[u32]> = w.iter().map(|v| v.as_slice()).collect();
    mamba3::train::Batch::from_windows(&refs)
}

/// A short training run of `model` on the byte tokenizer: `steps` steps of `accum`
/// micro-batches of `batch` windows of `seq_len` tokens, warm-up 5 steps to a 1e-2 peak,
/// clipping at 1, validation every 5th block, no evaluation or checkpoints.
pub fn short_run(
    model: mamba3::model::Config,
    steps: u64,
    batch: usize,
    accum: usize,
    seq_len: usize,
) -> mamba3::train::trainer::RunConfig {
    use mamba3::train::optim::{AdamWConfig, Schedule};
    mamba3::train::trainer::RunConfig {
        model,
        data: vec![],
        tokenizer: "byte".into(),
        steps,
        batch,
        accum,
        seq_len,
        schedule: Schedule {
            peak: 1e-2,
            min: 1e-3,
            warmup: 5,
            total: steps,
        },
        adamw: AdamWConfig::default(),
        clip: 1.0,
        seed: 3,
        val_every_block: 5,
        eval_every: 0,
        eval_windows: 16,
        ckpt_every: 0,
    }
}

/// Relative L2 of each tensor of `state` (`state.{l}.{name}`, layer by layer) against the
/// values `other` gives for that tensor (layer, index in the layout); angles compared
/// modulo 2π (they live on the circle: a phase just under 2π and one just over 0 are
/// neighbours).
fn tensor_errors(
    state: &mamba3::State,
    other: impl Fn(usize, usize, &str) -> Vec<f64>,
) -> Vec<(String, f64)> {
    let layout = state.layout().clone();
    let host = state.to_host().unwrap();
    let mut v = Vec::new();
    for l in 0..layout.n_layer {
        for (i, t) in layout.tensors.iter().enumerate() {
            let off = layout.offset_in_layer(i);
            let got = to_f64(&host.layer(l)[off..off + t.len()]);
            let name = layout.file_name(l, i);
            let want = other(l, i, &name);
            let e = if t.name == "angle" {
                rel_l2_angles(&got, &want)
            } else {
                rel_l2(&got, &want)
            };
            v.push((name, e));
        }
    }
    v
}

/// Relative L2 between two states of the same layout, tensor by tensor
/// ([`tensor_errors`]).
pub fn state_errors(a: &mamba3::State, b: &mamba3::State) -> Vec<(String, f64)> {
    let layout = b.layout().clone();
    let hb = b.to_host().unwrap();
    tensor_errors(a, |l, i, _| {
        let off = layout.offset_in_layer(i);
        to_f64(&hb.layer(l)[off..off + layout.tensors[i].len()])
    })
}

/// Every tensor of a state's layout (Mamba-3: angle, ssm, k, v; Mamba-1/2: conv, ssm)
/// against the golden tensor of the same name, within `tol` relative L2; angles are
/// compared modulo 2π.
pub fn check_states(g: &Golden, state: &mamba3::State, tol: f64, what: &str) {
    for (name, e) in tensor_errors(state, |_, _, name| g.tensor(name)) {
        assert!(e <= tol, "{what}: {name} rel L2 {e:e} > {tol:e}");
    }
}

/// Prefill `tokens` as consecutive windows ending at `ends` (the last must be the length):
/// every position's logits.
pub fn windows(m: &mamba3::Model, tokens: &[u32], ends: &[usize]) -> Vec<f32> {
    let mut st = m.new_state();
    let mut out = Vec::new();
    let mut start = 0;
    for &e in ends {
        out.extend(
            m.prefill(&tokens[start..e], &mut st, mamba3::LogitsWant::All)
                .unwrap()
                .data,
        );
        start = e;
    }
    assert_eq!(st.position(), tokens.len() as u64);
    out
}
