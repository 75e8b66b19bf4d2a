//! The bootstrap-server and engine-info calls a decode engine makes, spoken by pdgate
//! (spec §2.3, §2.8, §3.2, §6.6).
//!
//! Three generations of the `GET /route` API are understood: v3/v4 (the current
//! `prefill_dp_rank`/`prefill_cp_rank`/`target_tp_rank`/`target_pp_rank` query, 503 until
//! every rank registered, 404 for an unknown rank), v2 (`engine_rank`/`target_dp_group`/
//! `target_pp_rank`, a missing rank is a 500) and v1 (`engine_rank`/`target_dp_group`).
//! The generation is found once per server, newest first, and remembered.

use crate::upstream::{snippet, BODY_SNIPPET};
use std::time::Duration;

use http::StatusCode;
use serde::Deserialize;

pub use crate::engine::{Generation, Layout, ServerInfo, MAX_DP_SIZE};
use crate::upstream::{BaseUrl, CallError, Upstream};

/// What the sentinel said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sentinel {
    Ready(Layout),
    /// 503: not every rank registered yet.
    NotReady(String),
}

/// What a rank lookup said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankRoute {
    Ready {
        rank_ip: String,
        rank_port: u16,
    },
    /// 503: the server is not ready (for every query, observed on 0.5.23).
    NotReady,
    /// 404 (v3) or 500 KeyError (v1/v2): the rank is not registered.
    Missing(String),
}

/// A bootstrap call that did not produce an answer to act on.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("bootstrap server unreachable: {0}")]
    Unreachable(#[from] CallError),
    #[error("unexpected answer {status}: {body}")]
    BadAnswer { status: u16, body: String },
    #[error("the engine reports dp_size {dp_size}, above the limit of {MAX_DP_SIZE}: refused")]
    DpSizeTooLarge { dp_size: u32 },
}

/// `dp_size` within [`MAX_DP_SIZE`] (0 counts as 1).
pub fn checked_dp(dp_size: u32) -> Result<u32, BootstrapError> {
    if dp_size > MAX_DP_SIZE {
        return Err(BootstrapError::DpSizeTooLarge { dp_size });
    }
    Ok(dp_size.max(1))
}

#[derive(Deserialize)]
struct V3Info {
    dp_size: u32,
    #[serde(default = "one")]
    attn_tp_size: u32,
    #[serde(default = "one")]
    attn_cp_size: u32,
    #[serde(default = "one")]
    pp_size: u32,
    #[serde(default)]
    follow_bootstrap_room: Option<bool>,
    #[serde(default)]
    page_size: Option<u64>,
    #[serde(default)]
    kv_cache_dtype: Option<String>,
}

#[derive(Deserialize)]
struct OldInfo {
    prefill_dp_size: u32,
    #[serde(default)]
    prefill_attn_tp_size: Option<u32>,
    #[serde(default)]
    prefill_tp_size: Option<u32>,
    #[serde(default)]
    prefill_pp_size: Option<u32>,
}

fn one() -> u32 {
    1
}

pub(crate) const SENTINEL_V3: &str =
    "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";
const SENTINEL_V2: &str = "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1";
const SENTINEL_V1: &str = "/route?engine_rank=-1&target_dp_group=-1";

/// The sentinel query, in the generation given, or newest-first when `None`.
pub async fn sentinel(
    up: &Upstream,
    url: &BaseUrl,
    gen: Option<Generation>,
    timeout: Duration,
) -> Result<Sentinel, BootstrapError> {
    let order: &[Generation] = match gen {
        Some(Generation::V3) => &[Generation::V3],
        Some(Generation::V2) => &[Generation::V2],
        Some(Generation::V1) => &[Generation::V1],
        None => &[Generation::V3, Generation::V2, Generation::V1],
    };
    let mut last = None;
    for g in order {
        let path = match g {
            Generation::V3 => SENTINEL_V3,
            Generation::V2 => SENTINEL_V2,
            Generation::V1 => SENTINEL_V1,
        };
        let (status, body) = up.get(url, path, timeout).await?;
        match (g, status) {
            (_, StatusCode::SERVICE_UNAVAILABLE) => {
                return Ok(Sentinel::NotReady(snippet(&body, BODY_SNIPPET)))
            }
            (Generation::V3, StatusCode::OK) => {
                let info: V3Info =
                    serde_json::from_slice(&body).map_err(|_| BootstrapError::BadAnswer {
                        status: 200,
                        body: snippet(&body, BODY_SNIPPET),
                    })?;
                return Ok(Sentinel::Ready(Layout {
                    generation: Generation::V3,
                    dp_size: checked_dp(info.dp_size)?,
                    attn_tp_size: info.attn_tp_size.max(1),
                    attn_cp_size: info.attn_cp_size.max(1),
                    pp_size: info.pp_size.max(1),
                    follow_bootstrap_room: info.follow_bootstrap_room.unwrap_or(true),
                    page_size: info.page_size,
                    kv_cache_dtype: info.kv_cache_dtype,
                }));
            }
            (Generation::V2 | Generation::V1, StatusCode::OK) => {
                let info: OldInfo =
                    serde_json::from_slice(&body).map_err(|_| BootstrapError::BadAnswer {
                        status: 200,
                        body: snippet(&body, BODY_SNIPPET),
                    })?;
                // A v1 server ignores the v2 query's extra parameter; tell them apart by
                // the answer's shape (v2 names attention-TP and PP sizes).
                let generation =
                    if info.prefill_attn_tp_size.is_some() || info.prefill_pp_size.is_some() {
                        Generation::V2
                    } else {
                        Generation::V1
                    };
                return Ok(Sentinel::Ready(Layout {
                    generation,
                    dp_size: checked_dp(info.prefill_dp_size)?,
                    attn_tp_size: info
                        .prefill_attn_tp_size
                        .or(info.prefill_tp_size)
                        .unwrap_or(1)
                        .max(1),
                    attn_cp_size: 1,
                    pp_size: info.prefill_pp_size.unwrap_or(1).max(1),
                    follow_bootstrap_room: true,
                    page_size: None,
                    kv_cache_dtype: None,
                }));
            }
            // A server of an older generation answers 400 (missing its own params) or
            // 500 (a KeyError) to a newer query: try the next one.
            (_, s) => {
                last = Some(BootstrapError::BadAnswer {
                    status: s.as_u16(),
                    body: snippet(&body, BODY_SNIPPET),
                });
            }
        }
    }
    Err(last.unwrap_or(BootstrapError::BadAnswer {
        status: 0,
        body: "no generation answered".to_string(),
    }))
}

/// The route of one DP rank (CP 0, TP 0, PP 0: what every decode TP rank asks first).
pub async fn rank_route(
    up: &Upstream,
    url: &BaseUrl,
    gen: Generation,
    rank: u32,
    timeout: Duration,
) -> Result<RankRoute, BootstrapError> {
    let path = match gen {
        Generation::V3 => format!(
            "/route?prefill_dp_rank={rank}&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        ),
        Generation::V2 => format!("/route?engine_rank=0&target_dp_group={rank}&target_pp_rank=0"),
        Generation::V1 => format!("/route?engine_rank=0&target_dp_group={rank}"),
    };
    let (status, body) = up.get(url, &path, timeout).await?;
    #[derive(Deserialize)]
    struct Route {
        rank_ip: String,
        rank_port: u16,
    }
    match status {
        StatusCode::OK => {
            let r: Route =
                serde_json::from_slice(&body).map_err(|_| BootstrapError::BadAnswer {
                    status: 200,
                    body: snippet(&body, BODY_SNIPPET),
                })?;
            Ok(RankRoute::Ready {
                rank_ip: r.rank_ip,
                rank_port: r.rank_port,
            })
        }
        StatusCode::SERVICE_UNAVAILABLE => Ok(RankRoute::NotReady),
        StatusCode::NOT_FOUND if gen == Generation::V3 => {
            Ok(RankRoute::Missing(snippet(&body, BODY_SNIPPET)))
        }
        StatusCode::INTERNAL_SERVER_ERROR if gen != Generation::V3 => {
            Ok(RankRoute::Missing(snippet(&body, BODY_SNIPPET)))
        }
        s => Err(BootstrapError::BadAnswer {
            status: s.as_u16(),
            body: snippet(&body, BODY_SNIPPET),
        }),
    }
}

/// `GET /health` on the bootstrap server: 200 while its event loop lives.
pub async fn health(up: &Upstream, url: &BaseUrl, timeout: Duration) -> Result<(), BootstrapError> {
    let (status, body) = up.get(url, "/health", timeout).await?;
    if status.is_success() {
        Ok(())
    } else {
        Err(BootstrapError::BadAnswer {
            status: status.as_u16(),
            body: snippet(&body, BODY_SNIPPET),
        })
    }
}

pub async fn server_info(
    up: &Upstream,
    engine: &BaseUrl,
    timeout: Duration,
) -> Result<ServerInfo, BootstrapError> {
    let mut last = None;
    for path in ["/server_info", "/get_server_info"] {
        let (status, body) = up.get(engine, path, timeout).await?;
        if status == StatusCode::OK {
            return serde_json::from_slice(&body).map_err(|_| BootstrapError::BadAnswer {
                status: 200,
                body: snippet(&body, BODY_SNIPPET),
            });
        }
        last = Some(BootstrapError::BadAnswer {
            status: status.as_u16(),
            body: snippet(&body, BODY_SNIPPET),
        });
    }
    Err(last.unwrap_or(BootstrapError::BadAnswer {
        status: 0,
        body: String::new(),
    }))
}
