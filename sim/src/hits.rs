//! Counts of the requests each of an engine's HTTP servers received, by method and path
//! (`SimEngine::hits`): the engine port and, for a prefill, its bootstrap server.
//!
//! Why: the router's background calls (health checks, the bootstrap poll, load polls)
//! are load on the engine before any traffic; tests and benches count them to hold the
//! router to a budget per engine.
//!
//! Invariants: one count per request the server's handler saw (a request refused by a
//! "down" fault is never handled, so never counted); the key is `METHOD /path` without
//! the query string.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Which of an engine's servers a request reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Server {
    Engine,
    Bootstrap,
}

#[derive(Default)]
pub(crate) struct Hits {
    engine: Mutex<BTreeMap<String, u64>>,
    bootstrap: Mutex<BTreeMap<String, u64>>,
}

impl Hits {
    pub(crate) fn record(&self, server: Server, method: &hyper::Method, path: &str) {
        let map = match server {
            Server::Engine => &self.engine,
            Server::Bootstrap => &self.bootstrap,
        };
        let mut m = map.lock().unwrap_or_else(|e| e.into_inner());
        let key = format!("{method} {path}");
        *m.entry(key).or_insert(0) += 1;
    }

    pub(crate) fn snapshot(&self) -> HitsSnapshot {
        let copy =
            |m: &Mutex<BTreeMap<String, u64>>| m.lock().unwrap_or_else(|e| e.into_inner()).clone();
        HitsSnapshot {
            engine: copy(&self.engine),
            bootstrap: copy(&self.bootstrap),
        }
    }
}

/// A copy of an engine's request counts (`METHOD /path` → requests).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HitsSnapshot {
    pub engine: BTreeMap<String, u64>,
    pub bootstrap: BTreeMap<String, u64>,
}

impl HitsSnapshot {
    /// Requests the engine port received for `key` (`"GET /health"`).
    pub fn engine(&self, key: &str) -> u64 {
        self.engine.get(key).copied().unwrap_or(0)
    }

    /// Requests the bootstrap server received for `key` (`"GET /route"`).
    pub fn bootstrap(&self, key: &str) -> u64 {
        self.bootstrap.get(key).copied().unwrap_or(0)
    }

    /// Every request the bootstrap server received.
    pub fn bootstrap_total(&self) -> u64 {
        self.bootstrap.values().sum()
    }

    /// Every request the engine port received whose path is not a generation route
    /// (the background calls: health, server info, loads).
    pub fn engine_background(&self) -> u64 {
        self.engine
            .iter()
            .filter(|(k, _)| {
                [
                    "/health",
                    "/server_info",
                    "/get_server_info",
                    "/v1/loads",
                    "/get_load",
                ]
                .iter()
                .any(|p| k.ends_with(&format!(" {p}")))
            })
            .map(|(_, v)| v)
            .sum()
    }

    /// The counts of `self` minus those of an earlier snapshot `before`.
    pub fn since(&self, before: &HitsSnapshot) -> HitsSnapshot {
        let diff = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| {
            now.iter()
                .map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or(0).min(*v)))
                .filter(|(_, v)| *v > 0)
                .collect()
        };
        HitsSnapshot {
            engine: diff(&self.engine, &before.engine),
            bootstrap: diff(&self.bootstrap, &before.bootstrap),
        }
    }
}
