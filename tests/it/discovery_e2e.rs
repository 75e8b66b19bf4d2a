//! Kubernetes discovery end to end: the `pdgate` binary with `--service-discovery`, its
//! client configured by `KUBECONFIG` (set on the child only) pointing at the fake API
//! server, simulated engines as the pods' endpoints, under a bounded load while pods are
//! added, made unready, terminated and deleted.
//!
//! Checks: no client error, requests in flight on a draining pod included; a new pod gets
//! traffic within 2 s of being Ready; a removed pod gets none after its removal; each
//! pod's state is logged once per change.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use pdgate_sim::{EngineConfig, Faults, SimEngine};
use serde_json::Value;

use crate::discovery::{DECODE, NS, PREFILL};
use crate::support::common;
use crate::support::fake_kube::{self, FakeKube};

const BODY: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":12},"stream":true}"#;

struct Pdgate {
    child: Child,
    url: String,
    admin: String,
    logs: Arc<Mutex<Vec<Value>>>,
}

impl Drop for Pdgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `pdgate serve` with discovery flags and `KUBECONFIG`; returns once it listens.
fn pdgate(kubeconfig: &std::path::Path, config: &std::path::Path) -> Pdgate {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdgate"))
        .args(["serve", "--config"])
        .arg(config)
        .args(["--service-discovery", "--service-discovery-namespace", NS])
        .args(["--prefill-selector", "app=sglang,role=prefill"])
        // SGLang router's form: several `key=value`, joined with ','.
        .args(["--decode-selector", "app=sglang", "role=decode"])
        .args(["--service-discovery-port-name", "http"])
        .args(["--port", "0", "--admin-port", "0", "--log-format", "json"])
        .env("KUBECONFIG", kubeconfig)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("pdgate binary");
    let stdout = child.stdout.take().expect("stdout");
    let logs = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let keep = logs.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["message"] == "pdgate listening" {
                    let _ = tx.send(v["url"].as_str().unwrap_or("").to_string());
                }
                keep.lock().expect("logs").push(v);
            }
        }
    });
    let url = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("pdgate never said it listens");
    // The admin listener's url (its /readiness has the worker detail); bounded wait.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let admin = loop {
        let found = logs
            .lock()
            .expect("logs")
            .iter()
            .find(|v| v["message"] == "admin API listening")
            .and_then(|v| v["url"].as_str().map(str::to_string));
        if let Some(a) = found {
            break a;
        }
        assert!(std::time::Instant::now() < deadline, "no admin listener");
        std::thread::sleep(Duration::from_millis(20));
    };
    Pdgate {
        child,
        url,
        admin,
        logs,
    }
}

impl Pdgate {
    async fn readiness(&self) -> Value {
        let r = common::client()
            .get(format!("{}/readiness", self.admin).parse().expect("uri"))
            .await
            .expect("readiness");
        let b = r.into_body().collect().await.expect("body").to_bytes();
        serde_json::from_slice(&b).expect("json")
    }

    /// The admin listener's `/readiness` entry of pod `name`, if listed.
    async fn worker(&self, name: &str) -> Option<Value> {
        let r = self.readiness().await;
        r["workers"]
            .as_array()?
            .iter()
            .find(|w| w["source"]["pod"] == name)
            .cloned()
    }

    /// Waits (bounded: 15 s) until `f` holds of `/readiness`.
    async fn wait(&self, what: &str, f: impl Fn(&Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let r = self.readiness().await;
            if f(&r) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {r}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Log lines whose message contains `text` and whose `pod` field is `pod`.
    fn logged(&self, pod: &str, text: &str) -> usize {
        self.logs
            .lock()
            .expect("logs")
            .iter()
            .filter(|v| v["pod"] == pod && v["message"].as_str().is_some_and(|m| m.contains(text)))
            .count()
    }
}

fn listed(r: &Value, name: &str) -> bool {
    r["workers"]
        .as_array()
        .is_some_and(|ws| ws.iter().any(|w| w["source"]["pod"] == name))
}

fn draining(r: &Value, name: &str) -> bool {
    r["workers"].as_array().is_some_and(|ws| {
        ws.iter()
            .any(|w| w["source"]["pod"] == name && w["draining"] == true)
    })
}

/// Outcomes of the load.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    errors: Mutex<Vec<String>>,
}

/// `loops` clients sending streamed requests one after the other until `stop` (each
/// loop at most 5000 requests).
fn load(
    url: &str,
    loops: usize,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..loops)
        .map(|_| {
            let (url, stop, tally) = (url.to_string(), stop.clone(), tally.clone());
            tokio::spawn(async move {
                let client = common::client();
                for _ in 0..5000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let req = http::Request::post(format!("{url}/generate"))
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
                        .expect("request");
                    let outcome = match client.request(req).await {
                        Err(e) => Err(format!("send: {e}")),
                        Ok(r) => {
                            let status = r.status();
                            match r.into_body().collect().await {
                                Err(e) => Err(format!("{status} body: {e}")),
                                Ok(b) => {
                                    let b = b.to_bytes();
                                    let (events, done) = common::sse_events(&b);
                                    if status == 200
                                        && done
                                        && events.iter().all(|e| e.get("error").is_none())
                                    {
                                        Ok(())
                                    } else {
                                        Err(format!("{status}: {}", String::from_utf8_lossy(&b)))
                                    }
                                }
                            }
                        }
                    };
                    match outcome {
                        Ok(()) => {
                            tally.ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => tally.errors.lock().expect("errors").push(e),
                    }
                }
            })
        })
        .collect()
}

async fn decode_engine() -> SimEngine {
    let mut e = common::fast_engine(EngineConfig::decode(1));
    e.itl = Duration::from_millis(3);
    pdgate_sim::spawn(e).await.expect("decode")
}

/// Holds new requests on `e`; returns once at least one is held (bounded: 10 s): a
/// request that arrived after the hold, still there 100 ms later (an unheld one takes a
/// few tens of ms).
async fn hold(e: &SimEngine) -> u64 {
    e.set_faults(Faults {
        decode_hold: true,
        ..Faults::default()
    });
    let before = e.stats().requests_total;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = e.stats();
        if st.requests_total > before && st.held_now > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let held = e.stats().held_now;
            if held > 0 {
                return held;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no request reached the engine to hold"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (bounded: 10 s) until `e` holds nothing.
async fn settled(e: &SimEngine) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats().held_now > 0 {
        assert!(Instant::now() < deadline, "engine still holds requests");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_follows_pods_under_load() {
    let kube = FakeKube::start().await;
    let p = pdgate_sim::spawn(common::fast_engine(EngineConfig::prefill(1)))
        .await
        .expect("prefill");
    let (a, b, c) = (
        decode_engine().await,
        decode_engine().await,
        decode_engine().await,
    );
    kube.create(NS, fake_kube::pod("prefill-0", PREFILL, p.addr().port()));
    kube.create(NS, fake_kube::pod("decode-0", DECODE, a.addr().port()));
    kube.create(NS, fake_kube::pod("decode-1", DECODE, b.addr().port()));
    // A pod no selector picks.
    kube.create(
        NS,
        fake_kube::pod("other", &[("app", "web")], c.addr().port()),
    );

    let mut cfg = common::fast_config();
    cfg.discovery.default_grace_secs = 20;
    let dir = std::env::temp_dir().join(format!("pdgate-disc-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pdgate.toml");
    std::fs::write(&config, toml::to_string(&cfg).expect("toml")).expect("config");
    let router = pdgate(&kube.kubeconfig(NS), &config);
    router
        .wait("both decodes and the prefill routable", |r| {
            r["routable_prefill_ranks"] == 1 && r["routable_decode_ranks"] == 2
        })
        .await;

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let loops = load(&router.url, 4, stop.clone(), tally.clone());
    let run_deadline = Instant::now() + Duration::from_secs(90);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A new pod gets traffic within 2 s of being Ready.
    let ready_at = Instant::now();
    kube.create(NS, fake_kube::pod("decode-2", DECODE, c.addr().port()));
    let limit = Duration::from_secs(2);
    while c.stats().requests_total == 0 {
        assert!(
            ready_at.elapsed() < limit,
            "decode-2 got no traffic within {limit:?} of Ready"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let first_traffic = ready_at.elapsed();

    // decode-0 turns unready while requests are held on it: no new request goes there,
    // the held ones finish without error.
    let held_a = hold(&a).await;
    kube.update(NS, "decode-0", |p| fake_kube::set_ready(p, false));
    router
        .wait("decode-0 draining", |r| draining(r, "decode-0"))
        .await;
    a.set_faults(Faults::default());
    settled(&a).await;
    let a_after_drain = a.stats().requests_total;

    // decode-1 terminates (grace 20 s) with requests held: it stays, drained, until they
    // finish, then goes.
    let held_b = hold(&b).await;
    kube.terminate(NS, "decode-1", 20);
    router
        .wait("decode-1 draining", |r| draining(r, "decode-1"))
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    if router.worker("decode-1").await.is_none() {
        for l in router.logs.lock().expect("logs").iter() {
            eprintln!("{l}");
        }
        panic!("decode-1 removed with requests in flight");
    }
    b.set_faults(Faults::default());
    router
        .wait("decode-1 removed", |r| !listed(r, "decode-1"))
        .await;
    let b_after_removal = b.stats().requests_total;
    kube.delete(NS, "decode-1");

    // decode-0 is deleted outright (no terminating state seen): removed.
    kube.delete(NS, "decode-0");
    router
        .wait("decode-0 removed", |r| !listed(r, "decode-0"))
        .await;

    // More load on what is left, then stop.
    let more_from = tally.ok.load(Ordering::Relaxed);
    while tally.ok.load(Ordering::Relaxed) < more_from + 40 {
        assert!(Instant::now() < run_deadline, "the load stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        l.await.expect("load loop");
    }

    let errors = tally.errors.lock().expect("errors").clone();
    assert!(
        errors.is_empty(),
        "{} client errors: {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    assert!(held_a >= 1 && held_b >= 1);
    assert_eq!(
        a.stats().requests_total,
        a_after_drain,
        "decode-0 got requests after it drained"
    );
    assert_eq!(
        b.stats().requests_total,
        b_after_removal,
        "decode-1 got requests after its removal"
    );
    assert!(
        c.stats().requests_total > 40,
        "decode-2 serves: {:?}",
        c.stats()
    );
    // Each change logged once, with its reason.
    assert_eq!(router.logged("decode-0", "discovered pod not ready"), 1);
    assert_eq!(router.logged("decode-1", "discovered pod terminating"), 1);
    assert_eq!(
        router.logged("other", ""),
        0,
        "pods no selector picks are not seen"
    );
    eprintln!(
        "discovery e2e: {} requests ok, decode-2 traffic {first_traffic:?} after Ready, held {held_a}+{held_b}",
        tally.ok.load(Ordering::Relaxed)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_binary_refuses_a_malformed_selector_naming_its_flag() {
    let cases = [
        (["--prefill-selector", "app in (a"], "--prefill-selector"),
        (["--decode-selector", "role notin x"], "--decode-selector"),
    ];
    for (flag, want) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_pdgate"))
            .args([
                "serve",
                "--service-discovery",
                "--port",
                "0",
                "--admin-port",
                "0",
            ])
            .args(["--prefill-selector", "app=p", "--decode-selector", "app=d"])
            .args(flag)
            .env("KUBECONFIG", "/nonexistent/kubeconfig")
            .output()
            .expect("pdgate");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{err}");
    }
}
