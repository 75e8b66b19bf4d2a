//! A decode that dies mid-stream costs the client nothing but latency: the stream moves to
//! another decode with the prompt plus what the client already received, and the client
//! gets the uninterrupted answer. The simulator's tokens depend on the prompt it receives,
//! so a replay from scratch, or a continuation without the partial answer, fails these
//! tests; what each decode received is read back from the simulator.

use std::time::Duration;

use pdgate::config::PolicyKind;
use pdgate_sim::{EngineConfig, Faults, SimCluster};
use serde_json::{json, Value};

use crate::support::common::*;

/// One prefill, two decodes (round robin), with the given `/generate` stream modes.
async fn fleet(incremental: [bool; 2], tweak: impl FnOnce(&mut pdgate::config::Config)) -> Env {
    let decodes = incremental
        .iter()
        .map(|i| {
            let mut d = fast_engine(EngineConfig::decode(1));
            d.incremental_streaming_output = *i;
            d
        })
        .collect();
    let prefill = vec![fast_engine(EngineConfig::prefill(1))];
    let env = start_with_admin(prefill, decodes, |c| {
        c.policy.decode = PolicyKind::RoundRobin;
        tweak(c);
    })
    .await;
    env.wait_routable(1, 2).await;
    env
}

/// The client's view of an answer.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Answer {
    pub text: String,
    pub ids: Vec<i64>,
    /// Tokens, as the answer reports them (`/generate` meta_info, or OpenAI usage when
    /// asked; else the count of token events).
    pub tokens: u64,
    /// Token texts in the order they came (one per event for the simulator).
    pub pieces: Vec<String>,
    pub finish_reasons: usize,
    pub usage: Option<Value>,
    /// Chunks that carried a `usage` field (other than the final usage chunk).
    pub chunk_usages: usize,
    pub done: usize,
    pub errors: usize,
}

pub(crate) fn read_answer(path: &str, stream: bool, incremental: bool, body: &[u8]) -> Answer {
    let mut a = Answer::default();
    if !stream {
        let v: Value = serde_json::from_slice(body).expect("json answer");
        if path == "/generate" {
            a.text = v["text"].as_str().unwrap_or("").to_string();
            a.ids = serde_json::from_value(v["output_ids"].clone()).unwrap_or_default();
            a.tokens = v["meta_info"]["completion_tokens"].as_u64().unwrap_or(0);
        } else {
            let c = &v["choices"][0];
            a.text = c["message"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .unwrap_or("")
                .to_string();
            a.tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            a.usage = Some(v["usage"].clone());
        }
        a.finish_reasons = 1;
        a.done = 1;
        return a;
    }
    let text = std::str::from_utf8(body).expect("utf8");
    a.done = text.matches("data: [DONE]").count();
    let (events, _) = sse_events(body);
    for ev in &events {
        if ev.get("error").is_some() {
            a.errors += 1;
            continue;
        }
        if path == "/generate" {
            let t = ev["text"].as_str().unwrap_or("");
            let ids: Vec<i64> =
                serde_json::from_value(ev["output_ids"].clone()).unwrap_or_default();
            if incremental {
                a.pieces.push(t.to_string());
                a.text.push_str(t);
                a.ids.extend(ids);
            } else {
                a.pieces
                    .push(t.get(a.text.len()..).unwrap_or("").to_string());
                a.text = t.to_string();
                a.ids = ids;
            }
            a.tokens = ev["meta_info"]["completion_tokens"].as_u64().unwrap_or(0);
            if !ev["meta_info"]["finish_reason"].is_null() {
                a.finish_reasons += 1;
            }
            continue;
        }
        let choices = ev["choices"].as_array().cloned().unwrap_or_default();
        if choices.is_empty() {
            a.usage = Some(ev["usage"].clone());
            continue;
        }
        if ev.get("usage").is_some_and(|u| !u.is_null()) {
            a.chunk_usages += 1;
        }
        for c in choices {
            let t = c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .unwrap_or("");
            if !t.is_empty() {
                a.pieces.push(t.to_string());
                a.text.push_str(t);
            }
            if !c["finish_reason"].is_null() {
                a.finish_reasons += 1;
            }
        }
    }
    if path != "/generate" {
        a.tokens = a
            .usage
            .as_ref()
            .and_then(|u| u["completion_tokens"].as_u64())
            .unwrap_or(a.pieces.len() as u64);
    }
    a
}

/// The generate bodies each decode received so far.
fn bodies(env: &Env) -> Vec<Vec<Value>> {
    env.cluster
        .decodes
        .iter()
        .map(|d| {
            d.recent_generate_bodies()
                .into_iter()
                .map(|(_, b)| b)
                .collect()
        })
        .collect()
}

/// Decode `i`'s worker id in the router's pool.
fn decode_id(env: &Env, i: usize) -> pdgate::types::WorkerId {
    let url = env.cluster.decodes[i].url();
    env.router
        .pool
        .load()
        .workers(pdgate::types::Role::Decode)
        .iter()
        .find(|w| w.shared.url.as_str() == url)
        .expect("decode")
        .shared
        .id
}

/// Decode 0 took the request (once since `before`) and decode 1 its follow-up, and the
/// client got the uninterrupted answer.
fn moved_from_0_to_1(env: &Env, c: &Case, whole: &Answer, got: &Answer, before: &[Vec<Value>]) {
    let after = bodies(env);
    assert_eq!(after[0].len(), before[0].len() + 1, "decode 0 took it");
    assert_eq!(
        after[1].len(),
        before[1].len() + 1,
        "decode 1 got the follow-up"
    );
    check_moved(c, whole, got, &after[1][before[1].len()]);
}

/// One case: a route, a request body asking for `limit` tokens.
pub(crate) struct Case {
    pub name: &'static str,
    pub path: &'static str,
    pub body: Value,
    pub limit: u64,
}

pub(crate) fn cases(stream: bool) -> Vec<Case> {
    let l = 12;
    vec![
        Case {
            name: "generate text",
            path: "/generate",
            body: json!({"text": "tell me", "sampling_params": {"max_new_tokens": l, "temperature": 0}, "stream": stream}),
            limit: l,
        },
        Case {
            name: "generate input_ids",
            path: "/generate",
            body: json!({"input_ids": [11, 22, 33], "sampling_params": {"max_new_tokens": l}, "stream": stream}),
            limit: l,
        },
        Case {
            name: "completions",
            path: "/v1/completions",
            body: json!({"model": "m", "prompt": "once upon", "max_tokens": l, "stream": stream}),
            limit: l,
        },
        Case {
            name: "chat",
            path: "/v1/chat/completions",
            body: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": l, "stream": stream}),
            limit: l,
        },
        Case {
            name: "chat with usage",
            path: "/v1/chat/completions",
            body: json!({"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_completion_tokens": l, "stream": stream, "stream_options": {"include_usage": true}}),
            limit: l,
        },
    ]
}

pub(crate) async fn ask(env: &Env, c: &Case, incremental: bool) -> Answer {
    let (st, _, bytes) = env.post(c.path, &c.body.to_string()).await;
    assert_eq!(st, 200, "{}: {}", c.name, String::from_utf8_lossy(&bytes));
    let stream = c.body["stream"] == json!(true);
    read_answer(c.path, stream, incremental, &bytes)
}

/// Checks a moved answer against the uninterrupted one and what the second decode got.
pub(crate) fn check_moved(c: &Case, whole: &Answer, got: &Answer, follow: &Value) {
    let n = c.name;
    assert_eq!(
        got.text, whole.text,
        "{n}: the client's text is the uninterrupted answer"
    );
    assert_eq!(got.ids, whole.ids, "{n}: ids");
    assert_eq!(
        got.tokens, c.limit,
        "{n}: exactly the asked number of tokens"
    );
    assert_eq!(
        (got.done, got.finish_reasons, got.errors),
        (1, 1, 0),
        "{n}: {got:?}"
    );
    assert_eq!(got.usage, whole.usage, "{n}: usage as if uninterrupted");
    assert_eq!(got.chunk_usages, 0, "{n}: per-chunk usage hidden");
    // What the follow-up carried: the original prompt plus the k tokens the client had.
    let (prefix, limit) = match c.path {
        "/generate" if c.body.get("input_ids").is_some() => {
            let ids: Vec<i64> = serde_json::from_value(follow["input_ids"].clone()).unwrap();
            let orig: Vec<i64> = serde_json::from_value(c.body["input_ids"].clone()).unwrap();
            assert_eq!(ids[..orig.len()], orig[..], "{n}");
            let k = ids.len() - orig.len();
            assert_eq!(
                ids[orig.len()..],
                whole.ids[..k],
                "{n}: the ids the client had"
            );
            (
                whole.pieces[..k].concat(),
                follow["sampling_params"]["max_new_tokens"].clone(),
            )
        }
        "/generate" => {
            let t = follow["text"].as_str().unwrap();
            let orig = c.body["text"].as_str().unwrap();
            assert!(t.starts_with(orig), "{n}: {t}");
            assert_eq!(
                follow["sampling_params"]["temperature"], 0,
                "{n}: other params kept"
            );
            (
                t[orig.len()..].to_string(),
                follow["sampling_params"]["max_new_tokens"].clone(),
            )
        }
        "/v1/completions" => {
            let t = follow["prompt"].as_str().unwrap();
            let orig = c.body["prompt"].as_str().unwrap();
            (t[orig.len()..].to_string(), follow["max_tokens"].clone())
        }
        _ => {
            let msgs = follow["messages"].as_array().unwrap();
            let orig = c.body["messages"].as_array().unwrap();
            assert_eq!(msgs[..orig.len()], orig[..], "{n}");
            assert_eq!(msgs.len(), orig.len() + 1, "{n}");
            assert_eq!(msgs[orig.len()]["role"], "assistant", "{n}");
            assert_eq!(follow["continue_final_message"], true, "{n}");
            let lim = follow
                .get("max_completion_tokens")
                .cloned()
                .unwrap_or_else(|| follow["max_tokens"].clone());
            (
                msgs[orig.len()]["content"].as_str().unwrap().to_string(),
                lim,
            )
        }
    };
    assert!(
        !prefix.is_empty(),
        "{n}: the follow-up carried what the client had"
    );
    // k: how many of the answer's tokens make up the prefix.
    let mut k = 0;
    let mut acc = String::new();
    while acc.len() < prefix.len() {
        acc.push_str(&whole.pieces[k]);
        k += 1;
    }
    assert_eq!(acc, prefix, "{n}: the prefix is whole tokens of the answer");
    assert_eq!(
        limit,
        json!(c.limit - k as u64),
        "{n}: the limit reduced by the tokens sent"
    );
    assert!(got.text.starts_with(&prefix), "{n}");
}

/// Runs every case on `env`: uninterrupted first, then with decode 0 dying after
/// `die_after` chunks, until a request of the case was moved off it.
async fn run_cases(env: &Env, stream: bool, incremental: bool, die_after: u32) {
    for c in cases(stream) {
        env.cluster.decodes[0].set_faults(Faults::default());
        let whole = ask(env, &c, incremental).await;
        assert_eq!(whole.tokens, c.limit, "{}: {whole:?}", c.name);
        env.cluster.decodes[0].set_faults(Faults {
            decode_die_mid_stream_after: Some(die_after),
            ..Faults::default()
        });
        let mut moved = false;
        for _ in 0..4 {
            let before = bodies(env);
            let got = ask(env, &c, incremental).await;
            let after = bodies(env);
            let new: Vec<&[Value]> = (0..2).map(|i| &after[i][before[i].len()..]).collect();
            if new[0].is_empty() {
                // Served by the healthy decode alone.
                assert_eq!(got.text, whole.text, "{}", c.name);
                continue;
            }
            assert_eq!(
                new[1].len(),
                1,
                "{}: one follow-up on the other decode",
                c.name
            );
            if stream {
                check_moved(&c, &whole, &got, &new[1][0]);
            } else {
                // Not streamed: the client saw nothing; the request was re-run whole.
                assert_eq!(got.text, whole.text, "{}", c.name);
                assert_eq!(got.tokens, c.limit, "{}", c.name);
                assert_eq!(new[1][0]["stream"], new[0][0]["stream"], "{}", c.name);
            }
            moved = true;
            break;
        }
        assert!(moved, "{}: no request reached the dying decode", c.name);
    }
    env.cluster.decodes[0].set_faults(Faults::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_move_to_another_decode_in_cumulative_mode() {
    let env = fleet([false, false], |_| {}).await;
    run_cases(&env, true, false, 4).await;
    let (_, _, metrics) = env.admin("GET", "/metrics", None, "").await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("pdgate_stream_moves_total{") && l.contains("outcome=\"moved\"")),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_move_in_incremental_mode() {
    let env = fleet([true, true], |_| {}).await;
    run_cases(&env, true, true, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_requests_are_rerun_whole() {
    let env = fleet([false, false], |_| {}).await;
    run_cases(&env, false, false, 3).await;
}

/// Bodies that cannot be continued exactly end as before: with the error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_continued_ends_with_the_error_frame() {
    let env = fleet([false, false], |_| {}).await;
    env.cluster.decodes[0].set_faults(Faults {
        decode_die_mid_stream_after: Some(2),
        ..Faults::default()
    });
    let refused = [
        (
            "/generate",
            json!({"text": "x", "sampling_params": {"max_new_tokens": 8, "regex": "( [a-z]+)+"}, "stream": true}),
        ),
        (
            "/generate",
            json!({"text": "x", "sampling_params": {"max_new_tokens": 8}, "return_logprob": true, "logprob_start_len": 0, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "n": 2, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "response_format": {"type": "json_object"}, "stream": true}),
        ),
    ];
    for (path, body) in refused {
        let mut saw_error = false;
        for _ in 0..4 {
            let before = bodies(&env);
            let (st, _, bytes) = env.post(path, &body.to_string()).await;
            assert_eq!(st, 200);
            let after = bodies(&env);
            if after[0].len() == before[0].len() {
                continue;
            }
            let (events, done) = sse_events(&bytes);
            assert!(done, "{}", String::from_utf8_lossy(&bytes));
            assert_eq!(
                events.last().unwrap()["error"]["type"],
                "decode_broken",
                "{body}: {}",
                String::from_utf8_lossy(&bytes)
            );
            assert_eq!(after[1].len(), before[1].len(), "{body}: no follow-up");
            saw_error = true;
            break;
        }
        assert!(saw_error, "{body}: never reached the dying decode");
    }
}

/// `retry.max_stream_moves = 0` keeps the old behaviour: the error frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_off_keeps_the_error_frame() {
    let env = fleet([false, false], |c| c.retry.max_stream_moves = 0).await;
    env.cluster.decodes[0].set_faults(Faults {
        decode_die_mid_stream_after: Some(2),
        ..Faults::default()
    });
    let body = json!({"text": "x", "sampling_params": {"max_new_tokens": 8}, "stream": true});
    let mut seen = false;
    for _ in 0..4 {
        let before = bodies(&env);
        let (_, _, bytes) = env.post("/generate", &body.to_string()).await;
        let after = bodies(&env);
        if after[0].len() == before[0].len() {
            continue;
        }
        let (events, done) = sse_events(&bytes);
        assert!(done);
        assert_eq!(events.last().unwrap()["error"]["type"], "decode_broken");
        assert_eq!(after[1].len(), before[1].len(), "no follow-up");
        seen = true;
        break;
    }
    assert!(seen);
}

/// A decode that goes silent mid-stream (longer than the gap ceiling) is moved off too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_decode_is_moved_off() {
    let env = fleet([false, false], |c| c.retry.mid_stream_gap_ceiling_ms = 300).await;
    let c = &cases(true)[0];
    let whole = ask(&env, c, false).await;
    env.cluster.decodes[0].set_faults(Faults {
        decode_extra_itl_ms: 3000,
        ..Faults::default()
    });
    let mut moved = false;
    for _ in 0..4 {
        let before = bodies(&env);
        let started = std::time::Instant::now();
        let got = ask(&env, c, false).await;
        let after = bodies(&env);
        if after[0].len() == before[0].len() {
            continue;
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "moved before the idle bound"
        );
        check_moved(c, &whole, &got, &after[1][before[1].len()]);
        moved = true;
        break;
    }
    assert!(moved);
}

/// A real decode process killed mid-stream: every stream completes, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_process_loses_no_stream() {
    let cluster = SimCluster::spawn(
        &[fast_engine(EngineConfig::prefill(1))],
        &[fast_engine(EngineConfig::decode(1))],
    )
    .await
    .expect("cluster");
    let (mut child, url) = sim_process("decode").await;
    let mut cfg = fast_config();
    cfg.add_workers(
        cluster.prefill_endpoints(),
        cluster.decode_urls().chain([url]),
    );
    cfg.policy.decode = PolicyKind::RoundRobin;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = pdgate::router::start_with(
        cfg,
        Some(listener),
        pdgate::router::AdminListener::Off,
        pdgate::dispatch::RngSource::Seeded(1.into()),
    )
    .await
    .expect("router");
    let env = Env {
        cluster,
        router,
        client: client(),
    };
    env.wait_routable(1, 2).await;
    streams_survive_a_kill(&env, &mut child).await;
    // The streams on the killed process were continued on the other decode.
    let follow_ups = env.cluster.decodes[0]
        .recent_generate_bodies()
        .iter()
        .filter(|(_, b)| b["continue_final_message"] == true)
        .count();
    assert!(follow_ups >= 1, "no stream was moved off the killed decode");
}

/// Four streamed chats of 60 tokens at once, `child` (one of the engines that serves them)
/// killed 300 ms in: every stream completes as the uninterrupted answer does.
pub(crate) async fn streams_survive_a_kill(env: &Env, child: &mut tokio::process::Child) {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "long story"}], "max_tokens": 60, "stream": true, "stream_options": {"include_usage": true}}).to_string();
    let whole = {
        let (_, _, b) = env.post("/v1/chat/completions", &body).await;
        read_answer("/v1/chat/completions", true, false, &b)
    };
    assert_eq!(whole.tokens, 60);
    let streams: Vec<_> = (0..4)
        .map(|_| env.post("/v1/chat/completions", &body))
        .collect();
    let all = futures_util::future::join_all(streams);
    let kill = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        child.start_kill().expect("kill");
    };
    let (answers, ()) = tokio::join!(all, kill);
    for (st, _, b) in answers {
        assert_eq!(st, 200);
        let a = read_answer("/v1/chat/completions", true, false, &b);
        assert_eq!(a.text, whole.text, "{}", String::from_utf8_lossy(&b));
        assert_eq!(
            (a.tokens, a.done, a.finish_reasons, a.errors),
            (60, 1, 1, 0)
        );
        assert_eq!(a.usage, whole.usage);
    }
    let _ = child.wait().await;
}

/// A stream whose decode dies while no other decode is routable waits (up to
/// `retry.move_wait_ms`) for one, then moves: a pause, not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_waits_for_a_decode_to_come_back() {
    let env = fleet([false, false], |_| {}).await;
    let c = &cases(true)[0];
    let whole = ask(&env, c, false).await;
    let other = decode_id(&env, 1);
    // Only decode 0 takes the request, and it dies mid-stream.
    env.router
        .fleet
        .drain(pdgate::types::Role::Decode, other)
        .expect("drain");
    env.cluster.decodes[0].set_faults(Faults {
        decode_die_mid_stream_after: Some(2),
        ..Faults::default()
    });
    let before = bodies(&env);
    let back = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        env.router
            .fleet
            .undrain(pdgate::types::Role::Decode, other)
            .expect("undrain");
    };
    let (got, ()) = tokio::join!(ask(&env, c, false), back);
    moved_from_0_to_1(&env, c, &whole, &got, &before);
}

/// A stream whose decode dies while the other decode has no free slot (its capacity is
/// full) waits for one, then moves: nothing pickable is a pause, not an error (the chaos
/// soak lost streams this way while the other decode's one half-open trial was taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_waits_while_the_other_decode_is_full() {
    let env = fleet([false, false], |c| {
        c.capacity.decode_max_running_per_rank = 1;
    })
    .await;
    let c = &cases(true)[0];
    let whole = ask(&env, c, false).await;
    let d0 = decode_id(&env, 0);
    // Decode 1 runs a slow stream (its one slot), taken while decode 0 is drained.
    env.router
        .fleet
        .drain(pdgate::types::Role::Decode, d0)
        .expect("drain");
    env.cluster.decodes[1].set_faults(Faults {
        decode_extra_itl_ms: 40,
        ..Faults::default()
    });
    let slow = async {
        let (st, _, _) = env.post(c.path, &c.body.to_string()).await;
        st
    };
    let main = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        env.cluster.decodes[1].set_faults(Faults::default());
        env.router
            .fleet
            .undrain(pdgate::types::Role::Decode, d0)
            .expect("undrain");
        env.cluster.decodes[0].set_faults(Faults {
            decode_die_mid_stream_after: Some(2),
            ..Faults::default()
        });
        let before = bodies(&env);
        let got = ask(&env, c, false).await;
        (before, got)
    };
    let (slow_status, (before, got)) = tokio::join!(slow, main);
    assert_eq!(slow_status, 200, "the slow stream on decode 1");
    moved_from_0_to_1(&env, c, &whole, &got, &before);
}

/// A decode that dies after the whole answer but before ending its stream (no usage chunk,
/// no `[DONE]`): the client has every token, so pdgate ends the stream itself (the usage
/// chunk the client asked for, from the engine's counts, and `[DONE]`) — no error event,
/// no follow-up (the chaos soak lost such streams to the idle timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_dies_after_a_complete_answer_is_closed_cleanly() {
    let env = fleet([false, false], |_| {}).await;
    // (case, chunks its stream has before its end)
    let table = [(0usize, 12u32), (2, 13), (3, 14), (4, 14)];
    for (i, chunks) in table {
        let c = &cases(true)[i];
        let whole = ask(&env, c, false).await;
        for d in &env.cluster.decodes {
            d.set_faults(Faults {
                decode_die_mid_stream_after: Some(chunks),
                ..Faults::default()
            });
        }
        let before = bodies(&env);
        let got = ask(&env, c, false).await;
        for d in &env.cluster.decodes {
            d.set_faults(Faults::default());
        }
        let after = bodies(&env);
        let follow_ups: usize = (0..2).map(|k| after[k].len() - before[k].len()).sum();
        assert_eq!(follow_ups, 1, "{}: one decode leg, no follow-up", c.name);
        assert_eq!(got.errors, 0, "{}: no error event", c.name);
        assert_eq!(got.done, 1, "{}: one [DONE]", c.name);
        assert_eq!(got.text, whole.text, "{}", c.name);
        assert_eq!(got.finish_reasons, 1, "{}", c.name);
        if c.name == "chat with usage" {
            let u = got
                .usage
                .as_ref()
                .expect("the usage chunk the client asked for");
            assert_eq!(u["completion_tokens"], c.limit, "{}: {u}", c.name);
            let w = whole.usage.as_ref().expect("usage");
            for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                assert_eq!(u[k], w[k], "{}: {k}", c.name);
            }
        }
    }
}

/// A decode silent for the whole idle bound is moved off even when the learned gap bound
/// is as long as that (here the ceiling, with nothing learned yet): the idle timeout is
/// the last chance to move, not a plain failure (the chaos soak lost streams this way once
/// a moved stream's pause had been learned as a gap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_silent_for_the_idle_bound_is_moved_off() {
    let env = fleet([false, false], |c| {
        c.timeouts.stream_idle_secs = 1;
        c.retry.mid_stream_gap_ceiling_ms = 5000;
    })
    .await;
    let c = &cases(true)[0];
    let whole = ask(&env, c, false).await;
    env.cluster.decodes[0].set_faults(Faults {
        decode_extra_itl_ms: 3000,
        ..Faults::default()
    });
    let mut moved = false;
    for _ in 0..4 {
        let before = bodies(&env);
        let got = ask(&env, c, false).await;
        let after = bodies(&env);
        if after[0].len() == before[0].len() {
            continue;
        }
        assert_eq!(got.errors, 0, "moved, not ended with an error event");
        check_moved(c, &whole, &got, &after[1][before[1].len()]);
        moved = true;
        break;
    }
    assert!(moved);
}

/// A non-streamed request whose decode dies while the only other decode is briefly out
/// (down, then back within `retry.move_wait_ms`): the retry waits for it rather than
/// answering 502 at once (the chaos soak lost 172 non-streamed requests so, `decode_broken`,
/// the other decode's breaker still open after its own fault had cleared).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_waits_for_a_recovering_decode() {
    let env = fleet([false, false], |c| c.retry.move_wait_ms = 3_000).await;
    let (d0, d1) = (&env.cluster.decodes[0], &env.cluster.decodes[1]);
    d0.set_faults(Faults {
        decode_die_mid_stream_after: Some(1),
        ..Faults::default()
    });
    d1.set_faults(Faults {
        down: true,
        ..Faults::default()
    });
    env.wait_pool("decode 1 unhealthy", |s| {
        s.worker(pdgate::types::Role::Decode, pdgate::types::WorkerId(1))
            .is_some_and(|w| !w.facts.healthy)
    })
    .await;
    let body = json!({"text": "x", "sampling_params": {"max_new_tokens": 4}}).to_string();
    let clear = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        d1.set_faults(Faults::default());
    };
    let ((st, _, bytes), ()) = tokio::join!(env.post("/generate", &body), clear);
    let text = String::from_utf8_lossy(&bytes);
    assert_eq!(st, 200, "{text}");
    assert!(d1.stats().ok >= 1, "re-run on the decode that came back");
}

/// The retry budget keeps a reserve for moves: with nothing else in the budget, a failure
/// before the first byte is not retried (the client gets the error), a stream whose decode
/// dies after that is still moved (the reserve was left), and once the reserve is spent the
/// next such stream ends with its error frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_spend_a_reserve_that_retries_leave() {
    let env = fleet([false, false], |c| {
        c.retry.budget_ratio = 0.0;
        c.retry.budget_min_reserve = 0;
        c.retry.budget_move_reserve = 1;
        c.breaker.failure_threshold = 10;
    })
    .await;
    env.cluster.decodes[0].set_faults(Faults {
        decode_status: Some(500),
        ..Faults::default()
    });
    let once = json!({"text": "x", "sampling_params": {"max_new_tokens": 8}});
    let mut refused = false;
    for _ in 0..4 {
        let (st, _, bytes) = env.post("/generate", &once.to_string()).await;
        if st != 200 {
            // Decode 0's 500, not retried on decode 1.
            assert!(
                st.is_server_error(),
                "{st}: {}",
                String::from_utf8_lossy(&bytes)
            );
            refused = true;
            break;
        }
    }
    assert!(refused, "one request of four met decode 0");
    env.cluster.decodes[0].set_faults(Faults {
        decode_die_mid_stream_after: Some(2),
        ..Faults::default()
    });
    let stream = json!({"text": "x", "sampling_params": {"max_new_tokens": 8}, "stream": true});
    // (whether the stream met decode 0, and how it ended)
    let mut outcomes = Vec::new();
    for _ in 0..8 {
        let before = bodies(&env);
        let (st, _, bytes) = env.post("/generate", &stream.to_string()).await;
        let after = bodies(&env);
        assert_eq!(st, 200);
        if after[0].len() == before[0].len() {
            continue;
        }
        let (events, done) = sse_events(&bytes);
        assert!(done);
        let error = events
            .last()
            .and_then(|e| e["error"]["type"].as_str().map(str::to_string));
        outcomes.push((after[1].len() > before[1].len(), error));
        if outcomes.len() == 2 {
            break;
        }
    }
    assert_eq!(
        outcomes,
        [(true, None), (false, Some("decode_broken".to_string()))],
        "the first stream moved on the reserve, the second refused"
    );
}

/// An abort chunk well into a continuable stream (past the first 4 KiB of events, which
/// the tracker reads as they pass and, knowing most by their shape, checks for aborts
/// itself instead of the SSE scanner): the events before it reach the client, the abort
/// chunk does not, and the stream moves to the other decode as when the decode dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_chunk_deep_in_a_stream_moves_it() {
    let env = fleet([false, false], |_| {}).await;
    let limit = 60;
    for mut c in cases(true)
        .into_iter()
        .filter(|c| c.name != "generate input_ids")
    {
        for key in ["max_tokens", "max_completion_tokens"] {
            if c.body.get(key).is_some() {
                c.body[key] = json!(limit);
            }
        }
        if let Some(s) = c.body.get_mut("sampling_params") {
            s["max_new_tokens"] = json!(limit);
        }
        c.limit = limit;
        env.cluster.decodes[0].set_faults(Faults::default());
        let whole = ask(&env, &c, false).await;
        assert_eq!(whole.tokens, limit, "{}: {whole:?}", c.name);
        // Decode 0 streams a token every ~20 ms; ~0.7 s in, an operator's abort of all
        // its requests ends its stream with SGLang's abort chunk.
        env.cluster.decodes[0].set_faults(Faults {
            decode_extra_itl_ms: 20,
            ..Faults::default()
        });
        let mut moved = false;
        for _ in 0..4 {
            let before = bodies(&env);
            let d0 = &env.cluster.decodes[0];
            let aborter = async {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
                while d0.stats().held_now == 0 {
                    if tokio::time::Instant::now() > deadline {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(700)).await;
                let url = format!("{}/abort_request", d0.url());
                crate::support::sim_support::post(&url, r#"{"abort_all": true}"#).await;
            };
            let (got, ()) = tokio::join!(ask(&env, &c, false), aborter);
            let after = bodies(&env);
            if after[0].len() == before[0].len() {
                assert_eq!(got.text, whole.text, "{}", c.name);
                continue;
            }
            assert_eq!(got.errors, 0, "{}: moved, not ended: {got:?}", c.name);
            check_moved(&c, &whole, &got, &after[1][before[1].len()]);
            let prefix_tokens = limit - json_limit(&after[1][before[1].len()], c.path);
            assert!(
                prefix_tokens > 12,
                "{}: aborted after {prefix_tokens} tokens, within the first 4 KiB",
                c.name
            );
            moved = true;
            break;
        }
        assert!(moved, "{}: no request reached the aborted decode", c.name);
    }
}

/// The token limit a follow-up carried.
fn json_limit(follow: &Value, path: &str) -> u64 {
    let v = match path {
        "/generate" => &follow["sampling_params"]["max_new_tokens"],
        _ => follow
            .get("max_completion_tokens")
            .unwrap_or(&follow["max_tokens"]),
    };
    v.as_u64().expect("a limit")
}

/// A decode that does not report per-chunk usage (it ignores
/// `stream_options.continuous_usage_stats`, as older SGLang builds and other
/// OpenAI-compatible servers do): the tokens the client already has cannot be counted from
/// the engine's own figures, so a stream that breaks is not continued with a limit that
/// could overshoot: it ends with the error event, as with moves off, and no follow-up is
/// sent. The client never gets more tokens than it asked for (issue 33's second bug: the
/// follow-up went out with the whole limit again and clients got 110 tokens of 80).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_per_chunk_usage_is_not_continued_past_its_limit() {
    let decodes = (0..2)
        .map(|_| {
            let mut d = fast_engine(EngineConfig::decode(1));
            d.ignore_continuous_usage = true;
            d
        })
        .collect();
    let prefill = vec![fast_engine(EngineConfig::prefill(1))];
    let env = start_with_admin(prefill, decodes, |c| {
        c.policy.decode = PolicyKind::RoundRobin;
    })
    .await;
    env.wait_routable(1, 2).await;
    env.cluster.decodes[0].set_faults(Faults {
        decode_die_mid_stream_after: Some(3),
        ..Faults::default()
    });
    for c in cases(true).into_iter().filter(|c| c.path != "/generate") {
        let mut seen = false;
        for _ in 0..4 {
            let before = bodies(&env);
            let (st, _, bytes) = env.post(c.path, &c.body.to_string()).await;
            assert_eq!(st, 200, "{}", c.name);
            let after = bodies(&env);
            let got = read_answer(c.path, true, false, &bytes);
            assert!(
                got.pieces.len() as u64 <= c.limit,
                "{}: {} tokens past the limit of {}: {got:?}",
                c.name,
                got.pieces.len(),
                c.limit
            );
            if after[0].len() == before[0].len() {
                continue;
            }
            let (events, done) = sse_events(&bytes);
            assert!(done, "{}: {}", c.name, String::from_utf8_lossy(&bytes));
            assert_eq!(
                events.last().unwrap()["error"]["type"],
                "decode_broken",
                "{}: {}",
                c.name,
                String::from_utf8_lossy(&bytes)
            );
            assert_eq!(after[1].len(), before[1].len(), "{}: no follow-up", c.name);
            seen = true;
            break;
        }
        assert!(seen, "{}: never reached the dying decode", c.name);
    }
}
