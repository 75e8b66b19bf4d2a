//! The image's documented `docker run` lines, proven without a container engine: each
//! line's pdgate command (what follows the image name, or the image's CMD) runs with the
//! test build of the binary on loopback, and serves on the ports the Dockerfile's comment
//! under that line names. In-image paths become repository files (the config the image
//! carries is `config/pdgate.example.toml`), `--host 0.0.0.0` becomes `127.0.0.1`, and the
//! admin listener, on the container's loopback and published by no line, takes a free port.
//! The ports are the documented ones: a test run needs them free on 127.0.0.1.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use crate::serve_binary::{spawn_pdgate, until};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One documented run: the pdgate arguments and the ports its comment names.
struct Run {
    line: String,
    args: Vec<String>,
    ports: BTreeSet<u16>,
}

/// The `docker run` lines of the Dockerfile's header and the ports in the comment lines
/// that follow each (up to the next run or the end of the comment block).
fn documented_runs(dockerfile: &str, cmd: &[String]) -> Vec<Run> {
    let lines: Vec<&str> = dockerfile.lines().collect();
    crate::manifests::docker::documented_runs(dockerfile, cmd)
        .into_iter()
        .map(|(i, line, args)| {
            let ports = lines[i + 1..]
                .iter()
                .take_while(|l| l.starts_with("#  ") && !l.contains("docker run "))
                .flat_map(|note| note.split(|c: char| !c.is_ascii_digit()))
                .filter_map(|w| w.parse::<u16>().ok())
                .filter(|p| *p >= 1024)
                .collect();
            Run { line, args, ports }
        })
        .collect()
}

/// `GET path` on 127.0.0.1:`port`: the status line's code.
fn get(port: u16, path: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut head = String::new();
    s.read_to_string(&mut head).ok()?;
    head.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn each_documented_docker_run_serves_on_its_documented_ports() {
    let dockerfile = std::fs::read_to_string(root().join("docker/Dockerfile")).expect("Dockerfile");
    let cmd_line = dockerfile
        .lines()
        .rfind(|l| l.starts_with("CMD "))
        .expect("a CMD");
    let cmd: Vec<String> = serde_json::from_str(&cmd_line["CMD ".len()..]).expect("exec form");
    let example = root().join("config/pdgate.example.toml");
    let runs = documented_runs(&dockerfile, &cmd);
    assert!(runs.len() >= 2, "{} documented runs", runs.len());
    for run in runs {
        assert!(
            !run.ports.is_empty(),
            "{}: its comment names no port",
            run.line
        );
        let mut args: Vec<String> = run
            .args
            .iter()
            .map(|a| match a.as_str() {
                "/etc/pdgate/pdgate.toml" => example.display().to_string(),
                "0.0.0.0" => "127.0.0.1".to_string(),
                _ => a.clone(),
            })
            .collect();
        let args_ref: Vec<&str>;
        match args.first().map(String::as_str) {
            Some("serve") => {
                args.extend(["--admin-port".to_string(), "0".to_string()]);
                args_ref = args.iter().map(String::as_str).collect();
                let (_child, rx) = spawn_pdgate(&args_ref);
                let lines = until(&rx, "the front door's", |l| l.contains("pdgate listening"));
                let listening = lines.last().expect("a line");
                for port in &run.ports {
                    assert!(
                        listening.contains(&format!("127.0.0.1:{port}")),
                        "{}: listening line {listening}",
                        run.line
                    );
                    assert_eq!(
                        get(*port, "/liveness"),
                        Some(200),
                        "{}: port {port}",
                        run.line
                    );
                }
            }
            Some("sim") => {
                args_ref = args.iter().map(String::as_str).collect();
                let (_child, rx) = spawn_pdgate(&args_ref);
                // One READY line per engine: `READY <role> <url> [bootstrap_port=N] dp=N`.
                let engines = args_ref
                    .windows(2)
                    .filter(|w| w[0] == "--prefill" || w[0] == "--decode")
                    .map(|w| w[1].parse::<usize>().expect("a count"))
                    .sum::<usize>();
                let mut served = BTreeSet::new();
                let mut ready = 0;
                while ready < engines {
                    let line = until(&rx, "an engine's READY line", |l| l.starts_with("READY "))
                        .pop()
                        .expect("a line");
                    ready += 1;
                    for w in line.split_whitespace() {
                        let port = w
                            .rsplit_once(':')
                            .map(|(_, p)| p)
                            .or_else(|| w.strip_prefix("bootstrap_port="));
                        if let Some(p) = port.and_then(|p| p.parse::<u16>().ok()) {
                            served.insert(p);
                        }
                    }
                }
                assert_eq!(served, run.ports, "{}: the engines' ports", run.line);
                for port in &run.ports {
                    assert_eq!(
                        get(*port, "/health"),
                        Some(200),
                        "{}: port {port}",
                        run.line
                    );
                }
            }
            other => panic!("{}: pdgate command {other:?}", run.line),
        }
    }
}
