//! Hostile-clients bench: normal clients against `pdgate serve` (a separate process, default
//! settings) in front of simulated engines (`pdgate sim`), first alone (quiet), then while
//! hostile clients run beside them:
//! - slowloris heads: connections that send a request head one byte at a time, or fill a
//!   head of about 15 KiB and stall;
//! - slowloris bodies: a head declaring a maximum-size body, then a trickle of it;
//! - partial HTTP/2 prefaces: connections that send a prefix of `PRI * HTTP/2.0` and stall;
//! - idle connections: thousands of connections that send nothing;
//! - maximum-size bodies (`server.max_body_bytes`) sent as fast as the socket takes them;
//! - logprob bombs: streamed `/generate` with `return_logprob` and a long prompt, under the
//!   stream merge cap (its input logprobs repeated in every event) and over it (refused).
//!
//! The normal clients run two ways. Closed loops (`NORMAL_CLIENTS`, each sending when its
//! last answer came) measure throughput; on a machine this small they saturate it, so
//! their latencies move with any work added anywhere. The judged latency is open-loop: a
//! fixed rate (`PDGATE_HOSTILE_RATE`, else half the quiet closed loops' rate), each request
//! timed from its scheduled send (no coordinated omission), the same offered load quiet and
//! hostile, in alternating phases (`PDGATE_HOSTILE_ROUNDS` pairs, 3 by default) so that a
//! shared machine's drift falls on both alike. Nothing of a hostile phase outlives it (its
//! clients hang up at the phase's end, then the router gets a second to settle).
//!
//! Reported: the normal clients' p50/p99/max and errors, quiet against hostile (target: p99
//! within 2x, no error, no stall), the router's CPU (share of one core) in each phase and its
//! peak RSS (sampled every 50 ms, and the kernel's high-water mark) against the documented
//! bound (`pdgate::memory::rss_bound` of the default config: docs/pools-and-capacity.md, "Memory"), and what each
//! kind of hostile client got.
//!
//! The requests that reach engines (normal ones, maximum-size bodies, logprob bombs) name a
//! model: normal clients one simulator's (`normal`), hostile clients another's (`hostile`),
//! so that the normal clients measure what the router costs them, not a queue in an engine
//! the bombs share (each simulator's CPU is reported too). `PDGATE_HOSTILE_SHARED=1` puts
//! everything on one simulator instead (no model named), as an operator with one model sees
//! it. The normal clients run on a thread and runtime of their own, apart from the hostile
//! ones (which would otherwise delay the measuring clients in the bench process itself).
//!
//! On a machine this small the bench's own load generators and the hostile model's
//! simulator share the router's cores; in a fleet they are other machines (clients, GPU
//! engines). So the hostile clients' runtime thread and the hostile simulator run at
//! `SCHED_IDLE` (`PDGATE_HOSTILE_DEMOTE`: `idle`, the default; `nice:N`; `off`): what is left
//! of the normal clients' latency is the router's own work, hostile connections included,
//! plus the normal side's. `SCHED_IDLE`, not `nice 19`: Linux's EEVDF scheduler lets a
//! running task finish its slice before a waking one takes the CPU, so a `nice 19` simulator
//! still kept the router's thread waiting up to ~5 ms (`perf sched`, BENCHMARKS §10); an
//! idle-policy task is preempted at once, as work on another machine would never delay it.
//!
//! Demoting the stand-ins does not make them free: a core kept busy by demoted work still
//! costs a waking thread a preemption (an interrupt to that vCPU) and the caches that work
//! evicted. So each round also runs a **control** phase: the same open-loop normal clients
//! beside one CPU burner per core at the hostile side's class (JSON serialisation and
//! parsing, no I/O, nothing sent to the router or an engine). The bench prints hostile /
//! quiet (the target), control / quiet (what this machine charges for busy cores alone) and
//! hostile / control (the hostile clients' cost beyond it). `PDGATE_HOSTILE_CONTROL=0`
//! skips the control.
//!
//! Every loop is bounded in count and in time (the phase deadline). The machine is shared:
//! runs are short (`PDGATE_HOSTILE_SECS`, default 4 s per phase).
//!
//! Run: `cargo bench --bench hostile` (`PDGATE_BIN=/path/to/pdgate` to pick a binary). This
//! is a measurement, not a test: nothing here asserts on a time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod support;
use support::*;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const NORMAL_CLIENTS: usize = 8;
const NORMAL_BODY: &str = r#"{"model":"normal","text":"The capital of France is","sampling_params":{"max_new_tokens":4,"temperature":0}}"#;
const NORMAL_BODY_SHARED: &str =
    r#"{"text":"The capital of France is","sampling_params":{"max_new_tokens":4,"temperature":0}}"#;
const SLOW_HEADS: usize = 300;
const SLOW_BODIES: usize = 50;
const PREFACES: usize = 500;
const IDLE: usize = 2000;
const BIG_SENDERS: usize = 4;
const BOMBS_UNDER: usize = 2;
const BOMBS_OVER: usize = 2;

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    refused_503: AtomicU64,
    refused_413: AtomicU64,
    other: AtomicU64,
    conn_errors: AtomicU64,
}

impl Counts {
    fn status(&self, s: u16) {
        match s {
            200 => &self.ok,
            503 => &self.refused_503,
            413 => &self.refused_413,
            _ => &self.other,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
    fn line(&self) -> String {
        format!(
            "200: {}, 503: {}, 413: {}, other: {}, connection errors: {}",
            self.ok.load(Ordering::Relaxed),
            self.refused_503.load(Ordering::Relaxed),
            self.refused_413.load(Ordering::Relaxed),
            self.other.load(Ordering::Relaxed),
            self.conn_errors.load(Ordering::Relaxed)
        )
    }
}

struct Phase {
    lat: Vec<Duration>,
    /// The router-only probe's latencies (`GET /liveness`), sorted.
    probe: Vec<Duration>,
    errors: u64,
    cpu_share: f64,
    /// Each simulator's CPU, as a share of one core.
    sim_cpu: Vec<f64>,
    peak_rss_kib: u64,
}

impl Phase {
    /// Several phases of one kind as one: latencies pooled, CPU averaged, the highest RSS.
    fn pooled(phases: Vec<Phase>) -> Phase {
        let n = phases.len().max(1) as f64;
        let mut out = Phase {
            lat: Vec::new(),
            probe: Vec::new(),
            errors: 0,
            cpu_share: 0.0,
            sim_cpu: Vec::new(),
            peak_rss_kib: 0,
        };
        for p in phases {
            out.lat.extend(p.lat);
            out.probe.extend(p.probe);
            out.errors += p.errors;
            out.cpu_share += p.cpu_share / n;
            if out.sim_cpu.len() < p.sim_cpu.len() {
                out.sim_cpu.resize(p.sim_cpu.len(), 0.0);
            }
            for (o, c) in out.sim_cpu.iter_mut().zip(p.sim_cpu) {
                *o += c / n;
            }
            out.peak_rss_kib = out.peak_rss_kib.max(p.peak_rss_kib);
        }
        out.lat.sort();
        out.probe.sort();
        out
    }
}

fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// How the normal clients load the router.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// `NORMAL_CLIENTS` closed loops, each sending its next request when the last one
    /// ended: as much as the machine serves (a throughput figure; its latencies are those of
    /// a saturated machine, so they move with any work added to it).
    Closed,
    /// Requests sent at a fixed rate (per second), each at its scheduled time whatever
    /// the earlier ones are doing, its latency counted from that time (no coordinated
    /// omission): the same offered load in both phases, so their latencies compare.
    Open(f64),
}

/// One normal request; whether it got a whole 200.
async fn one_request(client: &HttpClient, url: &str, body: &'static str) -> bool {
    let req = Request::post(format!("{url}/generate"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request");
    match tokio::time::timeout(Duration::from_secs(20), client.request(req)).await {
        Ok(Ok(resp)) => {
            let st = resp.status();
            let body = resp.into_body().collect().await;
            st == 200 && body.is_ok()
        }
        _ => false,
    }
}

/// The normal clients, sending until `until` (at most 100,000 requests in all) as `load`
/// says; their latencies, sorted, their errors, and the probe's latencies, sorted.
async fn normal_clients(
    client: HttpClient,
    url: String,
    body: &'static str,
    until: Instant,
    load: Load,
) -> (Vec<Duration>, u64, Vec<Duration>) {
    let lat = Arc::new(std::sync::Mutex::new(Vec::new()));
    let errors = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let record = {
        let (lat, errors) = (lat.clone(), errors.clone());
        move |ok: bool, dt: Duration| {
            if ok {
                lat.lock().expect("lock").push(dt);
            } else {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    let mut tasks = Vec::new();
    match load {
        Load::Closed => {
            for _ in 0..NORMAL_CLIENTS {
                let (client, url, sent, record) =
                    (client.clone(), url.clone(), sent.clone(), record.clone());
                tasks.push(tokio::spawn(async move {
                    while Instant::now() < until && sent.fetch_add(1, Ordering::Relaxed) < 100_000 {
                        let t0 = Instant::now();
                        let ok = one_request(&client, &url, body).await;
                        record(ok, t0.elapsed());
                    }
                }));
            }
        }
        Load::Open(rate) => {
            let (client, url, record) = (client.clone(), url.clone(), record.clone());
            tasks.push(tokio::spawn(async move {
                let gap = Duration::from_secs_f64(1.0 / rate.max(1.0));
                let start = Instant::now();
                let mut inflight = Vec::new();
                for i in 0..100_000u32 {
                    let at = start + gap * i;
                    if at >= until {
                        break;
                    }
                    tokio::time::sleep_until(at.into()).await;
                    let (client, url, record) = (client.clone(), url.clone(), record.clone());
                    inflight.push(tokio::spawn(async move {
                        let ok = one_request(&client, &url, body).await;
                        record(ok, at.elapsed());
                    }));
                }
                for t in inflight {
                    let _ = t.await;
                }
            }));
        }
    }
    // The probe: `GET /liveness`, answered by the router alone, every 2 ms: the router's
    // own responsiveness, with no engine in the way.
    let probe = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < until && lat.len() < 100_000 {
                let req = Request::get(format!("{url}/liveness"))
                    .body(Full::new(Bytes::new()))
                    .expect("request");
                let t0 = Instant::now();
                if let Ok(Ok(resp)) =
                    tokio::time::timeout(Duration::from_secs(20), client.request(req)).await
                {
                    if resp.into_body().collect().await.is_ok() {
                        lat.push(t0.elapsed());
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            lat.sort();
            lat
        })
    };
    for t in tasks {
        let _ = t.await;
    }
    let probe = probe.await.unwrap_or_default();
    let mut v = std::mem::take(&mut *lat.lock().expect("lock"));
    v.sort();
    (v, errors.load(Ordering::Relaxed), probe)
}

/// Samples the router's RSS every 50 ms until `until`; the highest seen, in KiB.
async fn rss_sampler(pid: u32, until: Instant) -> u64 {
    let mut peak = 0;
    while Instant::now() < until {
        peak = peak.max(rss_kib(pid).0);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    peak
}

/// The normal clients' HTTP client (keep-alive, enough idle connections for all of them).
fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(64)
        .build_http()
}

/// The normal clients on a thread and a single-threaded runtime of their own.
fn normal_clients_apart(
    url: String,
    body: &'static str,
    until: Instant,
    load: Load,
) -> std::thread::JoinHandle<(Vec<Duration>, u64, Vec<Duration>)> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move { normal_clients(http_client(), url, body, until, load).await })
    })
}

/// Demotes this process's threads named `name`; how many it demoted.
fn demote_threads(name: &str, demote: Demote) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let mut n = 0;
    for e in dir.flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let tid = e.file_name().to_string_lossy().to_string();
        n += usize::from(demote.apply_to_thread(&tid));
    }
    n
}

async fn run_phase(
    url: &str,
    body: &'static str,
    pid: u32,
    sims: &[u32],
    secs: Duration,
    load: Load,
    beside: Beside,
) -> Phase {
    let until = Instant::now() + secs;
    let (attack, burners) = match beside {
        Beside::Nothing => (None, Vec::new()),
        Beside::Hostile(h, rt) => (Some(rt.spawn(h.run(until))), Vec::new()),
        Beside::Burners(demote) => (None, burners(until, demote)),
    };
    // Let the hostile clients take their connections first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cpu0 = cpu_ns(pid);
    let sims0: Vec<u64> = sims.iter().map(|p| cpu_ns(*p)).collect();
    let t0 = Instant::now();
    let sampler = tokio::spawn(rss_sampler(pid, until));
    let normal = normal_clients_apart(url.to_string(), body, until, load);
    let (lat, errors, probe) = tokio::task::spawn_blocking(move || normal.join())
        .await
        .expect("join")
        .expect("the normal clients' thread");
    let wall = t0.elapsed().as_nanos().max(1) as f64;
    let cpu_share = (cpu_ns(pid) - cpu0) as f64 / wall;
    let sim_cpu = sims
        .iter()
        .zip(sims0)
        .map(|(p, c0)| (cpu_ns(*p) - c0) as f64 / wall)
        .collect();
    let peak_rss_kib = sampler.await.unwrap_or(0);
    for b in burners {
        let _ = b.join();
    }
    if let Some(a) = attack {
        let _ = tokio::time::timeout(Duration::from_secs(10), a).await;
        // Let the router and the engines finish what the hostile clients left (cancelled
        // legs, freed buffers) before the next phase measures anything.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Phase {
        lat,
        probe,
        errors,
        cpu_share,
        sim_cpu,
        peak_rss_kib,
    }
}

/// What runs beside the normal clients in a phase.
enum Beside {
    /// Nothing: a quiet phase.
    Nothing,
    /// The hostile clients, on their runtime.
    Hostile(Arc<Hostile>, tokio::runtime::Handle),
    /// The control: one CPU burner per core, at the hostile side's scheduling class, that
    /// never touches the router or an engine. What it costs the normal clients is what
    /// this machine charges for cores kept busy by demoted work (wake-ups that must preempt
    /// it, caches it evicts), before the router does anything for a hostile client.
    Burners(Option<Demote>),
}

/// Starts the control's burners (see [`Beside::Burners`]), running until `until`: each
/// serialises and parses a logprob-sized JSON array in a loop (the stand-in engines' kind
/// of work: allocation, formatting, parsing), demoted before it starts.
fn burners(until: Instant, demote: Option<Demote>) -> Vec<std::thread::JoinHandle<()>> {
    let n = std::thread::available_parallelism().map_or(2, |n| n.get());
    let start = Arc::new(std::sync::Barrier::new(n + 1));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let start = start.clone();
            std::thread::Builder::new()
                .name("hostile-burner".into())
                .spawn(move || {
                    start.wait();
                    let rows: Vec<(f64, u32, Option<u8>)> = (0..60_000u32)
                        .map(|i| (-1.25 - f64::from(i % 97) / 1e4, i, None))
                        .collect();
                    while Instant::now() < until {
                        let text = serde_json::to_vec(&rows).unwrap_or_default();
                        let back: serde_json::Value =
                            serde_json::from_slice(&text).unwrap_or(serde_json::Value::Null);
                        std::hint::black_box(back);
                    }
                })
                .expect("a burner thread")
        })
        .collect();
    if let Some(d) = demote {
        demote_threads("hostile-burner", d);
    }
    start.wait();
    handles
}

/// The hostile clients and what they got.
struct Hostile {
    addr: String,
    max_body: usize,
    big_body: Bytes,
    bomb_under: Bytes,
    bomb_over: Bytes,
    big: Counts,
    bombs: Counts,
    slow_bodies: Counts,
    held: AtomicU64,
    kinds: Kinds,
}

/// Which kinds of hostile client run (`PDGATE_HOSTILE_ONLY`, a comma-separated list of
/// `idle`, `prefaces`, `heads`, `bodies`, `big`, `bombs`; unset, all of them): to tell what
/// each costs the normal clients.
struct Kinds(Option<Vec<String>>);

impl Kinds {
    fn from_env() -> Kinds {
        Kinds(
            std::env::var("PDGATE_HOSTILE_ONLY")
                .ok()
                .map(|v| v.split(',').map(|k| k.trim().to_string()).collect()),
        )
    }

    /// `n`, or 0 when `kind` is not selected.
    fn count(&self, kind: &str, n: usize) -> usize {
        match &self.0 {
            Some(only) if !only.iter().any(|k| k == kind) => 0,
            _ => n,
        }
    }
}

async fn connect(addr: &str) -> Option<TcpStream> {
    tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr))
        .await
        .ok()?
        .ok()
}

/// Reads an answer's status line (bounded: 20 s, 64 KiB); the rest is drained until EOF or
/// the phase's end (`until`: nothing of a hostile phase runs on into the next phase).
async fn status_of(s: &mut TcpStream, until: Instant) -> Option<u16> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut n = 0;
    let deadline = (Instant::now() + Duration::from_secs(20)).min(until);
    while n < 12 {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf[n..])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return None,
            Ok(Ok(k)) => n += k,
        }
    }
    let status = std::str::from_utf8(&buf[9..12]).ok()?.parse().ok();
    // Drain the answer (a stream of events for the bombs), bounded by the deadline.
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(k)) if k > 0 => {}
            _ => break,
        }
    }
    status
}

fn post_head(path: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {len}\r\n\r\n"
    )
}

impl Hostile {
    async fn run(self: Arc<Self>, until: Instant) {
        let mut tasks = Vec::new();
        // Idle connections and partial prefaces: opened, then held to the deadline.
        let idle = self.kinds.count("idle", IDLE);
        for i in 0..(idle + self.kinds.count("prefaces", PREFACES)) {
            let h = self.clone();
            tasks.push(tokio::spawn(async move {
                let Some(mut s) = connect(&h.addr).await else {
                    return;
                };
                if i >= idle {
                    let prefix: &[u8] = [&b"P"[..], b"PRI * HT", b"PRI * HTTP/2.0\r\n"][i % 3];
                    let _ = s.write_all(prefix).await;
                }
                h.held.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep_until(until.into()).await;
            }));
        }
        // Slowloris heads: half send one byte every 200 ms; half fill a head of about
        // 15 KiB (a long header, 1 KiB every 100 ms), then stall.
        for i in 0..self.kinds.count("heads", SLOW_HEADS) {
            let h = self.clone();
            tasks.push(tokio::spawn(async move {
                let Some(mut s) = connect(&h.addr).await else {
                    return;
                };
                if i % 2 == 1 {
                    let _ = s
                        .write_all(b"POST /generate HTTP/1.1\r\nhost: x\r\nx-pad: ")
                        .await;
                    for _ in 0..15 {
                        if Instant::now() >= until || s.write_all(&[b'a'; 1024]).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    tokio::time::sleep_until(until.into()).await;
                    return;
                }
                let head = post_head("/generate", 2);
                for b in head.as_bytes() {
                    if Instant::now() >= until || s.write_all(&[*b]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }));
        }
        // Slowloris bodies: a maximum-size body declared, 1 KiB sent every 100 ms.
        for _ in 0..self.kinds.count("bodies", SLOW_BODIES) {
            let h = self.clone();
            tasks.push(tokio::spawn(async move {
                let Some(mut s) = connect(&h.addr).await else {
                    return;
                };
                if s.write_all(post_head("/generate", h.max_body).as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
                let chunk = [b' '; 1024];
                for _ in 0..10_000 {
                    if Instant::now() >= until {
                        return;
                    }
                    if s.write_all(&chunk).await.is_err() {
                        // Refused or timed out: the router answered and closed.
                        h.slow_bodies.conn_errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }));
        }
        // Maximum-size bodies, back to back.
        for _ in 0..self.kinds.count("big", BIG_SENDERS) {
            let h = self.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..1000 {
                    if Instant::now() >= until {
                        return;
                    }
                    let Some(mut s) = connect(&h.addr).await else {
                        h.big.conn_errors.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let head = post_head("/generate", h.big_body.len());
                    let wrote = async {
                        s.write_all(head.as_bytes()).await?;
                        s.write_all(&h.big_body).await
                    };
                    let left = until
                        .saturating_duration_since(Instant::now())
                        .min(Duration::from_secs(20));
                    let wrote = tokio::time::timeout(left, wrote).await;
                    // A refused body is answered early and its write cut: the status counts.
                    let _ = wrote;
                    match status_of(&mut s, until).await {
                        Some(st) => h.big.status(st),
                        None => {
                            h.big.conn_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        // Logprob bombs.
        for i in 0..self.kinds.count("bombs", BOMBS_UNDER + BOMBS_OVER) {
            let h = self.clone();
            tasks.push(tokio::spawn(async move {
                let body = if i < BOMBS_UNDER {
                    &h.bomb_under
                } else {
                    &h.bomb_over
                };
                for _ in 0..1000 {
                    if Instant::now() >= until {
                        return;
                    }
                    let Some(mut s) = connect(&h.addr).await else {
                        h.bombs.conn_errors.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let head = post_head("/generate", body.len());
                    if s.write_all(head.as_bytes()).await.is_err()
                        || s.write_all(body).await.is_err()
                    {
                        h.bombs.conn_errors.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    match status_of(&mut s, until).await {
                        Some(st) => h.bombs.status(st),
                        None => {
                            h.bombs.conn_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
        }
    }
}

/// A streamed `/generate` with `return_logprob` and a prompt of `n` token ids; `model`
/// names the model, or nothing when empty.
fn bomb(model: &str, n: usize, tokens: u32) -> Bytes {
    let ids: Vec<String> = (0..n).map(|i| (1000 + i % 30_000).to_string()).collect();
    Bytes::from(format!(
        r#"{{{}"input_ids":[{}],"sampling_params":{{"max_new_tokens":{tokens}}},"return_logprob":true,"logprob_start_len":0,"stream":true}}"#,
        model_member(model),
        ids.join(",")
    ))
}

/// `"model":"<m>",`, or nothing for an empty `m`.
fn model_member(m: &str) -> String {
    if m.is_empty() {
        String::new()
    } else {
        format!(r#""model":"{m}","#)
    }
}

fn report(name: &str, p: &Phase) {
    println!(
        "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} / {:.2} / {:.2} | {} | {:.0}% | {} | {:.1} |",
        p.lat.len(),
        pct(&p.lat, 0.5).as_secs_f64() * 1e3,
        pct(&p.lat, 0.99).as_secs_f64() * 1e3,
        p.lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        pct(&p.probe, 0.5).as_secs_f64() * 1e3,
        pct(&p.probe, 0.99).as_secs_f64() * 1e3,
        p.probe.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        p.errors,
        p.cpu_share * 100.0,
        p.sim_cpu
            .iter()
            .map(|c| format!("{:.0}%", c * 100.0))
            .collect::<Vec<_>>()
            .join(" / "),
        p.peak_rss_kib as f64 / 1024.0,
    );
}

fn main() {
    let secs = std::env::var("PDGATE_HOSTILE_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(4)
        .clamp(1, 60);
    let phase = Duration::from_secs(secs);
    let shared = std::env::var("PDGATE_HOSTILE_SHARED").is_ok_and(|v| v == "1");
    let demote = Demote::from_env("PDGATE_HOSTILE_DEMOTE", Some(Demote::Idle));
    let demoted = demote.map_or_else(|| "not demoted".to_string(), |d| d.to_string());
    let bin = pdgate_bin();
    let mut sims = Vec::new();
    // A 128K-context model, so that a prompt can carry more input logprobs than the
    // stream cap allows.
    let long = ["--context-length", "131072"];
    if shared {
        sims.push(start_sim_with(&bin, 4, &long, None));
    } else {
        sims.push(start_sim_with(
            &bin,
            4,
            &["--served-model-name", "normal"],
            None,
        ));
        let hostile_args = [&["--served-model-name", "hostile"][..], &long].concat();
        sims.push(start_sim_with(&bin, 4, &hostile_args, demote));
    }
    // The hostile clients' runtime: one worker thread, demoted once it runs.
    let hostile_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("hostile-load")
        .enable_all()
        .build()
        .expect("runtime");
    hostile_rt.block_on(async {
        tokio::spawn(async {})
            .await
            .expect("the hostile runtime runs");
    });
    let reniced = demote.map_or(0, |d| demote_threads("hostile-load", d));
    let hostile_rt = hostile_rt.handle().clone();
    let infos: Vec<&SimInfo> = sims.iter().map(|(_, i)| i).collect();
    let (router, url) = start_router_over(&bin, &infos);
    let sim_pids: Vec<u32> = sims.iter().map(|(p, _)| p.pid()).collect();
    let (normal_body, hostile_model) = if shared {
        (NORMAL_BODY_SHARED, "")
    } else {
        (NORMAL_BODY, "hostile")
    };
    let pid = router.pid();
    // `PDGATE_HOSTILE_PIN=1`: the router on core 0, the simulators and this process on
    // core 1 (`taskset`, every thread), as a router with a core of its own would run.
    let pinned = std::env::var("PDGATE_HOSTILE_PIN").is_ok_and(|v| v == "1");
    if pinned {
        let others = sim_pids.iter().copied().chain([std::process::id()]);
        for (p, core) in std::iter::once((pid, "0")).chain(others.map(|p| (p, "1"))) {
            let _ = std::process::Command::new("taskset")
                .args(["-a", "-p", "-c", core, &p.to_string()])
                .stdout(std::process::Stdio::null())
                .status();
        }
    }
    let cfg = pdgate::config::Config::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let client = http_client();
        // Ready: a normal request answers (bounded: 20 s).
        let ready_until = Instant::now() + Duration::from_secs(20);
        loop {
            let req = Request::post(format!("{url}/generate"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(normal_body.as_bytes())))
                .expect("request");
            if let Ok(r) = client.request(req).await {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(Instant::now() < ready_until, "the router never answered");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let base_kib = rss_kib(pid).0;
        let quiet =
            run_phase(&url, normal_body, pid, &sim_pids, phase, Load::Closed, Beside::Nothing).await;
        // The open-loop rate: `PDGATE_HOSTILE_RATE`, else half of what the closed loops got.
        let rate = std::env::var("PDGATE_HOSTILE_RATE")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(quiet.lat.len() as f64 / phase.as_secs_f64() / 2.0)
            .clamp(10.0, 20_000.0);
        let max_body = cfg.server.max_body_bytes;
        let big_text = "a".repeat(max_body - 64);
        let big_body = Bytes::from(format!(
            r#"{{{}"text":"{big_text}"}}"#,
            model_member(hostile_model)
        ));
        let hostile = Arc::new(Hostile {
            addr: url.trim_start_matches("http://").to_string(),
            max_body,
            big_body,
            // ~26 bytes of input logprobs per prompt token (the simulator's token and top
            // logprobs): 8,000 tokens stay under the 1 MiB stream cap, 60,000 are over it
            // (and inside the 128K context, so that the router's cap is what refuses them).
            bomb_under: bomb(hostile_model, 8_000, 64),
            bomb_over: bomb(hostile_model, 60_000, 64),
            big: Counts::default(),
            bombs: Counts::default(),
            slow_bodies: Counts::default(),
            held: AtomicU64::new(0),
            kinds: Kinds::from_env(),
        });
        // Quiet and hostile open-loop phases alternate (`PDGATE_HOSTILE_ROUNDS` pairs, 3 by
        // default), so that a shared machine's drift falls on both alike; their latencies
        // are pooled per kind.
        let rounds = std::env::var("PDGATE_HOSTILE_ROUNDS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(3)
            .clamp(1, 10);
        // Each round also runs the control (`Beside::Burners`) unless
        // `PDGATE_HOSTILE_CONTROL=0`.
        let control = std::env::var("PDGATE_HOSTILE_CONTROL").map_or(true, |v| v != "0");
        let (mut quiet_open, mut control_open, mut loud_open) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let open = Load::Open(rate);
            quiet_open
                .push(run_phase(&url, normal_body, pid, &sim_pids, phase, open, Beside::Nothing).await);
            if control {
                let burn = Beside::Burners(demote);
                control_open
                    .push(run_phase(&url, normal_body, pid, &sim_pids, phase, open, burn).await);
            }
            let attack = Beside::Hostile(hostile.clone(), hostile_rt.clone());
            loud_open
                .push(run_phase(&url, normal_body, pid, &sim_pids, phase, open, attack).await);
        }
        let ms99 = |p: &Phase| format!("{:.2}", pct(&p.lat, 0.99).as_secs_f64() * 1e3);
        let per_round: Vec<String> = (0..rounds)
            .map(|i| {
                let mut cells = vec![ms99(&quiet_open[i])];
                cells.extend(control_open.get(i).map(ms99));
                cells.push(ms99(&loud_open[i]));
                cells.join(" / ")
            })
            .collect();
        let control_open = (!control_open.is_empty()).then(|| Phase::pooled(control_open));
        let (quiet_open, loud_open) = (Phase::pooled(quiet_open), Phase::pooled(loud_open));
        let loud = run_phase(
            &url,
            normal_body,
            pid,
            &sim_pids,
            phase,
            Load::Closed,
            Beside::Hostile(hostile.clone(), hostile_rt),
        )
        .await;
        let (_, hwm_kib) = rss_kib(pid);
        let k = &hostile.kinds;
        let conns = k.count("idle", IDLE)
            + k.count("prefaces", PREFACES)
            + k.count("heads", SLOW_HEADS)
            + k.count("bodies", SLOW_BODIES)
            + k.count("big", BIG_SENDERS)
            + k.count("bombs", BOMBS_UNDER + BOMBS_OVER)
            + NORMAL_CLIENTS;
        let bound = pdgate::memory::rss_bound(cfg.admission.max_bytes_in_flight, conns);
        println!("\n## hostile bench ({secs} s per phase, shared 2-core machine)\n");
        if shared {
            println!("engines: one simulator (prefill + decode) for every client (PDGATE_HOSTILE_SHARED=1)");
        } else {
            println!("engines: a simulator (prefill + decode) for the normal clients (model `normal`), another for the hostile ones (model `hostile`, 128K context, {demoted})");
        }
        println!("hostile clients: one runtime thread in the bench process, {demoted} ({reniced} thread(s) demoted)");
        if pinned {
            println!("pinned (PDGATE_HOSTILE_PIN=1): the router on core 0; the simulators and the bench on core 1");
        }
        println!("router: default settings (max_body_bytes {} MiB, admission.max_bytes_in_flight {} MiB, upstream.max_stream_logprob_bytes {} KiB); RSS after start {:.1} MiB", max_body >> 20, cfg.admission.max_bytes_in_flight >> 20, cfg.upstream.max_stream_logprob_bytes >> 10, base_kib as f64 / 1024.0);
        if let Some(only) = &hostile.kinds.0 {
            println!("only these hostile kinds (PDGATE_HOSTILE_ONLY): {}", only.join(", "));
        }
        println!("hostile: {IDLE} idle connections, {PREFACES} partial HTTP/2 prefaces, {SLOW_HEADS} slowloris heads, {SLOW_BODIES} slowloris bodies, {BIG_SENDERS} senders of {} MiB bodies, {BOMBS_UNDER}+{BOMBS_OVER} logprob bombs (8,000 / 60,000 prompt tokens, 64 events)\n", max_body >> 20);
        println!("| phase | normal requests | p50 ms | p99 ms | max ms | router-only probe p50 / p99 / max ms | errors | router CPU (one core) | simulators' CPU | peak RSS MiB |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        report(&format!("quiet, open loop at {rate:.0}/s ({rounds} phases)"), &quiet_open);
        if let Some(c) = &control_open {
            report(&format!("control: {} CPU burners, {demoted}, open loop at {rate:.0}/s ({rounds} phases)", std::thread::available_parallelism().map_or(2, |n| n.get())), c);
        }
        report(&format!("hostile, open loop at {rate:.0}/s ({rounds} phases)"), &loud_open);
        report(&format!("quiet, {NORMAL_CLIENTS} closed loops"), &quiet);
        report(&format!("hostile, {NORMAL_CLIENTS} closed loops"), &loud);
        let p99 = |p: &Phase| pct(&p.lat, 0.99).as_secs_f64().max(1e-9);
        let probe99 = |p: &Phase| pct(&p.probe, 0.99).as_secs_f64().max(1e-9);
        println!(
            "\np99 hostile / quiet at the same offered load (open loop, {rate:.0}/s: half the closed loops' quiet rate unless PDGATE_HOSTILE_RATE): {:.2}x (target <= 2x); router-only probe {:.2}x",
            p99(&loud_open) / p99(&quiet_open),
            probe99(&loud_open) / probe99(&quiet_open)
        );
        if let Some(c) = &control_open {
            println!(
                "p99 control / quiet (what demoted work that never reaches the router costs on this machine): {:.2}x; router-only probe {:.2}x",
                p99(c) / p99(&quiet_open),
                probe99(c) / probe99(&quiet_open)
            );
            println!(
                "p99 hostile / control (the hostile clients' cost beyond the machine's): {:.2}x; router-only probe {:.2}x",
                p99(&loud_open) / p99(c),
                probe99(&loud_open) / probe99(c)
            );
        }
        let cols = if control_open.is_some() { "quiet / control / hostile" } else { "quiet / hostile" };
        println!("p99 ms per round, {cols} (open loop): {}", per_round.join(", "));
        println!(
            "p99 hostile / quiet with closed loops (a saturated machine; the normal clients got {:.0}% of their quiet throughput): {:.2}x; router-only probe {:.2}x",
            100.0 * loud.lat.len() as f64 / quiet.lat.len().max(1) as f64,
            p99(&loud) / p99(&quiet),
            probe99(&loud) / probe99(&quiet)
        );
        println!(
            "normal requests over 1 s: {}; errors: {}",
            loud.lat.iter().chain(&loud_open.lat).filter(|d| d.as_secs_f64() > 1.0).count(),
            loud.errors + loud_open.errors
        );
        println!(
            "peak RSS: {:.1} MiB sampled, {:.1} MiB high-water mark; documented bound (docs/pools-and-capacity.md, Memory) for {conns} connections {:.1} MiB",
            loud.peak_rss_kib.max(loud_open.peak_rss_kib) as f64 / 1024.0,
            hwm_kib as f64 / 1024.0,
            bound as f64 / (1 << 20) as f64
        );
        println!("connections held by idle/preface clients: {}", hostile.held.load(Ordering::Relaxed));
        println!("max-size bodies: {}", hostile.big.line());
        println!("logprob bombs: {}", hostile.bombs.line());
        println!("slowloris bodies cut by the router: {}", hostile.slow_bodies.conn_errors.load(Ordering::Relaxed));
    });
    drop(router);
}
