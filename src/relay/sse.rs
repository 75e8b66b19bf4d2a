//! Event-granular inspection of a decode's SSE stream.
//!
//! Bytes are forwarded as soon as they complete an event (a blank line); only the unfinished
//! tail of the last event is held back (at most `upstream.max_answer_bytes`), so that an abort can
//! be replaced by one clean error event instead of following half an event. Each event's `data:` JSON is checked for
//! an SGLang abort (`finish_reason.type == "abort"`) or an `{"error": ...}` chunk, and,
//! with `return_logprob`, the prefill's input logprobs are merged into it. A stream that
//! can move to another decode has its tracker make that check instead
//! ([`SseScanner::leave_abort_checks`]): it reads each event anyway, and knows most of them
//! by their shape to hold no abort without searching them.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::logprobs::PrefillLogprobs;
use crate::legs::{abort_in_answer, InAnswer};
use crate::skim::may_hold_abort;

/// One scanner per decode stream.
#[derive(Debug)]
pub struct SseScanner {
    carry: BytesMut,
    logprobs: Option<Arc<PrefillLogprobs>>,
    /// The most of one unfinished event held (`upstream.max_answer_bytes`).
    limit: usize,
    /// Events are checked for aborts here; `false` once the stream's tracker checks them
    /// (see [`Self::leave_abort_checks`]).
    checks: bool,
    /// Complete events read but not merged yet: a run's merge stops once its output holds
    /// [`crate::body::SLICE_BYTES`] (see [`Self::take_held`]).
    held: Bytes,
}

/// What a chunk held.
#[derive(Debug, PartialEq, Eq)]
pub enum Scan {
    /// Complete events to forward (possibly empty when only a tail arrived).
    Forward(Bytes),
    /// An event carried an abort or error; its message. Nothing of that event is forwarded,
    /// but the events before it are.
    Abort { before: Bytes, abort: InAnswer },
    /// The unfinished event outgrew the scanner's limit: the stream is broken.
    Broken { message: String },
}

/// An event ends at a blank line: `\n\n`, `\r\n\r\n` (or the two mixed, `\n\r\n`), so
/// every ending ends with `\n`. Where the event ends when the line ending at the `\n` at `i`
/// is followed by a blank line (`\n` or `\r\n`).
fn blank_line_end(buf: &[u8], i: usize) -> Option<usize> {
    match buf.get(i + 1..) {
        Some([b'\n', ..]) => Some(i + 2),
        Some([b'\r', b'\n', ..]) => Some(i + 3),
        _ => None,
    }
}

/// The end of the last complete event in `buf`: the last `\n` that ends a blank line
/// (`\n\n` or `\n\r\n` just before it, inclusive). A chunk of whole events ends with one,
/// found at once.
fn event_end(buf: &[u8]) -> Option<usize> {
    event_end_after(buf, 0)
}

/// `event_end`, for a buffer whose first `from` bytes hold no complete event: only a `\n`
/// at `from` or later can end one (each push then scans only the new bytes).
fn event_end_after(buf: &[u8], from: usize) -> Option<usize> {
    memchr::memrchr_iter(b'\n', &buf[from..])
        .map(|i| i + from)
        .find(|&i| {
            let head = &buf[..=i];
            head.ends_with(b"\n\n") || head.ends_with(b"\n\r\n")
        })
        .map(|i| i + 1)
}

/// The length of the first event in `buf` (through its blank line), else all of `buf`.
fn first_event_len(buf: &[u8]) -> usize {
    memchr::memchr_iter(b'\n', buf)
        .find_map(|i| blank_line_end(buf, i))
        .unwrap_or(buf.len())
}

impl SseScanner {
    pub fn new(logprobs: Option<Arc<PrefillLogprobs>>, limit: usize) -> SseScanner {
        SseScanner {
            carry: BytesMut::new(),
            logprobs: logprobs.filter(|l| !l.is_empty()),
            limit,
            checks: true,
            held: Bytes::new(),
        }
    }

    /// Whether this stream's events get the prefill's input logprobs merged in.
    pub fn merges(&self) -> bool {
        self.logprobs.is_some()
    }

    /// Whether complete events wait to be merged ([`Self::take_held`]).
    pub fn holds(&self) -> bool {
        !self.held.is_empty()
    }

    /// The next slice of the held events, merged; `None` when none are held.
    ///
    /// Why: with `return_logprob` each event repeats the prompt's input logprobs, so one
    /// 4 KiB read of a decode's events can merge into megabytes (a long prompt's arrays
    /// times each event). Merged and written at once, that held the event loop, and every
    /// request on it, for milliseconds (the hostile bench's logprob bombs); merged a slice
    /// at a time, the body lets other tasks run between slices.
    pub fn take_held(&mut self) -> Option<Scan> {
        if self.held.is_empty() {
            return None;
        }
        let held = std::mem::take(&mut self.held);
        Some(self.scan_events(held))
    }

    /// The stream's tracker checks each event for an abort as it reads it (most events
    /// it has read by then; see `splice::Tracker::relay`): this scanner only cuts events.
    /// A stream whose prefill logprobs are merged here keeps its checks here.
    /// Returns whether the checks were left (the caller must then make them).
    pub fn leave_abort_checks(&mut self) -> bool {
        self.checks = self.logprobs.is_some();
        !self.checks
    }

    /// Complete events in `chunk` (after any still held), merged; an empty `chunk` hands
    /// out the next held slice, as [`Self::take_held`] does.
    pub fn push(&mut self, chunk: Bytes) -> Scan {
        if chunk.is_empty() {
            if let Some(scan) = self.take_held() {
                return scan;
            }
        }
        if !self.held.is_empty() {
            // Events still held come first: the new bytes join them (a caller that drains
            // the held events first never gets here).
            let mut all = BytesMut::from(std::mem::take(&mut self.held));
            all.extend_from_slice(&self.carry);
            all.extend_from_slice(&chunk);
            self.carry = all;
            return match event_end(&self.carry) {
                Some(end) => {
                    let complete = self.carry.split_to(end).freeze();
                    self.scan_events(complete)
                }
                None => self.waiting(),
            };
        }
        // Fast path: no tail pending and the chunk is whole events.
        let complete = if self.carry.is_empty() {
            match event_end(&chunk) {
                Some(end) if end == chunk.len() => chunk,
                Some(end) => {
                    self.carry.extend_from_slice(&chunk[end..]);
                    chunk.slice(..end)
                }
                None => {
                    self.carry.extend_from_slice(&chunk);
                    return self.waiting();
                }
            }
        } else {
            // The carry holds no complete event (its last one was split off).
            let old = self.carry.len();
            self.carry.extend_from_slice(&chunk);
            match event_end_after(&self.carry, old) {
                Some(end) => self.carry.split_to(end).freeze(),
                None => return self.waiting(),
            }
        };
        self.scan_events(complete)
    }

    /// No event completed: nothing to forward, unless the unfinished one outgrew its bound.
    fn waiting(&self) -> Scan {
        if self.carry.len() > self.limit {
            return Scan::Broken {
                message: format!(
                    "decode sent {} bytes of one SSE event without ending it (limit {} bytes)",
                    self.carry.len(),
                    self.limit
                ),
            };
        }
        Scan::Forward(Bytes::new())
    }

    /// The unfinished tail at the end of the stream, forwarded as is (after the held
    /// events: drain [`Self::take_held`] first).
    pub fn finish(&mut self) -> Bytes {
        std::mem::take(&mut self.carry).freeze()
    }

    fn scan_events(&mut self, complete: Bytes) -> Scan {
        // Fast path: nothing to merge, and no event of the run can hold an abort or error.
        if self.logprobs.is_none() && (!self.checks || !may_hold_abort(&complete)) {
            return Scan::Forward(complete);
        }
        // Sized for the data lines the merge writes, with the arrays merged in: every line of
        // the run up to the one that fills a slice (the rest is held). A buffer that grew by
        // doubling copied megabytes again at each step.
        let mut rebuilt: Option<Vec<u8>> = self.logprobs.as_ref().map(|lp| {
            let per = lp.bytes() + 256;
            let lines = memchr::memmem::find_iter(&complete, b"data:").count();
            let lines = lines.clamp(1, crate::body::SLICE_BYTES / per + 1);
            Vec::with_capacity(complete.len() + lines * per)
        });
        let mut pos = 0;
        let buf = &complete[..];
        while pos < buf.len() {
            let rest = &buf[pos..];
            let len = first_event_len(rest);
            let event = &rest[..len];
            let mut start = 0;
            let ends = memchr::memchr_iter(b'\n', event).chain(std::iter::once(event.len()));
            for end in ends {
                let line = &event[start..end];
                start = end + 1;
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                let Some(data) = line.strip_prefix(b"data:") else {
                    continue;
                };
                let data = data.strip_prefix(b" ").unwrap_or(data);
                if data == b"[DONE]" {
                    continue;
                }
                if let Some(abort) = abort_in_answer(data) {
                    let before = match rebuilt {
                        Some(v) => Bytes::from(v),
                        None => complete.slice(..pos),
                    };
                    return Scan::Abort { before, abort };
                }
            }
            if let (Some(out), Some(lp)) = (rebuilt.as_mut(), self.logprobs.as_ref()) {
                merge_event(out, event, lp);
                if out.len() >= crate::body::SLICE_BYTES && pos + len < buf.len() {
                    self.held = complete.slice(pos + len..);
                    break;
                }
            }
            pos += len;
        }
        Scan::Forward(match rebuilt {
            Some(v) => Bytes::from(v),
            None => complete,
        })
    }
}

fn merge_event(out: &mut Vec<u8>, event: &[u8], lp: &PrefillLogprobs) {
    // Extra blank lines before an event (`\n\n\n`) belong to it or stand alone depending
    // on how the stream was read: passed on as they are, so that the event is merged either
    // way (found by fuzzing).
    let lead = event
        .iter()
        .take_while(|b| matches!(b, b'\r' | b'\n'))
        .count();
    out.extend_from_slice(&event[..lead]);
    let event = &event[lead..];
    let trimmed = [&b"\r\n\r\n"[..], b"\n\r\n", b"\n\n"]
        .iter()
        .find_map(|end| event.strip_suffix(*end))
        .unwrap_or(event);
    if let Some(data) = trimmed
        .strip_prefix(b"data: ")
        .filter(|d| !d.contains(&b'\n') && *d != b"[DONE]")
    {
        // Spliced straight into the output (no tree, no buffer per event).
        let at = out.len();
        out.extend_from_slice(b"data: ");
        if lp.merge_chunk_into(data, out) {
            out.extend_from_slice(b"\n\n");
            return;
        }
        out.truncate(at);
    }
    out.extend_from_slice(event);
}

#[cfg(test)]
mod tests {
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
        let abort = "data: {\"meta_info\":{\"finish_reason\":{\"type\":\"abort\",\"message\":\"gone\"}}}\n\n";
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
            let openai_reason =
                prop::sample::select(vec![Value::Null, json!("stop"), json!("length")]);
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
                (arb_text(), arb_value())
                    .prop_map(|(t, v)| json!({"error": null, "text": t, "v": v})),
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
}
