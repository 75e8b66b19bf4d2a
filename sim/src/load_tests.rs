//! In-process tests of the load reports (`crate::info::loads`, `/get_load`) against what
//! the engines hold: a decode's pre-allocation queue behind `max_running_requests`, a
//! prefill's uncached prompt tokens queued for compute, and the prefill's bootstrap timeout
//! failing a request whose KV its decode did not take in time. Real time, real sockets:
//! the assertions wait for states (never for how fast anything ran), and every duration
//! that must not run out is seconds longer than the work it covers.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::task::JoinHandle;

use crate::config::EngineConfig;
use crate::http;
use crate::SimCluster;

const TIMEOUT: Duration = Duration::from_secs(20);

/// An answer: (status, body).
type Answer = (u16, String);

async fn call(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Answer {
    let r = http::call(
        addr,
        method,
        path,
        body.map(|b| b.to_string().into_bytes()),
        TIMEOUT,
    )
    .await
    .expect("the engine answers");
    (r.status, String::from_utf8_lossy(&r.body).into_owned())
}

/// Rank `rank`'s entry of `addr`'s `/v1/loads`.
async fn load(addr: &str, rank: usize) -> Value {
    let (status, body) = call(addr, "GET", "/v1/loads", None).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    v["loads"][rank].clone()
}

/// Waits until `pred` holds for rank 0 of `addr`'s `/v1/loads`; that entry.
async fn load_until(addr: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let l = load(addr, 0).await;
        if pred(&l) {
            return l;
        }
        assert!(start.elapsed() < TIMEOUT, "never {what}: {l}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Both legs of one request (`body` with the bootstrap fields of the cluster's first
/// prefill and `room`), sent at once to the first prefill and the first decode, in a task.
fn send_pair(c: &SimCluster, body: &Value, room: u64) -> JoinHandle<(Answer, Answer)> {
    let mut b = body.clone();
    b["bootstrap_host"] = json!("127.0.0.1");
    b["bootstrap_port"] = json!(c.prefills[0].bootstrap_port());
    b["bootstrap_room"] = json!(room);
    let (p, d) = (
        c.prefills[0].addr().to_string(),
        c.decodes[0].addr().to_string(),
    );
    tokio::spawn(async move {
        tokio::join!(
            call(&p, "POST", "/generate", Some(&b)),
            call(&d, "POST", "/generate", Some(&b))
        )
    })
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or(u64::MAX)
}

/// Every engine of `c` holds nothing, and its load gauges are back to 0.
async fn settled(c: &SimCluster) {
    let start = Instant::now();
    while c.total_stats().held_now > 0 && start.elapsed() < TIMEOUT {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(c.total_stats().held_now, 0, "{:?}", c.total_stats());
    for e in c.engines() {
        let l = load(&e.addr().to_string(), 0).await;
        for key in [
            "num_running_reqs",
            "num_waiting_reqs",
            "num_waiting_uncached_tokens",
        ] {
            assert_eq!(l[key], 0, "{key}: {l}");
        }
        for key in [
            "decode_prealloc_queue_reqs",
            "decode_transfer_queue_reqs",
            "prefill_inflight_queue_reqs",
        ] {
            assert_eq!(l["disaggregation"][key], 0, "{key}: {l}");
        }
    }
}

/// A decode that runs one request at a time reports the second in its pre-allocation
/// queue (and in `num_waiting_reqs`, as SGLang counts it); that request's prefill, computed,
/// reports it in its inflight queue and fails it with SGLang's `KVPoll.Bootstrapping` text
/// once its bootstrap timeout ran out while the decode queued it. The decode then finds no
/// KV for it and fails it at its own waiting timeout, as SGLang's decode does.
#[tokio::test]
async fn a_request_queued_past_the_bootstrap_timeout_fails_and_the_queue_is_reported() {
    let mut p = EngineConfig::prefill(1);
    p.prefill_delay = Duration::from_millis(1);
    p.bootstrap_timeout = Duration::from_millis(400);
    let mut d = EngineConfig::decode(1);
    d.max_running_requests = Some(1);
    d.ttft = Duration::from_millis(1);
    // The first request runs 40 × 50 ms = 2 s, five bootstrap timeouts.
    d.itl = Duration::from_millis(50);
    d.waiting_timeout = Duration::from_millis(300);
    let c = SimCluster::spawn(&[p], &[d]).await.expect("cluster");
    let (pa, da) = (
        c.prefills[0].addr().to_string(),
        c.decodes[0].addr().to_string(),
    );
    let body = json!({"text": "hello", "sampling_params": {"max_new_tokens": 40}});

    let first = send_pair(&c, &body, 1);
    load_until(&da, "running", |l| l["num_running_reqs"] == 1).await;
    let second = send_pair(&c, &body, 2);
    let l = load_until(&da, "queued", |l| {
        l["disaggregation"]["decode_prealloc_queue_reqs"] == 1
    })
    .await;
    assert_eq!(l["num_running_reqs"], 1, "{l}");
    assert_eq!(l["num_waiting_reqs"], 1, "the queue counts as waiting: {l}");
    assert_eq!(l["num_waiting_uncached_tokens"], 0, "a decode: {l}");
    assert_eq!(l["max_running_requests"], 1, "{l}");
    // The second prefill computed its prompt; its KV waits for the decode.
    let pl = load_until(&pa, "inflight", |l| {
        l["disaggregation"]["prefill_inflight_queue_reqs"] == 1
    })
    .await;
    assert_eq!(
        (n(&pl["num_running_reqs"]), n(&pl["num_waiting_reqs"])),
        (0, 0),
        "{pl}"
    );
    // `/get_load` (older engines) counts the queue too.
    let (_, gl) = call(&da, "GET", "/get_load", None).await;
    let gl: Value = serde_json::from_str(&gl).expect("JSON");
    assert_eq!(
        (gl[0]["num_reqs"].clone(), gl[0]["num_waiting_reqs"].clone()),
        (json!(2), json!(1)),
        "{gl}"
    );

    let ((ps, pb), (ds, db)) = second.await.expect("join");
    assert_eq!(ps, 500, "{pb}");
    assert!(
        pb.contains("timed out after") && pb.contains("KVPoll.Bootstrapping"),
        "{pb}"
    );
    assert_eq!(ds, 500, "{db}");
    assert!(db.contains("KVPoll.WaitingForInput"), "{db}");
    let ((ps, _), (ds, db)) = first.await.expect("join");
    assert_eq!((ps, ds), (200, 200), "{db}");
    let s = c.total_stats();
    assert_eq!((s.ok, s.failed), (2, 2), "{s:?}");
    settled(&c).await;
}

/// `n` distinct words starting with `tag` (one token each).
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A prefill rank with a prefix cache computes one prompt at a time; the prompts queued
/// behind it count in `num_waiting_uncached_tokens` by the tokens its cache lacks (whole
/// pages of 16, never the last token), and leave it when their compute starts.
#[tokio::test]
async fn a_prefill_reports_the_uncached_tokens_queued_for_compute() {
    let mut p = EngineConfig::prefill(1);
    p.prefill_prefix_cache_tokens = 100_000;
    p.prefill_delay = Duration::from_millis(1);
    // 320 tokens: 1.3 s of compute, long enough to queue two prompts behind it.
    p.prefill_per_token = Duration::from_millis(4);
    let mut d = EngineConfig::decode(1);
    d.ttft = Duration::from_millis(1);
    d.itl = Duration::ZERO;
    let c = SimCluster::spawn(&[p], &[d]).await.expect("cluster");
    let pa = c.prefills[0].addr().to_string();
    let gen = |text: String| json!({"text": text, "sampling_params": {"max_new_tokens": 1}});
    let long = words("a", 320);

    let first = send_pair(&c, &gen(long.clone()), 0);
    load_until(&pa, "computing", |l| l["num_running_reqs"] == 1).await;
    // 320 + 40 tokens, the first 320 cached (20 pages the first prompt stored): 40.
    let second = send_pair(&c, &gen(format!("{long} {}", words("b", 40))), 1);
    // 100 tokens the cache never saw.
    let third = send_pair(&c, &gen(words("c", 100)), 2);
    let l = load_until(&pa, "two queued", |l| l["num_waiting_reqs"] == 2).await;
    assert_eq!(l["num_waiting_uncached_tokens"], 140, "{l}");
    assert_eq!(l["num_running_reqs"], 1, "{l}");
    for t in [first, second, third] {
        let ((ps, pb), (ds, db)) = t.await.expect("join");
        assert_eq!((ps, ds), (200, 200), "{pb} {db}");
    }
    settled(&c).await;
    assert_eq!(
        c.prefills[0].stats().prefill_peak_waiting_uncached_tokens,
        vec![140],
        "the peak of the queue"
    );
}

/// `/v1/loads?include=...` keeps SGLang's sections: the core keys always, the
/// `disaggregation` section by default, with `all` or with `disagg`.
#[tokio::test]
async fn the_loads_sections_follow_include() {
    let c = SimCluster::spawn(&[EngineConfig::prefill(2)], &[EngineConfig::decode(1)])
        .await
        .expect("cluster");
    // (engine, query, entries, disaggregation mode or none)
    let table = [
        (&c.prefills[0], "", 2, Some("prefill")),
        (&c.prefills[0], "?include=core", 2, None),
        (
            &c.prefills[0],
            "?include=core,disagg&dp_rank=1",
            1,
            Some("prefill"),
        ),
        (&c.decodes[0], "?include=all", 1, Some("decode")),
        (&c.decodes[0], "?include=memory", 1, None),
    ];
    for (e, query, entries, mode) in table {
        let (status, body) = call(
            &e.addr().to_string(),
            "GET",
            &format!("/v1/loads{query}"),
            None,
        )
        .await;
        assert_eq!(status, 200, "{query}: {body}");
        let v: Value = serde_json::from_str(&body).expect("JSON");
        let loads = v["loads"].as_array().cloned().unwrap_or_default();
        assert_eq!(loads.len(), entries, "{query}: {v}");
        for l in &loads {
            for key in [
                "num_running_reqs",
                "num_waiting_reqs",
                "num_waiting_uncached_tokens",
            ] {
                assert!(l[key].is_u64(), "{query}: {key} in {l}");
            }
            assert_eq!(l["disaggregation"]["mode"].as_str(), mode, "{query}: {l}");
        }
    }
}
