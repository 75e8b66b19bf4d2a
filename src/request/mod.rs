//! Reading a client request: only the top-level JSON object is parsed, and only the keys
//! pdgate touches are looked at; every other value is kept as the exact bytes the client
//! sent and forwarded byte-for-byte.
//!
//! Invariants:
//! - A [`ParsedRequest`] exists only for a body that is valid UTF-8 JSON whose top level is
//!   an object with a prompt of the right shape for its route; anything else is a 400 that
//!   is decided before any leg is sent.
//! - Client-supplied PD fields (bootstrap host/port/room, DP ranks, rid) are dropped here
//!   and never reach an engine; pdgate writes its own in [`ParsedRequest::write_leg`].

use std::borrow::Cow;
use std::ops::Range;
use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::value::RawValue;

use crate::types::fnv1a;
use crate::upstream::Payload;

/// The generation routes pdgate dispatches as PD requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApiRoute {
    Generate,
    ChatCompletions,
    Completions,
}

impl ApiRoute {
    pub fn path(self) -> &'static str {
        match self {
            ApiRoute::Generate => "/generate",
            ApiRoute::ChatCompletions => "/v1/chat/completions",
            ApiRoute::Completions => "/v1/completions",
        }
    }
    pub const fn label(self) -> &'static str {
        match self {
            ApiRoute::Generate => "generate",
            ApiRoute::ChatCompletions => "chat_completions",
            ApiRoute::Completions => "completions",
        }
    }
}

/// Keys pdgate owns on the legs; a client's values for them are dropped.
pub const PD_KEYS: [&str; 7] = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "rid",
];

/// Largest `n` accepted (parallel samples per prompt).
pub const MAX_N: u64 = 1024;
/// Largest number of instances (prompts × samples) in one request.
pub const MAX_INSTANCES: usize = 65_536;

/// A top-level member kept verbatim.
#[derive(Debug)]
struct Field {
    /// The key, JSON-escaped and quoted, ready to write.
    key_json: KeyJson,
    /// Byte range of the raw value inside the body.
    value: Range<usize>,
}

/// A key as JSON: its quoted span in the body when it has no escapes (the usual case, no
/// allocation), else re-escaped.
#[derive(Debug)]
enum KeyJson {
    Span(Range<usize>),
    Escaped(Box<str>),
}

/// A validated client request.
#[derive(Debug)]
pub struct ParsedRequest {
    body: Bytes,
    fields: Vec<Field>,
    pub route: ApiRoute,
    pub stream: bool,
    /// Number of prompts when the prompt is a batch; `None` for a single prompt.
    pub batch: Option<usize>,
    /// Samples per prompt (`n`).
    pub n: u32,
    /// `/generate` with `return_logprob`: the prefill's input logprobs are merged.
    pub return_logprob: bool,
    /// PD keys the client sent that pdgate replaced (for the log).
    pub replaced: Vec<&'static str>,
    /// Byte range of the prompt's raw JSON value (`text`, `input_ids`, `input_embeds`,
    /// `prompt` or `messages`).
    prompt: Option<Range<usize>>,
    prefix_hash: OnceLock<Option<u64>>,
    /// The client's routing key, hashed (`request::RoutingKeys`, read from the headers at
    /// the front door): when set, it is the request's affinity key instead of the prompt's.
    pub routing_key: Option<u64>,
    /// Top-level members the legs carry instead of the client's (`stream_options` on a
    /// continuable OpenAI stream, see `request::continuation`; `model` when the client named an
    /// alias, see `crate::models::leg_name`). Empty (no allocation) on most requests.
    leg_overrides: Vec<(&'static str, Box<str>)>,
    /// Byte range of the top-level `model` string (its raw JSON, quotes included). Kept on
    /// OpenAI legs; SGLang's `/generate` has no such field, so it is not sent there.
    model: Option<Range<usize>>,
    /// The model the request was resolved to (`crate::models::resolve`): `None` while one
    /// handoff group serves everything (any worker may take it).
    pub scope: Option<std::sync::Arc<str>>,
}

/// How many bytes of a prompt's raw JSON form its affinity key.
pub const PREFIX_KEY_BYTES: usize = 256;

impl ParsedRequest {
    /// Prompt instances (prompts × samples): the number of rooms one attempt needs.
    pub fn instances(&self) -> usize {
        self.batch.unwrap_or(1) * self.n as usize
    }

    /// The key the request's picks are placed by: the client's routing key when it sent
    /// one, else the prompt's [`Self::prefix_hash`].
    pub fn affinity_key(&self) -> Option<u64> {
        self.routing_key.or_else(|| self.prefix_hash())
    }

    /// The prompt's affinity key, computed once on first use: for chat, the messages up to
    /// and including the first user message (stable across the turns of a conversation);
    /// otherwise the first [`PREFIX_KEY_BYTES`] bytes of the prompt's raw JSON.
    pub fn prefix_hash(&self) -> Option<u64> {
        *self.prefix_hash.get_or_init(|| {
            let raw = &self.body[self.prompt.clone()?];
            if self.route == ApiRoute::ChatCompletions {
                #[derive(serde::Deserialize)]
                struct Msg<'a> {
                    #[serde(borrow, default)]
                    role: Option<Cow<'a, str>>,
                }
                let items: Vec<&RawValue> = serde_json::from_slice(raw).ok()?;
                let end = items
                    .iter()
                    .position(|m| {
                        serde_json::from_str::<Msg<'_>>(m.get())
                            .ok()
                            .and_then(|m| m.role)
                            .as_deref()
                            == Some("user")
                    })
                    .unwrap_or(0);
                let mut h = Vec::new();
                for m in &items[..=end.min(items.len().saturating_sub(1))] {
                    h.extend_from_slice(m.get().as_bytes());
                    h.push(0);
                }
                return Some(fnv1a(&h));
            }
            Some(fnv1a(&raw[..raw.len().min(PREFIX_KEY_BYTES)]))
        })
    }

    /// The `model` the client named, unescaped (borrowed unless it had escapes).
    pub fn model(&self) -> Option<Cow<'_, str>> {
        let raw = self.raw(self.model.clone()?);
        match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
            Some(inner) if !inner.contains('\\') => Some(Cow::Borrowed(inner)),
            _ => serde_json::from_str::<String>(raw).ok().map(Cow::Owned),
        }
    }

    /// The request's size for stall detection: the byte length of the prompt's raw JSON
    /// (text, ids or messages; no tokenizer on the request path), at least 1.
    pub fn prompt_size(&self) -> u32 {
        self.prompt
            .as_ref()
            .map_or(1, |r| r.len().clamp(1, u32::MAX as usize) as u32)
    }

    /// The client's top-level members in order: the key (unescaped) and its raw JSON value.
    /// PD keys and `stream` are not among them.
    pub fn members(&self) -> impl Iterator<Item = (Cow<'_, str>, &str)> + '_ {
        self.fields
            .iter()
            .map(|f| (self.key_of(f), self.raw(f.value.clone())))
    }

    fn key_of(&self, f: &Field) -> Cow<'_, str> {
        match &f.key_json {
            KeyJson::Span(r) => Cow::Borrowed(self.raw(r.start + 1..r.end - 1)),
            KeyJson::Escaped(k) => {
                Cow::Owned(serde_json::from_str::<String>(k).unwrap_or_default())
            }
        }
    }

    fn raw(&self, r: Range<usize>) -> &str {
        // The body was checked to be UTF-8 and every range sits on JSON token bounds.
        std::str::from_utf8(&self.body[r]).unwrap_or("null")
    }

    /// The legs carry `raw` as the value of `key` instead of the client's member (added
    /// when the client had none). The client's value stays readable in [`Self::members`].
    pub fn override_on_legs(&mut self, key: &'static str, raw: String) {
        let raw = raw.into_boxed_str();
        match self.leg_overrides.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = raw,
            None => self.leg_overrides.push((key, raw)),
        }
    }

    /// A follow-up of `first` (a moved stream's continuation) goes where `first` went and
    /// carries what `first`'s legs carried instead of the client's members.
    pub fn follow(&mut self, first: &ParsedRequest) {
        self.scope = first.scope.clone();
        self.routing_key = first.routing_key;
        self.leg_overrides = first.leg_overrides.clone();
    }

    /// Whether the bootstrap fields go as lists (one entry per instance).
    pub fn is_multi(&self) -> bool {
        self.batch.is_some() || self.n > 1
    }

    /// Writes one leg's body: every untouched member verbatim, then pdgate's own fields
    /// (the bytes [`Self::write_legs`] writes for that leg, in one buffer).
    pub fn write_leg(&self, out: &mut Vec<u8>, leg: &LegFields<'_>) {
        let mut p = self.member_pieces();
        push_fields(&mut p, leg, self);
        out.clear();
        out.extend_from_slice(&p.to_vec());
    }

    /// The leg overrides `applies` selects, as `"key":value,` members.
    fn push_overrides(&self, out: &mut Vec<u8>, applies: impl Fn(&str) -> bool) {
        for (k, v) in self.leg_overrides.iter().filter(|(k, _)| applies(k)) {
            push_key(out, k);
            out.extend_from_slice(v.as_bytes());
            out.push(b',');
        }
    }

    /// Both legs' bodies, as pieces of the client's body (never copied: both point into
    /// the one allocation the request holds) and a small tail of pdgate's own fields each.
    pub fn write_legs(&self, p: &LegFields<'_>, d: &LegFields<'_>) -> (Payload, Payload) {
        let mut pb = self.member_pieces();
        let mut db = pb.clone();
        push_fields(&mut pb, p, self);
        push_fields(&mut db, d, self);
        (pb, db)
    }

    /// `{` and the client's members, as ranges of the body: a run of members that follow
    /// each other in the body (nothing dropped between) is one range, whitespace and all.
    fn member_pieces(&self) -> Payload {
        self.pieces_skipping(|_| true)
    }

    /// `{` and the client's members but those the leg overrides that `applies` selects
    /// replace (see [`Self::member_pieces`]; the caller writes those overrides).
    fn pieces_skipping(&self, applies: impl Fn(&str) -> bool) -> Payload {
        let mut out = Payload::over(self.body.clone());
        let body = &self.body[..];
        // Where the last member written ends in the body.
        let mut prev_end: Option<usize> = None;
        for f in &self.fields {
            if !self.leg_overrides.is_empty() {
                let key = self.key_of(f);
                if self
                    .leg_overrides
                    .iter()
                    .any(|(k, _)| key == *k && applies(k))
                {
                    continue;
                }
            }
            match &f.key_json {
                KeyJson::Span(r) => {
                    // The bytes before the key: `{` (first member) or `,` (members that
                    // follow each other), with whitespace; else a separator is written.
                    let gap = &body[prev_end.unwrap_or(0)..r.start];
                    let joins = gap.trim_ascii() == if prev_end.is_some() { b"," } else { b"{" };
                    let from = if joins {
                        prev_end.unwrap_or(0)
                    } else {
                        out.push_lit(if prev_end.is_some() { b"," } else { b"{" });
                        r.start
                    };
                    out.push_src(from..f.value.end);
                }
                KeyJson::Escaped(k) => {
                    out.push_lit(if prev_end.is_some() { b"," } else { b"{" });
                    out.push_own(k.as_bytes());
                    out.push_lit(b":");
                    out.push_src(f.value.clone());
                }
            }
            prev_end = Some(f.value.end);
        }
        if prev_end.is_none() {
            out.push_lit(b"{");
        } else {
            out.push_lit(b",");
        }
        out
    }
}

/// The bytes of a leg's own members but the host, rid, rooms and overrides: keys, quotes,
/// separators, a port, two DP ranks, `stream` and the closing brace.
const LEG_FIELDS_BYTES: usize = 128;
/// A room in a batch's lists: up to 20 digits, its port and separators.
const ROOM_BYTES: usize = 32;

/// pdgate's part of a leg, after the client's members: the override, the bootstrap host,
/// port and room(s), then what differs between the legs.
fn push_fields(out: &mut Payload, leg: &LegFields<'_>, req: &ParsedRequest) {
    out.own(|out| {
        // One allocation for what follows (a growing vector would reallocate five or six
        // times for ~200 bytes): the fixed members, the host, a room per request, the rid.
        out.reserve(
            LEG_FIELDS_BYTES
                + leg.host_json.len()
                + leg.rid.len()
                + leg.rooms.len() * (ROOM_BYTES + leg.host_json.len())
                + req
                    .leg_overrides
                    .iter()
                    .map(|(k, v)| k.len() + v.len() + 4)
                    .sum::<usize>(),
        );
        req.push_overrides(out, |_| true);
        let multi = req.is_multi();
        push_key(out, "bootstrap_host");
        list_or_scalar(out, multi, leg.rooms.len(), |o| {
            o.extend_from_slice(leg.host_json.as_bytes())
        });
        push_key(out, ",bootstrap_port");
        list_or_scalar(out, multi, leg.rooms.len(), |o| {
            push_u64(o, u64::from(leg.port))
        });
        push_key(out, ",bootstrap_room");
        if multi {
            out.push(b'[');
            for (i, r) in leg.rooms.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                push_u64(out, *r);
            }
            out.push(b']');
        } else {
            push_u64(out, leg.rooms.first().copied().unwrap_or(0));
        }
        write_own(out, leg);
    });
}

/// What differs between the legs: rid, DP fields, stream, and the closing brace.
fn write_own(out: &mut Vec<u8>, leg: &LegFields<'_>) {
    push_key(out, ",rid");
    out.push(b'"');
    out.extend_from_slice(leg.rid.as_bytes());
    out.push(b'"');
    if let Some(r) = leg.routed_dp_rank {
        push_key(out, ",routed_dp_rank");
        push_u64(out, u64::from(r));
    }
    if let Some(r) = leg.disagg_prefill_dp_rank {
        push_key(out, ",disagg_prefill_dp_rank");
        push_u64(out, u64::from(r));
    }
    push_key(out, ",stream");
    out.extend_from_slice(if leg.stream { b"true" } else { b"false" });
    out.push(b'}');
}

/// What pdgate writes on a leg.
#[derive(Debug)]
pub struct LegFields<'a> {
    /// The bootstrap host as a JSON string literal (quoted, escaped).
    pub host_json: &'a str,
    pub port: u16,
    pub rooms: &'a [u64],
    /// A rid made of `[A-Za-z0-9-]` only.
    pub rid: &'a str,
    pub routed_dp_rank: Option<u32>,
    pub disagg_prefill_dp_rank: Option<u32>,
    pub stream: bool,
}

fn push_key(out: &mut Vec<u8>, key_with_optional_comma: &str) {
    let (comma, key) = match key_with_optional_comma.strip_prefix(',') {
        Some(k) => (true, k),
        None => (false, key_with_optional_comma),
    };
    if comma {
        out.push(b',');
    }
    out.push(b'"');
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
}

fn push_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

fn list_or_scalar(out: &mut Vec<u8>, multi: bool, len: usize, mut item: impl FnMut(&mut Vec<u8>)) {
    if multi {
        out.push(b'[');
        for i in 0..len {
            if i > 0 {
                out.push(b',');
            }
            item(out);
        }
        out.push(b']');
    } else {
        item(out);
    }
}

pub use key::{RoutingKeys, MAX_KEY_BYTES};
pub use parse::parse;

pub mod continuation;
mod key;
mod parse;
mod plain;
pub mod record;
mod size;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
