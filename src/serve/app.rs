//! What the HTTP handlers share: the server's configuration ([`ServeConfig`]), the
//! application state ([`App`]) and what is known once the model has loaded ([`Ready`]).

use super::dispatch::Dispatch;
use super::listen;
use super::metrics::Metrics;
use super::scheduler::{SchedulerConfig, Shared};
use crate::engine::Device;
use crate::model::DType;
use crate::text::{ChatTemplate, ModelSource, Tokenizer};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub source: ModelSource,
    pub tokenizer: Option<PathBuf>,
    /// The device of a server of one replica…
    pub device: Device,
    /// …or the devices of several, one model replica (engine thread, prefix cache) on
    /// each (`--devices`); empty: `device` alone.
    pub devices: Vec<Device>,
    pub dtype: DType,
    pub addr: SocketAddr,
    pub api_key: Option<String>,
    /// The name clients use (`model` field); default: the model directory's name.
    pub model_name: Option<String>,
    /// Sequences waiting for a slot at most; past it requests get 429.
    pub max_queue: usize,
    /// Tokens one request may generate at most.
    pub max_tokens_limit: usize,
    /// Tokens a prompt may have at most.
    pub max_prompt_tokens: usize,
    /// `max_tokens` of a completion that names none (OpenAI's default is 16).
    pub default_max_tokens: usize,
    pub max_body_bytes: usize,
    /// Header and body read time-outs, and the shutdown grace period.
    pub timeouts: listen::Timeouts,
    pub scheduler: SchedulerConfig,
    /// Adds `/debug/panic` (for tests of the panic guard).
    pub debug_routes: bool,
}

impl ServeConfig {
    pub fn new(source: ModelSource) -> ServeConfig {
        ServeConfig {
            source,
            tokenizer: None,
            device: Device::Cpu,
            devices: Vec::new(),
            dtype: DType::F32,
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            api_key: None,
            model_name: None,
            max_queue: 256,
            max_tokens_limit: 4096,
            max_prompt_tokens: 131_072,
            default_max_tokens: 16,
            max_body_bytes: 32 << 20,
            timeouts: listen::Timeouts::default(),
            scheduler: SchedulerConfig::default(),
            debug_routes: false,
        }
    }
}

impl ServeConfig {
    /// The device of each replica.
    pub fn replicas(&self) -> Vec<Device> {
        if self.devices.is_empty() {
            vec![self.device]
        } else {
            self.devices.clone()
        }
    }
}

/// What the handlers need once the model is loaded.
pub struct Ready {
    pub vocab_size: usize,
    pub d_model: usize,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat: Option<ChatTemplate>,
    /// The tokenizer's longest entry in bytes (see [`Tokenizer::max_token_bytes`]);
    /// without a tokenizer prompts are token ids, and this is unused.
    pub max_token_bytes: usize,
}

/// State shared by all handlers.
pub struct App {
    pub cfg: ServeConfig,
    pub name: String,
    pub created: u64,
    pub metrics: Arc<Metrics>,
    pub shared: Arc<Shared>,
    /// Hands work to the replicas' engine threads.
    pub work: Dispatch,
    pub ready: OnceLock<Ready>,
    /// Replicas still loading their model (ready when none is).
    pub loading: std::sync::atomic::AtomicUsize,
    pub load_error: OnceLock<String>,
}
