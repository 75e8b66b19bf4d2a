//! Health checks with SGLang router's default flags (`--health-check-interval-secs 60
//! --health-check-timeout-secs 5 --health-failure-threshold 3 --health-success-threshold 2`),
//! which operators copy when they swap routers: workers that pass their first check are
//! routable at once, and a worker that is out is probed at the short unhealthy interval.

use crate::support::common;

use common::{start, Env};
use pdgate::config::Config;
use pdgate_sim::{EngineConfig, Faults};

const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;

fn sglang_health_flags(cfg: &mut Config) {
    cfg.health.interval_secs = 60.0;
    cfg.health.timeout_secs = 5.0;
    cfg.health.failure_threshold = 3;
    cfg.health.success_threshold = 2;
}

/// One prefill and two decodes; decode `down_decode` is down when the router starts.
async fn start_with_decode_down(down_decode: Option<usize>) -> Env {
    let decode = |i: usize| EngineConfig {
        faults: Faults {
            down: Some(i) == down_decode,
            ..Faults::default()
        },
        ..EngineConfig::decode(1)
    };
    start(
        vec![EngineConfig::prefill(2)],
        vec![decode(0), decode(1)],
        sglang_health_flags,
    )
    .await
}

#[tokio::test(crate = "crate::support::rt")]
async fn workers_are_routable_after_their_first_good_check() {
    let env = start_with_decode_down(None).await;
    // Before the fix the success threshold (2) held every worker out until the second
    // check, 60 s after start: this bounded wait (10 s) failed.
    env.wait_routable(2, 2).await;
    let (status, _, body) = env.post("/generate", GEN).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

#[tokio::test(crate = "crate::support::rt")]
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
