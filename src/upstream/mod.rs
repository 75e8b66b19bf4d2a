//! The HTTP clients pdgate uses towards engines and bootstrap servers.
//!
//! - Legs (the request path) go through [`leg`]: a lean HTTP/1.1 client whose connections
//!   belong to each worker ([`HostConns`]) and are driven by the request's own future.
//! - Background calls (server info, bootstrap polls, health, `/abort_request`) go through
//!   one pooled hyper client (HTTP/1.1, TCP_NODELAY, connect timeout, keep-alive), via
//!   [`Upstream::get`] / [`Upstream::call`], each with its own timeout.
//!
//! - Errors are typed and keep their cause ([`LegError`], [`ProtocolError`], [`CallError`],
//!   [`UrlError`]); a leg's error says whether the engine may have read the request
//!   ([`LegError::engine_may_have_read`]).
//!
//! [`Upstream`] is a cheap handle (one `Arc`): legs keep a clone to send their abort.

mod conns;
mod error;
mod leg;
mod leg_body;
mod payload;

pub use crate::url::{parse_base_url, BaseUrl, UrlError};
pub use conns::{HostConns, LegSettings};
pub use error::{error_chain, snippet, CallError, LegError, ProtocolError, BODY_SNIPPET};
pub use leg::{header_lines, LegRequest};
pub use leg_body::LegBody;
pub use payload::Payload;

use std::sync::Arc;

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioTimer};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Largest body a background call reads (server info, routes, health).
const SMALL_BODY_LIMIT: usize = 4 * 1024 * 1024;

/// `POST /abort_request` calls in flight at once; past it an abort is dropped and counted
/// (`pdgate_leg_aborts_dropped_total`): the leg's connection is closed anyway, so the
/// engine still sees the client gone, and a storm of cancellations cannot pile up tasks.
pub const MAX_ABORTS_IN_FLIGHT: usize = 256;

/// Shared clients plus the settings legs need.
#[derive(Clone)]
pub struct Upstream(Arc<UpstreamInner>);

pub struct UpstreamInner {
    pub client: HttpClient,
    /// `POST /abort_request` calls in flight, bounded by [`MAX_ABORTS_IN_FLIGHT`].
    aborts: Arc<tokio::sync::Semaphore>,
    pub auth: Option<http::HeaderValue>,
    pub forward_authorization: bool,
    pub legs: LegSettings,
}

impl std::ops::Deref for Upstream {
    type Target = UpstreamInner;
    fn deref(&self) -> &UpstreamInner {
        &self.0
    }
}

/// What the clients are built from (plain values; the router derives them from its
/// `[upstream]` and `[timeouts]` settings).
#[derive(Clone, Debug)]
pub struct UpstreamSettings {
    pub connect_timeout: Duration,
    pub pool_max_idle_per_host: usize,
    pub pool_idle_timeout: Duration,
    /// Sent to engines as `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Forward the client's `Authorization` header on legs (when no `api_key`).
    pub forward_authorization: bool,
}

impl Upstream {
    pub fn new(cfg: &UpstreamSettings) -> Upstream {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(cfg.connect_timeout));
        conn.set_keepalive(Some(Duration::from_secs(30)));
        conn.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(cfg.pool_idle_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle_per_host)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(conn);
        let auth = cfg
            .api_key
            .as_ref()
            .and_then(|k| http::HeaderValue::try_from(format!("Bearer {k}")).ok());
        Upstream(Arc::new(UpstreamInner {
            client,
            aborts: Arc::new(tokio::sync::Semaphore::new(MAX_ABORTS_IN_FLIGHT)),
            auth,
            forward_authorization: cfg.forward_authorization,
            legs: LegSettings {
                connect_timeout: cfg.connect_timeout,
                max_idle: cfg.pool_max_idle_per_host,
                idle_timeout: cfg.pool_idle_timeout,
            },
        }))
    }

    /// The same clients with other leg settings (a short idle timeout in a test, say).
    pub fn with_leg_settings(&self, legs: LegSettings) -> Upstream {
        Upstream(Arc::new(UpstreamInner {
            client: self.client.clone(),
            aborts: self.aborts.clone(),
            auth: self.auth.clone(),
            forward_authorization: self.forward_authorization,
            legs,
        }))
    }

    /// Sends a leg to `host` and returns the answer's head; its body streams from the
    /// socket as it is polled.
    pub async fn send_leg(
        &self,
        host: &Arc<HostConns>,
        req: &LegRequest,
    ) -> Result<http::Response<LegBody>, LegError> {
        leg::send(host, &self.legs, req).await
    }

    /// A small request with a whole-call timeout; returns status and (bounded) body.
    pub async fn call(
        &self,
        method: Method,
        uri: Uri,
        body: Option<Bytes>,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let mut b = Request::builder().method(method).uri(uri);
        if body.is_some() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(a) = &self.auth {
            b = b.header(header::AUTHORIZATION, a.clone());
        }
        let req = b
            .body(Full::new(body.unwrap_or_default()))
            .map_err(CallError::Url)?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(CallError::Transport)?;
            let status = resp.status();
            let bytes = Limited::new(resp.into_body(), SMALL_BODY_LIMIT)
                .collect()
                .await
                .map_err(CallError::Body)?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| CallError::Timeout(timeout))?
    }

    pub async fn get(
        &self,
        base: &BaseUrl,
        path: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let uri = base.uri(path).map_err(CallError::Url)?;
        self.call(Method::GET, uri, None, timeout).await
    }

    /// Fire-and-forget `POST /abort_request {"rid": rid}`: best effort, never awaited by
    /// the request path, at most [`MAX_ABORTS_IN_FLIGHT`] at once.
    pub fn abort(&self, base: &BaseUrl, rid: &str) {
        let Ok(uri) = base.uri("/abort_request") else {
            return;
        };
        let Ok(permit) = self.aborts.clone().try_acquire_owned() else {
            metrics::counter!(crate::telemetry::LEG_ABORTS_DROPPED).increment(1);
            return;
        };
        let body = serde_json::json!({ "rid": rid, "abort_all": false }).to_string();
        let this = self.clone();
        let rid = rid.to_string();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _permit = permit;
                let r = this
                    .call(
                        Method::POST,
                        uri,
                        Some(Bytes::from(body)),
                        Duration::from_secs(2),
                    )
                    .await;
                metrics::counter!(crate::telemetry::LEG_ABORTS).increment(1);
                if let Err(e) = r {
                    tracing::debug!(rid, error = %e, "abort_request failed");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        type Want = Result<(&'static str, &'static str, u16), fn(&UrlError) -> bool>;
        let cases: [(&str, Want); 14] = [
            // One engine, one spelling: case, default port, trailing dot, IPv6 forms.
            (
                "http://Engine.NS.:80",
                Ok(("http://engine.ns:80", "engine.ns", 80)),
            ),
            ("http://HOST", Ok(("http://host:80", "host", 80))),
            (
                "http://[0:0::1]:8000",
                Ok(("http://[::1]:8000", "::1", 8000)),
            ),
            (
                "http://[FE80::1]:1",
                Ok(("http://[fe80::1]:1", "fe80::1", 1)),
            ),
            (
                "http://10.0.0.1:30000",
                Ok(("http://10.0.0.1:30000", "10.0.0.1", 30000)),
            ),
            ("http://host:1/", Ok(("http://host:1", "host", 1))),
            ("http://[::1]:8000", Ok(("http://[::1]:8000", "::1", 8000))),
            ("http://h", Ok(("http://h:80", "h", 80))),
            (
                "https://h:1",
                Err(|e| matches!(e, UrlError::Scheme(s) if s == "https")),
            ),
            ("h:1", Err(|e| matches!(e, UrlError::MissingScheme))),
            ("/v1", Err(|e| matches!(e, UrlError::MissingScheme))),
            ("http://h:1/v1", Err(|e| matches!(e, UrlError::PathOrQuery))),
            (
                "http://h:1?a=1",
                Err(|e| matches!(e, UrlError::PathOrQuery)),
            ),
            ("not a url", Err(|e| matches!(e, UrlError::NotAUrl(_)))),
        ];
        for (input, want) in cases {
            let got = parse_base_url(input);
            match (got, want) {
                (Ok(b), Ok((base, host, port))) => {
                    assert_eq!(
                        (b.as_str(), b.host(), b.port()),
                        (base, host, port),
                        "{input}"
                    )
                }
                (Err(e), Err(check)) => assert!(check(&e), "{input}: {e:?}"),
                (g, w) => panic!("{input}: got {g:?}, want {:?}", w.ok()),
            }
        }
        let e = parse_base_url("not a url").unwrap_err();
        assert!(
            std::error::Error::source(&e).is_some(),
            "keeps the URI error"
        );
        assert!(e.to_string().starts_with("not a URL ("), "{e}");
        let b = parse_base_url("http://[::1]:8000").unwrap().with_port(8998);
        assert_eq!(b.as_str(), "http://[::1]:8998");
    }
}
