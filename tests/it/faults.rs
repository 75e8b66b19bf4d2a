//! Fail fast: every fault mode the simulator injects, streaming and not. For each: what the
//! client gets (status and an OpenAI-style error naming the reason, or an SSE error event
//! then `[DONE]` once streaming began), that the other leg was cancelled (simulator
//! counters), and that no engine is left holding a request. (With a healthy engine to
//! retry on, see `tests/retries.rs`.)

use crate::support::common;

use std::time::Duration;

use common::{
    attempts_seen, expect_ok, fast_engine, gen_body as body, sse_events, start, start_as_is,
    with_faults, Env, GEN, GEN_STREAM,
};
use http_body_util::BodyExt;
use pdgate_sim::{EngineConfig, Faults, StatsSnapshot};

/// The error of a failed answer: from the JSON body before headers, or the stream's last
/// event after streaming began. Returns (status, error type).
fn error_of(status: u16, bytes: &[u8]) -> (u16, String) {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
        if let Some(t) = v["error"]["type"].as_str() {
            return (status, t.to_string());
        }
    }
    let (events, done) = sse_events(bytes);
    let last = events.last().cloned().unwrap_or_default();
    assert!(
        done,
        "a failed stream must end with [DONE]: {}",
        String::from_utf8_lossy(bytes)
    );
    (
        status,
        last["error"]["type"].as_str().unwrap_or("none").to_string(),
    )
}

fn cancelled(s: &StatsSnapshot) -> u64 {
    s.aborted + s.client_disconnects
}

/// The other leg of a failed request: either it never left the router (the failing leg
/// answered first), or it arrived and was cancelled; it never completed and is not held.
fn assert_leg_cancelled(s: &StatsSnapshot, what: &str) {
    assert_eq!(
        s.ok, 0,
        "{what} leg completed although the request failed: {s:?}"
    );
    assert_eq!(s.held_now, 0, "{what} leg still held: {s:?}");
    assert_eq!(
        cancelled(s),
        s.requests_total,
        "{what} leg arrived but was not cancelled: {s:?}"
    );
}

/// A decode whose own heartbeat would take 10 s to notice a lost prefill, so that in a test
/// only the router ends its wait (`fast_engine`'s 200 ms races the router's detection).
fn patient_decode() -> EngineConfig {
    let mut d = fast_engine(EngineConfig::decode(1));
    d.heartbeat_interval = Duration::from_secs(10);
    d
}

/// The counters of what happened between `before` and `now` (per-rank counts and gauges
/// are taken from `now`).
fn since(now: &StatsSnapshot, before: &StatsSnapshot) -> StatsSnapshot {
    StatsSnapshot {
        requests_total: now.requests_total - before.requests_total,
        ok: now.ok - before.ok,
        failed: now.failed - before.failed,
        aborted: now.aborted - before.aborted,
        client_disconnects: now.client_disconnects - before.client_disconnects,
        abort_requests_received: now.abort_requests_received - before.abort_requests_received,
        ..now.clone()
    }
}

async fn expect_error(env: &Env, stream: bool, status: u16, kinds: &[&str]) {
    let (st, _, bytes) = env.post("/generate", body(stream)).await;
    let (got_status, kind) = error_of(st.as_u16(), &bytes);
    assert_eq!(
        got_status,
        status,
        "stream={stream}: {}",
        String::from_utf8_lossy(&bytes)
    );
    assert!(
        kinds.contains(&kind.as_str()),
        "stream={stream}: got {kind}, want one of {kinds:?}: {}",
        String::from_utf8_lossy(&bytes)
    );
    // The engines' URLs and messages go to the log, not to the client.
    let text = String::from_utf8_lossy(&bytes);
    assert!(!text.contains("127.0.0.1"), "stream={stream}: {text}");
}

// ---- faults visible before dispatch: never dispatched, 503 at once or another prefill ----

/// A wait no fail-fast answer may take: a retry's wait for a recovering alternative
/// (`retry.move_wait_ms`) set this long shows whether the answer waited for it.
const LONG_MOVE_WAIT_MS: u64 = 120_000;

/// [`expect_error`] of a fault the router saw before dispatch: answered at once, not after
/// a wait for an alternative (the only worker of a role is seen unroutable: nothing was
/// sent, nobody is blamed, and there is nothing to retry on).
async fn expect_error_at_once(env: &Env, stream: bool, status: u16, kinds: &[&str]) {
    let bound = Duration::from_secs(20);
    if tokio::time::timeout(bound, expect_error(env, stream, status, kinds))
        .await
        .is_err()
    {
        panic!("stream={stream}: no answer within {bound:?}: it waited for retry.move_wait_ms");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_down() {
    for stream in [false, true] {
        let env = start(
            vec![EngineConfig::prefill(2)],
            vec![EngineConfig::decode(1)],
            |c| c.retry.move_wait_ms = LONG_MOVE_WAIT_MS,
        )
        .await;
        env.wait_routable(2, 1).await;
        env.cluster.prefills[0].set_down(true);
        env.wait_pool("prefill out", |s| s.prefill_routable.is_empty())
            .await;
        expect_error_at_once(
            &env,
            stream,
            503,
            &["no_prefill_available", "bootstrap_unreachable"],
        )
        .await;
        assert_eq!(
            env.cluster.decodes[0].stats().requests_total,
            0,
            "decode must never receive the request"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_down() {
    for stream in [false, true] {
        let env = start(
            vec![EngineConfig::prefill(2)],
            vec![EngineConfig::decode(1)],
            |c| c.retry.move_wait_ms = LONG_MOVE_WAIT_MS,
        )
        .await;
        env.wait_routable(2, 1).await;
        env.cluster.prefills[0].set_faults(Faults {
            bootstrap_down: true,
            ..Faults::default()
        });
        env.wait_pool("bootstrap out", |s| s.prefill_routable.is_empty())
            .await;
        expect_error_at_once(&env, stream, 503, &["bootstrap_unreachable"]).await;
        assert_eq!(env.cluster.decodes[0].stats().requests_total, 0);
        // Back when the bootstrap server answers again.
        env.cluster.prefills[0].set_faults(Faults::default());
        env.wait_routable(2, 1).await;
        expect_ok(&env, stream, 2).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_never_registered() {
    let cases = [
        Faults {
            register_none: true,
            ..Faults::default()
        },
        Faults {
            unregistered_ranks: vec![1],
            ..Faults::default()
        },
    ];
    for f in cases {
        for stream in [false, true] {
            let env = start(
                vec![with_faults(EngineConfig::prefill(2), f.clone())],
                vec![EngineConfig::decode(1)],
                |c| c.retry.move_wait_ms = LONG_MOVE_WAIT_MS,
            )
            .await;
            env.wait_pool("prefill healthy", |s| s.prefills[0].facts.healthy)
                .await;
            expect_error_at_once(&env, stream, 503, &["bootstrap_not_ready"]).await;
            assert_eq!(env.stats().requests_total, 0, "no leg may be sent");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_missing_with_another_prefill_are_avoided() {
    let env = start(
        vec![
            with_faults(
                EngineConfig::prefill(2),
                Faults {
                    register_none: true,
                    ..Faults::default()
                },
            ),
            EngineConfig::prefill(2),
        ],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    expect_ok(&env, false, 6).await;
    expect_ok(&env, true, 6).await;
    assert_eq!(env.cluster.prefills[0].stats().requests_total, 0);
}

// ---- failures in flight: answered at once, the other leg cancelled ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_500() {
    for stream in [false, true] {
        let p = with_faults(
            EngineConfig::prefill(1),
            Faults {
                prefill_status: Some(500),
                ..Faults::default()
            },
        );
        let env = start(vec![p], vec![EngineConfig::decode(1)], |_| {}).await;
        env.wait_routable(1, 1).await;
        expect_error(&env, stream, 502, &["prefill_status"]).await;
        let s = env.settled_stats().await;
        let d = env.cluster.decodes[0].stats();
        assert_leg_cancelled(&d, "decode");
        assert_eq!(s.held_now, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_400_passes_through_and_is_not_retried() {
    for stream in [false, true] {
        let p = with_faults(
            EngineConfig::prefill(1),
            Faults {
                prefill_status: Some(400),
                ..Faults::default()
            },
        );
        let env = start(
            vec![p, EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            |c| {
                c.policy.prefill = pdgate::config::PolicyKind::RoundRobin;
            },
        )
        .await;
        env.wait_routable(2, 1).await;
        // Round robin: one of two consecutive requests lands on the rejecting prefill.
        let mut rejected = 0;
        for _ in 0..2 {
            let (st, _, bytes) = env.post("/generate", body(stream)).await;
            if st != 200 {
                let (status, kind) = error_of(st.as_u16(), &bytes);
                assert_eq!(
                    (status, kind.as_str()),
                    (400, "prefill_rejected"),
                    "{}",
                    String::from_utf8_lossy(&bytes)
                );
                rejected += 1;
            }
        }
        assert_eq!(rejected, 1);
        let s = env.settled_stats().await;
        assert_eq!(
            env.cluster.prefills[1].stats().requests_total,
            1,
            "a 4xx is not retried elsewhere"
        );
        let d = env.cluster.decodes[0].stats();
        assert_eq!(d.ok, 1, "{d:?}");
        assert_eq!(
            d.ok + cancelled(&d),
            d.requests_total,
            "the rejected request's decode leg is cancelled: {d:?}"
        );
        assert_eq!(s.held_now, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_hangs() {
    for stream in [false, true] {
        let p = with_faults(
            EngineConfig::prefill(1),
            Faults {
                prefill_hang: true,
                ..Faults::default()
            },
        );
        let env = start(vec![p], vec![EngineConfig::decode(1)], |c| {
            c.timeouts.prefill_secs = 1
        })
        .await;
        env.wait_routable(1, 1).await;
        expect_error(&env, stream, 504, &["prefill_timeout"]).await;
        let s = env.settled_stats().await;
        assert_eq!(cancelled(&env.cluster.decodes[0].stats()), 1);
        assert!(
            cancelled(&env.cluster.prefills[0].stats()) >= 1,
            "the hung prefill's connection is closed"
        );
        assert_eq!(s.held_now, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_dies_mid_request() {
    for stream in [false, true] {
        let env = start_as_is(
            vec![fast_engine(EngineConfig::prefill(1))],
            vec![patient_decode()],
            |_| {},
        )
        .await;
        env.wait_routable(1, 1).await;
        // One request first, so that the decode knows the prefill's layout and route: the
        // next one goes straight to the KV wait, and cannot fail on a bootstrap lookup of a
        // dead prefill before the router cancels it.
        expect_ok(&env, stream, 1).await;
        let before = env.settled_stats().await;
        let d_before = env.cluster.decodes[0].stats();
        env.cluster.prefills[0].set_faults(Faults {
            prefill_die_mid_request: true,
            ..Faults::default()
        });
        expect_error(
            &env,
            stream,
            502,
            &["prefill_connect", "prefill_aborted", "prefill_lost"],
        )
        .await;
        let s = env.settled_stats().await;
        let d = since(&env.cluster.decodes[0].stats(), &d_before);
        assert_leg_cancelled(&d, "decode");
        assert_eq!(s.held_now, 0);
        assert_eq!(s.ok, before.ok, "{s:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_500() {
    for stream in [false, true] {
        let d = with_faults(
            EngineConfig::decode(1),
            Faults {
                decode_status: Some(500),
                ..Faults::default()
            },
        );
        let env = start(vec![EngineConfig::prefill(1)], vec![d], |_| {}).await;
        env.wait_routable(1, 1).await;
        expect_error(&env, stream, 502, &["decode_status", "decode_aborted"]).await;
        let s = env.settled_stats().await;
        assert_leg_cancelled(&env.cluster.prefills[0].stats(), "prefill");
        assert_eq!(s.held_now, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_dies_mid_stream() {
    let d = with_faults(
        EngineConfig::decode(1),
        Faults {
            decode_die_mid_stream_after: Some(2),
            ..Faults::default()
        },
    );
    let env = start(vec![EngineConfig::prefill(1)], vec![d], |_| {}).await;
    env.wait_routable(1, 1).await;
    // Streaming: the client saw tokens, so the stream ends with an error event.
    let (st, _, bytes) = env.post("/generate", GEN_STREAM).await;
    assert_eq!(st, 200);
    let (events, done) = sse_events(&bytes);
    assert!(done);
    assert!(events.len() >= 2, "{}", String::from_utf8_lossy(&bytes));
    assert!(events[0].get("text").is_some());
    assert_eq!(events.last().unwrap()["error"]["type"], "decode_broken");
    // Not streaming: cut before answering, nothing reached the client: an error status.
    expect_error(&env, false, 502, &["decode_broken", "decode_connect"]).await;
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_decode_lives_while_tokens_flow_and_stalls_time_out() {
    let d = with_faults(
        EngineConfig::decode(1),
        Faults {
            decode_extra_itl_ms: 300,
            ..Faults::default()
        },
    );
    let env = start(vec![EngineConfig::prefill(1)], vec![d], |c| {
        c.timeouts.stream_idle_secs = 1
    })
    .await;
    env.wait_routable(1, 1).await;
    // 4 tokens × 300 ms: longer than... nothing; each gap is below the 1 s idle bound.
    expect_ok(&env, true, 1).await;
    expect_ok(&env, false, 1).await;
    // A stall longer than the idle bound ends the stream with an error event.
    env.cluster.decodes[0].set_faults(Faults {
        decode_extra_itl_ms: 2500,
        ..Faults::default()
    });
    let (st, _, bytes) = env.post("/generate", GEN_STREAM).await;
    assert_eq!(st, 200);
    let (events, done) = sse_events(&bytes);
    assert!(done);
    assert_eq!(
        events.last().unwrap()["error"]["type"],
        "decode_idle_timeout",
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0);
    assert!(cancelled(&env.cluster.decodes[0].stats()) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_never_starts_hits_the_first_byte_deadline() {
    let d = with_faults(
        EngineConfig::decode(1),
        Faults {
            decode_extra_ttft_ms: 5000,
            ..Faults::default()
        },
    );
    let env = start(vec![EngineConfig::prefill(1)], vec![d], |c| {
        c.timeouts.decode_first_byte_secs = 1
    })
    .await;
    env.wait_routable(1, 1).await;
    expect_error(&env, true, 504, &["decode_first_byte_timeout"]).await;
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0);
    assert_eq!(cancelled(&env.cluster.decodes[0].stats()), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_bounds_a_request_whose_legs_have_their_own_longer_deadlines() {
    // The prefill hangs within its own deadline (10 s): only the request timeout (2 s)
    // ends it, with a 504 before any byte, and both legs released. (A decode first-byte
    // deadline at or above the request timeout could never fire and is refused by the
    // config, so the request timeout is met here through a long prefill.)
    let p = with_faults(
        EngineConfig::prefill(1),
        Faults {
            prefill_hang: true,
            ..Faults::default()
        },
    );
    let env = start(vec![p], vec![EngineConfig::decode(1)], |c| {
        c.timeouts.prefill_secs = 10;
        c.timeouts.decode_first_byte_secs = 1;
        c.timeouts.request_secs = 2;
    })
    .await;
    env.wait_routable(1, 1).await;
    // (Had the timeout not fired, the prefill would have held the request for 10 s.)
    for stream in [false, true] {
        expect_error(&env, stream, 504, &["request_timeout"]).await;
    }
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0);
    assert_eq!(cancelled(&env.cluster.prefills[0].stats()), 2);
    assert_eq!(cancelled(&env.cluster.decodes[0].stats()), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_bootstrap_bug_is_never_dispatched_into() {
    let mut legacy = EngineConfig::decode(1);
    legacy.legacy_bootstrap_bug = true;
    for stream in [false, true] {
        let env = start(vec![EngineConfig::prefill(2)], vec![legacy.clone()], |_| {}).await;
        env.wait_routable(2, 1).await;
        // The bootstrap fails; the tracker sees it, so nothing is sent to the legacy decode
        // (which would wait out its whole waiting timeout).
        env.cluster.prefills[0].set_faults(Faults {
            bootstrap_down: true,
            ..Faults::default()
        });
        env.wait_pool("bootstrap out", |s| s.prefill_routable.is_empty())
            .await;
        expect_error(&env, stream, 503, &["bootstrap_unreachable"]).await;
        assert_eq!(env.cluster.decodes[0].stats().requests_total, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_bootstrap_bug_raced_is_answered_within_heartbeat_detection() {
    let mut legacy = fast_engine(EngineConfig::decode(1));
    legacy.legacy_bootstrap_bug = true;
    // Its bootstrap lookups keep failing for longer than the test runs, as an old engine
    // would wait: only the router can end the request.
    legacy.sentinel_attempts = 1000;
    // Only the heartbeat watches the bootstrap server (no refresh, no preflight), and it
    // needs two misses a second apart: the request goes out long before the router knows.
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(2))],
        vec![legacy],
        |c| {
            c.bootstrap.refresh_interval_ms = 600_000;
            c.bootstrap.freshness_ms = 600_000;
            c.bootstrap.heartbeat_interval_ms = 1000;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    // The bootstrap server dies right as the request goes out: the router's view is still
    // Ready, the decode cannot bootstrap; the heartbeat loss ends the request.
    env.cluster.prefills[0].set_faults(Faults {
        bootstrap_down: true,
        ..Faults::default()
    });
    let (st, _, bytes) = env.post("/generate", GEN).await;
    let (status, kind) = error_of(st.as_u16(), &bytes);
    assert_eq!(
        (status, kind.as_str()),
        (502, "prefill_lost"),
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    // That very request met the stale view: both of its legs reached the engines.
    let (p, d) = (&env.cluster.prefills[0], &env.cluster.decodes[0]);
    let sent = attempts_seen(p, 'p', 0);
    assert_eq!(sent.len(), 1, "{:?}", p.recent_rids());
    assert_eq!(attempts_seen(d, 'd', 0), sent, "{:?}", d.recent_rids());
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0, "{s:?}");
    assert_leg_cancelled(&d.stats(), "decode");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_both_legs() {
    // Streaming: the client reads one chunk and goes away.
    let d = with_faults(
        EngineConfig::decode(1),
        Faults {
            decode_extra_itl_ms: 200,
            ..Faults::default()
        },
    );
    let env = start(vec![EngineConfig::prefill(1)], vec![d], |_| {}).await;
    env.wait_routable(1, 1).await;
    let resp = env
        .send(
            "POST",
            "/generate",
            &[("content-type", "application/json")],
            r#"{"text":"a","sampling_params":{"max_new_tokens":50},"stream":true}"#,
        )
        .await;
    let mut b = resp.into_body();
    let _ = tokio::time::timeout(Duration::from_secs(10), b.frame())
        .await
        .unwrap();
    drop(b);
    let s = env.settled_stats().await;
    assert_eq!(cancelled(&env.cluster.decodes[0].stats()), 1, "{s:?}");

    // Not streaming, while the prefill still works: both legs are cancelled.
    let p = with_faults(
        EngineConfig::prefill(1),
        Faults {
            prefill_hang: true,
            ..Faults::default()
        },
    );
    let env = start(vec![p], vec![EngineConfig::decode(1)], |_| {}).await;
    env.wait_routable(1, 1).await;
    let url = env.url("/generate");
    let client = env.client.clone();
    let task = tokio::spawn(async move {
        let req = http::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                GEN.as_bytes(),
            )))
            .unwrap();
        client.request(req).await
    });
    // Wait until both engines hold the request, then drop the client.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.stats().held_now < 2 {
        assert!(tokio::time::Instant::now() < deadline, "legs never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    task.abort();
    let s = env.settled_stats().await;
    assert!(cancelled(&env.cluster.prefills[0].stats()) >= 1, "{s:?}");
    assert!(cancelled(&env.cluster.decodes[0].stats()) >= 1, "{s:?}");
}

/// Heartbeat loss fails the requests in flight on that prefill at once (here the prefill
/// hangs, so nothing else would end them before the prefill deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_loss_fails_in_flight_requests() {
    for stream in [false, true] {
        let p = with_faults(
            EngineConfig::prefill(1),
            Faults {
                prefill_hang: true,
                ..Faults::default()
            },
        );
        let env = std::sync::Arc::new(
            start_as_is(vec![fast_engine(p)], vec![patient_decode()], |c| {
                c.timeouts.prefill_secs = 300
            })
            .await,
        );
        env.wait_routable(1, 1).await;
        let e = env.clone();
        let req = tokio::spawn(async move { e.post("/generate", body(stream)).await });
        // Both legs arrived and the decode is done with the bootstrap server (it waits for
        // the KV at the prefill's rank endpoint): only the heartbeat loss can end it now.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while env.cluster.prefills[0].stats().held_now < 1
            || env.cluster.prefills[0].stats().kv_waiting_decodes < 1
        {
            assert!(tokio::time::Instant::now() < deadline, "legs never arrived");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        env.cluster.prefills[0].set_faults(Faults {
            prefill_hang: true,
            bootstrap_down: true,
            ..Faults::default()
        });
        let (st, _, bytes) = req.await.unwrap();
        let (status, kind) = error_of(st.as_u16(), &bytes);
        assert_eq!(
            (status, kind.as_str()),
            (502, "prefill_lost"),
            "{}",
            String::from_utf8_lossy(&bytes)
        );
        let s = env.settled_stats().await;
        assert_eq!(s.held_now, 0, "{s:?}");
        assert_leg_cancelled(&env.cluster.decodes[0].stats(), "decode");
    }
}
