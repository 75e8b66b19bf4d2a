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
//! - A move's attempts are run by the one attempts driver ([`super::attempts`], purpose
//!   `Move`): the same blame, exclusion and retry rule as a request's first attempts.
//! - The gap after which a silent decode counts as stalled comes from one place,
//!   `Follow::gap` (learned per (worker, rank), at most `retry.mid_stream_gap_ceiling_ms`).

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use super::attempt::Excluded;
use super::attempts::{Account, Drive, Purpose, WAIT_POLL};
use super::model::Model;
use super::{Dispatcher, ReqCtx};
use crate::error::{FailReason, Failure};
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
    /// The request's model, as it was resolved (its settings, its workers).
    model: Model,
    id: RequestId,
    request_id: HeaderValue,
    forward: Arc<[u8]>,
    moves_left: u32,
    next_attempt: u32,
    /// The request's span, when it is traced: each move's attempts hang under it.
    trace: Option<crate::trace::Scope>,
}

impl Dispatcher {
    /// Whether a move's next attempt has somewhere to go outside the excluded workers: a
    /// regular worker the routing rules pick, or a PD pair.
    fn move_target_left(&self, follow: &ParsedRequest, model: &Model, ex: &Excluded) -> bool {
        self.regular_route(&self.pool.load(), follow, model, ex) || self.has_alternative(model, ex)
    }

    /// [`Self::move_target_left`], looked at again every [`WAIT_POLL`] until `until`
    /// (bounded: the move's wait).
    async fn move_target_within(
        &self,
        follow: &ParsedRequest,
        model: &Model,
        ex: &Excluded,
        until: tokio::time::Instant,
    ) -> bool {
        loop {
            if self.move_target_left(follow, model, ex) {
                return true;
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(WAIT_POLL).await;
        }
    }
}

/// Whether `req` gets a mover, and the plan if so: a stream the config lets move, that
/// can be continued exactly.
pub fn plan_for(model: &Model, req: &ParsedRequest) -> Option<Plan> {
    if model.retry().max_stream_moves == 0 || !req.stream {
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
    model: Model,
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
        moves_left: model.retry().max_stream_moves,
        d,
        req: Arc::new(req),
        model,
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
    /// comes from.
    ///
    /// With stall detection on, the bound is what the decode's (worker, rank) and its peers
    /// taught ([`Dispatcher::gap_deadline`]: `progress.multiplier` × the largest
    /// recent gap of streams that ended well), at most `retry.mid_stream_gap_ceiling_ms`.
    fn gap(&self, at: &Passive) -> Option<Duration> {
        if self.moves_left == 0 {
            return None;
        }
        let ceiling = Duration::from_millis(self.model.retry().mid_stream_gap_ceiling_ms);
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
        let role = match role {
            Role::Regular => Role::Regular,
            Role::Decode | Role::Prefill => Role::Decode,
        };
        let excluded = Excluded::only(role, dead);
        // With no other worker routable now (the other one recovering, restarting, at
        // capacity), the move waits for one up to `retry.move_wait_ms`: a pause in the
        // stream rather than an error.
        // Only a worker that exists can come back: with no other decode or regular worker
        // of the model in the pool at all, the stream ends at once.
        let model = self.model.clone();
        let wait = Duration::from_millis(model.retry().move_wait_ms);
        let others = {
            let snap = self.d.pool.load();
            let scope = model.name();
            let other = |r: Role| {
                snap.workers(r).iter().any(|w| {
                    !excluded.of(r).contains(&w.shared.id)
                        && scope.is_none_or(|m| w.model.as_deref() == Some(m))
                })
            };
            other(Role::Decode) || other(Role::Regular)
        };
        if (wait.is_zero() || !others) && !self.d.move_target_left(&follow, &model, &excluded) {
            return Err(match role {
                Role::Regular => "no other worker to move to".into(),
                Role::Decode | Role::Prefill => "no other decode to move to".into(),
            });
        }
        if !model.budget().try_withdraw(super::Spend::Reserved) {
            return Err("the retry budget is spent".into());
        }
        self.moves_left -= 1;
        tracker.next_segment(sent);
        let d = self.d.clone();
        let mut ctx = ReqCtx {
            id: self.id,
            request_id: self.request_id.clone(),
            forward: self.forward.to_vec(),
            trace: None,
            slot: None,
            // A move does not wait for a decode slot: a full fleet pauses the move (up to
            // its wait) and then fails it, and the stream ends with its error frame.
            queue: None,
        };
        let root = self.trace.clone();
        let first = self.next_attempt;
        self.next_attempt += 1 + model.retry().max_retries;
        Ok(Box::pin(async move {
            let until = tokio::time::Instant::now() + wait;
            if !d
                .move_target_within(&follow, &model, &excluded, until)
                .await
            {
                return Err(Failure::new(
                    FailReason::NoDecodeAvailable,
                    format!(
                        "no other decode became routable within retry.move_wait_ms ({} ms)",
                        wait.as_millis()
                    ),
                ));
            }
            let mut run = Drive::new(Purpose::Move, &model, first);
            run.excluded = excluded;
            run.pause_until = Some(until);
            run.root = root;
            let mut legs = LegTrace::default();
            let ready = d
                .drive(&follow, &mut ctx, &mut run, Account::Move(&mut legs))
                .await?;
            Ok((ready, legs))
        }))
    }
}
