//! One engine's kept-alive connections for legs (`HostConns`, owned by the worker: see
//! `pool::WorkerShared::conns`), and reading from a leg's socket.
//!
//! Invariants:
//! - The idle list is a `Mutex<Vec<_>>` held for one push or pop, never across an await:
//!   the one lock a leg's checkout takes on the request path.
//! - A connection goes back only after its answer was read exactly to its end
//!   ([`HostConns::checkin`]); an idle one older than `idle_timeout`, or one the engine
//!   closed or wrote to unasked, is never handed out.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::net::{TcpSocket, TcpStream};

use super::error::LegError;

/// Read buffer size a leg starts with (grows for large answers).
pub(crate) const READ_CHUNK: usize = 4096;

/// Pool settings (from `[upstream]` and `[timeouts]`).
#[derive(Clone, Copy, Debug)]
pub struct LegSettings {
    pub connect_timeout: Duration,
    pub max_idle: usize,
    pub idle_timeout: Duration,
}

struct Idle {
    stream: TcpStream,
    since: Instant,
}

/// One engine's kept-alive connections for legs.
pub struct HostConns {
    host: String,
    port: u16,
    /// Parsed once when the host is an IP literal (no resolver on the request path).
    ip: Option<SocketAddr>,
    /// The `Host` header value.
    pub(super) authority: String,
    idle: Mutex<Vec<Idle>>,
}

impl std::fmt::Debug for HostConns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostConns")
            .field("authority", &self.authority)
            .field("idle", &self.idle_count())
            .finish()
    }
}

impl HostConns {
    pub fn new(url: &super::BaseUrl) -> HostConns {
        let host = url.host().to_string();
        let port = url.port();
        let ip = host
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, port));
        // `http://host:port` with IPv6 hosts bracketed: the rest is the Host header.
        let authority = url
            .as_str()
            .strip_prefix("http://")
            .unwrap_or(url.as_str())
            .to_string();
        HostConns {
            host,
            port,
            ip,
            authority,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().map_or(0, |v| v.len())
    }

    /// Closes idle connections older than `idle_timeout` (called from background loops).
    pub fn sweep(&self, idle_timeout: Duration) {
        let now = Instant::now();
        if let Ok(mut idle) = self.idle.lock() {
            idle.retain(|c| now.duration_since(c.since) < idle_timeout);
        }
    }

    /// The most recently used idle connection that still looks alive.
    pub(super) fn checkout(&self, s: &LegSettings) -> Option<TcpStream> {
        loop {
            let c = self.idle.lock().ok()?.pop()?;
            if c.since.elapsed() >= s.idle_timeout {
                continue;
            }
            if looks_alive(&c.stream) {
                return Some(c.stream);
            }
        }
    }

    /// Returns a connection whose answer was read exactly to its end.
    pub(crate) fn checkin(&self, stream: TcpStream, s: &LegSettings) {
        let Ok(mut idle) = self.idle.lock() else {
            return;
        };
        if idle.len() < s.max_idle {
            idle.push(Idle {
                stream,
                since: Instant::now(),
            });
        }
    }

    /// A new connection (TCP_NODELAY, keep-alive probes), within the connect timeout. A
    /// host name is resolved here (only new connections pay for it) and each of its
    /// addresses is tried in turn.
    pub(super) async fn connect(&self, s: &LegSettings) -> Result<TcpStream, LegError> {
        let addrs: Vec<SocketAddr> = match self.ip {
            Some(a) => vec![a],
            None => tokio::net::lookup_host((self.host.as_str(), self.port))
                .await
                .map_err(|source| LegError::Resolve {
                    host: self.authority.clone(),
                    source,
                })?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(LegError::Resolve {
                host: self.authority.clone(),
                source: io::Error::new(io::ErrorKind::NotFound, "no address"),
            });
        }
        let connect = async {
            let mut last = io::Error::other("no address");
            for addr in addrs {
                let sock = if addr.is_ipv4() {
                    TcpSocket::new_v4()?
                } else {
                    TcpSocket::new_v6()?
                };
                sock.set_nodelay(true)?;
                sock.set_keepalive(true)?;
                match sock.connect(addr).await {
                    Ok(stream) => return Ok(stream),
                    Err(e) => last = e,
                }
            }
            Err(last)
        };
        match tokio::time::timeout(s.connect_timeout, connect).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(source)) => Err(LegError::Connect {
                addr: self.authority.clone(),
                source,
            }),
            Err(_) => Err(LegError::ConnectTimeout(
                self.authority.clone(),
                s.connect_timeout,
            )),
        }
    }
}

/// Whether an idle connection can be reused: the engine has not closed it (EOF) nor sent
/// anything unasked. Costs no syscall unless the socket was reported readable.
fn looks_alive(stream: &TcpStream) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    match stream.poll_read_ready(&mut cx) {
        Poll::Pending => true,
        Poll::Ready(Err(_)) => false,
        Poll::Ready(Ok(())) => {
            let mut probe = [0u8; 1];
            matches!(stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
        }
    }
}

/// Reads more bytes into `buf` (growing it when full); 0 means EOF.
pub(crate) async fn read_more(stream: &mut TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    std::future::poll_fn(|cx| poll_read_more(stream, buf, READ_CHUNK, cx)).await
}

/// Reads more bytes into `buf`, with room for at least `want` of them (clamped to
/// [`READ_CHUNK`]..=[`crate::body::SLICE_BYTES`]) when less than a quarter of that is
/// spare. A stream's events are small and come one by one: [`READ_CHUNK`]. A body known to
/// be large (a prefill's answer with a long prompt's logprobs, megabytes) is read a slice
/// per call, where 4 KiB reads cost a syscall, a frame and a copy per 4 KiB.
pub(crate) fn poll_read_more(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    want: usize,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    make_room(buf, want);
    tokio_util::io::poll_read_buf(std::pin::Pin::new(stream), cx, buf)
}

/// Grows `buf` for a read of about `want` bytes (see [`poll_read_more`]).
fn make_room(buf: &mut BytesMut, want: usize) {
    let want = want.clamp(READ_CHUNK, crate::body::SLICE_BYTES);
    let spare = buf.capacity() - buf.len();
    if spare < want / 4 {
        buf.reserve(buf.len().max(want));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_sized_by_what_is_known_to_follow() {
        // (bytes already buffered, capacity, what follows) -> least spare room after.
        let cases: &[(usize, usize, usize, usize)] = &[
            // A stream's small event: a 4 KiB read.
            (0, 0, 120, READ_CHUNK),
            (0, 0, 0, READ_CHUNK),
            // A large answer: a slice per read, never more.
            (0, 0, 3 << 20, crate::body::SLICE_BYTES),
            (0, 0, 100_000, 100_000),
            // Enough room already: no growth.
            (0, READ_CHUNK, 10, READ_CHUNK),
            // Some bytes held: room for the read beside them.
            (1000, 4096, 1 << 20, crate::body::SLICE_BYTES),
        ];
        for &(len, cap, want, least) in cases {
            let mut buf = BytesMut::with_capacity(cap);
            buf.resize(len, b'x');
            make_room(&mut buf, want);
            let spare = buf.capacity() - buf.len();
            assert!(spare >= least, "{len} {cap} {want}: {spare} < {least}");
            assert!(
                spare <= least.max(READ_CHUNK) * 2 + len,
                "{len} {cap} {want}: {spare} is more than a read needs"
            );
            assert_eq!(buf.len(), len, "held bytes are kept");
        }
    }
}
