//! The admin listener's bearer token: where it comes from, when it is required, and the
//! tower layer that checks it.
//!
//! Invariants:
//! - The token comes from exactly one place: `admin.api_key`, the first line of
//!   `admin.api_key_file`, or the `PDGATE_ADMIN_API_KEY` environment variable. Setting two
//!   of them is refused, naming both (which one wins would be a guess, and an operator who
//!   rotates one would find the other still in use).
//! - A listener on a non-loopback address never runs without a token: start and reload
//!   both refuse it, naming the keys to set.
//! - The presented token is compared in constant time: both sides are hashed (so the
//!   comparison does not depend on the token's length either) and the digests compared
//!   with `subtle`.
//! - `/metrics` needs no token (Prometheus scrapes it); every other path does, unknown
//!   paths included (so nothing about the API is told to a caller without the token).
//!   Without a token (loopback only) every path is open to local processes.

use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use http::{header, Request, Response};
use subtle::ConstantTimeEq;
use tower_http::validate_request::ValidateRequest;

use crate::auth::{bearer, digest, KeyDigest};
use crate::body::RespBody;
use crate::config::{AdminConfig, Config};
use crate::error::{FailReason, Failure};

/// The environment variable the admin token may come from.
pub const TOKEN_ENV: &str = "PDGATE_ADMIN_API_KEY";

/// The admin paths served without the token: the scrape, and the liveness probe (a kubelet
/// holds no token; the answer says only that the process serves).
pub const OPEN_PATHS: &[&str] = &["/metrics", "/liveness"];

/// A token read and checked by [`AdminToken::stage`], not yet in use.
pub struct StagedToken(Option<Arc<KeyDigest>>);

/// The admin token of one listener (none: open, loopback only).
pub struct AdminToken {
    digest: ArcSwapOption<KeyDigest>,
    ip: IpAddr,
}

/// The token `cfg` names, read from its file or `env` as the case may be.
pub fn resolve(
    cfg: &AdminConfig,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, String> {
    let from_env = env(TOKEN_ENV)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());
    let key = match (&cfg.api_key, &cfg.api_key_file) {
        (Some(_), _) => Some("admin.api_key (or --api-key)"),
        (None, Some(_)) => Some("admin.api_key_file (--admin-api-key-file)"),
        (None, None) => None,
    };
    if let (Some(key), Some(_)) = (key, &from_env) {
        return Err(format!(
            "two admin tokens: {key} and the {TOKEN_ENV} environment variable are both set; \
             keep one (unset {TOKEN_ENV}, or drop {key})"
        ));
    }
    match (&cfg.api_key, &cfg.api_key_file) {
        (Some(_), Some(_)) => {
            Err("admin.api_key and admin.api_key_file are both set: keep one".to_string())
        }
        (Some(k), None) => Ok(Some(k.trim().to_string())),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read admin.api_key_file {}: {e}", path.display()))?;
            let line = text.lines().map(str::trim).find(|l| !l.is_empty());
            match line {
                Some(l) => Ok(Some(l.to_string())),
                None => Err(format!("admin.api_key_file {} is empty", path.display())),
            }
        }
        (None, None) => Ok(from_env),
    }
}

/// Whether a listener on `ip` may run with (or without) a token.
pub fn check_exposure(ip: IpAddr, has_token: bool) -> Result<(), String> {
    if has_token || ip.to_canonical().is_loopback() {
        return Ok(());
    }
    Err(format!(
        "the admin listener on {ip} is reachable from other hosts and has no token: set \
         admin.api_key, admin.api_key_file (--admin-api-key-file) or the {TOKEN_ENV} \
         environment variable, or listen on 127.0.0.1 (admin.host, --admin-host)"
    ))
}

fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl AdminToken {
    /// The token for a listener on `ip`, from `cfg` (and the process environment).
    pub fn from_config(cfg: &Config, ip: IpAddr) -> Result<AdminToken, String> {
        Self::from_config_with(cfg, ip, process_env)
    }

    /// Like [`AdminToken::from_config`], reading the environment through `env`.
    pub fn from_config_with(
        cfg: &Config,
        ip: IpAddr,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<AdminToken, String> {
        let t = AdminToken {
            digest: ArcSwapOption::empty(),
            ip,
        };
        t.reload_with(cfg, env)?;
        Ok(t)
    }

    /// Takes the token of a changed config; on an error the token in use stays.
    pub fn reload(&self, cfg: &Config) -> Result<(), String> {
        self.reload_with(cfg, process_env)
    }

    /// Reads and checks the token of a changed config without using it yet.
    pub fn stage(&self, cfg: &Config) -> Result<StagedToken, String> {
        self.stage_with(cfg, process_env)
    }

    /// Puts a staged token in use.
    pub fn install(&self, staged: StagedToken) {
        self.digest.store(staged.0);
    }

    fn stage_with(
        &self,
        cfg: &Config,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<StagedToken, String> {
        let token = resolve(&cfg.admin, env)?;
        check_exposure(self.ip, token.is_some())?;
        Ok(StagedToken(token.map(|t| Arc::new(digest(t.as_bytes())))))
    }

    fn reload_with(
        &self,
        cfg: &Config,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(), String> {
        let staged = self.stage_with(cfg, env)?;
        self.install(staged);
        Ok(())
    }

    pub fn required(&self) -> bool {
        self.digest.load().is_some()
    }

    /// Whether a request with these headers may use `path`.
    pub fn allows(&self, path: &str, headers: &http::HeaderMap) -> bool {
        if OPEN_PATHS.contains(&path) {
            return true;
        }
        let want = self.digest.load();
        let Some(want) = want.as_ref() else {
            return true;
        };
        let Some(got) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| bearer(v.as_bytes()))
        else {
            return false;
        };
        digest(got)[..].ct_eq(&want[..]).into()
    }
}

/// The tower layer's check: 401 (with `WWW-Authenticate: Bearer`) unless
/// [`AdminToken::allows`].
#[derive(Clone)]
pub struct RequireToken(pub Arc<AdminToken>);

impl<B> ValidateRequest<B> for RequireToken {
    type ResponseBody = RespBody;

    fn validate(&mut self, req: &mut Request<B>) -> Result<(), Response<RespBody>> {
        if self.0.allows(req.uri().path(), req.headers()) {
            return Ok(());
        }
        Err(Failure::new(
            FailReason::Unauthorized,
            "the admin API needs `Authorization: Bearer <admin token>`",
        )
        .into_response(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue};

    fn cfg(key: Option<&str>, file: Option<&std::path::Path>) -> Config {
        let mut c = Config::default();
        c.admin.api_key = key.map(str::to_string);
        c.admin.api_key_file = file.map(|p| p.to_path_buf());
        c
    }

    #[test]
    fn where_the_token_comes_from() {
        let dir = std::env::temp_dir().join(format!("pdgate-admin-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "\n  from-file  \nsecond line\n").unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n \n").unwrap();
        let env = |n: &str| (n == TOKEN_ENV).then(|| " from-env ".to_string());
        let no_env = |_: &str| None;
        let a = cfg(Some("from-config"), None);
        assert_eq!(
            resolve(&a.admin, no_env).unwrap().as_deref(),
            Some("from-config")
        );
        let b = cfg(None, Some(&f));
        assert_eq!(
            resolve(&b.admin, no_env).unwrap().as_deref(),
            Some("from-file")
        );
        // A config token and the environment's: refused, naming both and what to do.
        for two in [&a, &b] {
            let e = resolve(&two.admin, env).unwrap_err();
            assert!(e.contains(TOKEN_ENV) && e.contains("keep one"), "{e}");
        }
        let e = resolve(&b.admin, env).unwrap_err();
        assert!(e.contains("admin.api_key_file"), "{e}");
        let c = cfg(None, None);
        assert_eq!(resolve(&c.admin, env).unwrap().as_deref(), Some("from-env"));
        assert_eq!(resolve(&c.admin, no_env).unwrap(), None);
        let both = cfg(Some("k"), Some(&f));
        assert!(resolve(&both.admin, env).unwrap_err().contains("both set"));
        let e = cfg(None, Some(&empty));
        assert!(resolve(&e.admin, no_env).unwrap_err().contains("empty"));
    }

    #[test]
    fn only_loopback_runs_without_a_token() {
        let table: [(&str, bool, bool); 6] = [
            ("127.0.0.1", false, true),
            ("::1", false, true),
            ("::ffff:127.0.0.1", false, true),
            ("0.0.0.0", false, false),
            ("10.1.2.3", false, false),
            ("0.0.0.0", true, true),
        ];
        for (ip, token, ok) in table {
            let r = check_exposure(ip.parse().unwrap(), token);
            assert_eq!(r.is_ok(), ok, "{ip} token={token}: {r:?}");
            if let Err(e) = r {
                for key in [
                    "admin.api_key",
                    "admin.api_key_file",
                    TOKEN_ENV,
                    "admin.host",
                ] {
                    assert!(e.contains(key), "{e}");
                }
            }
        }
        let exposed = cfg(None, None);
        let err = AdminToken::from_config_with(&exposed, "0.0.0.0".parse().unwrap(), |_| None);
        assert!(err.is_err());
    }

    #[test]
    fn the_check() {
        let t = AdminToken::from_config_with(
            &cfg(Some("s3cret"), None),
            "0.0.0.0".parse().unwrap(),
            |_| None,
        )
        .unwrap();
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert!(t.required());
        assert!(t.allows("/metrics", &HeaderMap::new()));
        assert!(!t.allows("/workers", &HeaderMap::new()));
        assert!(!t.allows("/workers", &with("Bearer s3cre")));
        assert!(!t.allows("/workers", &with("Bearer s3cret2")));
        assert!(!t.allows("/workers", &with("Basic s3cret")));
        assert!(t.allows("/workers", &with("Bearer s3cret")));
        assert!(t.allows("/nope", &with("bearer s3cret")));
        // A reload that drops the token on a non-loopback listener is refused.
        assert!(t.reload_with(&cfg(None, None), |_| None).is_err());
        assert!(t.required());
        let open =
            AdminToken::from_config_with(&cfg(None, None), "127.0.0.1".parse().unwrap(), |_| None)
                .unwrap();
        assert!(!open.required());
        assert!(open.allows("/workers", &HeaderMap::new()));
    }
}
