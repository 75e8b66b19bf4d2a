//! Configuration: every setting, its default and its validation, in one place.
//!
//! Invariants:
//! - Defaults live only here (`Default` impls below); the CLI holds `Option`s that override
//!   a loaded file, and nothing else in the crate invents a default.
//! - Every struct denies unknown keys, so a typo in a TOML file fails at start with a
//!   message naming the key.
//! - [`Config::validate`] runs after the file and the flags are merged; a config that
//!   passed it is safe to serve with.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod affinity;
mod capacity;
mod log;
pub mod models;
mod ops;
mod progress;
mod resilience;
mod trace;
mod validate;
mod warnings;

/// The config as it is now: swapped whole on reload, read by background tasks at each step
/// (a health check reads `load().health` before each probe).
pub type LiveConfig = std::sync::Arc<arc_swap::ArcSwap<Config>>;

/// A [`LiveConfig`] holding `cfg`.
pub fn live(cfg: Config) -> LiveConfig {
    std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(cfg))
}

pub use affinity::{AffinityConfig, MAX_KEY_HEADERS};
pub use capacity::CapacityConfig;
pub use log::{LogConfig, LogFormat};
pub use models::{ModelSettings, ModelsConfig, RegularWorkerConfig};
pub use ops::{AdminConfig, AuthConfig, DiscoveryConfig, MetricsListenerConfig, ReloadConfig};
pub use progress::ProgressConfig;
pub use resilience::{BreakerConfig, HealthConfig, RetryConfig};
pub use trace::TraceConfig;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// The whole configuration of `pdgate serve`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    /// Prefill engines (`[[prefill]]` tables, or `--prefill URL [PORT]`).
    pub prefill: Vec<PrefillWorkerConfig>,
    /// Decode engines (`[[decode]]` tables, or `--decode URL`).
    pub decode: Vec<DecodeWorkerConfig>,
    /// Regular (non-PD) engines (`[[worker]]` tables, or `--worker URL`).
    pub worker: Vec<RegularWorkerConfig>,
    pub policy: PolicyConfig,
    pub affinity: AffinityConfig,
    pub contract: ContractConfig,
    pub timeouts: TimeoutConfig,
    pub retry: RetryConfig,
    pub health: HealthConfig,
    pub breaker: BreakerConfig,
    pub admission: AdmissionConfig,
    pub capacity: CapacityConfig,
    pub bootstrap: BootstrapConfig,
    pub upstream: UpstreamConfig,
    pub log: LogConfig,
    pub discovery: DiscoveryConfig,
    pub admin: AdminConfig,
    pub auth: AuthConfig,
    pub reload: ReloadConfig,
    pub progress: ProgressConfig,
    pub models: ModelsConfig,
    pub metrics_listener: MetricsListenerConfig,
    pub trace: TraceConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    pub host: IpAddr,
    pub port: u16,
    /// Largest accepted request body; larger gets 413.
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's head, from its first byte (and how
    /// long a kept-alive connection may sit idle before it); then the connection is closed.
    pub header_read_timeout_secs: u64,
    /// How long a client may take to send a request's body once its head is in; then 408
    /// `request_body_timeout` (nothing was sent to an engine).
    pub body_read_timeout_secs: u64,
    /// How long SIGTERM waits for in-flight requests before exiting.
    pub drain_secs: u64,
    /// Accept backlog of the listening socket.
    pub listen_backlog: u32,
    /// Runtime worker threads of `pdgate serve`: 1 (default) runs one current-thread
    /// runtime, the leanest per request; scale out with replicas, or raise this (0 = one per
    /// core).
    pub worker_threads: usize,
    /// Run the blocking pool's work (reading a request body or a prefill's logprobs of
    /// 256 KiB or more) at the OS's idle priority (Linux `SCHED_IDLE`), so that an event-loop
    /// thread that wakes takes the CPU from it at once. At normal priority a few milliseconds
    /// of parsing a hostile client's payload kept the event loop, and every other request,
    /// waiting for a CPU (the hostile bench, BENCHMARKS §10). The cost: that work runs only
    /// on CPU time the event loops leave (on a saturated replica it waits, bounded by the
    /// request's deadlines). Read at start.
    pub offload_idle_priority: bool,
    /// The most bytes a second that large request bodies move, all together, past the
    /// first 256 KiB of each: read from clients and written to engines (each leg counts).
    /// 0: no limit. Past it those bodies wait; smaller requests never do. Why: a
    /// maximum-size body costs the router its size three times in copies (read, two legs),
    /// so a few clients sending them took most of a core from every other request. At
    /// least 64 KiB/s when set.
    pub large_body_bytes_per_sec: u64,
    /// Client connections open at once (0 = no limit). A connection beyond it is answered
    /// `503 too_many_connections` (HTTP/1.1, `Retry-After`, `Connection: close`) and
    /// closed at once, so a load balancer in front retries elsewhere instead of waiting.
    pub max_connections: usize,
    /// An HTTP/2 connection with no open stream for this long is closed (GOAWAY). HTTP/1
    /// connections are bounded between requests by `header_read_timeout_secs`.
    pub idle_timeout_secs: u64,
    /// Also serve `/metrics` on the front door (it always is on the admin listener).
    pub public_metrics: bool,
}

impl ServerConfig {
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.idle_timeout_secs)
    }
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_secs(self.header_read_timeout_secs)
    }
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_secs(self.body_read_timeout_secs)
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: IpAddr::from([127, 0, 0, 1]),
            port: 8000,
            max_body_bytes: 32 * 1024 * 1024,
            header_read_timeout_secs: 30,
            body_read_timeout_secs: 30,
            drain_secs: 30,
            listen_backlog: 4096,
            worker_threads: 1,
            offload_idle_priority: true,
            large_body_bytes_per_sec: 256 * 1024 * 1024,
            max_connections: 16_384,
            idle_timeout_secs: 60,
            public_metrics: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillWorkerConfig {
    pub url: String,
    /// The prefill's bootstrap server port. Unset: the engine's
    /// `disaggregation_bootstrap_port` from `/server_info`, else 8998.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// The host decode engines reach the bootstrap server at. Unset: the URL's host.
    #[serde(default)]
    pub bootstrap_host: Option<String>,
    /// The model clients name for this engine. Unset: what its `/server_info` reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeWorkerConfig {
    pub url: String,
    /// The model clients name for this engine. Unset: what its `/server_info` reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Selection policies by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PolicyKind {
    Random,
    RoundRobin,
    /// The less loaded of two random workers (load = in flight + engine-reported).
    PowerOfTwo,
    /// Prefix affinity by consistent hashing with bounded loads.
    CacheAware,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    pub prefill: PolicyKind,
    pub decode: PolicyKind,
    /// cache_aware: bounded-load factor c; a (worker, rank) takes a request only while its
    /// load stays within ceil(c x (total load + 1) / members) + `cache_aware_slack`. At
    /// least 1.0.
    pub cache_aware_balance_factor: f64,
    /// cache_aware: requests a member may hold above the relative bound before its keys
    /// spill. At low load the relative bound is one or two requests, and a spilled turn
    /// recomputes its whole conversation on another rank, which costs more than waiting
    /// behind a request or two on its own (issue 35's multi-turn bench). 0..=64.
    pub cache_aware_slack: u32,
    /// cache_aware: virtual nodes per worker on the hash ring.
    pub cache_aware_vnodes: u32,
    /// Poll each engine's own load (`/v1/loads`, else `/get_load`) this often; 0 = off.
    /// On by default: decode admission across replicas reads the engines' reports
    /// (running, waiting, pre-allocation queue). With the default health and bootstrap
    /// intervals one idle router sends an engine at most 4 requests a second in all.
    pub load_poll_interval_ms: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            prefill: PolicyKind::RoundRobin,
            decode: PolicyKind::RoundRobin,
            cache_aware_balance_factor: 1.25,
            cache_aware_slack: 1,
            cache_aware_vnodes: 100,
            load_poll_interval_ms: 1000,
        }
    }
}

impl PolicyConfig {
    /// The load poll period, `None` when polling is off.
    pub fn load_poll_interval(&self) -> Option<Duration> {
        (self.load_poll_interval_ms > 0).then(|| Duration::from_millis(self.load_poll_interval_ms))
    }
}

/// How the prefill DP rank is conveyed (spec §4.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ContractMode {
    /// No DP field on the prefill leg; the rank rides on `room % dp_P`.
    Modulo,
    /// `routed_dp_rank` and `disagg_prefill_dp_rank` on both legs (SGLang engines that
    /// take `disagg_prefill_dp_rank`).
    Pinned,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContractConfig {
    pub mode: ContractMode,
}

impl Default for ContractConfig {
    fn default() -> Self {
        ContractConfig {
            mode: ContractMode::Modulo,
        }
    }
}

/// Deadlines per leg (no total timeout on a stream that keeps producing tokens).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutConfig {
    /// TCP connect to an engine.
    pub connect_ms: u64,
    /// Prefill leg: from send until its complete answer (it answers once its KV is sent).
    pub prefill_secs: u64,
    /// Decode leg: from the prefill's completion until decode's first body byte.
    pub decode_first_byte_secs: u64,
    /// Longest silence between two body chunks of decode once streaming.
    pub stream_idle_secs: u64,
    /// Cap on a whole request before its first byte reaches the client, and on a
    /// non-streamed request as a whole (`--request-timeout-secs`).
    pub request_secs: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            connect_ms: 1000,
            prefill_secs: 60,
            decode_first_byte_secs: 10,
            stream_idle_secs: 60,
            request_secs: 600,
        }
    }
}

impl TimeoutConfig {
    pub fn connect(&self) -> Duration {
        Duration::from_millis(self.connect_ms)
    }
    pub fn prefill(&self) -> Duration {
        Duration::from_secs(self.prefill_secs)
    }
    pub fn decode_first_byte(&self) -> Duration {
        Duration::from_secs(self.decode_first_byte_secs)
    }
    pub fn stream_idle(&self) -> Duration {
        Duration::from_secs(self.stream_idle_secs)
    }
    pub fn request(&self) -> Duration {
        Duration::from_secs(self.request_secs)
    }
}

/// Admission: a cap on requests in flight, with a bounded wait queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Requests served at once (0 = no limit).
    pub max_in_flight: usize,
    /// Requests that may wait for a slot; more get 429.
    pub max_queue: usize,
    /// Longest wait for a slot; longer gets 503. A request whose estimated wait (its place
    /// in the queue against the rate the decode slots free) is longer is answered 503 at
    /// once, with that estimate in `Retry-After`.
    pub queue_timeout_ms: u64,
    /// How long the engines let a prefill's KV wait for its decode
    /// (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, SGLang's default 300 s; engines do not
    /// report it). A decode rank whose reported queue would hold a new request for half
    /// of it (its waiting requests against its running ones and the time a request holds
    /// a slot there) is sent nothing until it shortens: the request waits in pdgate's
    /// queue instead of starting a bootstrap clock it may not win.
    pub engine_bootstrap_timeout_secs: u64,
    /// The in-flight byte budget (`crate::memory`): request bodies and buffered engine
    /// answers held at once, across all requests. A request that does not fit now gets 503
    /// with `Retry-After`; one that can never fit gets 413. A large request (over 1/64 of
    /// it) may fill 7/8 of it, the rest is kept for small ones. At least 8/7 of
    /// `server.max_body_bytes`. The process's memory is about a base plus this times a
    /// small factor (docs/pools-and-capacity.md, "Memory").
    pub max_bytes_in_flight: usize,
    /// How many pdgate replicas serve the same engines (a static deployment's count); 0 =
    /// unknown. Known, each replica holds at most its share of every decode rank's
    /// capacity (`pool::capacity::share`), so that together they never send a rank more
    /// than it runs (ARCHITECTURE.md, "Admission across replicas"). Replica-wide: a model's
    /// admission override does not change it.
    pub replicas: u32,
    /// This replica's index among `replicas` (0-based; a StatefulSet pod's ordinal): it
    /// decides which replicas take the `capacity mod replicas` remainder slots of each
    /// rank, so that the shares add up to the whole capacity. Unset: no remainder slot
    /// (at least one slot per rank).
    pub replica_index: Option<u32>,
    /// A label selector of pdgate's own pods (its Service's selector, e.g.
    /// `app.kubernetes.io/name=pdgate`): the replica count and this replica's index then come
    /// from Kubernetes, and follow replicas joining and leaving (`discovery::replicas` has
    /// the rule; the client and namespace are discovery's). Unset or empty: off. Not with
    /// `replicas` or `replica_index` (refused at start: one source of the count). Needs a
    /// restart to change.
    pub replica_selector: Option<String>,
    /// The most work a prefill DP rank may have queued, in seconds of its own learned pace
    /// (`pool::backlog`: the engine's queued uncached prompt tokens plus this replica's legs
    /// sent since, over the uncached tokens per second its legs took); 0 = no bound. A rank
    /// over it is not picked while another prefill rank has room; when none has, the
    /// request waits in the admission queue (`max_queue`, `queue_timeout_ms`). A rank
    /// holding none of this replica's legs always takes one; one whose pace is not learned
    /// yet is held to its pool's (none learned anywhere: no bound). Default 2 s, well under
    /// `engine_bootstrap_timeout_secs` (docs/pools-and-capacity.md, "Prefill admission by
    /// tokens").
    /// Replica-wide: a model's admission override does not change it.
    pub prefill_backlog_max_secs: f64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_in_flight: 4096,
            max_queue: 4096,
            queue_timeout_ms: 60_000,
            engine_bootstrap_timeout_secs: 300,
            max_bytes_in_flight: 128 * 1024 * 1024,
            replicas: 0,
            replica_index: None,
            replica_selector: None,
            prefill_backlog_max_secs: 2.0,
        }
    }
}

impl AdmissionConfig {
    /// The replica selector, trimmed, when one is set (see `replica_selector`).
    pub fn replica_selector(&self) -> Option<&str> {
        self.replica_selector
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
    }
}

/// The embedded decode-side bootstrap poll (spec §3, §7).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BootstrapConfig {
    /// The liveness check of each bootstrap server: one sentinel `GET /route` (layout and
    /// "every rank registered") per interval, whatever the DP size.
    pub heartbeat_interval_ms: u64,
    /// Consecutive missed heartbeats that mark a prefill lost.
    pub heartbeat_max_failures: u32,
    /// The slow pace at which every rank's route is re-read when nothing signalled a
    /// change (a failed leg, a restart, a layout change, a heartbeat miss re-read at once).
    pub refresh_interval_ms: u64,
    /// Each slow re-read is `refresh_interval_ms` times a random factor in `1 ± this`, so
    /// that replicas started together do not read together.
    pub refresh_jitter: f64,
    /// The most rank-route reads per second one router makes of one bootstrap server,
    /// averaged over re-reads (signalled or not), whatever the DP size.
    pub max_route_reads_per_sec: f64,
    /// A rank's view older than this is re-checked on the request path (preflight).
    pub freshness_ms: u64,
    /// Timeout of a preflight check on the request path.
    pub preflight_timeout_ms: u64,
    /// Timeout of every background call to a bootstrap server or engine info endpoint.
    pub http_timeout_ms: u64,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        BootstrapConfig {
            heartbeat_interval_ms: 750,
            heartbeat_max_failures: 2,
            refresh_interval_ms: 30_000,
            refresh_jitter: 0.2,
            max_route_reads_per_sec: 2.0,
            freshness_ms: 5000,
            preflight_timeout_ms: 500,
            http_timeout_ms: 2000,
        }
    }
}

impl BootstrapConfig {
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }
    pub fn refresh_interval(&self) -> Duration {
        Duration::from_millis(self.refresh_interval_ms)
    }
    pub fn freshness(&self) -> Duration {
        Duration::from_millis(self.freshness_ms)
    }
    pub fn preflight_timeout(&self) -> Duration {
        Duration::from_millis(self.preflight_timeout_ms)
    }
    pub fn http_timeout(&self) -> Duration {
        Duration::from_millis(self.http_timeout_ms)
    }
}

/// How pdgate talks to engines.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Forward the client's `Authorization` header to engines.
    pub forward_authorization: bool,
    /// Send `Authorization: Bearer <key>` to engines (wins over forwarding).
    pub api_key: Option<String>,
    /// Idle pooled connections kept per engine.
    pub pool_max_idle_per_host: usize,
    /// How long an idle engine connection is kept for reuse (legs and background calls).
    /// Kept below the engines' own keep-alive: SGLang and vLLM serve with uvicorn and
    /// `timeout_keep_alive=5`, so a connection idle for 5 s is being closed by the engine,
    /// and a leg written into it just then fails (it cannot be sent again: the engine may
    /// have read it). 4 s leaves a second between the engine's timer, which starts when it
    /// has written its answer, and pdgate's, which starts when it has read it.
    pub pool_idle_timeout_secs: u64,
    /// The most of an engine's answer pdgate holds at once: a prefill's whole answer (it
    /// carries input logprobs when asked for), a decode answer whose logprobs are merged,
    /// or one unfinished SSE event. Beyond it the leg counts as broken, so that an engine
    /// cannot grow the router's memory without bound.
    pub max_answer_bytes: usize,
    /// The most bytes of the prefill's input logprobs merged into each event of a streamed
    /// `/generate` with `return_logprob` (each event repeats them, as SGLang's chunks are
    /// cumulative, so a stream costs this times its events). Past it the request is
    /// answered 413 before its first byte (`logprobs_too_large`); a non-streamed request
    /// merges them once and is bounded by `max_answer_bytes` only.
    pub max_stream_logprob_bytes: usize,
    /// The most bytes of the prefill's input logprobs one such stream may repeat in all:
    /// their size times the events the request can produce (one per output token at most:
    /// its `max_new_tokens`, SGLang's default 128 when it sets none, per item of a batch).
    /// Past it the request is answered 413 before its first byte (`logprobs_too_large`).
    /// Why both: the per-event cap bounds one event; this one bounds what one request
    /// makes the router copy and send (a 1 MiB merge in each of 2,000 events is 2 GiB).
    pub max_stream_logprob_total_bytes: usize,
    /// The most bytes a second that all streams repeating input logprobs send together
    /// (0: no limit). Such a stream costs the router its prompt's logprobs again in every
    /// event (megabytes a second from one client); past this rate its events wait, so that
    /// these streams take a bounded share of the router, whatever their number, and every
    /// other request is never held back. 100 ms worth goes at full speed after a quiet spell.
    /// At least 64 KiB/s when set.
    pub stream_logprob_bytes_per_sec: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            forward_authorization: false,
            api_key: None,
            pool_max_idle_per_host: 256,
            pool_idle_timeout_secs: 4,
            max_answer_bytes: 64 * 1024 * 1024,
            max_stream_logprob_bytes: 1024 * 1024,
            max_stream_logprob_total_bytes: 256 * 1024 * 1024,
            stream_logprob_bytes_per_sec: 64 * 1024 * 1024,
        }
    }
}

impl Config {
    /// Adds static regular (non-PD) workers by URL, serving the model their engine reports.
    pub fn add_regular_workers(&mut self, urls: impl IntoIterator<Item = String>) {
        self.worker.extend(
            urls.into_iter()
                .map(|url| RegularWorkerConfig { url, model: None }),
        );
    }

    /// Adds static workers: prefills as (URL, bootstrap port), decodes as URLs.
    pub fn add_workers(
        &mut self,
        prefills: impl IntoIterator<Item = (String, Option<u16>)>,
        decodes: impl IntoIterator<Item = String>,
    ) {
        self.prefill
            .extend(
                prefills
                    .into_iter()
                    .map(|(url, bootstrap_port)| PrefillWorkerConfig {
                        url,
                        bootstrap_port,
                        bootstrap_host: None,
                        model: None,
                    }),
            );
        self.decode.extend(
            decodes
                .into_iter()
                .map(|url| DecodeWorkerConfig { url, model: None }),
        );
    }

    /// Reads a TOML file; unknown keys and wrong types are refused with the key named.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<inline>".to_string(),
            message: e.to_string().trim().to_string(),
        })
    }
}

/// A day in seconds: the longest any single deadline or interval may be.
const DAY: u64 = 86_400;
/// The largest body or answer size pdgate holds (4 GiB).
const MAX_BYTES: usize = 4 << 30;

fn invalid(message: String) -> ConfigError {
    ConfigError::Invalid(message)
}

fn out_of_range(key: &str, value: impl std::fmt::Display, allowed: &str) -> ConfigError {
    invalid(format!(
        "{key} = {value} is out of range (allowed: {allowed})"
    ))
}

/// The least shared byte rate accepted (64 KiB/s): below it a large body would take minutes
/// and run into its deadlines (a typo's rate, not a policy).
const MIN_BYTE_RATE: u64 = 64 << 10;

/// A byte rate: 0 (no limit) or at least [`MIN_BYTE_RATE`].
fn off_or_at_least(key: &str, v: u64) -> Result<(), ConfigError> {
    if v != 0 && v < MIN_BYTE_RATE {
        return Err(out_of_range(
            key,
            v,
            &format!("0 (no limit) or {MIN_BYTE_RATE}.."),
        ));
    }
    Ok(())
}

/// Checks `lo <= v <= hi`.
fn range<T>(key: &str, v: T, lo: T, hi: T) -> Result<(), ConfigError>
where
    T: PartialOrd + std::fmt::Display + Copy,
{
    if v < lo || v > hi {
        return Err(out_of_range(key, v, &format!("{lo}..={hi}")));
    }
    Ok(())
}

/// Checks that `v` is finite and `lo <= v <= hi`.
fn range_f(key: &str, v: f64, lo: f64, hi: f64) -> Result<(), ConfigError> {
    if !v.is_finite() || v < lo || v > hi {
        return Err(out_of_range(key, v, &format!("{lo}..={hi}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
