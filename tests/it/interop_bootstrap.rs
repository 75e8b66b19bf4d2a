//! Interop: pdgate's bootstrap client and tracker against SGLang's **real** KV bootstrap
//! server (`CommonKVBootstrapServer` from the sglang 0.5.23 wheel), started by
//! `tests/interop/sglang-bootstrap/bootstrap_server.py` from the venv at
//! `target/sglang-venv` (CI: `VENV=target/sglang-venv tests/interop/sglang-bootstrap/setup.sh`).
//!
//! Prefill ranks are played by the reference client `register_ranks.py put`; what the
//! server answers is recorded in `tests/interop/sglang-bootstrap/observed.md`.
//! Every case runs on a fresh server on 127.0.0.1 (`--port 0`).
//!
//! Without the venv the tests fail when `CI` is set and are skipped (loudly) otherwise.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::interop::{cannot_run, drain, manifest, upstream, venv_python};
use pdgate::bootstrap::client::{
    health, rank_route, sentinel, BootstrapError, Generation, RankRoute, Sentinel,
};
use pdgate::bootstrap::Layout;
use pdgate::config::BootstrapConfig;
use pdgate::pool::{Pool, RankFailure, RankReadiness};
use pdgate::types::Role;
use pdgate::upstream::{parse_base_url, BaseUrl};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Bound on the server printing its READY line.
const READY_WAIT: Duration = Duration::from_secs(30);
/// Bound on any polled state of the tracker.
const POLL_WAIT: Duration = Duration::from_secs(10);
/// Timeout of each direct client call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// The server exits by itself after this long, should a test process die without killing it.
const SERVER_MAX_SECONDS: &str = "120";

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

fn scripts_dir() -> PathBuf {
    manifest().join("tests/interop/sglang-bootstrap")
}

/// The venv's python; a missing venv fails the test (these tests are `#[ignore]`d, so
/// they run only when asked for: `--include-ignored`, as `.ci/run` does).
fn python_or_skip(test: &str) -> Option<PathBuf> {
    let py = venv_python();
    let server = scripts_dir().join("bootstrap_server.py");
    if py.is_file() && server.is_file() {
        return Some(py);
    }
    let why = format!(
        "SGLang bootstrap venv not found: need {} and {}; build it with \
         `VENV=target/sglang-venv tests/interop/sglang-bootstrap/setup.sh` (from {})",
        py.display(),
        server.display(),
        manifest().display()
    );
    cannot_run(test, &why)
}

/// One real SGLang bootstrap server, child of this test, killed on drop.
struct BootstrapServer {
    py: PathBuf,
    child: Child,
    url: String,
    base: BaseUrl,
    port: u16,
    log: Arc<Mutex<String>>,
}

impl BootstrapServer {
    async fn start(py: &PathBuf) -> BootstrapServer {
        let mut child = Command::new(py)
            .arg(scripts_dir().join("bootstrap_server.py"))
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--max-seconds", SERVER_MAX_SECONDS])
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", py.display()));
        let log = Arc::new(Mutex::new(String::new()));
        drain(child.stderr.take().unwrap(), log.clone());
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(READY_WAIT, async {
            while let Some(l) = lines.next_line().await.expect("read server stdout") {
                if let Some(rest) = l.strip_prefix("READY ") {
                    return Some(rest.to_string());
                }
                log.lock().unwrap().push_str(&format!("stdout: {l}\n"));
            }
            None
        })
        .await;
        let rest = match ready {
            Ok(Some(rest)) => rest,
            Ok(None) => panic!(
                "bootstrap server exited before READY; its log:\n{}",
                log.lock().unwrap()
            ),
            Err(_) => panic!(
                "bootstrap server printed no READY line within {READY_WAIT:?}; its log:\n{}",
                log.lock().unwrap()
            ),
        };
        // Keep stdout drained for the rest of the server's life.
        drain(lines.into_inner(), log.clone());
        // `READY http://127.0.0.1:PORT pid=N`
        let mut parts = rest.split_whitespace();
        let url = parts.next().expect("READY url").to_string();
        let pid: u32 = parts
            .next()
            .and_then(|p| p.strip_prefix("pid="))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("bad READY line: READY {rest}"));
        assert_eq!(
            Some(pid),
            child.id(),
            "the READY pid is our child (so killing it kills the server)"
        );
        let base = parse_base_url(&url).unwrap_or_else(|e| panic!("READY url {url}: {e}"));
        assert_eq!(base.host(), "127.0.0.1");
        let port = base.port();
        assert_ne!(port, 0);
        BootstrapServer {
            py: py.clone(),
            child,
            url,
            base,
            port,
            log,
        }
    }

    /// `register_ranks.py put --url URL <args>`: returns the rank port registered per DP
    /// rank, as the script reports it (a re-registered rank keeps its last port, as the
    /// server does).
    async fn put(&self, args: &[&str]) -> BTreeMap<u32, u16> {
        let out = Command::new(&self.py)
            .arg(scripts_dir().join("register_ranks.py"))
            .args(["--url", &self.url, "put"])
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(20), out)
            .await
            .expect("register_ranks.py timed out")
            .expect("run register_ranks.py");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "register_ranks.py put {args:?} failed ({}):\n{stdout}\n{}\nserver log:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        // `PUT /route [dp1/cp0/tp0/pp0 port=17001] -> 200 OK`
        let mut ports = BTreeMap::new();
        for line in stdout.lines() {
            let (Some(tag), true) = (
                line.split_once('[').and_then(|(_, r)| r.split_once(']')),
                line.ends_with("-> 200 OK"),
            ) else {
                panic!("unexpected register_ranks.py line: {line}");
            };
            let (rank, port) = tag.0.split_once(' ').expect("tag and port");
            let dp: u32 = rank
                .strip_prefix("dp")
                .and_then(|r| r.split('/').next())
                .and_then(|d| d.parse().ok())
                .unwrap_or_else(|| panic!("dp in {line}"));
            let port: u16 = port
                .strip_prefix("port=")
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("port in {line}"));
            ports.insert(dp, port);
        }
        assert!(!ports.is_empty(), "register_ranks.py registered nothing");
        ports
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGKILL and reap: the port is closed when this returns.
    async fn kill(&mut self) {
        self.child.kill().await.expect("kill bootstrap server");
    }
}

/// A loopback port nothing listens on (bound, then released).
fn unused_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn layout(dp: u32, page_size: u64, dtype: &str) -> Layout {
    Layout {
        generation: Generation::V3,
        dp_size: dp,
        attn_tp_size: 1,
        attn_cp_size: 1,
        pp_size: 1,
        follow_bootstrap_room: true,
        page_size: Some(page_size),
        kv_cache_dtype: Some(dtype.to_string()),
    }
}

fn assert_not_ready(s: &Sentinel, what: &str) {
    match s {
        Sentinel::NotReady(text) => assert!(
            text.contains("not fully registered"),
            "{what}: 503 text {text:?}"
        ),
        other => panic!("{what}: want NotReady, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// 1. Full layouts: dp 1, 2, 4
// ---------------------------------------------------------------------------------------

#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn full_layouts_dp1_dp2_dp4() {
    let Some(py) = python_or_skip("full_layouts_dp1_dp2_dp4") else {
        return;
    };
    let up = upstream();
    // (dp, page_size, kv_cache_dtype, base_port)
    let cases: &[(u32, u64, &str, u16)] = &[
        (1, 1, "auto", 17100),
        (2, 64, "bfloat16", 17200),
        (4, 1, "auto", 17400),
    ];
    for &(dp, page, dtype, base_port) in cases {
        let what = format!("dp{dp}");
        let srv = BootstrapServer::start(&py).await;

        // Before any PUT: newest-first detection and the pinned generation both see 503,
        // and so does every rank.
        for gen in [None, Some(Generation::V3)] {
            let s = sentinel(&up, &srv.base, gen, CALL_TIMEOUT).await.unwrap();
            assert_not_ready(&s, &format!("{what} before PUT, gen {gen:?}"));
        }
        for r in 0..=dp {
            let got = rank_route(&up, &srv.base, Generation::V3, r, CALL_TIMEOUT)
                .await
                .unwrap();
            assert_eq!(got, RankRoute::NotReady, "{what} rank {r} before PUT");
        }

        let dp_s = dp.to_string();
        let page_s = page.to_string();
        let base_s = base_port.to_string();
        let ports = srv
            .put(&[
                "--dp-size",
                &dp_s,
                "--dp-mode",
                "both",
                "--page-size",
                &page_s,
                "--kv-cache-dtype",
                dtype,
                "--base-port",
                &base_s,
            ])
            .await;
        assert_eq!(
            ports.keys().copied().collect::<Vec<_>>(),
            (0..dp).collect::<Vec<_>>(),
            "{what}: the script registered every rank"
        );

        for gen in [None, Some(Generation::V3)] {
            let s = sentinel(&up, &srv.base, gen, CALL_TIMEOUT).await.unwrap();
            assert_eq!(
                s,
                Sentinel::Ready(layout(dp, page, dtype)),
                "{what} after PUT, gen {gen:?}"
            );
        }
        for (&r, &port) in &ports {
            let got = rank_route(&up, &srv.base, Generation::V3, r, CALL_TIMEOUT)
                .await
                .unwrap();
            assert_eq!(
                got,
                RankRoute::Ready {
                    rank_ip: "127.0.0.1".to_string(),
                    rank_port: port
                },
                "{what} rank {r}"
            );
        }
        match rank_route(&up, &srv.base, Generation::V3, dp, CALL_TIMEOUT)
            .await
            .unwrap()
        {
            RankRoute::Missing(text) => assert!(
                text.contains(&format!("dp_rank={dp}")),
                "{what} out-of-range 404 text {text:?}"
            ),
            other => panic!("{what} rank {dp} (out of range): want Missing, got {other:?}"),
        }
        health(&up, &srv.base, CALL_TIMEOUT).await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// 2. Partial registration: 503 for the sentinel and every rank
// ---------------------------------------------------------------------------------------

#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn partial_registration_is_not_ready() {
    let Some(py) = python_or_skip("partial_registration_is_not_ready") else {
        return;
    };
    let up = upstream();
    let srv = BootstrapServer::start(&py).await;
    let ports = srv.put(&["--dp-size", "4", "--only-dp", "0,1"]).await;
    assert_eq!(ports.len(), 2);

    for gen in [None, Some(Generation::V3)] {
        let s = sentinel(&up, &srv.base, gen, CALL_TIMEOUT).await.unwrap();
        assert_not_ready(&s, &format!("dp4 with 2 ranks, gen {gen:?}"));
        if let Sentinel::NotReady(text) = s {
            assert!(text.contains("2 workers"), "{text:?}");
        }
    }
    // Registered (0, 1), unregistered (2, 3) and out of range (4): all 503 until ready.
    for r in 0..=4 {
        let got = rank_route(&up, &srv.base, Generation::V3, r, CALL_TIMEOUT)
            .await
            .unwrap();
        assert_eq!(got, RankRoute::NotReady, "rank {r}");
    }
}

// ---------------------------------------------------------------------------------------
// 3. Duplicate registration: the server says ready, rank 1 is missing
// ---------------------------------------------------------------------------------------

#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn duplicate_registration_ready_but_rank_missing() {
    let Some(py) = python_or_skip("duplicate_registration_ready_but_rank_missing") else {
        return;
    };
    let up = upstream();
    let srv = BootstrapServer::start(&py).await;
    let ports = srv
        .put(&["--dp-size", "2", "--only-dp", "0,0", "--base-port", "17600"])
        .await;
    assert_eq!(ports, BTreeMap::from([(0, 17600)]));

    // Two PUTs count as two: the sentinel claims the whole dp 2 layout.
    let s = sentinel(&up, &srv.base, None, CALL_TIMEOUT).await.unwrap();
    assert_eq!(s, Sentinel::Ready(layout(2, 1, "auto")));
    let got = rank_route(&up, &srv.base, Generation::V3, 0, CALL_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        got,
        RankRoute::Ready {
            rank_ip: "127.0.0.1".to_string(),
            rank_port: 17600
        }
    );
    // ...but rank 1 never registered: only the per-rank check sees it.
    match rank_route(&up, &srv.base, Generation::V3, 1, CALL_TIMEOUT)
        .await
        .unwrap()
    {
        RankRoute::Missing(text) => assert!(
            text.contains("Bootstrap info not found for dp_rank=1"),
            "404 text {text:?}"
        ),
        other => panic!("rank 1: want Missing, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// 4. Health while alive, Unreachable once killed
// ---------------------------------------------------------------------------------------

#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn health_then_unreachable_after_kill() {
    let Some(py) = python_or_skip("health_then_unreachable_after_kill") else {
        return;
    };
    let up = upstream();
    let mut srv = BootstrapServer::start(&py).await;
    health(&up, &srv.base, CALL_TIMEOUT).await.unwrap();
    // Leave a pooled keep-alive connection behind, as a long-running router would.
    let s = sentinel(&up, &srv.base, None, CALL_TIMEOUT).await.unwrap();
    assert_not_ready(&s, "fresh server");

    srv.kill().await;

    // Twice each: the first call may meet the dead pooled connection, the next a refusal.
    for i in 0..2 {
        match health(&up, &srv.base, CALL_TIMEOUT).await {
            Err(BootstrapError::Unreachable(_)) => {}
            other => panic!("health #{i} after kill: want Unreachable, got {other:?}"),
        }
        for gen in [None, Some(Generation::V3)] {
            match sentinel(&up, &srv.base, gen, CALL_TIMEOUT).await {
                Err(BootstrapError::Unreachable(_)) => {}
                other => {
                    panic!("sentinel #{i} ({gen:?}) after kill: want Unreachable, got {other:?}")
                }
            }
        }
        match rank_route(&up, &srv.base, Generation::V3, 0, CALL_TIMEOUT).await {
            Err(BootstrapError::Unreachable(_)) => {}
            other => panic!("rank_route #{i} after kill: want Unreachable, got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// 5. The tracker end-to-end
// ---------------------------------------------------------------------------------------

fn fast_cfg() -> BootstrapConfig {
    BootstrapConfig {
        heartbeat_interval_ms: 100,
        refresh_interval_ms: 100,
        http_timeout_ms: 1000,
        ..BootstrapConfig::default()
    }
}

/// A pool with one prefill whose tracker polls `srv`; the engine URL has no listener.
fn track(srv: &BootstrapServer) -> Arc<Pool> {
    let pool = Arc::new(Pool::new());
    let engine = parse_base_url(&format!("http://127.0.0.1:{}", unused_port())).unwrap();
    let id = pool.add_worker(Role::Prefill, engine.clone(), None);
    pdgate::bootstrap::tracker::spawn(
        pool.clone(),
        upstream(),
        pdgate::config::live(pdgate::config::Config {
            bootstrap: fast_cfg(),
            ..Default::default()
        }),
        id,
        engine,
        Some(srv.port),
        None,
    );
    pool
}

/// Polls the prefill's view until `pred` holds (bounded by [`POLL_WAIT`]).
async fn wait_for(
    pool: &Pool,
    srv: &BootstrapServer,
    what: &str,
    pred: impl Fn(&pdgate::pool::WorkerView) -> bool,
) {
    let deadline = tokio::time::Instant::now() + POLL_WAIT;
    loop {
        {
            let snap = pool.load();
            let w = &snap.prefills[0];
            if pred(w) {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "{what}: not reached within {POLL_WAIT:?}; ranks {:?}, layout {:?}\nserver log:\n{}",
                    w.facts.ranks,
                    w.facts.layout,
                    srv.log()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn all_ranks(
    w: &pdgate::pool::WorkerView,
    n: usize,
    want: impl Fn(&RankReadiness) -> bool,
) -> bool {
    w.facts.ranks.len() == n && w.facts.ranks.iter().all(want)
}

fn failed(reason: RankFailure) -> impl Fn(&RankReadiness) -> bool {
    move |r| matches!(r, RankReadiness::Failed { reason: got, .. } if *got == reason)
}

#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn tracker_follows_registration_and_loss() {
    let Some(py) = python_or_skip("tracker_follows_registration_and_loss") else {
        return;
    };
    let mut srv = BootstrapServer::start(&py).await;
    let pool = track(&srv);

    // The tracker points at the bootstrap server on the engine's host.
    wait_for(&pool, &srv, "bootstrap info", |w| {
        w.facts.bootstrap.is_some()
    })
    .await;
    {
        let snap = pool.load();
        let b = snap.prefills[0].facts.bootstrap.clone().unwrap();
        assert_eq!(b.url, srv.base);
        assert_eq!(b.port, srv.port);
        assert_eq!(b.host_json, "\"127.0.0.1\"");
    }

    // Nothing registered: 503 -> Bootstrapping, no layout yet.
    wait_for(&pool, &srv, "bootstrapping before PUT", |w| {
        !w.facts.ranks.is_empty()
            && w.facts
                .ranks
                .iter()
                .all(|r| *r == RankReadiness::Bootstrapping)
    })
    .await;
    {
        let snap = pool.load();
        assert_eq!(snap.prefills[0].facts.layout, None);
        assert!(
            !snap.prefills[0].facts.healthy,
            "no health checker runs here"
        );
    }

    let ports = srv.put(&["--dp-size", "2", "--base-port", "17700"]).await;
    assert_eq!(ports, BTreeMap::from([(0, 17700), (1, 17701)]));

    wait_for(&pool, &srv, "every rank ready after full dp 2 PUT", |w| {
        all_ranks(w, 2, |r| *r == RankReadiness::Ready)
    })
    .await;
    let mut lost = {
        let snap = pool.load();
        let w = &snap.prefills[0];
        assert_eq!(w.facts.layout, Some(layout(2, 1, "auto")));
        assert_eq!(w.effective_dp(), 2);
        w.lost.clone()
    };
    let epoch = lost.borrow_and_update().heartbeat;

    srv.kill().await;

    // The heartbeat (and the refresher) see the dead server: every rank Unreachable and
    // the lost epoch bumped.
    // (Ranks going unreachable bump their own entries of the same channel first.)
    tokio::time::timeout(POLL_WAIT, lost.wait_for(|e| e.heartbeat != epoch))
        .await
        .expect("heartbeat epoch did not change within the bound after the kill")
        .expect("lost watch sender alive");
    assert!(lost.borrow().heartbeat > epoch, "lost epoch bumped");
    // The layout is dropped with it, as a decode engine drops its cache.
    wait_for(
        &pool,
        &srv,
        "every rank unreachable, layout dropped after kill",
        |w| all_ranks(w, 2, failed(RankFailure::Unreachable)) && w.facts.layout.is_none(),
    )
    .await;
}

#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn tracker_marks_duplicate_registration_rank_missing() {
    let Some(py) = python_or_skip("tracker_marks_duplicate_registration_rank_missing") else {
        return;
    };
    let srv = BootstrapServer::start(&py).await;
    let pool = track(&srv);
    wait_for(&pool, &srv, "bootstrapping before PUT", |w| {
        !w.facts.ranks.is_empty()
            && w.facts
                .ranks
                .iter()
                .all(|r| *r == RankReadiness::Bootstrapping)
    })
    .await;

    srv.put(&["--dp-size", "2", "--only-dp", "0,0"]).await;

    wait_for(&pool, &srv, "rank 0 ready, rank 1 missing", |w| {
        w.facts.ranks.len() == 2
            && w.facts.ranks[0] == RankReadiness::Ready
            && failed(RankFailure::RankMissing)(&w.facts.ranks[1])
    })
    .await;
    let snap = pool.load();
    assert_eq!(snap.prefills[0].facts.layout, Some(layout(2, 1, "auto")));
    // Not routable: no health checker marked it healthy, and rank 1 is not Ready anyway.
    assert!(snap.prefill_routable.is_empty());
}
