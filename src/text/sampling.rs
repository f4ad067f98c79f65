//! Choosing the next token from a row of logits: the engine's rules
//! ([`crate::engine::sampling`]), which a decode step applies on the device too
//! ([`crate::engine::Model::decode_sample`]).

pub use crate::engine::sampling::*;
