//! The request-path rank check is single-flight and lock-free for the request: however
//! many requests find a rank's view stale at once, one `GET /route` goes out, and every
//! request waits on its outcome; the outcome is written to the pool by the check's own task.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use pdgate::bootstrap::client::Generation;
use pdgate::bootstrap::preflight;
use pdgate::bootstrap::Layout;
use pdgate::pool::{BootstrapInfo, Pool, PreflightOutcome, RankReadiness};
use pdgate::types::Role;
use pdgate::upstream::{parse_base_url, Upstream};

/// A bootstrap server whose rank routes answer after `delay` with `status`; counts them.
async fn slow_bootstrap(delay: Duration, status: StatusCode) -> (String, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicU64::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let seen = seen.clone();
            let svc = service_fn(move |_req: Request<hyper::body::Incoming>| {
                let seen = seen.clone();
                async move {
                    seen.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(delay).await;
                    let mut r = Response::new(Full::new(Bytes::from_static(
                        br#"{"rank_ip":"127.0.0.1","rank_port":1}"#,
                    )));
                    *r.status_mut() = status;
                    Ok::<_, Infallible>(r)
                }
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), count)
}

fn pool_with_prefill(url: &str) -> Arc<Pool> {
    let pool = Arc::new(Pool::new());
    let base = parse_base_url(url).expect("url");
    let boot = BootstrapInfo {
        url: base.clone(),
        host_json: "\"127.0.0.1\"".to_string(),
        port: base.port(),
    };
    let id = pool.add_worker(Role::Prefill, base, Some(boot));
    pool.update_worker(Role::Prefill, id, |w| {
        w.facts.healthy = true;
        w.facts.layout = Some(Layout {
            generation: Generation::V3,
            dp_size: 2,
            attn_tp_size: 1,
            attn_cp_size: 1,
            pp_size: 1,
            follow_bootstrap_room: true,
            page_size: None,
            kv_cache_dtype: None,
        });
    });
    pool
}

async fn checks(pool: &Arc<Pool>, up: &Upstream, rank: u32, n: usize) -> Vec<PreflightOutcome> {
    let snap = pool.load_full();
    let w = &snap.prefills[0];
    let boot = w.facts.bootstrap.clone().expect("bootstrap");
    let probes = w.per_rank.probes.clone();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (pool, up, boot, probes) = (pool.clone(), up.clone(), boot.clone(), probes.clone());
        let id = w.shared.id;
        tasks.push(tokio::spawn(async move {
            let t = preflight::Target {
                worker: id,
                rank,
                bootstrap: &boot,
                generation: Generation::V3,
                probes: &probes,
            };
            preflight::check(&pool, &up, t, Duration::from_secs(5)).await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("check"));
    }
    out
}

#[tokio::test(crate = "crate::support::rt")]
async fn concurrent_stale_requests_share_one_check() {
    let (url, count) = slow_bootstrap(Duration::from_millis(300), StatusCode::OK).await;
    let pool = pool_with_prefill(&url);
    let up = Upstream::new(&pdgate::router::upstream_settings(
        &pdgate::config::Config::default(),
    ));
    let got = checks(&pool, &up, 1, 20).await;
    assert!(got.iter().all(|o| *o == PreflightOutcome::Ready), "{got:?}");
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "one GET /route for 20 requests"
    );
    // The check's task wrote the outcome to the pool.
    let snap = pool.load_full();
    assert_eq!(
        snap.prefills[0].facts.ranks.get(1),
        Some(&RankReadiness::Ready)
    );
    // Another rank is another flight; and once a check ended, the next one goes out.
    let got = checks(&pool, &up, 0, 5).await;
    assert!(got.iter().all(|o| *o == PreflightOutcome::Ready));
    assert_eq!(count.load(Ordering::SeqCst), 2);
    checks(&pool, &up, 1, 1).await;
    assert_eq!(count.load(Ordering::SeqCst), 3);
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_failed_check_is_shared_too() {
    let (url, count) = slow_bootstrap(Duration::from_millis(200), StatusCode::NOT_FOUND).await;
    let pool = pool_with_prefill(&url);
    let up = Upstream::new(&pdgate::router::upstream_settings(
        &pdgate::config::Config::default(),
    ));
    let got = checks(&pool, &up, 0, 10).await;
    assert!(
        got.iter()
            .all(|o| matches!(o, PreflightOutcome::Missing(_))),
        "{got:?}"
    );
    assert_eq!(count.load(Ordering::SeqCst), 1);
    let snap = pool.load_full();
    assert_eq!(snap.prefills[0].facts.ranks[0].label(), "failed");
}

/// A bootstrap server with `dp` ranks, all registered, whose rank routes each take
/// `delay`; returns the most rank routes it had in flight at once.
async fn layout_server(dp: u32, delay: Duration) -> (String, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let now = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let seen_peak = peak.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (now, peak) = (now.clone(), peak.clone());
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let (now, peak) = (now.clone(), peak.clone());
                async move {
                    let q = req.uri().query().unwrap_or_default().to_string();
                    let body = if q.contains("prefill_dp_rank=-1") {
                        format!(
                            r#"{{"dp_size":{dp},"attn_tp_size":1,"attn_cp_size":1,"pp_size":1,"follow_bootstrap_room":true}}"#
                        )
                    } else {
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(n, Ordering::SeqCst);
                        tokio::time::sleep(delay).await;
                        now.fetch_sub(1, Ordering::SeqCst);
                        r#"{"rank_ip":"127.0.0.1","rank_port":1}"#.to_string()
                    };
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
                }
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), seen_peak)
}

#[tokio::test(crate = "crate::support::rt")]
async fn the_refresher_asks_for_rank_routes_concurrently() {
    let (url, peak) = layout_server(8, Duration::from_millis(200)).await;
    let pool = Arc::new(Pool::new());
    let base = parse_base_url(&url).expect("url");
    let id = pool.add_worker(Role::Prefill, base.clone(), None);
    let cfg = pdgate::config::Config::default();
    let up = Upstream::new(&pdgate::router::upstream_settings(&cfg));
    pdgate::bootstrap::tracker::refresh_once(&pool, &up, &cfg.bootstrap, id, &base).await;
    let snap = pool.load_full();
    let w = &snap.prefills[0];
    assert_eq!(w.facts.ranks.len(), 8);
    assert!(
        w.facts.ranks.iter().all(|r| *r == RankReadiness::Ready),
        "{:?}",
        w.facts.ranks
    );
    // One after another, a slow server would cost 8 × its delay (and 8 × the timeout when
    // it is dead); asked together, every rank's route is in flight at once.
    assert_eq!(
        peak.load(Ordering::SeqCst),
        8,
        "rank routes in flight at once"
    );
}

/// The prefill's bootstrap heartbeat is lost while a request waits on its preflight (the
/// route answered fine, late): the request's watch must count that loss, so the request
/// ends at once with `prefill_lost` rather than going out on a prefill already known lost.
/// (The watch's baseline used to be taken after the preflight's await, and missed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_loss_during_the_preflight_reaches_the_request() {
    use crate::support::common::start;
    use pdgate_sim::{EngineConfig, Faults};

    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            // Neither the refresher nor the heartbeat looks again: every request meets a
            // stale view and checks its rank on the request path.
            c.bootstrap.refresh_interval_ms = 600_000;
            c.bootstrap.heartbeat_interval_ms = 600_000;
            c.bootstrap.freshness_ms = 1;
            c.bootstrap.preflight_timeout_ms = 5_000;
            c.retry.max_retries = 0;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let p = &env.cluster.prefills[0];
    p.set_faults(Faults {
        bootstrap_route_delay_ms: 400,
        ..Faults::default()
    });
    let routes = p.hits().bootstrap("GET /route");
    let req = {
        let env = &env;
        async move { env.post("/generate", r#"{"text":"a"}"#).await }
    };
    let lose = async {
        // The preflight's route request reached the bootstrap server: the loss now.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while p.hits().bootstrap("GET /route") == routes {
            assert!(tokio::time::Instant::now() < deadline, "no preflight");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        env.router
            .pool
            .update_worker(Role::Prefill, pdgate::types::WorkerId(0), |w| {
                w.shared().lost_tx.send_modify(|e| e.heartbeat += 1)
            });
    };
    let ((st, _, body), ()) = tokio::join!(req, lose);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    assert_eq!(
        (st.as_u16(), v["error"]["type"].as_str()),
        (502, Some("prefill_lost")),
        "{}",
        String::from_utf8_lossy(&body)
    );
}
