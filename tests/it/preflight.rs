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
        w.healthy = true;
        w.layout = Some(Layout {
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
    let boot = w.bootstrap.clone().expect("bootstrap");
    let probes = w.probes.clone();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (pool, up, boot, probes) = (pool.clone(), up.clone(), boot.clone(), probes.clone());
        let id = w.id;
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

#[tokio::test]
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
    assert_eq!(snap.prefills[0].ranks.get(1), Some(&RankReadiness::Ready));
    // Another rank is another flight; and once a check ended, the next one goes out.
    let got = checks(&pool, &up, 0, 5).await;
    assert!(got.iter().all(|o| *o == PreflightOutcome::Ready));
    assert_eq!(count.load(Ordering::SeqCst), 2);
    checks(&pool, &up, 1, 1).await;
    assert_eq!(count.load(Ordering::SeqCst), 3);
}

#[tokio::test]
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
    assert_eq!(snap.prefills[0].ranks[0].label(), "failed");
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

#[tokio::test]
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
    assert_eq!(w.ranks.len(), 8);
    assert!(
        w.ranks.iter().all(|r| *r == RankReadiness::Ready),
        "{:?}",
        w.ranks
    );
    // One after another, a slow server would cost 8 × its delay (and 8 × the timeout when
    // it is dead); asked together, every rank's route is in flight at once.
    assert_eq!(
        peak.load(Ordering::SeqCst),
        8,
        "rank routes in flight at once"
    );
}
