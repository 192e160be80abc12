//! The crate's error type.

/// What can go wrong starting or running `kvmock` or `kvload`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MockError {
    /// A flag's value is not accepted.
    #[error("invalid {flag}: {message}")]
    Config {
        /// The flag, as spelled on the command line.
        flag: &'static str,
        /// What is wrong and what is accepted.
        message: String,
    },
    /// A tokenizer or its chat template could not be loaded or rendered.
    #[error(transparent)]
    Serve(#[from] kvserve::Error),
    /// A socket or file operation failed.
    #[error("{0}")]
    Io(String),
    /// The endpoint answered something unexpected (kvload).
    #[error("endpoint: {0}")]
    Endpoint(String),
}

/// A clap error's message on one line: its first paragraph (the message and, for missing
/// arguments, the flags it names), without the usage block.
///
/// ```
/// let text = "error: the following required arguments were not provided:\n  --endpoint <URL>\n\nUsage: kvload";
/// assert_eq!(kvmock::error::one_line(text), "error: the following required arguments were not provided: --endpoint <URL>");
/// ```
pub fn one_line(text: &str) -> String {
    text.lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}
