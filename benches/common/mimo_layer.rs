//! The MIMO benches' layer: the spec's cost example (spec-MIMO §7: d_model 768, d_state
//! 128, headdim 64, mimo_rank 4), one layer of synthetic f32 weights, and `rows` random
//! in_proj output rows to feed its mixer.

use mamba3::mixers::mimo::{mimo_config_from_json_str, MimoWeights};
use mamba3::model::rng::Rng;
use mamba3::model::DType;

/// The layer's weights and `rows` in_proj rows `[rows, d_in_proj]`.
pub fn spec_example(rows: usize) -> (MimoWeights, Vec<f32>) {
    let cfg = mimo_config_from_json_str(
        r#"{"d_model": 768, "n_layer": 1, "vocab_size": 256, "ssm_cfg": {
            "layer": "Mamba3", "d_state": 128, "headdim": 64, "expand": 2, "ngroups": 1,
            "rope_fraction": 0.5, "is_mimo": true, "mimo_rank": 4}}"#,
        "bench",
    )
    .expect("bench config");
    let w = MimoWeights::synthetic(cfg, DType::F32, 1).expect("synthetic weights");
    let mut rng = Rng::new(2);
    let proj = (0..rows * w.dims.d_in_proj)
        .map(|_| rng.normal() as f32)
        .collect();
    (w, proj)
}
