//! Environment, requests and one measured case: the router config, the simulated cluster
//! behind a router (`Env`), the client requests, and the per-case `Row` that `measure` fills.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pdgate::config::Config;
use pdgate::dispatch::RngSource;
use pdgate::pool::Snapshot;
use pdgate::router::Router;
use pdgate::types::Role;
use pdgate_sim::{EngineConfig, SimCluster, SimEngine, StatsSnapshot};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Spacing of the requests of one case.
const STAGGER: Duration = Duration::from_millis(2);
/// Client-side bound on one request.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

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
pub(crate) fn engine(mut e: EngineConfig) -> EngineConfig {
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

pub(crate) struct Env {
    pub(crate) cluster: SimCluster,
    router: Router,
    pub(crate) client: HttpClient,
}

pub(crate) async fn start(prefill: Vec<EngineConfig>, decode: Vec<EngineConfig>) -> Env {
    let cluster = SimCluster::spawn(&prefill, &decode)
        .await
        .expect("sim cluster");
    let mut cfg = router_config();
    cfg.add_workers(cluster.prefill_endpoints(), cluster.decode_urls());
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
    list.iter()
        .find(|w| w.shared.url.as_str() == url)
        .map(|w| w.shared.id)
}

pub(crate) fn routable(snap: &Snapshot, e: &SimEngine, prefill: bool) -> bool {
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
    pub(crate) async fn wait_pool(
        &self,
        bound: Duration,
        f: impl Fn(&Snapshot) -> bool,
    ) -> Option<Duration> {
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
    pub(crate) async fn wait_routable(&self, skip_prefill: &[usize]) {
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

    pub(crate) fn prefill_stats(&self) -> StatsSnapshot {
        sum(self.cluster.prefills.iter())
    }
    pub(crate) fn decode_stats(&self) -> StatsSnapshot {
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
pub(crate) enum Kind {
    /// Non-streamed `/generate`.
    Generate,
    /// Streamed `/v1/chat/completions` with `max_tokens` tokens.
    Stream(u32),
}

pub(crate) fn request(env: &Env, kind: Kind) -> Request<Full<Bytes>> {
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

pub(crate) async fn warm_up(env: &Env, n: usize) {
    for _ in 0..n {
        let (class, _) = send(env, Kind::Generate).await;
        if class != "200" {
            eprintln!("[faults] warning: warm-up request answered {class}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// One case

pub(crate) struct Row {
    pub(crate) fault: String,
    pub(crate) setup: &'static str,
    pub(crate) n: usize,
    pub(crate) mix: BTreeMap<String, usize>,
    lat_ms: Vec<f64>,
    /// Times to answer of the answers that were not a clean 200.
    pub(crate) err_ms: Vec<f64>,
    pub(crate) detect: String,
    pub(crate) faulty_saw: u64,
    pub(crate) decode_saw: u64,
    pub(crate) held_after: (u64, u64),
    /// When the engines held nothing any more, after the last answer (bounded: 2 s).
    pub(crate) released: Option<Duration>,
    pub(crate) held_1s: (u64, u64),
    pub(crate) p_abort: (u64, u64),
    pub(crate) d_abort: (u64, u64),
    pub(crate) target: String,
    pub(crate) verdict: String,
}

impl Row {
    pub(crate) fn errors(&self) -> usize {
        self.mix
            .iter()
            .filter(|(k, _)| k.as_str() != "200")
            .map(|(_, v)| v)
            .sum()
    }
    pub(crate) fn pct(&self, p: f64) -> f64 {
        pct(&self.lat_ms, p)
    }
    pub(crate) fn max(&self) -> f64 {
        self.lat_ms.last().copied().unwrap_or(f64::NAN)
    }
    /// Slowest error answer (0 when there was none).
    pub(crate) fn err_max(&self) -> f64 {
        self.err_ms.last().copied().unwrap_or(0.0)
    }
}

pub(crate) fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

/// Sends `n` requests 2 ms apart and records what the client and the engines saw.
pub(crate) async fn measure(env: &Env, faulty: &SimEngine, kind: Kind, n: usize) -> Row {
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
