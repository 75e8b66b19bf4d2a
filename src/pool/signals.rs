//! What an autoscaler needs to size each model's prefill and decode pools, per model:
//! decode slots used and their capacity (`pdgate_decode_slots_used`,
//! `pdgate_decode_slots_capacity`), the prefill engines its traffic keeps busy
//! (`pdgate_prefill_engines_busy`, `avg(P)` below) and a suggested prefill:decode ratio
//! (`pdgate_suggested_prefill_decode_ratio`).
//! docs/scaling.md says which signal scales which pool.
//!
//! Why a sampler: slots need the `[capacity]` settings (which the snapshot does not hold)
//! and the ratio needs averages over time, so one task per router ([`spawn`]) looks at the
//! snapshot every [`TICK`], off the request path (it reads the atomics the request path
//! moves anyway, and adds none), and publishes the figures into the pool, which renders
//! them at scrape time ([`Pool::signals`]). A model that leaves the pool leaves the next
//! publication, so its series leave the scrape (the recorder could not unregister them).
//!
//! The suggested ratio, "prefill engines needed per decode engine at the current traffic":
//!
//! ```text
//! P(t)  = Σ over the model's prefill workers of (DP ranks busy at t ÷ DP ranks)
//! D(t)  = Σ over the model's decode DP ranks of the slots in use at t (occupancy)
//! S     = slots per decode engine: the mean, over the model's routable decodes whose
//!         every rank's capacity is known, of the sum of their ranks' capacities
//! ratio = avg(P) ÷ (avg(D) ÷ S)
//! ```
//!
//! `avg` is an exponentially weighted average over [`WINDOW`], sampled every [`TICK`]. A
//! prefill rank is busy while the engine's last load report shows requests on it (running
//! or waiting, every replica's) or this replica has a leg in flight there; a decode rank's
//! occupancy is `pool::capacity`'s (the engine's running + waiting corrected by this
//! replica's reservations since, never less than its own). So `avg(P)` is the prefill
//! engines the traffic keeps busy and `avg(D) ÷ S` the decode engines its generations
//! fill; their quotient does not depend on how many engines run now, as long as neither
//! pool is saturated. A saturated prefill is busy all the time whatever the excess, so the
//! ratio is then a floor (the prefill backlog says by how much it is short); a saturated
//! decode shows its waiting requests in `D`, so that side keeps counting. No ratio while
//! no decode slot has been in use or no decode's capacity is known (`S` unknown).
//!
//! Invariants: the sampler never locks what the request path touches (a snapshot load and
//! relaxed atomic reads); publication is one `ArcSwap` store; with no worker it publishes
//! an empty list (no series); the figures of one publication come from one snapshot.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::config::LiveConfig;
use crate::telemetry::{self, Exposition};

use super::capacity::Limits;
use super::{Pool, Snapshot};

/// How often the sampler looks.
pub const TICK: Duration = Duration::from_millis(500);

/// The time constant of the averages behind the suggested ratio: long enough to smooth
/// the bursts of a few requests, short against an autoscaler's minutes.
pub const WINDOW: Duration = Duration::from_secs(60);

/// One model's pools at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Prefill engines busy: Σ over the model's prefill workers of busy ranks ÷ ranks.
    pub prefill_busy_engines: f64,
    /// Decode slots in use over all the model's decode ranks (occupancy).
    pub decode_slots_used: u64,
    /// Decode slots of the model's routable decode ranks whose capacity is known.
    pub decode_slots_total: u64,
    /// The mean slots of one decode engine (see the module docs); `None`: unknown.
    pub slots_per_decode_engine: Option<f64>,
}

/// Prefill engines needed per decode engine: `prefill_busy_engines ÷ (decode_slots_used ÷
/// slots_per_decode_engine)`; `None` when there is no decode work or no engine size.
pub fn suggested_ratio(
    prefill_busy_engines: f64,
    decode_slots_used: f64,
    slots_per_decode_engine: f64,
) -> Option<f64> {
    let ok = |x: f64| x.is_finite() && x > 0.0;
    if !ok(decode_slots_used) || !ok(slots_per_decode_engine) || !prefill_busy_engines.is_finite() {
        return None;
    }
    Some(prefill_busy_engines.max(0.0) * slots_per_decode_engine / decode_slots_used)
}

/// What one publication says of one model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSignals {
    pub model: Arc<str>,
    pub decode_slots_used: u64,
    pub decode_slots_total: u64,
    /// The average prefill engines busy (`avg(P)`).
    pub prefill_busy: f64,
    /// `None`: not known yet (no sample).
    pub ratio: Option<f64>,
}

/// Each model's [`Work`] in `snap`, under the capacity `limits`, in the snapshot's model
/// order. Workers whose engines name no model are in none.
pub fn work(snap: &Snapshot, limits: &Limits) -> Vec<(Arc<str>, Work)> {
    snap.models
        .iter()
        .map(|m| {
            let of_model = |w: &&super::WorkerView| w.model.as_deref() == Some(&*m.name);
            let mut work = Work::default();
            for w in snap.prefills.iter().filter(of_model) {
                let ranks = w.per_rank.loads.len().max(1);
                let busy = (0..ranks)
                    .filter(|&r| {
                        let own = w
                            .per_rank
                            .loads
                            .get(r)
                            .map_or(0, |n| n.load(std::sync::atomic::Ordering::Relaxed));
                        own > 0 || w.engine_load(r as u32) > 0
                    })
                    .count();
                work.prefill_busy_engines += busy as f64 / ranks as f64;
            }
            let mut engines = 0u64;
            let mut engine_slots = 0u64;
            for w in snap.decodes.iter().filter(of_model) {
                let caps = &w.per_rank.capacity;
                work.decode_slots_used += caps.iter().map(|c| c.occupancy()).sum::<u64>();
                let Some(routable) = m.decode_routable.iter().find(|r| r.worker == w.shared.id)
                else {
                    continue;
                };
                work.decode_slots_total += routable
                    .ranks
                    .iter()
                    .filter_map(|&r| caps.get(r as usize))
                    .map(|c| c.limit(limits))
                    .sum::<u64>();
                let each: Vec<u64> = caps.iter().map(|c| c.limit(limits)).collect();
                if !each.is_empty() && each.iter().all(|&c| c > 0) {
                    engines += 1;
                    engine_slots += each.iter().sum::<u64>();
                }
            }
            if engines > 0 {
                work.slots_per_decode_engine = Some(engine_slots as f64 / engines as f64);
            }
            (m.name.clone(), work)
        })
        .collect()
}

/// The sampler's averages per model (its own state: only the sampler touches it).
#[derive(Debug, Default)]
pub struct Averages {
    /// (average prefill engines busy, average decode slots used) per model.
    by_model: HashMap<Arc<str>, (f64, f64)>,
}

impl Averages {
    /// Folds one sample taken `dt` after the previous one into the averages and returns
    /// what to publish. A model seen for the first time starts at its sample; a model no
    /// longer in `work` is forgotten.
    pub fn sample(&mut self, work: &[(Arc<str>, Work)], dt: Duration) -> Vec<ModelSignals> {
        let alpha = 1.0 - (-dt.as_secs_f64() / WINDOW.as_secs_f64()).exp();
        let mut next = HashMap::with_capacity(work.len());
        let out = work
            .iter()
            .map(|(model, w)| {
                let now = (w.prefill_busy_engines, w.decode_slots_used as f64);
                let avg = match self.by_model.get(model) {
                    Some(&(p, d)) => (p + alpha * (now.0 - p), d + alpha * (now.1 - d)),
                    None => now,
                };
                next.insert(model.clone(), avg);
                ModelSignals {
                    model: model.clone(),
                    decode_slots_used: w.decode_slots_used,
                    decode_slots_total: w.decode_slots_total,
                    prefill_busy: avg.0,
                    ratio: w
                        .slots_per_decode_engine
                        .and_then(|s| suggested_ratio(avg.0, avg.1, s)),
                }
            })
            .collect();
        self.by_model = next;
        out
    }
}

/// Writes the last publication's series.
pub(super) fn write(signals: &[ModelSignals], out: &mut Exposition) {
    out.family(telemetry::DECODE_SLOTS_USED);
    for s in signals {
        out.sample(&[("model", &*s.model)], s.decode_slots_used);
    }
    out.family(telemetry::DECODE_SLOTS_CAPACITY);
    for s in signals {
        out.sample(&[("model", &*s.model)], s.decode_slots_total);
    }
    out.family(telemetry::PREFILL_ENGINES_BUSY);
    for s in signals {
        out.sample(&[("model", &*s.model)], s.prefill_busy);
    }
    out.family(telemetry::SUGGESTED_PREFILL_DECODE_RATIO);
    for s in signals {
        if let Some(r) = s.ratio {
            out.sample(&[("model", &*s.model)], r);
        }
    }
}

/// Starts the sampler of `pool`; it ends when the pool is dropped. Each tick reads the
/// `[capacity]` and `[admission]` settings from the live config (a reload applies).
pub fn spawn(pool: Weak<Pool>, live: LiveConfig) {
    tokio::spawn(async move {
        let mut avg = Averages::default();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = tokio::time::Instant::now();
        loop {
            tick.tick().await;
            let Some(pool) = pool.upgrade() else {
                return;
            };
            let limits = {
                let cfg = live.load();
                Limits::from_config(&cfg.capacity, &cfg.admission)
            };
            let now = tokio::time::Instant::now();
            let work = work(&pool.load(), &limits);
            pool.publish_signals(avg.sample(&work, now - last));
            last = now;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::capacity::Reported;
    use crate::pool::LoadGuard;
    use crate::types::Role;
    use crate::upstream::parse_base_url;

    #[test]
    fn the_ratio_from_synthetic_work() {
        // (prefill engines busy, decode slots used, slots per decode engine, ratio)
        let table: &[(f64, f64, f64, Option<f64>)] = &[
            // One prefill engine always busy, two decode engines of 16 slots full: 1:2.
            (1.0, 32.0, 16.0, Some(0.5)),
            // Half a prefill engine's time, one decode engine's slots: 1 prefill per 2.
            (0.5, 16.0, 16.0, Some(0.5)),
            // Prefill-heavy (long prompts, short answers): 3 prefills per decode.
            (3.0, 8.0, 8.0, Some(3.0)),
            // Decode-heavy (short prompts, long answers): 1 prefill per 4 decodes.
            (0.25, 64.0, 64.0, Some(0.25)),
            // The ratio does not depend on the engines running now: the same traffic on
            // twice the engines is the same work.
            (0.6, 12.0, 8.0, Some(0.4)),
            // No prefill work at all (every prompt cached): none needed.
            (0.0, 10.0, 8.0, Some(0.0)),
            // No decode work, or engines of unknown size: no ratio.
            (1.0, 0.0, 16.0, None),
            (1.0, 8.0, 0.0, None),
            (f64::NAN, 8.0, 8.0, None),
            (1.0, f64::INFINITY, 8.0, None),
            (-1.0, 8.0, 8.0, Some(0.0)),
        ];
        for &(p, d, s, want) in table {
            let got = suggested_ratio(p, d, s);
            match (got, want) {
                (Some(g), Some(w)) => assert!((g - w).abs() < 1e-9, "{p} {d} {s}: {g} != {w}"),
                _ => assert_eq!(got, want, "{p} {d} {s}"),
            }
        }
    }

    #[test]
    fn averages_follow_the_work_over_the_window() {
        let m: Arc<str> = Arc::from("m");
        let w = |p, used| {
            vec![(
                m.clone(),
                Work {
                    prefill_busy_engines: p,
                    decode_slots_used: used,
                    decode_slots_total: 16,
                    slots_per_decode_engine: Some(16.0),
                },
            )]
        };
        let mut a = Averages::default();
        // The first sample is taken as is.
        let s = a.sample(&w(1.0, 32), TICK);
        assert_eq!(s[0].ratio, Some(0.5));
        assert_eq!((s[0].decode_slots_used, s[0].decode_slots_total), (32, 16));
        // A window of no prefill work moves the average 1 − 1/e of the way.
        let s = a.sample(&w(0.0, 32), WINDOW);
        assert!((s[0].prefill_busy - (-1.0f64).exp()).abs() < 1e-9);
        let want = 0.5 * (-1.0f64).exp();
        assert!(
            (s[0].ratio.unwrap() - want).abs() < 1e-9,
            "{:?}",
            s[0].ratio
        );
        // Unknown engine size: no ratio, slots still published.
        let mut unknown = w(1.0, 4);
        unknown[0].1.slots_per_decode_engine = None;
        let s = a.sample(&unknown, TICK);
        assert_eq!((s[0].ratio, s[0].decode_slots_used), (None, 4));
        // A model that left is forgotten: it starts over when it comes back.
        assert!(a.sample(&[], TICK).is_empty());
        let s = a.sample(&w(0.25, 64), TICK);
        assert_eq!(s[0].ratio, Some(0.0625));
    }

    /// A pool with `prefills` and `decodes` of model `m` (DP 2 each), healthy.
    fn pool(prefills: usize, decodes: usize) -> Pool {
        let pool = Pool::new();
        for (role, n) in [(Role::Prefill, prefills), (Role::Decode, decodes)] {
            for i in 0..n {
                let url = parse_base_url(&format!("http://127.0.0.1:{}", 9000 + i)).unwrap();
                let id = pool.add_worker(role, url, None);
                pool.set_model(role, id, Some(Arc::from("m")));
                pool.update_worker(role, id, |w| {
                    w.facts.healthy = true;
                    w.facts.dp_size = Some(2);
                });
            }
        }
        pool
    }

    #[test]
    fn work_is_read_from_the_snapshot() {
        let limits = |per_rank| Limits {
            override_per_rank: per_rank,
            learn_from_engine: true,
            ..Limits::default()
        };
        // (engine capacity per decode rank, override, engine busy per decode rank,
        //  want: slots used, slots total, slots per engine)
        // (slots used, slots total, slots per engine)
        type Want = (u64, u64, Option<f64>);
        let table: &[(u64, u64, u64, Want)] = &[
            (4, 0, 3, (12, 16, Some(8.0))),
            (4, 2, 1, (4, 8, Some(4.0))),
            // Capacity unknown: no total, no engine size.
            (0, 0, 2, (8, 0, None)),
        ];
        for &(cap, over, busy, want) in table {
            let pool = pool(1, 2);
            let snap = pool.load_full();
            for d in &snap.decodes {
                for c in d.per_rank.capacity.iter() {
                    c.observe(&Reported {
                        busy: Some(busy),
                        max_running: Some(cap).filter(|c| *c > 0),
                        ..Reported::default()
                    });
                }
            }
            // The prefill's rank 0 has a leg of this replica in flight: half an engine.
            let leg = LoadGuard::new(&snap.prefills[0], 0);
            let work = work(&snap, &limits(over));
            drop(leg);
            let [(name, w)] = work.as_slice() else {
                panic!("{work:?}");
            };
            assert_eq!(&**name, "m");
            assert_eq!(w.prefill_busy_engines, 0.5, "{cap} {over} {busy}");
            assert_eq!(
                (
                    w.decode_slots_used,
                    w.decode_slots_total,
                    w.slots_per_decode_engine
                ),
                want,
                "{cap} {over} {busy}"
            );
        }
    }

    #[test]
    fn a_draining_decode_counts_its_slots_in_use_not_its_capacity() {
        let pool = pool(0, 2);
        let limits = Limits {
            override_per_rank: 4,
            ..Limits::default()
        };
        let snap = pool.load_full();
        snap.decodes[1].per_rank.capacity[0].observe(&Reported {
            busy: Some(3),
            ..Reported::default()
        });
        pool.set_drain(
            Role::Decode,
            snap.decodes[1].shared.id,
            crate::pool::DrainBy::Operator,
            true,
        );
        let work = work(&pool.load(), &limits);
        assert_eq!(work[0].1.decode_slots_used, 3);
        assert_eq!(work[0].1.decode_slots_total, 8, "one routable decode");
        assert_eq!(work[0].1.slots_per_decode_engine, Some(8.0));
    }

    #[test]
    fn published_signals_are_series() {
        let pool = pool(0, 0);
        pool.publish_signals(vec![
            ModelSignals {
                model: Arc::from("a"),
                decode_slots_used: 3,
                decode_slots_total: 8,
                prefill_busy: 1.5,
                ratio: Some(0.5),
            },
            ModelSignals {
                model: Arc::from("b"),
                decode_slots_used: 0,
                decode_slots_total: 0,
                prefill_busy: 0.0,
                ratio: None,
            },
        ]);
        let text = telemetry::render_derived(&pool);
        for line in [
            "pdgate_decode_slots_used{model=\"a\"} 3\n",
            "pdgate_decode_slots_capacity{model=\"a\"} 8\n",
            "pdgate_decode_slots_used{model=\"b\"} 0\n",
            "pdgate_suggested_prefill_decode_ratio{model=\"a\"} 0.5\n",
            "pdgate_prefill_engines_busy{model=\"a\"} 1.5\n",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        assert!(!text.contains("pdgate_suggested_prefill_decode_ratio{model=\"b\"}"));
    }
}
