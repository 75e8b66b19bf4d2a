//! Tests of the SSE scanner: events cut at their boundaries (CRLF too), a bounded event
//! without an end, aborts found in every shape, prefill logprobs merged per event.
use super::*;

/// The default limit (`upstream.max_answer_bytes`).
fn limit() -> usize {
    crate::config::UpstreamConfig::default().max_answer_bytes
}

fn scanner() -> SseScanner {
    SseScanner::new(None, limit())
}

#[test]
fn event_boundaries() {
    let ends: &[(&[u8], Option<usize>)] = &[
        (b"data: a\n\n", Some(9)),
        (b"data: a\n\ndata: b", Some(9)),
        (b"data: a\r\n\r\ndata: b\n", Some(11)),
        (b"data: a\n\ndata: b\r\n\r\n", Some(20)),
        (b"data: a\n", None),
        (b"\n", None),
        (b"", None),
        (b"\n\n", Some(2)),
        (b"data: a\n\r\ndata: b", Some(10)),
        (b"data: a\r\n", None),
    ];
    for (buf, want) in ends {
        assert_eq!(event_end(buf), *want, "{:?}", String::from_utf8_lossy(buf));
    }
    let firsts: &[(&[u8], usize)] = &[
        (b"data: a\n\ndata: b\n\n", 9),
        (b"data: a\n", 8),
        (b"a\nb\n\n", 5),
        (b"data: a\r\n\r\ndata: b\r\n\r\n", 11),
        (b"data: a\n\r\ndata: b\n\n", 10),
        (b"data: a\r\n", 9),
        (b"", 0),
    ];
    for (buf, want) in firsts {
        assert_eq!(
            first_event_len(buf),
            *want,
            "{:?}",
            String::from_utf8_lossy(buf)
        );
    }
}

fn fwd(s: &Scan) -> &[u8] {
    match s {
        Scan::Forward(b) => b,
        other => panic!("unexpected {other:?}"),
    }
}

/// An event that never ends is held only up to the limit; then the stream is broken.
/// Each push scans only its own bytes for the event's end.
#[test]
fn an_event_without_end_is_bounded() {
    let mut s = scanner();
    let r = s.push(Bytes::from_static(
        b"data: {\"text\":\"a\"}\n\ndata: {\"text\":\"",
    ));
    assert_eq!(fwd(&r), b"data: {\"text\":\"a\"}\n\n");
    let piece = Bytes::from(vec![b'x'; 1 << 20]);
    let mut pushed = 0;
    let broken = loop {
        match s.push(piece.clone()) {
            Scan::Forward(b) => assert!(b.is_empty()),
            Scan::Broken { message } => break message,
            other => panic!("{other:?}"),
        }
        pushed += piece.len();
        assert!(pushed <= limit() + piece.len(), "never broken");
    };
    assert!(broken.contains("without ending it"), "{broken}");
    // Below the limit, a long event split in many reads still completes exactly.
    let mut s = scanner();
    let mut out = Vec::new();
    for _ in 0..64 {
        out.extend_from_slice(fwd(&s.push(Bytes::from_static(b"data: 0123456789abcdef\n"))));
    }
    out.extend_from_slice(fwd(&s.push(Bytes::from_static(b"\r"))));
    out.extend_from_slice(fwd(&s.push(Bytes::from_static(b"\n"))));
    assert_eq!(out.len(), 64 * 23 + 2);
}

#[test]
fn whole_events_pass_through_and_tails_wait() {
    let mut s = scanner();
    let r = s.push(Bytes::from_static(b"data: {\"text\":\"a\"}\n\ndata: {\"te"));
    assert_eq!(fwd(&r), b"data: {\"text\":\"a\"}\n\n");
    let r = s.push(Bytes::from_static(b"xt\":\"ab\"}\n\n"));
    assert_eq!(fwd(&r), b"data: {\"text\":\"ab\"}\n\n");
    let r = s.push(Bytes::from_static(b"data: [DONE]\n\n"));
    assert_eq!(fwd(&r), b"data: [DONE]\n\n");
    assert!(s.finish().is_empty());
}

#[test]
fn aborts_are_caught_in_every_shape() {
    let cases: &[&[u8]] = &[
        b"data: {\"text\":\"a\"}\n\ndata: {\"text\":\"a\",\"meta_info\":{\"finish_reason\":{\"type\":\"abort\",\"message\":\"kv lost\",\"status_code\":500}}}\n\ndata: [DONE]\n\n",
        b"data: {\"text\":\"a\"}\n\ndata: {\"error\":{\"object\":\"error\",\"message\":\"kv lost\",\"type\":\"INTERNAL_SERVER_ERROR\",\"code\":500}}\n\ndata: [DONE]\n\n",
    ];
    for c in cases {
        let mut s = scanner();
        match s.push(Bytes::from_static(c)) {
            Scan::Abort { before, abort } => {
                assert_eq!(&before[..], b"data: {\"text\":\"a\"}\n\n");
                assert_eq!(abort.message, "kv lost");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Found by the abort property with CRLF events: the events ahead of an abort in the
/// same chunk were taken for part of it and lost.
#[test]
fn crlf_events_before_an_abort_are_kept() {
    let mut s = scanner();
    let chunk =
        b"data: {\"text\":\"a\"}\r\n\r\ndata: {\"error\":{\"message\":\"kv lost\"}}\r\n\r\n";
    match s.push(Bytes::from_static(chunk)) {
        Scan::Abort { before, abort } => {
            assert_eq!(&before[..], b"data: {\"text\":\"a\"}\r\n\r\n");
            assert_eq!(abort.message, "kv lost");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_words_alone_are_not_an_abort() {
    // The pre-check finds `"abort"` / `"error"` in the text; the full check does not.
    let run: &[u8] = b"data: {\"text\":\"\\\"abort\\\" \\\"error\\\"\",\"k\":\"abort\"}\n\ndata: {\"error\":null}\n\n";
    let mut s = scanner();
    assert_eq!(fwd(&s.push(Bytes::from_static(run))), run);
}

#[test]
fn logprobs_are_merged_per_event() {
    let lp = Arc::new(PrefillLogprobs::from_prefill_body(
        &Bytes::from_static(br#"{"meta_info":{"input_token_logprobs":[[null,1,null]]}}"#),
        crate::memory::Charge::none(),
    ));
    let mut s = SseScanner::new(Some(lp), limit());
    let r = s.push(Bytes::from_static(
        b"data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\ndata: [DONE]\n\n",
    ));
    let out = std::str::from_utf8(fwd(&r)).unwrap().to_string();
    assert!(
        out.starts_with("data: {\"meta_info\":{\"input_token_logprobs\":[[null,1,null]]}}\n\n"),
        "{out}"
    );
    assert!(out.ends_with("data: [DONE]\n\n"));
}

/// A prefill answer whose input logprobs are about `n` × 20 bytes.
fn big_logprobs(n: usize) -> Arc<PrefillLogprobs> {
    let entries = vec!["[-0.125,12345,null]"; n].join(",");
    let body = format!(r#"{{"meta_info":{{"input_token_logprobs":[{entries}]}}}}"#);
    Arc::new(PrefillLogprobs::from_prefill_body(
        &Bytes::from(body),
        crate::memory::Charge::none(),
    ))
}

/// A run of events with long input logprobs is merged a slice at a time: the first
/// push forwards about a slice and holds the rest, [`SseScanner::take_held`] hands out
/// the next slices, a push while events are held keeps them first, and the whole is
/// what merging each event alone gives.
#[test]
fn a_run_with_long_logprobs_is_merged_a_slice_at_a_time() {
    let lp = big_logprobs(5_000);
    assert!(
        lp.bytes() > 90_000 && lp.bytes() < 110_000,
        "{}",
        lp.bytes()
    );
    let event = |i: usize| {
        format!("data: {{\"text\":\"t{i}\",\"meta_info\":{{\"input_token_logprobs\":[]}}}}\n\n")
    };
    let run: String = (0..8).map(event).collect();
    let want: Vec<u8> = (0..10)
        .flat_map(|i| {
            let mut one = SseScanner::new(Some(lp.clone()), limit());
            fwd(&one.push(Bytes::from(event(i)))).to_vec()
        })
        .chain(b"data: [DONE]\n\n".iter().copied())
        .collect();
    let mut s = SseScanner::new(Some(lp.clone()), limit());
    let first = s.push(Bytes::from(run));
    let first = fwd(&first).to_vec();
    assert!(first.len() >= crate::body::SLICE_BYTES, "{}", first.len());
    assert!(
        first.len() < crate::body::SLICE_BYTES + 120_000,
        "{}",
        first.len()
    );
    assert!(s.holds());
    let mut out = first;
    let mut slices = 1;
    out.extend_from_slice(fwd(&s.take_held().expect("held")));
    // More events arrive while some are held: they queue behind them.
    let more = format!("{}{}data: [DONE]\n\n", event(8), event(9));
    out.extend_from_slice(fwd(&s.push(Bytes::from(more))));
    while let Some(r) = s.take_held() {
        slices += 1;
        out.extend_from_slice(fwd(&r));
    }
    out.extend_from_slice(&s.finish());
    assert!(slices >= 2, "{slices}");
    assert_eq!(out, want);
}

/// An abort among held events is found when they are merged, after the events before it.
#[test]
fn an_abort_among_held_events_is_found() {
    let lp = big_logprobs(5_000);
    let ok = "data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n";
    let abort =
        "data: {\"meta_info\":{\"finish_reason\":{\"type\":\"abort\",\"message\":\"gone\"}}}\n\n";
    let run = format!("{}{abort}{ok}", ok.repeat(5));
    let mut s = SseScanner::new(Some(lp), limit());
    let mut sent = fwd(&s.push(Bytes::from(run))).len();
    let found = loop {
        match s.take_held() {
            Some(Scan::Forward(b)) => sent += b.len(),
            Some(Scan::Abort { before, abort }) => break (before.len(), abort),
            other => panic!("{other:?}"),
        }
    };
    assert!(
        sent > 0 && found.0 > 0,
        "events before the abort are forwarded"
    );
    assert_eq!(found.1.message, "gone");
}

/// Found by fuzzing: an event after a run of blank lines was merged or not depending on
/// where the reads split the stream (the extra blank line began the event, which then did
/// not start with `data: `).
#[test]
fn extra_blank_lines_do_not_stop_a_merge() {
    let lp = Arc::new(PrefillLogprobs::from_prefill_body(
        &Bytes::from_static(br#"{"meta_info":{"input_token_logprobs":[[null,1,null]]}}"#),
        crate::memory::Charge::none(),
    ));
    let stream: &[u8] = b"data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n\ndata: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n";
    let merged = "data: {\"meta_info\":{\"input_token_logprobs\":[[null,1,null]]}}\n\n";
    let want = format!("{merged}\n{merged}");
    for cut in [stream.len(), 1, 2, 3, 5, 8] {
        let mut s = SseScanner::new(Some(lp.clone()), limit());
        let mut out = Vec::new();
        for c in stream.chunks(cut) {
            out.extend_from_slice(fwd(&s.push(Bytes::copy_from_slice(c))));
        }
        out.extend_from_slice(&s.finish());
        assert_eq!(String::from_utf8_lossy(&out), want, "cut {cut}");
    }
}

/// Property tests: whole, non-aborting events pass through unchanged however the
/// stream is cut into chunks, and an abort is found at its event under any cut.
mod props {
    use super::*;
    use crate::test_cuts::{arb_cuts, pieces, Cuts};
    use proptest::prelude::*;
    use proptest::sample::Index;
    use serde_json::{json, Value};

    /// Text with the words and bytes that matter to the scanner (quotes, the words
    /// `abort` and `error`, newlines, `[DONE]`, which JSON escapes in a payload).
    fn arb_text() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => "[a-z ]{0,12}",
            2 => prop::sample::select(vec![
                "abort", "\"abort\"", "error", "\"error\"", "data: x\n\n", "[DONE]",
                "\r\n\r\n", "\n", "\u{e9}\u{1f600}", "\\", "{\"error\":{}}",
            ])
            .prop_map(str::to_string),
            1 => prop::collection::vec(any::<char>(), 0..8).prop_map(String::from_iter),
        ]
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            arb_text().prop_map(Value::from),
        ];
        leaf.prop_recursive(2, 12, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
                prop::collection::btree_map(arb_text(), inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// An event's JSON payload with neither an abort nor an error, often close to one:
    /// SGLang and OpenAI chunks with other finish reasons, `"error": null`, and the
    /// words in strings.
    fn arb_payload() -> impl Strategy<Value = String> {
        let sglang_reason = prop_oneof![
            Just(Value::Null),
            (0u32..9).prop_map(|n| json!({"type": "length", "length": n})),
            arb_text().prop_map(|t| json!({"type": "stop", "matched": t})),
            Just(json!({"type": "aborted"})),
        ];
        let openai_reason = prop::sample::select(vec![Value::Null, json!("stop"), json!("length")]);
        prop_oneof![
            (
                arb_text(),
                prop::collection::vec(0u32..50_000, 0..3),
                sglang_reason,
                0u32..99
            )
                .prop_map(|(t, ids, fr, n)| json!({
                    "text": t,
                    "output_ids": ids,
                    "meta_info": {"id": "abc", "finish_reason": fr, "completion_tokens": n},
                })),
            (arb_text(), openai_reason).prop_map(|(t, fr)| json!({
                "id": "c1",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": fr}],
            })),
            (arb_text(), arb_value()).prop_map(|(t, v)| json!({"error": null, "text": t, "v": v})),
            arb_value(),
        ]
        .prop_map(|v| v.to_string())
        .prop_filter("an abort or error", |p| {
            abort_in_answer(p.as_bytes()).is_none()
        })
    }

    /// A line ending: SGLang writes `\n`; the SSE grammar also allows `\r\n`.
    fn arb_eol() -> impl Strategy<Value = &'static str> {
        prop_oneof![3 => Just("\n"), 1 => Just("\r\n")]
    }

    /// One well-formed event.
    fn arb_event() -> impl Strategy<Value = Vec<u8>> {
        let event = prop_oneof![
            6 => arb_payload().prop_map(|p| format!("data: {p}")),
            1 => arb_payload().prop_map(|p| format!("data:{p}")),
            1 => (arb_payload(), arb_eol()).prop_map(|(p, e)| format!("event: message{e}data: {p}")),
            1 => Just(": keep-alive".to_string()),
        ];
        (event, arb_eol(), arb_eol()).prop_map(|(ev, a, b)| format!("{ev}{a}{b}").into_bytes())
    }

    fn chunks(buf: &[u8], cuts: &Cuts) -> Vec<Bytes> {
        pieces(buf, cuts)
            .into_iter()
            .map(Bytes::copy_from_slice)
            .collect()
    }

    /// The stream, and the offset where each of its events ends.
    fn join(events: &[Vec<u8>]) -> (Vec<u8>, Vec<usize>) {
        let mut buf = Vec::new();
        let mut ends = Vec::new();
        for e in events {
            buf.extend_from_slice(e);
            ends.push(buf.len());
        }
        (buf, ends)
    }

    /// The forwarded length expected once `pushed` bytes went in: through the last
    /// whole event.
    fn whole(ends: &[usize], pushed: usize) -> usize {
        ends.iter()
            .copied()
            .filter(|e| *e <= pushed)
            .max()
            .unwrap_or(0)
    }

    proptest! {
        #[test]
        fn whole_events_pass_through_unchanged(
            mut events in prop::collection::vec(arb_event(), 0..10),
            done: bool,
            tail in prop::option::of(arb_payload().prop_map(|p| format!("data: {p}"))),
            cuts in arb_cuts(),
        ) {
            if done {
                events.push(b"data: [DONE]\n\n".to_vec());
            }
            let (mut stream, ends) = join(&events);
            stream.extend_from_slice(tail.as_deref().unwrap_or("").as_bytes());
            let mut s = scanner();
            let (mut out, mut pushed) = (Vec::new(), 0);
            for c in chunks(&stream, &cuts) {
                pushed += c.len();
                match s.push(c) {
                    Scan::Forward(b) => out.extend_from_slice(&b),
                    other => {
                        return Err(TestCaseError::fail(format!("{other:?}")));
                    }
                }
                // Only whole events go out, and each as soon as it is complete.
                prop_assert_eq!(out.len(), whole(&ends, pushed));
            }
            out.extend_from_slice(&s.finish());
            prop_assert_eq!(out, stream);
        }

        #[test]
        fn aborts_are_found_under_any_chunking(
            mut events in prop::collection::vec(arb_event(), 0..8),
            at: Index,
            error_shape: bool,
            message in arb_text(),
            eol in arb_eol(),
            done: bool,
            cuts in arb_cuts(),
        ) {
            let abort = if error_shape {
                json!({"error": {"object": "error", "message": message, "type": "INTERNAL_SERVER_ERROR", "code": 500}})
            } else {
                json!({"text": "a", "meta_info": {"finish_reason": {"type": "abort", "message": message, "status_code": 500}}})
            };
            let k = at.index(events.len() + 1);
            events.insert(k, format!("data: {abort}{eol}{eol}").into_bytes());
            if done {
                events.push(b"data: [DONE]\n\n".to_vec());
            }
            let (stream, ends) = join(&events);
            let (abort_start, abort_end) = (if k == 0 { 0 } else { ends[k - 1] }, ends[k]);
            let mut s = scanner();
            let (mut out, mut pushed, mut found) = (Vec::new(), 0, false);
            for c in chunks(&stream, &cuts) {
                let was = pushed;
                pushed += c.len();
                match s.push(c) {
                    Scan::Forward(b) => {
                        out.extend_from_slice(&b);
                        prop_assert!(pushed < abort_end, "the abort event went through");
                        prop_assert_eq!(out.len(), whole(&ends, pushed));
                    }
                    Scan::Abort { before, abort } => {
                        let got = abort.message;
                        // Found with the chunk that completes the abort event.
                        prop_assert!(was < abort_end && abort_end <= pushed);
                        prop_assert_eq!(&got, &message);
                        out.extend_from_slice(&before);
                        prop_assert_eq!(&out[..], &stream[..abort_start]);
                        found = true;
                        break;
                    }
                    Scan::Broken { message } => {
                        return Err(TestCaseError::fail(message));
                    }
                }
            }
            prop_assert!(found, "no abort");
        }
    }
}
