//! Building a pool snapshot from the master list: each worker's view, its handoff group and
//! model, the routable lists per role and model (one pass, on the single writer's side;
//! the request path only reads the result).

use super::*;

/// The snapshot of `workers` (the pool's master list, in order) as version `version`.
pub(super) fn snapshot(workers: &[Worker], version: u64) -> Snapshot {
    let mut s = Snapshot {
        version,
        ..Snapshot::default()
    };
    let mut grouping = groups::Grouping::default();
    for w in workers {
        let (id, role, facts) = (w.shared.id, w.shared.role, &w.facts);
        let key = HandoffKey::of(facts.info.as_deref(), facts.model_override.as_deref());
        // A regular worker hands off nothing: it joins its model, in no handoff group.
        let (group, model, regular_model) = if role == Role::Regular {
            let (ix, name) = grouping.place_regular(key.model.as_deref());
            (groups::NO_GROUP, name, ix)
        } else {
            let (group, model) = grouping.place(key);
            (group, model, None)
        };
        // Out of rotation whatever its health: breaker open, refused, or draining.
        let out =
            w.shared.breaker.state().is_out() || facts.refusal().is_some() || facts.draining();
        let view = WorkerView {
            shared: w.shared.clone(),
            per_rank: w.per_rank.clone(),
            facts: facts.clone(),
            group,
            model,
            lost: w.shared.lost_tx.subscribe(),
        };
        match role {
            Role::Prefill => {
                if facts.healthy && !out && facts.layout.is_some() {
                    let ranks: Vec<DpRank> = facts
                        .ranks
                        .iter()
                        .enumerate()
                        .filter(|(_, st)| **st == RankReadiness::Ready)
                        .map(|(r, _)| r as DpRank)
                        .collect();
                    if !ranks.is_empty() {
                        let r = Routable { worker: id, ranks };
                        grouping.add(group, 0, Some(&r));
                        s.prefill_routable.push(r);
                    } else {
                        grouping.add(group, 0, None);
                    }
                } else {
                    grouping.add(group, 0, None);
                }
                s.prefills.push(view);
            }
            Role::Decode => {
                if facts.healthy && !out {
                    let r = Routable {
                        worker: id,
                        ranks: (0..view.effective_dp()).collect(),
                    };
                    grouping.add(group, 1, Some(&r));
                    s.decode_routable.push(r);
                } else {
                    grouping.add(group, 1, None);
                }
                s.decodes.push(view);
            }
            Role::Regular => {
                if facts.healthy && !out {
                    let r = Routable {
                        worker: id,
                        ranks: (0..view.effective_dp()).collect(),
                    };
                    grouping.add_regular(regular_model, Some(&r));
                    s.regular_routable.push(r);
                } else {
                    grouping.add_regular(regular_model, None);
                }
                s.regulars.push(view);
            }
        }
    }
    s.prefill_pairable = grouping.finish();
    s.groups = grouping.groups;
    s.models = grouping.models;
    s
}
