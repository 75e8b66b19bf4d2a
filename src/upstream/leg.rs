//! The lean HTTP/1.1 client that carries request legs to engines.
//!
//! Why not hyper's client here: a leg is one POST and one answer on a kept-alive
//! connection, and the request path should pay for nothing else. hyper-util's pooled
//! client spends, per request, a pool checkout keyed by a hashed URI, a dispatch channel
//! (with its own allocation blocks) into a per-connection task, a oneshot back, and
//! 16 KB of buffers per idle connection. Here the request's own future drives its socket:
//! it writes the head and body in one `writev` (the body's pieces point into the client's
//! body: no copy, see [`Payload`]), parses the answer's head with `httparse`,
//! and hands back a [`LegBody`] that reads the socket directly as the response body is
//! polled. No task, no channel, no buffer kept on idle connections.
//! (Background calls — bootstrap polls, health, aborts — still use hyper's client.)
//!
//! Invariants:
//! - A connection goes back to its worker's idle list only after its answer was read to
//!   the end, exactly (no extra bytes), with HTTP/1.1 keep-alive. Anything else closes it.
//! - Dropping the send future or the [`LegBody`] closes the connection at once, which is
//!   how an engine learns the leg was cancelled.
//! - A request that an engine may have read is never sent again with the same bytes (the
//!   same rid and bootstrap room would run twice). It is sent once more, on a new
//!   connection, only when the engine cannot have read all of it: a kept-alive connection
//!   seen closed before the write is not used, and one whose write failed part-way (with
//!   no answer to read) is replaced. Once the request was written whole, an EOF or reset
//!   before any byte of an answer is [`LegError::ClosedAfterWrite`]; the dispatcher retries,
//!   if at all, with a fresh pair and fresh rooms. So that this stays rare, idle connections
//!   are kept at most `upstream.pool_idle_timeout_secs` (4 s), below the engines' keep-alive
//!   (uvicorn's `timeout_keep_alive=5` in SGLang and vLLM).
//! - An engine's answer is reported even when it came before the engine read the whole
//!   request (a 413 or 400, then a close): a failed write first reads what is there.
//! - Framing follows RFC 9112 §6.3: Transfer-Encoding wins over Content-Length, and such a
//!   length is not kept in the headers handed on.
//! - Nothing in here panics on what an engine sends: malformed heads, bad chunk sizes and
//!   early EOFs are errors.
//!
//! Known limits: an idle connection is judged alive from tokio's readiness (no syscall), so
//! a close the runtime has not yet seen is found only by the leg written into it (then
//! `ClosedAfterWrite { reused: true }`), and an engine that sends something unasked (a 408,
//! say) just before the connection is reused can have it read as the answer; an engine
//! that answers early but neither reads the rest of the request nor closes leaves the write
//! waiting until the leg's deadline; chunk data followed by a bad CRLF in the same read is
//! dropped with the error.
//!
//! The idle connections are the worker's ([`super::conns::HostConns`]), so no map is
//! looked up per request; their list's lock is the one a leg's checkout takes.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use tokio::net::TcpStream;

use super::conns::{read_more, HostConns, LegSettings, READ_CHUNK};
use super::error::{LegError, ProtocolError};
use super::leg_body::{Framing, LegBody};
use super::payload::Payload;

/// Largest response head accepted from an engine.
const MAX_HEAD: usize = 64 * 1024;
/// Most headers accepted in a response head.
const MAX_HEADERS: usize = 64;
/// How long an answer is awaited after writing the request failed (see `early_answer`).
const EARLY_ANSWER_WAIT: Duration = Duration::from_millis(200);

/// A leg ready to send: its request head (request line and headers) and its body (pieces
/// of the client's body and pdgate's own fields, written without a copy).
pub struct LegRequest {
    pub head: Vec<u8>,
    pub body: Payload,
    /// Whether the answer's headers are wanted (else only status and body are read).
    pub keep_headers: bool,
    /// The rate a large body is written at past its first slice
    /// (`server.large_body_bytes_per_sec`; `None`: as fast as the socket takes it).
    pub rate: Option<Arc<crate::body::ByteRate>>,
}

impl LegRequest {
    /// `POST path` with a JSON body and the forwarded header lines (`name: value\r\n`
    /// each, see [`header_lines`]).
    pub fn post_json(
        host: &HostConns,
        path: &str,
        body: impl Into<Payload>,
        fwd: &[u8],
    ) -> LegRequest {
        let body = body.into();
        let mut head = Vec::with_capacity(160 + path.len());
        head.extend_from_slice(b"POST ");
        head.extend_from_slice(path.as_bytes());
        head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        head.extend_from_slice(host.authority.as_bytes());
        head.extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
        head.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        head.extend_from_slice(b"\r\n");
        head.extend_from_slice(fwd);
        head.extend_from_slice(b"\r\n");
        LegRequest {
            head,
            body,
            keep_headers: true,
            rate: None,
        }
    }
}

impl LegRequest {
    /// Adds a header line (`name: value`) to the head, before its blank line: a leg's
    /// own `traceparent`. The value must be a valid header value.
    pub fn push_header(&mut self, name: &str, value: &[u8]) {
        let end = self.head.len().saturating_sub(2);
        self.head.truncate(end);
        self.head.extend_from_slice(name.as_bytes());
        self.head.extend_from_slice(b": ");
        self.head.extend_from_slice(value);
        self.head.extend_from_slice(b"\r\n\r\n");
    }
}

/// Serializes headers to forward on legs as `name: value\r\n` lines, once per request.
/// Headers that framing owns (host, length, type, transfer-encoding, connection) are
/// skipped: the leg writes its own.
pub fn header_lines<'a>(
    headers: impl IntoIterator<Item = (&'a HeaderName, &'a HeaderValue)>,
    out: &mut Vec<u8>,
) {
    for (k, v) in headers {
        if k == http::header::HOST
            || k == http::header::CONTENT_LENGTH
            || k == http::header::CONTENT_TYPE
            || k == http::header::TRANSFER_ENCODING
            || k == http::header::CONNECTION
        {
            continue;
        }
        out.extend_from_slice(k.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// Sends `req` to `host` and reads the answer's head; the body streams from the returned
/// [`LegBody`].
///
/// A request is sent a second time (on a new connection) only when the engine cannot have
/// read all of it: writing it on a kept-alive connection failed part-way and no answer was
/// there. Everything else is the caller's to decide (see [`LegError::engine_may_have_read`]).
pub async fn send(
    host: &Arc<HostConns>,
    s: &LegSettings,
    req: &LegRequest,
) -> Result<Response<LegBody>, LegError> {
    if let Some(stream) = host.checkout(s) {
        match exchange(stream, host, s, req, true).await {
            // The engine had closed the idle connection: it has not read this request.
            Err(LegError::Write(_)) => {
                metrics::counter!(crate::telemetry::STALE_RETRIES).increment(1);
            }
            other => return other,
        }
    }
    let stream = host.connect(s).await?;
    exchange(stream, host, s, req, false).await
}

/// Writes the request on `stream` (a kept-alive one when `reused`) and reads the answer's
/// head.
async fn exchange(
    mut stream: TcpStream,
    host: &Arc<HostConns>,
    s: &LegSettings,
    req: &LegRequest,
    reused: bool,
) -> Result<Response<LegBody>, LegError> {
    let rate = req.rate.as_deref();
    if let Err(e) = super::payload::write_all(&mut stream, &req.head, &req.body, rate).await {
        return match early_answer(&mut stream, req.keep_headers).await {
            Some((parts, buf)) => Ok(build(parts, buf, stream, host, s)),
            None => Err(LegError::Write(e)),
        };
    }
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let parts = read_head(&mut stream, &mut buf, req.keep_headers, reused).await?;
    Ok(build(parts, buf, stream, host, s))
}

/// The answer of an engine that answered before it had read the whole request (a 413 or a
/// 400 on the head alone) and closed, read after writing the request failed: that answer
/// says more than the write's reset. What the engine sent before its close is already here
/// (TCP delivers it before the reset), so this waits at most [`EARLY_ANSWER_WAIT`]; no
/// answer, or a broken one, leaves the write's error as the leg's. The connection is never
/// reused: the request was not written whole.
async fn early_answer(stream: &mut TcpStream, keep_headers: bool) -> Option<(Parts, BytesMut)> {
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let read = read_head(stream, &mut buf, keep_headers, false);
    let mut parts = tokio::time::timeout(EARLY_ANSWER_WAIT, read)
        .await
        .ok()?
        .ok()?;
    parts.keep_alive = false;
    Some((parts, buf))
}

/// Reads until the final answer's head is whole (1xx heads are skipped); what follows it
/// stays in `buf`. An EOF or reset before any byte of an answer is
/// [`LegError::ClosedAfterWrite`].
async fn read_head(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    keep_headers: bool,
    reused: bool,
) -> Result<Parts, LegError> {
    let mut answered = false;
    loop {
        // Nothing to parse before the first read.
        let head = if buf.is_empty() {
            Head::Partial
        } else {
            parse_head(buf, keep_headers)?
        };
        match head {
            Head::Done(parts) => return Ok(parts),
            // 1xx: the real answer follows (maybe already in `buf`).
            Head::Informational => continue,
            Head::Partial => {
                if buf.len() > MAX_HEAD {
                    return Err(ProtocolError::HeadTooLarge(MAX_HEAD).into());
                }
                match read_more(stream, buf).await {
                    Ok(0) if !answered => {
                        return Err(LegError::ClosedAfterWrite {
                            reused,
                            source: None,
                        })
                    }
                    Ok(0) => return Err(LegError::ClosedEarly),
                    Ok(_) => answered = true,
                    Err(e) if !answered && is_reset(&e) => {
                        return Err(LegError::ClosedAfterWrite {
                            reused,
                            source: Some(e),
                        })
                    }
                    Err(e) => return Err(LegError::Read(e)),
                }
            }
        }
    }
}

/// Whether a read error is the engine closing the connection (a reset).
fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
    )
}

/// A parsed response head (without hop-by-hop headers).
pub(crate) struct Parts {
    status: StatusCode,
    headers: HeaderMap,
    framing: Framing,
    keep_alive: bool,
}

enum Head {
    Partial,
    Informational,
    Done(Parts),
}

/// Parses one response head at the front of `buf`; on success the head's bytes are taken
/// off `buf` (what remains is body). Headers are kept only when asked for (decode's are
/// re-sent to the client; the prefill's are not needed), without the hop-by-hop ones and
/// without a Content-Length that came with a Transfer-Encoding.
fn parse_head(buf: &mut BytesMut, keep_headers: bool) -> Result<Head, LegError> {
    // Header slots left uninitialized (a 64-slot array is 2 KiB to fill otherwise).
    let mut hs = [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, &mut hs)
    {
        Ok(httparse::Status::Complete(n)) if n > MAX_HEAD => {
            return Err(ProtocolError::HeadTooLarge(MAX_HEAD).into())
        }
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(Head::Partial),
        Err(e) => return Err(ProtocolError::Head(e).into()),
    };
    let code = resp.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| ProtocolError::Status(code))?;
    let http11 = resp.version == Some(1);
    // Where each header's name and value sit in the head (no allocation per header).
    let mut spans: smallvec::SmallVec<[(u32, u32, u32, u32); 16]> = smallvec::SmallVec::new();
    let base = buf.as_ptr() as usize;
    let mut chunked = false;
    let mut te = false;
    let mut length: Option<u64> = None;
    let (mut said_close, mut said_keep_alive) = (false, false);
    for h in resp.headers.iter() {
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            // The lines combine into one list (RFC 9110 §5.3); empty elements do not count,
            // so a line without any leaves the last coding as it was.
            te = true;
            if let Some(last) = last_token(h.value) {
                chunked = last.eq_ignore_ascii_case(b"chunked");
            }
        } else if name.eq_ignore_ascii_case(b"content-length") {
            // Digits only (`u64::from_str` would take a sign).
            let v = h.value.trim_ascii();
            let n = (!v.is_empty() && v.iter().all(u8::is_ascii_digit))
                .then(|| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| ProtocolError::ContentLength(ProtocolError::snippet(v)))?;
            if let Some(l) = length.filter(|&l| l != n) {
                return Err(ProtocolError::ConflictingContentLength(l, n).into());
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case(b"connection") {
            // Any `close` closes (RFC 9112 §9.3); HTTP/1.0 stays open only on keep-alive.
            if has_token(h.value, b"close") {
                said_close = true;
            } else if has_token(h.value, b"keep-alive") {
                said_keep_alive = true;
            }
        }
        if keep_headers && !is_hop_by_hop(name) {
            // Offsets fit: the head is at most MAX_HEAD bytes.
            let n0 = (name.as_ptr() as usize - base) as u32;
            let v0 = (h.value.as_ptr() as usize - base) as u32;
            spans.push((n0, n0 + name.len() as u32, v0, v0 + h.value.len() as u32));
        }
    }
    if status.is_informational() && code != 101 {
        buf.advance(len);
        return Ok(Head::Informational);
    }
    let headers = if keep_headers {
        let raw = buf.split_to(len).freeze();
        // Room for the x-request-id the answer to the client gets.
        let mut headers = HeaderMap::with_capacity(spans.len() + 1);
        for &(n0, n1, v0, v1) in &spans {
            let (n0, n1, v0, v1) = (n0 as usize, n1 as usize, v0 as usize, v1 as usize);
            let name = HeaderName::from_bytes(&raw[n0..n1]).map_err(ProtocolError::HeaderName)?;
            // Transfer-Encoding frames the body; a length beside it is not passed on
            // (RFC 9112 §6.3).
            if te && name == http::header::CONTENT_LENGTH {
                continue;
            }
            let v = HeaderValue::from_maybe_shared(raw.slice(v0..v1))
                .map_err(ProtocolError::HeaderValue)?;
            headers.append(name, v);
        }
        headers
    } else {
        buf.advance(len);
        HeaderMap::new()
    };
    let mut close = said_close || (!http11 && !said_keep_alive);
    let framing = if code == 204 || code == 304 || code == 101 {
        Framing::Done
    } else if te {
        if chunked {
            Framing::chunked()
        } else {
            close = true;
            Framing::Eof
        }
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        close = true;
        Framing::Eof
    };
    Ok(Head::Done(Parts {
        status,
        headers,
        framing,
        keep_alive: !close && code != 101,
    }))
}

fn build(
    p: Parts,
    buf: BytesMut,
    stream: TcpStream,
    host: &Arc<HostConns>,
    s: &LegSettings,
) -> Response<LegBody> {
    let body = LegBody::new(
        stream,
        buf,
        p.framing,
        p.keep_alive.then(|| (host.clone(), *s)),
    );
    let mut resp = Response::new(body);
    *resp.status_mut() = p.status;
    *resp.headers_mut() = p.headers;
    resp
}

/// Headers that describe one connection (RFC 9110 §7.6.1): never kept from a leg's
/// answer, whose framing [`LegBody`] has already handled.
fn is_hop_by_hop(name: &[u8]) -> bool {
    const HOP: [&[u8]; 8] = [
        b"connection",
        b"transfer-encoding",
        b"keep-alive",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"proxy-authenticate",
    ];
    HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
}

fn tokens(v: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    v.split(|&b| b == b',').map(|t| t.trim_ascii())
}

fn has_token(v: &[u8], tok: &[u8]) -> bool {
    tokens(v).any(|t| t.eq_ignore_ascii_case(tok))
}

fn last_token(v: &[u8]) -> Option<&[u8]> {
    tokens(v).rfind(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(s: &str) -> Result<Head, LegError> {
        let mut b = BytesMut::from(s.as_bytes());
        parse_head(&mut b, true)
    }

    #[test]
    fn heads_table() {
        let cases: &[(&str, &str)] = &[
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
                "200 len5 ka",
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                "200 chunked ka",
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                "200 chunked ka",
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
                "200 eof close",
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", "200 eof close"),
            ("HTTP/1.1 204 No Content\r\n\r\n", "204 done ka"),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n",
                "200 len2 close",
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n",
                "200 len2 close",
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n",
                "200 len2 ka",
            ),
            ("HTTP/1.1 100 Continue\r\n\r\n", "1xx"),
            ("HTTP/1.1 200 OK\r\ncontent-le", "partial"),
            ("HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", "err"),
            ("HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n", "err"),
            (
                "HTTP/1.1 200 OK\r\ncontent-length:  7 \r\n\r\n",
                "200 len7 ka",
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
                "err",
            ),
            ("garbage\r\n\r\n", "err"),
            ("HTTP/1.1 099 What\r\n\r\n", "err"),
            ("HTTP/1.1 999 What\r\n\r\n", "999 eof close"),
        ];
        for (input, want) in cases {
            let got = match head(input) {
                Ok(Head::Partial) => "partial".to_string(),
                Ok(Head::Informational) => "1xx".to_string(),
                Err(_) => "err".to_string(),
                Ok(Head::Done(p)) => format!(
                    "{} {} {}",
                    p.status.as_u16(),
                    p.framing.label(),
                    if p.keep_alive { "ka" } else { "close" }
                ),
            };
            assert_eq!(&got, want, "{input:?}");
        }
    }

    #[test]
    fn header_values_survive_the_split() {
        let mut b = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-A: 1\r\n\r\nbody"[..],
        );
        let Ok(Head::Done(p)) = parse_head(&mut b, true) else {
            panic!("not parsed")
        };
        assert_eq!(p.headers["content-type"], "text/event-stream");
        assert_eq!(p.headers["x-a"], "1");
        assert_eq!(&b[..], b"body");
    }

    #[test]
    fn request_head_is_well_formed() {
        let url = super::super::parse_base_url("http://[::1]:8000").unwrap();
        let host = HostConns::new(&url);
        let mut fwd = HeaderMap::new();
        fwd.insert("x-request-id", HeaderValue::from_static("abc"));
        fwd.insert("content-length", HeaderValue::from_static("999"));
        let mut lines = Vec::new();
        header_lines(&fwd, &mut lines);
        let r = LegRequest::post_json(&host, "/generate", b"{}".to_vec(), &lines);
        assert_eq!(
            std::str::from_utf8(&r.head).unwrap(),
            "POST /generate HTTP/1.1\r\nhost: [::1]:8000\r\ncontent-type: application/json\r\ncontent-length: 2\r\nx-request-id: abc\r\n\r\n"
        );
    }
}

#[cfg(test)]
mod props;
