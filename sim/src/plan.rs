//! What a role decided for one request instance before its first token ([`Plan`]): how
//! many tokens, at what pace, and whether to cut the stream part-way.
//!
//! Why a module of its own: [`crate::prefill`] and [`crate::decode`] make it and
//! [`crate::run`] (which calls them) carries it out; apart, neither side depends back on
//! the other.

use std::time::Duration;

/// What the role decided before the first token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    pub tokens: u32,
    pub ttft: Duration,
    pub itl: Duration,
    /// Cut the connection after this many chunks (decode fault).
    pub die_after: Option<u32>,
    /// What the answer reports as `cached_tokens`: the prompt tokens the prefill's prefix
    /// cache held (on a decode, those of the prefill that sent the KV, as SGLang does).
    pub cached_tokens: u32,
}
