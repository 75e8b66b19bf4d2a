//! The errors of pdgate's clients towards engines: legs ([`LegError`], with what was
//! malformed in an answer as a [`ProtocolError`]), background calls ([`CallError`]) and
//! engine URLs ([`UrlError`]).
//!
//! Why typed: the dispatcher decides on the variant (a leg the engine may have read is
//! never sent again as it was, see [`LegError::engine_may_have_read`]), and logs keep the
//! whole cause. Every error keeps its cause as its `source()`.
//!
//! Convention: a message names its cause too (`"cannot resolve h:1: no address"`), so that
//! an error printed with `{}` alone is complete; [`error_chain`] prints a chain without
//! repeating a cause its error already named.

use std::io;
use std::time::Duration;

/// Why a leg failed at the transport or protocol level.
#[derive(Debug, thiserror::Error)]
pub enum LegError {
    #[error("connect to {addr} failed: {source}")]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("connect to {0} timed out after {1:?}")]
    ConnectTimeout(String, Duration),
    #[error("cannot resolve {host}: {source}")]
    Resolve {
        host: String,
        #[source]
        source: io::Error,
    },
    /// Writing the request failed before all of it was written, and no answer was there to
    /// read: the engine cannot have read the whole request.
    #[error("sending the request failed: {0}")]
    Write(#[source] io::Error),
    #[error("reading the answer failed: {0}")]
    Read(#[source] io::Error),
    /// The engine closed the connection (EOF, or a reset given as `source`) after the whole
    /// request was written and before any byte of an answer. It may have read the request
    /// and started on it, so the request is not sent again here: the same rid and bootstrap
    /// room would run twice. A caller that retries sends a new request (fresh rooms).
    ///
    /// `reused`: the connection had served an earlier leg (an engine closing a kept-alive
    /// connection just as it is reused looks like this).
    #[error(
        "the engine closed the connection without answering after the request was sent ({}){}",
        if *reused { "kept-alive connection" } else { "new connection" },
        reset_suffix(source)
    )]
    ClosedAfterWrite {
        reused: bool,
        #[source]
        source: Option<io::Error>,
    },
    #[error("the engine closed the connection before the answer was complete")]
    ClosedEarly,
    #[error("malformed answer from the engine: {0}")]
    Protocol(#[from] ProtocolError),
}

fn reset_suffix(source: &Option<io::Error>) -> String {
    source.as_ref().map_or(String::new(), |e| format!(": {e}"))
}

impl LegError {
    /// Whether the engine may have read the whole request (and may be working on it):
    /// everything that went wrong once the request was written in full. Such a request must
    /// not be sent again with the same bytes (rid, bootstrap room); connect failures and a
    /// write that failed part-way are safe to send again.
    pub fn engine_may_have_read(&self) -> bool {
        !matches!(
            self,
            LegError::Connect { .. }
                | LegError::ConnectTimeout(..)
                | LegError::Resolve { .. }
                | LegError::Write(_)
        )
    }
}

/// What was malformed in an engine's answer.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad response head: {0}")]
    Head(#[source] httparse::Error),
    #[error("bad status code {0}")]
    Status(u16),
    #[error("bad content-length {0:?}")]
    ContentLength(String),
    #[error("conflicting content-length values {0} and {1}")]
    ConflictingContentLength(u64, u64),
    #[error("response head larger than {0} bytes")]
    HeadTooLarge(usize),
    #[error("bad header name: {0}")]
    HeaderName(#[source] http::header::InvalidHeaderName),
    #[error("bad header value: {0}")]
    HeaderValue(#[source] http::header::InvalidHeaderValue),
    #[error("bad chunk size {0:?}")]
    ChunkSize(String),
    #[error("chunk-size or trailer line longer than {0} bytes")]
    ChunkLineTooLong(usize),
    #[error("chunk data not followed by CRLF")]
    ChunkDataEnd,
}

impl ProtocolError {
    /// The start of a malformed value, for a message (lossy, at most 32 bytes).
    pub(crate) fn snippet(v: &[u8]) -> String {
        snippet(v, 32)
    }
}

/// How much of an engine's answer body a message quotes.
pub const BODY_SNIPPET: usize = 200;

/// The start of what an engine sent (a body, a malformed value), for a message: at most
/// `max` bytes, lossy UTF-8, trimmed.
pub fn snippet(b: &[u8], max: usize) -> String {
    String::from_utf8_lossy(&b[..b.len().min(max)])
        .trim()
        .to_string()
}

/// Why a background call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("connect/transport error: {}", error_chain(.0))]
    Transport(#[source] hyper_util::client::legacy::Error),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("bad URL: {0}")]
    Url(#[source] http::Error),
    #[error("body read failed: {}", error_chain(&**.0))]
    Body(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The full source chain of an error, for logs and error messages. A cause that its error's
/// message already ends with (see the module's convention) is not repeated.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    if let Some(cause) = e.source() {
        let rest = error_chain(cause);
        if !s.ends_with(&rest) {
            s.push_str(": ");
            s.push_str(&rest);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_name_each_cause_once() {
        let io = || io::Error::new(io::ErrorKind::ConnectionReset, "reset by peer");
        let cases: Vec<(Box<dyn std::error::Error>, &str)> = vec![
            (
                Box::new(LegError::Connect {
                    addr: "h:1".into(),
                    source: io(),
                }),
                "connect to h:1 failed: reset by peer",
            ),
            (
                Box::new(LegError::ClosedAfterWrite {
                    reused: true,
                    source: Some(io()),
                }),
                "the engine closed the connection without answering after the request was \
                 sent (kept-alive connection): reset by peer",
            ),
            (
                Box::new(LegError::ClosedAfterWrite {
                    reused: false,
                    source: None,
                }),
                "the engine closed the connection without answering after the request was \
                 sent (new connection)",
            ),
            (
                Box::new(LegError::from(ProtocolError::ChunkDataEnd)),
                "malformed answer from the engine: chunk data not followed by CRLF",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(error_chain(&*e), want);
        }
    }

    #[test]
    fn only_what_happened_after_the_write_may_have_been_read() {
        let io = || io::Error::from(io::ErrorKind::BrokenPipe);
        let cases = [
            (LegError::Write(io()), false),
            (
                LegError::Resolve {
                    host: "h".into(),
                    source: io(),
                },
                false,
            ),
            (LegError::ConnectTimeout("h".into(), Duration::ZERO), false),
            (
                LegError::ClosedAfterWrite {
                    reused: true,
                    source: None,
                },
                true,
            ),
            (LegError::Read(io()), true),
            (LegError::ClosedEarly, true),
            (LegError::Protocol(ProtocolError::Status(42)), true),
        ];
        for (e, want) in cases {
            assert_eq!(e.engine_may_have_read(), want, "{e:?}");
        }
    }
}
