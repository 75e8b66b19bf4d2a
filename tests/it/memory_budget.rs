//! Issue 18's memory reproductions, over real sockets: the in-flight byte budget refuses a
//! body that would take the router past it (503 with `Retry-After`, OpenAI error JSON) and
//! gives its bytes back when the response ends; a streamed `return_logprob` request whose
//! input logprobs are past `upstream.max_stream_logprob_bytes` is refused with 413 before
//! its first byte, while the same request without `stream` is merged. Before the budget,
//! the second body below was admitted (admission counted requests, not bytes).

use std::sync::Arc;
use std::time::Duration;

use crate::support::common::{self, sse_events, start_with_admin, Env};
use pdgate_sim::{EngineConfig, Faults};

/// A `/generate` body of about `size` bytes (one long word: one token for the simulator).
fn big(size: usize) -> String {
    format!(
        r#"{{"text":"{}","sampling_params":{{"max_new_tokens":2}}}}"#,
        "a".repeat(size)
    )
}

/// A streamed `/generate` of `n` prompt ids with `return_logprob` and 6 output tokens: each
/// event repeats the prompt's `n` input logprobs (~25 bytes each).
fn logprob_stream(n: usize) -> String {
    let ids: Vec<String> = (1..=n).map(|i| (i % 30_000).to_string()).collect();
    format!(
        r#"{{"input_ids":[{}],"sampling_params":{{"max_new_tokens":6}},"return_logprob":true,"logprob_start_len":0,"stream":true}}"#,
        ids.join(",")
    )
}

/// One prefill and one decode behind a router with `tweak`, routable.
async fn one_pair(tweak: impl FnOnce(&mut pdgate::config::Config)) -> Env {
    let env = common::start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        tweak,
    )
    .await;
    env.wait_routable(1, 1).await;
    env
}

fn set_hold(env: &Env, hold: bool) {
    env.cluster.decodes[0].set_faults(Faults {
        decode_hold: hold,
        ..Faults::default()
    });
}

/// Sends a `/generate` head declaring a body of `len` bytes, and none of the body; the
/// status and the whole answer (bounded: 5 s, far below `server.body_read_timeout_secs`,
/// so an answer only comes if the router refused without waiting for the body).
async fn head_only(env: &Env, len: usize) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = env.router.url().trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let head = format!(
        "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "no answer before the body was sent");
    let text = String::from_utf8_lossy(&out).to_string();
    let st = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    (st, text)
}

fn error_type(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)));
    v["error"]["type"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_budget_refuses_what_would_exceed_it_and_frees_it_with_the_response() {
    const MIB: usize = 1 << 20;
    let env = Arc::new(
        start_with_admin(
            vec![EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            |c| {
                c.admission.max_bytes_in_flight = MIB;
                c.server.max_body_bytes = 768 << 10;
            },
        )
        .await,
    );
    env.wait_routable(1, 1).await;
    // A 600 KiB request held by the decode: its body is charged until it ends. A second
    // one would bring the budget past the 7/8 a large request may fill.
    set_hold(&env, true);
    let held = {
        let env = env.clone();
        tokio::spawn(async move { env.post("/generate", &big(600 << 10)).await })
    };
    // Held by the decode (bounded: 10 s): its body was charged before its legs went out.
    for _ in 0..1000 {
        if env.cluster.decodes[0].stats().held_now == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        env.cluster.decodes[0].stats().held_now,
        1,
        "the first request is held"
    );
    // A body declared too large for what is left is refused at its head: the answer comes
    // before a byte of the body was sent (it used to be awaited, read, then refused).
    let (st, head) = head_only(&env, 600 << 10).await;
    assert_eq!(st, 503, "{head}");
    assert!(head.contains("memory_full"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    let (st, h, body) = env.post("/generate", &big(600 << 10)).await;
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        error_type(&body),
        "memory_full",
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(h["retry-after"], "1");
    assert!(String::from_utf8_lossy(&body).contains("admission.max_bytes_in_flight"));
    set_hold(&env, false);
    let (st, _, body) = held.await.expect("task");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    // The response ended: its bytes are back, and the same body now fits.
    let (st, _, body) = env.post("/generate", &big(600 << 10)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let (_, _, text) = env.admin("GET", "/metrics", None, "").await;
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains("pdgate_bytes_in_flight"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("pdgate_admission_rejected_total{reason=\"bytes_full\"}")),
        "{text}"
    );
}

/// Under the per-event cap, a stream is still refused when its logprobs times the events it
/// can produce (its `max_new_tokens`, or SGLang's 128 when it sets none) are past the
/// per-stream cap; the same prompt with a short enough answer is merged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_logprobs_repeated_in_all_events_are_past_the_total_cap_is_refused() {
    let env = common::start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| c.upstream.max_stream_logprob_total_bytes = 4096,
    )
    .await;
    env.wait_routable(1, 1).await;
    // 20 prompt tokens: a few hundred bytes of input logprobs, under the 1 MiB per event.
    let ids: Vec<String> = (1..=20).map(|i| i.to_string()).collect();
    let body = |sampling: &str| {
        format!(
            r#"{{"input_ids":[{}],"sampling_params":{{{sampling}}},"return_logprob":true,"logprob_start_len":0,"stream":true}}"#,
            ids.join(",")
        )
    };
    for sampling in [r#""max_new_tokens":200"#, ""] {
        let (st, _, bytes) = env.post("/generate", &body(sampling)).await;
        assert_eq!(st, 413, "{sampling}: {}", String::from_utf8_lossy(&bytes));
        assert_eq!(error_type(&bytes), "logprobs_too_large");
        assert!(
            String::from_utf8_lossy(&bytes).contains("upstream.max_stream_logprob_total_bytes"),
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    let (st, _, bytes) = env.post("/generate", &body(r#""max_new_tokens":2"#)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("input_token_logprobs"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_logprob_merge_past_its_cap_is_refused_and_a_whole_answer_is_merged() {
    let env = common::start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| c.upstream.max_stream_logprob_bytes = 64,
    )
    .await;
    env.wait_routable(1, 1).await;
    // 20 prompt tokens: their input logprobs are well over 64 bytes.
    let ids: Vec<String> = (1..=20).map(|i| i.to_string()).collect();
    let body = |stream: bool| {
        format!(
            r#"{{"input_ids":[{}],"sampling_params":{{"max_new_tokens":2}},"return_logprob":true,"logprob_start_len":0,"stream":{stream}}}"#,
            ids.join(",")
        )
    };
    let (st, _, bytes) = env.post("/generate", &body(true)).await;
    assert_eq!(st, 413, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(error_type(&bytes), "logprobs_too_large");
    assert!(String::from_utf8_lossy(&bytes).contains("upstream.max_stream_logprob_bytes"));
    let (st, _, bytes) = env.post("/generate", &body(false)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        v["meta_info"]["input_token_logprobs"]
            .as_array()
            .map(Vec::len),
        Some(20),
        "{v}"
    );
    // Under the cap, a stream carries them in every event.
    let (st, _, bytes) = env
        .post(
            "/generate",
            r#"{"input_ids":[5],"sampling_params":{"max_new_tokens":3},"return_logprob":true,"logprob_start_len":0,"stream":true}"#,
        )
        .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    let (events, done) = sse_events(&bytes);
    assert!(done && !events.is_empty());
    for e in &events {
        assert_eq!(
            e["meta_info"]["input_token_logprobs"]
                .as_array()
                .map(Vec::len),
            Some(1),
            "{e}"
        );
    }
}

/// Bodies and answers of at least `pdgate::body::OFF_LOOP_BYTES` are read on the blocking
/// pool (so that the event loop keeps serving meanwhile, see `benches/hostile.rs`): the
/// request body's parse, the prefill's input logprobs and their merge into a whole answer.
/// What comes back is what the inline path gives: each case on both sides of the size.
#[tokio::test(crate = "crate::support::rt")]
async fn large_bodies_and_answers_read_off_the_event_loop_give_the_same_answers() {
    let env = common::start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(1, 1).await;
    let off = pdgate::body::OFF_LOOP_BYTES;
    // A request body just under and well over the size.
    for size in [off / 2, off * 4] {
        let (st, _, bytes) = env.post("/generate", &big(size)).await;
        assert_eq!(st, 200, "{size}: {}", String::from_utf8_lossy(&bytes));
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert!(v["text"].is_string(), "{v}");
    }
    // An invalid large body is refused as an inline one is.
    let bad = format!(r#"{{"text":"{}""#, "a".repeat(off * 2));
    let (st, _, bytes) = env.post("/generate", &bad).await;
    assert_eq!(st, 400, "{}", String::from_utf8_lossy(&bytes));
    // A prompt whose input logprobs (about 26 bytes a token) are over the size: read and
    // merged off the loop, whole (non-streamed) and per event (streamed).
    let tokens = off / 10;
    let ids: Vec<String> = (0..tokens).map(|i| (1000 + i).to_string()).collect();
    let body = |stream: bool| {
        format!(
            r#"{{"input_ids":[{}],"sampling_params":{{"max_new_tokens":2}},"return_logprob":true,"logprob_start_len":0,"stream":{stream}}}"#,
            ids.join(",")
        )
    };
    let (st, _, bytes) = env.post("/generate", &body(false)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(bytes.len() > off, "the answer is {} bytes", bytes.len());
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let lp = v["meta_info"]["input_token_logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), tokens);
    assert!(lp[0][0].is_null());
    assert_eq!(lp[tokens - 1][1], serde_json::json!(1000 + tokens - 1));
    let (st, _, bytes) = env.post("/generate", &body(true)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    let (events, done) = sse_events(&bytes);
    assert!(done && !events.is_empty());
    for e in &events {
        let n = e["meta_info"]["input_token_logprobs"]
            .as_array()
            .map(Vec::len);
        assert_eq!(n, Some(tokens));
    }
}

/// A stream whose events each repeat a long prompt's input logprobs (past
/// `pdgate::body::SLICE_BYTES` per merged event) is handed out a slice at a time, with the
/// event loop free between slices: the client still gets every event whole, each with all
/// of the prompt's logprobs, in order, and one `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_events_larger_than_a_slice_arrives_whole() {
    let env = one_pair(|_| {}).await;
    let n = 12_000;
    let (st, _, bytes) = env.post("/generate", &logprob_stream(n)).await;
    assert_eq!(
        st,
        200,
        "{}",
        String::from_utf8_lossy(&bytes[..bytes.len().min(2000)])
    );
    let (events, done) = sse_events(&bytes);
    assert!(done, "one [DONE] at the end");
    assert_eq!(
        String::from_utf8_lossy(&bytes)
            .matches("data: [DONE]")
            .count(),
        1
    );
    assert_eq!(events.len(), 6, "one event per token");
    let per_event = bytes.len() / events.len();
    assert!(
        per_event > pdgate::body::SLICE_BYTES,
        "each event is larger than a slice: {per_event}"
    );
    let mut last = 0;
    for e in &events {
        assert_eq!(
            e["meta_info"]["input_token_logprobs"]
                .as_array()
                .map(Vec::len),
            Some(n),
            "{}",
            &e.to_string()[..200]
        );
        let done_tokens = e["meta_info"]["completion_tokens"].as_u64().unwrap_or(0);
        assert!(done_tokens > last, "events in order");
        last = done_tokens;
    }
}

/// A stream that repeats its prompt's input logprobs goes out no faster than
/// `upstream.stream_logprob_bytes_per_sec`, and every other request is served meanwhile:
/// with the rate at 400 KB/s, an ordinary request sent once the stream's first ~300 KB
/// event came gets its whole answer, and the stream's other ~1.5 MB take at least their
/// time at the rate, and arrive whole. Without the rate they take milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_repeat_logprobs_go_at_their_rate_and_others_do_not_wait() {
    use http_body_util::BodyExt;
    let env = one_pair(|c| c.upstream.stream_logprob_bytes_per_sec = 400_000).await;
    let n = 12_000;
    let resp = env.post_streaming("/generate", &logprob_stream(n)).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.into_body();
    let mut got = Vec::new();
    // The first event (~300 KB: past the rate's 100 ms burst of 40 KB).
    while !got.windows(2).any(|w| w == b"\n\n") {
        let frame = stream.frame().await.expect("a frame").expect("no error");
        if let Ok(d) = frame.into_data() {
            got.extend_from_slice(&d);
        }
    }
    // An ordinary request meanwhile: answered whole while the stream still has ~1.5 MB to
    // send, which its rate spreads over more than 3 s.
    let (st, _, plain) = env.post("/generate", common::gen_body(false)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&plain));
    // The rest comes at the rate: a lower bound (a slow machine only makes it longer).
    let (before, from) = (got.len(), std::time::Instant::now());
    while let Some(frame) = stream.frame().await {
        if let Ok(d) = frame.expect("no error").into_data() {
            got.extend_from_slice(&d);
        }
    }
    let rest = got.len() - before;
    assert!(rest > 1_000_000, "{before} then {}", got.len());
    let took = from.elapsed();
    assert!(
        took.as_secs_f64() >= (rest - 200_000) as f64 / 400_000.0,
        "{rest} bytes in {took:?}: faster than the rate"
    );
    let (events, done) = sse_events(&got);
    assert!(done, "one [DONE] at the end");
    assert_eq!(events.len(), 6, "one event per token");
    for e in &events {
        assert_eq!(
            e["meta_info"]["input_token_logprobs"]
                .as_array()
                .map(Vec::len),
            Some(n)
        );
    }
}

/// A large body past its first slice is read and written to its legs no faster than
/// `server.large_body_bytes_per_sec`, and every other request is served meanwhile: with
/// the rate at 1 MB/s, a 1 MiB body (read, then written to two legs: ~2.5 MB past the free
/// slices) is still on its way after an ordinary request sent just after it got its whole
/// answer; then it is answered, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_go_at_their_rate_and_others_do_not_wait() {
    let env = Arc::new(one_pair(|c| c.server.large_body_bytes_per_sec = 1_000_000).await);
    let large = {
        let env = env.clone();
        tokio::spawn(async move { env.post("/generate", &big(1 << 20)).await })
    };
    // Let the large body get under way (its ~2.5 MB past the free slices take 2.5 s).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (st, _, plain) = env.post("/generate", common::gen_body(false)).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&plain));
    assert!(!large.is_finished(), "the large body is still at its rate");
    let (st, _, answer) = large.await.expect("joined");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&answer));
    // Both legs got the whole body: the engines parsed it (a cut body is a 400 there).
    let v: serde_json::Value = serde_json::from_slice(&answer).expect("JSON answer");
    assert!(v["text"].is_string(), "{v}");
    assert_eq!(env.cluster.prefills[0].stats().failed, 0);
}
