//! The load- and cache-aware policies end to end: a multi-turn conversation keeps landing on
//! the same prefill (prefix affinity), load spreads, and the contract still holds.

use crate::support::common;

use common::start;
use pdgate::config::PolicyKind;
use pdgate_sim::EngineConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_a_conversation_on_one_prefill() {
    let env = start(
        vec![
            EngineConfig::prefill(2),
            EngineConfig::prefill(2),
            EngineConfig::prefill(2),
        ],
        vec![EngineConfig::decode(2), EngineConfig::decode(2)],
        |c| {
            c.policy.prefill = PolicyKind::CacheAware;
            c.policy.decode = PolicyKind::PowerOfTwo;
            c.policy.load_poll_interval_ms = 50;
        },
    )
    .await;
    env.wait_routable(6, 4).await;
    for conv in 0..6 {
        let before: Vec<u64> = env
            .cluster
            .prefills
            .iter()
            .map(|p| p.stats().requests_total)
            .collect();
        let mut messages = vec![format!(
            r#"{{"role":"user","content":"conversation {conv} starts here"}}"#
        )];
        for turn in 0..4 {
            let body = format!(
                r#"{{"model":"sim-model","messages":[{}],"max_tokens":2}}"#,
                messages.join(",")
            );
            let (st, _, bytes) = env.post("/v1/chat/completions", &body).await;
            assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
            messages.push(format!(
                r#"{{"role":"assistant","content":"answer {turn}"}}"#
            ));
            messages.push(format!(r#"{{"role":"user","content":"follow-up {turn}"}}"#));
        }
        let used: Vec<usize> = env
            .cluster
            .prefills
            .iter()
            .enumerate()
            .filter(|(i, p)| p.stats().requests_total > before[*i])
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            used.len(),
            1,
            "conversation {conv} spread over prefills {used:?}"
        );
    }
    let s = env.settled_stats().await;
    assert_eq!(s.contract_violations, 0);
    assert_eq!(s.failed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_of_two_spreads_load() {
    let env = start(
        vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1), EngineConfig::decode(1)],
        |c| {
            c.policy.prefill = PolicyKind::PowerOfTwo;
            c.policy.decode = PolicyKind::PowerOfTwo;
        },
    )
    .await;
    env.wait_routable(2, 2).await;
    let body = r#"{"text":"x","sampling_params":{"max_new_tokens":2}}"#;
    let futs = (0..40).map(|_| env.post("/generate", body));
    for (st, _, b) in futures_util::future::join_all(futs).await {
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    for e in env.cluster.engines() {
        assert!(
            e.stats().requests_total > 0,
            "an engine got nothing: {:?}",
            e.stats()
        );
    }
    assert_eq!(env.settled_stats().await.contract_violations, 0);
}
