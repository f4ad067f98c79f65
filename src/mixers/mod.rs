//! The mixers: one folder each, holding its maths (module doc, in the notation of its
//! spec under `docs/spec/`), its token-by-token reference, its fast CPU paths, its CUDA
//! launches and kernels, its backward and its tests.
//!
//! The family is data: [`MixerKind`] is read from the config, and everything the engine
//! needs to know about a mixer without running it — the per-layer state it carries — is
//! asked of it here ([`state_layout`]). This file is the one place a mixer is registered.

pub mod mamba1;
pub mod mamba2;
pub mod mamba3;
pub mod mimo;

use crate::model::state_layout::StateLayout;
use crate::model::{Config, Dims};

/// Which mixer a model's layers use (`ssm_cfg.layer` in the official config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MixerKind {
    /// Mamba-3, single input single output (`layer = "Mamba3"`, `is_mimo = false`).
    Mamba3Siso,
}

impl MixerKind {
    /// The mixer a validated config names.
    pub fn of(_config: &Config) -> MixerKind {
        // `Config::validate` refuses every other mixer today, naming the field.
        MixerKind::Mamba3Siso
    }

    /// The name used in messages and state files.
    pub fn name(self) -> &'static str {
        match self {
            MixerKind::Mamba3Siso => "mamba3",
        }
    }
}

/// The named tensors one sequence's state holds per layer, for a model of this kind.
pub fn state_layout(kind: MixerKind, dims: &Dims) -> StateLayout {
    match kind {
        MixerKind::Mamba3Siso => mamba3::state::layout(dims),
    }
}
