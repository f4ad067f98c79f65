//! The official `config.json` (`MambaConfig` of state-spaces/mamba) and every dimension
//! derived from it (spec §1.2, §1.4).
//!
//! Missing keys take the official defaults. A model this engine cannot run (another mixer,
//! MIMO, attention layers, LayerNorm blocks) is refused with an error naming the field.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// How the data-dependent A is activated (spec §2.2, §10.1). The official code switched
/// from softplus to heavy-tail on 2026-06-02 and no config field records which one a
/// checkpoint was trained with; `ssm_cfg.a_activation` (our key) selects it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AActivation {
    #[default]
    HeavyTail,
    Softplus,
}

/// The mixer fields of `ssm_cfg` (spec §1.1), with the official defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SsmConfig {
    pub layer: String,
    pub d_state: usize,
    pub expand: f64,
    pub headdim: usize,
    pub ngroups: usize,
    pub rope_fraction: f64,
    #[serde(rename = "A_floor")]
    pub a_floor: f64,
    pub is_outproj_norm: bool,
    pub is_mimo: bool,
    pub mimo_rank: usize,
    pub chunk_size: usize,
    pub dt_min: f64,
    pub dt_max: f64,
    pub dt_init_floor: f64,
    pub a_activation: AActivation,
}

impl Default for SsmConfig {
    fn default() -> Self {
        SsmConfig {
            layer: "Mamba1".into(),
            d_state: 128,
            expand: 2.0,
            headdim: 64,
            ngroups: 1,
            rope_fraction: 0.5,
            a_floor: 1e-4,
            is_outproj_norm: false,
            is_mimo: false,
            mimo_rank: 4,
            chunk_size: 64,
            dt_min: 0.001,
            dt_max: 0.1,
            dt_init_floor: 1e-4,
            a_activation: AActivation::HeavyTail,
        }
    }
}

/// `MambaConfig` (spec §1.4), with the official defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub d_model: usize,
    pub d_intermediate: usize,
    pub n_layer: usize,
    pub vocab_size: usize,
    pub ssm_cfg: SsmConfig,
    pub attn_layer_idx: Vec<usize>,
    pub attn_cfg: serde_json::Map<String, serde_json::Value>,
    pub rms_norm: bool,
    pub residual_in_fp32: bool,
    pub fused_add_norm: bool,
    pub pad_vocab_size_multiple: usize,
    pub tie_embeddings: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            d_model: 2560,
            d_intermediate: 0,
            n_layer: 64,
            vocab_size: 50277,
            ssm_cfg: SsmConfig::default(),
            attn_layer_idx: vec![],
            attn_cfg: Default::default(),
            rms_norm: true,
            residual_in_fp32: true,
            fused_add_norm: true,
            pad_vocab_size_multiple: 8,
            tie_embeddings: true,
        }
    }
}

/// Block and mixer RMSNorm epsilon: fixed at 1e-5 by the official LM (spec §1.4).
pub const NORM_EPS: f64 = 1e-5;

/// Every size the engine needs, derived once from a validated `Config` (spec §1.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub d_model: usize,
    pub n_layer: usize,
    /// `D_i = expand · d_model`
    pub d_inner: usize,
    /// `P`
    pub headdim: usize,
    /// `H = D_i / P`
    pub nheads: usize,
    /// `N`
    pub d_state: usize,
    /// `G`
    pub ngroups: usize,
    /// `S`, rotary angles per head
    pub num_rope_angles: usize,
    /// `2·D_i + 2·N·G + 3·H + S`
    pub d_in_proj: usize,
    pub vocab_size: usize,
    pub vocab_padded: usize,
    /// GatedMLP hidden width (0 without MLP)
    pub mlp_hidden: usize,
    pub chunk_len: usize,
}

impl Dims {
    /// Offsets of the slices of one `in_proj` output row (spec §2.1).
    pub fn z_off(&self) -> usize {
        0
    }
    pub fn x_off(&self) -> usize {
        self.d_inner
    }
    pub fn b_off(&self) -> usize {
        2 * self.d_inner
    }
    pub fn c_off(&self) -> usize {
        2 * self.d_inner + self.ngroups * self.d_state
    }
    pub fn dt_off(&self) -> usize {
        2 * self.d_inner + 2 * self.ngroups * self.d_state
    }
    pub fn a_off(&self) -> usize {
        self.dt_off() + self.nheads
    }
    pub fn trap_off(&self) -> usize {
        self.dt_off() + 2 * self.nheads
    }
    pub fn angle_off(&self) -> usize {
        self.dt_off() + 3 * self.nheads
    }
    /// Group of head `h`: contiguous blocks of `H/G` heads (spec §2.3).
    pub fn group_of(&self, h: usize) -> usize {
        h / (self.nheads / self.ngroups)
    }
    /// f32 elements of one sequence's state in one layer (angle, ssm, k, v).
    pub fn state_elems_per_layer(&self) -> usize {
        let (h, p, n, s) = (
            self.nheads,
            self.headdim,
            self.d_state,
            self.num_rope_angles,
        );
        h * s + h * p * n + h * n + h * p
    }
}

fn unsupported(field: &str, found: impl std::fmt::Display, supported: &str) -> Error {
    Error::Unsupported {
        field: field.into(),
        found: found.to_string(),
        supported: supported.into(),
    }
}

impl Config {
    pub fn from_json_str(text: &str, origin: &str) -> Result<Config> {
        crate::model::config_shape::check(text, origin)?;
        let cfg: Config = serde_json::from_str(text).map_err(|e| Error::Config {
            path: origin.into(),
            msg: e.to_string(),
        })?;
        cfg.validate().map_err(|e| match e {
            Error::Config { msg, .. } => Error::Config {
                path: origin.into(),
                msg,
            },
            e => e,
        })?;
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serialises")
    }

    /// A Mamba-3 SISO language model config with the given shape and official defaults
    /// elsewhere (for synthetic models and tests).
    pub fn synthetic(
        d_model: usize,
        n_layer: usize,
        d_state: usize,
        headdim: usize,
        expand: usize,
        ngroups: usize,
        vocab_size: usize,
    ) -> Config {
        Config {
            d_model,
            n_layer,
            vocab_size,
            ssm_cfg: SsmConfig {
                layer: "Mamba3".into(),
                d_state,
                headdim,
                expand: expand as f64,
                ngroups,
                ..SsmConfig::default()
            },
            ..Config::default()
        }
    }

    /// Refuse what we cannot run, and shapes that cannot be derived.
    pub fn validate(&self) -> Result<()> {
        let s = &self.ssm_cfg;
        let bad = |msg: String| Error::Config {
            path: String::new(),
            msg,
        };
        if s.layer != "Mamba3" {
            return Err(unsupported(
                "ssm_cfg.layer",
                format!("{:?}", s.layer),
                "\"Mamba3\"",
            ));
        }
        if s.is_mimo {
            return Err(unsupported("ssm_cfg.is_mimo", "true", "false (SISO)"));
        }
        if !self.attn_layer_idx.is_empty() {
            return Err(unsupported(
                "attn_layer_idx",
                format!("{:?}", self.attn_layer_idx),
                "[] (no attention layers)",
            ));
        }
        if !self.rms_norm {
            return Err(unsupported("rms_norm", "false", "true (RMSNorm blocks)"));
        }
        for (name, v) in [
            ("d_model", self.d_model),
            ("n_layer", self.n_layer),
            ("vocab_size", self.vocab_size),
            ("pad_vocab_size_multiple", self.pad_vocab_size_multiple),
            ("ssm_cfg.d_state", s.d_state),
            ("ssm_cfg.headdim", s.headdim),
            ("ssm_cfg.ngroups", s.ngroups),
            ("ssm_cfg.chunk_size", s.chunk_size),
        ] {
            if v == 0 {
                return Err(bad(format!("`{name}` must be positive, found 0")));
            }
        }
        if !(s.expand > 0.0 && s.expand.is_finite()) {
            return Err(bad(format!(
                "`ssm_cfg.expand` must be positive, found {}",
                s.expand
            )));
        }
        let d_inner = (s.expand * self.d_model as f64) as usize;
        if !d_inner.is_multiple_of(s.headdim) {
            return Err(bad(format!(
                "`ssm_cfg.headdim` ({}) must divide d_inner = expand·d_model = {d_inner}",
                s.headdim
            )));
        }
        let nheads = d_inner / s.headdim;
        if !nheads.is_multiple_of(s.ngroups) {
            return Err(bad(format!(
                "`ssm_cfg.ngroups` ({}) must divide nheads = {nheads}",
                s.ngroups
            )));
        }
        if s.rope_fraction != 0.5 && s.rope_fraction != 1.0 {
            return Err(unsupported(
                "ssm_cfg.rope_fraction",
                s.rope_fraction,
                "0.5 or 1.0",
            ));
        }
        if Self::rope_angles(s.d_state, s.rope_fraction) == 0 {
            return Err(bad(format!(
                "`ssm_cfg.d_state` ({}) leaves no rotary angle at rope_fraction {}",
                s.d_state, s.rope_fraction
            )));
        }
        if !(s.a_floor >= 0.0 && s.a_floor.is_finite()) {
            return Err(bad(format!(
                "`ssm_cfg.A_floor` must be ≥ 0, found {}",
                s.a_floor
            )));
        }
        Ok(())
    }

    fn rope_angles(d_state: usize, rope_fraction: f64) -> usize {
        let mut split = (d_state as f64 * rope_fraction) as usize;
        if !split.is_multiple_of(2) {
            split -= 1;
        }
        split / 2
    }

    pub fn dims(&self) -> Dims {
        let s = &self.ssm_cfg;
        let d_inner = (s.expand * self.d_model as f64) as usize;
        let nheads = d_inner / s.headdim;
        let num_rope_angles = Self::rope_angles(s.d_state, s.rope_fraction);
        let m = self.pad_vocab_size_multiple;
        Dims {
            d_model: self.d_model,
            n_layer: self.n_layer,
            d_inner,
            headdim: s.headdim,
            nheads,
            d_state: s.d_state,
            ngroups: s.ngroups,
            num_rope_angles,
            d_in_proj: 2 * d_inner + 2 * s.d_state * s.ngroups + 3 * nheads + num_rope_angles,
            vocab_size: self.vocab_size,
            vocab_padded: self.vocab_size.div_ceil(m) * m,
            mlp_hidden: self.d_intermediate.div_ceil(128) * 128,
            chunk_len: s.chunk_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derives_the_spec_example() {
        let c = Config::synthetic(768, 24, 128, 64, 2, 1, 50277);
        c.validate().unwrap();
        let d = c.dims();
        assert_eq!((d.d_inner, d.nheads, d.num_rope_angles), (1536, 24, 32));
        assert_eq!(d.d_in_proj, 3432);
        assert_eq!(d.vocab_padded, 50280);
        let mut c = Config::synthetic(256, 2, 128, 64, 2, 1, 100);
        c.d_intermediate = 160;
        assert_eq!(c.dims().d_in_proj, 1336);
        assert_eq!(c.dims().mlp_hidden, 256);
    }

    #[test]
    fn missing_keys_take_defaults() {
        let c = Config::from_json_str(r#"{"ssm_cfg": {"layer": "Mamba3"}}"#, "t").unwrap();
        assert_eq!(c.d_model, 2560);
        assert_eq!(c.ssm_cfg.d_state, 128);
        assert!(c.tie_embeddings);
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        let e = Config::from_json_str(r#"{"ssm_cfg": {"layer": "Mamba2"}}"#, "t").unwrap_err();
        assert!(e.to_string().contains("ssm_cfg.layer"), "{e}");
        let e = Config::from_json_str(r#"{"ssm_cfg": {}}"#, "t").unwrap_err();
        assert!(e.to_string().contains("Mamba1"), "{e}");
        let e = Config::from_json_str(r#"{"ssm_cfg": {"layer": "Mamba3", "is_mimo": true}}"#, "t")
            .unwrap_err();
        assert!(e.to_string().contains("is_mimo"), "{e}");
        let e = Config::from_json_str(
            r#"{"attn_layer_idx": [1], "ssm_cfg": {"layer": "Mamba3"}}"#,
            "t",
        )
        .unwrap_err();
        assert!(e.to_string().contains("attn_layer_idx"), "{e}");
        let e = Config::from_json_str(
            r#"{"rms_norm": false, "ssm_cfg": {"layer": "Mamba3"}}"#,
            "t",
        )
        .unwrap_err();
        assert!(e.to_string().contains("rms_norm"), "{e}");
        let e = Config::from_json_str(
            r#"{"d_model": 100, "ssm_cfg": {"layer": "Mamba3", "headdim": 64}}"#,
            "t",
        )
        .unwrap_err();
        assert!(e.to_string().contains("headdim"), "{e}");
        let e = Config::from_json_str(r#"{"d_model": "big"}"#, "cfg.json").unwrap_err();
        assert!(e.to_string().contains("cfg.json"), "{e}");
    }
}
