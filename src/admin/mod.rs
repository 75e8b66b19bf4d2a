//! The admin listener: a second HTTP listener, apart from the front door, for operators and
//! Prometheus (`[admin]`, `--admin-host`, `--admin-port`; 127.0.0.1:29000 by default).
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/metrics` | Prometheus text; **no token needed** |
//! | GET | `/readiness` | ready or not, routable ranks, and every worker (the front door's `/readiness` has counts only) |
//! | GET | `/workers` | every worker: source, health, breaker, DP ranks with bootstrap state, in flight |
//! | POST | `/workers` | add one: `{"role": "prefill"\|"decode", "url", "bootstrap_port"?, "bootstrap_host"?}` → 201 |
//! | GET | `/workers/{id}` | one worker |
//! | POST | `/workers/{id}/drain` | out of rotation; requests in flight finish |
//! | POST | `/workers/{id}/undrain` | back in rotation (when healthy) |
//! | DELETE | `/workers/{id}` | drain, then remove when idle (or after `admin.remove_drain_secs`) → 202; `?wait=true` answers when it is gone |
//! | GET | `/config` | the effective config, secrets redacted |
//! | POST | `/add_worker?url=&worker_type=&bootstrap_port=` | SGLang router's call |
//! | POST | `/remove_worker?url=` | SGLang router's call (drains, then removes) |
//! | GET | `/list_workers` | SGLang router's call: `{"urls": [...]}` |
//!
//! Requests a browser sends (an `Origin` or `Sec-Fetch-*` header, a `Host` that is not an IP,
//! `localhost` or an `admin.allowed_hosts` name, a non-JSON mutation) are refused first
//! ([`guard`]). Worker ids are `prefill-<n>` / `decode-<n>` ([`view`]). Auth: a bearer token
//! ([`token`]) on every path but `/metrics`, checked by a tower layer
//! (`tower_http::validate_request`) in front of the API service.
//!
//! Invariants: the listener keeps its socket for its whole life; at most
//! [`MAX_CONNECTIONS`] connections are served at once (more are closed at once); a request
//! head must arrive within [`HEADER_WITHIN`]; on shutdown no connection is accepted and
//! open ones finish their request and close.

mod api;
pub(crate) use api::query;
pub mod front;
pub mod guard;
pub mod token;
pub mod view;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceBuilder;
use tower_http::validate_request::ValidateRequestHeaderLayer;

use crate::config::Config;
use crate::fleet::Fleet;

pub use front::FrontControl;
pub use token::AdminToken;

/// Connections the admin listener serves at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has for a request head.
pub const HEADER_WITHIN: Duration = Duration::from_secs(10);

/// A running admin listener.
pub struct AdminServer {
    addr: SocketAddr,
    token: Arc<AdminToken>,
    stop: watch::Sender<bool>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl AdminServer {
    /// Serves the admin API of `fleet` on `listener`, guarded by `token`.
    pub fn start(
        listener: TcpListener,
        fleet: Arc<Fleet>,
        token: AdminToken,
    ) -> std::io::Result<AdminServer> {
        let addr = listener.local_addr()?;
        let token = Arc::new(token);
        let (stop, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, fleet, token.clone(), rx));
        tracing::info!(
            url = %format!("http://{addr}"),
            token_required = token.required(),
            "admin API listening"
        );
        Ok(AdminServer {
            addr,
            token,
            stop,
            task: std::sync::Mutex::new(Some(task)),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The token this listener checks (the front door's control routes check the same).
    pub fn token(&self) -> Arc<AdminToken> {
        self.token.clone()
    }

    /// Takes the admin token of a changed config (refused, keeping the token in use, when
    /// it would leave a non-loopback listener without one).
    pub fn reload(&self, cfg: &Config) -> Result<(), String> {
        self.token.reload(cfg)
    }

    /// Reads and checks the admin token of a changed config without using it yet.
    pub fn stage_token(&self, cfg: &Config) -> Result<token::StagedToken, String> {
        self.token.stage(cfg)
    }

    /// Puts a staged admin token in use.
    pub fn install_token(&self, staged: token::StagedToken) {
        self.token.install(staged);
    }

    /// Stops accepting; open connections finish their request. A second call returns at
    /// once.
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    fleet: Arc<Fleet>,
    token: Arc<AdminToken>,
    stop: watch::Receiver<bool>,
) {
    let live = fleet.live().clone();
    let api = Arc::new(api::Api { fleet });
    // The tower stack: refuse what a browser sends, then the token check, then the API.
    let stack = ServiceBuilder::new()
        .layer(ValidateRequestHeaderLayer::custom(guard::BrowserGuard(
            live,
        )))
        .layer(ValidateRequestHeaderLayer::custom(token::RequireToken(
            token,
        )))
        .service(tower::service_fn(move |req| api::serve(api.clone(), req)));
    let limits = crate::listen::Limits {
        name: "admin",
        max_connections: MAX_CONNECTIONS,
        header_within: HEADER_WITHIN,
    };
    crate::listen::serve(listener, limits, stack, stop).await;
}
