//! SIGTERM on the real binary: pdgate stops taking new connections, lets the in-flight
//! stream finish to its `[DONE]`, and exits 0.

use crate::support::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use pdgate_sim::{EngineConfig, Faults, SimCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests() {
    let mut decode = common::fast_engine(EngineConfig::decode(1));
    decode.faults = Faults {
        decode_extra_itl_ms: 100,
        ..Faults::default()
    };
    let cluster = SimCluster::spawn(&[common::fast_engine(EngineConfig::prefill(2))], &[decode])
        .await
        .unwrap();
    let p = &cluster.prefills[0];
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdgate"))
        .args([
            "serve",
            "--port",
            "0",
            "--log-format",
            "json",
            "--health-check-interval-secs",
            "0.05",
            // `serve` opens the admin listener by default: on a free port here.
            "--admin-port",
            "0",
        ])
        .args([
            "--prefill",
            &p.url(),
            &p.bootstrap_port().unwrap().to_string(),
        ])
        .args(["--decode", &cluster.decodes[0].url()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("pdgate binary");
    let pid = child.id();
    // The listening line carries the bound address.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut admin = None;
    let url = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("pdgate never said it listens");
        let v: serde_json::Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(_) => continue,
        };
        if v["message"] == "admin API listening" {
            admin = v["url"].as_str().map(str::to_string);
        }
        if v["message"] == "pdgate listening" {
            break v["url"].as_str().unwrap().to_string();
        }
    };
    let admin = admin.expect("pdgate serve opens its admin listener (before the front door)");
    let client = common::client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ok = client
            .get(format!("{url}/readiness").parse().unwrap())
            .await
            .map(|r| r.status() == 200)
            .unwrap_or(false);
        if ok {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "router never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The admin listener serves the metrics (no token on loopback); the front door not.
    for (base, want) in [(&admin, 200), (&url, 404)] {
        let r = client
            .get(format!("{base}/metrics").parse().unwrap())
            .await
            .unwrap();
        assert_eq!(r.status(), want, "{base}/metrics");
    }
    let req = http::Request::post(format!("{url}/generate"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"text":"a","sampling_params":{"max_new_tokens":15},"stream":true}"#,
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "));

    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // New connections are refused once the drain started (bounded wait for it to start).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let fresh = common::client();
        let r = fresh.get(format!("{url}/health").parse().unwrap()).await;
        if r.is_err() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still accepting after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The in-flight stream still completes.
    let rest = body.collect().await.expect("stream finished").to_bytes();
    let mut all = first.to_vec();
    all.extend_from_slice(&rest);
    let (events, done) = common::sse_events(&all);
    assert!(done, "{}", String::from_utf8_lossy(&all));
    assert_eq!(events.len(), 15);
    assert!(events.iter().all(|e| e.get("error").is_none()));
    // And the process exits cleanly.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pdgate did not exit after draining"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(code.success(), "{code:?}");
}
