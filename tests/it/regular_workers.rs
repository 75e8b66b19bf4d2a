//! Regular (non-PD) workers beside PD pairs (issue 19, item 3): simulated engines in
//! SGLang's plain mode (`--disaggregation-mode null`) serving whole requests. The fleet:
//! `model-a` on a PD pair only, `model-b` on a PD pair and two regular workers, `model-c`
//! on a regular worker only. Each engine counts what it got: every request lands on its
//! model's engines, never another model's.

use crate::models::{get_json, json};
use crate::support::common;

use common::{start, Env};
use futures_util::future::join_all;
use pdgate::types::Role;
use pdgate_sim::{EngineConfig, SimEngine};
use serde_json::Value;

fn engine(mut e: EngineConfig, model: &str) -> EngineConfig {
    e.model = model.to_string();
    common::fast_engine(e)
}

fn chat(model: &str, content: &str, stream: bool) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "stream": stream,
    })
    .to_string()
}

pub(crate) struct Fleet {
    pub env: Env,
    /// model-b, model-b, model-c.
    pub regular: Vec<SimEngine>,
}

impl Fleet {
    fn count(e: &SimEngine) -> u64 {
        e.stats().requests_total
    }
    fn prefill(&self, i: usize) -> u64 {
        Self::count(&self.env.cluster.prefills[i])
    }
    fn decode(&self, i: usize) -> u64 {
        Self::count(&self.env.cluster.decodes[i])
    }
    pub fn regular(&self, i: usize) -> u64 {
        Self::count(&self.regular[i])
    }
}

/// The mixed fleet, routable, with its three models known.
pub(crate) async fn mixed(tweak: impl FnOnce(&mut pdgate::config::Config)) -> Fleet {
    let mut regular = Vec::new();
    for m in ["model-b", "model-b", "model-c"] {
        regular.push(
            pdgate_sim::spawn(engine(EngineConfig::regular(1), m))
                .await
                .expect("regular engine"),
        );
    }
    let urls: Vec<String> = regular.iter().map(SimEngine::url).collect();
    let env = start(
        vec![
            engine(EngineConfig::prefill(1), "model-a"),
            engine(EngineConfig::prefill(1), "model-b"),
        ],
        vec![
            engine(EngineConfig::decode(1), "model-a"),
            engine(EngineConfig::decode(1), "model-b"),
        ],
        |c| {
            c.add_regular_workers(urls);
            tweak(c);
        },
    )
    .await;
    env.wait_routable(2, 2).await;
    env.wait_pool("three models, three regular workers", |s| {
        s.models.len() == 3 && s.routable_ranks(Role::Regular) == 3
    })
    .await;
    Fleet { env, regular }
}

/// 36 requests, 12 per model, half streamed, all at once: model-a's land on its pair,
/// model-b's on its pair (PD first), model-c's on its regular worker; nothing crosses.
/// The models, `/readiness` and the metrics show the regular workers and their model; an
/// unknown model is 404 `model_not_found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_lands_on_its_models_engines() {
    let f = mixed(|_| {}).await;
    let env = &f.env;
    let bodies: Vec<(String, bool)> = (0..36)
        .map(|i| {
            let m = ["model-a", "model-b", "model-c"][i % 3];
            let stream = i % 2 == 0;
            (chat(m, "hello", stream), stream)
        })
        .collect();
    let answers = join_all(
        bodies
            .iter()
            .map(|(b, _)| env.post("/v1/chat/completions", b)),
    )
    .await;
    for ((status, _, body), (_, stream)) in answers.iter().zip(&bodies) {
        assert_eq!(*status, 200, "{}", String::from_utf8_lossy(body));
        if *stream {
            let (events, done) = common::sse_events(body);
            assert!(
                done && !events.is_empty(),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert!(
                events.iter().all(|e| e.get("error").is_none()),
                "{events:?}"
            );
        } else {
            assert_eq!(json(body)["object"], "chat.completion");
        }
    }
    let s = env.settled_stats().await;
    assert_eq!(s.violation_kv_layout_mismatch, 0, "{s:?}");
    assert_eq!((f.prefill(0), f.decode(0)), (12, 12), "model-a: its pair");
    assert_eq!(
        (f.prefill(1), f.decode(1)),
        (12, 12),
        "model-b: its pair first"
    );
    assert_eq!(
        f.regular(0) + f.regular(1),
        0,
        "model-b's regular workers wait"
    );
    assert_eq!(f.regular(2), 12, "model-c: its regular worker");
    // What the regular worker got: the client's body, no bootstrap fields.
    for (_, leg) in f.regular[2].recent_generate_bodies() {
        assert!(
            leg.get("bootstrap_room").is_none() && leg.get("bootstrap_host").is_none(),
            "{leg}"
        );
        assert_eq!(leg["model"], "model-c");
    }

    let (status, _, body) = env
        .post("/v1/chat/completions", &chat("model-z", "hi", false))
        .await;
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json(&body)["error"]["code"], "model_not_found");

    let (_, v) = get_json(env, "/v1/models").await;
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["model-a", "model-b", "model-c"], "{v}");
    let (status, v) = get_json(env, "/readiness").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["regular"]["workers"], 3, "{v}");
    let c = v["models"]
        .as_array()
        .expect("models")
        .iter()
        .find(|m| m["model"] == "model-c")
        .cloned()
        .expect("model-c in /readiness");
    assert_eq!(c["ready"], true, "{c}");
    assert_eq!(c["regular_workers"], 1, "{c}");
    assert_eq!(c["prefill_workers"], 0, "{c}");
    let scrape = pdgate::telemetry::render(&*env.router.pool);
    assert!(
        scrape.contains(r#"role="regular""#) && scrape.contains("regular-2"),
        "{scrape}"
    );
    // SGLang router's info route knows them too: a regular-only model's server info
    // comes from its regular worker.
    let (status, v) = get_json(env, "/get_server_info?model=model-c").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["router"]["regular_workers"], 3, "{v}");
    assert_eq!(v["served_model_name"], "model-c", "{v}");
}

/// SGLang's `/generate` on a regular worker: streamed and not, the client's bootstrap
/// fields stripped, `rid` pdgate's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_on_a_regular_worker_strips_pd_fields() {
    let f = mixed(|_| {}).await;
    for stream in [false, true] {
        let body = serde_json::json!({
            "model": "model-c",
            "text": "hi",
            "stream": stream,
            "bootstrap_room": 7,
            "bootstrap_host": "10.0.0.1",
            "sampling_params": {"max_new_tokens": 3},
        })
        .to_string();
        let (status, _, answer) = f.env.post("/generate", &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        if stream {
            let (events, done) = common::sse_events(&answer);
            assert!(done, "{}", String::from_utf8_lossy(&answer));
            assert_eq!(
                events.last().expect("events")["text"]
                    .as_str()
                    .map(str::len),
                Some(3 * 5)
            );
        } else {
            assert!(json(&answer)["text"].is_string());
        }
    }
    let legs = f.regular[2].recent_generate_bodies();
    assert_eq!(legs.len(), 2);
    for (_, leg) in legs {
        assert!(leg.get("bootstrap_room").is_none(), "{leg}");
        assert!(leg.get("bootstrap_host").is_none(), "{leg}");
        assert!(leg.get("model").is_none(), "{leg}");
        assert!(
            leg["rid"].as_str().is_some_and(|r| r.starts_with("pdg-")),
            "{leg}"
        );
    }
}

/// model-b's pair unroutable: its requests fall back to its regular workers (on by
/// default), never to another model's engines; with `models.regular_fallback` off they are
/// 503. model-c's only regular worker down: 503 for model-c alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_pairs_fall_back_and_nothing_routable_is_503() {
    for fallback in [true, false] {
        let f = mixed(|c| c.models.regular_fallback = fallback).await;
        let env = &f.env;
        env.cluster.decodes[1].set_down(true);
        env.wait_pool("model-b's decode out", |s| {
            s.model("model-b")
                .is_some_and(|m| m.decode_routable.is_empty())
        })
        .await;
        for _ in 0..6 {
            let (status, _, body) = env
                .post("/v1/chat/completions", &chat("model-b", "hi", false))
                .await;
            let want = if fallback { 200 } else { 503 };
            assert_eq!(
                status,
                want,
                "fallback={fallback}: {}",
                String::from_utf8_lossy(&body)
            );
            let (status, _, _) = env
                .post("/v1/chat/completions", &chat("model-a", "hi", false))
                .await;
            assert_eq!(status, 200);
        }
        let b_regular = f.regular(0) + f.regular(1);
        assert_eq!(
            b_regular,
            if fallback { 6 } else { 0 },
            "fallback={fallback}"
        );
        assert_eq!(f.regular(2), 0, "model-c's worker took none of model-b's");
        assert_eq!(f.prefill(1), 0, "no model-b prefill leg without a partner");
        assert_eq!(f.prefill(0), 6);

        f.regular[2].set_down(true);
        env.wait_pool("model-c's worker out", |s| {
            s.model("model-c")
                .is_some_and(|m| m.regular_routable.is_empty())
        })
        .await;
        let (status, headers, body) = env
            .post("/v1/chat/completions", &chat("model-c", "hi", false))
            .await;
        assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
        assert!(headers.contains_key("retry-after"));
        assert_eq!(
            f.regular(0) + f.regular(1),
            b_regular,
            "nothing crossed to model-b"
        );
    }
}

/// A regular worker that fails every request (then one cut off): each request it got is
/// retried on the other regular worker of its model, and the client sees 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_regular_worker_is_retried_on_another() {
    let f = mixed(|c| {
        // The router must not see the failures coming: only requests find them.
        c.health.interval_secs = 60.0;
        c.models
            .settings
            .entry("model-b".into())
            .or_default()
            .short_prompt_tokens = Some(1000);
    })
    .await;
    let env = &f.env;
    f.regular[0].set_faults(pdgate_sim::Faults {
        decode_status: Some(500),
        ..Default::default()
    });
    for i in 0..8 {
        let (status, _, body) = env
            .post(
                "/v1/chat/completions",
                &chat("model-b", "short", i % 2 == 0),
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    let retried = common::assert_retried(&f.regular[0], &f.regular[1], 'r');
    assert!(retried >= 1);
    assert_eq!(
        (f.prefill(1), f.decode(1)),
        (0, 0),
        "short prompts bypass the pair"
    );

    // Killed outright (connections cut, nothing answers): retried all the same.
    f.regular[0].set_faults(pdgate_sim::Faults::default());
    f.regular[0].set_down(true);
    let before = f.regular(1);
    for _ in 0..6 {
        let (status, _, body) = env
            .post("/v1/chat/completions", &chat("model-b", "short", false))
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(
        f.regular(1) - before,
        6,
        "every request served by the live worker"
    );
}

/// The short-prompt bypass: model-b's prompts under 64 tokens (exact for `input_ids`,
/// one per 4 bytes of JSON for text) go to its regular workers, longer ones to its pair;
/// model-a (no regular worker) and model-c (no pair) are unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_bypass_the_pair() {
    let f = mixed(|c| {
        c.models
            .settings
            .entry("model-b".into())
            .or_default()
            .short_prompt_tokens = Some(64);
        c.models
            .settings
            .entry("model-a".into())
            .or_default()
            .short_prompt_tokens = Some(64);
    })
    .await;
    let env = &f.env;
    let ids = |n: usize| -> String {
        serde_json::json!({
            "model": "model-b",
            "input_ids": (0..n as u32).collect::<Vec<_>>(),
            "sampling_params": {"max_new_tokens": 2},
        })
        .to_string()
    };
    let long_text = "word ".repeat(100);
    let cases: Vec<(&str, String, bool)> = vec![
        ("/generate", ids(63), true),
        ("/generate", ids(64), false),
        (
            "/v1/chat/completions",
            chat("model-b", "short", false),
            true,
        ),
        (
            "/v1/chat/completions",
            chat("model-b", &long_text, true),
            false,
        ),
    ];
    for (path, body, regular) in &cases {
        let (p, r) = (f.prefill(1), f.regular(0) + f.regular(1));
        let (status, _, answer) = env.post(path, body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        let went_regular = f.regular(0) + f.regular(1) == r + 1;
        assert_eq!(went_regular, *regular, "{path} {body:.80}");
        assert_eq!(f.prefill(1) == p + 1, !*regular, "{path} {body:.80}");
    }
    // model-a has no regular worker: its short prompts stay on its pair.
    let (status, _, _) = env
        .post("/v1/chat/completions", &chat("model-a", "short", false))
        .await;
    assert_eq!(status, 200);
    assert_eq!(f.prefill(0), 1);
}

const TOKEN: &str = "adm1n-t0ken";

/// Regular workers come and go through the admin API (`POST /workers` with role
/// `regular`; SGLang's `/add_worker` without a type), hot reload (`[[worker]]`) and
/// Kubernetes discovery (`discovery.regular_selector`); each serves its model once
/// admitted, and leaves it when removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regular_workers_join_by_admin_reload_and_discovery() {
    use crate::support::fake_kube::{self, FakeKube};
    let env = common::start_with_admin(
        vec![engine(EngineConfig::prefill(1), "model-a")],
        vec![engine(EngineConfig::decode(1), "model-a")],
        |c| c.admin.api_key = Some(TOKEN.to_string()),
    )
    .await;
    env.wait_routable(1, 1).await;
    let mut engines = Vec::new();
    for m in ["model-c", "model-c", "model-d", "model-e"] {
        engines.push(
            pdgate_sim::spawn(engine(EngineConfig::regular(1), m))
                .await
                .expect("regular engine"),
        );
    }
    let served = |m: &'static str, n: usize| {
        move |s: &pdgate::pool::Snapshot| s.model(m).is_some_and(|v| v.regular_routable.len() == n)
    };

    // The admin API: pdgate's own route, then SGLang's with no worker_type.
    let body = serde_json::json!({"role": "regular", "url": engines[0].url()}).to_string();
    let (st, _, b) = env.admin("POST", "/workers", Some(TOKEN), &body).await;
    assert_eq!(st, 201, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(
        (v["id"].as_str(), v["role"].as_str()),
        (Some("regular-0"), Some("regular")),
        "{v}"
    );
    let path = format!("/add_worker?url={}", engines[1].url());
    let (st, _, b) = env.admin("POST", &path, Some(TOKEN), "").await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("regular worker"));
    env.wait_pool("model-c on two regular workers", served("model-c", 2))
        .await;
    let (st, _, b) = env.admin("GET", "/workers", Some(TOKEN), "").await;
    assert_eq!(st, 200);
    let v = json(&b);
    assert_eq!(v["stats"]["regular"], 2, "{v}");
    assert!(
        v["workers"]
            .as_array()
            .expect("workers")
            .iter()
            .any(|w| w["role"] == "regular" && w["model"] == "model-c"),
        "{v}"
    );
    for _ in 0..4 {
        let (status, _, body) = env
            .post("/v1/chat/completions", &chat("model-c", "hi", false))
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(Fleet::count(&engines[0]) + Fleet::count(&engines[1]), 4);

    // Hot reload: a `[[worker]]` added, then removed.
    let mut next = (**env.router.fleet.live().load()).clone();
    next.worker.push(pdgate::config::RegularWorkerConfig {
        url: engines[2].url(),
        model: None,
    });
    let applied = pdgate::reload::apply(&env.router, next.clone()).expect("valid");
    assert_eq!((applied.added, applied.removed), (1, 0));
    env.wait_pool("model-d served", served("model-d", 1)).await;
    let (status, _, _) = env
        .post("/v1/chat/completions", &chat("model-d", "hi", false))
        .await;
    assert_eq!(status, 200);
    assert_eq!(Fleet::count(&engines[2]), 1);
    next.worker.clear();
    let applied = pdgate::reload::apply(&env.router, next).expect("valid");
    assert_eq!((applied.added, applied.removed), (0, 1));
    env.wait_pool("model-d gone", |s| s.model("model-d").is_none())
        .await;
    let (status, _, _) = env
        .post("/v1/chat/completions", &chat("model-d", "hi", false))
        .await;
    assert_eq!(status, 404, "a model no worker serves any more is unknown");

    // Discovery: a pod matching the regular selector becomes a regular worker.
    let kube = FakeKube::start().await;
    let d = pdgate::config::DiscoveryConfig {
        enabled: true,
        regular_selector: Some("app=sglang,role=worker".into()),
        namespace: Some("llm".into()),
        port_name: Some("http".into()),
        ..Default::default()
    };
    let _disc = pdgate::discovery::spawn_with_client(
        kube.client("llm").await,
        &d,
        env.router.fleet.clone(),
    )
    .expect("discovery");
    kube.create(
        "llm",
        fake_kube::pod(
            "worker-0",
            &[("app", "sglang"), ("role", "worker")],
            engines[3].addr().port(),
        ),
    );
    env.wait_pool("model-e served by a discovered pod", served("model-e", 1))
        .await;
    let (status, _, _) = env
        .post("/v1/chat/completions", &chat("model-e", "hi", true))
        .await;
    assert_eq!(status, 200);
    assert_eq!(Fleet::count(&engines[3]), 1);
    let snap = env.router.pool.load();
    assert!(snap.regulars.iter().any(|w| matches!(
        &w.shared.source,
        pdgate::pool::WorkerSource::Discovered(p) if p.name == "worker-0"
    )));
}

/// `pdgate check` with regular workers: a fleet of regular workers only passes (with
/// `--probe-request` going through one), each engine's role is checked (a decode engine
/// listed as `[[worker]]` fails `role`, naming the right flag), and the model is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdgate_check_knows_regular_workers() {
    use pdgate::check::{self, CheckOptions};
    let reg = pdgate_sim::spawn(engine(EngineConfig::regular(1), "model-c"))
        .await
        .expect("regular engine");
    let dec = pdgate_sim::spawn(engine(EngineConfig::decode(1), "model-c"))
        .await
        .expect("decode engine");
    let worker = |url: String| pdgate::config::RegularWorkerConfig { url, model: None };

    let mut cfg = common::fast_config();
    cfg.worker = vec![worker(reg.url())];
    let report = check::run(
        &cfg,
        CheckOptions {
            probe_request: true,
        },
    )
    .await;
    assert!(report.ok, "{}", report.table());
    let names: Vec<&str> = report.checks.iter().map(|c| c.name.as_str()).collect();
    for want in ["regular_configured", "role", "probe_request"] {
        assert!(names.contains(&want), "{want}: {}", report.table());
    }
    assert!(report.table().contains("model-c"), "{}", report.table());
    assert_eq!(
        Fleet::count(&reg),
        1,
        "the probe request went to the regular worker"
    );

    cfg.worker = vec![worker(dec.url())];
    let report = check::run(&cfg, CheckOptions::default()).await;
    assert!(!report.ok, "{}", report.table());
    let role = report
        .checks
        .iter()
        .find(|c| c.name == "role")
        .expect("a role check");
    assert!(!role.ok, "{}", report.table());
    assert!(
        role.fix.as_deref().is_some_and(|f| f.contains("--decode")),
        "{role:?}"
    );
}

/// model-c's one regular worker dies after 2 chunks of a streamed chat: the client's
/// events, whether `[DONE]` came, and the raw answer.
async fn break_model_c_stream(f: &Fleet) -> (Vec<Value>, bool, bytes::Bytes) {
    f.regular[2].set_faults(pdgate_sim::Faults {
        decode_die_mid_stream_after: Some(2),
        ..Default::default()
    });
    let body = serde_json::json!({
        "model": "model-c",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": true,
    })
    .to_string();
    let (status, _, answer) = f.env.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "the first bytes came before the failure");
    let (events, done) = common::sse_events(&answer);
    (events, done, answer)
}

/// A regular worker that dies mid-stream with no other worker of its model to move to
/// (model-c has one): the client, who already has tokens, gets the usual error event and
/// `[DONE]` at once (no retry after the first byte, no move, no wait for the other models'
/// workers); the worker's breaker counts it; every load counter is back to 0 when the
/// bodies end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regular_stream_that_breaks_ends_with_an_error_event() {
    // The ejection cap counts the model's own pool (one regular worker here): let the
    // breaker hold all of it open.
    let f = mixed(|c| {
        c.breaker.failure_threshold = 1;
        c.breaker.max_ejection_ratio = 1.0;
    })
    .await;
    let env = &f.env;
    let (events, done, answer) = break_model_c_stream(&f).await;
    assert!(done, "{}", String::from_utf8_lossy(&answer));
    let last = events.last().expect("events");
    assert_eq!(
        last["error"]["type"],
        "decode_broken",
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert!(events.len() >= 2, "tokens came first: {events:?}");
    assert_eq!(f.regular(2), 1, "not retried after the first byte");
    env.wait_pool("the broken worker's breaker open", |s| {
        s.model("model-c")
            .is_some_and(|m| m.regular_routable.is_empty())
    })
    .await;
    let snap = env.router.pool.load();
    for w in snap
        .regulars
        .iter()
        .chain(&snap.prefills)
        .chain(&snap.decodes)
    {
        assert_eq!(
            w.in_flight_total(),
            0,
            "{} still holds a counter",
            w.shared.url
        );
    }
}

/// An alias reaches a regular worker as the model it names, as it reaches PD legs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_reaches_a_regular_worker_as_its_model() {
    let f = mixed(|c| {
        c.models.aliases.insert("c-alias".into(), "model-c".into());
    })
    .await;
    let body = serde_json::json!({
        "model": "c-alias",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    })
    .to_string();
    let (status, _, answer) = f.env.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let seen: Vec<Value> = f.regular[2]
        .recent_generate_bodies()
        .into_iter()
        .map(|(_, b)| b["model"].clone())
        .collect();
    assert_eq!(seen, [Value::from("model-c")]);
}

/// A regular worker's mid-stream failure counts against its model's own breaker
/// thresholds (`[models.settings."M".breaker]`), as its failures before the first byte and
/// the PD path's do: the top level's breaker is off here, model-c's opens at its first
/// failure (issue 33's first bug: the regular path built its watch from the top level's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regular_workers_mid_stream_failure_counts_against_its_models_breaker() {
    let f = mixed(|c| {
        c.breaker.failure_threshold = 0;
        c.models
            .settings
            .entry("model-c".into())
            .or_default()
            .breaker = Some(pdgate::config::models::BreakerOverride {
            failure_threshold: Some(1),
            open_ms: Some(60_000),
            max_open_ms: Some(60_000),
            max_ejection_ratio: Some(1.0),
        });
    })
    .await;
    let env = &f.env;
    let (events, done, _) = break_model_c_stream(&f).await;
    assert!(done && events.len() >= 2, "{events:?}");
    assert_eq!(f.regular(2), 1, "not retried after the first byte");
    env.wait_pool("model-c's breaker open on its worker", |s| {
        s.model("model-c")
            .is_some_and(|m| m.regular_routable.is_empty())
    })
    .await;
}
