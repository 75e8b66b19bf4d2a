//! An engine that is down when pdgate starts: it is named at WARN with the reason (an
//! operator running `--log-level warn` sees it), and a prefill given without its bootstrap
//! port serves as soon as its engine is up, not at the bootstrap tracker's slow re-read.

use pdgate_sim::EngineConfig;

use crate::support::common::{fast_engine, start, GEN};

/// A port held (bound, not listening: a connection to it is refused) until the socket is
/// dropped, so that no other test's server takes it meanwhile.
fn held_port() -> (tokio::net::TcpSocket, u16) {
    let s = tokio::net::TcpSocket::new_v4().expect("socket");
    s.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let port = s.local_addr().expect("addr").port();
    (s, port)
}

/// The prefill's bootstrap port is learned from its `/server_info`, which cannot answer
/// while the engine is down. The slow re-read is set to an hour, so only the health check
/// seeing the engine come up can make it routable within the wait.
#[tokio::test(crate = "crate::support::rt")]
async fn a_prefill_without_bootstrap_port_serves_once_its_engine_is_up() {
    let (held, port) = held_port();
    let env = start(vec![], vec![EngineConfig::decode(1)], |cfg| {
        cfg.bootstrap.refresh_interval_ms = 3_600_000;
        cfg.prefill.push(pdgate::config::PrefillWorkerConfig {
            url: format!("http://127.0.0.1:{port}"),
            bootstrap_port: None,
            bootstrap_host: None,
            model: None,
        });
    })
    .await;
    env.wait_routable(0, 1).await;
    // Down at start: a few of its checks (50 ms apart) fail, and its port stays unknown.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        env.router
            .pool
            .load()
            .prefills
            .iter()
            .all(|w| !w.facts.healthy && w.facts.bootstrap.is_none()),
        "the prefill was down"
    );
    let mut e = fast_engine(EngineConfig::prefill(1));
    e.port = port;
    drop(held);
    let _prefill = pdgate_sim::spawn(e).await.expect("prefill engine");
    env.wait_routable(1, 1).await;
    let (st, _, body) = env.post("/generate", GEN).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
}

/// One WARN line per engine down at start, naming it (id and URL) and the reason: the real
/// binary at `--log-level warn`, as an operator runs it, until it exits (so every line it
/// wrote is read).
#[test]
fn an_engine_down_at_start_is_one_warn_line_with_the_reason() {
    use crate::serve_binary::{json, spawn, term, until};
    let (_held, port) = held_port();
    let down = format!("http://127.0.0.1:{port}");
    let (mut child, rx) = spawn(&[
        "--log-level",
        "warn",
        "--log-json",
        "--health-check-interval-secs",
        "0.05",
        "--decode",
        &down,
    ]);
    let mut lines = until(&rx, "naming the engine that is down", |l| l.contains(&down));
    // Twenty more failed checks (50 ms apart) while the router runs on; then its drain.
    std::thread::sleep(std::time::Duration::from_secs(1));
    term(&mut child);
    assert!(child.wait().expect("exit").success());
    // Every line it wrote: the reader thread ends at the closed pipe.
    lines.extend(rx.iter());
    let named: Vec<serde_json::Value> = lines
        .iter()
        .filter(|l| l.contains(&down))
        .map(|l| json(l))
        .collect();
    assert_eq!(named.len(), 1, "{lines:#?}");
    let line = &named[0];
    assert_eq!(line["level"], "WARN", "{line}");
    assert_eq!(line["worker_id"], "decode-0", "{line}");
    assert_eq!(line["worker_url"], down.as_str(), "{line}");
    let reason = line["reason"].as_str().unwrap_or_default().to_lowercase();
    assert!(
        reason.contains("refused") || reason.contains("connect"),
        "{line}"
    );
}
