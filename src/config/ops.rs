//! The operational sections of the config: Kubernetes discovery, the admin listener, client
//! API keys and config reload. Kept apart from the routing settings in the parent module so
//! each file stays readable; the same rules hold (defaults only here, unknown keys refused,
//! every value checked by [`super::Config::validate`]).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, range, ConfigError};

/// `[discovery]`: find prefill and decode engines as Kubernetes pods.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Watch pods (`--service-discovery`).
    pub enabled: bool,
    /// Label selector of prefill pods, full Kubernetes syntax (`app=sglang,role in (prefill)`).
    pub prefill_selector: Option<String>,
    /// Label selector of decode pods.
    pub decode_selector: Option<String>,
    /// Label selector of regular (non-PD) engine pods (SGLang's plain mode). Unset: none
    /// are discovered.
    pub regular_selector: Option<String>,
    /// Namespace to watch. Unset: the pod's own (the service-account namespace file), else
    /// `default`.
    pub namespace: Option<String>,
    /// Watch every namespace (needs the ClusterRole variant of the RBAC, and
    /// `allowed_namespaces`).
    pub all_namespaces: bool,
    /// With `all_namespaces`: the namespaces whose pods may become workers (`["*"]` for
    /// any). Whoever can create a pod with matching labels in a watched namespace can put
    /// an engine in the fleet (a decode receives every prompt), so cluster-wide discovery
    /// names the namespaces it trusts.
    pub allowed_namespaces: Vec<String>,
    /// The engine's HTTP port when no container port is named `port_name`.
    pub port: u16,
    /// A container port name to take the engine's port from (e.g. `http`), when the pod has
    /// one by that name.
    pub port_name: Option<String>,
    /// Annotation holding a prefill pod's bootstrap port; without it, the engine's
    /// `/server_info` tells (as for static workers).
    pub bootstrap_port_annotation: String,
    /// Annotation (or label) naming the model a pod serves, for clients; without it, the
    /// engine's `/server_info` tells (as for static workers).
    pub model_annotation: String,
    /// Reconcile the workers with the watched pods at least this often (from the watch's
    /// store: no LIST; pods are listed only when the watch starts over).
    pub resync_secs: u64,
    /// Longest a terminating pod's worker is drained when the pod has no grace period.
    pub default_grace_secs: u64,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            enabled: false,
            prefill_selector: None,
            decode_selector: None,
            regular_selector: None,
            namespace: None,
            all_namespaces: false,
            allowed_namespaces: Vec::new(),
            port: 80,
            port_name: None,
            bootstrap_port_annotation: "sglang.ai/bootstrap-port".to_string(),
            model_annotation: "sglang.ai/model".to_string(),
            resync_secs: 60,
            default_grace_secs: 30,
        }
    }
}

impl DiscoveryConfig {
    pub fn resync(&self) -> Duration {
        Duration::from_secs(self.resync_secs)
    }
    pub fn default_grace(&self) -> Duration {
        Duration::from_secs(self.default_grace_secs)
    }
}

/// `[admin]`: the admin listener (worker API, `/metrics`, effective config), apart from the
/// front door.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Serve the admin listener at all.
    pub enabled: bool,
    pub host: IpAddr,
    /// 0 picks a free port.
    pub port: u16,
    /// Bearer token the admin API requires on every path but `/metrics` (which Prometheus
    /// scrapes without one). Or from `api_key_file` (not both), else the
    /// `PDGATE_ADMIN_API_KEY` environment variable. Required on a non-loopback address;
    /// without one (loopback only) the admin API is open to local processes.
    pub api_key: Option<String>,
    /// A file whose first line is the admin token.
    pub api_key_file: Option<PathBuf>,
    /// How long `DELETE /workers/{id}` (and a worker removed by reload or discovery) waits
    /// for its requests in flight before the worker is dropped anyway.
    pub remove_drain_secs: u64,
    /// Names (besides IP literals and `localhost`) the admin listener accepts as `Host`,
    /// e.g. a Service's DNS name; any other Host is refused (DNS rebinding).
    pub allowed_hosts: Vec<String>,
    /// How long SGLang's `POST /add_worker` waits for the new worker to take traffic (its
    /// `/server_info` read and first health check passed), as SGLang's router does; past
    /// it the answer says the worker is registered but not yet checked (202). 0: answer
    /// at once.
    pub add_worker_wait_secs: u64,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            enabled: true,
            host: IpAddr::from([127, 0, 0, 1]),
            port: 29000,
            api_key: None,
            api_key_file: None,
            remove_drain_secs: 300,
            allowed_hosts: Vec::new(),
            add_worker_wait_secs: 30,
        }
    }
}

impl AdminConfig {
    pub fn remove_drain(&self) -> Duration {
        Duration::from_secs(self.remove_drain_secs)
    }

    pub fn add_worker_wait(&self) -> Duration {
        Duration::from_secs(self.add_worker_wait_secs)
    }
}

/// `[auth]`: client API keys on the front door.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// One key per line: `KEY`, `sha256:<64 hex>`, or either after a name (`team-a: KEY`,
    /// the key id in logs and metrics; else `line-N`, its line in the file);
    /// `#` starts a comment. Clients send `Authorization: Bearer KEY` (or `x-api-key`).
    /// Unset: no client auth.
    pub api_keys_file: Option<PathBuf>,
    /// Requests in flight per key id (0 = no limit); beyond it, 429.
    pub per_key_max_in_flight: usize,
    /// One more client key, given inline (key id `api-key`), beside the file's if any.
    /// SGLang router's `--api-key` sets it (with the admin token and the engines' key).
    pub api_key: Option<String>,
}

/// `[metrics_listener]`: a listener that serves only `/metrics` and `/liveness`, with no
/// token (Prometheus and Kubernetes probes), apart from the front door and the admin
/// listener. SGLang router's `--prometheus-host` / `--prometheus-port` turn it on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsListenerConfig {
    /// Serve it at all.
    pub enabled: bool,
    pub host: IpAddr,
    /// 0 picks a free port.
    pub port: u16,
}

impl Default for MetricsListenerConfig {
    fn default() -> Self {
        MetricsListenerConfig {
            enabled: false,
            host: IpAddr::from([0, 0, 0, 0]),
            port: 29000,
        }
    }
}

/// `[reload]`: applying a changed config without a restart (SIGHUP always does).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReloadConfig {
    /// Also reload when the config file's contents change, checked this often (0 = only on
    /// SIGHUP).
    pub watch_ms: u64,
    /// Reload when a secret file (`auth.api_keys_file`, `admin.api_key_file`) changes,
    /// checked this often (0 = only on SIGHUP or a config change). A rotated or revoked
    /// key takes effect within this interval of the file changing on disk (with a
    /// Kubernetes Secret volume, add the kubelet's sync delay, about a minute).
    pub secrets_watch_ms: u64,
}

impl Default for ReloadConfig {
    fn default() -> Self {
        ReloadConfig {
            watch_ms: 0,
            secrets_watch_ms: 2_000,
        }
    }
}

impl ReloadConfig {
    pub fn watch(&self) -> Option<Duration> {
        (self.watch_ms > 0).then(|| Duration::from_millis(self.watch_ms))
    }
    pub fn secrets_watch(&self) -> Option<Duration> {
        (self.secrets_watch_ms > 0).then(|| Duration::from_millis(self.secrets_watch_ms))
    }
}

/// The checks of the sections above (called by `Config::validate`).
pub(super) fn validate(cfg: &super::Config) -> Result<(), ConfigError> {
    let d = &cfg.discovery;
    if d.enabled {
        if d.prefill_selector.is_none()
            && d.decode_selector.is_none()
            && d.regular_selector.is_none()
        {
            return Err(invalid(
                "discovery.enabled needs discovery.prefill_selector, discovery.decode_selector \
                 or discovery.regular_selector (--prefill-selector / --decode-selector / --regular-selector)"
                    .to_string(),
            ));
        }
        if d.all_namespaces && d.namespace.is_some() {
            return Err(invalid(
                "discovery.namespace and discovery.all_namespaces exclude each other".to_string(),
            ));
        }
        if d.all_namespaces && d.allowed_namespaces.is_empty() {
            return Err(invalid(
                "discovery.all_namespaces needs discovery.allowed_namespaces \
                 (--service-discovery-allowed-namespaces): the namespaces whose pods may \
                 become workers, or [\"*\"] for any; a pod with matching labels in any \
                 namespace would otherwise receive prompts"
                    .to_string(),
            ));
        }
    }
    range("discovery.port", d.port, 1, u16::MAX)?;
    range("discovery.resync_secs", d.resync_secs, 1, super::DAY)?;
    range(
        "discovery.default_grace_secs",
        d.default_grace_secs,
        0,
        super::DAY,
    )?;
    if d.bootstrap_port_annotation.trim().is_empty() {
        return Err(invalid(
            "discovery.bootstrap_port_annotation must not be empty".to_string(),
        ));
    }
    if d.model_annotation.trim().is_empty() {
        return Err(invalid(
            "discovery.model_annotation must not be empty".to_string(),
        ));
    }
    let a = &cfg.admin;
    range(
        "admin.remove_drain_secs",
        a.remove_drain_secs,
        0,
        super::DAY,
    )?;
    range(
        "admin.add_worker_wait_secs",
        a.add_worker_wait_secs,
        0,
        3600,
    )?;
    if let Some(h) = a.allowed_hosts.iter().find(|h| {
        h.is_empty()
            || !h
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
    }) {
        return Err(invalid(format!(
            "admin.allowed_hosts: {h:?} is not a host name (letters, digits, '-' and '.')"
        )));
    }
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(invalid("admin.api_key must not be empty".to_string()));
    }
    range(
        "auth.per_key_max_in_flight",
        cfg.auth.per_key_max_in_flight,
        0,
        tokio::sync::Semaphore::MAX_PERMITS,
    )?;
    if cfg
        .auth
        .api_key
        .as_deref()
        .is_some_and(|k| k.is_empty() || !k.bytes().all(|c| c.is_ascii_graphic()))
    {
        return Err(invalid(
            "auth.api_key must be printable ASCII without spaces (it travels in an HTTP header)"
                .to_string(),
        ));
    }
    let m = &cfg.metrics_listener;
    // Two listeners on one address: the second bind would fail at start with an error that
    // names neither setting; refused here, naming both. Port 0 picks a free port each.
    let overlap = |(h1, p1): (IpAddr, u16), (h2, p2): (IpAddr, u16)| {
        p1 != 0 && p1 == p2 && (h1 == h2 || h1.is_unspecified() || h2.is_unspecified())
    };
    let front = (cfg.server.host, cfg.server.port);
    if a.enabled && overlap(front, (a.host, a.port)) {
        return Err(invalid(format!(
            "server.port = {} is also admin.port: the front door and the admin listener need \
             a port each; move one (--port N, or --admin-port N)",
            a.port
        )));
    }
    if m.enabled && overlap(front, (m.host, m.port)) {
        return Err(invalid(format!(
            "server.port = {} is also metrics_listener.port: the front door and the metrics \
             listener need a port each; move one (--port N, or --prometheus-port N)",
            m.port
        )));
    }
    if m.enabled && a.enabled && m.port != 0 && m.port == a.port {
        return Err(invalid(format!(
            "metrics_listener.port = {} is also admin.port: move one (--prometheus-port N, \
             or --admin-port N)",
            m.port
        )));
    }
    if cfg.reload.watch_ms != 0 {
        range("reload.watch_ms", cfg.reload.watch_ms, 50, 3_600_000)?;
    }
    if cfg.reload.secrets_watch_ms != 0 {
        range(
            "reload.secrets_watch_ms",
            cfg.reload.secrets_watch_ms,
            50,
            3_600_000,
        )?;
    }
    Ok(())
}
