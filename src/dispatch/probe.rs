//! Re-admitting a stalled worker: a one-token `/generate` through a *real* pair (the
//! stalled worker and a routable partner of the other role), sent by the normal attempt
//! stages (rooms, bootstrap fields, both legs, decode's answer read to its end). A stalled
//! regular worker (`dispatch::regular`) gets the same request whole, as a regular attempt on it
//! sends it (it has no partner: it runs the prompt and the token itself).
//!
//! Why not `/health_generate`: SGLang's runs with a fake bootstrap and never exercises the
//! KV path, which is exactly what a stalled engine has lost. Why not `/health`: it stays
//! fine on an engine stuck in the KV transfer.
//!
//! Invariants:
//! - One probe task per stalled worker: it is started by the transition into
//!   [`BreakerState::Stalled`] (which only one caller wins) holding the worker's
//!   [`ProbeClaim`] (so a worker re-admitted and stalled again before an old task noticed
//!   does not get a second one), and ends when the worker is re-admitted, leaves the
//!   stalled state otherwise, or leaves the pool.
//! - Bounded: one probe in flight per worker, each within `progress.probe_timeout_ms`, the
//!   wait between them doubling from `probe_interval_ms` up to `probe_max_interval_ms` —
//!   but only from the second probe in a row the engine *held* without answering (a timeout
//!   or a stall, what the worker was taken out for; not one blamed on its partner). One
//!   held probe alone says little: a hung engine keeps what it holds, so a probe sent just
//!   before it recovered is held and fails at its deadline all the same, and a doubled wait
//!   after it made that recovery ~1 s slower to see (the chaos soak's "serving within 3 s
//!   of the clear" missed once in CI: `stalls::a_probe_held_when_the_engine_recovers_…`).
//!   A probe that could not be sent (worker unhealthy, no rank registered, no partner) or
//!   that the engine answered at once (refused, an error status) cost it nothing: the next
//!   one comes after `probe_interval_ms`, so a worker whose last failed probe met another
//!   fault (a restart, ranks re-registering) is back within one interval of recovering, not
//!   after a grown backoff.
//! - A grown wait is cut short when the worker's own signals show it came back: seen
//!   unhealthy or with a rank not ready during the wait, then healthy with every rank
//!   ready (an engine restarted by its operator); checked once per `probe_interval_ms`.
//! - A probe is not a client request: no request metrics, no access line.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use http_body_util::BodyExt;

use super::attempt::ChosenPair;
use super::{Dispatcher, ReqCtx};
use crate::error::{FailReason, Failure};
use crate::policy::{self, PickCtx};
use crate::pool::{BreakerState, RankReadiness, Snapshot};
use crate::progress::ProbeClaim;
use crate::request::record::{RequestRecord, Route};
use crate::request::{self, ApiRoute};
use crate::types::{Pair, RequestId, Role, Target, WorkerId, WorkerIdent};

/// The probe: one token, greedy, a fixed short prompt.
const PROBE_BODY: &[u8] =
    br#"{"text":"pdgate stall probe","sampling_params":{"max_new_tokens":1,"temperature":0}}"#;

impl Dispatcher {
    /// A copy for a background task (same pool, clients, policies and config).
    fn for_task(&self) -> Dispatcher {
        Dispatcher {
            pool: self.pool.clone(),
            up: self.up.clone(),
            cfg: self.cfg.clone(),
            top: self.top.clone(),
            per_model: self.per_model.clone(),
            rng: self.rng.clone(),
            // A probe is pdgate's own request: not traced.
            tracer: None,
            merge_rate: self.merge_rate.clone(),
            bulk_rate: self.bulk_rate.clone(),
            keys: self.keys.clone(),
        }
    }

    /// Starts the probe task of a worker that just became stalled.
    pub(super) fn spawn_probe(&self, role: Role, worker: WorkerId, claim: ProbeClaim) {
        let d = self.for_task();
        self.pool.spawn_task(role, worker, async move {
            let _claim = claim;
            d.probe_until_readmitted(role, worker).await
        });
    }

    async fn probe_until_readmitted(self, role: Role, worker: WorkerId) {
        let p = self.cfg.progress.clone();
        let mut wait = Backoff::new(p.probe_interval());
        loop {
            self.wait_for_probe(role, worker, wait.wait, p.probe_interval())
                .await;
            let state = self.pool.load().worker(role, worker).map(|w| {
                (
                    w.shared.breaker.state(),
                    w.facts.healthy,
                    w.shared.url.clone(),
                )
            });
            let Some((state, healthy, url)) = state else {
                return;
            };
            if state != BreakerState::Stalled {
                return;
            }
            let outcome = if healthy {
                match tokio::time::timeout(p.probe_timeout(), self.probe_once(role, worker)).await {
                    Ok(r) => r,
                    Err(_) => Err(Failure::new(
                        FailReason::RequestTimeout,
                        format!("no answer within {} ms", p.probe_timeout_ms),
                    )),
                }
            } else {
                Err(Failure::new(FailReason::Internal, "not healthy"))
            };
            match outcome {
                Ok(()) => {
                    if let Some(w) = self.pool.load().worker(role, worker) {
                        w.per_rank.progress.clear_stalls();
                    }
                    self.pool.report_success(role, worker);
                    tracing::info!(role = %role, worker_id = %WorkerIdent::new(role, worker), worker_url = %url, "stalled worker re-admitted: a probe through a real pair succeeded");
                    return;
                }
                Err(f) => {
                    wait = wait.next(f.reason, role, &p);
                    tracing::info!(role = %role, worker_id = %WorkerIdent::new(role, worker), worker_url = %url, error = %f, next_ms = wait.wait.as_millis() as u64, "stall probe failed");
                }
            }
        }
    }

    /// Sleeps `wait` before the next probe, in steps of `step`, ending early once the
    /// worker, seen unhealthy or with a rank not ready during the wait, is healthy with
    /// every rank ready again.
    async fn wait_for_probe(&self, role: Role, worker: WorkerId, wait: Duration, step: Duration) {
        let until = tokio::time::Instant::now() + wait;
        let mut seen_down = false;
        // Bounded: one look per step.
        loop {
            let now = tokio::time::Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep_until(until.min(now + step)).await;
            let Some(up) = self.pool.load().worker(role, worker).map(|w| {
                w.facts.healthy && w.facts.ranks.iter().all(|r| *r == RankReadiness::Ready)
            }) else {
                return;
            };
            if !up {
                seen_down = true;
            } else if seen_down {
                return;
            }
        }
    }

    /// One probe: the attempt stages on a pair made of the stalled worker and a partner
    /// the policy picks, then decode's answer read to its end.
    async fn probe_once(&self, role: Role, worker: WorkerId) -> Result<(), Failure> {
        let req = request::parse(ApiRoute::Generate, Bytes::from_static(PROBE_BODY))?;
        let id = RequestId::random();
        let request_id = HeaderValue::from_str(id.as_str())
            .map_err(|e| Failure::new(FailReason::Internal, e.to_string()))?;
        let ctx = ReqCtx {
            id,
            request_id: request_id.clone(),
            forward: Vec::new(),
            slot: None,
            // A probe is one 1-token request per stalled worker: it takes no decode slot
            // and never waits in the admission queue.
            queue: None,
            trace: None,
        };
        let snap = self.pool.load_full();
        // The stalled worker's own model: its settings (breaker thresholds, policies).
        let model = {
            let w = snap.worker(role, worker).ok_or_else(|| {
                Failure::new(FailReason::Internal, "the stalled worker left the pool")
            })?;
            self.model_of_worker(w)
        };
        let ready = if role == Role::Regular {
            let w = snap.worker(Role::Regular, worker).ok_or_else(|| {
                Failure::new(FailReason::Internal, "the stalled worker left the pool")
            })?;
            let t = Target { worker, rank: 0 };
            let mut trace = crate::request::record::LegTrace::default();
            self.attempt_regular_on(&req, &model, &ctx, 0, w, t, None, &mut trace)
                .await
                .map_err(|af| af.failure)?
        } else {
            let chosen = self.choose_probe_pair(&snap, role, worker)?;
            self.preflight(&chosen).await.map_err(|af| af.failure)?;
            let legs = self.send_legs(&req, &ctx, 0, &chosen, None, None);
            super::attempt::first_byte::wait_first_bytes(self, &req, &model, legs)
                .await
                .map_err(|af| af.failure)?
        };
        let record = RequestRecord::new(id, Route::Other("stall_probe"), &request_id, false);
        let resp = crate::relay::PdBody::respond(ready, record, &request_id, None, None);
        let body = resp.into_body().collect().await.map_err(|e| {
            Failure::new(
                FailReason::DecodeBroken,
                format!("probe answer broke off: {e}"),
            )
        })?;
        let body = body.to_bytes();
        if let Some(abort) = crate::legs::abort_in_json(&body) {
            return Err(Failure::new(FailReason::DecodeAborted, abort));
        }
        Ok(())
    }

    fn choose_probe_pair<'s>(
        &self,
        snap: &'s Snapshot,
        role: Role,
        worker: WorkerId,
    ) -> Result<ChosenPair<'s>, Failure> {
        let gone = || Failure::new(FailReason::Internal, "the stalled worker left the pool");
        let me = snap.worker(role, worker).ok_or_else(gone)?;
        let rank = match role {
            Role::Prefill => me
                .facts
                .ranks
                .iter()
                .position(|r| *r == RankReadiness::Ready)
                .ok_or_else(|| {
                    Failure::new(
                        FailReason::BootstrapNotReady,
                        "no rank of the stalled prefill is ready",
                    )
                })? as u32,
            Role::Decode | Role::Regular => 0,
        };
        let own = Target { worker, rank };
        let other = match role {
            Role::Prefill => Role::Decode,
            Role::Decode => Role::Prefill,
            Role::Regular => return Err(gone()),
        };
        let settings = self.settings_of(me.model.as_deref());
        let policy = match other {
            Role::Prefill => settings.policies.prefill.as_ref(),
            Role::Decode | Role::Regular => settings.policies.decode.as_ref(),
        };
        // A partner from the stalled worker's own handoff group only.
        let ctx = PickCtx {
            exclude: &[],
            prefix_hash: None,
            need: None,
            among: snap.partners(other, me.group),
        };
        let partner = self
            .rng
            .with(|rng| policy::select(policy, snap, other, &ctx, rng))
            .ok_or_else(|| {
                Failure::new(
                    FailReason::NoDecodeAvailable,
                    "no routable partner for the probe",
                )
            })?;
        let pair = match role {
            Role::Prefill => Pair {
                prefill: own,
                decode: partner.target,
            },
            Role::Decode | Role::Regular => Pair {
                prefill: partner.target,
                decode: own,
            },
        };
        let (Some(prefill), Some(decode)) = (
            snap.worker(Role::Prefill, pair.prefill.worker),
            snap.worker(Role::Decode, pair.decode.worker),
        ) else {
            return Err(gone());
        };
        let (Some(bootstrap), Some(layout)) = (
            prefill.facts.bootstrap.as_ref(),
            prefill.facts.layout.as_ref(),
        ) else {
            return Err(Failure::new(
                FailReason::BootstrapNotReady,
                "prefill layout unknown",
            ));
        };
        Ok(ChosenPair {
            lost_seen: crate::relay::LostSeen::of(&prefill.lost, pair.prefill.rank),
            pair,
            prefill,
            decode,
            bootstrap,
            layout,
            trials: (None, partner.trial),
        })
    }
}

/// Whether a failed probe of a `role` worker was held by that engine without an answer (a
/// timeout or a stall): the only failure that says the engine is still stuck, and so grows
/// the wait. A stall blamed on the partner (a decode's probe whose prefill did not answer,
/// in a storm still going on) says nothing about the probed engine.
fn held(reason: FailReason, role: Role) -> bool {
    matches!(
        reason,
        FailReason::RequestTimeout
            | FailReason::PrefillTimeout
            | FailReason::PrefillStalled
            | FailReason::DecodeFirstByteTimeout
            | FailReason::DecodeStalled
            | FailReason::DecodeIdleTimeout
    ) && reason.coupling().blames.is_none_or(|b| {
        // A regular worker's failures carry decode's reasons (`dispatch::regular`).
        b == role || (role == Role::Regular && b == Role::Decode)
    })
}

/// The wait before a worker's next probe, and how many probes in a row the engine held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Backoff {
    wait: Duration,
    held: u32,
}

impl Backoff {
    fn new(interval: Duration) -> Backoff {
        Backoff {
            wait: interval,
            held: 0,
        }
    }

    /// After a probe of a `role` worker failed for `reason`: the wait doubles (up to the
    /// max) from the second held probe in a row; any other failure brings it back to the
    /// interval (see the module docs).
    fn next(self, reason: FailReason, role: Role, p: &crate::config::ProgressConfig) -> Backoff {
        if !held(reason, role) {
            return Backoff::new(p.probe_interval());
        }
        let wait = if self.held == 0 {
            p.probe_interval()
        } else {
            (self.wait * 2).min(p.probe_max_interval().max(p.probe_interval()))
        };
        Backoff {
            wait,
            held: self.held.saturating_add(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProgressConfig;

    fn cfg() -> ProgressConfig {
        ProgressConfig {
            probe_interval_ms: 1000,
            probe_max_interval_ms: 16_000,
            ..ProgressConfig::default()
        }
    }

    /// Table: only a held probe grows the wait, and only when the one before was held too;
    /// any other failure (nothing sent, or answered at once) brings it back to the interval.
    #[test]
    fn only_held_probes_in_a_row_grow_the_wait() {
        let p = cfg();
        let s = Duration::from_secs;
        let after = |wait, held| Backoff { wait, held };
        for (role, was, reason, want) in [
            // The first held probe: still the interval.
            (
                Role::Decode,
                after(s(1), 0),
                FailReason::RequestTimeout,
                after(s(1), 1),
            ),
            (
                Role::Prefill,
                after(s(1), 0),
                FailReason::PrefillStalled,
                after(s(1), 1),
            ),
            // From the second in a row, doubling up to the max.
            (
                Role::Decode,
                after(s(1), 1),
                FailReason::RequestTimeout,
                after(s(2), 2),
            ),
            (
                Role::Prefill,
                after(s(4), 3),
                FailReason::PrefillStalled,
                after(s(8), 4),
            ),
            (
                Role::Decode,
                after(s(8), 4),
                FailReason::DecodeFirstByteTimeout,
                after(s(16), 5),
            ),
            (
                Role::Decode,
                after(s(16), 5),
                FailReason::DecodeStalled,
                after(s(16), 6),
            ),
            (
                Role::Prefill,
                after(s(8), 2),
                FailReason::PrefillTimeout,
                after(s(16), 3),
            ),
            // A regular worker holds what it was sent as a decode would.
            (
                Role::Regular,
                after(s(2), 1),
                FailReason::DecodeStalled,
                after(s(4), 2),
            ),
            (
                Role::Regular,
                after(s(1), 0),
                FailReason::DecodeFirstByteTimeout,
                after(s(1), 1),
            ),
            (
                Role::Regular,
                after(s(4), 2),
                FailReason::DecodeConnect,
                after(s(1), 0),
            ),
            // Held by the partner: a decode's probe whose prefill did not answer.
            (
                Role::Decode,
                after(s(2), 2),
                FailReason::PrefillTimeout,
                after(s(1), 0),
            ),
            (
                Role::Decode,
                after(s(8), 3),
                FailReason::PrefillStalled,
                after(s(1), 0),
            ),
            // Not sent: unhealthy, no rank registered, no partner.
            (
                Role::Decode,
                after(s(8), 3),
                FailReason::Internal,
                after(s(1), 0),
            ),
            (
                Role::Prefill,
                after(s(16), 5),
                FailReason::BootstrapNotReady,
                after(s(1), 0),
            ),
            (
                Role::Prefill,
                after(s(4), 2),
                FailReason::NoDecodeAvailable,
                after(s(1), 0),
            ),
            // Answered at once: refused, an error status, a cut answer.
            (
                Role::Prefill,
                after(s(8), 3),
                FailReason::PrefillConnect,
                after(s(1), 0),
            ),
            (
                Role::Decode,
                after(s(8), 3),
                FailReason::DecodeStatus,
                after(s(1), 0),
            ),
            (
                Role::Prefill,
                after(s(2), 2),
                FailReason::PrefillStatus,
                after(s(1), 0),
            ),
            (
                Role::Decode,
                after(s(2), 2),
                FailReason::DecodeBroken,
                after(s(1), 0),
            ),
        ] {
            assert_eq!(
                was.next(reason, role, &p),
                want,
                "{role:?} {was:?} {reason:?}"
            );
        }
    }

    /// Held probes in a row: the interval once more, then doubling to the max, which holds.
    #[test]
    fn held_probes_back_off_to_the_max() {
        let p = cfg();
        let mut b = Backoff::new(p.probe_interval());
        let mut seen = Vec::new();
        for _ in 0..8 {
            b = b.next(FailReason::RequestTimeout, Role::Decode, &p);
            seen.push(b.wait.as_secs());
        }
        assert_eq!(seen, [1, 2, 4, 8, 16, 16, 16, 16]);
    }
}
