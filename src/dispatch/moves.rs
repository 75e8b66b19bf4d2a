//! Moving a live stream to another decode: when the decode of a continuable stream dies or
//! stalls after the client has seen tokens, the relay ([`crate::relay::PdBody`]) asks the
//! [`Mover`] for a follow-up on a fresh (prefill, decode) pair, and splices its stream onto
//! what the client already has ([`crate::relay::splice`]). A regular worker's stream (`dispatch::regular`)
//! moves the same way.
//!
//! Invariants:
//! - A move is an attempt like any other (choose_pair, preflight, send_legs,
//!   wait_first_bytes), without the dead decode, with fresh rooms and rids; it spends the
//!   retry budget, and `retry.max_stream_moves` bounds the moves of one request.
//! - Each of a move's attempts goes where a first attempt of the follow-up would
//!   ([`Dispatcher::regular_route`]): a PD pair or a regular worker of the same model, never
//!   the worker that just failed. So a regular stream whose worker dies continues on another
//!   regular worker (or a PD pair of its model), and a PD stream left with no other decode
//!   continues on a regular worker where `models.regular_fallback` allows.
//! - A move is made only when the answer can be continued exactly (see
//!   [`crate::request::continuation`]); otherwise the stream ends as before, with its error event.
//! - A move waits (up to `retry.move_wait_ms`) while no decode is routable or while nothing
//!   can be picked (a recovering decode's half-open trial taken, every rank full): a pause
//!   in the stream, not its end.
//! - The gap after which a silent decode counts as stalled comes from one place,
//!   [`Mover::gap`] (today the configured `retry.mid_stream_gap_ceiling_ms`).

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use super::{Dispatcher, ReqCtx};
use crate::error::Failure;
use crate::relay::splice::{GenerateMode, Tracker};
use crate::relay::{MoveFuture, Mover, Moves, Passive};
use crate::request::continuation::{self, Plan};
use crate::request::record::LegTrace;
use crate::request::{self, ApiRoute, ParsedRequest};
use crate::types::{RequestId, Role, WorkerId};

/// What a continuable stream keeps to be moved: the dispatcher's side of
/// [`crate::relay::Moves`] (the relay keeps the stream's account).
struct Follow {
    d: Arc<Dispatcher>,
    req: Arc<ParsedRequest>,
    id: RequestId,
    request_id: HeaderValue,
    forward: Arc<[u8]>,
    moves_left: u32,
    next_attempt: u32,
    /// The request's span, when it is traced: each move's attempts hang under it.
    trace: Option<crate::trace::Scope>,
}

impl Dispatcher {
    /// Whether a retry has a routable pair outside the excluded workers, waiting for one up
    /// to `retry.move_wait_ms` (and the request's `deadline`) when a worker that is not
    /// excluded exists but is not routable now (its breaker open after a fault, its ranks
    /// re-registering): a failed attempt whose only alternative is recovering costs the
    /// client that pause, as a stream's move does, not an error. With no such worker (the
    /// only one of a role was blamed) the answer is at once, and so it is when no worker
    /// failed the attempt (`blamed` false: nothing was sent, because nothing was routable
    /// or a pooled connection raced its close): what the router sees now is the answer,
    /// as fail fast promises, rather than a wait for the very workers it saw down.
    pub(super) async fn alternative_within(
        &self,
        scope: Option<&str>,
        exclude_p: &[WorkerId],
        exclude_d: &[WorkerId],
        blamed: bool,
        deadline: tokio::time::Instant,
    ) -> bool {
        if self.has_alternative(scope, exclude_p, exclude_d) {
            return true;
        }
        if !blamed {
            return false;
        }
        let wait = Duration::from_millis(self.retry(scope).0.move_wait_ms);
        let snap = self.pool.load();
        let exists =
            |role: Role, ex: &[WorkerId]| snap.workers(role).iter().any(|w| !ex.contains(&w.id));
        if wait.is_zero() || !exists(Role::Prefill, exclude_p) || !exists(Role::Decode, exclude_d) {
            return false;
        }
        drop(snap);
        let until = (tokio::time::Instant::now() + wait).min(deadline);
        // Bounded: one look per poll until `until`.
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(MOVE_WAIT_POLL).await;
            if self.has_alternative(scope, exclude_p, exclude_d) {
                return true;
            }
        }
        false
    }

    /// Whether a move's next attempt has somewhere to go outside the excluded workers: a
    /// regular worker the routing rules pick, or a PD pair.
    fn move_target_left(
        &self,
        follow: &ParsedRequest,
        exclude_p: &[WorkerId],
        exclude_d: &[WorkerId],
        exclude_r: &[WorkerId],
    ) -> bool {
        self.regular_route(follow, exclude_p, exclude_d, exclude_r)
            || self.has_alternative(follow.scope.as_deref(), exclude_p, exclude_d)
    }

    /// [`Self::move_target_left`], looked at again every [`MOVE_WAIT_POLL`] until `until`
    /// (bounded: the move's wait).
    async fn move_target_within(
        &self,
        follow: &ParsedRequest,
        exclude_d: &[WorkerId],
        exclude_r: &[WorkerId],
        until: tokio::time::Instant,
    ) -> bool {
        loop {
            if self.move_target_left(follow, &[], exclude_d, exclude_r) {
                return true;
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(MOVE_WAIT_POLL).await;
        }
    }
}

/// Whether an attempt failed only because no pair could be picked right now (no worker
/// was tried, so none is blamed): every decode rank full, no eligible worker, or no
/// prefill rank that can bootstrap.
fn nothing_pickable(af: &super::attempt::AttemptFailure) -> bool {
    use crate::error::FailReason::{
        BootstrapNotReady, BootstrapRankMissing, BootstrapUnreachable, NoDecodeAvailable,
        NoPrefillAvailable, NoWorkerAvailable,
    };
    af.blame.is_none()
        && (super::attempt::capacity::is_full(af)
            || matches!(
                af.failure.reason,
                NoDecodeAvailable
                    | NoPrefillAvailable
                    | NoWorkerAvailable
                    | BootstrapUnreachable
                    | BootstrapNotReady
                    | BootstrapRankMissing
            ))
}

/// How often a move waiting for a routable decode looks again.
const MOVE_WAIT_POLL: Duration = Duration::from_millis(25);

/// Whether `req` gets a mover, and the plan if so: a stream the config lets move, that
/// can be continued exactly.
pub fn plan_for(d: &Dispatcher, req: &ParsedRequest) -> Option<Plan> {
    if d.retry(req.scope.as_deref()).0.max_stream_moves == 0 || !req.stream {
        return None;
    }
    continuation::plan(req).ok()
}

/// A leg of a continuable OpenAI stream asks for per-chunk usage.
pub fn prepare_legs(req: &mut ParsedRequest, plan: &Plan) {
    if plan.route != ApiRoute::Generate {
        req.override_on_legs("stream_options", continuation::LEG_STREAM_OPTIONS.into());
    }
}

/// The relay's [`Mover`] of a continuable stream: its account, and the way to run its
/// follow-up attempts here.
pub fn mover(
    d: Arc<Dispatcher>,
    req: ParsedRequest,
    ctx: &ReqCtx,
    plan: Plan,
    incremental: bool,
    attempts: u32,
) -> Mover {
    let mode = if incremental {
        GenerateMode::Incremental
    } else {
        GenerateMode::Cumulative
    };
    let follow = Follow {
        moves_left: d.retry(req.scope.as_deref()).0.max_stream_moves,
        d,
        req: Arc::new(req),
        id: ctx.id,
        request_id: ctx.request_id.clone(),
        forward: ctx.forward.as_slice().into(),
        next_attempt: attempts,
        trace: ctx.trace.clone(),
    };
    Mover::new(Tracker::new(plan, mode), Box::new(follow))
}

impl Moves for Follow {
    /// The longest silence after which a decode that already sent tokens is taken for
    /// stalled and the stream moved; `None` when no move is left. The one place the bound
    /// comes from: a learned per-(decode, rank) bound can replace the configured ceiling
    /// here.
    ///
    /// With stall detection on, the bound is what the decode's (worker, rank) and its peers
    /// taught ([`Dispatcher::gap_deadline`]: `progress.multiplier` × the largest
    /// recent gap of streams that ended well), at most `retry.mid_stream_gap_ceiling_ms`.
    fn gap(&self, _tracker: &Tracker, at: &Passive) -> Option<Duration> {
        if self.moves_left == 0 {
            return None;
        }
        let retry = self.d.retry(self.req.scope.as_deref()).0;
        let ceiling = Duration::from_millis(retry.mid_stream_gap_ceiling_ms);
        Some(match at.gap_rank() {
            Some(r) if self.d.cfg.progress.enabled => self
                .d
                .gap_deadline(at.decode_role, at.decode, r)
                .min(ceiling),
            _ => ceiling,
        })
    }

    /// Starts moving the stream off `dead` (the decode or regular worker, by `role`, that
    /// just failed); `Err` says why the stream cannot be moved.
    fn start(
        &mut self,
        tracker: &mut Tracker,
        role: Role,
        dead: WorkerId,
    ) -> Result<MoveFuture, String> {
        if self.moves_left == 0 {
            return Err("no stream moves left (retry.max_stream_moves)".into());
        }
        let sent = tracker.sent()?;
        let body = continuation::follow_up(&self.req, tracker.plan(), &sent).map_err(|r| r.0)?;
        let mut follow = request::parse(self.req.route, body).map_err(|f| f.message.to_string())?;
        // The follow-up goes to the same model's workers (a `/generate` body names none),
        // its legs naming the model as the first attempt's did.
        follow.follow(&self.req);
        prepare_legs(&mut follow, tracker.plan());
        // Only the worker that just failed is avoided: one that failed an earlier move
        // may be back (its breaker says whether it is routable).
        let (mut exclude_d, mut exclude_r) = match role {
            Role::Regular => (Vec::new(), vec![dead]),
            Role::Decode | Role::Prefill => (vec![dead], Vec::new()),
        };
        // With no other worker routable now (the other one recovering, restarting, at
        // capacity), the move waits for one up to `retry.move_wait_ms`: a pause in the
        // stream rather than an error.
        // Only a worker that exists can come back: with no other decode or regular worker
        // of the model in the pool at all, the stream ends at once.
        let (retry, budget) = self.d.retry(self.req.scope.as_deref());
        let wait = Duration::from_millis(retry.move_wait_ms);
        let others = {
            let snap = self.d.pool.load();
            let scope = follow.scope.as_deref();
            let other = |r: Role, ex: &[WorkerId]| {
                snap.workers(r).iter().any(|w| {
                    !ex.contains(&w.id) && scope.is_none_or(|m| w.model.as_deref() == Some(m))
                })
            };
            other(Role::Decode, &exclude_d) || other(Role::Regular, &exclude_r)
        };
        if (wait.is_zero() || !others)
            && !self
                .d
                .move_target_left(&follow, &[], &exclude_d, &exclude_r)
        {
            return Err(match role {
                Role::Regular => "no other worker to move to".into(),
                Role::Decode | Role::Prefill => "no other decode to move to".into(),
            });
        }
        let scope = follow.scope.clone();
        if !budget.try_withdraw(super::Spend::Reserved) {
            return Err("the retry budget is spent".into());
        }
        self.moves_left -= 1;
        tracker.next_segment(sent);
        let d = self.d.clone();
        let root = self.trace.clone();
        let mut ctx = ReqCtx {
            id: self.id,
            request_id: self.request_id.clone(),
            forward: self.forward.to_vec(),
            trace: None,
            slot: None,
            // A move does not wait for a decode slot: a full fleet fails the move at once
            // and the stream ends with its error frame.
            queue: None,
        };
        let first = self.next_attempt;
        let retries = retry.max_retries;
        self.next_attempt += 1 + retries;
        Ok(Box::pin(async move {
            let until = tokio::time::Instant::now() + wait;
            if !d
                .move_target_within(&follow, &exclude_d, &exclude_r, until)
                .await
            {
                return Err(Failure::new(
                    crate::error::FailReason::NoDecodeAvailable,
                    format!(
                        "no other decode became routable within retry.move_wait_ms ({} ms)",
                        wait.as_millis()
                    ),
                ));
            }
            let mut exclude_p = Vec::new();
            let mut n = 0;
            loop {
                let mut trace = LegTrace::default();
                // Traced: an attempt span per try, its reason the move.
                let mut span = root.as_ref().map(|s| {
                    let mut sp = s.child("attempt", crate::trace::SpanKind::Internal);
                    sp.set("pdgate.attempt", first + n);
                    sp.set("retry.reason", "stream_move");
                    sp
                });
                ctx.trace = span.as_ref().and_then(|s| s.scope());
                // A PD pair or a regular worker, as for a first attempt (`dispatch::regular`).
                let r = if d.regular_route(&follow, &exclude_p, &exclude_d, &exclude_r) {
                    d.attempt_regular(&follow, &ctx, first + n, &exclude_r, &mut trace)
                        .await
                } else {
                    d.attempt(&follow, &ctx, first + n, &exclude_p, &exclude_d, &mut trace)
                        .await
                };
                match r {
                    Ok(mut ready) => {
                        ready.record_success(&d.pool);
                        return Ok((ready, trace));
                    }
                    // Nothing pickable now (a recovering decode's one half-open trial
                    // is taken, every rank is full): a pause, not a failure, until the
                    // move's wait is over.
                    Err(af) if nothing_pickable(&af) && tokio::time::Instant::now() < until => {
                        tokio::time::sleep(MOVE_WAIT_POLL).await;
                    }
                    Err(af) => {
                        let f = af.failure;
                        if let Some(sp) = span.as_mut() {
                            sp.fail(f.reason.as_str());
                        }
                        tracing::warn!(request_id = %ctx.id, reason = f.reason.as_str(), error = %f.message, "stream move attempt failed");
                        if let Some((role, w)) = af.blame.filter(|_| !f.stale_connection) {
                            let breaker = d.breaker_cfg(scope.as_deref());
                            d.pool.report_failure(role, w, f.reason, breaker);
                            match role {
                                Role::Prefill => exclude_p.push(w),
                                Role::Decode => exclude_d.push(w),
                                Role::Regular => exclude_r.push(w),
                            }
                        }
                        // The continuation is pdgate's own body, built from a request
                        // the engines already accepted: an engine's 4xx to it says more
                        // about that engine (or the continuation) than about the client,
                        // so another pair is tried (that worker excluded) as for a 5xx.
                        let rejected = matches!(
                            f.reason,
                            crate::error::FailReason::PrefillRejected
                                | crate::error::FailReason::DecodeRejected
                        );
                        let again = (f.reason.retryable() || rejected)
                            && n < retries
                            && d.move_target_left(&follow, &exclude_p, &exclude_d, &exclude_r)
                            && d.retry(scope.as_deref())
                                .1
                                .try_withdraw(super::Spend::Reserved);
                        if !again {
                            return Err(f);
                        }
                        n += 1;
                    }
                }
            }
        }))
    }
}
