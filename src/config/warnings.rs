//! What `serve` warns about at start: settings that are valid, so not refused, but that
//! most likely do not do what the operator meant. Each warning says what to do.
//!
//! Refusing is for what cannot work (a bad value, two listeners on one port); a warning is
//! for what can work later or elsewhere: a fleet with no workers yet (workers can be added
//! through the admin API or a reload), a collector address that may be an OTLP/HTTP
//! receiver on an unusual port.

use super::Config;

/// OTLP/gRPC's well-known port; pdgate exports OTLP over HTTP (4318).
const OTLP_GRPC_PORT: u16 = 4317;

impl Config {
    /// The warnings `serve` logs at start (at WARN, after its first line), each a sentence
    /// that names the setting and what to do.
    pub fn start_warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let workers = self.prefill.len() + self.decode.len() + self.worker.len();
        if workers == 0 && !self.discovery.enabled {
            out.push(
                "no workers and no discovery: every request is answered 503 until workers are \
                 added; add them with --prefill/--decode (or [[prefill]]/[[decode]] and a \
                 reload), the admin API (POST /workers, /add_worker), or turn on discovery \
                 (--service-discovery)"
                    .to_string(),
            );
        }
        if self.trace.enabled {
            let port = crate::url::parse_base_url(&self.trace.endpoint).map(|u| u.port());
            if port.is_ok_and(|p| p == OTLP_GRPC_PORT) {
                out.push(format!(
                    "trace.endpoint {} is on port {OTLP_GRPC_PORT}, OTLP/gRPC's: pdgate exports \
                     OTLP over HTTP (JSON), so a gRPC receiver refuses every batch; point \
                     trace.endpoint (--otlp-traces-endpoint) at the collector's OTLP/HTTP \
                     port, usually 4318",
                    self.trace.endpoint
                ));
            }
        }
        if self.affinity.sticky_idle_secs != super::AffinityConfig::default().sticky_idle_secs {
            out.push(format!(
                "affinity.sticky_idle_secs (--sticky-key-idle-secs) = {} has no effect: pdgate \
                 keeps no key map; a keyed request goes where its key hashes on the \
                 cache_aware ring (the same worker on every replica), so a key never expires \
                 and moves only when its worker leaves or is over the load bound",
                self.affinity.sticky_idle_secs
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DecodeWorkerConfig, PrefillWorkerConfig};

    fn with_workers() -> Config {
        let mut c = Config::default();
        c.prefill.push(PrefillWorkerConfig {
            url: "http://10.0.0.1:30000".into(),
            bootstrap_port: None,
            bootstrap_host: None,
            model: None,
        });
        c.decode.push(DecodeWorkerConfig {
            url: "http://10.0.0.2:30000".into(),
            model: None,
        });
        c
    }

    #[test]
    fn an_empty_fleet_is_warned_not_refused() {
        let empty = Config::default();
        assert!(empty.validate().is_ok());
        let w = empty.start_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("no workers") && w[0].contains("POST /workers"),
            "{w:?}"
        );
        assert!(with_workers().start_warnings().is_empty());
        let mut discovered = Config::default();
        discovered.discovery.enabled = true;
        assert!(discovered.start_warnings().is_empty());
    }

    #[test]
    fn sticky_sessions_say_the_idle_time_has_no_effect() {
        let mut c = with_workers();
        c.affinity.sticky = true;
        assert!(
            c.start_warnings().is_empty(),
            "the default idle time is not a choice"
        );
        c.affinity.sticky_idle_secs = 600;
        let w = c.start_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("= 600 has no effect"), "{w:?}");
    }

    #[test]
    fn a_grpc_collector_port_is_warned() {
        let mut c = with_workers();
        c.trace.enabled = true;
        for (endpoint, warned) in [
            ("http://otel-collector:4317", true),
            ("http://127.0.0.1:4317/", true),
            ("http://otel-collector:4318", false),
            ("http://otel-collector:14317", false),
        ] {
            c.trace.endpoint = endpoint.to_string();
            let w = c.start_warnings();
            assert_eq!(w.len(), usize::from(warned), "{endpoint}: {w:?}");
            if warned {
                assert!(w[0].contains("4318") && w[0].contains(endpoint), "{w:?}");
            }
        }
        // Not exporting: nothing to warn about.
        c.trace.enabled = false;
        c.trace.endpoint = "http://otel-collector:4317".to_string();
        assert!(c.start_warnings().is_empty());
    }
}
