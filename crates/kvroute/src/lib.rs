//! The KV-aware routing cost function, in-flight load tracking, the routing policies and the
//! `Router` facade.
//!
//! This crate is being built; see the workspace README for what exists today.
#![deny(missing_docs)]
