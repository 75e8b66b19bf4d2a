//! `pdgate sim` flags: parsing, defaults and the READY line.

use std::time::Duration;

use clap::Parser;
use pdgate_sim::cli::{ready_line, SimArgs};
use pdgate_sim::{EngineConfig, Role};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
}

#[test]
fn flags_override_only_what_they_name() {
    let cli = Cli::try_parse_from([
        "sim",
        "--prefill-dp",
        "2",
        "--itl-ms",
        "7",
        "--waiting-timeout-secs",
        "1.5",
        "--unregistered-ranks",
        "1,3",
        "--prefill-status",
        "503",
        "--legacy-bootstrap-bug",
        "--context-length",
        "64",
        "--role",
        "decode",
    ])
    .expect("parse");
    let a = cli.sim;
    assert_eq!(a.role, Some(Role::Decode));
    let c = a.config(Role::Prefill, a.prefill_dp);
    let d = EngineConfig::prefill(2);
    assert_eq!(c.itl, Duration::from_millis(7));
    assert_eq!(c.waiting_timeout, Duration::from_millis(1500));
    assert_eq!(c.ttft, d.ttft);
    assert_eq!(c.prefill_delay, d.prefill_delay);
    assert_eq!(c.sentinel_attempts, d.sentinel_attempts);
    assert!(c.legacy_bootstrap_bug);
    assert_eq!(c.context_length, 64);
    assert_eq!(c.faults.unregistered_ranks, vec![1, 3]);
    assert_eq!(c.faults.prefill_status, Some(503));
    assert!(Cli::try_parse_from(["sim", "--role", "router"]).is_err());
}

#[tokio::test(crate = "crate::support::rt")]
async fn ready_lines() {
    let p = pdgate_sim::spawn(EngineConfig::prefill(2))
        .await
        .expect("prefill");
    let d = pdgate_sim::spawn(EngineConfig::decode(1))
        .await
        .expect("decode");
    assert_eq!(
        ready_line(&p),
        format!(
            "READY prefill http://127.0.0.1:{} bootstrap_port={} dp=2",
            p.addr().port(),
            p.bootstrap_port().unwrap_or(0)
        )
    );
    assert_eq!(
        ready_line(&d),
        format!("READY decode http://127.0.0.1:{} dp=1", d.addr().port())
    );
}
