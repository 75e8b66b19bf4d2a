//! The room-to-rank contract end to end: pdgate in front of simulated SGLang engines, for
//! prefill DP ∈ {1, 2, 4, 8} × decode DP ∈ {1, 2, 3} × both contract modes × single / batch
//! / n > 1 × streaming or not, on all three routes. Every request must succeed and the
//! simulators (which check, for every room, that decode resolves the rank the prefill ran
//! it on, that no room is reused and that both legs carry the same bootstrap fields) must
//! count zero violations. A negative control shows the simulator does catch a violation.

use crate::support::common;

use std::time::Duration;

use common::{sse_events, start};
use futures_util::future::join_all;
use pdgate::config::ContractMode;
use pdgate_sim::EngineConfig;
use rand::{Rng, SeedableRng};

/// One request shape: (route, body, instances).
fn shapes(rng: &mut impl Rng, stream: bool) -> Vec<(&'static str, String, usize)> {
    let b = rng.random_range(2..=4usize);
    let n = rng.random_range(2..=3usize);
    let texts: Vec<String> = (0..b).map(|i| format!("\"prompt {i}\"")).collect();
    vec![
        (
            "/generate",
            format!(
                r#"{{"text":"hello","sampling_params":{{"max_new_tokens":3}},"stream":{stream}}}"#
            ),
            1,
        ),
        (
            "/generate",
            format!(
                r#"{{"text":[{}],"sampling_params":{{"max_new_tokens":2}},"stream":{stream}}}"#,
                texts.join(",")
            ),
            b,
        ),
        (
            "/generate",
            format!(
                r#"{{"input_ids":[[1,2],[3,4]],"sampling_params":{{"max_new_tokens":2,"n":{n}}},"stream":{stream}}}"#
            ),
            2 * n,
        ),
        (
            "/v1/chat/completions",
            format!(
                r#"{{"model":"sim-model","messages":[{{"role":"user","content":"hi"}}],"max_tokens":3,"stream":{stream}}}"#
            ),
            1,
        ),
        (
            "/v1/chat/completions",
            format!(
                r#"{{"model":"sim-model","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2,"n":{n},"stream":{stream}}}"#
            ),
            n,
        ),
        (
            "/v1/completions",
            format!(
                r#"{{"model":"sim-model","prompt":[{}],"max_tokens":2,"stream":{stream}}}"#,
                texts.join(",")
            ),
            b,
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"sim-model","prompt":[1,2,3],"max_tokens":2,"stream":{stream}}}"#),
            1,
        ),
    ]
}

async fn run_matrix(dp_p: u32, mode: ContractMode) {
    for dp_d in [1u32, 2, 3] {
        let env = start(
            vec![EngineConfig::prefill(dp_p), EngineConfig::prefill(dp_p)],
            vec![EngineConfig::decode(dp_d), EngineConfig::decode(dp_d)],
            |c| c.contract.mode = mode,
        )
        .await;
        env.wait_routable(2 * dp_p as usize, 2 * dp_d as usize)
            .await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(dp_p * 10 + dp_d));
        let mut expected_instances = 0usize;
        // Enough rounds that round robin visits every prefill rank with every shape.
        for round in 0..(2 * dp_p as usize).max(2) {
            let stream = round % 2 == 1;
            let batch = shapes(&mut rng, stream);
            let futs = batch.iter().map(|(path, body, _)| env.post(path, body));
            let results = join_all(futs).await;
            for ((path, body, instances), (status, _, bytes)) in batch.iter().zip(results) {
                expected_instances += instances;
                let text = String::from_utf8_lossy(&bytes);
                assert_eq!(
                    status.as_u16(),
                    200,
                    "dp_p={dp_p} dp_d={dp_d} {mode:?} {path} {body}: {text}"
                );
                if stream {
                    let (events, done) = sse_events(&bytes);
                    assert!(done, "stream ended without [DONE]: {text}");
                    assert!(!events.is_empty());
                    assert!(
                        events.iter().all(|e| e.get("error").is_none()),
                        "error event: {text}"
                    );
                } else {
                    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("json answer");
                    assert!(v.get("error").is_none(), "{text}");
                }
            }
        }
        let s = env.settled_stats().await;
        assert_eq!(
            s.contract_violations, 0,
            "dp_p={dp_p} dp_d={dp_d} {mode:?}: {s:?}"
        );
        assert_eq!(s.failed, 0, "dp_p={dp_p} dp_d={dp_d} {mode:?}: {s:?}");
        // Every prefill rank of every prefill ran something.
        for p in &env.cluster.prefills {
            let ps = p.stats();
            assert!(
                ps.requests_per_rank.iter().all(|n| *n > 0),
                "unused prefill rank: {:?}",
                ps.requests_per_rank
            );
        }
        // Every instance crossed the KV rendezvous exactly once.
        assert_eq!(s.kv_transfers as usize, expected_instances, "{s:?}");
        env.router.server.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp1_modulo() {
    run_matrix(1, ContractMode::Modulo).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp2_modulo() {
    run_matrix(2, ContractMode::Modulo).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp4_modulo() {
    run_matrix(4, ContractMode::Modulo).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp8_modulo() {
    run_matrix(8, ContractMode::Modulo).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp1_pinned() {
    run_matrix(1, ContractMode::Pinned).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp2_pinned() {
    run_matrix(2, ContractMode::Pinned).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp4_pinned() {
    run_matrix(4, ContractMode::Pinned).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_dp8_pinned() {
    run_matrix(8, ContractMode::Pinned).await;
}

/// Negative control: legs sent by hand whose decode hint names another rank than the one
/// the room maps to. The simulator must count the violation (and the decode waits, as a
/// real one would, until the client gives up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulator_catches_a_rank_mismatch() {
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    let p = &env.cluster.prefills[0];
    let d = &env.cluster.decodes[0];
    let room = 1000u64; // room % 2 == 0: the prefill runs it on rank 0
    let port = p.bootstrap_port().unwrap();
    let body = |rid: &str, hint: &str| {
        format!(
            r#"{{"text":"x","sampling_params":{{"max_new_tokens":1}},"bootstrap_host":"127.0.0.1","bootstrap_port":{port},"bootstrap_room":{room},"rid":"{rid}"{hint}}}"#
        )
    };
    let client = common::client();
    let send = |url: String, b: String| {
        let client = client.clone();
        async move {
            let req = http::Request::post(url)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(b)))
                .unwrap();
            client.request(req).await
        }
    };
    let pf = tokio::spawn(send(format!("{}/generate", p.url()), body("neg-p", "")));
    let df = tokio::spawn(send(
        format!("{}/generate", d.url()),
        body("neg-d", r#","disagg_prefill_dp_rank":1"#),
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = env.stats();
        if s.violation_rank_mismatch >= 1 {
            assert!(s.contract_violations >= 1);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "violation not detected: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pf.abort();
    df.abort();
}
