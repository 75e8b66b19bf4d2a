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

fn network_policies(
    objs: &[Value],
    ns: &Option<String>,
    labels: &Labels,
    c: &Container,
) -> Res<()> {
    let from_monitoring = |peers: &[NetworkPolicyPeer]| {
        let set = |s: &Option<LabelSelector>| {
            s.as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .is_some_and(|l| !l.is_empty())
        };
        !peers.is_empty()
            && peers
                .iter()
                .all(|p| set(&p.namespace_selector) && set(&p.pod_selector) && p.ip_block.is_none())
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
