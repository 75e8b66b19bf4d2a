//! The pool's own series, derived from its snapshot when `/metrics` is rendered: per
//! worker its health and breaker state, per (worker, DP rank) the legs in flight and what
//! its prefix cache did (`pool::tally`), per decode (worker, DP rank) the engine's
//! pre-allocation queue at the last poll (`pool::capacity`), per
//! (prefill, DP rank) its bootstrap state and its backlog and pace (`pool::backlog`, with
//! each model's prefill backlog together), and the routable ranks of each role and model;
//! then the per-model scaling signals the sampler published last (`pool::signals`).
//!
//! Read at scrape time because they are already here: the in-flight counters are the
//! atomics the policies balance on (a request moves no gauge), and the states are the
//! snapshot's. A worker removed from the pool is simply absent from the next scrape.

use std::sync::atomic::Ordering;

use crate::telemetry::{self, Exposition, Source};
use crate::types::Role;

use super::{BreakerState, Pool, Snapshot, WorkerView};

const BREAKER_STATES: [BreakerState; 4] = [
    BreakerState::Closed,
    BreakerState::Open,
    BreakerState::HalfOpen,
    BreakerState::Stalled,
];

const RANK_STATES: [&str; 4] = ["unknown", "bootstrapping", "ready", "failed"];

/// A worker's labels: its role, its stable id (`prefill-0`, `worker_id`) and its URL
/// (`worker_url`), the two names every log line and admin answer gives it, then `extra`.
fn labels<'a>(
    w: &'a WorkerView,
    id: &'a str,
    extra: Option<(&'static str, &'a str)>,
) -> Vec<(&'static str, &'a str)> {
    let mut l = vec![
        ("role", w.shared.role.as_str()),
        ("worker_id", id),
        ("worker_url", w.shared.url.as_str()),
    ];
    l.extend(extra);
    l
}

fn flag(b: bool) -> u8 {
    u8::from(b)
}

impl Source for Pool {
    fn write_series(&self, out: &mut Exposition) {
        self.load().write_series(out);
        super::signals::write(&self.signals.load(), out);
    }
}

impl Source for Snapshot {
    fn write_series(&self, out: &mut Exposition) {
        // Each worker with its stable id (`prefill-0`): two workers that share a URL (one
        // re-added while the other drains) are never one series.
        let all = || {
            self.prefills
                .iter()
                .chain(self.decodes.iter())
                .chain(self.regulars.iter())
        };
        let ids: Vec<String> = all()
            .map(|w| w.shared.id.reference(w.shared.role))
            .collect();
        let workers = || all().zip(ids.iter().map(String::as_str));

        out.family(telemetry::WORKER_HEALTHY);
        for (w, id) in workers() {
            out.sample(&labels(w, id, None), flag(w.facts.healthy));
        }

        out.family(telemetry::WORKER_IN_FLIGHT);
        for (w, id) in workers() {
            for (rank, n) in w.per_rank.loads.iter().enumerate() {
                let rank = rank.to_string();
                let l = labels(w, id, Some(("rank", &rank)));
                out.sample(&l, n.load(Ordering::Relaxed));
            }
        }

        // Only what the engine reported: a rank without the figure has no sample.
        out.family(telemetry::DECODE_PREALLOC_QUEUE);
        for (w, id) in workers().filter(|(w, _)| w.shared.role == Role::Decode) {
            for (rank, c) in w.per_rank.capacity.iter().enumerate() {
                if let Some(q) = c.prealloc_queue() {
                    let rank = rank.to_string();
                    let labels = [
                        ("worker_id", id),
                        ("worker_url", w.shared.url.as_str()),
                        ("rank", rank.as_str()),
                    ];
                    out.sample(&labels, q);
                }
            }
        }

        self.write_backlog(out, &ids[..self.prefills.len()]);

        let tallies: Vec<_> = workers().map(|(w, _)| w.per_rank.tally.read()).collect();
        for (family, value) in [
            (
                telemetry::RANK_PROMPT_TOKENS,
                (|c| c.prompt_tokens) as fn(&super::tally::RankCounts) -> u64,
            ),
            (telemetry::RANK_CACHED_TOKENS, |c| c.cached_tokens),
            (telemetry::AFFINITY_SPILLS, |c| c.spills),
        ] {
            out.family(family);
            for ((w, id), ranks) in workers().zip(&tallies) {
                for (rank, c) in ranks.iter().enumerate() {
                    let rank = rank.to_string();
                    out.sample(&labels(w, id, Some(("rank", &rank))), value(c));
                }
            }
        }

        out.family(telemetry::WORKER_BREAKER_STATE);
        for (w, id) in workers() {
            let now = w.shared.breaker.state();
            for st in BREAKER_STATES {
                out.sample(&labels(w, id, Some(("state", st.label()))), flag(st == now));
            }
        }

        out.family(telemetry::WORKER_REQUESTS);
        for (w, id) in workers() {
            for (outcome, n) in w.shared.stats.outcomes() {
                out.sample(&labels(w, id, Some(("outcome", outcome))), n);
            }
        }

        for (family, role) in [
            (telemetry::WORKER_PREFILL_DURATION, Role::Prefill),
            (telemetry::WORKER_FIRST_BYTE, Role::Decode),
        ] {
            out.family(family);
            for (w, id) in workers().filter(|(w, _)| w.shared.role == role) {
                let h = match role {
                    Role::Prefill => &w.shared.stats.prefill,
                    Role::Decode | Role::Regular => &w.shared.stats.first_byte,
                };
                out.histogram(&labels(w, id, None), h);
            }
        }

        out.family(telemetry::BOOTSTRAP_RANK_STATE);
        for (w, id) in workers().filter(|(w, _)| w.shared.role == Role::Prefill) {
            for (rank, now) in w.facts.ranks.iter().enumerate() {
                let rank = rank.to_string();
                for st in RANK_STATES {
                    let labels = [
                        ("worker_id", id),
                        ("worker_url", w.shared.url.as_str()),
                        ("rank", rank.as_str()),
                        ("state", st),
                    ];
                    out.sample(&labels, flag(now.label() == st));
                }
            }
        }

        out.family(telemetry::ROUTABLE_RANKS);
        for role in [Role::Prefill, Role::Decode, Role::Regular] {
            out.sample(&[("role", role.as_str())], self.routable_ranks(role));
        }

        // Per model (the names engines or the operator gave: bounded by the fleet): a
        // model with 0 routable prefill or decode ranks answers 503.
        out.family(telemetry::MODEL_ROUTABLE_RANKS);
        let ranks = |l: &[super::Routable]| l.iter().map(|r| r.ranks.len()).sum::<usize>();
        for m in &self.models {
            for (role, list) in [
                (Role::Prefill, &m.prefill_routable),
                (Role::Decode, &m.decode_routable),
            ] {
                out.sample(&[("model", &*m.name), ("role", role.as_str())], ranks(list));
            }
        }
    }
}

impl Snapshot {
    /// The prefill backlog series (`super::backlog`): per model, its prefill ranks' backlog
    /// tokens and the requests held back in the admission queue for them, over their
    /// learned paces together (a rank without one at the others' mean); per prefill rank,
    /// its seconds and pace.
    /// `ids`: the prefills' stable ids, in order.
    fn write_backlog(&self, out: &mut Exposition, ids: &[String]) {
        let prefills = || self.prefills.iter().zip(ids.iter().map(String::as_str));
        let figures: Vec<Vec<_>> = self
            .prefills
            .iter()
            .map(|w| w.per_rank.backlog.iter().map(|b| b.figures()).collect())
            .collect();
        out.family(telemetry::PREFILL_BACKLOG);
        for m in &self.models {
            let (mut tokens, mut pace, mut known, mut cold) = (0.0f64, 0.0f64, 0u32, 0u32);
            for (w, ranks) in self.prefills.iter().zip(&figures) {
                if w.model.as_deref() != Some(&*m.name) {
                    continue;
                }
                for f in ranks {
                    tokens += f.tokens();
                    match f.pace {
                        Some(p) => (pace, known) = (pace + p, known + 1),
                        None => cold += 1,
                    }
                }
                let held = w.per_rank.backlog.iter().map(|b| b.held_back());
                tokens += held.sum::<f64>();
            }
            // A rank that has learned no pace yet counts at the others' mean (as the bound
            // holds it to), so that a fresh rank does not read as no throughput at all.
            if known > 0 {
                pace += f64::from(cold) * pace / f64::from(known);
            }
            let secs = if pace > 0.0 {
                Some(tokens / pace)
            } else {
                (tokens <= 0.0).then_some(0.0)
            };
            if let Some(v) = secs.filter(|v| v.is_finite()) {
                out.sample(&[("model", &*m.name)], v);
            }
        }
        for (family, value) in [
            (
                telemetry::PREFILL_RANK_BACKLOG,
                (|f| f.secs()) as fn(&super::backlog::Figures) -> Option<f64>,
            ),
            (telemetry::PREFILL_RANK_PACE, |f| f.pace),
        ] {
            out.family(family);
            for ((w, id), ranks) in prefills().zip(&figures) {
                for (rank, f) in ranks.iter().enumerate() {
                    if let Some(v) = value(f).filter(|v| v.is_finite()) {
                        let rank = rank.to_string();
                        let labels = [
                            ("worker_id", id),
                            ("worker_url", w.shared.url.as_str()),
                            ("rank", rank.as_str()),
                        ];
                        out.sample(&labels, v);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{LoadGuard, RankFailure, RankReadiness};
    use crate::upstream::parse_base_url;

    #[test]
    fn every_rank_state_is_a_label() {
        let now = std::time::Instant::now();
        let all = [
            RankReadiness::Unknown,
            RankReadiness::Bootstrapping,
            RankReadiness::Ready,
            RankReadiness::Failed {
                reason: RankFailure::Unreachable,
                since: now,
            },
        ];
        for st in all {
            assert!(RANK_STATES.contains(&st.label()), "{}", st.label());
        }
    }

    #[test]
    fn a_snapshot_as_series() {
        let pool = Pool::new();
        let url = parse_base_url("http://127.0.0.1:9").unwrap();
        let id = pool.add_worker(Role::Decode, url, None);
        pool.update_worker(Role::Decode, id, |w| {
            w.facts.healthy = true;
            w.facts.dp_size = Some(2);
        });
        let snap = pool.load_full();
        let guard = LoadGuard::new(&snap.decodes[0], 1);
        // Rank 1 reported a queue of 3; rank 0 reported nothing (no sample).
        snap.decodes[0].per_rank.capacity[1].observe(&crate::pool::capacity::Reported {
            prealloc: Some(3),
            ..Default::default()
        });
        let text = telemetry::render_derived(&pool);
        drop(guard);
        for line in [
            "pdgate_worker_healthy{role=\"decode\",worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\"} 1\n",
            "pdgate_worker_in_flight_requests{role=\"decode\",worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\",rank=\"0\"} 0\n",
            "pdgate_worker_in_flight_requests{role=\"decode\",worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\",rank=\"1\"} 1\n",
            "pdgate_worker_breaker_state{role=\"decode\",worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\",state=\"closed\"} 1\n",
            "pdgate_worker_breaker_state{role=\"decode\",worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\",state=\"open\"} 0\n",
            "pdgate_worker_requests_total{role=\"decode\",worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\",outcome=\"ok\"} 0\n",
            "pdgate_worker_first_byte_seconds_count{role=\"decode\",worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\"} 0\n",
            "pdgate_decode_prealloc_queue{worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\",rank=\"1\"} 3\n",
            "pdgate_routable_ranks{role=\"decode\"} 2\n",
            "pdgate_routable_ranks{role=\"prefill\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        assert!(
            !text.contains("pdgate_decode_prealloc_queue{worker_id=\"decode-0\",worker_url=\"http://127.0.0.1:9\",rank=\"0\"}"),
            "a rank without a report has no sample:\n{text}"
        );
    }

    #[test]
    fn the_prefill_backlog_per_model_and_per_rank() {
        let pool = Pool::new();
        let url = parse_base_url("http://127.0.0.1:9").unwrap();
        let id = pool.add_worker(Role::Prefill, url, None);
        pool.update_worker(Role::Prefill, id, |w| {
            w.facts.healthy = true;
            w.facts.dp_size = Some(2);
        });
        pool.set_model(Role::Prefill, id, Some("m".into()));
        let snap = pool.load_full();
        let ranks = &snap.prefills[0].per_rank.backlog;
        let signal = pool.capacity_signal();
        // Rank 0 learned 1000 tokens a second and holds a leg of 2000 tokens; rank 1 has
        // no pace yet (it counts at rank 0's) and its engine reports 500 tokens queued:
        // 2500 tokens over 2000 a second.
        ranks[0].learn(1000, 0, 1_000_000, Some((1000, 0)));
        let off = crate::pool::backlog::Bound::default();
        let hold = crate::pool::backlog::BacklogHold::take(ranks, 0, 2000, true, &off, signal);
        ranks[1].observe(Some(500));
        let text = telemetry::render_derived(&pool);
        // A request of 500 tokens held back in the admission queue counts in the model's.
        let held = crate::pool::backlog::HeldBack::new(ranks, 500);
        let with_held = telemetry::render_derived(&pool);
        drop(held);
        assert!(
            with_held.contains("pdgate_prefill_backlog_seconds{model=\"m\"} 1.5\n"),
            "{with_held}"
        );
        assert_eq!(
            telemetry::render_derived(&pool),
            text,
            "given back when dropped"
        );
        drop(hold);
        for line in [
            "pdgate_prefill_backlog_seconds{model=\"m\"} 1.25\n",
            "pdgate_prefill_rank_backlog_seconds{worker_id=\"prefill-0\",worker_url=\"http://127.0.0.1:9\",rank=\"0\"} 2\n",
            "pdgate_prefill_rank_tokens_per_second{worker_id=\"prefill-0\",worker_url=\"http://127.0.0.1:9\",rank=\"0\"} 1000\n",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        for absent in ["rank_backlog_seconds{worker_id=\"prefill-0\",worker_url=\"http://127.0.0.1:9\",rank=\"1\"}", "tokens_per_second{worker_id=\"prefill-0\",worker_url=\"http://127.0.0.1:9\",rank=\"1\"}"] {
            assert!(!text.contains(absent), "no pace, no sample: {absent} in\n{text}");
        }
        // Nothing queued and no pace: 0 s, not absent.
        let idle = Pool::new();
        let id = idle.add_worker(
            Role::Prefill,
            parse_base_url("http://127.0.0.1:8").unwrap(),
            None,
        );
        idle.set_model(Role::Prefill, id, Some("n".into()));
        let text = telemetry::render_derived(&idle);
        assert!(
            text.contains("pdgate_prefill_backlog_seconds{model=\"n\"} 0\n"),
            "{text}"
        );
    }

    /// Every sample's name and labels in `text` (no duplicates), by parsing the exposition.
    fn series_keys(text: &str) -> Vec<String> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.rsplit_once(' ').map(|(k, _)| k.to_string()))
            .collect()
    }

    #[test]
    fn two_workers_on_one_url_are_two_series() {
        let pool = std::sync::Arc::new(Pool::new());
        let url = parse_base_url("http://127.0.0.1:9").unwrap();
        for role in [Role::Prefill, Role::Decode] {
            // One leaving (re-added by the operator while it drains) and its successor.
            let a = pool.add_worker(role, url.clone(), None);
            let b = pool.add_worker(role, url.clone(), None);
            assert_ne!(a, b);
        }
        pool.report_success(Role::Decode, crate::types::WorkerId(1));
        let text = telemetry::render_derived(&*pool);
        let keys = series_keys(&text);
        let mut uniq = keys.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), keys.len(), "duplicate series in\n{text}");
        for id in ["prefill-0", "prefill-1", "decode-0", "decode-1"] {
            let ok =
                format!("worker_id=\"{id}\",worker_url=\"http://127.0.0.1:9\",outcome=\"ok\"}}");
            let n = if id == "decode-1" { 1 } else { 0 };
            assert!(text.contains(&format!("{ok} {n}\n")), "{id} in\n{text}");
        }
    }
}
