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

mod error;
mod leg;
mod leg_body;

pub use error::{error_chain, CallError, LegError, ProtocolError, UrlError};
pub use leg::{header_lines, HostConns, LegRequest, LegSettings};
pub use leg_body::LegBody;

use std::sync::Arc;

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::{TimeoutConfig, UpstreamConfig};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Largest body a background call reads (server info, routes, health).
const SMALL_BODY_LIMIT: usize = 4 * 1024 * 1024;

/// An engine's base URL: `http://host:port`, without a trailing slash. Cheap to clone
/// (one `Arc`): legs keep one for their abort.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseUrl(Arc<UrlParts>);

#[derive(Debug, PartialEq, Eq)]
struct UrlParts {
    base: String,
    host: String,
    port: u16,
}

impl BaseUrl {
    /// `http://host:port`, the host as written (an IPv6 host gets its brackets here).
    fn new(host: &str, port: u16) -> BaseUrl {
        let base = if host.contains(':') {
            format!("http://[{host}]:{port}")
        } else {
            format!("http://{host}:{port}")
        };
        BaseUrl(Arc::new(UrlParts {
            base,
            host: host.to_string(),
            port,
        }))
    }

    pub fn as_str(&self) -> &str {
        &self.0.base
    }
    /// The host as written (IPv6 without brackets).
    pub fn host(&self) -> &str {
        &self.0.host
    }
    pub fn port(&self) -> u16 {
        self.0.port
    }
    /// `base + path` as a URI; `path` starts with `/`.
    pub fn uri(&self, path: &str) -> Result<Uri, http::Error> {
        let mut s = String::with_capacity(self.0.base.len() + path.len());
        s.push_str(&self.0.base);
        s.push_str(path);
        Ok(Uri::try_from(s)?)
    }
    /// `http://host:port` with another port on the same host (the bootstrap server).
    pub fn with_port(&self, port: u16) -> BaseUrl {
        BaseUrl::new(self.host(), port)
    }
}

impl std::fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses `http://host[:port][/]`; only plain http (engines speak cleartext in-cluster).
pub fn parse_base_url(s: &str) -> Result<BaseUrl, UrlError> {
    let uri: Uri = s.trim().parse().map_err(UrlError::NotAUrl)?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => return Err(UrlError::Scheme(other.to_string())),
        None => return Err(UrlError::MissingScheme),
    }
    let auth = uri.authority().ok_or(UrlError::MissingHost)?;
    let path = uri.path();
    if !(path.is_empty() || path == "/") || uri.query().is_some() {
        return Err(UrlError::PathOrQuery);
    }
    let host = auth.host().trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(UrlError::MissingHost);
    }
    Ok(BaseUrl::new(host, auth.port_u16().unwrap_or(80)))
}

/// Shared clients plus the settings legs need.
#[derive(Clone)]
pub struct Upstream(Arc<UpstreamInner>);

pub struct UpstreamInner {
    pub client: HttpClient,
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

impl Upstream {
    pub fn new(cfg: &UpstreamConfig, timeouts: &TimeoutConfig) -> Upstream {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(timeouts.connect()));
        conn.set_keepalive(Some(Duration::from_secs(30)));
        conn.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(cfg.pool_idle_timeout_secs))
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
            auth,
            forward_authorization: cfg.forward_authorization,
            legs: LegSettings {
                connect_timeout: timeouts.connect(),
                max_idle: cfg.pool_max_idle_per_host,
                idle_timeout: Duration::from_secs(cfg.pool_idle_timeout_secs),
            },
        }))
    }

    /// The same clients with other leg settings (a short idle timeout in a test, say).
    pub fn with_leg_settings(&self, legs: LegSettings) -> Upstream {
        Upstream(Arc::new(UpstreamInner {
            client: self.client.clone(),
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
    /// the request path.
    pub fn abort(&self, base: &BaseUrl, rid: &str) {
        let Ok(uri) = base.uri("/abort_request") else {
            return;
        };
        let body = serde_json::json!({ "rid": rid, "abort_all": false }).to_string();
        let this = self.clone();
        let rid = rid.to_string();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let r = this
                    .call(
                        Method::POST,
                        uri,
                        Some(Bytes::from(body)),
                        Duration::from_secs(2),
                    )
                    .await;
                metrics::counter!("pdgate_leg_aborts_total").increment(1);
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
        let cases: [(&str, Want); 10] = [
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
