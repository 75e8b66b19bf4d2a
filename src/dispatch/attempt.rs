//! One attempt, stage by stage (see ARCHITECTURE.md, "A request's life"):
//!
//! 1. [`Dispatcher::choose_pair`]: a prefill (worker, rank) and a decode (worker, rank) from
//!    one pool snapshot, holding the half-open trials of the workers picked, and a slot
//!    reserved on the decode rank (at capacity, the request waits in the admission queue
//!    first: [`super::attempt::capacity`]);
//! 2. [`Dispatcher::preflight`]: a stale view of the prefill rank is re-checked;
//! 3. [`Dispatcher::send_legs`]: rooms under the contract, both legs written and sent
//!    together;
//! 4. [`super::attempt::first_byte::wait_first_bytes`]: wait until decode's first bytes are in
//!    hand — the last point where a failure can still be retried, because the client has
//!    seen nothing;
//! 5. relay: [`crate::relay::PdBody`] streams decode to the client while it keeps watching
//!    the prefill.
//!
//! Each stage fails with an [`AttemptFailure`] naming the reason and the worker it blames;
//! what a reason cancels and whether it is retried is the table in
//! [`crate::error::FailReason::coupling`].

use std::future::Future;
use std::sync::Arc;

use super::model::Model;
use super::{Dispatcher, ReqCtx};
use crate::bootstrap::{preflight, Layout};
use crate::config::ContractMode;
use crate::error::{FailReason, Failure};
use crate::legs::{self, LegCancel};
use crate::policy::{self, PickCtx};
use crate::pool::backlog::BacklogHold;
use crate::pool::capacity::Need;
use crate::pool::{
    BootstrapInfo, LoadGuard, PreflightOutcome, RankFailure, RankReadiness, Reservation, Snapshot,
    WorkerView,
};
use crate::relay::{LostSeen, PrefillFuture, PrefillWatch, Ready, Trials};
use crate::request::record::{LegAt, LegTrace};
use crate::request::{LegFields, ParsedRequest};
use crate::trace::{Span, SpanKind};
use crate::types::{Pair, Role, WorkerId, WorkerIdent};
use crate::upstream::{LegBody, LegError, LegRequest};

/// The workers the next attempts avoid, by role: those blamed for a failed attempt.
#[derive(Clone, Debug, Default)]
pub struct Excluded {
    prefill: Vec<WorkerId>,
    decode: Vec<WorkerId>,
    regular: Vec<WorkerId>,
}

impl Excluded {
    /// Only `worker` (of `role`).
    pub fn only(role: Role, worker: WorkerId) -> Excluded {
        let mut e = Excluded::default();
        e.push(role, worker);
        e
    }

    pub fn of(&self, role: Role) -> &[WorkerId] {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
            Role::Regular => &self.regular,
        }
    }

    pub fn push(&mut self, role: Role, worker: WorkerId) {
        match role {
            Role::Prefill => self.prefill.push(worker),
            Role::Decode => self.decode.push(worker),
            Role::Regular => self.regular.push(worker),
        }
    }
}

/// A failed attempt and the worker it blames (excluded from the next attempt).
pub struct AttemptFailure {
    pub failure: Failure,
    pub blame: Option<(Role, WorkerId)>,
    /// Dropped after the verdict (see [`Trials`]).
    pub trials: Trials,
}

impl AttemptFailure {
    /// A failure blamed on the worker serving the leg its reason names (if any).
    pub fn on(pair: &Pair, failure: Failure) -> AttemptFailure {
        let blame = failure.reason.leg().map(|role| match role {
            Role::Prefill => (Role::Prefill, pair.prefill.worker),
            Role::Decode | Role::Regular => (Role::Decode, pair.decode.worker),
        });
        AttemptFailure {
            failure,
            blame,
            trials: Trials::default(),
        }
    }

    /// A failure that blames no worker (nothing was picked, or nobody is at fault).
    pub fn unblamed(failure: Failure) -> AttemptFailure {
        AttemptFailure {
            failure,
            blame: None,
            trials: Trials::default(),
        }
    }
}

/// Stage 1's result: the pair and what the next stages read of its workers.
pub(super) struct ChosenPair<'s> {
    pub pair: Pair,
    pub prefill: &'s WorkerView,
    pub decode: &'s WorkerView,
    pub bootstrap: &'s BootstrapInfo,
    pub layout: &'s Layout,
    /// The prefill's loss epochs when the pair was chosen (see [`LostSeen`]).
    pub lost_seen: LostSeen,
    /// The half-open trials of the workers picked: handed out with the attempt's result
    /// and dropped after the dispatcher's verdict. An attempt that ends without a verdict
    /// on a worker frees its trial for the next request.
    pub trials: Trials,
}

/// Stage 3's result: both legs on their way.
pub(super) struct LegsInFlight<D> {
    pub pair: Pair,
    /// The first bootstrap room of the legs (the access log's).
    pub room: Option<u64>,
    /// The prefill leg, its lost signal, its abort-on-drop and its load counter.
    pub prefill: PrefillWatch,
    /// The decode leg's answer head, when it comes.
    pub decode: D,
    pub decode_cancel: LegCancel,
    pub decode_load: LoadGuard,
    /// The prefill rank's cache tally (the answer's `cached_tokens` are its).
    pub prefill_tally: std::sync::Arc<crate::pool::tally::RankTally>,
    /// Stall detection until decode's first event.
    pub stall: super::stall::StallWatch,
    /// The `decode_first_byte` span, when the request is traced.
    pub span: Option<crate::trace::Span>,
}

/// What the decode leg's send resolves to.
pub(super) type DecodeHead = Result<http::Response<LegBody>, LegError>;

impl Dispatcher {
    /// One attempt on a PD pair, picked from `snap` (and from a fresh snapshot after each
    /// wait for a decode slot).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn attempt(
        &self,
        snap: Arc<Snapshot>,
        req: &ParsedRequest,
        model: &Model,
        ctx: &ReqCtx,
        attempt_no: u32,
        ex: &Excluded,
        trace: &mut LegTrace,
    ) -> Result<Ready, AttemptFailure> {
        let need_now = || {
            capacity::need(
                &self.cfg.capacity,
                &self.cfg.admission,
                self.cfg.policy.load_poll_interval_ms > 0,
                self.pool.replicas().get(),
                req,
            )
        };
        let mut need = need_now();
        let mut prefill_need = backlog::PrefillNeed::of(&self.cfg.admission, req);
        let pick = span(ctx, "pick", SpanKind::Internal);
        let mut queued = None;
        let mut snap = snap;
        let mut waited = false;
        let mut held_back = None;
        let (chosen, slot, hold) = loop {
            // Waiting: listen for a freed slot before looking, so no release is missed.
            let mut wake = queued.as_ref().map(|q: &capacity::Queue<'_>| q.wake());
            if let Some(w) = wake.as_mut() {
                w.as_mut().enable();
            }
            if std::mem::replace(&mut waited, true) {
                snap = self.pool.load_full();
                // The replica count may have changed meanwhile (a replica joined or left:
                // `pool::replicas` wakes the waiters).
                need = need_now();
            }
            let signal = self.pool.capacity_signal();
            let full = match self.choose_pair(&snap, req, model, ex, Some(need), &mut prefill_need)
            {
                Ok(c) => match backlog::hold(&c, &prefill_need, signal) {
                    None => backlog::over_failure(),
                    Some(hold) => match Reservation::try_take(
                        &c.decode.per_rank.capacity,
                        c.pair.decode.rank,
                        &need,
                        signal,
                    ) {
                        Some(r) => break (c, Some(r), hold),
                        None if c.pair.decode.rank as usize >= c.decode.per_rank.capacity.len() => {
                            break (c, None, hold)
                        }
                        None => capacity::full_failure(),
                    },
                },
                Err(af) if capacity::is_full(&af) => af,
                Err(af) => return Err(failed(pick, af)),
            };
            held_back = backlog::held_back(held_back, &full, &snap, model.name(), &prefill_need);
            // Waiting for a decode slot: a fresh engine report may give one (slots other
            // replicas released, a queue drained, this replica's next proportional part).
            if capacity::decode_full(&full) {
                signal.want_poll();
            }
            // At capacity: join the admission queue once (then look again, listening), or
            // wait for a wake-up under the queue's deadline.
            if queued.is_none() {
                drop(wake);
                queued = Some(capacity::Queue::join(
                    self,
                    ctx,
                    full,
                    &snap,
                    model.name(),
                    &need,
                )?);
                continue;
            }
            if let (Some(q), Some(w)) = (&queued, wake) {
                q.wait(w, capacity::waiting_for(&full))
                    .await
                    .map_err(AttemptFailure::unblamed)?;
            }
        };
        // Admitted: its tokens now count on the rank it goes to (its hold).
        drop(held_back);
        if let Some(mut sp) = pick {
            sp.set(
                "pdgate.prefill.worker_id",
                WorkerIdent::new(Role::Prefill, chosen.pair.prefill.worker).to_string(),
            );
            sp.set("pdgate.prefill.dp_rank", chosen.pair.prefill.rank);
            sp.set(
                "pdgate.decode.worker_id",
                WorkerIdent::new(Role::Decode, chosen.pair.decode.worker).to_string(),
            );
            sp.set("pdgate.decode.dp_rank", chosen.pair.decode.rank);
            sp.set("pdgate.queued", queued.is_some());
        }
        // Out of the queue before the legs run: the wait ended with a slot.
        if let Some(q) = queued {
            q.admitted();
        }
        *trace = LegTrace {
            prefill: Some(LegAt {
                worker: WorkerIdent::new(Role::Prefill, chosen.pair.prefill.worker),
                url: chosen.prefill.shared.url.clone(),
                rank: chosen.pair.prefill.rank,
            }),
            decode: Some(LegAt {
                worker: WorkerIdent::new(Role::Decode, chosen.pair.decode.worker),
                url: chosen.decode.shared.url.clone(),
                rank: chosen.pair.decode.rank,
            }),
            room: None,
        };
        let mut chosen = chosen;
        let trials = std::mem::take(&mut chosen.trials);
        let check = span(ctx, "bootstrap_check", SpanKind::Internal);
        if let Err(mut af) = self.preflight(&chosen).await {
            af.trials = trials;
            return Err(failed(check, af));
        }
        drop(check);
        let mut legs = self.send_legs(req, ctx, attempt_no, &chosen, slot, Some(hold));
        trace.room = legs.room;
        let first_byte = legs.span.take();
        let incremental = chosen.decode.facts.incremental_stream();
        match first_byte::wait_first_bytes(self, req, model, legs).await {
            Ok(mut ready) => {
                ready.decode_incremental = incremental;
                ready.trials = trials;
                Ok(ready)
            }
            Err(mut af) => {
                af.trials = trials;
                Err(failed(first_byte, af))
            }
        }
    }

    /// Stage 1: the policies pick a prefill and a decode target in one snapshot.
    fn choose_pair<'s>(
        &self,
        snap: &'s Snapshot,
        req: &ParsedRequest,
        model: &Model,
        ex: &Excluded,
        need: Option<Need>,
        prefill_need: &mut backlog::PrefillNeed,
    ) -> Result<ChosenPair<'s>, AttemptFailure> {
        let policies = model.policies();
        // Sticky sessions: a keyed request is placed by its key whatever the policy.
        let sticky = self.sticky_key(req);
        let (prefill_policy, decode_policy) = (
            policies.placing(Role::Prefill, sticky),
            policies.placing(Role::Decode, sticky),
        );
        let (exclude_p, exclude_d) = (ex.of(Role::Prefill), ex.of(Role::Decode));
        let prefix_hash = if prefill_policy.wants_prefix() || decode_policy.wants_prefix() {
            req.affinity_key()
        } else {
            None
        };
        // The request's model (none: one handoff group serves all); the decode comes from
        // the picked prefill's handoff group, never another.
        let scope = model.name();
        let prefill_among = (scope.is_some() || snap.groups.len() > 1)
            .then(|| snap.routable_for(Role::Prefill, scope));
        // A retry that excluded decodes picks only among prefills whose handoff group still
        // has a decode left: another group of the model, not the one whose partners all
        // failed (a retry's slow path; the first attempt never allocates here).
        let narrowed = with_partner_left(snap, prefill_among, exclude_d);
        // Only the prefill ranks under their backlog bound, while some are.
        let open = backlog::with_room(
            snap,
            narrowed.as_deref().or(prefill_among),
            exclude_p,
            prefill_need,
        )?;
        let (prefill_pick, decode_pick, decode_among) = self.rng.with(|rng| {
            let pctx = PickCtx {
                exclude: exclude_p,
                prefix_hash,
                need: None,
                among: open.as_deref(),
            };
            let p = policy::select(prefill_policy, snap, Role::Prefill, &pctx, rng);
            let among = p
                .as_ref()
                .and_then(|p| snap.decodes_for(p.target.worker))
                .or_else(|| scope.map(|m| snap.routable_for(Role::Decode, Some(m))));
            let dctx = PickCtx {
                exclude: exclude_d,
                prefix_hash,
                need,
                among,
            };
            let d = policy::select(decode_policy, snap, Role::Decode, &dctx, rng);
            (p, d, among)
        });
        let Some(prefill_pick) = prefill_pick else {
            // Scoped or not, the same telling reason over the prefills that could serve
            // it (a fleet is briefly two groups while engines' server info is read).
            let (reason, msg) = match scope {
                Some(m) => match no_prefill_detail(snap, Some(m)) {
                    (FailReason::NoPrefillAvailable, _) => (
                        FailReason::NoPrefillAvailable,
                        format!("no routable prefill worker serves model {m}"),
                    ),
                    (reason, msg) => (reason, format!("model {m}: {msg}")),
                },
                None => no_prefill_detail(snap, None),
            };
            return Err(AttemptFailure::unblamed(Failure::new(reason, msg)));
        };
        let Some(decode_pick) = decode_pick else {
            if need.is_some() && capacity::any_routable(snap, decode_among, exclude_d) {
                return Err(capacity::full_failure());
            }
            let msg = if snap.decodes.is_empty() {
                "no decode workers are configured"
            } else if decode_among.is_some() {
                "no healthy decode worker of the prefill's model and handoff group"
            } else {
                "no healthy decode worker"
            };
            return Err(AttemptFailure::unblamed(Failure::new(
                FailReason::NoDecodeAvailable,
                msg,
            )));
        };
        let pair = Pair {
            prefill: prefill_pick.target,
            decode: decode_pick.target,
        };
        let (Some(prefill), Some(decode)) = (
            snap.worker(Role::Prefill, pair.prefill.worker),
            snap.worker(Role::Decode, pair.decode.worker),
        ) else {
            let f = Failure::new(FailReason::Internal, "picked worker missing from snapshot");
            return Err(AttemptFailure::unblamed(f));
        };
        let (Some(bootstrap), Some(layout)) = (
            prefill.facts.bootstrap.as_ref(),
            prefill.facts.layout.as_ref(),
        ) else {
            let f = Failure::new(FailReason::BootstrapNotReady, "prefill layout unknown");
            return Err(AttemptFailure::on(&pair, f));
        };
        Ok(ChosenPair {
            lost_seen: LostSeen::of(&prefill.lost, pair.prefill.rank),
            pair,
            prefill,
            decode,
            bootstrap,
            layout,
            trials: (prefill_pick.trial, decode_pick.trial),
        })
    }

    /// Stage 2: a prefill rank whose view is older than the freshness bound is re-checked
    /// now, briefly (one check per rank at a time; see `bootstrap::preflight`).
    pub(super) async fn preflight(&self, c: &ChosenPair<'_>) -> Result<(), AttemptFailure> {
        let bcfg = &self.cfg.bootstrap;
        let rank = c.pair.prefill.rank;
        if c.prefill
            .per_rank
            .fresh
            .fresh_within(rank as usize, bcfg.freshness())
        {
            return Ok(());
        }
        let target = preflight::Target {
            worker: c.pair.prefill.worker,
            rank,
            bootstrap: c.bootstrap,
            generation: c.layout.generation,
            probes: &c.prefill.per_rank.probes,
        };
        let outcome =
            preflight::check(&self.pool, &self.up, target, bcfg.preflight_timeout()).await;
        let url = &c.prefill.shared.url;
        let failure = match outcome {
            PreflightOutcome::Ready => return Ok(()),
            PreflightOutcome::NotReady => Failure::new(
                FailReason::BootstrapNotReady,
                format!("prefill {url} rank {rank} is not registered yet"),
            ),
            PreflightOutcome::Missing(m) => Failure::new(
                FailReason::BootstrapRankMissing,
                format!("prefill {url} rank {rank}: {m}"),
            ),
            PreflightOutcome::Unreachable(e) => Failure::new(
                FailReason::BootstrapUnreachable,
                format!("prefill {url} bootstrap: {e}"),
            ),
        };
        Err(AttemptFailure::on(&c.pair, failure))
    }

    /// Stage 3: rooms and ranks under the contract, both legs written and sent together;
    /// the prefill leg keeps `hold` on its rank's backlog until it ends.
    /// The prefill leg is polled by whoever holds the returned [`PrefillWatch`]; the decode
    /// leg by whoever polls `decode`.
    pub(super) fn send_legs(
        &self,
        req: &ParsedRequest,
        ctx: &ReqCtx,
        attempt_no: u32,
        c: &ChosenPair<'_>,
        slot: Option<Reservation>,
        hold: Option<BacklogHold>,
    ) -> LegsInFlight<impl Future<Output = DecodeHead> + Send + 'static> {
        let (pt, dt) = (c.pair.prefill, c.pair.decode);
        let mut rooms = Vec::new();
        self.rng
            .with(|rng| room::assign(rng, c.layout.dp_size, pt.rank, req.instances(), &mut rooms));
        let pinned = self.cfg.contract.mode == ContractMode::Pinned;
        let hint = pinned.then_some(pt.rank);
        let decode_rank = (c.decode.effective_dp() > 1).then_some(dt.rank);
        let rid_p = ctx.id.leg_rid(attempt_no, 'p');
        let rid_d = ctx.id.leg_rid(attempt_no, 'd');
        let boot = c.bootstrap;
        let (prefill_body, decode_body) = req.write_legs(
            &LegFields {
                host_json: &boot.host_json,
                port: boot.port,
                rooms: &rooms,
                rid: &rid_p,
                routed_dp_rank: hint,
                disagg_prefill_dp_rank: hint,
                stream: false,
            },
            &LegFields {
                host_json: &boot.host_json,
                port: boot.port,
                rooms: &rooms,
                rid: &rid_d,
                routed_dp_rank: decode_rank,
                disagg_prefill_dp_rank: hint,
                stream: req.stream,
            },
        );
        let path = req.route.path();
        let mut prefill_req =
            LegRequest::post_json(&c.prefill.shared.conns, path, prefill_body, &ctx.forward);
        // The prefill's answer headers are never read (decode's go to the client).
        prefill_req.keep_headers = false;
        prefill_req.rate = self.bulk_rate.clone();
        let mut decode_req =
            LegRequest::post_json(&c.decode.shared.conns, path, decode_body, &ctx.forward);
        decode_req.rate = self.bulk_rate.clone();
        // Traced: each leg names its own span as the engine's parent.
        let prefill_span = leg_span(ctx, "prefill", c.prefill, pt.rank, &mut prefill_req);
        let decode_span = leg_span(ctx, "decode_first_byte", c.decode, dt.rank, &mut decode_req);
        tracing::debug!(request_id = %ctx.id,
            prefill_id = %WorkerIdent::new(Role::Prefill, pt.worker), prefill_url = %c.prefill.shared.url, prefill_rank = pt.rank,
            decode_id = %WorkerIdent::new(Role::Decode, dt.worker), decode_url = %c.decode.shared.url, decode_rank = dt.rank,
            rooms = ?rooms, "dispatch");

        let timeouts = &self.cfg.timeouts;
        let size = req.prompt_size();
        let prefill_leg: PrefillFuture = Box::pin(super::stall::timed_prefill(
            legs::run_prefill(
                self.up.clone(),
                c.prefill.shared.conns.clone(),
                prefill_req,
                timeouts.prefill(),
                self.cfg.upstream.max_answer_bytes,
                ctx.queue.as_ref().map(|a| a.bytes().clone()),
            ),
            c.prefill.per_rank.progress.clone(),
            c.prefill.shared.stats.clone(),
            pt.rank,
            size,
            hold,
        ));
        let prefill_leg = match prefill_span {
            None => prefill_leg,
            Some(mut sp) => Box::pin(async move {
                let r = prefill_leg.await;
                if let Err(f) = &r {
                    sp.fail(f.reason.as_str());
                }
                r
            }),
        };
        let prefill = PrefillWatch::new(
            prefill_leg,
            c.prefill.lost.clone(),
            pt.rank,
            c.lost_seen,
            LegCancel::new(&self.up, &c.prefill.shared.url, rid_p),
            LoadGuard::new(c.prefill, pt.rank),
        );
        let (up, conns) = (self.up.clone(), c.decode.shared.conns.clone());
        LegsInFlight {
            pair: c.pair,
            room: rooms.first().copied(),
            prefill,
            decode: async move { up.send_leg(&conns, &decode_req).await },
            decode_cancel: LegCancel::new(&self.up, &c.decode.shared.url, rid_d),
            decode_load: LoadGuard::new(c.decode, dt.rank).with_reservation(slot),
            prefill_tally: c.prefill.per_rank.tally.clone(),
            stall: super::stall::StallWatch::new(
                &self.cfg.progress,
                c.pair,
                c.prefill,
                c.decode,
                size,
                req.stream,
            ),
            span: decode_span,
        }
    }
}

/// A child of the attempt's span, when the request is traced.
fn span(ctx: &ReqCtx, name: &'static str, kind: SpanKind) -> Option<Span> {
    ctx.trace.as_ref().map(|s| s.child(name, kind))
}

/// A stage's span marked with the failure that ended the attempt.
fn failed(sp: Option<Span>, af: AttemptFailure) -> AttemptFailure {
    if let Some(mut sp) = sp {
        sp.fail(af.failure.reason.as_str());
    }
    af
}

/// A leg's span (kind CLIENT) and its `traceparent` on the leg, when the request is traced.
pub(super) fn leg_span(
    ctx: &ReqCtx,
    name: &'static str,
    w: &crate::pool::WorkerView,
    rank: crate::types::DpRank,
    leg: &mut LegRequest,
) -> Option<Span> {
    let mut sp = span(ctx, name, SpanKind::Client)?;
    sp.set(
        "pdgate.worker_id",
        WorkerIdent::new(w.shared.role, w.shared.id).to_string(),
    );
    sp.set("pdgate.dp_rank", rank);
    sp.set("server.address", w.shared.url.to_string());
    if let Some(tp) = sp.traceparent() {
        leg.push_header(crate::trace::TRACEPARENT, &tp);
    }
    Some(sp)
}

pub(super) mod backlog;
/// Why no prefill target is eligible: the most telling reason over the healthy prefills
/// (of `model`, when the request names one) — an unreachable bootstrap, then a missing
/// rank, then registration still under way — and a few words per worker.
pub(super) mod capacity;
pub(super) mod first_byte;
pub mod room;

#[cfg(test)]
mod pairing_props;

fn no_prefill_detail(snap: &Snapshot, model: Option<&str>) -> (FailReason, String) {
    let of_model = |w: &&WorkerView| model.is_none_or(|m| w.model.as_deref() == Some(m));
    if !snap.prefills.iter().any(|w| of_model(&w)) {
        return (
            FailReason::NoPrefillAvailable,
            "no prefill workers are configured".into(),
        );
    }
    let rank_of = |r: FailReason| match r {
        FailReason::BootstrapUnreachable => 3,
        FailReason::BootstrapRankMissing => 2,
        FailReason::BootstrapNotReady => 1,
        _ => 0,
    };
    let mut reason = FailReason::NoPrefillAvailable;
    let mut parts = Vec::new();
    for w in snap.prefills.iter().filter(of_model) {
        let mut why = FailReason::BootstrapNotReady;
        let mut labels = Vec::new();
        for (r, st) in w.facts.ranks.iter().enumerate() {
            match st {
                RankReadiness::Failed { reason: f, .. } => {
                    let this = match f {
                        RankFailure::Unreachable | RankFailure::BadAnswer => {
                            FailReason::BootstrapUnreachable
                        }
                        RankFailure::RankMissing => FailReason::BootstrapRankMissing,
                    };
                    if rank_of(this) > rank_of(why) {
                        why = this;
                    }
                    labels.push(format!("rank {r} {}", f.label()));
                }
                other => labels.push(format!("rank {r} {}", other.label())),
            }
        }
        let state = if !w.facts.healthy {
            "unhealthy".to_string()
        } else {
            if rank_of(why) > rank_of(reason) {
                reason = why;
            }
            if labels.is_empty() {
                "bootstrap not known yet".to_string()
            } else {
                labels.join(", ")
            }
        };
        parts.push(format!("{}: {state}", w.shared.url));
    }
    (
        reason,
        format!("no prefill rank can bootstrap now ({})", parts.join("; ")),
    )
}

/// The prefills of `among` whose handoff group has a routable decode outside `exclude_d`,
/// when excluding decodes leaves some group without one and another with one; `None` to
/// pick among `among` as it is (one group, nothing excluded, or no group with a decode
/// left: the decode pick then fails with its own reason).
fn with_partner_left(
    snap: &Snapshot,
    among: Option<&[crate::pool::Routable]>,
    exclude_d: &[WorkerId],
) -> Option<Vec<crate::pool::Routable>> {
    let among = among?;
    if exclude_d.is_empty() || snap.groups.len() <= 1 {
        return None;
    }
    let left = |p: &crate::pool::Routable| {
        snap.decodes_for(p.worker)
            .is_none_or(|ds| ds.iter().any(|d| !exclude_d.contains(&d.worker)))
    };
    let kept: Vec<_> = among.iter().filter(|p| left(p)).cloned().collect();
    (!kept.is_empty() && kept.len() < among.len()).then_some(kept)
}
