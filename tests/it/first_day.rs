//! What a first day with pdgate trips on, met by the real binary at start: each mistake is
//! refused or warned with what to do (docs/troubleshooting.md, "Common first-day
//! symptoms").

use std::process::Command;

use crate::serve_binary::{json, spawn, until};

fn pdgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pdgate"))
}

/// Valid but most likely not meant: a fleet with no workers and no discovery (it can get
/// workers later, so it starts), and a trace collector on OTLP/gRPC's port. Each is one
/// WARN line saying what to do, and the router serves.
#[test]
fn an_empty_fleet_and_a_grpc_collector_are_warned_at_start() {
    let (_child, rx) = spawn(&[
        "--log-json",
        "--enable-trace",
        "--otlp-traces-endpoint",
        "127.0.0.1:4317",
    ]);
    let lines = until(&rx, "the collector's warning", |l| l.contains("4317"));
    let warns: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| json(l))
        .filter(|v| v["level"] == "WARN")
        .collect();
    let said = |part: &str| {
        warns
            .iter()
            .any(|v| v["message"].as_str().is_some_and(|m| m.contains(part)))
    };
    assert!(said("no workers") && said("POST /workers"), "{warns:#?}");
    assert!(said("4318") && said("trace.endpoint"), "{warns:#?}");
    // It starts all the same.
    until(&rx, "the front door's", |l| l.contains("pdgate listening"));
}

/// A port that is taken: the error names the listener and the settings that move it.
#[test]
fn a_taken_port_names_its_listener() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    for (args, listener, setting) in [
        (
            vec!["--port", port.as_str(), "--admin-port", "0"],
            "front door",
            "--port",
        ),
        (
            vec!["--port", "0", "--admin-port", port.as_str()],
            "admin listener",
            "--admin-port",
        ),
    ] {
        let out = pdgate().arg("serve").args(&args).output().expect("pdgate");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(
            err.contains(listener) && err.contains(setting) && err.contains(&port),
            "{args:?}: {err}"
        );
    }
}

/// The front door and the admin listener on one port, and two admin tokens (a file and the
/// environment): refused before anything binds, naming both and what to do.
#[test]
fn one_port_for_two_listeners_and_two_admin_tokens_are_refused() {
    let out = pdgate()
        .args(["serve", "--port", "8123", "--admin-port", "8123"])
        .output()
        .expect("pdgate");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    for part in ["server.port", "admin.port", "--admin-port"] {
        assert!(err.contains(part), "{err}");
    }
    let dir = std::env::temp_dir().join(format!("pdgate-first-day-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("admin-token");
    std::fs::write(&file, "from-the-file\n").expect("token file");
    let out = pdgate()
        .args([
            "serve",
            "--port",
            "0",
            "--admin-port",
            "0",
            "--admin-api-key-file",
        ])
        .arg(&file)
        .env(pdgate::admin::token::TOKEN_ENV, "from-the-environment")
        .output()
        .expect("pdgate");
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with two admin tokens");
    for part in [
        "admin.api_key_file",
        pdgate::admin::token::TOKEN_ENV,
        "keep one",
    ] {
        assert!(err.contains(part), "{err}");
    }
}
