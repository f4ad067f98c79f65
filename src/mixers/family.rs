//! Either Mamba-1 or Mamba-2 language model, as `config.json` names it, from a folder of
//! either file layout.

use crate::error::Result;
use crate::mixers::mamba1::weights::{self as m1, Mamba1Weights};
use crate::mixers::mamba2::weights::{self as m2, Mamba2Weights};
use crate::model::dtype::DType;
use crate::model::family_config::{wrong_family, FamilyConfig, MixerConfig};
use crate::model::family_weights::{load_lm, locate};
use crate::model::shards::TensorSource;
use std::path::Path;

/// Either family, as loaded from a folder.
#[derive(Clone, Debug, PartialEq)]
pub enum FamilyWeights {
    Mamba1(Mamba1Weights),
    Mamba2(Mamba2Weights),
}

impl FamilyWeights {
    /// Load a model folder (config.json + weights of either layout, possibly sharded), or a
    /// weights file / shard index with `config.json` beside it.
    pub fn load(path: &Path, dtype: DType) -> Result<FamilyWeights> {
        let (config_path, weights_path) = locate(path)?;
        let config = FamilyConfig::from_file(&config_path)?;
        let src = TensorSource::open(&weights_path)?;
        Self::from_source(config, &src, dtype)
    }

    pub fn from_source(
        config: FamilyConfig,
        src: &TensorSource,
        dtype: DType,
    ) -> Result<FamilyWeights> {
        let dm = config.d_model;
        Ok(match config.mixer.clone() {
            MixerConfig::Mamba1(m) => {
                FamilyWeights::Mamba1(load_lm(config, src, dtype, |r, l| {
                    m1::read_mixer(r, l, dm, &m)
                })?)
            }
            MixerConfig::Mamba2(m) => {
                FamilyWeights::Mamba2(load_lm(config, src, dtype, |r, l| {
                    m2::read_mixer(r, l, dm, &m)
                })?)
            }
        })
    }

    pub fn config(&self) -> &FamilyConfig {
        match self {
            FamilyWeights::Mamba1(w) => &w.config,
            FamilyWeights::Mamba2(w) => &w.config,
        }
    }
}

/// [`FamilyWeights::load`] for a folder that must hold one family.
impl Mamba1Weights {
    pub fn load(path: &Path, dtype: DType) -> Result<Mamba1Weights> {
        match FamilyWeights::load(path, dtype)? {
            FamilyWeights::Mamba1(w) => Ok(w),
            FamilyWeights::Mamba2(_) => Err(wrong_family("Mamba2", "Mamba1")),
        }
    }
}

impl Mamba2Weights {
    pub fn load(path: &Path, dtype: DType) -> Result<Mamba2Weights> {
        match FamilyWeights::load(path, dtype)? {
            FamilyWeights::Mamba2(w) => Ok(w),
            FamilyWeights::Mamba1(_) => Err(wrong_family("Mamba1", "Mamba2")),
        }
    }
}

#[cfg(test)]
#[path = "family_tests.rs"]
mod tests;
