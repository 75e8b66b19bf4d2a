//! Assembling a running router from a validated [`Config`]: the pool, one bootstrap
//! tracker per prefill, one health checker (and, when enabled, one load poller) per
//! worker, and the front door.

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::config::{Config, ConfigError};
use crate::pd::{Dispatcher, RngSource};
use crate::pool::Pool;
use crate::server::Server;
use crate::types::{Role, WorkerId};
use crate::upstream::{parse_base_url, BaseUrl, Upstream, UpstreamSettings};

/// A router serving on its listener.
pub struct Router {
    pub server: Server,
    pub pool: Arc<Pool>,
}

impl Router {
    pub fn url(&self) -> String {
        self.server.url()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
}

/// The engine clients' settings from `[upstream]` and `[timeouts]`.
pub fn upstream_settings(cfg: &Config) -> UpstreamSettings {
    UpstreamSettings {
        connect_timeout: cfg.timeouts.connect(),
        pool_max_idle_per_host: cfg.upstream.pool_max_idle_per_host,
        pool_idle_timeout: std::time::Duration::from_secs(cfg.upstream.pool_idle_timeout_secs),
        api_key: cfg.upstream.api_key.clone(),
        forward_authorization: cfg.upstream.forward_authorization,
    }
}

/// Starts the engine load poller of a worker when `policy.load_poll_interval_ms` > 0.
fn spawn_load_poller(
    cfg: &Config,
    pool: &Arc<Pool>,
    up: &Upstream,
    role: Role,
    id: WorkerId,
    url: BaseUrl,
) {
    if let Some(every) = cfg.policy.load_poll_interval() {
        crate::health::load::spawn(
            pool.clone(),
            up.clone(),
            every,
            cfg.bootstrap.http_timeout(),
            role,
            id,
            url,
        );
    }
}

/// Binds with an explicit accept backlog (the default of 128 overflows when hundreds of
/// clients connect at once, and each overflowed client waits a 1 s SYN retry).
fn bind(addr: std::net::SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Starts a router. `listener`: an already-bound socket (tests bind port 0), else
/// `server.host:server.port` is bound.
pub async fn start(
    cfg: Config,
    listener: Option<TcpListener>,
    rng: RngSource,
) -> Result<Router, StartError> {
    cfg.validate()?;
    let _ = crate::telemetry::install();
    crate::telemetry::config_loaded();
    // The Prometheus recorder keeps histogram samples until upkeep folds them in: run it
    // on a timer so memory stays flat when nobody scrapes `/metrics`.
    tokio::spawn(async {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tick.tick().await;
            crate::telemetry::upkeep();
        }
    });
    let cfg = Arc::new(cfg);
    let up = Upstream::new(&upstream_settings(&cfg));
    let pool = Arc::new(Pool::new());
    for p in &cfg.prefill {
        let url = parse_base_url(&p.url)
            .map_err(|e| ConfigError::Invalid(format!("prefill url {}: {e}", p.url)))?;
        let id = pool.add_worker(Role::Prefill, url.clone(), None);
        crate::bootstrap::tracker::spawn(
            pool.clone(),
            up.clone(),
            cfg.bootstrap.clone(),
            id,
            url.clone(),
            p.bootstrap_port,
            p.bootstrap_host.clone(),
        );
        crate::health::spawn(
            pool.clone(),
            up.clone(),
            cfg.health.clone(),
            cfg.bootstrap.clone(),
            Role::Prefill,
            id,
            url.clone(),
        );
        spawn_load_poller(&cfg, &pool, &up, Role::Prefill, id, url);
    }
    for d in &cfg.decode {
        let url = parse_base_url(&d.url)
            .map_err(|e| ConfigError::Invalid(format!("decode url {}: {e}", d.url)))?;
        let id = pool.add_worker(Role::Decode, url.clone(), None);
        crate::health::spawn(
            pool.clone(),
            up.clone(),
            cfg.health.clone(),
            cfg.bootstrap.clone(),
            Role::Decode,
            id,
            url.clone(),
        );
        spawn_load_poller(&cfg, &pool, &up, Role::Decode, id, url);
    }
    let listener = match listener {
        Some(l) => l,
        None => {
            let addr = std::net::SocketAddr::new(cfg.server.host, cfg.server.port);
            bind(addr, cfg.server.listen_backlog).map_err(|source| StartError::Bind {
                addr: addr.to_string(),
                source,
            })?
        }
    };
    let drain = std::time::Duration::from_secs(cfg.server.drain_secs);
    let dispatcher = Dispatcher::new(pool.clone(), up, cfg, rng);
    let server = Server::start(listener, dispatcher, drain).map_err(|source| StartError::Bind {
        addr: "listener".into(),
        source,
    })?;
    tracing::info!(url = %server.url(), "pdgate listening");
    Ok(Router { server, pool })
}
