//! Engine base URLs: `http://host:port`, parsed once and cheap to clone. A leaf: it
//! imports nothing of the crate, so the config (which checks URLs) and the clients (which
//! use them) do not import each other.

use std::sync::Arc;

use http::Uri;

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
    Ok(BaseUrl::new(
        &canonical_host(host),
        auth.port_u16().unwrap_or(80),
    ))
}

/// One spelling per host, so that one engine is one worker however its URL was written:
/// IP addresses in their standard form, names in lower case without a trailing dot
/// (`http://Engine.NS.:80` and `http://engine.ns` are the same worker).
fn canonical_host(host: &str) -> String {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.to_string();
    }
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Why an engine URL was refused (`http://host[:port][/]` only).
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("not a URL ({0})")]
    NotAUrl(#[source] http::uri::InvalidUri),
    #[error("scheme {0} is not supported, use http")]
    Scheme(String),
    #[error("missing http:// scheme")]
    MissingScheme,
    #[error("missing host")]
    MissingHost,
    #[error("a path or query is not supported; give http://host:port")]
    PathOrQuery,
}
