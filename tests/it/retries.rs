//! Retries: a request whose first attempt fails on one engine while another engine of that
//! pool is healthy is answered without an error. Each test also checks, from the rids the
//! engines saw (`pdg-<id>-<attempt><p|d>`), that a retry really happened: the failing engine
//! got the first attempt and the healthy one served the second.

use crate::support::common;

use std::time::Duration;

use common::{assert_retried, attempts_seen, expect_ok, start, with_faults, GEN, GEN_STREAM};
use pdgate::bootstrap::client::{self, Generation, RankRoute};
use pdgate::types::{Role, WorkerId};
use pdgate::upstream::{parse_base_url, Upstream};
use pdgate_sim::{EngineConfig, Faults};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_down_with_another_prefill_healthy_gives_no_errors() {
    let env = start(
        vec![EngineConfig::prefill(2), EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(4, 1).await;
    // Requests sent right after the kill race the detection: retries must cover them.
    // (Whether one is sent before the detection is up to that race, and a prefill that is
    // down sees nothing: so no retry is asserted here, only that no client sees an error.)
    env.cluster.prefills[0].set_down(true);
    expect_ok(&env, false, 10).await;
    expect_ok(&env, true, 10).await;
    let s = env.settled_stats().await;
    assert_eq!(s.contract_violations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_500_with_another_prefill_is_retried() {
    let bad = with_faults(
        EngineConfig::prefill(1),
        Faults {
            prefill_status: Some(500),
            ..Faults::default()
        },
    );
    // The default round robin sends one of the first two requests to the failing prefill.
    let env = start(
        vec![bad, EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    expect_ok(&env, false, 6).await;
    expect_ok(&env, true, 6).await;
    let s = env.settled_stats().await;
    assert_eq!(s.contract_violations, 0);
    let (bad, good) = (&env.cluster.prefills[0], &env.cluster.prefills[1]);
    assert_retried(bad, good, 'p');
    assert_eq!(bad.stats().ok, 0, "{:?}", bad.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_dies_mid_request_with_another_prefill_is_retried() {
    let p = with_faults(
        EngineConfig::prefill(1),
        Faults {
            prefill_die_mid_request: true,
            ..Faults::default()
        },
    );
    let env = start(
        vec![p, EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    expect_ok(&env, false, 4).await;
    expect_ok(&env, true, 4).await;
    // The first request it got took it down: once down it sees nothing more.
    let (dead, good) = (&env.cluster.prefills[0], &env.cluster.prefills[1]);
    assert_eq!(
        assert_retried(dead, good, 'p'),
        1,
        "{:?}",
        dead.recent_rids()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_500_with_another_decode_is_retried() {
    let d = with_faults(
        EngineConfig::decode(1),
        Faults {
            decode_status: Some(500),
            ..Faults::default()
        },
    );
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![d, EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    expect_ok(&env, false, 4).await;
    expect_ok(&env, true, 4).await;
    let (bad, good) = (&env.cluster.decodes[0], &env.cluster.decodes[1]);
    assert_retried(bad, good, 'd');
    assert_eq!(bad.stats().ok, 0, "{:?}", bad.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_hangs_with_another_prefill_is_retried() {
    let p = with_faults(
        EngineConfig::prefill(1),
        Faults {
            prefill_hang: true,
            ..Faults::default()
        },
    );
    let env = start(
        vec![p, EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.timeouts.prefill_secs = 1;
            c.breaker.open_ms = 60_000;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    // Requests that land on the hung prefill wait out its deadline, then go to the healthy
    // one; once its breaker opened, nothing more is sent to it.
    for stream in [false, true, false, true] {
        expect_ok(&env, stream, 1).await;
    }
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0);
    assert_eq!(s.contract_violations, 0);
    assert_retried(&env.cluster.prefills[0], &env.cluster.prefills[1], 'p');
}

/// The router's view was stale when it dispatched (the rank had just stopped being
/// registered), and the decode is an old engine that waits out its whole waiting timeout
/// when a rank lookup fails. The tracker's next look ends the in-flight requests on that
/// rank at once, and they are retried on the healthy prefill: every client gets its answer
/// (without this they would sit until the request timeout and get a 504).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_bootstrap_bug_with_a_stale_view_is_cut_short() {
    // The tracker looks every 2.5 s: the requests go out right after one look, so that
    // the view they meet is stale until the next. (At 1 s, a loaded machine sometimes took
    // longer than the window between the look and the requests: about 1 run in 8 saw no
    // stale view.)
    const LOOK_EVERY_MS: u64 = 2500;
    let mut legacy = EngineConfig::decode(1);
    legacy.legacy_bootstrap_bug = true;
    legacy.waiting_timeout = Duration::from_secs(300);
    let env = start(
        vec![EngineConfig::prefill(4), EngineConfig::prefill(4)],
        vec![legacy],
        |c| {
            c.timeouts.prefill_secs = 300;
            c.timeouts.request_secs = 20;
            c.bootstrap.refresh_interval_ms = LOOK_EVERY_MS;
            // The heartbeat's sentinel is a look too.
            c.bootstrap.heartbeat_interval_ms = LOOK_EVERY_MS;
            c.bootstrap.freshness_ms = 60_000;
        },
    )
    .await;
    env.wait_routable(8, 1).await;
    // Warm the decode's cache of prefill 0 by hand (its layout and rank 0's route), as
    // earlier traffic would have: later lookups of ranks 1-3 then go to the bootstrap server.
    let p = &env.cluster.prefills[0];
    let port = p.bootstrap_port().unwrap();
    let leg = |rid: &str| {
        format!(
            r#"{{"text":"w","sampling_params":{{"max_new_tokens":1}},"bootstrap_host":"127.0.0.1","bootstrap_port":{port},"bootstrap_room":4,"rid":"{rid}"}}"#
        )
    };
    let (pl, dl) = tokio::join!(
        env.client.request(
            http::Request::post(format!("{}/generate", p.url()))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(leg("warm-p"))))
                .unwrap()
        ),
        env.client.request(
            http::Request::post(format!("{}/generate", env.cluster.decodes[0].url()))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(leg("warm-d"))))
                .unwrap()
        ),
    );
    assert_eq!(pl.unwrap().status(), 200);
    assert_eq!(dl.unwrap().status(), 200);
    // Right after one of the tracker's looks at prefill 0...
    let checked = |s: &pdgate::pool::Snapshot| {
        s.worker(Role::Prefill, WorkerId(0))
            .unwrap()
            .per_rank
            .fresh
            .last_confirmed(0)
    };
    let last = checked(&env.router.pool.load());
    env.wait_pool("a look of the tracker", |s| checked(s) > last)
        .await;
    // ...its ranks stop being registered (the simulator's table follows at once)...
    env.cluster.prefills[0].set_faults(Faults {
        register_none: true,
        ..Faults::default()
    });
    let up = Upstream::new(&pdgate::router::upstream_settings(
        &pdgate::config::Config::default(),
    ));
    let base = parse_base_url(&p.bootstrap_url().unwrap()).unwrap();
    for r in 1..4 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while matches!(
            client::rank_route(&up, &base, Generation::V3, r, Duration::from_secs(2)).await,
            Ok(RankRoute::Ready { .. })
        ) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "rank {r} still registered"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // ...and the requests go out before its next look: some land on ranks 1-3.
    let futs = (0..12).map(|i| env.post("/generate", if i % 2 == 0 { GEN } else { GEN_STREAM }));
    for (st, _, bytes) in futures_util::future::join_all(futs).await {
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
        assert!(
            !bytes.windows(9).any(|w| w == b"\"error\":{"),
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    // (The warm-up ran on rank 0: only the router's requests count on ranks 1-3.)
    let stale: u64 = p.stats().requests_per_rank[1..].iter().sum();
    assert!(
        stale > 0,
        "no request met the stale view on ranks 1-3: {:?}",
        p.stats()
    );
    // Those were retried on the healthy prefill (one on rank 0 may have been served where
    // it was: the decode knew that rank's route).
    let retried = attempts_seen(&env.cluster.prefills[1], 'p', 1);
    assert!(
        attempts_seen(p, 'p', 0)
            .iter()
            .any(|id| retried.contains(id)),
        "no request was retried on the healthy prefill: {:?} / {:?}",
        p.recent_rids(),
        env.cluster.prefills[1].recent_rids()
    );
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0, "{s:?}");
}

/// A prompt longer than the model's context is the client's fault, however it is reported:
/// as the prefill's 400, or inside decode's stream (SGLang's in-stream validation error
/// `{"error": {"code": 400, ...}}`, which can arrive before the prefill's answer). Either
/// way the client gets a 4xx and the request is never retried nor held against a breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_too_long_prompt_is_a_4xx_and_never_retried() {
    let short = |e: EngineConfig| EngineConfig {
        context_length: 8,
        ..e
    };
    let env = start(
        vec![
            short(EngineConfig::prefill(1)),
            short(EngineConfig::prefill(1)),
        ],
        vec![
            short(EngineConfig::decode(1)),
            short(EngineConfig::decode(1)),
        ],
        |_| {},
    )
    .await;
    env.wait_routable(2, 2).await;
    let long = "a b c d e f g h i j k l m n o p";
    for stream in [false, true] {
        for route in ["/generate", "/v1/chat/completions"] {
            for _ in 0..6 {
                let body = if route == "/generate" {
                    serde_json::json!({"text": long, "sampling_params": {"max_new_tokens": 3}, "stream": stream})
                } else {
                    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": long}], "max_tokens": 3, "stream": stream})
                };
                let (status, _, bytes) = env.post(route, &body.to_string()).await;
                let text = String::from_utf8_lossy(&bytes);
                assert_eq!(status, 400, "{route} stream={stream}: {text}");
                let v: serde_json::Value = serde_json::from_slice(&bytes).expect("error JSON");
                let kind = v["error"]["type"].as_str().unwrap_or_default();
                assert!(
                    kind == "prefill_rejected" || kind == "decode_rejected",
                    "{route} stream={stream}: {text}"
                );
            }
        }
    }
    env.settled_stats().await;
    for e in env.cluster.engines() {
        for side in ['p', 'd'] {
            assert!(
                attempts_seen(e, side, 1).is_empty(),
                "a rejected request was retried: {:?}",
                e.recent_rids()
            );
        }
    }
    let snap = env.router.pool.load();
    for w in snap.prefills.iter().chain(snap.decodes.iter()) {
        assert_eq!(w.shared.breaker.state(), pdgate::pool::BreakerState::Closed);
    }
}
