//! `pdgate demo`: the embedded default. Simulated engines (2 prefill with DP 2 and their
//! bootstrap servers, 2 decode with DP 2) on loopback, and the router in front of them.
//!
//! Part of the binary, not the library: it runs the simulator, a test double.

use clap::Args;
use pdgate::config::Config;
use pdgate::dispatch::RngSource;
use pdgate::types::Role;
use pdgate_sim::{EngineConfig, SimCluster};

/// Flags of `pdgate demo`. Unset, each takes `serve`'s default (`server.host`,
/// `server.port`); the engines and the admin API stay on loopback whatever the router's
/// address (e.g. `--host 0.0.0.0` in a container).
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Router address (the engines and the admin API stay on loopback).
    #[arg(long)]
    pub host: Option<std::net::IpAddr>,
    /// Router port.
    #[arg(long)]
    pub port: Option<u16>,
}

pub async fn run(args: DemoArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let prefill = [EngineConfig::prefill(2), EngineConfig::prefill(2)];
    let decode = [EngineConfig::decode(2), EngineConfig::decode(2)];
    let cluster = SimCluster::spawn(&prefill, &decode).await?;
    let mut cfg = Config::default();
    if let Some(host) = args.host {
        cfg.server.host = host;
    }
    if let Some(port) = args.port {
        cfg.server.port = port;
    }
    // The demo's `/metrics` is on the front door too; its admin listener (worker detail,
    // `/readiness` with every worker) is on a free loopback port, without a token.
    cfg.server.public_metrics = true;
    cfg.add_workers(cluster.prefill_endpoints(), cluster.decode_urls());
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let router = pdgate::router::start_with(
        cfg,
        None,
        pdgate::router::AdminListener::Bound(admin),
        RngSource::Os,
    )
    .await?;
    // Wait (bounded) until both pools are routable, so the printed commands work at once.
    for _ in 0..100 {
        let s = router.pool.load();
        if s.routable_ranks(Role::Prefill) > 0 && s.routable_ranks(Role::Decode) > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let url = router.url();
    let admin = router.admin_url().unwrap_or_default();
    println!("pdgate demo: router on {url}, admin API on {admin}");
    for p in &cluster.prefills {
        println!(
            "  prefill {} (DP 2, bootstrap port {})",
            p.url(),
            p.bootstrap_port().unwrap_or(0)
        );
    }
    for d in &cluster.decodes {
        println!("  decode  {} (DP 2)", d.url());
    }
    println!(
        r#"
Try:
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{{"model":"sim-model","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":8}}'
  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{{"model":"sim-model","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":8,"stream":true}}'
  curl -s {url}/generate -H 'Content-Type: application/json' \
    -d '{{"text":"The capital of France is","sampling_params":{{"max_new_tokens":8}}}}'
  curl -s {url}/readiness                 # status and counts
  curl -s {admin}/readiness               # every worker, its health and each DP rank's bootstrap state
  curl -s {url}/metrics | grep pdgate_
Ctrl-C stops everything."#
    );
    tokio::signal::ctrl_c().await?;
    router.shutdown().await;
    drop(cluster);
    Ok(())
}
