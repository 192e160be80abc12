//! vLLM's and SGLang's KV-event wire, end to end: one test binary, a module per idea (decoding and
//! ingestion, hybrid-model groups, data-parallel ranks, SGLang's salted events, mirror snapshots,
//! offload tiers), each with its fixtures from `fixtures/make_vllm_fixtures.py`.

mod groups;
mod ingest;
mod ranks;
mod sglang;
mod snapshot;
mod support;
mod tiers;
