//! What an engine reports is bounded: a DP size above `MAX_DP_SIZE` (it sizes per-rank
//! vectors on every snapshot rebuild) refuses the worker, with an error naming it, instead
//! of making the router allocate whatever the engine says.

use crate::support::common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use pdgate::config::{Config, DecodeWorkerConfig, PrefillWorkerConfig};
use pdgate::dispatch::RngSource;
use pdgate::types::Role;

/// An engine (and bootstrap server, on the same port) that claims `dp_size` ranks.
async fn huge_engine(dp_size: u64) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| async move {
                let body = match req.uri().path() {
                    "/health" => String::new(),
                    "/server_info" => format!(
                        r#"{{"dp_size":{dp_size},"disaggregation_bootstrap_port":{}}}"#,
                        addr.port()
                    ),
                    // The sentinel: every rank registered.
                    "/route" => format!(
                        r#"{{"dp_size":{dp_size},"attn_tp_size":1,"attn_cp_size":1,"pp_size":1,"follow_bootstrap_room":true}}"#
                    ),
                    _ => String::from("{}"),
                };
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(crate = "crate::support::rt")]
async fn engines_reporting_a_huge_dp_size_are_refused() {
    let prefill = huge_engine(5_000).await;
    let decode = huge_engine(100_000).await;
    let mut cfg: Config = common::fast_config();
    cfg.prefill.push(PrefillWorkerConfig {
        url: prefill.clone(),
        bootstrap_port: None,
        bootstrap_host: None,
        model: None,
    });
    cfg.decode.push(DecodeWorkerConfig {
        url: decode.clone(),
        model: None,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = pdgate::router::start(cfg, Some(listener), RngSource::Seeded(1.into()))
        .await
        .expect("router");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = router.pool.load();
        let d = &s.decodes[0];
        let p = &s.prefills[0];
        if d.facts.refusal().is_some()
            && p.facts.refusal().is_some()
            && p.facts.ranks.iter().any(|r| r.label() == "failed")
        {
            let why = d.facts.refusal().unwrap_or_default();
            assert!(
                why.contains("dp_size 100000") && why.contains("1024"),
                "{why}"
            );
            // Nothing sized by the engine's claim.
            assert!(d.per_rank.loads.len() <= 1 && p.per_rank.loads.len() <= 1);
            assert!(p.facts.ranks.len() <= 1 && p.facts.layout.is_none());
            assert_eq!(s.routable_ranks(Role::Prefill), 0);
            assert_eq!(s.routable_ranks(Role::Decode), 0);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not refused in time: decode {:?}, prefill {:?} {:?}",
            d.facts.refusal(),
            p.facts.refusal(),
            p.facts.ranks
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The readiness document names why.
    let c = common::client();
    let resp = c
        .get(format!("{}/readiness", router.url()).parse().expect("uri"))
        .await
        .expect("readiness");
    assert_eq!(resp.status(), 503);
}
