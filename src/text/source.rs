//! Where a model comes from, decided in one place: [`ModelSource::resolve`]: the directory
//! named by `--model DIR`, else the built-in default model (embedded in the binary,
//! `crate::model::default_model`).

use super::chat::ChatTemplate;
use super::tokenizer::Tokenizer;
use crate::engine::{Device, Model};
use crate::error::Result;
use crate::mixers::mamba3::Weights;
use crate::model::{Config, DType};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Debug)]
pub enum ModelSource {
    /// An official checkpoint directory: config.json, weights, and optionally
    /// tokenizer.json, tokenizer_config.json, generation_config.json.
    Dir(PathBuf),
    /// A random model of a given shape (benchmarks, tests); no tokenizer of its own.
    Synthetic { config: Config, seed: u64 },
}

/// A model ready to run, with its text side.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat: Option<ChatTemplate>,
}

/// The text side of a model.
pub struct TextAssets {
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat: Option<ChatTemplate>,
}

impl ModelSource {
    /// The source a command runs: the directory given, else the built-in default model.
    pub fn resolve(model: Option<&Path>) -> Result<ModelSource> {
        Ok(ModelSource::Dir(crate::model::default_model::resolve(
            model,
        )?))
    }

    /// The name the server reports (`/v1/models`): the directory's name.
    pub fn name(&self) -> String {
        match self {
            ModelSource::Dir(p) if crate::model::default_model::is_default_dir(p) => {
                "mamba3-default".into()
            }
            ModelSource::Dir(p) => {
                let p = p.canonicalize().unwrap_or_else(|_| p.clone());
                p.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "mamba3".into())
            }
            ModelSource::Synthetic { .. } => "mamba3-synthetic".into(),
        }
    }

    pub fn load_model(&self, device: Device, dtype: DType) -> Result<Model> {
        match self {
            ModelSource::Dir(p) => Model::load(p, device, dtype),
            ModelSource::Synthetic { config, seed } => {
                Model::from_weights(Weights::synthetic(config.clone(), dtype, *seed)?, device)
            }
        }
    }

    /// The tokenizer (`tokenizer` if given, else the directory's `tokenizer.json`, else
    /// none) and the chat template of the `tokenizer_config.json` beside it.
    pub fn load_text(&self, tokenizer: Option<&Path>) -> Result<TextAssets> {
        let file = match (tokenizer, self) {
            (Some(t), _) => Some(t.to_path_buf()),
            (None, ModelSource::Dir(d)) => {
                let dir = if d.is_file() {
                    d.parent().unwrap_or(Path::new(".")).to_path_buf()
                } else {
                    d.clone()
                };
                Some(dir.join("tokenizer.json")).filter(|p| p.is_file())
            }
            (None, ModelSource::Synthetic { .. }) => None,
        };
        let Some(file) = file else {
            return Ok(TextAssets {
                tokenizer: None,
                chat: None,
            });
        };
        let tok = Tokenizer::from_file(&file)?;
        let dir = file.parent().unwrap_or(Path::new("."));
        // A model without a template of its own chats through the plain-text fallback.
        let chat = ChatTemplate::from_tokenizer_config(&dir.join("tokenizer_config.json"))?
            .or_else(|| Some(ChatTemplate::fallback()));
        Ok(TextAssets {
            tokenizer: Some(Arc::new(tok)),
            chat,
        })
    }

    pub fn load(&self, device: Device, dtype: DType, tokenizer: Option<&Path>) -> Result<Loaded> {
        let text = self.load_text(tokenizer)?;
        let model = self.load_model(device, dtype)?;
        Ok(Loaded {
            model,
            tokenizer: text.tokenizer,
            chat: text.chat,
        })
    }
}
