//! The embedded bootstrap poll beyond the happy path: the request-path preflight when the
//! view is stale, the older wire generations (spec §2.8), and learning a prefill's
//! bootstrap port from its `/server_info` when `--prefill URL` gives none (or the older
//! `/get_server_info`), and prefill/decode pairs whose KV layouts disagree.

use crate::support::common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use common::start;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use pdgate::bootstrap::client::{self, Generation, RankRoute, Sentinel};
use pdgate::types::{Role, WorkerId};
use pdgate::upstream::{parse_base_url, Upstream};
use pdgate_sim::{EngineConfig, Faults};

/// With the background refresh far apart, a rank view older than the freshness bound is
/// checked again on the request path; a rank that went away is then not dispatched into.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_views_are_checked_on_the_request_path() {
    let env = start(
        vec![EngineConfig::prefill(2), EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.bootstrap.refresh_interval_ms = 600_000;
            // Nor the heartbeat (its sentinel would see the ranks go).
            c.bootstrap.heartbeat_interval_ms = 600_000;
            c.bootstrap.freshness_ms = 1;
        },
    )
    .await;
    env.wait_routable(4, 1).await;
    // Prefill 0 stops being registered; the heartbeat (bootstrap /health) stays fine and the
    // background refresh will not run again during the test: only the preflight can see it.
    env.cluster.prefills[0].set_faults(Faults {
        register_none: true,
        ..Faults::default()
    });
    // The simulator drops the ranks from its bootstrap table in the background: wait until
    // its server answers that way (as the preflight will ask it), and until the router's
    // view of them is older than the freshness bound (so that the preflight runs).
    let up = Upstream::new(&pdgate::router::upstream_settings(
        &pdgate::config::Config::default(),
    ));
    let base = parse_base_url(&env.cluster.prefills[0].bootstrap_url().unwrap()).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for r in 0..2 {
        loop {
            let route = client::rank_route(&up, &base, Generation::V3, r, Duration::from_secs(2))
                .await
                .unwrap();
            if !matches!(route, RankRoute::Ready { .. }) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "rank {r} still registered: {route:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    env.wait_pool("prefill 0's view older than the freshness bound", |s| {
        let w = s.worker(Role::Prefill, WorkerId(0)).unwrap();
        (0..2).all(|r| !w.per_rank.fresh.fresh_within(r, Duration::from_millis(1)))
    })
    .await;
    for _ in 0..8 {
        let (st, _, b) = env.post("/generate", r#"{"text":"a"}"#).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    assert_eq!(
        env.cluster.prefills[0].stats().requests_total,
        0,
        "no leg went to the unregistered prefill"
    );
    let snap = env.router.pool.load();
    let p0 = snap.worker(Role::Prefill, WorkerId(0)).unwrap();
    assert!(
        p0.facts.ranks.iter().all(|r| r.label() == "bootstrapping"),
        "{:?}",
        p0.facts.ranks
    );
}

/// A prefill given without a bootstrap port: the port comes from its `/server_info`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_port_is_learned_from_server_info() {
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.prefill[0].bootstrap_port = None;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    let snap = env.router.pool.load();
    let b = snap.prefills[0].facts.bootstrap.as_ref().unwrap();
    assert_eq!(Some(b.port), env.cluster.prefills[0].bootstrap_port());
    let (st, _, _) = env.post("/generate", r#"{"text":"a"}"#).await;
    assert_eq!(st, 200);
    assert_eq!(env.settled_stats().await.contract_violations, 0);
}

/// A plain HTTP server on 127.0.0.1 answering every request with `answer(path, query)`.
async fn fake_server(
    answer: fn(&str, &str) -> (u16, String),
) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| async move {
                    let (status, body) = answer(req.uri().path(), req.uri().query().unwrap_or(""));
                    let mut r = Response::new(Full::new(Bytes::from(body)));
                    *r.status_mut() = StatusCode::from_u16(status).unwrap();
                    Ok::<_, Infallible>(r)
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (url, task)
}

/// A bootstrap server of an older generation (v1/v2), answering as those did: its own
/// query parameters, old sentinel JSON, and a KeyError (500) for an unknown rank.
async fn old_server(gen: Generation) -> (String, tokio::task::JoinHandle<()>) {
    let answer: fn(&str, &str) -> (u16, String) = match gen {
        Generation::V1 => |path, q| old_answer(Generation::V1, path, q),
        Generation::V2 => |path, q| old_answer(Generation::V2, path, q),
        Generation::V3 => panic!("V3 is what the simulator and SGLang's own server speak"),
    };
    fake_server(answer).await
}

fn old_answer(gen: Generation, path: &str, q: &str) -> (u16, String) {
    let p = |k: &str| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .map(str::to_string)
    };
    match gen {
        _ if path == "/health" => (200, "OK".to_string()),
        Generation::V2
            if p("engine_rank").is_none()
                || p("target_dp_group").is_none()
                || p("target_pp_rank").is_none() =>
        {
            (400, "Missing inputs for bootstrap server.".to_string())
        }
        Generation::V1 if p("engine_rank").is_none() || p("target_dp_group").is_none() => {
            (400, "Missing inputs for bootstrap server.".to_string())
        }
        Generation::V2 if p("engine_rank").as_deref() == Some("-1") => (
            200,
            r#"{"prefill_attn_tp_size":1,"prefill_dp_size":2,"prefill_pp_size":1}"#.to_string(),
        ),
        Generation::V1 if p("engine_rank").as_deref() == Some("-1") => (
            200,
            r#"{"prefill_tp_size":1,"prefill_dp_size":2}"#.to_string(),
        ),
        _ => match p("target_dp_group").as_deref() {
            Some("0") | Some("1") => (
                200,
                r#"{"rank_ip":"127.0.0.1","rank_port":17000}"#.to_string(),
            ),
            _ => (
                500,
                "500 Internal Server Error\n\nServer got itself in trouble".to_string(),
            ),
        },
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn older_bootstrap_generations_are_understood() {
    let up = Upstream::new(&pdgate::router::upstream_settings(
        &pdgate::config::Config::default(),
    ));
    for gen in [Generation::V1, Generation::V2] {
        let (url, task) = old_server(gen).await;
        let base = parse_base_url(&url).unwrap();
        let t = Duration::from_secs(2);
        let Sentinel::Ready(layout) = client::sentinel(&up, &base, None, t).await.unwrap() else {
            panic!("{gen:?}: not ready")
        };
        assert_eq!(layout.generation, gen);
        assert_eq!(layout.dp_size, 2);
        assert!(layout.follow_bootstrap_room);
        for r in 0..2 {
            assert!(
                matches!(
                    client::rank_route(&up, &base, gen, r, t).await.unwrap(),
                    RankRoute::Ready {
                        rank_port: 17000,
                        ..
                    }
                ),
                "{gen:?} rank {r}"
            );
        }
        assert!(
            matches!(
                client::rank_route(&up, &base, gen, 5, t).await.unwrap(),
                RankRoute::Missing(_)
            ),
            "{gen:?}: a KeyError means the rank is missing"
        );
        task.abort();
    }
}

/// A prefill and a decode that disagree on page size or KV dtype are found (and warned
/// about, and counted in `pdgate_layout_mismatches`) once both sides have reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_mismatches_between_prefill_and_decode_are_found() {
    let mut odd = EngineConfig::decode(1);
    odd.page_size = 16;
    odd.kv_cache_dtype = "fp8_e4m3".to_string();
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1), odd],
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    let odd_url = env.cluster.decodes[1].url();
    // Both sides have reported once the prefill's layout and every decode's server info are
    // known; only then are the mismatches final.
    env.wait_pool("the prefill's layout and both decodes' server info", |s| {
        s.prefills[0].facts.layout.is_some()
            && s.decodes.iter().all(|d| {
                env.router
                    .pool
                    .with_worker(Role::Decode, d.shared.id, |w| w.facts.info.is_some())
                    .unwrap_or(false)
            })
    })
    .await;
    let found = env.router.pool.layout_mismatches();
    let mut got: Vec<_> = found
        .iter()
        .map(|m| (m.what, m.prefill_value.as_str(), m.decode_value.as_str()))
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("kv_cache_dtype", "auto", "fp8_e4m3"),
            ("page_size", "1", "16")
        ],
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .all(|m| m.decode.trim_end_matches('/') == odd_url.trim_end_matches('/')),
        "only the odd decode disagrees: {found:?}"
    );
}

/// An engine that answers only `/get_server_info` (`knows_it`), or nothing at all.
async fn info_server(knows_it: bool) -> (String, tokio::task::JoinHandle<()>) {
    const INFO: &str = r#"{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":8999,"dp_size":2,"page_size":64,"kv_cache_dtype":"auto","version":"0.4.6"}"#;
    const NOT_FOUND: &str = r#"{"detail":"Not Found"}"#;
    if knows_it {
        fake_server(|path, _| match path {
            "/get_server_info" => (200, INFO.to_string()),
            _ => (404, NOT_FOUND.to_string()),
        })
        .await
    } else {
        fake_server(|_, _| (404, NOT_FOUND.to_string())).await
    }
}

/// Engines older than `/server_info` answer `/get_server_info`; both are tried in turn.
#[tokio::test(crate = "crate::support::rt")]
async fn server_info_falls_back_to_get_server_info() {
    let up = Upstream::new(&pdgate::router::upstream_settings(
        &pdgate::config::Config::default(),
    ));
    let t = Duration::from_secs(2);
    let (url, task) = info_server(true).await;
    let info = client::server_info(&up, &parse_base_url(&url).unwrap(), t)
        .await
        .unwrap();
    assert_eq!(info.disaggregation_bootstrap_port, Some(8999));
    assert_eq!(info.dp_size, Some(2));
    assert_eq!(info.page_size, Some(64));
    assert_eq!(info.version.as_deref(), Some("0.4.6"));
    task.abort();
    // Neither route: an error naming the last answer.
    let (url, task) = info_server(false).await;
    let err = client::server_info(&up, &parse_base_url(&url).unwrap(), t)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("404"), "{err}");
    task.abort();
}

/// Ranks failed by the request path (a preflight that found the bootstrap server down) while
/// the heartbeat never missed: once the server answers ready again, the next heartbeat
/// re-reads the routes, instead of leaving the prefill out until the slow re-read
/// (`refresh_interval`). Seen in the chaos soak: a prefill out for the 10 s after the faults
/// cleared, its ranks `failed` (unreachable), breaker closed, healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_failed_by_the_request_path_come_back_with_the_next_ready_heartbeat() {
    use pdgate::pool::{RankFailure, RankReadiness};
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.bootstrap.refresh_interval_ms = 600_000;
            c.bootstrap.heartbeat_interval_ms = 200;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    // What a preflight does when it cannot reach the bootstrap server (both ranks failed);
    // the refresher's re-read that it signals came and went while the server was still
    // down, so nothing but the heartbeat runs now, and it sees a ready server throughout.
    env.router
        .pool
        .update_worker_if(Role::Prefill, WorkerId(0), |w| {
            let now = std::time::Instant::now();
            let failed = RankReadiness::Failed {
                reason: RankFailure::Unreachable,
                since: now,
            };
            let a = pdgate::bootstrap::tracker::set_rank(w, 0, failed.clone(), now);
            let b = pdgate::bootstrap::tracker::set_rank(w, 1, failed, now);
            a || b
        });
    assert_eq!(
        env.router.pool.load().routable_ranks(Role::Prefill),
        0,
        "the ranks are out"
    );
    // Back within a few heartbeats (wait_routable's bound: 10 s; the slow re-read is 600 s).
    env.wait_routable(2, 1).await;
    let (st, _, b) = env.post("/generate", r#"{"text":"a"}"#).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
}
