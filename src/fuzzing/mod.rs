//! Fuzz entry points: one function per parser that reads bytes from clients or engines.
//!
//! Why here: the fuzz targets (`fuzz/fuzz_targets/*.rs`, cargo-fuzz's layout, a crate of
//! their own so that a stable `cargo test` never builds libFuzzer) and the replay of the
//! committed corpus (`tests/it/fuzz_corpus.rs`, an ordinary test) both call these
//! functions, so the two cannot drift apart, and each drives the production parser itself
//! (no copy of it), through its public API.
//!
//! Each entry point takes arbitrary bytes (the first byte or two often pick a route, a
//! mode or how the input is cut) and panics only when an invariant breaks:
//! - a panic inside a parser is a bug (input never panics pdgate);
//! - the cheap invariants below hold, checked where they cost little (a parsed request's
//!   legs parse again to the same members; SSE comes out the same however it is cut;
//!   framing never yields more body bytes than the engine sent; a selector prints to what
//!   it parses from).
//!
//! Not on the request path: nothing in the router calls this module.

mod loopback;

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use crate::auth;
use crate::discovery::selector;
use crate::engine::ServerInfo;
use crate::health::{self, capacity, load};
use crate::legs;
use crate::relay::logprobs::PrefillLogprobs;
use crate::relay::splice::{GenerateMode, Tracker};
use crate::relay::sse::{Scan, SseScanner};
use crate::request::continuation;
use crate::request::{self, ApiRoute, LegFields, ParsedRequest};
use crate::types::Role;

pub use loopback::{bootstrap, leg_answer};

/// A fuzz entry point.
pub type Target = fn(&[u8]);

/// Every target by name: the name of its `fuzz/fuzz_targets/<name>.rs` and of its corpus
/// folder `fuzz/corpus/<name>/`.
pub const TARGETS: [(&str, Target); 8] = [
    ("request", request),
    ("leg_answer", leg_answer),
    ("sse", sse),
    ("splice", splice),
    ("bootstrap", bootstrap),
    ("engine_json", engine_json),
    ("selector", selector),
    ("keys_file", keys_file),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

const ROUTES: [ApiRoute; 3] = [
    ApiRoute::Generate,
    ApiRoute::ChatCompletions,
    ApiRoute::Completions,
];

/// The first byte picks a route, the rest is the body: a client request
/// (`request::parse`). A request that parses is written as both legs, and each leg
/// must parse again with the same members in the same order, the same shape (stream,
/// batch, n) and pdgate's own fields in place of any the client sent; the affinity key,
/// size estimate and continuation plan are computed (they read the body again).
pub fn request(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let route = ROUTES[usize::from(sel % 3)];
    let Ok(req) = request::parse(route, Bytes::copy_from_slice(body)) else {
        return;
    };
    let _ = req.prefix_hash();
    let _ = req.kv_tokens_estimate();
    let _ = req.prompt_size();
    let _ = continuation::plan(&req);
    let rooms: Vec<u64> = (0..req.instances() as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let p = LegFields {
        host_json: "\"10.0.0.1\"",
        port: 8998,
        rooms: &rooms,
        rid: "fuzz-prefill",
        routed_dp_rank: Some(3),
        disagg_prefill_dp_rank: None,
        stream: false,
    };
    let d = LegFields {
        rid: "fuzz-decode",
        routed_dp_rank: None,
        disagg_prefill_dp_rank: Some(3),
        stream: req.stream,
        ..p
    };
    let (pb, db) = req.write_legs(&p, &d);
    let (pb, db) = (pb.to_vec(), db.to_vec());
    let mut one = Vec::new();
    req.write_leg(&mut one, &d);
    assert_eq!(one, db, "write_leg and write_legs disagree");
    for (leg, fields) in [(pb, &p), (db, &d)] {
        let again = match request::parse(route, Bytes::from(leg.clone())) {
            Ok(r) => r,
            Err(e) => panic!(
                "a leg does not parse again ({}): {}",
                e.message,
                String::from_utf8_lossy(&leg)
            ),
        };
        same_members(&req, &again);
        assert_eq!(again.stream, fields.stream, "leg stream");
        assert_eq!((again.batch, again.n), (req.batch, req.n), "leg shape");
        for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room", "rid"] {
            assert!(again.replaced.contains(&k), "leg without {k}");
        }
    }
}

fn same_members(a: &ParsedRequest, b: &ParsedRequest) {
    let (ma, mb): (Vec<_>, Vec<_>) = (a.members().collect(), b.members().collect());
    assert_eq!(ma, mb, "a leg changed the client's members");
}

/// The prefill answer whose input logprobs the `sse` and `engine_json` targets merge.
const PREFILL_LOGPROBS: &[u8] = br#"{"text":"","meta_info":{"input_token_logprobs":[[-0.5,1,null],[-1.25,2,null]],"input_top_logprobs":[null,[[-0.5,1,null]]]}}"#;

/// Limit of one unfinished SSE event in the `sse` target (small, so that it is reached).
const SSE_LIMIT: usize = 2048;

/// What a decode stream became.
#[derive(Debug, PartialEq, Eq)]
enum Scanned {
    /// Everything forwarded, the unfinished tail included.
    Ended(Vec<u8>),
    /// Forwarded up to an abort, and the abort's message and status.
    Aborted(Vec<u8>, String, Option<u16>),
    Broken,
}

fn scan<'a>(lp: Option<Arc<PrefillLogprobs>>, chunks: impl Iterator<Item = &'a [u8]>) -> Scanned {
    let mut s = SseScanner::new(lp, SSE_LIMIT);
    let mut out = Vec::new();
    for c in chunks {
        match s.push(Bytes::copy_from_slice(c)) {
            Scan::Forward(b) => {
                assert!(
                    b.is_empty() || b.ends_with(b"\n\n") || b.ends_with(b"\n\r\n"),
                    "forwarded part of an event: {:?}",
                    String::from_utf8_lossy(&b)
                );
                out.extend_from_slice(&b);
            }
            Scan::Abort { before, abort } => {
                out.extend_from_slice(&before);
                return Scanned::Aborted(out, abort.message, abort.status);
            }
            Scan::Broken { .. } => return Scanned::Broken,
        }
    }
    out.extend_from_slice(&s.finish());
    Scanned::Ended(out)
}

/// A decode's SSE stream through `relay::sse::SseScanner`: the first byte says whether the
/// prefill's logprobs are merged (bit 0) and the size of the pieces the stream is cut into
/// (the rest). The stream pushed whole and pushed in pieces must give the same bytes and
/// the same abort (unless one broke on the event size limit); without logprobs and
/// without an abort, the bytes out are the bytes in.
pub fn sse(data: &[u8]) {
    let Some((&sel, stream)) = data.split_first() else {
        return;
    };
    let lp = (sel & 1 == 1).then(|| {
        Arc::new(PrefillLogprobs::from_prefill_body(
            &Bytes::from_static(PREFILL_LOGPROBS),
            crate::memory::Charge::none(),
        ))
    });
    let cut = usize::from(sel >> 1) + 1;
    let whole = scan(lp.clone(), std::iter::once(stream));
    let pieces = scan(lp.clone(), stream.chunks(cut));
    if whole == Scanned::Broken || pieces == Scanned::Broken {
        return;
    }
    match (&whole, &pieces) {
        // Where a run of blank lines ends an event and the next begins is not one place
        // (`\n\n\n` is an event's end and an empty line): the events before an abort may
        // end with one newline more or less, which no SSE client sees.
        (Scanned::Aborted(a, ma, sa), Scanned::Aborted(b, mb, sb)) => {
            let trim = |v: &[u8]| v.trim_ascii_end().len();
            assert_eq!(
                (trim(a), ma, sa),
                (trim(b), mb, sb),
                "the cut changed the abort"
            );
            assert_eq!(
                a[..trim(a)],
                b[..trim(b)],
                "the cut changed the events before an abort"
            );
        }
        _ => assert_eq!(whole, pieces, "the stream's cut changed what was forwarded"),
    }
    if let (None, Scanned::Ended(out)) = (&lp, &whole) {
        assert_eq!(out.as_slice(), stream, "bytes changed on the way through");
    }
}

/// Whole SSE events of `stream`, in the runs a scanner forwards them in when the stream
/// arrives in pieces of `cut` bytes (what the relay hands the continuation tracker).
fn runs(stream: &[u8], cut: usize) -> Vec<Bytes> {
    let mut s = SseScanner::new(None, usize::MAX);
    let mut out = Vec::new();
    for c in stream.chunks(cut) {
        match s.push(Bytes::copy_from_slice(c)) {
            Scan::Forward(b) if !b.is_empty() => out.push(b),
            Scan::Forward(_) => {}
            Scan::Abort { before, .. } => {
                out.push(before);
                return out;
            }
            Scan::Broken { .. } => return out,
        }
    }
    out
}

/// Events in a run of whole events (blank lines).
fn event_count(run: &[u8]) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < run.len() {
        let rest = &run[i..];
        let len = memchr::memchr_iter(b'\n', rest)
            .find_map(|j| match rest.get(j + 1..) {
                Some([b'\n', ..]) => Some(j + 2),
                Some([b'\r', b'\n', ..]) => Some(j + 3),
                _ => None,
            })
            .unwrap_or(rest.len());
        n += 1;
        i += len;
    }
    n
}

/// A continuable stream (`request::continuation`, `relay::splice`): `[selector] request \0
/// stream`. The selector picks the route (`% 3`), the engine's `/generate` mode (bit 2)
/// and the piece size of the stream (the rest). A request that can be continued relays
/// the stream, builds the follow-up from what was sent, which must parse as a request
/// again, then relays the stream once more as the continued segment; a relay never gives
/// more events than it was given.
pub fn splice(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let route = ROUTES[usize::from(sel % 3)];
    let mode = if sel & 4 == 0 {
        GenerateMode::Cumulative
    } else {
        GenerateMode::Incremental
    };
    let cut = usize::from(sel >> 3) * 8 + 1;
    let split = memchr::memchr(0, rest).unwrap_or(rest.len());
    let (body, stream) = (&rest[..split], rest.get(split + 1..).unwrap_or_default());
    let Ok(req) = request::parse(route, Bytes::copy_from_slice(body)) else {
        return;
    };
    let Ok(plan) = continuation::plan(&req) else {
        return;
    };
    let mut tracker = Tracker::new(plan.clone(), mode);
    // As in flight: the tracker checks events for aborts (a run stops at one).
    tracker.check_aborts();
    let runs = runs(stream, cut);
    for r in &runs {
        let out = match tracker.relay(r.clone()) {
            Ok(out) => out,
            Err(a) => a.before,
        };
        assert!(event_count(&out) <= event_count(r), "the relay made events");
    }
    let Ok(sent) = tracker.sent() else {
        return;
    };
    let Ok(follow) = continuation::follow_up(&req, &plan, &sent) else {
        return;
    };
    if let Err(e) = request::parse(route, follow.clone()) {
        panic!(
            "the follow-up does not parse ({}): {}",
            e.message,
            String::from_utf8_lossy(&follow)
        );
    }
    tracker.next_segment(sent);
    tracker.set_source_mode(GenerateMode::Incremental);
    for r in &runs {
        let out = match tracker.relay(r.clone()) {
            Ok(out) => out,
            Err(a) => a.before,
        };
        assert!(event_count(&out) <= event_count(r), "the relay made events");
    }
    let _ = tracker.sent();
}

/// Engine answers read off the request path, by the first byte: a load report
/// (`health::load`, `health::capacity`), server info (`engine::ServerInfo` and its
/// admission), a prefill's answer with logprobs merged into a decode's (`relay::logprobs`),
/// and an error or abort body (`legs`).
pub fn engine_json(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    match sel % 4 {
        0 => {
            if let Some(report) = load::parse(body) {
                let dp = usize::from(sel >> 2) + 1;
                assert_eq!(load::per_rank(&report, dp).len(), dp);
            }
            let _ = capacity::parse(body);
        }
        1 => {
            if let Ok(info) = serde_json::from_slice::<ServerInfo>(body) {
                for role in [Role::Prefill, Role::Decode] {
                    if let Ok(Some(dp)) = health::admit_info(role, &info) {
                        assert!((1..=crate::engine::MAX_DP_SIZE).contains(&dp));
                    }
                }
            }
        }
        2 => {
            let lp = PrefillLogprobs::from_prefill_body(
                &Bytes::copy_from_slice(body),
                crate::memory::Charge::none(),
            );
            let _ = lp.is_empty();
            let from = PrefillLogprobs::from_prefill_body(
                &Bytes::from_static(PREFILL_LOGPROBS),
                crate::memory::Charge::none(),
            );
            // JSON's grammar, not serde_json's number range: `1E999` is JSON that a
            // `Value` refuses (it overflows f64), and a merge copies such a number through
            // as the engine wrote it.
            let is_json = |b: &[u8]| serde_json::from_slice::<serde::de::IgnoredAny>(b).is_ok();
            for merged in [from.merge_answer(body), from.merge_chunk(body)]
                .into_iter()
                .flatten()
            {
                assert!(is_json(&merged), "a merge wrote invalid JSON");
            }
        }
        _ => {
            let _ = legs::abort_in_answer(body);
            let _ = legs::error_message(body);
            for status in [400, 500, 503] {
                let s = http::StatusCode::from_u16(status).unwrap_or_default();
                let _ = legs::status_failure(Role::Decode, s, body);
            }
        }
    }
}

/// A Kubernetes label selector (`discovery::selector::parse`): one that parses prints to a
/// string that parses to the same selector, and matches a label set without panicking.
pub fn selector(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(sel) = selector::parse(s) else {
        return;
    };
    let printed = sel.to_string();
    match selector::parse(&printed) {
        Ok(again) => assert_eq!(again, sel, "{s:?} printed as {printed:?}"),
        Err(e) => panic!("{s:?} printed as {printed:?}, which does not parse: {e}"),
    }
    let labels: BTreeMap<String, String> = [("app", "sglang"), ("role", "decode"), ("n", "3")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let _ = sel.matches(&labels);
}

/// The client keys file (`auth.api_keys_file`, `auth::parse_keys`): what parses gives at
/// most one key per line, no digest twice, each id a valid name or `line-N`, and every raw
/// key is known by its SHA-256.
pub fn keys_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(keys) = auth::parse_keys(text) else {
        return;
    };
    assert!(keys.len() <= text.lines().count(), "more keys than lines");
    let digests: std::collections::HashSet<_> = keys.iter().map(|k| k.digest).collect();
    assert_eq!(digests.len(), keys.len(), "a digest twice");
    for k in &keys {
        let id: &str = &k.id;
        let line = id
            .strip_prefix("line-")
            .and_then(|n| n.parse::<usize>().ok());
        let named = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
        assert!(line.is_some() || named, "bad key id {id:?}");
    }
    for line in text.lines() {
        let words: Vec<&str> = line
            .split_whitespace()
            .take_while(|w| !w.starts_with('#'))
            .collect();
        if let Some(key) = words.last().filter(|k| !k.starts_with("sha256:")) {
            assert!(
                digests.contains(&auth::digest(key.as_bytes())),
                "a key was lost"
            );
        }
    }
}
