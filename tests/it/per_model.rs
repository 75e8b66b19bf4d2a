//! Per-model settings (`[models.settings."NAME"]`, issue 19): a model's own admission,
//! retries, policies and breaker thresholds, with every other model on the top level's,
//! and a reload that changes one model's. Two models of simulated engines that report
//! their model as SGLang does; each test names its models apart (the admission series are
//! process-wide, labelled by model).

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use http::StatusCode;
use http_body_util::BodyExt;
use pdgate::config::models::{AdmissionOverride, BreakerOverride, PolicyOverride, RetryOverride};
use pdgate::config::{Config, ModelSettings, PolicyKind};
use pdgate::pool::BreakerState;
use pdgate::types::Role;
use pdgate_sim::{EngineConfig, Faults, SimEngine};
use serde_json::Value;

use crate::models::engine;
use crate::support::common::{fast_engine, start, start_with_admin, Env};

fn failing_prefill(model: &str) -> EngineConfig {
    let mut e = engine(true, model);
    e.faults.prefill_status = Some(500);
    e
}

fn chat(model: &str) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "the same prompt every time"}],
        "max_tokens": 3,
    })
    .to_string()
}

fn settings(cfg: &mut Config, model: &str, f: impl FnOnce(&mut ModelSettings)) {
    f(cfg.models.settings.entry(model.to_string()).or_default());
}

fn one_slot() -> AdmissionOverride {
    AdmissionOverride {
        max_in_flight: Some(1),
        max_queue: Some(0),
        ..AdmissionOverride::default()
    }
}

async fn wait_models(env: &Env, n: usize) {
    env.wait_pool("every model known", |s| s.models.len() == n)
        .await;
}

/// A POST sent from a task (it may be held by its engine); its status and body.
fn post_task(env: &Env, body: String) -> tokio::task::JoinHandle<(StatusCode, Bytes)> {
    let client = env.client.clone();
    let url = env.url("/v1/chat/completions");
    tokio::spawn(async move {
        let req = http::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(body)))
            .expect("request");
        let resp = client.request(req).await.expect("answered");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, body)
    })
}

async fn wait_held(e: &SimEngine, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while e.stats().held_now != n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "engine holds {} requests, not {n}",
            e.stats().held_now
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn hold(e: &SimEngine, on: bool) {
    e.set_faults(Faults {
        decode_hold: on,
        ..Faults::default()
    });
}

/// A 429 from a model's own admission: OpenAI's shape, `Retry-After`, nothing internal.
fn assert_model_full(status: StatusCode, headers: &http::HeaderMap, body: &[u8], model: &str) {
    let text = String::from_utf8_lossy(body);
    assert_eq!(status, 429, "{text}");
    assert!(headers.contains_key("retry-after"), "{headers:?}");
    let v: Value = serde_json::from_slice(body).expect("json");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(
        !text.contains(model) && !text.contains("127.0.0.1"),
        "{text}"
    );
}

async fn metrics_text(env: &Env) -> String {
    let (st, _, body) = env.admin("GET", "/metrics", None, "").await;
    assert_eq!(st, 200);
    String::from_utf8(body.to_vec()).expect("utf-8")
}

/// The value of the sample `name{model="..."[,reason="..."]}`.
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let head = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&head))
        .and_then(|v| v.trim().parse().ok())
}

const TOKEN: &str = "per-model-admin-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_admission_is_its_own() {
    let (a, b) = ("adm-a", "adm-b");
    let env = start_with_admin(
        vec![fast_engine(engine(true, a)), fast_engine(engine(true, b))],
        vec![fast_engine(engine(false, a)), fast_engine(engine(false, b))],
        |c| {
            c.admin.api_key = Some(TOKEN.into());
            settings(c, a, |s| s.admission = Some(one_slot()));
        },
    )
    .await;
    env.wait_routable(2, 2).await;
    wait_models(&env, 2).await;
    // The admin API shows the model's settings as configured.
    let (st, _, cfg) = env.admin("GET", "/config", Some(TOKEN), "").await;
    assert_eq!(st, 200);
    let cfg: Value = serde_json::from_slice(&cfg).expect("json");
    let shown = &cfg["models"]["settings"][a]["admission"];
    assert_eq!(shown["max_in_flight"], 1, "{cfg}");
    assert_eq!(shown["max_queue"], 0, "{cfg}");
    assert!(cfg["models"]["settings"][a]["retry"].is_null(), "{cfg}");

    let da = &env.cluster.decodes[0];
    hold(da, true);
    let first = post_task(&env, chat(a));
    wait_held(da, 1).await;
    // model-a's one slot is taken: its next request is shed at once.
    let (st, headers, body) = env.post("/v1/chat/completions", &chat(a)).await;
    assert_model_full(st, &headers, &body, a);
    // model-b is not limited by it: three at once go through.
    let body_b = chat(b);
    let bs = join_all((0..3).map(|_| env.post("/v1/chat/completions", &body_b))).await;
    for (st, _, body) in &bs {
        assert_eq!(*st, 200, "{}", String::from_utf8_lossy(body));
    }
    let text = metrics_text(&env).await;
    let m = format!("model=\"{a}\"");
    assert_eq!(
        sample(&text, "pdgate_model_in_flight_requests", &m),
        Some(1.0),
        "{text}"
    );
    let rejected = format!("model=\"{a}\",reason=\"queue_full\"");
    assert!(
        sample(&text, "pdgate_model_admission_rejected_total", &rejected) >= Some(1.0),
        "{text}"
    );
    assert!(
        sample(
            &text,
            "pdgate_model_in_flight_requests",
            &format!("model=\"{b}\"")
        )
        .is_none(),
        "a model without an admission override has no series: {text}"
    );
    crate::metrics::promtool_check("a_models_admission_is_its_own", &text);

    // The slot is given back when the held response ends.
    hold(da, false);
    let (st, body) = first.await.expect("task");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let (st, _, body) = env.post("/v1/chat/completions", &chat(a)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let text = metrics_text(&env).await;
    assert_eq!(
        sample(&text, "pdgate_model_in_flight_requests", &m),
        Some(0.0),
        "{text}"
    );
}

/// Prefills: `a` failing, `a`, `b` failing, `b`; decodes `a`, `b`.
async fn failing_fleet(a: &str, b: &str, tweak: impl FnOnce(&mut Config)) -> Env {
    let env = start(
        vec![
            failing_prefill(a),
            engine(true, a),
            failing_prefill(b),
            engine(true, b),
        ],
        vec![engine(false, a), engine(false, b)],
        tweak,
    )
    .await;
    env.wait_routable(4, 2).await;
    wait_models(&env, 2).await;
    env
}

/// Sends `n` requests for `model` one after the other; their statuses.
async fn statuses(env: &Env, model: &str, n: usize) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(
            env.post("/v1/chat/completions", &chat(model))
                .await
                .0
                .as_u16(),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_retries_are_its_own() {
    let (a, b) = ("retry-a", "retry-b");
    let env = failing_fleet(a, b, |c| {
        c.breaker.failure_threshold = 0;
        settings(c, a, |s| {
            s.retry = Some(RetryOverride {
                max_retries: Some(0),
                ..RetryOverride::default()
            })
        });
    })
    .await;
    // Round robin sends half of model-a's requests to its failing prefill: not retried.
    let got = statuses(&env, a, 4).await;
    assert_eq!(got.iter().filter(|s| **s == 200).count(), 2, "{got:?}");
    assert!(got.iter().all(|s| *s == 200 || *s >= 500), "{got:?}");
    // model-b's failures are retried on its other prefill (the top level's max_retries).
    let got = statuses(&env, b, 4).await;
    assert!(got.iter().all(|s| *s == 200), "{got:?}");
    let bad_b = env.cluster.prefills[2].stats();
    assert!(bad_b.requests_total >= 1 && bad_b.ok == 0, "{bad_b:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_breaker_thresholds_are_its_own() {
    let (a, b) = ("brk-a", "brk-b");
    let env = failing_fleet(a, b, |c| {
        // Off at the top level; model-a's workers open at their first failure.
        c.breaker.failure_threshold = 0;
        c.retry.max_retries = 0;
        settings(c, a, |s| {
            s.breaker = Some(BreakerOverride {
                failure_threshold: Some(1),
                open_ms: Some(60_000),
                max_open_ms: Some(60_000),
                ..BreakerOverride::default()
            })
        });
    })
    .await;
    statuses(&env, a, 4).await;
    statuses(&env, b, 4).await;
    let state = |i: usize| {
        let url = env.cluster.prefills[i].url();
        let snap = env.router.pool.load();
        let w = snap
            .workers(Role::Prefill)
            .iter()
            .find(|w| w.shared.url.to_string().trim_end_matches('/') == url.trim_end_matches('/'))
            .expect("worker");
        w.shared.breaker.state()
    };
    assert!(env.cluster.prefills[0].stats().requests_total >= 1);
    assert_eq!(state(0), BreakerState::Open, "model-a's failing prefill");
    assert!(env.cluster.prefills[2].stats().requests_total >= 2);
    assert_eq!(state(2), BreakerState::Closed, "model-b's failing prefill");
    // With its failing prefill out, model-a's requests all succeed.
    let got = statuses(&env, a, 4).await;
    assert!(got.iter().all(|s| *s == 200), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_policies_are_its_own() {
    let (a, b) = ("pol-a", "pol-b");
    let env = start(
        vec![engine(true, a), engine(true, b)],
        vec![
            engine(false, a),
            engine(false, a),
            engine(false, b),
            engine(false, b),
        ],
        |c| {
            c.policy.decode = PolicyKind::RoundRobin;
            settings(c, a, |s| {
                s.policy = Some(PolicyOverride {
                    decode: Some(PolicyKind::CacheAware),
                    ..PolicyOverride::default()
                })
            });
        },
    )
    .await;
    env.wait_routable(2, 4).await;
    wait_models(&env, 2).await;
    let per_decode = |env: &Env| -> Vec<u64> {
        env.cluster
            .decodes
            .iter()
            .map(|d| d.stats().requests_total)
            .collect()
    };
    // model-a: the same prompt always goes to the same decode (prefix affinity).
    assert!(statuses(&env, a, 6).await.iter().all(|s| *s == 200));
    let n = per_decode(&env);
    assert!(
        (n[0], n[1]) == (6, 0) || (n[0], n[1]) == (0, 6),
        "model-a's decodes: {n:?}"
    );
    // model-b: the top level's round robin alternates.
    assert!(statuses(&env, b, 6).await.iter().all(|s| *s == 200));
    let n = per_decode(&env);
    assert_eq!((n[2], n[3]), (3, 3), "model-b's decodes: {n:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_one_models_settings() {
    let (a, b) = ("rel-a", "rel-b");
    let env = start(
        vec![engine(true, a), engine(true, b)],
        vec![engine(false, a), engine(false, b)],
        |c| settings(c, a, |s| s.admission = Some(one_slot())),
    )
    .await;
    env.wait_routable(2, 2).await;
    wait_models(&env, 2).await;
    let da = &env.cluster.decodes[0];
    hold(da, true);
    let mut held = vec![post_task(&env, chat(a))];
    wait_held(da, 1).await;
    let (st, headers, body) = env.post("/v1/chat/completions", &chat(a)).await;
    assert_model_full(st, &headers, &body, a);

    // Two slots now: the held request keeps its slot, one more fits, the next is shed.
    let mut next = (**env.router.fleet.live().load()).clone();
    settings(&mut next, a, |s| {
        s.admission = Some(AdmissionOverride {
            max_in_flight: Some(2),
            ..one_slot()
        })
    });
    pdgate::reload::apply(&env.router, next.clone()).expect("valid");
    held.push(post_task(&env, chat(a)));
    wait_held(da, 2).await;
    let (st, headers, body) = env.post("/v1/chat/completions", &chat(a)).await;
    assert_model_full(st, &headers, &body, a);
    // model-b was never limited.
    let (st, _, _) = env.post("/v1/chat/completions", &chat(b)).await;
    assert_eq!(st, 200);

    // Its settings removed: model-a is under the top level's admission only.
    next.models.settings.clear();
    pdgate::reload::apply(&env.router, next).expect("valid");
    held.push(post_task(&env, chat(a)));
    wait_held(da, 3).await;
    hold(da, false);
    for h in held {
        let (st, body) = h.await.expect("task");
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    }
    // A reload with an invalid override changes nothing.
    let mut bad = (**env.router.fleet.live().load()).clone();
    settings(&mut bad, a, |s| {
        s.retry = Some(RetryOverride {
            max_retries: Some(99),
            ..RetryOverride::default()
        })
    });
    let err = pdgate::reload::apply(&env.router, bad)
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("models.settings.\"rel-a\": retry.max_retries"),
        "{err}"
    );
    assert!(env.router.fleet.live().load().models.settings.is_empty());

    // Settings added for model-b by a reload: its own slot from the next request on.
    let mut next = (**env.router.fleet.live().load()).clone();
    settings(&mut next, b, |s| s.admission = Some(one_slot()));
    pdgate::reload::apply(&env.router, next).expect("valid");
    let db = &env.cluster.decodes[1];
    hold(db, true);
    let first = post_task(&env, chat(b));
    wait_held(db, 1).await;
    let (st, headers, body) = env.post("/v1/chat/completions", &chat(b)).await;
    assert_model_full(st, &headers, &body, b);
    hold(db, false);
    let (st, body) = first.await.expect("task");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
}

/// One model in one handoff group (requests resolve to "any worker"): its settings apply
/// all the same; settings naming another model leave it as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_model_takes_its_settings_and_others_change_nothing() {
    let solo = "solo-model";
    let env = start(vec![engine(true, solo)], vec![engine(false, solo)], |c| {
        settings(c, solo, |s| s.admission = Some(one_slot()))
    })
    .await;
    env.wait_routable(1, 1).await;
    wait_models(&env, 1).await;
    let d = &env.cluster.decodes[0];
    hold(d, true);
    // Any `model` value routes to the one model, and takes its slot.
    let mut held = vec![post_task(&env, chat("whatever"))];
    wait_held(d, 1).await;
    let (st, headers, body) = env.post("/v1/chat/completions", &chat(solo)).await;
    assert_model_full(st, &headers, &body, solo);

    let mut next = (**env.router.fleet.live().load()).clone();
    next.models.settings.clear();
    settings(&mut next, "another-model", |s| {
        s.admission = Some(one_slot())
    });
    pdgate::reload::apply(&env.router, next).expect("valid");
    for _ in 0..2 {
        held.push(post_task(&env, chat(solo)));
    }
    wait_held(d, 3).await;
    hold(d, false);
    for h in held {
        let (st, body) = h.await.expect("task");
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    }
}
