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
mod tests;
