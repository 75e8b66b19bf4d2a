//! Fault injection and failure shapes of the simulated engines.

use crate::support::sim_support;

use std::time::Duration;

use pdgate_sim::{EngineConfig, Faults, SimCluster};
use serde_json::{json, Value};
use sim_support::{eventually, get, post, try_request};

fn fast(mut c: EngineConfig) -> EngineConfig {
    c.prefill_delay = Duration::from_millis(2);
    c.ttft = Duration::from_millis(2);
    c.itl = Duration::from_millis(1);
    c.sentinel_attempts = 3;
    c.sentinel_interval = Duration::from_millis(20);
    c.waiting_timeout = Duration::from_secs(5);
    c.bootstrap_timeout = Duration::from_secs(5);
    c
}

fn leg(c: &SimCluster, room: u64, extra: Value) -> String {
    let mut b = json!({"text": "hello", "sampling_params": {"max_new_tokens": 3},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": c.prefills[0].bootstrap_port(), "bootstrap_room": room});
    if let (Value::Object(m), Value::Object(e)) = (&mut b, extra) {
        m.extend(e);
    }
    b.to_string()
}

async fn held_zero(c: &SimCluster) {
    let ok = eventually(|| c.total_stats().held_now == 0).await;
    assert!(ok, "{:?}", c.total_stats());
}

#[tokio::test(crate = "crate::support::rt")]
async fn prefill_status_faults_use_sglang_shapes() {
    let mut p = fast(EngineConfig::prefill(1));
    p.faults.prefill_status = Some(500);
    let c = SimCluster::spawn(&[p], &[]).await.expect("cluster");
    let url = c.prefills[0].url();
    let a = post(&format!("{url}/generate"), &leg(&c, 1, json!({}))).await;
    assert_eq!(a.status, 500);
    let v = a.json();
    assert_eq!(
        (v["object"].clone(), v["type"].clone(), v["code"].clone()),
        (json!("error"), json!("500"), json!(500))
    );

    c.prefills[0].set_faults(Faults {
        prefill_status: Some(400),
        ..Faults::default()
    });
    let a = post(&format!("{url}/generate"), &leg(&c, 2, json!({}))).await;
    assert_eq!(a.status, 400);
    assert!(a.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("longer than the model's context length"));
    let a = post(
        &format!("{url}/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "x"}], "bootstrap_room": 3}).to_string(),
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(a.json()["type"], "BadRequestError");
    assert_eq!(a.json()["code"], 400);
    held_zero(&c).await;
    let s = c.total_stats();
    assert_eq!((s.requests_total, s.failed), (3, 3), "{s:?}");
}

#[tokio::test(crate = "crate::support::rt")]
async fn missing_room_and_conflicting_routed_rank() {
    let c = SimCluster::spawn(
        &[fast(EngineConfig::prefill(2))],
        &[fast(EngineConfig::decode(1))],
    )
    .await
    .expect("cluster");
    let d = post(
        &format!("{}/generate", c.decodes[0].url()),
        r#"{"text": "x"}"#,
    )
    .await;
    assert_eq!(d.status, 400);
    assert!(
        d.body
            .contains("Disaggregated request received without bootstrap room id"),
        "{}",
        d.body
    );
    // routed_dp_rank 0 with room 5 (implies rank 1): SGLang's conflict error.
    let p = post(
        &format!("{}/generate", c.prefills[0].url()),
        &leg(&c, 5, json!({"routed_dp_rank": 0})),
    )
    .await;
    assert_eq!(p.status, 500);
    assert!(p.body.contains("follow_bootstrap_room conflict: dispatched to dp_rank 0 but bootstrap_room 5 implies dp_rank 1"), "{}", p.body);
    let p = post(
        &format!("{}/generate", c.prefills[0].url()),
        &leg(&c, 6, json!({"routed_dp_rank": 7})),
    )
    .await;
    assert_eq!(p.status, 400);
    assert!(p.body.contains("DP rank 7 is not active."), "{}", p.body);
    held_zero(&c).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn bootstrap_down_fails_decode_after_sentinel_attempts() {
    let mut p = fast(EngineConfig::prefill(1));
    p.faults.bootstrap_down = true;
    let c = SimCluster::spawn(&[p], &[fast(EngineConfig::decode(1))])
        .await
        .expect("cluster");
    let d = post(
        &format!("{}/generate", c.decodes[0].url()),
        &leg(&c, 1, json!({})),
    )
    .await;
    assert_eq!(d.status, 500);
    let addr = format!("127.0.0.1:{}", c.prefills[0].bootstrap_port().unwrap_or(0));
    let msg = d.json()["message"].as_str().unwrap_or("").to_string();
    assert_eq!(
        msg,
        format!("Could not fetch prefill parallel info from {addr} after 3 attempts")
    );
    // Streaming on the OpenAI route: 200, an error chunk, [DONE].
    let body = json!({"messages": [{"role": "user", "content": "x"}], "stream": true,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": c.prefills[0].bootstrap_port(), "bootstrap_room": 2});
    let d = post(
        &format!("{}/v1/chat/completions", c.decodes[0].url()),
        &body.to_string(),
    )
    .await;
    assert_eq!(d.status, 200);
    let ev = d.events();
    assert_eq!(ev.len(), 2, "{ev:?}");
    let err: Value = serde_json::from_str(&ev[0]).expect("json");
    assert_eq!(err["error"]["type"], "INTERNAL_SERVER_ERROR");
    assert_eq!(err["error"]["code"], 500);
    assert_eq!(ev[1], "[DONE]");
    held_zero(&c).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn unregistered_rank_fails_decode_at_once() {
    let c = SimCluster::spawn(
        &[fast(EngineConfig::prefill(2))],
        &[fast(EngineConfig::decode(1))],
    )
    .await
    .expect("cluster");
    let (p_url, d_url) = (
        format!("{}/generate", c.prefills[0].url()),
        format!("{}/generate", c.decodes[0].url()),
    );
    // Warm the decode's cache of the prefill's parallel info with a room on rank 0.
    let b = leg(&c, 10, json!({}));
    let (p, d) = tokio::join!(post(&p_url, &b), post(&d_url, &b));
    assert_eq!((p.status, d.status), (200, 200));
    c.prefills[0].set_faults(Faults {
        unregistered_ranks: vec![1],
        ..Faults::default()
    });
    let base = c.prefills[0].bootstrap_url().unwrap_or_default();
    let route1 = format!(
        "{base}/route?prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    );
    let mut status = 0;
    for _ in 0..100 {
        status = get(&route1).await.status;
        if status != 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(status, 503);
    // Room 11 maps to rank 1, whose GET /route is now 503: the decode fails at once.
    let d = post(&d_url, &leg(&c, 11, json!({"stream": true}))).await;
    assert_eq!(d.status, 200);
    let ev = d.events();
    let chunk: Value = serde_json::from_str(&ev[0]).expect("json");
    let fr = &chunk["meta_info"]["finish_reason"];
    assert_eq!(fr["type"], "abort");
    assert_eq!(fr["status_code"], 500);
    assert!(fr["message"].as_str().unwrap_or("").contains(
        "Could not fetch bootstrap info for: prefill_dp_rank: 1 prefill_cp_rank: 0 target_tp_rank: 0 and target_pp_rank 0"
    ), "{fr}");
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    held_zero(&c).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn legacy_bug_waits_until_waiting_timeout() {
    let mut d = fast(EngineConfig::decode(1));
    d.legacy_bootstrap_bug = true;
    d.waiting_timeout = Duration::from_millis(300);
    let mut p = fast(EngineConfig::prefill(2));
    p.faults.unregistered_ranks = vec![1];
    let c = SimCluster::spawn(&[p], &[d]).await.expect("cluster");
    // Make the bootstrap server "ready" although rank 1 is missing (SGLang
    // counts PUTs): register rank 0 a second time by hand.
    let base = c.prefills[0].bootstrap_url().unwrap_or_default();
    let put = json!({"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 2, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
        "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": c.prefills[0].rank_ports()[0],
        "page_size": 1, "kv_cache_dtype": "auto"});
    assert_eq!(
        sim_support::request("PUT", &format!("{base}/route"), Some(&put.to_string()))
            .await
            .status,
        200
    );
    let d = post(
        &format!("{}/generate", c.decodes[0].url()),
        &leg(&c, 3, json!({})),
    )
    .await;
    assert_eq!(d.status, 500);
    assert!(
        d.body.contains("timed out after") && d.body.contains("in KVPoll.WaitingForInput"),
        "{}",
        d.body
    );
    held_zero(&c).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn abort_request_ends_a_waiting_decode() {
    let c = SimCluster::spawn(
        &[fast(EngineConfig::prefill(1))],
        &[fast(EngineConfig::decode(1))],
    )
    .await
    .expect("cluster");
    let d_url = c.decodes[0].url();
    let body = leg(&c, 4, json!({"rid": "req-abc"}));
    let pending = tokio::spawn({
        let url = format!("{d_url}/generate");
        async move { post(&url, &body).await }
    });
    let seen = eventually(|| c.decodes[0].stats().held_now == 1).await;
    assert!(seen);
    // An untracked rid is ignored; the exact rid aborts.
    assert_eq!(
        post(&format!("{d_url}/abort_request"), r#"{"rid": "req-zzz"}"#)
            .await
            .status,
        200
    );
    let a = post(&format!("{d_url}/abort_request"), r#"{"rid": "req-abc"}"#).await;
    assert_eq!((a.status, a.body.as_str()), (200, ""));
    let d = pending.await.expect("join");
    assert_eq!(d.status, 200, "{}", d.body);
    assert_eq!(d.json()["meta_info"]["finish_reason"]["type"], "abort");
    held_zero(&c).await;
    assert_eq!(c.decodes[0].stats().aborted, 1);
}

#[tokio::test(crate = "crate::support::rt")]
async fn client_disconnect_is_counted() {
    let c = SimCluster::spawn(
        &[fast(EngineConfig::prefill(1))],
        &[fast(EngineConfig::decode(1))],
    )
    .await
    .expect("cluster");
    let url = format!("{}/generate", c.decodes[0].url());
    let body = leg(&c, 5, json!({}));
    let client = tokio::spawn(async move { try_request("POST", &url, Some(&body)).await });
    assert!(eventually(|| c.decodes[0].stats().held_now == 1).await);
    client.abort();
    assert!(
        eventually(|| c.decodes[0].stats().client_disconnects == 1).await,
        "{:?}",
        c.decodes[0].stats()
    );
    held_zero(&c).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn decode_dies_mid_stream() {
    let mut d = fast(EngineConfig::decode(1));
    d.faults.decode_die_mid_stream_after = Some(2);
    let c = SimCluster::spawn(&[fast(EngineConfig::prefill(1))], &[d])
        .await
        .expect("cluster");
    let b = leg(
        &c,
        6,
        json!({"stream": true, "sampling_params": {"max_new_tokens": 5}}),
    );
    let (pu, du) = (
        format!("{}/generate", c.prefills[0].url()),
        format!("{}/generate", c.decodes[0].url()),
    );
    let (p, d) = tokio::join!(post(&pu, &b), try_request("POST", &du, Some(&b)));
    assert_eq!(p.status, 200);
    assert!(d.is_err(), "the stream must be cut: {d:?}");
    held_zero(&c).await;
    assert_eq!(c.decodes[0].stats().failed, 1);
}

#[tokio::test(crate = "crate::support::rt")]
async fn prefill_death_is_noticed_by_the_decode_heartbeat() {
    let mut d = fast(EngineConfig::decode(1));
    d.heartbeat_interval = Duration::from_millis(30);
    d.heartbeat_max_failures = 2;
    let mut p = fast(EngineConfig::prefill(1));
    p.faults.prefill_die_mid_request = true;
    p.prefill_delay = Duration::from_millis(20);
    let c = SimCluster::spawn(&[p], &[d]).await.expect("cluster");
    let b = leg(&c, 8, json!({}));
    let (pu, du) = (
        format!("{}/generate", c.prefills[0].url()),
        format!("{}/generate", c.decodes[0].url()),
    );
    let (p, d) = tokio::join!(try_request("POST", &pu, Some(&b)), post(&du, &b));
    assert!(p.is_err(), "prefill connection must be cut: {p:?}");
    assert_eq!(d.status, 500);
    assert!(
        d.body.contains("Lost connection with prefill instance"),
        "{}",
        d.body
    );
    assert!(c.prefills[0].faults().down);
    // The engine is down: new connections are dropped; back up, it answers.
    assert!(
        try_request("GET", &format!("{}/health", c.prefills[0].url()), None)
            .await
            .is_err()
    );
    c.prefills[0].set_down(false);
    assert_eq!(
        get(&format!("{}/health", c.prefills[0].url())).await.status,
        200
    );
    held_zero(&c).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn sim_endpoints_and_info() {
    let e = pdgate_sim::spawn(EngineConfig::decode(2))
        .await
        .expect("spawn");
    let url = e.url();
    let f = post(
        &format!("{url}/sim/faults"),
        r#"{"decode_extra_itl_ms": 7}"#,
    )
    .await;
    assert_eq!(f.status, 200);
    assert_eq!(e.faults().decode_extra_itl_ms, 7);
    assert_eq!(
        get(&format!("{url}/sim/faults")).await.json()["decode_extra_itl_ms"],
        7
    );
    assert_eq!(
        post(&format!("{url}/sim/faults"), r#"{"nope": 1}"#)
            .await
            .status,
        400
    );
    let s = get(&format!("{url}/sim/stats")).await.json();
    assert_eq!(s["requests_per_rank"], json!([0, 0]));
    let info = get(&format!("{url}/server_info")).await.json();
    assert_eq!(info["disaggregation_mode"], "decode");
    assert_eq!(info["dp_size"], 2);
    assert_eq!(info["internal_states"].as_array().map(Vec::len), Some(2));
    let loads = get(&format!("{url}/v1/loads")).await.json();
    assert_eq!(loads["loads"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        get(&format!("{url}/get_load"))
            .await
            .json()
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    assert_eq!(
        get(&format!("{url}/v1/models")).await.json()["data"][0]["max_model_len"],
        32768
    );
    assert_eq!(
        get(&format!("{url}/get_model_info")).await.json()["model_path"],
        "sim-model"
    );
    assert_eq!(get(&format!("{url}/nope")).await.status, 404);
}
