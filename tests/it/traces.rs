//! OpenTelemetry traces (`[trace]`) against an in-process OTLP/HTTP collector
//! (`support::otlp_collector`) and simulated engines: the span tree of a request (parents,
//! kinds, times nested and in stage order), the caller's trace continued, the engines'
//! `traceparent`, a retry's attempt spans and reason, sampling, the flush at shutdown, and a
//! collector that is down or slow costing requests nothing.

use std::time::Duration;

use crate::support::common::{self, start, with_faults, Env, GEN, GEN_STREAM};
use crate::support::otlp_collector::{Collector, Got};
use http_body_util::BodyExt;
use pdgate::config::Config;
use pdgate_sim::{EngineConfig, Faults};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn traced(collector: &str) -> impl FnOnce(&mut Config) + '_ {
    move |c: &mut Config| {
        c.trace.enabled = true;
        c.trace.endpoint = collector.to_string();
        c.trace.service_name = "pdgate-it".into();
        c.trace.export_interval_ms = 20;
    }
}

/// A collector, and a router tracing to it (then `tweak`) in front of one prefill and one
/// decode, routable.
async fn traced_pair(tweak: impl FnOnce(&mut Config)) -> (Collector, Env) {
    let col = Collector::start(Duration::ZERO).await;
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            traced(&col.url)(c);
            tweak(c);
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    (col, env)
}

/// POSTs `body` to `path` with the given extra headers; the whole answer (bounded: 20 s).
async fn post(env: &Env, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, Vec<u8>) {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let fut = async {
        let resp = env.send("POST", path, &h, body.to_string()).await;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (status, bytes.to_vec())
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("answered within 20 s")
}

fn one<'a>(spans: &'a [Got], name: &str) -> &'a Got {
    let found: Vec<&Got> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
    found[0]
}

fn within(child: &Got, parent: &Got) {
    assert_eq!(
        child.parent.as_deref(),
        Some(parent.span_id.as_str()),
        "{} under {}",
        child.name,
        parent.name
    );
    assert!(
        parent.start <= child.start && child.end <= parent.end && child.start <= child.end,
        "{} [{}, {}] within {} [{}, {}]",
        child.name,
        child.start,
        child.end,
        parent.name,
        parent.start,
        parent.end
    );
}

/// The `traceparent` an engine received last, as (trace id, parent span id).
fn engine_parent(e: &pdgate_sim::SimEngine) -> (String, String) {
    let h = e.last_generate_headers();
    let tp = h
        .iter()
        .find(|(k, _)| k == "traceparent")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("the engine got no traceparent: {h:?}"));
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!((parts[0], parts[3]), ("00", "01"), "{tp}");
    (parts[1].to_string(), parts[2].to_string())
}

fn header(e: &pdgate_sim::SimEngine, name: &str) -> Option<String> {
    e.last_generate_headers()
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_continues_the_callers_trace_as_one_span_tree() {
    let (col, env) = traced_pair(|_| {}).await;
    let tp = format!("00-{TRACE}-{CALLER_SPAN}-01");
    for (path, body, root_name) in [
        ("/generate", GEN_STREAM, "POST /generate"),
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":4}"#,
            "POST /v1/completions",
        ),
    ] {
        col.spans.lock().unwrap().clear();
        let (status, answer) = post(
            &env,
            path,
            &[("traceparent", &tp), ("tracestate", "vendor=a,other=b")],
            body,
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        col.wait_for(TRACE, root_name).await;
        let spans = col.wait_for(TRACE, "prefill").await;
        assert!(spans.iter().all(|s| s.service == "pdgate-it"), "{spans:#?}");
        // The request's span continues the caller's, with its tracestate.
        let root = one(&spans, root_name);
        assert_eq!(root.parent.as_deref(), Some(CALLER_SPAN));
        assert_eq!(root.kind, 2, "SERVER");
        assert_eq!(root.trace_state.as_deref(), Some("vendor=a,other=b"));
        assert_eq!(
            root.attr("http.response.status_code").as_deref(),
            Some("200")
        );
        assert_eq!(root.attr("pdgate.outcome").as_deref(), Some("ok"));
        assert_eq!(root.attr("http.request.method").as_deref(), Some("POST"));
        assert_eq!(root.attr("http.route").as_deref(), Some(path));
        assert_eq!(root.status_code, 0);
        // One attempt, its stages in order, the relay after them.
        let attempt = one(&spans, "attempt");
        within(attempt, root);
        assert_eq!(attempt.attr("pdgate.attempt").as_deref(), Some("0"));
        assert_eq!(attempt.attr("retry.reason"), None);
        let (pick, check) = (one(&spans, "pick"), one(&spans, "bootstrap_check"));
        let (prefill, first) = (one(&spans, "prefill"), one(&spans, "decode_first_byte"));
        let relay = one(&spans, "relay");
        for s in [pick, check, prefill, first] {
            within(s, attempt);
        }
        within(relay, root);
        assert!(pick.end <= check.start && check.end <= prefill.start);
        assert!(check.end <= first.start && first.end <= relay.start);
        assert!(attempt.end <= relay.start);
        assert_eq!((prefill.kind, first.kind, pick.kind), (3, 3, 1));
        assert_eq!(pick.attr("pdgate.prefill.dp_rank").as_deref(), Some("0"));
        assert!(pick.attr("pdgate.decode.worker_id").is_some(), "{pick:?}");
        assert_eq!(spans.len(), 7, "{spans:#?}");
        // Each engine got the request's trace, under its own leg's span, and the caller's
        // tracestate unchanged.
        let (p, d) = (&env.cluster.prefills[0], &env.cluster.decodes[0]);
        assert_eq!(
            engine_parent(p),
            (TRACE.to_string(), prefill.span_id.clone())
        );
        assert_eq!(engine_parent(d), (TRACE.to_string(), first.span_id.clone()));
        assert_eq!(header(d, "tracestate").as_deref(), Some("vendor=a,other=b"));
    }
    assert!(col.bad.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_an_attempt_span_with_its_reason() {
    let col = Collector::start(Duration::ZERO).await;
    let bad = with_faults(
        EngineConfig::prefill(1),
        Faults {
            prefill_status: Some(500),
            ..Faults::default()
        },
    );
    let env = start(
        vec![bad, EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        traced(&col.url),
    )
    .await;
    env.wait_routable(2, 1).await;
    // Round robin sends one of the first two requests to the failing prefill first.
    let ids = [
        "11111111111111111111111111111111",
        "22222222222222222222222222222222",
    ];
    for id in ids {
        let tp = format!("00-{id}-{CALLER_SPAN}-01");
        let (status, _) = post(&env, "/generate", &[("traceparent", &tp)], GEN).await;
        assert_eq!(status, 200);
    }
    let mut retried = 0;
    for id in ids {
        col.wait_for(id, "POST /generate").await;
        let spans = col.trace(id);
        let root = one(&spans, "POST /generate");
        let mut attempts: Vec<&Got> = spans.iter().filter(|s| s.name == "attempt").collect();
        attempts.sort_by_key(|s| s.attr("pdgate.attempt"));
        for a in &attempts {
            within(a, root);
        }
        if attempts.len() == 1 {
            continue;
        }
        retried += 1;
        assert_eq!(attempts.len(), 2, "{spans:#?}");
        let (first, second) = (attempts[0], attempts[1]);
        assert_eq!(
            first.status_code, 2,
            "the failed attempt is an error: {first:?}"
        );
        assert_eq!(first.attr("error.type").as_deref(), Some("prefill_status"));
        assert_eq!(first.attr("pdgate.blamed_role").as_deref(), Some("prefill"));
        assert_eq!(
            second.attr("retry.reason").as_deref(),
            Some("prefill_status")
        );
        assert_eq!(second.attr("pdgate.attempt").as_deref(), Some("1"));
        assert!(first.end <= second.start);
        assert_eq!(root.attr("pdgate.attempts").as_deref(), Some("2"));
        assert_eq!(root.status_code, 0, "the request succeeded: {root:?}");
        // The failed prefill leg's span is under the first attempt, marked failed.
        let failed_leg: Vec<&Got> = spans
            .iter()
            .filter(|s| s.name == "prefill" && s.parent.as_deref() == Some(&first.span_id))
            .collect();
        assert_eq!(failed_leg.len(), 1, "{spans:#?}");
        assert_eq!(failed_leg[0].status_code, 2);
    }
    // Round robin sends one or both to the failing prefill first (its breaker needs more).
    assert!(retried >= 1, "a request was retried");
}

/// Sampling: a caller's flag decides for its trace; without a valid header,
/// `trace.sample_ratio` decides (0 here: nothing). An untraced request forwards the
/// caller's headers as they came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_follows_the_caller_then_the_ratio() {
    let (col, env) = traced_pair(|c| {
        c.trace.sample_ratio = 0.0;
    })
    .await;
    let unsampled = format!("00-{TRACE}-{CALLER_SPAN}-00");
    let malformed = format!("00-{}-{CALLER_SPAN}-01", TRACE.to_uppercase());
    // (traceparent sent, what the engines get): none of them is traced.
    let cases: &[(Option<&str>, Option<&str>)] = &[
        (Some(&unsampled), Some(&unsampled)),
        (Some(&malformed), Some(&malformed)),
        (None, None),
    ];
    for (tp, engine_gets) in cases {
        let h: Vec<(&str, &str)> = tp.iter().map(|v| ("traceparent", *v)).collect();
        let (status, _) = post(&env, "/generate", &h, GEN).await;
        assert_eq!(status, 200);
        let d = &env.cluster.decodes[0];
        assert_eq!(header(d, "traceparent").as_deref(), *engine_gets, "{tp:?}");
    }
    // A sampled caller is traced whatever the ratio; its spans, exported after the
    // others were finished, show that the exporter had nothing else to send.
    let sampled = format!("00-{TRACE}-{CALLER_SPAN}-01");
    post(&env, "/generate", &[("traceparent", &sampled)], GEN).await;
    col.wait_for(TRACE, "POST /generate").await;
    let all = col.spans.lock().unwrap().clone();
    let roots: Vec<&Got> = all.iter().filter(|s| s.name == "POST /generate").collect();
    assert_eq!(
        roots.len(),
        1,
        "only the sampled request was traced: {all:#?}"
    );
    assert!(all.iter().all(|s| s.trace_id == TRACE), "{all:#?}");
}

/// A malformed `traceparent` starts a new trace (ratio 1): never an error, and the engines
/// get the new trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_traceparent_starts_a_new_trace() {
    let (col, env) = traced_pair(|_| {}).await;
    for bad in [
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    ] {
        col.spans.lock().unwrap().clear();
        let (status, _) = post(&env, "/generate", &[("traceparent", bad)], GEN).await;
        assert_eq!(status, 200);
        let (trace, _) = engine_parent(&env.cluster.decodes[0]);
        assert_ne!(trace, "0".repeat(32));
        let spans = col.wait_for(&trace, "POST /generate").await;
        let root = one(&spans, "POST /generate");
        assert_eq!(root.parent, None, "a new trace has no parent: {root:?}");
    }
}

/// Spans still queued when the router shuts down are sent then (the export interval here
/// is far longer than the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_spans_are_flushed_at_shutdown() {
    let (col, env) = traced_pair(|c| {
        c.trace.export_interval_ms = 600_000;
    })
    .await;
    let tp = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let (status, _) = post(&env, "/generate", &[("traceparent", &tp)], GEN).await;
    assert_eq!(status, 200);
    // Let the request's last spans reach the queue (the body's end drops its record).
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The interval's first tick is one interval after start: nothing is sent before.
    assert!(col.trace(TRACE).is_empty(), "{:#?}", col.trace(TRACE));
    tokio::time::timeout(Duration::from_secs(10), env.router.shutdown())
        .await
        .expect("shutdown within 10 s");
    let spans = col.trace(TRACE);
    assert_eq!(spans.len(), 7, "{spans:#?}");
    let stats = env.router.traces.as_ref().unwrap().stats();
    assert_eq!(stats.exported.load(std::sync::atomic::Ordering::Relaxed), 7);
}

/// A collector that is down, or answers after seconds, costs requests nothing: every
/// request is answered at once, and the spans that cannot go are dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_or_slow_collector_never_holds_a_request() {
    let slow = Collector::start(Duration::from_secs(30)).await;
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    for endpoint in [slow.url.clone(), down] {
        let env = start(
            vec![EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            move |c| {
                traced(&endpoint)(c);
                c.trace.max_queue_spans = 8;
                c.trace.max_batch_spans = 4;
                c.trace.export_timeout_ms = 300;
            },
        )
        .await;
        env.wait_routable(1, 1).await;
        let started = tokio::time::Instant::now();
        for i in 0..20 {
            let body = common::gen_body(i % 2 == 0);
            let (status, answer) = post(&env, "/generate", &[], body).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        }
        // Generous: 20 requests to simulated engines take well under a second; a router
        // that waited for its collector would take 20 × 300 ms at least.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let stats = env.router.traces.as_ref().unwrap().stats();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while stats.dropped.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            assert!(tokio::time::Instant::now() < deadline, "no span dropped");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(stats.exported.load(std::sync::atomic::Ordering::Relaxed), 0);
        let text = pdgate::telemetry::render(&*env.router.pool);
        assert!(text.contains("pdgate_trace_spans_dropped_total{"), "{text}");
        // The shutdown's flush is bounded by the export timeout, not the collector.
        tokio::time::timeout(Duration::from_secs(5), env.router.shutdown())
            .await
            .expect("shutdown within 5 s");
    }
}

/// A stream moved off a decode that died mid-stream: the move's attempt hangs under the
/// request's span with `retry.reason = stream_move`, and its legs carry the same trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_move_is_an_attempt_span_under_the_request() {
    let col = Collector::start(Duration::ZERO).await;
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1), EngineConfig::decode(1)],
        traced(&col.url),
    )
    .await;
    env.wait_routable(1, 2).await;
    env.cluster.decodes[0].set_faults(Faults {
        decode_die_mid_stream_after: Some(2),
        ..Faults::default()
    });
    let body = r#"{"text":"hello","sampling_params":{"max_new_tokens":8},"stream":true}"#;
    let mut moved = None;
    for i in 0..4 {
        let id = format!("{:032x}", 0xabc0 + i);
        let tp = format!("00-{id}-{CALLER_SPAN}-01");
        let (status, answer) = post(&env, "/generate", &[("traceparent", &tp)], body).await;
        assert_eq!(status, 200);
        assert!(!String::from_utf8_lossy(&answer).contains("\"error\""));
        let spans = col.wait_for(&id, "POST /generate").await;
        if spans.iter().filter(|s| s.name == "attempt").count() == 2 {
            moved = Some(spans);
            break;
        }
    }
    let spans = moved.expect("a stream reached the dying decode and moved");
    let root = one(&spans, "POST /generate");
    assert_eq!(root.attr("pdgate.moves").as_deref(), Some("1"));
    let relay = one(&spans, "relay");
    within(relay, root);
    let moved: Vec<&Got> = spans
        .iter()
        .filter(|s| s.name == "attempt" && s.attr("retry.reason").as_deref() == Some("stream_move"))
        .collect();
    assert_eq!(moved.len(), 1, "{spans:#?}");
    within(moved[0], root);
    // The move's legs: a decode_first_byte under its attempt, whose id the new decode got.
    let first: Vec<&Got> = spans
        .iter()
        .filter(|s| s.name == "decode_first_byte" && s.parent.as_deref() == Some(&moved[0].span_id))
        .collect();
    assert_eq!(first.len(), 1, "{spans:#?}");
    let (trace, parent) = engine_parent(&env.cluster.decodes[1]);
    assert_eq!(
        (trace.as_str(), parent.as_str()),
        (root.trace_id.as_str(), first[0].span_id.as_str())
    );
}
