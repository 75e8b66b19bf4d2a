//! Shared harness for router integration tests: simulated engines on 127.0.0.1 port 0, a
//! router on a port-0 listener it keeps, fast health and bootstrap intervals, and a small
//! HTTP client.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pdgate::config::Config;
use pdgate::dispatch::RngSource;
use pdgate::router::Router;
use pdgate_sim::{EngineConfig, Faults, SimCluster, SimEngine, StatsSnapshot};

pub struct Env {
    pub cluster: SimCluster,
    pub router: Router,
    pub client: Client<HttpConnector, Full<Bytes>>,
}

/// Router settings for tests: checks every 50–100 ms so that state changes show fast.
pub fn fast_config() -> Config {
    let mut cfg = Config::default();
    cfg.health.interval_secs = 0.05;
    cfg.health.timeout_secs = 0.5;
    cfg.health.failure_threshold = 2;
    cfg.health.success_threshold = 1;
    cfg.bootstrap.heartbeat_interval_ms = 100;
    cfg.bootstrap.heartbeat_max_failures = 2;
    cfg.bootstrap.refresh_interval_ms = 100;
    cfg.bootstrap.max_route_reads_per_sec = 10_000.0;
    cfg.bootstrap.http_timeout_ms = 500;
    cfg.timeouts.connect_ms = 500;
    cfg.timeouts.prefill_secs = 10;
    cfg.timeouts.decode_first_byte_secs = 2;
    cfg.timeouts.stream_idle_secs = 5;
    cfg.timeouts.request_secs = 30;
    cfg
}

/// Engine settings for tests: short engine-side timeouts so that nothing hangs long.
pub fn fast_engine(mut e: EngineConfig) -> EngineConfig {
    e.prefill_delay = Duration::from_millis(2);
    e.ttft = Duration::from_millis(2);
    e.itl = Duration::from_millis(1);
    e.default_output_tokens = 4;
    e.sentinel_interval = Duration::from_millis(50);
    e.sentinel_attempts = 5;
    e.heartbeat_interval = Duration::from_millis(200);
    e.waiting_timeout = Duration::from_secs(20);
    e.bootstrap_timeout = Duration::from_secs(20);
    e
}

/// Adds every engine of a simulated cluster to `cfg` as a worker (prefills with their
/// bootstrap ports).
pub fn add_sim_workers(cfg: &mut Config, cluster: &SimCluster) {
    cfg.add_workers(cluster.prefill_endpoints(), cluster.decode_urls());
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(c)
}

/// Engines (with [`fast_engine`] settings) plus a router in front of them.
pub async fn start(
    prefill: Vec<EngineConfig>,
    decode: Vec<EngineConfig>,
    tweak: impl FnOnce(&mut Config),
) -> Env {
    let prefill: Vec<_> = prefill.into_iter().map(fast_engine).collect();
    let decode: Vec<_> = decode.into_iter().map(fast_engine).collect();
    start_as_is(prefill, decode, tweak).await
}

/// One prefill and one decode engine (DP 1 each) behind a router with the test defaults,
/// routable.
pub async fn start_pair() -> Env {
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(1, 1).await;
    env
}

/// Like [`start`], with the engine configurations exactly as given (for a test that needs
/// one of the settings [`fast_engine`] overrides).
pub async fn start_as_is(
    prefill: Vec<EngineConfig>,
    decode: Vec<EngineConfig>,
    tweak: impl FnOnce(&mut Config),
) -> Env {
    start_env(prefill, decode, tweak, false).await
}

/// Like [`start_as_is`], plus the admin listener on 127.0.0.1 port 0
/// (`env.router.admin`).
pub async fn start_with_admin(
    prefill: Vec<EngineConfig>,
    decode: Vec<EngineConfig>,
    tweak: impl FnOnce(&mut Config),
) -> Env {
    start_env(prefill, decode, tweak, true).await
}

async fn start_env(
    prefill: Vec<EngineConfig>,
    decode: Vec<EngineConfig>,
    tweak: impl FnOnce(&mut Config),
    admin: bool,
) -> Env {
    let cluster = SimCluster::spawn(&prefill, &decode)
        .await
        .expect("sim cluster");
    let mut cfg = fast_config();
    add_sim_workers(&mut cfg, &cluster);
    tweak(&mut cfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let admin = if admin {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind admin");
        pdgate::router::AdminListener::Bound(l)
    } else {
        pdgate::router::AdminListener::Off
    };
    let router =
        pdgate::router::start_with(cfg, Some(listener), admin, RngSource::Seeded(1.into()))
            .await
            .expect("router");
    Env {
        cluster,
        router,
        client: client(),
    }
}

impl Env {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.router.url(), path)
    }

    /// The router's `host:port`, for raw sockets.
    pub fn addr(&self) -> String {
        self.router.server.local_addr().to_string()
    }

    /// Waits until `p` prefill ranks and `d` decode ranks are routable (bounded: 10 s).
    pub async fn wait_routable(&self, p: usize, d: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.router.pool.load();
            if s.routable_ranks(pdgate::types::Role::Prefill) == p
                && s.routable_ranks(pdgate::types::Role::Decode) == d
            {
                return;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "not routable in time: prefill {} of {p}, decode {} of {d}; {:?}",
                    s.routable_ranks(pdgate::types::Role::Prefill),
                    s.routable_ranks(pdgate::types::Role::Decode),
                    s.prefills
                        .iter()
                        .map(|w| (
                            w.shared.url.to_string(),
                            w.facts.healthy,
                            w.facts.ranks.clone()
                        ))
                        .collect::<Vec<_>>()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until a condition on the router's pool holds (bounded: 10 s).
    pub async fn wait_pool(&self, what: &str, f: impl Fn(&pdgate::pool::Snapshot) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !f(&self.router.pool.load()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.cluster.total_stats()
    }

    /// Waits until no engine holds a request (bounded: 10 s), then returns the totals.
    pub async fn settled_stats(&self) -> StatsSnapshot {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.stats();
            if s.held_now == 0 {
                return s;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "engines still hold requests: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> hyper::Response<Incoming> {
        let mut b = Request::builder().method(method).uri(self.url(path));
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = b.body(Full::new(body.into())).expect("request");
        self.client.request(req).await.expect("router answered")
    }

    /// One call to the admin listener (with `Authorization: Bearer <token>` when given);
    /// the whole answer.
    pub async fn admin(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> (StatusCode, HeaderMap, Bytes) {
        let base = self.router.admin_url().expect("the admin listener runs");
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{base}{path}"));
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        if !body.is_empty() {
            b = b.header("content-type", "application/json");
        }
        let req = b
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(30), self.client.request(req))
            .await
            .expect("admin answered in time")
            .expect("admin answered");
        let (parts, body) = resp.into_parts();
        let bytes = tokio::time::timeout(Duration::from_secs(30), body.collect())
            .await
            .expect("body in time")
            .expect("body")
            .to_bytes();
        (parts.status, parts.headers, bytes)
    }

    /// POSTs a JSON body; returns the answer with its body still coming (a stream).
    pub async fn post_streaming(&self, path: &str, body: &str) -> hyper::Response<Incoming> {
        self.send(
            "POST",
            path,
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await
    }

    /// The index of the one decode engine that holds a request now.
    pub fn busy_decode(&self) -> usize {
        let held: Vec<usize> = (0..self.cluster.decodes.len())
            .filter(|i| self.cluster.decodes[*i].stats().held_now > 0)
            .collect();
        assert_eq!(held.len(), 1, "one decode holds requests: {held:?}");
        held[0]
    }

    /// POSTs JSON and reads the whole answer.
    pub async fn post(&self, path: &str, body: &str) -> (StatusCode, HeaderMap, Bytes) {
        let resp = self
            .send(
                "POST",
                path,
                &[("content-type", "application/json")],
                body.to_string(),
            )
            .await;
        let (parts, body) = resp.into_parts();
        let bytes = tokio::time::timeout(Duration::from_secs(30), body.collect())
            .await
            .expect("body in time")
            .expect("body")
            .to_bytes();
        (parts.status, parts.headers, bytes)
    }
}

/// The JSON payloads of an SSE body (without `[DONE]`), and whether it ended with `[DONE]`.
pub fn sse_events(body: &[u8]) -> (Vec<serde_json::Value>, bool) {
    let text = std::str::from_utf8(body).expect("utf8");
    let mut out = Vec::new();
    let mut done = false;
    for ev in text.split("\n\n") {
        let Some(data) = ev.trim().strip_prefix("data:") else {
            continue;
        };
        let data = data.trim();
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(
            serde_json::from_str(data)
                .unwrap_or_else(|e| panic!("event is not JSON ({e}): {data}")),
        );
    }
    (out, done)
}

pub const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":4}}"#;
pub const GEN_STREAM: &str =
    r#"{"text":"hello","sampling_params":{"max_new_tokens":4},"stream":true}"#;

/// [`GEN_STREAM`] or [`GEN`].
pub fn gen_body(stream: bool) -> &'static str {
    if stream {
        GEN_STREAM
    } else {
        GEN
    }
}

pub fn with_faults(mut e: EngineConfig, f: Faults) -> EngineConfig {
    e.faults = f;
    e
}

/// Sends `times` requests one after the other; each must succeed (a stream without an
/// error event).
pub async fn expect_ok(env: &Env, stream: bool, times: usize) {
    for _ in 0..times {
        let (st, _, bytes) = env.post("/generate", gen_body(stream)).await;
        assert_eq!(
            st,
            200,
            "stream={stream}: {}",
            String::from_utf8_lossy(&bytes)
        );
        if stream {
            let (events, done) = sse_events(&bytes);
            assert!(
                done && events.iter().all(|e| e.get("error").is_none()),
                "{}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }
}

/// A leg's rid, `pdg-<request id>-<attempt, 2 digits><p|d>`, as (request id, attempt, side).
pub fn split_leg_rid(rid: &str) -> Option<(&str, u32, char)> {
    let (id, tail) = rid.strip_prefix("pdg-")?.rsplit_once('-')?;
    let side = tail.chars().last()?;
    let attempt = tail.get(..tail.len() - 1)?.parse().ok()?;
    Some((id, attempt, side))
}

/// The request ids whose `side` leg `e` saw at attempt `attempt` (0 = the first).
pub fn attempts_seen(e: &SimEngine, side: char, attempt: u32) -> Vec<String> {
    e.recent_rids()
        .iter()
        .filter_map(|r| split_leg_rid(r))
        .filter(|(_, a, s)| *a == attempt && *s == side)
        .map(|(id, _, _)| id.to_string())
        .collect()
}

/// Checks, from what the engines saw, that the router retried: `failing` got the first
/// attempt (`-00`) of at least one request's `side` leg, and every such request got its
/// second attempt (`-01`) on `other`. Returns how many requests were retried.
pub fn assert_retried(failing: &SimEngine, other: &SimEngine, side: char) -> usize {
    let first = attempts_seen(failing, side, 0);
    let retried = attempts_seen(other, side, 1);
    assert!(
        !first.is_empty(),
        "no first attempt reached the failing engine: nothing was retried; it saw {:?}",
        failing.recent_rids()
    );
    for id in &first {
        assert!(
            retried.contains(id),
            "request {id} failed on the failing engine and was not retried on the other; \
             failing saw {:?}, other saw {:?}",
            failing.recent_rids(),
            other.recent_rids()
        );
    }
    first.len()
}

/// Reads a whole stream (bounded: 20 s); checks that it is a 200 that ended with `[DONE]` and
/// no error event; returns its event count.
pub async fn finish_clean(resp: hyper::Response<Incoming>) -> usize {
    assert_eq!(resp.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
        .await
        .expect("stream in time")
        .expect("stream")
        .to_bytes();
    let (events, done) = sse_events(&body);
    assert!(done, "{}", String::from_utf8_lossy(&body));
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "{events:?}"
    );
    events.len()
}

/// A `MakeWriter` into a shared buffer (a test's captured log lines; `.0` holds the bytes).
#[derive(Clone, Default)]
pub struct Captured(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut v) = self.0.lock() {
            v.extend_from_slice(b);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A `pdgate sim --role ROLE` child process (2 ms to the first token, 15 ms between
/// tokens), killed when dropped, and its engine URL from its READY line (bounded: 10 s).
pub async fn sim_process(role: &str) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_pdgate"))
        .args(["sim", "--role", role, "--ttft-ms", "2", "--itl-ms", "15"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("pdgate sim");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let line = lines
                .next_line()
                .await
                .expect("stdout")
                .expect("a READY line");
            if line.starts_with("READY") {
                return line;
            }
        }
    })
    .await
    .expect("READY in time");
    let url = ready.split_whitespace().nth(2).expect("url").to_string();
    (child, url)
}
