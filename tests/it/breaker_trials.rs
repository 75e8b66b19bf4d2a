//! A half-open breaker's one trial always ends: in a verdict on the worker's own leg, or
//! released when the request ends any other way, so the worker is never locked out until a
//! restart. Each case opens one worker's breaker, lets it go half-open, ends the trial
//! request in one way, then checks that the trial is free and that a good request closes
//! the circuit again.

use crate::support::common;

use std::time::Duration;

use common::{start, Env};
use pdgate::config::Config;
use pdgate::error::FailReason;
use pdgate::pool::{Breaker, BreakerState};
use pdgate::types::{Role, WorkerId};
use pdgate_sim::{EngineConfig, Faults};

const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;

fn breaker(env: &Env, role: Role) -> std::sync::Arc<Breaker> {
    env.router
        .pool
        .load()
        .worker(role, WorkerId(0))
        .expect("worker 0")
        .shared
        .breaker
        .clone()
}

/// How the trial request is made to end.
#[derive(Clone, Copy, Debug)]
enum Outcome {
    /// The trial worker itself rejects the request (4xx: the client's fault).
    Rejected,
    /// The other leg fails (blamed on the other worker).
    OtherLegFails,
    /// The other pool has nobody left after the trial worker was picked.
    NoPartner,
    /// The prefill's bootstrap says "not registered yet" on the request path.
    BootstrapNotReady,
    /// The request's own deadline passes.
    RequestTimeout,
    /// The client goes away.
    ClientGone,
}

fn tweak(outcome: Outcome) -> impl FnOnce(&mut Config) {
    move |c: &mut Config| {
        c.breaker.open_ms = 100;
        c.breaker.max_open_ms = 100;
        // A pool of one may be ejected here (the cap would keep it in otherwise).
        c.breaker.max_ejection_ratio = 1.0;
        match outcome {
            Outcome::RequestTimeout => {
                c.timeouts.decode_first_byte_secs = 1;
                c.timeouts.request_secs = 2;
            }
            Outcome::BootstrapNotReady => {
                // Every request re-checks its rank on the request path (preflight); the
                // refresher's next round comes long after the trial request.
                c.bootstrap.freshness_ms = 1;
                c.bootstrap.refresh_interval_ms = 2000;
            }
            _ => {}
        }
    }
}

/// Opens `role`'s breaker by passive signals and waits until it is half-open.
async fn half_open(env: &Env, role: Role) {
    let reason = match role {
        Role::Prefill => FailReason::PrefillStatus,
        Role::Decode | Role::Regular => FailReason::DecodeStatus,
    };
    let cfg = pdgate::config::BreakerConfig {
        open_ms: 100,
        max_open_ms: 100,
        max_ejection_ratio: 1.0,
        ..Default::default()
    };
    for _ in 0..cfg.failure_threshold {
        env.router
            .pool
            .report_failure(role, WorkerId(0), reason, &cfg);
    }
    assert_eq!(breaker(env, role).state(), BreakerState::Open);
    env.wait_pool("half-open", |s| {
        s.worker(role, WorkerId(0))
            .expect("worker")
            .shared
            .breaker
            .state()
            == BreakerState::HalfOpen
    })
    .await;
    assert!(!breaker(env, role).trial_taken());
}

/// Makes the next request end as `outcome` with `trial` as the half-open worker; returns
/// the error type the client saw (None: the client went away).
async fn provoke(env: &Env, trial: Role, outcome: Outcome) -> Option<String> {
    let other = match trial {
        Role::Prefill => &env.cluster.decodes[0],
        Role::Decode | Role::Regular => &env.cluster.prefills[0],
    };
    let own = match trial {
        Role::Prefill => &env.cluster.prefills[0],
        Role::Decode | Role::Regular => &env.cluster.decodes[0],
    };
    match outcome {
        Outcome::Rejected => own.set_faults(match trial {
            Role::Prefill => Faults {
                prefill_status: Some(400),
                ..Faults::default()
            },
            Role::Decode | Role::Regular => Faults {
                decode_status: Some(400),
                ..Faults::default()
            },
        }),
        Outcome::OtherLegFails => other.set_faults(match trial {
            Role::Prefill => Faults {
                decode_status: Some(500),
                ..Faults::default()
            },
            Role::Decode | Role::Regular => Faults {
                prefill_status: Some(500),
                ..Faults::default()
            },
        }),
        Outcome::NoPartner => {
            other.set_down(true);
            let other_role = match trial {
                Role::Prefill => Role::Decode,
                Role::Decode | Role::Regular => Role::Prefill,
            };
            env.wait_pool("partner out", |s| s.routable(other_role).is_empty())
                .await;
        }
        Outcome::BootstrapNotReady => env.cluster.prefills[0].set_faults(Faults {
            register_none: true,
            ..Faults::default()
        }),
        Outcome::RequestTimeout | Outcome::ClientGone => {
            env.cluster.prefills[0].set_faults(Faults {
                prefill_hang: true,
                ..Faults::default()
            })
        }
    }
    if let Outcome::ClientGone = outcome {
        let gone = tokio::time::timeout(Duration::from_millis(300), env.post("/generate", GEN));
        assert!(gone.await.is_err(), "a hung prefill answered");
        return None;
    }
    let (status, _, body) = env.post("/generate", GEN).await;
    let v: serde_json::Value = serde_json::from_slice(&body).expect("error JSON");
    assert!(!status.is_success(), "{trial:?} {outcome:?}: {v}");
    Some(v["error"]["type"].as_str().expect("error type").to_string())
}

async fn heal(env: &Env) {
    for e in env.cluster.engines() {
        e.set_faults(Faults::default());
        e.set_down(false);
    }
    env.wait_routable(1, 1).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn every_trial_ends_in_a_verdict_or_is_released() {
    let cases: &[(Role, Outcome, Option<&str>)] = &[
        (Role::Prefill, Outcome::Rejected, Some("prefill_rejected")),
        (Role::Prefill, Outcome::OtherLegFails, Some("decode_status")),
        (
            Role::Prefill,
            Outcome::NoPartner,
            Some("no_decode_available"),
        ),
        (
            Role::Prefill,
            Outcome::BootstrapNotReady,
            Some("bootstrap_not_ready"),
        ),
        (
            Role::Prefill,
            Outcome::RequestTimeout,
            Some("request_timeout"),
        ),
        (Role::Prefill, Outcome::ClientGone, None),
        (Role::Decode, Outcome::Rejected, Some("decode_rejected")),
        (Role::Decode, Outcome::OtherLegFails, Some("prefill_status")),
        // Whichever the router notices first: the bootstrap heartbeat or /health.
        (
            Role::Decode,
            Outcome::NoPartner,
            Some("no_prefill_available|bootstrap_unreachable"),
        ),
        (
            Role::Decode,
            Outcome::RequestTimeout,
            Some("request_timeout"),
        ),
        (Role::Decode, Outcome::ClientGone, None),
    ];
    for &(trial, outcome, want) in cases {
        let env = start(
            vec![EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            tweak(outcome),
        )
        .await;
        env.wait_routable(1, 1).await;
        half_open(&env, trial).await;
        let got = provoke(&env, trial, outcome).await;
        match (got.as_deref(), want) {
            (Some(got), Some(want)) => assert!(
                want.split('|').any(|w| w == got),
                "{trial:?} {outcome:?}: error type {got}, want {want}"
            ),
            (got, want) => assert_eq!(got, want, "{trial:?} {outcome:?}"),
        }
        // The trial ended without a verdict on this worker: it must be free again (the
        // client's disconnect reaches the router asynchronously, hence the bounded wait).
        env.wait_pool("trial released", |s| {
            let b = &s.worker(trial, WorkerId(0)).expect("worker").shared.breaker;
            b.state() == BreakerState::HalfOpen && !b.trial_taken()
        })
        .await;
        // A good request is the next trial and closes the circuit.
        heal(&env).await;
        let (status, _, body) = env.post("/generate", GEN).await;
        assert_eq!(
            status,
            200,
            "{trial:?} {outcome:?}: {}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(
            breaker(&env, trial).state(),
            BreakerState::Closed,
            "{trial:?} {outcome:?}: a good trial closes the circuit"
        );
        env.settled_stats().await;
    }
}

/// A half-open prefill is judged by its own leg: when decode's answer comes first (the
/// prefill's own answer is late), the circuit stays half-open, its trial held, until the
/// prefill's leg ends well; then it closes. (It used to close at decode's first byte,
/// before the prefill's leg had succeeded.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_prefill_is_closed_by_its_own_leg() {
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        tweak(Outcome::Rejected),
    )
    .await;
    env.wait_routable(1, 1).await;
    half_open(&env, Role::Prefill).await;
    env.cluster.prefills[0].set_faults(Faults {
        prefill_answer_delay_ms: 800,
        ..Faults::default()
    });
    let (status, _, body) = env.post("/generate", GEN).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let b = breaker(&env, Role::Prefill);
    assert_eq!(
        b.state(),
        BreakerState::HalfOpen,
        "decode answered, the prefill's leg has not"
    );
    assert!(b.trial_taken(), "the trial is held by the prefill's leg");
    env.wait_pool("closed by the prefill's own success", |s| {
        s.worker(Role::Prefill, WorkerId(0))
            .expect("worker")
            .shared
            .breaker
            .state()
            == BreakerState::Closed
    })
    .await;
}
