//! `kvrouter`: the KV-aware router server. `kvrouter --help` explains every flag.

use clap::Parser;

fn main() {
    let cfg = kvrouter::Config::parse();
    let endpoint = cfg.otlp_traces_endpoint.as_deref();
    let _traces = match kvserve::logging::init_traced(cfg.log_format, endpoint, "kvrouter") {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("kvrouter: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvrouter: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    if let Some(kvrouter::config::Command::Relay(args)) = cfg.command {
        if let Err(e) = rt.block_on(kvrouter::relay::run(args, shutdown)) {
            eprintln!("kvrouter relay: {e}");
            std::process::exit(2);
        }
        return;
    }
    tracing::info!(
        "listening on {}:{} with {} worker(s)",
        cfg.host,
        cfg.port,
        cfg.workers.len()
    );
    if let Err(e) = rt.block_on(kvrouter::run(cfg, shutdown)) {
        eprintln!("kvrouter: {e}");
        std::process::exit(2);
    }
}
