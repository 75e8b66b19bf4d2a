//! Shared helpers of the leg-client tests (`upstream_legs`, `upstream_leg_errors`):
//! hand-written HTTP/1.1 servers on real sockets and client-side shorthands.

pub use std::future::Future;
pub use std::net::SocketAddr;
pub use std::sync::atomic::{AtomicUsize, Ordering};
pub use std::sync::Arc;
pub use std::time::Duration;

pub use http::header::{AUTHORIZATION, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HOST};
pub use http::{HeaderMap, HeaderValue, Response};
pub use http_body_util::BodyExt;
pub use hyper::body::Body;
pub use pdgate::config::UpstreamConfig;
pub use pdgate::upstream::{
    error_chain, header_lines, parse_base_url, CallError, HostConns, LegBody, LegError, LegRequest,
    ProtocolError, Upstream,
};
pub use tokio::io::{AsyncReadExt, AsyncWriteExt};
pub use tokio::net::{TcpListener, TcpStream};
pub use tokio::sync::mpsc;
pub use tokio::task::JoinHandle;

pub const OK2: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
pub const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";

pub async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(5), f)
        .await
        .expect("test timed out")
}

// ---------------------------------------------------------------- server side

#[derive(Debug)]
pub enum Ev {
    Req(usize),
    Closed(usize),
}

#[derive(Debug)]
pub struct Req {
    pub head: String,
    pub body: Vec<u8>,
}

impl Req {
    /// The values of a header, in order.
    pub fn values(&self, name: &str) -> Vec<&str> {
        self.head
            .split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
            .collect()
    }
}

/// The server's side of one connection.
pub struct Conn {
    pub i: usize,
    pub s: TcpStream,
    pub buf: Vec<u8>,
    pub ev: Option<mpsc::UnboundedSender<Ev>>,
}

impl Conn {
    pub fn new(i: usize, s: TcpStream, ev: Option<mpsc::UnboundedSender<Ev>>) -> Conn {
        Conn {
            i,
            s,
            buf: Vec::new(),
            ev,
        }
    }

    pub fn emit(&self, e: Ev) {
        if let Some(tx) = &self.ev {
            let _ = tx.send(e);
        }
    }

    /// Reads one request (head and content-length body); `None` once the client closed
    /// (EOF or reset), which is also reported as `Ev::Closed`.
    pub async fn request(&mut self) -> Option<Req> {
        let end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            if !self.fill().await {
                return None;
            }
        };
        let head = String::from_utf8(self.buf.drain(..end).collect()).expect("utf-8 head");
        let mut req = Req { head, body: vec![] };
        let len: usize = req
            .values("content-length")
            .first()
            .map_or(0, |v| v.parse().unwrap());
        while self.buf.len() < len {
            if !self.fill().await {
                return None;
            }
        }
        req.body = self.buf.drain(..len).collect();
        self.emit(Ev::Req(self.i));
        Some(req)
    }

    pub async fn fill(&mut self) -> bool {
        let mut b = vec![0u8; 64 * 1024];
        match self.s.read(&mut b).await {
            Ok(n) if n > 0 => {
                self.buf.extend_from_slice(&b[..n]);
                true
            }
            _ => {
                self.emit(Ev::Closed(self.i));
                false
            }
        }
    }

    pub async fn send(&mut self, b: &[u8]) {
        let _ = self.s.write_all(b).await;
    }

    /// Reads one request's head only (its body is left unread); false once the client
    /// closed.
    pub async fn head_only(&mut self) -> bool {
        while !self.buf.windows(4).any(|w| w == b"\r\n\r\n") {
            if !self.fill().await {
                return false;
            }
        }
        true
    }

    /// Closes the connection (FIN, or RST when `reset`); `Ev::Closed` is sent once the
    /// socket is closed.
    pub fn close(self, reset: bool) {
        if reset {
            let _ = self.s.set_zero_linger();
        }
        let (i, ev) = (self.i, self.ev.clone());
        drop(self);
        if let Some(tx) = ev {
            let _ = tx.send(Ev::Closed(i));
        }
    }

    /// Answers every request with `answer` until the client closes.
    pub async fn answer_all(mut self, answer: &[u8]) {
        while self.request().await.is_some() {
            self.send(answer).await;
        }
    }
}

/// A counting server: `handler` runs for each accepted connection.
pub struct Server {
    pub host: Arc<HostConns>,
    pub accepted: Arc<AtomicUsize>,
    pub ev: mpsc::UnboundedReceiver<Ev>,
    /// Connection index of each request seen (while waiting for closes too).
    pub reqs: Vec<usize>,
    pub task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
    /// Waits for the next connection the client closed.
    pub async fn closed(&mut self) -> usize {
        loop {
            match self.ev.recv().await.expect("server alive") {
                Ev::Closed(i) => return i,
                Ev::Req(i) => self.reqs.push(i),
            }
        }
    }
    /// The connection index of each request received so far.
    pub fn request_conns(&mut self) -> Vec<usize> {
        while let Ok(e) = self.ev.try_recv() {
            if let Ev::Req(i) = e {
                self.reqs.push(i);
            }
        }
        std::mem::take(&mut self.reqs)
    }
}

pub async fn serve<F, Fut>(handler: F) -> Server
where
    F: Fn(Conn) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let (tx, ev) = mpsc::unbounded_channel();
    let n = accepted.clone();
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let i = n.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(handler(Conn::new(i, s, Some(tx.clone()))));
        }
    });
    Server {
        host: host_for(addr),
        accepted,
        ev,
        reqs: vec![],
        task,
    }
}

/// A listener the test accepts on itself.
pub struct Manual {
    pub listener: TcpListener,
    pub up: Upstream,
    pub host: Arc<HostConns>,
}

impl Manual {
    pub async fn new() -> Manual {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = host_for(listener.local_addr().unwrap());
        Manual {
            listener,
            up: upstream(|_| {}),
            host,
        }
    }
    pub async fn accept(&self) -> Conn {
        Conn::new(0, self.listener.accept().await.unwrap().0, None)
    }
    pub fn spawn(&self, body: &[u8]) -> JoinHandle<Result<Response<LegBody>, LegError>> {
        spawn_leg(&self.up, &self.host, leg(&self.host, body))
    }
    /// Sends `req` on a new connection, reads it, writes `answer` (then FIN if `close`)
    /// and returns the connection, the request and the leg's result.
    pub async fn exchange(&self, req: LegRequest, answer: &[u8], close: bool) -> Exchange {
        let pending = spawn_leg(&self.up, &self.host, req);
        let mut c = self.accept().await;
        let r = c.request().await.expect("request");
        c.send(answer).await;
        if close {
            c.s.shutdown().await.unwrap();
        }
        (c, r, pending.await.unwrap())
    }
}

pub type Exchange = (Conn, Req, Result<Response<LegBody>, LegError>);

// ---------------------------------------------------------------- client side

/// Returns once this runtime's I/O driver has polled the kernel after the call: a loopback
/// connect, whose readiness the driver must fetch. Readiness that arrived before (an engine's
/// close of an idle connection, on loopback delivered by the close itself) is then known to
/// tokio, so a test can wait for "the client has seen the close" without sleeping.
pub async fn reactor_turn() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
    a.unwrap();
    b.unwrap();
}

pub fn upstream(tweak: impl FnOnce(&mut UpstreamConfig)) -> Upstream {
    let mut cfg = pdgate::config::Config::default();
    tweak(&mut cfg.upstream);
    Upstream::new(&pdgate::router::upstream_settings(&cfg))
}

pub fn host_for(addr: SocketAddr) -> Arc<HostConns> {
    Arc::new(HostConns::new(
        &parse_base_url(&format!("http://{addr}")).unwrap(),
    ))
}

pub fn leg(host: &HostConns, body: &[u8]) -> LegRequest {
    LegRequest::post_json(host, "/generate", body.to_vec(), b"")
}

pub fn spawn_leg(
    up: &Upstream,
    host: &Arc<HostConns>,
    req: LegRequest,
) -> JoinHandle<Result<Response<LegBody>, LegError>> {
    let (up, host) = (up.clone(), host.clone());
    tokio::spawn(async move { up.send_leg(&host, &req).await })
}

pub async fn body_bytes(resp: Response<LegBody>) -> Vec<u8> {
    resp.into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec()
}

/// One whole leg: status and body.
pub async fn call(up: &Upstream, host: &Arc<HostConns>) -> Result<(u16, Vec<u8>), LegError> {
    let resp = up.send_leg(host, &leg(host, b"{}")).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes().to_vec();
    Ok((status, body))
}

/// Data frames until `n` bytes were read, the body ended, or an error.
pub async fn data_until(body: &mut LegBody, n: usize) -> Result<Vec<u8>, LegError> {
    let mut got = Vec::new();
    while got.len() < n {
        match body.frame().await {
            Some(Ok(f)) => got.extend_from_slice(&f.into_data().expect("data frame")),
            Some(Err(e)) => return Err(e),
            None => break,
        }
    }
    Ok(got)
}

/// Writes `bytes` in pieces of `piece` bytes, yielding between writes so that the client
/// sees them in many small reads.
pub async fn trickle(s: &mut TcpStream, bytes: Option<(Vec<u8>, usize)>) {
    let Some((bytes, piece)) = bytes else { return };
    for p in bytes.chunks(piece) {
        let _ = s.write_all(p).await;
        tokio::task::yield_now().await;
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum At {
    Send,
    Body,
}

pub fn protocol(e: &LegError) -> bool {
    matches!(e, LegError::Protocol(_))
}
pub fn closed_early(e: &LegError) -> bool {
    matches!(e, LegError::ClosedEarly)
}
