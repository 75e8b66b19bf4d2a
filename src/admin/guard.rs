//! What a browser can send never reaches the admin API.
//!
//! A web page the operator opens can make the browser send requests to the admin listener
//! (on loopback, or through DNS rebinding a name it controls to 127.0.0.1). Without this
//! guard such a page could, for instance, `POST /add_worker?url=` a decode of its own that
//! would then receive every prompt. Browsers mark what they send; tools (curl, Prometheus,
//! SGLang's router scripts, kubelet probes) do not. So the guard refuses, on every path:
//! - a request with an `Origin` header or any `Sec-Fetch-*` header (403): browsers send
//!   `Origin` on every cross-origin request and on every POST, and `Sec-Fetch-*` on all;
//! - a `Host` that is not an IP literal, `localhost`, or a name in `admin.allowed_hosts`
//!   (403): a rebinding page's requests carry its own domain as Host;
//! - a mutation (POST, PUT, PATCH, DELETE) whose body or `Content-Type` is not JSON (415):
//!   a form can post `text/plain` or form data without a CORS preflight, never JSON.
//!   SGLang's query-string calls (`POST /add_worker?url=…`, `POST /remove_worker?url=…`)
//!   are exempt from this rule (SGLang's scripts send them with no content type), not from
//!   the other two.
//!
//! It runs before the token check, so a browser learns nothing, not even whether a token is
//! needed.

use http::{header, HeaderMap, Method, Request, Response};
use tower_http::validate_request::ValidateRequest;

use crate::body::RespBody;
use crate::config::LiveConfig;
use crate::error::{FailReason, Failure};

/// The tower layer's check (see the module docs).
#[derive(Clone)]
pub struct BrowserGuard(pub LiveConfig);

impl<B> ValidateRequest<B> for BrowserGuard {
    type ResponseBody = RespBody;

    fn validate(&mut self, req: &mut Request<B>) -> Result<(), Response<RespBody>> {
        let cfg = self.0.load();
        match check(
            req.method(),
            req.uri().path(),
            req.headers(),
            &cfg.admin.allowed_hosts,
        ) {
            Ok(()) => Ok(()),
            Err(f) => {
                tracing::warn!(
                    method = %req.method(),
                    path = req.uri().path(),
                    reason = f.reason.as_str(),
                    error = %f.message,
                    "admin request refused"
                );
                Err(f.into_response(None))
            }
        }
    }
}

/// The guard's rules over a request's method, path and headers.
pub fn check(
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    allowed_hosts: &[String],
) -> Result<(), Failure> {
    if headers.contains_key(header::ORIGIN)
        || headers.keys().any(|k| k.as_str().starts_with("sec-fetch-"))
    {
        return Err(Failure::new(
            FailReason::Forbidden,
            "the admin API does not serve browsers (the request has an Origin or Sec-Fetch header)",
        ));
    }
    if let Some(host) = headers.get(header::HOST) {
        let ok = host.to_str().is_ok_and(|h| host_allowed(h, allowed_hosts));
        if !ok {
            return Err(Failure::new(
                FailReason::Forbidden,
                "the admin API answers only to an IP address, localhost, or a name in \
                 admin.allowed_hosts as Host",
            ));
        }
    }
    let mutation = matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    let exempt = matches!(path, "/add_worker" | "/remove_worker");
    if mutation && !exempt && (has_body(headers) || headers.contains_key(header::CONTENT_TYPE)) {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json);
        if !json {
            return Err(Failure::new(
                FailReason::UnsupportedMediaType,
                "admin API changes take a JSON body with `Content-Type: application/json` \
                 (or no body at all)",
            ));
        }
    }
    Ok(())
}

fn has_body(headers: &HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
}

fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

/// Whether a `Host` value names this listener the way a tool does: an IP literal (with
/// or without a port; IPv6 in brackets), `localhost`, or an allowed name.
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6] or [v6]:port
        match rest.split_once(']') {
            Some((v6, tail)) if tail.is_empty() || valid_port(tail) => {
                return v6.parse::<std::net::Ipv6Addr>().is_ok();
            }
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if valid_port(port) => name,
            Some(_) => return false,
            None => host,
        }
    };
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(name))
}

fn valid_port(tail: &str) -> bool {
    tail.strip_prefix(':')
        .unwrap_or(tail)
        .parse::<u16>()
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn hosts() {
        let allowed = vec!["pdgate-admin.ops.svc".to_string()];
        let table = [
            ("127.0.0.1:29000", true),
            ("127.0.0.1", true),
            ("10.1.2.3:29000", true),
            ("[::1]:29000", true),
            ("[::1]", true),
            ("localhost:29000", true),
            ("LOCALHOST", true),
            ("pdgate-admin.ops.svc:29000", true),
            ("evil.example:29000", false),
            ("rebind.127.0.0.1.nip.io", false),
            ("127.0.0.1.evil.example", false),
            ("[::1", false),
            ("[::1]x", false),
            ("[evil]:80", false),
            ("127.0.0.1:notaport", false),
            ("127.0.0.1:70000", false),
            ("", false),
        ];
        for (host, ok) in table {
            assert_eq!(host_allowed(host, &allowed), ok, "{host}");
        }
    }

    /// (method, path, headers, the refusal's reason)
    type Case = (
        Method,
        &'static str,
        Vec<(&'static str, &'static str)>,
        Option<FailReason>,
    );

    #[test]
    fn what_is_refused_and_with_what() {
        use FailReason::{Forbidden, UnsupportedMediaType};
        let host = ("host", "127.0.0.1:29000");
        let json = ("content-type", "application/json; charset=utf-8");
        let len = ("content-length", "20");
        let table: Vec<Case> = vec![
            (Method::GET, "/workers", vec![host], None),
            (Method::GET, "/metrics", vec![host], None),
            (Method::GET, "/workers", vec![], None),
            (
                Method::GET,
                "/workers",
                vec![host, ("origin", "https://evil.example")],
                Some(Forbidden),
            ),
            (
                Method::GET,
                "/metrics",
                vec![host, ("origin", "null")],
                Some(Forbidden),
            ),
            (
                Method::GET,
                "/workers",
                vec![host, ("sec-fetch-mode", "no-cors")],
                Some(Forbidden),
            ),
            (
                Method::GET,
                "/workers",
                vec![("host", "evil.example")],
                Some(Forbidden),
            ),
            (Method::POST, "/workers", vec![host, json, len], None),
            (
                Method::POST,
                "/workers",
                vec![host, ("content-type", "text/plain"), len],
                Some(UnsupportedMediaType),
            ),
            (
                Method::POST,
                "/workers",
                vec![host, len],
                Some(UnsupportedMediaType),
            ),
            (
                Method::POST,
                "/workers",
                vec![host, ("transfer-encoding", "chunked")],
                Some(UnsupportedMediaType),
            ),
            (Method::POST, "/workers/prefill-1/drain", vec![host], None),
            (
                Method::POST,
                "/workers/prefill-1/drain",
                vec![host, ("content-length", "0")],
                None,
            ),
            (
                Method::POST,
                "/workers/prefill-1/drain",
                vec![host, ("content-type", "application/x-www-form-urlencoded")],
                Some(UnsupportedMediaType),
            ),
            (Method::DELETE, "/workers/decode-1", vec![host], None),
            (
                Method::POST,
                "/add_worker",
                vec![
                    host,
                    ("content-type", "application/x-www-form-urlencoded"),
                    len,
                ],
                None,
            ),
            (Method::POST, "/remove_worker", vec![host], None),
            (
                Method::POST,
                "/add_worker",
                vec![host, ("origin", "https://evil.example")],
                Some(Forbidden),
            ),
            (
                Method::POST,
                "/add_worker",
                vec![("host", "evil.example")],
                Some(Forbidden),
            ),
        ];
        for (method, path, hs, want) in table {
            let got = check(&method, path, &headers(&hs), &[])
                .err()
                .map(|f| f.reason);
            assert_eq!(got, want, "{method} {path} {hs:?}");
        }
    }
}
