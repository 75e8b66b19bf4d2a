//! Event-granular inspection of a decode's SSE stream.
//!
//! Bytes are forwarded as soon as they complete an event (`\n\n`); only the unfinished
//! tail of the last event is held back, so that an abort can be replaced by one clean
//! error event instead of following half an event. Each event's `data:` JSON is checked for
//! an SGLang abort (`finish_reason.type == "abort"`) or an `{"error": ...}` chunk, and,
//! with `return_logprob`, the prefill's input logprobs are merged into it.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::legs::{abort_in_json, may_hold_abort};
use super::logprobs::PrefillLogprobs;

/// One scanner per decode stream.
#[derive(Debug, Default)]
pub struct SseScanner {
    carry: BytesMut,
    logprobs: Option<Arc<PrefillLogprobs>>,
}

/// What a chunk held.
#[derive(Debug, PartialEq, Eq)]
pub enum Scan {
    /// Complete events to forward (possibly empty when only a tail arrived).
    Forward(Bytes),
    /// An event carried an abort or error; its message. Nothing of that event is forwarded,
    /// but the events before it are.
    Abort { before: Bytes, message: String },
}

/// The end of the last complete event in `buf` (after its `\n\n` or `\r\n\r\n`).
/// Both separators end with `\n`, so the last `\n` that closes one gives the answer; a
/// chunk of whole events ends with one, found at once.
fn event_end(buf: &[u8]) -> Option<usize> {
    memchr::memrchr_iter(b'\n', buf)
        .find(|&i| {
            let head = &buf[..=i];
            head.ends_with(b"\n\n") || head.ends_with(b"\r\n\r\n")
        })
        .map(|i| i + 1)
}

/// The length of the first event in `buf` (through its `\n\n`), else all of `buf`.
fn first_event_len(buf: &[u8]) -> usize {
    memchr::memchr_iter(b'\n', buf)
        .find(|&i| buf.get(i + 1) == Some(&b'\n'))
        .map_or(buf.len(), |i| i + 2)
}

impl SseScanner {
    pub fn new(logprobs: Option<Arc<PrefillLogprobs>>) -> SseScanner {
        SseScanner {
            carry: BytesMut::new(),
            logprobs: logprobs.filter(|l| !l.is_empty()),
        }
    }

    pub fn push(&mut self, chunk: Bytes) -> Scan {
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
                    return Scan::Forward(Bytes::new());
                }
            }
        } else {
            self.carry.extend_from_slice(&chunk);
            match event_end(&self.carry) {
                Some(end) => self.carry.split_to(end).freeze(),
                None => return Scan::Forward(Bytes::new()),
            }
        };
        self.scan_events(complete)
    }

    /// The unfinished tail at the end of the stream, forwarded as is.
    pub fn finish(&mut self) -> Bytes {
        std::mem::take(&mut self.carry).freeze()
    }

    fn scan_events(&self, complete: Bytes) -> Scan {
        // Fast path: nothing to merge, and no event of the run can hold an abort or error.
        if self.logprobs.is_none() && !may_hold_abort(&complete) {
            return Scan::Forward(complete);
        }
        let mut rebuilt: Option<Vec<u8>> = self
            .logprobs
            .as_ref()
            .map(|_| Vec::with_capacity(complete.len() + 256));
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
                if let Some(message) = abort_in_json(data) {
                    let before = match rebuilt {
                        Some(v) => Bytes::from(v),
                        None => complete.slice(..pos),
                    };
                    return Scan::Abort { before, message };
                }
            }
            if let (Some(out), Some(lp)) = (rebuilt.as_mut(), self.logprobs.as_ref()) {
                merge_event(out, event, lp);
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
    let trimmed = event.strip_suffix(b"\n\n").unwrap_or(event);
    if let Some(data) = trimmed
        .strip_prefix(b"data: ")
        .filter(|d| !d.contains(&b'\n') && *d != b"[DONE]")
    {
        if let Some(merged) = lp.merge_chunk(data) {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(&merged);
            out.extend_from_slice(b"\n\n");
            return;
        }
    }
    out.extend_from_slice(event);
}

#[cfg(test)]
mod tests {
    use super::*;

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
        ];
        for (buf, want) in ends {
            assert_eq!(event_end(buf), *want, "{:?}", String::from_utf8_lossy(buf));
        }
        let firsts: &[(&[u8], usize)] = &[
            (b"data: a\n\ndata: b\n\n", 9),
            (b"data: a\n", 8),
            (b"a\nb\n\n", 5),
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
            Scan::Abort { .. } => panic!("unexpected abort"),
        }
    }

    #[test]
    fn whole_events_pass_through_and_tails_wait() {
        let mut s = SseScanner::new(None);
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
            let mut s = SseScanner::new(None);
            match s.push(Bytes::from_static(c)) {
                Scan::Abort { before, message } => {
                    assert_eq!(&before[..], b"data: {\"text\":\"a\"}\n\n");
                    assert_eq!(message, "kv lost");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn the_words_alone_are_not_an_abort() {
        // The pre-check finds `"abort"` / `"error"` in the text; the full check does not.
        let run: &[u8] = b"data: {\"text\":\"\\\"abort\\\" \\\"error\\\"\",\"k\":\"abort\"}\n\ndata: {\"error\":null}\n\n";
        let mut s = SseScanner::new(None);
        assert_eq!(fwd(&s.push(Bytes::from_static(run))), run);
    }

    #[test]
    fn logprobs_are_merged_per_event() {
        let lp = Arc::new(PrefillLogprobs::from_prefill_body(
            br#"{"meta_info":{"input_token_logprobs":[[null,1,null]]}}"#,
        ));
        let mut s = SseScanner::new(Some(lp));
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
}
