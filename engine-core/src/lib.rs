//! tether's portable engine: the Qwen3.5 dense hybrid (Gated DeltaNet + gated full attention),
//! its checkpoint formats, the op-level `Backend` it runs on, the paged KV cache with exact
//! page merging, and generation. Compiles for native targets and `wasm32-unknown-unknown`
//! (file access and memory mapping are native-only).

pub mod backend;
pub mod batch;
pub mod cache_types;
pub mod config;
pub mod convert;
#[cfg(feature = "coreml")]
pub mod coreml;
pub mod draft;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod helper;
pub mod host;
pub mod identity;
pub mod interleaved;
pub mod kv;
pub mod lending;
pub mod link;
pub mod model;
pub mod printable;
pub mod protocol;
pub mod quant;
#[cfg(not(target_arch = "wasm32"))]
pub mod resident;
pub mod source;
pub mod synth;
pub mod tensor;
pub mod tokenizer;
pub mod weights;

pub use backend::{Backend, CpuBackend};
pub use config::{LayerKind, ModelConfig};
pub use error::{Error, Result};
pub use model::{Logits, Model, State};
