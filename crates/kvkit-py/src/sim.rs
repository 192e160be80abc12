//! The simulator: `kvsim`'s own command line, run by `kvsim_cli::run`.

use pyo3::prelude::*;

use crate::errors::Error;

/// Runs a `kvsim` command line (`argv[0]` is the program name) and returns what the command
/// prints; kvkit.simulate, sweep, capacity and calibrate build the command line from keyword
/// arguments. `--help` returns the help text. The GIL is released while it runs.
#[pyfunction]
pub(crate) fn _run(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    py.detach(|| match kvsim_cli::run(argv) {
        Ok(out) => Ok(out),
        Err(kvsim_cli::Error::Help(h)) => Ok(h.to_string()),
        Err(e) => Err(Error::from(e)),
    })
    .map_err(Into::into)
}
