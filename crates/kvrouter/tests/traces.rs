//! OpenTelemetry traces: with `--otlp-traces-endpoint` on the router and on `kvmock`, one request
//! is one trace at the collector: the router's span (continuing the caller's `traceparent`), its
//! tokenize, route and upstream children, and the engine's `llm_request` under the upstream span.

mod common;

use std::time::Duration;

use common::{eventually, Engine, Kvrouter};
use kvtest::net::{free_port, request, OtlpReceiver};
use serde_json::Value;

const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER: &str = "b7ad6b7169203331";
/// The router's span of a request is named by its method and path.
const REQUEST: &str = "POST /v1/completions";

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    span["attributes"]
        .as_array()
        .and_then(|a| a.iter().find(|kv| kv["key"] == key))
        .map_or(&Value::Null, |kv| &kv["value"])
}

fn named<'a>(spans: &'a [Value], name: &str) -> &'a Value {
    spans
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
}

#[test]
fn a_request_is_one_trace_from_the_caller_through_the_router_to_the_engine() {
    let collector = OtlpReceiver::start();
    let endpoint = collector.endpoint();
    let engine = Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--otlp-traces-endpoint", &endpoint],
    );
    let router = Kvrouter::start(&[&engine], &["--otlp-traces-endpoint", &endpoint]);

    let body = r#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], "max_tokens": 3}"#;
    let headers = format!("traceparent: 00-{TRACE}-{CALLER}-01\r\nx-request-id: traced-1\r\n");
    let r = request(router.port, "POST", "/v1/completions", &headers, body);
    assert_eq!(r.status, 200, "{}", r.body);

    eventually(
        "the router's and the engine's spans arrive",
        Duration::from_secs(20),
        || {
            let spans = collector.spans();
            [REQUEST, "tokenize", "route", "upstream", "llm_request"]
                .iter()
                .all(|n| spans.iter().any(|s| s["name"] == *n))
        },
    );
    let spans = collector.spans();
    // Only the request is traced (not the health checks and admin calls around it), all of it
    // in the caller's trace.
    assert!(spans.iter().all(|s| s["traceId"] == TRACE), "{spans:#?}");
    let request = named(&spans, REQUEST);
    assert_eq!(request["parentSpanId"], CALLER);
    assert_eq!(attr(request, "request_id")["stringValue"], "traced-1");
    for child in ["tokenize", "route", "upstream"] {
        assert_eq!(
            named(&spans, child)["parentSpanId"],
            request["spanId"],
            "{child}"
        );
    }
    let route = named(&spans, "route");
    assert_eq!(attr(route, "hits")["intValue"], "0");
    assert_eq!(attr(route, "blocks")["intValue"], "1");
    assert_eq!(attr(route, "candidates")["intValue"], "1");
    assert_eq!(attr(route, "policy")["stringValue"], "KvAware");
    // The engine continued the trace the router sent it, under the upstream call.
    let llm = named(&spans, "llm_request");
    assert_eq!(llm["parentSpanId"], named(&spans, "upstream")["spanId"]);
    assert_eq!(
        attr(llm, "gen_ai.request.id")["stringValue"],
        "cmpl-traced-1"
    );
    assert_eq!(attr(llm, "gen_ai.usage.prompt_tokens")["intValue"], "20");
    assert_eq!(attr(llm, "gen_ai.usage.completion_tokens")["intValue"], "3");
    assert!(router.metric("kvrouter_otlp_export_errors_total") == 0.0);
}

#[test]
fn an_unreachable_collector_costs_a_counter_not_the_request() {
    // Nothing listens on this port.
    let endpoint = format!("http://127.0.0.1:{}/v1/traces", free_port());
    let engine = Engine::start();
    let router = Kvrouter::start(&[&engine], &["--otlp-traces-endpoint", &endpoint]);
    let body = r#"{"prompt": [1, 2, 3, 4], "max_tokens": 2}"#;
    let (status, text) = router.post("/v1/completions", body);
    assert_eq!(status, 200, "{text}");
    eventually(
        "the failed export is counted",
        Duration::from_secs(20),
        || router.metric("kvrouter_otlp_export_errors_total") >= 1.0,
    );
}
