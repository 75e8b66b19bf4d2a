//! Self-healing pools under bounded load: workers and DP ranks that die are taken out with
//! no client errors while capacity remains, and are used again after they recover; passive
//! circuit breaking blames the right leg; admission sheds load with 429/503 + Retry-After.

use crate::support::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{start, Env};
use pdgate::pool::BreakerState;
use pdgate::types::{Role, WorkerId};
use pdgate_sim::{EngineConfig, Faults};

const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;
const GEN_STREAM: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3},"stream":true}"#;

/// Errors seen by the clients of [`load`].
#[derive(Debug, Default)]
struct Errors {
    /// Requests answered with an error before any byte (non-200).
    before_first_byte: usize,
    /// Streams that began and then ended with an error event, by error type.
    mid_stream: Vec<String>,
}

/// `clients` closed-loop clients send `per_client` requests each (alternating streaming and
/// not) and collect every error.
async fn load(env: &Arc<Env>, clients: usize, per_client: usize) -> Errors {
    let errors = Arc::new(std::sync::Mutex::new(Errors::default()));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let env = env.clone();
        let errors = errors.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..per_client {
                let stream = (c + i) % 2 == 1;
                let (st, _, bytes) = env
                    .post("/generate", if stream { GEN_STREAM } else { GEN })
                    .await;
                let mut e = errors.lock().unwrap();
                if st != 200 {
                    eprintln!("error: {st} {}", String::from_utf8_lossy(&bytes));
                    e.before_first_byte += 1;
                } else if stream {
                    let (events, _) = common::sse_events(&bytes);
                    if let Some(kind) = events.iter().find_map(|ev| ev["error"]["type"].as_str()) {
                        eprintln!("mid-stream error: {}", String::from_utf8_lossy(&bytes));
                        e.mid_stream.push(kind.to_string());
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let e = std::mem::take(&mut *errors.lock().unwrap());
    e
}

fn clean(e: &Errors) -> bool {
    e.before_first_byte == 0 && e.mid_stream.is_empty()
}

/// Runs load while `during` happens; returns what the clients saw. `during` starts once the
/// load flows (the engines saw a few of its requests) and while it still runs, so that what
/// it breaks is broken under load.
async fn load_while(env: &Arc<Env>, during: impl std::future::Future<Output = ()>) -> Errors {
    let done = AtomicBool::new(false);
    let before = env.stats().requests_total;
    let l = async {
        let errors = load(env, 4, 40).await;
        done.store(true, Ordering::SeqCst);
        errors
    };
    let d = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while env.stats().requests_total < before + 8 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the load never reached the engines"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(
            !done.load(Ordering::SeqCst),
            "the load ended before the fault: nothing was tested under load"
        );
        during.await
    };
    let (errors, ()) = tokio::join!(l, d);
    errors
}

fn used_since(env: &Env, role: Role, i: usize, before: u64) -> bool {
    let e = match role {
        Role::Prefill => &env.cluster.prefills[i],
        Role::Decode | Role::Regular => &env.cluster.decodes[i],
    };
    e.stats().requests_total > before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_killed_and_restarted_under_load() {
    let env = Arc::new(
        start(
            vec![EngineConfig::prefill(2), EngineConfig::prefill(2)],
            vec![EngineConfig::decode(1)],
            |_| {},
        )
        .await,
    );
    env.wait_routable(4, 1).await;
    let e = env.clone();
    let errors = load_while(&env, async move {
        e.cluster.prefills[0].set_down(true);
        e.wait_pool("prefill 0 out", |s| {
            s.prefill_routable.iter().all(|r| r.worker != WorkerId(0))
        })
        .await;
    })
    .await;
    assert!(
        clean(&errors),
        "client errors while another prefill was healthy: {errors:?}"
    );
    // Restarted: back in rotation and used again.
    env.cluster.prefills[0].set_down(false);
    env.wait_routable(4, 1).await;
    let before = env.cluster.prefills[0].stats().requests_total;
    assert!(clean(&load(&env, 2, 10).await));
    assert!(
        used_since(&env, Role::Prefill, 0, before),
        "restarted prefill not used again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_rank_unregistered_and_back_under_load() {
    let env = Arc::new(
        start(
            vec![EngineConfig::prefill(2), EngineConfig::prefill(2)],
            vec![EngineConfig::decode(1)],
            |_| {},
        )
        .await,
    );
    env.wait_routable(4, 1).await;
    let e = env.clone();
    let errors = load_while(&env, async move {
        e.cluster.prefills[0].set_faults(Faults {
            unregistered_ranks: vec![1],
            ..Faults::default()
        });
        e.wait_pool("prefill 0 rank 1 out", |s| {
            !s.prefill_routable
                .iter()
                .any(|r| r.worker == WorkerId(0) && r.ranks.contains(&1))
        })
        .await;
    })
    .await;
    assert!(
        clean(&errors),
        "client errors while capacity remained: {errors:?}"
    );
    env.cluster.prefills[0].set_faults(Faults::default());
    env.wait_routable(4, 1).await;
    let before = env.cluster.prefills[0]
        .stats()
        .requests_per_rank
        .get(1)
        .copied()
        .unwrap_or(0);
    assert!(clean(&load(&env, 2, 10).await));
    let after = env.cluster.prefills[0]
        .stats()
        .requests_per_rank
        .get(1)
        .copied()
        .unwrap_or(0);
    assert!(after > before, "re-registered rank not used again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_killed_and_restarted_under_load() {
    let env = Arc::new(
        start(
            vec![EngineConfig::prefill(2)],
            vec![EngineConfig::decode(2), EngineConfig::decode(2)],
            |_| {},
        )
        .await,
    );
    env.wait_routable(2, 4).await;
    let e = env.clone();
    let errors = load_while(&env, async move {
        e.cluster.decodes[0].set_down(true);
        e.wait_pool("decode 0 out", |s| {
            s.decode_routable.iter().all(|r| r.worker != WorkerId(0))
        })
        .await;
    })
    .await;
    // Nothing fails before its first byte (those are retried on the other decode). A stream
    // that was already flowing from the killed decode cannot move (its KV died with it):
    // it ends with one decode_broken error event, and only those streams do.
    assert_eq!(errors.before_first_byte, 0, "{errors:?}");
    assert!(
        errors.mid_stream.iter().all(|k| k == "decode_broken"),
        "{errors:?}"
    );
    assert!(
        errors.mid_stream.len() <= 4,
        "more broken streams than clients: {errors:?}"
    );
    env.cluster.decodes[0].set_down(false);
    env.wait_routable(2, 4).await;
    let before = env.cluster.decodes[0].stats().requests_total;
    assert!(clean(&load(&env, 2, 10).await));
    assert!(
        used_since(&env, Role::Decode, 0, before),
        "restarted decode not used again"
    );
}

fn breaker(env: &Env, role: Role, i: u32) -> BreakerState {
    env.router
        .pool
        .load()
        .worker(role, WorkerId(i))
        .unwrap()
        .shared
        .breaker
        .state()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breakers_blame_the_failing_leg_only() {
    let bad = EngineConfig {
        faults: Faults {
            prefill_status: Some(500),
            ..Faults::default()
        },
        ..EngineConfig::prefill(1)
    };
    // Health checks would not notice (the engine's /health is fine): only passive signals.
    let env = Arc::new(
        start(
            vec![bad, EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            |c| c.breaker.open_ms = 60_000,
        )
        .await,
    );
    env.wait_routable(2, 1).await;
    assert!(
        clean(&load(&env, 2, 10).await),
        "retries cover the failing prefill"
    );
    assert_eq!(breaker(&env, Role::Prefill, 0), BreakerState::Open);
    assert_eq!(breaker(&env, Role::Prefill, 1), BreakerState::Closed);
    assert_eq!(
        breaker(&env, Role::Decode, 0),
        BreakerState::Closed,
        "prefill errors never trip a decode breaker"
    );
    // Once open, the failing prefill gets nothing more.
    let before = env.cluster.prefills[0].stats().requests_total;
    assert!(clean(&load(&env, 2, 10).await));
    assert_eq!(env.cluster.prefills[0].stats().requests_total, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_half_open_trial_readmits_a_recovered_worker() {
    let bad = EngineConfig {
        faults: Faults {
            decode_status: Some(500),
            ..Faults::default()
        },
        ..EngineConfig::decode(1)
    };
    let env = Arc::new(
        start(
            vec![EngineConfig::prefill(1)],
            vec![bad, EngineConfig::decode(1)],
            |c| {
                c.breaker.open_ms = 200;
                // However often failed trials re-open it, the wait for half-open below
                // stays short.
                c.breaker.max_open_ms = 400;
            },
        )
        .await,
    );
    env.wait_routable(1, 2).await;
    assert!(clean(&load(&env, 2, 10).await));
    // It opened: by now its timer may have made it half-open (and a failed trial may have
    // re-opened it), but only a success can close it again, which the failing decode never
    // gives.
    let opened = breaker(&env, Role::Decode, 0);
    assert!(
        matches!(opened, BreakerState::Open | BreakerState::HalfOpen),
        "the failing decode's breaker never opened: {opened:?}"
    );
    assert_eq!(
        breaker(&env, Role::Prefill, 0),
        BreakerState::Closed,
        "decode errors never trip a prefill breaker"
    );
    env.cluster.decodes[0].set_faults(Faults::default());
    env.wait_pool("half-open", |s| {
        s.worker(Role::Decode, WorkerId(0))
            .unwrap()
            .shared
            .breaker
            .state()
            == BreakerState::HalfOpen
    })
    .await;
    let before = env.cluster.decodes[0].stats().requests_total;
    assert!(clean(&load(&env, 2, 10).await));
    assert_eq!(
        breaker(&env, Role::Decode, 0),
        BreakerState::Closed,
        "a good trial closes the circuit"
    );
    assert!(used_since(&env, Role::Decode, 0, before));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_never_count() {
    let rejecting = EngineConfig {
        faults: Faults {
            prefill_status: Some(400),
            ..Faults::default()
        },
        ..EngineConfig::prefill(1)
    };
    let env = Arc::new(start(vec![rejecting], vec![EngineConfig::decode(1)], |_| {}).await);
    env.wait_routable(1, 1).await;
    for _ in 0..10 {
        let (st, _, _) = env.post("/generate", GEN).await;
        assert_eq!(st, 400);
    }
    assert_eq!(breaker(&env, Role::Prefill, 0), BreakerState::Closed);
    assert_eq!(breaker(&env, Role::Decode, 0), BreakerState::Closed);
}

/// Waits (bounded: 10 s) until the decode engines hold `n` requests between them.
async fn wait_decode_holds(env: &Env, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let held: u64 = env.cluster.decodes.iter().map(|d| d.stats().held_now).sum();
        if held == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the decodes hold {held} requests, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn set_hold(env: &Env, hold: bool) {
    for d in &env.cluster.decodes {
        d.set_faults(Faults {
            decode_hold: hold,
            ..Faults::default()
        });
    }
}

fn assert_shed(st: http::StatusCode, headers: &http::HeaderMap, bytes: &[u8], kind: &str) {
    assert_eq!(
        (
            st.as_u16(),
            headers.get("retry-after").and_then(|v| v.to_str().ok())
        ),
        (if kind == "overloaded" { 429 } else { 503 }, Some("1")),
        "{}",
        String::from_utf8_lossy(bytes)
    );
    let v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
    assert_eq!(v["error"]["type"], kind);
}

/// The admitted requests are held by the decode (`decode_hold`) until the test lets them
/// go, so which requests are in flight, queued or shed never depends on timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_shed_with_retry_after() {
    let held = EngineConfig {
        faults: Faults {
            decode_hold: true,
            ..Faults::default()
        },
        ..EngineConfig::decode(1)
    };
    let post = |env: &Arc<Env>| {
        let env = env.clone();
        tokio::spawn(async move { env.post("/generate", GEN).await })
    };
    // Queue full → 429.
    let env = Arc::new(
        start(vec![EngineConfig::prefill(1)], vec![held.clone()], |c| {
            c.admission.max_in_flight = 2;
            c.admission.max_queue = 1;
            c.admission.queue_timeout_ms = 30_000;
        })
        .await,
    );
    env.wait_routable(1, 1).await;
    let served: Vec<_> = (0..2).map(|_| post(&env)).collect();
    wait_decode_holds(&env, 2).await;
    // Both slots are taken until the hold is lifted: of four more, one waits in the queue
    // and three are shed at once.
    let mut more = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let env = env.clone();
        more.spawn(async move { env.post("/generate", GEN).await });
    }
    for _ in 0..3 {
        let shed = tokio::time::timeout(Duration::from_secs(10), more.join_next())
            .await
            .expect("three requests shed in time")
            .expect("a task")
            .unwrap();
        assert_shed(shed.0, &shed.1, &shed.2, "overloaded");
    }
    assert!(
        more.try_join_next().is_none(),
        "the queued request must still wait for a slot"
    );
    set_hold(&env, false);
    let queued = more.join_next().await.expect("a task").unwrap();
    assert_eq!(queued.0, 200, "{}", String::from_utf8_lossy(&queued.2));
    for t in served {
        assert_eq!(t.await.unwrap().0, 200);
    }

    // Queue wait too long → 503.
    let env = Arc::new(
        start(vec![EngineConfig::prefill(1)], vec![held], |c| {
            c.admission.max_in_flight = 1;
            c.admission.max_queue = 10;
            c.admission.queue_timeout_ms = 50;
        })
        .await,
    );
    env.wait_routable(1, 1).await;
    let first = post(&env);
    // The only slot is held until the hold is lifted.
    wait_decode_holds(&env, 1).await;
    let (st, headers, bytes) = env.post("/generate", GEN).await;
    assert_shed(st, &headers, &bytes, "queue_timeout");
    set_hold(&env, false);
    assert_eq!(first.await.unwrap().0, 200);
}
