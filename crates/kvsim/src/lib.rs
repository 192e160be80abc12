//! A deterministic discrete-event simulator of a fleet of LLM engine replicas behind the
//! `kvroute` router, and the `kvsim` command.
//!
//! This crate is being built; see the workspace README for what exists today.
#![deny(missing_docs)]
