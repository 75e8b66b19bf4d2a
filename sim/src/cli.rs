//! `pdgate sim`: run simulated engines from the command line until Ctrl-C.
//!
//! Why: demos and manual tests against a router in another process need the
//! same engines the Rust tests use, with the same knobs.
//!
//! Invariants: every default comes from [`EngineConfig::default`] (flags are
//! `Option`s that override it); one `READY …` line per engine is printed to
//! stdout (and flushed) once all engines listen, in the order prefills, decodes.

use std::io::Write;
use std::time::Duration;

use crate::cluster::SimCluster;
use crate::config::{EngineConfig, Faults, Role};
use crate::engine::SimEngine;

/// Flags of `pdgate sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Number of prefill engines (ignored with --role).
    #[arg(long, default_value_t = 1)]
    pub prefill: u32,
    /// Number of decode engines (ignored with --role).
    #[arg(long, default_value_t = 1)]
    pub decode: u32,
    /// Run a single engine of this role on --port / --bootstrap-port (prefill, decode, or
    /// regular: SGLang's plain mode, one engine for the whole request).
    #[arg(long)]
    pub role: Option<Role>,
    /// Engine HTTP port with --role (0 = ephemeral).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Bootstrap port with --role prefill (0 = ephemeral).
    #[arg(long, default_value_t = 0)]
    pub bootstrap_port: u16,
    /// DP size of each prefill.
    #[arg(long, default_value_t = 1)]
    pub prefill_dp: u32,
    /// DP size of each decode.
    #[arg(long, default_value_t = 1)]
    pub decode_dp: u32,
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// First port for --prefill/--decode engines (0 = ephemeral). Prefill i
    /// gets base+2i (HTTP) and base+2i+1 (bootstrap); decodes follow.
    #[arg(long, default_value_t = 0)]
    pub base_port: u16,
    /// Prefill compute time per request (ms).
    #[arg(long)]
    pub prefill_ms: Option<u64>,
    /// Prefill compute time per prompt token its DP rank's prefix cache lacks (all of them
    /// without a cache), on top of --prefill-ms (ms, fractions allowed).
    #[arg(long)]
    pub prefill_per_token_ms: Option<f64>,
    /// Prefill: prefix cache per DP rank, in tokens (0: none). With one, each rank computes
    /// one prompt at a time.
    #[arg(long)]
    pub prefill_prefix_cache_tokens: Option<u64>,
    /// Decode: prefix cache per DP rank, in tokens (0: none).
    #[arg(long)]
    pub decode_prefix_cache_tokens: Option<u64>,
    /// Tokens per page of the prefix caches (only whole pages are cached).
    #[arg(long)]
    pub prefix_cache_page_size: Option<u32>,
    /// Decode: wait per prompt token of KV its DP rank's prefix cache lacks, before the
    /// first token (ms, fractions allowed).
    #[arg(long)]
    pub decode_per_missing_token_ms: Option<f64>,
    /// OpenAI usage reports the prompt's cached tokens (SGLang's `--enable-cache-report`).
    #[arg(long)]
    pub enable_cache_report: bool,
    /// Decode time to first token after the KV arrived (ms).
    #[arg(long)]
    pub ttft_ms: Option<u64>,
    /// Decode inter-token latency (ms).
    #[arg(long)]
    pub itl_ms: Option<u64>,
    /// Default number of output tokens.
    #[arg(long)]
    pub tokens: Option<u32>,
    /// Decode waiting timeout (s, fractions allowed).
    #[arg(long)]
    pub waiting_timeout_secs: Option<f64>,
    /// Prefill bootstrap timeout (s, fractions allowed).
    #[arg(long)]
    pub bootstrap_timeout_secs: Option<f64>,
    /// Decode sentinel attempts.
    #[arg(long)]
    pub sentinel_attempts: Option<u32>,
    /// Pause between sentinel attempts (ms).
    #[arg(long)]
    pub sentinel_interval_ms: Option<u64>,
    /// Decode heartbeat period (ms).
    #[arg(long)]
    pub heartbeat_interval_ms: Option<u64>,
    /// Consecutive heartbeat failures before "prefill lost".
    #[arg(long)]
    pub heartbeat_max_failures: Option<u32>,
    /// Model path (also the served name unless --served-model-name is given).
    #[arg(long)]
    pub model: Option<String>,
    /// The name clients use (SGLang's `--served-model-name`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Model context length in tokens (whitespace-separated words of a prompt); a longer
    /// prompt gets SGLang's 400, so a client can ask for a rejection per request.
    #[arg(long)]
    pub context_length: Option<u32>,
    /// KV page size.
    #[arg(long)]
    pub page_size: Option<u32>,
    /// KV cache dtype.
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// Prefill load balance method (follow_bootstrap_room, round_robin, ...).
    #[arg(long)]
    pub load_balance_method: Option<String>,
    /// Decode: failed rank lookups hang until the waiting timeout (pre-#24772).
    #[arg(long)]
    pub legacy_bootstrap_bug: bool,
    /// Decode: requests each DP rank runs at once; more queue in the engine.
    #[arg(long)]
    pub max_running_requests: Option<u32>,
    /// `/generate` streams only what is new in each event (SGLang's
    /// `--incremental-streaming-output`).
    #[arg(long)]
    pub incremental_streaming_output: bool,
    /// OpenAI routes: no usage on each chunk, whatever `stream_options` asks (older SGLang
    /// builds and other OpenAI-compatible servers).
    #[arg(long)]
    pub ignore_continuous_usage: bool,
    /// Fault: engines start down.
    #[arg(long)]
    pub down: bool,
    /// Fault: bootstrap servers accept and drop.
    #[arg(long)]
    pub bootstrap_down: bool,
    /// Fault: these prefill DP ranks never register (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub unregistered_ranks: Vec<u32>,
    /// Fault: no prefill rank registers.
    #[arg(long)]
    pub register_none: bool,
    /// Fault: prefill answers this status.
    #[arg(long)]
    pub prefill_status: Option<u16>,
    /// Fault: prefill never answers.
    #[arg(long)]
    pub prefill_hang: bool,
    /// Fault: prefill goes down during its first request.
    #[arg(long)]
    pub prefill_die_mid_request: bool,
    /// Fault: decode answers this status.
    #[arg(long)]
    pub decode_status: Option<u16>,
    /// Fault: decode cuts the stream after this many chunks.
    #[arg(long)]
    pub decode_die_mid_stream_after: Option<u32>,
    /// Fault: extra decode inter-token latency (ms).
    #[arg(long, default_value_t = 0)]
    pub decode_extra_itl_ms: u64,
    /// Fault: extra decode time to first token (ms).
    #[arg(long, default_value_t = 0)]
    pub decode_extra_ttft_ms: u64,
    /// Fault: the prefill answers this long (ms) after its KV hand-off.
    #[arg(long, default_value_t = 0)]
    pub prefill_answer_delay_ms: u64,
    /// Fault: decode holds every request before its bootstrap lookup until the fault is
    /// cleared (`POST /sim/faults {"decode_hold": false}`).
    #[arg(long)]
    pub decode_hold: bool,
    /// Fault: decode pulls the KV, then never sends a first byte.
    #[arg(long)]
    pub decode_hang: bool,
    /// Fault: every compute time of the engine multiplied by this (0, 1: none).
    #[arg(long, default_value_t = 0)]
    pub slowdown: u32,
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
}

fn millis(ms: f64) -> Duration {
    secs(ms / 1000.0)
}

impl SimArgs {
    /// The faults selected by the flags.
    pub fn faults(&self) -> Faults {
        Faults {
            down: self.down,
            bootstrap_down: self.bootstrap_down,
            unregistered_ranks: self.unregistered_ranks.clone(),
            register_none: self.register_none,
            prefill_status: self.prefill_status,
            prefill_hang: self.prefill_hang,
            prefill_die_mid_request: self.prefill_die_mid_request,
            decode_status: self.decode_status,
            decode_die_mid_stream_after: self.decode_die_mid_stream_after,
            decode_extra_itl_ms: self.decode_extra_itl_ms,
            decode_extra_ttft_ms: self.decode_extra_ttft_ms,
            prefill_answer_delay_ms: self.prefill_answer_delay_ms,
            decode_hold: self.decode_hold,
            decode_hang: self.decode_hang,
            slowdown: self.slowdown,
            bootstrap_route_delay_ms: 0,
        }
    }

    /// The engine configuration for `role` with `dp_size` DP ranks.
    pub fn config(&self, role: Role, dp_size: u32) -> EngineConfig {
        let mut c = EngineConfig {
            role,
            dp_size,
            host: self.host.clone(),
            legacy_bootstrap_bug: self.legacy_bootstrap_bug,
            max_running_requests: self.max_running_requests,
            incremental_streaming_output: self.incremental_streaming_output,
            ignore_continuous_usage: self.ignore_continuous_usage,
            enable_cache_report: self.enable_cache_report,
            faults: self.faults(),
            ..Default::default()
        };
        if let Some(v) = self.prefill_ms {
            c.prefill_delay = Duration::from_millis(v);
        }
        if let Some(v) = self.prefill_per_token_ms {
            c.prefill_per_token = millis(v);
        }
        if let Some(v) = self.prefill_prefix_cache_tokens {
            c.prefill_prefix_cache_tokens = v;
        }
        if let Some(v) = self.decode_prefix_cache_tokens {
            c.decode_prefix_cache_tokens = v;
        }
        if let Some(v) = self.prefix_cache_page_size {
            c.prefix_cache_page_size = v;
        }
        if let Some(v) = self.decode_per_missing_token_ms {
            c.decode_per_missing_token = millis(v);
        }
        if let Some(v) = self.ttft_ms {
            c.ttft = Duration::from_millis(v);
        }
        if let Some(v) = self.itl_ms {
            c.itl = Duration::from_millis(v);
        }
        if let Some(v) = self.tokens {
            c.default_output_tokens = v;
        }
        if let Some(v) = self.waiting_timeout_secs {
            c.waiting_timeout = secs(v);
        }
        if let Some(v) = self.bootstrap_timeout_secs {
            c.bootstrap_timeout = secs(v);
        }
        if let Some(v) = self.sentinel_attempts {
            c.sentinel_attempts = v;
        }
        if let Some(v) = self.sentinel_interval_ms {
            c.sentinel_interval = Duration::from_millis(v);
        }
        if let Some(v) = self.heartbeat_interval_ms {
            c.heartbeat_interval = Duration::from_millis(v);
        }
        if let Some(v) = self.heartbeat_max_failures {
            c.heartbeat_max_failures = v;
        }
        if let Some(v) = &self.model {
            c.model = v.clone();
        }
        if let Some(v) = &self.served_model_name {
            c.served_model_name = Some(v.clone());
        }
        if let Some(v) = self.context_length {
            c.context_length = v;
        }
        if let Some(v) = self.page_size {
            c.page_size = v;
        }
        if let Some(v) = &self.kv_cache_dtype {
            c.kv_cache_dtype = v.clone();
        }
        if let Some(v) = &self.load_balance_method {
            c.load_balance_method = v.clone();
        }
        c
    }

    fn port_at(&self, offset: u32) -> Result<u16, String> {
        if self.base_port == 0 {
            return Ok(0);
        }
        u16::try_from(u32::from(self.base_port) + offset).map_err(|_| {
            format!(
                "--base-port {} leaves no room for every engine",
                self.base_port
            )
        })
    }
}

/// The `READY …` line of one engine.
pub fn ready_line(e: &SimEngine) -> String {
    match e.bootstrap_port() {
        Some(b) => format!(
            "READY {} {} bootstrap_port={b} dp={}",
            e.role(),
            e.url(),
            e.config().dp()
        ),
        None => format!("READY {} {} dp={}", e.role(), e.url(), e.config().dp()),
    }
}

/// Starts the engines, prints one `READY` line each, runs until Ctrl-C.
pub async fn run(args: SimArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let engines: Vec<SimEngine> = match args.role {
        Some(role) => {
            let dp = if role == Role::Prefill {
                args.prefill_dp
            } else {
                args.decode_dp
            };
            let mut cfg = args.config(role, dp);
            cfg.port = args.port;
            cfg.bootstrap_port = args.bootstrap_port;
            vec![crate::engine::spawn(cfg).await?]
        }
        None => {
            let mut prefills = Vec::new();
            for i in 0..args.prefill {
                let mut cfg = args.config(Role::Prefill, args.prefill_dp);
                cfg.port = args.port_at(2 * i)?;
                cfg.bootstrap_port = args.port_at(2 * i + 1)?;
                prefills.push(cfg);
            }
            let mut decodes = Vec::new();
            for j in 0..args.decode {
                let mut cfg = args.config(Role::Decode, args.decode_dp);
                cfg.port = args.port_at(2 * args.prefill + j)?;
                decodes.push(cfg);
            }
            let cluster = SimCluster::spawn(&prefills, &decodes).await?;
            let SimCluster { prefills, decodes } = cluster;
            prefills.into_iter().chain(decodes).collect()
        }
    };
    {
        let mut out = std::io::stdout().lock();
        for e in &engines {
            writeln!(out, "{}", ready_line(e))?;
        }
        out.flush()?;
    }
    // Ctrl-C, or SIGTERM (a container's PID 1 gets no default SIGTERM handler).
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await?;
    drop(engines);
    Ok(())
}
