//! The command line: `pdgate serve | sim | demo`.
//!
//! `serve` accepts the PD flags operators already pass to SGLang's router, so pdgate can be
//! swapped in. Every flag is an `Option` that overrides the TOML file (`--config`); the
//! defaults themselves live only in [`crate::config`].

use std::path::PathBuf;

use clap::{ArgMatches, Args, Parser, Subcommand};

use crate::config::{
    Config, ConfigError, ContractMode, DecodeWorkerConfig, LogFormat, PolicyKind,
    PrefillWorkerConfig,
};

#[derive(Debug, Parser)]
#[command(
    name = "pdgate",
    version,
    about = "Router and load balancer for prefill/decode disaggregated SGLang serving"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the router.
    Serve(ServeArgs),
    /// Run simulated SGLang engines (prefill + bootstrap server, decode), no GPU.
    Sim(crate::sim::cli::SimArgs),
    /// Simulated engines (2 prefill with DP 2, 2 decode with DP 2) plus the router, in one process.
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML file with every setting; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A prefill engine: `--prefill URL [BOOTSTRAP_PORT]` (repeatable).
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = clap::ArgAction::Append)]
    pub prefill: Vec<String>,
    /// A decode engine URL (repeatable).
    #[arg(long, action = clap::ArgAction::Append)]
    pub decode: Vec<String>,
    /// Listen address (default 127.0.0.1).
    #[arg(long)]
    pub host: Option<std::net::IpAddr>,
    /// Listen port (default 8000; 0 picks a free one).
    #[arg(long)]
    pub port: Option<u16>,
    /// Policy for both pools (overridden per pool by the two flags below).
    #[arg(long, value_enum)]
    pub policy: Option<PolicyKind>,
    /// Policy for the prefill pool.
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy for the decode pool.
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyKind>,
    /// `modulo` (no DP field on the prefill leg) or `pinned` (routed_dp_rank and
    /// disagg_prefill_dp_rank on both legs).
    #[arg(long, value_enum)]
    pub contract_mode: Option<ContractMode>,
    /// Cap on a request before its first byte, and on a non-streamed request.
    #[arg(long)]
    pub request_timeout_secs: Option<u64>,
    /// Seconds between engine health checks.
    #[arg(long)]
    pub health_check_interval_secs: Option<f64>,
    /// Timeout of one engine health check (seconds).
    #[arg(long)]
    pub health_check_timeout_secs: Option<f64>,
    /// Failed checks in a row that take a worker out.
    #[arg(long)]
    pub health_failure_threshold: Option<u32>,
    /// Good checks in a row that bring it back.
    #[arg(long)]
    pub health_success_threshold: Option<u32>,
    /// Runtime worker threads (1 = one current-thread runtime; 0 = one per core).
    #[arg(long)]
    pub worker_threads: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long)]
    pub max_payload_size: Option<usize>,
    /// Log format: text or json.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter (`info`, `pdgate=debug`, ...); RUST_LOG wins.
    #[arg(long)]
    pub log_level: Option<String>,
    /// Accepted for compatibility with SGLang's router; pdgate is always PD.
    #[arg(long, hide = true)]
    pub pd_disaggregation: bool,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Router port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
}

/// Parses `--prefill URL [PORT]` groups from the matches of `serve`.
pub fn prefill_groups(m: &ArgMatches) -> Result<Vec<PrefillWorkerConfig>, ConfigError> {
    let Ok(Some(occ)) = m.try_get_occurrences::<String>("prefill") else {
        return Ok(Vec::new());
    };
    occ.map(|mut vals| {
        let url = vals.next().cloned().unwrap_or_default();
        let bootstrap_port = match vals.next() {
            None => None,
            Some(p) if p.eq_ignore_ascii_case("none") => None,
            Some(p) => Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "--prefill {url} {p}: BOOTSTRAP_PORT must be 1..=65535"
                ))
            })?),
        };
        Ok(PrefillWorkerConfig {
            url,
            bootstrap_port,
            bootstrap_host: None,
        })
    })
    .collect()
}

impl ServeArgs {
    /// The file (if any), then the flags; the result is validated.
    pub fn into_config(self, prefills: Vec<PrefillWorkerConfig>) -> Result<Config, ConfigError> {
        let mut cfg = match &self.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        if !prefills.is_empty() {
            cfg.prefill = prefills;
        }
        if !self.decode.is_empty() {
            cfg.decode = self
                .decode
                .into_iter()
                .map(|url| DecodeWorkerConfig { url })
                .collect();
        }
        if let Some(h) = self.host {
            cfg.server.host = h;
        }
        if let Some(p) = self.port {
            cfg.server.port = p;
        }
        if let Some(p) = self.policy {
            cfg.policy.prefill = p;
            cfg.policy.decode = p;
        }
        if let Some(p) = self.prefill_policy {
            cfg.policy.prefill = p;
        }
        if let Some(p) = self.decode_policy {
            cfg.policy.decode = p;
        }
        if let Some(m) = self.contract_mode {
            cfg.contract.mode = m;
        }
        if let Some(t) = self.request_timeout_secs {
            cfg.timeouts.request_secs = t;
        }
        if let Some(v) = self.health_check_interval_secs {
            cfg.health.interval_secs = v;
        }
        if let Some(v) = self.health_check_timeout_secs {
            cfg.health.timeout_secs = v;
        }
        if let Some(v) = self.health_failure_threshold {
            cfg.health.failure_threshold = v;
        }
        if let Some(v) = self.health_success_threshold {
            cfg.health.success_threshold = v;
        }
        if let Some(v) = self.worker_threads {
            cfg.server.worker_threads = v;
        }
        if let Some(v) = self.max_payload_size {
            cfg.server.max_body_bytes = v;
        }
        if let Some(v) = self.log_format {
            cfg.log.format = v;
        }
        if let Some(v) = self.log_level {
            cfg.log.level = v;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    fn serve(args: &[&str]) -> Result<Config, String> {
        let mut argv = vec!["pdgate", "serve"];
        argv.extend_from_slice(args);
        let m = Cli::command()
            .try_get_matches_from(argv)
            .map_err(|e| e.to_string())?;
        let sm = m.subcommand_matches("serve").cloned().ok_or("no serve")?;
        let cli = Cli::from_arg_matches(&m).map_err(|e| e.to_string())?;
        let Command::Serve(a) = cli.command else {
            return Err("not serve".into());
        };
        let groups = prefill_groups(&sm).map_err(|e| e.to_string())?;
        a.into_config(groups).map_err(|e| e.to_string())
    }

    #[test]
    fn sglang_router_flags_are_accepted() {
        let cfg = serve(&[
            "--pd-disaggregation",
            "--prefill",
            "http://10.0.0.1:30000",
            "9000",
            "--prefill",
            "http://10.0.0.2:30000",
            "--decode",
            "http://10.0.0.3:30001",
            "--decode",
            "http://10.0.0.4:30001",
            "--host",
            "0.0.0.0",
            "--port",
            "30080",
            "--policy",
            "random",
            "--decode-policy",
            "round_robin",
            "--request-timeout-secs",
            "120",
            "--health-check-interval-secs",
            "2",
            "--health-failure-threshold",
            "3",
        ])
        .unwrap();
        assert_eq!(cfg.prefill.len(), 2);
        assert_eq!(cfg.prefill[0].bootstrap_port, Some(9000));
        assert_eq!(cfg.prefill[1].bootstrap_port, None);
        assert_eq!(cfg.decode.len(), 2);
        assert_eq!(cfg.server.port, 30080);
        assert_eq!(cfg.policy.prefill, PolicyKind::Random);
        assert_eq!(cfg.policy.decode, PolicyKind::RoundRobin);
        assert_eq!(cfg.timeouts.request_secs, 120);
        assert_eq!(cfg.health.failure_threshold, 3);
    }

    #[test]
    fn bad_flags_are_refused_with_the_name() {
        let e = serve(&["--prefill", "http://h:1", "notaport"]).unwrap_err();
        assert!(e.contains("BOOTSTRAP_PORT"), "{e}");
        let e = serve(&["--health-failure-threshold", "0"]).unwrap_err();
        assert!(e.contains("health.failure_threshold"), "{e}");
        let e = serve(&["--policy", "nope"]).unwrap_err();
        assert!(e.contains("nope"), "{e}");
    }

    #[test]
    fn flags_override_the_file() {
        let dir = std::env::temp_dir().join(format!("pdgate-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(
            &f,
            "[server]\nport = 1234\nmax_body_bytes = 10\n[[decode]]\nurl = \"http://d:1\"\n",
        )
        .unwrap();
        let cfg = serve(&["--config", f.to_str().unwrap(), "--port", "4321"]).unwrap();
        assert_eq!(cfg.server.port, 4321);
        assert_eq!(cfg.server.max_body_bytes, 10);
        assert_eq!(cfg.decode.len(), 1);
        std::fs::write(&f, "[server]\nbogus = 1\n").unwrap();
        let e = serve(&["--config", f.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("bogus"), "{e}");
    }
}
