//! Sending one leg, and cancelling it.
//!
//! Invariants:
//! - A leg that was sent and has not finished is cancelled when its [`LegCancel`] is
//!   dropped: its connection is closed (the future or task is dropped) and
//!   `POST /abort_request` is sent with the leg's rid. A leg that finished is disarmed.
//! - The prefill leg is always sent with `stream: false`: its whole answer arrives when
//!   its KV was sent, and failures show as a status (SGLang turns aborts into 4xx/5xx for
//!   non-streamed requests), so one small JSON read classifies it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Limited};
use hyper::body::Body as _;
use serde::Deserialize;

use crate::admission::Admission;
use crate::error::{FailReason, Failure};
use crate::memory::{ByteBudget, Charge};
use crate::skim::may_hold_abort;
use crate::types::Role;
use crate::upstream::{error_chain, BaseUrl, HostConns, LegBody, LegError, LegRequest, Upstream};

/// Largest error body read from a failed decode.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Cancels a leg on drop unless disarmed.
pub struct LegCancel {
    up: Upstream,
    url: BaseUrl,
    rid: String,
    armed: bool,
}

impl LegCancel {
    pub fn new(up: &Upstream, url: &BaseUrl, rid: String) -> LegCancel {
        LegCancel {
            up: up.clone(),
            url: url.clone(),
            rid,
            armed: true,
        }
    }
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for LegCancel {
    fn drop(&mut self) {
        if self.armed {
            self.up.abort(&self.url, &self.rid);
        }
    }
}

/// A leg that could not be sent, or whose engine closed the connection without answering
/// (`reason` is the leg's `*Connect`). A kept-alive connection the engine closed just as the
/// leg was written on it is a keep-alive race, not the engine's fault: marked
/// `stale_connection`, so the retry may go to the same worker (with fresh rooms).
pub fn send_failure(reason: FailReason, what: &str, e: &LegError) -> Failure {
    let mut f = Failure::new(reason, format!("{what} request failed: {}", error_chain(e)));
    f.stale_connection = matches!(e, LegError::ClosedAfterWrite { reused: true, .. });
    f
}

/// What a successful prefill leg returns: its whole answer, and its charge on the
/// in-flight byte budget (given back when dropped).
#[derive(Debug)]
pub struct PrefillDone {
    pub body: Bytes,
    pub charge: Charge,
}

/// Sends the prefill leg and reads its whole answer (at most `limit` bytes, each frame
/// charged to `budget` as it arrives), within `deadline`.
pub async fn run_prefill(
    up: Upstream,
    host: Arc<HostConns>,
    req: LegRequest,
    deadline: Duration,
    limit: usize,
    budget: Option<Arc<ByteBudget>>,
) -> Result<PrefillDone, Failure> {
    let fut = async {
        let resp = up
            .send_leg(&host, &req)
            .await
            .map_err(|e| send_failure(FailReason::PrefillConnect, "prefill", &e))?;
        let status = resp.status();
        let mut charge = budget.map_or_else(Charge::none, |b| b.charge());
        let body = read_answer(resp.into_body(), limit, &mut charge, req.rate.as_deref()).await?;
        if !status.is_success() {
            return Err(status_failure(Role::Prefill, status, &body));
        }
        if let Some(abort) = abort_in_answer(&body) {
            let msg = abort.message;
            return Err(
                match abort.status.and_then(|s| StatusCode::from_u16(s).ok()) {
                    Some(s) if s.is_client_error() => Failure::new(
                        FailReason::PrefillRejected,
                        format!("prefill rejected the request ({}): {msg}", s.as_u16()),
                    )
                    .with_status(s),
                    _ => Failure::new(
                        FailReason::PrefillAborted,
                        format!("prefill aborted the request: {msg}"),
                    ),
                },
            );
        }
        Ok(PrefillDone { body, charge })
    };
    match tokio::time::timeout(deadline, fut).await {
        Ok(r) => r,
        Err(_) => Err(Failure::new(
            FailReason::PrefillTimeout,
            format!("prefill did not answer within {}s", deadline.as_secs_f64()),
        )),
    }
}

/// A prefill's whole answer, at most `limit` bytes, charged as it arrives, past its first
/// slice at `rate`. An answer in one frame is that frame, without a copy.
async fn read_answer(
    mut body: LegBody,
    limit: usize,
    charge: &mut Charge,
    rate: Option<&crate::body::ByteRate>,
) -> Result<Bytes, Failure> {
    let broke = |m: String| Failure::new(FailReason::PrefillAborted, m);
    let mut first: Option<Bytes> = None;
    let mut rest: Vec<u8> = Vec::new();
    // The answer's length when it says so (within the limit): the buffer that gathers its
    // frames is allocated once, where doubling copied a long prompt's logprobs (megabytes)
    // again at each step and faulted in fresh pages on the event loop.
    let whole = usize::try_from(body.size_hint().exact().unwrap_or(0))
        .unwrap_or(usize::MAX)
        .min(limit);
    let mut total = 0usize;
    // A large answer (a long prompt's logprobs) past its first slice goes at the rate
    // large bodies share (`server.large_body_bytes_per_sec`).
    let mut pacer = crate::body::Pacer::with_rate(rate);
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| broke(format!("prefill answer broke off: {}", error_chain(&e))))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total = total.saturating_add(data.len());
        if total > limit {
            return Err(broke(format!(
                "prefill answer broke off: larger than {limit} bytes (upstream.max_answer_bytes)"
            )));
        }
        Admission::charge(charge, data.len(), "the prefill's answer")?;
        pacer.moved(data.len()).await;
        match first.take() {
            None if rest.is_empty() => first = Some(data),
            f => {
                if let Some(f) = f {
                    rest.reserve_exact(whole.max(f.len() + data.len()));
                    rest.extend_from_slice(&f);
                }
                rest.extend_from_slice(&data);
            }
        }
    }
    Ok(first.unwrap_or_else(|| Bytes::from(rest)))
}

/// Reads a failed decode's (bounded) error body and classifies it.
pub async fn decode_status_failure(status: StatusCode, body: LegBody) -> Failure {
    let bytes = tokio::time::timeout(
        Duration::from_secs(2),
        Limited::new(body, ERROR_BODY_LIMIT).collect(),
    )
    .await
    .ok()
    .and_then(|r| r.ok())
    .map(|c| c.to_bytes())
    .unwrap_or_default();
    status_failure(Role::Decode, status, &bytes)
}

/// What SGLang's decode says when the KV handoff from the prefill failed: the fault is on
/// the prefill side (or between the two), so it is blamed on the prefill and retried with
/// another one.
const KV_MARKERS: [&str; 6] = [
    "KVTransferError",
    "Lost connection with prefill",
    "Failed to get kvcache from prefill",
    "Could not fetch bootstrap info",
    "Could not fetch prefill parallel info",
    "Prefill bootstrap failed",
];

fn is_kv_failure(message: &str) -> bool {
    KV_MARKERS.iter().any(|m| message.contains(m))
}

/// An abort reported by decode (an SSE abort chunk, or an abort inside its answer).
pub fn decode_abort_failure(abort: &InAnswer) -> Failure {
    let message = &abort.message;
    if let Some(status) = abort.status.and_then(|s| StatusCode::from_u16(s).ok()) {
        if status.is_client_error() {
            // The engine refused the request itself (SGLang's in-stream validation error,
            // e.g. a prompt longer than the context): the client's fault, passed through.
            return Failure::new(
                FailReason::DecodeRejected,
                format!(
                    "decode rejected the request ({}): {message}",
                    status.as_u16()
                ),
            )
            .with_status(status);
        }
    }
    if is_kv_failure(message) {
        Failure::new(
            FailReason::KvTransferFailed,
            format!("the KV handoff from the prefill failed: {message}"),
        )
    } else {
        Failure::new(
            FailReason::DecodeAborted,
            format!("decode aborted the request: {message}"),
        )
    }
}

/// A non-2xx engine answer as a failure; a 4xx passes through as that 4xx.
pub fn status_failure(role: Role, status: StatusCode, body: &[u8]) -> Failure {
    let msg = error_message(body).unwrap_or_else(|| {
        String::from_utf8_lossy(&body[..body.len().min(300)])
            .trim()
            .to_string()
    });
    if role == Role::Decode && !status.is_client_error() && is_kv_failure(&msg) {
        return Failure::new(
            FailReason::KvTransferFailed,
            format!(
                "the KV handoff from the prefill failed ({}): {msg}",
                status.as_u16()
            ),
        )
        .with_status(status);
    }
    let (reason, what) = match (role, status.is_client_error()) {
        (Role::Prefill, true) => (FailReason::PrefillRejected, "prefill rejected the request"),
        (Role::Prefill, false) => (FailReason::PrefillStatus, "prefill failed"),
        // A regular worker's one leg fails like a decode leg (its reasons are decode's).
        (Role::Decode | Role::Regular, true) => {
            (FailReason::DecodeRejected, "decode rejected the request")
        }
        (Role::Decode | Role::Regular, false) => (FailReason::DecodeStatus, "decode failed"),
    };
    Failure::new(reason, format!("{what} ({}): {msg}", status.as_u16())).with_status(status)
}

#[derive(Deserialize)]
struct ErrBody {
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    #[serde(default)]
    detail: Option<serde_json::Value>,
}

/// The message of an SGLang/OpenAI error body, in any of its shapes.
pub fn error_message(body: &[u8]) -> Option<String> {
    let e: ErrBody = serde_json::from_slice(body).ok()?;
    if let Some(m) = e.message {
        return Some(m);
    }
    match e.error.or(e.detail)? {
        serde_json::Value::String(s) => Some(s),
        v => v
            .get("message")
            .and_then(|m| m.as_str())
            .map(str::to_string)
            .or(Some(v.to_string())),
    }
}

/// An abort or error inside a 200 JSON answer (or one SSE event's JSON): a
/// `finish_reason` of type `abort`, or a top-level `error` object. Returns its message.
pub fn abort_in_json(json: &[u8]) -> Option<String> {
    abort_in_answer(json).map(|a| a.message)
}

/// An abort or error found inside an engine's answer: its message, and the status it
/// names (`error.code`, or an abort's `status_code`), when it names one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InAnswer {
    pub message: String,
    pub status: Option<u16>,
}

/// Like [`abort_in_json`], with the status the abort names.
pub fn abort_in_answer(json: &[u8]) -> Option<InAnswer> {
    if !may_hold_abort(json) {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(json).ok()?;
    let items: Vec<&serde_json::Value> = match &v {
        serde_json::Value::Array(a) => a.iter().collect(),
        other => vec![other],
    };
    let status = |v: &serde_json::Value, key: &str| {
        v.get(key)
            .and_then(serde_json::Value::as_u64)
            .and_then(|c| u16::try_from(c).ok())
    };
    for it in items {
        if let Some(err) = it.get("error").filter(|e| !e.is_null()) {
            let message = err
                .get("message")
                .and_then(|m| m.as_str())
                .map_or_else(|| err.to_string(), str::to_string);
            let status = status(err, "code");
            return Some(InAnswer { message, status });
        }
        let fr = it.get("meta_info").and_then(|m| m.get("finish_reason"));
        let choices = it.get("choices").and_then(|c| c.as_array());
        let mut reasons: Vec<&serde_json::Value> = fr.into_iter().collect();
        if let Some(cs) = choices {
            reasons.extend(cs.iter().filter_map(|c| c.get("finish_reason")));
        }
        for r in reasons {
            let is_abort = r.get("type").and_then(|t| t.as_str()) == Some("abort")
                || r.as_str() == Some("abort");
            if is_abort {
                let message = r
                    .get("message")
                    .and_then(|m| m.as_str())
                    .unwrap_or("aborted")
                    .to_string();
                let status = status(r, "status_code");
                return Some(InAnswer { message, status });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_detection_table() {
        let cases: &[(&str, Option<&str>)] = &[
            (
                r#"{"text":"x","meta_info":{"finish_reason":{"type":"length","length":1}}}"#,
                None,
            ),
            (
                r#"{"text":"x","meta_info":{"finish_reason":{"type":"abort","message":"boom","status_code":500}}}"#,
                Some("boom"),
            ),
            (
                r#"[{"meta_info":{"finish_reason":null}},{"meta_info":{"finish_reason":{"type":"abort","message":"b2"}}}]"#,
                Some("b2"),
            ),
            (
                r#"{"error":{"object":"error","message":"oops","code":500}}"#,
                Some("oops"),
            ),
            (
                r#"{"choices":[{"finish_reason":"abort"}]}"#,
                Some("aborted"),
            ),
            (
                r#"{"choices":[{"finish_reason":"stop","text":"the word \"abort\""}]}"#,
                None,
            ),
        ];
        for (body, want) in cases {
            assert_eq!(abort_in_json(body.as_bytes()).as_deref(), *want, "{body}");
        }
    }

    #[test]
    fn status_failures_keep_the_engine_message() {
        let f = status_failure(
            Role::Prefill,
            StatusCode::BAD_REQUEST,
            br#"{"object":"error","message":"too long","type":"BadRequestError","code":400}"#,
        );
        assert_eq!(f.reason, FailReason::PrefillRejected);
        assert_eq!(f.status(), StatusCode::BAD_REQUEST);
        assert!(f.message.contains("too long"));
        let f = status_failure(
            Role::Decode,
            StatusCode::INTERNAL_SERVER_ERROR,
            b"plain text",
        );
        assert_eq!(f.reason, FailReason::DecodeStatus);
        assert_eq!(f.status(), StatusCode::BAD_GATEWAY);
        assert!(f.message.contains("plain text"));
    }
}
