//! What a continuable stream has sent the client, and the splice of a continued stream onto
//! it, so that the client sees one answer.
//!
//! Before a move (segment 0) the relay hands each run of whole events to [`Tracker::relay`]:
//! - `/generate` in SGLang's default cumulative mode: nothing is parsed; the last data
//!   event (a zero-copy slice) already holds the whole answer so far, and is parsed only
//!   when a move needs it;
//! - `/generate` in incremental mode (`--incremental-streaming-output`): each event's few
//!   fields (text, ids, engine-reported completion tokens, finish reason) are read;
//! - the OpenAI routes: the per-chunk usage pdgate asked the decode for is cut out of what
//!   the client gets unless it asked for it (and its final usage chunk dropped unless it
//!   asked for that). The account of each event (text, completion tokens, finish reason,
//!   tool calls, reasoning) is deferred: the stream's first [`LAZY_BYTES`] of events are
//!   kept and read only if a move or a failure needs them, so a short answer that ends
//!   well is never read past its usage; past that, events are read as they pass
//!   (most from the stream's shape, [`skim::ShapeCache`]). An event is cut from the usage
//!   member found at its end ([`skim::tail`]), a usage chunk shown or dropped as the
//!   client asked; an event that does not end with usage is read whole at once, as are
//!   the events kept before it.
//!
//! After a move (segment 1, 2, ...) each event of the continued stream is rewritten: its
//! counts are the sums over segments (`prompt_tokens` the original's), its ids the first
//! segment's, its cumulative `text`/`output_ids` prefixed with what earlier segments sent,
//! and the continuation's own role chunk dropped. Counts are only ever the engine's.
//!
//! Once the SSE scanner leaves them to it, the tracker also checks each event for an abort
//! or an error chunk before accounting it ([`Tracker::relay`] stops at one): an event that
//! matches the stream's shape holds neither word unless its template or its whole text does
//! ([`skim::Token::abort_free`]), so most events are not searched at all.
//!
//! Invariants: bytes pass unchanged unless a rewrite is needed; one event in gives at most
//! one event out; `[DONE]` and comments pass as they are; an abort is never accounted.

use bytes::Bytes;
use serde_json::Value;

use crate::legs::{abort_in_answer, InAnswer};
use crate::request::continuation::{Plan, Sent};
use crate::request::ApiRoute;
use crate::skim;

mod chunk;
mod events;
use chunk::{choices, count, cut_member, cut_range, note, push_event, GenChunk, Replace};
use events::{events, payload_with};

/// How an engine streams `/generate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenerateMode {
    /// SGLang's default: each event holds the whole text and ids so far.
    Cumulative,
    /// `--incremental-streaming-output`: each event holds only what is new.
    Incremental,
}

/// Why a stream can no longer be continued, seen in the stream itself.
pub type Stop = &'static str;

/// The [`Stop`] of an answer that finished (a finish reason was relayed).
const COMPLETE: Stop = "the answer was complete";

/// Why a stream whose engine did not count the tokens it sent is not continued.
pub const UNCOUNTED: &str =
    "the engine reported no completion tokens for what was sent (no per-chunk usage), so a follow-up's limit could overshoot the client's";

/// The most bytes of events an OpenAI stream keeps unread before a move (see the module
/// docs): about a dozen chunks, so that short answers skip their account.
pub const LAZY_BYTES: usize = 4 * 1024;

/// One continuable stream's account (see the module docs).
#[derive(Debug)]
pub struct Tracker {
    plan: Plan,
    /// How the client's `/generate` stream goes (the first decode's mode).
    client_mode: GenerateMode,
    /// How the current segment's decode streams.
    mode: GenerateMode,
    segment: u32,
    /// What earlier segments sent.
    base: Sent,
    /// What this segment sent (the engine's own counts).
    cur: Sent,
    /// Cumulative `/generate`: this segment's last data payload, parsed on demand.
    last: Option<Bytes>,
    /// The OpenAI routes: this segment's text as the engine escaped it, appended to
    /// `cur.text` once decoded (when a move needs it).
    raw_text: Vec<u8>,
    prompt_tokens: Option<u64>,
    /// This segment relayed text the engine has not counted yet (its events carry no
    /// completion tokens: an engine that ignores `continuous_usage_stats`). Such a stream
    /// is not continued: the follow-up's limit could not be reduced by what was sent.
    uncounted: bool,
    /// `[DONE]` was forwarded.
    done_seen: bool,
    /// The final usage chunk (no choices) was forwarded.
    usage_chunk_sent: bool,
    /// The first segment's object id (OpenAI `id`, `/generate` `meta_info.id`).
    id: Option<String>,
    stop: Option<Stop>,
    /// The OpenAI routes: this stream's event shape (most events are skimmed from it).
    shape: skim::ShapeCache,
    /// The OpenAI routes, before a move: payloads forwarded but not yet accounted, each
    /// followed by `\n` (a data line holds none), and the most it may hold (0: account
    /// each event as it passes).
    pending: Vec<u8>,
    lazy_limit: usize,
    /// [`Self::relay`] checks events for aborts (see [`Self::check_aborts`]).
    check_aborts: bool,
}

/// An abort or error found by [`Tracker::relay`], and what the client gets before it.
#[derive(Debug)]
pub struct Aborted {
    pub before: Bytes,
    pub abort: InAnswer,
}

impl Tracker {
    pub fn new(plan: Plan, mode: GenerateMode) -> Tracker {
        Tracker {
            plan,
            client_mode: mode,
            mode,
            segment: 0,
            base: Sent::default(),
            cur: Sent::default(),
            last: None,
            raw_text: Vec::new(),
            prompt_tokens: None,
            uncounted: false,
            done_seen: false,
            usage_chunk_sent: false,
            id: None,
            stop: None,
            shape: skim::ShapeCache::default(),
            pending: Vec::new(),
            lazy_limit: LAZY_BYTES,
            check_aborts: false,
        }
    }

    /// Accounts each event as it passes (no deferred account; to compare both in tests).
    #[cfg(test)]
    pub fn eager(mut self) -> Tracker {
        self.lazy_limit = 0;
        self
    }

    /// [`Self::relay`] of a run that holds no abort.
    #[cfg(test)]
    pub fn relay_ok(&mut self, run: Bytes) -> Bytes {
        match self.relay(run) {
            Ok(b) => b,
            Err(a) => panic!("an abort in the run: {a:?}"),
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Moves made so far.
    pub fn segment(&self) -> u32 {
        self.segment
    }

    /// The stream showed something that cannot be continued (a tool call, reasoning, a
    /// finished answer), in the events accounted so far: [`Self::sent`] and
    /// [`Self::complete`] account every event first, so a move never starts from a stale
    /// answer; a stale `None` here only arms a stall timer that then finds no move.
    pub fn stopped(&self) -> Option<Stop> {
        self.stop
    }

    /// Whole events forwarded to the client: recorded, and rewritten where needed. With
    /// [`Self::check_aborts`], an event that carries an abort or an error ends the run:
    /// `Err` holds what goes to the client before it (recorded and rewritten) and the
    /// abort, which is not recorded.
    pub fn relay(&mut self, run: Bytes) -> Result<Bytes, Aborted> {
        let fast = self.segment == 0
            && self.plan.route == ApiRoute::Generate
            && self.mode == GenerateMode::Cumulative;
        if fast {
            // The last data event holds everything; keep it, forward the run as is.
            let maybe = self.check_aborts && skim::may_hold_abort(&run);
            for (s, e, first) in events(&run) {
                if let Some((ds, de)) = payload_with(&run[s..e], first) {
                    let data = &run[s + ds..s + de];
                    if data == b"[DONE]" {
                        self.done_seen = true;
                    } else {
                        if let Some(abort) = maybe.then(|| abort_in_answer(data)).flatten() {
                            let before = run.slice(..s);
                            return Err(Aborted { before, abort });
                        }
                        self.last = Some(run.slice(s + ds..s + de));
                    }
                }
            }
            return Ok(run);
        }
        if let Some(out) = self.one_token(&run) {
            return Ok(out);
        }
        let mut out: Option<Vec<u8>> = None;
        for (s, e, first) in events(&run) {
            let event = &run[s..e];
            let data = payload_with(event, first).map(|(ds, de)| &event[ds..de]);
            let replaced = match data {
                Some(d) if d != b"[DONE]" => match self.event(d) {
                    Ok(r) => r,
                    Err(abort) => {
                        let before = match out {
                            Some(o) => Bytes::from(o),
                            None => run.slice(..s),
                        };
                        return Err(Aborted { before, abort });
                    }
                },
                Some(_) => {
                    self.done_seen = true;
                    Replace::Keep
                }
                None => Replace::Keep,
            };
            if let Replace::Keep = replaced {
                if let Some(o) = out.as_mut() {
                    o.extend_from_slice(event);
                }
                continue;
            }
            let o = out.get_or_insert_with(|| {
                // Sized exactly for the usual run, one event cut (its usage member and
                // comma): `Bytes::from` then takes the buffer as it is, where a buffer
                // with spare room costs a second allocation.
                let cap = match &replaced {
                    Replace::Cut(m) => run.len().saturating_sub(m.len() + 1),
                    _ => run.len(),
                };
                let mut o = Vec::with_capacity(cap);
                o.extend_from_slice(&run[..s]);
                o
            });
            match (replaced, data) {
                (Replace::With(d), _) => push_event(o, &d),
                (Replace::Cut(m), Some(d)) => {
                    o.extend_from_slice(b"data: ");
                    cut_member(o, d, m);
                    o.extend_from_slice(b"\n\n");
                }
                _ => {}
            }
        }
        Ok(match out {
            Some(o) => Bytes::from(o),
            None => run,
        })
    }

    /// [`Self::relay`] of the usual run of an OpenAI stream that has not moved: one event,
    /// one `data: ` line, a token chunk that matches the stream's shape and holds no abort.
    /// `None` when the run is anything else (the caller reads it event by event).
    ///
    /// Why: most runs are one token event; read as a whole, the run needs no scan for its
    /// events' ends, and its output is two copies (the run without the usage member).
    /// It is one event: a payload that matches the template is one JSON object whose bytes
    /// are the template's (a data line's), a string and digits, and a matching text holds no
    /// raw `\n`.
    fn one_token(&mut self, run: &Bytes) -> Option<Bytes> {
        if self.segment > 0
            || self.lazy_limit > 0
            || self.id.is_none()
            || self.plan.route == ApiRoute::Generate
        {
            return None;
        }
        let data = run.strip_prefix(b"data: ")?.strip_suffix(b"\n\n")?;
        let t = self.shape.token(data)?;
        // (A matching event's text holds no raw `\n`: see `skim::ShapeCache::token`.)
        if self.check_aborts && !t.abort_free {
            return None;
        }
        // What the client does not get (the usage member and its comma), in the run's
        // bytes. Found before the event is recorded: a `None` after would record it twice.
        let cut = match self.hidden_usage(&t) {
            Some(m) => Some(cut_range(data, m).map(|r| 6 + r.start..6 + r.end)?),
            None => None,
        };
        self.record_token(data, t);
        let Some(cut) = cut else {
            return Some(run.clone());
        };
        let mut out = Vec::with_capacity(run.len() - cut.len());
        out.extend_from_slice(&run[..cut.start]);
        out.extend_from_slice(&run[cut.end..]);
        Some(Bytes::from(out))
    }

    /// From now on [`Self::relay`] checks each event for an abort or an error (the SSE
    /// scanner no longer does: see `sse::SseScanner::leave_abort_checks`).
    pub fn check_aborts(&mut self) {
        self.check_aborts = true;
    }

    /// The abort or error `data` carries, when this tracker checks for them.
    fn check(&self, data: &[u8]) -> Result<(), InAnswer> {
        match self.check_aborts.then(|| abort_in_answer(data)).flatten() {
            Some(abort) => Err(abort),
            None => Ok(()),
        }
    }

    /// What becomes of one data payload; checked for an abort before it is recorded.
    fn event(&mut self, data: &[u8]) -> Result<Replace, InAnswer> {
        if self.plan.route == ApiRoute::Generate {
            self.check(data)?;
            return Ok(self.generate_event(data).into());
        }
        let checked = self.lazy_limit > 0;
        if checked {
            self.check(data)?;
            if let Some(r) = self.deferred(data) {
                return Ok(r);
            }
            self.account_pending();
        }
        // Read as it passes: most events of a stream that has not moved match its shape
        // (the first segment's id, once read, is never read again), and most of those
        // are known to hold no abort without a search.
        if self.segment == 0 && self.id.is_some() {
            if let Some(t) = self.shape.token(data) {
                if !t.abort_free && !checked {
                    self.check(data)?;
                }
                return Ok(self.token(data, t));
            }
        }
        if !checked {
            self.check(data)?;
        }
        Ok(self.openai_event(data))
    }

    /// An OpenAI event before a move, kept to be accounted later: what it becomes for the
    /// client, or `None` when it must be read now (see the module docs).
    fn deferred(&mut self, data: &[u8]) -> Option<Replace> {
        if self.segment > 0 || self.pending.len() + data.len() >= self.lazy_limit {
            self.lazy_limit = 0;
            return None;
        }
        let r = match choices(data)? {
            // A usage chunk: shown if the client asked for usage, as the account says.
            false => {
                skim::tail::usage_member(data)?;
                if self.plan.client_usage || self.plan.client_continuous_usage {
                    Replace::Keep
                } else {
                    Replace::Drop
                }
            }
            true if self.plan.client_continuous_usage => Replace::Keep,
            true => Replace::Cut(skim::tail::usage_member(data)?),
        };
        self.pending.extend_from_slice(data);
        self.pending.push(b'\n');
        Some(r)
    }

    /// Brings the account up to date: the last event of a cumulative `/generate` stream
    /// (it holds the whole answer so far), or the events kept by [`Self::deferred`], in
    /// order.
    fn account_pending(&mut self) {
        if let Some(last) = self.last.take() {
            self.generate_event(&last);
        }
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        let mut from = 0;
        for end in memchr::memchr_iter(b'\n', &pending) {
            let _ = self.openai_event(&pending[from..end]);
            from = end + 1;
        }
        self.pending = pending;
        self.pending.clear();
    }

    fn generate_event(&mut self, data: &[u8]) -> Option<Option<Vec<u8>>> {
        let Ok(c) = serde_json::from_slice::<GenChunk<'_>>(data) else {
            return None;
        };
        let meta = c.meta_info.as_ref();
        if self.segment == 0 {
            if self.id.is_none() {
                self.id = meta.and_then(|m| m.id.as_deref()).map(str::to_string);
            }
            if let Some(p) = meta.and_then(|m| m.prompt_tokens) {
                self.prompt_tokens = Some(p);
            }
        }
        if meta.and_then(|m| m.finish_reason).is_some() {
            self.stop = Some(COMPLETE);
        }
        let text = c.text.as_deref().unwrap_or("");
        let ids = c.output_ids.as_deref().unwrap_or(&[]);
        count(
            &mut self.cur,
            &mut self.uncounted,
            meta.and_then(|m| m.completion_tokens),
            !text.is_empty() || !ids.is_empty(),
        );
        let (text_was, ids_was) = (self.cur.text.len(), self.cur.ids.len());
        match self.mode {
            GenerateMode::Cumulative => {
                self.cur.text.clear();
                self.cur.text.push_str(text);
                self.cur.ids.clear();
                self.cur.ids.extend_from_slice(ids);
            }
            GenerateMode::Incremental => {
                self.cur.text.push_str(text);
                self.cur.ids.extend_from_slice(ids);
            }
        }
        if self.segment == 0 {
            return None;
        }
        let mut v: Value = serde_json::from_slice(data).ok()?;
        // The client's format, whatever this decode's: the whole answer, or what is new.
        let (out_text, out_ids): (String, Vec<i64>) = match self.client_mode {
            GenerateMode::Cumulative => (
                format!("{}{}", self.base.text, self.cur.text),
                self.base.ids.iter().chain(&self.cur.ids).copied().collect(),
            ),
            GenerateMode::Incremental => (
                self.cur.text.get(text_was..).unwrap_or("").to_string(),
                self.cur.ids.get(ids_was..).unwrap_or(&[]).to_vec(),
            ),
        };
        if let Some(t) = v.get_mut("text") {
            *t = Value::from(out_text);
        }
        if let Some(o) = v.get_mut("output_ids") {
            *o = Value::from(out_ids);
        }
        if let Some(m) = v.get_mut("meta_info").and_then(Value::as_object_mut) {
            if let Some(n) = meta.and_then(|m| m.completion_tokens) {
                m.insert(
                    "completion_tokens".into(),
                    (n + self.base.completion_tokens).into(),
                );
            }
            if let Some(p) = self.prompt_tokens {
                m.insert("prompt_tokens".into(), p.into());
            }
            if let Some(id) = &self.id {
                m.insert("id".into(), id.clone().into());
            }
            if let Some(len) = m
                .get_mut("finish_reason")
                .and_then(|f| f.get_mut("length"))
                .filter(|l| l.is_u64())
            {
                *len = self.plan.limit.map_or_else(|| len.clone(), Value::from);
            }
        }
        Some(serde_json::to_vec(&v).ok())
    }

    fn openai_event(&mut self, data: &[u8]) -> Replace {
        let Some(c) = self.shape.chunk(data) else {
            return Replace::Keep;
        };
        let completion_tokens = c.completion_tokens;
        let mut text_relayed = false;
        if self.segment == 0 {
            if let Some(p) = c.prompt_tokens {
                self.prompt_tokens = Some(p);
            }
            if self.id.is_none() {
                self.id =
                    c.id.as_ref()
                        .and_then(|r| skim::string_body(data, r))
                        .and_then(|r| skim::unescape(&data[r]));
            }
        }
        let mut role_only = self.segment > 0 && !c.choices.is_empty();
        for ch in &c.choices {
            let piece = ch
                .text
                .as_ref()
                .or(ch.content.as_ref())
                .and_then(|r| skim::string_body(data, r))
                .map_or(&[][..], |r| &data[r]);
            // Kept escaped; decoded once, when a move needs it.
            self.raw_text.extend_from_slice(piece);
            text_relayed |= !piece.is_empty();
            note(&mut self.stop, ch.flags(data));
            if !piece.is_empty() || ch.finish_reason.is_some() || !ch.has_delta {
                role_only = false;
            }
        }
        count(
            &mut self.cur,
            &mut self.uncounted,
            completion_tokens,
            text_relayed,
        );
        let usage_chunk = c.choices.is_empty() && c.usage.is_some();
        let usage_member = c.usage_member.clone();
        let show_usage = if usage_chunk {
            self.plan.client_usage || self.plan.client_continuous_usage
        } else {
            self.plan.client_continuous_usage
        };
        if usage_chunk && !show_usage {
            return Replace::Drop;
        }
        if usage_chunk {
            self.usage_chunk_sent = true;
        }
        if self.segment == 0 {
            return match usage_member {
                Some(m) if !show_usage => Replace::Cut(m),
                _ => Replace::Keep,
            };
        }
        if role_only {
            // The continuation's opening chunk (its role): the client has had one.
            return Replace::Drop;
        }
        let Ok(mut v) = serde_json::from_slice::<Value>(data) else {
            return Replace::Keep;
        };
        let Some(o) = v.as_object_mut() else {
            return Replace::Keep;
        };
        if let Some(id) = &self.id {
            o.insert("id".into(), id.clone().into());
        }
        if let Some(chs) = o.get_mut("choices").and_then(Value::as_array_mut) {
            for ch in chs {
                if let Some(d) = ch.get_mut("delta").and_then(Value::as_object_mut) {
                    d.remove("role");
                }
            }
        }
        if show_usage {
            if let (Some(u), Some(n)) = (o.get_mut("usage"), completion_tokens) {
                let total = n + self.base.completion_tokens;
                let prompt = self.prompt_tokens.unwrap_or(0);
                // The engine's usage object, with the counts of the whole answer.
                if let Some(u) = u.as_object_mut() {
                    u.insert("prompt_tokens".into(), prompt.into());
                    u.insert("completion_tokens".into(), total.into());
                    u.insert("total_tokens".into(), (prompt + total).into());
                }
            }
        } else {
            o.remove("usage");
        }
        serde_json::to_vec(&v).map_or(Replace::Drop, Replace::With)
    }

    /// [`Self::openai_event`] for a token chunk of the first segment that matched the
    /// stream's shape (one choice, so never the usage chunk).
    fn token(&mut self, data: &[u8], t: skim::Token) -> Replace {
        let replace = self.hidden_usage(&t).map_or(Replace::Keep, Replace::Cut);
        self.record_token(data, t);
        replace
    }

    /// The usage member a matching token event is forwarded without (`None`: forwarded as
    /// it is, the client asked for per-chunk usage).
    fn hidden_usage(&self, t: &skim::Token) -> Option<std::ops::Range<usize>> {
        t.usage_member
            .clone()
            .filter(|_| !self.plan.client_continuous_usage)
    }

    /// Records a matching token event: its counts, its text, its flags.
    fn record_token(&mut self, data: &[u8], t: skim::Token) {
        count(
            &mut self.cur,
            &mut self.uncounted,
            t.completion_tokens,
            !t.piece.is_empty(),
        );
        if let Some(p) = t.prompt_tokens {
            self.prompt_tokens = Some(p);
        }
        // Kept escaped; decoded once, when a move needs it.
        self.raw_text
            .extend_from_slice(data.get(t.piece).unwrap_or_default());
        note(&mut self.stop, t.flags);
    }

    /// The answer is complete (a finish reason was relayed): nothing is left to generate.
    pub fn complete(&mut self) -> bool {
        self.account_pending();
        self.stop == Some(COMPLETE)
    }

    /// What ends a complete answer whose decode went away before ending its stream: the
    /// usage chunk the client asked for (the engine's counts, summed over segments) and
    /// `[DONE]`, or nothing if the client has them.
    pub fn closing(&mut self) -> Vec<u8> {
        self.account_pending();
        let mut out = Vec::new();
        if self.done_seen {
            return out;
        }
        if self.plan.route != ApiRoute::Generate && self.plan.client_usage && !self.usage_chunk_sent
        {
            let completion = self.base.completion_tokens + self.cur.completion_tokens;
            let prompt = self.prompt_tokens.unwrap_or(0);
            let object = match self.plan.route {
                ApiRoute::ChatCompletions => "chat.completion.chunk",
                _ => "text_completion",
            };
            let chunk = serde_json::json!({
                "id": self.id,
                "object": object,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            });
            if let Ok(v) = serde_json::to_vec(&chunk) {
                push_event(&mut out, &v);
            }
        }
        push_event(&mut out, b"[DONE]");
        out
    }

    /// What the client has received in all, for the follow-up; `Err` when the stream
    /// cannot be continued.
    pub fn sent(&mut self) -> Result<Sent, String> {
        self.account_pending();
        if !self.raw_text.is_empty() {
            let Some(text) = skim::unescape(&self.raw_text) else {
                return Err("the stream's text could not be read".to_string());
            };
            self.cur.text.push_str(&text);
            self.raw_text.clear();
        }
        if let Some(why) = self.stop {
            return Err(why.to_string());
        }
        if self.uncounted {
            // The follow-up's limit is the client's less what the engine counted: with
            // tokens it did not count, a follow-up could overshoot the client's limit.
            return Err(UNCOUNTED.to_string());
        }
        let mut s = self.base.clone();
        s.text.push_str(&self.cur.text);
        s.ids.extend_from_slice(&self.cur.ids);
        s.completion_tokens += self.cur.completion_tokens;
        Ok(s)
    }

    /// The next segment's decode streams `/generate` in `mode`.
    pub fn set_source_mode(&mut self, mode: GenerateMode) {
        self.mode = mode;
    }

    /// A move was made: what was sent so far is the base of the next segment.
    pub fn next_segment(&mut self, sent: Sent) {
        self.base = sent;
        self.cur = Sent::default();
        self.last = None;
        self.raw_text.clear();
        self.uncounted = false;
        self.segment += 1;
    }
}

#[cfg(test)]
mod tests;
