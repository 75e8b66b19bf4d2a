//! The `pdgate` binary: `serve`, `check`, `sim` and `demo`.
#![forbid(unsafe_code)]

mod command;
mod demo;

use clap::FromArgMatches;
use command::{Cli, Command};
use pdgate::cli::prefill_groups;
use pdgate::config::{LogConfig, LogFormat};
use pdgate::dispatch::RngSource;
use pdgate::telemetry::access;

/// The main log (text or JSON, filtered by `log.level` or `RUST_LOG`) and, with
/// `log.access`, the access log: one JSON object per line on stdout, whatever the main
/// format, never filtered by the main log's level (see `pdgate::telemetry::access`).
/// Logs (and the access log) go through one bounded, non-blocking writer: a dedicated
/// thread writes stdout, and when the pipe is slow lines are dropped and counted instead of
/// stalling the runtime. The guard flushes what is buffered when dropped (at exit).
fn init_logs(cfg: &LogConfig) -> tracing_appender::non_blocking::WorkerGuard {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    // `log.level` was checked by `Config::validate`; SGLang's `warning` and `critical` are
    // spelt as tracing's here.
    let level = cfg.filter().unwrap_or_else(|_| "info".to_string());
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if let Ok(d) = access::EXCLUDE.parse() {
        filter = filter.add_directive(d);
    }
    let (out, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(cfg.buffer_lines)
        .thread_name("pdgate-log")
        .finish(std::io::stdout());
    let dropped = out.error_counter();
    // Colours only for a terminal: a pipe or a log collector gets plain text. JSON lines
    // carry `message` and the fields at the top level.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let main = match cfg.format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(out.clone())
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(out.clone())
            .boxed(),
    };
    let access = cfg.access.then(|| access::layer(out));
    tracing_subscriber::registry()
        .with(main.with_filter(filter))
        .with(access)
        .init();
    // The drop count, published where the metrics are (read once a second).
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            loop {
                metrics::counter!(pdgate::telemetry::LOG_LINES_DROPPED)
                    .absolute(dropped.dropped_lines() as u64);
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
    }
    guard
}

/// The first line `serve` logs: what runs (version, commit) and how it routes, then the
/// SGLang router flags it accepted without a setting of their own.
fn log_start(cfg: &pdgate::config::Config, notes: &[(bool, String)]) {
    use clap::ValueEnum;
    let name = |v: Option<clap::builder::PossibleValue>| {
        v.map(|p| p.get_name().to_string()).unwrap_or_default()
    };
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = option_env!("PDGATE_COMMIT").unwrap_or("unknown"),
        prefill_policy = %name(cfg.policy.prefill.to_possible_value()),
        decode_policy = %name(cfg.policy.decode.to_possible_value()),
        contract_mode = %name(cfg.contract.mode.to_possible_value()),
        prefills = cfg.prefill.len(),
        decodes = cfg.decode.len(),
        regular_workers = cfg.worker.len(),
        discovery = cfg.discovery.enabled,
        "pdgate starting"
    );
    for (warn, line) in notes {
        if *warn {
            tracing::warn!("{line}");
        } else {
            tracing::info!("{line}");
        }
    }
    for line in cfg.start_warnings() {
        tracing::warn!("{line}");
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

/// The runtime for `threads` workers: 1 is a current-thread runtime (no cross-thread
/// wake-ups: about half the CPU per request of a 2-worker pool on a 2-core machine, see
/// BENCHMARKS.md), 0 is one worker per core.
fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    match threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    }
}

/// mimalloc instead of glibc's malloc: the request path allocates a few dozen small
/// objects per request; see BENCHMARKS.md for the measured effect.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's setting that `serve` runs with (docs/pools-and-capacity.md, "Memory").
const PURGE_DELAY_VAR: &str = "MIMALLOC_PURGE_DELAY";

/// The purge delay `serve` runs with, in ms: how long mimalloc keeps freed pages resident
/// before giving them back to the OS.
const PURGE_DELAY_MS: &str = "100";

/// Makes mimalloc give freed memory back within 100 ms. Its default delay (1 s in mimalloc
/// 3) kept pages freed by large bodies resident, so a flood of maximum-size bodies left RSS
/// at up to ~1.9x the bytes in flight (the hostile bench; 223 MiB against the 206 MiB bound
/// even with refused bodies no longer read), past the bound that the docs' memory formula and
/// the manifests' memory limit rely on. A shorter delay costs the request path: every page
/// that empties is purged and faulted back in (at 64 concurrent requests ~2 minor page
/// faults per request at 0, ~0.5 at 10 ms, ~0.1 at 100 ms, 0.03 at 1 s), which moved the
/// floor ratio at c=64 from ~1.4 to ~1.7 at 0. At 100 ms the hostile bench peaks at 183-184
/// MiB (166-168 at 10 ms) since a body the budget cannot hold is refused unread (before
/// that, 100 ms reached 207): BENCHMARKS.md §8 and §10. mimalloc reads the option from the
/// environment as it starts, before `main`, and setting it from inside would take unsafe
/// code: so `serve` re-executes itself once with the variable set (same pid, arguments and
/// streams). An operator's own value is kept; a failed exec (e.g. the binary replaced on
/// disk) is reported and `serve` runs on.
fn purge_freed_memory_promptly() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(PURGE_DELAY_VAR).is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| exe.clone().into_os_string());
    let err = std::process::Command::new(&exe)
        .arg0(arg0)
        .args(args)
        .env(PURGE_DELAY_VAR, PURGE_DELAY_MS)
        .exec();
    eprintln!(
        "pdgate: could not re-execute {} with {PURGE_DELAY_VAR}={PURGE_DELAY_MS} ({err}); memory freed by \
         large bodies may stay resident longer than the memory bound allows (docs/pools-and-capacity.md, Memory)",
        exe.display()
    );
}

/// `pdgate check`: exit code 0 when every check passed, 1 on any ✗, 2 on a config error
/// (a malformed discovery selector included). Discovery's client comes from the
/// environment (`KUBECONFIG`, else the in-cluster service account), as `serve`'s.
fn check(args: command::CheckArgs, matches: &clap::ArgMatches) -> std::process::ExitCode {
    use std::process::ExitCode;
    let sm = matches
        .subcommand_matches("check")
        .cloned()
        .unwrap_or_default();
    let cfg = match prefill_groups(&sm).and_then(|g| args.serve.into_config(g)) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("pdgate: {e}");
            return ExitCode::from(2);
        }
    };
    // A malformed selector is a config error (it names its flag), as it refuses `serve`.
    if cfg.discovery.enabled {
        if let Err(e) = pdgate::discovery::plan(&cfg.discovery) {
            eprintln!("pdgate: {e}");
            return ExitCode::from(2);
        }
    }
    let rt = match runtime(1) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pdgate: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = pdgate::check::CheckOptions {
        probe_request: args.probe_request,
    };
    let report = rt.block_on(pdgate::check::run(&cfg, opts));
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("pdgate: cannot write the report: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", report.table());
    }
    if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn main() -> std::process::ExitCode {
    let matches = command::cli().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    // `serve` reads its config first: it says how many worker threads to run.
    let mut reload_source: Option<(pdgate::reload::Source, Option<std::path::PathBuf>)> = None;
    let mut notes = Vec::new();
    let (command, serve_cfg) = match cli.command {
        Command::Serve(args) => {
            purge_freed_memory_promptly();
            notes = args.sglang_compat.notes();
            let sm = matches
                .subcommand_matches("serve")
                .cloned()
                .unwrap_or_default();
            // A reload re-reads the file and applies the same flags over it.
            let file = args.config.clone();
            let again = (args.clone(), sm.clone());
            reload_source = Some((
                Box::new(move || {
                    let (args, sm) = again.clone();
                    prefill_groups(&sm).and_then(|g| args.into_config(g))
                }),
                file,
            ));
            match prefill_groups(&sm).and_then(|g| args.into_config(g)) {
                Ok(cfg) => (None, Some(cfg)),
                Err(e) => {
                    eprintln!("pdgate: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            }
        }
        Command::Check(args) => return check(args, &matches),
        other => (Some(other), None),
    };
    let threads = serve_cfg.as_ref().map_or(0, |c| c.server.worker_threads);
    let rt = match runtime(threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pdgate: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = rt.block_on(async {
        match (command, serve_cfg) {
            (_, Some(cfg)) => {
                let _logs = init_logs(&cfg.log);
                log_start(&cfg, &notes);
                let watch = cfg.reload.watch();
                // Bound before the router starts, so that a taken port refuses the start.
                let metrics_socket = cfg
                    .metrics_listener
                    .enabled
                    .then(|| {
                        let m = &cfg.metrics_listener;
                        let addr = std::net::SocketAddr::new(m.host, m.port);
                        std::net::TcpListener::bind(addr)
                            .and_then(|l| l.set_nonblocking(true).map(|()| l))
                            .and_then(tokio::net::TcpListener::from_std)
                            .map_err(|e| format!("cannot listen on {addr} for the metrics listener (metrics_listener.host, metrics_listener.port; --prometheus-host, --prometheus-port): {e}"))
                    })
                    .transpose()?;
                let router = std::sync::Arc::new(
                    pdgate::router::start_with(
                        cfg,
                        None,
                        pdgate::router::AdminListener::FromConfig,
                        RngSource::Os,
                    )
                    .await?,
                );
                let metrics = metrics_socket
                    .map(|l| {
                        pdgate::metrics_listener::MetricsListener::start(l, router.pool.clone())
                    })
                    .transpose()?;
                if let Some((source, file)) = reload_source {
                    pdgate::reload::spawn(router.clone(), source, file, watch);
                }
                wait_for_signal().await;
                tracing::info!("signal received");
                let began = std::time::Instant::now();
                router.shutdown().await;
                if let Some(m) = &metrics {
                    m.shutdown().await;
                }
                tracing::info!(
                    drained_in = ?began.elapsed(),
                    "drain ended; pdgate exits"
                );
                Ok(())
            }
            (Some(Command::Sim(args)), None) => {
                let _logs = init_logs(&LogConfig::default());
                pdgate_sim::cli::run(args).await
            }
            (Some(Command::Demo(args)), None) => {
                let _logs = init_logs(&LogConfig::default());
                demo::run(args).await
            }
            _ => Err("no command".into()),
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
