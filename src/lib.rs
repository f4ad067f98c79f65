//! mamba3: a fast inference engine for Mamba-3 state-space language models.
//!
//! Layers, each depending only on those above it: [`model`] (config, weights, files),
//! [`cpu`] (the reference recurrence and the fast CPU paths), [`engine`] (device-agnostic
//! model, states, prefill and decode).

// Numeric kernels index several arrays with one loop variable, as the spec writes them.
#![allow(clippy::needless_range_loop)]

pub mod atomic;
pub mod cli;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod error;
pub mod mixers;
pub mod model;
pub mod options;
pub mod serve;
pub mod text;
pub mod timeline;
pub mod train;

pub use engine::{Device, Logits, LogitsWant, Model, State};
pub use error::{Error, Result};
pub use mixers::{MixerKind, MixerWeights};
pub use model::DType;
