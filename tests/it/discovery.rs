//! Kubernetes discovery in-process: the real kube client and runtime watcher against the
//! fake API server (`support::fake_kube`), simulated engines as the pods' endpoints (pod
//! IP 127.0.0.1, each engine on its own named container port `http`), and a router with
//! no static worker (or one, where the test says).

use std::time::Duration;

use pdgate::config::DiscoveryConfig;
use pdgate::discovery::{self, Discovery};
use pdgate::pool::{Snapshot, WorkerSource};
use pdgate::types::Role;
use pdgate_sim::{EngineConfig, Faults, SimEngine};

use crate::support::common::{self, fast_engine, Env};
use crate::support::fake_kube::{self, FakeKube};

pub const NS: &str = "llm";
pub const PREFILL: &[(&str, &str)] = &[("app", "sglang"), ("role", "prefill")];
pub const DECODE: &[(&str, &str)] = &[("app", "sglang"), ("role", "decode")];

pub fn discovery_config() -> DiscoveryConfig {
    DiscoveryConfig {
        enabled: true,
        prefill_selector: Some("app=sglang,role=prefill".into()),
        decode_selector: Some("app = sglang, role in (decode), !canary".into()),
        namespace: Some(NS.into()),
        port_name: Some("http".into()),
        default_grace_secs: 5,
        ..DiscoveryConfig::default()
    }
}

struct Setup {
    kube: FakeKube,
    env: Env,
    disc: Discovery,
}

/// A router (static workers from `static_decodes`), the fake API server, and discovery.
async fn setup(
    static_decodes: Vec<EngineConfig>,
    tweak: impl FnOnce(&mut DiscoveryConfig),
) -> Setup {
    setup_on(FakeKube::start().await, static_decodes, tweak).await
}

/// [`setup`] on a fake that may already hold pods.
async fn setup_on(
    kube: FakeKube,
    static_decodes: Vec<EngineConfig>,
    tweak: impl FnOnce(&mut DiscoveryConfig),
) -> Setup {
    let env = common::start(vec![], static_decodes, |_| {}).await;
    let mut d = discovery_config();
    tweak(&mut d);
    let disc = discovery::spawn_with_client(kube.client(NS).await, &d, env.router.fleet.clone())
        .expect("discovery");
    Setup { kube, env, disc }
}

async fn engine(role: Role) -> SimEngine {
    let cfg = match role {
        Role::Prefill => EngineConfig::prefill(1),
        Role::Decode => EngineConfig::decode(1),
        Role::Regular => EngineConfig::regular(1),
    };
    pdgate_sim::spawn(fast_engine(cfg)).await.expect("engine")
}

/// The discovered worker of pod `name`: (role, url, draining, healthy).
pub fn by_pod(s: &Snapshot, name: &str) -> Option<(Role, String, bool, bool)> {
    s.prefills
        .iter()
        .chain(s.decodes.iter())
        .find_map(|w| match &w.shared.source {
            WorkerSource::Discovered(p) if p.name == name => Some((
                w.shared.role,
                w.shared.url.to_string(),
                w.facts.draining(),
                w.facts.healthy,
            )),
            _ => None,
        })
}

fn discovered(s: &Snapshot) -> usize {
    s.prefills
        .iter()
        .chain(s.decodes.iter())
        .filter(|w| matches!(&w.shared.source, WorkerSource::Discovered(_)))
        .count()
}

/// Waits (bounded: 10 s) until `f` holds of the discovery stats.
async fn wait_stats(
    d: &Discovery,
    what: &str,
    f: impl Fn(discovery::metrics::StatsSnapshot) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f(d.stats()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {:?}",
            d.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn pods_become_workers_and_follow_their_pods() {
    let s = setup(vec![], |_| {}).await;
    let p = engine(Role::Prefill).await;
    let d0 = engine(Role::Decode).await;
    let d1 = engine(Role::Decode).await;
    let mut pp = fake_kube::pod("prefill-0", PREFILL, p.addr().port());
    pp.metadata.annotations = Some(
        [(
            "sglang.ai/bootstrap-port".to_string(),
            p.bootstrap_port().expect("bootstrap").to_string(),
        )]
        .into(),
    );
    let p_uid = s.kube.create(NS, pp);
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, d0.addr().port()));
    s.env.wait_routable(1, 1).await;
    common::expect_ok(&s.env, true, 3).await;

    // The front door's /readiness counts workers and lists none of them (no URL, no pod).
    let resp = s.env.send("GET", "/readiness", &[], "").await;
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["prefill"]["workers"], 1, "{v}");
    assert!(v.get("workers").is_none(), "{v}");
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("prefill-0") && !text.contains(&p.url()),
        "internal topology on the client port: {text}"
    );
    // The pool (what the admin listener's /readiness shows) names each discovered pod.
    let snap = s.env.router.pool.load();
    let pf = &snap.workers(Role::Prefill)[0];
    let WorkerSource::Discovered(pod) = &pf.shared.source else {
        panic!("the prefill is discovered");
    };
    assert_eq!(
        (pod.name.as_str(), pod.namespace.as_str()),
        ("prefill-0", NS)
    );
    assert_eq!(pod.uid, p_uid);
    assert_eq!(
        pf.facts.bootstrap.as_ref().map(|b| b.url.to_string()),
        p.bootstrap_url()
    );
    drop(snap);

    // Not ready: drained at once; ready again: back, same worker.
    let before = by_pod(&s.env.router.pool.load(), "decode-0").expect("decode-0");
    s.kube
        .update(NS, "decode-0", |p| fake_kube::set_ready(p, false));
    s.env
        .wait_pool("decode-0 drained", |sn| {
            by_pod(sn, "decode-0").is_some_and(|w| w.2)
        })
        .await;
    s.env.wait_routable(1, 0).await;
    s.kube
        .update(NS, "decode-0", |p| fake_kube::set_ready(p, true));
    s.env.wait_routable(1, 1).await;
    assert_eq!(by_pod(&s.env.router.pool.load(), "decode-0"), Some(before));

    // A pod that is not ready yet gets no worker; it does once ready.
    let mut p1 = fake_kube::pod("decode-1", DECODE, d1.addr().port());
    fake_kube::set_ready(&mut p1, false);
    s.kube.create(NS, p1);
    wait_stats(&s.disc, "a reconcile", |st| st.reconciles >= 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(by_pod(&s.env.router.pool.load(), "decode-1"), None);
    s.kube
        .update(NS, "decode-1", |p| fake_kube::set_ready(p, true));
    s.env.wait_routable(1, 2).await;

    // Terminating: drained and removed (nothing in flight: at once).
    s.kube.terminate(NS, "decode-0", 30);
    s.env
        .wait_pool("decode-0 removed", |sn| by_pod(sn, "decode-0").is_none())
        .await;
    let served = d0.stats().requests_total;
    s.kube.delete(NS, "decode-0");
    common::expect_ok(&s.env, false, 6).await;
    assert_eq!(
        d0.stats().requests_total,
        served,
        "a removed pod gets nothing"
    );
    assert!(d1.stats().requests_total > 0);

    // A label change that leaves the selector (the watch says DELETED): removed.
    s.kube.update(NS, "decode-1", |p| {
        if let Some(l) = p.metadata.labels.as_mut() {
            l.insert("canary".into(), "yes".into());
        }
    });
    s.env
        .wait_pool("decode-1 removed", |sn| by_pod(sn, "decode-1").is_none())
        .await;
    assert_eq!(discovered(&s.env.router.pool.load()), 1);
}

#[tokio::test(crate = "crate::support::rt")]
async fn requests_in_flight_on_a_draining_pod_finish() {
    let s = setup(vec![], |d| d.default_grace_secs = 30).await;
    let p = engine(Role::Prefill).await;
    let held = pdgate_sim::spawn(fast_engine(EngineConfig::decode(1)))
        .await
        .expect("engine");
    s.kube
        .create(NS, fake_kube::pod("prefill-0", PREFILL, p.addr().port()));
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, held.addr().port()));
    s.env.wait_routable(1, 1).await;
    held.set_faults(Faults {
        decode_hold: true,
        ..Faults::default()
    });
    let env = std::sync::Arc::new(s.env);
    let mut inflight = Vec::new();
    for _ in 0..3 {
        let env = env.clone();
        inflight.push(tokio::spawn(async move {
            env.post("/generate", common::gen_body(true)).await
        }));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while held.stats().held_now < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "requests never reached decode-0"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The pod terminates with a grace period: no new request, the held ones go on.
    s.kube.terminate(NS, "decode-0", 30);
    env.wait_pool("decode-0 draining", |sn| {
        by_pod(sn, "decode-0").is_some_and(|w| w.2)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        by_pod(&env.router.pool.load(), "decode-0").is_some(),
        "removed while requests were in flight"
    );
    held.set_faults(Faults::default());
    for t in inflight {
        let (status, _, body) = t.await.expect("task");
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let (events, done) = common::sse_events(&body);
        assert!(done && events.iter().all(|e| e.get("error").is_none()));
    }
    env.wait_pool("decode-0 removed once empty", |sn| {
        by_pod(sn, "decode-0").is_none()
    })
    .await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn an_endpoint_or_uid_change_replaces_the_worker() {
    let s = setup(vec![], |_| {}).await;
    let p = engine(Role::Prefill).await;
    let a = engine(Role::Decode).await;
    let b = engine(Role::Decode).await;
    s.kube
        .create(NS, fake_kube::pod("prefill-0", PREFILL, p.addr().port()));
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, a.addr().port()));
    s.env.wait_routable(1, 1).await;
    // Same UID, another endpoint (here the port; an IP change is the same path).
    s.kube.update(NS, "decode-0", |pod| {
        if let Some(spec) = pod.spec.as_mut() {
            spec.containers[0].ports = Some(vec![k8s_openapi::api::core::v1::ContainerPort {
                name: Some("http".into()),
                container_port: i32::from(b.addr().port()),
                ..Default::default()
            }]);
        }
    });
    s.env
        .wait_pool("decode-0 at b", |sn| {
            by_pod(sn, "decode-0").is_some_and(|w| w.1 == b.url()) && sn.decodes.len() == 1
        })
        .await;
    s.env.wait_routable(1, 1).await;
    let id_b = s.env.router.pool.load().decodes[0].shared.id;
    // Same name, new UID, same endpoint (a StatefulSet pod recreated): the old worker
    // goes, a new one comes at the same URL once the old one is gone.
    s.kube.delete(NS, "decode-0");
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, b.addr().port()));
    s.env
        .wait_pool("a new worker for the new pod", |sn| {
            sn.decodes.len() == 1 && sn.decodes[0].shared.id != id_b && sn.decodes[0].facts.healthy
        })
        .await;
    s.env.wait_routable(1, 1).await;
    common::expect_ok(&s.env, false, 3).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn pods_that_cannot_be_used_are_skipped_and_static_workers_untouched() {
    let s = setup(vec![EngineConfig::decode(1)], |_| {}).await;
    s.env.wait_routable(0, 1).await;
    let static_port = s.env.cluster.decodes[0].addr().port();
    let p = engine(Role::Prefill).await;
    // A pod at the static decode's URL: logged and skipped, the static worker stays.
    s.kube
        .create(NS, fake_kube::pod("decode-static", DECODE, static_port));
    // A prefill with a malformed bootstrap-port annotation.
    let mut bad = fake_kube::pod("bad-annotation", PREFILL, p.addr().port());
    bad.metadata.annotations =
        Some([("sglang.ai/bootstrap-port".to_string(), "http".to_string())].into());
    s.kube.create(NS, bad);
    // A pod in another namespace.
    s.kube.create(
        "other",
        fake_kube::pod("elsewhere", PREFILL, p.addr().port()),
    );
    wait_stats(&s.disc, "reconciles", |st| {
        st.reconciles >= 1 && st.lists >= 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let snap = s.env.router.pool.load();
    assert_eq!(
        discovered(&snap),
        0,
        "nothing discovered: {:?}",
        snap.decodes
    );
    assert_eq!(snap.decodes.len(), 1);
    assert_eq!(snap.decodes[0].shared.source, WorkerSource::Static);
    assert!(!snap.decodes[0].facts.draining());
    drop(snap);
    // A pod matching both selectors: refused.
    let s2 = setup(vec![], |d| {
        d.prefill_selector = Some("tier=engine".into());
        d.decode_selector = Some("tier in (engine, decode)".into());
    })
    .await;
    s2.kube.create(
        NS,
        fake_kube::pod("both", &[("tier", "engine")], p.addr().port()),
    );
    wait_stats(&s2.disc, "reconciles", |st| st.reconciles >= 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(discovered(&s2.env.router.pool.load()), 0);
    // The metrics are described and exported.
    let text = pdgate::telemetry::render(&*s2.env.router.pool);
    for name in [
        "pdgate_discovery_pods",
        "pdgate_discovery_last_sync_timestamp_seconds",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics");
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn watch_faults_never_remove_workers_and_recovery_catches_up() {
    // No periodic relist within the test: recovery is the watcher's own.
    let s = setup(vec![], |_| {}).await;
    let p = engine(Role::Prefill).await;
    let d0 = engine(Role::Decode).await;
    let d1 = engine(Role::Decode).await;
    let d2 = engine(Role::Decode).await;
    s.kube
        .create(NS, fake_kube::pod("prefill-0", PREFILL, p.addr().port()));
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, d0.addr().port()));
    s.kube
        .create(NS, fake_kube::pod("decode-1", DECODE, d1.addr().port()));
    s.env.wait_routable(1, 2).await;

    // The API server is down (the watch ends, every reconnect fails): the workers stay
    // and serve.
    let errors = s.disc.stats().watch_errors;
    s.kube.set_down(true);
    wait_stats(&s.disc, "errors", |st| st.watch_errors >= errors + 2).await;
    assert_eq!(discovered(&s.env.router.pool.load()), 3);
    common::expect_ok(&s.env, false, 3).await;

    // A pod deleted while the watch is down: removed once the watch resumes (the
    // history replays the DELETED event).
    s.kube.delete(NS, "decode-1");
    s.kube.set_down(false);
    s.env
        .wait_pool("decode-1 removed after the outage", |sn| {
            by_pod(sn, "decode-1").is_none()
        })
        .await;

    // 410 Expired: the watcher relists; a pod created meanwhile is found.
    let restarts = s.disc.stats().watch_restarts;
    s.kube.expire();
    s.kube
        .create(NS, fake_kube::pod("decode-2", DECODE, d2.addr().port()));
    s.env
        .wait_pool("decode-2 found after 410", |sn| {
            by_pod(sn, "decode-2").is_some()
        })
        .await;
    wait_stats(&s.disc, "a restart", |st| st.watch_restarts > restarts).await;

    // Down again, a pod deleted and the history compacted: the reconnect gets 410, the
    // relist no longer has the pod, and its worker goes.
    s.kube.set_down(true);
    s.kube.delete(NS, "decode-2");
    s.kube.expire();
    s.kube.set_down(false);
    s.env
        .wait_pool("decode-2 removed at the relist", |sn| {
            by_pod(sn, "decode-2").is_none()
        })
        .await;

    // A cut stream reconnects from its resourceVersion and misses nothing.
    s.kube.cut_watches();
    s.kube
        .update(NS, "decode-0", |p| fake_kube::set_ready(p, false));
    s.env
        .wait_pool("decode-0 drained after the cut", |sn| {
            by_pod(sn, "decode-0").is_some_and(|w| w.2)
        })
        .await;
    assert_eq!(discovered(&s.env.router.pool.load()), 2);
}

#[tokio::test(crate = "crate::support::rt")]
async fn the_periodic_pass_reconciles_from_the_store_without_listing() {
    let s = setup(vec![], |d| d.resync_secs = 1).await;
    let p = engine(Role::Prefill).await;
    let d0 = engine(Role::Decode).await;
    s.kube
        .create(NS, fake_kube::pod("prefill-0", PREFILL, p.addr().port()));
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, d0.addr().port()));
    s.env.wait_routable(1, 1).await;
    let before = s.disc.stats();
    let lists_sent = s
        .kube
        .requests()
        .iter()
        .filter(|r| !r.contains("watch="))
        .count();
    // Several resync periods with nothing changing: the reconciler passes over the store,
    // and nothing is listed again (the cost on the API server does not grow with time).
    wait_stats(&s.disc, "two periodic passes", |st| {
        st.reconciles >= before.reconciles + 2
    })
    .await;
    assert_eq!(s.disc.stats().lists, before.lists, "no LIST on a timer");
    let lists_now = s
        .kube
        .requests()
        .iter()
        .filter(|r| !r.contains("watch="))
        .count();
    assert_eq!(lists_now, lists_sent, "{:?}", s.kube.requests());
    assert_eq!(discovered(&s.env.router.pool.load()), 2);
    // An event lost on the way (an API server never does this within a watch) is caught
    // when the watch must start over: 410 Gone, a fresh LIST, the pod gone.
    s.kube.delete_unseen(NS, "decode-0");
    s.kube.expire();
    s.env
        .wait_pool("decode-0 removed by the relist after 410", |sn| {
            by_pod(sn, "decode-0").is_none()
        })
        .await;
    assert!(s.disc.stats().lists > before.lists);
}

#[tokio::test(crate = "crate::support::rt")]
async fn the_watcher_speaks_the_list_and_watch_protocol() {
    let kube = FakeKube::start().await;
    let p = engine(Role::Prefill).await;
    // More pods than the fake's page: the first LIST is paged with continue tokens.
    let mut decodes = Vec::new();
    for i in 0..5 {
        let d = engine(Role::Decode).await;
        kube.create(
            NS,
            fake_kube::pod(&format!("decode-{i}"), DECODE, d.addr().port()),
        );
        decodes.push(d);
    }
    kube.create(NS, fake_kube::pod("prefill-0", PREFILL, p.addr().port()));
    let s = setup_on(kube, vec![], |_| {}).await;
    s.env.wait_routable(1, 5).await;
    let reqs = s.kube.requests();
    let base = format!("/api/v1/namespaces/{NS}/pods?");
    assert!(reqs.iter().all(|r| r.starts_with(&base)), "{reqs:?}");
    let lists: Vec<_> = reqs.iter().filter(|r| !r.contains("watch=true")).collect();
    let watches: Vec<_> = reqs.iter().filter(|r| r.contains("watch=true")).collect();
    assert!(lists.iter().any(|r| r.contains("limit=500")), "{lists:?}");
    assert!(
        lists.iter().any(|r| r.contains("continue=")),
        "paged: {lists:?}"
    );
    assert!(
        lists
            .iter()
            .any(|r| r.contains("labelSelector=app%3Dsglang%2Crole%3Dprefill")),
        "{lists:?}"
    );
    for w in &watches {
        for param in [
            "timeoutSeconds=290",
            "allowWatchBookmarks=true",
            "resourceVersion=",
            "labelSelector=",
        ] {
            assert!(w.contains(param), "{w} lacks {param}");
        }
    }
    assert!(s.kube.open_watches() >= 2);
}

#[tokio::test(crate = "crate::support::rt")]
async fn the_namespace_defaults_and_all_namespaces() {
    // No namespace configured: the kubeconfig context's (the service-account file does
    // not exist here).
    let s = setup(vec![], |d| d.namespace = None).await;
    assert_eq!(s.disc.scope(), NS);
    let p = engine(Role::Prefill).await;
    let d = engine(Role::Decode).await;
    s.kube.create(
        "other",
        fake_kube::pod("prefill-x", PREFILL, p.addr().port()),
    );
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, d.addr().port()));
    s.env.wait_routable(0, 1).await;
    assert_eq!(discovered(&s.env.router.pool.load()), 1);

    let all = setup(vec![], |d| {
        d.namespace = None;
        d.all_namespaces = true;
        d.allowed_namespaces = vec!["other".into(), NS.into()];
    })
    .await;
    assert_eq!(all.disc.scope(), "*");
    // A matching pod in a namespace not allowed never becomes a worker. Created before
    // decode-0 (one watch, events in order): the pass that adds decode-0 has seen it. (A
    // count of passes is no such proof: on several threads the first LIST may already
    // see all three pods, and one pass does everything.)
    let rogue = engine(Role::Decode).await;
    all.kube.create(
        "untrusted",
        fake_kube::pod("decode-rogue", DECODE, rogue.addr().port()),
    );
    all.kube.create(
        "other",
        fake_kube::pod("prefill-x", PREFILL, p.addr().port()),
    );
    all.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, d.addr().port()));
    all.env.wait_routable(1, 1).await;
    assert_eq!(discovered(&all.env.router.pool.load()), 2);
    assert!(by_pod(&all.env.router.pool.load(), "decode-rogue").is_none());
    assert!(all
        .kube
        .requests()
        .iter()
        .all(|r| r.starts_with("/api/v1/pods?")));
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_malformed_selector_refuses_the_start_naming_it() {
    let cases = [
        (Some("app in (prefill"), Some("app=d"), "--prefill-selector"),
        (Some("app=p"), Some("role=,"), "--decode-selector"),
        (Some("app=p"), Some("app = p"), "are the same selector"),
    ];
    for (p, d, want) in cases {
        let mut cfg = common::fast_config();
        cfg.discovery.enabled = true;
        cfg.discovery.prefill_selector = p.map(str::to_string);
        cfg.discovery.decode_selector = d.map(str::to_string);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let err = pdgate::router::start(
            cfg,
            Some(listener),
            pdgate::dispatch::RngSource::Seeded(1.into()),
        )
        .await
        .err()
        .expect("refused");
        assert!(err.to_string().contains(want), "{err}");
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_readiness_flap_does_not_undo_an_operators_drain() {
    let s = setup(vec![], |_| {}).await;
    let p = engine(Role::Prefill).await;
    let d0 = engine(Role::Decode).await;
    let mut pp = fake_kube::pod("prefill-0", PREFILL, p.addr().port());
    pp.metadata.annotations = Some(
        [(
            "sglang.ai/bootstrap-port".to_string(),
            p.bootstrap_port().expect("bootstrap").to_string(),
        )]
        .into(),
    );
    s.kube.create(NS, pp);
    s.kube
        .create(NS, fake_kube::pod("decode-0", DECODE, d0.addr().port()));
    s.env.wait_routable(1, 1).await;
    let id = s
        .env
        .router
        .pool
        .load()
        .workers(Role::Decode)
        .iter()
        .find(|w| matches!(&w.shared.source, WorkerSource::Discovered(p) if p.name == "decode-0"))
        .expect("decode-0")
        .shared
        .id;
    // The operator drains it; then its pod goes unready and ready again.
    s.env.router.fleet.drain(Role::Decode, id).expect("drain");
    let base = s.disc.stats().reconciles;
    s.kube
        .update(NS, "decode-0", |p| fake_kube::set_ready(p, false));
    wait_stats(&s.disc, "the unready pass", |st| st.reconciles > base).await;
    let base = s.disc.stats().reconciles;
    s.kube
        .update(NS, "decode-0", |p| fake_kube::set_ready(p, true));
    wait_stats(&s.disc, "the ready pass", |st| st.reconciles > base).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let snap = s.env.router.pool.load();
    let w = snap.worker(Role::Decode, id).expect("still there");
    assert!(
        w.facts.draining(),
        "the operator's drain holds through the flap"
    );
    assert_eq!(snap.routable_ranks(Role::Decode), 0);
    drop(snap);
    // The operator's undrain brings it back (the pod is ready).
    s.env
        .router
        .fleet
        .undrain(Role::Decode, id)
        .expect("undrain");
    s.env.wait_routable(1, 1).await;
    // And an operator's undrain does not bring back an unready pod.
    s.kube
        .update(NS, "decode-0", |p| fake_kube::set_ready(p, false));
    s.env.wait_routable(1, 0).await;
    s.env
        .router
        .fleet
        .undrain(Role::Decode, id)
        .expect("undrain");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.env.router.pool.load().routable_ranks(Role::Decode), 0);
}
