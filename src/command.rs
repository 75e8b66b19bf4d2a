//! The binary's command line: `pdgate serve | check | sim | demo`.
//!
//! Why here and not in the library: `sim` and `demo` run the engine simulator, which is a
//! test double the router library does not contain. `serve`'s flags and how they become a
//! configuration stay in the library ([`pdgate::cli`]) for tests and benches.

use clap::{Args, Parser, Subcommand};
use pdgate::cli::ServeArgs;

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
// Parsed once at start: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run the router.
    Serve(ServeArgs),
    /// Probe every configured engine, and every engine discovery finds (the same flags and
    /// config as `serve`: a `serve` command line is checked by changing its first word), and
    /// report what is wrong and how to fix it. Exit code 0: all ✓; 1: a ✗; 2: a config
    /// error.
    Check(CheckArgs),
    /// Run simulated SGLang engines (prefill + bootstrap server, decode), no GPU.
    Sim(pdgate_sim::cli::SimArgs),
    /// Simulated engines (2 prefill with DP 2, 2 decode with DP 2) plus the router, in one process.
    Demo(crate::demo::DemoArgs),
}

/// `pdgate check`: `serve`'s flags plus the output format and the end-to-end probe.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Print the report as JSON (machine output).
    #[arg(long)]
    pub json: bool,
    /// Also send one PD request end to end through an in-process router.
    #[arg(long)]
    pub probe_request: bool,
}

/// The command line, with `serve`'s defaults in its help and `check`'s help narrowed to
/// what `check` uses.
pub fn cli() -> clap::Command {
    use clap::CommandFactory;
    Cli::command()
        .mut_subcommand("serve", |c| {
            pdgate::cli::with_defaults(c).after_help(
                "Every other flag of SGLang's router (smg launch) is accepted as a no-op, \
                 ignored with a warning at start, or refused with what replaces it: \
                 docs/coming-from-sglang.md.",
            )
        })
        .mut_subcommand("check", |c| {
            pdgate::cli::for_check(pdgate::cli::with_defaults(c))
        })
        .mut_subcommand("demo", pdgate::cli::with_defaults)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};
    use pdgate::cli::prefill_groups;
    use pdgate::config::{Config, PolicyKind};

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
    fn check_takes_serve_flags_plus_its_own() {
        let argv = [
            "pdgate",
            "check",
            "--prefill",
            "http://10.0.0.1:30000",
            "9000",
            "--decode",
            "http://10.0.0.3:30001",
            "--contract-mode",
            "pinned",
            "--json",
            "--probe-request",
        ];
        let m = Cli::command().try_get_matches_from(argv).unwrap();
        let sm = m.subcommand_matches("check").cloned().unwrap();
        let Command::Check(a) = Cli::from_arg_matches(&m).unwrap().command else {
            panic!("not check");
        };
        assert!(a.json && a.probe_request);
        let cfg = a.serve.into_config(prefill_groups(&sm).unwrap()).unwrap();
        assert_eq!(cfg.prefill[0].bootstrap_port, Some(9000));
        assert_eq!(cfg.decode.len(), 1);
        assert_eq!(cfg.contract.mode, pdgate::config::ContractMode::Pinned);
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
