//! The replica count from Kubernetes: pdgate's own pods, found by `admission.replica_selector`
//! (the selector of pdgate's own Service), counted, and this replica's index among them,
//! written to the pool's shared count (`pool::replicas`) after every change the watch sees.
//!
//! The rule ([`count`], pure, table-tested): a pod is *counted* while it may hold requests
//! that reach its engines through pdgate:
//! - `Ready=True` and not terminating (the Service's endpoints: the pods that get new
//!   requests), and
//! - terminating (`deletionTimestamp` set) while not finished (phase neither `Succeeded` nor
//!   `Failed`): it left the Service's endpoints, but it drains the requests it holds (up to
//!   `server.drain_secs`), so the others keep their smaller shares until its pod is gone.
//!   Counting it only by the endpoints would let the others grow their shares over the
//!   requests it still holds; counting it costs its share's slots for the length of its
//!   drain, not an overfilled rank.
//! - A pod not Ready and not terminating (starting, or failing its readiness probe) is not
//!   counted: it gets no new requests, and one that never becomes Ready (a crash loop) must
//!   not keep a share from the others.
//!
//! This replica's own pod (its name: `POD_NAME`, from the downward API, else the hostname,
//! which Kubernetes sets to the pod's name): when counted, the count is the counted pods and
//! the index its name's position among their sorted names (every replica sorts the same
//! names, so the indexes are distinct and the shares add up to the capacity); when not
//! counted (not Ready yet, or its name not found), the count is the counted pods plus
//! itself, and no index (no remainder slot): the others do not count it, so whatever it
//! holds is beyond their shares; the smallest share without an index keeps that least.
//!
//! Where: pdgate's own namespace (the service account's), else `discovery.namespace`, else
//! the client configuration's; the client is discovery's ([`super::client_from`]).
//!
//! Invariants:
//! - Until the first complete LIST the count stays unknown (no shares); a LIST or watch
//!   error keeps the last count (the watch backs off and starts over, as discovery's does).
//! - Every event the store applies is followed by one recount; the shared count changes
//!   (and is logged) only when the count or the index does. A replica joining or leaving
//!   changes every replica's share within one watch event.
//! - Nothing here runs on the request path: the request path reads the shared count.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use tokio_util::sync::CancellationToken;

use super::{selector, DiscoveryError, SERVICE_ACCOUNT_NAMESPACE};
use crate::config::{AdmissionConfig, DiscoveryConfig};
use crate::pool::replicas::{Count, Source};
use crate::pool::Pool;

/// What one pdgate pod says about the count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub name: String,
    /// Whether it is counted (see the module docs).
    pub counted: bool,
}

/// What `pod` says (`None`: a pod without a name, which the API server never sends).
pub fn seen(pod: &Pod) -> Option<Seen> {
    let name = pod.metadata.name.clone().filter(|n| !n.is_empty())?;
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let finished = matches!(phase, Some("Succeeded" | "Failed"));
    let counted = if pod.metadata.deletion_timestamp.is_some() {
        !finished
    } else {
        !finished && super::pod::is_ready(pod)
    };
    Some(Seen { name, counted })
}

/// The count and this replica's index from the pods seen and this replica's own pod name
/// (see the module docs).
pub fn count<'a>(
    pods: impl IntoIterator<Item = &'a Seen>,
    own: Option<&str>,
) -> (u32, Option<u32>) {
    let names: BTreeSet<&str> = pods
        .into_iter()
        .filter(|p| p.counted)
        .map(|p| p.name.as_str())
        .collect();
    let n = u32::try_from(names.len()).unwrap_or(u32::MAX);
    match own.and_then(|o| names.iter().position(|x| *x == o)) {
        Some(i) => (n, u32::try_from(i).ok()),
        None => (n.saturating_add(1), None),
    }
}

/// This replica's pod name: `POD_NAME` (the downward API), else `HOSTNAME`, else the
/// kernel's hostname (Kubernetes sets it to the pod's name).
pub fn own_pod_name() -> Option<String> {
    let clean = |s: String| Some(s.trim().to_string()).filter(|s| !s.is_empty());
    std::env::var("POD_NAME")
        .ok()
        .and_then(clean)
        .or_else(|| std::env::var("HOSTNAME").ok().and_then(clean))
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .and_then(clean)
        })
}

/// What to watch, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub selector: String,
    /// `discovery.namespace` (used outside a cluster: inside, the pod's own namespace wins).
    pub namespace: Option<String>,
}

/// The plan of `[admission] replica_selector` (`None`: off); a malformed selector is
/// refused, naming its flag.
pub fn plan(a: &AdmissionConfig, d: &DiscoveryConfig) -> Result<Option<Plan>, DiscoveryError> {
    let Some(s) = a.replica_selector() else {
        return Ok(None);
    };
    let parsed = selector::parse(s).map_err(|error| DiscoveryError::ReplicaSelector {
        selector: s.to_string(),
        error,
    })?;
    if parsed.selects_all() {
        return Err(DiscoveryError::ReplicaSelector {
            selector: s.to_string(),
            error: selector::SelectorError(
                "it selects every pod in the namespace; use pdgate's Service's selector".into(),
            ),
        });
    }
    Ok(Some(Plan {
        selector: s.to_string(),
        namespace: d.namespace.clone().filter(|n| !n.trim().is_empty()),
    }))
}

/// The namespace of pdgate's own pods: the pod's own, else `configured`, else the client's.
fn namespace(configured: Option<&str>, client: &kube::Client) -> String {
    std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| configured.map(str::to_string))
        .unwrap_or_else(|| client.default_namespace().to_string())
}

/// A running count of pdgate's replicas; stops when dropped (the last count stays).
pub struct ReplicaWatch {
    stop: CancellationToken,
    namespace: String,
}

impl ReplicaWatch {
    /// The namespace watched.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

impl Drop for ReplicaWatch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts counting with `client`; `own` is this replica's pod name ([`own_pod_name`]).
pub fn start(
    plan: Plan,
    client: kube::Client,
    own: Option<String>,
    pool: Arc<Pool>,
) -> ReplicaWatch {
    let ns = namespace(plan.namespace.as_deref(), &client);
    let api: Api<Pod> = Api::namespaced(client, &ns);
    let stop = CancellationToken::new();
    match &own {
        Some(name) => tracing::info!(
            namespace = %ns,
            replica_selector = %plan.selector,
            pod = %name,
            "counting pdgate replicas"
        ),
        None => tracing::warn!(
            namespace = %ns,
            replica_selector = %plan.selector,
            "counting pdgate replicas, but this replica's pod name is unknown (no POD_NAME, \
             no hostname): it counts itself apart and takes no remainder slot"
        ),
    }
    tokio::spawn(run(api, plan.selector, own, pool, stop.clone()));
    ReplicaWatch {
        stop,
        namespace: ns,
    }
}

async fn run(
    api: Api<Pod>,
    sel: String,
    own: Option<String>,
    pool: Arc<Pool>,
    stop: CancellationToken,
) {
    let cfg = watcher::Config::default().labels(&sel);
    let mut pods: HashMap<String, Seen> = HashMap::new();
    let mut building: Option<HashMap<String, Seen>> = None;
    let mut synced = false;
    let uid = |p: &Pod| p.metadata.uid.clone().filter(|u| !u.is_empty());
    loop {
        let stream = watcher::watcher(api.clone(), cfg.clone()).default_backoff();
        tokio::pin!(stream);
        loop {
            let ev = tokio::select! {
                _ = stop.cancelled() => return,
                ev = stream.next() => ev,
            };
            let changed = match ev {
                // The watcher's stream never ends; if it did, start over.
                None => break,
                Some(Ok(Event::Init)) => {
                    building = Some(HashMap::new());
                    false
                }
                Some(Ok(Event::InitApply(p))) => {
                    if let (Some(b), Some(u), Some(s)) = (building.as_mut(), uid(&p), seen(&p)) {
                        b.insert(u, s);
                    }
                    false
                }
                Some(Ok(Event::InitDone)) => {
                    pods = building.take().unwrap_or_default();
                    synced = true;
                    true
                }
                Some(Ok(Event::Apply(p))) => match (uid(&p), seen(&p)) {
                    (Some(u), Some(s)) => pods.insert(u, s.clone()) != Some(s),
                    _ => false,
                },
                Some(Ok(Event::Delete(p))) => uid(&p).is_some_and(|u| pods.remove(&u).is_some()),
                Some(Err(e)) => {
                    tracing::warn!(
                        replica_selector = %sel,
                        error = %e,
                        "pdgate pod watch failed; keeping the replica count as it is and retrying"
                    );
                    false
                }
            };
            if changed && synced {
                let (replicas, index) = count(pods.values(), own.as_deref());
                pool.replicas().set(Count {
                    replicas,
                    index,
                    source: Source::Discovery,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn s(name: &str, counted: bool) -> Seen {
        Seen {
            name: name.into(),
            counted,
        }
    }

    #[test]
    fn the_count_and_the_index_by_table() {
        // (pods seen, own name, count, index)
        type Case<'a> = (Vec<Seen>, Option<&'a str>, u32, Option<u32>);
        let cases: Vec<Case> = vec![
            // Alone and Ready: one replica, index 0.
            (vec![s("pdgate-a", true)], Some("pdgate-a"), 1, Some(0)),
            // Not listed yet (or not Ready): itself, no index.
            (vec![], Some("pdgate-a"), 1, None),
            (vec![s("pdgate-a", false)], Some("pdgate-a"), 1, None),
            // Its index is its place among the sorted names, whatever the order seen.
            (
                vec![
                    s("pdgate-c", true),
                    s("pdgate-a", true),
                    s("pdgate-b", true),
                ],
                Some("pdgate-b"),
                3,
                Some(1),
            ),
            // A pod not counted takes no index from the others.
            (
                vec![
                    s("pdgate-a", false),
                    s("pdgate-b", true),
                    s("pdgate-c", true),
                ],
                Some("pdgate-c"),
                2,
                Some(1),
            ),
            // Starting while two serve: it counts itself on top, without an index.
            (
                vec![
                    s("pdgate-a", true),
                    s("pdgate-b", true),
                    s("pdgate-c", false),
                ],
                Some("pdgate-c"),
                3,
                None,
            ),
            // Its name unknown, or not among the pods: counted apart.
            (
                vec![s("pdgate-a", true), s("pdgate-b", true)],
                None,
                3,
                None,
            ),
            (vec![s("pdgate-a", true)], Some("elsewhere"), 2, None),
            // A name seen twice (a pod recreated under its name) counts once.
            (
                vec![
                    s("pdgate-0", true),
                    s("pdgate-0", true),
                    s("pdgate-1", true),
                ],
                Some("pdgate-1"),
                2,
                Some(1),
            ),
        ];
        for (pods, own, n, index) in cases {
            assert_eq!(count(&pods, own), (n, index), "{pods:?} {own:?}");
        }
    }

    fn pod(ready: Option<bool>, terminating: bool, phase: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("pdgate-x".into()),
                deletion_timestamp: terminating
                    .then_some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
                ..Default::default()
            },
            status: Some(PodStatus {
                phase: Some(phase.into()),
                conditions: ready.map(|r| {
                    vec![PodCondition {
                        type_: "Ready".into(),
                        status: if r { "True" } else { "False" }.into(),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            spec: None,
        }
    }

    #[test]
    fn which_pods_count_by_table() {
        // (Ready condition, terminating, phase, counted)
        let cases = [
            (Some(true), false, "Running", true),
            (Some(false), false, "Running", false),
            (None, false, "Pending", false),
            // Draining: out of the Service, still holding requests.
            (Some(true), true, "Running", true),
            (Some(false), true, "Running", true),
            // Finished: holds nothing.
            (Some(false), true, "Succeeded", false),
            (Some(false), false, "Failed", false),
        ];
        for (ready, terminating, phase, counted) in cases {
            let got = seen(&pod(ready, terminating, phase)).map(|s| s.counted);
            assert_eq!(got, Some(counted), "{ready:?} {terminating} {phase}");
        }
        let mut nameless = pod(Some(true), false, "Running");
        nameless.metadata.name = None;
        assert_eq!(seen(&nameless), None);
    }

    #[test]
    fn the_plan_checks_the_selector_and_names_the_flag() {
        // (selector, namespace, Ok(selector as watched) or the error's words)
        type Case<'a> = (
            Option<&'a str>,
            Option<&'a str>,
            Result<Option<&'a str>, &'a str>,
        );
        let cases: &[Case] = &[
            (None, None, Ok(None)),
            (Some("  "), None, Ok(None)),
            (
                Some(" app.kubernetes.io/name=pdgate "),
                Some("llm"),
                Ok(Some("app.kubernetes.io/name=pdgate")),
            ),
            (
                Some("app in (pdgate"),
                None,
                Err("--replica-selector (admission.replica_selector)"),
            ),
        ];
        for (sel, ns, want) in cases {
            let a = AdmissionConfig {
                replica_selector: sel.map(str::to_string),
                ..AdmissionConfig::default()
            };
            let d = DiscoveryConfig {
                namespace: ns.map(str::to_string),
                ..DiscoveryConfig::default()
            };
            match (plan(&a, &d), want) {
                (Ok(p), Ok(w)) => {
                    assert_eq!(p.as_ref().map(|p| p.selector.as_str()), *w);
                    if let Some(p) = p {
                        assert_eq!(p.namespace.as_deref(), *ns);
                    }
                }
                (Err(e), Err(w)) => assert!(e.to_string().contains(w), "{e}"),
                (got, _) => panic!("{sel:?}: {got:?}"),
            }
        }
    }
}
