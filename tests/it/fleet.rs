//! Workers joining and leaving a running router (`pdgate::fleet`): the lifecycle the admin
//! API, Kubernetes discovery and config reload are built on.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use pdgate::fleet::{FleetError, Removed, WorkerSpec};
use pdgate::pool::{PodRef, WorkerSource};
use pdgate::types::Role;
use pdgate::url::parse_base_url;
use pdgate_sim::EngineConfig;

use crate::support::common::{self, fast_engine, start};

const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;

fn decode_spec(url: &str, source: WorkerSource) -> WorkerSpec {
    WorkerSpec {
        role: Role::Decode,
        url: parse_base_url(url).expect("url"),
        bootstrap_port: None,
        bootstrap_host: None,
        source,
        model: None,
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_worker_added_at_run_time_takes_traffic_once_checked() {
    let env = common::start_pair().await;
    let extra = pdgate_sim::spawn(fast_engine(EngineConfig::decode(2)))
        .await
        .expect("engine");
    let pod = WorkerSource::Discovered(PodRef {
        namespace: "llm".into(),
        name: "decode-7".into(),
        uid: "u-7".into(),
    });
    let id = env
        .router
        .fleet
        .add(decode_spec(&extra.url(), pod.clone()))
        .expect("added");
    // Its server info tells its DP size (2): one decode rank plus two.
    env.wait_routable(1, 3).await;
    let snap = env.router.pool.load();
    let view = snap.worker(Role::Decode, id).expect("listed");
    assert_eq!(view.shared.source, pod);
    assert_eq!(view.effective_dp(), 2);
    drop(snap);
    for _ in 0..12 {
        let (status, _, body) = env.post("/generate", GEN).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert!(
        extra.stats().requests_total > 0 && env.cluster.decodes[0].stats().requests_total > 0,
        "both decodes serve"
    );
    // The same engine again is refused, naming the worker that has it.
    let again = env
        .router
        .fleet
        .add(decode_spec(&extra.url(), WorkerSource::Admin));
    assert_eq!(
        again,
        Err(FleetError::Exists {
            role: Role::Decode,
            url: parse_base_url(&extra.url()).expect("url").to_string(),
            id
        })
    );
}

/// An engine that answers `/health` but not `/server_info` (nor `/get_server_info`);
/// counts health checks.
pub(crate) async fn health_only_engine() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let checks = Arc::new(AtomicUsize::new(0));
    let seen = checks.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let status = if req.uri().path() == "/health" {
                            seen.fetch_add(1, Ordering::SeqCst);
                            200
                        } else {
                            404
                        };
                        let mut r = hyper::Response::new(Full::new(Bytes::from_static(b"{}")));
                        *r.status_mut() = http::StatusCode::from_u16(status).expect("status");
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (url, checks)
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_run_time_worker_without_server_info_is_never_routable() {
    let env = common::start_pair().await;
    let (url, checks) = health_only_engine().await;
    let id = env
        .router
        .fleet
        .add(decode_spec(&url, WorkerSource::Admin))
        .expect("added");
    // Bounded: a few health checks (every 50 ms) pass, the worker stays out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while checks.load(Ordering::SeqCst) < 5 {
        assert!(tokio::time::Instant::now() < deadline, "no health checks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let snap = env.router.pool.load();
    assert!(!snap.worker(Role::Decode, id).expect("listed").facts.healthy);
    assert_eq!(snap.routable_ranks(Role::Decode), 1);
}

#[tokio::test(crate = "crate::support::rt")]
async fn drain_then_remove_lets_a_stream_finish_and_ids_are_not_reused() {
    // Two decodes; tokens every 40 ms, so a 25-token stream runs about a second.
    let slow = || EngineConfig {
        itl: Duration::from_millis(40),
        ..fast_engine(EngineConfig::decode(1))
    };
    let env = common::start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![slow(), slow()],
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    let long = r#"{"text":"hello","stream":true,"sampling_params":{"max_new_tokens":25}}"#;
    let stream = env.post_streaming("/generate", long).await;
    assert_eq!(stream.status(), 200);
    // The decode that holds the stream.
    let busy = env.busy_decode();
    let snap = env.router.pool.load();
    let busy_id = snap.workers(Role::Decode)[busy].shared.id;
    let other_id = snap.workers(Role::Decode)[1 - busy].shared.id;
    drop(snap);

    let removal = env
        .router
        .fleet
        .remove(Role::Decode, busy_id, Duration::from_secs(20))
        .expect("known worker");
    // At once out of rotation: every new request goes to the other decode.
    let before = env.cluster.decodes[busy].stats().requests_total;
    for _ in 0..6 {
        let (status, _, body) = env.post("/generate", GEN).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(env.cluster.decodes[busy].stats().requests_total, before);
    assert!(!removal.is_finished(), "the stream is still in flight");
    assert!(env
        .router
        .pool
        .load()
        .worker(Role::Decode, busy_id)
        .is_some());

    // The stream runs to its end, untouched.
    common::finish_clean(stream).await;

    // Then the worker goes, having drained.
    let how = tokio::time::timeout(Duration::from_secs(20), removal)
        .await
        .expect("removed in time")
        .expect("task");
    assert_eq!(how, Removed::Drained);
    let snap = env.router.pool.load();
    assert!(snap.worker(Role::Decode, busy_id).is_none());
    assert!(snap.worker(Role::Decode, other_id).is_some());
    drop(snap);

    // Added again, the same engine gets a new id; the old id names nothing.
    let url = env.cluster.decodes[busy].url();
    let new_id = env
        .router
        .fleet
        .add(decode_spec(&url, WorkerSource::Admin))
        .expect("added again");
    assert_ne!(new_id, busy_id);
    env.wait_routable(1, 2).await;
    assert!(env
        .router
        .pool
        .load()
        .worker(Role::Decode, busy_id)
        .is_none());
    assert!(matches!(
        env.router.fleet.undrain(Role::Decode, busy_id),
        Err(FleetError::NotFound { .. })
    ));
}

#[tokio::test(crate = "crate::support::rt")]
async fn drain_and_undrain() {
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1), EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    let id = env.router.pool.load().workers(Role::Decode)[0].shared.id;
    env.router.fleet.drain(Role::Decode, id).expect("drain");
    assert_eq!(env.router.pool.load().routable_ranks(Role::Decode), 1);
    let before = env.cluster.decodes[0].stats().requests_total;
    for _ in 0..4 {
        let (status, _, _) = env.post("/generate", GEN).await;
        assert_eq!(status, 200);
    }
    assert_eq!(env.cluster.decodes[0].stats().requests_total, before);
    env.router.fleet.undrain(Role::Decode, id).expect("undrain");
    assert_eq!(env.router.pool.load().routable_ranks(Role::Decode), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_url_added_at_once_from_many_threads_is_one_worker() {
    let env = common::start_pair().await;
    let extra = pdgate_sim::spawn(fast_engine(EngineConfig::decode(1)))
        .await
        .expect("engine");
    let port: u16 = extra
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    // One engine spelled four ways (host case, trailing slash, trailing dot, default
    // path), added by 16 tasks on 4 threads at once: one worker.
    let spellings = [
        format!("http://localhost:{port}"),
        format!("http://LocalHost:{port}/"),
        format!("http://localhost.:{port}"),
        format!("http://LOCALHOST:{port}"),
    ];
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let fleet = env.router.fleet.clone();
            let url = spellings[i % spellings.len()].clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                fleet.add(decode_spec(&url, WorkerSource::Admin))
            })
        })
        .collect();
    let mut added = Vec::new();
    let mut exists = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(id) => added.push(id),
            Err(FleetError::Exists { .. }) => exists += 1,
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!(added.len(), 1, "added {added:?}");
    assert_eq!(exists, 15);
    let snap = env.router.pool.load();
    let same: Vec<_> = snap
        .workers(Role::Decode)
        .iter()
        .filter(|w| w.shared.url.port() == port)
        .map(|w| w.shared.url.to_string())
        .collect();
    assert_eq!(same, vec![format!("http://localhost:{port}")]);
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_removal_with_an_endless_deadline_still_removes() {
    // A pod can carry any grace period; a deadline past the clock's range must not
    // panic the removal task and leave a zombie worker.
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1), EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    let id = env.router.pool.load().workers(Role::Decode)[0].shared.id;
    let done = env
        .router
        .fleet
        .remove(Role::Decode, id, Duration::MAX)
        .expect("removing");
    let how = tokio::time::timeout(Duration::from_secs(10), done)
        .await
        .expect("in time")
        .expect("the task did not panic");
    assert_eq!(how, Removed::Drained);
    assert!(env.router.pool.load().worker(Role::Decode, id).is_none());
}

/// Starts an engine on `port`, retrying while the previous one there lets go of it.
async fn spawn_on(mut cfg: EngineConfig, port: u16) -> pdgate_sim::SimEngine {
    cfg.port = port;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match pdgate_sim::spawn(fast_engine(cfg.clone())).await {
            Ok(e) => return e,
            Err(e) if tokio::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("port {port}: {e}"),
        }
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn an_engine_that_comes_back_as_another_engine_is_read_again() {
    let env = common::start_pair().await;
    let first = pdgate_sim::spawn(fast_engine(EngineConfig::decode(1)))
        .await
        .expect("engine");
    let port = first.addr().port();
    env.router
        .fleet
        .add(decode_spec(&first.url(), WorkerSource::Admin))
        .expect("added");
    env.wait_routable(1, 2).await;
    // Restarted with another --dp-size: its ranks follow.
    first.shutdown();
    env.wait_routable(1, 1).await;
    let second = spawn_on(EngineConfig::decode(2), port).await;
    env.wait_routable(1, 3).await;
    // Restarted as a prefill: refused, named in the view, and out of rotation.
    second.shutdown();
    env.wait_routable(1, 1).await;
    let third = spawn_on(EngineConfig::prefill(1), port).await;
    env.wait_pool("the engine refused for its role", |s| {
        s.workers(Role::Decode).iter().any(|w| {
            w.shared.url.port() == port
                && w.facts
                    .refusal()
                    .is_some_and(|r| r.contains("disaggregation_mode prefill"))
        })
    })
    .await;
    assert_eq!(env.router.pool.load().routable_ranks(Role::Decode), 1);
    // Back as a decode: admitted again.
    third.shutdown();
    let _fourth = spawn_on(EngineConfig::decode(1), port).await;
    env.wait_routable(1, 2).await;
}
