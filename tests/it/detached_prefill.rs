//! A prefill leg that is still answering when decode's answer is complete runs on alone
//! (its KV was sent): it must keep counting as in flight on its rank, and keep its
//! request's admission slot, until it ends.

use crate::support::common;

use common::start;
use pdgate::types::{Role, WorkerId};
use pdgate_sim::{EngineConfig, Faults};

const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;

#[tokio::test(crate = "crate::support::rt")]
async fn a_detached_prefill_counts_until_it_ends() {
    // The prefill answers 1.5 s after its KV hand-off; decode finishes long before.
    let slow_answer = EngineConfig {
        faults: Faults {
            prefill_answer_delay_ms: 1500,
            ..Faults::default()
        },
        ..EngineConfig::prefill(1)
    };
    let env = start(vec![slow_answer], vec![EngineConfig::decode(1)], |c| {
        c.admission.max_in_flight = 1;
        c.admission.max_queue = 0;
    })
    .await;
    env.wait_routable(1, 1).await;
    let in_flight = || {
        env.router
            .pool
            .load()
            .worker(Role::Prefill, WorkerId(0))
            .expect("prefill")
            .in_flight(0)
    };

    let (status, _, body) = env.post("/generate", GEN).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        env.cluster.prefills[0].stats().held_now,
        1,
        "the prefill is still answering"
    );
    assert_eq!(in_flight(), 1, "the detached prefill leg is in flight");
    // Its admission slot is still taken: with one slot and no queue, the next is shed.
    let (status, _, body) = env.post("/generate", GEN).await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));

    // Once the prefill has answered, both are released.
    env.wait_pool("prefill leg ended", |s| {
        s.worker(Role::Prefill, WorkerId(0))
            .is_some_and(|w| w.in_flight(0) == 0)
    })
    .await;
    // The slot went with the leg's load counter (both held by the leg until it ended).
    let (status, _, body) = env.post("/generate", GEN).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}
