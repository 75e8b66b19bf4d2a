//! Stage 4 of an attempt: wait until decode's first bytes are in hand, while watching the
//! prefill, then decide: a failure here is still retried (the client has seen nothing);
//! success hands both legs to the response body (stage 5).
//!
//! Invariants:
//! - Decode's first-byte deadline runs from the prefill's completion: one timer, re-armed
//!   when the prefill completes and polled only from then on (the request's own deadline
//!   bounds everything before that).
//! - When streaming, the first bytes are decode's first *whole* SSE event, so an abort in
//!   the first chunk is retried, not streamed.
//! - A non-streamed answer whose logprobs are merged is read whole (bounded by
//!   `upstream.max_answer_bytes`, and charged to the in-flight byte budget until sent);
//!   any other answer is handed on after its first bytes.
//! - A streamed request whose prefill input logprobs are larger than
//!   `upstream.max_stream_logprob_bytes`, or whose logprobs times the events it can produce
//!   are larger than `upstream.max_stream_logprob_total_bytes`, is refused (413
//!   `logprobs_too_large`) before its first byte: every event would repeat them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::header;
use http_body_util::BodyExt;
use tokio::time::Sleep;

use super::super::model::Model;
use super::super::stall::StallWatch;
use super::super::Dispatcher;
use super::{AttemptFailure, DecodeHead, LegsInFlight};
use crate::error::{FailReason, Failure};
use crate::legs::{self, PrefillDone};
use crate::memory::Charge;
use crate::relay::logprobs::PrefillLogprobs;
use crate::relay::sse::{Scan, SseScanner};
use crate::relay::Ready;
use crate::relay::{Passive, PdBodyParts, PrefillWatch};
use crate::request::ParsedRequest;
use crate::types::Role;
use crate::upstream::{error_chain, LegBody};

/// The prefill's progress and decode's first-byte timer, shared by the two waits below.
struct PrefillProgress<'t> {
    done: Option<PrefillDone>,
    /// On the caller's stack (no allocation per request).
    first_byte: Pin<&'t mut Sleep>,
    first_byte_within: std::time::Duration,
    first_byte_secs: u64,
    /// Stall detection ([`super::super::stall`]): the watch and its next look, on the stack too.
    stall: StallWatch,
    look: Pin<&'t mut Sleep>,
}

impl PrefillProgress<'_> {
    /// The prefill answered: decode's first byte is due within its deadline from now.
    fn completed(&mut self, d: PrefillDone) {
        self.done = Some(d);
        let due = tokio::time::Instant::now() + self.first_byte_within;
        self.first_byte.as_mut().reset(due);
        if self.stall.enabled() {
            let at = self.stall.prefill_done();
            // A non-streamed decode is not watched past this point: its look timer is
            // left as it is, never re-armed (a timer reset to now would wake the runtime
            // for nothing, once per request).
            if self.stall.enabled() {
                self.look.as_mut().reset(at);
            }
        }
    }

    /// A stall look is due: re-armed for the next, or the stall that ends the attempt.
    fn look(&mut self, d: &Dispatcher) -> Result<(), Failure> {
        let at = self.stall.look(d)?;
        self.look.as_mut().reset(at);
        Ok(())
    }

    fn first_byte_timeout(&self) -> Failure {
        Failure::new(
            FailReason::DecodeFirstByteTimeout,
            format!(
                "decode sent nothing within {}s after the prefill finished (its KV never arrived?)",
                self.first_byte_secs
            ),
        )
    }
}

/// Waits for decode's answer head, then its first bytes; returns the attempt's response
/// parts, or the failure (blamed on its leg) that ends the attempt.
pub(in crate::dispatch) async fn wait_first_bytes<D>(
    d: &Dispatcher,
    req: &ParsedRequest,
    model: &Model,
    legs: LegsInFlight<D>,
) -> Result<Ready, AttemptFailure>
where
    D: Future<Output = DecodeHead>,
{
    let LegsInFlight {
        pair,
        room: _,
        mut prefill,
        decode,
        mut decode_cancel,
        decode_load,
        prefill_tally,
        mut stall,
        span: _,
    } = legs;
    let failed = |f: Failure| AttemptFailure::on(&pair, f);
    let timeouts = &d.cfg.timeouts;
    let first_byte = tokio::time::sleep(timeouts.decode_first_byte());
    tokio::pin!(first_byte);
    let look = tokio::time::sleep_until(stall.start());
    tokio::pin!(look);
    let mut progress = PrefillProgress {
        done: None,
        first_byte,
        first_byte_within: timeouts.decode_first_byte(),
        first_byte_secs: timeouts.decode_first_byte_secs,
        stall,
        look,
    };

    // Decode's answer head, while the prefill runs.
    tokio::pin!(decode);
    let head = loop {
        tokio::select! {
            r = &mut prefill, if progress.done.is_none() => match r {
                Ok(done) => progress.completed(done),
                Err(f) => return Err(failed(f)),
            },
            r = &mut decode => match r {
                Ok(resp) => break resp,
                Err(e) => return Err(failed(legs::send_failure(FailReason::DecodeConnect, "decode", &e))),
            },
            _ = progress.first_byte.as_mut(), if progress.done.is_some() => {
                return Err(failed(progress.first_byte_timeout()));
            }
            _ = progress.look.as_mut(), if progress.stall.enabled() => progress.look(d).map_err(failed)?,
        }
    };
    let status = head.status();
    if !status.is_success() {
        decode_cancel.disarm();
        let (_, body) = head.into_parts();
        return Err(failed(legs::decode_status_failure(status, body).await));
    }
    let (mut head, mut decode_body) = head.into_parts();

    // With return_logprob the prefill's answer is needed before decode's first bytes.
    while req.return_logprob && progress.done.is_none() {
        // Bounded by the prefill's own deadline and the request's, and watched for stalls.
        tokio::select! {
            r = &mut prefill => match r {
                Ok(done) => progress.completed(done),
                Err(f) => return Err(failed(f)),
            },
            _ = progress.look.as_mut(), if progress.stall.enabled() => progress.look(d).map_err(failed)?,
        }
    }
    // The decode answer read whole below is charged beside the prefill's answer.
    let mut held = progress
        .done
        .as_ref()
        .map_or_else(Charge::none, |d| d.charge.sibling());
    let logprobs = match progress.done.as_mut().filter(|_| req.return_logprob) {
        Some(done) => {
            let (body, charge) = (done.body.clone(), std::mem::take(&mut done.charge));
            // A long prompt's answer is megabytes: read off the event loop.
            let read = crate::body::off_loop(body.len(), move || {
                PrefillLogprobs::from_prefill_body(&body, charge)
            });
            match read.await {
                Some(lp) => Some(Arc::new(lp)),
                None => {
                    return Err(failed(Failure::new(
                        FailReason::Internal,
                        "the prefill's logprobs could not be read (the runtime is stopping)",
                    )))
                }
            }
        }
        None => None,
    };
    if let Some(why) = logprobs.as_ref().filter(|_| req.stream).and_then(|lp| {
        stream_logprobs_refused(&d.cfg.upstream, lp.bytes(), req.output_tokens_bound())
    }) {
        // Each event would repeat them: refused rather than merged (see `relay::logprobs`).
        return Err(failed(Failure::new(FailReason::LogprobsTooLarge, why)));
    }
    let is_sse = head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let limit = d.cfg.upstream.max_answer_bytes;
    let mut sse = (req.stream && is_sse).then(|| SseScanner::new(logprobs.clone(), limit));

    let first = first_bytes(
        d,
        &mut prefill,
        &mut progress,
        &mut decode_body,
        sse.as_mut(),
        logprobs.is_some().then_some(&mut held),
        limit,
    )
    .await;
    let (mut first, ended) = match first {
        Ok(v) => v,
        Err(f) => {
            if f.reason.coupling().reported_by == Some(Role::Decode) {
                decode_cancel.disarm();
            }
            return Err(failed(f));
        }
    };
    progress.stall.first_byte();
    if ended {
        decode_cancel.disarm();
        if let Some(s) = sse.as_mut() {
            while let Some(scan) = s.take_held() {
                match scan {
                    Scan::Forward(b) => first.extend_from_slice(&b),
                    Scan::Abort { abort, .. } => {
                        return Err(failed(legs::decode_abort_failure(&abort)))
                    }
                    Scan::Broken { message } => return Err(failed(broken(message))),
                }
            }
            first.extend_from_slice(&s.finish());
        }
    }
    // A non-streamed answer with logprobs was read whole: merge and send it.
    if let (Some(lp), None, true) = (logprobs.clone(), sse.as_ref(), ended) {
        let len = first.len() + lp.bytes();
        let (answer, merged) = crate::body::off_loop(len, move || {
            let merged = lp.merge_answer(&first);
            (first, merged)
        })
        .await
        .ok_or_else(|| {
            failed(Failure::new(
                FailReason::Internal,
                "the answer's logprobs could not be merged (the runtime is stopping)",
            ))
        })?;
        first = answer;
        if let Some(merged) = merged {
            // Held until sent: best effort (the merge is at most the two parts it joins,
            // both already bounded).
            let _ = held.resize(merged.len());
            first = merged;
        }
    }
    if sse.is_some() || logprobs.is_some() {
        // pdgate rewrites the body: decode's length no longer holds.
        head.headers.remove(header::CONTENT_LENGTH);
    }
    let prefill = if progress.done.is_some() {
        None
    } else {
        Some(prefill)
    };
    // A stream that repeats the prompt's input logprobs goes out at the router's rate.
    let merge_rate = sse
        .as_ref()
        .is_some_and(SseScanner::merges)
        .then(|| d.merge_rate.clone())
        .flatten();
    Ok(Ready {
        held,
        trials: Default::default(),
        pair,
        decode_incremental: false,
        head,
        body: PdBodyParts {
            first: Bytes::from(first),
            decode: decode_body,
            decode_cancel,
            decode_guard: decode_load,
            sse,
            prefill,
            prefill_trial: None,
            idle_for: timeouts.stream_idle(),
            passive: Passive {
                pool: d.pool.clone(),
                cfg: model.breaker().clone(),
                prefill: pair.prefill.worker,
                decode: pair.decode.worker,
                decode_role: Role::Decode,
                gaps: Some((progress.stall.decode_progress(), pair.decode.rank)),
                tally: Some((prefill_tally, pair.prefill.rank)),
            },
            merge_rate,
        },
    })
}

/// Reads decode's body until its first bytes (its first whole event when streaming; all of
/// it when `whole` is given, charged to it), while watching the prefill and the
/// first-byte deadline.
async fn first_bytes(
    d: &Dispatcher,
    prefill: &mut PrefillWatch,
    progress: &mut PrefillProgress<'_>,
    decode_body: &mut LegBody,
    mut sse: Option<&mut SseScanner>,
    mut whole: Option<&mut Charge>,
    limit: usize,
) -> Result<(Vec<u8>, bool), Failure> {
    let read_whole = whole.is_some();
    let mut first: Vec<u8> = Vec::new();
    loop {
        tokio::select! {
            r = &mut *prefill, if progress.done.is_none() => match r {
                Ok(done) => progress.completed(done),
                Err(f) => return Err(f),
            },
            frame = decode_body.frame() => match frame {
                None => return Ok((first, true)),
                Some(Err(e)) => return Err(broken(format!("decode answer broke off: {}", error_chain(&e)))),
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else { continue };
                    match sse.as_deref_mut() {
                        Some(s) => match s.push(data) {
                            Scan::Forward(b) => first.extend_from_slice(&b),
                            Scan::Abort { abort, .. } => return Err(legs::decode_abort_failure(&abort)),
                            Scan::Broken { message } => return Err(broken(message)),
                        },
                        None if read_whole && first.len() + data.len() > limit => {
                            return Err(broken(format!("decode's answer is larger than {limit} bytes (upstream.max_answer_bytes)")));
                        }
                        None => {
                            if let Some(held) = whole.as_deref_mut() {
                                crate::admission::Admission::charge(held, data.len(), "decode's answer")?;
                            }
                            first.extend_from_slice(&data);
                        }
                    }
                    if !first.is_empty() && (sse.is_some() || !read_whole) {
                        return Ok((first, false));
                    }
                }
            },
            _ = progress.first_byte.as_mut(), if progress.done.is_some() => {
                return Err(progress.first_byte_timeout());
            }
            _ = progress.look.as_mut(), if progress.stall.enabled() => progress.look(d)?,
        }
    }
}

fn broken(message: String) -> Failure {
    Failure::new(FailReason::DecodeBroken, message)
}

/// Why a streamed request whose prompt's input logprobs are `bytes` long, and which can
/// produce `tokens` events, is refused: past the per-event cap, or past the per-stream cap
/// on what all its events repeat. `None`: merged.
fn stream_logprobs_refused(
    u: &crate::config::UpstreamConfig,
    bytes: usize,
    tokens: u64,
) -> Option<String> {
    let cap = u.max_stream_logprob_bytes;
    if bytes > cap {
        return Some(format!(
            "the prompt's input logprobs are {bytes} bytes, more than the {cap} bytes a streamed \
             request may repeat in every event (upstream.max_stream_logprob_bytes); ask \
             without stream, or for fewer (logprob_start_len, top_logprobs_num)"
        ));
    }
    let total = u.max_stream_logprob_total_bytes;
    let all = (bytes as u64).saturating_mul(tokens);
    (all > total as u64).then(|| {
        format!(
            "the prompt's input logprobs are {bytes} bytes, repeated in each of up to {tokens} \
             events: {all} bytes, more than the {total} a stream may repeat in all \
             (upstream.max_stream_logprob_total_bytes); ask without stream, for fewer tokens \
             (max_new_tokens), or for fewer logprobs (logprob_start_len, top_logprobs_num)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Table: a stream's logprobs are refused past the per-event cap, or when their size
    /// times the events the request can produce is past the per-stream cap.
    #[test]
    fn streamed_logprobs_are_bounded_per_event_and_per_stream() {
        let u = crate::config::UpstreamConfig {
            max_stream_logprob_bytes: 1000,
            max_stream_logprob_total_bytes: 100_000,
            ..Default::default()
        };
        for (bytes, tokens, want) in [
            (10, 128, None),
            (1000, 100, None),
            (1001, 1, Some("upstream.max_stream_logprob_bytes")),
            (1000, 101, Some("upstream.max_stream_logprob_total_bytes")),
            (1, 100_001, Some("upstream.max_stream_logprob_total_bytes")),
            (1, u64::MAX, Some("upstream.max_stream_logprob_total_bytes")),
            (0, u64::MAX, None),
        ] {
            let got = stream_logprobs_refused(&u, bytes, tokens);
            match want {
                None => assert_eq!(got, None, "{bytes} x {tokens}"),
                Some(key) => assert!(
                    got.as_deref().is_some_and(|m| m.contains(key)),
                    "{bytes} x {tokens}: {got:?}"
                ),
            }
        }
    }
}
