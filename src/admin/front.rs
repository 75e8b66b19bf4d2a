//! The admin API's control routes as the front door serves them (SGLang's router serves
//! `/flush_cache`, `/get_loads` and its worker routes on its main port).
//!
//! Invariants:
//! - A control route on the front door needs the admin token, checked exactly as the admin
//!   listener checks it (the same [`AdminToken`], so a reload changes both), after the
//!   same browser guard ([`super::guard`]). A client API key never grants it.
//! - With no admin token in use (an admin listener on loopback without one, or none at
//!   all), the front door refuses control routes and says where pdgate serves them: an
//!   open front door must not hand out `add_worker` to whoever reaches it.
//! - The worker routes are answered by the admin API itself ([`super::api::Api`]), never a
//!   copy of it.

use std::sync::Arc;

use http::{HeaderMap, Method, Request, Response};

use crate::body::RespBody;
use crate::error::{FailReason, Failure};
use crate::fleet::Fleet;

use super::api::Api;
use super::token::AdminToken;

/// The front door's handle on the admin API.
pub struct FrontControl {
    api: Arc<Api>,
    /// The admin listener's token; `None`: no admin listener runs.
    token: Option<Arc<AdminToken>>,
}

/// Whether a front-door path is one of the admin API's worker routes (SGLang's router
/// serves them on its main port).
pub fn is_worker_route(path: &str) -> bool {
    let p = path.trim_end_matches('/');
    matches!(
        p,
        "/workers" | "/add_worker" | "/remove_worker" | "/list_workers"
    ) || p
        .strip_prefix("/workers/")
        .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'))
        || p.strip_prefix("/workers/").is_some_and(|rest| {
            rest.split_once('/')
                .is_some_and(|(id, tail)| !id.is_empty() && matches!(tail, "drain" | "undrain"))
        })
}

/// The refusal of a control route where no admin listener runs.
pub fn not_here(path: &str) -> Failure {
    Failure::new(
        FailReason::NotFound,
        format!("pdgate serves {path} on its admin listener ([admin], --admin-port), which is off"),
    )
}

impl FrontControl {
    /// Control over `fleet`, guarded by the admin listener's `token` (none: refused).
    pub fn new(fleet: Arc<Fleet>, token: Option<Arc<AdminToken>>) -> FrontControl {
        FrontControl {
            api: Arc::new(Api { fleet }),
            token,
        }
    }

    /// Whether a request may use the control route `path`: the browser guard, then the
    /// admin token (required here even where the admin listener runs without one).
    pub fn authorize(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<(), Failure> {
        let Some(token) = self.token.as_ref() else {
            return Err(not_here(path));
        };
        if !token.required() {
            return Err(Failure::new(
                FailReason::Forbidden,
                format!(
                    "pdgate serves {path} on its admin listener (admin.port); to call it on \
                     this port too, set an admin token (admin.api_key, admin.api_key_file or \
                     PDGATE_ADMIN_API_KEY)"
                ),
            ));
        }
        let allowed = self.api.fleet.live().load().admin.allowed_hosts.clone();
        super::guard::check(method, path, headers, &allowed)?;
        if token.allows(path, headers) {
            return Ok(());
        }
        Err(Failure::new(
            FailReason::Unauthorized,
            format!("{path} needs `Authorization: Bearer <admin token>` (a client key does not grant it)"),
        ))
    }

    /// Answers an authorized worker route with the admin API.
    pub async fn workers(&self, req: Request<hyper::body::Incoming>) -> Response<RespBody> {
        self.api.handle(req).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_routes() {
        let table = [
            ("/workers", true),
            ("/workers/", true),
            ("/workers/prefill-0", true),
            ("/workers/prefill-0/drain", true),
            ("/workers/prefill-0/undrain", true),
            ("/workers/prefill-0/other", false),
            ("/workers//drain", false),
            ("/add_worker", true),
            ("/remove_worker", true),
            ("/list_workers", true),
            ("/config", false),
            ("/metrics", false),
            ("/generate", false),
        ];
        for (p, want) in table {
            assert_eq!(is_worker_route(p), want, "{p}");
        }
    }
}
