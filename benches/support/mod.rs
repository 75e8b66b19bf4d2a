//! What the process-based benches share: child processes (the simulator, the router),
//! the release binary they run, and `/proc` readings (CPU ticks, RSS, listen overflows).
//! Each bench uses a subset, hence `dead_code` is allowed here.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------
// Child processes

/// A child process killed (by its own pid) and reaped when dropped.
pub struct Proc {
    pub child: Child,
    pub name: &'static str,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        eprintln!("[bench] stopped {} (pid {})", self.name, self.child.id());
    }
}

pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The release `pdgate` binary: `$PDGATE_BIN`, else `<target>/release/pdgate` next to this
/// bench's `deps/` directory (built once with `cargo build --release --bin pdgate` when
/// missing).
pub fn pdgate_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("PDGATE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    let release = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest_dir().join("target/release"));
    let bin = release.join("pdgate");
    if !bin.exists() {
        eprintln!(
            "[bench] {} is missing; running `cargo build --release --bin pdgate` ...",
            bin.display()
        );
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .args(["build", "--release", "--bin", "pdgate"])
            .current_dir(manifest_dir())
            .status();
        match status {
            Ok(s) if s.success() && bin.exists() => {}
            other => {
                eprintln!(
                    "[bench] could not build the router binary ({other:?}).\n\
                     Build it first:  cargo build --release --bin pdgate\n\
                     or point PDGATE_BIN at a pdgate binary."
                );
                std::process::exit(2);
            }
        }
    } else if let Some(age) = newest_source_after(&bin) {
        eprintln!(
            "[bench] warning: {} is older than src/ ({age:?} newer); rebuild with `cargo build --release --bin pdgate` to bench the current code",
            bin.display()
        );
    }
    bin
}

/// How much newer than `bin` the newest file under `src/` is, if it is newer.
pub fn newest_source_after(bin: &Path) -> Option<Duration> {
    let built = std::fs::metadata(bin).and_then(|m| m.modified()).ok()?;
    let mut newest = built;
    let mut stack = vec![manifest_dir().join("src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).ok()?.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                newest = newest.max(t);
            }
        }
    }
    newest.duration_since(built).ok().filter(|d| !d.is_zero())
}

pub fn log_file(name: &str) -> Stdio {
    let path = std::env::temp_dir().join(format!("pdgate-bench-{name}-{}.log", std::process::id()));
    match std::fs::File::create(&path) {
        Ok(f) => Stdio::from(f),
        Err(_) => Stdio::null(),
    }
}

pub struct SimInfo {
    pub prefill_url: String,
    pub bootstrap_port: u16,
    pub decode_url: String,
}

/// `pdgate sim --prefill 1 --decode 1` with tiny latencies; parses its `READY` lines.
pub fn start_sim(bin: &Path, tokens: u32) -> (Proc, SimInfo) {
    let mut child = Command::new(bin)
        .args([
            "sim",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--host",
            "127.0.0.1",
        ])
        .args(["--prefill-ms", "0", "--ttft-ms", "0", "--itl-ms", "0"])
        .args(["--tokens", &tokens.to_string()])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file("sim"))
        .spawn()
        .expect("spawn pdgate sim");
    let stdout = child.stdout.take().expect("sim stdout");
    let proc = Proc {
        child,
        name: "pdgate sim",
    };
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                // Keep draining so that the child never blocks on a full pipe.
                continue;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut prefill, mut decode) = (None, None);
    while prefill.is_none() || decode.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("pdgate sim printed no READY lines within 20 s"));
        let mut it = line.split_whitespace();
        if it.next() != Some("READY") {
            continue;
        }
        let role = it.next().unwrap_or("");
        let url = it.next().unwrap_or("").to_string();
        match role {
            "prefill" => {
                let port = it
                    .find_map(|w| w.strip_prefix("bootstrap_port="))
                    .and_then(|p| p.parse::<u16>().ok())
                    .expect("bootstrap_port in READY line");
                prefill = Some((url, port));
            }
            "decode" => decode = Some(url),
            _ => {}
        }
    }
    let (prefill_url, bootstrap_port) = prefill.unwrap();
    (
        proc,
        SimInfo {
            prefill_url,
            bootstrap_port,
            decode_url: decode.unwrap(),
        },
    )
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("addr").port()
}

pub fn start_router(bin: &Path, sim: &SimInfo) -> (Proc, String) {
    let port = free_port();
    let child = Command::new(bin)
        .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--prefill",
            &sim.prefill_url,
            &sim.bootstrap_port.to_string(),
        ])
        .args(["--decode", &sim.decode_url])
        .args(
            std::env::var("PDGATE_BENCH_ROUTER_ARGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .stdin(Stdio::null())
        .stdout(log_file("router-out"))
        .stderr(log_file("router"))
        .spawn()
        .expect("spawn pdgate serve");
    (
        Proc {
            child,
            name: "pdgate serve",
        },
        format!("http://127.0.0.1:{port}"),
    )
}

// ---------------------------------------------------------------------------------------
// /proc readings

pub fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|v| *v > 0.0)
        .unwrap_or(100.0)
}

/// (utime, stime) of a process (all threads), in clock ticks.
pub fn cpu_ticks(pid: u32) -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return (0, 0);
    };
    // The command name may contain spaces: fields are counted after the last ')'.
    let Some(rest) = s.rfind(')').map(|i| &s[i + 1..]) else {
        return (0, 0);
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14, stime field 15.
    let get = |field: usize| {
        f.get(field - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (get(14), get(15))
}

/// Time on a CPU of a process (all its threads), in ns: the scheduler's own exact count
/// (`/proc/<pid>/task/*/schedstat`), where `cpu_ticks` samples at the clock tick.
/// Threads that have ended are not counted.
pub fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// System-wide `TcpExt: ListenOverflows` (accept queue full → SYN dropped → the client
/// retransmits its SYN after 1 s).
pub fn listen_overflows() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/net/netstat") else {
        return 0;
    };
    let mut lines = s.lines();
    while let Some(names) = lines.next() {
        let Some(values) = lines.next() else { break };
        if !names.starts_with("TcpExt:") {
            continue;
        }
        let i = names
            .split_whitespace()
            .position(|n| n == "ListenOverflows");
        if let Some(v) = i
            .and_then(|i| values.split_whitespace().nth(i))
            .and_then(|v| v.parse().ok())
        {
            return v;
        }
    }
    0
}

/// (VmRSS, VmHWM) in KiB.
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return (0, 0);
    };
    let get = |key: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (get("VmRSS:"), get("VmHWM:"))
}
