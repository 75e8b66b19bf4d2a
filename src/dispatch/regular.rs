//! A request served whole by a regular (non-PD) worker: SGLang's plain mode, one engine
//! for prefill and decode. One leg, no rooms, no bootstrap.
//!
//! Which way an attempt goes ([`Dispatcher::regular_route`], per attempt, from one
//! snapshot), for the request's model:
//! 1. no routable regular worker (outside the ones this request already blamed): PD;
//! 2. the model has no PD workers at all: regular;
//! 3. the short-prompt bypass (`models.settings."NAME".short_prompt_tokens`): a prompt shorter than the
//!    model's threshold goes regular;
//! 4. none of the model's PD pairs is routable (outside the excluded workers) and
//!    `models.regular_fallback` is on (the default): regular;
//! 5. otherwise PD.
//!
//! Never across models: the regular workers considered are the request's model's
//! (`Snapshot::routable_for`). While one model is served and no name must match
//! (`models::resolve` gives no scope), every regular worker serves that model.
//!
//! Invariants:
//! - The body is the client's, minus the fields pdgate strips from every request (the
//!   client's bootstrap and disaggregation fields), plus `rid` and `stream`
//!   (`ParsedRequest::write_plain`); the answer streams through unbuffered, in the same
//!   response body as a PD answer ([`crate::relay::PdBody`], with no prefill watch).
//! - A failure before the first byte is retried within the usual rules (another regular
//!   worker, or a PD pair when rule 4 or 5 applies then). After it, a continuable stream
//!   moves as a PD stream does ([`super::moves`]: the follow-up goes to another regular
//!   worker of the model, or a PD pair by the same rules); any other ends with the usual
//!   error event. The worker is blamed as `Role::Regular` (its breaker); the reasons are
//!   decode's (`decode_connect`, `decode_status`, ...), the engine that answers.
//! - The load counter of the (worker, rank) is held by the response body and released
//!   when it ends.
//! - Policies: the pick uses the dispatcher's `regular_policy` (the decode policy's
//!   kind), or under a model's policy override its own (`dispatch::model::Policies`).

use bytes::Bytes;
use http::header;
use http_body_util::BodyExt;

use super::attempt::AttemptFailure;
use super::attempt::Excluded;
use super::model::Model;
use super::stall::StallWatch;
use super::{Dispatcher, ReqCtx};
use crate::error::{FailReason, Failure};
use crate::legs::{self, LegCancel};
use crate::memory::Charge;
use crate::policy::{self, PickCtx};
use crate::pool::{LoadGuard, Snapshot};
use crate::relay::sse::{Scan, SseScanner};
use crate::relay::Ready;
use crate::relay::{Passive, PdBodyParts};
use crate::request::record::{LegAt, LegTrace};
use crate::request::ParsedRequest;
use crate::types::{Pair, Role, WorkerIdent};
use crate::upstream::{error_chain, LegBody, LegRequest};

impl Dispatcher {
    /// Whether the next attempt goes to a regular worker (see the module docs). Costs one
    /// empty-slice check while no regular worker is routable.
    pub(super) fn regular_route(
        &self,
        snap: &Snapshot,
        req: &ParsedRequest,
        model: &Model,
        ex: &Excluded,
    ) -> bool {
        if snap.regular_routable.is_empty() {
            return false;
        }
        let scope = model.name();
        if !super::any_routable_left(snap, Role::Regular, scope, ex.of(Role::Regular)) {
            return false;
        }
        // The model's name: its scope, else the only model served.
        let name = scope.or_else(|| match snap.models.as_slice() {
            [only] => Some(&*only.name),
            _ => None,
        });
        let has_pd = match name.and_then(|m| snap.model(m)) {
            Some(m) => m.has_pd(),
            None => !snap.prefills.is_empty() || !snap.decodes.is_empty(),
        };
        if !has_pd {
            return true;
        }
        // The model's own bypass (a fleet serving one model with settings resolves to it:
        // `Dispatcher::resolve_model`).
        if let Some(limit) = model.settings.short_prompt_tokens {
            if req.prompt_tokens() < u64::from(limit) {
                return true;
            }
        }
        self.cfg.models.regular_fallback && !super::pair_left(snap, scope, ex)
    }

    /// One attempt on a regular worker: pick, send, wait for the first bytes (the first
    /// whole event of a stream), within `timeouts.prefill_secs + decode_first_byte_secs`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn attempt_regular(
        &self,
        snap: &Snapshot,
        req: &ParsedRequest,
        model: &Model,
        ctx: &ReqCtx,
        attempt_no: u32,
        ex: &Excluded,
        trace: &mut LegTrace,
    ) -> Result<Ready, AttemptFailure> {
        let scope = model.name();
        let policy = model
            .policies()
            .placing(Role::Regular, self.sticky_key(req));
        let pctx = PickCtx {
            exclude: ex.of(Role::Regular),
            prefix_hash: if policy.wants_prefix() {
                req.affinity_key()
            } else {
                None
            },
            need: None,
            among: Some(snap.routable_for(Role::Regular, scope)),
        };
        let Some(pick) = self
            .rng
            .with(|rng| policy::select(policy, snap, Role::Regular, &pctx, rng))
        else {
            return Err(AttemptFailure::unblamed(no_regular(snap, scope)));
        };
        let t = pick.target;
        let Some(w) = snap.worker(Role::Regular, t.worker) else {
            let f = Failure::new(FailReason::Internal, "picked worker missing from snapshot");
            return Err(AttemptFailure::unblamed(f));
        };
        self.attempt_regular_on(req, model, ctx, attempt_no, w, t, pick.trial, trace)
            .await
    }

    /// One attempt on the regular worker `w` at `t` (picked, or the stalled worker a probe
    /// targets): send, then wait for the first bytes under the stall watch
    /// ([`super::stall::StallWatch::regular`]) and the attempt's timeout.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn attempt_regular_on(
        &self,
        req: &ParsedRequest,
        model: &Model,
        ctx: &ReqCtx,
        attempt_no: u32,
        w: &crate::pool::WorkerView,
        t: crate::types::Target,
        trial: Option<crate::pool::TrialGuard>,
        trace: &mut LegTrace,
    ) -> Result<Ready, AttemptFailure> {
        *trace = LegTrace {
            prefill: None,
            decode: Some(LegAt {
                worker: WorkerIdent::new(Role::Regular, t.worker),
                url: w.shared.url.clone(),
                rank: t.rank,
            }),
            room: None,
        };
        let rid = ctx.id.leg_rid(attempt_no, 'r');
        let body = req.write_plain(&rid, (w.effective_dp() > 1).then_some(t.rank));
        let mut leg = LegRequest::post_json(&w.shared.conns, req.route.path(), body, &ctx.forward);
        leg.rate = self.bulk_rate.clone();
        let mut span = super::attempt::leg_span(ctx, "regular_first_byte", w, t.rank, &mut leg);
        if let Some(sp) = span.as_mut() {
            sp.set("pdgate.role", "regular");
        }
        tracing::debug!(request_id = %ctx.id, worker_id = %WorkerIdent::new(Role::Regular, t.worker), worker_url = %w.shared.url, rank = t.rank, "dispatch to a regular worker");
        let mut cancel = LegCancel::new(&self.up, &w.shared.url, rid);
        let guard = LoadGuard::new(w, t.rank);
        let timeouts = &self.cfg.timeouts;
        let within = timeouts.prefill() + timeouts.decode_first_byte();
        let mut stall =
            StallWatch::regular(&self.cfg.progress, t, w, req.prompt_size(), req.stream);
        let first = self
            .watched_first_bytes(req, w, &leg, within, &mut stall)
            .await;
        let (mut head, decode, first, sse, ended) = match first {
            Ok(v) => v,
            Err(f) => {
                if f.reason.coupling().reported_by == Some(Role::Decode) {
                    cancel.disarm();
                }
                if let Some(sp) = span.as_mut() {
                    sp.fail(f.reason.as_str());
                }
                return Err(AttemptFailure {
                    blame: f.reason.leg().map(|_| (Role::Regular, t.worker)),
                    failure: f,
                    trials: (None, trial),
                });
            }
        };
        if ended {
            cancel.disarm();
        }
        if sse.is_some() {
            // Whole events are forwarded: the engine's length no longer holds.
            head.headers.remove(header::CONTENT_LENGTH);
        }
        Ok(Ready {
            held: Charge::none(),
            pair: Pair {
                prefill: t,
                decode: t,
            },
            decode_incremental: w.facts.incremental_stream(),
            head,
            body: PdBodyParts {
                first: Bytes::from(first),
                decode,
                decode_cancel: cancel,
                decode_guard: guard,
                sse,
                prefill: None,
                prefill_trial: None,
                idle_for: timeouts.stream_idle(),
                passive: Passive {
                    pool: self.pool.clone(),
                    // The model's own thresholds, as before the first byte and on the PD
                    // path (not the top level's).
                    cfg: model.breaker().clone(),
                    prefill: t.worker,
                    decode: t.worker,
                    decode_role: Role::Regular,
                    // No gap is learned from a regular worker's streams: they pause
                    // whenever the engine computes another prompt (its decode steps wait
                    // for a prefill batch), so a silence is judged against
                    // `retry.mid_stream_gap_ceiling_ms` alone.
                    gaps: None,
                    tally: Some((w.per_rank.tally.clone(), t.rank)),
                },
                merge_rate: None,
            },
            trials: (None, trial),
        })
    }

    /// [`Self::regular_first_bytes`] within `within`, under the stall watch: a worker that
    /// sends nothing past its learned deadline while its peers progress fails the attempt
    /// as `decode_stalled` (retried elsewhere; `Dispatcher::on_stall` counts it).
    async fn watched_first_bytes(
        &self,
        req: &ParsedRequest,
        w: &crate::pool::WorkerView,
        leg: &LegRequest,
        within: std::time::Duration,
        stall: &mut StallWatch,
    ) -> Result<FirstBytes, Failure> {
        let first = self.regular_first_bytes(req, w, leg);
        tokio::pin!(first);
        let timeout = tokio::time::sleep(within);
        tokio::pin!(timeout);
        let look = tokio::time::sleep_until(stall.start());
        tokio::pin!(look);
        // Bounded: each turn ends the wait or moves the look later (the timeout holds).
        loop {
            tokio::select! {
                r = &mut first => {
                    if r.is_ok() {
                        stall.first_byte();
                    }
                    return r;
                }
                _ = &mut timeout => {
                    return Err(Failure::new(
                        FailReason::DecodeFirstByteTimeout,
                        format!(
                            "the regular worker sent nothing within {}s",
                            within.as_secs()
                        ),
                    ));
                }
                _ = &mut look, if stall.enabled() => {
                    let at = stall.look(self)?;
                    look.as_mut().reset(at);
                }
            }
        }
    }

    /// Sends the leg and reads until its first bytes: the answer's head, then its first
    /// whole SSE event (an abort in it is a failure, retried) or its first chunk.
    async fn regular_first_bytes(
        &self,
        req: &ParsedRequest,
        w: &crate::pool::WorkerView,
        leg: &LegRequest,
    ) -> Result<FirstBytes, Failure> {
        let resp = self
            .up
            .send_leg(&w.shared.conns, leg)
            .await
            .map_err(|e| legs::send_failure(FailReason::DecodeConnect, "regular worker", &e))?;
        let status = resp.status();
        if !status.is_success() {
            let (_, body) = resp.into_parts();
            return Err(legs::decode_status_failure(status, body).await);
        }
        let (head, mut body) = resp.into_parts();
        let is_sse = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        let limit = self.cfg.upstream.max_answer_bytes;
        let mut sse = (req.stream && is_sse).then(|| SseScanner::new(None, limit));
        let mut first: Vec<u8> = Vec::new();
        let ended = loop {
            match body.frame().await {
                None => break true,
                Some(Err(e)) => {
                    return Err(Failure::new(
                        FailReason::DecodeBroken,
                        format!("the regular worker's answer broke off: {}", error_chain(&e)),
                    ))
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    match sse.as_mut() {
                        Some(s) => match s.push(data) {
                            Scan::Forward(b) => first.extend_from_slice(&b),
                            Scan::Abort { abort, .. } => {
                                return Err(legs::decode_abort_failure(&abort))
                            }
                            Scan::Broken { message } => {
                                return Err(Failure::new(FailReason::DecodeBroken, message))
                            }
                        },
                        None => first.extend_from_slice(&data),
                    }
                    if !first.is_empty() {
                        break false;
                    }
                }
            }
        };
        if ended {
            if let Some(s) = sse.as_mut() {
                first.extend_from_slice(&s.finish());
            }
        }
        Ok((head, body, first, sse, ended))
    }
}

#[cfg(test)]
mod route_props;

/// A regular answer's head, body, first bytes, SSE scanner, and whether it already ended.
type FirstBytes = (
    http::response::Parts,
    LegBody,
    Vec<u8>,
    Option<SseScanner>,
    bool,
);

/// No regular worker of the model can take the request now.
fn no_regular(snap: &Snapshot, model: Option<&str>) -> Failure {
    let msg = match model {
        Some(m) => format!("no routable regular worker serves model {m}"),
        None if snap.regulars.is_empty() => "no regular workers are configured".to_string(),
        None => "no routable regular worker".to_string(),
    };
    Failure::new(FailReason::NoWorkerAvailable, msg)
}
