//! One error type for the whole engine. Every variant says what was expected, what was
//! found and where, so that a user can fix the input without reading our code.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("config {path}: {msg}")]
    Config { path: String, msg: String },

    #[error("unsupported model: field `{field}` is {found}; this engine supports {supported}")]
    Unsupported {
        field: String,
        found: String,
        supported: String,
    },

    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: String, msg: String },

    #[error("tensor `{name}`: expected {expected}, found {found}")]
    Tensor {
        name: String,
        expected: String,
        found: String,
    },

    #[error("missing tensor `{name}` in {path} (expected shape {expected:?})")]
    MissingTensor {
        name: String,
        path: String,
        expected: Vec<usize>,
    },

    #[error("token id {id} at position {pos} is out of range: the vocabulary has {vocab} entries")]
    TokenOutOfRange { id: u64, pos: usize, vocab: usize },

    #[error("invalid input: {0}")]
    Input(String),

    #[error("state: {0}")]
    State(String),

    /// NaN or infinite values where finite ones are required (weights, a state, logits).
    #[error("non-finite values: {0}")]
    NonFinite(String),

    #[error("device: {0}")]
    Device(String),

    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn checkpoint(path: impl std::fmt::Display, msg: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.to_string(),
            msg: msg.into(),
        }
    }
    pub fn input(msg: impl Into<String>) -> Self {
        Error::Input(msg.into())
    }
}
