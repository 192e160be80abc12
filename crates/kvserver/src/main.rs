//! `kvserver`: the KV-aware router server. `kvserver --help` explains every flag.

use clap::Parser;

fn main() {
    let cfg = kvserver::Config::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvserver: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    if let Some(kvserver::config::Command::Relay(args)) = cfg.command {
        if let Err(e) = rt.block_on(kvserver::relay::run(args, shutdown)) {
            eprintln!("kvserver relay: {e}");
            std::process::exit(2);
        }
        return;
    }
    eprintln!(
        "kvserver: listening on {}:{} with {} worker(s)",
        cfg.host,
        cfg.port,
        cfg.workers.len()
    );
    if let Err(e) = rt.block_on(kvserver::run(cfg, shutdown)) {
        eprintln!("kvserver: {e}");
        std::process::exit(2);
    }
}
