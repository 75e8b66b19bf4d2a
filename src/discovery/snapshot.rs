//! One look at the pods discovery would see, without watching: one LIST per role with its
//! selector, each pod classified by the same rules as the watched ones
//! ([`super::pod::classify`], the same [`super::PodSettings`]). `pdgate check` reports it.
//!
//! Invariants:
//! - Read-only and one-shot: LISTs only (paged like kube's watcher, [`PAGE`] pods a page,
//!   at most [`MAX_PAGES`] pages a role), no watch, nothing added to any fleet.
//! - A pod is keyed as the watcher's store keys it (UID; namespace/name when it has none),
//!   and its [`Matched`] says which of the LISTs returned it, so a pod matching both
//!   selectors is seen as such.
//! - The first failed LIST is the answer: a partial view is never returned.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;

use super::pod::{classify, pod_ref, Matched, PodState};
use super::{pods_api, scope, DiscoveryError, Plan};
use crate::pool::PodRef;
use crate::types::Role;

/// Pods a LIST page asks for (kube's watcher asks for as many).
pub const PAGE: u32 = 500;
/// Pages a role's LIST may take (500 000 pods) before it is cut off as a runaway.
pub const MAX_PAGES: usize = 1000;

/// One pod a selector matched, and what it means for the router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundPod {
    pub pod: PodRef,
    pub matched: Matched,
    pub state: PodState,
}

/// What the LISTs found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The namespace listed, or `*` for all.
    pub scope: String,
    /// By namespace, then name.
    pub pods: Vec<FoundPod>,
}

impl Found {
    /// How many pods `role`'s selector matched (a pod matching both counts for both).
    pub fn matched(&self, role: Role) -> usize {
        self.pods.iter().filter(|p| p.matched.has(role)).count()
    }
}

async fn list_role(
    api: &kube::Api<Pod>,
    role: Role,
    selector: &str,
) -> Result<Vec<Pod>, DiscoveryError> {
    let err = |error| DiscoveryError::List {
        role,
        selector: selector.to_string(),
        error,
    };
    let mut lp = ListParams::default().labels(selector).limit(PAGE);
    let mut out = Vec::new();
    for _ in 0..MAX_PAGES {
        let page = api.list(&lp).await.map_err(err)?;
        out.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => lp = lp.continue_token(&token),
            None => return Ok(out),
        }
    }
    Err(DiscoveryError::TooManyPods {
        role,
        selector: selector.to_string(),
        pods: out.len(),
    })
}

/// Lists the pods of every role of `plan` once, with `client`, and classifies them.
pub async fn snapshot(client: kube::Client, plan: &Plan) -> Result<Found, DiscoveryError> {
    let scope = scope(plan, &client);
    let api = pods_api(client, &scope);
    let mut seen: BTreeMap<String, (Pod, Matched)> = BTreeMap::new();
    for role in plan.roles() {
        let Some(selector) = plan.selector(role) else {
            continue;
        };
        for pod in list_role(&api, role, selector).await? {
            let r = pod_ref(&pod);
            let key = if r.uid.is_empty() {
                format!("{}/{}", r.namespace, r.name)
            } else {
                r.uid
            };
            let e = seen.entry(key).or_insert_with(|| (pod, Matched::default()));
            e.1.set(role);
        }
    }
    let mut pods: Vec<FoundPod> = seen
        .into_values()
        .map(|(pod, matched)| FoundPod {
            pod: pod_ref(&pod),
            matched,
            state: classify(&pod, matched, &plan.pod),
        })
        .collect();
    pods.sort_by(|a, b| {
        let (a, b) = (&a.pod, &b.pod);
        (&a.namespace, &a.name, &a.uid).cmp(&(&b.namespace, &b.name, &b.uid))
    });
    Ok(Found { scope, pods })
}
