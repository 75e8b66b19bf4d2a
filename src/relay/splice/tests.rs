//! Tests of the splice: a stream cut after any event and continued by a second decode (in
//! either `/generate` mode) reaches the client as one stream in the client's format, with
//! the engine's counts summed; per-chunk usage the client did not ask for never shows.
use super::*;
use crate::request::ApiRoute;
use crate::skim;
use serde_json::json;

fn plan(route: ApiRoute, limit: u64, usage: bool, continuous: bool) -> Plan {
    Plan {
        route,
        limit: Some(limit),
        uses_ids: false,
        client_usage: usage,
        client_continuous_usage: continuous,
    }
}

/// A `/generate` stream of `words` (ids 100+i) from token `from`, in `mode`, as events.
fn gen_events(
    words: &[&str],
    from: usize,
    mode: GenerateMode,
    rid: &str,
    prompt: u64,
) -> Vec<Bytes> {
    (from..words.len())
        .map(|k| {
            let (text, ids): (String, Vec<i64>) = match mode {
                GenerateMode::Cumulative => (
                    words[from..=k].concat(),
                    (from..=k).map(|i| 100 + i as i64).collect(),
                ),
                GenerateMode::Incremental => (words[k].to_string(), vec![100 + k as i64]),
            };
            let fin = if k + 1 == words.len() {
                json!({"type": "length", "length": words.len() - from})
            } else {
                Value::Null
            };
            let v = json!({"text": text, "output_ids": ids, "meta_info": {
                "id": rid, "prompt_tokens": prompt, "completion_tokens": k + 1 - from, "finish_reason": fin}});
            Bytes::from(format!("data: {v}\n\n"))
        })
        .collect()
}

fn client_view(out: &[u8], mode: GenerateMode) -> (String, Vec<i64>, u64, Vec<Value>) {
    let text = std::str::from_utf8(out).unwrap();
    let evs: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let (mut t, mut ids, mut n) = (String::new(), Vec::new(), 0);
    for e in &evs {
        let et = e["text"].as_str().unwrap().to_string();
        let ei: Vec<i64> = serde_json::from_value(e["output_ids"].clone()).unwrap();
        match mode {
            GenerateMode::Cumulative => {
                t = et;
                ids = ei;
            }
            GenerateMode::Incremental => {
                t.push_str(&et);
                ids.extend(ei);
            }
        }
        n = e["meta_info"]["completion_tokens"].as_u64().unwrap();
    }
    (t, ids, n, evs)
}

#[test]
fn generate_streams_splice_in_every_mode_pair() {
    use GenerateMode::*;
    let words = [" a", " b", " c", " d", " e", " f"];
    for client in [Cumulative, Incremental] {
        for second in [Cumulative, Incremental] {
            for cut in 1..words.len() {
                let mut t = Tracker::new(plan(ApiRoute::Generate, 6, false, false), client);
                let mut out = Vec::new();
                for e in gen_events(&words, 0, client, "r0", 7).into_iter().take(cut) {
                    out.extend_from_slice(&t.relay_ok(e));
                }
                let sent = t.sent().expect("continuable");
                assert_eq!(sent.completion_tokens, cut as u64);
                assert_eq!(sent.text, words[..cut].concat());
                t.next_segment(sent);
                t.set_source_mode(second);
                // The second decode's stream: its own counts, its own rid, a longer prompt.
                for e in gen_events(&words, cut, second, "r1", 7 + cut as u64) {
                    out.extend_from_slice(&t.relay_ok(e));
                }
                out.extend_from_slice(&t.relay_ok(Bytes::from_static(b"data: [DONE]\n\n")));
                let (text, ids, n, evs) = client_view(&out, client);
                let case = format!("{client:?} then {second:?}, cut {cut}");
                assert_eq!(text, words.concat(), "{case}");
                assert_eq!(ids, (100..106).collect::<Vec<_>>(), "{case}");
                assert_eq!(n, 6, "{case}");
                assert_eq!(evs.len(), 6, "{case}: one event per token");
                assert!(
                    evs.iter()
                        .all(|e| e["meta_info"]["id"] == "r0"
                            && e["meta_info"]["prompt_tokens"] == 7),
                    "{case}"
                );
                let fins: Vec<&Value> = evs
                    .iter()
                    .map(|e| &e["meta_info"]["finish_reason"])
                    .filter(|f| !f.is_null())
                    .collect();
                assert_eq!(
                    fins,
                    vec![&json!({"type": "length", "length": 6})],
                    "{case}"
                );
                assert_eq!(String::from_utf8_lossy(&out).matches("[DONE]").count(), 1);
            }
        }
    }
}

#[test]
fn a_finished_answer_is_not_continued() {
    let words = [" a", " b"];
    let mut t = Tracker::new(
        plan(ApiRoute::Generate, 2, false, false),
        GenerateMode::Cumulative,
    );
    for e in gen_events(&words, 0, GenerateMode::Cumulative, "r", 1) {
        t.relay_ok(e);
    }
    assert!(t.sent().is_err());
}

fn chat_chunk(
    content: Option<&str>,
    role: bool,
    fin: Option<&str>,
    usage: Option<(u64, u64)>,
) -> Bytes {
    let mut delta = serde_json::Map::new();
    if role {
        delta.insert("role".into(), json!("assistant"));
    }
    if let Some(c) = content {
        delta.insert("content".into(), json!(c));
    }
    let mut v = json!({"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]});
    if let Some((p, c)) = usage {
        v["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    }
    Bytes::from(format!("data: {v}\n\n"))
}

fn usage_chunk(p: u64, c: u64) -> Bytes {
    let v = json!({"id": "x", "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}});
    Bytes::from(format!("data: {v}\n\n"))
}

#[test]
fn chat_usage_is_hidden_unless_asked_and_summed_after_a_move() {
    for (asked, continuous) in [(false, false), (true, false), (true, true)] {
        let mut t = Tracker::new(
            plan(ApiRoute::ChatCompletions, 4, asked, continuous),
            GenerateMode::Cumulative,
        );
        let mut out = Vec::new();
        out.extend_from_slice(&t.relay_ok(chat_chunk(Some(""), true, None, Some((5, 0)))));
        out.extend_from_slice(&t.relay_ok(chat_chunk(Some(" a"), false, None, Some((5, 1)))));
        // Two tokens in one chunk (speculative decoding): the engine's count says 3.
        out.extend_from_slice(&t.relay_ok(chat_chunk(Some(" b c"), false, None, Some((5, 3)))));
        let sent = t.sent().unwrap();
        assert_eq!((sent.text.as_str(), sent.completion_tokens), (" a b c", 3));
        t.next_segment(sent);
        let mut second = Vec::new();
        second.extend_from_slice(&chat_chunk(Some(""), true, None, Some((9, 0))));
        second.extend_from_slice(&chat_chunk(Some(" d"), false, None, Some((9, 1))));
        second.extend_from_slice(&chat_chunk(None, false, Some("length"), Some((9, 1))));
        second.extend_from_slice(&usage_chunk(9, 1));
        second.extend_from_slice(b"data: [DONE]\n\n");
        out.extend_from_slice(&t.relay_ok(Bytes::from(second)));
        let text = String::from_utf8(out).unwrap();
        let evs: Vec<Value> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let content: String = evs
            .iter()
            .filter_map(|e| e["choices"].get(0)?["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, " a b c d");
        let roles = evs
            .iter()
            .filter(|e| {
                e["choices"]
                    .get(0)
                    .is_some_and(|c| c["delta"].get("role").is_some())
            })
            .count();
        assert_eq!(roles, 1, "one role chunk");
        assert!(evs.iter().all(|e| e["id"] == "x"));
        let finals: Vec<&Value> = evs.iter().filter(|e| e["choices"] == json!([])).collect();
        let with_usage = evs
            .iter()
            .filter(|e| e["choices"] != json!([]) && e.get("usage").is_some())
            .count();
        if asked {
            assert_eq!(finals.len(), 1);
            assert_eq!(
                finals[0]["usage"],
                json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})
            );
        } else {
            assert!(finals.is_empty(), "{text}");
        }
        assert_eq!(with_usage > 0, continuous, "{text}");
        assert_eq!(text.matches("[DONE]").count(), 1);
    }
}

#[test]
fn tool_calls_and_reasoning_stop_a_move() {
    let mut t = Tracker::new(
        plan(ApiRoute::ChatCompletions, 9, false, false),
        GenerateMode::Cumulative,
    );
    t.relay_ok(Bytes::from_static(
        b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\n",
    ));
    assert!(t.sent().unwrap_err().contains("tool call"));
    let mut t = Tracker::new(
        plan(ApiRoute::ChatCompletions, 9, false, false),
        GenerateMode::Cumulative,
    );
    t.relay_ok(Bytes::from_static(
        b"data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n",
    ));
    assert!(t.sent().unwrap_err().contains("reasoning"));
}

#[test]
fn usage_is_cut_out_in_any_position() {
    let cases: &[&[u8]] = &[
        br#"{"usage":{"a":1},"id":"x"}"#,
        br#"{"id":"x","usage":{"a":1}}"#,
        br#"{"id":"x" , "usage" : {"a":1} , "z":2}"#,
    ];
    for c in cases {
        let m = skim::chunk(c).unwrap().usage_member.unwrap();
        let mut out = Vec::new();
        cut_member(&mut out, c, m);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(v.get("usage").is_none());
        assert_eq!(v["id"], "x");
    }
}

/// One chat stream: a role chunk, `n` content chunks (maybe a tool call or reasoning
/// among them), a finish chunk and the usage chunk, each with per-chunk usage.
fn chat_stream(texts: &[String], special: Option<usize>, finish: bool) -> Vec<Bytes> {
    let mut evs = vec![chat_chunk(Some(""), true, None, Some((7, 0)))];
    for (i, t) in texts.iter().enumerate() {
        let c = (i + 1) as u64;
        evs.push(match special {
            Some(k) if k == i && k % 2 == 0 => Bytes::from(format!(
                "data: {}\n\n",
                json!({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}, "finish_reason": null}], "usage": {"prompt_tokens": 7, "completion_tokens": c}})
            )),
            Some(k) if k == i => Bytes::from(format!(
                "data: {}\n\n",
                json!({"id": "x", "choices": [{"index": 0, "delta": {"reasoning_content": t}, "finish_reason": null}], "usage": {"prompt_tokens": 7, "completion_tokens": c}})
            )),
            _ => chat_chunk(Some(t), false, None, Some((7, c))),
        });
    }
    if finish {
        let n = texts.len() as u64;
        evs.push(chat_chunk(None, false, Some("length"), Some((7, n))));
        evs.push(usage_chunk(7, n));
        evs.push(Bytes::from_static(b"data: [DONE]\n\n"));
    }
    evs
}

proptest::proptest! {
    /// Deferring the account changes nothing the client sees or a move reads: a tracker
    /// that defers and one that accounts each event give the same bytes, the same answer
    /// so far, the same verdict on completeness and the same closing.
    #[test]
    fn the_deferred_account_agrees_with_the_eager_one(
        texts in proptest::collection::vec("(.|\\\\|\"|\n){0,6}", 0..40),
        special in proptest::option::of(0usize..40),
        finish in proptest::bool::ANY,
        asked in proptest::bool::ANY,
        continuous in proptest::bool::ANY,
        cuts in proptest::collection::vec(1usize..4, 0..20),
    ) {
        let p = plan(ApiRoute::ChatCompletions, 64, asked || continuous, continuous);
        let mut lazy = Tracker::new(p.clone(), GenerateMode::Cumulative);
        let mut eager = Tracker::new(p, GenerateMode::Cumulative).eager();
        let evs = chat_stream(&texts, special, finish);
        // The events in runs of 1 to 3 (one read can hold several).
        let mut runs = Vec::new();
        let mut i = 0;
        for c in cuts.iter().cycle().take(evs.len()) {
            if i >= evs.len() {
                break;
            }
            let end = (i + c).min(evs.len());
            runs.push(evs[i..end].concat());
            i = end;
        }
        if i < evs.len() {
            runs.push(evs[i..].concat());
        }
        for r in runs {
            let r = Bytes::from(r);
            let (a, b) = (lazy.relay_ok(r.clone()), eager.relay_ok(r));
            proptest::prop_assert_eq!(a, b);
        }
        proptest::prop_assert_eq!(lazy.complete(), eager.complete());
        proptest::prop_assert_eq!(lazy.closing(), eager.closing());
        proptest::prop_assert_eq!(lazy.sent(), eager.sent());
    }
}

#[test]
fn a_short_chat_stream_is_cut_without_being_read() {
    let p = plan(ApiRoute::ChatCompletions, 64, false, false);
    let mut t = Tracker::new(p, GenerateMode::Cumulative);
    let texts: Vec<String> = [" a", " \"b\"", " c"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let evs = chat_stream(&texts, None, false);
    let mut out = Vec::new();
    for e in evs {
        out.extend_from_slice(&t.relay_ok(e));
    }
    // Kept unread, cut all the same.
    assert!(!t.pending.is_empty());
    assert!(!String::from_utf8_lossy(&out).contains("usage"));
    let sent = t.sent().unwrap();
    assert_eq!(
        (sent.text.as_str(), sent.completion_tokens),
        (" a \"b\" c", 3)
    );
    assert!(t.pending.is_empty());
}

/// A run of events, and the payloads of its events (`None`: an event without data).
type PayloadCase = (&'static [u8], &'static [Option<&'static [u8]>]);

#[test]
fn events_and_their_payloads() {
    let table: &[PayloadCase] = &[
        (b"data: {\"a\":1}\n\n", &[Some(b"{\"a\":1}")]),
        (
            b"data:x\r\n\r\ndata: [DONE]\n\n",
            &[Some(b"x"), Some(b"[DONE]")],
        ),
        (b": ping\n\ndata: y\n\n", &[None, Some(b"y")]),
        (b"event: e\ndata: z\n\n", &[Some(b"z")]),
        (b"data: \n\n", &[Some(b"")]),
        (b"data: tail", &[Some(b"tail")]),
    ];
    for (run, want) in table {
        let got: Vec<Option<&[u8]>> = events(run)
            .map(|(s, e, first)| payload_with(&run[s..e], first).map(|(a, b)| &run[s..e][a..b]))
            .collect();
        assert_eq!(&got, want, "{}", String::from_utf8_lossy(run));
    }
}

proptest::proptest! {
    /// A tracker that checks for aborts (as it does once the SSE scanner leaves them to
    /// it) stops at the first event that carries one, as the scanner's check does: the
    /// same bytes before it, the same abort, and an account without it, whether the events
    /// were deferred, read by their shape or skimmed whole. Texts that are the words
    /// themselves are no abort.
    #[test]
    fn the_tracker_finds_the_aborts_the_scanner_finds(
        texts in proptest::collection::vec(
            proptest::sample::select(vec![" a", "abort", "error", " \"abort\"", "x\\"]), 0..60),
        abort_at in proptest::option::of(0usize..62),
        error_chunk in proptest::bool::ANY,
        eager in proptest::bool::ANY,
        cut in 1usize..4,
    ) {
        let texts: Vec<String> = texts.iter().map(|s| s.to_string()).collect();
        let mut evs = chat_stream(&texts, None, true);
        if let Some(k) = abort_at.filter(|k| *k < evs.len()) {
            let abort = if error_chunk {
                json!({"error": {"object": "error", "message": "boom", "type": "InternalServerError", "code": 500}})
            } else {
                json!({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]})
            };
            evs.insert(k, Bytes::from(format!("data: {abort}\n\n")));
        }
        let first_abort = evs.iter().position(|e| {
            let d = e.strip_prefix(b"data: ").unwrap_or(e);
            abort_in_answer(d.strip_suffix(b"\n\n").unwrap_or(d)).is_some()
        });
        let p = plan(ApiRoute::ChatCompletions, 64, false, false);
        // The reference: the events before the first abort, relayed without checks.
        let mut reference = Tracker::new(p.clone(), GenerateMode::Cumulative);
        let mut want = Vec::new();
        for e in &evs[..first_abort.unwrap_or(evs.len())] {
            want.extend_from_slice(&reference.relay_ok(e.clone()));
        }
        let mut t = Tracker::new(p, GenerateMode::Cumulative);
        if eager {
            t = t.eager();
        }
        t.check_aborts();
        let mut got = Vec::new();
        let mut found = None;
        for run in evs.chunks(cut) {
            match t.relay(Bytes::from(run.concat())) {
                Ok(b) => got.extend_from_slice(&b),
                Err(a) => {
                    got.extend_from_slice(&a.before);
                    found = Some(a.abort);
                    break;
                }
            }
        }
        proptest::prop_assert_eq!(found.is_some(), first_abort.is_some());
        proptest::prop_assert_eq!(got, want);
        proptest::prop_assert_eq!(t.sent(), reference.sent());
    }
}

/// The cumulative `/generate` stream (forwarded as it comes) stops at an abort too, its
/// last event before the abort the answer so far.
#[test]
fn a_cumulative_generate_stream_stops_at_an_abort() {
    let words = [" a", " b", " c", " d"];
    let mut evs = gen_events(&words, 0, GenerateMode::Cumulative, "r", 3);
    let abort = json!({"text": " a b", "output_ids": [100, 101], "meta_info": {"id": "r",
        "finish_reason": {"type": "abort", "message": "gone", "status_code": 500}}});
    evs.insert(2, Bytes::from(format!("data: {abort}\n\n")));
    let mut t = Tracker::new(
        plan(ApiRoute::Generate, 4, false, false),
        GenerateMode::Cumulative,
    );
    t.check_aborts();
    let a = t.relay(Bytes::from(evs.concat())).unwrap_err();
    assert_eq!(a.before, Bytes::from(evs[..2].concat()));
    assert_eq!(a.abort.message, "gone");
    let sent = t.sent().unwrap();
    assert_eq!((sent.text.as_str(), sent.completion_tokens), (" a b", 2));
}

/// A stream is continued only from the engine's own count of what it sent: text relayed
/// after the last event that carried completion tokens (an engine that ignores
/// `continuous_usage_stats`) makes `sent` refuse, in eager and deferred accounting alike;
/// a role chunk without usage does not. Table: the chunks' usage, and whether `sent` is
/// `Ok` with that count.
#[test]
fn text_the_engine_did_not_count_is_not_continued() {
    type Usage = Option<(u64, u64)>;
    let cases: [(&str, [Usage; 3], Option<u64>); 4] = [
        (
            "usage on every chunk",
            [Some((5, 0)), Some((5, 1)), Some((5, 2))],
            Some(2),
        ),
        ("no usage at all", [None, None, None], None),
        (
            "role chunk without usage",
            [None, Some((5, 1)), Some((5, 2))],
            Some(2),
        ),
        (
            "usage stops after the first token",
            [Some((5, 0)), Some((5, 1)), None],
            None,
        ),
    ];
    for (name, usage, want) in cases {
        for eager in [false, true] {
            let t = Tracker::new(
                plan(ApiRoute::ChatCompletions, 8, false, false),
                GenerateMode::Cumulative,
            );
            let mut t = if eager { t.eager() } else { t };
            t.relay_ok(chat_chunk(Some(""), true, None, usage[0]));
            t.relay_ok(chat_chunk(Some(" a"), false, None, usage[1]));
            t.relay_ok(chat_chunk(Some(" b"), false, None, usage[2]));
            match (t.sent(), want) {
                (Ok(s), Some(n)) => assert_eq!(s.completion_tokens, n, "{name}"),
                (Err(why), None) => assert_eq!(why, UNCOUNTED, "{name}"),
                (got, _) => panic!("{name} (eager {eager}): {got:?}"),
            }
        }
    }
    // `/generate` without `meta_info.completion_tokens` likewise.
    let mut t = Tracker::new(
        plan(ApiRoute::Generate, 8, false, false),
        GenerateMode::Incremental,
    );
    t.relay_ok(Bytes::from_static(
        b"data: {\"text\":\" a\",\"meta_info\":{}}\n\n",
    ));
    assert_eq!(t.sent().unwrap_err(), UNCOUNTED);
}
