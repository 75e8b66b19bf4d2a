//! Whether a prefill's bootstrap server is its own, proved before any request is sent to
//! the prefill.
//!
//! Why: a decode looks up the KV sender at the bootstrap server named in the request. If
//! that server belongs to another prefill (a bootstrap port given wrong, or two prefills
//! pointed at one server), the decode waits for KV from an engine that never got the
//! request, and every request hangs until the prefill timeout (60 s), then 504. Nothing in
//! the bootstrap server's health or layout looks wrong, so this is checked on its own.
//!
//! The proofs, from what the engines answer:
//! 1. a bootstrap port given in the config (or a pod's annotation) equals the prefill's own
//!    `/server_info` `disaggregation_bootstrap_port`;
//! 2. the bootstrap server's layout answer (SGLang 0.5.x's `/route` sentinel) names the HTTP
//!    port of the prefill that registered it (`prefill_http_port`): it equals the prefill
//!    URL's port;
//! 3. no two prefills use one bootstrap server (same host and port): the later one (higher
//!    worker id) is refused.
//!
//! Proofs 1 and 2 apply when the bootstrap server is reached at the prefill's own host
//! (no `bootstrap_host`): behind another address, ports may be mapped. A fact an engine
//! does not report (an older SGLang) is not compared.
//!
//! Invariant: a prefill is not routable until the proof is done ([`UNPROVED`]); a refused
//! prefill is never routable (`WorkerFacts::bootstrap_refused`), its
//! refusal is logged at ERROR with what to fix, and counted in
//! `pdgate_bootstrap_refused_total{reason}`.

use std::time::Duration;

use http::StatusCode;

use super::client::SENTINEL_V3;
use crate::upstream::{BaseUrl, Upstream};

/// The refusal a prefill carries until its proof is done.
pub const UNPROVED: &str =
    "its bootstrap server is not yet proved to be its own (waiting for the engine and every \
     rank's registration)";

/// Why a bootstrap server is not the prefill's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// Proof 1 failed.
    PortDisagrees { given: u16, reported: u16 },
    /// Proof 2 failed.
    NotItsOwn {
        bootstrap_port: u16,
        owner_http_port: u16,
        engine_port: u16,
    },
    /// Proof 3 failed: `other` (a worker id or URL) uses the same bootstrap server.
    Shared { bootstrap: String, other: String },
}

impl Mismatch {
    /// The metrics label.
    pub fn label(&self) -> &'static str {
        match self {
            Mismatch::PortDisagrees { .. } => "port_disagrees",
            Mismatch::NotItsOwn { .. } => "not_its_own",
            Mismatch::Shared { .. } => "shared",
        }
    }

    /// What is wrong and what to do, in one sentence each.
    pub fn message(&self) -> String {
        match self {
            Mismatch::PortDisagrees { given, reported } => format!(
                "bootstrap port {given} was given, but the prefill's /server_info reports \
                 disaggregation_bootstrap_port {reported}: give {reported} (or leave the port \
                 out: pdgate reads it from /server_info)"
            ),
            Mismatch::NotItsOwn {
                bootstrap_port,
                owner_http_port,
                engine_port,
            } => format!(
                "the bootstrap server on port {bootstrap_port} belongs to the prefill whose \
                 HTTP port is {owner_http_port}, not to this one (port {engine_port}): give \
                 this prefill's own bootstrap port (its --disaggregation-bootstrap-port)"
            ),
            Mismatch::Shared { bootstrap, other } => format!(
                "{other} already uses the bootstrap server {bootstrap}: each prefill has its \
                 own bootstrap server; give this prefill's own port (its \
                 --disaggregation-bootstrap-port)"
            ),
        }
    }
}

/// Proofs 1 and 2 over what the engines answered (see the module docs).
pub fn judge(
    engine_port: u16,
    bootstrap_port: u16,
    given: bool,
    host_given: bool,
    reported: Option<u16>,
    owner_http_port: Option<u16>,
) -> Option<Mismatch> {
    if host_given {
        return None;
    }
    if let (true, Some(r)) = (given, reported) {
        if r != bootstrap_port {
            return Some(Mismatch::PortDisagrees {
                given: bootstrap_port,
                reported: r,
            });
        }
    }
    match owner_http_port {
        Some(o) if o != engine_port => Some(Mismatch::NotItsOwn {
            bootstrap_port,
            owner_http_port: o,
            engine_port,
        }),
        _ => None,
    }
}

/// What the bootstrap server's layout answer says of its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// The owner's HTTP port, or `None` when the server does not report it (or does not
    /// speak SGLang 0.5.x's route API).
    Known(Option<u16>),
    /// Not every rank registered yet (503), or no answer: ask again later.
    NotYet,
}

/// Reads `prefill_http_port` from the bootstrap server's layout answer.
pub async fn owner(up: &Upstream, bootstrap: &BaseUrl, timeout: Duration) -> Owner {
    match up.get(bootstrap, SENTINEL_V3, timeout).await {
        Ok((StatusCode::OK, body)) => Owner::Known(
            serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("prefill_http_port").and_then(|p| p.as_u64()))
                .and_then(|p| u16::try_from(p).ok()),
        ),
        Ok((StatusCode::SERVICE_UNAVAILABLE, _)) | Err(_) => Owner::NotYet,
        Ok(_) => Owner::Known(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs() {
        // (engine port, bootstrap port, given, host given, reported, owner port, want label)
        type Case = (
            u16,
            u16,
            bool,
            bool,
            Option<u16>,
            Option<u16>,
            Option<&'static str>,
        );
        let table: [Case; 9] = [
            (30000, 8998, false, false, Some(8998), Some(30000), None),
            (30000, 8998, true, false, Some(8998), Some(30000), None),
            (
                30000,
                8999,
                true,
                false,
                Some(8998),
                Some(30001),
                Some("port_disagrees"),
            ),
            (
                30000,
                8999,
                true,
                false,
                None,
                Some(30001),
                Some("not_its_own"),
            ),
            (
                30000,
                8998,
                false,
                false,
                Some(8998),
                Some(30001),
                Some("not_its_own"),
            ),
            (30000, 8998, false, false, None, None, None),
            (
                30000,
                8999,
                true,
                false,
                Some(8998),
                None,
                Some("port_disagrees"),
            ),
            // Behind another host, ports may be mapped: not compared.
            (30000, 8999, true, true, Some(8998), Some(30001), None),
            (80, 8998, false, false, Some(8998), None, None),
        ];
        for (e, b, given, host, rep, own, want) in table {
            let got = judge(e, b, given, host, rep, own);
            assert_eq!(
                got.as_ref().map(Mismatch::label),
                want,
                "{e} {b} {given} {host} {rep:?} {own:?}"
            );
            if let Some(m) = got {
                assert!(m.message().contains("give"), "{}", m.message());
            }
        }
    }
}
