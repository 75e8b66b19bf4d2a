use std::sync::atomic::Ordering;

use http::{HeaderMap, HeaderValue};
use rand::SeedableRng;

use super::*;

fn tracer(ratio: f64, queue: usize) -> (Tracer, mpsc::Receiver<SpanData>) {
    let (tx, rx) = mpsc::channel(queue);
    (Tracer::new(tx, ratio, Arc::default()), rx)
}

fn headers(tp: Option<&str>) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Some(v) = tp {
        h.insert(TRACEPARENT, HeaderValue::from_str(v).unwrap());
        h.insert(TRACESTATE, HeaderValue::from_static("k=v"));
    }
    h
}

/// How many of `n` requests with `tp` are traced at `ratio`.
fn traced(ratio: f64, tp: Option<&str>, n: usize) -> usize {
    let (t, _rx) = tracer(ratio, 16);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    (0..n)
        .filter(|_| {
            t.start_request(&headers(tp), "r".into(), &mut rng)
                .is_some()
        })
        .count()
}

#[test]
fn sampling_is_parent_based_then_by_ratio() {
    let sampled = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    let unsampled = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
    let malformed = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7");
    // (ratio, traceparent, traced out of 1000: range)
    let cases: &[(f64, Option<&str>, std::ops::RangeInclusive<usize>)] = &[
        (0.0, sampled, 1000..=1000),
        (1.0, unsampled, 0..=0),
        (1.0, None, 1000..=1000),
        (0.0, None, 0..=0),
        (0.0, malformed, 0..=0),
        (1.0, malformed, 1000..=1000),
        // A quarter, within a wide band (a seeded draw: the same every run).
        (0.25, None, 200..=300),
    ];
    for (ratio, tp, want) in cases {
        let got = traced(*ratio, *tp, 1000);
        assert!(want.contains(&got), "ratio {ratio}, {tp:?}: {got}");
    }
}

#[test]
fn a_continued_trace_keeps_the_callers_ids_and_state() {
    let (t, mut rx) = tracer(1.0, 16);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut r = t
        .start_request(&headers(Some(tp)), "POST /generate".into(), &mut rng)
        .unwrap();
    let scope = r.scope().unwrap();
    let mut leg = scope.child("prefill", SpanKind::Client);
    let header = leg.traceparent().unwrap();
    let parsed = TraceParent::parse(&header).unwrap();
    assert_eq!(parsed.trace_id.hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert!(parsed.sampled());
    leg.fail("prefill_status");
    let leg_id = parsed.parent_id;
    drop(leg);
    r.relay_started();
    r.finish(502, Some("prefill_status"));
    let got: Vec<SpanData> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    let names: Vec<&str> = got.iter().map(|s| s.name.as_ref()).collect();
    assert_eq!(names, ["prefill", "relay", "POST /generate"]);
    let (leg, relay, root) = (&got[0], &got[1], &got[2]);
    assert_eq!(leg.span_id, leg_id);
    assert_eq!(leg.parent, Some(root.span_id));
    assert_eq!(relay.parent, Some(root.span_id));
    assert_eq!(
        root.parent.map(|p| p.hex()).as_deref(),
        Some("00f067aa0ba902b7")
    );
    assert_eq!(root.trace_state.as_deref(), Some("k=v"));
    assert_eq!(root.kind, SpanKind::Server);
    assert_eq!(leg.status, SpanStatus::Error("prefill_status".into()));
    assert!(root.start <= relay.start && relay.end <= root.end);
    assert!(got
        .iter()
        .all(|s| s.trace_id == root.trace_id && s.end >= s.start));
}

#[test]
fn span_ids_are_distinct_and_never_zero() {
    let (t, _rx) = tracer(1.0, 1);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..10_000 {
        let id = t.span_id();
        assert!(id.is_valid());
        assert!(seen.insert(id));
    }
}

#[test]
fn a_full_queue_drops_and_counts_without_waiting() {
    let (t, mut rx) = tracer(1.0, 2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for _ in 0..5 {
        let r = t
            .start_request(&headers(None), "r".into(), &mut rng)
            .unwrap();
        r.finish(200, None);
    }
    assert_eq!(t.stats().dropped.load(Ordering::Relaxed), 3);
    let kept = std::iter::from_fn(|| rx.try_recv().ok()).count();
    assert_eq!(kept, 2);
}

/// A span queued before the exporter task first runs waits for its interval: the first
/// tick is one interval after start, not at once. (Before, the task's first poll could
/// take the span and the immediate tick together and send it at once; the select's
/// branch order is random, so the scenario runs several times.)
#[tokio::test(flavor = "current_thread")]
async fn a_span_queued_before_the_exporter_runs_waits_for_its_interval() {
    // A closed port: an export that happens fails at once and is counted as dropped.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    for _ in 0..12 {
        let cfg = crate::config::TraceConfig {
            enabled: true,
            endpoint: format!("http://127.0.0.1:{port}"),
            export_interval_ms: 600_000,
            export_timeout_ms: 2_000,
            ..Default::default()
        };
        // On a current-thread runtime the spawned task has not run yet.
        let (t, exporter) = super::export::start(&cfg);
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let r = t
            .start_request(&headers(None), "r".into(), &mut rng)
            .unwrap();
        r.finish(200, None);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let stats = exporter.stats();
        assert_eq!(stats.exported.load(Ordering::Relaxed), 0);
        assert_eq!(
            stats.dropped.load(Ordering::Relaxed),
            0,
            "sent before its interval"
        );
        // Shutdown sends it (and the closed port drops it, counted).
        exporter.shutdown().await;
        assert_eq!(exporter.stats().dropped.load(Ordering::Relaxed), 1);
    }
}
