//! The checks of a build's scaling, scraping and network objects against the pdgate
//! Deployment they serve: a HorizontalPodAutoscaler scales that Deployment on CPU (which the
//! container requests) and owns its replica count; a ServiceMonitor selects a Service that
//! selects pdgate's pods, by a port name that Service has, whose target is the metrics
//! listener; a NetworkPolicy selects pdgate's pods, opens the front door to every client and
//! the metrics port only to pods that match both a namespace and a pod selector, and
//! nothing else.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Container, Service};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::fleet::{container_port, matches, Res};

/// The Prometheus Operator's `monitoring.coreos.com/v1` ServiceMonitor, the fields the
/// manifests use (any other is refused, so the round trip catches a typo).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: LabelSelector,
    endpoints: Vec<Endpoint>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Endpoint {
    port: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
}

fn of_kind<K: serde::de::DeserializeOwned>(objs: &[Value], kind: &str) -> Res<Vec<K>> {
    objs.iter()
        .filter(|o| o["kind"] == kind)
        .map(|o| serde_json::from_value(o.clone()).map_err(|e| format!("{kind}: {e}")))
        .collect()
}

type Labels = BTreeMap<String, String>;

/// `router` is the pdgate Deployment's (name, namespace), `labels` its pods' labels and `c`
/// its `pdgate serve` container.
pub fn check(
    objs: &[Value],
    router: (&str, &Option<String>),
    labels: &Labels,
    c: &Container,
) -> Res<()> {
    hpas(objs, router, c)?;
    service_monitors(objs, router.1, labels, c)?;
    network_policies(objs, router.1, labels, c)
}

fn hpas(objs: &[Value], (name, ns): (&str, &Option<String>), c: &Container) -> Res<()> {
    for h in of_kind::<HorizontalPodAutoscaler>(objs, "HorizontalPodAutoscaler")? {
        let spec = h.spec.ok_or("HPA without spec")?;
        let t = &spec.scale_target_ref;
        if t.kind == "StatefulSet" {
            continue; // an engine pool's: `super::autoscaling` checks it
        }
        if h.metadata.namespace != *ns
            || (t.api_version.as_deref(), t.kind.as_str(), t.name.as_str())
                != (Some("apps/v1"), "Deployment", name)
        {
            return Err(format!("the HPA scales {t:?}, not Deployment {name}"));
        }
        let min = spec.min_replicas.unwrap_or(1);
        if min < 2 || min > spec.max_replicas {
            return Err(format!("HPA replicas {min}..{}", spec.max_replicas));
        }
        let cpu =
            spec.metrics.iter().flatten().any(|m| {
                m.type_ == "Resource" && m.resource.as_ref().is_some_and(|r| r.name == "cpu")
            });
        let requested = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .is_some_and(|r| r.contains_key("cpu"));
        if !cpu || !requested {
            return Err("the HPA scales on CPU, which the container must request".into());
        }
        // The HPA owns the count: a `replicas` in the Deployment resets it on every apply.
        let d = objs
            .iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == name)
            .ok_or("no Deployment")?;
        if !d["spec"]["replicas"].is_null() {
            return Err("the HPA's Deployment still sets spec.replicas".into());
        }
    }
    Ok(())
}

fn service_monitors(
    objs: &[Value],
    ns: &Option<String>,
    labels: &Labels,
    c: &Container,
) -> Res<()> {
    let services = of_kind::<Service>(objs, "Service")?;
    for m in of_kind::<ServiceMonitor>(objs, "ServiceMonitor")? {
        if m.metadata.namespace != *ns {
            return Err("the ServiceMonitor is not in pdgate's namespace".into());
        }
        let sel = m.spec.selector.match_labels.as_ref();
        let picked: Vec<&Service> = services
            .iter()
            .filter(|s| s.metadata.namespace == *ns && matches(sel, s.metadata.labels.as_ref()))
            .collect();
        let [svc] = picked.as_slice() else {
            return Err(format!(
                "the ServiceMonitor selects {} Services",
                picked.len()
            ));
        };
        let spec = svc.spec.as_ref().ok_or("Service without spec")?;
        if !matches(spec.selector.as_ref(), Some(labels)) {
            return Err("the ServiceMonitor's Service does not select pdgate's pods".into());
        }
        if m.spec.endpoints.is_empty() {
            return Err("a ServiceMonitor without endpoints".into());
        }
        // A stock Operator install picks it up as shipped.
        let stock = labels_of(STOCK_SERVICEMONITOR_SELECTOR);
        if !matches(Some(&stock), m.metadata.labels.as_ref()) {
            return Err(format!(
                "the ServiceMonitor lacks the labels a stock Prometheus Operator selects: \
                 {STOCK_SERVICEMONITOR_SELECTOR:?}"
            ));
        }
        for e in &m.spec.endpoints {
            let p = spec
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(e.port.as_str()))
                .ok_or_else(|| format!("the Service has no port named {}", e.port))?;
            let target = match &p.target_port {
                Some(IntOrString::String(n)) => container_port(c, n)?,
                Some(IntOrString::Int(n)) => *n,
                None => p.port,
            };
            if target != container_port(c, "metrics")? || e.path.as_deref() != Some("/metrics") {
                return Err(format!(
                    "endpoint {} is not the metrics listener's /metrics",
                    e.port
                ));
            }
        }
    }
    Ok(())
}

/// The labels a stock Prometheus Operator install gives its Prometheus pods
/// (kube-prometheus-stack installed as `kube-prometheus-stack`; kube-prometheus's differ
/// only in the instance names), and its namespace's (only the name Kubernetes sets).
const STOCK_PROMETHEUS_POD: &[(&str, &str)] = &[
    ("app.kubernetes.io/name", "prometheus"),
    ("app.kubernetes.io/managed-by", "prometheus-operator"),
    (
        "app.kubernetes.io/instance",
        "kube-prometheus-stack-prometheus",
    ),
    ("prometheus", "kube-prometheus-stack-prometheus"),
    (
        "operator.prometheus.io/name",
        "kube-prometheus-stack-prometheus",
    ),
];
const STOCK_PROMETHEUS_NAMESPACE: &[(&str, &str)] =
    &[("kubernetes.io/metadata.name", "monitoring")];
/// The label kube-prometheus-stack's Prometheus selects ServiceMonitors by (its Helm
/// release); kube-prometheus selects every ServiceMonitor.
const STOCK_SERVICEMONITOR_SELECTOR: &[(&str, &str)] = &[("release", "kube-prometheus-stack")];

fn labels_of(l: &[(&str, &str)]) -> Labels {
    l.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Whether `peer` lets in a stock Prometheus pod from its own namespace (`monitoring`,
/// which is not pdgate's `ns`): a namespace selector that matches it (an empty one matches
/// every namespace; none means pdgate's namespace only) and a pod selector that does.
fn admits(peer: &NetworkPolicyPeer, ns: &Option<String>) -> bool {
    let selects = |s: &Option<LabelSelector>, l: &Labels| {
        s.as_ref().is_some_and(|s| {
            s.match_expressions.as_ref().is_none_or(Vec::is_empty)
                && s.match_labels
                    .as_ref()
                    .is_none_or(|m| m.iter().all(|(k, v)| l.get(k) == Some(v)))
        })
    };
    let ns_ok = match &peer.namespace_selector {
        None => ns.as_deref() == Some("monitoring"),
        s => selects(s, &labels_of(STOCK_PROMETHEUS_NAMESPACE)),
    };
    ns_ok && selects(&peer.pod_selector, &labels_of(STOCK_PROMETHEUS_POD))
}

fn network_policies(
    objs: &[Value],
    ns: &Option<String>,
    labels: &Labels,
    c: &Container,
) -> Res<()> {
    // Every peer names the pods it lets in (never an IP block, never every pod), and a
    // stock Prometheus Operator's Prometheus is one of them.
    let from_monitoring = |peers: &[NetworkPolicyPeer]| {
        let pods = |s: &Option<LabelSelector>| {
            s.as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .is_some_and(|l| !l.is_empty())
        };
        !peers.is_empty()
            && peers
                .iter()
                .all(|p| pods(&p.pod_selector) && p.ip_block.is_none())
            && peers.iter().any(|p| admits(p, ns))
    };
    for np in of_kind::<NetworkPolicy>(objs, "NetworkPolicy")? {
        let spec = np.spec.ok_or("NetworkPolicy without spec")?;
        if np.metadata.namespace != *ns
            || !matches(
                spec.pod_selector
                    .as_ref()
                    .and_then(|s| s.match_labels.as_ref()),
                Some(labels),
            )
        {
            return Err("the NetworkPolicy does not select pdgate's pods".into());
        }
        if !spec.policy_types.iter().flatten().any(|t| t == "Ingress") {
            return Err("the NetworkPolicy does not restrict ingress".into());
        }
        let (http, metrics) = (container_port(c, "http")?, container_port(c, "metrics")?);
        let mut open = BTreeSet::new();
        for rule in spec.ingress.iter().flatten() {
            let ports = rule.ports.as_deref().unwrap_or_default();
            if ports.is_empty() {
                return Err("an ingress rule opens every port".into());
            }
            for p in ports {
                let n = match p.port.as_ref().ok_or("a rule port without a port")? {
                    IntOrString::String(name) => container_port(c, name)?,
                    IntOrString::Int(n) => *n,
                };
                let peers = rule.from.as_deref().unwrap_or_default();
                let ok = if n == http {
                    peers.is_empty()
                } else {
                    n == metrics && from_monitoring(peers)
                };
                if !ok {
                    return Err(format!("port {n}: open to the wrong peers"));
                }
                open.insert(n);
            }
        }
        if !open.contains(&http) || !open.contains(&metrics) {
            return Err("the NetworkPolicy closes the front door or the metrics port".into());
        }
    }
    Ok(())
}
