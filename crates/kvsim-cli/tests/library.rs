//! `kvsim_cli::run`, the command as a library, returns exactly what the `kvsim` binary prints,
//! and its errors are the binary's one-line messages.

use std::process::Command;

fn binary(args: &[&str]) -> (i32, String, String) {
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

fn library(args: &[&str]) -> Result<String, kvsim_cli::Error> {
    kvsim_cli::run(std::iter::once("kvsim").chain(args.iter().copied()))
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
        let (code, out, err) = binary(&args);
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
        let (code, out, err) = binary(args);
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
