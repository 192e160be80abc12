//! The `kvsim` command: simulate a fleet of LLM engines behind a KV-aware router. The command
//! line is parsed and run by the library ([`kvsim_cli::run_with`]); this prints what it returns.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use kvsim_cli::{Error, Options};

fn main() -> ExitCode {
    match kvsim_cli::run_with(std::env::args_os(), &Options::command()) {
        Ok(out) => {
            emit(&out);
            ExitCode::SUCCESS
        }
        Err(Error::Help(help)) => {
            let _ = help.print();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvsim: {e}");
            ExitCode::from(2)
        }
    }
}

/// Writes `text` to stdout; a reader that went away (`kvsim ... | head`) is not an error, any
/// other failure to write ends the command with one line and exit code 1.
fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("kvsim: cannot write the output: {e}");
            std::process::exit(1);
        }
        _ => {}
    }
}
