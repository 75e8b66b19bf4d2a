//! SGLang router (smg) flags on `pdgate serve`, so that a launch command written for SGLang's
//! router starts pdgate unchanged or is refused with a message that says what to use.
//!
//! Every flag of `smg launch --help` (1.13) and of the older `sglang-router` package's
//! `python -m sglang_router.launch_router --help` (0.3.2, whose flags smg kept but one,
//! `--mini-lb`) has one entry in [`FLAGS`] (the captured texts are test fixtures in
//! `tests/it/fixtures/`), with its fate:
//! - [`Fate::Mapped`]: a real flag of [`SglangArgs`] (or of `ServeArgs` when pdgate has the
//!   same name) sets pdgate's setting;
//! - [`Fate::Always`]: accepted and unused, because pdgate always does it (`--dp-aware`);
//! - [`Fate::Ignored`]: accepted and unused, with a warning at start that says what pdgate
//!   does instead (tuning of a mechanism pdgate replaces with its own);
//! - [`Fate::Only`]: accepted when its value is what pdgate always does, refused otherwise;
//! - [`Fate::Refused`]: refused at start, naming what replaces it. A flag is refused rather
//!   than ignored when ignoring it would change what clients get or weaken security (TLS,
//!   auth, CORS, storage, tokenization).
//!
//! Invariant: the table test (`tests/it/sglang_flags.rs`) fails when the fixture has a flag
//! this table does not cover, and checks every fate by parsing the flag.

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};

use crate::config::{Config, ConfigError, LogFormat};

/// What `pdgate serve` does with an SGLang router flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Sets pdgate's setting (a real `serve` flag).
    Mapped,
    /// Accepted and unused: pdgate always does this (the reason).
    Always(&'static str),
    /// Accepted and unused, warned at start (what pdgate does instead).
    Ignored(&'static str),
    /// Accepted when every value given is `value` (case-insensitive), else refused (`why`).
    Only {
        value: &'static str,
        why: &'static str,
    },
    /// Refused at start (what replaces it).
    Refused(&'static str),
}

/// One SGLang router flag (its long name without `--`) and its fate.
#[derive(Clone, Copy, Debug)]
pub struct Flag {
    pub name: &'static str,
    pub fate: Fate,
}

const fn f(name: &'static str, fate: Fate) -> Flag {
    Flag { name, fate }
}

use Fate::{Always, Ignored, Mapped, Only, Refused};

const CACHE_AWARE: Fate = Ignored(
    "pdgate's cache_aware is prefix affinity on a hash ring with bounded loads; tune it with \
     policy.cache_aware_balance_factor (--prefix-hash-load-factor)",
);
const LOAD: Fate = Ignored(
    "pdgate's power_of_two weighs requests in flight and the engine's reported load \
     (policy.load_poll_interval_ms)",
);
const OVERLOAD: Fate = Ignored(
    "pdgate holds a request back while its decode rank is at capacity ([capacity], learned \
     from the engine) and bounds requests in flight with --max-concurrent-requests",
);
const STALL: Fate = Ignored(
    "pdgate detects a stalled leg from learned leg times ([progress]) and moves a stalled \
     stream to another decode (retry.max_stream_moves)",
);
const WARMUP: Fate = Ignored("pdgate routes to a worker from its first good health check");
const STARTUP: Fate = Ignored(
    "pdgate starts at once and routes to a worker from its first good health check; \
     /readiness says when a prefill/decode pair is up",
);
const RECOVERY: Fate = Ignored(
    "pdgate takes an unhealthy worker out of rotation and back when it is healthy again; \
     discovery removes deleted pods, and DELETE /workers/{id} on the admin listener removes \
     one",
);
const BACKOFF: Fate = Ignored(
    "pdgate retries at once on another worker, within a retry budget (retry.budget_ratio), \
     without backoff",
);
const PREFILL_LIMIT: Fate = Ignored(
    "pdgate bounds requests in flight with --max-concurrent-requests and per decode rank \
     ([capacity]); it has no per-prefill queue",
);
const STUDIO: Fate = Refused(
    "pdgate forwards request bodies to the engines as they are: it does no tokenization, \
     chat templating, parsing or multimodal processing (the SGLang engines do)",
);
const STORAGE: Fate = Refused(
    "pdgate stores no conversations or responses; it routes /generate, \
     /v1/chat/completions and /v1/completions",
);
const TENANT: Fate = Refused(
    "pdgate tells clients apart by API key: --api-keys-file with `NAME: KEY` lines, and \
     auth.per_key_max_in_flight for a per-key limit",
);
const MESH: Fate = Refused("pdgate replicas share no state: run several behind one Service");
const EPD: Fate =
    Refused("pdgate routes prefill/decode pairs only (no encode stage): --prefill and --decode");
const MTLS: Fate =
    Refused("pdgate talks plain HTTP to engines; put mTLS to the engines in a service mesh");
const TLS: Fate = Refused(
    "pdgate serves plain HTTP: terminate TLS in front of it (ingress, load balancer, sidecar)",
);
const JWT: Fate =
    Refused("pdgate authenticates clients by API key (--api-key, --api-keys-file), not JWT");
const RL: Fate =
    Refused("pdgate has no RL control plane: send weight updates to the engines directly");
const PRIORITY: Fate = Refused(
    "pdgate admits requests in arrival order (admission queue); it has no priority classes",
);

/// Every flag of `smg launch --help` (smg 1.13), sorted as that help lists them, and
/// `--mini-lb` of sglang-router 0.3.2.
pub const FLAGS: &[Flag] = &[
    f("job-queue-capacity", Ignored("pdgate adds a worker at once (admin API, discovery); there is no job queue")),
    f("job-queue-concurrency", Ignored("pdgate adds a worker at once (admin API, discovery); there is no job queue")),
    f("load-monitor-interval", Mapped),
    f("disable-load-monitoring", Mapped),
    f("multimodal-tensor-transport", STUDIO),
    f("multimodal-shm-min-bytes", STUDIO),
    f("multimodal-max-inflight-bytes", STUDIO),
    f("mm-per-request-image-limit", STUDIO),
    f("mm-processing", STUDIO),
    f("mm-pixel-cache-mb", STUDIO),
    f("mm-pixel-rdma", STUDIO),
    f("mm-allowed-media-domains", STUDIO),
    f("mm-allow-private-media-hosts", STUDIO),
    f("rdma-listen-ip", STUDIO),
    f("rdma-slot-ttl-s", STUDIO),
    f("log-mm-timing", STUDIO),
    f("host", Mapped),
    f("port", Mapped),
    f("worker-urls", Mapped),
    f("upstream-http2", Ignored("pdgate speaks HTTP/1.1 to engines, as SGLang's HTTP server does")),
    f("upstream-pool-idle-timeout-secs", Mapped),
    f("health-check-port", Refused("--prometheus-port opens a listener for /liveness and /metrics apart from the front door")),
    f("policy", Mapped),
    f("encode-policy", EPD),
    f("prefill-policy", Mapped),
    f("decode-policy", Mapped),
    f("cache-threshold", CACHE_AWARE),
    f("cache-match-threshold", CACHE_AWARE),
    f("prefix-token-count", CACHE_AWARE),
    f("prefix-hash-load-factor", Mapped),
    f("prefix-hash-balance-abs-threshold", CACHE_AWARE),
    f("least-load-kv-pressure-weight", LOAD),
    f("least-load-default-throughput", LOAD),
    f("least-load-mean-prefill-tokens", LOAD),
    f("least-load-max-waiting-requests", LOAD),
    f("power-of-two-load-metric", LOAD),
    f("balance-abs-threshold", CACHE_AWARE),
    f("balance-rel-threshold", CACHE_AWARE),
    f("balance-token-usage-threshold", CACHE_AWARE),
    f("overload-token-usage-threshold", OVERLOAD),
    f("worker-overload-waiting-requests", OVERLOAD),
    f("worker-overload-token-usage", OVERLOAD),
    f("worker-overload-protection", OVERLOAD),
    f("disable-worker-overload-protection", OVERLOAD),
    f("worker-overload-shed", OVERLOAD),
    f("kv-index", CACHE_AWARE),
    f("worker-stall-secs", STALL),
    f("worker-wedge-secs", STALL),
    f("worker-stale-secs", STALL),
    f("worker-warmup-secs", WARMUP),
    f("worker-warmup-share", WARMUP),
    f("worker-warmup-blocks", WARMUP),
    f("worker-warmup-thin-ratio", WARMUP),
    f("worker-warmup-divert-every", WARMUP),
    f("selection-policy", CACHE_AWARE),
    f("selection-accounting-ttl-ms", CACHE_AWARE),
    f("overlap-decay", CACHE_AWARE),
    f("selection-temperature", CACHE_AWARE),
    f("bucket-adjust-interval-secs", CACHE_AWARE),
    f("eviction-interval-secs", CACHE_AWARE),
    f("max-tree-size", CACHE_AWARE),
    f("block-size", CACHE_AWARE),
    f("cache-boundaries", CACHE_AWARE),
    f("cache-index", CACHE_AWARE),
    f("cache-ttl-secs", CACHE_AWARE),
    f("max-idle-secs", Mapped),
    f("spill-abs-threshold", CACHE_AWARE),
    f("spill-rel-threshold", CACHE_AWARE),
    f("assignment-mode", Refused("pdgate places a new routing key by its hash on the cache_aware ring (the same worker on every replica), not by an assignment mode; see [affinity]")),
    f("max-payload-size", Mapped),
    f("max-buffered-request-bytes", Ignored("pdgate reads every request body whole (within admission.max_bytes_in_flight), so every request can be retried")),
    f("pd-admission-wait-secs", Ignored("a request waiting for a decode slot waits in the admission queue, up to admission.queue_timeout_ms")),
    f("stream-body-stall-timeout-secs", Mapped),
    f("sse-keepalive-secs", Ignored("pdgate relays the decode engine's stream as it comes, without keep-alive comments")),
    f("dp-aware", Always("pdgate always routes to a DP rank: it reads each engine's DP layout")),
    f("routing-key-override", Mapped),
    f("sticky-sessions", Mapped),
    f("sticky-key-idle-secs", Mapped),
    f("routing-key-headers", Mapped),
    f("dp-minimum-tokens-scheduler", Ignored("pdgate picks the DP rank with its own policy")),
    f("enable-igw", Refused("pdgate routes one prefill/decode fleet; it is not a multi-fleet gateway")),
    f("pd-disaggregation", Always("pdgate routes prefill/decode pairs wherever a model has them, and regular workers (--worker-urls) beside them")),
    // sglang-router 0.3.2 (`python -m sglang_router.launch_router`) only:
    f(
        "mini-lb",
        Ignored("pdgate is the load balancer; there is no separate mini load balancer"),
    ),
    f("epd-disaggregation", EPD),
    f("encode", EPD),
    f("prefill", Mapped),
    f("decode", Mapped),
    f("prefill-max-inflight-requests-per-worker", PREFILL_LIMIT),
    f("prefill-queue-size", PREFILL_LIMIT),
    f("prefill-queue-timeout-secs", PREFILL_LIMIT),
    f("worker-startup-timeout-secs", STARTUP),
    f("worker-startup-delay", STARTUP),
    f("worker-startup-check-interval", STARTUP),
    f("service-discovery", Mapped),
    f("discovery-provider", Only { value: "kubernetes", why: "pdgate discovers Kubernetes pods (--service-discovery) or takes static workers from its config file (reloaded on SIGHUP)" }),
    f("selector", Mapped),
    f("service-discovery-port", Mapped),
    f("service-discovery-namespace", Mapped),
    f("kv-connector-annotation", Ignored("pdgate learns a prefill's bootstrap port from its /server_info, or from --bootstrap-port-annotation")),
    f("kv-engine-id-annotation", Ignored("pdgate learns a prefill's bootstrap port from its /server_info, or from --bootstrap-port-annotation")),
    f("encode-selector", EPD),
    f("prefill-selector", Mapped),
    f("decode-selector", Mapped),
    f("router-selector", MESH),
    f("model-id-from", Refused("pdgate serves the model names its engines report (/v1/models)")),
    f("model-alias", Refused("aliases are set in the config: [models.aliases] \"alias\" = \"served name\"")),
    f("discovery-file", Refused("pdgate takes static workers from its config file (--config, reloaded on SIGHUP or with reload.watch_ms) or discovers Kubernetes pods (--service-discovery)")),
    f("discovery-check-interval-secs", Refused("pdgate takes static workers from its config file (--config, reloaded on SIGHUP or with reload.watch_ms) or discovers Kubernetes pods (--service-discovery)")),
    f("log-dir", Refused("pdgate logs to stdout only: collect it with the container runtime, or redirect it")),
    f("log-level", Mapped),
    f("log-json", Mapped),
    f("prometheus-port", Mapped),
    f("prometheus-host", Mapped),
    f("prometheus-duration-buckets", Ignored("pdgate's histogram buckets are fixed per series (docs/operations.md, Metrics)")),
    f("jemalloc-prof-dir", Ignored("pdgate uses mimalloc and writes no heap profiles")),
    f("request-id-headers", Only { value: "x-request-id", why: "pdgate takes a request's id from x-request-id (else makes one) and returns it in x-request-id" }),
    f("storage-context-headers", STORAGE),
    f("request-timeout-secs", Mapped),
    f("shutdown-grace-period-secs", Mapped),
    f("header-read-timeout-secs", Mapped),
    f("idle-connection-timeout-secs", Mapped),
    f("trust-tenant-header", TENANT),
    f("tenant-header-name", TENANT),
    f("cors-allowed-origins", Refused("pdgate sends no CORS headers: add them at the ingress or proxy in front of it")),
    f("max-concurrent-requests", Mapped),
    f("queue-size", Mapped),
    f("queue-timeout-secs", Mapped),
    f("rate-limit-tokens-per-second", Refused("pdgate bounds concurrency, not rate: --max-concurrent-requests, and auth.per_key_max_in_flight per client key")),
    f("max-background-responses", STORAGE),
    f("retry-max-retries", Mapped),
    f("retry-initial-backoff-ms", BACKOFF),
    f("retry-max-backoff-ms", BACKOFF),
    f("retry-backoff-multiplier", BACKOFF),
    f("retry-jitter-factor", BACKOFF),
    f("disable-retries", Mapped),
    f("cb-failure-threshold", Mapped),
    f("cb-success-threshold", Ignored("one successful trial closes a pdgate circuit (half-open allows one request)")),
    f("cb-timeout-duration-secs", Mapped),
    f("cb-window-duration-secs", Ignored("pdgate's breaker counts failures in a row, not in a window")),
    f("disable-circuit-breaker", Mapped),
    f("health-failure-threshold", Mapped),
    f("health-success-threshold", Mapped),
    f("health-check-timeout-secs", Mapped),
    f("health-check-interval-secs", Mapped),
    f("health-check-endpoint", Only { value: "/health", why: "pdgate checks an engine's /health and its bootstrap server; --health-check-interval-secs and --health-check-timeout-secs tune it" }),
    f("disable-health-check", Refused("pdgate's health checks also read each engine's DP layout and bootstrap state; check less often with --health-check-interval-secs")),
    f("remove-unhealthy-workers", RECOVERY),
    f("no-remove-unhealthy-workers", RECOVERY),
    f("worker-auto-recovery", RECOVERY),
    f("no-worker-auto-recovery", RECOVERY),
    f("model-path", STUDIO),
    f("model", STUDIO),
    f("tokenizer-path", STUDIO),
    f("chat-template", STUDIO),
    f("disable-tokenizer-autoload", STUDIO),
    f("parser", STUDIO),
    f("tokenizer-cache-enable-l0", STUDIO),
    f("tokenizer-cache-l0-max-entries", STUDIO),
    f("tokenizer-cache-enable-l1", STUDIO),
    f("tokenizer-cache-l0-max-memory", STUDIO),
    f("tokenizer-cache-l1-max-memory", STUDIO),
    f("reasoning-parser", STUDIO),
    f("tool-call-parser", STUDIO),
    f("mcp-config-path", Refused("pdgate runs no MCP tools; the engines answer tool calls")),
    f("backend", Only { value: "sglang", why: "pdgate routes SGLang prefill/decode engines over HTTP" }),
    f("zmq-engine-count", Refused("pdgate talks HTTP to the engines (--prefill, --decode), not ZMQ")),
    f("enable-wasm", Refused("pdgate runs no WebAssembly plugins")),
    f("storage-hook-wasm-path", Refused("pdgate runs no WebAssembly plugins")),
    f("history-backend", Only { value: "none", why: "pdgate stores no conversations or responses" }),
    f("history-memory-max-responses", STORAGE),
    f("history-memory-max-items", STORAGE),
    f("history-memory-retention-secs", STORAGE),
    f("schema-config", STORAGE),
    f("oracle-wallet-path", STORAGE),
    f("oracle-tns-alias", STORAGE),
    f("oracle-connect-descriptor", STORAGE),
    f("oracle-username", STORAGE),
    f("oracle-password", STORAGE),
    f("oracle-external-auth", STORAGE),
    f("oracle-pool-min", STORAGE),
    f("oracle-pool-max", STORAGE),
    f("oracle-pool-timeout-secs", STORAGE),
    f("postgres-db-url", STORAGE),
    f("postgres-pool-max", STORAGE),
    f("postgres-op-timeout-secs", STORAGE),
    f("redis-url", STORAGE),
    f("redis-pool-max", STORAGE),
    f("redis-retention-days", STORAGE),
    f("redis-op-timeout-secs", STORAGE),
    f("client-cert-path", MTLS),
    f("client-key-path", MTLS),
    f("ca-cert-paths", MTLS),
    f("tls-cert-path", TLS),
    f("tls-key-path", TLS),
    f("enable-trace", Mapped),
    f("otlp-traces-endpoint", Mapped),
    f("api-key", Mapped),
    f("control-plane-api-keys", Refused("the admin listener takes one bearer token: --admin-api-key-file or PDGATE_ADMIN_API_KEY")),
    f("control-plane-audit-enabled", Refused("pdgate has no control-plane audit log; the admin listener takes one bearer token (--admin-api-key-file)")),
    f("jwt-issuer", JWT),
    f("jwt-audience", JWT),
    f("jwt-jwks-uri", JWT),
    f("jwt-role-mapping", JWT),
    f("enable-rl", RL),
    f("rl-control-timeout-secs", RL),
    f("rl-fanout-concurrency", RL),
    f("tenant-api-key", TENANT),
    f("priority-scheduler-enabled", PRIORITY),
    f("priority-scheduler-default-max-class", PRIORITY),
    f("priority-scheduler-config", PRIORITY),
    f("priority-scheduler-tenant-metric-top-n", PRIORITY),
    f("tenant-rate-limit-enabled", TENANT),
    f("tenant-rate-limit-config", TENANT),
    f("enable-mesh", MESH),
    f("mesh-server-name", MESH),
    f("mesh-host", MESH),
    f("mesh-advertise-host", MESH),
    f("mesh-port", MESH),
    f("mesh-peer-urls", MESH),
    f("mesh-tls-ca-cert", MESH),
    f("mesh-tls-cert", MESH),
    f("mesh-tls-key", MESH),
];

/// The fate of the SGLang router flag `name` (without `--`), if it is one.
pub fn fate(name: &str) -> Option<Fate> {
    FLAGS.iter().find(|f| f.name == name).map(|f| f.fate)
}

/// The SGLang router flags pdgate has no setting for (every fate but [`Fate::Mapped`]),
/// as hidden `serve` flags: which were given, and their values.
#[derive(Clone, Debug, Default)]
pub struct SglangCompat {
    pub given: Vec<(&'static str, Vec<String>)>,
}

impl SglangCompat {
    /// Refuses a [`Fate::Refused`] flag, or an [`Fate::Only`] flag with another value, with
    /// a message that names the flag and what replaces it.
    pub fn check(&self) -> Result<(), ConfigError> {
        for (name, values) in &self.given {
            let message = match fate(name) {
                Some(Refused(why)) => {
                    format!("--{name} (an SGLang router flag) is not supported: {why}")
                }
                Some(Only { value, why })
                    if values.is_empty()
                        || values.iter().any(|v| !v.eq_ignore_ascii_case(value)) =>
                {
                    format!(
                        "--{name} {} (an SGLang router flag): pdgate supports only `{value}`: {why}",
                        values.join(" ")
                    )
                }
                _ => continue,
            };
            return Err(ConfigError::Invalid(message));
        }
        Ok(())
    }

    /// What to log at start for the accepted flags that change nothing: `(warn, line)`,
    /// warn for [`Fate::Ignored`].
    pub fn notes(&self) -> Vec<(bool, String)> {
        self.given
            .iter()
            .filter_map(|(name, _)| match fate(name)? {
                Ignored(why) => Some((true, format!("--{name} is ignored: {why}"))),
                Always(why) => Some((false, format!("--{name}: {why}"))),
                Only { why, .. } => Some((false, format!("--{name}: {why}"))),
                _ => None,
            })
            .collect()
    }
}

fn hidden(name: &'static str) -> Arg {
    Arg::new(name)
        .long(name)
        .hide(true)
        .num_args(0..)
        .action(ArgAction::Append)
        .allow_negative_numbers(true)
        .value_parser(clap::value_parser!(String))
}

impl Args for SglangCompat {
    fn augment_args(cmd: Command) -> Command {
        FLAGS
            .iter()
            .filter(|f| f.fate != Mapped)
            .fold(cmd, |cmd, f| cmd.arg(hidden(f.name)))
    }
    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for SglangCompat {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut out = SglangCompat::default();
        out.update_from_arg_matches(m)?;
        Ok(out)
    }
    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        for f in FLAGS.iter().filter(|f| f.fate != Mapped) {
            if m.value_source(f.name) != Some(ValueSource::CommandLine) {
                continue;
            }
            let values = m
                .get_many::<String>(f.name)
                .map(|v| v.cloned().collect())
                .unwrap_or_default();
            self.given.push((f.name, values));
        }
        Ok(())
    }
}

/// The SGLang router flags that set a pdgate setting under SGLang's name (the ones whose
/// name pdgate shares are `ServeArgs`' own).
#[derive(Clone, Debug, Default, Args)]
pub struct SglangArgs {
    /// Regular (non-PD) engines, SGLang's plain mode (`[[worker]]`; with `--worker`).
    #[arg(long, num_args = 1.., value_name = "URL")]
    pub worker_urls: Vec<String>,
    /// Label selector of regular (non-PD) engine pods (discovery.regular_selector; as
    /// `--regular-selector`).
    #[arg(long, num_args = 1.., value_name = "SELECTOR")]
    pub selector: Vec<String>,
    /// Open a listener for `/metrics` and `/liveness` only, no token (Prometheus,
    /// Kubernetes probes), on this port ([metrics_listener]).
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// That listener's address (turns it on too).
    #[arg(long)]
    pub prometheus_host: Option<std::net::IpAddr>,
    /// One key that is at once a client key (auth.api_key), the admin token (admin.api_key)
    /// and the key sent to engines (upstream.api_key), as SGLang's router uses it.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Requests served at once (admission.max_in_flight; 0: no limit; -1: pdgate's
    /// default).
    #[arg(long, allow_negative_numbers = true)]
    pub max_concurrent_requests: Option<i64>,
    /// Requests that may wait for a slot (admission.max_queue).
    #[arg(long)]
    pub queue_size: Option<usize>,
    /// Longest wait for a slot, seconds (admission.queue_timeout_ms).
    #[arg(long)]
    pub queue_timeout_secs: Option<u64>,
    /// Extra attempts per request (retry.max_retries).
    #[arg(long)]
    pub retry_max_retries: Option<u32>,
    /// No retries and no stream moves (retry.max_retries = retry.max_stream_moves = 0).
    #[arg(long)]
    pub disable_retries: bool,
    /// Failures in a row that open a worker's circuit (breaker.failure_threshold).
    #[arg(long)]
    pub cb_failure_threshold: Option<u32>,
    /// First open time of a circuit, seconds (breaker.open_ms).
    #[arg(long)]
    pub cb_timeout_duration_secs: Option<u64>,
    /// No circuit breakers (breaker.failure_threshold = 0).
    #[arg(long)]
    pub disable_circuit_breaker: bool,
    /// JSON logs (log.format = json).
    #[arg(long)]
    pub log_json: bool,
    /// How long SIGTERM waits for requests in flight, seconds (server.drain_secs).
    #[arg(long)]
    pub shutdown_grace_period_secs: Option<u64>,
    /// Time for a client's request head, seconds (server.header_read_timeout_secs).
    #[arg(long)]
    pub header_read_timeout_secs: Option<u64>,
    /// Idle HTTP/2 connection timeout, seconds (server.idle_timeout_secs).
    #[arg(long)]
    pub idle_connection_timeout_secs: Option<u64>,
    /// Time for a client's request body, seconds; 0: the longest allowed
    /// (server.body_read_timeout_secs).
    #[arg(long)]
    pub stream_body_stall_timeout_secs: Option<u64>,
    /// Idle engine connections kept this long, seconds (upstream.pool_idle_timeout_secs).
    #[arg(long)]
    pub upstream_pool_idle_timeout_secs: Option<u64>,
    /// Poll each engine's load this often, seconds (policy.load_poll_interval_ms).
    #[arg(long)]
    pub load_monitor_interval: Option<f64>,
    /// No engine load polls (policy.load_poll_interval_ms = 0).
    #[arg(long)]
    pub disable_load_monitoring: bool,
    /// cache_aware's bounded-load factor (policy.cache_aware_balance_factor).
    #[arg(long)]
    pub prefix_hash_load_factor: Option<f64>,
    /// Export OpenTelemetry traces (trace.enabled).
    #[arg(long)]
    pub enable_trace: bool,
    /// The OTLP collector, `host:port` or a URL (trace.endpoint). pdgate sends OTLP over
    /// HTTP (JSON): the collector's port 4318, not gRPC's 4317.
    #[arg(long, value_name = "HOST:PORT")]
    pub otlp_traces_endpoint: Option<String>,
    /// Sticky sessions: a request with a routing key is placed by the key whatever the
    /// policy (affinity.sticky; `--sticky-sessions` is the same flag).
    #[arg(long, alias = "sticky-sessions")]
    pub routing_key_override: bool,
    /// SGLang's idle time of a sticky key, seconds (affinity.sticky_idle_secs): accepted,
    /// no effect, since pdgate keeps no key map (`--sticky-key-idle-secs` is the same flag).
    #[arg(long, alias = "sticky-key-idle-secs", value_name = "SECS")]
    pub max_idle_secs: Option<u64>,
    /// Request headers read for a routing key, first present wins (affinity.headers; no
    /// value: none).
    #[arg(long, num_args = 0.., value_name = "HEADER")]
    pub routing_key_headers: Option<Vec<String>>,
}

/// Seconds as milliseconds, saturating (the range check then names the key).
fn ms(secs: u64) -> u64 {
    secs.saturating_mul(1000)
}

impl SglangArgs {
    /// Applies the flags given. `--api-key` first, so that pdgate's own secret flags,
    /// applied after it, win.
    pub fn apply(&self, cfg: &mut Config) {
        if !self.selector.is_empty() {
            cfg.discovery.regular_selector = Some(self.selector.join(","));
        }
        if let Some(k) = &self.api_key {
            cfg.auth.api_key = Some(k.clone());
            cfg.admin.api_key = Some(k.clone());
            cfg.admin.api_key_file = None;
            cfg.upstream.api_key = Some(k.clone());
        }
        if self.prometheus_port.is_some() || self.prometheus_host.is_some() {
            cfg.metrics_listener.enabled = true;
        }
        if let Some(p) = self.prometheus_port {
            cfg.metrics_listener.port = p;
        }
        if let Some(h) = self.prometheus_host {
            cfg.metrics_listener.host = h;
        }
        match self.max_concurrent_requests {
            Some(n) if n >= 0 => {
                cfg.admission.max_in_flight = usize::try_from(n).unwrap_or(usize::MAX);
            }
            _ => {}
        }
        if let Some(v) = self.queue_size {
            cfg.admission.max_queue = v;
        }
        if let Some(v) = self.queue_timeout_secs {
            cfg.admission.queue_timeout_ms = ms(v);
        }
        if let Some(v) = self.retry_max_retries {
            cfg.retry.max_retries = v;
        }
        if self.disable_retries {
            cfg.retry.max_retries = 0;
            cfg.retry.max_stream_moves = 0;
        }
        if let Some(v) = self.cb_failure_threshold {
            cfg.breaker.failure_threshold = v;
        }
        if let Some(v) = self.cb_timeout_duration_secs {
            cfg.breaker.open_ms = ms(v);
            cfg.breaker.max_open_ms = cfg.breaker.max_open_ms.max(ms(v));
        }
        if self.disable_circuit_breaker {
            cfg.breaker.failure_threshold = 0;
        }
        if self.log_json {
            cfg.log.format = LogFormat::Json;
        }
        if let Some(v) = self.shutdown_grace_period_secs {
            cfg.server.drain_secs = v;
        }
        if let Some(v) = self.header_read_timeout_secs {
            cfg.server.header_read_timeout_secs = v;
        }
        if let Some(v) = self.idle_connection_timeout_secs {
            cfg.server.idle_timeout_secs = v;
        }
        match self.stream_body_stall_timeout_secs {
            Some(0) => cfg.server.body_read_timeout_secs = 86_400,
            Some(v) => cfg.server.body_read_timeout_secs = v,
            None => {}
        }
        if let Some(v) = self.upstream_pool_idle_timeout_secs {
            cfg.upstream.pool_idle_timeout_secs = v;
        }
        if let Some(v) = self.load_monitor_interval {
            // A non-finite or negative value becomes 0 ms: polls off (the range check
            // passes 0; SGLang refuses such values, pdgate turns the poll off).
            cfg.policy.load_poll_interval_ms = (v * 1000.0).round().max(0.0) as u64;
        }
        if self.disable_load_monitoring {
            cfg.policy.load_poll_interval_ms = 0;
        }
        if self.enable_trace {
            cfg.trace.enabled = true;
        }
        if let Some(e) = &self.otlp_traces_endpoint {
            cfg.trace.endpoint = if e.contains("://") {
                e.clone()
            } else {
                format!("http://{e}")
            };
        }
        if let Some(v) = self.prefix_hash_load_factor {
            cfg.policy.cache_aware_balance_factor = v;
        }
        if self.routing_key_override {
            cfg.affinity.sticky = true;
        }
        if let Some(v) = self.max_idle_secs {
            cfg.affinity.sticky_idle_secs = v;
        }
        if let Some(h) = &self.routing_key_headers {
            // SGLang lower-cases the names it is given; so does pdgate (the check then
            // refuses what is not a header name).
            cfg.affinity.headers = h.iter().map(|n| n.to_ascii_lowercase()).collect();
        }
    }
}

/// A policy name: pdgate's (`random`, `round_robin`, `power_of_two`, `cache_aware`), or
/// SGLang's `prefix_hash` (prefix affinity on a hash ring with bounded loads, which is what
/// pdgate's `cache_aware` is). SGLang's other policies are refused with what replaces them.
pub fn parse_policy(s: &str) -> Result<crate::config::PolicyKind, String> {
    use crate::config::PolicyKind;
    use clap::ValueEnum;
    if let Ok(p) = PolicyKind::from_str(s, true) {
        return Ok(p);
    }
    let why = match s {
        "prefix_hash" => return Ok(PolicyKind::CacheAware),
        "manual" | "consistent_hashing" => {
            "cache_aware places a request by its routing key header (X-SMG-Routing-Key, \
             [affinity]) and else by its prompt prefix; --sticky-sessions applies the key \
             under any policy"
        }
        "least_load" => "power_of_two weighs requests in flight and the engine's reported load",
        "passthrough" | "bucket" => "use round_robin, power_of_two or cache_aware",
        _ => "",
    };
    Err(format!(
        "{s:?} is not a pdgate policy (random, round_robin, power_of_two, cache_aware; \
         prefix_hash means cache_aware){}{why}",
        if why.is_empty() { "" } else { ": " }
    ))
}
