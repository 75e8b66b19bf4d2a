//! A leg's response body, read straight from its connection as it is polled.
//!
//! Framing: `Content-Length`, `Transfer-Encoding: chunked` (chunk extensions and
//! trailers are read and dropped), or read to EOF. Data frames are slices of the read
//! buffer (no copy). The body reports its end (`is_end_stream`) as soon as the bytes that
//! end it were read, even when they came with the last data, so that a caller can finish
//! the response without polling again.
//!
//! Invariants: a connection is handed back to its worker's idle list only when the body
//! ended exactly at the end of what was read and the answer allowed keep-alive; dropping
//! the body before its end closes the connection.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use tokio::net::TcpStream;

use super::conns::{poll_read_more, HostConns, LegSettings};
use super::error::{LegError, ProtocolError};

/// Longest chunk-size or trailer line accepted.
const MAX_LINE: usize = 4096;

/// How the body's end is found.
#[derive(Debug)]
pub enum Framing {
    /// This many bytes are left.
    Length(u64),
    Chunked(Chunk),
    /// Until the engine closes the connection (never reused).
    Eof,
    /// Complete.
    Done,
}

/// Where a chunked decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// This many data bytes of the current chunk are left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
}

impl Framing {
    pub(crate) fn chunked() -> Framing {
        Framing::Chunked(Chunk::Size)
    }

    #[cfg(test)]
    pub(crate) fn label(&self) -> String {
        match self {
            Framing::Length(n) => format!("len{n}"),
            Framing::Chunked(_) => "chunked".to_string(),
            Framing::Eof => "eof".to_string(),
            Framing::Done => "done".to_string(),
        }
    }
}

/// The body of a leg's answer.
pub struct LegBody {
    stream: Option<TcpStream>,
    buf: BytesMut,
    framing: Framing,
    /// Where the connection goes back when the body ends cleanly (None: close it).
    reuse: Option<(Arc<HostConns>, LegSettings)>,
    /// A framing error found before the first poll.
    error: Option<LegError>,
}

impl std::fmt::Debug for LegBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LegBody")
            .field("framing", &self.framing)
            .field("buffered", &self.buf.len())
            .finish()
    }
}

impl LegBody {
    pub(crate) fn new(
        stream: TcpStream,
        buf: BytesMut,
        framing: Framing,
        reuse: Option<(Arc<HostConns>, LegSettings)>,
    ) -> LegBody {
        let mut b = LegBody {
            stream: Some(stream),
            buf,
            framing,
            reuse,
            error: None,
        };
        if matches!(b.framing, Framing::Length(0)) {
            b.framing = Framing::Done;
        }
        if let Framing::Chunked(_) = b.framing {
            // A tiny chunked answer may already be whole.
            if let Err(e) = b.advance_chunk_meta() {
                b.error = Some(e);
                return b;
            }
        }
        if matches!(b.framing, Framing::Done) {
            b.finish();
        }
        b
    }

    /// The body ended: hand the connection back if it is clean, else close it.
    fn finish(&mut self) {
        self.framing = Framing::Done;
        let stream = self.stream.take();
        if let (Some(stream), Some((host, s))) = (stream, self.reuse.take()) {
            if self.buf.is_empty() {
                host.checkin(stream, &s);
            }
        }
        self.buf = BytesMut::new();
    }

    /// Consumes everything but data in the chunked stream that is already buffered
    /// (chunk-size lines, data CRLFs, trailers), stopping at data or at missing bytes.
    fn advance_chunk_meta(&mut self) -> Result<(), LegError> {
        loop {
            let Framing::Chunked(state) = self.framing else {
                return Ok(());
            };
            match state {
                Chunk::Data(_) => return Ok(()),
                Chunk::DataEnd => {
                    if self.buf.len() < 2 {
                        return Ok(());
                    }
                    if &self.buf[..2] != b"\r\n" {
                        return Err(ProtocolError::ChunkDataEnd.into());
                    }
                    self.buf.advance(2);
                    self.framing = Framing::Chunked(Chunk::Size);
                }
                Chunk::Size => {
                    let (size, line) = match plain_size_line(&self.buf) {
                        Some(p) => p,
                        None => {
                            let Some(i) = self.line_end()? else {
                                return Ok(());
                            };
                            (parse_chunk_size(trim_cr(&self.buf[..i]))?, i + 1)
                        }
                    };
                    self.buf.advance(line);
                    self.framing = Framing::Chunked(if size == 0 {
                        Chunk::Trailers
                    } else {
                        Chunk::Data(size)
                    });
                }
                Chunk::Trailers => {
                    let Some(i) = self.line_end()? else {
                        return Ok(());
                    };
                    let empty = trim_cr(&self.buf[..i]).is_empty();
                    self.buf.advance(i + 1);
                    if empty {
                        self.finish();
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Where the buffered line ends (its `\n`), if it is whole.
    fn line_end(&self) -> Result<Option<usize>, LegError> {
        match memchr::memchr(b'\n', &self.buf) {
            Some(i) => Ok(Some(i)),
            None if self.buf.len() > MAX_LINE => {
                Err(ProtocolError::ChunkLineTooLong(MAX_LINE).into())
            }
            None => Ok(None),
        }
    }

    /// The rest of the current chunk (`left` bytes, all buffered) and the data of every
    /// whole chunk buffered after it, as one frame: each following chunk's data is moved
    /// in place to follow the previous one, over the framing between them, so nothing is
    /// allocated. It stops before the last chunk, a size line that is not plain (see
    /// [`plain_size_line`]), or a chunk not wholly buffered; what it stops at is read as
    /// before, the framing left at the CRLF after the data taken. `None` when no chunk
    /// follows whole (the caller takes the current chunk's data alone).
    ///
    /// Why: an engine writes each event as its own chunk, and when several arrived in one
    /// read, relaying them as one frame costs the request path, the client's framing and
    /// the write once for all of them rather than once each. Nothing waits: only bytes
    /// already read are joined.
    fn merged_chunks(&mut self, left: u64) -> Option<Bytes> {
        let left = usize::try_from(left).ok()?;
        // The smallest chunk after the CRLF: `1\r\n`, a byte.
        if self.buf.len() < left.saturating_add(6) {
            return None;
        }
        let b = &mut self.buf[..];
        // `b[..w]` is the data so far; `b[r..]` is unread (it starts at a data CRLF).
        let (mut w, mut r) = (left, left);
        loop {
            if b.get(r..r + 2) != Some(b"\r\n") {
                break;
            }
            let Some((size, line)) = b.get(r + 2..).and_then(plain_size_line) else {
                break;
            };
            let start = r + 2 + line;
            let Some(end) = usize::try_from(size)
                .ok()
                .and_then(|n| start.checked_add(n))
            else {
                break;
            };
            if size == 0 || end > b.len() {
                break;
            }
            b.copy_within(start..end, w);
            w += end - start;
            r = end;
        }
        if r == left {
            return None;
        }
        let data = self.buf.split_to(w).freeze();
        self.buf.advance(r - w);
        Some(data)
    }

    /// Up to `max` buffered bytes as a frame.
    fn take_data(&mut self, max: u64) -> Bytes {
        let n = (self.buf.len() as u64).min(max) as usize;
        self.buf.split_to(n).freeze()
    }

    fn fail(&mut self, e: LegError) -> Poll<Option<Result<Frame<Bytes>, LegError>>> {
        self.framing = Framing::Done;
        self.stream = None;
        self.reuse = None;
        self.buf = BytesMut::new();
        Poll::Ready(Some(Err(e)))
    }
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// The usual chunk-size line at the start of `buf`, hex digits and CRLF, in one pass: the
/// size and the line's length. `None` for anything else (an extension, whitespace, too many
/// digits, a line not yet whole), which [`parse_chunk_size`] reads or refuses.
///
/// Why: every event of a stream is a chunk; its size line read here is a short digit loop,
/// where the general path scans for the line's end and splits it first.
fn plain_size_line(buf: &[u8]) -> Option<(u64, usize)> {
    let mut size = 0u64;
    for (i, &d) in buf.iter().enumerate() {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            b'\r' if i > 0 && buf.get(i + 1) == Some(&b'\n') => return Some((size, i + 2)),
            _ => return None,
        };
        // As many digits as `parse_chunk_size` takes.
        if i == 15 {
            return None;
        }
        size = size * 16 + u64::from(v);
    }
    None
}

fn parse_chunk_size(line: &[u8]) -> Result<u64, ProtocolError> {
    let bad = || ProtocolError::ChunkSize(ProtocolError::snippet(line));
    let digits = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(bad());
    }
    let mut n: u64 = 0;
    for &d in digits {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            _ => return Err(bad()),
        };
        n = n * 16 + u64::from(v);
    }
    Ok(n)
}

impl Body for LegBody {
    type Data = Bytes;
    type Error = LegError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, LegError>>> {
        let this = &mut *self;
        if let Some(e) = this.error.take() {
            return this.fail(e);
        }
        loop {
            match this.framing {
                Framing::Done => return Poll::Ready(None),
                Framing::Length(left) => {
                    if !this.buf.is_empty() {
                        let data = this.take_data(left);
                        let left = left - data.len() as u64;
                        this.framing = Framing::Length(left);
                        if left == 0 {
                            this.finish();
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Framing::Eof => {
                    if !this.buf.is_empty() {
                        let data = this.take_data(u64::MAX);
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Framing::Chunked(_) => {
                    if let Err(e) = this.advance_chunk_meta() {
                        return this.fail(e);
                    }
                    if let Framing::Chunked(Chunk::Data(left)) = this.framing {
                        if !this.buf.is_empty() {
                            let (data, left) = match this.merged_chunks(left) {
                                // It ends at the CRLF after its last chunk's data.
                                Some(data) => (data, 0),
                                None => {
                                    let data = this.take_data(left);
                                    let rest = left - data.len() as u64;
                                    (data, rest)
                                }
                            };
                            this.framing = Framing::Chunked(if left == 0 {
                                Chunk::DataEnd
                            } else {
                                Chunk::Data(left)
                            });
                            // Read past the chunk's end now, so that the body's end is
                            // known together with its last data.
                            if let Err(e) = this.advance_chunk_meta() {
                                return this.fail(e);
                            }
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                    }
                    if matches!(this.framing, Framing::Done) {
                        return Poll::Ready(None);
                    }
                }
            }
            // Need more bytes.
            let Some(stream) = this.stream.as_mut() else {
                return this.fail(LegError::ClosedEarly);
            };
            // What is known to follow: a large body is read a slice per call.
            let want = match this.framing {
                Framing::Length(left) | Framing::Chunked(Chunk::Data(left)) => {
                    usize::try_from(left).unwrap_or(usize::MAX)
                }
                _ => 0,
            };
            match poll_read_more(stream, &mut this.buf, want, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return this.fail(LegError::Read(e)),
                Poll::Ready(Ok(0)) => {
                    if matches!(this.framing, Framing::Eof) {
                        this.reuse = None;
                        this.finish();
                        return Poll::Ready(None);
                    }
                    return this.fail(LegError::ClosedEarly);
                }
                Poll::Ready(Ok(_)) => {}
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.error.is_none() && matches!(self.framing, Framing::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes() {
        let cases: &[(&[u8], Option<u64>)] = &[
            (b"0", Some(0)),
            (b"1a", Some(26)),
            (b"FF;ext=1", Some(255)),
            (b" 10 ", Some(16)),
            (b"", None),
            (b"xyz", None),
            (b"1234567890abcdef0", None),
        ];
        for (line, want) in cases {
            assert_eq!(parse_chunk_size(line).ok(), *want, "{line:?}");
            // The one-pass reader agrees wherever it answers.
            let mut crlf = line.to_vec();
            crlf.extend_from_slice(b"\r\n");
            if let Some((n, len)) = plain_size_line(&crlf) {
                assert_eq!(Some(n), *want, "{line:?}");
                assert_eq!(len, crlf.len());
            }
        }
        // (buffer, (size, line length))
        type Case = (&'static [u8], Option<(u64, usize)>);
        let plain: &[Case] = &[
            (b"1a\r\ndata", Some((26, 4))),
            (b"0\r\n\r\n", Some((0, 3))),
            (b"1a;x=1\r\n", None),
            (b"1a \r\n", None),
            (b"\r\n", None),
            (b"1a\r", None),
            (b"1a\n", None),
            (b"fffffffffffffff\r\n", Some((0xfff_ffff_ffff_ffff, 17))),
            (b"1000000000000000\r\n", None),
        ];
        for (buf, want) in plain {
            assert_eq!(plain_size_line(buf), *want, "{buf:?}");
        }
    }
}

#[cfg(test)]
mod props;
