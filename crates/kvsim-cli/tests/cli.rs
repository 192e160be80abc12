//! The `kvsim` command: exit codes, one-line errors, byte-identical output; and the command as
//! a library (`kvsim_cli::run`) printing the same.

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

/// `kvsim` with `base` then `extra`, which must succeed: what it printed.
fn kvsim_ok(base: &[&str], extra: &[&str]) -> String {
    let args: Vec<&str> = base.iter().chain(extra).copied().collect();
    let (code, out, err) = kvsim(&args);
    assert_eq!(code, 0, "{args:?}: {err}");
    out
}

/// 40 synthetic chats of 3 turns.
const CHATS: &[&str] = &[
    "--sessions",
    "40",
    "--turns",
    "3",
    "--think-ms",
    "500",
    "--request-rate",
    "4",
    "--des-block-size",
    "64",
];

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
    let with = |extra: &[&str]| kvsim_ok(&base, extra);
    let plain = with(&[]);
    for off in [
        &["--cost-model", "seed"][..],
        &["--router-temperature", "0"][..],
        &["--predicted-ttl-ms", "0"][..],
        &["--busy-threshold", "prefill-tokens=100000000"][..],
        &["--host-hit-credit", "0.75", "--host-load-gbps", "25"][..],
        &["--des-router-sync", "--des-sync-delay-ms", "5"][..],
    ] {
        assert_eq!(with(off), plain, "{off:?}");
    }
    // Each option on changes the report against the same flags without it (sync with two
    // routers; nothing with one, above), and the same flags give the same bytes.
    for (option, shared) in [
        (
            &["--cost-model", "prefill-aware"][..],
            &["--des-overlap-weight", "4"][..],
        ),
        (&["--router-temperature", "2"][..], &[][..]),
        (
            &["--busy-threshold", "decode=0.05,prefill-tokens=2048"][..],
            &[][..],
        ),
        (
            &["--host-kv-blocks", "4000"][..],
            &["--des-kv-blocks", "300"][..],
        ),
        (
            &["--des-router-sync", "--des-sync-delay-ms", "5"][..],
            &["--des-routers", "2"][..],
        ),
    ] {
        let on: Vec<&str> = shared.iter().chain(option).copied().collect();
        let out = with(&on);
        assert_ne!(out, with(shared), "{on:?} changed nothing");
        assert_eq!(with(&on), out, "{on:?}: same flags, same bytes");
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
        (&["--dp-ranks", "0"][..], "--dp-ranks"),
        (&["--des-sync-delay-ms=-1"][..], "--des-sync-delay-ms"),
        (&["--dp-routing", "gpu"][..], "rank or engine"),
        (&["--slo-ttft-ms", "0"][..], "--slo-ttft-ms"),
        (&["--kv-allocation", "lazy"][..], "reserve or incremental"),
        (&["--concurrency", "0"][..], "--concurrency"),
        (&["--pd-link", "fair"][..], "per-transfer or shared"),
        (&["--think-ms", "-5", "--sessions", "3"][..], "--think-ms"),
        (&["--turns", "3"][..], "--turns"),
        (&["--session-affinity", "soft"][..], "--session-affinity"),
        (
            &["--session-affinity", "sticky", "--sessions", "3"][..],
            "off, soft or hard",
        ),
        (
            &["--session-ttl-s", "-1", "--sessions", "3"][..],
            "--session-ttl-s",
        ),
        (&["--slo-itl-ms", "abc"][..], "--slo-itl-ms"),
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
    for flag in [
        "--sessions",
        "--turns",
        "--think-ms",
        "--concurrency",
        "--kv-allocation",
        "--pd-link",
        "--timing <MODEL>",
        "--slo-e2e-ms",
    ] {
        assert!(out.contains(flag), "--help lacks {flag}");
    }
    let (code, out, _) = kvsim(&["capacity", "--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--find",
        "--attainment",
        "--runs",
        "--probes",
        "--plot",
        "--jobs",
        "--slo-itl-ms",
        "mean gap",
    ] {
        assert!(out.contains(flag), "capacity --help lacks {flag}");
    }
}

#[test]
fn slo_targets_add_one_line_and_a_json_part() {
    let (code, plain, _) = kvsim(DOC);
    assert_eq!(code, 0);
    let mut args = DOC.to_vec();
    args.extend(["--slo-ttft-ms", "100", "--slo-itl-ms", "10"]);
    let (code, out, err) = kvsim(&args);
    assert_eq!(code, 0, "{err}");
    let extra: Vec<&str> = out.lines().filter(|l| !plain.contains(l)).collect();
    assert_eq!(extra.len(), 1, "{out}");
    assert!(
        extra[0].starts_with("  SLO attainment: TTFT <= 100 ms ")
            && extra[0].contains("ITL <= 10 ms (mean per request)")
            && extra[0].contains("goodput"),
        "{out}"
    );
    args.extend(["--format", "json"]);
    let (_, out, _) = kvsim(&args);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["slo"]["ttft_ms"], 100.0);
    assert!(v["slo"]["e2e_attainment"].is_null());
    let (_, out, _) = kvsim(&["--des-num-requests", "20", "--format", "json"]);
    assert!(!out.contains("\"slo\""));
}

const CAPACITY: &[&str] = &[
    "capacity",
    "--slo-ttft-ms",
    "200",
    "--slo-itl-ms",
    "50",
    "--des-num-requests",
    "80",
    "--des-block-size",
    "512",
    "--runs",
    "9",
    "--quiet",
];

#[test]
fn capacity_search_is_deterministic_whatever_the_threads() {
    let mut one = CAPACITY.to_vec();
    one.extend(["--jobs", "1"]);
    let (code, a, err) = kvsim(&one);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("9 runs in 3 rounds"), "{err}");
    let mut three = CAPACITY.to_vec();
    three.extend(["--jobs", "3"]);
    let (_, b, _) = kvsim(&three);
    assert_eq!(a, b);
    assert!(a.starts_with("  Capacity search: highest request rate with >= 99.0% of requests within TTFT <= 200 ms, ITL <= 50 ms | routing=kv"), "{a}");
    assert_eq!(
        a.lines()
            .filter(|l| l.ends_with("pass") || l.ends_with("FAIL"))
            .count(),
        9,
        "{a}"
    );
    let answer = a.lines().last().unwrap();
    assert!(
        answer.starts_with("  Answer: ") && answer.contains(" req/s sustained ("),
        "{a}"
    );
    // JSON: the answer passes, the first failure above it fails, and nothing between was tried.
    let mut json = CAPACITY.to_vec();
    json.extend(["--format", "json"]);
    let (_, out, _) = kvsim(&json);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (ans, fail) = (
        v["answer"].as_f64().unwrap(),
        v["first_failure"].as_f64().unwrap(),
    );
    assert!(ans < fail);
    for p in v["probes"].as_array().unwrap() {
        let x = p["x"].as_f64().unwrap();
        assert_eq!(
            p["pass"].as_bool().unwrap(),
            p["attainment"].as_f64().unwrap() >= 0.99
        );
        assert!(!(x > ans && x < fail), "{x} inside the bracket");
        if x == ans || x == fail {
            assert_eq!(p["pass"].as_bool().unwrap(), x == ans);
        }
    }
}

#[test]
fn capacity_finds_the_fewest_instances() {
    let (code, out, err) = kvsim(&[
        "capacity",
        "--find",
        "instances",
        "--request-rate",
        "30",
        "--slo-ttft-ms",
        "300",
        "--des-num-requests",
        "80",
        "--des-block-size",
        "512",
        "--quiet",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let n = v["answer"].as_f64().unwrap();
    let probes = v["probes"].as_array().unwrap();
    // The answer passes and one fewer instance was tried and fails (or the answer is 1).
    let verdict = |x: f64| {
        probes
            .iter()
            .find(|p| p["x"] == x)
            .map(|p| p["pass"].as_bool().unwrap())
    };
    assert_eq!(verdict(n), Some(true));
    assert!(n == 1.0 || verdict(n - 1.0) == Some(false), "{out}");
}

#[test]
fn capacity_refuses_bad_settings_in_one_line() {
    for (args, needle) in [
        (&["capacity"][..], "--slo-ttft-ms"),
        (
            &["capacity", "--slo-ttft-ms", "100", "--attainment", "1.5"][..],
            "--attainment",
        ),
        (
            &["capacity", "--slo-ttft-ms", "100", "--runs", "0"][..],
            "--runs",
        ),
        (
            &["capacity", "--slo-ttft-ms", "100", "--find", "speed"][..],
            "--find",
        ),
        (
            &["capacity", "--slo-ttft-ms", "100", "--concurrency", "4"][..],
            "--concurrency",
        ),
        (
            &[
                "capacity",
                "--slo-ttft-ms",
                "100",
                "--find",
                "instances",
                "--des-prefill-instances",
                "1",
                "--des-decode-instances",
                "1",
            ][..],
            "--find instances",
        ),
    ] {
        let (code, out, err) = kvsim(args);
        assert_eq!(code, 2, "{args:?}");
        assert!(out.is_empty(), "{args:?}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn calibrate_prints_flags_a_run_accepts() {
    // Steps of the default linear model (7050, 19.5, 25.4, 0.04) with +-1% deterministic noise.
    let mut csv = String::from("prefill_tokens,decode_requests,context_tokens,step_us\n");
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % n
    };
    for i in 0..3000u64 {
        let p = if i % 3 == 1 { 0 } else { next(8192) };
        let d = if i % 3 == 0 { 0 } else { 1 + next(255) };
        let c = d * (64 + next(8000));
        let t = (7050.0 + 19.5 * p as f64 + 25.4 * d as f64 + 0.04 * c as f64)
            * (0.99 + next(2001) as f64 / 100_000.0);
        csv.push_str(&format!("{p},{d},{c},{t:.1}\n"));
    }
    let path = std::env::temp_dir().join(format!("kvsim-steps-{}.csv", std::process::id()));
    std::fs::write(&path, csv).unwrap();
    let (code, out, err) = kvsim(&["calibrate", "--steps", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let flags = out
        .lines()
        .find_map(|l| l.strip_prefix("  Flags: "))
        .expect(&out);
    let words: Vec<&str> = flags.split(' ').collect();
    for (flag, want) in [
        ("--timing-base-us", 7050.0),
        ("--timing-prefill-us", 19.5),
        ("--timing-decode-us", 25.4),
        ("--timing-context-us", 0.04),
    ] {
        let i = words.iter().position(|w| *w == flag).expect(flag);
        let got: f64 = words[i + 1].parse().unwrap();
        assert!((got - want).abs() / want < 0.01, "{flag} {got}");
    }
    assert!(out.contains("Mean absolute percentage error 0."), "{out}");
    let mut run = words.clone();
    run.extend(["--des-num-requests", "10"]);
    let (code, _, err) = kvsim(&run);
    assert_eq!(code, 0, "{err}");
    std::fs::write(
        &path,
        "prefill_tokens,decode_requests,context_tokens,step_us\n1,2,3,4\n5,x,6,7\n",
    )
    .unwrap();
    let (code, out, err) = kvsim(&["calibrate", "--steps", path.to_str().unwrap()]);
    assert_eq!((code, out.as_str()), (2, ""));
    assert_eq!(err.lines().count(), 1);
    assert!(
        err.contains("--steps ") && err.contains(".csv:3: decode_requests \"x\""),
        "{err}"
    );
    std::fs::remove_file(&path).ok();
}

#[test]
fn incremental_allocation_counts_preemptions() {
    let small = [
        "--des-kv-blocks",
        "300",
        "--request-rate",
        "20",
        "--des-num-requests",
        "200",
        "--input-len",
        "256",
        "--des-prefix-len",
        "128",
        "--output-len",
        "1024",
    ];
    let mut args = small.to_vec();
    args.extend(["--kv-allocation", "incremental"]);
    let (code, out, err) = kvsim(&args);
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("  Preemptions (incremental KV allocation): "))
        .expect(&out);
    let n: u64 = line
        .split(": ")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n > 0, "{line}");
    args.extend(["--format", "json"]);
    let (_, out, _) = kvsim(&args);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["preemptions"].as_u64(), Some(n));
    assert!(v["recomputed_tokens"].as_u64().unwrap() > 0);
    let mut reserve = small.to_vec();
    reserve.extend(["--format", "json"]);
    let (_, out, _) = kvsim(&reserve);
    assert!(!out.contains("preemptions") && !out.contains("recomputed_tokens"));
}

#[test]
fn sessions_report_per_turn_hits_and_concurrency_runs() {
    let out = kvsim_ok(CHATS, &[]);
    assert!(out.starts_with("  Fleet: 4 instance(s), routing=kv | 40 sessions x 3 turns, think 500 ms, prefix pool: 8 prefixes\n"), "{out}");
    assert!(out.contains("  Requests: 120 completed"), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("  Per turn: turn 1 hit rate "))
        .expect(&out);
    assert!(
        line.contains("(40 requests) | later turns hit rate ") && line.ends_with("(80 requests)"),
        "{line}"
    );
    let (code, out, err) = kvsim(&[
        "--concurrency",
        "4",
        "--des-num-requests",
        "40",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["completed"], 40);
    assert!(v["content"]
        .as_str()
        .unwrap()
        .ends_with(", closed loop at concurrency 4"));
    assert!(v.get("turns").is_none());
}

/// --session-affinity off is the run without it; soft and hard add one line (and a JSON part)
/// and keep every later turn on its session's instance; a sweep takes the flag.
#[test]
fn session_affinity_adds_one_line_and_sweeps() {
    let with = |extra: &[&str]| kvsim_ok(CHATS, extra);
    let plain = with(&[]);
    assert_eq!(
        with(&["--session-affinity", "off", "--session-ttl-s", "5"]),
        plain
    );
    let soft = with(&["--session-affinity", "soft"]);
    let extra: Vec<&str> = soft.lines().filter(|l| !plain.contains(*l)).collect();
    let line = soft
        .lines()
        .find(|l| l.starts_with("  Sessions: "))
        .expect(&soft);
    assert_eq!(
        line,
        "  Sessions: soft affinity, TTL 600 s | later turns: 80 kept on their session's instance (100.0%), 0 moved (busy), 0 new (TTL lapsed or unknown to the router)"
    );
    assert!(extra.contains(&line), "{extra:?}");
    assert_eq!(
        with(&["--session-affinity", "soft"]),
        soft,
        "same flags, same bytes"
    );
    let json = with(&[
        "--session-affinity",
        "hard",
        "--session-ttl-s",
        "0.1",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["sessions"]["affinity"], "hard");
    assert_eq!(v["sessions"]["ttl_s"], 0.1);
    assert_eq!(v["sessions"]["new"], 80);
    let plain_json = with(&["--format", "json"]);
    assert!(!plain_json.contains("\"sessions\""));
    let sweep = [
        "sweep",
        "--param",
        "session-affinity=off,soft",
        "--jobs",
        "1",
    ];
    let out = kvsim_ok(&sweep, CHATS);
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("off") || l.contains("soft"))
            .count(),
        2,
        "{out}"
    );
}

#[test]
fn requests_out_replays_and_calibrates_with_spans() {
    let dir = std::env::temp_dir().join(format!("kvsim-spans-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let made = dir.join("made.jsonl");
    let log = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kvsim/tests/fixtures/vllm.log"
    );
    let gen = [
        "--des-instances",
        "1",
        "--des-num-requests",
        "40",
        "--output-len",
        "30",
        "--request-rate",
        "20",
        "--timing-base-us",
        "9000",
    ];
    let mut args = gen.to_vec();
    args.extend(["--requests-out", made.to_str().unwrap()]);
    let (code, report, err) = kvsim(&args);
    assert_eq!(code, 0, "{err}");
    // The report is the one the run prints without --requests-out.
    assert_eq!(report, kvsim(&gen).1);
    let text = std::fs::read_to_string(&made).unwrap();
    assert_eq!(text.lines().count(), 40);
    assert!(text
        .lines()
        .all(|l| l.contains("\"instance\":0") && l.contains("\"preemptions\":0")));

    let (code, out, err) = kvsim(&[
        "calibrate",
        "--spans",
        made.to_str().unwrap(),
        "--shared-prefix-tokens",
        "2048",
        "--phase-requests",
        "10",
        "--fit-phases",
        "0-2",
        "--max-evaluations",
        "150",
        "--vllm-log",
        log,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Engine: block 16 tok, 2537 KV blocks, 4096 tokens per step, 256 sequences, incremental allocation, vllm scheduler, 1 instance(s)"), "{out}");
    assert!(out.contains("held-out phases (1 phases)"), "{out}");
    // The last line is every flag that reproduces the fit, and a run takes them.
    let last = out.lines().last().unwrap();
    let flags = last.strip_prefix("  Flags: ").expect(last);
    assert!(
        flags.starts_with("--timing-base-us ") && flags.ends_with("--shared-prefix-tokens 2048"),
        "{flags}"
    );
    let mut run = vec!["--spans", made.to_str().unwrap()];
    run.extend(flags.split(' '));
    let (code, out, err) = kvsim(&run);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Requests: 40 completed"), "{out}");

    // Bad input: one line, exit 2, naming the flag (and the file and line).
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"arrival_us\": 0, \"prompt_tokens\": 5}\n").unwrap();
    let bad = bad.to_str().unwrap();
    for (args, needle) in [
        (vec!["--spans", bad], "--spans "),
        (
            vec!["--spans", bad],
            "bad.jsonl:1: a request record needs output_tokens",
        ),
        (
            vec![
                "calibrate",
                "--spans",
                made.to_str().unwrap(),
                "--fit-phases",
                "9",
            ],
            "--fit-phases: phase 9, but the requests make 2 phases (0-1)",
        ),
        (
            vec![
                "calibrate",
                "--spans",
                made.to_str().unwrap(),
                "--fit-phases",
                "x",
            ],
            "invalid --fit-phases \"x\"",
        ),
        (
            vec![
                "calibrate",
                "--spans",
                made.to_str().unwrap(),
                "--phase-window-s",
                "-1",
            ],
            "invalid --phase-window-s -1",
        ),
        (vec!["--vllm-log", bad], "--vllm-log "),
        (vec!["--shared-prefix-tokens", "16"], "--spans"),
        (vec!["--spans", bad, "--trace", bad], "cannot be used with"),
        (vec!["calibrate"], "--steps"),
    ] {
        let (code, out, err) = kvsim(&args);
        assert_eq!((code, out.as_str()), (2, ""), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_host_tier_of_zero_blocks_is_no_host_tier() {
    for format in ["text", "json"] {
        let base = [
            "--des-kv-blocks",
            "400",
            "--des-num-requests",
            "60",
            "--format",
            format,
        ];
        let (code, without, err) = kvsim(&base);
        assert_eq!(code, 0, "{err}");
        let mut zero = base.to_vec();
        zero.extend(["--host-kv-blocks", "0"]);
        let (code, with_zero, err) = kvsim(&zero);
        assert_eq!(code, 0, "{err}");
        assert_eq!(with_zero, without, "{format}");
        let mut some = base.to_vec();
        some.extend(["--host-kv-blocks", "100"]);
        assert_ne!(kvsim(&some).1, without, "{format}: a real tier shows");
    }
}

/// `kvsim_cli::run`, the command as a library.
fn library(args: &[&str]) -> Result<String, kvsim_cli::Error> {
    kvsim_cli::run(std::iter::once("kvsim").chain(args.iter().copied()))
}

// `kvsim_cli::run` returns exactly what the binary prints, and its errors are the binary's
// one-line messages.

#[test]
fn library_output_is_the_command_output_byte_for_byte() {
    fn with(extra: &[&'static str]) -> Vec<&'static str> {
        DOC.iter().chain(extra).copied().collect()
    }
    for args in [
        with(&[]),
        with(&["--format", "json"]),
        with(&["-v"]),
        [
            &["sweep", "--param", "des-overlap-weight=0,1", "--jobs", "1"][..],
            DOC,
        ]
        .concat(),
        [
            &[
                "sweep",
                "--param",
                "des-overlap-weight=0,1",
                "--format",
                "json",
            ][..],
            DOC,
        ]
        .concat(),
        [
            &[
                "capacity",
                "--slo-ttft-ms",
                "2000",
                "--runs",
                "2",
                "--format",
                "json",
            ][..],
            DOC,
        ]
        .concat(),
    ] {
        let (code, out, err) = kvsim(&args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert_eq!(library(&args).expect("runs"), out, "{args:?}");
    }
}

#[test]
fn library_errors_are_the_command_messages() {
    for args in [
        &["--des-instances", "0"][..],
        &["--no-such-flag"],
        &["sweep", "--param", "bad"],
        &["capacity", "--des-num-requests", "20"],
    ] {
        let (code, out, err) = kvsim(args);
        assert_eq!((code, out.as_str()), (2, ""), "{args:?}");
        match library(args) {
            Err(e @ kvsim_cli::Error::Usage(_)) => {
                assert_eq!(format!("kvsim: {e}\n"), err, "{args:?}")
            }
            other => panic!("{args:?}: {other:?}"),
        }
    }
    let help = library(&["--help"]);
    assert!(
        matches!(&help, Err(kvsim_cli::Error::Help(h)) if h.to_string().contains("Usage: kvsim")),
        "{help:?}"
    );
}
