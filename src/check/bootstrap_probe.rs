//! `pdgate check`'s look at a prefill's bootstrap server: alive, the prefill's own
//! (`crate::bootstrap::ownership`), every rank registered, every rank's route.

use super::*;

/// The bootstrap server is this prefill's own (`crate::bootstrap::ownership`, proofs 1
/// and 2). `None` when it cannot tell yet (not every rank registered: reported below).
#[allow(clippy::too_many_arguments)]
async fn owner_check(
    up: &Upstream,
    t: &str,
    engine: &BaseUrl,
    url: &BaseUrl,
    port: u16,
    given: bool,
    info: &ServerInfo,
    timeout: Duration,
) -> Option<Check> {
    use crate::bootstrap::ownership::{judge, owner, Owner};
    let Owner::Known(owner_port) = owner(up, url, timeout).await else {
        return None;
    };
    let reported = info.disaggregation_bootstrap_port;
    let name = "bootstrap_owner";
    Some(
        match judge(engine.port(), port, given, false, reported, owner_port) {
            Some(m) => Check::fail(
                t,
                name,
                format!("the bootstrap server on port {port} is not this prefill's: every request would wait for KV that never comes (then 504)"),
                m.message(),
            ),
            None => Check::pass(
                t,
                name,
                match owner_port {
                    Some(o) => format!("registered by the prefill on HTTP port {o}: this one"),
                    None => "the bootstrap server does not name its prefill (older SGLang): \
                             not verified"
                        .to_string(),
                },
            ),
        },
    )
}

/// The prefill's bootstrap server: alive, its own (`crate::bootstrap::ownership`), every
/// rank registered, every rank's route. Returns the layout from the sentinel, and the
/// server's `host:port` when it answered.
pub(super) async fn probe_bootstrap(
    up: &Upstream,
    checks: &mut Vec<Check>,
    e: &Engine,
    engine: &BaseUrl,
    info: &ServerInfo,
    timeout: Duration,
) -> (Option<Layout>, Option<String>) {
    let mut at = None;
    let layout = probe_bootstrap_at(up, checks, e, engine, info, timeout, &mut at).await;
    (layout, at)
}

async fn probe_bootstrap_at(
    up: &Upstream,
    checks: &mut Vec<Check>,
    e: &Engine,
    engine: &BaseUrl,
    info: &ServerInfo,
    timeout: Duration,
    at: &mut Option<String>,
) -> Option<Layout> {
    let t = e.target.as_str();
    let (port, from) = match (e.bootstrap_port, info.disaggregation_bootstrap_port) {
        (Some(p), _) if matches!(e.listed, Listed::Pod { .. }) => (p, "from the pod's annotation"),
        (Some(p), _) => (p, "configured"),
        (None, Some(p)) => (p, "from /server_info"),
        (None, None) => (sglang_pd::DEFAULT_BOOTSTRAP_PORT, "the default"),
    };
    let url = engine.with_port(port);
    if let Err(err) = client::health(up, &url, timeout).await {
        let give = match &e.listed {
            Listed::Static => "--prefill URL PORT, or bootstrap_port in [[prefill]]".to_string(),
            Listed::Pod { annotation, .. } => format!("the pod's {annotation} annotation"),
        };
        checks.push(Check::fail(
            t,
            "bootstrap_health",
            format!("bootstrap server {url} (port {from}): {err}"),
            format!(
                "the prefill's bootstrap server must answer on port {port}: give the right port \
                 ({give}; the engine's --disaggregation-bootstrap-port) and check the \
                 prefill's logs"
            ),
        ));
        return None;
    }
    checks.push(Check::pass(
        t,
        "bootstrap_health",
        format!("bootstrap server {url} (port {from}) answers /health"),
    ));
    *at = Some(format!("{}:{port}", url.host()));
    if let Some(c) = owner_check(
        up,
        t,
        engine,
        &url,
        port,
        e.bootstrap_port.is_some(),
        info,
        timeout,
    )
    .await
    {
        checks.push(c);
    }
    let layout = match client::sentinel(up, &url, None, timeout).await {
        Ok(Sentinel::Ready(l)) => l,
        Ok(Sentinel::NotReady(text)) => {
            checks.push(Check::fail(
                t,
                "bootstrap_registered",
                format!("503, not every rank registered: {text}; rank routes not checked"),
                "a DP rank of the prefill never registered with its bootstrap server: wait \
                 for the prefill to finish starting, else see its logs for a rank that failed \
                 to start (every request to this prefill fails meanwhile)",
            ));
            return None;
        }
        Err(e) => {
            checks.push(Check::fail(
                t,
                "bootstrap_registered",
                format!("the layout query failed: {e}"),
                "the bootstrap server answers /health but not GET /route: is it an SGLang \
                 bootstrap server of a supported version?",
            ));
            return None;
        }
    };
    checks.push(Check::pass(
        t,
        "bootstrap_registered",
        format!(
            "every rank registered: DP {}, attention TP {}, CP {}, PP {} ({:?} route API)",
            layout.dp_size,
            layout.attn_tp_size,
            layout.attn_cp_size,
            layout.pp_size,
            layout.generation
        ),
    ));
    for rank in 0..layout.dp_size {
        let name = format!("rank_route[{rank}]");
        checks.push(
            match client::rank_route(up, &url, layout.generation, rank, timeout).await {
                Ok(RankRoute::Ready { rank_ip, rank_port }) => {
                    Check::pass(t, &name, format!("DP rank {rank} at {rank_ip}:{rank_port}"))
                }
                Ok(RankRoute::NotReady) => Check::fail(
                    t,
                    &name,
                    format!("DP rank {rank}: 503, the bootstrap server is not ready"),
                    "wait for the prefill to finish starting, else see its logs",
                ),
                Ok(RankRoute::Missing(text)) => Check::fail(
                    t,
                    &name,
                    format!("DP rank {rank} is not registered: {text}"),
                    "see the prefill's logs for this rank (it did not start or register)",
                ),
                Err(e) => Check::fail(
                    t,
                    &name,
                    format!("DP rank {rank}: {e}"),
                    "the bootstrap server did not answer the rank query: see its logs",
                ),
            },
        );
    }
    Some(layout)
}
