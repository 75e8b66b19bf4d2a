//! One pod watcher per role: kube's `runtime::watcher` (LIST, then WATCH from the list's
//! resourceVersion, bookmarks on, a fresh LIST after 410 Gone) feeding a store of the
//! role's pods keyed by UID, and waking the reconciler after every change.
//!
//! Invariants:
//! - The store is replaced only by a complete LIST (between the watcher's `Init` and
//!   `InitDone`); a LIST or watch error leaves it as it was, so errors never remove
//!   workers. Errors are logged, counted, and the stream backs off (kube's default
//!   backoff: 0.8 s doubling to 30 s, with jitter).
//! - The store follows the watch alone: a LIST happens at start and when the watch must
//!   start over (410 Gone, a broken stream), never on a timer, so a replica's cost on the
//!   API server does not grow with the cluster's pod count every minute. (The reconciler
//!   re-reads the store on its own timer, `discovery.resync_secs`.)
//! - A store is `synced` after its first complete LIST; the reconciler waits for every
//!   role's store to be synced, so that a pod matching both selectors is never added as
//!   one role before the other role's LIST shows it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::metrics::{Stats, LAST_SYNC};
use crate::telemetry::unix_now;
use crate::types::{role_index, Role};

/// One role's pods, by UID.
#[derive(Debug, Default)]
pub struct RoleStore {
    pub pods: HashMap<String, Arc<Pod>>,
    /// Pods of a LIST in progress.
    building: Option<HashMap<String, Arc<Pod>>>,
    pub synced: bool,
    /// When the last complete LIST ended (Unix seconds).
    pub listed_at: Option<f64>,
}

/// The stores of both roles, shared by the watchers (writers) and the reconciler.
#[derive(Debug, Default)]
pub struct Stores {
    pub roles: Mutex<[RoleStore; 3]>,
}

fn uid(pod: &Pod) -> Option<String> {
    pod.metadata.uid.clone().filter(|u| !u.is_empty())
}

impl Stores {
    fn with<T>(&self, role: Role, f: impl FnOnce(&mut RoleStore) -> T) -> T {
        let mut g = self.roles.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut g[role_index(role)])
    }

    /// Applies one watcher event; true when the store changed in a way the reconciler must
    /// see.
    pub fn apply(&self, role: Role, ev: Event<Pod>) -> bool {
        self.with(role, |s| match ev {
            Event::Init => {
                s.building = Some(HashMap::new());
                false
            }
            Event::InitApply(p) => {
                if let (Some(b), Some(u)) = (s.building.as_mut(), uid(&p)) {
                    b.insert(u, Arc::new(p));
                }
                false
            }
            Event::InitDone => {
                s.pods = s.building.take().unwrap_or_default();
                s.synced = true;
                s.listed_at = Some(unix_now());
                true
            }
            Event::Apply(p) => match uid(&p) {
                Some(u) => {
                    s.pods.insert(u, Arc::new(p));
                    true
                }
                None => false,
            },
            Event::Delete(p) => match uid(&p) {
                Some(u) => s.pods.remove(&u).is_some(),
                None => false,
            },
        })
    }

    /// Whether every role in `roles` has completed a LIST.
    pub fn synced(&self, roles: &[Role]) -> bool {
        let g = self.roles.lock().unwrap_or_else(|e| e.into_inner());
        roles.iter().all(|r| g[role_index(*r)].synced)
    }

    /// The oldest of the roles' last complete LISTs.
    pub fn last_sync(&self, roles: &[Role]) -> Option<f64> {
        let g = self.roles.lock().unwrap_or_else(|e| e.into_inner());
        roles
            .iter()
            .map(|r| g[role_index(*r)].listed_at)
            .try_fold(f64::INFINITY, |acc, t| t.map(|t| acc.min(t)))
    }

    /// Every pod of either role with the roles whose selector it matched.
    pub fn observed(&self) -> HashMap<String, (Arc<Pod>, super::pod::Matched)> {
        let g = self.roles.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: HashMap<String, (Arc<Pod>, super::pod::Matched)> = HashMap::new();
        for (uid, pod) in &g[0].pods {
            let e = out
                .entry(uid.clone())
                .or_insert_with(|| (pod.clone(), Default::default()));
            e.1.prefill = true;
        }
        for (uid, pod) in &g[1].pods {
            let e = out
                .entry(uid.clone())
                .or_insert_with(|| (pod.clone(), Default::default()));
            e.1.decode = true;
        }
        for (uid, pod) in &g[2].pods {
            let e = out
                .entry(uid.clone())
                .or_insert_with(|| (pod.clone(), Default::default()));
            e.1.regular = true;
        }
        out
    }
}

/// What one role's watcher needs.
pub struct RoleWatch {
    pub role: Role,
    pub api: Api<Pod>,
    pub selector: String,
    pub roles: Vec<Role>,
}

/// Runs a role's watcher until `stop`.
pub async fn run(
    w: RoleWatch,
    stores: Arc<Stores>,
    wake: Arc<Notify>,
    stats: Arc<Stats>,
    stop: CancellationToken,
) {
    let cfg = watcher::Config::default().labels(&w.selector);
    let role = w.role;
    loop {
        let stream = watcher::watcher(w.api.clone(), cfg.clone()).default_backoff();
        tokio::pin!(stream);
        let mut inits = 0u32;
        loop {
            let ev = tokio::select! {
                _ = stop.cancelled() => return,
                ev = stream.next() => ev,
            };
            match ev {
                // The watcher's stream never ends; if it did, start over.
                None => break,
                Some(Ok(ev)) => {
                    if matches!(ev, Event::Init) {
                        inits += 1;
                        if inits > 1 {
                            tracing::info!(role = %role, "pod watch starts over with a fresh LIST");
                            stats.watch_restart(role);
                        }
                    }
                    let done = matches!(ev, Event::InitDone);
                    if stores.apply(role, ev) {
                        if done {
                            stats
                                .lists
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if let Some(t) = stores.last_sync(&w.roles) {
                                metrics::gauge!(LAST_SYNC).set(t);
                            }
                        }
                        wake.notify_one();
                    }
                }
                Some(Err(e)) => {
                    stats.watch_error(role);
                    tracing::warn!(
                        role = %role,
                        selector = %w.selector,
                        error = %e,
                        "pod watch failed; keeping the workers as they are and retrying"
                    );
                }
            }
        }
    }
}
