//! What a model is: its config, its parameters and their files. No arithmetic beyond
//! dtype conversions.

pub mod config;
mod config_shape;
pub mod default_model;
pub mod dtype;
pub mod family_config;
pub mod family_weights;
pub mod finite;
pub mod raw_tensor;
pub mod rng;
pub mod shards;
pub mod state_layout;
pub mod tensor_file;
pub mod torch_bin;
mod torch_pickle;
pub mod weights;

pub use config::{Config, Dims};
pub use dtype::{DType, Element, TensorData};
pub use weights::Matrix;
