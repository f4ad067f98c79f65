//! Reading Mamba-1/Mamba-2 configs of both layouts: the fixtures, the spec's real
//! examples, the JSON quirks, and refusals that name the field.

use super::*;

fn fixture(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(rel)
}

fn err(text: &str) -> String {
    FamilyConfig::from_json_str(text, "cfg.json")
        .unwrap_err()
        .to_string()
}

#[test]
fn reads_the_fixture_configs_of_both_layouts_alike() {
    let m1 = FamilyConfig::from_file(&fixture("m1-tiny/config.json")).unwrap();
    let m1_hf = FamilyConfig::from_file(&fixture("m1-tiny/hf/config.json")).unwrap();
    assert_eq!(m1.layout, ConfigLayout::Official);
    assert_eq!(m1_hf.layout, ConfigLayout::Transformers("mamba".into()));
    let want = Mamba1Config {
        d_inner: 128,
        d_state: 16,
        d_conv: 4,
        dt_rank: 4,
        conv_bias: true,
        proj_bias: false,
        bcdt_rms_eps: None,
    };
    for c in [&m1, &m1_hf] {
        assert_eq!(c.mamba1(), Some(&want));
        assert_eq!((c.d_model, c.n_layer, c.vocab_padded), (64, 2, 256));
        assert!(c.tie_embeddings);
        assert_eq!(c.norm_eps, 1e-5);
    }

    let m2 = FamilyConfig::from_file(&fixture("m2-tiny/config.json")).unwrap();
    let m2_hf = FamilyConfig::from_file(&fixture("m2-tiny/hf/config.json")).unwrap();
    for c in [&m2, &m2_hf] {
        let m = c.mamba2().unwrap();
        assert_eq!(c.family(), FamilyKind::Mamba2);
        assert_eq!((m.d_inner, m.d_ssm, m.nheads, m.headdim), (128, 128, 8, 16));
        assert_eq!((m.d_state, m.ngroups, m.chunk_size), (32, 1, 16));
        assert_eq!((m.conv_dim(), m.d_in_proj()), (192, 328));
        // the hf file's `[0.0, Infinity]`
        assert_eq!(m.dt_limit, (0.0, f64::INFINITY));
        assert!(m.rmsnorm && !m.norm_before_gate);
        assert!(c.tie_embeddings);
        assert_eq!(c.vocab_padded, 256);
    }
}

#[test]
fn derives_the_spec_examples() {
    let c = FamilyConfig::from_json_str(
        r#"{"d_model": 768, "n_layer": 24, "vocab_size": 50277, "ssm_cfg": {},
            "rms_norm": true, "residual_in_fp32": true, "fused_add_norm": true,
            "pad_vocab_size_multiple": 8}"#,
        "mamba-130m",
    )
    .unwrap();
    let m = c.mamba1().unwrap();
    assert_eq!((m.d_inner, m.d_state, m.dt_rank), (1536, 16, 48));
    assert_eq!(c.vocab_padded, 50280);

    let c = FamilyConfig::from_json_str(
        r#"{"d_model": 2560, "d_intermediate": 0, "n_layer": 64, "vocab_size": 50277,
            "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {},
            "rms_norm": true, "residual_in_fp32": true, "fused_add_norm": true,
            "pad_vocab_size_multiple": 16, "tie_embeddings": true}"#,
        "mamba2-2.7b",
    )
    .unwrap();
    let m = c.mamba2().unwrap();
    assert_eq!(
        (m.d_inner, m.nheads, m.conv_dim(), m.d_in_proj()),
        (5120, 80, 5376, 10576)
    );
    assert_eq!(c.vocab_padded, 50288);

    // Codestral as transformers writes it: grouped, untied by default, and a
    // `norm_before_gate: true` that transformers never reads.
    let c = FamilyConfig::from_json_str(
        r#"{"model_type": "mamba2", "hidden_size": 4096, "num_hidden_layers": 64,
            "vocab_size": 32768, "num_heads": 128, "head_dim": 64, "n_groups": 8,
            "state_size": 128, "norm_before_gate": true,
            "time_step_limit": {"__float__": "Infinity"}}"#,
        "codestral",
    );
    // a single value is not a pair
    assert!(c.unwrap_err().to_string().contains("time_step_limit"));
    let c = FamilyConfig::from_json_str(
        r#"{"model_type": "mamba2", "hidden_size": 4096, "num_hidden_layers": 64,
            "vocab_size": 32768, "num_heads": 128, "head_dim": 64, "n_groups": 8,
            "state_size": 128, "norm_before_gate": true,
            "time_step_limit": [0.0, {"__float__": "Infinity"}]}"#,
        "codestral",
    )
    .unwrap();
    let m = c.mamba2().unwrap();
    assert_eq!(
        (m.d_inner, m.nheads, m.conv_dim(), m.d_in_proj()),
        (8192, 128, 10240, 18560)
    );
    assert!(!m.norm_before_gate);
    assert!(!c.tie_embeddings);
    assert_eq!(m.dt_limit.1, f64::INFINITY);

    // FalconMamba: intermediate_size overrides expand; the mixer norms' eps.
    let c = FamilyConfig::from_json_str(
        r#"{"model_type": "falcon_mamba", "hidden_size": 4096, "num_hidden_layers": 64,
            "vocab_size": 65024, "expand": 16, "intermediate_size": 8192,
            "time_step_rank": 256, "state_size": 16, "tie_word_embeddings": false}"#,
        "falcon",
    )
    .unwrap();
    let m = c.mamba1().unwrap();
    assert_eq!(
        (m.d_inner, m.dt_rank, m.bcdt_rms_eps),
        (8192, 256, Some(1e-6))
    );
}

#[test]
fn early_hf_configs_with_both_key_sets_dispatch_on_model_type() {
    let c = FamilyConfig::from_json_str(
        r#"{"model_type": "mamba", "d_model": 768, "n_layer": 24, "ssm_cfg": {},
            "rms_norm": true, "fused_add_norm": true, "pad_vocab_size_multiple": 8,
            "d_inner": 1536, "hidden_size": 768, "num_hidden_layers": 24,
            "vocab_size": 50280, "state_size": 16, "intermediate_size": 1536,
            "time_step_rank": 48, "conv_kernel": 4}"#,
        "mamba-130m-hf",
    )
    .unwrap();
    assert_eq!(c.layout, ConfigLayout::Transformers("mamba".into()));
    assert_eq!(c.vocab_padded, 50280);
    assert_eq!(c.mamba1().unwrap().d_inner, 1536);
}

#[test]
fn lenient_json_accepts_python_tokens_outside_strings_only() {
    let v = parse_json_lenient(
        r#"{"a": [0.0, Infinity, -Infinity, NaN], "s": "NaN Infinity \" Infinity"}"#,
    )
    .unwrap();
    let a = v["a"].as_array().unwrap();
    assert_eq!(as_f64(&a[1]), Some(f64::INFINITY));
    assert_eq!(as_f64(&a[2]), Some(f64::NEG_INFINITY));
    assert!(as_f64(&a[3]).unwrap().is_nan());
    assert_eq!(v["s"], "NaN Infinity \" Infinity");
    // a NaN limit is refused by name
    let e = err(
        r#"{"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2,
                   "vocab_size": 256, "num_heads": 8, "head_dim": 16, "n_groups": 1,
                   "time_step_limit": [NaN, Infinity]}"#,
    );
    assert!(e.contains("time_step_limit"), "{e}");
}

#[test]
fn refusals_name_the_field() {
    let base = r#""d_model": 64, "n_layer": 2, "vocab_size": 256"#;
    let cases: Vec<(String, &str)> = vec![
        (format!(r#"{{{base}, "attn_layer_idx": [1]}}"#), "attn_layer_idx"),
        (
            format!(r#"{{{base}, "ssm_cfg": {{"layer": "Mamba2"}}, "attn_layer_idx": [3, 7]}}"#),
            "attn_layer_idx",
        ),
        (format!(r#"{{{base}, "d_intermediate": 128}}"#), "d_intermediate"),
        (format!(r#"{{{base}, "rms_norm": false}}"#), "rms_norm"),
        (format!(r#"{{{base}, "ssm_cfg": {{"layer": "Mamba3"}}}}"#), "ssm_cfg.layer"),
        (format!(r#"{{{base}, "ssm_cfg": {{"layer": "Mamba4"}}}}"#), "ssm_cfg.layer"),
        (format!(r#"{{{base}, "ssm_cfg": {{"rope_fraction": 0.5}}}}"#), "ssm_cfg.rope_fraction"),
        (format!(r#"{{{base}, "frobnicate": 1}}"#), "frobnicate"),
        (
            format!(r#"{{{base}, "ssm_cfg": {{"layer": "Mamba2", "headdim": 48}}}}"#),
            "ssm_cfg.headdim",
        ),
        (
            format!(r#"{{{base}, "ssm_cfg": {{"layer": "Mamba2", "headdim": 16, "ngroups": 3}}}}"#),
            "ssm_cfg.ngroups",
        ),
        (
            format!(r#"{{{base}, "ssm_cfg": {{"layer": "Mamba2", "d_ssm": 512}}}}"#),
            "ssm_cfg.d_ssm",
        ),
        (
            format!(r#"{{{base}, "ssm_cfg": {{"layer": "Mamba2", "dt_limit": [1.0, 0.5]}}}}"#),
            "ssm_cfg.dt_limit",
        ),
        (format!(r#"{{{base}, "ssm_cfg": {{"dt_rank": "big"}}}}"#), "ssm_cfg.dt_rank"),
        (format!(r#"{{{base}, "ssm_cfg": {{"d_state": -3}}}}"#), "ssm_cfg.d_state"),
        (format!(r#"{{{base}, "ssm_cfg": {{"expand": 0}}}}"#), "ssm_cfg.expand"),
        (format!(r#"{{{base}, "ssm_cfg": {{"bias": "no"}}}}"#), "ssm_cfg.bias"),
        (format!(r#"{{{base}, "ssm_cfg": [1]}}"#), "ssm_cfg"),
        (format!(r#"{{{base}, "tie_embeddings": 1}}"#), "tie_embeddings"),
        (format!(r#"{{{base}, "pad_vocab_size_multiple": 0}}"#), "pad_vocab_size_multiple"),
        (r#"{"n_layer": 2, "vocab_size": 256}"#.into(), "d_model"),
        (r#"{"d_model": "wide", "n_layer": 2, "vocab_size": 256}"#.into(), "d_model"),
        (r#"{"d_model": 64, "n_layer": 2.5, "vocab_size": 256}"#.into(), "n_layer"),
        (r#"{"model_type": "mamba", "num_hidden_layers": 2, "vocab_size": 9}"#.into(), "hidden_size"),
        (
            r#"{"model_type": "jamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 9}"#
                .into(),
            "model_type",
        ),
        (
            r#"{"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 9,
                "hidden_act": "gelu"}"#
                .into(),
            "hidden_act",
        ),
        (
            r#"{"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 9,
                "num_heads": 4, "head_dim": 16, "n_groups": 1}"#
                .into(),
            "num_heads",
        ),
        (
            r#"{"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 9,
                "num_heads": 4, "head_dim": 32}"#
                .into(),
            "n_groups",
        ),
        (
            r#"{"model_type": "falcon_mamba", "hidden_size": 64, "num_hidden_layers": 2,
                "vocab_size": 9, "mixer_rms_eps": -1}"#
                .into(),
            "mixer_rms_eps",
        ),
    ];
    for (text, field) in cases {
        let e = err(&text);
        assert!(e.contains(field), "{text}\n -> {e}\n should name `{field}`");
    }
    let e = err("{not json");
    assert!(e.contains("cfg.json") && e.contains("JSON"), "{e}");
    let e = err("[1, 2]");
    assert!(e.contains("object"), "{e}");
}

#[test]
fn detects_the_family_of_every_layout() {
    let k = |t: &str| detect_family(t, "t").unwrap();
    assert_eq!(k(r#"{"ssm_cfg": {}}"#), FamilyKind::Mamba1);
    assert_eq!(k(r#"{}"#), FamilyKind::Mamba1);
    assert_eq!(k(r#"{"ssm_cfg": {"layer": "Mamba2"}}"#), FamilyKind::Mamba2);
    assert_eq!(k(r#"{"ssm_cfg": {"layer": "Mamba3"}}"#), FamilyKind::Mamba3);
    assert_eq!(k(r#"{"model_type": "falcon_mamba"}"#), FamilyKind::Mamba1);
    assert_eq!(
        k(r#"{"model_type": "mamba2", "x": Infinity}"#),
        FamilyKind::Mamba2
    );
    let e = detect_family(r#"{"model_type": "llama"}"#, "t").unwrap_err();
    assert!(e.to_string().contains("model_type"), "{e}");
}
