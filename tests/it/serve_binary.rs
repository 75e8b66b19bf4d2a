//! The `pdgate` binary as an operator meets it: its logs (no colour in a pipe, JSON with a
//! top-level `message`, the start-up line, the last line of a drain), the metrics listener
//! of `--prometheus-port`, refusals at start (an SGLang flag pdgate replaces, an unknown log
//! level) and its help (defaults shown, `check` narrowed, no internal ids).

use crate::support::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use http_body_util::BodyExt;
use pdgate::config::Config;

fn pdgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pdgate"))
}

/// A child killed when the test ends, passed or not (a failed assertion must not leave a
/// router running).
pub(crate) struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Running {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Running {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// `pdgate serve ARGS` with stdout piped, its lines sent to the receiver.
pub(crate) fn spawn(args: &[&str]) -> (Running, Receiver<String>) {
    let mut all = vec!["serve", "--port", "0", "--admin-port", "0"];
    all.extend_from_slice(args);
    spawn_pdgate(&all)
}

/// `pdgate ARGS` with stdout piped, its lines sent to the receiver.
pub(crate) fn spawn_pdgate(args: &[&str]) -> (Running, Receiver<String>) {
    let mut child = pdgate()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("pdgate binary");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (Running(child), rx)
}

/// Lines until one satisfies `f` (all of them, that one last).
pub(crate) fn until(rx: &Receiver<String>, what: &str, f: impl Fn(&str) -> bool) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no line {what}; saw {seen:#?}"));
        let done = f(&line);
        seen.push(line);
        if done {
            return seen;
        }
    }
}

pub(crate) fn term(child: &mut Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

pub(crate) fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
}

async fn get(url: &str) -> (u16, String) {
    let r = common::client().get(url.parse().unwrap()).await.unwrap();
    let status = r.status().as_u16();
    let body = r.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_start_line_metrics_listener_and_drain_line() {
    let (mut child, rx) = spawn(&[
        "--log-json",
        "--decode",
        "http://127.0.0.1:9",
        "--policy",
        "prefix_hash",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "0",
        "--dp-aware",
        "--retry-jitter-factor",
        "0.2",
    ]);
    // The metrics listener starts after the front door.
    let lines = until(&rx, "the metrics listener's", |l| {
        l.contains("metrics listener")
    });
    for l in &lines {
        assert!(!l.contains('\x1b'), "a colour code in a pipe: {l}");
    }
    let first = json(&lines[0]);
    assert_eq!(first["message"], "pdgate starting", "{first}");
    assert_eq!(first["version"], env!("CARGO_PKG_VERSION"));
    assert!(
        first["commit"].as_str().is_some_and(|c| !c.is_empty()),
        "{first}"
    );
    assert_eq!(first["prefill_policy"], "cache_aware");
    assert_eq!(first["contract_mode"], "modulo");
    let notes: Vec<serde_json::Value> = lines.iter().map(|l| json(l)).collect();
    assert!(
        notes.iter().any(|v| v["level"] == "WARN"
            && v["message"]
                .as_str()
                .is_some_and(|m| m.contains("--retry-jitter-factor is ignored"))),
        "{lines:#?}"
    );
    assert!(notes.iter().any(|v| v["message"]
        .as_str()
        .is_some_and(|m| m.contains("--dp-aware"))));
    let metrics = notes
        .iter()
        .find(|v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("metrics listener"))
        })
        .and_then(|v| v["url"].as_str().map(str::to_string))
        .expect("the metrics listener's line");
    let (s, body) = get(&format!("{metrics}/metrics")).await;
    assert_eq!(s, 200);
    assert!(body.contains("# TYPE pdgate_"), "{body}");
    assert_eq!(get(&format!("{metrics}/liveness")).await.0, 200);
    let post = http::Request::post(format!("{metrics}/metrics"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let r = common::client().request(post).await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["allow"], "GET, HEAD");
    for path in ["/workers", "/config", "/generate", "/readiness"] {
        let (s, body) = get(&format!("{metrics}{path}")).await;
        assert_eq!(s, 404, "{path}");
        assert!(body.contains("only /metrics and /liveness"), "{body}");
    }
    term(&mut child);
    let rest = until(&rx, "drain ended", |l| l.contains("drain ended"));
    let last = json(rest.last().unwrap());
    assert_eq!(last["message"], "drain ended; pdgate exits");
    // A duration in human units ("75.4µs", "1.2s"), not seconds in exponent notation.
    let took = last["drained_in"]
        .as_str()
        .unwrap_or_else(|| panic!("{last}"));
    assert!(
        took.ends_with('s')
            && !took.contains('e')
            && took.starts_with(|c: char| c.is_ascii_digit()),
        "{last}"
    );
    assert!(child.wait().unwrap().success());
    assert!(
        rx.recv_timeout(Duration::from_secs(5)).is_err(),
        "a line after the last one"
    );
}

#[test]
fn text_logs_have_no_colour_in_a_pipe_and_warning_is_a_level() {
    let (mut child, rx) = spawn(&[
        "--log-level",
        "warning",
        "--worker-startup-timeout-secs",
        "600",
    ]);
    // At `warning`, the ignored flag's warning shows and the INFO start-up line does not.
    let lines = until(&rx, "the ignored flag's warning", |l| {
        l.contains("--worker-startup-timeout-secs is ignored")
    });
    for l in &lines {
        assert!(!l.contains('\x1b'), "a colour code in a pipe: {l:?}");
        assert!(!l.contains("INFO"), "an INFO line at level warning: {l}");
    }
    assert!(lines.last().unwrap().contains("WARN"));
    // (It may not have installed its SIGTERM handler yet: no line says so at `warning`.)
    child.kill().unwrap();
    let _ = child.wait();
}

#[test]
fn bad_start_flags_are_refused_with_what_replaces_them() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--cors-allowed-origins", "*"],
            &["--cors-allowed-origins", "ingress"],
        ),
        (&["--log-dir", "/tmp/x"], &["--log-dir", "stdout"]),
        (
            &["--enable-trace", "--otlp-traces-endpoint", "https://c:4317"],
            &["trace.endpoint", "4318"],
        ),
        (
            &["--rate-limit-tokens-per-second", "10"],
            &["--max-concurrent-requests"],
        ),
        (&["--policy", "manual"], &["manual", "cache_aware"]),
        (&["--log-level", "warnign"], &["warnign", "not a log level"]),
        (
            &["--log-level", "pdgate=loud"],
            &["loud", "not a log level"],
        ),
    ];
    for (args, want) in cases {
        let out = pdgate().arg("serve").args(*args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        for w in *want {
            assert!(err.contains(w), "{args:?}: {err}");
        }
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

/// Help text with an internal requirement id (`R4`, `R10`) or an issue number (`#12`).
fn internal_id(text: &str) -> Option<String> {
    let words: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '#'))
        .collect();
    words
        .iter()
        .find(|w| {
            let (head, digits) = w.split_at(1.min(w.len()));
            (head == "R" || head == "#")
                && !digits.is_empty()
                && digits.chars().all(|c| c.is_ascii_digit())
        })
        .map(|w| w.to_string())
}

#[test]
fn help_shows_defaults_and_check_shows_what_check_uses() {
    let help = |sub: &str| {
        let args: &[&str] = if sub.is_empty() {
            &["--help"]
        } else {
            &[sub, "--help"]
        };
        let out = pdgate().args(args).output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let serve = help("serve");
    let d = Config::default();
    for (flag, default) in [
        (
            "--request-timeout-secs",
            d.timeouts.request_secs.to_string(),
        ),
        ("--max-payload-size", d.server.max_body_bytes.to_string()),
        ("--port", d.server.port.to_string()),
        ("--admin-port", d.admin.port.to_string()),
        ("--queue-size", d.admission.max_queue.to_string()),
    ] {
        let at = serve
            .find(&format!("{flag} "))
            .unwrap_or_else(|| panic!("{flag} in {serve}"));
        let entry: String = serve[at..].chars().take(400).collect();
        let entry = entry.split("\n  -").next().unwrap_or("");
        assert!(
            entry.contains(&format!("[default: {default}]")),
            "{flag}: {entry}"
        );
    }
    assert!(serve.contains("SGLang router flags"), "{serve}");
    let check = help("check");
    for used in [
        "--prefill",
        "--decode",
        "--config",
        "--contract-mode",
        "--probe-request",
        "--json",
    ] {
        assert!(check.contains(used), "check --help lacks {used}");
    }
    for unused in [
        "--worker-threads",
        "--access-log",
        "--admin-port",
        "--log-format",
        "--prometheus-port",
        "--queue-size",
    ] {
        assert!(!check.contains(unused), "check --help shows {unused}");
    }
    // `demo` takes serve's address flags, with serve's defaults.
    let demo = help("demo");
    for (flag, default) in [
        ("--host", d.server.host.to_string()),
        ("--port", d.server.port.to_string()),
    ] {
        let at = demo
            .find(&format!("{flag} "))
            .unwrap_or_else(|| panic!("{flag} in {demo}"));
        let entry = demo[at..].split("\n  -").next().unwrap_or("");
        assert!(
            entry.contains(&format!("[default: {default}]")),
            "demo {flag}: {entry}"
        );
    }
    for (name, text) in [("serve", &serve), ("check", &check), ("pdgate", &help(""))] {
        assert_eq!(internal_id(text), None, "{name} --help");
    }
}

/// The README's first command: `pdgate demo` starts simulated engines and a router that
/// answers the commands it prints (here on a free port: `--port 0`, and `--host`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_serves_the_requests_it_prints() {
    let (mut child, rx) = spawn_pdgate(&["demo", "--host", "127.0.0.1", "--port", "0"]);
    let lines = until(&rx, "naming the router", |l| {
        l.contains("router on http://")
    });
    let line = lines.last().unwrap();
    let url = line
        .split("router on ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("{line}"))
        .to_string();
    assert!(url.starts_with("http://127.0.0.1:"), "{line}");
    let post = |path: &'static str, body: &'static str| {
        let req = http::Request::post(format!("{url}{path}"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                body.as_bytes(),
            )))
            .unwrap();
        async move {
            let r = common::client().request(req).await.unwrap();
            let st = r.status().as_u16();
            let b = r.into_body().collect().await.unwrap().to_bytes();
            (st, String::from_utf8_lossy(&b).into_owned())
        }
    };
    let (st, body) = post(
        "/v1/chat/completions",
        r#"{"model":"sim-model","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}"#,
    )
    .await;
    assert_eq!(st, 200, "{body}");
    assert!(
        json(&body)["choices"][0]["message"]["content"].is_string(),
        "{body}"
    );
    let (st, body) = post(
        "/generate",
        r#"{"text":"The capital of France is","sampling_params":{"max_new_tokens":8}}"#,
    )
    .await;
    assert_eq!(st, 200, "{body}");
    let (st, body) = get(&format!("{url}/metrics")).await;
    assert_eq!(st, 200);
    assert!(body.contains("pdgate_requests_total"), "{body}");
    term(&mut child);
}

/// `serve` runs with mimalloc giving freed memory back within 100 ms (`MIMALLOC_PURGE_DELAY=100`,
/// set by re-executing itself: docs/pools-and-capacity.md, "Memory"); an operator's own value is kept. Read from
/// the running process's environment, once it logged its start.
#[test]
fn serve_runs_with_the_allocator_giving_freed_memory_back_promptly() {
    for (given, want) in [(None, "100"), (Some("25"), "25")] {
        let mut cmd = pdgate();
        cmd.args(["serve", "--port", "0", "--admin-port", "0"])
            .args(["--log-json", "--decode", "http://127.0.0.1:9"])
            .env_remove("MIMALLOC_PURGE_DELAY")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(v) = given {
            cmd.env("MIMALLOC_PURGE_DELAY", v);
        }
        let mut child = Running(cmd.spawn().expect("pdgate binary"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        until(&rx, "starting", |l| l.contains("pdgate starting"));
        let environ = std::fs::read(format!("/proc/{}/environ", child.id())).unwrap();
        let vars: Vec<String> = environ
            .split(|b| *b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .filter(|v| v.starts_with("MIMALLOC_PURGE_DELAY="))
            .collect();
        assert_eq!(
            vars,
            [format!("MIMALLOC_PURGE_DELAY={want}")],
            "given {given:?}"
        );
    }
}
