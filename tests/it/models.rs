//! Many models behind one front door (issue 19): simulated engines that report their model
//! the way SGLang does (`/server_info`'s `served_model_name` / `model_path`); pdgate pairs
//! a prefill and a decode only within one model's handoff group and routes by the
//! request's `model`. The engines are the judge: a decode that asks a prefill of other
//! weights for its KV is counted by the simulator (`violation_kv_layout_mismatch`).

use crate::support::common;

use common::{start, Env};
use futures_util::future::join_all;
use pdgate_sim::EngineConfig;
use serde_json::Value;

/// A DP 1 simulated engine that reports serving `model` (`/server_info`).
pub(crate) fn engine(prefill: bool, model: &str) -> EngineConfig {
    let mut e = if prefill {
        EngineConfig::prefill(1)
    } else {
        EngineConfig::decode(1)
    };
    e.model = model.to_string();
    e
}

fn chat(model: &str) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
    })
    .to_string()
}

/// Prefills `a`, `b`; decodes `a`, `b`, `a` (the issue's fleet plus a second decode of
/// model-a), routable, with both models known.
async fn two_models(tweak: impl FnOnce(&mut pdgate::config::Config)) -> Env {
    let env = start(
        vec![engine(true, "model-a"), engine(true, "model-b")],
        vec![
            engine(false, "model-a"),
            engine(false, "model-b"),
            engine(false, "model-a"),
        ],
        tweak,
    )
    .await;
    env.wait_routable(2, 3).await;
    env.wait_pool("two models in two groups", |s| {
        s.models.len() == 2 && s.groups.len() == 2
    })
    .await;
    env
}

fn requests(env: &Env, prefills: &[usize], decodes: &[usize]) -> u64 {
    let p: u64 = prefills
        .iter()
        .map(|i| env.cluster.prefills[*i].stats().requests_total)
        .sum();
    let d: u64 = decodes
        .iter()
        .map(|i| env.cluster.decodes[*i].stats().requests_total)
        .sum();
    p + d
}

pub(crate) fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(bytes)))
}

fn assert_model_not_found(status: http::StatusCode, body: &[u8]) {
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(body));
    let v = json(body);
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    assert_eq!(v["error"]["param"], "model", "{v}");
    let text = v.to_string();
    assert!(
        !text.contains("127.0.0.1") && !text.contains("model-a"),
        "{text}"
    );
}

/// The issue's run: 48 chat requests, 24 per model, all at once. Every leg lands on its
/// model's engines (counted by each engine), no cross-model KV handoff happened, both
/// models are listed, and an unknown model is a 404 in OpenAI's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_leg_lands_on_its_models_engines() {
    let env = two_models(|_| {}).await;
    let bodies: Vec<String> = (0..48)
        .map(|i| chat(if i % 2 == 0 { "model-a" } else { "model-b" }))
        .collect();
    let answers = join_all(bodies.iter().map(|b| env.post("/v1/chat/completions", b))).await;
    for (status, _, body) in &answers {
        assert_eq!(*status, 200, "{}", String::from_utf8_lossy(body));
    }
    let s = env.settled_stats().await;
    assert_eq!(s.contract_violations, 0, "{s:?}");
    assert_eq!(s.violation_kv_layout_mismatch, 0, "{s:?}");
    // model-a: prefill 0, decodes 0 and 2; model-b: prefill 1, decode 1.
    assert_eq!(env.cluster.prefills[0].stats().requests_total, 24);
    assert_eq!(env.cluster.prefills[1].stats().requests_total, 24);
    assert_eq!(requests(&env, &[], &[0, 2]), 24);
    assert_eq!(env.cluster.decodes[1].stats().requests_total, 24);
    assert!(
        env.cluster.decodes[0].stats().requests_total > 0
            && env.cluster.decodes[2].stats().requests_total > 0,
        "both decodes of model-a take traffic"
    );

    let resp = env.send("GET", "/v1/models", &[], "").await;
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    let v = json(&body);
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["model-a", "model-b"], "{v}");
    assert_eq!(v["data"][0]["object"], "model");
    let scrape = pdgate::telemetry::render(&*env.router.pool);
    for m in ["model-a", "model-b"] {
        assert!(
            scrape.contains(&format!(
                r#"pdgate_model_requests_total{{model="{m}",outcome="ok"}}"#
            )),
            "{scrape}"
        );
        assert!(
            scrape.contains(&format!(
                r#"pdgate_model_request_duration_seconds_count{{model="{m}",outcome="ok"}}"#
            )),
            "{scrape}"
        );
        assert!(
            scrape.contains(&format!(
                r#"pdgate_model_routable_ranks{{model="{m}",role="decode"}} {}"#,
                if m == "model-a" { 2 } else { 1 }
            )),
            "{scrape}"
        );
    }

    let before = requests(&env, &[0, 1], &[0, 1, 2]);
    let (status, _, body) = env.post("/v1/chat/completions", &chat("model-c")).await;
    assert_model_not_found(status, &body);
    let (status, _, body) = env
        .post(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        )
        .await;
    assert_eq!(
        status,
        400,
        "no model with two served: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(
        requests(&env, &[0, 1], &[0, 1, 2]),
        before,
        "refused before any leg"
    );
}

/// SGLang's `/generate` names its model in a `model` field (not forwarded: SGLang's
/// `/generate` has none), else gets the default; `base:adapter` goes to `base`'s engines;
/// an alias to the model it names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_default_alias_and_adapter() {
    let env = two_models(|c| {
        c.models.default = Some("model-b".into());
        c.models.aliases.insert("gpt-4o".into(), "model-a".into());
    })
    .await;
    let (status, _, body) = env
        .post(
            "/generate",
            r#"{"text":"hi","model":"model-a","sampling_params":{"max_new_tokens":2}}"#,
        )
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(env.cluster.prefills[0].stats().requests_total, 1);
    let legs = env.cluster.prefills[0].recent_generate_bodies();
    assert!(
        legs.iter().all(|(_, b)| b.get("model").is_none()),
        "the /generate leg carries no model: {legs:?}"
    );
    let (status, _, _) = env.post("/generate", common::GEN).await;
    assert_eq!(status, 200);
    assert_eq!(
        env.cluster.prefills[1].stats().requests_total,
        1,
        "the default"
    );

    // An alias reaches the engines as the model they serve (both legs), a LoRA adapter
    // of an alias as `model:adapter`, a served base's adapter unchanged.
    let leg_models = |n: usize| -> Vec<String> {
        let mut names: Vec<String> = [&env.cluster.prefills[0], &env.cluster.decodes[0]]
            .iter()
            .chain(&[&env.cluster.decodes[2]])
            .flat_map(|e| e.recent_generate_bodies())
            .filter_map(|(_, b)| b["model"].as_str().map(str::to_string))
            .collect();
        names.sort();
        names.dedup();
        assert!(names.len() <= n, "{names:?}");
        names
    };
    let (status, _, body) = env.post("/v1/chat/completions", &chat("gpt-4o")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(leg_models(1), ["model-a"]);
    let (status, _, body) = env
        .post("/v1/chat/completions", &chat("model-a:my-lora"))
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(leg_models(2), ["model-a", "model-a:my-lora"]);
    let (status, _, body) = env.post("/v1/chat/completions", &chat("gpt-4o:sql")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(leg_models(3), ["model-a", "model-a:my-lora", "model-a:sql"]);
    assert_eq!(env.cluster.prefills[0].stats().requests_total, 4);
    assert_eq!(env.cluster.prefills[1].stats().requests_total, 1);
    let (status, _, body) = env
        .post("/v1/chat/completions", &chat("model-z:my-lora"))
        .await;
    assert_model_not_found(status, &body);

    let resp = env.send("GET", "/v1/models", &[], "").await;
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    let v = json(&body);
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["model-a", "model-b", "gpt-4o"], "{v}");
    assert_eq!(env.stats().contract_violations, 0);
}

/// With model-a's decodes down, model-a's requests get 503 and never go to model-b's
/// decode; model-b's requests still succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_a_decode_fails_alone() {
    let env = two_models(|_| {}).await;
    env.cluster.decodes[0].set_down(true);
    env.cluster.decodes[2].set_down(true);
    env.wait_pool("model-a's decodes out", |s| {
        s.model("model-a")
            .is_some_and(|m| m.decode_routable.is_empty())
    })
    .await;
    let b_decode = env.cluster.decodes[1].stats().requests_total;
    for _ in 0..6 {
        let (status, headers, body) = env.post("/v1/chat/completions", &chat("model-a")).await;
        assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
        assert!(headers.contains_key("retry-after"));
        let (status, _, body) = env.post("/v1/chat/completions", &chat("model-b")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(
        env.cluster.decodes[1].stats().requests_total - b_decode,
        6,
        "model-b's decode took model-b's requests only"
    );
    assert_eq!(
        env.cluster.prefills[0].stats().requests_total,
        0,
        "no model-a prefill leg without a partner"
    );
    assert_eq!(env.stats().violation_kv_layout_mismatch, 0);
}

/// One model served, no aliases: any `model` value (or none) reaches it, as SGLang engines
/// ignore the name; with `models.strict` only its own name does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_model_loose_and_strict() {
    for strict in [false, true] {
        let env = start(
            vec![engine(true, "Qwen/Qwen3-8B")],
            vec![engine(false, "Qwen/Qwen3-8B")],
            |c| c.models.strict = strict,
        )
        .await;
        env.wait_routable(1, 1).await;
        let (status, _, body) = env
            .post("/v1/chat/completions", &chat("Qwen/Qwen3-8B"))
            .await;
        assert_eq!(
            status,
            200,
            "strict={strict}: {}",
            String::from_utf8_lossy(&body)
        );
        let (status, _, body) = env.post("/v1/chat/completions", &chat("gpt-4o")).await;
        if strict {
            assert_model_not_found(status, &body);
        } else {
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        }
        let (status, _, _) = env.post("/generate", common::GEN).await;
        assert_eq!(status, 200, "strict={strict}: /generate without a model");
    }
}

/// The operator's word wins: four engines that all report `sim-model`, named `left` and
/// `right` per worker in the config, are two models.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_worker_override_splits_one_reported_model() {
    let env = start(
        vec![engine(true, "sim-model"), engine(true, "sim-model")],
        vec![engine(false, "sim-model"), engine(false, "sim-model")],
        |c| {
            c.prefill[0].model = Some("left".into());
            c.decode[0].model = Some("left".into());
            c.prefill[1].model = Some("right".into());
            c.decode[1].model = Some("right".into());
        },
    )
    .await;
    env.wait_routable(2, 2).await;
    env.wait_pool("two models", |s| s.models.len() == 2).await;
    for _ in 0..4 {
        let (status, _, _) = env.post("/v1/chat/completions", &chat("right")).await;
        assert_eq!(status, 200);
    }
    assert_eq!(env.cluster.prefills[1].stats().requests_total, 4);
    assert_eq!(env.cluster.decodes[1].stats().requests_total, 4);
    assert_eq!(requests(&env, &[0], &[0]), 0);
}

/// An engine restarted with other weights is re-read and moves to its new model's group:
/// model-b's only decode comes back serving model-a, so model-b answers 503 and model-a's
/// requests use it, with no cross-model handoff. `/readiness` says so per model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_regrouped() {
    let mut env = two_models(|_| {}).await;
    let old = env.cluster.decodes.remove(1);
    let mut cfg = old.config().clone();
    cfg.port = old.addr().port();
    cfg.model = "model-a".into();
    old.shutdown();
    env.wait_pool("model-b's decode seen down", |s| {
        s.model("model-b")
            .is_some_and(|m| m.decode_routable.is_empty())
    })
    .await;
    let mut again = None;
    for _ in 0..100 {
        match pdgate_sim::spawn(cfg.clone()).await {
            Ok(e) => {
                again = Some(e);
                break;
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
    env.cluster
        .decodes
        .push(again.expect("the engine restarts on its port"));
    env.wait_pool("three decodes of model-a", |s| {
        s.model("model-a")
            .is_some_and(|m| m.decode_routable.len() == 3)
    })
    .await;
    let (status, _, _) = env.post("/v1/chat/completions", &chat("model-b")).await;
    assert_eq!(status, 503);
    for _ in 0..9 {
        let (status, _, body) = env.post("/v1/chat/completions", &chat("model-a")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert!(
        env.cluster.decodes[2].stats().requests_total > 0,
        "the restarted decode serves model-a"
    );
    assert_eq!(env.stats().violation_kv_layout_mismatch, 0);

    let resp = env.send("GET", "/readiness", &[], "").await;
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    let v = json(&body);
    assert_eq!(v["ready"], true, "{v}");
    let per: Vec<(String, bool)> = v["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| {
            (
                m["model"].as_str().unwrap_or("").to_string(),
                m["ready"] == true,
            )
        })
        .collect();
    assert_eq!(
        per,
        [
            ("model-a".to_string(), true),
            ("model-b".to_string(), false)
        ],
        "{v}"
    );
}

/// The admin API adds a worker with its model, and shows for every worker its model and
/// its handoff group (why it sits where it does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_adds_a_worker_with_its_model_and_shows_its_group() {
    let env = common::start_with_admin(
        vec![
            common::fast_engine(engine(true, "model-a")),
            common::fast_engine(engine(true, "model-b")),
        ],
        vec![
            common::fast_engine(engine(false, "model-a")),
            common::fast_engine(engine(false, "model-b")),
        ],
        |_| {},
    )
    .await;
    env.wait_routable(2, 2).await;
    let extra = pdgate_sim::spawn(common::fast_engine(engine(false, "model-b")))
        .await
        .expect("engine");
    let body = serde_json::json!({"role": "decode", "url": extra.url(), "model": "model-b"});
    let (st, _, b) = env.admin("POST", "/workers", None, &body.to_string()).await;
    assert_eq!(st, 201, "{}", String::from_utf8_lossy(&b));
    env.wait_pool("two decodes of model-b", |s| {
        s.model("model-b")
            .is_some_and(|m| m.decode_routable.len() == 2)
    })
    .await;
    let (st, _, b) = env.admin("GET", "/workers", None, "").await;
    assert_eq!(st, 200);
    let v = json(&b);
    let workers = v["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 5);
    for w in workers {
        assert!(w["model"].is_string(), "{w}");
        assert!(w["handoff_group"]["index"].is_u64(), "{w}");
        assert_eq!(w["handoff_group"]["page_size"], 1, "{w}");
    }
    let groups_of = |m: &str| -> Vec<u64> {
        let mut g: Vec<u64> = workers
            .iter()
            .filter(|w| w["model"] == m)
            .filter_map(|w| w["handoff_group"]["index"].as_u64())
            .collect();
        g.dedup();
        g
    };
    assert_eq!(groups_of("model-b").len(), 1, "{v}");
    assert_ne!(groups_of("model-a"), groups_of("model-b"), "{v}");
    // Listed per model: model-b's three workers and what it can route to.
    let (st, _, b) = env.admin("GET", "/workers?model=model-b", None, "").await;
    assert_eq!(st, 200);
    let per = json(&b);
    assert_eq!(per["model"], "model-b", "{per}");
    assert_eq!(per["total"], 3, "{per}");
    assert_eq!(per["stats"]["decode"], 2, "{per}");
    assert_eq!(per["stats"]["routable_decode_ranks"], 2, "{per}");
    assert!(
        per["workers"]
            .as_array()
            .expect("workers")
            .iter()
            .all(|w| w["model"] == "model-b"),
        "{per}"
    );
    let (st, _, b) = env.admin("GET", "/workers?model=nobody", None, "").await;
    assert_eq!(st, 200);
    assert_eq!(json(&b)["total"], 0);
    let (bad, _, b) = env
        .admin(
            "POST",
            "/workers",
            None,
            &serde_json::json!({"role": "decode", "url": "http://127.0.0.1:9", "model": " "})
                .to_string(),
        )
        .await;
    assert_eq!(bad, 400, "{}", String::from_utf8_lossy(&b));
}

/// Discovery: pods whose engines all report `sim-model` are named by their
/// `sglang.ai/model` annotation, and requests follow the annotation's model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovered_pods_are_named_by_their_model_annotation() {
    use crate::discovery::{discovery_config, DECODE, NS, PREFILL};
    use crate::support::fake_kube::{self, FakeKube};
    let kube = FakeKube::start().await;
    let env = start(vec![], vec![], |_| {}).await;
    let disc = pdgate::discovery::spawn_with_client(
        kube.client(NS).await,
        &discovery_config(),
        env.router.fleet.clone(),
    )
    .expect("discovery");
    let mut engines = Vec::new();
    for (i, model) in ["left", "right"].iter().enumerate() {
        for (role, labels) in [(true, PREFILL), (false, DECODE)] {
            let e = pdgate_sim::spawn(common::fast_engine(engine(role, "sim-model")))
                .await
                .expect("engine");
            let name = format!("{}-{i}", if role { "prefill" } else { "decode" });
            let mut pod = fake_kube::pod(&name, labels, e.addr().port());
            let mut notes = std::collections::BTreeMap::new();
            notes.insert("sglang.ai/model".to_string(), model.to_string());
            if let Some(bp) = e.bootstrap_port() {
                notes.insert("sglang.ai/bootstrap-port".to_string(), bp.to_string());
            }
            pod.metadata.annotations = Some(notes);
            kube.create(NS, pod);
            engines.push(e);
        }
    }
    env.wait_routable(2, 2).await;
    env.wait_pool("two models", |s| s.models.len() == 2).await;
    for _ in 0..4 {
        let (status, _, body) = env.post("/v1/chat/completions", &chat("right")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    // engines: [left prefill, left decode, right prefill, right decode]
    let counts: Vec<u64> = engines.iter().map(|e| e.stats().requests_total).collect();
    assert_eq!(counts, [0, 0, 4, 4]);
    drop(disc);
}

/// Hot reload: `[models]` applies to the next request (an alias added), and a static
/// worker whose `model` changed is replaced by one of the new model (the old one drains).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_aliases_and_renames_a_worker() {
    let env = two_models(|_| {}).await;
    let (status, _, body) = env.post("/v1/chat/completions", &chat("gpt-4o")).await;
    assert_model_not_found(status, &body);
    let mut next = (**env.router.fleet.live().load()).clone();
    next.models
        .aliases
        .insert("gpt-4o".into(), "model-b".into());
    // Decode 2 (model-a's second) is renamed; its engine still reports model-a, so it now
    // serves "model-c" alone, in a group of its own.
    next.decode[2].model = Some("model-c".into());
    let applied = pdgate::reload::apply(&env.router, next).expect("valid");
    assert_eq!((applied.added, applied.removed), (1, 1), "{applied:?}");
    let (status, _, body) = env.post("/v1/chat/completions", &chat("gpt-4o")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    env.wait_pool("model-c's decode in, the old one gone", |s| {
        s.model("model-c").is_some_and(|m| m.workers[1] == 1) && s.decodes.len() == 3
    })
    .await;
    let before = env.cluster.decodes[2].stats().requests_total;
    for _ in 0..6 {
        let (status, _, body) = env.post("/v1/chat/completions", &chat("model-a")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(
        env.cluster.decodes[2].stats().requests_total,
        before,
        "the renamed decode no longer takes model-a's requests"
    );
    // model-c has a decode but no prefill of its own: a 503 for it alone.
    let (status, _, _) = env.post("/v1/chat/completions", &chat("model-c")).await;
    assert_eq!(status, 503);
}

/// A GET on the front door: status and JSON body.
pub(crate) async fn get_json(env: &Env, path: &str) -> (http::StatusCode, Value) {
    let resp = env.send("GET", path, &[], "").await;
    let status = resp.status();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    (status, json(&body))
}

/// SGLang router's info and probe routes take `?model=` and answer for that model's
/// engines (an alias and `base:adapter` resolve as a request's `model` does; an unknown
/// name is a 404); without it, for `models.default`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_health_generate_answer_per_model() {
    let env = two_models(|c| {
        c.models.default = Some("model-b".into());
        c.models.aliases.insert("gpt-4o".into(), "model-a".into());
    })
    .await;
    let cases = [
        ("/get_server_info?model=model-a", "model-a"),
        ("/server_info?model=gpt-4o", "model-a"),
        ("/get_server_info?model=model-b%3Amy-lora", "model-b"),
        ("/get_server_info", "model-b"),
        ("/get_model_info?model=model-a", "model-a"),
        ("/model_info", "model-b"),
    ];
    for (path, model) in cases {
        let (status, v) = get_json(&env, path).await;
        assert_eq!(status, 200, "{path}: {v}");
        assert_eq!(v["model_path"], model, "{path}: {v}");
        if path.contains("server_info") {
            assert_eq!(v["served_model_name"], model, "{path}: {v}");
        }
    }
    for path in [
        "/get_server_info?model=model-c",
        "/get_model_info?model=model-c",
        "/health_generate?model=model-c",
    ] {
        let resp = env.send("GET", path, &[], "").await;
        let status = resp.status();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("body")
            .to_bytes();
        assert_model_not_found(status, &body);
    }

    // The probe goes through the named model's pair, else the default's.
    let (status, v) = get_json(&env, "/health_generate?model=model-a").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(env.cluster.prefills[0].stats().requests_total, 1);
    assert_eq!(env.cluster.prefills[1].stats().requests_total, 0);
    let (status, v) = get_json(&env, "/health_generate").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(env.cluster.prefills[1].stats().requests_total, 1);
    assert_eq!(env.cluster.prefills[0].stats().requests_total, 1);

    // A model whose decodes are down: its probe fails, the other's still passes.
    env.cluster.decodes[1].set_down(true);
    env.wait_pool("model-b's decode out", |s| {
        s.model("model-b")
            .is_some_and(|m| m.decode_routable.is_empty())
    })
    .await;
    let (status, v) = get_json(&env, "/health_generate?model=model-b").await;
    assert_eq!(status, 503, "{v}");
    let (status, v) = get_json(&env, "/health_generate?model=model-a").await;
    assert_eq!(status, 200, "{v}");
    let s = env.settled_stats().await;
    assert_eq!(s.violation_kv_layout_mismatch, 0, "{s:?}");
}

/// One model in two handoff groups (weights `v1` and `v2`); `v1`'s decode fails every
/// request (500) while its health is fine. A retry excludes that decode; the next attempt
/// must then pick a prefill whose group still has a decode left (here `v2`'s), never
/// `v1`'s prefill, whose only partner is excluded (that answered 503 `no decode`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_moves_to_another_handoff_group_of_the_model() {
    let version = |prefill: bool, v: &str| {
        let mut e = engine(prefill, "org/model");
        e.weight_version = v.to_string();
        e
    };
    let mut bad = version(false, "v1");
    bad.faults = pdgate_sim::Faults {
        decode_status: Some(500),
        ..pdgate_sim::Faults::default()
    };
    let env = start(
        vec![version(true, "v1"), version(true, "v2")],
        vec![bad, version(false, "v2")],
        |cfg| {
            // Passive ejection off: the failing decode stays routable, so every request
            // that meets it must be moved by its retry.
            cfg.breaker.failure_threshold = 0;
            cfg.policy.prefill = pdgate::config::PolicyKind::Random;
            cfg.policy.decode = pdgate::config::PolicyKind::Random;
        },
    )
    .await;
    env.wait_routable(2, 2).await;
    env.wait_pool("one model in two groups", |s| {
        s.models.len() == 1 && s.groups.len() == 2
    })
    .await;
    for i in 0..24 {
        let (status, _, body) = env.post("/v1/chat/completions", &chat("org/model")).await;
        assert_eq!(
            status,
            200,
            "request {i}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    assert!(
        env.cluster.decodes[0].stats().requests_total > 0,
        "the failing decode was met (the test exercised a retry)"
    );
    assert_eq!(env.stats().violation_kv_layout_mismatch, 0);
}
