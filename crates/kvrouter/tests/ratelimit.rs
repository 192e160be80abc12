//! `--rate-limit RPS[,BURST]`: a token bucket per API key, 429 with `Retry-After` past it.

mod common;

use common::{Engine, Kvrouter};
use kvtest::net::request;
use serde_json::Value;

const SHORT: &str = r#"{"prompt": [5, 6, 7, 8], "max_tokens": 2}"#;

/// POSTs a completion with `key` as its bearer token (none for `""`): the reply.
fn post(port: u16, key: &str) -> kvtest::net::Reply {
    let auth = if key.is_empty() {
        String::new()
    } else {
        format!("Authorization: Bearer {key}\r\n")
    };
    request(port, "POST", "/v1/completions", &auth, SHORT)
}

#[test]
fn each_api_key_gets_its_burst_then_429_with_retry_after() {
    let engine = Engine::start();
    // One token every 100 s: nothing refills while the test runs.
    let router = Kvrouter::start(&[&engine], &["--rate-limit", "0.01,2"]);
    let port = router.port;
    for _ in 0..2 {
        let r = post(port, "alice");
        assert_eq!(r.status, 200, "{}\n{}", r.head, r.body);
    }
    let r = post(port, "alice");
    assert_eq!(r.status, 429, "{}\n{}", r.head, r.body);
    let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((90..=100).contains(&wait), "Retry-After {wait}");
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "RateLimitError", "{v}");
    assert_eq!(v["error"]["code"], 429, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--rate-limit"));
    // Another key has its own bucket; requests without a key share one.
    assert_eq!(post(port, "bob").status, 200);
    assert_eq!(post(port, "").status, 200);
    assert_eq!(post(port, "").status, 200);
    assert_eq!(post(port, "").status, 429);
    assert_eq!(router.metric("kvrouter_rate_limited_total"), 2.0);
    // Turned away before routing: the engine saw only the admitted ones.
    assert_eq!(router.metric("kvrouter_requests_routed_total"), 5.0);
    // Other endpoints are not limited.
    for _ in 0..5 {
        assert_eq!(request(port, "GET", "/health", "", "").status, 200);
    }
}

#[test]
fn without_the_flag_nothing_is_limited() {
    let engine = Engine::start();
    let router = Kvrouter::start(&[&engine], &[]);
    for _ in 0..20 {
        assert_eq!(post(router.port, "alice").status, 200);
    }
    assert_eq!(router.metric("kvrouter_rate_limited_total"), 0.0);
}
