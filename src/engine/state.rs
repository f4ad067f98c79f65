//! One sequence's recurrent state across all layers: per layer `angle [H,S]`,
//! `ssm [H,P,N]`, `k [H,N]`, `v [H,P]`, all f32 (spec §3.1), plus the number of tokens it
//! has consumed and the fingerprint of the model it belongs to.
//!
//! A snapshot is a clone. Host states share their buffers until one side writes
//! (copy-on-write), so snapshots for a prefix cache cost nothing until used. Saved files are
//! safetensors holding `state.{l}.angle|ssm|k|v` and metadata naming the model; loading a
//! state into a different model is refused.

use crate::cpu::{zero_state, LayerState, SeqState};
use crate::error::{Error, Result};
use crate::model::config::Dims;
use crate::model::tensor_file::{write_safetensors, RawTensor, TensorFile};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub const STATE_FORMAT: &str = "mamba3-state";
pub const STATE_VERSION: &str = "1";

#[derive(Clone)]
pub enum StateData {
    Host(Arc<SeqState<f32>>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaState),
}

#[derive(Clone)]
pub struct State {
    pub(crate) model: u64,
    pub(crate) dims: Dims,
    pub(crate) position: u64,
    pub(crate) data: StateData,
}

impl State {
    /// A fresh (all-zero) host state for a model with these dims and fingerprint.
    pub(crate) fn new_host(model: u64, dims: Dims) -> State {
        State {
            model,
            dims,
            position: 0,
            data: StateData::Host(Arc::new(zero_state(&dims))),
        }
    }

    /// Tokens consumed since the state was fresh.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// The fingerprint of the model this state belongs to.
    pub fn model_fingerprint(&self) -> u64 {
        self.model
    }

    /// Bytes the state occupies.
    pub fn bytes(&self) -> usize {
        self.dims.n_layer * self.dims.state_elems_per_layer() * 4
    }

    /// A copy of the state's values on the host.
    pub fn to_host(&self) -> Result<SeqState<f32>> {
        match &self.data {
            StateData::Host(s) => Ok((**s).clone()),
            #[cfg(feature = "cuda")]
            StateData::Cuda(s) => s.to_host(&self.dims),
        }
    }

    /// Named tensors as in the fixtures: `state.{l}.angle|ssm|k|v`.
    pub fn tensors(&self) -> Result<Vec<(String, RawTensor<'static>)>> {
        let d = &self.dims;
        let host = self.to_host()?;
        let mut out = Vec::new();
        for (l, ls) in host.iter().enumerate() {
            out.push((
                format!("state.{l}.angle"),
                RawTensor::from_f32(vec![d.nheads, d.num_rope_angles], &ls.angle),
            ));
            out.push((
                format!("state.{l}.ssm"),
                RawTensor::from_f32(vec![d.nheads, d.headdim, d.d_state], &ls.ssm),
            ));
            out.push((
                format!("state.{l}.k"),
                RawTensor::from_f32(vec![d.nheads, d.d_state], &ls.k),
            ));
            out.push((
                format!("state.{l}.v"),
                RawTensor::from_f32(vec![d.nheads, d.headdim], &ls.v),
            ));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Write the state to a safetensors file that records its model.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut meta = HashMap::new();
        meta.insert("format".into(), STATE_FORMAT.into());
        meta.insert("version".into(), STATE_VERSION.into());
        meta.insert("model_fingerprint".into(), format!("{:016x}", self.model));
        meta.insert("position".into(), self.position.to_string());
        meta.insert("dims".into(), dims_text(&self.dims));
        write_safetensors(path, &self.tensors()?, Some(meta))
    }

    /// Read a state file written by [`State::save`], checking that it belongs to the model
    /// with `fingerprint` and `dims`. The result is a host state.
    pub(crate) fn load_host(path: &Path, fingerprint: u64, dims: Dims) -> Result<State> {
        let file = TensorFile::open(path)?;
        let meta = file.metadata();
        let where_ = path.display();
        if meta.get("format").map(String::as_str) != Some(STATE_FORMAT) {
            return Err(Error::State(format!(
                "{where_} is not a mamba3 state file (metadata format = {:?}, expected {STATE_FORMAT:?})",
                meta.get("format")
            )));
        }
        let their = meta.get("model_fingerprint").cloned().unwrap_or_default();
        let ours = format!("{fingerprint:016x}");
        if their != ours {
            let their_dims = meta.get("dims").cloned().unwrap_or_default();
            return Err(Error::State(format!(
                "{where_} belongs to another model (fingerprint {their}, dims {their_dims}); \
                 this model is {ours} ({})",
                dims_text(&dims)
            )));
        }
        let position = meta
            .get("position")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| {
                Error::State(format!(
                    "{where_}: metadata `position` missing or not a number"
                ))
            })?;
        let mut layers = Vec::with_capacity(dims.n_layer);
        for l in 0..dims.n_layer {
            let mut ls = LayerState::<f32>::zeros(&dims);
            for (field, buf) in [
                ("angle", &mut ls.angle),
                ("ssm", &mut ls.ssm),
                ("k", &mut ls.k),
                ("v", &mut ls.v),
            ] {
                let name = format!("state.{l}.{field}");
                let raw = file
                    .get(&name)
                    .ok_or_else(|| Error::State(format!("{where_}: tensor `{name}` is missing")))?;
                let vals = raw.to_float(&name, crate::model::DType::F32)?.to_f32_vec();
                crate::model::finite::check_f32(&format!("{where_}: {name}"), &vals)?;
                if vals.len() != buf.len() {
                    return Err(Error::Tensor {
                        name,
                        expected: format!("{} elements", buf.len()),
                        found: format!("shape {:?}", raw.shape),
                    });
                }
                buf.copy_from_slice(&vals);
            }
            layers.push(ls);
        }
        Ok(State {
            model: fingerprint,
            dims,
            position,
            data: StateData::Host(Arc::new(layers)),
        })
    }
}

fn dims_text(d: &Dims) -> String {
    format!(
        "layers {} heads {} headdim {} d_state {} angles {}",
        d.n_layer, d.nheads, d.headdim, d.d_state, d.num_rope_angles
    )
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match &self.data {
            StateData::Host(_) => "host".to_string(),
            #[cfg(feature = "cuda")]
            StateData::Cuda(_) => "cuda".to_string(),
        };
        write!(
            f,
            "State {{ model: {:016x}, position: {}, {} bytes on {place} }}",
            self.model,
            self.position,
            self.bytes()
        )
    }
}
