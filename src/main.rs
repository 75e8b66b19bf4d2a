//! The `pdgate` binary: `serve`, `sim` and `demo`.
#![forbid(unsafe_code)]

use clap::{CommandFactory, FromArgMatches};
use pdgate::cli::{prefill_groups, Cli, Command};
use pdgate::config::{LogConfig, LogFormat};
use pdgate::pd::RngSource;

fn init_logs(cfg: &LogConfig) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&cfg.level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt().with_env_filter(filter);
    match cfg.format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn main() -> std::process::ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pdgate: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => {
                let sm = matches
                    .subcommand_matches("serve")
                    .cloned()
                    .unwrap_or_default();
                let cfg = prefill_groups(&sm).and_then(|g| args.into_config(g))?;
                init_logs(&cfg.log);
                let router = pdgate::router::start(cfg, None, RngSource::Os).await?;
                wait_for_signal().await;
                tracing::info!("signal received");
                router.server.shutdown().await;
                Ok(())
            }
            Command::Sim(args) => {
                init_logs(&LogConfig::default());
                pdgate::sim::cli::run(args).await
            }
            Command::Demo(args) => {
                init_logs(&LogConfig::default());
                pdgate::demo::run(args).await
            }
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pdgate: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
