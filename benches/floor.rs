//! The floor under router CPU per request: what a PD forwarder that does nothing but move
//! bytes costs on this machine, measured beside pdgate in the same run.
//!
//! Issue 2's CPU targets are 0.04 ms per non-streamed request. At concurrency 1 a router
//! sleeps and wakes for each of the client's request, the prefill's answer and the decode's
//! answer, and makes at least 3 writes and 3 reads; all of that is kernel time, paid by any
//! router. This bench measures how much of the target that floor takes, with three targets,
//! each its own process, driven by the same closed-loop keep-alive client:
//! - `raw`: a null forwarder on bare tokio (current-thread runtime, mimalloc). It reads a
//!   content-length-framed request, writes the two legs (the client's body plus the
//!   bootstrap fields) on its own kept-alive upstream connections, reads both answers and
//!   writes decode's body back. No JSON parsing, policy, timers, metrics or request ids.
//! - `hyper`: the same legs behind pdgate's front-door configuration (hyper-util's auto
//!   builder, HTTP/1 keep-alive, header-read timer, current-thread runtime, mimalloc).
//! - `pdgate`: `pdgate serve` with its defaults.
//!
//! The targets take turns, round after round, so that a drift in the VM's speed hits all
//! of them alike; the report gives every round and each target's median. CPU is the
//! scheduler's exact count (`/proc/<pid>/task/*/schedstat`); the user/sys split beside it
//! is sampled at the clock tick, like the `load` bench's figures.
//!
//! Run: `cargo build --release --bin pdgate && cargo bench --bench floor`
//! (`PDGATE_BENCH_QUICK=1` for one short round; `PDGATE_FLOOR_ROUNDS=N` to set the rounds;
//! `PDGATE_FLOOR_ONLY=generate` or `chat` for one route; `PDGATE_FLOOR_TOKENS=N` for
//! answers of N tokens, 4 by default). To compare builds and peers in the same run:
//! `PDGATE_FLOOR_ALSO=name=/path/to/pdgate,...` adds more pdgate binaries (each judged
//! against the same forwarder, round by round); `PDGATE_FLOOR_PEER='name=command'` adds
//! another router, started with `{port}`, `{prefill}`, `{bootstrap}` and `{decode}`
//! replaced (e.g. SGLang's router: `sglang-router=python -m sglang_router.launch_router
//! --pd-disaggregation --host 127.0.0.1 --port {port} --prefill {prefill} {bootstrap}
//! --decode {decode}`); `PDGATE_BENCH_PIN=N` pins every router and forwarder to core N.
//! Beside CPU, each line counts the
//! times the process was put on a CPU and its minor page faults, per request.
//! This is a measurement, not a test: nothing here asserts on a time.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod support;
use support::*;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The two requests of the load bench: non-streamed `/generate` and streamed chat.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    Generate,
    ChatStream,
}

impl Route {
    const ALL: [Route; 2] = [Route::Generate, Route::ChatStream];

    fn label(self) -> &'static str {
        match self {
            Route::Generate => "/generate (non-streamed)",
            Route::ChatStream => "chat (streamed)",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Route::Generate => "/generate",
            Route::ChatStream => "/v1/chat/completions",
        }
    }

    fn of_path(head: &[u8]) -> Route {
        if head.starts_with(b"POST /v1/chat/completions ") {
            Route::ChatStream
        } else {
            Route::Generate
        }
    }

    /// The client's body, asking for `tokens` tokens.
    fn client_body(self, tokens: u32) -> String {
        match self {
            Route::Generate => format!(
                r#"{{"text":"The capital of France is","sampling_params":{{"max_new_tokens":{tokens},"temperature":0}}}}"#
            ),
            Route::ChatStream => format!(
                r#"{{"model":"sim-model","messages":[{{"role":"user","content":"The capital of France is"}}],"max_tokens":{tokens},"stream":true}}"#
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------
// HTTP/1.1 framing, the least of it (content-length and chunked bodies, no trailers)

enum Framing {
    Length(usize),
    Chunked,
}

/// How a head frames its body.
fn framing(head: &[u8]) -> Option<Framing> {
    for line in head.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Some(Framing::Chunked);
        }
        if name.eq_ignore_ascii_case(b"content-length") {
            return std::str::from_utf8(value)
                .ok()?
                .parse()
                .ok()
                .map(Framing::Length);
        }
    }
    Some(Framing::Length(0))
}

/// One chunk at the start of `b`: (its data range, where the next chunk starts), or
/// `None` while it is incomplete. A zero-size chunk (data range empty) ends the body.
fn next_chunk(b: &[u8]) -> Option<(std::ops::Range<usize>, usize)> {
    let line = memchr::memmem::find(b, b"\r\n")?;
    let size = std::str::from_utf8(&b[..line]).ok()?;
    let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
    let data = line + 2..line + 2 + size;
    let next = data.end + 2;
    (b.len() >= next).then_some((data, next))
}

/// The length of the complete chunked body at the start of `b`, if it is complete.
fn chunked_len(b: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let (data, next) = next_chunk(&b[at..])?;
        at += next;
        if data.is_empty() {
            return Some(at);
        }
    }
}

/// Reads into `buf` until it holds a whole head; returns where the body starts.
async fn read_head(s: &mut TcpStream, buf: &mut BytesMut) -> Option<usize> {
    loop {
        if let Some(h) = memchr::memmem::find(buf, b"\r\n\r\n") {
            return Some(h + 4);
        }
        buf.reserve(4096);
        if s.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// Reads one whole message into `buf` (cleared first); returns the body's range (for a
/// chunked body, its chunk-framed bytes), or `None` when the peer closed.
async fn read_msg(s: &mut TcpStream, buf: &mut BytesMut) -> Option<(usize, usize)> {
    buf.clear();
    let start = read_head(s, buf).await?;
    loop {
        let end = match framing(&buf[..start])? {
            Framing::Length(n) => Some(start + n).filter(|&e| buf.len() >= e),
            Framing::Chunked => chunked_len(&buf[start..]).map(|n| start + n),
        };
        if let Some(end) = end {
            return Some((start, end));
        }
        buf.reserve(4096);
        if s.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// One leg into `out`: the client's body with the bootstrap fields added.
fn write_leg(out: &mut Vec<u8>, route: Route, host: &str, body: &[u8], port: u16, room: u64) {
    let open = body.trim_ascii_end();
    let open = open.strip_suffix(b"}").unwrap_or(open);
    let pd = format!(
        r#","bootstrap_host":"127.0.0.1","bootstrap_port":{port},"bootstrap_room":{room}}}"#
    );
    out.clear();
    out.extend_from_slice(
        format!(
            "POST {} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            route.path(),
            open.len() + pd.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(open);
    out.extend_from_slice(pd.as_bytes());
}

// ---------------------------------------------------------------------------------------
// The null forwarders (run in a child process: this bench re-executed with
// PDGATE_FLOOR_ROLE set)

#[derive(Clone)]
struct Upstreams {
    prefill: String,
    decode: String,
    bootstrap_port: u16,
}

/// One client connection's own upstream connections and buffers.
struct Legs {
    ups: Upstreams,
    p: TcpStream,
    d: TcpStream,
    out: Vec<u8>,
    pb: BytesMut,
    db: BytesMut,
    room: u64,
}

impl Legs {
    async fn connect(ups: &Upstreams, room: u64) -> std::io::Result<Legs> {
        let p = TcpStream::connect(&ups.prefill).await?;
        let d = TcpStream::connect(&ups.decode).await?;
        p.set_nodelay(true)?;
        d.set_nodelay(true)?;
        Ok(Legs {
            ups: ups.clone(),
            p,
            d,
            out: Vec::with_capacity(4096),
            pb: BytesMut::with_capacity(4096),
            db: BytesMut::with_capacity(4096),
            room,
        })
    }

    /// Sends both legs, reads the prefill's whole answer and decode's head; returns where
    /// decode's body starts in `self.db`.
    async fn send(&mut self, route: Route, body: &[u8]) -> Option<usize> {
        self.room += 1;
        let port = self.ups.bootstrap_port;
        write_leg(
            &mut self.out,
            route,
            &self.ups.prefill,
            body,
            port,
            self.room,
        );
        self.p.write_all(&self.out).await.ok()?;
        write_leg(
            &mut self.out,
            route,
            &self.ups.decode,
            body,
            port,
            self.room,
        );
        self.d.write_all(&self.out).await.ok()?;
        self.db.clear();
        let (p, d) = tokio::join!(
            read_msg(&mut self.p, &mut self.pb),
            read_head(&mut self.d, &mut self.db)
        );
        p?;
        d
    }

    /// Both legs for a non-streamed request; decode's answer body (its range in `self.db`).
    async fn exchange(&mut self, route: Route, body: &[u8]) -> Option<(usize, usize)> {
        let start = self.send(route, body).await?;
        let Framing::Length(n) = framing(&self.db[..start])? else {
            return None;
        };
        while self.db.len() < start + n {
            self.db.reserve(start + n - self.db.len());
            if self.d.read_buf(&mut self.db).await.ok()? == 0 {
                return None;
            }
        }
        Some((start, start + n))
    }
}

/// Rooms never repeat across connections: each connection starts its own range.
fn room_base(conn: u64) -> u64 {
    (u64::from(std::process::id()) << 40) | (conn << 24)
}

async fn raw_conn(mut c: TcpStream, ups: Upstreams, conn: u64) -> Option<()> {
    c.set_nodelay(true).ok()?;
    let mut legs = Legs::connect(&ups, room_base(conn)).await.ok()?;
    let mut cb = BytesMut::with_capacity(4096);
    let mut answer = Vec::with_capacity(4096);
    loop {
        let (a, b) = read_msg(&mut c, &mut cb).await?;
        let route = Route::of_path(&cb);
        if route == Route::ChatStream {
            // Decode's chunk-framed events are relayed as they arrive, read by read.
            let start = legs.send(route, &cb[a..b]).await?;
            c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").await.ok()?;
            let mut sent = start;
            loop {
                if legs.db.len() > sent {
                    c.write_all(&legs.db[sent..]).await.ok()?;
                    sent = legs.db.len();
                }
                if chunked_len(&legs.db[start..]).is_some() {
                    break;
                }
                legs.db.reserve(4096);
                if legs.d.read_buf(&mut legs.db).await.ok()? == 0 {
                    return None;
                }
            }
            continue;
        }
        let (da, db) = legs.exchange(route, &cb[a..b]).await?;
        answer.clear();
        answer.extend_from_slice(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                db - da
            )
            .as_bytes(),
        );
        answer.extend_from_slice(&legs.db[da..db]);
        c.write_all(&answer).await.ok()?;
    }
}

type Slot = Arc<Mutex<Option<Legs>>>;

/// Decode's chunked body as data frames, read as hyper polls; the legs go back to their
/// slot at the end.
struct DecodeEvents {
    legs: Option<Legs>,
    slot: Slot,
    at: usize,
}

impl hyper::body::Body for DecodeEvents {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        let Some(legs) = this.legs.as_mut() else {
            return Poll::Ready(None);
        };
        loop {
            if let Some((data, next)) = next_chunk(&legs.db[this.at..]) {
                let data =
                    Bytes::copy_from_slice(&legs.db[this.at + data.start..this.at + data.end]);
                this.at += next;
                if data.is_empty() {
                    if let (Some(l), Ok(mut slot)) = (this.legs.take(), this.slot.lock()) {
                        *slot = Some(l);
                    }
                    return Poll::Ready(None);
                }
                return Poll::Ready(Some(Ok(hyper::body::Frame::data(data))));
            }
            legs.db.reserve(4096);
            match tokio_util::io::poll_read_buf(std::pin::Pin::new(&mut legs.d), cx, &mut legs.db) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Some(Err(std::io::ErrorKind::UnexpectedEof.into())))
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

async fn hyper_answer(
    slot: Slot,
    req: hyper::Request<hyper::body::Incoming>,
) -> http::Result<hyper::Response<http_body_util::Either<Full<Bytes>, DecodeEvents>>> {
    use http_body_util::Either;
    let route = if req.uri().path() == Route::ChatStream.path() {
        Route::ChatStream
    } else {
        Route::Generate
    };
    let body = req.into_body().collect().await.map(|c| c.to_bytes());
    let taken = slot.lock().ok().and_then(|mut l| l.take());
    let (Ok(body), Some(mut legs)) = (body, taken) else {
        return hyper::Response::builder()
            .status(500)
            .body(Either::Left(Full::new(Bytes::new())));
    };
    if route == Route::ChatStream {
        let Some(at) = legs.send(route, &body).await else {
            return hyper::Response::builder()
                .status(502)
                .body(Either::Left(Full::new(Bytes::new())));
        };
        let events = DecodeEvents {
            legs: Some(legs),
            slot,
            at,
        };
        return hyper::Response::builder()
            .header("content-type", "text/event-stream")
            .body(Either::Right(events));
    }
    let (status, out) = match legs.exchange(route, &body).await {
        Some((a, b)) => (200, Bytes::copy_from_slice(&legs.db[a..b])),
        None => (502, Bytes::new()),
    };
    if let Ok(mut s) = slot.lock() {
        *s = Some(legs);
    }
    hyper::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Either::Left(Full::new(out)))
}

async fn hyper_conn(c: TcpStream, ups: Upstreams, conn: u64) -> Option<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    c.set_nodelay(true).ok()?;
    let legs = Legs::connect(&ups, room_base(conn)).await.ok()?;
    // hyper serves one request at a time per connection: the legs are taken and put back.
    let slot: Slot = Arc::new(Mutex::new(Some(legs)));
    let svc = hyper::service::service_fn(move |req| hyper_answer(slot.clone(), req));
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).keep_alive(true);
    builder
        .serve_connection_with_upgrades(TokioIo::new(c), svc)
        .await
        .ok()
}

/// Serves as the null forwarder named by `role` until killed.
fn run_forwarder(role: &str) {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} must be set"));
    let ups = Upstreams {
        prefill: var("PDGATE_FLOOR_PREFILL"),
        decode: var("PDGATE_FLOOR_DECODE"),
        bootstrap_port: var("PDGATE_FLOOR_BOOTSTRAP_PORT").parse().expect("a port"),
    };
    let listen = var("PDGATE_FLOOR_LISTEN");
    let hyper = role == "hyper";
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let l = TcpListener::bind(&listen).await.expect("bind");
        let mut conn = 0u64;
        loop {
            let Ok((c, _)) = l.accept().await else {
                continue;
            };
            conn += 1;
            let ups = ups.clone();
            if hyper {
                tokio::spawn(hyper_conn(c, ups, conn));
            } else {
                tokio::spawn(raw_conn(c, ups, conn));
            }
        }
    });
}

// ---------------------------------------------------------------------------------------
// The client and the measurement

/// Tokens per answer: `PDGATE_FLOOR_TOKENS` (default 4). With a long answer (256) the
/// streamed route's figures are mostly per token: the relay of each event.
fn tokens() -> u32 {
    std::env::var("PDGATE_FLOOR_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4)
}

fn client_request(addr: SocketAddr, route: Route) -> Vec<u8> {
    let body = route.client_body(tokens());
    let mut r = format!(
        "POST {} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        route.path(),
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body.as_bytes());
    r
}

#[derive(Default)]
struct Tally {
    ok: u64,
    errors: u64,
    /// Latencies in µs.
    lat: Vec<u32>,
}

/// `conc` kept-alive connections, each sending its next request when the last one is
/// answered (or after 5 s without an answer), until `until` or `max` answers in all.
async fn drive(addr: SocketAddr, route: Route, conc: usize, until: Instant, max: u64) -> Tally {
    let req = Arc::new(client_request(addr, route));
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (req, done) = (req.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut t = Tally::default();
            let Ok(mut s) = TcpStream::connect(addr).await else {
                t.errors += 1;
                return t;
            };
            let _ = s.set_nodelay(true);
            let mut buf = BytesMut::with_capacity(4096);
            while Instant::now() < until
                && done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < max
            {
                let t0 = Instant::now();
                if s.write_all(&req).await.is_err() {
                    t.errors += 1;
                    break;
                }
                let answer =
                    tokio::time::timeout(Duration::from_secs(5), read_msg(&mut s, &mut buf));
                match answer.await {
                    Ok(Some(_)) if buf.starts_with(b"HTTP/1.1 200") => {
                        t.ok += 1;
                        t.lat
                            .push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    }
                    Ok(Some(_)) => t.errors += 1,
                    Ok(None) | Err(_) => {
                        t.errors += 1;
                        break;
                    }
                }
            }
            t
        }));
    }
    let mut all = Tally::default();
    for t in tasks {
        if let Ok(t) = t.await {
            all.ok += t.ok;
            all.errors += t.errors;
            all.lat.extend(t.lat);
        }
    }
    all.lat.sort_unstable();
    all
}

struct Point {
    req_s: f64,
    p50_ms: f64,
    /// From the scheduler's exact count; `user_ms` and `sys_ms` are its split as sampled at
    /// the clock tick (their sum may differ a little).
    cpu_ms: f64,
    user_ms: f64,
    sys_ms: f64,
    /// Times on a CPU and minor page faults, per request (`sched_counts`).
    runs: f64,
    minflt: f64,
    errors: u64,
}

async fn measure(t: &Target, route: Route, conc: usize, s: &Settings, tck: f64) -> Point {
    drive(t.addr, route, conc, Instant::now() + s.warmup, u64::MAX).await;
    let (u0, s0) = cpu_ticks(t.pid);
    let ns0 = cpu_ns(t.pid);
    let (r0, f0) = sched_counts(t.pid);
    let t0 = Instant::now();
    let tally = drive(t.addr, route, conc, t0 + s.duration, s.max_requests).await;
    let secs = t0.elapsed().as_secs_f64();
    let (u1, s1) = cpu_ticks(t.pid);
    let ns1 = cpu_ns(t.pid);
    let (r1, f1) = sched_counts(t.pid);
    let per = |ticks: u64| ticks as f64 / tck * 1000.0 / tally.ok.max(1) as f64;
    let each = |n: u64| n as f64 / tally.ok.max(1) as f64;
    Point {
        req_s: tally.ok as f64 / secs,
        p50_ms: tally
            .lat
            .get(tally.lat.len() / 2)
            .map_or(0.0, |&v| f64::from(v) / 1000.0),
        cpu_ms: ns1.saturating_sub(ns0) as f64 / 1e6 / tally.ok.max(1) as f64,
        user_ms: per(u1.saturating_sub(u0)),
        sys_ms: per(s1.saturating_sub(s0)),
        runs: each(r1.saturating_sub(r0)),
        minflt: each(f1.saturating_sub(f0)),
        errors: tally.errors,
    }
}

/// Sends requests until one of each route is answered 200 (pdgate first learns its
/// workers).
async fn wait_answering(addr: SocketAddr) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    for route in Route::ALL {
        loop {
            let t = drive(
                addr,
                route,
                1,
                Instant::now() + Duration::from_millis(50),
                1,
            )
            .await;
            if t.ok == 1 {
                break;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    true
}

struct Settings {
    rounds: usize,
    warmup: Duration,
    duration: Duration,
    max_requests: u64,
    concurrency: [usize; 2],
}

fn settings() -> Settings {
    let quick = std::env::var("PDGATE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let rounds = std::env::var("PDGATE_FLOOR_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1 } else { 3 });
    Settings {
        rounds,
        warmup: Duration::from_millis(if quick { 100 } else { 300 }),
        duration: Duration::from_millis(if quick { 300 } else { 2000 }),
        max_requests: 20_000,
        // The hardening issue judges pdgate at c=1 and c=64 against the hyper forwarder.
        concurrency: [1, 64],
    }
}

struct Target {
    name: String,
    pid: u32,
    addr: SocketAddr,
}

fn start_forwarder(role: &'static str, sim: &SimInfo) -> (Proc, Target) {
    let port = free_port();
    let strip = |u: &str| u.trim_start_matches("http://").to_string();
    let exe = std::env::current_exe().expect("current exe");
    let child = pinned(exe)
        .env("PDGATE_FLOOR_ROLE", role)
        .env("PDGATE_FLOOR_PREFILL", strip(&sim.prefill_url))
        .env("PDGATE_FLOOR_DECODE", strip(&sim.decode_url))
        .env(
            "PDGATE_FLOOR_BOOTSTRAP_PORT",
            sim.bootstrap_port.to_string(),
        )
        .env("PDGATE_FLOOR_LISTEN", format!("127.0.0.1:{port}"))
        .stdin(std::process::Stdio::null())
        .stdout(log_file(&format!("floor-{role}")))
        .stderr(log_file(&format!("floor-{role}-err")))
        .spawn()
        .expect("spawn a forwarder");
    let name = if role == "hyper" {
        "hyper null forwarder"
    } else {
        "raw null forwarder"
    };
    let target = Target {
        name: name.to_string(),
        pid: child.id(),
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    (Proc { child, name }, target)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    if let Ok(role) = std::env::var("PDGATE_FLOOR_ROLE") {
        run_forwarder(&role);
        return;
    }
    let s = settings();
    let tck = clk_tck();
    let bin = pdgate_bin();
    let (_sim_proc, sim) = start_sim(&bin, tokens());
    let (_raw, raw) = start_forwarder("raw", &sim);
    let (_hyper, hyper) = start_forwarder("hyper", &sim);
    let (router, router_url) = start_router(&bin, &sim);
    let pdgate = Target {
        name: "pdgate".to_string(),
        pid: router.pid(),
        addr: router_url
            .trim_start_matches("http://")
            .parse()
            .expect("router address"),
    };
    let mut targets = vec![raw, hyper, pdgate];
    // More builds and peers, each judged against the hyper forwarder like pdgate.
    let mut _more: Vec<Proc> = Vec::new();
    for (name, path) in named_list("PDGATE_FLOOR_ALSO") {
        let (p, url) = start_router(std::path::Path::new(&path), &sim);
        targets.push(Target {
            name,
            pid: p.pid(),
            addr: url
                .trim_start_matches("http://")
                .parse()
                .expect("router address"),
        });
        _more.push(p);
    }
    if let Some((name, cmd)) = named_list("PDGATE_FLOOR_PEER").into_iter().next() {
        let (p, t) = start_peer(name, &cmd, &sim);
        targets.push(t);
        _more.push(p);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // (route, target, conc) -> one point per round
    let conc = s.concurrency;
    // `PDGATE_FLOOR_ONLY=generate` (or `chat`) measures one route only.
    let only = std::env::var("PDGATE_FLOOR_ONLY").unwrap_or_default();
    let cases: Vec<(Route, usize, usize)> = Route::ALL
        .iter()
        .filter(|r| only.is_empty() || r.path().contains(only.as_str()))
        .flat_map(|&r| (0..targets.len()).flat_map(move |t| conc.map(|c| (r, t, c))))
        .collect();
    let mut points: Vec<Vec<Point>> = cases.iter().map(|_| Vec::new()).collect();
    rt.block_on(async {
        for t in &targets {
            if !wait_answering(t.addr).await {
                eprintln!(
                    "[floor] {} at {} never answered 200; see the logs in {}",
                    t.name,
                    t.addr,
                    std::env::temp_dir().display()
                );
                std::process::exit(1);
            }
        }
        for round in 0..s.rounds {
            for (i, &(route, ti, conc)) in cases.iter().enumerate() {
                let t = &targets[ti];
                let p = measure(t, route, conc, &s, tck).await;
                eprintln!(
                    "[floor] round {} {:<24} {:<22} c={conc:<3} {:>7.0} req/s  p50 {:.3} ms  CPU {:.4} ms/req (user {:.4} sys {:.4})  runs {:.2} minflt {:.3} /req  errors {}",
                    round + 1,
                    route.label(),
                    t.name,
                    p.req_s,
                    p.p50_ms,
                    p.cpu_ms,
                    p.user_ms,
                    p.sys_ms,
                    p.runs,
                    p.minflt,
                    p.errors
                );
                points[i].push(p);
            }
        }
    });
    println!(
        "\n## floor: router CPU per request, null forwarders beside pdgate ({} rounds)\n",
        s.rounds
    );
    println!("| route | target | conc | req/s (median) | p50 ms (median) | CPU ms/req, each round (user + sys, tick-sampled) | CPU ms/req, median | errors |");
    println!("|---|---|---|---|---|---|---|---|");
    for (i, &(route, ti, conc)) in cases.iter().enumerate() {
        let ps = &points[i];
        if ps.is_empty() {
            continue;
        }
        let rounds: Vec<String> = ps
            .iter()
            .map(|p| format!("{:.4} ({:.4} + {:.4})", p.cpu_ms, p.user_ms, p.sys_ms))
            .collect();
        let mut cpu: Vec<f64> = ps.iter().map(|p| p.cpu_ms).collect();
        let mut rps: Vec<f64> = ps.iter().map(|p| p.req_s).collect();
        let mut p50: Vec<f64> = ps.iter().map(|p| p.p50_ms).collect();
        let errors: u64 = ps.iter().map(|p| p.errors).sum();
        println!(
            "| {} | {} | {conc} | {:.0} | {:.3} | {} | {:.4} | {errors} |",
            route.label(),
            targets[ti].name,
            median(&mut rps),
            median(&mut p50),
            rounds.join(" · "),
            median(&mut cpu)
        );
    }
    // The judged figure: pdgate's CPU per request over the hyper null forwarder's, per
    // round (the two measured back to back), then the median and the worst round.
    println!("\n## floor ratio: pdgate / hyper null forwarder, CPU per request (goal ≤ 1.5)\n");
    let find = |route: Route, ti: usize, conc: usize| {
        cases
            .iter()
            .position(|&(r, t, c)| r == route && t == ti && c == conc)
            .map(|i| &points[i])
    };
    println!("\n(each target from pdgate on, over the hyper null forwarder measured beside it)\n");
    println!("| route | target | conc | ratio each round | median | worst |");
    println!("|---|---|---|---|---|---|");
    for &route in Route::ALL.iter() {
        for (ti, target) in targets.iter().enumerate().skip(2) {
            for conc in s.concurrency {
                let (Some(h), Some(p)) = (find(route, 1, conc), find(route, ti, conc)) else {
                    continue;
                };
                let mut ratios: Vec<f64> = h
                    .iter()
                    .zip(p.iter())
                    .filter(|(h, _)| h.cpu_ms > 0.0)
                    .map(|(h, p)| p.cpu_ms / h.cpu_ms)
                    .collect();
                if ratios.is_empty() {
                    continue;
                }
                let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
                let worst = ratios.iter().copied().fold(0.0, f64::max);
                println!(
                    "| {} | {} | {conc} | {} | {:.2} | {:.2} |",
                    route.label(),
                    target.name,
                    each.join(" · "),
                    median(&mut ratios),
                    worst
                );
            }
        }
    }
}

/// `name=value,name=value` from the environment variable `var` (empty when unset).
fn named_list(var: &str) -> Vec<(String, String)> {
    let v = std::env::var(var).unwrap_or_default();
    if var == "PDGATE_FLOOR_PEER" {
        // One peer: its command may hold commas.
        return v
            .split_once('=')
            .map(|(n, c)| vec![(n.trim().to_string(), c.trim().to_string())])
            .unwrap_or_default();
    }
    v.split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(n, p)| (n.trim().to_string(), p.trim().to_string()))
        .collect()
}

/// Another router, from a command template (see the module docs), on a free port.
fn start_peer(name: String, template: &str, sim: &SimInfo) -> (Proc, Target) {
    let port = free_port();
    let cmd = template
        .replace("{port}", &port.to_string())
        .replace("{prefill}", &sim.prefill_url)
        .replace("{bootstrap}", &sim.bootstrap_port.to_string())
        .replace("{decode}", &sim.decode_url);
    let mut words = cmd.split_whitespace();
    let exe = words.next().expect("a peer command");
    let child = pinned(exe)
        .args(words)
        .stdin(std::process::Stdio::null())
        .stdout(log_file("floor-peer"))
        .stderr(log_file("floor-peer-err"))
        .spawn()
        .expect("spawn the peer router");
    let target = Target {
        name,
        pid: child.id(),
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    (
        Proc {
            child,
            name: "peer router",
        },
        target,
    )
}
