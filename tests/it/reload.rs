//! Hot reload (`pdgate::reload`): a new config applied while streams run disturbs none of
//! them; an invalid one changes nothing; static worker lists are diffed (added workers are
//! checked first, removed ones drain); restart-only sections keep their running values;
//! SIGHUP and the file watch reload the real binary.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use http_body_util::BodyExt;
use pdgate::config::{Config, PolicyKind};
use pdgate::types::Role;
use pdgate_sim::{EngineConfig, SimCluster};

use crate::support::common::{self, fast_engine, finish_clean, start_as_is};

const LONG: &str = r#"{"text":"hello","stream":true,"sampling_params":{"max_new_tokens":25}}"#;
const GEN: &str = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;

fn slow_decode() -> EngineConfig {
    EngineConfig {
        itl: Duration::from_millis(40),
        ..fast_engine(EngineConfig::decode(1))
    }
}

fn current(env: &common::Env) -> Config {
    (**env.router.fleet.live().load()).clone()
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_reload_while_streams_run_disturbs_none_of_them() {
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![slow_decode()],
        |_| {},
    )
    .await;
    env.wait_routable(1, 1).await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(env.post_streaming("/generate", LONG).await);
    }
    assert_eq!(env.cluster.decodes[0].stats().held_now, 4);

    // Everything that reloads changes at once, and a decode is added.
    let extra = pdgate_sim::spawn(fast_engine(EngineConfig::decode(1)))
        .await
        .expect("engine");
    let mut next = current(&env);
    next.policy.prefill = PolicyKind::Random;
    next.policy.decode = PolicyKind::PowerOfTwo;
    next.timeouts.request_secs = 40;
    next.retry.max_retries = 1;
    next.breaker.failure_threshold = 7;
    next.admission.max_in_flight = 64;
    next.health.failure_threshold = 3;
    next.bootstrap.refresh_interval_ms = 150;
    next.decode.push(pdgate::config::DecodeWorkerConfig {
        url: extra.url(),
        model: None,
    });
    let applied = pdgate::reload::apply(&env.router, next).expect("valid");
    assert_eq!((applied.added, applied.removed), (1, 0));
    assert!(applied.restart_needed.is_empty(), "{applied:?}");

    // The streams run to their ends, untouched.
    for s in streams {
        assert_eq!(finish_clean(s).await, 25);
    }
    // The new settings are the running ones, and the new decode serves once checked.
    let now = current(&env);
    assert_eq!(now.policy.decode, PolicyKind::PowerOfTwo);
    assert_eq!(now.timeouts.request_secs, 40);
    assert_eq!(now.breaker.failure_threshold, 7);
    env.wait_routable(1, 2).await;
    for _ in 0..16 {
        let (status, _, body) = env.post("/generate", GEN).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert!(extra.stats().requests_total > 0, "the added decode serves");
}

#[tokio::test(crate = "crate::support::rt")]
async fn an_invalid_config_changes_nothing_and_is_counted() {
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |_| {},
    )
    .await;
    env.wait_routable(1, 1).await;
    let before = current(&env);
    type Break = fn(&mut Config);
    let cases: Vec<(Break, &str)> = vec![
        (
            |c| c.health.failure_threshold = 0,
            "health.failure_threshold = 0",
        ),
        (
            |c| c.timeouts.decode_first_byte_secs = c.timeouts.request_secs,
            "timeouts.decode_first_byte_secs",
        ),
        (|c| c.decode[0].url = "ftp://nope".into(), "decode[0].url"),
        // A secret that cannot be read refuses the reload too.
        (
            |c| c.auth.api_keys_file = Some("/nonexistent/pdgate-keys".into()),
            "auth.api_keys_file",
        ),
    ];
    for (breakit, named) in cases {
        let mut bad = before.clone();
        bad.policy.decode = PolicyKind::Random; // would change if applied
        breakit(&mut bad);
        let err = pdgate::reload::apply(&env.router, bad)
            .expect_err("refused")
            .to_string();
        assert!(err.contains(named), "{err} should name {named}");
        assert_eq!(current(&env), before, "nothing changed");
    }
    let (status, _, _) = env.post("/generate", GEN).await;
    assert_eq!(status, 200);
    let text = pdgate::telemetry::render(&*env.router.pool);
    let line = text
        .lines()
        .find(|l| l.starts_with("pdgate_config_reloads_total{result=\"error\"}"))
        .unwrap_or_else(|| panic!("no reload counter in {text}"));
    let n: f64 = line
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("value");
    assert!(n >= 3.0, "{line}");
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_removed_static_worker_drains_its_stream_then_goes() {
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![slow_decode(), fast_engine(EngineConfig::decode(1))],
        |c| c.policy.decode = PolicyKind::RoundRobin,
    )
    .await;
    env.wait_routable(1, 2).await;
    // Streams until one is on decode 0 (round robin: within two).
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(env.post_streaming("/generate", LONG).await);
    }
    assert!(env.cluster.decodes[0].stats().held_now >= 1);
    let mut next = current(&env);
    let gone = next.decode.remove(0);
    let applied = pdgate::reload::apply(&env.router, next).expect("valid");
    assert_eq!((applied.added, applied.removed), (0, 1));
    // Out of rotation at once.
    let before = env.cluster.decodes[0].stats().requests_total;
    for _ in 0..4 {
        let (status, _, _) = env.post("/generate", GEN).await;
        assert_eq!(status, 200);
    }
    assert_eq!(env.cluster.decodes[0].stats().requests_total, before);
    for s in held {
        finish_clean(s).await;
    }
    let url = pdgate::url::parse_base_url(&gone.url).expect("url");
    env.wait_pool("the removed decode is gone", |s| {
        s.workers(Role::Decode).iter().all(|w| w.shared.url != url)
    })
    .await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn restart_only_sections_keep_their_running_values() {
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |_| {},
    )
    .await;
    let before = current(&env);
    let mut next = before.clone();
    next.server.max_body_bytes = 7;
    next.upstream.pool_max_idle_per_host = 3;
    next.discovery.resync_secs = 5;
    next.timeouts.request_secs = 41;
    let applied = pdgate::reload::apply(&env.router, next).expect("valid");
    assert_eq!(
        applied.restart_needed,
        vec!["server", "discovery", "upstream"]
    );
    let now = current(&env);
    assert_eq!(now.server, before.server);
    assert_eq!(now.upstream, before.upstream);
    assert_eq!(now.discovery, before.discovery);
    assert_eq!(now.timeouts.request_secs, 41, "the rest applies");
}

/// The real binary: a changed file is applied on SIGHUP, and (with `reload.watch_ms`) when
/// the file changes; an invalid file is logged with its key and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_the_file_watch_reload_the_binary() {
    let cluster = SimCluster::spawn(
        &[fast_engine(EngineConfig::prefill(1))],
        &[
            fast_engine(EngineConfig::decode(1)),
            fast_engine(EngineConfig::decode(1)),
        ],
    )
    .await
    .expect("cluster");
    let dir = std::env::temp_dir().join(format!("pdgate-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("pdgate.toml");
    let p = &cluster.prefills[0];
    let toml = |decodes: &[String], extra: &str| {
        let mut s = format!(
            "[health]\ninterval_secs = 0.05\n[reload]\nwatch_ms = 100\n[[prefill]]\nurl = \"{}\"\nbootstrap_port = {}\n",
            p.url(),
            p.bootstrap_port().expect("port")
        );
        for d in decodes {
            s.push_str(&format!("[[decode]]\nurl = \"{d}\"\n"));
        }
        s.push_str(extra);
        s
    };
    let d0 = cluster.decodes[0].url();
    let d1 = cluster.decodes[1].url();
    std::fs::write(&file, toml(std::slice::from_ref(&d0), "")).expect("write");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdgate"))
        .args([
            "serve",
            "--port",
            "0",
            "--admin-port",
            "0",
            "--log-format",
            "json",
        ])
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("pdgate binary");
    let pid = child.id().to_string();
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
    });
    let next_log = |what: &str| loop {
        let v = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("pdgate never logged {what}"));
        if v["message"] == what {
            return v;
        }
    };
    let url = next_log("pdgate listening")["url"]
        .as_str()
        .expect("url")
        .to_string();
    let client = common::client();
    let decodes_ready = |n: u64| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok(r) = client
                    .get(format!("{url}/readiness").parse().expect("uri"))
                    .await
                {
                    let b = r.into_body().collect().await.expect("body").to_bytes();
                    let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
                    if v["routable_decode_ranks"] == n {
                        return v;
                    }
                }
                assert!(tokio::time::Instant::now() < deadline, "never {n} decodes");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    decodes_ready(1).await;

    // 1. SIGHUP after the file gained a decode (written in place: the watch may see it
    //    first; either way one reload applies it).
    std::fs::write(&file, toml(&[d0.clone(), d1.clone()], "")).expect("write");
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .expect("kill")
        .success());
    let v = next_log("config reloaded");
    assert_eq!(v["added"], 1, "{v}");
    decodes_ready(2).await;

    // 2. An invalid file: logged with its key, nothing changes.
    std::fs::write(
        &file,
        toml(
            std::slice::from_ref(&d0),
            "[breaker]\nmax_ejection_ratio = 3.0\n",
        ),
    )
    .expect("write");
    let v = next_log("config reload refused; the running config is kept");
    let err = v["error"].as_str().expect("error").to_string();
    assert!(err.contains("breaker.max_ejection_ratio = 3"), "{err}");
    decodes_ready(2).await;

    // 3. The watch: the file drops decode 1; no signal sent.
    std::fs::write(&file, toml(std::slice::from_ref(&d0), "")).expect("write");
    let v = next_log("config reloaded");
    assert_eq!(v["removed"], 1, "{v}");
    decodes_ready(1).await;

    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_static_worker_drained_by_an_operator_is_still_removed_by_a_reload() {
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![
            fast_engine(EngineConfig::decode(1)),
            fast_engine(EngineConfig::decode(1)),
        ],
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    let mut next = current(&env);
    let gone = next.decode.remove(0);
    let url = pdgate::url::parse_base_url(&gone.url).expect("url");
    let id = env
        .router
        .pool
        .load()
        .workers(Role::Decode)
        .iter()
        .find(|w| w.shared.url == url)
        .expect("listed")
        .shared
        .id;
    env.router.fleet.drain(Role::Decode, id).expect("drain");
    let applied = pdgate::reload::apply(&env.router, next).expect("valid");
    assert_eq!((applied.added, applied.removed), (0, 1));
    env.wait_pool("the drained, removed decode is gone", |s| {
        s.workers(Role::Decode).iter().all(|w| w.shared.url != url)
    })
    .await;
}

/// A reload that turns engine load polling on (or changes its pace, or turns it off)
/// applies to the workers already in the pool, not only to workers added later.
#[tokio::test(crate = "crate::support::rt")]
async fn a_reload_applies_load_polling_to_existing_workers() {
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |c| c.policy.load_poll_interval_ms = 0,
    )
    .await;
    env.wait_routable(1, 1).await;
    let d = &env.cluster.decodes[0];
    let polls = |e: &pdgate_sim::SimEngine| {
        let h = e.hits();
        h.engine("GET /v1/loads") + h.engine("GET /get_load")
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(polls(d), 0, "polling is off");

    let mut next = current(&env);
    next.policy.load_poll_interval_ms = 20;
    pdgate::reload::apply(&env.router, next).expect("valid");
    // Picked up within the off-state recheck (1 s), then every 20 ms.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while polls(d) < 5 || polls(&env.cluster.prefills[0]) < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "existing workers not polled after the reload: {:?}",
            d.hits().engine
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let mut off = current(&env);
    off.policy.load_poll_interval_ms = 0;
    pdgate::reload::apply(&env.router, off).expect("valid");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopped = polls(d);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        polls(d),
        stopped,
        "still polled after polling was turned off"
    );
}
