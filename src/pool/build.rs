//! Building a pool snapshot from the master list: each worker's view, its handoff group and
//! model, the routable lists per role and model (one pass, on the single writer's side;
//! the request path only reads the result).

use super::*;

/// The snapshot of `workers` (the pool's master list, in order) as version `version`.
pub(super) fn snapshot(workers: &[WorkerState], version: u64) -> Snapshot {
    let mut s = Snapshot {
        version,
        ..Snapshot::default()
    };
    let mut grouping = groups::Grouping::default();
    for w in workers {
        let key = HandoffKey::of(w.info.as_ref(), w.model.as_deref());
        // A regular worker hands off nothing: it joins its model, in no handoff group.
        let (group, model, regular_model) = if w.role == Role::Regular {
            let (ix, name) = grouping.place_regular(key.model.as_deref());
            (groups::NO_GROUP, name, ix)
        } else {
            let (group, model) = grouping.place(key);
            (group, model, None)
        };
        let view = WorkerView {
            id: w.id,
            role: w.role,
            url: w.url.clone(),
            source: w.source.clone(),
            draining: w.drain.any(),
            leaving: w.drain.leaving,
            healthy: w.healthy,
            dp_size: w.dp_size,
            loads: w.loads.clone(),
            engine_load: w.engine_load.clone(),
            capacity: w.capacity.clone(),
            bootstrap: w.bootstrap.clone(),
            layout: w.layout.clone(),
            ranks: w.ranks.clone(),
            fresh: w.fresh.clone(),
            refresh: w.refresh.clone(),
            lost: w.lost_tx.subscribe(),
            breaker: w.breaker.clone(),
            conns: w.conns.clone(),
            refused: w.refused.clone().or_else(|| w.bootstrap_refused.clone()),
            probes: w.probes.clone(),
            progress: w.progress.clone(),
            stats: w.stats.clone(),
            incremental_stream: w
                .info
                .as_ref()
                .and_then(|i| i.incremental_streaming_output)
                .unwrap_or(false),
            group,
            model,
        };
        // Out of rotation whatever its health: breaker open, refused, or draining.
        let out = w.breaker.state().is_out()
            || w.refused.is_some()
            || w.bootstrap_refused.is_some()
            || w.drain.any();
        match w.role {
            Role::Prefill => {
                if w.healthy && !out && w.layout.is_some() {
                    let ranks: Vec<DpRank> = w
                        .ranks
                        .iter()
                        .enumerate()
                        .filter(|(_, st)| **st == RankReadiness::Ready)
                        .map(|(r, _)| r as DpRank)
                        .collect();
                    if !ranks.is_empty() {
                        let r = Routable {
                            worker: w.id,
                            ranks,
                        };
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
                if w.healthy && !out {
                    let r = Routable {
                        worker: w.id,
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
                if w.healthy && !out {
                    let r = Routable {
                        worker: w.id,
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
