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

/// Where the log of the child process `name` goes: `$TMPDIR/pdgate-bench-NAME-PID.log`.
pub fn log_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pdgate-bench-{name}-{}.log", std::process::id()))
}

pub fn log_file(name: &str) -> Stdio {
    match std::fs::File::create(log_path(name)) {
        Ok(f) => Stdio::from(f),
        Err(_) => Stdio::null(),
    }
}

pub struct SimInfo {
    pub prefill_url: String,
    pub bootstrap_port: u16,
    pub decode_url: String,
}

/// One `READY role url [bootstrap_port=N] dp=N` line of `pdgate sim`.
#[derive(Clone, Debug)]
pub struct Ready {
    pub role: String,
    pub url: String,
    pub bootstrap_port: Option<u16>,
}

/// Starts `pdgate sim ARGS` (logs to the `name` log file) and waits (bounded: 20 s) until
/// it printed `n` READY lines; its stdout is drained for the rest of its life.
pub fn spawn_sim(
    bin: &Path,
    args: &[String],
    n: usize,
    name: &'static str,
) -> Result<(Proc, Vec<Ready>), String> {
    spawn_sim_niced(bin, args, n, name, None)
}

/// How a bench runs what stands for other machines (load generators, engines) beside the
/// router on a small machine, so that it takes only the CPU the router leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demote {
    /// `nice -n N`: a smaller share, but Linux's EEVDF scheduler still lets a running task
    /// finish its slice (milliseconds) before a waking router thread gets the CPU.
    Nice(i32),
    /// `SCHED_IDLE` (`chrt --idle 0`): runs only when nothing else wants the CPU; a waking
    /// router thread preempts it at once. The closer stand-in for "another machine".
    Idle,
}

impl Demote {
    /// From an env var: `idle`, `nice:N` (or a bare `N`), or `0`/`off`/`none` for neither;
    /// `default` when unset or unreadable.
    pub fn from_env(var: &str, default: Option<Demote>) -> Option<Demote> {
        let Ok(v) = std::env::var(var) else {
            return default;
        };
        let v = v.trim();
        match v {
            "idle" => Some(Demote::Idle),
            "0" | "off" | "none" => None,
            _ => v
                .strip_prefix("nice:")
                .unwrap_or(v)
                .parse::<i32>()
                .ok()
                .map(|k| Demote::Nice(k.clamp(1, 19)))
                .or(default),
        }
    }

    /// The command that runs `bin` demoted.
    pub fn command(self, bin: &Path) -> Command {
        let mut c = match self {
            Demote::Nice(k) => {
                let mut c = Command::new("nice");
                c.args(["-n", &k.to_string()]);
                c
            }
            Demote::Idle => {
                let mut c = Command::new("chrt");
                c.args(["--idle", "0"]);
                c
            }
        };
        c.arg(bin);
        c
    }

    /// Demotes one thread (`tid`) of a running process; whether it took.
    pub fn apply_to_thread(self, tid: &str) -> bool {
        let mut c = match self {
            Demote::Nice(k) => {
                let mut c = Command::new("renice");
                c.args(["-n", &k.to_string(), "-p", tid]);
                c
            }
            Demote::Idle => {
                let mut c = Command::new("chrt");
                c.args(["--idle", "-p", "0", tid]);
                c
            }
        };
        c.stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl std::fmt::Display for Demote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Demote::Nice(k) => write!(f, "nice {k}"),
            Demote::Idle => f.write_str("SCHED_IDLE"),
        }
    }
}

/// [`spawn_sim`] demoted (every thread of the simulator: threads inherit the niceness and
/// the scheduling policy).
pub fn spawn_sim_niced(
    bin: &Path,
    args: &[String],
    n: usize,
    name: &'static str,
    demote: Option<Demote>,
) -> Result<(Proc, Vec<Ready>), String> {
    let mut cmd = match demote {
        Some(d) => d.command(bin),
        None => Command::new(bin),
    };
    let mut child = cmd
        .arg("sim")
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file(name))
        .spawn()
        .map_err(|e| format!("spawn pdgate sim: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let proc = Proc { child, name };
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // Keep draining after the receiver is gone, so that the child never blocks.
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ready = Vec::new();
    while ready.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .map_err(|_| format!("pdgate sim printed {} of {n} READY lines", ready.len()))?;
        let mut it = line.split_whitespace();
        if it.next() != Some("READY") {
            continue;
        }
        let role = it.next().unwrap_or("").to_string();
        let url = it.next().unwrap_or("").to_string();
        let bootstrap_port = it
            .find_map(|w| w.strip_prefix("bootstrap_port="))
            .and_then(|p| p.parse::<u16>().ok());
        ready.push(Ready {
            role,
            url,
            bootstrap_port,
        });
    }
    Ok((proc, ready))
}

/// `pdgate sim --prefill 1 --decode 1` with tiny latencies; parses its `READY` lines.
pub fn start_sim(bin: &Path, tokens: u32) -> (Proc, SimInfo) {
    start_sim_with(bin, tokens, &[], None)
}

/// [`start_sim`] with more `pdgate sim` arguments (e.g. `--served-model-name`), maybe
/// demoted.
pub fn start_sim_with(
    bin: &Path,
    tokens: u32,
    extra: &[&str],
    demote: Option<Demote>,
) -> (Proc, SimInfo) {
    let args: Vec<String> = [
        "--prefill",
        "1",
        "--decode",
        "1",
        "--host",
        "127.0.0.1",
        "--prefill-ms",
        "0",
        "--ttft-ms",
        "0",
        "--itl-ms",
        "0",
        "--tokens",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(std::iter::once(tokens.to_string()))
    .chain(extra.iter().map(|s| s.to_string()))
    .collect();
    let (proc, ready) =
        spawn_sim_niced(bin, &args, 2, "sim", demote).unwrap_or_else(|e| panic!("{e}"));
    let prefill = ready.iter().find(|r| r.role == "prefill");
    let decode = ready.iter().find(|r| r.role == "decode");
    let (Some(p), Some(d)) = (prefill, decode) else {
        panic!("pdgate sim printed no prefill and decode READY lines");
    };
    let info = SimInfo {
        prefill_url: p.url.clone(),
        bootstrap_port: p.bootstrap_port.expect("bootstrap_port in READY line"),
        decode_url: d.url.clone(),
    };
    (proc, info)
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("addr").port()
}

pub fn start_router(bin: &Path, sim: &SimInfo) -> (Proc, String) {
    start_router_over(bin, &[sim])
}

/// [`start_router`] in front of the pairs of several simulators.
pub fn start_router_over(bin: &Path, sims: &[&SimInfo]) -> (Proc, String) {
    let port = free_port();
    let mut cmd = pinned(bin);
    cmd.args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
        // No fixed admin port for a bench's router.
        .args(["--admin-port", "0"]);
    for sim in sims {
        cmd.args([
            "--prefill",
            &sim.prefill_url,
            &sim.bootstrap_port.to_string(),
        ])
        .args(["--decode", &sim.decode_url]);
    }
    let child = cmd
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

/// A command for a router under measurement: `taskset -c N bin` when
/// `PDGATE_BENCH_PIN=N` is set (every router and forwarder on one core, so that routers
/// built for many cores and pdgate's one event loop are compared on the same CPU), else
/// `bin`. taskset execs the program, so the child's pid is the router's.
pub fn pinned(bin: impl AsRef<std::ffi::OsStr>) -> Command {
    match std::env::var("PDGATE_BENCH_PIN") {
        Ok(core) if !core.is_empty() => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(core).arg(bin);
            c
        }
        _ => Command::new(bin),
    }
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

/// Times a process's threads were put on a CPU (`/proc/<pid>/task/*/schedstat`, third
/// field: wake-ups and preemptions), and its minor page faults (`/proc/<pid>/stat` field
/// 10). Counts, not times: a change in them explains a change in CPU per request without
/// hardware counters (which a VM may not have).
pub fn sched_counts(pid: u32) -> (u64, u64) {
    let runs = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().nth(2)?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    let minflt = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().nth(10 - 3)?.parse::<u64>().ok()
        })
        .unwrap_or(0);
    (runs, minflt)
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
