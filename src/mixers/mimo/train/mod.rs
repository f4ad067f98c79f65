//! Training the Mamba-3 MIMO mixer on the CPU: the forward that keeps what the backward
//! needs ([`forward`]) and its exact backward ([`backward`]), generic over f32/f64 like the
//! SISO mixer's (`crate::mixers::mamba3::train`). The language model around the mixer
//! (embedding, block norms, MLP, head, loss) is `crate::train::model`'s, which dispatches
//! to this mixer when the config says `is_mimo`.
//!
//! Windows start from a zero state (no carried state in training), so the first token has
//! no previous-token term. The forward is spec-MIMO §2.8 token by token — the arithmetic of
//! [`crate::mixers::mimo::MimoReference`] on the trainable parameters.

pub mod backward;
pub mod forward;

use super::weights::MimoDims;
use crate::model::config::AActivation;

pub use backward::mimo_mixer_backward;
pub use forward::{mimo_mixer_forward, MimoSaved};

/// One MIMO mixer layer's constants and the batch's shape.
#[derive(Clone, Copy)]
pub struct MimoShape {
    pub d: MimoDims,
    pub a_floor: f64,
    pub a_act: AActivation,
    /// sequences in the batch, each `seq_len` rows
    pub batch: usize,
    pub seq_len: usize,
}
