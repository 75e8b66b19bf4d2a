//! The client's response body once an attempt produced its first bytes: it streams the
//! decode to the client while it keeps watching the prefill ([`super::prefill`]).
//!
//! Invariants:
//! - Whatever ends the response (its last byte, a failure, the client going away), both
//!   legs are finished or cancelled, and every load counter is released, when the body is
//!   dropped — except a prefill leg still answering after decode's answer was complete:
//!   it runs on (bounded by its deadline) and holds its rank's load counter and the
//!   request's admission slot until it ends.
//! - After the first byte reached the client a failure is never retried: a streamed
//!   response ends with one JSON error event and `data: [DONE]`; a non-streamed one is cut.
//!   The one exception is a continuable stream whose decode died or stalled: it is moved to
//!   a new pair and continued exactly (through [`super::mover::Moves`], which `dispatch::moves` implements), or else ends the same way.
//! - A stream that cannot move pays nothing for moves: no mover, no per-event parsing.
//! - The decode body is never buffered: each frame is forwarded when it arrives (an SSE
//!   stream at event granularity, see [`super::sse`]).
//! - The request's record rides in the body: a stream's first event relayed is its time to
//!   first token, each later write one inter-event gap; the request is counted and
//!   access-logged when the body is dropped ([`crate::request::record`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Sleep;

use super::mover::{self, MoveFuture, MoveOutcome, Mover};
use super::parts::{Passive, PdBodyParts, Ready};
use super::prefill::PrefillWatch;
use super::sse::{Scan, SseScanner};
use crate::admission::Slot;
use crate::body::{BoxError, RespBody};
use crate::error::{FailReason, Failure};
use crate::legs::LegCancel;
use crate::pool::{LoadGuard, TrialGuard};
use crate::request::record::{self, Outcome, Phase, RequestRecord};
use crate::types::Role;
use crate::upstream::LegBody;

/// The client's response body: decode's bytes, watched.
pub struct PdBody {
    /// Where the response is: relaying a pair's decode, moving to a new pair, or ended.
    state: State,
    /// How long the decode may be silent.
    idle: IdleWatch,
    /// A continuable stream's account and its way to another decode (through
    /// [`super::mover::Moves`], which `dispatch::moves` implements).
    mover: Option<Box<Mover>>,
    /// Where the pair's failures are reported (the dead pair's while a move is under way).
    passive: Passive,
    /// The response is an SSE stream (for its whole life, moves included): a failure ends
    /// it with an error event, and each write is an event whose time is recorded.
    events: bool,
    /// An SSE stream's last frame read from the decode, as the decode sent it (before a
    /// continuable stream's account cut its usage): a stream's final figures (its usage
    /// chunk) may come a read before its `[DONE]`, and the answer's prompt-cache figures are
    /// read from its end ([`Self::tally`]). A reference to bytes already read (no copy).
    last: Bytes,
    record: RequestRecord,
    /// The request's admission slot: released with this body, or handed to a prefill leg
    /// still running when decode's answer is complete.
    slot: Option<Slot>,
    /// What goes out: a slice at a time, at the merge rate when the stream repeats input
    /// logprobs ([`crate::body::Outflow`]).
    out: crate::body::Outflow,
}

/// Where a response is. `Relaying` → `Ended` is the common life; a continuable stream
/// goes `Relaying` → `Moving` → `Relaying` once per move, or `Moving` → `Ended` when the
/// move fails. Nothing is read once `Ended`.
// `Relaying` is the state nearly every response lives and dies in, and the body is boxed
// once already: boxing the legs would cost each request an allocation to make two rare
// states smaller.
#[allow(clippy::large_enum_variant)]
enum State {
    /// A pair's decode streams to the client.
    Relaying(Legs),
    /// The decode died or stalled; a follow-up attempt finds the stream a new pair.
    Moving(Moving),
    /// The answer is complete, or the response failed.
    Ended,
}

/// The live pair: what the relay reads and what it must finish or cancel.
struct Legs {
    /// Bytes to relay before the decode is read again (the attempt's first bytes).
    pending: Option<Bytes>,
    decode: LegBody,
    /// Aborts the decode's request on its engine when dropped armed.
    cancel: LegCancel,
    /// The decode rank's load counter.
    _guard: LoadGuard,
    /// Cuts an SSE decode stream into events; `None`: bytes pass as they come.
    sse: Option<SseScanner>,
    /// The prefill leg, while it still runs.
    prefill: Option<PrefillWatch>,
    /// See [`PdBodyParts::prefill_trial`].
    prefill_trial: Option<TrialGuard>,
}

impl Legs {
    /// The decode's stream ended and every event it sent has been merged.
    fn decode_ended(&self) -> bool {
        self.decode.is_end_stream() && !self.sse.as_ref().is_some_and(SseScanner::holds)
    }
}

/// A move under way.
struct Moving {
    fut: MoveFuture,
    /// Why it moves (the `reason` of `pdgate_stream_moves_total`).
    why: &'static str,
    /// What the dead pair still holds (its decode's cancel, its rank's load counter, its
    /// prefill's half-open trial): released when the move ends, either way.
    _dead: (LegCancel, LoadGuard, Option<TrialGuard>),
}

/// The silence bound on the decode: the mover's mid-stream gap while a move is left (a
/// stall), then `timeouts.stream_idle`.
struct IdleWatch {
    /// Fires `bound` after the last decode bytes; re-armed lazily (only when it fires
    /// early), so that a frame costs a clock read, not a timer-wheel update.
    timer: Pin<Box<Sleep>>,
    bound: Duration,
    /// `timeouts.stream_idle`: the bound once no move is left.
    stream_idle: Duration,
    last_data: tokio::time::Instant,
}

impl IdleWatch {
    fn new(bound: Duration, stream_idle: Duration) -> IdleWatch {
        IdleWatch {
            timer: Box::pin(tokio::time::sleep(bound)),
            bound,
            stream_idle,
            last_data: tokio::time::Instant::now(),
        }
    }

    /// Bytes came now.
    fn saw_data(&mut self, now: tokio::time::Instant) {
        self.last_data = now;
    }

    /// A new decode streams: silence is counted from now, to `bound`.
    fn restart(&mut self, bound: Duration) {
        self.last_data = tokio::time::Instant::now();
        self.bound = bound;
        self.timer.as_mut().reset(self.last_data + bound);
    }

    /// The bound is the shorter mid-stream gap (a silence past it is a stall).
    fn is_gap(&self) -> bool {
        self.bound < self.stream_idle
    }

    /// No move is left for a stall: the stream waits on for the whole idle bound.
    fn widen(&mut self) {
        self.bound = self.stream_idle;
        self.timer.as_mut().reset(self.last_data + self.stream_idle);
    }

    /// Ready when the decode has been silent for the bound.
    fn poll_silent(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        while self.timer.as_mut().poll(cx).is_ready() {
            let due = self.last_data + self.bound;
            if due > tokio::time::Instant::now() {
                // Data came since the timer was armed: re-arm from the last data.
                self.timer.as_mut().reset(due);
                continue;
            }
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

/// `p` taken apart: the pair's legs, where its failures go, and its merge rate.
fn split(p: PdBodyParts) -> (Legs, Passive, Option<std::sync::Arc<crate::body::ByteRate>>) {
    let legs = Legs {
        pending: (!p.first.is_empty()).then_some(p.first),
        decode: p.decode,
        cancel: p.decode_cancel,
        _guard: p.decode_guard,
        sse: p.sse,
        prefill: p.prefill,
        prefill_trial: p.prefill_trial,
    };
    (legs, p.passive, p.merge_rate)
}

/// Forwarded events pass the mover's account (and its rewrite after a move); `Err`: an
/// event carried an abort or an error (the tracker checks for them: see
/// [`PdBody::adopt_scanner`]), with what goes to the client before it.
fn relay(mover: &mut Option<Box<Mover>>, b: Bytes) -> Result<Bytes, super::splice::Aborted> {
    match mover.as_mut() {
        Some(m) if !b.is_empty() => m.tracker.relay(b),
        _ => Ok(b),
    }
}

type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

impl PdBody {
    /// The response to a client from `ready`: its head (with the request id) and this
    /// body, which holds the admission `slot` (and the bytes the answer held) until it
    /// ends, and moves the stream with `mover` when it can.
    pub fn respond(
        ready: Ready,
        mut record: RequestRecord,
        request_id: &HeaderValue,
        slot: Option<Slot>,
        mover: Option<Box<Mover>>,
    ) -> Response<RespBody> {
        let mut head = ready.head;
        record.set_status(head.status);
        head.headers
            .insert(crate::types::REQUEST_ID, request_id.clone());
        let mut slot = slot;
        if let Some(s) = slot.as_mut() {
            s.hold_bytes(ready.held);
        }
        let body = PdBody::new(ready.body, record, slot, mover);
        Response::from_parts(head, body.boxed_unsync())
    }

    pub fn new(
        p: PdBodyParts,
        record: RequestRecord,
        slot: Option<Slot>,
        mover: Option<Box<Mover>>,
    ) -> PdBody {
        let stream_idle = p.idle_for;
        let (legs, passive, merge_rate) = split(p);
        let bound = idle_bound(mover.as_deref(), &passive, stream_idle);
        let mut body = PdBody {
            events: legs.sse.is_some(),
            last: Bytes::new(),
            state: State::Relaying(legs),
            idle: IdleWatch::new(bound, stream_idle),
            mover,
            passive,
            record,
            slot,
            out: crate::body::Outflow::default(),
        };
        body.out.set_rate(merge_rate);
        body.adopt_scanner();
        body
    }

    /// The decode's events are cut by its scanner; a stream that can move has its tracker
    /// check them for aborts as it reads them (most it has read by then), not the scanner.
    fn adopt_scanner(&mut self) {
        if let (State::Relaying(legs), Some(m)) = (&mut self.state, self.mover.as_mut()) {
            if legs
                .sse
                .as_mut()
                .is_some_and(SseScanner::leave_abort_checks)
            {
                m.tracker.check_aborts();
            }
        }
    }

    /// The relay ends: a prefill leg still running runs on to its own end (holding the
    /// admission slot, recording its verdict and freeing its half-open trial then). Returns
    /// the scanner's unfinished tail; the rest of the legs is dropped by the caller.
    fn detach(&mut self, legs: &mut Legs) -> Bytes {
        if let Some(pw) = legs.prefill.take() {
            let verdict = (
                self.passive.pool.clone(),
                self.passive.prefill,
                legs.prefill_trial.take(),
            );
            pw.detach(self.slot.take(), Some(verdict));
        }
        legs.sse
            .as_mut()
            .map(SseScanner::finish)
            .unwrap_or_default()
    }

    /// Decode's answer is complete: nothing is cancelled, and a prefill answer still on its
    /// way (its KV was sent, or decode could not have answered) is left to finish on its
    /// own. Returns the scanner's unfinished tail, if any.
    /// The answer's prompt-cache figures, read from `out`, its last bytes as the decode
    /// sent them (else from the stream's frame before), go to the prefill rank's tally.
    fn tally(&mut self, out: &[u8]) {
        let Some((tally, rank)) = &self.passive.tally else {
            return;
        };
        let last = std::mem::take(&mut self.last);
        if let Some(pc) =
            crate::skim::prompt_cache(out).or_else(|| crate::skim::prompt_cache(&last))
        {
            tally.answered(*rank, pc.prompt_tokens, pc.cached_tokens);
        }
    }

    /// The answer ended well, its last bytes (as the decode sent them) `out`: counted,
    /// its legs let go; returns what still goes to the client after `out`.
    fn end_ok(&mut self, out: &[u8]) -> Bytes {
        let State::Relaying(mut legs) = std::mem::replace(&mut self.state, State::Ended) else {
            return Bytes::new();
        };
        self.tally(out);
        legs.cancel.disarm();
        let tail = self.detach(&mut legs);
        self.record.finish(Outcome::Ok);
        // A moved stream's largest gap is the pause of its move, not its decode's rhythm:
        // learned from, it would lift the bound that finds the next stall.
        if let (Some((p, rank)), Some(gap), 0) = (
            &self.passive.gaps,
            self.record.max_gap(),
            self.record.moves(),
        ) {
            p.record(crate::progress::Kind::Gap, *rank, gap, 1);
        }
        tail
    }

    /// Ends the response with `f` (the current pair's failure, reported to its breaker):
    /// cancels what still runs, then an SSE error event or a cut connection.
    fn fail(&mut self, f: Failure, before: Bytes) -> Polled {
        if let Some(role) = f.reason.leg() {
            let (role, id) = match role {
                Role::Prefill => (role, self.passive.prefill),
                // A regular worker's answer fails like a decode's (`Passive::decode_role`).
                Role::Decode | Role::Regular => (self.passive.decode_role, self.passive.decode),
            };
            self.passive
                .pool
                .report_failure(role, id, f.reason, &self.passive.cfg);
        }
        self.end_failed(f, before)
    }

    /// Ends the response with `f`, reported already (a failed move reported its own legs'
    /// failures; the dead pair was reported when the move began).
    fn end_failed(&mut self, f: Failure, before: Bytes) -> Polled {
        tracing::warn!(request_id = %self.record.id(), reason = f.reason.as_str(), error = %f.message, "request failed after streaming began");
        record::failed(f.reason, Phase::Streaming);
        self.record.fail(f.reason);
        if let State::Relaying(mut legs) = std::mem::replace(&mut self.state, State::Ended) {
            if f.reason.coupling().reported_by == Some(Role::Decode) {
                // The decode answered the failure itself: nothing to abort.
                legs.cancel.disarm();
            }
            // Dropped here: both legs (the decode aborted on its engine unless disarmed),
            // the prefill's trial and the decode's load counter.
        }
        if self.events {
            let mut out = Vec::with_capacity(before.len() + 256);
            out.extend_from_slice(&before);
            out.extend_from_slice(&f.sse_event());
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))))
        } else {
            Poll::Ready(Some(Err(Box::new(FailureError(f)))))
        }
    }

    /// The decode failed mid-stream: move the stream to another decode if it can be
    /// continued, else end it with `f`. `before` (whole events ahead of the failure) is
    /// forwarded first either way.
    fn fail_or_move(
        &mut self,
        f: Failure,
        before: Bytes,
        why: &'static str,
        cx: &mut Context<'_>,
    ) -> Polled {
        match relay(&mut self.mover, before) {
            Ok(before) => self.fail_or_move_relayed(f, before, why, cx),
            // An event ahead of the failure was itself an abort: that is the failure.
            Err(a) => self.aborted(a, cx),
        }
    }

    /// An event carried an abort or an error: [`Self::fail_or_move_relayed`] with it.
    fn aborted(&mut self, a: super::splice::Aborted, cx: &mut Context<'_>) -> Polled {
        let f = crate::legs::decode_abort_failure(&a.abort);
        let why = f.reason.as_str();
        self.fail_or_move_relayed(f, a.before, why, cx)
    }

    /// [`Self::fail_or_move`] with `before` already relayed.
    fn fail_or_move_relayed(
        &mut self,
        f: Failure,
        before: Bytes,
        why: &'static str,
        cx: &mut Context<'_>,
    ) -> Polled {
        if self.answer_complete() {
            return self.close_complete(&f, before);
        }
        if self.try_move(&f, why).is_err() {
            return self.fail(f, before);
        }
        if !before.is_empty() {
            self.record.event_sent(tokio::time::Instant::now());
            return Poll::Ready(Some(Ok(Frame::data(before))));
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// The client has the whole answer (a finish reason was relayed): a decode that fails
    /// now only failed to end its stream.
    fn answer_complete(&mut self) -> bool {
        self.mover.as_mut().is_some_and(|m| m.tracker.complete())
    }

    /// Ends a complete answer whose decode failed before ending its stream: what the
    /// client still lacks (its usage chunk, `[DONE]`) is written by pdgate, and the request
    /// counts as answered; the decode's failure still counts for its breaker (no stream
    /// gap is learned from it).
    fn close_complete(&mut self, f: &Failure, before: Bytes) -> Polled {
        tracing::info!(request_id = %self.record.id(), reason = f.reason.as_str(), error = %f.message, "decode failed after the answer was complete; stream ended by pdgate");
        let (role, decode) = (self.passive.decode_role, self.passive.decode);
        self.passive
            .pool
            .report_failure(role, decode, f.reason, &self.passive.cfg);
        let closing = self
            .mover
            .as_mut()
            .map(|m| m.tracker.closing())
            .unwrap_or_default();
        let carry = match std::mem::replace(&mut self.state, State::Ended) {
            State::Relaying(mut legs) => {
                if f.reason.coupling().reported_by == Some(Role::Decode) {
                    legs.cancel.disarm();
                }
                self.detach(&mut legs)
            }
            _ => Bytes::new(),
        };
        self.record.finish(Outcome::Ok);
        let mut out = Vec::with_capacity(before.len() + carry.len() + closing.len());
        out.extend_from_slice(&before);
        out.extend_from_slice(&carry);
        out.extend_from_slice(&closing);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))))
    }

    /// A silent stream (`f`, its idle failure) started moving, when a move is left for it.
    fn move_stalled(&mut self, f: &Failure) -> bool {
        let can = self
            .mover
            .as_ref()
            .is_some_and(|m| m.gap(&self.passive).is_some());
        can && self.try_move(f, "stalled").is_ok()
    }

    /// Starts moving the stream off its decode after `f`; `Err` (logged and counted) when
    /// it cannot be moved. Nothing is ended here.
    fn try_move(&mut self, f: &Failure, why: &'static str) -> Result<(), ()> {
        let Some(m) = self.mover.as_mut() else {
            return Err(());
        };
        if !matches!(self.state, State::Relaying(_)) {
            return Err(());
        }
        let route = m.route();
        let (role, dead) = (self.passive.decode_role, self.passive.decode);
        let fut = match m.start(role, dead) {
            Ok(fut) => fut,
            Err(refused) => {
                tracing::info!(request_id = %self.record.id(), reason = why, refused = %refused, "stream not moved");
                mover::count(route, why, MoveOutcome::Refused);
                return Err(());
            }
        };
        let url = self
            .passive
            .pool
            .load()
            .worker(role, dead)
            .map(|w| w.shared.url.to_string());
        tracing::warn!(request_id = %self.record.id(), reason = f.reason.as_str(), error = %f.message, role = role.as_str(),
            worker_id = %crate::types::WorkerIdent::new(role, dead), worker_url = url.as_deref().unwrap_or("-"),
            "decode failed mid-stream; moving the stream to another worker");
        self.passive
            .pool
            .report_failure(role, dead, f.reason, &self.passive.cfg);
        if let State::Relaying(mut legs) = std::mem::replace(&mut self.state, State::Ended) {
            if f.reason.coupling().reported_by == Some(Role::Decode) {
                legs.cancel.disarm();
            }
            // The dead decode's leg and anything left of its prefill end here.
            let Legs {
                cancel,
                _guard,
                prefill_trial,
                ..
            } = legs;
            self.state = State::Moving(Moving {
                fut,
                why,
                _dead: (cancel, _guard, prefill_trial),
            });
        }
        Ok(())
    }

    /// The move's new pair streams now: its parts replace the dead decode's.
    fn install(&mut self, ready: Ready, trace: crate::request::record::LegTrace) {
        if let Some(m) = self.mover.as_mut() {
            m.moved_to(ready.decode_incremental);
        }
        let (legs, passive, merge_rate) = split(ready.body);
        self.state = State::Relaying(legs);
        self.passive = passive;
        self.adopt_scanner();
        self.out.set_rate(merge_rate);
        self.record.legs = trace;
        self.record.moved();
        let bound = idle_bound(self.mover.as_deref(), &self.passive, self.idle.stream_idle);
        self.idle.restart(bound);
    }

    /// A move under way: `None` while it runs on or once the new pair streams; its
    /// failure ends the response.
    fn poll_move(&mut self, cx: &mut Context<'_>) -> Option<Polled> {
        let State::Moving(mv) = &mut self.state else {
            return None;
        };
        let why = mv.why;
        let route = match self.record.route() {
            record::Route::Api(r) => r,
            record::Route::Other(_) => crate::request::ApiRoute::Generate,
        };
        match mv.fut.as_mut().poll(cx) {
            Poll::Pending => Some(Poll::Pending),
            Poll::Ready(Ok((ready, trace))) => {
                self.state = State::Ended;
                mover::count(route, why, MoveOutcome::Moved);
                self.install(ready, trace);
                None
            }
            Poll::Ready(Err(f)) => {
                self.state = State::Ended;
                mover::count(route, why, MoveOutcome::Failed);
                Some(self.end_failed(f, Bytes::new()))
            }
        }
    }
}

/// How long a stream may be silent: the mover's gap bound for its worker while a move is
/// left, at most `stream_idle`.
fn idle_bound(mover: Option<&Mover>, passive: &Passive, stream_idle: Duration) -> Duration {
    mover
        .and_then(|m| m.gap(passive))
        .map_or(stream_idle, |g| g.min(stream_idle))
}

/// A failure carried as a body error (cuts a non-streamed response).
#[derive(Debug)]
pub struct FailureError(pub Failure);
impl std::fmt::Display for FailureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
impl std::error::Error for FailureError {}

impl Body for PdBody {
    type Data = Bytes;
    type Error = BoxError;

    /// [`PdBody::poll_next`], handed to hyper through [`crate::body::Outflow`]: at most
    /// [`crate::body::SLICE_BYTES`] at a time, with a yield to the event loop after each.
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = &mut *self;
        if let Some(data) = std::task::ready!(this.out.poll_pending(cx)) {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        match this.poll_next(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => this.out.send(data, cx).map(|d| Some(Ok(Frame::data(d)))),
                Err(frame) => Poll::Ready(Some(Ok(frame))),
            },
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, State::Ended) && self.out.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl PdBody {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Polled {
        if let Some(p) = self.poll_move(cx) {
            return p;
        }
        let State::Relaying(legs) = &mut self.state else {
            return Poll::Ready(None);
        };
        if let Some(b) = legs.pending.take() {
            // The decode's own bytes, before a continuable stream's account cuts the usage
            // it asked for (the tally reads them).
            let raw = self.mover.is_some().then(|| b.clone());
            let b = match relay(&mut self.mover, b) {
                Ok(b) => b,
                Err(a) => return self.aborted(a, cx),
            };
            let at_end = matches!(&self.state, State::Relaying(l) if l.decode_ended());
            // A continued stream's first event may be one the client already had (dropped).
            if !b.is_empty() || at_end {
                if self.events {
                    self.record.event_sent(tokio::time::Instant::now());
                }
                // The whole answer may have come with the first bytes (a non-streamed
                // answer with a Content-Length, after which hyper stops polling this body).
                let b = if at_end {
                    let tail = self.end_ok(raw.as_ref().unwrap_or(&b));
                    join(b, tail)
                } else {
                    if self.events {
                        self.last = raw.unwrap_or_else(|| b.clone());
                    }
                    b
                };
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
        }
        if let State::Relaying(legs) = &mut self.state {
            if let Some(pw) = legs.prefill.as_mut() {
                if let Poll::Ready(r) = Pin::new(pw).poll(cx) {
                    legs.prefill = None;
                    match r {
                        // The prefill's own leg succeeded: its verdict, then its trial.
                        Ok(_) => {
                            let p = &self.passive;
                            p.pool.report_success(Role::Prefill, p.prefill);
                            legs.prefill_trial = None;
                        }
                        Err(f) => return self.fail(f, Bytes::new()),
                    }
                }
            }
        }
        loop {
            let State::Relaying(legs) = &mut self.state else {
                return Poll::Ready(None);
            };
            // Events the scanner still holds go first (an empty push merges them).
            let held = legs.sse.as_ref().is_some_and(SseScanner::holds);
            let polled = match held {
                true => Poll::Ready(Some(Ok(Frame::data(Bytes::new())))),
                false => Pin::new(&mut legs.decode).poll_frame(cx),
            };
            match polled {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let now = tokio::time::Instant::now();
                    self.idle.saw_data(now);
                    // The decode's own bytes when the account rewrites them (see the tally).
                    let mut raw = None;
                    let out = match legs.sse.as_mut() {
                        None => data,
                        Some(sse) => match sse.push(data) {
                            Scan::Forward(b) => {
                                if self.mover.is_some() {
                                    raw = Some(b.clone());
                                }
                                match relay(&mut self.mover, b) {
                                    Ok(b) => b,
                                    Err(a) => return self.aborted(a, cx),
                                }
                            }
                            Scan::Abort { before, abort } => {
                                let f = crate::legs::decode_abort_failure(&abort);
                                let why = f.reason.as_str();
                                return self.fail_or_move(f, before, why, cx);
                            }
                            Scan::Broken { message } => {
                                let f = Failure::new(FailReason::DecodeBroken, message);
                                return self.fail(f, Bytes::new());
                            }
                        },
                    };
                    let at_end = legs.decode_ended();
                    let out = if at_end {
                        let tail = self.end_ok(raw.as_ref().unwrap_or(&out));
                        join(out, tail)
                    } else {
                        if self.events {
                            let frame = raw.unwrap_or_else(|| out.clone());
                            if !frame.is_empty() {
                                self.last = frame;
                            }
                        }
                        out
                    };
                    if out.is_empty() {
                        if at_end {
                            return Poll::Ready(None);
                        }
                        continue;
                    }
                    if self.events {
                        self.record.event_sent(now);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(out))));
                }
                Poll::Ready(Some(Err(e))) => {
                    let f = Failure::new(
                        FailReason::DecodeBroken,
                        format!(
                            "decode stream broke off: {}",
                            crate::upstream::error_chain(&e)
                        ),
                    );
                    return self.fail_or_move(f, Bytes::new(), "decode_broken", cx);
                }
                Poll::Ready(None) => {
                    let tail = self.end_ok(&[]);
                    if !tail.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(tail))));
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => break,
            }
        }
        while self.idle.poll_silent(cx).is_ready() {
            let f = Failure::new(
                FailReason::DecodeIdleTimeout,
                format!("decode sent nothing for {}s", self.idle.bound.as_secs_f64()),
            );
            if self.answer_complete() {
                return self.close_complete(&f, Bytes::new());
            }
            if self.idle.is_gap() {
                // Silent past the mid-stream gap: a stall, moved if it can be; if not, the
                // stream waits on for the full idle bound.
                if self.move_stalled(&f) {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                self.idle.widen();
                continue;
            }
            // Silent for the whole idle bound (the learned gap was at least as long, or
            // the move above could not start then): moved if it can be now.
            if self.move_stalled(&f) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            return self.fail(f, Bytes::new());
        }
        Poll::Pending
    }
}

/// `a` then `b`, copying only when both hold bytes.
fn join(a: Bytes, b: Bytes) -> Bytes {
    match (a.is_empty(), b.is_empty()) {
        (_, true) => a,
        (true, false) => b,
        (false, false) => {
            let mut v = Vec::with_capacity(a.len() + b.len());
            v.extend_from_slice(&a);
            v.extend_from_slice(&b);
            Bytes::from(v)
        }
    }
}
