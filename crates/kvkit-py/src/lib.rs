//! Python bindings of kvkit: the `kvkit` Python package (built with maturin, see
//! `pyproject.toml`). The compiled module is `kvkit._kvkit`; the package's `__init__.py` adds
//! the keyword-argument front end of the simulator and `to_pandas`.
//!
//! - `BlockHasher`: kvblock's hashing ([`hasher`]).
//! - `Router`: kvroute's router with kvroute-vllm's event ingestion behind a mutex ([`router`]).
//! - `_run`: the `kvsim` command line through `kvsim_cli::run` ([`sim`]).
//! - `_bench_route`: the Rust side of `examples/python/bench_route.py`.
//!
//! Errors are [`errors::Error`], raised as `kvkit.KvkitError` subclasses.
#![deny(missing_docs)]
// pyo3's #[pyclass]/#[pymethods]/#[pymodule] and create_exception! expand to `unsafe` FFI
// glue; this crate writes none itself (the workspace denies unsafe_code, so it is allowed here,
// for the macros' expansions, and nowhere else).
#![forbid(unsafe_code)]

pub mod errors;
pub mod hasher;
pub mod router;
pub mod sim;

use std::time::Instant;

use kvroute::{RequestId, Role};
use pyo3::prelude::*;

/// Times `Router.route` followed by `Router.finish` in Rust, on a copy of `router`, over
/// `prompts` in turn, `n` times in all: nanoseconds per route-and-finish. The Python-side
/// overhead of the bindings is the time of the same calls from Python less this.
#[pyfunction]
fn _bench_route(
    py: Python<'_>,
    router: &router::Router,
    prompts: Vec<Vec<u32>>,
    n: usize,
) -> PyResult<f64> {
    let mut r = router.clone_router()?;
    if prompts.is_empty() || n == 0 {
        return Ok(0.0);
    }
    py.detach(|| {
        let start = Instant::now();
        for i in 0..n {
            let id = RequestId::new((1 << 62) + i as u64);
            let p = &prompts[i % prompts.len()];
            r.route_tokens(id, p, Role::Unified)
                .map_err(errors::Error::from)?;
            r.finish(id).map_err(errors::Error::from)?;
        }
        Ok::<f64, errors::Error>(start.elapsed().as_nanos() as f64 / n as f64)
    })
    .map_err(Into::into)
}

/// The compiled part of the `kvkit` package.
#[pymodule]
#[pyo3(name = "_kvkit")]
fn kvkit_py(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<hasher::BlockHasher>()?;
    m.add_class::<router::Router>()?;
    m.add_class::<router::Decision>()?;
    m.add_class::<router::Candidate>()?;
    m.add("KvkitError", py.get_type::<errors::KvkitError>())?;
    m.add("HashError", py.get_type::<errors::HashError>())?;
    m.add("RouteError", py.get_type::<errors::RouteError>())?;
    m.add("EventError", py.get_type::<errors::EventError>())?;
    m.add("SnapshotError", py.get_type::<errors::SnapshotError>())?;
    m.add("SimError", py.get_type::<errors::SimError>())?;
    m.add_function(wrap_pyfunction!(sim::_run, m)?)?;
    m.add_function(wrap_pyfunction!(_bench_route, m)?)?;
    Ok(())
}
