//! The `serve` command line: the flags of `pdgate serve` ([`ServeArgs`]) and how they make a
//! [`Config`] ([`prefill_groups`], [`ServeArgs::into_config`]). The top-level
//! `pdgate serve | sim | demo` parser lives in the binary (`src/command.rs`), which adds the
//! simulator's subcommands; the library keeps only what builds a router's configuration.
//!
//! `serve` accepts the PD flags operators already pass to SGLang's router, so pdgate can be
//! swapped in. Every flag is an `Option` that overrides the TOML file (`--config`); the
//! defaults themselves live only in [`crate::config`].

pub mod sglang;

use std::path::PathBuf;

use clap::{ArgMatches, Args};

use crate::config::{
    Config, ConfigError, ContractMode, DecodeWorkerConfig, LogFormat, PolicyKind,
    PrefillWorkerConfig,
};

#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    /// TOML file with every setting; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A prefill engine: `--prefill URL [BOOTSTRAP_PORT]` (repeatable).
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = clap::ArgAction::Append)]
    pub prefill: Vec<String>,
    /// A decode engine URL (repeatable).
    #[arg(long, action = clap::ArgAction::Append)]
    pub decode: Vec<String>,
    /// A regular (non-PD) engine URL, SGLang's plain mode (repeatable; `[[worker]]`).
    #[arg(long, action = clap::ArgAction::Append)]
    pub worker: Vec<String>,
    /// Listen address.
    #[arg(long)]
    pub host: Option<std::net::IpAddr>,
    /// Listen port (0 picks a free one).
    #[arg(long)]
    pub port: Option<u16>,
    /// Policy for both pools (overridden per pool by the two flags below): random,
    /// round_robin, power_of_two, cache_aware (SGLang's prefix_hash is cache_aware).
    #[arg(long, value_parser = sglang::parse_policy, value_name = "POLICY")]
    pub policy: Option<PolicyKind>,
    /// Policy for the prefill pool.
    #[arg(long, value_parser = sglang::parse_policy, value_name = "POLICY")]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy for the decode pool.
    #[arg(long, value_parser = sglang::parse_policy, value_name = "POLICY")]
    pub decode_policy: Option<PolicyKind>,
    /// `modulo` (no DP field on the prefill leg) or `pinned` (routed_dp_rank and
    /// disagg_prefill_dp_rank on both legs).
    #[arg(long, value_enum)]
    pub contract_mode: Option<ContractMode>,
    /// Cap on a request before its first byte, and on a non-streamed request.
    #[arg(long)]
    pub request_timeout_secs: Option<u64>,
    /// Seconds between engine health checks.
    #[arg(long)]
    pub health_check_interval_secs: Option<f64>,
    /// Timeout of one engine health check (seconds).
    #[arg(long)]
    pub health_check_timeout_secs: Option<f64>,
    /// Failed checks in a row that take a worker out.
    #[arg(long)]
    pub health_failure_threshold: Option<u32>,
    /// Good checks in a row that bring it back.
    #[arg(long)]
    pub health_success_threshold: Option<u32>,
    /// pdgate replicas serving the same engines (0 = unknown): each then holds at most its
    /// share of every decode rank's capacity (`[admission] replicas`).
    #[arg(long)]
    pub replicas: Option<u32>,
    /// This replica's index among `--replicas` (0-based; a StatefulSet pod's ordinal):
    /// which replicas take each rank's remainder slots (`[admission] replica_index`).
    #[arg(long)]
    pub replica_index: Option<u32>,
    /// The label selector of pdgate's own pods (its Service's, e.g.
    /// `app.kubernetes.io/name=pdgate`): the replica count and this replica's index come
    /// from Kubernetes, Ready pods counted, this pod named by `POD_NAME` (else the hostname)
    /// (`[admission] replica_selector`; empty = off; not with `--replicas`).
    #[arg(long)]
    pub replica_selector: Option<String>,
    /// Runtime worker threads (1 = one current-thread runtime; 0 = one per core).
    #[arg(long)]
    pub worker_threads: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long)]
    pub max_payload_size: Option<usize>,
    /// Log format: text or json.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log level (trace, debug, info, warn or warning, error or critical, off) or
    /// `target=level` directives (`pdgate=debug,info`); anything else is refused. RUST_LOG
    /// wins.
    #[arg(long)]
    pub log_level: Option<String>,
    /// Discover engines as Kubernetes pods (see `[discovery]`).
    #[arg(long)]
    pub service_discovery: bool,
    /// Label selector of prefill pods, full syntax (`app=sglang,component in (prefill)`);
    /// several values are joined with `,` (SGLang router's `--prefill-selector k=v k2=v2`).
    #[arg(long, num_args = 1.., value_name = "SELECTOR")]
    pub prefill_selector: Vec<String>,
    /// Label selector of decode pods (as `--prefill-selector`).
    #[arg(long, num_args = 1.., value_name = "SELECTOR")]
    pub decode_selector: Vec<String>,
    /// Label selector of regular (non-PD) engine pods (as `--prefill-selector`).
    #[arg(long, num_args = 1.., value_name = "SELECTOR")]
    pub regular_selector: Vec<String>,
    /// Namespace to watch (default: the pod's own); `*` watches all namespaces.
    #[arg(long)]
    pub service_discovery_namespace: Option<String>,
    /// With `--service-discovery-namespace '*'`: the namespaces whose pods may become
    /// workers (comma-separated; `*` for any). Required there.
    #[arg(long, value_delimiter = ',', value_name = "NAMESPACES")]
    pub service_discovery_allowed_namespaces: Vec<String>,
    /// The engines' HTTP port when no container port has `--service-discovery-port-name`.
    #[arg(long)]
    pub service_discovery_port: Option<u16>,
    /// A named container port to take the engine's port from.
    #[arg(long)]
    pub service_discovery_port_name: Option<String>,
    /// Annotation with a prefill pod's bootstrap port.
    #[arg(long)]
    pub bootstrap_port_annotation: Option<String>,
    /// Admin listener address.
    #[arg(long)]
    pub admin_host: Option<std::net::IpAddr>,
    /// Admin listener port (0 picks a free one).
    #[arg(long)]
    pub admin_port: Option<u16>,
    /// File holding the admin bearer token (else `PDGATE_ADMIN_API_KEY`).
    #[arg(long)]
    pub admin_api_key_file: Option<PathBuf>,
    /// Client API keys, one per line (raw or `sha256:<hex>`).
    #[arg(long)]
    pub api_keys_file: Option<PathBuf>,
    /// One JSON access-log line per request.
    #[arg(long)]
    pub access_log: bool,
    /// Also serve `/metrics` on the front door.
    #[arg(long)]
    pub public_metrics: bool,
    /// SGLang router flags that set a pdgate setting under SGLang's name.
    #[command(flatten, next_help_heading = "SGLang router flags")]
    pub sglang: sglang::SglangArgs,
    /// SGLang router flags pdgate has no setting for (hidden; docs/coming-from-sglang.md).
    #[command(flatten)]
    pub sglang_compat: sglang::SglangCompat,
}

/// Parses `--prefill URL [PORT]` groups from the matches of `serve`.
pub fn prefill_groups(m: &ArgMatches) -> Result<Vec<PrefillWorkerConfig>, ConfigError> {
    let Ok(Some(occ)) = m.try_get_occurrences::<String>("prefill") else {
        return Ok(Vec::new());
    };
    occ.map(|mut vals| {
        let url = vals.next().cloned().unwrap_or_default();
        let bootstrap_port = match vals.next() {
            None => None,
            Some(p) if p.eq_ignore_ascii_case("none") => None,
            Some(p) => Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "--prefill {url} {p}: BOOTSTRAP_PORT must be 1..=65535"
                ))
            })?),
        };
        Ok(PrefillWorkerConfig {
            url,
            bootstrap_port,
            bootstrap_host: None,
            model: None,
        })
    })
    .collect()
}

impl ServeArgs {
    /// The file (if any), then the flags; the result is validated.
    pub fn into_config(self, prefills: Vec<PrefillWorkerConfig>) -> Result<Config, ConfigError> {
        self.sglang_compat.check()?;
        let mut cfg = match &self.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        if !prefills.is_empty() {
            cfg.prefill = prefills;
        }
        self.discovery_flags(&mut cfg);
        self.sglang.apply(&mut cfg);
        if !self.decode.is_empty() {
            cfg.decode = self
                .decode
                .into_iter()
                .map(|url| DecodeWorkerConfig { url, model: None })
                .collect();
        }
        // `--worker` and SGLang's `--worker-urls` together replace `[[worker]]`.
        let workers: Vec<String> = self
            .worker
            .iter()
            .chain(self.sglang.worker_urls.iter())
            .cloned()
            .collect();
        if !workers.is_empty() {
            cfg.worker = workers
                .into_iter()
                .map(|url| crate::config::RegularWorkerConfig { url, model: None })
                .collect();
        }
        if let Some(h) = self.host {
            cfg.server.host = h;
        }
        if let Some(p) = self.port {
            cfg.server.port = p;
        }
        if let Some(p) = self.policy {
            cfg.policy.prefill = p;
            cfg.policy.decode = p;
        }
        if let Some(p) = self.prefill_policy {
            cfg.policy.prefill = p;
        }
        if let Some(p) = self.decode_policy {
            cfg.policy.decode = p;
        }
        if let Some(m) = self.contract_mode {
            cfg.contract.mode = m;
        }
        if let Some(t) = self.request_timeout_secs {
            cfg.timeouts.request_secs = t;
        }
        if let Some(v) = self.health_check_interval_secs {
            cfg.health.interval_secs = v;
        }
        if let Some(v) = self.health_check_timeout_secs {
            cfg.health.timeout_secs = v;
        }
        if let Some(v) = self.health_failure_threshold {
            cfg.health.failure_threshold = v;
        }
        if let Some(v) = self.health_success_threshold {
            cfg.health.success_threshold = v;
        }
        if let Some(v) = self.worker_threads {
            cfg.server.worker_threads = v;
        }
        if let Some(v) = self.replicas {
            cfg.admission.replicas = v;
        }
        if let Some(v) = self.replica_index {
            cfg.admission.replica_index = Some(v);
        }
        if let Some(v) = &self.replica_selector {
            cfg.admission.replica_selector = Some(v.clone());
        }
        if let Some(v) = self.max_payload_size {
            cfg.server.max_body_bytes = v;
        }
        if let Some(v) = self.log_format {
            cfg.log.format = v;
        }
        if let Some(v) = self.log_level {
            cfg.log.level = v;
        }
        if let Some(v) = self.admin_host {
            cfg.admin.host = v;
        }
        if let Some(v) = self.admin_port {
            cfg.admin.port = v;
        }
        if let Some(v) = self.admin_api_key_file {
            // The flag overrides the file's token, whichever way the file gives it.
            cfg.admin.api_key = None;
            cfg.admin.api_key_file = Some(v);
        }
        if let Some(v) = self.api_keys_file {
            cfg.auth.api_keys_file = Some(v);
        }
        cfg.log.access |= self.access_log;
        cfg.server.public_metrics |= self.public_metrics;
        cfg.validate()?;
        Ok(cfg)
    }
}

impl ServeArgs {
    fn discovery_flags(&self, cfg: &mut Config) {
        let d = &mut cfg.discovery;
        d.enabled |= self.service_discovery;
        if !self.prefill_selector.is_empty() {
            d.prefill_selector = Some(self.prefill_selector.join(","));
        }
        if !self.decode_selector.is_empty() {
            d.decode_selector = Some(self.decode_selector.join(","));
        }
        if !self.regular_selector.is_empty() {
            d.regular_selector = Some(self.regular_selector.join(","));
        }
        if !self.service_discovery_allowed_namespaces.is_empty() {
            d.allowed_namespaces = self
                .service_discovery_allowed_namespaces
                .iter()
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect();
        }
        match self.service_discovery_namespace.as_deref() {
            Some("*") => {
                d.all_namespaces = true;
                d.namespace = None;
            }
            Some(ns) => {
                d.all_namespaces = false;
                d.namespace = Some(ns.to_string());
            }
            None => {}
        }
        if let Some(v) = self.service_discovery_port {
            d.port = v;
        }
        if let Some(v) = &self.service_discovery_port_name {
            d.port_name = Some(v.clone());
        }
        if let Some(v) = &self.bootstrap_port_annotation {
            d.bootstrap_port_annotation = v.clone();
        }
    }
}

/// `serve`'s help (and `demo`'s) with each flag's default, read from [`Config::default`] (the
/// defaults live only there; clap is given none, so a flag left out never overrides the
/// config file).
pub fn with_defaults(cmd: clap::Command) -> clap::Command {
    use clap::ValueEnum;
    let c = Config::default();
    let name = |v: Option<clap::builder::PossibleValue>| {
        v.map(|p| p.get_name().to_string()).unwrap_or_default()
    };
    let secs = |ms: u64| format!("{}", ms as f64 / 1000.0);
    let defaults: Vec<(&str, String)> = vec![
        ("host", c.server.host.to_string()),
        ("port", c.server.port.to_string()),
        ("policy", name(c.policy.prefill.to_possible_value())),
        ("prefill_policy", name(c.policy.prefill.to_possible_value())),
        ("decode_policy", name(c.policy.decode.to_possible_value())),
        ("contract_mode", name(c.contract.mode.to_possible_value())),
        ("request_timeout_secs", c.timeouts.request_secs.to_string()),
        (
            "health_check_interval_secs",
            c.health.interval_secs.to_string(),
        ),
        (
            "health_check_timeout_secs",
            c.health.timeout_secs.to_string(),
        ),
        (
            "health_failure_threshold",
            c.health.failure_threshold.to_string(),
        ),
        (
            "health_success_threshold",
            c.health.success_threshold.to_string(),
        ),
        ("worker_threads", c.server.worker_threads.to_string()),
        ("max_payload_size", c.server.max_body_bytes.to_string()),
        ("log_format", name(c.log.format.to_possible_value())),
        ("log_level", c.log.level.clone()),
        ("service_discovery_port", c.discovery.port.to_string()),
        (
            "bootstrap_port_annotation",
            c.discovery.bootstrap_port_annotation.clone(),
        ),
        ("admin_host", c.admin.host.to_string()),
        ("admin_port", c.admin.port.to_string()),
        ("prometheus_port", c.metrics_listener.port.to_string()),
        ("prometheus_host", c.metrics_listener.host.to_string()),
        (
            "max_concurrent_requests",
            c.admission.max_in_flight.to_string(),
        ),
        ("queue_size", c.admission.max_queue.to_string()),
        ("replicas", c.admission.replicas.to_string()),
        ("queue_timeout_secs", secs(c.admission.queue_timeout_ms)),
        ("retry_max_retries", c.retry.max_retries.to_string()),
        (
            "cb_failure_threshold",
            c.breaker.failure_threshold.to_string(),
        ),
        ("cb_timeout_duration_secs", secs(c.breaker.open_ms)),
        (
            "shutdown_grace_period_secs",
            c.server.drain_secs.to_string(),
        ),
        (
            "header_read_timeout_secs",
            c.server.header_read_timeout_secs.to_string(),
        ),
        (
            "idle_connection_timeout_secs",
            c.server.idle_timeout_secs.to_string(),
        ),
        (
            "stream_body_stall_timeout_secs",
            c.server.body_read_timeout_secs.to_string(),
        ),
        (
            "upstream_pool_idle_timeout_secs",
            c.upstream.pool_idle_timeout_secs.to_string(),
        ),
        (
            "load_monitor_interval",
            match c.policy.load_poll_interval_ms {
                0 => "off".to_string(),
                ms => secs(ms),
            },
        ),
        (
            "prefix_hash_load_factor",
            c.policy.cache_aware_balance_factor.to_string(),
        ),
        ("max_idle_secs", c.affinity.sticky_idle_secs.to_string()),
        ("routing_key_headers", c.affinity.headers.join(" ")),
    ];
    // A command with only some of these flags (`demo`: host and port) shows those.
    defaults.into_iter().fold(cmd, |cmd, (id, v)| {
        if !cmd.get_arguments().any(|a| a.get_id() == id) {
            return cmd;
        }
        cmd.mut_arg(id, |a| {
            let help = a.get_help().map(ToString::to_string).unwrap_or_default();
            a.help(format!("{help} [default: {v}]"))
        })
    })
}

/// `serve` flags that `check` accepts (so that a `serve` command line can be checked by
/// changing its first word) but does not use: hidden from `check --help`.
pub const SERVE_ONLY: &[&str] = &[
    "host",
    "port",
    "health_check_interval_secs",
    "health_check_timeout_secs",
    "health_failure_threshold",
    "health_success_threshold",
    "worker_threads",
    "max_payload_size",
    "log_format",
    "log_level",
    "admin_host",
    "admin_port",
    "admin_api_key_file",
    "api_keys_file",
    "access_log",
    "public_metrics",
    "prometheus_port",
    "prometheus_host",
    "max_concurrent_requests",
    "queue_size",
    "queue_timeout_secs",
    "replicas",
    "replica_index",
    "replica_selector",
    "retry_max_retries",
    "disable_retries",
    "cb_failure_threshold",
    "cb_timeout_duration_secs",
    "disable_circuit_breaker",
    "log_json",
    "shutdown_grace_period_secs",
    "header_read_timeout_secs",
    "idle_connection_timeout_secs",
    "stream_body_stall_timeout_secs",
    "upstream_pool_idle_timeout_secs",
    "load_monitor_interval",
    "disable_load_monitoring",
    "prefix_hash_load_factor",
    "routing_key_override",
    "max_idle_secs",
    "routing_key_headers",
];

/// `check`'s help: `serve`'s flags that `check` does not use are hidden.
pub fn for_check(cmd: clap::Command) -> clap::Command {
    SERVE_ONLY
        .iter()
        .fold(cmd, |cmd, id| cmd.mut_arg(*id, |a| a.hide(true)))
}
