//! One error type for everything that crosses a file, user or (later) network boundary.
//! Each variant names what was wrong so the message alone tells a user what to fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config: {0}")]
    Config(String),
    #[error("weights: {0}")]
    Weights(String),
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{0}` is missing from the checkpoint")]
    MissingTensor(String),
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The helper failed, vanished or answered out of protocol.
    #[error("helper: {0}")]
    Remote(String),
    /// The helper is there but would not serve a request (its memory budget, an order it
    /// cannot follow); the link is still good.
    #[error("helper refused: {code}: {message}")]
    Refused { code: String, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
