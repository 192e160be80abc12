//! The `kvsim` command: exit codes, one-line errors, byte-identical output.

use std::process::Command;

fn kvsim(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvsim"))
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const DOC: &[&str] = &[
    "--request-rate",
    "6",
    "--arrival-model",
    "poisson",
    "--des-num-requests",
    "200",
    "--des-instances",
    "4",
    "--des-routing",
    "kv",
    "--des-num-prefixes",
    "8",
    "--des-prefix-len",
    "2048",
    "--des-block-size",
    "512",
];

#[test]
fn source_document_command_prints_the_report() {
    let (code, out, err) = kvsim(DOC);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("  Fleet: 4 instance(s), routing=kv | prefix pool: 8 prefixes\n"),
        "{out}"
    );
    assert!(out.contains("  KV block cache: block_size=512 tok, capacity/instance=unbounded, evictions=0, block-reuse="));
    assert!(out.contains("  Prefix-cache hit rate: "));
    assert!(
        out.contains("TTFT")
            && out.contains("ITL")
            && out.contains("E2E")
            && out.contains("Load balance")
    );
    let (_, again, _) = kvsim(DOC);
    assert_eq!(out, again, "same flags, same bytes");
}

/// The routing model's options at their off values print exactly the default report; on, they
/// change it, and the same flags give the same bytes.
#[test]
fn routing_model_options_off_are_byte_identical() {
    let base = [
        "--des-num-requests",
        "120",
        "--request-rate",
        "20",
        "--des-kv-blocks",
        "3000",
    ];
    let with = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (code, out, err) = kvsim(&args);
        assert_eq!(code, 0, "{args:?}: {err}");
        out
    };
    let plain = with(&[]);
    for off in [
        &["--cost-model", "seed"][..],
        &["--router-temperature", "0"][..],
        &["--predicted-ttl-ms", "0"][..],
        &["--busy-threshold", "prefill-tokens=100000000"][..],
        &["--host-hit-credit", "0.75", "--host-load-gbps", "25"][..],
    ] {
        assert_eq!(with(off), plain, "{off:?}");
    }
    for on in [
        &["--cost-model", "prefill-aware", "--des-overlap-weight", "4"][..],
        &["--router-temperature", "2"][..],
        &["--busy-threshold", "decode=0.05,prefill-tokens=2048"][..],
        &["--host-kv-blocks", "4000", "--des-kv-blocks", "300"][..],
    ] {
        let out = with(on);
        assert_ne!(out, plain, "{on:?} changed nothing");
        assert_eq!(with(on), out, "{on:?}: same flags, same bytes");
    }
}

#[test]
fn defaults_run_and_json_parses() {
    let (code, out, _) = kvsim(&["--des-num-requests", "30", "--format", "json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    assert_eq!(v["completed"], 30);
    let (code, out, _) = kvsim(&["--des-num-requests", "30", "--verbose"]);
    assert_eq!(code, 0);
    assert!(out.contains("instance  pool      requests  hit-rate"));
}

#[test]
fn bad_flags_exit_2_with_one_line_naming_the_flag() {
    for (args, needle) in [
        (&["--des-instances", "0"][..], "--des-instances"),
        (&["--request-rate", "-1"][..], "--request-rate"),
        (&["--request-rate", "abc"][..], "--request-rate"),
        (&["--des-block-size", "0"][..], "--des-block-size"),
        (
            &["--des-routing", "lru"][..],
            "kv, prefix_aware, round_robin, random",
        ),
        (
            &["--arrival-model", "burst"][..],
            "poisson, constant, gamma",
        ),
        (
            &["--prefix-popularity", "zipf:x"][..],
            "--prefix-popularity",
        ),
        (&["--des-prefix-len", "9000"][..], "--des-prefix-len"),
        (&["--format", "xml"][..], "--format"),
        (&["--cost-model", "fast"][..], "seed or prefill-aware"),
        (&["--router-temperature", "-1"][..], "--router-temperature"),
        (&["--busy-threshold", "decode=0.5"][..], "--des-kv-blocks"),
        (&["--busy-threshold", "load=3"][..], "--busy-threshold"),
        (&["--predicted-ttl-ms", "-5"][..], "--predicted-ttl-ms"),
        (&["--host-hit-credit", "2"][..], "--host-hit-credit"),
        (&["--host-load-gbps", "0"][..], "--host-load-gbps"),
        (&["--no-such-flag"][..], "--no-such-flag"),
    ] {
        let (code, out, err) = kvsim(args);
        assert_eq!(code, 2, "{args:?}");
        assert!(out.is_empty(), "{args:?} printed a report");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn help_explains_and_exits_0() {
    let (code, out, _) = kvsim(&["--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--des-overlap-weight",
        "--des-kv-blocks",
        "--arrival-cv",
        "--timing-base-us",
        "--format",
    ] {
        assert!(out.contains(flag), "--help lacks {flag}");
    }
}
