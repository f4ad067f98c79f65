//! Helpers of the GPU tests (`tests/gpu_*.rs`). The fixtures are found beside the sources
//! that built the test, or under `tests/fixtures` of the working directory (the test
//! binaries run on the GPU machine from a copy of the repository).
#![allow(dead_code)]

use mamba3::model::config::Config;
use mamba3::model::tensor_file::TensorFile;
use mamba3::model::DType;
use std::path::PathBuf;

pub const FIXTURES: [&str; 2] = ["siso-tiny", "siso-mlp-norm"];

pub fn fixture(name: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let base = if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    };
    base.join(name)
}

pub struct Golden {
    pub input_ids: Vec<u32>,
    pub logits: Vec<f64>,
    pub prefix: usize,
    pub file: TensorFile,
}

impl Golden {
    pub fn load(name: &str) -> Golden {
        let dir = fixture(name);
        let file = TensorFile::open(&dir.join("golden.safetensors")).unwrap();
        let ids = file.get("input_ids").unwrap().to_i64("input_ids").unwrap();
        let logits = file
            .get("logits")
            .unwrap()
            .to_float("logits", DType::F64)
            .unwrap()
            .to_f64_vec();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        Golden {
            input_ids: ids.iter().map(|&i| i as u32).collect(),
            logits,
            prefix: meta["prefix_len"].as_u64().unwrap() as usize,
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
}

/// ‖a − b‖ / ‖b‖ (NaN never passes: it is returned as infinity).
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

pub fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Relative L2 of angles, differences folded to (−π, π].
pub fn rel_l2_angles(a: &[f64], b: &[f64]) -> f64 {
    let tp = 2.0 * std::f64::consts::PI;
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| {
            let d = (x - y).rem_euclid(tp);
            let d = if d > std::f64::consts::PI { d - tp } else { d };
            d * d
        })
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    let r = (num / den.max(1e-30)).sqrt();
    if r.is_finite() {
        r
    } else {
        f64::INFINITY
    }
}

/// A synthetic SISO config for the random-config tests.
#[allow(clippy::too_many_arguments)]
pub fn config(
    d_model: usize,
    layers: usize,
    d_state: usize,
    headdim: usize,
    ngroups: usize,
    rope: f64,
    outnorm: bool,
    mlp: usize,
    chunk: usize,
) -> Config {
    let mut c = Config::synthetic(d_model, layers, d_state, headdim, 2, ngroups, 200);
    c.ssm_cfg.rope_fraction = rope;
    c.ssm_cfg.is_outproj_norm = outnorm;
    c.ssm_cfg.chunk_size = chunk;
    c.d_intermediate = mlp;
    c.tie_embeddings = mlp == 0;
    c
}

/// Deterministic pseudo-random tokens below `vocab`.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = mamba3::model::rng::Rng::new(seed);
    (0..n).map(|_| r.below(vocab as u64) as u32).collect()
}
