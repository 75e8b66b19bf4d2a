//! `pdgate check`, the deployment doctor: probes every configured engine, and every engine
//! Kubernetes discovery finds (and, on request, one PD request end to end), and says, check
//! by check, what is right and what to fix.
//!
//! Why: most failed PD deployments are misconfigurations that only show as timeouts under
//! traffic — a decode listed as a prefill, a prefill that does not place rooms by
//! `bootstrap_room % dp`, a rank that never registered with its bootstrap server, page
//! sizes that differ. Each is cheap to see from the engines' own answers before serving.
//!
//! Invariants:
//! - Read-only: the probes are `GET`s (the engine's `/health`, `/server_info`, the bootstrap
//!   server's `/health` and `/route`); only `--probe-request` sends one 1-token `/generate`.
//! - Bounded: every call has `bootstrap.http_timeout`; the engines are probed concurrently;
//!   the end-to-end probe waits at most [`ROUTABLE_WAIT`] for the router, then one request
//!   timeout (capped at [`PROBE_REQUEST_CAP`]).
//! - Every ✗ carries a `fix`; a ✓ never does. A check whose precondition failed (the engine
//!   did not answer) is not reported at all rather than reported as a second failure.
//! - With `[discovery]` enabled, the pods are listed once (`discovered.rs`: the same client,
//!   namespace, selectors and pod rules as `serve`), and every pod the router would use is
//!   probed exactly as a static engine is, under the target `namespace/name`.
//! - Layer: above [`crate::router`] (the end-to-end probe starts one in-process); nothing in
//!   the library imports this module, only the binary.

use crate::upstream::{snippet, BODY_SNIPPET};
use std::time::{Duration, Instant};

use http::StatusCode;
use serde::Serialize;

use crate::bootstrap::client::{self, RankRoute, Sentinel};
use crate::config::{Config, ContractMode, DecodeWorkerConfig, PrefillWorkerConfig};
use crate::engine::{Layout, ServerInfo};
use crate::types::Role;
use crate::upstream::Upstream;
use crate::url::{parse_base_url, BaseUrl};

mod bootstrap_probe;
mod discovered;
mod fleet;
mod pairing;

use bootstrap_probe::probe_bootstrap;
pub use discovered::{KubeSource, DISCOVERY_WAIT};
use fleet::{fleet, probe_request};

/// The `target` of a check about the deployment as a whole (discovery included).
pub const FLEET: &str = "fleet";
/// The prefill DP dispatch that `modulo` contract mode needs.
pub const FOLLOW_BOOTSTRAP_ROOM: &str = "follow_bootstrap_room";
/// The longest wait for the in-process router to see a routable prefill and decode rank.
pub const ROUTABLE_WAIT: Duration = Duration::from_secs(10);
/// The longest wait for the end-to-end probe's answer.
pub const PROBE_REQUEST_CAP: Duration = Duration::from_secs(60);

/// One check: what was probed, whether it is right, and what to do when it is not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// An engine URL, or [`FLEET`].
    pub target: String,
    pub name: String,
    pub ok: bool,
    pub detail: String,
    /// Set on every ✗, never on a ✓.
    pub fix: Option<String>,
}

impl Check {
    fn pass(target: &str, name: &str, detail: impl Into<String>) -> Check {
        Check {
            target: target.to_string(),
            name: name.to_string(),
            ok: true,
            detail: detail.into(),
            fix: None,
        }
    }

    fn fail(target: &str, name: &str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            target: target.to_string(),
            name: name.to_string(),
            ok: false,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// Every check, in order: discovery (what it found, then each pod it would not use), per
/// engine (prefills, then decodes; static ones as configured, then discovered ones by pod
/// name), then the fleet.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub ok: bool,
    pub passed: usize,
    pub failed: usize,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn new(checks: Vec<Check>) -> Report {
        let failed = checks.iter().filter(|c| !c.ok).count();
        Report {
            ok: failed == 0,
            passed: checks.len() - failed,
            failed,
            checks,
        }
    }

    /// Names of the failed checks, in order (for tests and scripts).
    pub fn failures(&self) -> Vec<&str> {
        self.checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| c.name.as_str())
            .collect()
    }

    /// The human table: one line per check, an indented `fix:` under each ✗, a summary.
    pub fn table(&self) -> String {
        let tw = self
            .checks
            .iter()
            .map(|c| c.target.len())
            .max()
            .unwrap_or(0);
        let nw = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let mut out = String::new();
        for c in &self.checks {
            let mark = if c.ok { "✓" } else { "✗" };
            out.push_str(&format!(
                "{mark} {:tw$}  {:nw$}  {}\n",
                c.target, c.name, c.detail
            ));
            if let Some(fix) = &c.fix {
                out.push_str(&format!("    fix: {fix}\n"));
            }
        }
        out.push_str(&format!(
            "{} checks: {} passed, {} failed\n",
            self.checks.len(),
            self.passed,
            self.failed
        ));
        out
    }
}

/// What `check` does beyond the engine probes.
#[derive(Clone, Copy, Debug, Default)]
pub struct CheckOptions {
    /// Start the router in-process and send one PD request end to end.
    pub probe_request: bool,
}

/// How an engine came to be probed.
#[derive(Clone, Debug)]
enum Listed {
    /// In the config or on the command line.
    Static,
    /// A pod discovery would use: its ✓ `pod` row (the endpoint) opens the engine's checks.
    Pod { row: Check, annotation: String },
}

/// An engine to probe.
#[derive(Clone, Debug)]
struct Engine {
    role: Role,
    /// The report's target: the URL as configured, or the pod's `namespace/name`.
    target: String,
    url: String,
    bootstrap_port: Option<u16>,
    /// The operator's name for its model (config `model`, the pod's model annotation).
    model: Option<String>,
    listed: Listed,
}

/// What one engine answered.
struct EngineProbe {
    role: Role,
    /// The engine's target in the report.
    target: String,
    discovered: bool,
    checks: Vec<Check>,
    /// `/server_info`, only when the engine reports the role it was configured with (an
    /// engine in the wrong role is left out of the fleet comparisons).
    info: Option<ServerInfo>,
    layout: Option<Layout>,
    /// A prefill's bootstrap server as probed (`host:port`), when it answered.
    bootstrap: Option<String>,
    /// The model facts of `/server_info` compared across pairs ([`pairing`]).
    facts: pairing::Facts,
}

/// Probes every engine of `cfg` (a validated configuration) and the fleet as a whole; with
/// `[discovery]` enabled, the Kubernetes client comes from the environment, as `serve`'s.
pub async fn run(cfg: &Config, opts: CheckOptions) -> Report {
    run_with(cfg, opts, KubeSource::Environment).await
}

/// [`run`], with the Kubernetes client configuration given (tests use a fake API server).
pub async fn run_with(cfg: &Config, opts: CheckOptions, kube: KubeSource) -> Report {
    let up = Upstream::new(&crate::router::upstream_settings(cfg));
    let timeout = cfg.bootstrap.http_timeout();
    let mode = cfg.contract.mode;
    let mut engines: Vec<Engine> = cfg
        .prefill
        .iter()
        .map(|p| {
            (
                Role::Prefill,
                p.url.clone(),
                p.bootstrap_port,
                p.model.clone(),
            )
        })
        .chain(
            cfg.decode
                .iter()
                .map(|d| (Role::Decode, d.url.clone(), None, d.model.clone())),
        )
        .chain(
            cfg.worker
                .iter()
                .map(|w| (Role::Regular, w.url.clone(), None, w.model.clone())),
        )
        .map(|(role, url, bootstrap_port, model)| Engine {
            role,
            target: url.clone(),
            url,
            bootstrap_port,
            model,
            listed: Listed::Static,
        })
        .collect();
    let mut checks = Vec::new();
    if cfg.discovery.enabled {
        let d = discovered::discover(cfg, kube, &engines).await;
        checks.extend(d.checks);
        engines.extend(d.engines);
        // Prefills first, each role in listing order.
        engines.sort_by_key(|e| e.role != Role::Prefill);
    }
    let handles: Vec<_> = engines
        .iter()
        .map(|e| {
            let up = up.clone();
            let task = tokio::spawn({
                let e = e.clone();
                async move { probe_engine(&up, &e, mode, timeout).await }
            });
            (e, task)
        })
        .collect();
    let mut probes = Vec::with_capacity(handles.len());
    for (e, task) in handles {
        let probe = task.await.unwrap_or_else(|err| EngineProbe {
            role: e.role,
            checks: vec![Check::fail(
                &e.target,
                "probe",
                format!("the probe task failed: {err}"),
                "a pdgate bug: please report it with this output",
            )],
            target: e.target.clone(),
            discovered: matches!(e.listed, Listed::Pod { .. }),
            info: None,
            layout: None,
            bootstrap: None,
            facts: pairing::Facts::default(),
        });
        probes.push(probe);
    }
    checks.extend(probes.iter().flat_map(|p| p.checks.clone()));
    checks.extend(fleet(cfg, &probes));
    if opts.probe_request {
        checks.push(probe_request(&probe_config(cfg, &engines), &up).await);
    }
    Report::new(checks)
}

/// The end-to-end probe's router config: the engines probed here, all static, discovery
/// off. The router then routes to exactly the fleet this report describes, and does not
/// look for a Kubernetes client of its own (the one `check` used may have been given).
fn probe_config(cfg: &Config, engines: &[Engine]) -> Config {
    let mut c = cfg.clone();
    c.discovery.enabled = false;
    for e in engines
        .iter()
        .filter(|e| matches!(e.listed, Listed::Pod { .. }))
    {
        match e.role {
            Role::Prefill => c.prefill.push(PrefillWorkerConfig {
                url: e.url.clone(),
                bootstrap_port: e.bootstrap_port,
                bootstrap_host: None,
                model: None,
            }),
            Role::Decode => c.decode.push(DecodeWorkerConfig {
                url: e.url.clone(),
                model: None,
            }),
            Role::Regular => c.worker.push(crate::config::RegularWorkerConfig {
                url: e.url.clone(),
                model: None,
            }),
        }
    }
    c
}

fn or_unknown<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "?".to_string(), T::to_string)
}

async fn probe_engine(
    up: &Upstream,
    e: &Engine,
    mode: ContractMode,
    timeout: Duration,
) -> EngineProbe {
    let role = e.role;
    let mut p = EngineProbe {
        role,
        target: e.target.clone(),
        discovered: matches!(e.listed, Listed::Pod { .. }),
        checks: Vec::new(),
        info: None,
        layout: None,
        bootstrap: None,
        facts: pairing::Facts::default(),
    };
    if let Listed::Pod { row, .. } = &e.listed {
        p.checks.push(row.clone());
    }
    let t = e.target.as_str();
    let url = match parse_base_url(&e.url) {
        Ok(u) => u,
        Err(e) => {
            p.checks.push(Check::fail(
                t,
                "url",
                format!("not an engine URL: {e}"),
                "give the engine as http://HOST:PORT",
            ));
            return p;
        }
    };
    let started = Instant::now();
    match up.get(&url, "/health", timeout).await {
        Err(err) => {
            let unresolved = does_not_resolve(&url, timeout).await;
            let fix = match &e.listed {
                _ if unresolved => format!(
                    "the host {} does not resolve (no DNS answer): check its spelling; for a \
                     Kubernetes Service, its name and namespace (NAME.NAMESPACE.svc)",
                    url.host()
                ),
                Listed::Static => format!(
                    "start the {role} engine at {url}, or correct its URL (host, port); check \
                     that pdgate's host can connect to it"
                ),
                Listed::Pod { .. } => format!(
                    "the pod is Ready but nothing answers at {url}: check the engine's port \
                     (--service-discovery-port, or the container port named by \
                     --service-discovery-port-name) and that pdgate's host can reach pod IPs \
                     (network policies)"
                ),
            };
            p.checks.push(Check::fail(
                t,
                "reachable",
                format!("no HTTP answer from the {role} engine: {err}"),
                fix,
            ));
            return p;
        }
        Ok((status, body)) => {
            p.checks.push(Check::pass(
                t,
                "reachable",
                format!("HTTP answered in {} ms", started.elapsed().as_millis()),
            ));
            if status == StatusCode::OK {
                p.checks.push(Check::pass(t, "health", "GET /health 200"));
            } else {
                p.checks.push(Check::fail(
                    t,
                    "health",
                    format!(
                        "GET /health answered {status}: {}",
                        snippet(&body, BODY_SNIPPET)
                    ),
                    "the engine is up but not healthy: see its logs (it may still be loading \
                     the model, or its scheduler died)",
                ));
            }
        }
    }
    let info = match client::server_info(up, &url, timeout).await {
        Ok(info) => {
            p.checks
                .push(Check::pass(t, "server_info", "/server_info answered"));
            info
        }
        Err(e) => {
            // A bootstrap server answers /health too: say so when that is what the URL is.
            let bootstrap = client::sentinel(up, &url, None, timeout).await.is_ok();
            let fix = if bootstrap {
                format!(
                    "{url} is a bootstrap server (it answers GET /route), not the engine: give \
                     the engine's HTTP port (its --port) in the URL, and the bootstrap port \
                     apart (bootstrap_port, or leave it out: /server_info tells)"
                )
            } else {
                "pdgate reads the role, DP size, page size and KV dtype there: is this an \
                 SGLang engine (and its API key, if any, in [upstream] api_key)?"
                    .to_string()
            };
            p.checks.push(Check::fail(
                t,
                "server_info",
                format!("neither /server_info nor /get_server_info answered: {e}"),
                fix,
            ));
            return p;
        }
    };
    p.facts = pairing::Facts::read(up, &url, timeout, e.model.as_deref()).await;
    let role_ok = role_check(&mut p.checks, e, &info);
    p.checks.push(Check::pass(
        t,
        "engine",
        format!(
            "DP {}, page size {}, KV dtype {}, transfer backend {}, version {}",
            or_unknown(&info.dp_size),
            or_unknown(&info.page_size),
            or_unknown(&info.kv_cache_dtype),
            or_unknown(&info.disaggregation_transfer_backend),
            or_unknown(&info.version)
        ),
    ));
    if role == Role::Decode && role_ok {
        p.checks.push(decode_cache_check(t, &info));
    }
    if role == Role::Prefill && role_ok {
        p.checks.push(room_check(t, &info, mode));
        let (layout, bootstrap) = probe_bootstrap(up, &mut p.checks, e, &url, &info, timeout).await;
        p.layout = layout;
        p.bootstrap = bootstrap;
    }
    if role_ok {
        p.info = Some(info);
    }
    p
}

/// Whether the URL's host is a name that does not resolve (an IP literal always does).
async fn does_not_resolve(url: &BaseUrl, timeout: Duration) -> bool {
    let host = url.host();
    if host.parse::<std::net::IpAddr>().is_ok() {
        return false;
    }
    let lookup = tokio::net::lookup_host((host, url.port()));
    matches!(tokio::time::timeout(timeout, lookup).await, Ok(Err(_)))
}

/// The engine's `disaggregation_mode` is the role it was configured with (or its pod's
/// selector says).
fn role_check(checks: &mut Vec<Check>, e: &Engine, info: &ServerInfo) -> bool {
    let (t, role) = (e.target.as_str(), e.role);
    let mode = info.disaggregation_mode.as_deref().unwrap_or("null");
    if mode == role.disaggregation_mode() {
        checks.push(Check::pass(
            t,
            "role",
            format!("disaggregation_mode {mode}"),
        ));
        return true;
    }
    let fix = match (mode, &e.listed) {
        ("prefill" | "decode", Listed::Static) => format!(
            "this is a {mode} engine: list it with --{mode} (in [[{mode}]]), not as a {role}"
        ),
        ("prefill" | "decode", Listed::Pod { .. }) => format!(
            "this pod runs a {mode} engine but matches --{role}-selector: correct its labels \
             (it must match --{mode}-selector only) or the selectors"
        ),
        ("null", _) => format!(
            "this is a regular (non-PD) engine: list it with --worker (in [[worker]]), not as a {role}"
        ),
        _ => format!(
            "start the engine with --disaggregation-mode {}",
            role.disaggregation_mode()
        ),
    };
    let how = match e.listed {
        Listed::Static => "configured",
        Listed::Pod { .. } => "discovered",
    };
    checks.push(Check::fail(
        t,
        "role",
        format!("the engine reports disaggregation_mode {mode}; {how} as a {role}"),
        fix,
    ));
    false
}

/// A prefill places room R on rank `R % dp` (`modulo` needs it; `pinned` does not).
/// Whether a decode keeps its own prefix cache (SGLang's
/// `--disaggregation-decode-enable-radix-cache`). Informational either way: without it a
/// decode receives a request's whole KV every turn, and decode-side affinity
/// (`cache_aware` on decodes) only balances; with it a conversation's turns that meet their
/// rank receive only the KV that rank lacks.
fn decode_cache_check(t: &str, info: &ServerInfo) -> Check {
    let name = "decode_radix_cache";
    let detail = match (
        info.disaggregation_decode_enable_radix_cache,
        info.disable_radix_cache,
    ) {
        (Some(true), Some(true)) => {
            "enabled, but --disable-radix-cache is set too: the decode keeps no prefix cache"
        }
        (Some(true), _) => {
            "on (--disaggregation-decode-enable-radix-cache): each rank keeps the KV it \
             received, and --decode-policy cache_aware sends a conversation's turns back to \
             it, so they receive only what the rank lacks"
        }
        (Some(false), _) => {
            "off: the decode receives a request's whole KV every turn; to reuse it across \
             turns start the decode with --disaggregation-decode-enable-radix-cache and route \
             with --decode-policy cache_aware"
        }
        (None, _) => "not reported by /server_info (an engine without the decode radix cache)",
    };
    Check::pass(t, name, detail)
}

fn room_check(t: &str, info: &ServerInfo, mode: ContractMode) -> Check {
    let name = "load_balance_method";
    match (info.load_balance_method.as_deref(), mode) {
        (Some(FOLLOW_BOOTSTRAP_ROOM), _) => Check::pass(t, name, FOLLOW_BOOTSTRAP_ROOM),
        (None, _) => Check::pass(
            t,
            name,
            "not reported by /server_info (older engine): not verified",
        ),
        (Some(m), ContractMode::Pinned) => Check::pass(
            t,
            name,
            format!("{m} (fine under pinned contract mode: the rank rides on the request)"),
        ),
        (Some(m), ContractMode::Modulo) if info.dp_size.unwrap_or(1) <= 1 => Check::pass(
            t,
            name,
            format!("{m} (fine at DP 1: every room lands on rank 0, as modulo expects)"),
        ),
        (Some(m), ContractMode::Modulo) => Check::fail(
            t,
            name,
            format!("{m}: the prefill will not run room R on rank R % dp, which modulo contract mode relies on"),
            format!(
                "start the prefill with --load-balance-method {FOLLOW_BOOTSTRAP_ROOM}, or run \
                 pdgate with --contract-mode pinned (needs SGLang PR #19268 on every engine)"
            ),
        ),
    }
}
