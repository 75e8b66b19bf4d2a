//! The checks about the deployment as a whole: something to route to, a contract mode the
//! engines can honour, the KV layout facts every prefill/decode pair must share (the idea
//! of [`crate::pool::mismatch`], from the engines' answers instead of the pool), and the
//! optional end-to-end request.
//!
//! Invariant: a fact an engine did not report is not compared (it is said so in the detail),
//! so a missing field never makes a ✗; a differing one always does.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};

use super::{Check, EngineProbe, FLEET, FOLLOW_BOOTSTRAP_ROOM, PROBE_REQUEST_CAP, ROUTABLE_WAIT};
use crate::config::{Config, ContractMode};
use crate::types::Role;
use crate::upstream::Upstream;
use crate::url::parse_base_url;

/// Every fleet check, in order.
pub(super) fn fleet(cfg: &Config, probes: &[EngineProbe]) -> Vec<Check> {
    let mut out = Vec::new();
    let discovery = cfg.discovery.enabled;
    let regulars = probes.iter().filter(|p| p.role == Role::Regular).count();
    for role in [Role::Prefill, Role::Decode, Role::Regular] {
        let name = format!("{role}_configured");
        let of_role = || probes.iter().filter(|p| p.role == role);
        let n = of_role().count();
        let found = of_role().filter(|p| p.discovered).count();
        out.push(match (n, discovery) {
            // Regular workers are optional; without PD pairs they serve everything.
            (0, _) if role == Role::Regular => {
                Check::pass(FLEET, &name, "no regular (non-PD) engine".to_string())
            }
            (0, _) if regulars > 0 => Check::pass(
                FLEET,
                &name,
                format!("no {role} engine: requests go to the {regulars} regular engine(s)"),
            ),
            (0, false) => Check::fail(
                FLEET,
                &name,
                format!("no {role} engine configured: no request can be served"),
                format!("add one: --{role} URL, or [[{role}]] in the config file"),
            ),
            (0, true) => Check::fail(
                FLEET,
                &name,
                format!("no {role} engine configured or discovered: no request can be served"),
                format!(
                    "run a Ready {role} pod that matches --{role}-selector (see the discovery \
                     rows above), or add one: --{role} URL, or [[{role}]] in the config file"
                ),
            ),
            (n, false) => Check::pass(FLEET, &name, format!("{n} {role} engine(s)")),
            (n, true) => Check::pass(
                FLEET,
                &name,
                format!(
                    "{n} {role} engine(s): {} static, {found} discovered",
                    n - found
                ),
            ),
        });
    }
    out.push(contract(cfg.contract.mode, probes));
    out.push(shared_bootstrap(probes));
    out.extend(super::pairing::checks(probes));
    let page = |p: &EngineProbe| {
        p.info
            .as_ref()
            .and_then(|i| i.page_size)
            .or(p.layout.as_ref().and_then(|l| l.page_size))
            .map(|v| v.to_string())
    };
    let dtype = |p: &EngineProbe| {
        p.info
            .as_ref()
            .and_then(|i| i.kv_cache_dtype.clone())
            .or(p.layout.as_ref().and_then(|l| l.kv_cache_dtype.clone()))
    };
    let backend = |p: &EngineProbe| {
        p.info
            .as_ref()
            .and_then(|i| i.disaggregation_transfer_backend.clone())
    };
    out.push(pairs(
        probes,
        "page_size",
        "page size",
        &page,
        "start every prefill and decode with the same --page-size (a decode paired with a \
         prefill of another page size crashes its scheduler)",
    ));
    out.push(pairs(
        probes,
        "kv_cache_dtype",
        "KV dtype",
        &dtype,
        "start every prefill and decode with the same --kv-cache-dtype (the KV is copied \
         byte for byte)",
    ));
    out.push(pairs(
        probes,
        "transfer_backend",
        "transfer backend",
        &backend,
        "start every prefill and decode with the same --disaggregation-transfer-backend",
    ));
    out
}

/// Whether the contract mode can work with these prefills.
/// No two prefills use one bootstrap server (`crate::bootstrap::ownership`, proof 3).
fn shared_bootstrap(probes: &[EngineProbe]) -> Check {
    let name = "bootstrap_shared";
    let prefills: Vec<(&str, &str)> = probes
        .iter()
        .filter(|p| p.role == Role::Prefill)
        .filter_map(|p| p.bootstrap.as_deref().map(|b| (p.target.as_str(), b)))
        .collect();
    for (i, (t, b)) in prefills.iter().enumerate() {
        if let Some((first, _)) = prefills[..i].iter().find(|(_, b2)| b2 == b) {
            return Check::fail(
                FLEET,
                name,
                format!("prefills {first} and {t} both use the bootstrap server {b}"),
                "each prefill has its own bootstrap server: give each its own port (its \
                 --disaggregation-bootstrap-port), or leave the port out (pdgate reads it \
                 from /server_info)",
            );
        }
    }
    Check::pass(
        FLEET,
        name,
        format!(
            "{} prefill bootstrap server(s), each used once",
            prefills.len()
        ),
    )
}

fn contract(mode: ContractMode, probes: &[EngineProbe]) -> Check {
    let name = "contract_mode";
    match mode {
        ContractMode::Pinned => Check::pass(
            FLEET,
            name,
            "pinned: needs every engine to carry SGLang PR #19268 (routed_dp_rank, \
             disagg_prefill_dp_rank); pdgate cannot verify this from /server_info — check the \
             engines' version",
        ),
        ContractMode::Modulo => {
            let off: Vec<String> = probes
                .iter()
                .filter(|p| p.role == Role::Prefill)
                .filter_map(|p| {
                    let info = p.info.as_ref()?;
                    let m = info.load_balance_method.as_deref()?;
                    // DP 1: every room lands on rank 0 whatever the method.
                    let dp1 = info.dp_size.unwrap_or(1) <= 1
                        && p.layout.as_ref().is_none_or(|l| l.dp_size <= 1);
                    (m != FOLLOW_BOOTSTRAP_ROOM && !dp1).then(|| format!("{} ({m})", p.target))
                })
                .collect();
            if off.is_empty() {
                Check::pass(
                    FLEET,
                    name,
                    "modulo: every prefill that reports it follows the bootstrap room",
                )
            } else {
                Check::fail(
                    FLEET,
                    name,
                    format!(
                        "modulo: these prefills do not follow the bootstrap room: {}",
                        off.join(", ")
                    ),
                    format!(
                        "start them with --load-balance-method {FOLLOW_BOOTSTRAP_ROOM}, or \
                         use --contract-mode pinned (engines with SGLang PR #19268)"
                    ),
                )
            }
        }
    }
}

/// One fact compared over every (prefill, decode) pair where both sides report it.
fn pairs(
    probes: &[EngineProbe],
    name: &str,
    what: &str,
    fact: &dyn Fn(&EngineProbe) -> Option<String>,
    fix: &str,
) -> Check {
    let of = |role| {
        probes
            .iter()
            .filter(move |p| p.role == role)
            .filter_map(|p| Some((p.target.as_str(), fact(p)?)))
            .collect::<Vec<_>>()
    };
    let (prefills, decodes) = (of(Role::Prefill), of(Role::Decode));
    let mut differ = Vec::new();
    for (p, pv) in &prefills {
        for (d, dv) in &decodes {
            if pv != dv {
                differ.push(format!("prefill {p} {pv} ≠ decode {d} {dv}"));
            }
        }
    }
    if !differ.is_empty() {
        return Check::fail(FLEET, name, format!("{what}: {}", differ.join("; ")), fix);
    }
    let mut seen: Vec<&str> = prefills
        .iter()
        .chain(decodes.iter())
        .map(|(_, v)| v.as_str())
        .collect();
    seen.sort_unstable();
    seen.dedup();
    if prefills.is_empty() || decodes.is_empty() {
        Check::pass(
            FLEET,
            name,
            format!("{what}: not known for both a prefill and a decode, not compared"),
        )
    } else {
        Check::pass(
            FLEET,
            name,
            format!("{what} {} on every prefill/decode pair", seen.join(", ")),
        )
    }
}

/// One PD request end to end through an in-process router with the same configuration.
/// The router's front door is shut down afterwards; its background tasks (bootstrap
/// trackers, health checkers) live until the runtime ends, which for `pdgate check` is
/// right after the report.
pub(super) async fn probe_request(cfg: &Config, up: &Upstream) -> Check {
    let name = "probe_request";
    let fail = |detail: String, fix: &str| Check::fail(FLEET, name, detail, fix);
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => return fail(format!("cannot bind 127.0.0.1:0: {e}"), "free a local port"),
    };
    let router =
        match crate::router::start(cfg.clone(), Some(listener), crate::dispatch::RngSource::Os)
            .await
        {
            Ok(r) => r,
            Err(e) => return fail(format!("the router did not start: {e}"), "see the error"),
        };
    let deadline = Instant::now() + ROUTABLE_WAIT;
    loop {
        let s = router.pool.load();
        if (s.routable_ranks(Role::Prefill) > 0 && s.routable_ranks(Role::Decode) > 0)
            || s.routable_ranks(Role::Regular) > 0
        {
            break;
        }
        if Instant::now() > deadline {
            router.server.shutdown().await;
            return fail(
                format!(
                    "no routable prefill and decode rank within {ROUTABLE_WAIT:?} (routable \
                     prefill ranks {}, decode ranks {})",
                    s.routable_ranks(Role::Prefill),
                    s.routable_ranks(Role::Decode)
                ),
                "fix the ✗ checks above first",
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let timeout = cfg.timeouts.request().min(PROBE_REQUEST_CAP);
    let body = Bytes::from_static(
        br#"{"text":"pdgate check","sampling_params":{"max_new_tokens":1,"temperature":0}}"#,
    );
    let started = Instant::now();
    let answer = match parse_base_url(&router.url()).map(|u| u.uri("/generate")) {
        Ok(Ok(uri)) => up.call(Method::POST, uri, Some(body), timeout).await,
        _ => {
            router.server.shutdown().await;
            return fail("the router's own URL is invalid".into(), "a pdgate bug");
        }
    };
    router.server.shutdown().await;
    match answer {
        Ok((StatusCode::OK, _)) => Check::pass(
            FLEET,
            name,
            "POST /generate (1 token) through the router (a prefill and decode pair, or a regular engine): 200",
        ),
        Ok((status, b)) => fail(
            format!(
                "POST /generate answered {status}: {}",
                String::from_utf8_lossy(&b[..b.len().min(500)]).trim()
            ),
            "the error JSON names the failing leg and engine: see that engine's logs and the \
             ✗ checks above",
        ),
        Err(e) => fail(
            format!(
                "POST /generate: no answer: {e} ({} ms)",
                started.elapsed().as_millis()
            ),
            "the router did not answer in time: see the engines' logs",
        ),
    }
}
