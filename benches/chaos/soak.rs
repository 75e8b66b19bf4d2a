//! The chaos soak: a simulated fleet (2 prefills with DP 2, 2 decodes with DP 2) behind
//! pdgate under steady load, while a driver injects every simulator fault on random workers,
//! kills and restarts engines, then clears every fault; afterwards it checks that
//!
//! - every request ended within its client-side deadline, with a well-formed answer;
//! - the engines counted 0 contract violations;
//! - every worker was routable and served new requests within 3 s of the faults clearing
//!   (no stranded breaker);
//! - pdgate's in-flight and admission gauges came back to 0 and no engine holds a request;
//! - the router's RSS at the end is within 10 % of its RSS after the warm-up (only where the
//!   router is a process of its own; the bench runs several storms against one router and
//!   judges the growth between the first storm's end and the last's instead, see
//!   [`RSS_BETWEEN_STORMS`]).
//!
//! Why: each fault is tested alone elsewhere (`tests/faults.rs`, the `faults` bench); a
//! soak finds what only their mix shows: state left behind by one fault that the next one
//! trips on (a breaker never released, a slot or a leg never given back, memory that grows).
//!
//! This module (with `client.rs`, `driver.rs`, `report.rs`) is shared by the bench
//! (`benches/chaos/main.rs`: the router and the decodes as processes of their own, decodes
//! killed for real) and the test (`tests/chaos.rs`: everything in-process); what differs is
//! behind [`Fleet`]. Everything talks HTTP on 127.0.0.1 (faults of in-process engines go
//! through their handles); every loop is bounded in count and time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdgate::config::Config;
use pdgate_sim::{EngineConfig, Faults, Role, StatsSnapshot};
use serde_json::Value;

use crate::client::{self, Bounds, HttpClient, Load, Mix, Tally};
use crate::driver::{drive_faults, Injected};

// ---------------------------------------------------------------------------------------
// Settings shared by the bench and the test

/// Router settings of the soak (everything else at its default). Leg timeouts are short so
/// that a run is bounded; the breaker's longest open time (1.5 s) stays under the 3 s
/// recovery bound (at the default 30 s a worker that failed many trials could legitimately
/// stay out for 30 s after the faults clear).
pub const ROUTER_TOML: &str = r#"
[server]
drain_secs = 1
# The soak reads the gauges from the front door's /metrics.
public_metrics = true

# No admin listener (the bench's `pdgate serve` would take the fixed port 29000).
[admin]
enabled = false

[timeouts]
connect_ms = 500
prefill_secs = 2
decode_first_byte_secs = 2
stream_idle_secs = 3
request_secs = 8

[breaker]
open_ms = 500
max_open_ms = 1500

# A moving stream waits at most 1.5 s for a routable decode (the clients' stream-gap bound
# is stream_idle_secs + 2 s).
[retry]
move_wait_ms = 1500

[admission]
queue_timeout_ms = 1000
"#;

/// The soak's router settings, without workers.
pub fn router_config() -> Config {
    Config::from_toml(ROUTER_TOML).expect("the soak's router settings parse")
}

/// Engines' context length: a prompt of more words than this is refused with a 400.
pub const CONTEXT_LENGTH: u32 = 256;
/// DP size of every engine.
pub const DP: u32 = 2;
/// Output tokens per request.
pub const TOKENS: u32 = 4;
/// Decode `D1` emulates an engine without SGLang PR #24772 (`legacy_bootstrap_bug`).
pub const LEGACY_DECODE: usize = 1;

/// Engine settings: tiny latencies, short engine-side timeouts (20 s: longer than any
/// drain wait, so a leg the router forgot shows as held).
pub fn engine_config(role: Role, legacy: bool) -> EngineConfig {
    let mut e = match role {
        Role::Prefill => EngineConfig::prefill(DP),
        Role::Decode => EngineConfig::decode(DP),
        Role::Regular => EngineConfig::regular(DP),
    };
    e.prefill_delay = Duration::from_millis(2);
    e.ttft = Duration::from_millis(2);
    e.itl = Duration::from_millis(1);
    e.default_output_tokens = TOKENS;
    e.context_length = CONTEXT_LENGTH;
    e.sentinel_interval = Duration::from_millis(50);
    e.sentinel_attempts = 5;
    e.heartbeat_interval = Duration::from_millis(200);
    e.waiting_timeout = Duration::from_secs(20);
    e.bootstrap_timeout = Duration::from_secs(20);
    e.legacy_bootstrap_bug = legacy;
    e
}

/// The same settings as `pdgate sim` flags (the bench's processes; unused by the test).
#[allow(dead_code)]
pub fn sim_flags(legacy: bool) -> Vec<String> {
    let mut v: Vec<String> = [
        "--prefill-dp",
        "2",
        "--decode-dp",
        "2",
        "--prefill-ms",
        "2",
        "--ttft-ms",
        "2",
        "--itl-ms",
        "1",
        "--tokens",
        "4",
        "--context-length",
        "256",
        "--sentinel-interval-ms",
        "50",
        "--sentinel-attempts",
        "5",
        "--heartbeat-interval-ms",
        "200",
        "--waiting-timeout-secs",
        "20",
        "--bootstrap-timeout-secs",
        "20",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if legacy {
        v.push("--legacy-bootstrap-bug".into());
    }
    v
}

/// Slack on every client-side bound (a loaded 2-core machine).
const SLACK: Duration = Duration::from_secs(2);
/// A worker must serve again within this time of the faults clearing.
pub const RECOVERY_BOUND: Duration = Duration::from_secs(3);
/// How long recovery is watched (to report times beyond the bound).
const RECOVERY_WATCH: Duration = Duration::from_secs(10);
/// How long the gauges and engines are given to come back to 0 after the load stopped.
const DRAIN_WATCH: Duration = Duration::from_secs(5);
/// Allowed RSS growth from after the warm-up to the end.
pub const RSS_GROWTH: f64 = 0.10;
/// Allowed RSS growth (at rest) from the end of a storm to the end of a later one against
/// the same router. Why a second measure: the first storm allocates once what later ones
/// reuse (label sets and histograms its faults create first, the allocator's pages kept
/// after the in-flight peak: at rest 19.9–21.7 MiB after single storms of 45, 90 and 180 s,
/// from 17.6–19.0 MiB after the warm-up, the same after 180 s as after 90 s), while a leak
/// grows with every storm.
#[allow(dead_code)]
pub const RSS_BETWEEN_STORMS: f64 = 0.05;
/// Period of every polling loop.
pub const POLL: Duration = Duration::from_millis(25);
/// Timeout of one control call (`/sim/*`, `/readiness`, `/metrics`).
pub const CALL: Duration = Duration::from_secs(2);

/// Client-side bounds from the router's timeouts: the head (and a whole non-streamed
/// answer) within the admission wait plus `request_secs`, each stream gap within
/// `stream_idle_secs`, both plus [`SLACK`].
pub fn bounds(cfg: &Config) -> Bounds {
    Bounds {
        head: Duration::from_millis(cfg.admission.queue_timeout_ms)
            + cfg.timeouts.request()
            + SLACK,
        gap: cfg.timeouts.stream_idle() + SLACK,
    }
}

// ---------------------------------------------------------------------------------------
// The fleet

/// One engine as the soak addresses it.
#[derive(Clone, Debug)]
pub struct EngineRef {
    /// `P0`, `P1`, `D0`, `D1`.
    pub label: String,
    pub role: Role,
    /// `http://127.0.0.1:PORT` (stable across restarts).
    pub url: String,
}

/// A boxed future, so that [`Fleet`] stays object-safe.
pub type Fut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What differs between the bench's processes and the test's in-process fleet.
pub trait Fleet: Send + Sync {
    /// Every engine, prefills first.
    fn engines(&self) -> Vec<EngineRef>;
    /// How the fleet runs, for the report.
    fn describe(&self) -> String;
    /// Whether engine `i` runs in this process, its faults set through its handle. Else the
    /// soak uses `POST /sim/faults`, which a "down" engine cannot answer: faults that take
    /// an engine down are only put on in-process engines (or are real kills).
    fn in_process(&self, _i: usize) -> bool {
        false
    }
    /// Replaces the faults of in-process engine `i`.
    fn set_faults_direct(&self, _i: usize, _f: &Faults) {}
    /// Whether engine `i` can be killed and restarted for real (else a kill is its `down`
    /// fault).
    fn can_kill(&self, _i: usize) -> bool {
        false
    }
    /// Kills engine `i` (what was done, or why it failed).
    fn kill(&self, i: usize) -> Fut<'_, Result<String, String>> {
        Box::pin(async move { Err(format!("engine {i} cannot be killed")) })
    }
    /// Starts engine `i` again on the same port.
    fn restart(&self, i: usize) -> Fut<'_, Result<String, String>> {
        Box::pin(async move { Err(format!("engine {i} cannot be restarted")) })
    }
    /// The router's VmRSS in KiB, when it is a process of its own.
    fn router_rss_kib(&self) -> Option<u64> {
        None
    }
    /// The router process's open file descriptors (client and engine connections, ...).
    fn router_fds(&self) -> Option<u64> {
        None
    }
    /// Legs the router's pool counts in flight (in-process only).
    fn router_legs_in_flight(&self) -> Option<u64> {
        None
    }
    /// Each worker's breaker state, as evidence when recovery fails.
    fn breakers(&self) -> Option<String> {
        None
    }
}

// ---------------------------------------------------------------------------------------
// Plan

/// How long and how hard.
#[derive(Clone, Debug)]
pub struct Plan {
    pub warm: Duration,
    pub chaos: Duration,
    pub after: Duration,
    /// Open-loop lanes of load.
    pub lanes: usize,
    pub mix: Mix,
    pub seed: u64,
    /// How long one fault lasts (min, max).
    pub fault_len: (Duration, Duration),
    /// Pause between two fault starts (min, max).
    pub fault_gap: (Duration, Duration),
    /// At most one faulted engine per role at a time (`PDGATE_CHAOS_ONE_PER_ROLE=1`): the
    /// storm of "one engine failing at a time", where no request should be lost.
    pub one_per_role: bool,
}

impl Plan {
    /// A run of about `secs` seconds: 10 % warm-up (≥ 1 s), ≥ 3.5 s after the faults clear
    /// (20 % of long runs), the rest chaos.
    pub fn for_secs(secs: f64, lanes: usize, seed: u64) -> Plan {
        let secs = secs.max(6.0);
        let warm = (secs * 0.1).max(1.0);
        let after = (secs * 0.2).max(3.5);
        let chaos = (secs - warm - after).max(1.0);
        let longest = (secs / 40.0).clamp(0.8, 3.0);
        Plan {
            warm: Duration::from_secs_f64(warm),
            chaos: Duration::from_secs_f64(chaos),
            after: Duration::from_secs_f64(after),
            lanes,
            mix: Mix {
                share_4xx: 0.15,
                share_disconnect: 0.10,
                pause: Duration::from_millis(20),
                long_prompt_words: CONTEXT_LENGTH as usize + 16,
                tokens: TOKENS,
            },
            seed,
            fault_len: (Duration::from_millis(200), Duration::from_secs_f64(longest)),
            fault_gap: (Duration::from_millis(80), Duration::from_millis(300)),
            one_per_role: false,
        }
    }

    /// Overrides from the environment: `PDGATE_CHAOS_SHARE_4XX`,
    /// `PDGATE_CHAOS_SHARE_DISCONNECT` (0..1), `PDGATE_CHAOS_PAUSE_MS` (between two request
    /// starts of a lane).
    pub fn with_env(mut self) -> Plan {
        let get = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = get("PDGATE_CHAOS_SHARE_4XX") {
            self.mix.share_4xx = v.clamp(0.0, 1.0);
        }
        if let Some(v) = get("PDGATE_CHAOS_SHARE_DISCONNECT") {
            self.mix.share_disconnect = v.clamp(0.0, 1.0);
        }
        if let Some(v) = get("PDGATE_CHAOS_PAUSE_MS") {
            self.mix.pause = Duration::from_secs_f64(v.max(0.1) / 1000.0);
        }
        if get("PDGATE_CHAOS_ONE_PER_ROLE").is_some_and(|v| v != 0.0) {
            self.one_per_role = true;
        }
        self
    }
}

/// An engine's `/sim/stats` (None: it did not answer, e.g. while down or killed).
pub async fn stats(client: &HttpClient, e: &EngineRef) -> Option<StatsSnapshot> {
    let (s, b) = client::get(client, &format!("{}/sim/stats", e.url), CALL).await?;
    (s == 200)
        .then(|| serde_json::from_slice(&b).ok())
        .flatten()
}

// ---------------------------------------------------------------------------------------
// Recovery, drain

/// One worker after the faults cleared.
#[derive(Debug, Clone)]
pub struct Recovery {
    pub label: String,
    /// When `/readiness` first showed it healthy with every rank ready.
    pub ready: Option<Duration>,
    /// When it first completed a request it started after the faults cleared.
    pub serving: Option<Duration>,
    /// Request instances it received after the faults cleared, until it served (or until
    /// the end of the watch).
    pub received: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Recovered {
    pub workers: Vec<Recovery>,
    /// When `/readiness` first counted every rank of both pools routable.
    pub all_routable: Option<Duration>,
    /// How long recovery was watched.
    pub watched: Option<Duration>,
    /// Breaker states at the end of the watch, when a worker did not recover in time.
    pub breakers: Option<String>,
}

fn port_of(url: &str) -> &str {
    url.rsplit(':').next().unwrap_or("").trim_end_matches('/')
}

/// Per worker: healthy with every rank ready, from `/readiness`.
fn readiness(v: &Value, engines: &[EngineRef]) -> (Vec<bool>, bool) {
    let workers = v.get("workers").and_then(Value::as_array);
    let ready = engines
        .iter()
        .map(|e| {
            workers
                .into_iter()
                .flatten()
                .find(|w| {
                    w.get("url")
                        .and_then(Value::as_str)
                        .is_some_and(|u| port_of(u) == port_of(&e.url))
                })
                .is_some_and(|w| {
                    let healthy = w.get("healthy").and_then(Value::as_bool) == Some(true);
                    let ranks = w.get("ranks").and_then(Value::as_array);
                    healthy
                        && ranks
                            .into_iter()
                            .flatten()
                            .all(|r| r.as_str() == Some("ready"))
                })
        })
        .collect();
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let want_p = engines.iter().filter(|e| e.role == Role::Prefill).count() as u64 * DP as u64;
    let want_d = engines.iter().filter(|e| e.role == Role::Decode).count() as u64 * DP as u64;
    let all = n("routable_prefill_ranks") == want_p && n("routable_decode_ranks") == want_d;
    (ready, all)
}

async fn watch_recovery(
    client: &HttpClient,
    router: &str,
    fleet: &dyn Fleet,
    engines: &[EngineRef],
) -> Recovered {
    let t0 = Instant::now();
    let mut base: Vec<Option<StatsSnapshot>> = Vec::new();
    for e in engines {
        base.push(stats(client, e).await);
    }
    let mut out = Recovered {
        workers: engines
            .iter()
            .map(|e| Recovery {
                label: e.label.clone(),
                ready: None,
                serving: None,
                received: 0,
            })
            .collect(),
        ..Recovered::default()
    };
    let max_steps = (RECOVERY_WATCH.as_millis() / POLL.as_millis()) as usize;
    for _ in 0..max_steps {
        if t0.elapsed() > RECOVERY_WATCH {
            break;
        }
        let at = t0.elapsed();
        if let Some((_, b)) = client::get(client, &format!("{router}/readiness"), CALL).await {
            if let Ok(v) = serde_json::from_slice::<Value>(&b) {
                let (ready, all) = readiness(&v, engines);
                for (w, r) in out.workers.iter_mut().zip(ready) {
                    if r && w.ready.is_none() {
                        w.ready = Some(at);
                    }
                }
                if all && out.all_routable.is_none() {
                    out.all_routable = Some(at);
                }
            }
        }
        for (i, e) in engines.iter().enumerate() {
            if out.workers[i].serving.is_some() {
                continue;
            }
            let Some(now) = stats(client, e).await else {
                continue;
            };
            match &base[i] {
                None => base[i] = Some(now),
                Some(b) => {
                    out.workers[i].received = now.requests_total.saturating_sub(b.requests_total);
                    if now.requests_total > b.requests_total && now.ok > b.ok {
                        out.workers[i].serving = Some(t0.elapsed());
                    }
                }
            }
        }
        let done = out.all_routable.is_some()
            && out
                .workers
                .iter()
                .all(|w| w.ready.is_some() && w.serving.is_some());
        if done {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    out.watched = Some(t0.elapsed());
    if out
        .workers
        .iter()
        .any(|w| w.serving.is_none_or(|s| s > RECOVERY_BOUND))
    {
        out.breakers = fleet.breakers();
    }
    out
}

/// The router's gauges and the engines' held requests once the load stopped.
#[derive(Debug, Clone, Default)]
pub struct Drained {
    pub in_flight: Option<f64>,
    pub queue: Option<f64>,
    pub legs_in_flight: Option<u64>,
    /// Engine label → held_now (None: stats unavailable).
    pub held: Vec<(String, Option<u64>)>,
    /// When everything read 0 (None: not within the watch).
    pub zero_after: Option<Duration>,
}

fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = rest.strip_prefix(' ')?;
        rest.trim().parse().ok()
    })
}

async fn watch_drain(
    client: &HttpClient,
    router: &str,
    fleet: &dyn Fleet,
    engines: &[EngineRef],
) -> Drained {
    let t0 = Instant::now();
    let mut d = Drained::default();
    let max_steps = (DRAIN_WATCH.as_millis() / POLL.as_millis()) as usize;
    for _ in 0..max_steps {
        let metrics = client::get(client, &format!("{router}/metrics"), CALL)
            .await
            .map(|(_, b)| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        d.in_flight = gauge(&metrics, "pdgate_in_flight_requests");
        d.queue = gauge(&metrics, "pdgate_admission_queue");
        d.legs_in_flight = fleet.router_legs_in_flight();
        d.held.clear();
        for e in engines {
            let held = stats(client, e).await.map(|s| s.held_now);
            d.held.push((e.label.clone(), held));
        }
        let zero = d.in_flight == Some(0.0)
            && d.queue == Some(0.0)
            && d.legs_in_flight.unwrap_or(0) == 0
            && d.held.iter().all(|(_, h)| *h == Some(0));
        if zero {
            d.zero_after = Some(t0.elapsed());
            break;
        }
        if t0.elapsed() > DRAIN_WATCH {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    d
}

/// Waits (bounded) until every rank of both pools is routable.
pub async fn wait_routable(client: &HttpClient, router: &str, engines: &[EngineRef]) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if let Some((_, b)) = client::get(client, &format!("{router}/readiness"), CALL).await {
            if let Ok(v) = serde_json::from_slice::<Value>(&b) {
                if readiness(&v, engines).1 {
                    return true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

// ---------------------------------------------------------------------------------------
// The run

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub fleet: String,
    pub plan: Plan,
    pub bounds: Bounds,
    pub tally: Tally,
    pub injected: Injected,
    pub recovered: Recovered,
    pub drained: Drained,
    /// Engine label → final stats (None: unavailable).
    pub engines: Vec<(String, Option<StatsSnapshot>)>,
    pub violations: u64,
    /// Each engine's role, in the fleet's order (the driver's windows name engines by it).
    pub engine_roles: Vec<Role>,
    /// How long a request caught by a hang or stall stays stuck after the fault clears:
    /// the router's longest leg bound (stream idle, prefill, decode first byte).
    pub held_carry: Duration,
    pub rss_warm_kib: Option<u64>,
    /// When the faults were cleared (to tell a step the faults leave from growth with time).
    pub rss_cleared_kib: Option<u64>,
    /// Right after the load ended and the gauges were back to 0.
    pub rss_drained_kib: Option<u64>,
    pub rss_end_kib: Option<u64>,
    /// The router's open fds when its RSS was read (after the warm-up, at the end).
    pub fds: (Option<u64>, Option<u64>),
    pub elapsed: Duration,
}

/// How long after the drain the router's RSS is read "at rest": past the allocator's purge
/// delay (`serve` sets 100 ms) and the leg pools' idle timeout (`upstream.pool_idle_timeout_secs`,
/// 4 s), so that pages and idle connections those keep by design are not read as growth.
pub const AT_REST: Duration = Duration::from_secs(5);

/// Runs the soak against the router at `router` (`http://127.0.0.1:PORT`).
pub async fn run(fleet: Arc<dyn Fleet>, router: &str, cfg: &Config, plan: Plan) -> Outcome {
    let started = Instant::now();
    let client = client::http_client();
    let engines = fleet.engines();
    if !wait_routable(&client, router, &engines).await {
        eprintln!("[chaos] warning: the fleet was not fully routable within 20 s");
    }
    let bounds = bounds(cfg);
    let load = Load::start(&client, router, plan.lanes, plan.mix, bounds, plan.seed);
    eprintln!("[chaos] warm-up {:.1} s", plan.warm.as_secs_f64());
    tokio::time::sleep(plan.warm).await;
    let rss_warm_kib = fleet.router_rss_kib();
    let fds_warm = fleet.router_fds();
    load.set_phase(1);
    eprintln!("[chaos] faults for {:.1} s", plan.chaos.as_secs_f64());
    let injected = drive_faults(&client, &*fleet, &engines, &plan).await;
    let cleared = Instant::now();
    let rss_cleared_kib = fleet.router_rss_kib();
    load.set_phase(2);
    eprintln!(
        "[chaos] faults cleared; watching recovery, load goes on for {:.1} s",
        plan.after.as_secs_f64()
    );
    let recovered = watch_recovery(&client, router, &*fleet, &engines).await;
    tokio::time::sleep(plan.after.saturating_sub(cleared.elapsed())).await;
    let during = load.tally().total;
    eprintln!("[chaos] stopping the load ({during} requests so far)");
    let tally = load.stop(bounds.head + SLACK).await;
    let drained = watch_drain(&client, router, &*fleet, &engines).await;
    let rss_drained_kib = fleet.router_rss_kib();
    // At rest: the allocator's purge delay (100 ms) and the leg pools' idle timeout (4 s)
    // passed with no request, so what is left resident is not what they hold by design.
    if rss_drained_kib.is_some() {
        tokio::time::sleep(AT_REST).await;
    }
    let rss_end_kib = fleet.router_rss_kib();
    let fds_end = fleet.router_fds();
    let mut finals = Vec::new();
    let mut violations = injected.retired_violations;
    for e in &engines {
        let s = stats(&client, e).await;
        violations += s.as_ref().map_or(0, |s| s.contract_violations);
        finals.push((e.label.clone(), s));
    }
    Outcome {
        fleet: fleet.describe(),
        plan,
        bounds,
        tally,
        injected,
        recovered,
        drained,
        engines: finals,
        violations,
        engine_roles: engines.iter().map(|e| e.role).collect(),
        held_carry: cfg
            .timeouts
            .stream_idle()
            .max(cfg.timeouts.prefill())
            .max(cfg.timeouts.decode_first_byte()),
        rss_warm_kib,
        rss_cleared_kib,
        rss_drained_kib,
        rss_end_kib,
        fds: (fds_warm, fds_end),
        elapsed: started.elapsed(),
    }
}
