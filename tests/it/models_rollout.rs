//! A rollout of new weights through Kubernetes discovery (issue 19, item 5): two versions
//! of one model (same served name, another `weight_version` in `/server_info`) served side
//! by side while the old one is drained. pdgate must never pair a prefill of one version
//! with a decode of the other, and no request may fail. The simulated engines are the
//! judge: a decode of other weights asking a prefill for its KV is counted by the prefill
//! (`violation_kv_layout_mismatch`, whose identity includes the weight version).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdgate::discovery;
use pdgate_sim::{EngineConfig, SimEngine};

use crate::discovery::{by_pod, discovery_config, DECODE, NS, PREFILL};
use crate::support::common::{self, fast_engine, Env};
use crate::support::fake_kube::{self, FakeKube};

const MODEL: &str = "org/model";

async fn engine(prefill: bool, version: &str) -> SimEngine {
    let mut cfg = if prefill {
        EngineConfig::prefill(1)
    } else {
        EngineConfig::decode(1)
    };
    cfg.model = MODEL.to_string();
    cfg.weight_version = version.to_string();
    pdgate_sim::spawn(fast_engine(cfg)).await.expect("engine")
}

/// The pods of one version: a prefill (with its bootstrap-port annotation) and a decode.
fn add_pods(kube: &FakeKube, version: &str, p: &SimEngine, d: &SimEngine) {
    let mut pp = fake_kube::pod(&format!("prefill-{version}"), PREFILL, p.addr().port());
    pp.metadata.annotations = Some(
        [(
            "sglang.ai/bootstrap-port".to_string(),
            p.bootstrap_port().expect("bootstrap").to_string(),
        )]
        .into(),
    );
    kube.create(NS, pp);
    kube.create(
        NS,
        fake_kube::pod(&format!("decode-{version}"), DECODE, d.addr().port()),
    );
}

fn chat() -> String {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
    })
    .to_string()
}

/// Requests from 4 clients until `stop` (bounded: 2000 in all); returns each failure.
fn traffic(env: Arc<Env>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    tokio::spawn(async move {
        let body = chat();
        let clients = (0..4).map(|_| {
            let (env, stop, body) = (env.clone(), stop.clone(), body.clone());
            async move {
                let mut sent = 0;
                let mut failed = Vec::new();
                while !stop.load(Ordering::Relaxed) && sent < 500 {
                    let (status, _, bytes) = env.post("/v1/chat/completions", &body).await;
                    sent += 1;
                    if status != 200 {
                        failed.push(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
                    }
                }
                (sent, failed)
            }
        });
        let mut total = 0;
        let mut failures = Vec::new();
        for (n, f) in futures_util::future::join_all(clients).await {
            total += n;
            failures.extend(f);
        }
        (total, failures)
    })
}

async fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// v1 serves; v2 comes up beside it (same name, new weights) while traffic runs; v1's
/// decode terminates and its prefill turns NotReady. Every request succeeds, each version's
/// prefill served exactly as many requests as its own decode, and no engine saw a KV
/// handoff across versions; once v1 drained, it gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_rollout_never_pairs_across_versions_and_loses_nothing() {
    let kube = FakeKube::start().await;
    let env = Arc::new(common::start(vec![], vec![], |_| {}).await);
    let disc = discovery::spawn_with_client(
        kube.client(NS).await,
        &discovery_config(),
        env.router.fleet.clone(),
    )
    .expect("discovery");
    let (p1, d1) = (engine(true, "v1").await, engine(false, "v1").await);
    let (p2, d2) = (engine(true, "v2").await, engine(false, "v2").await);
    add_pods(&kube, "v1", &p1, &d1);
    env.wait_routable(1, 1).await;

    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(env.clone(), stop.clone());
    wait_until("v1 serves", || d1.stats().requests_total >= 5).await;

    // v2 comes up: one model, two handoff groups (the weight versions differ).
    add_pods(&kube, "v2", &p2, &d2);
    env.wait_routable(2, 2).await;
    env.wait_pool("one model in two groups", |s| {
        s.models.len() == 1 && s.groups.len() == 2 && s.models[0].groups.len() == 2
    })
    .await;
    wait_until("v2 serves", || d2.stats().requests_total >= 5).await;

    // v1 goes: its decode first (its prefill, still routable, has no partner left), then
    // its prefill.
    kube.terminate(NS, "decode-v1", 30);
    env.wait_pool("decode-v1 drained", |s| {
        by_pod(s, "decode-v1").is_none_or(|w| w.2)
    })
    .await;
    let p2_before = p2.stats().requests_total;
    wait_until("v2 serves alone", || {
        p2.stats().requests_total >= p2_before + 10
    })
    .await;
    kube.update(NS, "prefill-v1", |p| fake_kube::set_ready(p, false));
    env.wait_pool("prefill-v1 drained", |s| {
        by_pod(s, "prefill-v1").is_none_or(|w| w.2)
    })
    .await;
    // Requests that picked v1 just before the drain finish; after that, v1 gets nothing.
    wait_until("v1 idle", || {
        p1.stats().held_now == 0 && d1.stats().held_now == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let v1_after = (p1.stats().requests_total, d1.stats().requests_total);
    let d2_before = d2.stats().requests_total;
    wait_until("v2 takes the rest", || {
        d2.stats().requests_total >= d2_before + 20
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (sent, failures) = load.await.expect("traffic");
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {failures:?}",
        failures.len()
    );
    assert_eq!(
        (p1.stats().requests_total, d1.stats().requests_total),
        v1_after,
        "a drained version got traffic"
    );

    // Every leg stayed within its version.
    let s = [p1.stats(), d1.stats(), p2.stats(), d2.stats()];
    for (name, st) in ["p1", "d1", "p2", "d2"].iter().zip(&s) {
        assert_eq!(st.violation_kv_layout_mismatch, 0, "{name}: {st:?}");
        assert_eq!(st.contract_violations, 0, "{name}: {st:?}");
    }
    assert_eq!(s[0].requests_total, s[1].requests_total, "v1: {s:?}");
    assert_eq!(s[2].requests_total, s[3].requests_total, "v2: {s:?}");
    assert_eq!(
        (s[0].requests_total + s[2].requests_total) as usize,
        sent,
        "every request served once"
    );
    drop(disc);
}
