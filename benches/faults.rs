//! Fault benchmark: how long a client waits for an answer, and what answer it gets, for
//! each engine fault, with pdgate in front of simulated SGLang engines (router, engines and
//! client in one process, one fresh tokio runtime per case so that nothing leaks between
//! cases).
//!
//! For every case: N requests sent 2 ms apart (open loop), then the time to the complete
//! answer (p50/p99/max), the client-visible status mix, how long the router took to see
//! the fault (when it is visible before dispatch), which engines received the request, the
//! requests the engines still held right after the last answer and 1 s later, and the
//! engines' `aborted` / `client_disconnects` counters (the cancelled other leg).
//!
//! Two setups where they make sense: (a) the faulty engine is the only one of its role,
//! (b) one healthy engine of that role remains (the goal there is 0 client errors).
//!
//! Router settings: the defaults (health every 0.5 s, 2 failures; bootstrap heartbeat 1 s,
//! 2 misses; refresh 2 s; freshness 5 s; retries 2 within the budget; breaker 3 failures)
//! except shortened leg timeouts so that the bench stays bounded: prefill 3 s, decode first
//! byte 2 s, stream idle 5 s, request 30 s.
//!
//! Run: `cargo bench --bench faults` (`PDGATE_BENCH_QUICK=1` for a smoke run).
//! This is a measurement, not a test: nothing here asserts on a time.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pdgate::config::{Config, DecodeWorkerConfig, PrefillWorkerConfig};
use pdgate::pd::RngSource;
use pdgate::pool::{RankReadiness, Snapshot};
use pdgate::router::Router;
use pdgate::sim::{EngineConfig, Faults, SimCluster, SimEngine, StatsSnapshot};
use pdgate::types::Role;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Spacing of the requests of one case.
const STAGGER: Duration = Duration::from_millis(2);
/// Client-side bound on one request.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

struct Knobs {
    quick: bool,
    n: usize,
    n_disconnect: usize,
}

fn knobs() -> Knobs {
    let quick = std::env::var("PDGATE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    Knobs {
        quick,
        n: if quick { 10 } else { 50 },
        n_disconnect: if quick { 5 } else { 20 },
    }
}

// ---------------------------------------------------------------------------------------
// Environment

fn router_config() -> Config {
    let mut cfg = Config::default();
    cfg.timeouts.prefill_secs = 3;
    cfg.timeouts.decode_first_byte_secs = 2;
    cfg.timeouts.stream_idle_secs = 5;
    cfg.timeouts.request_secs = 30;
    cfg.server.drain_secs = 1;
    cfg
}

/// Engine settings as in the tests (tiny latencies, short engine-side timeouts), except the
/// decode's own bootstrap heartbeat, left at the simulator's default (5 s, 2 misses) so that
/// the router's detection, not the engine's, is what is measured.
fn engine(mut e: EngineConfig) -> EngineConfig {
    e.prefill_delay = Duration::from_millis(2);
    e.ttft = Duration::from_millis(2);
    e.itl = Duration::from_millis(1);
    e.default_output_tokens = 4;
    e.sentinel_interval = Duration::from_millis(50);
    e.sentinel_attempts = 5;
    e.waiting_timeout = Duration::from_secs(20);
    e.bootstrap_timeout = Duration::from_secs(20);
    e
}

struct Env {
    cluster: SimCluster,
    router: Router,
    client: HttpClient,
}

async fn start(prefill: Vec<EngineConfig>, decode: Vec<EngineConfig>) -> Env {
    let cluster = SimCluster::spawn(&prefill, &decode)
        .await
        .expect("sim cluster");
    let mut cfg = router_config();
    for p in &cluster.prefills {
        cfg.prefill.push(PrefillWorkerConfig {
            url: p.url(),
            bootstrap_port: p.bootstrap_port(),
            bootstrap_host: None,
        });
    }
    for d in &cluster.decodes {
        cfg.decode.push(DecodeWorkerConfig { url: d.url() });
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = pdgate::router::start(cfg, Some(listener), RngSource::Os)
        .await
        .expect("router");
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(conn);
    Env {
        cluster,
        router,
        client,
    }
}

fn worker_id(snap: &Snapshot, url: &str, prefill: bool) -> Option<pdgate::types::WorkerId> {
    let list = if prefill {
        &snap.prefills
    } else {
        &snap.decodes
    };
    list.iter().find(|w| w.url.as_str() == url).map(|w| w.id)
}

fn routable(snap: &Snapshot, e: &SimEngine, prefill: bool) -> bool {
    let Some(id) = worker_id(snap, &e.url(), prefill) else {
        return false;
    };
    let role = if prefill { Role::Prefill } else { Role::Decode };
    snap.routable(role)
        .iter()
        .any(|r| r.worker == id && !r.ranks.is_empty())
}

impl Env {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.router.url())
    }

    /// Waits (bounded) until `f` holds on the router's pool; the time it took.
    async fn wait_pool(&self, bound: Duration, f: impl Fn(&Snapshot) -> bool) -> Option<Duration> {
        let t0 = Instant::now();
        while t0.elapsed() < bound {
            if f(&self.router.pool.load()) {
                return Some(t0.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        None
    }

    /// Waits until every engine whose fault is not set from the start is routable.
    async fn wait_routable(&self, skip_prefill: &[usize]) {
        let ok = self
            .wait_pool(Duration::from_secs(10), |s| {
                self.cluster
                    .prefills
                    .iter()
                    .enumerate()
                    .all(|(i, p)| skip_prefill.contains(&i) || routable(s, p, true))
                    && self.cluster.decodes.iter().all(|d| routable(s, d, false))
            })
            .await;
        if ok.is_none() {
            eprintln!("[faults] warning: not every engine became routable within 10 s");
        }
    }

    fn prefill_stats(&self) -> StatsSnapshot {
        sum(self.cluster.prefills.iter())
    }
    fn decode_stats(&self) -> StatsSnapshot {
        sum(self.cluster.decodes.iter())
    }
}

fn sum<'a>(it: impl Iterator<Item = &'a SimEngine>) -> StatsSnapshot {
    let mut t = StatsSnapshot::default();
    for e in it {
        t.add(&e.stats());
    }
    t
}

// ---------------------------------------------------------------------------------------
// Requests

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Non-streamed `/generate`.
    Generate,
    /// Streamed `/v1/chat/completions` with `max_tokens` tokens.
    Stream(u32),
}

fn request(env: &Env, kind: Kind) -> Request<Full<Bytes>> {
    let (path, body) = match kind {
        Kind::Generate => (
            "/generate",
            r#"{"text":"The capital of France is","sampling_params":{"max_new_tokens":4}}"#
                .to_string(),
        ),
        Kind::Stream(t) => (
            "/v1/chat/completions",
            format!(
                r#"{{"model":"sim-model","messages":[{{"role":"user","content":"hi"}}],"max_tokens":{t},"stream":true}}"#
            ),
        ),
    };
    Request::post(env.url(path))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request")
}

/// Sends one request and reads the whole answer: (status class, time to the complete answer).
async fn send(env: &Env, kind: Kind) -> (String, Duration) {
    let t0 = Instant::now();
    let fut = async {
        let resp = match env.client.request(request(env, kind)).await {
            Ok(r) => r,
            Err(e) => return format!("no answer ({e})"),
        };
        let status = resp.status();
        let body = match resp.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => return format!("{} cut", status.as_u16()),
        };
        if status == StatusCode::OK && matches!(kind, Kind::Stream(_)) {
            let has = |w: &[u8]| memchr::memmem::find(&body, w).is_some();
            if has(b"\"error\"") {
                return "200 + error event".to_string();
            }
            if !has(b"[DONE]") {
                return "200 without [DONE]".to_string();
            }
        }
        status.as_u16().to_string()
    };
    let class = match tokio::time::timeout(CLIENT_TIMEOUT, fut).await {
        Ok(c) => c,
        Err(_) => "no answer within 15 s".to_string(),
    };
    (class, t0.elapsed())
}

async fn warm_up(env: &Env, n: usize) {
    for _ in 0..n {
        let (class, _) = send(env, Kind::Generate).await;
        if class != "200" {
            eprintln!("[faults] warning: warm-up request answered {class}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// One case

struct Row {
    fault: String,
    setup: &'static str,
    n: usize,
    mix: BTreeMap<String, usize>,
    lat_ms: Vec<f64>,
    /// Times to answer of the answers that were not a clean 200.
    err_ms: Vec<f64>,
    detect: String,
    faulty_saw: u64,
    decode_saw: u64,
    held_after: (u64, u64),
    /// When the engines held nothing any more, after the last answer (bounded: 2 s).
    released: Option<Duration>,
    held_1s: (u64, u64),
    p_abort: (u64, u64),
    d_abort: (u64, u64),
    target: String,
    verdict: String,
}

impl Row {
    fn errors(&self) -> usize {
        self.mix
            .iter()
            .filter(|(k, _)| k.as_str() != "200")
            .map(|(_, v)| v)
            .sum()
    }
    fn pct(&self, p: f64) -> f64 {
        pct(&self.lat_ms, p)
    }
    fn max(&self) -> f64 {
        self.lat_ms.last().copied().unwrap_or(f64::NAN)
    }
    /// Slowest error answer (0 when there was none).
    fn err_max(&self) -> f64 {
        self.err_ms.last().copied().unwrap_or(0.0)
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

/// Sends `n` requests 2 ms apart and records what the client and the engines saw.
async fn measure(env: &Env, faulty: &SimEngine, kind: Kind, n: usize) -> Row {
    let p0 = env.prefill_stats();
    let d0 = env.decode_stats();
    let f0 = faulty.stats().requests_total;
    let futs = (0..n).map(|i| async move {
        tokio::time::sleep(STAGGER * i as u32).await;
        send(env, kind).await
    });
    let answers = futures_util::future::join_all(futs).await;
    let held_after = (env.prefill_stats().held_now, env.decode_stats().held_now);
    let t = Instant::now();
    let mut released = None;
    while t.elapsed() < Duration::from_secs(2) {
        if env.prefill_stats().held_now + env.decode_stats().held_now == 0 {
            released = Some(t.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Let counters of cancelled legs land.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let p1 = env.prefill_stats();
    let d1 = env.decode_stats();
    let mut mix = BTreeMap::new();
    let mut lat_ms: Vec<f64> = Vec::with_capacity(n);
    let mut err_ms: Vec<f64> = Vec::new();
    for (class, d) in answers {
        let ms = d.as_secs_f64() * 1000.0;
        if class != "200" {
            err_ms.push(ms);
        }
        *mix.entry(class).or_insert(0) += 1;
        lat_ms.push(ms);
    }
    lat_ms.sort_by(f64::total_cmp);
    err_ms.sort_by(f64::total_cmp);
    Row {
        fault: String::new(),
        setup: "",
        n,
        mix,
        lat_ms,
        err_ms,
        detect: "—".into(),
        faulty_saw: faulty.stats().requests_total - f0,
        decode_saw: d1.requests_total - d0.requests_total,
        held_after,
        released,
        held_1s: (p1.held_now, d1.held_now),
        p_abort: (
            p1.aborted - p0.aborted,
            p1.client_disconnects - p0.client_disconnects,
        ),
        d_abort: (
            d1.aborted - d0.aborted,
            d1.client_disconnects - d0.client_disconnects,
        ),
        target: String::new(),
        verdict: String::new(),
    }
}

// ---------------------------------------------------------------------------------------
// Cases

#[derive(Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// The faulty engine is the only one of its role.
    Only,
    /// One healthy engine of that role remains.
    Spare,
}

impl Setup {
    fn label(self) -> &'static str {
        match self {
            Setup::Only => "(a) only",
            Setup::Spare => "(b) +healthy",
        }
    }
}

fn prefills(setup: Setup, faulty: EngineConfig) -> Vec<EngineConfig> {
    let mut v = vec![engine(faulty)];
    if setup == Setup::Spare {
        v.push(engine(EngineConfig::prefill(1)));
    }
    v
}

fn decodes(setup: Setup, faulty: EngineConfig) -> Vec<EngineConfig> {
    let mut v = vec![engine(faulty)];
    if setup == Setup::Spare {
        v.push(engine(EngineConfig::decode(1)));
    }
    v
}

fn set(e: &SimEngine, f: impl FnOnce(&mut Faults)) {
    let mut faults = e.faults();
    f(&mut faults);
    e.set_faults(faults);
}

/// Targets of a fault visible before dispatch.
fn judge_visible(r: &mut Row, setup: Setup) {
    match setup {
        Setup::Spare => {
            r.target = "0 client errors".into();
            r.verdict = ok_text(r.errors() == 0);
        }
        Setup::Only => {
            r.target = "503 ≤ 10 ms, decode never receives".into();
            let all_503 = r.mix.get("503").copied().unwrap_or(0) == r.n;
            r.verdict = ok_text(all_503 && r.pct(0.99) <= 10.0 && r.decode_saw == 0);
        }
    }
}

/// Targets of a prefill 4xx/5xx. The simulated prefill answers its error at once, so the
/// time to an error answer bounds "time after the prefill's answer" from above.
fn judge_prefill_status(r: &mut Row, setup: Setup) {
    let fast = r.err_max() <= 10.0;
    let has_4xx = r.mix.keys().any(|k| k.starts_with('4'));
    match setup {
        Setup::Only => {
            r.target = "error answered ≤ 10 ms after the prefill's".into();
            r.verdict = ok_text(fast);
        }
        Setup::Spare if has_4xx => {
            r.target =
                "4xx passed through ≤ 10 ms after the prefill's (a client error: not retried)"
                    .into();
            r.verdict = ok_text(fast);
        }
        Setup::Spare => {
            r.target = "0 client errors (retried on the healthy prefill)".into();
            r.verdict = ok_text(r.errors() == 0);
        }
    }
}

fn ok_text(ok: bool) -> String {
    if ok {
        "met".into()
    } else {
        "**missed**".into()
    }
}

/// Prefill fault set at run time, visible before dispatch: waits until the router sees it.
async fn prefill_visible(
    name: &str,
    setup: Setup,
    n: usize,
    seen: bool,
    fault: fn(&mut Faults),
) -> Row {
    let env = start(
        prefills(setup, EngineConfig::prefill(1)),
        vec![engine(EngineConfig::decode(1))],
    )
    .await;
    env.wait_routable(&[]).await;
    warm_up(&env, 4).await;
    let faulty = &env.cluster.prefills[0];
    let t0 = Instant::now();
    set(faulty, fault);
    let mut detect = "not waited for".to_string();
    if seen {
        let d = env
            .wait_pool(Duration::from_secs(10), |s| !routable(s, faulty, true))
            .await;
        detect = d.map_or("not within 10 s".into(), |_| {
            format!("{:.0} ms", t0.elapsed().as_secs_f64() * 1000.0)
        });
    }
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = name.to_string();
    r.setup = setup.label();
    r.detect = detect;
    if seen {
        judge_visible(&mut r, setup);
    } else {
        r.target = "(not yet visible: retried / failed fast)".into();
        r.verdict = if setup == Setup::Spare {
            ok_text(r.errors() == 0)
        } else {
            "—".into()
        };
    }
    r
}

async fn ranks_never_registered(setup: Setup, n: usize) -> Row {
    let mut p = EngineConfig::prefill(1);
    p.faults.register_none = true;
    let env = start(prefills(setup, p), vec![engine(EngineConfig::decode(1))]).await;
    env.wait_routable(&[0]).await;
    let faulty = &env.cluster.prefills[0];
    // The router has looked at the faulty prefill (healthy, ranks not Unknown any more).
    let t0 = Instant::now();
    let d = env
        .wait_pool(Duration::from_secs(10), |s| {
            s.prefills.iter().any(|w| {
                w.url.as_str() == faulty.url()
                    && w.healthy
                    && !w.ranks.is_empty()
                    && w.ranks.iter().all(|r| *r != RankReadiness::Unknown)
            })
        })
        .await;
    if setup == Setup::Spare {
        warm_up(&env, 4).await;
    }
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = "ranks never registered".into();
    r.setup = setup.label();
    r.detect = d.map_or("not within 10 s".into(), |_| {
        format!("view after {:.0} ms", t0.elapsed().as_secs_f64() * 1000.0)
    });
    judge_visible(&mut r, setup);
    r
}

/// A prefill fault that only shows when a request arrives.
async fn prefill_runtime(
    name: &str,
    setup: Setup,
    n: usize,
    fault: fn(&mut Faults),
    judge: fn(&mut Row, Setup),
) -> Row {
    let env = start(
        prefills(setup, EngineConfig::prefill(1)),
        vec![engine(EngineConfig::decode(1))],
    )
    .await;
    env.wait_routable(&[]).await;
    warm_up(&env, 4).await;
    let faulty = &env.cluster.prefills[0];
    set(faulty, fault);
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = name.to_string();
    r.setup = setup.label();
    judge(&mut r, setup);
    r
}

async fn decode_runtime(
    name: &str,
    setup: Setup,
    n: usize,
    kind: Kind,
    fault: fn(&mut Faults),
    judge: fn(&mut Row, Setup),
) -> Row {
    let env = start(
        vec![engine(EngineConfig::prefill(1))],
        decodes(setup, EngineConfig::decode(1)),
    )
    .await;
    env.wait_routable(&[]).await;
    warm_up(&env, 4).await;
    let faulty = &env.cluster.decodes[0];
    set(faulty, fault);
    let mut r = measure(&env, faulty, kind, n).await;
    r.fault = name.to_string();
    r.setup = setup.label();
    judge(&mut r, setup);
    r
}

/// Decode engines without SGLang PR #24772 (`legacy_bootstrap_bug`): a failed rank lookup
/// hangs the decode until its waiting timeout. The failing lookup: rank `r'` of a DP-2
/// prefill is unregistered after the router saw it Ready, while the decode already knows
/// the prefill (sentinel cached by one warm-up request on the other rank).
async fn legacy_bug(setup: Setup, n: usize, seen: bool) -> Row {
    let mut d = EngineConfig::decode(1);
    d.legacy_bootstrap_bug = true;
    let env = start(prefills(setup, EngineConfig::prefill(2)), vec![engine(d)]).await;
    env.wait_routable(&[]).await;
    let faulty = &env.cluster.prefills[0];
    // Exactly one request on the faulty prefill, so the decode caches its layout and one
    // rank's route only.
    for _ in 0..6 {
        if faulty.stats().requests_total > 0 {
            break;
        }
        warm_up(&env, 1).await;
    }
    let per_rank = faulty.stats().requests_per_rank;
    let used = per_rank.iter().position(|c| *c > 0).unwrap_or(0) as u32;
    let other = 1 - used.min(1);
    let t0 = Instant::now();
    set(faulty, |f| f.unregistered_ranks = vec![other]);
    let mut detect = "not waited for (stale view)".to_string();
    if seen {
        let dd = env
            .wait_pool(Duration::from_secs(10), |s| !routable(s, faulty, true))
            .await;
        detect = dd.map_or("not within 10 s".into(), |_| {
            format!("{:.0} ms", t0.elapsed().as_secs_f64() * 1000.0)
        });
    }
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = if seen {
        "legacy bootstrap bug, tracker saw the rank fail".into()
    } else {
        format!("legacy bootstrap bug, stale view (rank {other} of 2 unregistered)")
    };
    r.setup = setup.label();
    r.detect = detect;
    if seen {
        r.target = "never dispatched to the failing prefill".into();
        r.verdict = ok_text(r.faulty_saw == 0 && (setup == Setup::Only || r.errors() == 0));
    } else {
        r.target = "answered at the decode first-byte deadline (2 s here)".into();
        // The error answers are the requests that hit the failing rank.
        r.verdict = ok_text(r.err_max() <= 2000.0 + 100.0);
    }
    r
}

// ---------------------------------------------------------------------------------------
// Client disconnects

struct DisconnectRow {
    case: &'static str,
    n: usize,
    held_at_drop: Vec<u64>,
    cancel_ms: Vec<f64>,
    not_cancelled: usize,
    p_abort: (u64, u64),
    d_abort: (u64, u64),
    /// Requests that could not be dropped as planned.
    early: Vec<String>,
}

/// `before_first_byte`: the client gives up during a 200 ms prefill, once both engines hold
/// the request; otherwise it drops the stream after its first chunk (a 100-token stream at 20 ms per token). Then the
/// engines are polled every millisecond until neither holds the request.
/// Waits until the prefills hold at least `p` and the decodes at least `d` requests.
async fn wait_held(env: &Env, p: u64, d: u64, bound: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < bound {
        if env.prefill_stats().held_now >= p && env.decode_stats().held_now >= d {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    false
}

async fn disconnect(before_first_byte: bool, n: usize) -> DisconnectRow {
    let mut p = EngineConfig::prefill(1);
    let mut d = EngineConfig::decode(1);
    p = engine(p);
    d = engine(d);
    if before_first_byte {
        p.prefill_delay = Duration::from_millis(200);
    } else {
        d.itl = Duration::from_millis(20);
    }
    let env = start(vec![p], vec![d]).await;
    env.wait_routable(&[]).await;
    warm_up(&env, 2).await;
    let p0 = env.prefill_stats();
    let d0 = env.decode_stats();
    let mut held_at_drop = Vec::new();
    let mut cancel_ms = Vec::new();
    let mut not_cancelled = 0;
    let mut early: Vec<String> = Vec::new();
    for _ in 0..n {
        let req = request(&env, Kind::Stream(100));
        let mut fut = Box::pin(env.client.request(req));
        if before_first_byte {
            // Drop the request once both legs are held by the engines (the prefill is
            // computing, the decode waits for its KV), and 20 ms more.
            let reached = tokio::select! {
                r = &mut fut => {
                    early.push(match r {
                        Ok(resp) => format!("answered {} before the drop", resp.status()),
                        Err(e) => format!("client error before the drop: {e}"),
                    });
                    false
                }
                ok = wait_held(&env, 1, 1, Duration::from_secs(1)) => ok,
            };
            if reached {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            drop(fut);
        } else {
            match tokio::time::timeout(Duration::from_secs(5), fut).await {
                Ok(Ok(resp)) => {
                    let mut body = resp.into_body();
                    let _ = tokio::time::timeout(Duration::from_secs(5), body.frame()).await;
                    drop(body);
                }
                other => early.push(format!("no stream to drop: {other:?}")),
            }
        }
        // The future (or body) is dropped: the connection closes now.
        let t_drop = Instant::now();
        held_at_drop.push(env.prefill_stats().held_now + env.decode_stats().held_now);
        let mut done = false;
        while t_drop.elapsed() < Duration::from_secs(2) {
            if env.prefill_stats().held_now + env.decode_stats().held_now == 0 {
                done = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if done {
            cancel_ms.push(t_drop.elapsed().as_secs_f64() * 1000.0);
        } else {
            not_cancelled += 1;
            // Do not let one stuck request spoil the next one.
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(5)
                && env.prefill_stats().held_now + env.decode_stats().held_now > 0
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let p1 = env.prefill_stats();
    let d1 = env.decode_stats();
    cancel_ms.sort_by(f64::total_cmp);
    DisconnectRow {
        case: if before_first_byte {
            "client gives up before the first byte (during a 200 ms prefill, both legs held)"
        } else {
            "client drops the stream after its first chunk"
        },
        n,
        held_at_drop,
        cancel_ms,
        not_cancelled,
        p_abort: (
            p1.aborted - p0.aborted,
            p1.client_disconnects - p0.client_disconnects,
        ),
        d_abort: (
            d1.aborted - d0.aborted,
            d1.client_disconnects - d0.client_disconnects,
        ),
        early,
    }
}

// ---------------------------------------------------------------------------------------
// Main

/// Runs one case on a fresh runtime, dropped afterwards (ending every router and engine task).
fn run<T>(label: &str, fut: impl Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let t0 = Instant::now();
    let out = rt.block_on(fut);
    rt.shutdown_timeout(Duration::from_millis(500));
    eprintln!("[faults] {label}: {:.1} s", t0.elapsed().as_secs_f64());
    out
}

fn set_down(f: &mut Faults) {
    f.down = true;
}
fn set_bootstrap_down(f: &mut Faults) {
    f.bootstrap_down = true;
}

fn main() {
    let k = knobs();
    let n = k.n;
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    for setup in [Setup::Only, Setup::Spare] {
        rows.push(run(
            "prefill down (seen)",
            prefill_visible("prefill down (router saw it)", setup, n, true, set_down),
        ));
        rows.push(run(
            "prefill down (at once)",
            prefill_visible("prefill down, requests at once", setup, n, false, set_down),
        ));
        rows.push(run(
            "bootstrap down (seen)",
            prefill_visible(
                "bootstrap server down (router saw it)",
                setup,
                n,
                true,
                set_bootstrap_down,
            ),
        ));
        rows.push(run(
            "bootstrap down (at once)",
            prefill_visible(
                "bootstrap server down, requests at once",
                setup,
                n,
                false,
                set_bootstrap_down,
            ),
        ));
        rows.push(run(
            "ranks never registered",
            ranks_never_registered(setup, n),
        ));
        rows.push(run(
            "prefill 500",
            prefill_runtime(
                "prefill answers 500",
                setup,
                n,
                |f| f.prefill_status = Some(500),
                judge_prefill_status,
            ),
        ));
        rows.push(run(
            "prefill 400",
            prefill_runtime(
                "prefill answers 400",
                setup,
                n,
                |f| f.prefill_status = Some(400),
                judge_prefill_status,
            ),
        ));
        rows.push(run(
            "prefill hangs",
            prefill_runtime(
                "prefill hangs",
                setup,
                n,
                |f| f.prefill_hang = true,
                |r, _| {
                    r.target = "answered at the prefill timeout (3 s here), nothing held".into();
                    r.verdict = ok_text(r.max() <= 3000.0 + 200.0 && r.held_1s == (0, 0));
                },
            ),
        ));
        rows.push(run(
            "prefill dies mid-request",
            prefill_runtime(
                "prefill dies mid-request",
                setup,
                n,
                |f| f.prefill_die_mid_request = true,
                |r, setup| {
                    r.target = "answered within the heartbeat detection (~2 s)".into();
                    r.verdict = ok_text(
                        r.max() <= 2000.0 + 200.0 && (setup == Setup::Only || r.errors() == 0),
                    );
                },
            ),
        ));
        rows.push(run(
            "prefill goes silent",
            prefill_runtime(
                "prefill goes silent mid-request (hangs + bootstrap unreachable, no connection reset)",
                setup,
                n,
                |f| {
                    f.prefill_hang = true;
                    f.bootstrap_down = true;
                },
                |r, setup| {
                    r.target = "answered within the heartbeat detection (~2 s)".into();
                    r.verdict = ok_text(r.max() <= 2000.0 + 200.0 && (setup == Setup::Only || r.errors() == 0));
                },
            ),
        ));
        rows.push(run(
            "decode 500",
            decode_runtime(
                "decode answers 500",
                setup,
                n,
                Kind::Generate,
                |f| f.decode_status = Some(500),
                |r, setup| {
                    if setup == Setup::Spare {
                        r.target = "0 client errors (retried on the other decode)".into();
                        r.verdict = ok_text(r.errors() == 0);
                    } else {
                        r.target = "error answered ≤ 10 ms, prefill leg cancelled".into();
                        r.verdict = ok_text(r.err_max() <= 10.0 && r.held_1s == (0, 0));
                    }
                },
            ),
        ));
        rows.push(run(
            "decode dies mid-stream",
            decode_runtime(
                "decode dies mid-stream (after 2 chunks)",
                setup,
                n,
                Kind::Stream(8),
                |f| f.decode_die_mid_stream_after = Some(2),
                |r, _| {
                    r.target = "stream ends with an error event, nothing held".into();
                    let ended = r.mix.keys().all(|k| k == "200" || k == "200 + error event");
                    r.verdict = ok_text(ended && r.held_1s == (0, 0));
                },
            ),
        ));
        rows.push(run(
            "slow decode",
            decode_runtime(
                "slow decode (+300 ms TTFT, +50 ms ITL)",
                setup,
                n,
                Kind::Stream(4),
                |f| {
                    f.decode_extra_ttft_ms = 300;
                    f.decode_extra_itl_ms = 50;
                },
                |r, _| {
                    r.target = "no errors (slow is not failed)".into();
                    r.verdict = ok_text(r.errors() == 0);
                },
            ),
        ));
        rows.push(run("legacy bug (stale)", legacy_bug(setup, n, false)));
        rows.push(run("legacy bug (seen)", legacy_bug(setup, n, true)));
    }
    let dis = vec![
        run(
            "disconnect before first byte",
            disconnect(true, k.n_disconnect),
        ),
        run("disconnect mid-stream", disconnect(false, k.n_disconnect)),
    ];
    report(&k, &rows, &dis, started.elapsed());
}

fn pair(p: (u64, u64)) -> String {
    format!("{} / {}", p.0, p.1)
}

fn report(k: &Knobs, rows: &[Row], dis: &[DisconnectRow], total: Duration) {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!();
    println!(
        "## pdgate fault bench ({} requests per case, 2 ms apart; {cores} cores; router, engines and client in one process{})",
        k.n,
        if k.quick { "; QUICK smoke run" } else { "" }
    );
    println!();
    println!("| fault | setup | client-visible answers | time to answer p50 / p99 / max ms | slowest error answer ms | router saw it after | faulty engine got | decode got | held right after (P / D) | all released after ms (held at 2 s, P / D) | prefill aborted / disconnected | decode aborted / disconnected | target | verdict |");
    println!("|---|---|---|---|---:|---|---:|---:|---|---|---|---|---|---|");
    for r in rows {
        let mix: Vec<String> = r.mix.iter().map(|(k, v)| format!("{v}× {k}")).collect();
        println!(
            "| {} | {} | {} | {:.1} / {:.1} / {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.fault,
            r.setup,
            mix.join(", "),
            r.pct(0.5),
            r.pct(0.99),
            r.max(),
            if r.err_ms.is_empty() { "—".to_string() } else { format!("{:.1}", r.err_max()) },
            r.detect,
            r.faulty_saw,
            r.decode_saw,
            pair(r.held_after),
            match r.released {
                Some(_) if r.held_after == (0, 0) => "—".to_string(),
                Some(d) => format!("{:.1}", d.as_secs_f64() * 1000.0),
                None => format!("**not within 2 s** ({})", pair(r.held_1s)),
            },
            pair(r.p_abort),
            pair(r.d_abort),
            r.target,
            r.verdict
        );
    }
    println!();
    println!("| client disconnect | n | engines holding it at the drop (min–max) | both legs released after p50 / p99 / max ms | not released within 2 s | prefill aborted / disconnected | decode aborted / disconnected | target ≤ 100 ms |");
    println!("|---|---:|---|---|---:|---|---|---|");
    for d in dis {
        let lo = d.held_at_drop.iter().min().copied().unwrap_or(0);
        let hi = d.held_at_drop.iter().max().copied().unwrap_or(0);
        let max = d.cancel_ms.last().copied().unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {lo}–{hi} | {:.1} / {:.1} / {:.1} | {} | {} | {} | {} |",
            d.case,
            d.n,
            pct(&d.cancel_ms, 0.5),
            pct(&d.cancel_ms, 0.99),
            max,
            d.not_cancelled,
            pair(d.p_abort),
            pair(d.d_abort),
            ok_text(d.not_cancelled == 0 && max <= 100.0)
        );
    }
    for d in dis {
        for e in &d.early {
            println!("- note ({}): {e}", d.case);
        }
    }
    println!();
    println!("(total {:.1} s)", total.as_secs_f64());
}
