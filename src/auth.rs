//! Client API keys on the front door (`[auth]`): who may send requests, under which key id
//! they are logged and counted, and how many each key may have in flight.
//!
//! The keys file (`auth.api_keys_file`, `--api-keys-file`) holds one key per line:
//!
//! ```text
//! # a comment; blank lines are skipped
//! sk-raw-key-1                          # a raw key (id: line-3, its line number)
//! sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! team-a: sk-raw-key-2                  # a named key (id: team-a)
//! team-b: sha256:<64 hex digits>        # a named, hashed key
//! ```
//!
//! A client sends its key as `Authorization: Bearer <key>`, or as `x-api-key: <key>` (what
//! Anthropic-style clients send) when it has no bearer token. Keys never contain
//! whitespace (RFC 6750 tokens cannot), which is what makes `NAME: KEY` unambiguous.
//!
//! Invariants:
//! - A key is never stored, logged or put in a metric: only its SHA-256 is kept, and a
//!   request is known by its key id: the name, or `line-N` for an unnamed key (its line in
//!   the file). Nothing derived from the key alone is shown: an id made of the digest's
//!   first bits, on `/metrics` or in logs, would let anyone who reads them confirm offline
//!   guesses of a weak key. Name keys for ids that survive edits of the file. Errors about
//!   the file name lines.
//! - Lookup does not leak the key through timing: the presented key is hashed, and the
//!   digest is looked up in a hash map of digests. What the map's comparisons could leak is
//!   how many leading bytes of the *digest* matched, which tells an attacker nothing they
//!   can steer: finding a key whose digest shares a prefix with a valid one is a preimage
//!   search on SHA-256. (Comparing raw keys byte by byte would leak the key's prefix.)
//! - The key set is one `ArcSwap`: the request path does one `load()` and no lock;
//!   [`ClientKeys::reload`] swaps a whole new set (or keeps the old one if the file is
//!   bad). Per-key counters survive a reload for every key id that stays.
//! - Keys with the same name share one id and so one in-flight limit (a key being rotated:
//!   old and new in the file under one name).

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use http::{header, HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use crate::admission::ClientHold;
use crate::config::Config;
use crate::error::{FailReason, Failure};

/// The SHA-256 of a key.
pub type KeyDigest = [u8; 32];

/// `x-api-key`, accepted when a request has no bearer token.
pub static X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// The client keys of a running front door (none: no client auth).
pub struct ClientKeys {
    set: ArcSwapOption<KeySet>,
}

struct KeySet {
    by_digest: HashMap<KeyDigest, Arc<KeyEntry>>,
    /// Requests in flight per key id (0: no limit).
    max_in_flight: usize,
}

struct KeyEntry {
    id: Arc<str>,
    in_flight: Arc<AtomicUsize>,
}

/// Keys read and checked by [`ClientKeys::stage`], not yet in use (with the file they came
/// from); none: no client auth.
pub struct StagedKeys(Option<(String, Arc<KeySet>)>);

/// A request whose key was accepted: its key id and its count against the key's limit.
pub struct Admitted {
    pub id: Arc<str>,
    pub hold: Option<ClientHold>,
}

impl ClientKeys {
    /// No client auth: every request passes.
    pub fn disabled() -> ClientKeys {
        ClientKeys {
            set: ArcSwapOption::empty(),
        }
    }

    /// The keys `cfg` names (`auth.api_keys_file`), or none.
    pub fn from_config(cfg: &Config) -> Result<ClientKeys, String> {
        let keys = ClientKeys::disabled();
        keys.reload(cfg)?;
        Ok(keys)
    }

    /// Reads the keys file again (and `auth.per_key_max_in_flight`) and swaps the set in
    /// whole. On an error the set in use stays, and the error names the file and the line.
    pub fn reload(&self, cfg: &Config) -> Result<(), String> {
        let staged = self.stage(cfg)?;
        self.install(staged);
        Ok(())
    }

    /// Reads and checks the keys `cfg` names without using them yet (a reload stages every
    /// secret first, so that one that cannot be read refuses the reload before anything
    /// changed). Per-key in-flight counts carry over to the same key ids.
    pub fn stage(&self, cfg: &Config) -> Result<StagedKeys, String> {
        let (path, mut parsed) = match &cfg.auth.api_keys_file {
            None if cfg.auth.api_key.is_none() => return Ok(StagedKeys(None)),
            None => (std::path::PathBuf::from("auth.api_key"), Vec::new()),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!("cannot read auth.api_keys_file {}: {e}", path.display())
                })?;
                let parsed = parse_keys(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                (path.clone(), parsed)
            }
        };
        // The inline key (`--api-key`), under the id `api-key`.
        if let Some(k) = &cfg.auth.api_key {
            let d = digest(k.as_bytes());
            if !parsed.iter().any(|p| p.digest == d) {
                parsed.push(ParsedKey {
                    id: Arc::from("api-key"),
                    digest: d,
                });
            }
        }
        let path = &path;
        if parsed.is_empty() {
            return Err(format!(
                "{} holds no key: every request would be refused (remove auth.api_keys_file \
                 to serve without client keys)",
                path.display()
            ));
        }
        let old = self.set.load_full();
        let mut counters: HashMap<Arc<str>, Arc<AtomicUsize>> = HashMap::new();
        if let Some(old) = &old {
            for e in old.by_digest.values() {
                counters.insert(e.id.clone(), e.in_flight.clone());
            }
        }
        let mut by_digest = HashMap::with_capacity(parsed.len());
        for k in parsed {
            let in_flight = counters.entry(k.id.clone()).or_default().clone();
            by_digest.insert(
                k.digest,
                Arc::new(KeyEntry {
                    id: k.id,
                    in_flight,
                }),
            );
        }
        Ok(StagedKeys(Some((
            path.display().to_string(),
            Arc::new(KeySet {
                by_digest,
                max_in_flight: cfg.auth.per_key_max_in_flight,
            }),
        ))))
    }

    /// Puts staged keys in use.
    pub fn install(&self, staged: StagedKeys) {
        match staged.0 {
            None => self.set.store(None),
            Some((file, set)) => {
                tracing::info!(
                    file,
                    keys = set.by_digest.len(),
                    per_key_max_in_flight = set.max_in_flight,
                    "client API keys loaded"
                );
                self.set.store(Some(set));
            }
        }
    }

    /// Whether requests need a key.
    pub fn enabled(&self) -> bool {
        self.set.load().is_some()
    }

    /// The key id of the request's key (`Ok(None)`: no client auth), or the 401.
    pub fn identify(&self, headers: &HeaderMap) -> Result<Option<Arc<str>>, Failure> {
        let set = self.set.load();
        let Some(set) = set.as_ref() else {
            return Ok(None);
        };
        Ok(Some(set.lookup(headers)?.id.clone()))
    }

    /// Like [`ClientKeys::identify`], and counts the request against its key's limit: 429
    /// past it. The hold goes with the request's admission slot.
    pub fn admit(&self, headers: &HeaderMap) -> Result<Option<Admitted>, Failure> {
        self.admit_keyed(headers).map_err(|(f, _)| f)
    }

    /// [`ClientKeys::admit`], a refusal with the key id when the key was known (a 429 over
    /// its limit): the access log and `pdgate_client_requests_total` name whose it was.
    pub fn admit_keyed(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<Admitted>, (Failure, Option<Arc<str>>)> {
        let set = self.set.load();
        let Some(set) = set.as_ref() else {
            return Ok(None);
        };
        let entry = set.lookup(headers).map_err(|f| (f, None))?;
        let hold = match set.max_in_flight {
            0 => None,
            max => match ClientHold::try_take(&entry.in_flight, max) {
                Some(h) => Some(h),
                None => {
                    tracing::warn!(key_id = %entry.id, limit = max, "client key over its in-flight limit");
                    let f = Failure::new(
                        FailReason::KeyInFlightLimit,
                        format!(
                            "API key {} already has {max} requests in flight (auth.per_key_max_in_flight)",
                            entry.id
                        ),
                    );
                    return Err((f, Some(entry.id.clone())));
                }
            },
        };
        tracing::debug!(key_id = %entry.id, "client key accepted");
        Ok(Some(Admitted {
            id: entry.id.clone(),
            hold,
        }))
    }
}

impl KeySet {
    fn lookup(&self, headers: &HeaderMap) -> Result<&Arc<KeyEntry>, Failure> {
        let Some(key) = presented_key(headers) else {
            tracing::debug!("request without a client key refused");
            return Err(Failure::new(
                FailReason::InvalidApiKey,
                "missing API key: send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
            ));
        };
        match self.by_digest.get(&digest(key)) {
            Some(e) => Ok(e),
            None => {
                tracing::debug!("request with an unknown client key refused");
                Err(Failure::new(FailReason::InvalidApiKey, "invalid API key"))
            }
        }
    }
}

/// The key a request presents: its bearer token, else its `x-api-key`.
pub fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(token) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()))
    {
        return Some(token);
    }
    headers
        .get(&X_API_KEY)
        .map(|v| v.as_bytes().trim_ascii())
        .filter(|k| !k.is_empty())
}

/// The token of a `Bearer <token>` value (scheme case-insensitive), if not empty.
pub fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest.first().is_none_or(|c| *c != b' ') {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

pub fn digest(key: &[u8]) -> KeyDigest {
    Sha256::digest(key).into()
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

/// The id of an unnamed key: its line in the keys file (never anything derived from the
/// key, see the module docs).
pub fn line_id(line: usize) -> String {
    format!("line-{line}")
}

/// One line of the keys file.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ParsedKey {
    pub(crate) id: Arc<str>,
    pub(crate) digest: KeyDigest,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn parse_hex_digest(h: &str) -> Option<KeyDigest> {
    if h.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in h.as_bytes().chunks_exact(2).enumerate() {
        let hi = char::from(pair[0]).to_digit(16)?;
        let lo = char::from(pair[1]).to_digit(16)?;
        out[i] = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(out)
}

/// Parses a keys file. Errors name the line, never its key.
pub(crate) fn parse_keys(text: &str) -> Result<Vec<ParsedKey>, String> {
    let mut out: Vec<ParsedKey> = Vec::new();
    let mut seen: HashMap<KeyDigest, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let words: Vec<&str> = line
            .split_whitespace()
            .take_while(|w| !w.starts_with('#'))
            .collect();
        let (name, key) = match words.as_slice() {
            [] => continue,
            [key] => (None, *key),
            [name, key] if name.ends_with(':') && name.len() > 1 => {
                (Some(&name[..name.len() - 1]), *key)
            }
            _ => {
                return Err(format!(
                    "line {n}: expected `KEY`, `sha256:HEX` or `NAME: KEY` (keys contain no spaces)"
                ))
            }
        };
        if let Some(name) = name {
            if !valid_name(name) {
                return Err(format!(
                    "line {n}: a key name is 1 to 64 of A-Z a-z 0-9 . _ -"
                ));
            }
        }
        let d = match key.strip_prefix("sha256:") {
            Some(h) => parse_hex_digest(h)
                .ok_or_else(|| format!("line {n}: sha256: must be followed by 64 hex digits"))?,
            None => {
                if !key.bytes().all(|c| c.is_ascii_graphic()) {
                    return Err(format!(
                        "line {n}: a key is printable ASCII (it travels in an HTTP header)"
                    ));
                }
                digest(key.as_bytes())
            }
        };
        if let Some(first) = seen.insert(d, n) {
            return Err(format!("line {n}: the same key as line {first}"));
        }
        let id: Arc<str> = match name {
            Some(name) => Arc::from(name),
            None => Arc::from(line_id(n)),
        };
        out.push(ParsedKey { id, digest: d });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_file_format() {
        let hashed = hex(&digest(b"sk-two"));
        let text = format!(
            "# keys\n\n  sk-one  # trailing comment\nsha256:{}\nteam-a: sk-three\nteam-b: sha256:{}\n",
            hashed.to_uppercase(),
            hex(&digest(b"sk-four"))
        );
        let keys = parse_keys(&text).unwrap();
        let ids: Vec<&str> = keys.iter().map(|k| &*k.id).collect();
        assert_eq!(ids, vec!["line-3", "line-4", "team-a", "team-b"]);
        assert_eq!(keys[1].digest, digest(b"sk-two"), "hex in either case");
        assert_eq!(keys[3].digest, digest(b"sk-four"));
    }

    #[test]
    fn bad_lines_are_refused_by_number_without_the_key() {
        let cases = [
            ("a b c\n", "line 1"),
            (
                "ok\nsha256:abc\n",
                "line 2: sha256: must be followed by 64 hex",
            ),
            ("bad!: sk-secret-1\n", "line 1: a key name"),
            (
                "sk-secret-1\nx: sk-secret-1\n",
                "line 2: the same key as line 1",
            ),
            (": sk-secret-1\n", "line 1"),
        ];
        for (text, want) in cases {
            let e = parse_keys(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(!e.contains("sk-secret"), "{e}");
        }
    }

    #[test]
    fn bearer_and_x_api_key() {
        type Case<'a> = (&'a [(&'a str, &'a str)], Option<&'a [u8]>);
        let table: [Case; 7] = [
            (&[("authorization", "Bearer k1")], Some(b"k1")),
            (&[("authorization", "bearer   k1  ")], Some(b"k1")),
            (&[("x-api-key", "k2")], Some(b"k2")),
            (
                &[("authorization", "Basic abc"), ("x-api-key", "k2")],
                Some(b"k2"),
            ),
            (
                &[("authorization", "Bearer k1"), ("x-api-key", "k2")],
                Some(b"k1"),
            ),
            (&[("authorization", "Bearer ")], None),
            (&[("authorization", "Bearerk1")], None),
        ];
        for (h, want) in table {
            assert_eq!(presented_key(&headers(h)), want, "{h:?}");
        }
    }

    fn load_file(path: &std::path::Path, max_in_flight: usize) -> Result<ClientKeys, String> {
        let mut cfg = Config::default();
        cfg.auth.api_keys_file = Some(path.to_path_buf());
        cfg.auth.per_key_max_in_flight = max_in_flight;
        ClientKeys::from_config(&cfg)
    }

    fn keys_with(text: &str, max: usize) -> (ClientKeys, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "pdgate-auth-{}-{}",
            std::process::id(),
            hex(&digest(text.as_bytes())[..4])
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("keys");
        std::fs::write(&f, text).unwrap();
        (load_file(&f, max).unwrap(), f)
    }

    #[test]
    fn admit_checks_the_key_and_the_per_key_limit() {
        let (keys, _) = keys_with("team-a: sk-a\nteam-a: sk-a2\nsk-b\n", 1);
        let none = keys.admit(&HeaderMap::new()).err().unwrap();
        assert_eq!(none.reason, FailReason::InvalidApiKey);
        let bad = keys
            .admit(&headers(&[("authorization", "Bearer nope")]))
            .err()
            .unwrap();
        assert_eq!(bad.reason, FailReason::InvalidApiKey);
        let a = keys
            .admit(&headers(&[("authorization", "Bearer sk-a")]))
            .unwrap()
            .unwrap();
        assert_eq!(&*a.id, "team-a");
        // The rotated key shares team-a's limit.
        let over = keys
            .admit(&headers(&[("x-api-key", "sk-a2")]))
            .err()
            .unwrap();
        assert_eq!(over.reason, FailReason::KeyInFlightLimit);
        assert_eq!(over.status().as_u16(), 429);
        // Another key is not limited by team-a's requests.
        assert!(keys
            .admit(&headers(&[("x-api-key", "sk-b")]))
            .unwrap()
            .is_some());
        drop(a);
        assert!(keys
            .admit(&headers(&[("x-api-key", "sk-a2")]))
            .unwrap()
            .is_some());
    }

    #[test]
    fn reload_swaps_the_set_keeps_counters_and_survives_a_bad_file() {
        let (keys, f) = keys_with("team-a: sk-a\n", 1);
        let held = keys
            .admit(&headers(&[("x-api-key", "sk-a")]))
            .unwrap()
            .unwrap();
        let mut cfg = Config::default();
        cfg.auth.api_keys_file = Some(f.clone());
        cfg.auth.per_key_max_in_flight = 1;
        // A new key for team-a: its request in flight still counts.
        std::fs::write(&f, "team-a: sk-a-new\nsk-c\n").unwrap();
        keys.reload(&cfg).unwrap();
        assert!(keys.identify(&headers(&[("x-api-key", "sk-a")])).is_err());
        let over = keys
            .admit(&headers(&[("x-api-key", "sk-a-new")]))
            .err()
            .unwrap();
        assert_eq!(over.reason, FailReason::KeyInFlightLimit);
        drop(held);
        assert!(keys
            .admit(&headers(&[("x-api-key", "sk-a-new")]))
            .unwrap()
            .is_some());
        // A bad file keeps the set in use; an empty one is refused.
        std::fs::write(&f, "sha256:zz\n").unwrap();
        assert!(keys.reload(&cfg).unwrap_err().contains("line 1"));
        std::fs::write(&f, "# nothing\n").unwrap();
        assert!(keys.reload(&cfg).unwrap_err().contains("holds no key"));
        assert!(keys
            .identify(&headers(&[("x-api-key", "sk-c")]))
            .unwrap()
            .is_some());
        // Without the file setting, client auth is off.
        cfg.auth.api_keys_file = None;
        keys.reload(&cfg).unwrap();
        assert!(!keys.enabled());
        assert_eq!(keys.identify(&HeaderMap::new()).unwrap(), None);
    }
}
