//! `[affinity]`: client routing keys. A request header (SGLang router's
//! `--routing-key-headers`, smg's `X-SMG-Routing-Key`, a session id) names the key a
//! request's worker is chosen by, in place of its prompt prefix.
//!
//! Why a section of its own: the key is read at the front door (before the body) and used
//! by every policy pick of the request, and SGLang's flags for it (`--routing-key-override`,
//! `--sticky-sessions`, `--sticky-key-idle-secs`, `--routing-key-headers`) map here.
//! Invariants: defaults only here; every header name is a valid, lower-case HTTP header
//! name (checked by [`AffinityConfig::validate`]), so the front door never fails to
//! build its lookup list.

use serde::{Deserialize, Serialize};

use super::{invalid, range, ConfigError, DAY};

/// The most header names `affinity.headers` may list (each is one lookup per request).
pub const MAX_KEY_HEADERS: usize = 8;

/// `[affinity]`: routing keys from request headers (see POLICIES.md, "Client routing keys").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityConfig {
    /// Request headers read for a routing key, in order: the first one present wins. Its
    /// value (hashed) replaces the prompt-prefix key of `cache_aware` picks. Empty: no
    /// header is read.
    pub headers: Vec<String>,
    /// Sticky sessions (SGLang's `--routing-key-override`, `--sticky-sessions`): a keyed
    /// request is placed by its key on the `cache_aware` ring whatever the policy, and the
    /// key's per-turn and per-retry suffixes (`conv_t2_r1` → `conv`) are stripped.
    pub sticky: bool,
    /// SGLang's `--sticky-key-idle-secs`: how long its sticky map keeps an idle key.
    /// Accepted and has no effect: pdgate keeps no map (a key's worker is a pure function
    /// of the key and the fleet, the same on every replica), so a key never expires.
    pub sticky_idle_secs: u64,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            headers: vec!["x-smg-routing-key".into(), "x-session-id".into()],
            sticky: false,
            sticky_idle_secs: 14_400,
        }
    }
}

impl AffinityConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.headers.len() > MAX_KEY_HEADERS {
            return Err(invalid(format!(
                "affinity.headers lists {} headers (at most {MAX_KEY_HEADERS})",
                self.headers.len()
            )));
        }
        for h in &self.headers {
            let ok = !h.is_empty()
                && h.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
                })
                && http::HeaderName::from_bytes(h.as_bytes()).is_ok();
            if !ok {
                return Err(invalid(format!(
                    "affinity.headers: {h:?} is not a lower-case HTTP header name \
                     (letters, digits, '-' and '_')"
                )));
            }
        }
        range(
            "affinity.sticky_idle_secs",
            self.sticky_idle_secs,
            1,
            30 * DAY,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_names_and_idle_secs_are_checked() {
        let cases: &[(&[&str], u64, Option<&str>)] = &[
            (&["x-smg-routing-key", "x-session-id"], 14_400, None),
            (&[], 1, None),
            (&["X-Session-Id"], 60, Some("not a lower-case")),
            (&["bad header"], 60, Some("not a lower-case")),
            (&[""], 60, Some("not a lower-case")),
            (&["a"; 9], 60, Some("at most 8")),
            (&["x-a"], 0, Some("affinity.sticky_idle_secs = 0")),
            (&["x-a"], 31 * DAY, Some("affinity.sticky_idle_secs")),
        ];
        for (headers, idle, want) in cases {
            let c = AffinityConfig {
                headers: headers.iter().map(|s| s.to_string()).collect(),
                sticky: true,
                sticky_idle_secs: *idle,
            };
            match (c.validate(), want) {
                (Ok(()), None) => {}
                (Err(e), Some(w)) => assert!(e.to_string().contains(w), "{headers:?}: {e}"),
                (r, w) => panic!("{headers:?} {idle}: {r:?}, wanted {w:?}"),
            }
        }
    }
}
