//! The load- and cache-aware policies end to end: a multi-turn conversation keeps landing on
//! the same prefill (prefix affinity), and with DP on the same prefill rank and decode rank
//! (one prefix cache per rank), load spreads, and the contract still holds.

use crate::support::common;

use common::start;
use pdgate::config::{ContractMode, PolicyKind};
use pdgate_sim::{EngineConfig, StatsSnapshot};

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
            // Odd turns stream (a continuable stream: its account cuts the usage pdgate
            // asked for out of what the client gets, and the tally still counts it).
            let body = format!(
                r#"{{"model":"sim-model","messages":[{}],"max_tokens":2,"stream":{}}}"#,
                messages.join(","),
                turn % 2 == 1
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

/// Which (engine, rank)s ran something between two readings of per-rank request counts.
fn ranks_used(before: &[Vec<u64>], after: &[Vec<u64>]) -> Vec<(usize, usize)> {
    let mut used = Vec::new();
    for (e, (b, a)) in before.iter().zip(after).enumerate() {
        for (k, (x, y)) in b.iter().zip(a).enumerate() {
            if y > x {
                used.push((e, k));
            }
        }
    }
    used
}

fn per_rank(engines: &[pdgate_sim::SimEngine]) -> Vec<Vec<u64>> {
    engines
        .iter()
        .map(|e| e.stats().requests_per_rank)
        .collect()
}

async fn conversations_stay_on_their_ranks(mode: ContractMode) {
    let with_cache = |mut e: EngineConfig| {
        e.prefill_prefix_cache_tokens = 20_000;
        e.decode_prefix_cache_tokens = 20_000;
        // As SGLang's `--enable-cache-report`: OpenAI answers carry `cached_tokens`.
        e.enable_cache_report = true;
        e
    };
    let env = start(
        vec![
            with_cache(EngineConfig::prefill(4)),
            with_cache(EngineConfig::prefill(4)),
        ],
        vec![
            with_cache(EngineConfig::decode(4)),
            with_cache(EngineConfig::decode(2)),
        ],
        |c| {
            c.policy.prefill = PolicyKind::CacheAware;
            c.policy.decode = PolicyKind::CacheAware;
            c.contract.mode = mode;
        },
    )
    .await;
    env.wait_routable(8, 6).await;
    let (mut prefill_members, mut decode_members) = (Vec::new(), Vec::new());
    for conv in 0..6 {
        let system = (0..40)
            .map(|i| format!("c{conv}w{i}"))
            .collect::<Vec<_>>()
            .join(" ");
        let mut messages = vec![
            format!(r#"{{"role":"system","content":"{system}"}}"#),
            format!(r#"{{"role":"user","content":"conversation {conv} starts here"}}"#),
        ];
        let (mut on_p, mut on_d) = (Vec::new(), Vec::new());
        for turn in 0..4 {
            env.settled_stats().await;
            let (p0, d0) = (
                per_rank(&env.cluster.prefills),
                per_rank(&env.cluster.decodes),
            );
            let body = format!(
                r#"{{"model":"sim-model","messages":[{}],"max_tokens":2}}"#,
                messages.join(",")
            );
            let (st, _, bytes) = env.post("/v1/chat/completions", &body).await;
            assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
            env.settled_stats().await;
            on_p.extend(ranks_used(&p0, &per_rank(&env.cluster.prefills)));
            on_d.extend(ranks_used(&d0, &per_rank(&env.cluster.decodes)));
            messages.push(format!(
                r#"{{"role":"assistant","content":"answer {turn}"}}"#
            ));
            messages.push(format!(r#"{{"role":"user","content":"follow-up {turn}"}}"#));
        }
        on_p.dedup();
        on_d.dedup();
        assert_eq!(
            on_p.len(),
            1,
            "{mode:?} conversation {conv}: prefill ranks {on_p:?}"
        );
        assert_eq!(
            on_d.len(),
            1,
            "{mode:?} conversation {conv}: decode ranks {on_d:?}"
        );
        prefill_members.extend(on_p);
        decode_members.extend(on_d);
    }
    // Different conversations use different ranks (6 keys over 8 and 6 members: all on one
    // has odds of about 1 in 30,000).
    prefill_members.sort();
    prefill_members.dedup();
    decode_members.sort();
    decode_members.dedup();
    assert!(prefill_members.len() >= 2, "{prefill_members:?}");
    assert!(decode_members.len() >= 2, "{decode_members:?}");
    let s: StatsSnapshot = env.settled_stats().await;
    assert_eq!(s.contract_violations, 0, "{s:?}");
    assert_eq!(s.failed, 0, "{s:?}");
    // Turns 2-4 find their conversation so far in the rank's caches, on both sides.
    let (hp, hd) = (
        s.prefill_cache_hit_ratio().unwrap_or(0.0),
        s.decode_cache_hit_ratio().unwrap_or(0.0),
    );
    assert!(hp > 0.5 && hd > 0.5, "{mode:?}: hit ratios {hp} {hd}");
    // pdgate's tally per (prefill, rank), from the answers' `cached_tokens`, is the
    // engines' own count rank by rank.
    let scrape = pdgate::telemetry::render_derived(&*env.router.pool);
    let mut seen: Vec<u64> = samples(&scrape, "pdgate_rank_cached_tokens_total{role=\"prefill\"");
    let mut want: Vec<u64> = env
        .cluster
        .prefills
        .iter()
        .flat_map(|p| p.stats().prefill_prefix_cached_tokens)
        .collect();
    seen.retain(|v| *v > 0);
    want.retain(|v| *v > 0);
    seen.sort_unstable();
    want.sort_unstable();
    assert!(!want.is_empty(), "{s:?}");
    assert_eq!(seen, want, "{mode:?}: per-rank cached tokens\n{scrape}");
    let prompt: u64 = samples(&scrape, "pdgate_rank_prompt_tokens_total{role=\"prefill\"")
        .iter()
        .sum();
    assert!(prompt > want.iter().sum::<u64>(), "{scrape}");
    env.router.server.shutdown().await;
}

/// The values of the samples whose line starts with `prefix`.
fn samples(scrape: &str, prefix: &str) -> Vec<u64> {
    scrape
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse().ok()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_a_conversation_on_its_ranks_modulo() {
    conversations_stay_on_their_ranks(ContractMode::Modulo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_a_conversation_on_its_ranks_pinned() {
    conversations_stay_on_their_ranks(ContractMode::Pinned).await;
}

/// A client's routing key (`[affinity]`) places every request that carries it, whatever
/// its prompt: on `cache_aware` always, on another policy with sticky sessions only; a value
/// that cannot be a key is refused with an OpenAI-style 400 before any leg is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_key_places_its_requests_whatever_the_prompt() {
    use http_body_util::BodyExt;
    // (policy, sticky, header, one prefill for all requests of a key)
    let cases = [
        (PolicyKind::CacheAware, false, "x-smg-routing-key", true),
        (PolicyKind::CacheAware, false, "x-session-id", true),
        (PolicyKind::RoundRobin, true, "x-smg-routing-key", true),
        (PolicyKind::RoundRobin, true, "x-session-id", true),
        (PolicyKind::RoundRobin, false, "x-smg-routing-key", false),
    ];
    for (kind, sticky, header, one) in cases {
        let env = start(
            vec![
                EngineConfig::prefill(1),
                EngineConfig::prefill(1),
                EngineConfig::prefill(1),
            ],
            vec![EngineConfig::decode(1)],
            |c| {
                c.policy.prefill = kind;
                c.affinity.sticky = sticky;
            },
        )
        .await;
        env.wait_routable(3, 1).await;
        for key in ["session-a", "session-b"] {
            let before: Vec<u64> = env
                .cluster
                .prefills
                .iter()
                .map(|p| p.stats().requests_total)
                .collect();
            for turn in 0..6 {
                let body = format!(
                    r#"{{"text":"prompt {turn} of {key}","sampling_params":{{"max_new_tokens":2}}}}"#
                );
                let resp = env
                    .send(
                        "POST",
                        "/generate",
                        &[("content-type", "application/json"), (header, key)],
                        body,
                    )
                    .await;
                assert_eq!(resp.status(), 200, "{kind:?} {header}");
                let _ = resp.into_body().collect().await;
            }
            let used = env
                .cluster
                .prefills
                .iter()
                .enumerate()
                .filter(|(i, p)| p.stats().requests_total > before[*i])
                .count();
            assert_eq!(
                used == 1,
                one,
                "{kind:?} sticky={sticky} {header}: {used} prefills"
            );
        }
        let prefill_requests = || -> u64 {
            env.cluster
                .prefills
                .iter()
                .map(|p| p.stats().requests_total)
                .sum()
        };
        let before = prefill_requests();
        let long = "k".repeat(pdgate::request::MAX_KEY_BYTES + 1);
        let resp = env
            .send(
                "POST",
                "/generate",
                &[("content-type", "application/json"), (header, &long)],
                r#"{"text":"hi"}"#,
            )
            .await;
        assert_eq!(resp.status(), 400);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON error");
        assert_eq!(v["error"]["type"], "invalid_request", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(header)),
            "{v}"
        );
        assert_eq!(before, prefill_requests(), "a refused key sent a leg");
    }
}
