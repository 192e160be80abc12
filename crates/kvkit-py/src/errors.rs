//! The bindings' error enum and the Python exception classes it becomes.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::PyErr;

create_exception!(
    kvkit,
    KvkitError,
    PyValueError,
    "Base class of every error kvkit raises (a ValueError)."
);
create_exception!(
    kvkit,
    HashError,
    KvkitError,
    "Invalid hashing input: a block size of 0, extra keys of an unsupported type."
);
create_exception!(
    kvkit,
    RouteError,
    KvkitError,
    "The router refused a call: no workers, an unknown worker or request, an invalid setting."
);
create_exception!(
    kvkit,
    EventError,
    KvkitError,
    "A KV-event batch or event was rejected: malformed MessagePack, a block size mismatch, an unknown event kind."
);
create_exception!(
    kvkit,
    SnapshotError,
    KvkitError,
    "A snapshot could not be read or restored."
);
create_exception!(
    kvkit,
    SimError,
    KvkitError,
    "The simulator refused its flags (the message is the one line kvsim prints) or could not run."
);

/// What can go wrong in a call from Python; each variant becomes one of the exception classes
/// above, with this message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A hashing setting was refused by kvblock.
    #[error(transparent)]
    Hash(#[from] kvblock::Error),
    /// Extra keys that cannot be encoded.
    #[error("invalid extra_keys: {0}")]
    ExtraKeys(String),
    /// The router refused a call.
    #[error(transparent)]
    Route(#[from] kvroute::Error),
    /// An invalid argument of a router call.
    #[error("invalid {name} {value}: expected {expected}")]
    RouteArgument {
        /// The argument.
        name: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A worker name the router does not know.
    #[error("unknown worker {0:?}: add it with add_worker first")]
    UnknownWorker(String),
    /// The router refused an event.
    #[error(transparent)]
    EventRejected(kvroute::Error),
    /// A vLLM or SGLang event batch was refused.
    #[error(transparent)]
    Vllm(#[from] kvroute_vllm::VllmError),
    /// An event of our own that is not well formed.
    #[error("invalid event: {0}")]
    Event(String),
    /// A snapshot that cannot be read.
    #[error("invalid snapshot: {0}")]
    Snapshot(String),
    /// The simulator refused its command line.
    #[error(transparent)]
    Sim(#[from] kvsim_cli::Error),
    /// An earlier call panicked while it held the router (a bug): the router cannot be trusted.
    #[error("the router is unusable: an earlier call panicked while holding it")]
    Poisoned,
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::Hash(_) | Error::ExtraKeys(_) => HashError::new_err(msg),
            Error::Route(_) | Error::RouteArgument { .. } | Error::UnknownWorker(_) => {
                RouteError::new_err(msg)
            }
            Error::EventRejected(_) | Error::Vllm(_) | Error::Event(_) => EventError::new_err(msg),
            Error::Snapshot(_) => SnapshotError::new_err(msg),
            Error::Sim(_) => SimError::new_err(msg),
            _ => KvkitError::new_err(msg),
        }
    }
}
