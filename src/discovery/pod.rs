//! What a pod means for the router: a pure function from a pod (and which selectors it
//! matched) to a [`PodState`], with no I/O, so every rule is one table-driven test.
//!
//! Rules, in the order they are applied:
//! 1. A pod that matches both the prefill and the decode selector is refused.
//! 2. A pod with `metadata.deletionTimestamp` is terminating: its worker drains and is
//!    removed within the pod's grace period (`deletionGracePeriodSeconds`, else
//!    `spec.terminationGracePeriodSeconds`, else `discovery.default_grace_secs`).
//! 3. A pod not in phase `Running`, or without an IP, is not used.
//! 4. Its endpoint: `http://IP:PORT`, PORT the container port named `discovery.port_name`
//!    when the pod has one, else `discovery.port`; an IPv6 IP gets brackets. A prefill's
//!    bootstrap port is the annotation's value when present (a malformed one refuses the
//!    pod), else unset (the engine's `/server_info` tells, as for static workers). Its
//!    model is the model annotation's value (else the label's of that key), else unset
//!    (`/server_info` tells); a value past the name bound refuses the pod.
//! 5. `Ready=True` makes the pod serving; otherwise it is not ready (a worker it already has
//!    drains; none is added).

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use crate::pool::PodRef;
use crate::types::Role;
use crate::url::{parse_base_url, BaseUrl};

/// How pods become endpoints (from `[discovery]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSettings {
    /// Namespaces whose pods may become workers; empty or `*` among them: any.
    pub namespaces: Vec<String>,
    pub port: u16,
    pub port_name: Option<String>,
    pub bootstrap_annotation: String,
    /// The annotation (else label) naming the pod's model.
    pub model_key: String,
    pub default_grace: Duration,
}

/// Which selectors a pod matched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Matched {
    pub prefill: bool,
    pub decode: bool,
    pub regular: bool,
}

impl Matched {
    /// Records that `role`'s selector matched.
    pub fn set(&mut self, role: Role) {
        match role {
            Role::Prefill => self.prefill = true,
            Role::Decode => self.decode = true,
            Role::Regular => self.regular = true,
        }
    }

    /// Whether `role`'s selector matched.
    pub fn has(&self, role: Role) -> bool {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
            Role::Regular => self.regular,
        }
    }
}

/// Where a pod's engine is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub role: Role,
    pub url: BaseUrl,
    /// Prefill only: from the annotation.
    pub bootstrap_port: Option<u16>,
    /// The model clients name for it, from the pod's model annotation (else label); unset,
    /// the engine's `/server_info` tells.
    pub model: Option<String>,
}

/// Why a pod seen by discovery is not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ignored {
    BothSelectors,
    /// The phase (`Pending`, `Succeeded`, `Failed`, `Unknown`).
    NotRunning(String),
    NoIp,
    /// The IP as the pod reports it.
    BadIp(String),
    /// The named container port holds no valid port number.
    NoPort(String),
    /// The bootstrap-port annotation's value.
    BadAnnotation(String),
    /// Matched no selector (a pod the API server should not have sent).
    NoSelector,
    /// In a namespace that `discovery.allowed_namespaces` does not list.
    NamespaceNotAllowed(String),
}

impl Ignored {
    pub fn label(&self) -> &'static str {
        match self {
            Ignored::BothSelectors => "both_selectors",
            Ignored::NotRunning(_) => "not_running",
            Ignored::NoIp => "no_ip",
            Ignored::BadIp(_) => "bad_ip",
            Ignored::NoPort(_) => "no_port",
            Ignored::BadAnnotation(_) => "bad_annotation",
            Ignored::NoSelector => "no_selector",
            Ignored::NamespaceNotAllowed(_) => "namespace_not_allowed",
        }
    }

    /// Refusals an operator has to fix (logged as warnings), as opposed to pods on their
    /// way in or out.
    pub fn is_misconfiguration(&self) -> bool {
        matches!(
            self,
            Ignored::BothSelectors
                | Ignored::NamespaceNotAllowed(_)
                | Ignored::BadIp(_)
                | Ignored::NoPort(_)
                | Ignored::BadAnnotation(_)
        )
    }
}

impl std::fmt::Display for Ignored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ignored::BothSelectors => {
                f.write_str("matches both the prefill and the decode selector")
            }
            Ignored::NotRunning(p) => write!(f, "not running (phase {p})"),
            Ignored::NoIp => f.write_str("has no IP yet"),
            Ignored::BadIp(ip) => write!(f, "its IP {ip:?} is not an IP address"),
            Ignored::NoPort(why) => write!(f, "no usable port: {why}"),
            Ignored::BadAnnotation(v) => {
                write!(
                    f,
                    "its bootstrap-port annotation {v:?} is not a port (1-65535)"
                )
            }
            Ignored::NoSelector => f.write_str("matches no selector"),
            Ignored::NamespaceNotAllowed(ns) => write!(
                f,
                "its namespace {ns:?} is not in discovery.allowed_namespaces"
            ),
        }
    }
}

/// What a pod means for the router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodState {
    /// Running, with an IP, `Ready=True`: its worker should serve.
    Ready(Endpoint),
    /// Running with an IP but not ready: a worker it has drains; none is added.
    NotReady(Endpoint),
    /// Being deleted: its worker drains and is removed within `grace`.
    Terminating {
        grace: Duration,
    },
    Ignored(Ignored),
}

impl PodState {
    /// The `state` label of `pdgate_discovery_pods`.
    pub fn label(&self) -> &'static str {
        match self {
            PodState::Ready(_) => "ready",
            PodState::NotReady(_) => "not_ready",
            PodState::Terminating { .. } => "terminating",
            PodState::Ignored(i) => i.label(),
        }
    }
}

/// Every value [`PodState::label`] takes (the gauge is set for each, zeros included), plus
/// `url_taken`, which the reconciler decides.
pub const STATE_LABELS: &[&str] = &[
    "ready",
    "not_ready",
    "terminating",
    "both_selectors",
    "not_running",
    "no_ip",
    "bad_ip",
    "no_port",
    "bad_annotation",
    "no_selector",
    "namespace_not_allowed",
    "url_taken",
];

/// The pod's namespace, name and UID (empty strings when absent: the store keys pods by
/// UID and never holds one without).
pub fn pod_ref(pod: &Pod) -> PodRef {
    let m = &pod.metadata;
    PodRef {
        namespace: m.namespace.clone().unwrap_or_default(),
        name: m.name.clone().unwrap_or_default(),
        uid: m.uid.clone().unwrap_or_default(),
    }
}

fn secs(v: Option<i64>) -> Option<Duration> {
    v.map(|s| Duration::from_secs(s.max(0).unsigned_abs()))
}

/// The longest grace period taken from a pod (a day): the API server accepts any `i64`,
/// and a pod's numbers are read, not trusted.
pub const MAX_GRACE: Duration = Duration::from_secs(86_400);

/// The grace period of a terminating pod, at most [`MAX_GRACE`].
fn grace(pod: &Pod, default: Duration) -> Duration {
    secs(pod.metadata.deletion_grace_period_seconds)
        .or_else(|| secs(pod.spec.as_ref()?.termination_grace_period_seconds))
        .unwrap_or(default)
        .min(MAX_GRACE)
}

pub(super) fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod_ip(pod: &Pod) -> Option<&str> {
    let st = pod.status.as_ref()?;
    st.pod_ip.as_deref().filter(|s| !s.is_empty()).or_else(|| {
        st.pod_ips
            .as_ref()?
            .iter()
            .map(|p| p.ip.as_str())
            .find(|s| !s.is_empty())
    })
}

/// The engine's port: the named container port if the pod has one, else the default.
fn port(pod: &Pod, s: &PodSettings) -> Result<u16, Ignored> {
    let Some(name) = s.port_name.as_deref() else {
        return Ok(s.port);
    };
    let named = pod.spec.as_ref().and_then(|spec| {
        spec.containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(name))
    });
    match named {
        None => Ok(s.port),
        Some(p) => u16::try_from(p.container_port)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| {
                Ignored::NoPort(format!(
                    "container port {name:?} is {} (not 1-65535)",
                    p.container_port
                ))
            }),
    }
}

fn endpoint(pod: &Pod, role: Role, ip: &str, s: &PodSettings) -> Result<Endpoint, Ignored> {
    let addr: IpAddr = ip.parse().map_err(|_| Ignored::BadIp(ip.to_string()))?;
    let port = port(pod, s)?;
    let text = match addr {
        IpAddr::V4(a) => format!("http://{a}:{port}"),
        IpAddr::V6(a) => format!("http://[{a}]:{port}"),
    };
    let url = parse_base_url(&text).map_err(|_| Ignored::BadIp(ip.to_string()))?;
    let bootstrap_port = match role {
        Role::Decode | Role::Regular => None,
        Role::Prefill => match pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&s.bootstrap_annotation))
        {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| Ignored::BadAnnotation(v.clone()))?,
            ),
        },
    };
    let meta = &pod.metadata;
    let model = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(&s.model_key))
        .or_else(|| meta.labels.as_ref().and_then(|l| l.get(&s.model_key)))
        .map(|v| v.trim())
        .filter(|v| !v.is_empty());
    if let Some(m) = model {
        if m.len() > crate::config::models::MAX_NAME_BYTES {
            return Err(Ignored::BadAnnotation(m.chars().take(64).collect()));
        }
    }
    Ok(Endpoint {
        role,
        url,
        bootstrap_port,
        model: model.map(str::to_string),
    })
}

/// What `pod` means, given the selectors it matched.
pub fn classify(pod: &Pod, matched: Matched, s: &PodSettings) -> PodState {
    if !s.namespaces.is_empty() && !s.namespaces.iter().any(|n| n == "*") {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("");
        if !s.namespaces.iter().any(|n| n == ns) {
            return PodState::Ignored(Ignored::NamespaceNotAllowed(ns.to_string()));
        }
    }
    let role = match (matched.prefill, matched.decode, matched.regular) {
        (true, false, false) => Role::Prefill,
        (false, true, false) => Role::Decode,
        (false, false, true) => Role::Regular,
        (false, false, false) => return PodState::Ignored(Ignored::NoSelector),
        _ => return PodState::Ignored(Ignored::BothSelectors),
    };
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Terminating {
            grace: grace(pod, s.default_grace),
        };
    }
    let phase = pod
        .status
        .as_ref()
        .and_then(|st| st.phase.as_deref())
        .unwrap_or("Unknown");
    if phase != "Running" {
        return PodState::Ignored(Ignored::NotRunning(phase.to_string()));
    }
    let Some(ip) = pod_ip(pod) else {
        return PodState::Ignored(Ignored::NoIp);
    };
    match endpoint(pod, role, ip, s) {
        Err(why) => PodState::Ignored(why),
        Ok(ep) if is_ready(pod) => PodState::Ready(ep),
        Ok(ep) => PodState::NotReady(ep),
    }
}

#[cfg(test)]
#[path = "pod_tests.rs"]
mod tests;
