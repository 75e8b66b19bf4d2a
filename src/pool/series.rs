//! The pool's own series, derived from its snapshot when `/metrics` is rendered: per
//! worker its health and breaker state, per (worker, DP rank) the legs in flight, per
//! (prefill, DP rank) its bootstrap state, and the routable ranks of each role.
//!
//! Read at scrape time because they are already here: the in-flight counters are the
//! atomics the policies balance on (a request moves no gauge), and the states are the
//! snapshot's. A worker removed from the pool is simply absent from the next scrape.

use std::sync::atomic::Ordering;

use crate::telemetry::{self, Exposition, Source};
use crate::types::Role;

use super::{BreakerState, Pool, Snapshot};

const BREAKER_STATES: [BreakerState; 4] = [
    BreakerState::Closed,
    BreakerState::Open,
    BreakerState::HalfOpen,
    BreakerState::Stalled,
];

const RANK_STATES: [&str; 4] = ["unknown", "bootstrapping", "ready", "failed"];

fn flag(b: bool) -> u8 {
    u8::from(b)
}

impl Source for Pool {
    fn write_series(&self, out: &mut Exposition) {
        self.load().write_series(out);
    }
}

impl Source for Snapshot {
    fn write_series(&self, out: &mut Exposition) {
        let workers = || self.prefills.iter().chain(self.decodes.iter());

        out.family(telemetry::WORKER_HEALTHY);
        for w in workers() {
            let labels = [("role", w.role.as_str()), ("worker", w.url.as_str())];
            out.sample(&labels, flag(w.healthy));
        }

        out.family(telemetry::WORKER_IN_FLIGHT);
        for w in workers() {
            for (rank, n) in w.loads.iter().enumerate() {
                let rank = rank.to_string();
                let labels = [
                    ("role", w.role.as_str()),
                    ("worker", w.url.as_str()),
                    ("rank", rank.as_str()),
                ];
                out.sample(&labels, n.load(Ordering::Relaxed));
            }
        }

        out.family(telemetry::WORKER_BREAKER_STATE);
        for w in workers() {
            let now = w.breaker.state();
            for st in BREAKER_STATES {
                let labels = [
                    ("role", w.role.as_str()),
                    ("worker", w.url.as_str()),
                    ("state", st.label()),
                ];
                out.sample(&labels, flag(st == now));
            }
        }

        out.family(telemetry::BOOTSTRAP_RANK_STATE);
        for w in &self.prefills {
            for (rank, now) in w.ranks.iter().enumerate() {
                let rank = rank.to_string();
                for st in RANK_STATES {
                    let labels = [
                        ("prefill", w.url.as_str()),
                        ("rank", rank.as_str()),
                        ("state", st),
                    ];
                    out.sample(&labels, flag(now.label() == st));
                }
            }
        }

        out.family(telemetry::ROUTABLE_RANKS);
        for role in [Role::Prefill, Role::Decode] {
            out.sample(&[("role", role.as_str())], self.routable_ranks(role));
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
            w.healthy = true;
            w.dp_size = Some(2);
        });
        let snap = pool.load_full();
        let guard = LoadGuard::new(&snap.decodes[0], 1);
        let text = telemetry::render_derived(&pool);
        drop(guard);
        for line in [
            "pdgate_worker_healthy{role=\"decode\",worker=\"http://127.0.0.1:9\"} 1\n",
            "pdgate_worker_in_flight_requests{role=\"decode\",worker=\"http://127.0.0.1:9\",rank=\"0\"} 0\n",
            "pdgate_worker_in_flight_requests{role=\"decode\",worker=\"http://127.0.0.1:9\",rank=\"1\"} 1\n",
            "pdgate_worker_breaker_state{role=\"decode\",worker=\"http://127.0.0.1:9\",state=\"closed\"} 1\n",
            "pdgate_worker_breaker_state{role=\"decode\",worker=\"http://127.0.0.1:9\",state=\"open\"} 0\n",
            "pdgate_routable_ranks{role=\"decode\"} 2\n",
            "pdgate_routable_ranks{role=\"prefill\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }
}
