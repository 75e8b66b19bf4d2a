//! The replica count from Kubernetes (issue 36, item 1): one router in process counts
//! pdgate's own pods (`admission.replica_selector`) in the fake API server
//! (`support::fake_kube`) while pods of other (imaginary) replicas join, drain and leave,
//! and its share of a decode rank follows: checked through `/readiness` (count, index,
//! source) and through admission, with requests held by the simulated decode
//! (`decode_hold`) so that what the router admits is the test's count, not a race.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use pdgate::config::Config;
use pdgate::dispatch::RngSource;
use pdgate::router::{AdminListener, Cluster, Router};
use pdgate::types::{Role, WorkerId};
use pdgate_sim::{EngineConfig, Faults, SimCluster};
use serde_json::Value;

use crate::support::common::{add_sim_workers, client, fast_config, fast_engine};
use crate::support::fake_kube::{self, FakeKube};

const NS: &str = "gateway";
const PDGATE: &[(&str, &str)] = &[("app.kubernetes.io/name", "pdgate")];
const SELECTOR: &str = "app.kubernetes.io/name=pdgate";
/// This router's pod.
const OWN: &str = "pdgate-a";
/// Requests per decode DP rank (`capacity.decode_max_running_per_rank`).
const CAP: u64 = 4;
const BODY: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":4}}"#;

/// A pdgate pod (its port is never used: only its labels, readiness and name count).
fn pdgate_pod(name: &str, ready: bool) -> k8s_openapi::api::core::v1::Pod {
    let mut p = fake_kube::pod(name, PDGATE, 8000);
    fake_kube::set_ready(&mut p, ready);
    p
}

fn tweak(c: &mut Config) {
    c.admission.replica_selector = Some(SELECTOR.into());
    c.capacity.decode_max_running_per_rank = CAP;
    // The share alone decides: the engine's reports (none: the load poll is off) and its
    // pre-allocation queue (where held requests sit) are not looked at.
    c.capacity.learn_from_engine = false;
    // Held requests wait for the test, not for a deadline.
    c.admission.queue_timeout_ms = 60_000;
    c.timeouts.prefill_secs = 60;
    c.timeouts.decode_first_byte_secs = 60;
    c.timeouts.request_secs = 120;
}

async fn readiness(url: &str) -> Value {
    let r = client()
        .get(format!("{url}/readiness").parse().expect("uri"))
        .await
        .expect("readiness");
    let b = r.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&b).expect("json")
}

/// Waits (bounded: 10 s) until `/readiness` shows `replicas` and `index`, from discovery.
async fn until_count(url: &str, replicas: u64, index: Option<u64>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = readiness(url).await;
        if v["replicas"] == replicas
            && v["replica_index"] == index.map_or(Value::Null, Value::from)
            && v["replica_source"] == "discovery"
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never showed {replicas} replicas, index {index:?}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// This router's reservations on the decode's rank 0.
fn own(r: &Router) -> u64 {
    r.pool
        .load()
        .worker(Role::Decode, WorkerId(0))
        .and_then(|w| w.capacity(0).map(|c| c.own()))
        .unwrap_or(0)
}

/// Waits (bounded: 10 s) until the decode holds `n` requests and the router `n` slots.
async fn until_held(cluster: &SimCluster, r: &Router, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.decodes[0].stats().held_now != n || own(r) != n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never held {n}: the decode holds {}, the router reserved {}",
            cluster.decodes[0].stats().held_now,
            own(r)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn shares_follow_replicas_joining_and_leaving() {
    let kube = FakeKube::start().await;
    let p = fast_engine(EngineConfig::prefill(1));
    let mut d = fast_engine(EngineConfig::decode(1));
    d.faults.decode_hold = true;
    let cluster = SimCluster::spawn(&[p], &[d]).await.expect("sim cluster");
    let mut cfg = fast_config();
    add_sim_workers(&mut cfg, &cluster);
    tweak(&mut cfg);
    // Its own pod exists, not Ready yet.
    kube.create(NS, pdgate_pod(OWN, false));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = pdgate::router::start_in_cluster(
        cfg,
        Some(l),
        AdminListener::Off,
        RngSource::Seeded(1.into()),
        Cluster {
            client: kube.client(NS).await,
            pod_name: Some(OWN.into()),
        },
    )
    .await
    .expect("router");
    let url = router.url();

    // Not Ready: it counts itself, without an index; Ready: one replica, index 0.
    until_count(&url, 1, None).await;
    kube.update(NS, OWN, |p| fake_kube::set_ready(p, true));
    until_count(&url, 1, Some(0)).await;
    // Another replica joins, and is counted once Ready.
    kube.create(NS, pdgate_pod("pdgate-b", false));
    kube.update(NS, "pdgate-b", |p| fake_kube::set_ready(p, true));
    until_count(&url, 2, Some(0)).await;

    // Two replicas: this one holds at most its share, 2 of the rank's 4 slots.
    let post = || {
        let url = url.clone();
        tokio::spawn(async move {
            let req = http::Request::post(format!("{url}/generate"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(BODY.as_bytes())))
                .expect("request");
            let resp = client().request(req).await.expect("answered");
            let status = resp.status();
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            (status, body)
        })
    };
    let calls: Vec<_> = (0..4).map(|_| post()).collect();
    until_held(&cluster, &router, 2).await;
    // Fifteen of the router's health intervals: with the rank's whole capacity as its
    // share, the other two would have gone at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(cluster.decodes[0].stats().held_now, 2);
    assert_eq!(
        cluster.prefills[0].stats().requests_total,
        2,
        "a request beyond the share was sent"
    );
    assert!(calls.iter().all(|c| !c.is_finished()), "the rest wait");

    // A draining replica still holds its requests: it stays counted. A third one joins
    // and sorts first: this one is index 1 of 3 (share 1 on rank 0), and keeps what it
    // holds.
    kube.terminate(NS, "pdgate-b", 30);
    kube.create(NS, pdgate_pod("pdgate-0", true));
    until_count(&url, 3, Some(1)).await;
    assert_eq!(own(&router), 2);

    // Both others leave: the whole rank is this replica's again, and the requests that
    // waited are admitted.
    kube.delete(NS, "pdgate-b");
    kube.delete(NS, "pdgate-0");
    until_count(&url, 1, Some(0)).await;
    until_held(&cluster, &router, CAP).await;

    cluster.decodes[0].set_faults(Faults::default());
    for c in calls {
        let (status, body) = tokio::time::timeout(Duration::from_secs(20), c)
            .await
            .expect("answered in time")
            .expect("a task");
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(cluster.decodes[0].stats().ok, CAP);
    router.shutdown().await;
}

async fn start(cfg: Config) -> Router {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    pdgate::router::start(cfg, Some(l), RngSource::Seeded(1.into()))
        .await
        .expect("router")
}

/// `/readiness`'s (replicas, replica_index, replica_source).
async fn shown(r: &Router) -> (Value, Value, Value) {
    let v = readiness(&r.url()).await;
    (
        v["replicas"].clone(),
        v["replica_index"].clone(),
        v["replica_source"].clone(),
    )
}

/// Without a selector the count is the config's (unknown, or static, and a reload changes
/// it); a selector with a static count is refused at start, naming both settings.
#[tokio::test(crate = "crate::support::rt")]
async fn the_count_says_where_it_comes_from() {
    let r = start(fast_config()).await;
    assert_eq!(shown(&r).await, (0.into(), Value::Null, "unknown".into()));

    let mut cfg = fast_config();
    cfg.admission.replicas = 3;
    cfg.admission.replica_index = Some(2);
    let r = start(cfg.clone()).await;
    assert_eq!(shown(&r).await, (3.into(), 2.into(), "static".into()));
    let mut two = cfg.clone();
    two.admission.replicas = 2;
    two.admission.replica_index = None;
    pdgate::reload::apply(&r, two).expect("reload");
    assert_eq!(shown(&r).await, (2.into(), Value::Null, "static".into()));

    cfg.admission.replica_selector = Some(SELECTOR.into());
    let e = pdgate::router::start(cfg, None, RngSource::Seeded(1.into()))
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("admission.replica_selector (--replica-selector)")
            && e.contains("admission.replicas (--replicas) = 3"),
        "{e}"
    );
}
