//! The crate's error type.

/// What can go wrong loading a tokenizer or rendering a chat template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tokenizer or its chat template could not be loaded.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The file or directory given.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
}
