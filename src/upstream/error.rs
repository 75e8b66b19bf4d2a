//! The errors of pdgate's clients towards engines: legs ([`LegError`], with what was
//! malformed in an answer as a [`ProtocolError`]), background calls ([`CallError`]) and
//! engine URLs ([`UrlError`]).
//!
//! Why typed: callers decide on the variant, and logs keep the whole cause. Every error keeps its cause as its `source()`.
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
    #[error("the engine closed the connection before answering")]
    ClosedBeforeAnswer,
    #[error("the engine closed the connection before the answer was complete")]
    ClosedEarly,
    #[error("malformed answer from the engine: {0}")]
    Protocol(#[from] ProtocolError),
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
        String::from_utf8_lossy(&v[..v.len().min(32)]).into_owned()
    }
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

/// Why an engine URL was refused (`http://host[:port][/]` only).
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("not a URL ({0})")]
    NotAUrl(#[source] http::uri::InvalidUri),
    #[error("scheme {0} is not supported, use http")]
    Scheme(String),
    #[error("missing http:// scheme")]
    MissingScheme,
    #[error("missing host")]
    MissingHost,
    #[error("a path or query is not supported; give http://host:port")]
    PathOrQuery,
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
                Box::new(LegError::from(ProtocolError::ChunkDataEnd)),
                "malformed answer from the engine: chunk data not followed by CRLF",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(error_chain(&*e), want);
        }
    }
}
