//! What pdgate tells an operator: every metric series it exports (name, type, unit, labels,
//! help text, histogram buckets) in one table, the process-wide Prometheus recorder, the
//! `/metrics` text, and the access log's line format ([`access`]).
//!
//! A leaf: it imports nothing of the crate, so every layer (the engine clients, the pool,
//! admission, the request path, the front door) can name its series from here.
//!
//! Two kinds of series, one exposition:
//! - *recorded* series go through the `metrics` crate (counters, histograms and the
//!   admission gauges), with handles cached by their callers: the request path never builds
//!   a labelled key per request;
//! - *derived* series (per worker, per DP rank) are read from the pool's snapshot when
//!   `/metrics` is rendered ([`Source`]): in-flight counters are the pool's own atomics, so a
//!   request touches no gauge, and a worker that leaves the pool leaves the exposition at
//!   the next scrape (the Prometheus recorder cannot unregister a series; these never enter
//!   it).
//!
//! Invariants: every series pdgate exports is in [`SERIES`] and described once at start
//! ([`install`]); a derived series never has the name of a recorded one (each family
//! appears once in the text).

pub mod access;
mod exposition;
mod histogram;

use std::sync::OnceLock;

use metrics::Unit;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub use exposition::{Exposition, Source};
pub use histogram::{AtomicHistogram, MAX_BUCKETS};

/// The kind of a series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Where a series' values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The `metrics` recorder (moved as things happen).
    Recorded,
    /// The pool's snapshot, read when `/metrics` is rendered.
    Derived,
}

/// One series: everything the exposition, the docs' table (docs/operations.md) and the dashboard test read.
#[derive(Clone, Copy, Debug)]
pub struct Series {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Unit,
    pub labels: &'static [&'static str],
    pub help: &'static str,
    pub origin: Origin,
    /// Histogram buckets (upper bounds, seconds).
    pub buckets: &'static [f64],
}

/// Request durations and time to first token: 10 ms to 10 min (an LLM answer can take
/// minutes; a rejected request takes microseconds and lands in the first bucket).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Time between streamed events: decode's inter-token latency is typically 5–100 ms.
pub const INTER_EVENT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Any other histogram (none today): the recorder renders histograms, never summaries.
const DEFAULT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

// Recorded series.
pub const REQUESTS: &str = "pdgate_requests_total";
pub const CLIENT_REQUESTS: &str = "pdgate_client_requests_total";
pub const MODEL_REQUESTS: &str = "pdgate_model_requests_total";
pub const MODEL_REQUEST_DURATION: &str = "pdgate_model_request_duration_seconds";
pub const MODEL_TIME_TO_FIRST_TOKEN: &str = "pdgate_model_time_to_first_token_seconds";
pub const REQUEST_DURATION: &str = "pdgate_request_duration_seconds";
pub const TIME_TO_FIRST_TOKEN: &str = "pdgate_time_to_first_token_seconds";
pub const INTER_EVENT: &str = "pdgate_stream_inter_event_seconds";
pub const REQUEST_FAILURES: &str = "pdgate_request_failures_total";
pub const RETRIES: &str = "pdgate_retries_total";
pub const STREAM_MOVES: &str = "pdgate_stream_moves_total";
pub const IN_FLIGHT: &str = "pdgate_in_flight_requests";
pub const ADMISSION_QUEUE: &str = "pdgate_admission_queue";
pub const ADMISSION_REPLICAS: &str = "pdgate_admission_replicas";
pub const ADMISSION_REJECTED: &str = "pdgate_admission_rejected_total";
// The router queue per model, for autoscalers (waits for a decode slot).
pub const ADMISSION_QUEUE_WAITING: &str = "pdgate_admission_queue_waiting";
pub const ADMISSION_QUEUE_WAIT: &str = "pdgate_admission_queue_wait_seconds";
// A model's own admission (`[models.settings."NAME".admission]`).
pub const MODEL_IN_FLIGHT: &str = "pdgate_model_in_flight_requests";
pub const MODEL_ADMISSION_QUEUE: &str = "pdgate_model_admission_queue";
pub const MODEL_ADMISSION_REJECTED: &str = "pdgate_model_admission_rejected_total";
pub const BYTES_IN_FLIGHT: &str = "pdgate_bytes_in_flight";
pub const OPEN_CONNECTIONS: &str = "pdgate_open_connections";
pub const CONNECTIONS_REJECTED: &str = "pdgate_connections_rejected_total";
pub const STALE_RETRIES: &str = "pdgate_upstream_stale_retries_total";
pub const LEG_ABORTS: &str = "pdgate_leg_aborts_total";
pub const LEG_ABORTS_DROPPED: &str = "pdgate_leg_aborts_dropped_total";
pub const LOG_LINES_DROPPED: &str = "pdgate_log_lines_dropped_total";
// OpenTelemetry traces (`crate::trace`).
pub const TRACE_SPANS_EXPORTED: &str = "pdgate_trace_spans_exported_total";
pub const TRACE_SPANS_DROPPED: &str = "pdgate_trace_spans_dropped_total";
pub const LAYOUT_MISMATCHES: &str = "pdgate_layout_mismatches";
pub const BREAKER_TRANSITIONS: &str = "pdgate_breaker_transitions_total";
pub const BREAKER_EJECTION_CAPPED: &str = "pdgate_breaker_ejection_capped_total";
pub const PREFLIGHT_CHECKS: &str = "pdgate_preflight_checks_total";
pub const BOOTSTRAP_RANK_TRANSITIONS: &str = "pdgate_bootstrap_rank_transitions_total";
pub const BOOTSTRAP_HEARTBEAT_LOST: &str = "pdgate_bootstrap_heartbeat_lost_total";
pub const BOOTSTRAP_REFUSED: &str = "pdgate_bootstrap_refused_total";
pub const CONFIG_RELOADS: &str = "pdgate_config_reloads_total";
pub const CONFIG_LAST_RELOAD: &str = "pdgate_config_last_reload_success_timestamp_seconds";
pub const BUILD_INFO: &str = "pdgate_build_info";
// Kubernetes discovery (`crate::discovery`).
pub const DISCOVERY_PODS: &str = "pdgate_discovery_pods";
pub const DISCOVERY_WATCH_RESTARTS: &str = "pdgate_discovery_watch_restarts_total";
pub const DISCOVERY_WATCH_ERRORS: &str = "pdgate_discovery_watch_errors_total";
pub const DISCOVERY_LAST_SYNC: &str = "pdgate_discovery_last_sync_timestamp_seconds";
pub const DISCOVERY_WORKERS: &str = "pdgate_discovery_workers";

// Derived series (read from the pool at scrape time).
pub const WORKER_HEALTHY: &str = "pdgate_worker_healthy";
pub const WORKER_IN_FLIGHT: &str = "pdgate_worker_in_flight_requests";
pub const DECODE_PREALLOC_QUEUE: &str = "pdgate_decode_prealloc_queue";
pub const PREFILL_BACKLOG: &str = "pdgate_prefill_backlog_seconds";
pub const PREFILL_RANK_BACKLOG: &str = "pdgate_prefill_rank_backlog_seconds";
pub const PREFILL_RANK_PACE: &str = "pdgate_prefill_rank_tokens_per_second";
pub const WORKER_BREAKER_STATE: &str = "pdgate_worker_breaker_state";
pub const BOOTSTRAP_RANK_STATE: &str = "pdgate_bootstrap_rank_state";
pub const ROUTABLE_RANKS: &str = "pdgate_routable_ranks";
pub const MODEL_ROUTABLE_RANKS: &str = "pdgate_model_routable_ranks";
pub const WORKER_REQUESTS: &str = "pdgate_worker_requests_total";
pub const WORKER_PREFILL_DURATION: &str = "pdgate_worker_prefill_duration_seconds";
pub const WORKER_FIRST_BYTE: &str = "pdgate_worker_first_byte_seconds";
pub const RANK_PROMPT_TOKENS: &str = "pdgate_rank_prompt_tokens_total";
pub const RANK_CACHED_TOKENS: &str = "pdgate_rank_cached_tokens_total";
pub const AFFINITY_SPILLS: &str = "pdgate_affinity_spills_total";
// Scaling signals per model, published by the sampler (`pool::signals`).
pub const DECODE_SLOTS_USED: &str = "pdgate_decode_slots_used";
pub const DECODE_SLOTS_CAPACITY: &str = "pdgate_decode_slots_capacity";
pub const PREFILL_ENGINES_BUSY: &str = "pdgate_prefill_engines_busy";
pub const SUGGESTED_PREFILL_DECODE_RATIO: &str = "pdgate_suggested_prefill_decode_ratio";

const fn s(
    name: &'static str,
    kind: Kind,
    unit: Unit,
    labels: &'static [&'static str],
    help: &'static str,
) -> Series {
    Series {
        name,
        kind,
        unit,
        labels,
        help,
        origin: Origin::Recorded,
        buckets: &[],
    }
}

const fn histogram(
    name: &'static str,
    labels: &'static [&'static str],
    buckets: &'static [f64],
    help: &'static str,
) -> Series {
    Series {
        buckets,
        ..s(name, Kind::Histogram, Unit::Seconds, labels, help)
    }
}

const fn derived(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
) -> Series {
    Series {
        origin: Origin::Derived,
        ..s(name, Kind::Gauge, Unit::Count, labels, help)
    }
}

/// A derived series of another kind than a gauge (per-worker counters and histograms).
const fn derived_of(series: Series) -> Series {
    Series {
        origin: Origin::Derived,
        ..series
    }
}

use Kind::{Counter as C, Gauge as G};

/// Every series pdgate exports.
pub static SERIES: &[Series] = &[
    s(CLIENT_REQUESTS, C, Unit::Count, &["key", "outcome"],
        "PD requests by client key id (the name in auth.api_keys_file, or line-N for an unnamed key; never the key or anything derived from it) and outcome; only with client keys."),
    s(MODEL_REQUESTS, C, Unit::Count, &["model", "outcome"],
        "PD requests by the model they were routed to (a model a worker serves or an alias names: never the client's raw string) and outcome; only while requests are routed by model (several handoff groups, aliases or strict)."),
    histogram(MODEL_REQUEST_DURATION, &["model", "outcome"], LATENCY_BUCKETS,
        "Time from a request's arrival to the end of its response body, by the model it was routed to (as pdgate_model_requests_total: only while requests are routed by model) and outcome."),
    histogram(MODEL_TIME_TO_FIRST_TOKEN, &["model"], LATENCY_BUCKETS,
        "Streams: time from the request's arrival to its first event relayed to the client, by the model it was routed to (only while requests are routed by model)."),
    s(REQUESTS, C, Unit::Count, &["route", "outcome"],
        "PD requests by route and outcome (ok, or the failure reason: the error type clients see), counted when the response ends."),
    histogram(REQUEST_DURATION, &["route", "outcome"], LATENCY_BUCKETS,
        "Time from a PD request's arrival to the end of its response body (the whole stream for a stream), by route and outcome."),
    histogram(TIME_TO_FIRST_TOKEN, &["route"], LATENCY_BUCKETS,
        "Streams: time from the request's arrival to its first event relayed to the client (decode's first token)."),
    derived_of(histogram(INTER_EVENT, &["route"], INTER_EVENT_BUCKETS,
        "Streams: time between consecutive writes of SSE events to the client (events that arrive together are written together); kept in atomics (observed per event), derived at scrape time.")),
    s(REQUEST_FAILURES, C, Unit::Count, &["reason", "phase"],
        "Failures by reason: phase=before_first_byte counts failed attempts (retried when possible), phase=streaming streams that failed after the client saw bytes."),
    s(RETRIES, C, Unit::Count, &["reason"],
        "Attempts retried with a fresh pair, by the reason the previous attempt failed."),
    s(STREAM_MOVES, C, Unit::Count, &["route", "reason", "outcome"],
        "Live streams moved to another decode after theirs died or stalled mid-stream: moved, refused (cannot be continued exactly, or no move left), failed (the follow-up failed)."),
    s(IN_FLIGHT, G, Unit::Count, &[],
        "PD requests admitted whose response has not ended (including prefill legs still answering after it)."),
    s(ADMISSION_QUEUE, G, Unit::Count, &[],
        "PD requests waiting for an admission slot (admission.max_in_flight reached)."),
    s(ADMISSION_REPLICAS, G, Unit::Count, &[],
        "The replica count this replica shares each decode rank's capacity with (admission.replicas, or pdgate's pods counted by admission.replica_selector; 0 = unknown: no shares)."),
    s(ADMISSION_REJECTED, C, Unit::Count, &["reason"],
        "PD requests shed by admission: queue_full (429) or queue_timeout (503) waiting for the in-flight cap; capacity_queue_full, capacity_timeout waiting for a decode slot (or a prefill rank under admission.prefill_backlog_max_secs), capacity_wait_estimate (503 at once: the estimated wait for a decode slot is longer than the queue timeout); bytes_full (503) with the byte budget full, bytes_too_large (413) for a body or answer larger than the whole budget."),
    s(ADMISSION_QUEUE_WAITING, G, Unit::Count, &["model"],
        "Per model: requests waiting in the admission queue for a decode slot of their model, or a prefill rank under admission.prefill_backlog_max_secs (all counted in pdgate_admission_queue too); model is \"\" while requests are not routed by model and several models are served."),
    histogram(ADMISSION_QUEUE_WAIT, &["model", "outcome"], LATENCY_BUCKETS,
        "Per model: time a request waited in the admission queue for a decode slot (or a prefill rank under its backlog bound), observed when the wait ends, by outcome: admitted (a slot was reserved), timeout (answered 503), gone (the client left or the attempt ended otherwise)."),
    s(MODEL_IN_FLIGHT, G, Unit::Count, &["model"],
        "Requests holding a slot of their model's own admission (models with an admission override only), until their response ends."),
    s(MODEL_ADMISSION_QUEUE, G, Unit::Count, &["model"],
        "Requests waiting for a slot of their model's own admission (its max_in_flight reached)."),
    s(MODEL_ADMISSION_REJECTED, C, Unit::Count, &["model", "reason"],
        "Requests shed by their model's own admission: queue_full (429), queue_timeout (503)."),
    s(BYTES_IN_FLIGHT, G, Unit::Bytes, &[],
        "Bytes of request bodies and buffered engine answers held now, against admission.max_bytes_in_flight."),
    s(OPEN_CONNECTIONS, G, Unit::Count, &[],
        "Client connections open on the front door."),
    s(CONNECTIONS_REJECTED, C, Unit::Count, &[],
        "Client connections answered 503 and closed because server.max_connections were open."),
    s(STALE_RETRIES, C, Unit::Count, &[],
        "Legs re-sent on a new connection because the engine had closed the kept-alive one before reading them."),
    s(LEG_ABORTS, C, Unit::Count, &[],
        "abort_request calls sent to engines for cancelled legs."),
    s(LOG_LINES_DROPPED, C, Unit::Count, &[],
        "Log and access-log lines dropped because stdout could not keep up (the writer never blocks a request)."),
    s(TRACE_SPANS_EXPORTED, C, Unit::Count, &[],
        "Trace spans the OTLP collector accepted ([trace])."),
    s(TRACE_SPANS_DROPPED, C, Unit::Count, &["why"],
        "Trace spans dropped: the export queue was full (queue_full) or their batch was not accepted (export_failed); a request never waits for the exporter."),
    s(LEG_ABORTS_DROPPED, C, Unit::Count, &[],
        "abort_request calls not sent because too many were in flight (the leg's connection was still closed)."),
    s(LAYOUT_MISMATCHES, G, Unit::Count, &[],
        "Prefill/decode pairs whose engines disagree on page size or KV dtype (see the log)."),
    s(BREAKER_TRANSITIONS, C, Unit::Count, &["role", "to"],
        "Circuit breaker transitions, by role and new state (closed, open, half_open, stalled)."),
    s(BREAKER_EJECTION_CAPPED, C, Unit::Count, &["role"],
        "Breakers that would have opened but were kept closed by breaker.max_ejection_ratio."),
    s(PREFLIGHT_CHECKS, C, Unit::Count, &["ok"],
        "Request-path re-checks of a prefill rank whose bootstrap view was stale, by result."),
    s(BOOTSTRAP_RANK_TRANSITIONS, C, Unit::Count, &["to"],
        "Bootstrap state changes of (prefill, DP rank)s, by new state (unknown, bootstrapping, ready, failed)."),
    s(BOOTSTRAP_HEARTBEAT_LOST, C, Unit::Count, &[],
        "Times a prefill's bootstrap server missed heartbeat_max_failures heartbeats in a row (its requests in flight are failed)."),
    s(BOOTSTRAP_REFUSED, C, Unit::Count, &["reason"],
        "Prefills refused because their bootstrap server is not their own, by reason (port_disagrees, not_its_own, shared)."),
    s(CONFIG_RELOADS, C, Unit::Count, &["result"],
        "Config reloads, by result (ok, error)."),
    s(CONFIG_LAST_RELOAD, G, Unit::Seconds, &[],
        "Unix time of the last successful config load (start or reload)."),
    s(BUILD_INFO, G, Unit::Count, &["version"],
        "Always 1; the version label is pdgate's."),
    s(DISCOVERY_PODS, G, Unit::Count, &["state"],
        "Pods matched by a discovery selector, by state (ready, not_ready, terminating, or why one is not used)."),
    s(DISCOVERY_WATCH_RESTARTS, C, Unit::Count, &["role"],
        "Pod watches that started over with a fresh LIST (after 410 Gone, a failed LIST, a desync), by role; the periodic resync is not counted."),
    s(DISCOVERY_WATCH_ERRORS, C, Unit::Count, &["role"],
        "Failed pod LISTs and watches, by role (workers are kept; the watch backs off)."),
    s(DISCOVERY_LAST_SYNC, G, Unit::Seconds, &[],
        "Unix time of the last complete pod LIST of every discovery selector (age: time() minus this)."),
    s(DISCOVERY_WORKERS, G, Unit::Count, &["role"],
        "Workers discovery has in the pool, by role."),
    derived_of(s(WORKER_REQUESTS, C, Unit::Count, &["role", "worker_id", "worker_url", "outcome"],
        "Legs by worker and outcome: ok, or the failure reason blamed on this worker's leg; counted where its circuit breaker hears it (a stall probe's leg included). Only workers in the pool: a removed worker's series leave the next scrape.")),
    derived_of(histogram(WORKER_PREFILL_DURATION, &["role", "worker_id", "worker_url"], LATENCY_BUCKETS,
        "Prefill legs that answered: time from the leg's send to the prefill's answer, per prefill worker.")),
    derived_of(histogram(WORKER_FIRST_BYTE, &["role", "worker_id", "worker_url"], LATENCY_BUCKETS,
        "Decode legs: time from the legs' send to the decode's first bytes (it waits for its prefill), per decode worker.")),
    derived_of(s(RANK_PROMPT_TOKENS, C, Unit::Count, &["role", "worker_id", "worker_url", "rank"],
        "Prompt tokens of the answers whose prefill ran on this (worker, DP rank), as the engine reported them (usage.prompt_tokens, meta_info.prompt_tokens) in the answer's last event or bytes; answers that report none are not counted.")),
    derived_of(s(RANK_CACHED_TOKENS, C, Unit::Count, &["role", "worker_id", "worker_url", "rank"],
        "Of those prompt tokens, the ones the engine found in the rank's prefix cache (meta_info.cached_tokens, usage.prompt_tokens_details.cached_tokens): divide by pdgate_rank_prompt_tokens_total for the rank's hit ratio.")),
    derived_of(s(AFFINITY_SPILLS, C, Unit::Count, &["role", "worker_id", "worker_url", "rank"],
        "Requests cache_aware placed on this (worker, DP rank) although their key's own rank was another (over the load bound, or without room for the request): where hot keys spilled.")),
    derived(WORKER_HEALTHY, &["role", "worker_id", "worker_url"],
        "1 when the worker passes its active health checks, else 0."),
    derived(WORKER_IN_FLIGHT, &["role", "worker_id", "worker_url", "rank"],
        "Legs pdgate has in flight on a worker's DP rank (what the policies balance; sum by worker for the worker's total)."),
    derived(DECODE_PREALLOC_QUEUE, &["worker_id", "worker_url", "rank"],
        "Requests in a decode DP rank's pre-allocation queue at the last load poll (the engine's disaggregation.decode_prealloc_queue_reqs, every replica's requests); more than this replica sent the rank in the interval before (which may only be handshaking) and the rank is sent nothing new until a poll shows it drained. Absent for a rank whose engine does not report it."),
    derived_of(s(PREFILL_BACKLOG, G, Unit::Seconds, &["model"],
        "Per model served: the uncached prompt tokens its prefill ranks have queued (each rank's num_waiting_uncached_tokens at the last load poll, corrected by this replica's legs sent and ended since; without a report, this replica's legs in flight) plus the requests this replica holds in its admission queue because every one of those ranks was over admission.prefill_backlog_max_secs, over the sum of the ranks' learned paces (a rank without one at the others' mean): how long the prefill pool needs to clear its queue. Absent while no pace is learned and something is queued. What a prefill autoscaler reads.")),
    derived_of(s(PREFILL_RANK_BACKLOG, G, Unit::Seconds, &["worker_id", "worker_url", "rank"],
        "A prefill DP rank's backlog in seconds of its learned pace (the tokens of pdgate_prefill_backlog_seconds, one rank's); a rank over admission.prefill_backlog_max_secs is sent nothing new while another has room. Absent until the rank's pace is learned.")),
    derived_of(s(PREFILL_RANK_PACE, G, Unit::Count, &["worker_id", "worker_url", "rank"],
        "A prefill DP rank's learned pace: uncached prompt tokens per second of its service time (exponentially weighted over the legs that answered; the engine's prompt_tokens minus cached_tokens where it reports them). Absent until a leg answered.")),
    derived(WORKER_BREAKER_STATE, &["role", "worker_id", "worker_url", "state"],
        "1 for the circuit breaker's current state (closed, open, half_open, stalled) of each worker, else 0."),
    derived(BOOTSTRAP_RANK_STATE, &["worker_id", "worker_url", "rank", "state"],
        "1 for the current bootstrap state (unknown, bootstrapping, ready, failed) of each (prefill, DP rank), else 0."),
    derived(ROUTABLE_RANKS, &["role"],
        "(worker, DP rank)s that can take a leg now: healthy, breaker not open and, for a prefill, bootstrap ready."),
    derived(DECODE_SLOTS_USED, &["model"],
        "Per model: decode slots in use, summed over its decode DP ranks as this replica sees them (the engine's running + waiting requests at the last load poll, every replica's, corrected by this replica's reservations since, never less than its own; this replica's own alone without load polling); waiting requests count, so it can exceed pdgate_decode_slots_capacity. Sampled every 0.5 s."),
    derived(DECODE_SLOTS_CAPACITY, &["model"],
        "Per model: decode slots of its routable decode DP ranks (capacity.decode_max_running_per_rank, else the engine's max_running_requests); a rank of unknown capacity counts 0. Sampled every 0.5 s."),
    derived(PREFILL_ENGINES_BUSY, &["model"],
        "Per model: prefill engines its traffic keeps busy, averaged over about 60 s: the sum over its prefill workers of busy DP ranks / DP ranks (a rank is busy while the engine's last load report shows requests on it, or this replica has a leg there); at most the prefills running, so a saturated pool reads its size (pdgate_prefill_backlog_seconds says how far short it is)."),
    derived(SUGGESTED_PREFILL_DECODE_RATIO, &["model"],
        "Per model: prefill engines needed per decode engine at the current traffic, avg(prefill engines busy) / (avg(decode slots used) / slots per decode engine), averages over about 60 s (docs/scaling.md); a floor while its prefills are saturated; absent without decode work or a known decode capacity."),
    derived(MODEL_ROUTABLE_RANKS, &["model", "role"],
        "Per model served: (worker, DP rank)s that can take its legs now (a prefill counts only with a routable decode of its handoff group); 0 prefill ranks means the model's requests get 503."),
];

/// The table entry of `name`.
pub fn series(name: &str) -> Option<&'static Series> {
    SERIES.iter().find(|s| s.name == name)
}

static RECORDER: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process-wide Prometheus recorder once (later calls return the same handle)
/// and describes every series. `None` when another recorder was installed first (a program
/// embedding pdgate with its own): pdgate's series then go there.
pub fn install() -> Option<&'static PrometheusHandle> {
    RECORDER
        .get_or_init(|| {
            let mut b = PrometheusBuilder::new().set_buckets(DEFAULT_BUCKETS).ok()?;
            for s in SERIES.iter().filter(|s| s.kind == Kind::Histogram) {
                b = b
                    .set_buckets_for_metric(Matcher::Full(s.name.to_string()), s.buckets)
                    .ok()?;
            }
            let handle = match b.install_recorder() {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics recorder not installed");
                    return None;
                }
            };
            describe();
            metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            // Both results exist from the start, so `increase(...{result="error"}[5m])`
            // has a series to read before the first reload.
            for result in ["ok", "error"] {
                metrics::counter!(CONFIG_RELOADS, "result" => result).absolute(0);
            }
            Some(handle)
        })
        .as_ref()
}

fn describe() {
    for s in SERIES {
        match s.kind {
            Kind::Counter => metrics::describe_counter!(s.name, s.unit, s.help),
            Kind::Gauge => metrics::describe_gauge!(s.name, s.unit, s.help),
            Kind::Histogram => metrics::describe_histogram!(s.name, s.unit, s.help),
        }
    }
}

/// Folds recorded histogram samples into their buckets (run on a timer, so memory stays
/// flat when nobody scrapes).
pub fn upkeep() {
    if let Some(h) = install() {
        h.run_upkeep();
    }
}

/// A derived histogram family its owner keeps in statics, one histogram per value of its
/// one label, written at every [`render`] once [`register`]ed.
///
/// Why: a recorder call costs a few hundred instructions (a sample pushed, a timestamp
/// read); observed on every event of every stream, that was a tenth of a relayed token's
/// cost. An [`AtomicHistogram`] observation is a bucket search and two relaxed adds.
#[derive(Debug)]
pub struct StaticHistograms {
    /// A derived histogram series of [`SERIES`].
    pub name: &'static str,
    pub label: &'static str,
    pub members: &'static [(&'static str, &'static AtomicHistogram)],
}

impl Source for StaticHistograms {
    fn write_series(&self, out: &mut Exposition) {
        if out.family(self.name) {
            for (value, h) in self.members {
                out.histogram(&[(self.label, value)], h);
            }
        }
    }
}

static REGISTERED: std::sync::Mutex<Vec<&'static StaticHistograms>> =
    std::sync::Mutex::new(Vec::new());

/// Makes `family` part of every [`render`] from now on (once however often it is called).
pub fn register(family: &'static StaticHistograms) {
    let mut r = REGISTERED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !r.iter().any(|f| f.name == family.name) {
        r.push(family);
    }
}

/// The `/metrics` text: the recorded series, those `source` derives (the pool), then the
/// [`register`]ed families.
pub fn render(source: &dyn Source) -> String {
    let recorded = install().map(PrometheusHandle::render).unwrap_or_default();
    let mut ex = Exposition::new(recorded);
    source.write_series(&mut ex);
    let families = REGISTERED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for f in families {
        f.write_series(&mut ex);
    }
    ex.into_text()
}

/// Only the series `source` derives (no recorder).
pub fn render_derived(source: &dyn Source) -> String {
    let mut ex = Exposition::new(String::new());
    source.write_series(&mut ex);
    ex.into_text()
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A config was applied (at start, or by a good reload): stamps
/// `pdgate_config_last_reload_success_timestamp_seconds`.
pub fn config_loaded() {
    metrics::gauge!(CONFIG_LAST_RELOAD).set(unix_now());
}

/// Seconds since the Unix epoch, now: the value of every `*_timestamp_seconds` series.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A config reload ended: counted by result (`ok`, `error`); a good one also stamps the
/// last-success time ([`config_loaded`]).
pub fn config_reloaded(ok: bool) {
    let result = if ok { "ok" } else { "error" };
    metrics::counter!(CONFIG_RELOADS, "result" => result).increment(1);
    if ok {
        config_loaded();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_sound() {
        let mut names: Vec<&str> = SERIES.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a name appears twice");
        for s in SERIES {
            assert!(s.name.starts_with("pdgate_"), "{}", s.name);
            assert!(!s.help.is_empty(), "{}", s.name);
            assert_eq!(
                s.kind == Kind::Counter,
                s.name.ends_with("_total"),
                "{}",
                s.name
            );
            assert_eq!(
                s.kind == Kind::Histogram,
                !s.buckets.is_empty(),
                "{}",
                s.name
            );
            assert!(s.buckets.windows(2).all(|w| w[0] < w[1]), "{}", s.name);
            if s.origin == Origin::Derived && s.labels.contains(&"worker_url") {
                assert!(s.labels.contains(&"worker_id"), "{}", s.name);
            }
        }
        assert!(SERIES.iter().all(|s| s.buckets.len() <= MAX_BUCKETS));
        assert_eq!(LATENCY_BUCKETS.first(), Some(&0.01));
        assert_eq!(LATENCY_BUCKETS.last(), Some(&600.0));
    }
}
