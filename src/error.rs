//! Every way a request can fail, mapped once to an HTTP status, an OpenAI-style error JSON,
//! a log line and a metrics label.
//!
//! Invariant: this is the only place that turns a failure into bytes for the client, both
//! before headers (a JSON response) and after a stream began (one SSE `data:` event that is
//! valid JSON, then `data: [DONE]`).

use bytes::Bytes;

use crate::types::Role;
use http::{header, HeaderValue, Response, StatusCode};

use crate::body::RespBody;

/// The reason a request failed. `as_str` is the error `type` and the metrics label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailReason {
    InvalidRequest,
    PayloadTooLarge,
    RequestBodyTimeout,
    UnsupportedMediaType,
    NotFound,
    ModelNotFound,
    MethodNotAllowed,
    Unauthorized,
    Forbidden,
    InvalidApiKey,
    KeyInFlightLimit,
    Conflict,
    Overloaded,
    QueueTimeout,
    MemoryFull,
    LogprobsTooLarge,
    TooManyConnections,
    NoPrefillAvailable,
    NoDecodeAvailable,
    /// No routable regular (non-PD) worker of the request's model (`dispatch::regular`).
    NoWorkerAvailable,
    BootstrapUnreachable,
    BootstrapNotReady,
    BootstrapRankMissing,
    PrefillConnect,
    PrefillStatus,
    PrefillRejected,
    PrefillAborted,
    PrefillTimeout,
    PrefillLost,
    PrefillStalled,
    KvTransferFailed,
    DecodeConnect,
    DecodeStatus,
    DecodeRejected,
    DecodeAborted,
    DecodeFirstByteTimeout,
    DecodeStalled,
    DecodeIdleTimeout,
    DecodeBroken,
    RequestTimeout,
    ClientDisconnected,
    Internal,
}

impl FailReason {
    pub const ALL: [FailReason; 42] = [
        FailReason::InvalidRequest,
        FailReason::PayloadTooLarge,
        FailReason::RequestBodyTimeout,
        FailReason::UnsupportedMediaType,
        FailReason::NotFound,
        FailReason::ModelNotFound,
        FailReason::MethodNotAllowed,
        FailReason::Unauthorized,
        FailReason::Forbidden,
        FailReason::InvalidApiKey,
        FailReason::KeyInFlightLimit,
        FailReason::Conflict,
        FailReason::Overloaded,
        FailReason::QueueTimeout,
        FailReason::MemoryFull,
        FailReason::LogprobsTooLarge,
        FailReason::TooManyConnections,
        FailReason::NoPrefillAvailable,
        FailReason::NoDecodeAvailable,
        FailReason::NoWorkerAvailable,
        FailReason::BootstrapUnreachable,
        FailReason::BootstrapNotReady,
        FailReason::BootstrapRankMissing,
        FailReason::PrefillConnect,
        FailReason::PrefillStatus,
        FailReason::PrefillRejected,
        FailReason::PrefillAborted,
        FailReason::PrefillTimeout,
        FailReason::PrefillLost,
        FailReason::PrefillStalled,
        FailReason::KvTransferFailed,
        FailReason::DecodeConnect,
        FailReason::DecodeStatus,
        FailReason::DecodeRejected,
        FailReason::DecodeAborted,
        FailReason::DecodeFirstByteTimeout,
        FailReason::DecodeStalled,
        FailReason::DecodeIdleTimeout,
        FailReason::DecodeBroken,
        FailReason::RequestTimeout,
        FailReason::ClientDisconnected,
        FailReason::Internal,
    ];

    /// The error `type` in the JSON, the `reason` metrics label and the log field.
    pub fn as_str(self) -> &'static str {
        use FailReason::*;
        match self {
            InvalidRequest => "invalid_request",
            PayloadTooLarge => "payload_too_large",
            RequestBodyTimeout => "request_body_timeout",
            UnsupportedMediaType => "unsupported_media_type",
            NotFound => "not_found",
            ModelNotFound => "model_not_found",
            MethodNotAllowed => "method_not_allowed",
            Unauthorized => "unauthorized",
            Forbidden => "forbidden",
            InvalidApiKey => "invalid_api_key",
            KeyInFlightLimit => "key_in_flight_limit",
            Conflict => "conflict",
            Overloaded => "overloaded",
            QueueTimeout => "queue_timeout",
            MemoryFull => "memory_full",
            LogprobsTooLarge => "logprobs_too_large",
            TooManyConnections => "too_many_connections",
            NoPrefillAvailable => "no_prefill_available",
            NoDecodeAvailable => "no_decode_available",
            NoWorkerAvailable => "no_worker_available",
            BootstrapUnreachable => "bootstrap_unreachable",
            BootstrapNotReady => "bootstrap_not_ready",
            BootstrapRankMissing => "bootstrap_rank_missing",
            PrefillConnect => "prefill_connect",
            PrefillStatus => "prefill_status",
            PrefillRejected => "prefill_rejected",
            PrefillAborted => "prefill_aborted",
            PrefillTimeout => "prefill_timeout",
            PrefillLost => "prefill_lost",
            PrefillStalled => "prefill_stalled",
            KvTransferFailed => "kv_transfer_failed",
            DecodeConnect => "decode_connect",
            DecodeStatus => "decode_status",
            DecodeRejected => "decode_rejected",
            DecodeAborted => "decode_aborted",
            DecodeFirstByteTimeout => "decode_first_byte_timeout",
            DecodeStalled => "decode_stalled",
            DecodeIdleTimeout => "decode_idle_timeout",
            DecodeBroken => "decode_broken",
            RequestTimeout => "request_timeout",
            ClientDisconnected => "client_disconnected",
            Internal => "internal_error",
        }
    }

    /// The status for this reason; `upstream` is the engine's own 4xx for the `*Rejected`
    /// reasons, which pass through as that 4xx.
    pub fn status(self, upstream: Option<StatusCode>) -> StatusCode {
        use FailReason::*;
        match self {
            InvalidRequest => StatusCode::BAD_REQUEST,
            PayloadTooLarge | LogprobsTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            RequestBodyTimeout => StatusCode::REQUEST_TIMEOUT,
            UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            NotFound | ModelNotFound => StatusCode::NOT_FOUND,
            MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Unauthorized | InvalidApiKey => StatusCode::UNAUTHORIZED,
            Forbidden => StatusCode::FORBIDDEN,
            Conflict => StatusCode::CONFLICT,
            Overloaded | KeyInFlightLimit => StatusCode::TOO_MANY_REQUESTS,
            QueueTimeout | MemoryFull | TooManyConnections | NoPrefillAvailable
            | NoDecodeAvailable | NoWorkerAvailable | BootstrapUnreachable | BootstrapNotReady
            | BootstrapRankMissing => StatusCode::SERVICE_UNAVAILABLE,
            PrefillRejected | DecodeRejected => match upstream {
                Some(s) if s.is_client_error() => s,
                _ => StatusCode::BAD_REQUEST,
            },
            PrefillConnect | PrefillStatus | PrefillAborted | PrefillLost | KvTransferFailed
            | DecodeConnect | DecodeStatus | DecodeAborted | DecodeBroken => {
                StatusCode::BAD_GATEWAY
            }
            PrefillTimeout
            | PrefillStalled
            | DecodeFirstByteTimeout
            | DecodeStalled
            | DecodeIdleTimeout
            | RequestTimeout => StatusCode::GATEWAY_TIMEOUT,
            ClientDisconnected => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// How this failure couples the two legs of a request: the one table of the coupling
    /// rules (see [`Coupling`]). `leg`, `is_worker_fault` and `retryable` read it.
    pub const fn coupling(self) -> Coupling {
        use crate::types::Role::{Decode as D, Prefill as P};
        use FailReason::*;
        const fn c(
            blames: Option<Role>,
            breaker: bool,
            retry: bool,
            reported_by: Option<Role>,
        ) -> Coupling {
            Coupling {
                blames,
                breaker,
                retry,
                reported_by,
            }
        }
        #[rustfmt::skip]
        let row = match self {
            //                       blames   breaker retry  reported by
            BootstrapUnreachable   => c(Some(P), true,  true,  None),
            BootstrapRankMissing   => c(Some(P), true,  true,  None),
            // Still registering: another rank or prefill may be ready; nobody's fault.
            BootstrapNotReady      => c(Some(P), false, true,  None),
            PrefillConnect         => c(Some(P), true,  true,  None),
            PrefillStatus          => c(Some(P), true,  true,  Some(P)),
            // The engine's 4xx: the client's request is at fault; passed through.
            PrefillRejected        => c(Some(P), false, false, Some(P)),
            PrefillAborted         => c(Some(P), true,  true,  Some(P)),
            // The client has seen nothing, and a hung prefill must not cost every request
            // sent to it before its breaker opens.
            PrefillTimeout         => c(Some(P), true,  true,  None),
            PrefillLost            => c(Some(P), true,  true,  None),
            // No progress past the learned deadline while peers progressed (see
            // `crate::progress`): retried elsewhere; not counted by the failure breaker,
            // which a stuck request on a healthy engine must not open — stalls have their
            // own count and their own ejection (`progress.eject_after_stalls`).
            PrefillStalled         => c(Some(P), false, true,  None),
            // Decode says the KV never came: the prefill's fault, in decode's answer.
            KvTransferFailed       => c(Some(P), true,  true,  Some(D)),
            DecodeConnect          => c(Some(D), true,  true,  None),
            DecodeStatus           => c(Some(D), true,  true,  Some(D)),
            DecodeRejected         => c(Some(D), false, false, Some(D)),
            DecodeAborted          => c(Some(D), true,  true,  Some(D)),
            DecodeFirstByteTimeout => c(Some(D), true,  true,  None),
            DecodeStalled          => c(Some(D), false, true,  None),
            // Only after bytes reached the client: never retried.
            DecodeIdleTimeout      => c(Some(D), true,  false, None),
            DecodeBroken           => c(Some(D), true,  true,  None),
            // Not a leg's doing: the request itself, the router, or the client.
            InvalidRequest | PayloadTooLarge | RequestBodyTimeout | UnsupportedMediaType
            | NotFound | ModelNotFound | MethodNotAllowed | Unauthorized | Forbidden | InvalidApiKey | KeyInFlightLimit
            | Conflict | Overloaded | QueueTimeout | MemoryFull | LogprobsTooLarge
            | TooManyConnections | NoPrefillAvailable | NoDecodeAvailable | NoWorkerAvailable | RequestTimeout
            | ClientDisconnected | Internal => c(None, false, false, None),
        };
        row
    }

    /// A leg that stopped making progress (stall detection's own reasons).
    pub fn is_stall(self) -> bool {
        matches!(self, FailReason::PrefillStalled | FailReason::DecodeStalled)
    }

    /// Whether the failure is the fault of the worker serving the leg it names (and so
    /// counts for that worker's circuit breaker).
    pub fn is_worker_fault(self) -> bool {
        self.coupling().breaker
    }

    /// Whether a fresh pair may succeed where this attempt failed (only before the client
    /// saw a byte).
    pub fn retryable(self) -> bool {
        self.coupling().retry
    }

    /// Which leg a reason blames, for logs and breaker attribution.
    pub fn leg(self) -> Option<Role> {
        self.coupling().blames
    }

    /// The client-key failures answer with OpenAI's own error `type` and string `code`, so
    /// that OpenAI SDKs and tools that read them (`invalid_api_key`, `rate_limit_exceeded`)
    /// behave as they do against OpenAI. Every other reason uses pdgate's shape: `type` is
    /// [`FailReason::as_str`], `code` the HTTP status.
    pub fn openai_type_and_code(self) -> Option<(&'static str, &'static str)> {
        match self {
            FailReason::InvalidApiKey => Some(("invalid_request_error", "invalid_api_key")),
            FailReason::KeyInFlightLimit => Some(("requests", "rate_limit_exceeded")),
            FailReason::ModelNotFound => Some(("invalid_request_error", "model_not_found")),
            _ => None,
        }
    }

    /// OpenAI's `param`: the request field at fault, where OpenAI names one.
    pub fn openai_param(self) -> Option<&'static str> {
        match self {
            FailReason::ModelNotFound => Some("model"),
            _ => None,
        }
    }
}

/// The coupling rules of one [`FailReason`]. Whatever the reason, once a request failed
/// the client is answered at once and every leg still running is cancelled (its
/// connection closed and `POST /abort_request` sent) — except a leg whose engine reported
/// the failure itself (`reported_by`), which has already ended. Retries happen only
/// before the client saw a byte, within `retry.max_retries` and the retry budget, and only
/// where another worker can take the blamed leg.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coupling {
    /// The leg (and so the worker) the failure is blamed on, excluded from the retry.
    pub blames: Option<Role>,
    /// Counts for the blamed worker's circuit breaker.
    pub breaker: bool,
    /// A fresh pair may succeed (before the first byte).
    pub retry: bool,
    /// The engine whose own answer carried the failure: its leg needs no abort.
    pub reported_by: Option<Role>,
}

/// A failure with its human-readable detail.
#[derive(Clone, Debug)]
pub struct Failure {
    pub reason: FailReason,
    pub message: String,
    /// The engine's own status, when one answered.
    pub upstream_status: Option<StatusCode>,
    /// The leg's kept-alive connection was closed by the engine just as the leg was sent
    /// on it (a keep-alive race): the engine is not at fault, so the attempt is retried
    /// (with fresh rooms) without blaming it, on the same worker if need be.
    pub stale_connection: bool,
    /// `Retry-After` in seconds for a 429 or 503 (1 when not set): when pdgate knows
    /// how long the wait would be.
    pub retry_after_secs: Option<u32>,
}

impl Failure {
    pub fn new(reason: FailReason, message: impl Into<String>) -> Failure {
        Failure {
            reason,
            message: message.into(),
            upstream_status: None,
            stale_connection: false,
            retry_after_secs: None,
        }
    }

    /// Sets the `Retry-After` a 429 or 503 answer carries (at least 1 s).
    pub fn retry_after(mut self, secs: u32) -> Failure {
        self.retry_after_secs = Some(secs.max(1));
        self
    }

    fn retry_after_value(&self) -> HeaderValue {
        match self.retry_after_secs {
            Some(s) if s > 1 => HeaderValue::from(s),
            _ => HeaderValue::from_static("1"),
        }
    }

    pub fn with_status(mut self, status: StatusCode) -> Failure {
        self.upstream_status = Some(status);
        self
    }

    pub fn status(&self) -> StatusCode {
        self.reason.status(self.upstream_status)
    }

    /// What a client is told: pdgate's own words for a failure of an engine or of the
    /// fleet (their detail names internal URLs, ranks and engine messages, which go to the
    /// log with the request id), the message itself otherwise (the client's own request
    /// is at fault, or the words are pdgate's and name nothing internal; an engine's 4xx
    /// about the client's request is passed through).
    pub fn client_message(&self) -> &str {
        use FailReason::*;
        match self.reason {
            BootstrapUnreachable => "no prefill's bootstrap server can be reached now",
            BootstrapRankMissing => {
                "the prefill's DP rank is not registered with its bootstrap server"
            }
            BootstrapNotReady => "the prefill is still registering with its bootstrap server",
            PrefillConnect => "a prefill engine could not be reached",
            PrefillStatus => "a prefill engine failed the request",
            PrefillAborted => "a prefill engine aborted the request",
            PrefillTimeout => "a prefill engine did not answer in time",
            PrefillLost => "a prefill engine was lost while the request was in flight",
            PrefillStalled => "a prefill engine stopped making progress",
            KvTransferFailed => "the KV cache transfer from prefill to decode failed",
            DecodeConnect => "a decode engine could not be reached",
            DecodeStatus => "a decode engine failed the request",
            DecodeAborted => "a decode engine aborted the request",
            DecodeFirstByteTimeout => "a decode engine sent nothing in time after the prefill",
            DecodeStalled => "a decode engine stopped making progress",
            DecodeIdleTimeout => "a decode engine went silent mid-stream",
            DecodeBroken => "a decode engine's answer broke off",
            NoPrefillAvailable => "no prefill engine is available now",
            NoDecodeAvailable => "no decode engine is available now",
            NoWorkerAvailable => "no engine of the model is available now",
            Internal => "internal error",
            _ => &self.message,
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}`, OpenAI's shape (`param` null
    /// unless a request field is at fault; OpenAI's `type`, `param` and string `code`
    /// for the client-key failures: [`FailReason::openai_type_and_code`]); the message is
    /// [`Failure::client_message`].
    pub fn json(&self) -> Bytes {
        let v = match self.reason.openai_type_and_code() {
            Some((kind, code)) => serde_json::json!({
                "error": {
                    "message": self.client_message(),
                    "type": kind,
                    "param": self.reason.openai_param(),
                    "code": code,
                }
            }),
            None => serde_json::json!({
                "error": {
                    "message": self.client_message(),
                    "type": self.reason.as_str(),
                    "param": self.reason.openai_param(),
                    "code": self.status().as_u16(),
                }
            }),
        };
        Bytes::from(v.to_string())
    }

    /// The terminal SSE bytes of a stream that fails after its headers were sent.
    pub fn sse_event(&self) -> Bytes {
        let json = self.json();
        let mut out = Vec::with_capacity(json.len() + 32);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&json);
        out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        Bytes::from(out)
    }

    /// The failure as a whole HTTP/1.1 response that closes its connection, for answers
    /// written straight to a socket (before any HTTP machinery runs on it).
    pub fn raw_http1(&self) -> Vec<u8> {
        let json = self.json();
        let status = self.status();
        let mut out = Vec::with_capacity(json.len() + 160);
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\ncontent-type: application/json\r\nconnection: close\r\n");
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            out.extend_from_slice(b"retry-after: ");
            out.extend_from_slice(self.retry_after_value().as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(json.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n\r\n");
        out.extend_from_slice(&json);
        out
    }

    /// The complete HTTP response for a failure before headers.
    pub fn into_response(self, request_id: Option<&HeaderValue>) -> Response<RespBody> {
        let status = self.status();
        let mut resp = crate::body::whole_response(status, crate::body::JSON, self.json());
        let h = resp.headers_mut();
        if matches!(
            status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            h.insert(header::RETRY_AFTER, self.retry_after_value());
        }
        if status == StatusCode::UNAUTHORIZED {
            // RFC 9110: a 401 names the scheme it wants.
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(id) = request_id {
            h.insert(crate::types::REQUEST_ID, id.clone());
        }
        resp
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason.as_str(), self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Internal URLs and engine messages stay in the log: a failure of an engine or of
    /// the fleet tells the client pdgate's own words; the client's own errors keep theirs.
    #[test]
    fn client_bodies_name_nothing_internal() {
        let detail = "prefill http://10.1.2.3:30000 rank 3: engine said 'CUDA OOM in worker'";
        for r in FailReason::ALL {
            let f = Failure::new(r, detail);
            let body = String::from_utf8(f.json().to_vec()).unwrap();
            let leaks = body.contains("10.1.2.3") || body.contains("CUDA");
            let engine_side = r.leg().is_some() && r.retryable()
                || matches!(
                    r,
                    FailReason::NoPrefillAvailable
                        | FailReason::NoDecodeAvailable
                        | FailReason::NoWorkerAvailable
                        | FailReason::Internal
                        | FailReason::DecodeIdleTimeout
                );
            if engine_side {
                assert!(!leaks, "{}: {body}", r.as_str());
                assert!(f.to_string().contains("10.1.2.3"), "the log keeps it");
            }
        }
        // An engine's 4xx about the client's request reaches the client.
        let f = Failure::new(FailReason::PrefillRejected, "input longer than the context");
        assert!(String::from_utf8_lossy(&f.json()).contains("longer than the context"));
    }

    #[test]
    fn every_reason_has_a_unique_label_and_valid_json() {
        let mut seen = std::collections::HashSet::new();
        for r in FailReason::ALL {
            assert!(seen.insert(r.as_str()), "duplicate label {}", r.as_str());
            let f = Failure::new(r, "m \"quoted\"");
            let v: serde_json::Value = serde_json::from_slice(&f.json()).unwrap();
            match r.openai_type_and_code() {
                Some((kind, code)) => {
                    assert_eq!(v["error"]["type"], kind);
                    assert_eq!(v["error"]["code"], code);
                }
                None => {
                    assert_eq!(v["error"]["type"], r.as_str());
                    assert_eq!(v["error"]["code"], f.status().as_u16());
                }
            }
            let sse = f.sse_event();
            let s = std::str::from_utf8(&sse).unwrap();
            let first = s
                .strip_prefix("data: ")
                .unwrap()
                .split("\n\n")
                .next()
                .unwrap();
            serde_json::from_str::<serde_json::Value>(first).unwrap();
            assert!(s.ends_with("data: [DONE]\n\n"));
        }
    }

    /// Every error pdgate writes has OpenAI's shape: exactly `message` (a string), `type`
    /// (a string), `param` (null or the field at fault) and `code` (OpenAI's string for the
    /// reasons it names, else the HTTP status), over every reason, as a body and as an SSE
    /// event.
    #[test]
    fn every_reason_has_openai_error_shape() {
        for r in FailReason::ALL {
            let f = Failure::new(r, "m");
            let sse = f.sse_event();
            let event = std::str::from_utf8(&sse)
                .unwrap()
                .strip_prefix("data: ")
                .and_then(|s| s.split("\n\n").next())
                .unwrap()
                .to_string();
            for text in [String::from_utf8(f.json().to_vec()).unwrap(), event] {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                let top = v.as_object().unwrap();
                assert_eq!(top.len(), 1, "{text}");
                let e = v["error"].as_object().unwrap();
                let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
                keys.sort_unstable();
                assert_eq!(keys, ["code", "message", "param", "type"], "{text}");
                assert!(e["message"].is_string() && e["type"].is_string(), "{text}");
                assert_eq!(e["param"].as_str(), r.openai_param(), "{text}");
                match r.openai_type_and_code() {
                    Some((_, code)) => assert_eq!(e["code"], code, "{text}"),
                    None => assert_eq!(e["code"], f.status().as_u16(), "{text}"),
                }
            }
        }
    }

    #[test]
    fn fault_and_retry_classes() {
        use FailReason::*;
        let faults: Vec<_> = FailReason::ALL
            .into_iter()
            .filter(|r| r.is_worker_fault())
            .collect();
        assert_eq!(
            faults,
            vec![
                BootstrapUnreachable,
                BootstrapRankMissing,
                PrefillConnect,
                PrefillStatus,
                PrefillAborted,
                PrefillTimeout,
                PrefillLost,
                KvTransferFailed,
                DecodeConnect,
                DecodeStatus,
                DecodeAborted,
                DecodeFirstByteTimeout,
                DecodeIdleTimeout,
                DecodeBroken
            ]
        );
        for r in [
            InvalidRequest,
            PrefillRejected,
            DecodeRejected,
            DecodeIdleTimeout,
            RequestTimeout,
            Overloaded,
        ] {
            assert!(!r.retryable(), "{r:?}");
        }
        for r in [
            BootstrapNotReady,
            PrefillConnect,
            PrefillTimeout,
            PrefillStalled,
            KvTransferFailed,
            DecodeFirstByteTimeout,
            DecodeStalled,
            DecodeBroken,
        ] {
            assert!(r.retryable(), "{r:?}");
        }
    }

    #[test]
    fn rejected_passes_the_engine_4xx_through() {
        let f = Failure::new(FailReason::PrefillRejected, "too long")
            .with_status(StatusCode::from_u16(422).unwrap());
        assert_eq!(f.status().as_u16(), 422);
        let f = Failure::new(FailReason::PrefillRejected, "odd")
            .with_status(StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(f.status(), StatusCode::BAD_REQUEST);
    }
}
