//! The attempts driver: the one loop that runs a request's attempts until one produces its
//! first bytes, before the first byte (a request's answer, after a failure or a stall) and
//! for a live stream's move alike, on PD pairs and regular workers alike.
//!
//! Each attempt reads one pool snapshot: the route (a PD pair or a regular worker,
//! [`Dispatcher::regular_route`]) and the pick come from it (an attempt that waits for a
//! decode slot looks again after each wake-up). After a failed attempt, one place blames
//! (the failure table, [`crate::error::FailReason::coupling`], names the leg; the model's
//! breaker thresholds count it; a stall is counted for ejection), excludes the blamed
//! worker from the next attempts ([`Excluded`], by role), and decides what comes next
//! (`Dispatcher::next_after`, a rule in the style of tower's retry policy):
//! - **pause**: a move whose attempt found nothing to pick right now (every decode rank
//!   full, a recovering worker's one trial taken) looks again shortly, until its wait ends;
//! - **retry**: the reason is retryable, retries are left (a keep-alive race before the
//!   first byte is not counted), the retry budget has a balance for it, and a worker outside
//!   the exclusions is routable, or becomes routable within `retry.move_wait_ms` when a
//!   worker was blamed ([`Dispatcher::alternative_within`]);
//! - **answer**: anything else; the client gets the failure (logged with why it was not
//!   retried).
//!
//! What differs between a request's answer and a move is its [`Purpose`]: a move spends
//! the budget's reserve, retries an engine's 4xx to pdgate's own continuation body, pauses
//! while nothing can be picked, and counts every retry; a request's answer is bounded by
//! the request's timeout and its failures are counted as `before_first_byte`.

use std::time::Duration;

use tokio::time::Instant;

use super::model::Model;
use super::{Dispatcher, ReqCtx, Spend, MAX_ATTEMPTS};
use crate::error::{FailReason, Failure};
use crate::relay::Ready;
use crate::request::record::{self, LegTrace, Phase, RequestRecord};
use crate::request::ParsedRequest;
use crate::types::{Role, WorkerIdent};

use super::attempt::{AttemptFailure, Excluded};

/// How often a wait for a routable worker looks again.
pub(super) const WAIT_POLL: Duration = Duration::from_millis(25);

/// Why attempts run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A request's answer: nothing has reached the client yet.
    Answer,
    /// A live stream's move to another worker (`dispatch::moves`).
    Move,
}

impl Purpose {
    /// What a retry after `reason` spends of the budget.
    fn spend(self, reason: FailReason) -> Spend {
        match self {
            Purpose::Answer => Spend::retry_of(reason),
            Purpose::Move => Spend::Reserved,
        }
    }

    /// Whether a failure for `reason` may be retried at all. A move's continuation is
    /// pdgate's own body, built from a request the engines already accepted: an engine's
    /// 4xx to it says more about that engine (or the continuation) than about the client,
    /// so another pair is tried (that worker excluded) as for a 5xx.
    fn retryable(self, reason: FailReason) -> bool {
        reason.retryable()
            || (self == Purpose::Move
                && matches!(
                    reason,
                    FailReason::PrefillRejected | FailReason::DecodeRejected
                ))
    }
}

/// One run of attempts: what it is for, for which model, and where it stands.
pub struct Drive<'m> {
    pub purpose: Purpose,
    pub model: &'m Model,
    pub excluded: Excluded,
    /// The next attempt's number (its legs' rids and span).
    pub attempt_no: u32,
    /// Retries counted against `retry.max_retries`.
    counted: u32,
    /// Each attempt ends by then (`RequestTimeout`), when set; a retry's wait for a
    /// recovering worker ends by then too.
    pub deadline: Option<Instant>,
    /// A move: until when an attempt that found nothing to pick is paused, not failed.
    pub pause_until: Option<Instant>,
    /// The span the attempts hang under, when the request is traced.
    pub root: Option<crate::trace::Scope>,
}

impl<'m> Drive<'m> {
    pub fn new(purpose: Purpose, model: &'m Model, attempt_no: u32) -> Drive<'m> {
        Drive {
            purpose,
            model,
            excluded: Excluded::default(),
            attempt_no,
            counted: 0,
            deadline: None,
            pause_until: None,
            root: None,
        }
    }
}

/// Where a run's attempts are accounted: a request's record (its legs and attempt count),
/// or a move's own leg trace.
pub enum Account<'a> {
    Request(&'a mut RequestRecord),
    Move(&'a mut LegTrace),
}

impl Account<'_> {
    fn legs(&mut self) -> &mut LegTrace {
        match self {
            Account::Request(r) => &mut r.legs,
            Account::Move(t) => t,
        }
    }
}

/// What follows a failed attempt (a pause, for a move that found nothing to pick, comes
/// before blame: it is not a failure).
enum Next {
    Retry,
    /// The failure is the answer; why it was not retried, when it was retryable.
    Answer(Option<&'static str>),
}

impl Dispatcher {
    /// Runs attempts for `req` (see the module docs) until one produces its first bytes
    /// (its verdict recorded), or the failure that is the answer.
    pub(super) async fn drive(
        &self,
        req: &ParsedRequest,
        ctx: &mut ReqCtx,
        run: &mut Drive<'_>,
        mut account: Account<'_>,
    ) -> Result<Ready, Failure> {
        let mut retry_reason: Option<&'static str> = match run.purpose {
            Purpose::Answer => None,
            Purpose::Move => Some("stream_move"),
        };
        loop {
            if let Account::Request(r) = &mut account {
                r.set_attempts(run.attempt_no + 1);
            }
            let mut span = run.root.as_ref().map(|s| {
                let mut sp = s.child("attempt", crate::trace::SpanKind::Internal);
                sp.set("pdgate.attempt", run.attempt_no);
                if let Some(why) = retry_reason {
                    sp.set("retry.reason", why);
                }
                sp
            });
            ctx.trace = span.as_ref().and_then(|s| s.scope());
            let res = self.one_attempt(req, ctx, run, account.legs()).await;
            let af = match res {
                Ok(mut ready) => {
                    drop(span);
                    ready.record_success(&self.pool);
                    return Ok(ready);
                }
                Err(af) => af,
            };
            if run.pause_until.is_some_and(|until| Instant::now() < until) && nothing_pickable(&af)
            {
                // Not a failure: nothing can be picked right now (see `Next::Pause`).
                tokio::time::sleep(WAIT_POLL).await;
                continue;
            }
            let blamed = self.blame(req, ctx, run, &af, span.as_mut());
            match self.next_after(req, run, &af.failure, blamed).await {
                Next::Retry => {
                    let f = &af.failure;
                    if run.purpose == Purpose::Answer {
                        record::retried(f.reason);
                        retry_reason = Some(f.reason.as_str());
                    }
                    if run.purpose == Purpose::Move || !f.stale_connection {
                        run.counted += 1;
                    }
                    run.attempt_no += 1;
                }
                Next::Answer(why_not) => {
                    if let Some(why) = why_not {
                        tracing::info!(request_id = %ctx.id, reason = af.failure.reason.as_str(), attempt = run.attempt_no, why, "not retried");
                    }
                    return Err(af.failure);
                }
            }
        }
    }

    /// One attempt from one snapshot: a regular worker or a PD pair, within the run's
    /// deadline.
    async fn one_attempt(
        &self,
        req: &ParsedRequest,
        ctx: &ReqCtx,
        run: &Drive<'_>,
        legs: &mut LegTrace,
    ) -> Result<Ready, AttemptFailure> {
        let snap = self.pool.load_full();
        let ex = &run.excluded;
        let model = run.model;
        let fut = async {
            if self.regular_route(&snap, req, model, ex) {
                self.attempt_regular(&snap, req, model, ctx, run.attempt_no, ex, legs)
                    .await
            } else {
                self.attempt(snap.clone(), req, model, ctx, run.attempt_no, ex, legs)
                    .await
            }
        };
        let Some(deadline) = run.deadline else {
            return fut.await;
        };
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(AttemptFailure::unblamed(Failure::new(
                FailReason::RequestTimeout,
                format!(
                    "no response within the request timeout of {}s",
                    self.cfg.timeouts.request_secs
                ),
            ))),
        }
    }

    /// A failed attempt's account: counted, traced and logged with the worker it blames;
    /// that worker's breaker counts it (by the model's thresholds), a stall is counted for
    /// ejection, and the worker is excluded from the next attempts. A keep-alive race (the
    /// engine closed the leg's pooled connection just as it was sent) is nobody's fault:
    /// no breaker count, no exclusion. Returns whether a worker was blamed.
    fn blame(
        &self,
        req: &ParsedRequest,
        ctx: &ReqCtx,
        run: &mut Drive<'_>,
        af: &AttemptFailure,
        span: Option<&mut crate::trace::Span>,
    ) -> bool {
        let f = &af.failure;
        if run.purpose == Purpose::Answer {
            record::failed(f.reason, Phase::BeforeFirstByte);
        }
        if let Some(sp) = span {
            sp.fail(f.reason.as_str());
            if let Some((role, w)) = af.blame {
                sp.set("pdgate.blamed_role", role.as_str());
                sp.set(
                    "pdgate.blamed_worker_id",
                    WorkerIdent::new(role, w).to_string(),
                );
            }
        }
        // The line names the worker blamed (its one name and URL), when one is.
        let blamed = af.blame.map(|(role, w)| {
            let url = self
                .pool
                .load()
                .worker(role, w)
                .map(|v| v.shared.url.to_string());
            (role, WorkerIdent::new(role, w), url.unwrap_or_default())
        });
        let message = match run.purpose {
            Purpose::Answer => "attempt failed",
            Purpose::Move => "stream move attempt failed",
        };
        tracing::warn!(
            request_id = %ctx.id,
            attempt = run.attempt_no,
            reason = f.reason.as_str(),
            error = %f.message,
            role = blamed.as_ref().map_or("-", |b| b.0.as_str()),
            worker_id = %blamed.as_ref().map_or("-".to_string(), |b| b.1.to_string()),
            worker_url = blamed.as_ref().map_or("-", |b| b.2.as_str()),
            model = req.scope.as_deref().unwrap_or("-"),
            "{message}"
        );
        let Some((role, w)) = af.blame.filter(|_| !f.stale_connection) else {
            return false;
        };
        self.pool
            .report_failure(role, w, f.reason, run.model.breaker());
        if f.reason.is_stall() {
            self.on_stall(role, w);
        }
        run.excluded.push(role, w);
        true
    }

    /// The rule after a failed attempt (see the module docs): retry only where a fresh
    /// pick can avoid the blamed worker.
    async fn next_after(
        &self,
        req: &ParsedRequest,
        run: &Drive<'_>,
        f: &Failure,
        blamed: bool,
    ) -> Next {
        if !run.purpose.retryable(f.reason) {
            return Next::Answer(None);
        }
        let spend = run.purpose.spend(f.reason);
        let budget = run.model.budget();
        let counts = run.purpose == Purpose::Move || !f.stale_connection;
        if (counts && run.counted >= run.model.retry().max_retries)
            || run.attempt_no >= MAX_ATTEMPTS
        {
            return Next::Answer(Some("the request's retries are spent"));
        }
        if !budget.has_balance(spend) {
            return Next::Answer(Some("the retry budget is spent"));
        }
        let until = match (run.deadline, run.pause_until) {
            (Some(d), Some(p)) => d.min(p),
            (Some(d), None) => d,
            (None, Some(p)) => p,
            (None, None) => Instant::now(),
        };
        if !(self.regular_route(&self.pool.load(), req, run.model, &run.excluded)
            || self
                .alternative_within(run.model, &run.excluded, blamed, until)
                .await)
        {
            return Next::Answer(Some("no other pair to retry on"));
        }
        if !budget.try_withdraw(spend) {
            return Next::Answer(Some("the retry budget is spent"));
        }
        Next::Retry
    }

    /// Whether a retry has a routable pair outside the excluded workers, waiting for one up
    /// to `retry.move_wait_ms` (and `deadline`) when a worker that is not excluded exists
    /// but is not routable now (its breaker open after a fault, its ranks re-registering):
    /// a failed attempt whose only alternative is recovering costs the client that pause,
    /// as a stream's move does, not an error. With no such worker (the only one of a role
    /// was blamed) the answer is at once, and so it is when no worker failed the attempt
    /// (`blamed` false: nothing was sent, because nothing was routable or a pooled
    /// connection raced its close): what the router sees now is the answer, as fail fast
    /// promises, rather than a wait for the very workers it saw down.
    pub(super) async fn alternative_within(
        &self,
        model: &Model,
        ex: &Excluded,
        blamed: bool,
        deadline: Instant,
    ) -> bool {
        if self.has_alternative(model, ex) {
            return true;
        }
        if !blamed {
            return false;
        }
        let wait = Duration::from_millis(model.retry().move_wait_ms);
        let snap = self.pool.load();
        let exists = |role: Role| {
            snap.workers(role)
                .iter()
                .any(|w| !ex.of(role).contains(&w.shared.id))
        };
        if wait.is_zero() || !exists(Role::Prefill) || !exists(Role::Decode) {
            return false;
        }
        drop(snap);
        let until = (Instant::now() + wait).min(deadline);
        // Bounded: one look per poll until `until`.
        while Instant::now() < until {
            tokio::time::sleep(WAIT_POLL).await;
            if self.has_alternative(model, ex) {
                return true;
            }
        }
        false
    }

    /// Whether both pools (of the model) still have a routable target outside the
    /// excluded workers.
    pub(super) fn has_alternative(&self, model: &Model, ex: &Excluded) -> bool {
        super::pair_left(&self.pool.load(), model.name(), ex)
    }
}

/// Whether an attempt failed only because no pair could be picked right now (no worker
/// was tried, so none is blamed): every decode rank full, no eligible worker, or no
/// prefill rank that can bootstrap.
fn nothing_pickable(af: &AttemptFailure) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::WorkerId;

    /// The rule's two purposes differ only where the module docs say: what a retry spends,
    /// and whether an engine's 4xx is retried. Table: reason, purpose → (retryable, spend).
    #[test]
    fn a_moves_rule_and_an_answers_rule() {
        use FailReason::*;
        use Purpose::*;
        let cases = [
            (DecodeBroken, Answer, true, Spend::Retry),
            (DecodeBroken, Move, true, Spend::Reserved),
            (DecodeStalled, Answer, true, Spend::Reserved),
            (DecodeRejected, Answer, false, Spend::Retry),
            (DecodeRejected, Move, true, Spend::Reserved),
            (PrefillRejected, Move, true, Spend::Reserved),
            (InvalidRequest, Answer, false, Spend::Retry),
            (InvalidRequest, Move, false, Spend::Reserved),
        ];
        for (reason, purpose, retryable, spend) in cases {
            assert_eq!(
                purpose.retryable(reason),
                retryable,
                "{reason:?} {purpose:?}"
            );
            assert_eq!(purpose.spend(reason), spend, "{reason:?} {purpose:?}");
        }
    }

    /// One exclusion set, keyed by role.
    #[test]
    fn exclusions_are_kept_by_role() {
        let mut ex = Excluded::only(Role::Regular, WorkerId(3));
        ex.push(Role::Decode, WorkerId(1));
        ex.push(Role::Decode, WorkerId(2));
        assert_eq!(ex.of(Role::Regular), &[WorkerId(3)]);
        assert_eq!(ex.of(Role::Decode), &[WorkerId(1), WorkerId(2)]);
        assert!(ex.of(Role::Prefill).is_empty());
    }
}
