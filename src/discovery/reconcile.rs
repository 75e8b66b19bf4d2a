//! Level-triggered reconcile: the pods the watchers see, classified ([`super::pod`]),
//! against the workers discovery owns in the fleet, keyed by pod UID. Run after every
//! batch of watch events (coalesced), after every LIST, and when a removal ends.
//!
//! Invariants:
//! - Discovery only ever drains, undrains or removes workers it added itself (its own UID
//!   map); a static or admin worker is never touched, and a pod whose URL is already such
//!   a worker's is logged and skipped.
//! - A serving pod (Running, IP, `Ready=True`) has exactly one worker; an IP, port,
//!   bootstrap-port or role change replaces it (the old one drains, the new one is added).
//! - `Ready=False` drains the worker at once (in-flight requests finish); `Ready=True`
//!   again with the same endpoint undrains it.
//! - A terminating pod's worker drains and is removed when nothing is in flight or at the
//!   pod's grace period; a pod gone from the store (deleted, or missing from a relist) is
//!   removed the same way within `default_grace`.
//! - A new worker is added only for a ready pod; it becomes routable only after its
//!   `/server_info` answered and its first health check passed (the fleet's rule).
//! - Every pod's state is logged once per change, with the reason when it is not used.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::Notify;

use super::metrics::{Stats, PODS, WORKERS};
use super::pod::{classify, pod_ref, Endpoint, Matched, PodSettings, PodState, STATE_LABELS};
use crate::fleet::{Fleet, FleetError, WorkerSpec};
use crate::pool::{DrainBy, PodRef, WorkerSource};
use crate::types::{Role, WorkerId};

/// A worker discovery added for a pod.
#[derive(Debug)]
struct Tracked {
    pod: PodRef,
    ep: Endpoint,
    id: WorkerId,
    /// Drained because the pod is not ready.
    drained: bool,
}

/// Discovery's side of the fleet.
pub struct Reconciler {
    fleet: Arc<Fleet>,
    settings: PodSettings,
    tracked: HashMap<String, Tracked>,
    /// Workers being drained for removal.
    removing: HashSet<(Role, WorkerId)>,
    /// The last state logged per pod UID.
    logged: HashMap<String, String>,
    stats: Arc<Stats>,
    wake: Arc<Notify>,
}

/// What one pass left undone: something to retry soon.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub pending: bool,
}

impl Reconciler {
    pub fn new(
        fleet: Arc<Fleet>,
        settings: PodSettings,
        stats: Arc<Stats>,
        wake: Arc<Notify>,
    ) -> Reconciler {
        Reconciler {
            fleet,
            settings,
            tracked: HashMap::new(),
            removing: HashSet::new(),
            logged: HashMap::new(),
            stats,
            wake,
        }
    }

    /// One pass over every observed pod (by UID).
    pub fn reconcile(&mut self, observed: &HashMap<String, (Arc<Pod>, Matched)>) -> Pass {
        self.stats.reconciles.fetch_add(1, Ordering::Relaxed);
        let mut pass = Pass::default();
        let states: HashMap<&String, (PodRef, PodState)> = observed
            .iter()
            .map(|(uid, (pod, m))| (uid, (pod_ref(pod), classify(pod, *m, &self.settings))))
            .collect();
        self.forget_vanished_workers();
        self.update_tracked(&states);
        let mut taken: HashMap<&String, String> = HashMap::new();
        for (uid, (pod, state)) in &states {
            if let PodState::Ready(ep) = state {
                if !self.tracked.contains_key(*uid) {
                    match self.add(uid, pod, ep) {
                        Added::Yes | Added::Waiting => {}
                        Added::Pending => pass.pending = true,
                        Added::Taken(why) => {
                            taken.insert(*uid, why);
                        }
                    }
                }
            }
        }
        self.log_changes(&states, &taken);
        self.export(&states, taken.len());
        pass
    }

    /// Drops tracked workers the pool no longer has (removed by someone else) and finished
    /// removals.
    fn forget_vanished_workers(&mut self) {
        let snap = self.fleet.pool().load();
        self.removing
            .retain(|(role, id)| snap.worker(*role, *id).is_some());
        self.tracked.retain(|uid, t| {
            let there = snap.worker(t.ep.role, t.id).is_some();
            if !there {
                tracing::info!(
                    pod = %t.pod.name, uid = %uid, worker = %t.ep.url,
                    "the worker of a discovered pod was removed from outside discovery"
                );
            }
            there
        });
    }

    /// Drains, undrains or removes the workers discovery has, as their pods say.
    fn update_tracked(&mut self, states: &HashMap<&String, (PodRef, PodState)>) {
        let default_grace = self.settings.default_grace;
        let uids: Vec<String> = self.tracked.keys().cloned().collect();
        for uid in uids {
            let Some(t) = self.tracked.get_mut(&uid) else {
                continue;
            };
            let remove_within = match states.get(&uid).map(|(_, s)| s) {
                None => Some((default_grace, "the pod is gone")),
                Some(PodState::Terminating { grace }) => Some((*grace, "the pod is terminating")),
                Some(PodState::Ready(ep)) if *ep == t.ep => {
                    if t.drained {
                        t.drained = false;
                        let _ = self
                            .fleet
                            .set_drain(t.ep.role, t.id, DrainBy::Unready, false);
                    }
                    None
                }
                Some(PodState::NotReady(ep)) if *ep == t.ep => {
                    if !t.drained {
                        t.drained = true;
                        let _ = self
                            .fleet
                            .set_drain(t.ep.role, t.id, DrainBy::Unready, true);
                    }
                    None
                }
                Some(PodState::Ready(_) | PodState::NotReady(_)) => {
                    Some((default_grace, "the pod's endpoint changed"))
                }
                Some(PodState::Ignored(_)) => Some((default_grace, "the pod is no longer usable")),
            };
            if let Some((within, why)) = remove_within {
                if let Some(t) = self.tracked.remove(&uid) {
                    self.remove(t, within, why);
                }
            }
        }
    }

    fn remove(&mut self, t: Tracked, within: Duration, why: &str) {
        tracing::info!(
            pod = %t.pod.name, namespace = %t.pod.namespace, uid = %t.pod.uid,
            role = %t.ep.role, worker = %t.ep.url, within_secs = within.as_secs(),
            "{why}: draining and removing its worker"
        );
        match self.fleet.remove(t.ep.role, t.id, within) {
            Ok(done) => {
                self.removing.insert((t.ep.role, t.id));
                let wake = self.wake.clone();
                tokio::spawn(async move {
                    let _ = done.await;
                    // A pod waiting for this URL can now be added.
                    wake.notify_one();
                });
            }
            Err(FleetError::NotFound { .. }) | Err(FleetError::Exists { .. }) => {}
        }
    }

    fn add(&mut self, uid: &str, pod: &PodRef, ep: &Endpoint) -> Added {
        if let Some(id) = self.fleet.find(ep.role, &ep.url) {
            if self.removing.contains(&(ep.role, id)) {
                // The previous worker at this URL (an earlier pod, or this pod before its
                // endpoint changed back) is still draining; added once it is gone.
                return Added::Waiting;
            }
            let snap = self.fleet.pool().load();
            let owner = match snap.worker(ep.role, id).map(|w| w.shared.source.clone()) {
                Some(WorkerSource::Discovered(other)) => format!("pod {}", other.name),
                Some(WorkerSource::Static) => "a static worker".to_string(),
                Some(WorkerSource::Admin) => "a worker added by the admin API".to_string(),
                None => return Added::Pending,
            };
            return Added::Taken(format!("its URL {} is already {owner}'s", ep.url));
        }
        let spec = WorkerSpec {
            role: ep.role,
            url: ep.url.clone(),
            bootstrap_port: ep.bootstrap_port,
            bootstrap_host: None,
            source: WorkerSource::Discovered(pod.clone()),
            model: ep.model.clone(),
        };
        match self.fleet.add(spec) {
            Ok(id) => {
                tracing::info!(
                    pod = %pod.name, namespace = %pod.namespace, uid = %uid,
                    worker_id = %crate::types::WorkerIdent::new(ep.role, id), worker_url = %ep.url,
                    bootstrap_port = ?ep.bootstrap_port,
                    "discovered pod added; routable once its server info and health check pass"
                );
                self.tracked.insert(
                    uid.to_string(),
                    Tracked {
                        pod: pod.clone(),
                        ep: ep.clone(),
                        id,
                        drained: false,
                    },
                );
                Added::Yes
            }
            // Someone added the URL between the look-up and the add: look again soon.
            Err(_) => Added::Pending,
        }
    }

    fn log_changes(
        &mut self,
        states: &HashMap<&String, (PodRef, PodState)>,
        taken: &HashMap<&String, String>,
    ) {
        self.logged.retain(|uid, _| states.contains_key(uid));
        for (uid, (pod, state)) in states {
            let (text, warn) = match (taken.get(uid), state) {
                (Some(why), _) => (format!("not used: {why}"), true),
                (None, PodState::Ready(ep)) => (format!("ready at {}", ep.url), false),
                (None, PodState::NotReady(ep)) => (
                    format!("not ready (at {}): takes no new requests", ep.url),
                    false,
                ),
                (None, PodState::Terminating { grace }) => {
                    (format!("terminating (grace {}s)", grace.as_secs()), false)
                }
                (None, PodState::Ignored(why)) => {
                    (format!("not used: {why}"), why.is_misconfiguration())
                }
            };
            if self.logged.get(*uid) == Some(&text) {
                continue;
            }
            if warn {
                tracing::warn!(pod = %pod.name, namespace = %pod.namespace, uid = %uid, "discovered pod {text}");
            } else {
                tracing::info!(pod = %pod.name, namespace = %pod.namespace, uid = %uid, "discovered pod {text}");
            }
            self.logged.insert((*uid).clone(), text);
        }
    }

    fn export(&self, states: &HashMap<&String, (PodRef, PodState)>, taken: usize) {
        let mut counts: HashMap<&'static str, usize> = HashMap::new();
        for (_, s) in states.values() {
            *counts.entry(s.label()).or_default() += 1;
        }
        // A ready pod whose URL is taken counts as `url_taken`, not `ready`.
        if let Some(r) = counts.get_mut("ready") {
            *r = r.saturating_sub(taken);
        }
        counts.insert("url_taken", taken);
        for label in STATE_LABELS {
            let n = counts.get(label).copied().unwrap_or(0);
            metrics::gauge!(PODS, "state" => *label).set(n as f64);
        }
        for role in [Role::Prefill, Role::Decode, Role::Regular] {
            let n = self.tracked.values().filter(|t| t.ep.role == role).count();
            metrics::gauge!(WORKERS, "role" => role.as_str()).set(n as f64);
        }
    }
}

enum Added {
    Yes,
    /// Waits for a draining worker at the same URL to be removed (a removal wakes us).
    Waiting,
    /// Try again soon.
    Pending,
    /// The URL belongs to a worker discovery does not own.
    Taken(String),
}
