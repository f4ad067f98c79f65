//! One sequence's recurrent state across all layers: the named tensors the model's mixer
//! keeps per layer (its [`StateLayout`]: Mamba-3 `angle`, `ssm`, `k`, `v`, the `ssm` one
//! stored in f32, bf16 or f16 as `--state-dtype` says), plus the number of tokens it has
//! consumed and the fingerprint of the model it belongs to. Nothing here knows which mixer
//! it is: snapshots, files and the prefix cache work from the layout.
//!
//! A snapshot is a clone. Host states share their buffers until one side writes
//! (copy-on-write), so snapshots for a prefix cache cost nothing until used. Saved files are
//! safetensors holding `state.{l}.{name}`, each tensor in its storage dtype, and metadata
//! naming the model and the state dtype; loading a state into a different model is
//! refused. A file of another state dtype is converted on loading: widened exactly into a
//! wider state, rounded to nearest even into a narrower one.

use crate::error::{Error, Result};
use crate::model::state_layout::{StateBuf, StateLayout};
use crate::model::tensor_file::{write_safetensors, RawTensor, TensorFile};
use crate::model::TensorData;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub const STATE_FORMAT: &str = "mamba3-state";
pub const STATE_VERSION: &str = "1";

#[derive(Clone)]
pub enum StateData {
    Host(Arc<StateBuf<f32>>),
    #[cfg(feature = "cuda")]
    Cuda(crate::engine::cuda::CudaState),
}

impl StateData {
    /// Bring a state on a device to the host (a no-op for a host state).
    pub(crate) fn bring_to_host(&mut self, layout: &StateLayout) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let StateData::Cuda(s) = self {
            *self = StateData::Host(Arc::new(s.to_host(layout)?));
        }
        let _ = layout;
        Ok(())
    }

    /// The host values of several states (each made unique: copy-on-write); an error for
    /// a state on a device.
    pub(crate) fn hosts_mut<'a>(
        states: &'a mut [&mut StateData],
    ) -> Result<Vec<&'a mut StateBuf<f32>>> {
        states.iter_mut().map(|s| s.host_mut()).collect()
    }

    /// The host values (made unique: copy-on-write); an error for a state on a device.
    pub(crate) fn host_mut(&mut self) -> Result<&mut StateBuf<f32>> {
        match self {
            StateData::Host(h) => Ok(Arc::make_mut(h)),
            #[cfg(feature = "cuda")]
            StateData::Cuda(_) => Err(Error::State(
                "a state on a GPU reached the CPU model (place it first)".into(),
            )),
        }
    }

    /// The device state; an error for a host state.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_mut(&mut self) -> Result<&mut crate::engine::cuda::CudaState> {
        match self {
            StateData::Cuda(c) => Ok(c),
            StateData::Host(_) => Err(Error::State(
                "a host state reached the GPU model (place it first)".into(),
            )),
        }
    }
}

#[derive(Clone)]
pub struct State {
    pub(crate) model: u64,
    pub(crate) layout: Arc<StateLayout>,
    pub(crate) position: u64,
    pub(crate) data: StateData,
}

impl State {
    /// A fresh (all-zero) host state for a model with this layout and fingerprint.
    pub(crate) fn new_host(model: u64, layout: Arc<StateLayout>) -> State {
        State {
            model,
            data: StateData::Host(Arc::new(StateBuf::zeros(&layout))),
            layout,
            position: 0,
        }
    }

    /// The named tensors it holds per layer.
    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }

    /// Tokens consumed since the state was fresh.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// The fingerprint of the model this state belongs to.
    pub fn model_fingerprint(&self) -> u64 {
        self.model
    }

    /// Bytes the state occupies where it lives (a host state keeps f32 values, a device
    /// state each tensor in its storage dtype).
    pub fn bytes(&self) -> usize {
        match &self.data {
            StateData::Host(_) => self.layout.len() * 4,
            #[cfg(feature = "cuda")]
            StateData::Cuda(_) => self.layout.device_bytes(),
        }
    }

    /// A copy of the state's values on the host.
    pub fn to_host(&self) -> Result<StateBuf<f32>> {
        match &self.data {
            StateData::Host(s) => Ok((**s).clone()),
            #[cfg(feature = "cuda")]
            StateData::Cuda(s) => s.to_host(&self.layout),
        }
    }

    /// Named tensors as in the fixtures: `state.{l}.{name}` (Mamba-3: `angle|ssm|k|v`).
    pub fn tensors(&self) -> Result<Vec<(String, RawTensor<'static>)>> {
        let layout = &self.layout;
        let host = self.to_host()?;
        let mut out = Vec::new();
        for l in 0..layout.n_layer {
            let values = host.layer(l);
            for (i, t) in layout.tensors.iter().enumerate() {
                let off = layout.offset_in_layer(i);
                let data = TensorData::from_f32(&values[off..off + t.len()], t.dtype);
                out.push((
                    layout.file_name(l, i),
                    RawTensor::from_data(t.shape.clone(), &data),
                ));
            }
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
        meta.insert("dims".into(), self.layout.describe());
        meta.insert(
            "state_dtype".into(),
            self.layout.state_dtype().name().into(),
        );
        write_safetensors(path, &self.tensors()?, Some(meta))
    }

    /// Read a state file written by [`State::save`], checking that it belongs to the model
    /// with `fingerprint` and `layout`. The result is a host state.
    pub(crate) fn load_host(
        path: &Path,
        fingerprint: u64,
        layout: Arc<StateLayout>,
    ) -> Result<State> {
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
                layout.describe()
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
        let mut host = StateBuf::<f32>::zeros(&layout);
        for l in 0..layout.n_layer {
            for (i, t) in layout.tensors.iter().enumerate() {
                let name = layout.file_name(l, i);
                let raw = file
                    .get(&name)
                    .ok_or_else(|| Error::State(format!("{where_}: tensor `{name}` is missing")))?;
                if raw.shape != t.shape {
                    return Err(Error::Tensor {
                        name,
                        expected: format!("shape {:?}", t.shape),
                        found: format!("shape {:?}", raw.shape),
                    });
                }
                let vals = raw.to_float(&name, crate::model::DType::F32)?.to_f32_vec();
                crate::model::finite::check_f32(&format!("{where_}: {name}"), &vals)?;
                let off = layout.offset_in_layer(i);
                host.layer_mut(l)[off..off + t.len()].copy_from_slice(&vals);
            }
        }
        // a file of a wider state dtype into a 16-bit state: rounded as a store would
        layout.round_host(&mut host);
        Ok(State {
            model: fingerprint,
            layout,
            position,
            data: StateData::Host(Arc::new(host)),
        })
    }
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
