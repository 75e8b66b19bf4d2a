//! A regular worker's stream moves like a decode's (`dispatch::moves`): a regular worker that
//! dies mid-stream costs the client nothing but latency when another worker of its model
//! exists (another regular worker, or a PD pair), and a PD stream with no other decode
//! moves to a regular worker of its model. The simulator's tokens depend on the prompt it
//! receives, so a replay from scratch or a continuation without the partial answer fails
//! `check_moved`.

use pdgate::types::Role;
use pdgate_sim::{EngineConfig, Faults, SimEngine};
use serde_json::Value;

use crate::regular_workers::mixed;
use crate::stream_moves::{ask, cases, check_moved, streams_survive_a_kill, Case};
use crate::support::common::*;

/// `n` regular workers of model `m` (SGLang's plain mode; `engine` adjusts each), behind a
/// router over them alone (no PD pair; round robin; `cfg` adjusts the config), routable,
/// and their URLs.
pub(crate) async fn regular_fleet(
    n: usize,
    engine: impl Fn(&mut EngineConfig),
    cfg: impl FnOnce(&mut pdgate::config::Config),
) -> (Env, Vec<SimEngine>, Vec<String>) {
    let mut regular = Vec::new();
    for _ in 0..n {
        let mut e = fast_engine(EngineConfig::regular(1));
        engine(&mut e);
        regular.push(pdgate_sim::spawn(e).await.expect("regular engine"));
    }
    let urls: Vec<String> = regular.iter().map(SimEngine::url).collect();
    let env = over_regular(&urls, cfg).await;
    (env, regular, urls)
}

/// A router over the regular workers at `urls` alone, routable.
async fn over_regular(urls: &[String], cfg: impl FnOnce(&mut pdgate::config::Config)) -> Env {
    let env = start(vec![], vec![], |c| {
        c.add_regular_workers(urls.iter().cloned());
        c.policy.decode = pdgate::config::PolicyKind::RoundRobin;
        cfg(c);
    })
    .await;
    let n = urls.len();
    env.wait_pool("the regular workers routable", |s| {
        s.routable_ranks(Role::Regular) == n
    })
    .await;
    env
}

/// A regular worker that dies mid-stream costs the client nothing but latency, as a decode
/// does (`dispatch::moves`): two regular workers of one model (no PD pair), the first cut after
/// 3 chunks. Every route's stream continues on the other worker, which got the prompt plus
/// what the client already had (the simulator's tokens depend on the prompt it receives,
/// so a replay from scratch fails `check_moved`), with the limit reduced by the tokens
/// sent; the client's answer is the uninterrupted one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regular_workers_stream_moves_to_the_other_regular_worker() {
    let (env, regular, _) = regular_fleet(2, |_| {}, |_| {}).await;
    let bodies = |e: &SimEngine| -> Vec<Value> {
        e.recent_generate_bodies()
            .into_iter()
            .map(|(_, b)| b)
            .collect()
    };
    for c in cases(true) {
        regular[0].set_faults(Faults::default());
        let whole = ask(&env, &c, false).await;
        assert_eq!(whole.tokens, c.limit, "{}: {whole:?}", c.name);
        regular[0].set_faults(Faults {
            decode_die_mid_stream_after: Some(3),
            ..Faults::default()
        });
        let mut moved = false;
        for _ in 0..4 {
            let before = [bodies(&regular[0]).len(), bodies(&regular[1]).len()];
            let got = ask(&env, &c, false).await;
            let after = [bodies(&regular[0]), bodies(&regular[1])];
            if after[0].len() == before[0] {
                // Served by the healthy worker alone.
                assert_eq!(got.text, whole.text, "{}", c.name);
                continue;
            }
            assert_eq!(
                after[1].len(),
                before[1] + 1,
                "{}: one follow-up on the other worker",
                c.name
            );
            check_moved(&c, &whole, &got, &after[1][before[1]]);
            moved = true;
            break;
        }
        assert!(moved, "{}: no request reached the dying worker", c.name);
    }
}

/// A PD stream whose model has no other decode continues on a regular worker of that
/// model (`models.regular_fallback`, as a retry would): model-b's one decode dies after 3
/// chunks; the client's answer is the uninterrupted one, and one of model-b's regular
/// workers got the prompt plus the partial answer, with the limit reduced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pd_stream_with_no_other_decode_moves_to_a_regular_worker() {
    let f = mixed(|_| {}).await;
    let env = &f.env;
    let c = Case {
        name: "model-b chat",
        path: "/v1/chat/completions",
        body: serde_json::json!({"model": "model-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": true}),
        limit: 12,
    };
    let whole = ask(env, &c, false).await;
    assert_eq!(whole.tokens, c.limit, "{whole:?}");
    let decode_b = &env.cluster.decodes[1];
    assert!(decode_b.stats().requests_total >= 1, "PD first for model-b");
    decode_b.set_faults(pdgate_sim::Faults {
        decode_die_mid_stream_after: Some(3),
        ..Default::default()
    });
    let before = [f.regular(0), f.regular(1), f.regular(2)];
    let got = ask(env, &c, false).await;
    let took: Vec<usize> = (0..2).filter(|&i| f.regular(i) > before[i]).collect();
    assert_eq!(
        took.len(),
        1,
        "one of model-b's regular workers took the follow-up"
    );
    assert_eq!(f.regular(2), before[2], "model-c's worker got nothing");
    let follow = f.regular[took[0]]
        .recent_generate_bodies()
        .last()
        .map(|(_, b)| b.clone())
        .expect("the follow-up's body");
    check_moved(&c, &whole, &got, &follow);
}

/// A regular worker's process killed while it streams (SIGKILL, no goodbye): every stream
/// completes whole on the other regular worker, which got follow-ups carrying the partial
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_regular_worker_process_loses_no_stream() {
    let healthy = pdgate_sim::spawn(fast_engine(EngineConfig::regular(1)))
        .await
        .expect("regular engine");
    let (mut child, url) = sim_process("regular").await;
    let env = over_regular(&[healthy.url(), url], |_| {}).await;
    streams_survive_a_kill(&env, &mut child).await;
    let follow_ups = healthy
        .recent_generate_bodies()
        .iter()
        .filter(|(_, b)| b["continue_final_message"] == true)
        .count();
    assert!(follow_ups >= 1, "no stream was moved off the killed worker");
}
