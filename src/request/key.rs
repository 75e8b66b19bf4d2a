//! A client's routing key: the value of the first configured request header present
//! (`affinity.headers`: smg's `x-smg-routing-key`, a session id), hashed with
//! [`fnv1a`]. When a request has one it replaces the prompt-prefix key of its picks
//! (`ParsedRequest::affinity_key`), so every request of a session lands where the session's
//! KV cache is, whatever its prompt.
//!
//! Why at the front door, before the body: a key pdgate cannot honour is refused before
//! any slot is taken or byte read; and the lookups are a few header-map probes (one per
//! configured name), so a request without a key pays nothing measurable.
//!
//! Invariants:
//! - A key is 1..=[`MAX_KEY_BYTES`] bytes of UTF-8. An empty value counts as absent (the
//!   next header is read, as SGLang's router does); a value that is not UTF-8 or is longer
//!   is refused with 400 `invalid_request` (SGLang skips it; pdgate says so, since a key it
//!   skipped would scatter the session's turns without a trace).
//! - With `sticky`, SGLang's per-turn and per-retry suffixes are stripped before hashing
//!   (`conv_t2_r1`, `conv_t2`, `conv_r1` → `conv`), as its `--routing-key-override` does.
//! - The hash depends only on the key's bytes: every replica gets the same one.

use http::{HeaderMap, HeaderName};

use crate::error::{FailReason, Failure};
use crate::types::fnv1a;

/// The longest routing key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 256;

/// The headers a routing key is read from, parsed once per config.
#[derive(Clone, Debug, Default)]
pub struct RoutingKeys {
    headers: Vec<HeaderName>,
    sticky: bool,
}

impl RoutingKeys {
    /// From `affinity.headers` (names that are not header names are skipped: the config
    /// check refused them already) and `affinity.sticky`.
    pub fn new(headers: &[String], sticky: bool) -> RoutingKeys {
        RoutingKeys {
            headers: headers
                .iter()
                .filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok())
                .collect(),
            sticky,
        }
    }

    /// Whether keyed requests are placed by their key whatever the policy.
    pub fn sticky(&self) -> bool {
        self.sticky
    }

    /// The request's routing key, hashed: `None` without one, a [`Failure`] (400) for a
    /// value that cannot be a key.
    pub fn read(&self, h: &HeaderMap) -> Result<Option<u64>, Failure> {
        for name in &self.headers {
            let Some(v) = h.get(name) else { continue };
            let b = v.as_bytes();
            if b.is_empty() {
                continue;
            }
            if b.len() > MAX_KEY_BYTES {
                return Err(Failure::new(
                    FailReason::InvalidRequest,
                    format!(
                        "routing key header {name}: {} bytes, at most {MAX_KEY_BYTES}",
                        b.len()
                    ),
                ));
            }
            let Ok(s) = std::str::from_utf8(b) else {
                return Err(Failure::new(
                    FailReason::InvalidRequest,
                    format!("routing key header {name}: the value is not UTF-8"),
                ));
            };
            let key = if self.sticky { strip_suffixes(s) } else { s };
            return Ok(Some(fnv1a(key.as_bytes())));
        }
        Ok(None)
    }
}

/// `key` without a trailing per-retry `_r<digits>`, then a per-turn `_t<digits>`; a key
/// that would become empty is kept whole.
pub fn strip_suffixes(key: &str) -> &str {
    fn strip(k: &str, tag: char) -> &str {
        let Some(at) = k.rfind('_') else { return k };
        let tail = &k[at + 1..];
        let mut c = tail.chars();
        let digits = c.as_str().get(1..).unwrap_or("");
        if at > 0
            && c.next() == Some(tag)
            && !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
        {
            &k[..at]
        } else {
            k
        }
    }
    strip(strip(key, 'r'), 't')
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn keys(sticky: bool) -> RoutingKeys {
        RoutingKeys::new(&["x-smg-routing-key".into(), "x-session-id".into()], sticky)
    }

    #[test]
    fn the_first_header_present_wins_and_bad_values_are_refused() {
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        let max = "k".repeat(MAX_KEY_BYTES);
        // (headers, sticky, the key hashed, or the error's words)
        type Case<'a> = (
            &'a [(&'a str, &'a [u8])],
            bool,
            Result<Option<&'a str>, &'a str>,
        );
        let cases: &[Case] = &[
            (&[], false, Ok(None)),
            (&[("x-other", b"a")], false, Ok(None)),
            (&[("x-session-id", b"s1")], false, Ok(Some("s1"))),
            (
                &[("x-session-id", b"s1"), ("x-smg-routing-key", b"r1")],
                false,
                Ok(Some("r1")),
            ),
            (
                &[("x-smg-routing-key", b""), ("x-session-id", b"s1")],
                false,
                Ok(Some("s1")),
            ),
            (
                &[("x-smg-routing-key", max.as_bytes())],
                false,
                Ok(Some(&max)),
            ),
            (
                &[("x-smg-routing-key", long.as_bytes())],
                false,
                Err("at most 256"),
            ),
            (
                &[("x-smg-routing-key", b"\xff\xfe")],
                false,
                Err("not UTF-8"),
            ),
            (
                &[("x-smg-routing-key", "café".as_bytes())],
                false,
                Ok(Some("café")),
            ),
            (
                &[("x-smg-routing-key", b"conv_t2_r1")],
                false,
                Ok(Some("conv_t2_r1")),
            ),
            (
                &[("x-smg-routing-key", b"conv_t2_r1")],
                true,
                Ok(Some("conv")),
            ),
        ];
        for (hs, sticky, want) in cases {
            let mut h = HeaderMap::new();
            for (n, v) in hs.iter() {
                h.insert(
                    HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_bytes(v).unwrap(),
                );
            }
            let got = keys(*sticky).read(&h);
            match (got, want) {
                (Ok(k), Ok(w)) => assert_eq!(k, w.map(|w| fnv1a(w.as_bytes())), "{hs:?}"),
                (Err(f), Err(w)) => {
                    assert_eq!(f.reason, FailReason::InvalidRequest);
                    assert!(f.message.contains(w), "{hs:?}: {}", f.message);
                }
                (g, w) => panic!("{hs:?}: {g:?}, wanted {w:?}"),
            }
        }
    }

    #[test]
    fn sglang_suffixes_are_stripped() {
        for (k, want) in [
            ("conv_t2_r1", "conv"),
            ("conv_t12", "conv"),
            ("conv_r3", "conv"),
            ("conv_r1_t2", "conv_r1"),
            ("conv", "conv"),
            ("_t1", "_t1"),
            ("conv_t", "conv_t"),
            ("conv_tx", "conv_tx"),
            ("a_b_t1", "a_b"),
        ] {
            assert_eq!(strip_suffixes(k), want, "{k}");
        }
    }
}
