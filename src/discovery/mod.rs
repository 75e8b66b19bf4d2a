//! Kubernetes service discovery: prefill and decode engines found as pods, by label
//! selector, and kept in the fleet while they serve.
//!
//! Shape: one pod watcher per configured role ([`watch`]: kube's runtime watcher into a
//! store keyed by pod UID), and one reconciler ([`reconcile`]) that, after every change, a
//! relist, or a finished removal, compares what the pods say ([`pod::classify`]) with the
//! workers discovery added, and adds, drains, undrains or removes workers through
//! [`Fleet`]. It is level-triggered: missing an event costs nothing once the next one (or
//! the periodic relist, `discovery.resync_secs`) arrives.
//!
//! [`snapshot`] is the one-shot view of the same pods (one LIST per role, the same client,
//! namespace, selectors and classification, no watch, no fleet) that `pdgate check`
//! reports; [`infer_config`], [`client_from`] and [`scope`] are shared by both, so the
//! doctor looks where the router will.
//!
//! [`replicas`] counts pdgate's own pods for admission (`[admission] replica_selector`),
//! with the same client, in pdgate's own namespace; it writes the pool's replica count,
//! never the fleet.
//!
//! Invariants:
//! - Selectors are checked at start ([`plan`]); a malformed one refuses the start and names
//!   its flag. They are sent to the API server as written.
//! - The namespace is `discovery.namespace`, else (unless `all_namespaces`) the pod's own
//!   from the service-account file, else the client configuration's default namespace.
//! - LIST and watch errors never remove workers: the last known pods stay, the error is
//!   logged and counted, and the watch backs off.
//! - Discovery never touches a worker it did not add (static, admin).
//! - Nothing here runs on the request path: discovery only calls [`Fleet`], which
//!   publishes pool snapshots.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::DiscoveryConfig;
use crate::fleet::Fleet;
use crate::types::Role;

pub mod metrics;
pub mod pod;
mod reconcile;
pub mod replicas;
pub mod selector;
mod snapshot;
mod watch;

use metrics::{Stats, StatsSnapshot};
use pod::PodSettings;
pub use snapshot::{snapshot, Found, FoundPod};

/// Where a pod reads its own namespace.
pub const SERVICE_ACCOUNT_NAMESPACE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// How long the reconciler waits before it tries again something it could not do.
const RETRY: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("{flag} (discovery.{key}) {selector:?} is not a label selector: {error}")]
    Selector {
        flag: &'static str,
        key: &'static str,
        selector: String,
        error: selector::SelectorError,
    },
    #[error("--replica-selector (admission.replica_selector) {selector:?} is not a label selector of pdgate's pods: {error}")]
    ReplicaSelector {
        selector: String,
        error: selector::SelectorError,
    },
    #[error("two of --prefill-selector, --decode-selector and --regular-selector are the same selector ({0:?}): every pod would match both and be refused")]
    SameSelectors(String),
    #[error("no Kubernetes client configuration (KUBECONFIG, ~/.kube/config, or in-cluster service account): {0}")]
    Config(String),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(String),
    /// A one-shot LIST ([`snapshot`]) failed.
    #[error("LIST pods with the {role} selector {selector:?}: {error}")]
    List {
        role: Role,
        selector: String,
        #[source]
        error: kube::Error,
    },
    /// A one-shot LIST did not end within [`snapshot::MAX_PAGES`] pages.
    #[error("LIST pods with the {role} selector {selector:?}: still more after {pods} pods")]
    TooManyPods {
        role: Role,
        selector: String,
        pods: usize,
    },
}

impl DiscoveryError {
    /// The API server's answer when it refused a LIST: HTTP status and message.
    pub fn api_status(&self) -> Option<(u16, &str)> {
        match self {
            DiscoveryError::List {
                error: kube::Error::Api(st),
                ..
            } => Some((st.code, st.message.as_str())),
            _ => None,
        }
    }
}

/// Which pods to watch, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub prefill_selector: Option<String>,
    pub decode_selector: Option<String>,
    pub regular_selector: Option<String>,
    /// `None`: the pod's own namespace (resolved when discovery starts).
    pub namespace: Option<String>,
    pub all_namespaces: bool,
    pub pod: PodSettings,
    pub resync: Duration,
}

impl Plan {
    /// The selector of `role`, if it has one.
    pub fn selector(&self, role: Role) -> Option<&str> {
        match role {
            Role::Prefill => self.prefill_selector.as_deref(),
            Role::Decode => self.decode_selector.as_deref(),
            Role::Regular => self.regular_selector.as_deref(),
        }
    }

    /// The roles with a selector.
    pub fn roles(&self) -> Vec<Role> {
        [Role::Prefill, Role::Decode, Role::Regular]
            .into_iter()
            .filter(|r| self.selector(*r).is_some())
            .collect()
    }
}

fn checked(
    s: Option<&str>,
    flag: &'static str,
    key: &'static str,
) -> Result<Option<(String, selector::LabelSelector)>, DiscoveryError> {
    let Some(s) = s else { return Ok(None) };
    let parsed = selector::parse(s).map_err(|error| DiscoveryError::Selector {
        flag,
        key,
        selector: s.to_string(),
        error,
    })?;
    if parsed.selects_all() {
        tracing::warn!(flag, "an empty selector matches every pod in the namespace");
    }
    Ok(Some((s.trim().to_string(), parsed)))
}

/// Checks `[discovery]` (the selectors above all) without starting anything.
pub fn plan(cfg: &DiscoveryConfig) -> Result<Plan, DiscoveryError> {
    let p = checked(
        cfg.prefill_selector.as_deref(),
        "--prefill-selector",
        "prefill_selector",
    )?;
    let d = checked(
        cfg.decode_selector.as_deref(),
        "--decode-selector",
        "decode_selector",
    )?;
    let r = checked(
        cfg.regular_selector.as_deref(),
        "--regular-selector",
        "regular_selector",
    )?;
    // The same requirements in any order select the same pods.
    let set = |s: &selector::LabelSelector| {
        s.0.iter()
            .map(ToString::to_string)
            .collect::<std::collections::BTreeSet<_>>()
    };
    for (x, y) in [(&p, &d), (&p, &r), (&d, &r)] {
        if let (Some((text, a)), Some((_, b))) = (x, y) {
            if set(a) == set(b) {
                return Err(DiscoveryError::SameSelectors(text.clone()));
            }
        }
    }
    Ok(Plan {
        prefill_selector: p.map(|(s, _)| s),
        decode_selector: d.map(|(s, _)| s),
        regular_selector: r.map(|(s, _)| s),
        namespace: cfg.namespace.clone().filter(|n| !n.trim().is_empty()),
        all_namespaces: cfg.all_namespaces,
        pod: PodSettings {
            namespaces: if cfg.all_namespaces {
                cfg.allowed_namespaces.clone()
            } else {
                Vec::new()
            },
            port: cfg.port,
            port_name: cfg.port_name.clone().filter(|n| !n.trim().is_empty()),
            bootstrap_annotation: cfg.bootstrap_port_annotation.trim().to_string(),
            model_key: cfg.model_annotation.trim().to_string(),
            default_grace: cfg.default_grace(),
        },
        resync: cfg.resync(),
    })
}

/// A running discovery; stops when dropped (the workers it added stay).
pub struct Discovery {
    stop: CancellationToken,
    stats: Arc<Stats>,
    scope: String,
}

impl Discovery {
    /// Its counters (reconcile passes, complete LISTs, watch errors and restarts).
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// The namespace watched, or `*` for all.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The client configuration of the environment: `KUBECONFIG` (or `~/.kube/config`), else
/// the in-cluster service account.
pub async fn infer_config() -> Result<kube::Config, DiscoveryError> {
    kube::Config::infer()
        .await
        .map_err(|e| DiscoveryError::Config(e.to_string()))
}

/// The client discovery uses, from a client configuration.
pub fn client_from(kc: kube::Config) -> Result<kube::Client, DiscoveryError> {
    kube::Client::try_from(kc).map_err(|e| DiscoveryError::Client(e.to_string()))
}

/// Starts discovery with the client configuration of the environment ([`infer_config`]).
pub async fn spawn(cfg: &DiscoveryConfig, fleet: Arc<Fleet>) -> Result<Discovery, DiscoveryError> {
    let plan = plan(cfg)?;
    let client = client_from(infer_config().await?)?;
    Ok(start(plan, client, fleet))
}

/// Starts discovery with a given client (tests point one at a fake API server).
pub fn spawn_with_client(
    client: kube::Client,
    cfg: &DiscoveryConfig,
    fleet: Arc<Fleet>,
) -> Result<Discovery, DiscoveryError> {
    Ok(start(plan(cfg)?, client, fleet))
}

/// The namespace to watch when none is configured: the pod's own, else the client's.
fn own_namespace(client: &kube::Client) -> String {
    std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| client.default_namespace().to_string())
}

/// The namespace `plan` watches with `client`, or `*` for all.
pub fn scope(plan: &Plan, client: &kube::Client) -> String {
    match (&plan.namespace, plan.all_namespaces) {
        (_, true) => "*".to_string(),
        (Some(ns), false) => ns.clone(),
        (None, false) => own_namespace(client),
    }
}

/// The pods API of `scope` (`*`: every namespace).
fn pods_api(client: kube::Client, scope: &str) -> Api<Pod> {
    if scope == "*" {
        Api::all(client)
    } else {
        Api::namespaced(client, scope)
    }
}

fn start(plan: Plan, client: kube::Client, fleet: Arc<Fleet>) -> Discovery {
    let scope = scope(&plan, &client);
    let api = pods_api(client, &scope);
    let stop = CancellationToken::new();
    let stats = Arc::new(Stats::default());
    let stores = Arc::new(watch::Stores::default());
    let wake = Arc::new(Notify::new());
    let roles = plan.roles();
    tracing::info!(
        namespace = %scope,
        prefill_selector = plan.prefill_selector.as_deref().unwrap_or("-"),
        decode_selector = plan.decode_selector.as_deref().unwrap_or("-"),
        regular_selector = plan.regular_selector.as_deref().unwrap_or("-"),
        resync_secs = plan.resync.as_secs(),
        "discovery watching pods"
    );
    for role in &roles {
        let Some(selector) = plan.selector(*role) else {
            continue;
        };
        let w = watch::RoleWatch {
            role: *role,
            api: api.clone(),
            selector: selector.to_string(),
            roles: roles.clone(),
        };
        tokio::spawn(watch::run(
            w,
            stores.clone(),
            wake.clone(),
            stats.clone(),
            stop.clone(),
        ));
    }
    let rec = reconcile::Reconciler::new(fleet, plan.pod.clone(), stats.clone(), wake.clone());
    tokio::spawn(reconcile_loop(
        rec,
        stores,
        wake,
        roles,
        plan.resync,
        stop.clone(),
    ));
    Discovery { stop, stats, scope }
}

async fn reconcile_loop(
    mut rec: reconcile::Reconciler,
    stores: Arc<watch::Stores>,
    wake: Arc<Notify>,
    roles: Vec<Role>,
    resync: Duration,
    stop: CancellationToken,
) {
    let mut pending = false;
    loop {
        let retry = async {
            if pending {
                tokio::time::sleep(RETRY).await;
            } else {
                // Reconcile from the store at least every `resync` (no LIST): whatever a
                // pass could not finish, or a worker that changed under it, is looked at
                // again.
                tokio::time::sleep(resync).await;
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = wake.notified() => {}
            _ = retry => {}
        }
        if !stores.synced(&roles) {
            continue;
        }
        let observed = stores.observed();
        pending = rec.reconcile(&observed).pending;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(p: Option<&str>, d: Option<&str>) -> DiscoveryConfig {
        DiscoveryConfig {
            enabled: true,
            prefill_selector: p.map(str::to_string),
            decode_selector: d.map(str::to_string),
            ..DiscoveryConfig::default()
        }
    }

    #[test]
    fn plan_checks_the_selectors_and_names_the_flag() {
        type Case<'a> = (Option<&'a str>, Option<&'a str>, Result<Vec<Role>, &'a str>);
        let cases: &[Case] = &[
            (
                Some("app=p"),
                Some("app=d"),
                Ok(vec![Role::Prefill, Role::Decode]),
            ),
            (Some("app=p"), None, Ok(vec![Role::Prefill])),
            (None, Some("role in (decode)"), Ok(vec![Role::Decode])),
            (
                Some("app in (p"),
                Some("app=d"),
                Err("--prefill-selector (discovery.prefill_selector)"),
            ),
            (
                Some("app=p"),
                Some("app=d,"),
                Err("--decode-selector (discovery.decode_selector)"),
            ),
            (
                Some("a=1, b in (x,y)"),
                Some("b in (y,x),a==1"),
                Err("the same selector"),
            ),
        ];
        for (p, d, want) in cases {
            match (plan(&cfg(*p, *d)), want) {
                (Ok(plan), Ok(roles)) => assert_eq!(&plan.roles(), roles, "{p:?} {d:?}"),
                (Err(e), Err(text)) => assert!(e.to_string().contains(text), "{e}"),
                (got, _) => panic!("{p:?} {d:?}: {got:?}"),
            }
        }
    }

    #[test]
    fn plan_takes_the_settings_as_given() {
        let mut c = cfg(Some(" app=p "), Some("app=d"));
        c.port_name = Some(" ".into());
        c.namespace = Some("".into());
        c.bootstrap_port_annotation = " example.com/bp ".into();
        let p = plan(&c).expect("plan");
        assert_eq!(p.prefill_selector.as_deref(), Some("app=p"));
        assert_eq!(p.pod.port_name, None);
        assert_eq!(p.namespace, None);
        assert_eq!(p.pod.bootstrap_annotation, "example.com/bp");
        assert_eq!(p.pod.default_grace, Duration::from_secs(30));
        assert_eq!(p.resync, Duration::from_secs(60));
    }

    /// The TLS stack builds (rustls with ring: the one provider compiled in).
    #[tokio::test]
    async fn a_client_for_an_https_api_server_builds() {
        let uri: http::Uri = "https://127.0.0.1:6443".parse().expect("uri");
        let client = kube::Client::try_from(kube::Config::new(uri)).expect("client");
        assert_eq!(client.default_namespace(), "default");
    }
}
