//! Happy PD requests sent by hand (prefill leg + decode leg with identical
//! bootstrap fields), and the rank-mismatch negative control.

use crate::support::sim_support;

use std::time::Duration;

use pdgate_sim::{EngineConfig, SimCluster, StatsSnapshot};
use serde_json::{json, Value};
use sim_support::{eventually, post, Answer};

fn fast(mut c: EngineConfig) -> EngineConfig {
    c.prefill_delay = Duration::from_millis(2);
    c.ttft = Duration::from_millis(2);
    c.itl = Duration::from_millis(1);
    c
}

async fn cluster(prefill_dp: u32, decode_dp: u32) -> SimCluster {
    SimCluster::spawn(
        &[fast(EngineConfig::prefill(prefill_dp))],
        &[fast(EngineConfig::decode(decode_dp))],
    )
    .await
    .expect("cluster")
}

/// Adds the bootstrap fields of the cluster's prefill to `body`.
fn with_bootstrap(c: &SimCluster, mut body: Value, room: Value) -> Value {
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(c.prefills[0].bootstrap_port());
    body["bootstrap_room"] = room;
    body
}

/// Sends both legs concurrently; returns (prefill answer, decode answer).
async fn pd(
    c: &SimCluster,
    path: &str,
    prefill_body: &Value,
    decode_body: &Value,
) -> (Answer, Answer) {
    let p_url = format!("{}{path}", c.prefills[0].url());
    let d_url = format!("{}{path}", c.decodes[0].url());
    let (pb, db) = (prefill_body.to_string(), decode_body.to_string());
    tokio::join!(post(&p_url, &pb), post(&d_url, &db))
}

async fn settled(c: &SimCluster) -> StatsSnapshot {
    let ok = eventually(|| c.total_stats().held_now == 0).await;
    let s = c.total_stats();
    assert!(ok, "held_now never returned to 0: {s:?}");
    s
}

fn assert_clean(s: &StatsSnapshot, instances: u64) {
    assert_eq!(s.contract_violations, 0, "{s:?}");
    assert_eq!(s.held_now, 0, "{s:?}");
    assert_eq!(s.kv_waiting_decodes, 0, "{s:?}");
    assert_eq!(s.failed + s.aborted + s.client_disconnects, 0, "{s:?}");
    assert_eq!(s.kv_transfers, instances, "{s:?}");
    assert_eq!(s.requests_total, 2 * instances, "{s:?}");
    assert_eq!(s.ok, 2 * instances, "{s:?}");
}

#[tokio::test(crate = "crate::support::rt")]
async fn generate_non_stream_dp1_with_logprobs() {
    let c = cluster(1, 1).await;
    let body = with_bootstrap(
        &c,
        json!({"text": "one two three four", "sampling_params": {"max_new_tokens": 5}, "return_logprob": true, "logprob_start_len": 0}),
        json!(12345),
    );
    let (p, d) = pd(&c, "/generate", &body, &body).await;
    assert_eq!(p.status, 200, "{}", p.body);
    assert_eq!(d.status, 200, "{}", d.body);
    let pv = p.json();
    assert_eq!(pv["meta_info"]["completion_tokens"], 1);
    let input = pv["meta_info"]["input_token_logprobs"]
        .as_array()
        .expect("input logprobs")
        .clone();
    assert_eq!(input.len(), 4);
    assert!(input[0][0].is_null());
    let dv = d.json();
    assert_eq!(dv["meta_info"]["completion_tokens"], 5);
    assert_eq!(
        dv["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 5})
    );
    assert_eq!(dv["output_ids"].as_array().map(Vec::len), Some(5));
    assert_eq!(dv["meta_info"]["input_token_logprobs"], json!([]));
    assert_eq!(
        dv["meta_info"]["output_token_logprobs"]
            .as_array()
            .map(Vec::len),
        Some(5)
    );
    let s = settled(&c).await;
    assert_clean(&s, 1);
}

/// Input logprobs as SGLang returns them: from `logprob_start_len` on, and none without it
/// (its default -1: output tokens only).
#[tokio::test(crate = "crate::support::rt")]
async fn input_logprobs_start_at_logprob_start_len() {
    let c = cluster(1, 1).await;
    for (start, want) in [(None, 0usize), (Some(0), 4), (Some(2), 2), (Some(9), 0)] {
        let mut req = json!({"text": "one two three four", "sampling_params": {"max_new_tokens": 2}, "return_logprob": true});
        if let Some(s) = start {
            req["logprob_start_len"] = json!(s);
        }
        let body = with_bootstrap(
            &c,
            req,
            json!(777 + want as u64 + start.unwrap_or(50) as u64),
        );
        let (p, d) = pd(&c, "/generate", &body, &body).await;
        assert_eq!(p.status, 200, "{}", p.body);
        assert_eq!(d.status, 200, "{}", d.body);
        let input = p.json()["meta_info"]["input_token_logprobs"].clone();
        assert_eq!(
            input.as_array().map(Vec::len),
            Some(want),
            "{start:?}: {input}"
        );
        if start == Some(2) {
            assert_eq!(input[0][0], json!(-0.5), "not the prompt's first token");
        }
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn generate_stream_dp2_cumulative_chunks() {
    let c = cluster(2, 2).await;
    for room in [7u64, 8] {
        let body = with_bootstrap(
            &c,
            json!({"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 3}}),
            json!(room),
        );
        let (p, d) = pd(&c, "/generate", &body, &body).await;
        assert_eq!(p.status, 200);
        assert_eq!(p.content_type, "text/event-stream");
        let pe = p.events();
        assert_eq!(pe.len(), 2, "{pe:?}");
        assert_eq!(pe[1], "[DONE]");
        let de = d.events();
        assert_eq!(de.len(), 4, "{de:?}");
        assert_eq!(de[3], "[DONE]");
        let chunks: Vec<Value> = de[..3]
            .iter()
            .map(|e| serde_json::from_str(e).expect("json"))
            .collect();
        let mut prev = String::new();
        for (i, ch) in chunks.iter().enumerate() {
            let text = ch["text"].as_str().expect("text").to_string();
            assert!(
                text.starts_with(&prev) && text.len() > prev.len(),
                "cumulative: {de:?}"
            );
            prev = text;
            let fr = &ch["meta_info"]["finish_reason"];
            if i < 2 {
                assert!(fr.is_null());
            } else {
                assert_eq!(fr["type"], "length");
            }
        }
    }
    let s = settled(&c).await;
    assert_clean(&s, 2);
    // Prefill ran room 7 on rank 1 and room 8 on rank 0.
    assert_eq!(c.prefills[0].stats().requests_per_rank, vec![1, 1]);
}

#[tokio::test(crate = "crate::support::rt")]
async fn chat_non_stream_dp2() {
    let c = cluster(2, 2).await;
    let body = with_bootstrap(
        &c,
        json!({"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}),
        json!(101),
    );
    let (p, d) = pd(&c, "/v1/chat/completions", &body, &body).await;
    assert_eq!(p.status, 200, "{}", p.body);
    assert_eq!(p.json()["object"], "chat.completion");
    let dv = d.json();
    assert_eq!(d.status, 200, "{}", d.body);
    assert_eq!(dv["object"], "chat.completion");
    assert_eq!(dv["choices"][0]["finish_reason"], "length");
    assert_eq!(dv["choices"][0]["message"]["role"], "assistant");
    assert_eq!(dv["usage"]["completion_tokens"], 4);
    let s = settled(&c).await;
    assert_clean(&s, 1);
}

#[tokio::test(crate = "crate::support::rt")]
async fn chat_stream_dp1_with_usage() {
    let c = cluster(1, 1).await;
    let body = with_bootstrap(
        &c,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true,
               "stream_options": {"include_usage": true}}),
        json!(55),
    );
    let (p, d) = pd(&c, "/v1/chat/completions", &body, &body).await;
    let pe = p.events();
    assert_eq!(pe.len(), 2, "prefill: one chunk then [DONE]: {pe:?}");
    let pc: Value = serde_json::from_str(&pe[0]).expect("json");
    assert_eq!(pc["choices"][0]["finish_reason"], "length");
    let de = d.events();
    assert_eq!(de.last().map(String::as_str), Some("[DONE]"), "{de:?}");
    let chunks: Vec<Value> = de[..de.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json"))
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty());
    let s = settled(&c).await;
    assert_clean(&s, 1);
}

#[tokio::test(crate = "crate::support::rt")]
async fn generate_batch_with_room_list() {
    let c = cluster(2, 1).await;
    let body = with_bootstrap(
        &c,
        json!({"text": ["a b", "c d e"], "sampling_params": {"max_new_tokens": 2}}),
        json!([1000, 1001]),
    );
    let (p, d) = pd(&c, "/generate", &body, &body).await;
    assert_eq!(p.status, 200, "{}", p.body);
    let dv = d.json();
    let list = dv.as_array().expect("batch answers a list");
    assert_eq!(list.len(), 2);
    assert_eq!(list[1]["meta_info"]["prompt_tokens"], 3);
    let s = settled(&c).await;
    assert_clean(&s, 2);
    assert_eq!(c.prefills[0].stats().requests_per_rank, vec![1, 1]);
}

#[tokio::test(crate = "crate::support::rt")]
async fn completions_non_stream_query_mode() {
    // A prefill that does not follow rooms registers each room's rank; the
    // decode resolves it through /query_dp_ranks.
    let mut p = fast(EngineConfig::prefill(2));
    p.load_balance_method = "round_robin".to_string();
    let c = SimCluster::spawn(&[p], &[fast(EngineConfig::decode(1))])
        .await
        .expect("cluster");
    for room in [20u64, 22, 24] {
        let body = with_bootstrap(&c, json!({"prompt": "x y", "max_tokens": 2}), json!(room));
        let (p, d) = pd(&c, "/v1/completions", &body, &body).await;
        assert_eq!(p.status, 200, "{}", p.body);
        assert_eq!(d.status, 200, "{}", d.body);
        assert_eq!(d.json()["object"], "text_completion");
    }
    let s = settled(&c).await;
    assert_clean(&s, 3);
    // Round robin: even rooms still land on both ranks.
    assert_eq!(
        c.prefills[0].stats().requests_per_rank.iter().sum::<u64>(),
        3
    );
    assert!(c.prefills[0]
        .stats()
        .requests_per_rank
        .iter()
        .all(|n| *n > 0));
}

#[tokio::test(crate = "crate::support::rt")]
async fn rank_mismatch_is_counted_and_both_legs_time_out() {
    let mut p = fast(EngineConfig::prefill(2));
    p.bootstrap_timeout = Duration::from_millis(300);
    let mut d = fast(EngineConfig::decode(1));
    d.waiting_timeout = Duration::from_millis(300);
    let c = SimCluster::spawn(&[p], &[d]).await.expect("cluster");
    let room = 41u64; // prefill runs it on rank 1
    let prefill_body = with_bootstrap(&c, json!({"text": "hi"}), json!(room));
    let mut decode_body = prefill_body.clone();
    decode_body["disagg_prefill_dp_rank"] = json!(0);
    let (p, d) = pd(&c, "/generate", &prefill_body, &decode_body).await;
    assert_eq!(p.status, 500, "{}", p.body);
    assert!(p.body.contains("KVPoll.Bootstrapping"), "{}", p.body);
    assert_eq!(d.status, 500, "{}", d.body);
    assert_eq!(d.json()["type"], "500");
    assert!(d.body.contains("KVPoll.WaitingForInput"), "{}", d.body);
    let s = settled(&c).await;
    assert_eq!(s.violation_rank_mismatch, 1, "{s:?}");
    assert_eq!(s.contract_violations, 1, "{s:?}");
    assert_eq!(s.kv_transfers, 0);
    assert_eq!(s.failed, 2);
    let gone = eventually(|| c.total_stats().kv_waiting_decodes == 0).await;
    assert!(
        gone,
        "a decode still waits at the rank endpoint: {:?}",
        c.total_stats()
    );
}

#[tokio::test(crate = "crate::support::rt")]
async fn decode_first_then_prefill_and_room_reuse() {
    let c = cluster(1, 1).await;
    let body = with_bootstrap(
        &c,
        json!({"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
        json!(9),
    );
    let d_url = format!("{}/generate", c.decodes[0].url());
    let p_url = format!("{}/generate", c.prefills[0].url());
    let b = body.to_string();
    let decode = tokio::spawn({
        let b = b.clone();
        async move { post(&d_url, &b).await }
    });
    // The decode reaches the prefill's rank endpoint (and waits there) before the prefill
    // leg is sent.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while c.prefills[0].stats().kv_waiting_decodes == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the decode never reached the rank endpoint: {:?}",
            c.prefills[0].stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = post(&p_url, &b).await;
    assert_eq!(p.status, 200);
    assert_eq!(decode.await.expect("join").status, 200);
    // Reusing room 9 is a violation (but still served).
    let (p2, d2) = pd(&c, "/generate", &body, &body).await;
    assert_eq!((p2.status, d2.status), (200, 200));
    let s = settled(&c).await;
    assert_eq!(s.violation_room_reused, 1, "{s:?}");
    assert_eq!(s.kv_transfers, 2);
}

#[tokio::test(crate = "crate::support::rt")]
async fn decode_at_wrong_prefill_is_a_bootstrap_mismatch() {
    let mut d = fast(EngineConfig::decode(1));
    d.waiting_timeout = Duration::from_millis(200);
    let mut p = fast(EngineConfig::prefill(1));
    p.bootstrap_timeout = Duration::from_millis(200);
    let c = SimCluster::spawn(&[p.clone(), p], &[d])
        .await
        .expect("cluster");
    let prefill_body = with_bootstrap(&c, json!({"text": "hi"}), json!(77));
    let mut decode_body = prefill_body.clone();
    decode_body["bootstrap_port"] = json!(c.prefills[1].bootstrap_port());
    let (p, d) = pd(&c, "/generate", &prefill_body, &decode_body).await;
    assert_eq!((p.status, d.status), (500, 500));
    let s = settled(&c).await;
    assert_eq!(s.violation_bootstrap_mismatch, 1, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_pairs_settle_cleanly() {
    let c = SimCluster::spawn(
        &[
            fast(EngineConfig::prefill(2)),
            fast(EngineConfig::prefill(2)),
        ],
        &[fast(EngineConfig::decode(2))],
    )
    .await
    .expect("cluster");
    let mut tasks = Vec::new();
    for i in 0..100u64 {
        let p = &c.prefills[(i % 2) as usize];
        let body = json!({"text": "a b c", "stream": i % 3 == 0, "sampling_params": {"max_new_tokens": 3},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port(), "bootstrap_room": 5000 + i})
        .to_string();
        let (pu, du) = (
            format!("{}/generate", p.url()),
            format!("{}/generate", c.decodes[0].url()),
        );
        tasks.push(tokio::spawn(async move {
            let (p, d) = tokio::join!(post(&pu, &body), post(&du, &body));
            (p.status, d.status)
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("join"), (200, 200));
    }
    let s = settled(&c).await;
    assert_clean(&s, 100);
}

/// A decode of other weights asking a prefill for its KV (a cross-model pair) is refused
/// by the prefill at once and counted; the sim's `/server_info` and `/v1/models` name the
/// model as SGLang does.
#[tokio::test(crate = "crate::support::rt")]
async fn a_cross_model_handoff_is_refused_and_counted() {
    let mut d = fast(EngineConfig::decode(1));
    d.model = "/models/other".into();
    d.served_model_name = Some("other".into());
    let mut p = fast(EngineConfig::prefill(1));
    p.bootstrap_timeout = Duration::from_millis(300);
    let c = SimCluster::spawn(&[p], &[d]).await.expect("cluster");
    let info = sim_support::get(&format!("{}/server_info", c.decodes[0].url()))
        .await
        .json();
    assert_eq!(info["served_model_name"], "other");
    assert_eq!(info["model_path"], "/models/other");
    assert_eq!(info["weight_version"], "default");
    let models = sim_support::get(&format!("{}/v1/models", c.decodes[0].url()))
        .await
        .json();
    assert_eq!(models["data"][0]["id"], "other");
    assert_eq!(models["data"][0]["root"], "/models/other");
    let body = with_bootstrap(&c, json!({"text": "hi"}), json!(91));
    let (_p, d) = pd(&c, "/generate", &body, &body).await;
    assert_eq!(d.status, 500, "{}", d.body);
    let s = settled(&c).await;
    assert_eq!(s.violation_kv_layout_mismatch, 1, "{s:?}");
    assert_eq!(s.kv_transfers, 0, "{s:?}");
}

/// A negative or non-integer token limit is a 400, as SGLang answers it, on every route
/// and before any KV transfer; an absent or null one takes the default.
#[tokio::test(crate = "crate::support::rt")]
async fn a_negative_token_limit_is_refused() {
    let c = cluster(1, 1).await;
    let url = |path: &str| format!("{}{path}", c.decodes[0].url());
    let bad = [
        (
            "/generate",
            json!({"text": "hi", "sampling_params": {"max_new_tokens": -5}}),
        ),
        (
            "/generate",
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 2.5}}),
        ),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": -5})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "8"}),
        ),
    ];
    for (path, body) in bad {
        let body = with_bootstrap(&c, body, json!(7));
        let a = post(&url(path), &body.to_string()).await;
        assert_eq!(a.status, 400, "{path} {body}: {}", a.body);
        assert!(a.body.contains("must be at least 0"), "{}", a.body);
    }
    assert_eq!(c.total_stats().kv_transfers, 0);
    // Null is "not given" (SGLang's default applies): served.
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": null}});
    let body = with_bootstrap(&c, body, json!(8));
    let (p, d) = pd(&c, "/generate", &body, &body).await;
    assert_eq!((p.status, d.status), (200, 200), "{} {}", p.body, d.body);
}
