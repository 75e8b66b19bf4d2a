//! `pdgate check` with `[discovery]` enabled: the pods the router would find, listed once,
//! and what each one means for the report.
//!
//! Why: a discovered fleet fails in ways a static one cannot — no client configuration, an
//! API server out of reach, RBAC that forbids listing pods, a selector that matches nothing,
//! a pod labelled for both roles, a bad bootstrap-port annotation — and each of these
//! leaves the router silently without engines.
//!
//! Invariants:
//! - The client, the namespace, the selectors and the pod rules are `serve`'s
//!   ([`crate::discovery::infer_config`], [`crate::discovery::scope`],
//!   [`crate::discovery::snapshot`]): the doctor looks exactly where the router will.
//! - One fleet row `discovery`: ✓ with the scope and the pods per selector, ✗ when the pods
//!   could not be listed or a selector matches no pod. A failed LIST leaves the discovered
//!   part of the fleet empty (the fleet rows then say what is missing).
//! - One `pod` row per pod the router would not use: ✗ for a misconfiguration
//!   ([`Ignored::is_misconfiguration`], and a URL another worker already has), ✓ with a note
//!   for a pod on its way in or out (not Ready, not running yet, terminating). Such pods
//!   are not probed.
//! - Every pod the router would use becomes an engine probed like a static one, its target
//!   `namespace/name`, its checks opened by a ✓ `pod` row with its URL.
//! - Bounded: the LISTs together take at most [`DISCOVERY_WAIT`].

use std::time::Duration;

use super::{Check, Engine, Listed, FLEET};
use crate::config::Config;
use crate::discovery::pod::{Endpoint, Ignored, Matched, PodState};
use crate::discovery::{self, DiscoveryError, Found, FoundPod, Plan};
use crate::types::Role;
use crate::url::parse_base_url;

/// The longest wait for the API server to answer the LISTs.
pub const DISCOVERY_WAIT: Duration = Duration::from_secs(15);

const NAME: &str = "discovery";

/// Where `check` gets its Kubernetes client configuration when `[discovery]` is enabled.
pub enum KubeSource {
    /// As `serve` does: `KUBECONFIG` (or `~/.kube/config`), else the in-cluster service
    /// account.
    Environment,
    /// This one (tests point it at a fake API server).
    Config(Box<kube::Config>),
}

/// The discovery rows, and the engines of the pods the router would use.
#[derive(Default)]
pub(super) struct Discovered {
    pub checks: Vec<Check>,
    pub engines: Vec<Engine>,
}

impl Discovered {
    fn failed(detail: impl Into<String>, fix: impl Into<String>) -> Discovered {
        Discovered {
            checks: vec![Check::fail(FLEET, NAME, detail, fix)],
            engines: Vec::new(),
        }
    }
}

/// Lists the pods of `cfg.discovery` once; `listed`: the static engines (a pod at one of
/// their URLs is not used, as the router would not use it).
pub(super) async fn discover(cfg: &Config, kube: KubeSource, listed: &[Engine]) -> Discovered {
    let plan = match discovery::plan(&cfg.discovery) {
        Ok(p) => p,
        Err(e) => {
            return Discovered::failed(
                e.to_string(),
                "correct the selector: comma-separated requirements key=value, key!=value, \
                 key in (a,b), key notin (a,b), key, !key",
            )
        }
    };
    let kc = match kube {
        KubeSource::Config(c) => *c,
        KubeSource::Environment => match discovery::infer_config().await {
            Ok(c) => c,
            Err(e) => {
                return Discovered::failed(
                    e.to_string(),
                    "give pdgate a Kubernetes client configuration: run it in the cluster \
                     under a service account, or set KUBECONFIG (or ~/.kube/config) to a \
                     kubeconfig for the cluster",
                )
            }
        },
    };
    let server = kc.cluster_url.to_string().trim_end_matches('/').to_string();
    let client = match discovery::client_from(kc) {
        Ok(c) => c,
        Err(e) => {
            return Discovered::failed(
                e.to_string(),
                "check the kubeconfig's cluster (server URL, certificate authority) and user",
            )
        }
    };
    let scope = discovery::scope(&plan, &client);
    let place = if scope == "*" {
        "every namespace".to_string()
    } else {
        format!("namespace {scope}")
    };
    let found = match tokio::time::timeout(DISCOVERY_WAIT, discovery::snapshot(client, &plan)).await
    {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => {
            let (detail, fix) = list_failed(&e, &server, &scope);
            return Discovered::failed(detail, fix);
        }
        Err(_) => {
            return Discovered::failed(
                format!(
                    "the API server {server} did not answer a LIST of pods in {place} within \
                     {DISCOVERY_WAIT:?}"
                ),
                unreachable_fix(),
            )
        }
    };
    let mut out = Discovered::default();
    let mut rows = Vec::new();
    for p in &found.pods {
        match &p.state {
            PodState::Ready(ep) => match taken(ep, listed, &out.engines) {
                Some(owner) => rows.push(url_taken(p, ep, &owner)),
                None => out.engines.push(engine(p, ep, &plan)),
            },
            state => rows.push(not_used(p, state, &plan)),
        }
    }
    out.checks
        .push(summary(&found, &plan, &place, &server, &out.engines));
    out.checks.extend(rows);
    out
}

fn unreachable_fix() -> String {
    "check the API server's address (the kubeconfig's server:, or KUBERNETES_SERVICE_HOST and \
     KUBERNETES_SERVICE_PORT in a pod) and that pdgate's host can reach it (network \
     policies, proxies, firewalls)"
        .to_string()
}

/// An error and its sources, each once (kube's transport errors say little on their own:
/// "client error (SendRequest)").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = s.source();
    }
    out
}

/// What a failed LIST in `scope` means, and what to do.
fn list_failed(e: &DiscoveryError, server: &str, scope: &str) -> (String, String) {
    let (place, ns) = if scope == "*" {
        ("every namespace".to_string(), "-A".to_string())
    } else {
        (format!("namespace {scope}"), format!("-n {scope}"))
    };
    match e.api_status() {
        Some((403, msg)) => (
            format!("the API server {server} forbids listing pods in {place}: 403 {msg}"),
            format!(
                "grant pods get/list/watch: apply docker/k8s/base/rbac.yaml (or the \
                 cluster-wide component, docker/k8s/components/cluster-wide, for \
                 --service-discovery-namespace '*'); check with `kubectl auth can-i list pods \
                 {ns} --as system:serviceaccount:<pdgate's namespace>:pdgate`"
            ),
        ),
        Some((401, msg)) => (
            format!("the API server {server} refused pdgate's credentials: 401 {msg}"),
            "check the kubeconfig's user (token, client certificate), or the pod's service \
             account token"
                .to_string(),
        ),
        Some((code, msg)) => (
            format!(
                "the API server {server} answered a LIST of pods in {place} with {code}: {msg}"
            ),
            "see the API server's message; check the selectors and --service-discovery-namespace"
                .to_string(),
        ),
        None if matches!(e, DiscoveryError::TooManyPods { .. }) => (
            e.to_string(),
            "narrow the selector: it matches more pods than any fleet has".to_string(),
        ),
        None => (
            format!("cannot reach the API server {server}: {}", chain(e)),
            unreachable_fix(),
        ),
    }
}

/// The `discovery` row: where, and how many pods each selector matched; ✗ when one matched
/// none.
fn summary(found: &Found, plan: &Plan, place: &str, server: &str, used: &[Engine]) -> Check {
    let mut counts = Vec::new();
    let mut empty = Vec::new();
    for role in plan.roles() {
        let Some(sel) = plan.selector(role) else {
            continue;
        };
        let n = found.matched(role);
        let u = used.iter().filter(|e| e.role == role).count();
        counts.push(format!("--{role}-selector {sel:?}: {n} pod(s), {u} used"));
        if n == 0 {
            let get = if found.scope == "*" {
                format!("kubectl get pods -A -l '{sel}'")
            } else {
                format!("kubectl get pods -n {} -l '{sel}'", found.scope)
            };
            empty.push(format!(
                "label the {role} pods with what --{role}-selector {sel:?} asks for (`{get}` \
                 must list them), or correct --{role}-selector (discovery.{role}_selector)"
            ));
        }
    }
    let detail = format!("{place} (API server {server}): {}", counts.join("; "));
    if empty.is_empty() {
        Check::pass(FLEET, NAME, detail)
    } else {
        let ns = if found.scope == "*" {
            String::new()
        } else {
            format!(
                "; or the pods run in another namespace than {} (--service-discovery-namespace)",
                found.scope
            )
        };
        Check::fail(
            FLEET,
            NAME,
            format!("{detail}: a selector matches no pod"),
            format!("{}{ns}", empty.join("; ")),
        )
    }
}

fn target(p: &FoundPod) -> String {
    format!("{}/{}", p.pod.namespace, p.pod.name)
}

fn roles(m: Matched) -> &'static str {
    match (m.prefill, m.decode) {
        (true, true) => "prefill and decode",
        (true, false) => "prefill",
        (false, true) => "decode",
        (false, false) => "unselected",
    }
}

/// Who already has `ep`'s URL in its role: a static worker, or a pod listed before.
fn taken(ep: &Endpoint, listed: &[Engine], discovered: &[Engine]) -> Option<String> {
    let same = |e: &&Engine| e.role == ep.role && parse_base_url(&e.url).is_ok_and(|u| u == ep.url);
    if listed.iter().any(|e| same(&e)) {
        return Some("a static worker".to_string());
    }
    discovered
        .iter()
        .find(same)
        .map(|e| format!("pod {}", e.target))
}

fn url_taken(p: &FoundPod, ep: &Endpoint, owner: &str) -> Check {
    let fix = if owner.starts_with("pod ") {
        "two pods with one URL (host network?): give each engine its own port".to_string()
    } else {
        format!(
            "remove the static --{0} (or [[{0}]]) entry, or keep this pod out of \
             --{0}-selector: the router uses the static worker and ignores the pod",
            ep.role
        )
    };
    Check::fail(
        &target(p),
        "pod",
        format!(
            "{} pod ready at {}, not used: its URL is already {owner}'s",
            ep.role, ep.url
        ),
        fix,
    )
}

/// A pod the router would use, as an engine to probe.
fn engine(p: &FoundPod, ep: &Endpoint, plan: &Plan) -> Engine {
    let annotation = plan.pod.bootstrap_annotation.clone();
    let boot = match (ep.role, ep.bootstrap_port) {
        (Role::Decode | Role::Regular, _) => String::new(),
        (Role::Prefill, Some(port)) => {
            format!(", bootstrap port {port} from its {annotation} annotation")
        }
        (Role::Prefill, None) => format!(", no {annotation} annotation"),
    };
    let t = target(p);
    Engine {
        role: ep.role,
        url: ep.url.to_string(),
        bootstrap_port: ep.bootstrap_port,
        model: ep.model.clone(),
        listed: Listed::Pod {
            row: Check::pass(
                &t,
                "pod",
                format!("{} pod, ready at {}{boot}", ep.role, ep.url),
            ),
            annotation,
        },
        target: t,
    }
}

/// A pod the router would not use: ✗ with a fix when it is misconfigured, else ✓ with why.
fn not_used(p: &FoundPod, state: &PodState, plan: &Plan) -> Check {
    let t = target(p);
    let role = roles(p.matched);
    match state {
        PodState::Ready(ep) => Check::pass(&t, "pod", format!("{role} pod, ready at {}", ep.url)),
        PodState::NotReady(ep) => Check::pass(
            &t,
            "pod",
            format!(
                "{role} pod at {} is not Ready: not used (nor probed) until it is",
                ep.url
            ),
        ),
        PodState::Terminating { grace } => Check::pass(
            &t,
            "pod",
            format!(
                "{role} pod is terminating (grace {}s): not used",
                grace.as_secs()
            ),
        ),
        PodState::Ignored(why) if why.is_misconfiguration() => Check::fail(
            &t,
            "pod",
            format!("{role} pod not used: {why}"),
            fix(why, plan),
        ),
        PodState::Ignored(why) => Check::pass(&t, "pod", format!("{role} pod not used yet: {why}")),
    }
}

fn fix(why: &Ignored, plan: &Plan) -> String {
    let s = &plan.pod;
    match why {
        Ignored::BothSelectors => format!(
            "a pod must match exactly one selector: give it labels that only one of \
             --prefill-selector {:?} and --decode-selector {:?} selects, or make the \
             selectors exclude each other",
            plan.prefill_selector.as_deref().unwrap_or(""),
            plan.decode_selector.as_deref().unwrap_or("")
        ),
        Ignored::BadAnnotation(_) => format!(
            "set the pod's {} annotation to the prefill's --disaggregation-bootstrap-port \
             (1-65535), or remove it (the engine's /server_info then tells)",
            s.bootstrap_annotation
        ),
        Ignored::NoPort(_) => format!(
            "give the container port named {:?} a number 1-65535, or drop \
             --service-discovery-port-name (the port is then --service-discovery-port, {})",
            s.port_name.as_deref().unwrap_or(""),
            s.port
        ),
        Ignored::BadIp(_) => {
            "the pod's status.podIP is not an IP address: see the cluster's network plugin"
                .to_string()
        }
        _ => "a pdgate bug: please report it with this output".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PodRef;

    /// Every way a pod is not used: a misconfiguration is a ✗ with a real fix, anything
    /// else a ✓ without one.
    #[test]
    fn a_pod_not_used_is_a_fix_exactly_when_misconfigured() {
        let plan = discovery::plan(&crate::config::DiscoveryConfig {
            enabled: true,
            prefill_selector: Some("role=p".into()),
            decode_selector: Some("role=d".into()),
            port_name: Some("http".into()),
            ..Default::default()
        })
        .expect("plan");
        let ep = Endpoint {
            role: Role::Decode,
            url: parse_base_url("http://10.0.0.1:30000").expect("url"),
            bootstrap_port: None,
            model: None,
        };
        let states = [
            (PodState::NotReady(ep), false),
            (
                PodState::Terminating {
                    grace: Duration::from_secs(5),
                },
                false,
            ),
            (PodState::Ignored(Ignored::BothSelectors), true),
            (
                PodState::Ignored(Ignored::NotRunning("Pending".into())),
                false,
            ),
            (PodState::Ignored(Ignored::NoIp), false),
            (PodState::Ignored(Ignored::BadIp("x".into())), true),
            (PodState::Ignored(Ignored::NoPort("http is 0".into())), true),
            (PodState::Ignored(Ignored::BadAnnotation("x".into())), true),
            (PodState::Ignored(Ignored::NoSelector), false),
        ];
        for (state, misconfigured) in states {
            let p = FoundPod {
                pod: PodRef {
                    namespace: "llm".into(),
                    name: "pod-0".into(),
                    uid: "u".into(),
                },
                matched: Matched {
                    prefill: false,
                    decode: true,
                    regular: false,
                },
                state: state.clone(),
            };
            let c = not_used(&p, &state, &plan);
            assert_eq!(c.target, "llm/pod-0");
            assert_eq!(c.ok, !misconfigured, "{state:?}: {c:?}");
            assert_eq!(c.fix.is_some(), misconfigured, "{state:?}: {c:?}");
            assert!(
                !c.fix.as_deref().unwrap_or_default().contains("pdgate bug"),
                "{state:?}: {c:?}"
            );
        }
    }

    #[test]
    fn a_refused_list_says_what_to_grant_or_fix() {
        let status = |code: u16| DiscoveryError::List {
            role: Role::Prefill,
            selector: "role=p".into(),
            error: kube::Error::Api(Box::new(kube::core::Status {
                code,
                message: "nope".into(),
                ..Default::default()
            })),
        };
        let cases = [
            (status(403), "403 nope", "grant pods get/list/watch"),
            (status(401), "401 nope", "check the kubeconfig's user"),
            (
                status(404),
                "with 404: nope",
                "see the API server's message",
            ),
            (
                DiscoveryError::TooManyPods {
                    role: Role::Decode,
                    selector: "".into(),
                    pods: 500_000,
                },
                "still more after 500000 pods",
                "narrow the selector",
            ),
        ];
        for (e, detail, fix) in cases {
            let (d, f) = list_failed(&e, "https://k8s:6443", "llm");
            assert!(d.contains(detail), "{d}");
            assert!(f.starts_with(fix), "{f}");
        }
    }
}
