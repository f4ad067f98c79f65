//! Loading Mamba-1/Mamba-2 parameters: every bad file is an error naming the tensor.

use super::*;
use crate::model::dtype::TensorData;
use crate::model::tensor_file::{write_safetensors, RawTensor};
use std::path::PathBuf;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(rel)
}

/// The tensors of a fixture file, owned.
fn tensors_of(rel: &str) -> Vec<(String, RawTensor<'static>)> {
    let src = TensorSource::open(&fixture(rel)).unwrap();
    src.names()
        .into_iter()
        .map(|n| {
            let t = src.get(&n).unwrap();
            let owned = RawTensor {
                dtype: t.dtype,
                shape: t.shape.clone(),
                bytes: std::borrow::Cow::Owned(t.bytes.into_owned()),
            };
            (n, owned)
        })
        .collect()
}

/// A model folder with `config` and these tensors.
fn folder(config: &str, tensors: &[(String, RawTensor<'static>)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    let mut sorted = tensors.to_vec();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    write_safetensors(&dir.path().join("model.safetensors"), &sorted, None).unwrap();
    dir
}

fn config_of(rel: &str) -> String {
    std::fs::read_to_string(fixture(rel)).unwrap()
}

fn load_err(config: &str, tensors: &[(String, RawTensor<'static>)]) -> String {
    let dir = folder(config, tensors);
    FamilyWeights::load(dir.path(), DType::F32)
        .unwrap_err()
        .to_string()
}

#[test]
fn wrong_shapes_missing_and_unexpected_tensors_are_named() {
    let cfg = config_of("m1-tiny/config.json");
    let base = tensors_of("m1-tiny/model.safetensors");
    let name = "backbone.layers.1.mixer.x_proj.weight";

    let mut t = base.clone();
    t.iter_mut().find(|(n, _)| n == name).unwrap().1.shape = vec![18, 256];
    let e = load_err(&cfg, &t);
    assert!(
        e.contains(name) && e.contains("[36, 128]") && e.contains("[18, 256]"),
        "{e}"
    );

    let t: Vec<_> = base.iter().filter(|(n, _)| n != name).cloned().collect();
    let e = load_err(&cfg, &t);
    assert!(e.contains("missing") && e.contains(name), "{e}");

    let mut t = base.clone();
    t.push((
        "backbone.layers.0.mixer.in_proj.bias".into(),
        RawTensor::from_f32(vec![256], &[0.0; 256]),
    ));
    let e = load_err(&cfg, &t);
    assert!(e.contains("in_proj.bias") && e.contains("bias"), "{e}");

    let mut t = base.clone();
    t.push((
        "backbone.layers.2.norm.weight".into(),
        RawTensor::from_f32(vec![64], &[1.0; 64]),
    ));
    let e = load_err(&cfg, &t);
    assert!(
        e.contains("unexpected tensor `backbone.layers.2.norm.weight`"),
        "{e}"
    );

    let mut t = base.clone();
    let d = t
        .iter_mut()
        .find(|(n, _)| n.ends_with("0.mixer.D"))
        .unwrap();
    d.1 = RawTensor::from_i64(vec![128], &[1; 128]);
    let e = load_err(&cfg, &t);
    assert!(
        e.contains("backbone.layers.0.mixer.D") && e.contains("i64"),
        "{e}"
    );

    // Untied by config, but no head stored.
    let untied = cfg.replace(
        "\"ssm_cfg\": {}",
        "\"ssm_cfg\": {}, \"tie_embeddings\": false",
    );
    assert_ne!(untied, cfg);
    let e = load_err(&untied, &base);
    assert!(e.contains("lm_head.weight"), "{e}");

    // Both spellings of the embedding: ambiguous.
    let mut t = base.clone();
    let emb = t
        .iter()
        .find(|(n, _)| n == "backbone.embedding.weight")
        .unwrap()
        .1
        .clone();
    t.push(("backbone.embeddings.weight".into(), emb));
    let e = load_err(&cfg, &t);
    assert!(e.contains("backbone.embeddings.weight"), "{e}");
}

#[test]
fn mixed_dtypes_prefixes_and_an_untied_head_load() {
    let cfg = config_of("m2-tiny/config.json");
    let base = tensors_of("m2-tiny/model.safetensors");
    let reference = FamilyWeights::load(&fixture("m2-tiny"), DType::F32).unwrap();
    let FamilyWeights::Mamba2(reference) = reference else {
        panic!("m2-tiny is Mamba-2")
    };

    // Half the tensors in f16 (as mamba2-*'s .bin files mix them), a `model.` prefix on
    // every name, and the head stored separately under an untied config.
    let mut t: Vec<(String, RawTensor<'static>)> = Vec::new();
    for (i, (n, raw)) in base.iter().enumerate() {
        let raw = if i % 2 == 0 {
            let data = raw.to_float(n, DType::F16).unwrap();
            RawTensor::from_data(raw.shape.clone(), &data)
        } else {
            raw.clone()
        };
        t.push((format!("model.{n}"), raw));
    }
    let emb = base
        .iter()
        .find(|(n, _)| n == "backbone.embedding.weight")
        .unwrap();
    t.push(("model.lm_head.weight".into(), emb.1.clone()));
    let untied = cfg.replace("\"tie_embeddings\": true", "\"tie_embeddings\": false");
    let dir = folder(&untied, &t);
    let FamilyWeights::Mamba2(w) = FamilyWeights::load(dir.path(), DType::F32).unwrap() else {
        panic!("still Mamba-2")
    };
    assert!(w.lm_head.is_some());
    assert_eq!(w.head().data, reference.embedding.data);
    // f16 rounding of the even-numbered tensors, nothing more.
    for (a, b) in w.layers.iter().zip(&reference.layers) {
        let (x, y) = (&a.mixer.dt_bias, &b.mixer.dt_bias);
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() <= 1e-3 * q.abs().max(1e-2), "{p} vs {q}");
        }
    }

    // Asking for the other family is an error naming it.
    let e = Mamba1Weights::load(&fixture("m2-tiny"), DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Mamba1") && e.contains("Mamba2"), "{e}");
}

#[test]
fn matrices_take_the_dtype_asked_for_and_vectors_stay_f32() {
    let FamilyWeights::Mamba1(w) = FamilyWeights::load(&fixture("m1-tiny"), DType::BF16).unwrap()
    else {
        panic!("m1-tiny is Mamba-1")
    };
    assert!(matches!(
        w.layers[0].mixer.in_proj.data,
        TensorData::BF16(_)
    ));
    assert!(matches!(w.embedding.data, TensorData::BF16(_)));
    let f32w = Mamba1Weights::load(&fixture("m1-tiny"), DType::F32).unwrap();
    assert_eq!(w.layers[0].mixer.a_log, f32w.layers[0].mixer.a_log);
}

#[test]
fn a_sharded_transformers_folder_loads_like_the_single_file() {
    let base = tensors_of("m2-tiny/hf/model.safetensors");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        config_of("m2-tiny/hf/config.json"),
    )
    .unwrap();
    let mut map = serde_json::Map::new();
    for (i, part) in base.chunks(base.len().div_ceil(3)).enumerate() {
        let shard = format!("model-0000{}-of-00003.safetensors", i + 1);
        write_safetensors(&dir.path().join(&shard), part, None).unwrap();
        for (n, _) in part {
            map.insert(n.clone(), shard.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded = Mamba2Weights::load(dir.path(), DType::F32).unwrap();
    let single = Mamba2Weights::load(&fixture("m2-tiny/hf"), DType::F32).unwrap();
    assert_eq!(sharded.layers, single.layers);
    assert_eq!(sharded.embedding, single.embedding);
    assert_eq!(sharded.norm_f, single.norm_f);
}
