//! Assembling a running router from a validated [`Config`]: the pool, one bootstrap
//! tracker per prefill, one health checker (and, when enabled, one load poller) per
//! worker, the client keys, Kubernetes discovery when `[discovery]` is enabled, the front door and, when asked for, the admin listener.
//!
//! The admin listener is opt-in for callers of the library: [`start`] never opens it (the
//! tests and benches start many routers with the default config, whose admin port is the
//! fixed 29000), [`start_with`] takes an [`AdminListener`]; `pdgate serve` passes
//! [`AdminListener::FromConfig`], so the binary serves it by default (`admin.enabled`).

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::admin::{AdminServer, AdminToken};
use crate::auth::ClientKeys;
use crate::config::{Config, ConfigError};
use crate::dispatch::{Dispatcher, RngSource};
use crate::fleet::{Fleet, WorkerSpec};
use crate::pool::{Pool, WorkerSource};
use crate::server::Server;
use crate::types::Role;
use crate::upstream::{parse_base_url, Upstream, UpstreamSettings};

/// A router serving on its listener.
pub struct Router {
    pub server: Server,
    pub pool: Arc<Pool>,
    /// Adds, drains and removes workers while the router runs.
    pub fleet: Arc<Fleet>,
    /// The front door's client API keys; `keys.reload(&cfg)` takes a changed keys file.
    pub keys: Arc<ClientKeys>,
    /// The admin listener, when one was asked for; `admin.reload(&cfg)` takes a changed
    /// admin token.
    pub admin: Option<AdminServer>,
    /// Kubernetes discovery, when enabled (stops when the router is dropped).
    pub discovery: Option<crate::discovery::Discovery>,
    /// The replica count from Kubernetes, when `admission.replica_selector` is set (stops
    /// when the router is dropped).
    pub replica_watch: Option<crate::discovery::replicas::ReplicaWatch>,
    /// The OTLP trace exporter, when `[trace]` is on (flushed by [`Router::shutdown`]).
    pub traces: Option<crate::trace::Exporter>,
}

impl Router {
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The admin listener's URL, when it runs.
    pub fn admin_url(&self) -> Option<String> {
        self.admin.as_ref().map(AdminServer::url)
    }

    /// Drains the front door (up to `server.drain_secs`), then closes the admin listener
    /// (kept open meanwhile, so that `/metrics` shows the drain), then sends the spans
    /// still queued (bounded by `trace.export_timeout_ms`).
    pub async fn shutdown(&self) {
        self.server.shutdown().await;
        if let Some(a) = &self.admin {
            a.shutdown().await;
        }
        if let Some(t) = &self.traces {
            t.shutdown().await;
        }
    }
}

/// Whether (and where) [`start_with`] opens the admin listener.
pub enum AdminListener {
    /// No admin listener.
    Off,
    /// `admin.host:admin.port` when `admin.enabled` (what `pdgate serve` does).
    FromConfig,
    /// This already-bound socket (tests bind 127.0.0.1 port 0), whatever `admin.enabled`.
    Bound(TcpListener),
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Fleet(#[from] crate::fleet::FleetError),
    #[error("service discovery: {0}")]
    Discovery(#[from] crate::discovery::DiscoveryError),
    #[error("cannot listen on {addr} for the {listener}: {source}")]
    Bind {
        /// Which listener, and the settings that place it.
        listener: &'static str,
        addr: String,
        source: std::io::Error,
    },
    /// The admin token could not be read, or is missing on a non-loopback listener.
    #[error("admin listener: {0}")]
    Admin(String),
    /// The client keys file could not be read or parsed.
    #[error("client API keys: {0}")]
    Auth(String),
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

/// The listeners a bind error names, with the settings that place them.
const FRONT_DOOR: &str = "front door (server.host, server.port; --host, --port)";
const ADMIN_LISTENER: &str = "admin listener (admin.host, admin.port; --admin-host, --admin-port)";

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

/// Starts a router without an admin listener. `listener`: an already-bound socket (tests
/// bind port 0), else `server.host:server.port` is bound.
pub async fn start(
    cfg: Config,
    listener: Option<TcpListener>,
    rng: RngSource,
) -> Result<Router, StartError> {
    start_with(cfg, listener, AdminListener::Off, rng).await
}

/// The Kubernetes API a router talks to (discovery, the replica count) and its own pod's
/// name. [`start_with`] takes both from the environment when it needs them
/// (`discovery::infer_config`, `discovery::replicas::own_pod_name`); tests give a client
/// of a fake API server ([`start_in_cluster`]).
pub struct Cluster {
    pub client: kube::Client,
    pub pod_name: Option<String>,
}

/// Starts a router, and its admin listener as `admin` says. Everything that can be refused
/// (config, keys file, admin token) is checked before any socket is bound.
pub async fn start_with(
    cfg: Config,
    listener: Option<TcpListener>,
    admin: AdminListener,
    rng: RngSource,
) -> Result<Router, StartError> {
    start_inner(cfg, listener, admin, rng, None).await
}

/// [`start_with`] with a given Kubernetes client and pod name.
pub async fn start_in_cluster(
    cfg: Config,
    listener: Option<TcpListener>,
    admin: AdminListener,
    rng: RngSource,
    cluster: Cluster,
) -> Result<Router, StartError> {
    start_inner(cfg, listener, admin, rng, Some(cluster)).await
}

async fn start_inner(
    cfg: Config,
    listener: Option<TcpListener>,
    admin: AdminListener,
    rng: RngSource,
    cluster: Option<Cluster>,
) -> Result<Router, StartError> {
    cfg.validate()?;
    // A malformed selector refuses the start before anything runs.
    if cfg.discovery.enabled {
        crate::discovery::plan(&cfg.discovery)?;
    }
    let replica_plan = crate::discovery::replicas::plan(&cfg.admission, &cfg.discovery)?;
    let keys = Arc::new(ClientKeys::from_config(&cfg).map_err(StartError::Auth)?);
    if keys.enabled() && cfg.upstream.forward_authorization {
        tracing::warn!(
            "upstream.forward_authorization is ignored while client API keys are on: a \
             client's Authorization is its pdgate key and is not sent to engines (use \
             upstream.api_key for engines that need one)"
        );
    }
    let admin = match admin {
        AdminListener::Off => None,
        AdminListener::FromConfig if !cfg.admin.enabled => None,
        AdminListener::FromConfig => {
            let addr = std::net::SocketAddr::new(cfg.admin.host, cfg.admin.port);
            let token = AdminToken::from_config(&cfg, addr.ip()).map_err(StartError::Admin)?;
            Some((None, addr, token))
        }
        AdminListener::Bound(l) => {
            let addr = l.local_addr().map_err(|source| StartError::Bind {
                listener: ADMIN_LISTENER,
                addr: "a bound socket".into(),
                source,
            })?;
            let token = AdminToken::from_config(&cfg, addr.ip()).map_err(StartError::Admin)?;
            Some((Some(l), addr, token))
        }
    };
    crate::body::offload_idle_priority(cfg.server.offload_idle_priority);
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
    let up = Upstream::new(&upstream_settings(&cfg));
    let pool = Arc::new(Pool::new());
    let live = crate::config::live(cfg.clone());
    // The scaling signals per model (`pool::signals`): one sampler, off the request path.
    crate::pool::signals::spawn(Arc::downgrade(&pool), live.clone());
    let fleet = Arc::new(Fleet::new(pool.clone(), up.clone(), live));
    for p in &cfg.prefill {
        let url = parse_base_url(&p.url)
            .map_err(|e| ConfigError::Invalid(format!("prefill url {}: {e}", p.url)))?;
        fleet.add(WorkerSpec {
            role: Role::Prefill,
            url,
            bootstrap_port: p.bootstrap_port,
            bootstrap_host: p.bootstrap_host.clone(),
            source: WorkerSource::Static,
            model: p.model.clone(),
        })?;
    }
    for d in &cfg.decode {
        let url = parse_base_url(&d.url)
            .map_err(|e| ConfigError::Invalid(format!("decode url {}: {e}", d.url)))?;
        fleet.add(WorkerSpec::static_plain(Role::Decode, url, d.model.clone()))?;
    }
    for w in &cfg.worker {
        let url = parse_base_url(&w.url)
            .map_err(|e| ConfigError::Invalid(format!("worker url {}: {e}", w.url)))?;
        fleet.add(WorkerSpec::static_plain(
            Role::Regular,
            url,
            w.model.clone(),
        ))?;
    }
    let cluster = match cluster {
        Some(c) => Some(c),
        None if cfg.discovery.enabled || replica_plan.is_some() => Some(Cluster {
            client: crate::discovery::client_from(crate::discovery::infer_config().await?)?,
            pod_name: crate::discovery::replicas::own_pod_name(),
        }),
        None => None,
    };
    let (discovery, replica_watch) = match &cluster {
        None => (None, None),
        Some(c) => {
            let discovery = match cfg.discovery.enabled {
                true => Some(crate::discovery::spawn_with_client(
                    c.client.clone(),
                    &cfg.discovery,
                    fleet.clone(),
                )?),
                false => None,
            };
            let watch = replica_plan.map(|p| {
                crate::discovery::replicas::start(
                    p,
                    c.client.clone(),
                    c.pod_name.clone(),
                    pool.clone(),
                )
            });
            (discovery, watch)
        }
    };
    let cfg = Arc::new(cfg);
    let listener = match listener {
        Some(l) => l,
        None => {
            let addr = std::net::SocketAddr::new(cfg.server.host, cfg.server.port);
            bind(addr, cfg.server.listen_backlog).map_err(|source| StartError::Bind {
                listener: FRONT_DOOR,
                addr: addr.to_string(),
                source,
            })?
        }
    };
    let admin = match admin {
        None => None,
        Some((l, addr, token)) => {
            let l = match l {
                Some(l) => l,
                None => bind(addr, 128).map_err(|source| StartError::Bind {
                    listener: ADMIN_LISTENER,
                    addr: addr.to_string(),
                    source,
                })?,
            };
            Some(
                AdminServer::start(l, fleet.clone(), token).map_err(|source| StartError::Bind {
                    listener: ADMIN_LISTENER,
                    addr: addr.to_string(),
                    source,
                })?,
            )
        }
    };
    let drain = std::time::Duration::from_secs(cfg.server.drain_secs);
    let (tracer, traces) = match cfg.trace.enabled {
        true => {
            let (t, e) = crate::trace::start(&cfg.trace);
            (Some(t), Some(e))
        }
        false => (None, None),
    };
    let dispatcher = Dispatcher::new(pool.clone(), up, cfg, rng).with_tracer(tracer);
    let server = Server::start(listener, dispatcher, keys.clone(), drain).map_err(|source| {
        StartError::Bind {
            listener: FRONT_DOOR,
            addr: "a bound socket".into(),
            source,
        }
    })?;
    // SGLang's router serves its control routes on its main port: so does pdgate, under the
    // admin listener's token (refused where none runs).
    server.serve_control(crate::admin::FrontControl::new(
        fleet.clone(),
        admin.as_ref().map(AdminServer::token),
    ));
    tracing::info!(url = %server.url(), "pdgate listening");
    Ok(Router {
        server,
        pool,
        fleet,
        keys,
        admin,
        discovery,
        replica_watch,
        traces,
    })
}
