//! One request's account, kept from its arrival at the front door to the end of its
//! response body: its outcome, status, the last attempt's legs, its stream timings. When the
//! record is dropped — with the response body, however it ends — the request is counted
//! (`pdgate_requests_total`, `pdgate_request_duration_seconds`) and, with `log.access`, its
//! access line written.
//!
//! Invariants:
//! - Exactly one record per request the front door routes, dropped exactly once: it moves
//!   with the request (front door → dispatcher → response body) and ends in the body that
//!   is sent ([`RequestRecord::answer`] wraps any other body), so a line is written for every
//!   request, rejected or served, when its body ends.
//! - The first outcome set wins; a record dropped without one is a client that went away
//!   (status 499 if nothing was sent).
//! - Per request, metrics cost cached handle lookups only: every (route, outcome) handle is
//!   registered once, at its first use, in the static tables below.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::{HeaderValue, Response, StatusCode};
use metrics::{Counter, Histogram};
use tokio::time::Instant;

use super::ApiRoute;
use crate::body::RespBody;
use crate::error::FailReason;
use crate::telemetry::{self, access, AtomicHistogram};
use crate::types::{DpRank, RequestId, WorkerIdent};
use crate::upstream::BaseUrl;

/// The endpoint a request hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// A PD route: counted in the request series.
    Api(ApiRoute),
    /// Anything else (`/health`, `/metrics`, a 404, ...): access-logged only.
    Other(&'static str),
}

impl Route {
    pub fn label(self) -> &'static str {
        match self {
            Route::Api(r) => r.label(),
            Route::Other(l) => l,
        }
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Failed(FailReason),
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed(r) => r.as_str(),
        }
    }

    fn index(self) -> usize {
        match self {
            Outcome::Ok => OUTCOMES - 1,
            Outcome::Failed(r) => r as usize,
        }
    }
}

/// The last attempt's legs (the access log's prefill, decode and room).
#[derive(Debug, Default)]
pub struct LegTrace {
    pub prefill: Option<LegAt>,
    pub decode: Option<LegAt>,
    pub room: Option<u64>,
}

/// Where a leg went: its worker's one name, its URL and the DP rank.
#[derive(Clone, Debug)]
pub struct LegAt {
    pub worker: WorkerIdent,
    pub url: BaseUrl,
    pub rank: DpRank,
}

/// One request's account (see the module docs).
#[derive(Debug)]
pub struct RequestRecord {
    route: Route,
    id: RequestId,
    start: Instant,
    /// The client-visible id; kept only for the access log.
    request_id: Option<HeaderValue>,
    /// The client API key's id (set by the front door when keys are configured).
    pub key_id: Option<Arc<str>>,
    /// The model the request was routed to (a name from the pool's snapshot or the
    /// config, so the label set stays bounded); `None` while one group serves all.
    pub model: Option<Arc<str>>,
    stream: Option<bool>,
    status: Option<StatusCode>,
    outcome: Option<Outcome>,
    /// Filled by each attempt as it picks its pair and rooms.
    pub legs: LegTrace,
    attempts: u32,
    /// Times the stream was moved to another decode.
    moves: u32,
    ttft: Option<Duration>,
    last_event: Option<Instant>,
    /// The largest gap between two events relayed (stall detection learns it).
    max_gap: Option<Duration>,
    access: bool,
    /// The request's span, when it is traced (`[trace]`): ended when the record is.
    pub trace: Option<Box<crate::trace::RequestTrace>>,
}

impl RequestRecord {
    /// A request that just arrived; `access`: write its access line (`log.access`).
    pub fn new(id: RequestId, route: Route, request_id: &HeaderValue, access: bool) -> Self {
        RequestRecord {
            route,
            id,
            start: Instant::now(),
            request_id: access.then(|| request_id.clone()),
            key_id: None,
            model: None,
            stream: None,
            status: None,
            outcome: None,
            legs: LegTrace::default(),
            attempts: 0,
            moves: 0,
            ttft: None,
            last_event: None,
            max_gap: None,
            access,
            trace: None,
        }
    }

    /// The largest gap between two relayed events (none before the second event).
    pub fn max_gap(&self) -> Option<Duration> {
        self.max_gap
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    pub fn route(&self) -> Route {
        self.route
    }

    pub fn set_stream(&mut self, stream: bool) {
        self.stream = Some(stream);
    }

    /// Attempt `n` (1 = the first) is being dispatched.
    pub fn set_attempts(&mut self, n: u32) {
        self.attempts = n;
    }

    /// The stream was moved to another decode (its legs are now the new pair's).
    pub fn moved(&mut self) {
        self.moves += 1;
    }

    /// Moves made so far.
    pub fn moves(&self) -> u32 {
        self.moves
    }

    /// The response head's status (kept if a status was already set).
    pub fn set_status(&mut self, status: StatusCode) {
        self.status.get_or_insert(status);
    }

    /// The request's outcome; the first one set wins.
    pub fn finish(&mut self, outcome: Outcome) {
        self.outcome.get_or_insert(outcome);
    }

    pub fn fail(&mut self, reason: FailReason) {
        self.finish(Outcome::Failed(reason));
    }

    /// A stream's event was relayed to the client `now`: the first one is the time to first
    /// token, the others one gap each between events.
    pub fn event_sent(&mut self, now: Instant) {
        let series = match self.route {
            Route::Api(r) => Some(route_series(r)),
            Route::Other(_) => None,
        };
        match self.last_event.replace(now) {
            None => {
                register_series();
                let ttft = now.saturating_duration_since(self.start);
                self.ttft = Some(ttft);
                if let Some(s) = series {
                    s.ttft().record(ttft.as_secs_f64());
                    if let Some(m) = &self.model {
                        metrics::histogram!(telemetry::MODEL_TIME_TO_FIRST_TOKEN, "model" => m.to_string())
                            .record(ttft.as_secs_f64());
                    }
                }
            }
            Some(prev) => {
                let gap = now.saturating_duration_since(prev);
                if self.max_gap.is_none_or(|m| gap > m) {
                    self.max_gap = Some(gap);
                }
                if let Route::Api(r) = self.route {
                    INTER_EVENT[r as usize].observe(gap);
                }
            }
        }
    }

    /// `resp` with this record riding on its body: the request is accounted for when the
    /// body ends. Its status is the response's unless one was set; its outcome `Ok` unless
    /// one was set.
    pub fn answer(mut self, resp: Response<RespBody>) -> Response<RespBody> {
        self.set_status(resp.status());
        self.finish(Outcome::Ok);
        resp.map(|inner| {
            http_body_util::BodyExt::boxed_unsync(crate::body::Guarded::new(inner, self))
        })
    }

    /// The request's span ends with its status, outcome, model and attempts.
    fn end_trace(&self, mut t: Box<crate::trace::RequestTrace>, outcome: Outcome) {
        let status = self.status.unwrap_or_else(|| match outcome {
            Outcome::Ok => StatusCode::OK,
            Outcome::Failed(r) => r.status(None),
        });
        if let Some(m) = &self.model {
            t.set("pdgate.model", m.to_string());
        }
        t.set("pdgate.attempts", self.attempts);
        if self.moves > 0 {
            t.set("pdgate.moves", self.moves);
        }
        let failure = match outcome {
            Outcome::Ok => None,
            Outcome::Failed(r) => Some(r.as_str()),
        };
        t.finish(status.as_u16(), failure);
    }

    fn write_access(&self, took: Duration, outcome: Outcome) {
        let rid = self
            .request_id
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-");
        let status = self.status.unwrap_or_else(|| match outcome {
            Outcome::Ok => StatusCode::OK,
            Outcome::Failed(r) => r.status(None),
        });
        access::AccessLine {
            request_id: rid,
            id: self.id.as_str(),
            route: self.route.label(),
            stream: self.stream,
            status: status.as_u16(),
            fail_reason: match outcome {
                Outcome::Ok => None,
                Outcome::Failed(r) => Some(r.as_str()),
            },
            prefill: self.legs.prefill.as_ref().map(|l| l.url.as_str()),
            prefill_id: self.legs.prefill.as_ref().map(|l| l.worker),
            prefill_rank: self.legs.prefill.as_ref().map(|l| l.rank),
            decode: self.legs.decode.as_ref().map(|l| l.url.as_str()),
            decode_id: self.legs.decode.as_ref().map(|l| l.worker),
            decode_rank: self.legs.decode.as_ref().map(|l| l.rank),
            room: self.legs.room.map(|r| r.to_string()),
            attempts: self.attempts,
            moves: self.moves,
            ttft_ms: self.ttft.map(access::millis),
            duration_ms: access::millis(took),
            key_id: self.key_id.as_deref(),
            model: self.model.as_deref(),
        }
        .emit();
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        let took = self.start.elapsed();
        let outcome = self
            .outcome
            .unwrap_or(Outcome::Failed(FailReason::ClientDisconnected));
        if let Route::Api(route) = self.route {
            let s = route_series(route);
            s.requests(outcome).increment(1);
            // Only with client keys: their ids are as many as the keys file has names.
            if let Some(key) = &self.key_id {
                metrics::counter!(telemetry::CLIENT_REQUESTS, "key" => key.to_string(), "outcome" => outcome.label())
                    .increment(1);
            }
            // Only while requests are routed by model: names from the snapshot or config.
            if let Some(m) = &self.model {
                metrics::counter!(telemetry::MODEL_REQUESTS, "model" => m.to_string(), "outcome" => outcome.label())
                    .increment(1);
                metrics::histogram!(telemetry::MODEL_REQUEST_DURATION, "model" => m.to_string(), "outcome" => outcome.label())
                    .record(took.as_secs_f64());
            }
            s.duration(outcome).record(took.as_secs_f64());
            let (id, route, secs) = (self.id, route.label(), took.as_secs_f64());
            match outcome {
                Outcome::Ok => tracing::debug!(request_id = %id, route, secs, "request done"),
                Outcome::Failed(FailReason::ClientDisconnected) => {
                    tracing::info!(request_id = %id, route, secs, "client went away; legs cancelled")
                }
                Outcome::Failed(_) => {}
            }
        }
        if self.access && access::wanted() {
            self.write_access(took, outcome);
        }
        if let Some(t) = self.trace.take() {
            self.end_trace(t, outcome);
        }
    }
}

/// Outcomes per route: every failure reason, then `ok`.
const OUTCOMES: usize = FailReason::ALL.len() + 1;
const ROUTES: usize = 3;

/// A route's series, each registered at its first use.
struct RouteSeries {
    route: ApiRoute,
    requests: [OnceLock<Counter>; OUTCOMES],
    duration: [OnceLock<Histogram>; OUTCOMES],
    ttft: OnceLock<Histogram>,
}

impl RouteSeries {
    const fn new(route: ApiRoute) -> RouteSeries {
        RouteSeries {
            route,
            requests: [const { OnceLock::new() }; OUTCOMES],
            duration: [const { OnceLock::new() }; OUTCOMES],
            ttft: OnceLock::new(),
        }
    }

    fn requests(&self, o: Outcome) -> &Counter {
        let (route, outcome) = (self.route.label(), o.label());
        self.requests[o.index()].get_or_init(
            || metrics::counter!(telemetry::REQUESTS, "route" => route, "outcome" => outcome),
        )
    }

    fn duration(&self, o: Outcome) -> &Histogram {
        let (route, outcome) = (self.route.label(), o.label());
        self.duration[o.index()].get_or_init(|| {
            metrics::histogram!(telemetry::REQUEST_DURATION, "route" => route, "outcome" => outcome)
        })
    }

    fn ttft(&self) -> &Histogram {
        let route = self.route.label();
        self.ttft
            .get_or_init(|| metrics::histogram!(telemetry::TIME_TO_FIRST_TOKEN, "route" => route))
    }
}

/// `pdgate_stream_inter_event_seconds` by route (in [`ApiRoute`] order): observed on every
/// event of every stream, so kept in atomics ([`telemetry::StaticHistograms`]).
static INTER_EVENT: [AtomicHistogram; ROUTES] =
    [const { AtomicHistogram::new(telemetry::INTER_EVENT_BUCKETS) }; ROUTES];

static INTER_EVENT_FAMILY: telemetry::StaticHistograms = telemetry::StaticHistograms {
    name: telemetry::INTER_EVENT,
    label: "route",
    members: &[
        (
            ApiRoute::Generate.label(),
            &INTER_EVENT[ApiRoute::Generate as usize],
        ),
        (
            ApiRoute::ChatCompletions.label(),
            &INTER_EVENT[ApiRoute::ChatCompletions as usize],
        ),
        (
            ApiRoute::Completions.label(),
            &INTER_EVENT[ApiRoute::Completions as usize],
        ),
    ],
};

/// Puts the per-route stream series in the exposition (once; every record calls it).
fn register_series() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| telemetry::register(&INTER_EVENT_FAMILY));
}

static ROUTE_SERIES: [RouteSeries; ROUTES] = [
    RouteSeries::new(ApiRoute::Generate),
    RouteSeries::new(ApiRoute::ChatCompletions),
    RouteSeries::new(ApiRoute::Completions),
];

fn route_series(route: ApiRoute) -> &'static RouteSeries {
    &ROUTE_SERIES[route as usize]
}

/// Where in a request's life a failure happened (`pdgate_request_failures_total{phase}`).
#[derive(Clone, Copy, Debug)]
pub enum Phase {
    BeforeFirstByte,
    Streaming,
}

const REASONS: usize = FailReason::ALL.len();

static FAILURES: [[OnceLock<Counter>; REASONS]; 2] =
    [const { [const { OnceLock::new() }; REASONS] }; 2];
static RETRIES: [OnceLock<Counter>; REASONS] = [const { OnceLock::new() }; REASONS];

/// Counts a failure (a failed attempt, or a stream that failed after its first byte).
pub fn failed(reason: FailReason, phase: Phase) {
    let label = match phase {
        Phase::BeforeFirstByte => "before_first_byte",
        Phase::Streaming => "streaming",
    };
    FAILURES[phase as usize][reason as usize]
        .get_or_init(|| {
            metrics::counter!(telemetry::REQUEST_FAILURES, "reason" => reason.as_str(), "phase" => label)
        })
        .increment(1);
}

/// Counts a retry after an attempt failed for `reason`.
pub fn retried(reason: FailReason) {
    RETRIES[reason as usize]
        .get_or_init(|| metrics::counter!(telemetry::RETRIES, "reason" => reason.as_str()))
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_indexed_by_their_enums() {
        for (i, r) in FailReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
            assert_eq!(Outcome::Failed(*r).index(), i);
        }
        assert_eq!(Outcome::Ok.index(), OUTCOMES - 1);
        for (i, s) in ROUTE_SERIES.iter().enumerate() {
            assert_eq!(s.route as usize, i);
            let (label, h) = INTER_EVENT_FAMILY.members[i];
            assert_eq!(label, s.route.label());
            assert!(std::ptr::eq(h, &INTER_EVENT[i]));
        }
    }
}
