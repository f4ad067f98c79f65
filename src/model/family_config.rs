//! The config of a Mamba-1 (or FalconMamba) or Mamba-2 language model, read from either
//! checkpoint layout and normalised into one description (spec §1, §2.1, §3.1, §4, §5.1).
//!
//! - Official layout: the `MambaConfig` JSON of state-spaces/mamba; `ssm_cfg.layer` picks
//!   the mixer (absent or `"Mamba1"` → Mamba-1, `"Mamba2"` → Mamba-2). Like the official
//!   constructors, unknown keys are refused (they would raise there).
//! - transformers layout: dispatched on `model_type` (`mamba`, `falcon_mamba`, `mamba2`),
//!   never on key presence, because early `-hf` configs carry the official keys too. Keys
//!   transformers does not read are ignored, as transformers does.
//!
//! Python writes `Infinity`, `-Infinity` and `NaN` as bare tokens (`"time_step_limit":
//! [0.0, Infinity]`), which is not JSON; [`parse_json_lenient`] accepts them, as well as
//! transformers 5's `{"__float__": "Infinity"}`.
//!
//! The model sizes (`d_model`/`hidden_size`, `n_layer`/`num_hidden_layers`, `vocab_size`)
//! are required: the dataclass defaults describe no real checkpoint, and a file without them
//! is broken. Mixer fields take the official (or transformers) defaults when absent.

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// Which mixer family a config describes (also reports Mamba-3, which this module does not
/// read, so that a caller can dispatch on one look at the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FamilyKind {
    Mamba1,
    Mamba2,
    Mamba3,
}

/// Where a config came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigLayout {
    /// state-spaces/mamba `MambaConfig`
    Official,
    /// transformers, with its `model_type`
    Transformers(String),
}

/// Mamba-1 mixer sizes and options (spec §2.1, §2.5).
#[derive(Clone, Debug, PartialEq)]
pub struct Mamba1Config {
    /// `D_i`
    pub d_inner: usize,
    /// `N`
    pub d_state: usize,
    /// `K`
    pub d_conv: usize,
    /// `R`
    pub dt_rank: usize,
    pub conv_bias: bool,
    /// `in_proj.bias` and `out_proj.bias` present
    pub proj_bias: bool,
    /// FalconMamba: the eps of the weightless RMS norms on δ, B and C (spec §2.5).
    pub bcdt_rms_eps: Option<f64>,
}

/// Mamba-2 mixer sizes and options (spec §3.1).
#[derive(Clone, Debug, PartialEq)]
pub struct Mamba2Config {
    /// `D_i`
    pub d_inner: usize,
    /// channels through the SSM (`D_i` unless set; the rest form a gated-MLP branch)
    pub d_ssm: usize,
    /// `N`
    pub d_state: usize,
    /// `K`
    pub d_conv: usize,
    /// `P`
    pub headdim: usize,
    /// `H = d_ssm / P`
    pub nheads: usize,
    /// `G`
    pub ngroups: usize,
    /// `D` is `[d_ssm]` rather than `[H]`
    pub d_has_hdim: bool,
    /// gated RMSNorm before `out_proj` (else a plain `silu(z)` gate)
    pub rmsnorm: bool,
    pub norm_before_gate: bool,
    /// eps of the gated norm (1e-5 in the official module, `layer_norm_epsilon` in
    /// transformers)
    pub gated_norm_eps: f64,
    /// clamp of Δ after the softplus
    pub dt_limit: (f64, f64),
    pub conv_bias: bool,
    pub proj_bias: bool,
    /// prefill chunk length `Q` (rounding only)
    pub chunk_size: usize,
}

impl Mamba2Config {
    /// `C_d = d_ssm + 2·G·N`
    pub fn conv_dim(&self) -> usize {
        self.d_ssm + 2 * self.ngroups * self.d_state
    }
    /// width of the gated-MLP branch, `D_i − d_ssm`
    pub fn d_mlp(&self) -> usize {
        self.d_inner - self.d_ssm
    }
    /// `2·D_i + 2·G·N + H`
    pub fn d_in_proj(&self) -> usize {
        2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads
    }
    /// Group of head `h`: contiguous blocks of `H/G` heads (spec §3.3).
    pub fn group_of(&self, h: usize) -> usize {
        h / (self.nheads / self.ngroups)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum MixerConfig {
    Mamba1(Mamba1Config),
    Mamba2(Mamba2Config),
}

/// A Mamba-1 or Mamba-2 language model (spec §1).
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyConfig {
    pub layout: ConfigLayout,
    pub d_model: usize,
    pub n_layer: usize,
    /// as the config says (unpadded in the official layout, padded in transformers')
    pub vocab_size: usize,
    /// rows of the embedding and the logits
    pub vocab_padded: usize,
    pub tie_embeddings: bool,
    /// eps of the block norms and `norm_f`
    pub norm_eps: f64,
    pub mixer: MixerConfig,
}

/// Block norm eps of the official LM (spec §1), never overridden there.
pub const OFFICIAL_NORM_EPS: f64 = 1e-5;

impl FamilyConfig {
    pub fn from_file(path: &Path) -> Result<FamilyConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Read a config of either layout; `origin` names the file in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<FamilyConfig> {
        let root = parse_root(text, origin)?;
        let obj = Obj::new(&root, "", origin);
        if let Some(model_type) = obj.string("model_type")? {
            return from_transformers(&obj, &model_type);
        }
        from_official(&obj)
    }

    pub fn family(&self) -> FamilyKind {
        match self.mixer {
            MixerConfig::Mamba1(_) => FamilyKind::Mamba1,
            MixerConfig::Mamba2(_) => FamilyKind::Mamba2,
        }
    }
    pub fn mamba1(&self) -> Option<&Mamba1Config> {
        match &self.mixer {
            MixerConfig::Mamba1(m) => Some(m),
            MixerConfig::Mamba2(_) => None,
        }
    }
    pub fn mamba2(&self) -> Option<&Mamba2Config> {
        match &self.mixer {
            MixerConfig::Mamba2(m) => Some(m),
            MixerConfig::Mamba1(_) => None,
        }
    }
}

/// The mixer family of a config of either layout, without validating the rest.
/// The error of a model of family `found` given where `want` was needed.
pub(crate) fn wrong_family(found: &str, want: &str) -> Error {
    Error::Unsupported {
        field: "mixer family (ssm_cfg.layer / model_type)".into(),
        found: found.into(),
        supported: want.into(),
    }
}

pub fn detect_family(text: &str, origin: &str) -> Result<FamilyKind> {
    let root = parse_root(text, origin)?;
    let obj = Obj::new(&root, "", origin);
    if let Some(mt) = obj.string("model_type")? {
        return match mt.as_str() {
            "mamba" | "falcon_mamba" => Ok(FamilyKind::Mamba1),
            "mamba2" => Ok(FamilyKind::Mamba2),
            other => Err(unsupported(
                "model_type",
                format!("{other:?}"),
                "\"mamba\", \"falcon_mamba\" or \"mamba2\"",
            )),
        };
    }
    let layer = match obj.object("ssm_cfg")? {
        Some(s) => s.string("layer")?,
        None => None,
    };
    match layer.as_deref() {
        None | Some("Mamba1") => Ok(FamilyKind::Mamba1),
        Some("Mamba2") => Ok(FamilyKind::Mamba2),
        Some("Mamba3") => Ok(FamilyKind::Mamba3),
        Some(other) => Err(unsupported(
            "ssm_cfg.layer",
            format!("{other:?}"),
            "\"Mamba1\", \"Mamba2\" or \"Mamba3\"",
        )),
    }
}

fn parse_root(text: &str, origin: &str) -> Result<Value> {
    let root = parse_json_lenient(text).map_err(|e| Error::Config {
        path: origin.into(),
        msg: format!("not valid JSON: {e}"),
    })?;
    if !root.is_object() {
        return Err(Error::Config {
            path: origin.into(),
            msg: "expected a JSON object at the top level".into(),
        });
    }
    Ok(root)
}

const OFFICIAL_KEYS: [&str; 12] = [
    "d_model",
    "d_intermediate",
    "n_layer",
    "vocab_size",
    "ssm_cfg",
    "attn_layer_idx",
    "attn_cfg",
    "rms_norm",
    "residual_in_fp32",
    "fused_add_norm",
    "pad_vocab_size_multiple",
    "tie_embeddings",
];

/// Keys of the official `Mamba` (Mamba-1) constructor that `ssm_cfg` may set (M1:32-50).
const MAMBA1_KEYS: [&str; 13] = [
    "layer",
    "d_state",
    "d_conv",
    "expand",
    "dt_rank",
    "dt_min",
    "dt_max",
    "dt_init",
    "dt_scale",
    "dt_init_floor",
    "conv_bias",
    "bias",
    "use_fast_path",
];

/// Keys of the official `Mamba2` constructor that `ssm_cfg` may set (M2:38-66).
const MAMBA2_KEYS: [&str; 22] = [
    "layer",
    "d_state",
    "d_conv",
    "conv_init",
    "expand",
    "headdim",
    "d_ssm",
    "ngroups",
    "A_init_range",
    "D_has_hdim",
    "rmsnorm",
    "norm_before_gate",
    "dt_min",
    "dt_max",
    "dt_init_floor",
    "dt_limit",
    "bias",
    "conv_bias",
    "chunk_size",
    "use_mem_eff_path",
    "process_group",
    "sequence_parallel",
];

fn from_official(obj: &Obj) -> Result<FamilyConfig> {
    obj.refuse_unknown(&OFFICIAL_KEYS, "the fields of the official MambaConfig")?;
    let d_model = obj.req_usize("d_model")?;
    let n_layer = obj.req_usize("n_layer")?;
    let vocab_size = obj.req_usize("vocab_size")?;
    let d_intermediate = obj.usize_or("d_intermediate", 0, true)?;
    if d_intermediate != 0 {
        return Err(unsupported(
            "d_intermediate",
            d_intermediate,
            "0 (no GatedMLP after the mixers)",
        ));
    }
    if let Some(v) = obj.get("attn_layer_idx") {
        let empty = matches!(v, Value::Array(a) if a.is_empty()) || v.is_null();
        if !empty {
            return Err(unsupported(
                "attn_layer_idx",
                v,
                "[] (no attention layers; hybrid models are not supported)",
            ));
        }
    }
    if !obj.bool_or("rms_norm", true)? {
        return Err(unsupported(
            "rms_norm",
            "false",
            "true (RMSNorm blocks; LayerNorm blocks are not supported)",
        ));
    }
    // Rounding and kernel choices only (spec §1): read to check their type.
    obj.bool_or("residual_in_fp32", true)?;
    obj.bool_or("fused_add_norm", true)?;
    let pad = obj.usize_or("pad_vocab_size_multiple", 8, false)?;
    let tie_embeddings = obj.bool_or("tie_embeddings", true)?;
    let empty = Value::Object(Map::new());
    let ssm = match obj.get("ssm_cfg") {
        None | Some(Value::Null) => Obj::new(&empty, "ssm_cfg.", obj.origin),
        Some(v @ Value::Object(_)) => Obj::new(v, "ssm_cfg.", obj.origin),
        Some(other) => return Err(obj.bad("ssm_cfg", "an object", other)),
    };
    let mixer = match ssm.string("layer")?.as_deref() {
        None | Some("Mamba1") => {
            ssm.refuse_unknown(&MAMBA1_KEYS, "the fields of the official Mamba-1 mixer")?;
            MixerConfig::Mamba1(Mamba1Config {
                d_inner: d_inner_of(&ssm, "expand", d_model, false)?,
                d_state: ssm.usize_or("d_state", 16, false)?,
                d_conv: ssm.usize_or("d_conv", 4, false)?,
                dt_rank: dt_rank_of(&ssm, "dt_rank", d_model)?,
                conv_bias: ssm.bool_or("conv_bias", true)?,
                proj_bias: ssm.bool_or("bias", false)?,
                bcdt_rms_eps: None,
            })
        }
        Some("Mamba2") => {
            ssm.refuse_unknown(&MAMBA2_KEYS, "the fields of the official Mamba-2 mixer")?;
            if let Some(v) = ssm.get("process_group").filter(|v| !v.is_null()) {
                return Err(unsupported(
                    "ssm_cfg.process_group",
                    v,
                    "null (no tensor parallelism)",
                ));
            }
            let d_inner = d_inner_of(&ssm, "expand", d_model, true)?;
            let d_ssm = ssm.usize_or("d_ssm", d_inner, false)?;
            mamba2_config(
                &ssm,
                Mamba2Fields {
                    d_inner,
                    d_ssm,
                    d_state: ssm.usize_or("d_state", 128, false)?,
                    d_conv: ssm.usize_or("d_conv", 4, false)?,
                    headdim: ssm.usize_or("headdim", 64, false)?,
                    nheads: None,
                    ngroups: ssm.usize_or("ngroups", 1, false)?,
                    d_has_hdim: ssm.bool_or("D_has_hdim", false)?,
                    rmsnorm: ssm.bool_or("rmsnorm", true)?,
                    norm_before_gate: ssm.bool_or("norm_before_gate", false)?,
                    gated_norm_eps: OFFICIAL_NORM_EPS,
                    dt_limit: ssm.float_pair_or("dt_limit", (0.0, f64::INFINITY))?,
                    conv_bias: ssm.bool_or("conv_bias", true)?,
                    proj_bias: ssm.bool_or("bias", false)?,
                    chunk_size: ssm.usize_or("chunk_size", 256, false)?,
                },
            )?
        }
        Some(other) => {
            return Err(unsupported(
                "ssm_cfg.layer",
                format!("{other:?}"),
                "\"Mamba1\" or \"Mamba2\" (Mamba-3 is read by model::config)",
            ))
        }
    };
    Ok(FamilyConfig {
        layout: ConfigLayout::Official,
        d_model,
        n_layer,
        vocab_size,
        vocab_padded: vocab_size.div_ceil(pad) * pad,
        tie_embeddings,
        norm_eps: OFFICIAL_NORM_EPS,
        mixer,
    })
}

fn from_transformers(obj: &Obj, model_type: &str) -> Result<FamilyConfig> {
    let d_model = obj.req_usize("hidden_size")?;
    let n_layer = obj.req_usize("num_hidden_layers")?;
    let vocab_size = obj.req_usize("vocab_size")?;
    let norm_eps = obj.pos_f64_or("layer_norm_epsilon", 1e-5)?;
    if let Some(act) = obj.string("hidden_act")? {
        if act != "silu" {
            return Err(unsupported("hidden_act", format!("{act:?}"), "\"silu\""));
        }
    }
    let conv_bias = obj.bool_or("use_conv_bias", true)?;
    let proj_bias = obj.bool_or("use_bias", false)?;
    let (mixer, tie_default) = match model_type {
        "mamba" | "falcon_mamba" => {
            let d_inner = match obj.get("intermediate_size").filter(|v| !v.is_null()) {
                Some(_) => obj.req_usize("intermediate_size")?,
                None => d_inner_of(obj, "expand", d_model, false)?,
            };
            let bcdt_rms_eps = if model_type == "falcon_mamba" {
                Some(obj.pos_f64_or("mixer_rms_eps", 1e-6)?)
            } else {
                None
            };
            let m = Mamba1Config {
                d_inner,
                d_state: obj.usize_or("state_size", 16, false)?,
                d_conv: obj.usize_or("conv_kernel", 4, false)?,
                dt_rank: dt_rank_of(obj, "time_step_rank", d_model)?,
                conv_bias,
                proj_bias,
                bcdt_rms_eps,
            };
            (MixerConfig::Mamba1(m), true)
        }
        "mamba2" => {
            // transformers derives d_inner from expand and ignores intermediate_size; its
            // heads must tile d_inner exactly (it has no d_ssm).
            let d_inner = d_inner_of(obj, "expand", d_model, true)?;
            let fields = Mamba2Fields {
                d_inner,
                d_ssm: d_inner,
                d_state: obj.usize_or("state_size", 128, false)?,
                d_conv: obj.usize_or("conv_kernel", 4, false)?,
                headdim: obj.usize_or("head_dim", 64, false)?,
                nheads: Some(("num_heads", obj.usize_or("num_heads", 128, false)?)),
                ngroups: obj.usize_or("n_groups", 8, false)?,
                d_has_hdim: false,
                rmsnorm: true,
                // transformers always gates before normalising; Codestral conversions carry
                // a `norm_before_gate: true` it never reads (spec §5.1).
                norm_before_gate: false,
                gated_norm_eps: norm_eps,
                dt_limit: obj.float_pair_or("time_step_limit", (0.0, f64::INFINITY))?,
                conv_bias,
                proj_bias,
                chunk_size: obj.usize_or("chunk_size", 256, false)?,
            };
            (mamba2_config(obj, fields)?, false)
        }
        other => {
            return Err(unsupported(
                "model_type",
                format!("{other:?}"),
                "\"mamba\", \"falcon_mamba\" or \"mamba2\"",
            ))
        }
    };
    Ok(FamilyConfig {
        layout: ConfigLayout::Transformers(model_type.into()),
        d_model,
        n_layer,
        vocab_size,
        vocab_padded: vocab_size,
        tie_embeddings: obj.bool_or("tie_word_embeddings", tie_default)?,
        norm_eps,
        mixer,
    })
}

/// Mamba-2 fields before validation; `nheads` is given (with its key) by transformers and
/// derived from `headdim` by the official layout.
struct Mamba2Fields {
    d_inner: usize,
    d_ssm: usize,
    d_state: usize,
    d_conv: usize,
    headdim: usize,
    nheads: Option<(&'static str, usize)>,
    ngroups: usize,
    d_has_hdim: bool,
    rmsnorm: bool,
    norm_before_gate: bool,
    gated_norm_eps: f64,
    dt_limit: (f64, f64),
    conv_bias: bool,
    proj_bias: bool,
    chunk_size: usize,
}

fn mamba2_config(obj: &Obj, f: Mamba2Fields) -> Result<MixerConfig> {
    let p = obj.prefix;
    if f.d_ssm > f.d_inner {
        return Err(obj.invalid(&format!(
            "`{p}d_ssm` ({}) must not exceed d_inner = expand·d_model = {}",
            f.d_ssm, f.d_inner
        )));
    }
    let head_key = if f.nheads.is_some() {
        "head_dim"
    } else {
        "headdim"
    };
    if !f.d_ssm.is_multiple_of(f.headdim) {
        return Err(obj.invalid(&format!(
            "`{p}{head_key}` ({}) must divide the SSM width {}",
            f.headdim, f.d_ssm
        )));
    }
    let nheads = f.d_ssm / f.headdim;
    if let Some((key, given)) = f.nheads {
        if given != nheads {
            return Err(obj.invalid(&format!(
                "`{key}` ({given}) times `head_dim` ({}) must equal expand·hidden_size = {}",
                f.headdim, f.d_ssm
            )));
        }
    }
    let group_key = if f.nheads.is_some() {
        "n_groups"
    } else {
        "ngroups"
    };
    if !nheads.is_multiple_of(f.ngroups) {
        return Err(obj.invalid(&format!(
            "`{p}{group_key}` ({}) must divide the number of heads {nheads}",
            f.ngroups
        )));
    }
    let (lo, hi) = f.dt_limit;
    if lo.is_nan() || hi.is_nan() || lo > hi {
        let key = if f.nheads.is_some() {
            "time_step_limit"
        } else {
            "ssm_cfg.dt_limit"
        };
        return Err(obj.invalid(&format!(
            "`{key}` must be [low, high] with low ≤ high, found [{lo}, {hi}]"
        )));
    }
    Ok(MixerConfig::Mamba2(Mamba2Config {
        d_inner: f.d_inner,
        d_ssm: f.d_ssm,
        d_state: f.d_state,
        d_conv: f.d_conv,
        headdim: f.headdim,
        nheads,
        ngroups: f.ngroups,
        d_has_hdim: f.d_has_hdim,
        rmsnorm: f.rmsnorm,
        norm_before_gate: f.norm_before_gate,
        gated_norm_eps: f.gated_norm_eps,
        dt_limit: f.dt_limit,
        conv_bias: f.conv_bias,
        proj_bias: f.proj_bias,
        chunk_size: f.chunk_size,
    }))
}

/// `D_i = expand·D_m`: truncated for Mamba-1 (`int(...)`, M1:57); Mamba-2 needs an integer.
fn d_inner_of(obj: &Obj, key: &str, d_model: usize, exact: bool) -> Result<usize> {
    let expand = obj.pos_f64_or(key, 2.0)?;
    let d = expand * d_model as f64;
    if exact && d.fract() != 0.0 {
        return Err(obj.invalid(&format!(
            "`{}{key}` ({expand}) times d_model ({d_model}) must be a whole number",
            obj.prefix
        )));
    }
    let d = d as usize;
    if d == 0 {
        return Err(obj.invalid(&format!(
            "`{}{key}` ({expand}) leaves d_inner = 0",
            obj.prefix
        )));
    }
    Ok(d)
}

/// `"auto"` → `ceil(d_model/16)`, else a positive integer.
fn dt_rank_of(obj: &Obj, key: &str, d_model: usize) -> Result<usize> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(d_model.div_ceil(16)),
        Some(Value::String(s)) if s == "auto" => Ok(d_model.div_ceil(16)),
        Some(_) => obj
            .req_usize(key)
            .map_err(|_| obj.bad(key, "\"auto\" or a positive integer", obj.get(key).unwrap())),
    }
}

fn unsupported(field: &str, found: impl std::fmt::Display, supported: &str) -> Error {
    Error::Unsupported {
        field: field.into(),
        found: found.to_string(),
        supported: supported.into(),
    }
}

/// A JSON object with the path of its keys (`ssm_cfg.`) for error messages.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
    origin: &'a str,
}

impl<'a> Obj<'a> {
    fn new(v: &'a Value, prefix: &'a str, origin: &'a str) -> Self {
        Obj {
            // Callers only wrap values they have matched as objects.
            map: v.as_object().expect("Obj wraps a JSON object"),
            prefix,
            origin,
        }
    }
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }
    fn invalid(&self, msg: &str) -> Error {
        Error::Config {
            path: self.origin.into(),
            msg: msg.into(),
        }
    }
    fn bad(&self, key: &str, expected: &str, found: &Value) -> Error {
        self.invalid(&format!(
            "field `{}{key}`: expected {expected}, found {found}",
            self.prefix
        ))
    }
    fn refuse_unknown(&self, known: &[&str], what: &str) -> Result<()> {
        match self.map.keys().find(|k| !known.contains(&k.as_str())) {
            None => Ok(()),
            Some(k) => Err(unsupported(
                &format!("{}{k}", self.prefix),
                "present",
                &format!("{what} ({})", known.join(", ")),
            )),
        }
    }
    fn object(&self, key: &str) -> Result<Option<Obj<'a>>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v @ Value::Object(_)) => Ok(Some(Obj::new(v, "", self.origin))),
            Some(other) => Err(self.bad(key, "an object", other)),
        }
    }
    fn string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.bad(key, "a string", other)),
        }
    }
    fn req_usize(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None | Some(Value::Null) => Err(self.invalid(&format!(
                "missing field `{}{key}` (a positive integer)",
                self.prefix
            ))),
            Some(v) => match as_usize(v) {
                Some(n) if n > 0 => Ok(n),
                _ => Err(self.bad(key, "a positive integer", v)),
            },
        }
    }
    fn usize_or(&self, key: &str, default: usize, zero_ok: bool) -> Result<usize> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => match as_usize(v) {
                Some(n) if n > 0 || zero_ok => Ok(n),
                _ => Err(self.bad(
                    key,
                    if zero_ok {
                        "a non-negative integer"
                    } else {
                        "a positive integer"
                    },
                    v,
                )),
            },
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(self.bad(key, "true or false", other)),
        }
    }
    fn pos_f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => match as_f64(v) {
                Some(x) if x > 0.0 && x.is_finite() => Ok(x),
                _ => Err(self.bad(key, "a positive number", v)),
            },
        }
    }
    fn float_pair_or(&self, key: &str, default: (f64, f64)) -> Result<(f64, f64)> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => match v.as_array().map(|a| a.as_slice()) {
                Some([a, b]) => match (as_f64(a), as_f64(b)) {
                    (Some(a), Some(b)) => Ok((a, b)),
                    _ => Err(self.bad(key, "a pair of numbers", v)),
                },
                _ => Err(self.bad(key, "a pair of numbers [low, high]", v)),
            },
        }
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    if let Some(n) = v.as_u64() {
        return usize::try_from(n).ok();
    }
    // Python may write an integral float (`2.0`) where an int is meant.
    let x = v.as_f64()?;
    (x >= 0.0 && x.fract() == 0.0 && x < 2f64.powi(53)).then_some(x as usize)
}

/// A number, or a non-finite value spelled `{"__float__": "Infinity"}` (transformers 5, and
/// what [`parse_json_lenient`] turns bare `Infinity`/`NaN` tokens into).
fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Object(m) if m.len() == 1 => {
            let s = m.get("__float__")?.as_str()?;
            match s.trim().to_ascii_lowercase().as_str() {
                "infinity" | "inf" | "+infinity" | "+inf" => Some(f64::INFINITY),
                "-infinity" | "-inf" => Some(f64::NEG_INFINITY),
                "nan" => Some(f64::NAN),
                other => other.parse().ok(),
            }
        }
        _ => None,
    }
}

/// Parse JSON that may contain Python's bare `Infinity`, `-Infinity` and `NaN` tokens: each
/// is rewritten (outside strings) to `{"__float__": "…"}`, the spelling transformers 5 uses.
pub fn parse_json_lenient(text: &str) -> std::result::Result<Value, serde_json::Error> {
    const TOKENS: [(&str, &str); 3] = [
        ("-Infinity", "-Infinity"),
        ("Infinity", "Infinity"),
        ("NaN", "NaN"),
    ];
    let b = text.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(b.len() + 16);
    let mut i = 0;
    let mut in_string = false;
    while i < b.len() {
        let c = b[i];
        if in_string {
            out.push(c);
            if c == b'\\' && i + 1 < b.len() {
                out.push(b[i + 1]);
                i += 2;
                continue;
            }
            in_string = c != b'"';
            i += 1;
            continue;
        }
        if c == b'"' {
            in_string = true;
            out.push(c);
            i += 1;
            continue;
        }
        let token = TOKENS
            .iter()
            .find(|(t, _)| b[i..].starts_with(t.as_bytes()));
        match token {
            Some((t, name)) => {
                out.extend_from_slice(format!("{{\"__float__\": \"{name}\"}}").as_bytes());
                i += t.len();
            }
            None => {
                out.push(c);
                i += 1;
            }
        }
    }
    // Only ASCII was inserted, at ASCII positions: still UTF-8.
    let text = String::from_utf8(out).expect("rewriting keeps UTF-8");
    serde_json::from_str(&text)
}

#[cfg(test)]
#[path = "family_config_tests.rs"]
mod tests;
