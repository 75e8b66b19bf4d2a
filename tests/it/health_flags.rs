//! Health checks with SGLang router's default flags (`--health-check-interval-secs 60
//! --health-check-timeout-secs 5 --health-failure-threshold 3 --health-success-threshold 2`),
//! which operators copy when they swap routers: workers that pass their first check are
//! routable at once, and a worker that is out is probed at the short unhealthy interval.

use crate::support::common;

use common::{add_sim_workers, client, fast_config, fast_engine, Env};
use pdgate::config::Config;
use pdgate::pd::RngSource;
use pdgate_sim::{EngineConfig, SimCluster};

const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;

fn sglang_health_flags(cfg: &mut Config) {
    cfg.health.interval_secs = 60.0;
    cfg.health.timeout_secs = 5.0;
    cfg.health.failure_threshold = 3;
    cfg.health.success_threshold = 2;
}

/// A cluster whose decode `down_decode` is down when the router starts.
async fn start_with_decode_down(down_decode: Option<usize>) -> Env {
    let prefill = vec![fast_engine(EngineConfig::prefill(2))];
    let decode = vec![
        fast_engine(EngineConfig::decode(1)),
        fast_engine(EngineConfig::decode(1)),
    ];
    let cluster = SimCluster::spawn(&prefill, &decode)
        .await
        .expect("sim cluster");
    if let Some(i) = down_decode {
        cluster.decodes[i].set_down(true);
    }
    let mut cfg = fast_config();
    add_sim_workers(&mut cfg, &cluster);
    sglang_health_flags(&mut cfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = pdgate::router::start(cfg, Some(listener), RngSource::Seeded(1.into()))
        .await
        .expect("router");
    Env {
        cluster,
        router,
        client: client(),
    }
}

#[tokio::test]
async fn workers_are_routable_after_their_first_good_check() {
    let env = start_with_decode_down(None).await;
    // Before the fix the success threshold (2) held every worker out until the second
    // check, 60 s after start: this bounded wait (10 s) failed.
    env.wait_routable(2, 2).await;
    let (status, _, body) = env.post("/generate", GEN).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

#[tokio::test]
async fn a_worker_that_comes_up_later_is_probed_at_the_unhealthy_interval() {
    let env = start_with_decode_down(Some(1)).await;
    env.wait_routable(2, 1).await;
    let before = env.cluster.decodes[1].stats().requests_total;
    env.cluster.decodes[1].set_down(false);
    // Probed every second while out (not every 60 s): back well within the 10 s bound.
    env.wait_routable(2, 2).await;
    // And it gets traffic again.
    let mut served = false;
    for _ in 0..20 {
        let (status, _, _) = env.post("/generate", GEN).await;
        assert_eq!(status, 200);
        if env.cluster.decodes[1].stats().requests_total > before {
            served = true;
            break;
        }
    }
    assert!(served, "the decode that came up got no request");
}
