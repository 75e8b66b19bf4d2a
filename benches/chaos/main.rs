//! Chaos soak bench: the soak of `soak.rs` for `--secs` seconds (120 by default) with the
//! router as a process of its own, so that its RSS is its own.
//!
//! - router: `pdgate serve --config FILE` (the soak's settings, JSON logs), the release
//!   binary (`PDGATE_BIN` to pick another);
//! - decodes: one `pdgate sim --role decode` process each, **killed for real** (SIGKILL)
//!   and restarted on the same port;
//! - prefills: a `SimCluster` in this bench's process, because a "down" simulated engine
//!   can only be brought back through its handle (its HTTP port drops every connection,
//!   `/sim/faults` included), and because a restarted prefill process would come back with
//!   new KV rank ports that decodes cache by bootstrap address (a simulator artefact, not
//!   the router's); a prefill "kill" is its `down` fault;
//! - load: open-loop lanes in this process (`--lanes`, 16 by default).
//!
//! Memory: the soak runs `--storms` storms (2 by default, `--secs` shared between them, the
//! same faults each) against one router, and judges its RSS at rest after the last against
//! that after the first: a leak grows with each storm, what the first allocates once does
//! not (the RSS against the warm-up is then reported).
//!
//! Run: `cargo bench --bench chaos -- --secs 120` (`--lanes N`, `--seed N`, `--storms N`;
//! `PDGATE_BENCH_ROUTER_ARGS="--worker-threads 2"` passes extra flags to the router). It prints a
//! summary and one verdict per check; like every bench here it asserts nothing (the exit
//! code is 0 either way). Logs: `$TMPDIR/pdgate-bench-chaos-*.log`.

mod client;
mod driver;
mod report;
mod soak;
#[path = "../support/mod.rs"]
mod support;

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdgate_sim::{Role, SimCluster, SimEngine};
use serde_json::Value;

use soak::{EngineRef, Fleet, Fut};
use support::Proc;

struct Decode {
    proc: Option<Proc>,
    port: u16,
    legacy: bool,
}

struct Processes {
    bin: PathBuf,
    prefills: Vec<SimEngine>,
    decodes: Mutex<Vec<Decode>>,
    decode_urls: Vec<String>,
    router: Proc,
    router_log: PathBuf,
}

const DECODE_LOGS: [&str; 2] = ["chaos-decode0", "chaos-decode1"];

fn decode_args(port: u16, legacy: bool) -> Vec<String> {
    let mut v: Vec<String> = ["--role", "decode", "--host", "127.0.0.1", "--port"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(port.to_string());
    v.extend(soak::sim_flags(legacy));
    v
}

fn spawn_decode(
    bin: &std::path::Path,
    d: usize,
    port: u16,
    legacy: bool,
) -> Result<(Proc, String), String> {
    let name = DECODE_LOGS.get(d).copied().unwrap_or("chaos-decode");
    let (proc, ready) = support::spawn_sim(bin, &decode_args(port, legacy), 1, name)?;
    let url = ready
        .first()
        .map(|r| r.url.clone())
        .ok_or("no READY line")?;
    Ok((proc, url))
}

impl Processes {
    fn decode_index(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.prefills.len())
            .filter(|d| *d < self.decode_urls.len())
    }
}

impl Fleet for Processes {
    fn engines(&self) -> Vec<EngineRef> {
        let p = self.prefills.iter().enumerate().map(|(i, e)| EngineRef {
            label: format!("P{i}"),
            role: Role::Prefill,
            url: e.url(),
        });
        let d = self.decode_urls.iter().enumerate().map(|(i, u)| EngineRef {
            label: format!("D{i}"),
            role: Role::Decode,
            url: u.clone(),
        });
        p.chain(d).collect()
    }

    fn describe(&self) -> String {
        format!(
            "router `{} serve{}` (pid {}); decodes D0, D1 are `pdgate sim --role decode` processes, killed with SIGKILL and restarted on the same port; prefills P0, P1 run in the bench's process (a prefill kill is its `down` fault); D1 has the legacy bootstrap bug",
            self.bin.display(),
            std::env::var("PDGATE_BENCH_ROUTER_ARGS")
                .map(|a| format!(" {}", a.trim()))
                .unwrap_or_default(),
            self.router.pid()
        )
    }

    fn in_process(&self, i: usize) -> bool {
        i < self.prefills.len()
    }

    fn set_faults_direct(&self, i: usize, f: &pdgate_sim::Faults) {
        if let Some(p) = self.prefills.get(i) {
            p.set_faults(f.clone());
        }
    }

    fn can_kill(&self, i: usize) -> bool {
        self.decode_index(i).is_some()
    }

    fn kill(&self, i: usize) -> Fut<'_, Result<String, String>> {
        let taken = self.decode_index(i).and_then(|d| {
            self.decodes
                .lock()
                .ok()
                .and_then(|mut g| g.get_mut(d).and_then(|x| x.proc.take()))
        });
        Box::pin(async move {
            let mut p = taken.ok_or_else(|| format!("engine {i} is not a running decode"))?;
            let pid = p.pid();
            // Proc's drop would do the same; done here to report a failure.
            p.child.kill().map_err(|e| format!("kill {pid}: {e}"))?;
            drop(p);
            Ok(format!("SIGKILL to pid {pid}"))
        })
    }

    fn restart(&self, i: usize) -> Fut<'_, Result<String, String>> {
        Box::pin(async move {
            let d = self.decode_index(i).ok_or("not a decode")?;
            let (port, legacy) = {
                let g = self.decodes.lock().map_err(|_| "poisoned")?;
                (g[d].port, g[d].legacy)
            };
            let bin = self.bin.clone();
            let mut last = String::new();
            // The killed process's listener is gone with it; retry briefly in case the
            // port is not free yet.
            for _ in 0..10 {
                let b = bin.clone();
                let spawned =
                    tokio::task::spawn_blocking(move || spawn_decode(&b, d, port, legacy))
                        .await
                        .map_err(|e| e.to_string())?;
                match spawned {
                    Ok((proc, _)) => {
                        let pid = proc.pid();
                        if let Ok(mut g) = self.decodes.lock() {
                            g[d].proc = Some(proc);
                        }
                        return Ok(format!("decode {d} restarted as pid {pid} on port {port}"));
                    }
                    Err(e) => last = e,
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(format!("decode {d} did not restart on port {port}: {last}"))
        })
    }

    fn router_rss_kib(&self) -> Option<u64> {
        Some(support::rss_kib(self.router.pid()).0).filter(|k| *k > 0)
    }

    fn router_fds(&self) -> Option<u64> {
        let dir = std::fs::read_dir(format!("/proc/{}/fd", self.router.pid())).ok()?;
        Some(dir.count() as u64)
    }

    fn breakers(&self) -> Option<String> {
        breakers_from_log(&self.router_log)
    }
}

/// The last breaker transition of each worker (state, when, how many), from the router's
/// JSON log (stdout).
fn breakers_from_log(path: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut last: std::collections::BTreeMap<(String, String), (String, String, u64)> =
        std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| l.contains("circuit breaker")) {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        // JSON logs carry the fields at the top level.
        let f = &v;
        let s = |k: &str| f[k].as_str().unwrap_or("?").to_string();
        let e = last.entry((s("role"), s("worker"))).or_default();
        e.0 = s("to");
        e.1 = v["timestamp"].as_str().unwrap_or("?").to_string();
        e.2 += 1;
    }
    Some(
        last.iter()
            .map(|((role, w), (to, at, n))| {
                format!("{role} {w}: {to} since {at} (last of {n} transitions)")
            })
            .collect::<Vec<_>>()
            .join("; "),
    )
}

struct Args {
    secs: f64,
    lanes: usize,
    seed: u64,
    /// Storms against the same router, `secs / storms` each (same seed: the same faults).
    storms: usize,
}

fn args() -> Args {
    let mut a = Args {
        secs: 120.0,
        storms: 2,
        lanes: 16,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs()),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(k) = it.next() {
        let mut val = || it.next().cloned().unwrap_or_default();
        match k.as_str() {
            "--secs" => a.secs = val().parse().unwrap_or(a.secs),
            "--lanes" => a.lanes = val().parse().unwrap_or(a.lanes),
            "--seed" => a.seed = val().parse().unwrap_or(a.seed),
            "--storms" => a.storms = val().parse().unwrap_or(a.storms).max(1),
            _ => {} // `--bench` and other flags cargo passes
        }
    }
    a
}

/// The router's config file: the soak's settings, JSON logs, the workers.
fn router_config_file(prefills: &[SimEngine], decode_urls: &[String]) -> PathBuf {
    let mut text = String::from(soak::ROUTER_TOML);
    text.push_str("\n[log]\nformat = \"json\"\n");
    for p in prefills {
        text.push_str(&format!(
            "\n[[prefill]]\nurl = \"{}\"\nbootstrap_port = {}\n",
            p.url(),
            p.bootstrap_port().unwrap_or(0)
        ));
    }
    for d in decode_urls {
        text.push_str(&format!("\n[[decode]]\nurl = \"{d}\"\n"));
    }
    let path = std::env::temp_dir().join(format!("pdgate-bench-chaos-{}.toml", std::process::id()));
    let written = std::fs::File::create(&path).and_then(|mut f| f.write_all(text.as_bytes()));
    if let Err(e) = written {
        eprintln!("[chaos] cannot write {}: {e}", path.display());
        std::process::exit(2);
    }
    path
}

fn main() {
    let a = args();
    let bin = support::pdgate_bin();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let prefills: Vec<_> = (0..2)
            .map(|_| soak::engine_config(Role::Prefill, false))
            .collect();
        let cluster = SimCluster::spawn(&prefills, &[]).await.expect("prefills");
        let mut decodes = Vec::new();
        let mut decode_urls = Vec::new();
        for d in 0..2 {
            let legacy = d == soak::LEGACY_DECODE;
            let (proc, url) =
                spawn_decode(&bin, d, 0, legacy).unwrap_or_else(|e| panic!("decode {d}: {e}"));
            let port = url
                .rsplit(':')
                .next()
                .and_then(|p| p.parse::<u16>().ok())
                .expect("decode port");
            decodes.push(Decode {
                proc: Some(proc),
                port,
                legacy,
            });
            decode_urls.push(url);
        }
        let cfg_file = router_config_file(&cluster.prefills, &decode_urls);
        let port = support::free_port();
        let child = std::process::Command::new(&bin)
            .args(["serve", "--config"])
            .arg(&cfg_file)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // e.g. `--worker-threads 2`: the soak with the router on several threads.
            .args(
                std::env::var("PDGATE_BENCH_ROUTER_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .stdin(std::process::Stdio::null())
            .stdout(support::log_file("chaos-router-out"))
            .stderr(support::log_file("chaos-router"))
            .spawn()
            .expect("spawn pdgate serve");
        let router = Proc {
            child,
            name: "pdgate serve",
        };
        let url = format!("http://127.0.0.1:{port}");
        let cfg = soak::router_config();
        let SimCluster { prefills, .. } = cluster;
        let fleet = Arc::new(Processes {
            bin: bin.clone(),
            prefills,
            decodes: Mutex::new(decodes),
            decode_urls,
            router,
            router_log: support::log_path("chaos-router-out"),
        });
        let t0 = Instant::now();
        let mut failed = Vec::new();
        let mut outcomes = Vec::new();
        for k in 1..=a.storms {
            let secs = a.secs / a.storms as f64;
            let plan = soak::Plan::for_secs(secs, a.lanes, a.seed).with_env();
            eprintln!("[chaos] storm {k} of {}", a.storms);
            let outcome = soak::run(fleet.clone(), &url, &cfg, plan).await;
            let mut checks = report::checks(&outcome);
            if a.storms > 1 {
                report::rss_reported(&mut checks);
                println!("\n# Storm {k} of {}", a.storms);
            }
            report::print(&outcome, &checks);
            failed.extend(
                report::failures(&checks)
                    .into_iter()
                    .map(|f| format!("storm {k}: {f}")),
            );
            outcomes.push(outcome);
        }
        if let (Some(first), Some(last)) = (outcomes.first(), outcomes.last()) {
            if a.storms > 1 {
                let between = [report::rss_between_storms(first, last, a.storms)];
                println!("\n# Between the storms");
                report::print_checks(&between);
                failed.extend(report::failures(&between));
            }
        }
        if !failed.is_empty() {
            eprintln!(
                "[chaos] {} check(s) failed:\n{}",
                failed.len(),
                failed.join("\n")
            );
        }
        println!(
            "(router log: {}; {:.0} s in all)",
            support::log_path("chaos-router-out").display(),
            t0.elapsed().as_secs_f64()
        );
        drop(fleet);
        let _ = std::fs::remove_file(cfg_file);
    });
}
