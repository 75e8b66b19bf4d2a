//! One attempt: pick a pair, check the prefill rank's bootstrap, send both legs, and wait
//! until decode's first bytes are in hand (the last point where a failure can still be
//! retried, because the client has seen nothing).

use bytes::Bytes;
use http::{header, HeaderValue, Response};
use http_body_util::BodyExt;

use super::flight::{Passive, PdBody, PdBodyParts, PrefillWatch, RequestRecord};
use super::legs::{self, LegCancel, PrefillDone};
use super::logprobs::PrefillLogprobs;
use super::request::{LegFields, ParsedRequest};
use super::sse::{Scan, SseScanner};
use super::{room, Dispatcher, ReqCtx};
use crate::body::RespBody;
use crate::bootstrap::preflight;
use crate::config::ContractMode;
use crate::error::{FailReason, Failure};
use crate::policy::{self, PickCtx};
use crate::pool::{LoadGuard, PreflightOutcome, RankFailure, RankReadiness, Snapshot};
use crate::types::{Pair, Role, WorkerId};
use crate::upstream::LegRequest;

/// A failed attempt and the worker it blames (excluded from the next attempt).
pub struct AttemptFailure {
    pub failure: Failure,
    pub blame: Option<(Role, WorkerId)>,
}

fn fail(f: Failure, blame: Option<(Role, WorkerId)>) -> AttemptFailure {
    AttemptFailure { failure: f, blame }
}

/// The worker a failure blames: the one serving the leg its reason names.
fn blame(f: &Failure, pair: &Pair) -> Option<(Role, WorkerId)> {
    match f.reason.leg()? {
        Role::Prefill => Some((Role::Prefill, pair.prefill.worker)),
        Role::Decode => Some((Role::Decode, pair.decode.worker)),
    }
}

/// An attempt whose decode produced its first bytes.
pub struct Ready {
    pub pair: Pair,
    head: http::response::Parts,
    body: PdBodyParts,
}

impl Ready {
    pub fn into_response(
        self,
        record: RequestRecord,
        request_id: &HeaderValue,
        slot: Option<super::AdmissionSlot>,
    ) -> Response<RespBody> {
        let mut head = self.head;
        head.headers
            .insert(crate::server::REQUEST_ID, request_id.clone());
        Response::from_parts(head, PdBody::new(self.body, record, slot).boxed_unsync())
    }
}

/// Why no prefill target is eligible: the most telling reason over the healthy prefills
/// (an unreachable bootstrap, then a missing rank, then registration still under way),
/// and a few words per worker.
fn no_prefill_detail(snap: &Snapshot) -> (FailReason, String) {
    if snap.prefills.is_empty() {
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
    for w in &snap.prefills {
        let mut why = FailReason::BootstrapNotReady;
        let mut labels = Vec::new();
        for (r, st) in w.ranks.iter().enumerate() {
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
        let state = if !w.healthy {
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
        parts.push(format!("{}: {state}", w.url));
    }
    (
        reason,
        format!("no prefill rank can bootstrap now ({})", parts.join("; ")),
    )
}

impl Dispatcher {
    pub(super) async fn attempt(
        &self,
        req: &ParsedRequest,
        ctx: &ReqCtx,
        attempt_no: u32,
        exclude_p: &[WorkerId],
        exclude_d: &[WorkerId],
    ) -> Result<Ready, AttemptFailure> {
        let snap = self.pool.load_full();
        let prefix_hash = if self.prefill_policy.wants_prefix() || self.decode_policy.wants_prefix()
        {
            req.prefix_hash()
        } else {
            None
        };
        let (pt, dt) = self.rng.with(|rng| {
            let pctx = PickCtx {
                exclude: exclude_p,
                prefix_hash,
            };
            let dctx = PickCtx {
                exclude: exclude_d,
                prefix_hash,
            };
            (
                policy::select(
                    self.prefill_policy.as_ref(),
                    &snap,
                    Role::Prefill,
                    &pctx,
                    rng,
                ),
                policy::select(self.decode_policy.as_ref(), &snap, Role::Decode, &dctx, rng),
            )
        });
        // A pick of a half-open worker holds its trial until this attempt returns, however
        // it ends; the dispatcher's verdict (success, or the blamed leg's failure) follows
        // with no await in between. An attempt that ends without a verdict on that worker
        // frees the trial for the next request.
        let Some(policy::Pick {
            target: pt,
            trial: _trial_p,
        }) = pt
        else {
            let (reason, msg) = no_prefill_detail(&snap);
            return Err(fail(Failure::new(reason, msg), None));
        };
        let Some(policy::Pick {
            target: dt,
            trial: _trial_d,
        }) = dt
        else {
            let msg = if snap.decodes.is_empty() {
                "no decode workers are configured"
            } else {
                "no healthy decode worker"
            };
            return Err(fail(Failure::new(FailReason::NoDecodeAvailable, msg), None));
        };
        let (Some(pv), Some(dv)) = (
            snap.worker(Role::Prefill, pt.worker),
            snap.worker(Role::Decode, dt.worker),
        ) else {
            return Err(fail(
                Failure::new(FailReason::Internal, "picked worker missing from snapshot"),
                None,
            ));
        };
        let (Some(boot), Some(layout)) = (pv.bootstrap.as_ref(), pv.layout.as_ref()) else {
            return Err(fail(
                Failure::new(FailReason::BootstrapNotReady, "prefill layout unknown"),
                Some((Role::Prefill, pt.worker)),
            ));
        };
        let blame_p = Some((Role::Prefill, pt.worker));
        let pair = Pair {
            prefill: pt,
            decode: dt,
        };
        let failed = |f: Failure| {
            let b = blame(&f, &pair);
            fail(f, b)
        };

        // Preflight: a view older than the freshness bound is re-checked now, briefly
        // (one check per rank at a time; see `bootstrap::preflight`).
        let bcfg = &self.cfg.bootstrap;
        let checked = pv.ranks_checked_at.get(pt.rank as usize).copied();
        if checked.is_none_or(|t| t.elapsed() > bcfg.freshness()) {
            let target = preflight::Target {
                worker: pt.worker,
                rank: pt.rank,
                bootstrap: boot,
                generation: layout.generation,
                probes: &pv.probes,
            };
            let outcome =
                preflight::check(&self.pool, &self.up, target, bcfg.preflight_timeout()).await;
            let (reason, msg) = match outcome {
                PreflightOutcome::Ready => (None, String::new()),
                PreflightOutcome::NotReady => (
                    Some(FailReason::BootstrapNotReady),
                    format!("prefill {} rank {} is not registered yet", pv.url, pt.rank),
                ),
                PreflightOutcome::Missing(m) => (
                    Some(FailReason::BootstrapRankMissing),
                    format!("prefill {} rank {}: {m}", pv.url, pt.rank),
                ),
                PreflightOutcome::Unreachable(e) => (
                    Some(FailReason::BootstrapUnreachable),
                    format!("prefill {} bootstrap: {e}", pv.url),
                ),
            };
            if let Some(reason) = reason {
                return Err(fail(Failure::new(reason, msg), blame_p));
            }
        }

        // Rooms and ranks under the contract.
        let dp_p = layout.dp_size;
        let mut rooms = Vec::new();
        self.rng
            .with(|rng| room::assign(rng, dp_p, pt.rank, req.instances(), &mut rooms));
        let pinned = self.cfg.contract.mode == ContractMode::Pinned;
        let hint = pinned.then_some(pt.rank);
        let decode_rank = (dv.effective_dp() > 1).then_some(dt.rank);
        let rid_p = ctx.id.leg_rid(attempt_no, 'p');
        let rid_d = ctx.id.leg_rid(attempt_no, 'd');
        let (pbody, dbody) = req.write_legs(
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
        let mut preq = LegRequest::post_json(&pv.conns, path, pbody, &ctx.forward);
        // The prefill's answer headers are never read (decode's go to the client).
        preq.keep_headers = false;
        let dreq = LegRequest::post_json(&dv.conns, path, dbody, &ctx.forward);
        tracing::debug!(request_id = %ctx.id, prefill = %pv.url, prefill_rank = pt.rank, decode = %dv.url, decode_rank = dt.rank, rooms = ?rooms, "dispatch");

        // Both legs go out together.
        let timeouts = &self.cfg.timeouts;
        let leg: super::flight::PrefillFuture = Box::pin(legs::run_prefill(
            self.up.clone(),
            pv.conns.clone(),
            preq,
            timeouts.prefill(),
            self.cfg.upstream.max_answer_bytes,
        ));
        let mut pw = PrefillWatch::new(
            leg,
            pv.lost.clone(),
            pt.rank,
            LegCancel::new(&self.up, &pv.url, rid_p),
            LoadGuard::new(pv, pt.rank),
        );
        let mut dcancel = LegCancel::new(&self.up, &dv.url, rid_d);
        let dguard = LoadGuard::new(dv, dt.rank);
        let dfut = self.up.send_leg(&dv.conns, &dreq);
        tokio::pin!(dfut);

        // Decode's first-byte deadline runs from the prefill's completion: one timer, armed
        // (reset) when `prefill_done` is set and polled only from then on (the request's own
        // deadline bounds everything before that).
        let fb = timeouts.decode_first_byte();
        let first_byte = tokio::time::sleep(fb);
        tokio::pin!(first_byte);
        let mut prefill_done: Option<PrefillDone> = None;
        let resp = loop {
            tokio::select! {
                r = &mut pw, if prefill_done.is_none() => match r {
                    Ok(d) => {
                        prefill_done = Some(d);
                        first_byte.as_mut().reset(tokio::time::Instant::now() + fb);
                    }
                    Err(f) => return Err(failed(f)),
                },
                r = &mut dfut => match r {
                    Ok(resp) => break resp,
                    Err(e) => return Err(failed(Failure::new(FailReason::DecodeConnect, format!("decode request failed: {}", crate::upstream::error_chain(&e))))),
                },
                _ = &mut first_byte, if prefill_done.is_some() => return Err(failed(first_byte_timeout(timeouts.decode_first_byte_secs))),
            }
        };
        let status = resp.status();
        if !status.is_success() {
            dcancel.disarm();
            let (_, body) = resp.into_parts();
            let f = legs::decode_status_failure(status, body).await;
            return Err(failed(f));
        }
        let (mut head, mut dbody_in) = resp.into_parts();

        // With return_logprob the prefill's answer is needed before decode's first bytes.
        if req.return_logprob {
            while prefill_done.is_none() {
                // Bounded by the prefill's own deadline and the request's.
                match (&mut pw).await {
                    Ok(d) => {
                        prefill_done = Some(d);
                        first_byte.as_mut().reset(tokio::time::Instant::now() + fb);
                    }
                    Err(f) => return Err(failed(f)),
                }
            }
        }
        let logprobs = prefill_done
            .as_ref()
            .filter(|_| req.return_logprob)
            .map(|d| std::sync::Arc::new(PrefillLogprobs::from_prefill_body(&d.body)));

        let is_sse = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        let limit = self.cfg.upstream.max_answer_bytes;
        let mut sse = (req.stream && is_sse).then(|| SseScanner::new(logprobs.clone(), limit));

        // Wait for decode's first bytes (the first whole event when streaming).
        let mut first: Vec<u8> = Vec::new();
        let mut ended = false;
        loop {
            tokio::select! {
                r = &mut pw, if prefill_done.is_none() => match r {
                    Ok(d) => {
                        prefill_done = Some(d);
                        first_byte.as_mut().reset(tokio::time::Instant::now() + fb);
                    }
                    Err(f) => return Err(failed(f)),
                },
                fr = dbody_in.frame() => match fr {
                    None => { ended = true; break; }
                    Some(Err(e)) => return Err(failed(Failure::new(FailReason::DecodeBroken, format!("decode answer broke off: {}", crate::upstream::error_chain(&e))))),
                    Some(Ok(frame)) => {
                        let Ok(data) = frame.into_data() else { continue };
                        match sse.as_mut() {
                            Some(s) => match s.push(data) {
                                Scan::Forward(b) => first.extend_from_slice(&b),
                                Scan::Abort { message, .. } => {
                                    dcancel.disarm();
                                    return Err(failed(legs::decode_abort_failure(&message)));
                                }
                                Scan::Broken { message } => return Err(failed(Failure::new(FailReason::DecodeBroken, message))),
                            },
                            // Only a non-streamed answer with logprobs is read whole.
                            None if logprobs.is_some() && first.len() + data.len() > limit => {
                                let message = format!("decode's answer is larger than {limit} bytes (upstream.max_answer_bytes)");
                                return Err(failed(Failure::new(FailReason::DecodeBroken, message)));
                            }
                            None => first.extend_from_slice(&data),
                        }
                        if !first.is_empty() && (sse.is_some() || logprobs.is_none()) {
                            break;
                        }
                    }
                },
                _ = &mut first_byte, if prefill_done.is_some() => return Err(failed(first_byte_timeout(timeouts.decode_first_byte_secs))),
            }
        }
        if ended {
            dcancel.disarm();
            if let Some(s) = sse.as_mut() {
                first.extend_from_slice(&s.finish());
            }
        }
        // A non-streamed answer with logprobs was read whole: merge and send it.
        if let (Some(lp), None) = (logprobs.as_ref(), sse.as_ref()) {
            if ended {
                if let Some(merged) = lp.merge_answer(&first) {
                    first = merged;
                }
            }
        }
        clean_head(&mut head, sse.is_some() || logprobs.is_some());
        let prefill = if prefill_done.is_some() {
            None
        } else {
            Some(pw)
        };
        Ok(Ready {
            pair,
            head,
            body: PdBodyParts {
                first: Bytes::from(first),
                decode: dbody_in,
                decode_cancel: dcancel,
                decode_guard: dguard,
                sse,
                prefill,
                idle_for: timeouts.stream_idle(),
                passive: Passive {
                    pool: self.pool.clone(),
                    cfg: self.cfg.breaker.clone(),
                    prefill: pt.worker,
                    decode: dt.worker,
                },
            },
        })
    }
}

fn first_byte_timeout(secs: u64) -> Failure {
    Failure::new(
        FailReason::DecodeFirstByteTimeout,
        format!(
            "decode sent nothing within {secs}s after the prefill finished (its KV never arrived?)"
        ),
    )
}

/// Drops decode's length when pdgate rewrites the body (hop-by-hop headers were never
/// kept, see `upstream::leg`).
fn clean_head(head: &mut http::response::Parts, rewritten: bool) {
    if rewritten {
        head.headers.remove(header::CONTENT_LENGTH);
    }
}
