//! Text in and out of the engine: the tokenizer (HF `tokenizer.json`), the chat template
//! (`tokenizer_config.json`), sampling, stop rules, streaming detokenization and the
//! generation loop that `mamba3 generate` and the server share.
//!
//! Where a model comes from is decided in one place, [`source::ModelSource`], so that a
//! default model can later be plugged in without touching the commands.

pub mod chat;
pub mod detok;
pub mod generate;
pub mod sampling;
pub mod source;
pub mod stop;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use generate::{
    Continuation, FinishReason, GenParams, StepOut, TextRules, TokenEnd, TokenRules,
};
pub use sampling::{Sampler, SamplingParams};
pub use source::{Loaded, ModelSource};
pub use tokenizer::Tokenizer;
