//! `[trace]`: OpenTelemetry traces (OTLP over HTTP, JSON encoding), off by default. Kept in
//! its own file; the same rules hold (defaults only here, unknown keys refused, every value
//! checked by [`super::Config::validate`]). What is exported and why the exporter is
//! pdgate's own: `crate::trace`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, range, range_f, ConfigError};

/// `[trace]`: export a span tree per request to an OTLP/HTTP collector.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TraceConfig {
    /// Export traces (`--enable-trace`). Off: the request path pays one branch.
    pub enabled: bool,
    /// The collector's OTLP/HTTP base URL (`--otlp-traces-endpoint`); spans are POSTed to
    /// `<endpoint>/v1/traces` as JSON. Plain `http://` only (run a collector agent beside
    /// pdgate for TLS). A URL that already ends in `/v1/traces` is used as it is.
    pub endpoint: String,
    /// The resource's `service.name`.
    pub service_name: String,
    /// Share of new traces recorded when the client sent no (valid) `traceparent`, 0..=1.
    /// A client's sampled flag always decides for its own trace (parent-based).
    pub sample_ratio: f64,
    /// Spans sent in one export request, at most.
    pub max_batch_spans: usize,
    /// Finished spans waiting for export, at most; past it a span is dropped and counted
    /// (`pdgate_trace_spans_dropped_total`), never waited for.
    pub max_queue_spans: usize,
    /// A batch is sent at least this often while spans wait.
    pub export_interval_ms: u64,
    /// One export request's limit (connect, send, answer); then its spans are dropped and
    /// counted. Also bounds the last flush at shutdown.
    pub export_timeout_ms: u64,
}

impl Default for TraceConfig {
    fn default() -> Self {
        TraceConfig {
            enabled: false,
            endpoint: "http://127.0.0.1:4318".to_string(),
            service_name: "pdgate".to_string(),
            sample_ratio: 1.0,
            max_batch_spans: 512,
            max_queue_spans: 8192,
            export_interval_ms: 1000,
            export_timeout_ms: 5000,
        }
    }
}

impl TraceConfig {
    pub fn export_interval(&self) -> Duration {
        Duration::from_millis(self.export_interval_ms)
    }
    pub fn export_timeout(&self) -> Duration {
        Duration::from_millis(self.export_timeout_ms)
    }

    /// The URL spans are POSTed to.
    pub fn traces_url(&self) -> String {
        let base = self.endpoint.trim_end_matches('/');
        if base.ends_with("/v1/traces") {
            base.to_string()
        } else {
            format!("{base}/v1/traces")
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        range_f("trace.sample_ratio", self.sample_ratio, 0.0, 1.0)?;
        range("trace.max_batch_spans", self.max_batch_spans, 1, 65_536)?;
        range("trace.max_queue_spans", self.max_queue_spans, 1, 1 << 20)?;
        range(
            "trace.export_interval_ms",
            self.export_interval_ms,
            10,
            600_000,
        )?;
        range(
            "trace.export_timeout_ms",
            self.export_timeout_ms,
            10,
            600_000,
        )?;
        if self.service_name.is_empty() || self.service_name.len() > 256 {
            return Err(invalid(format!(
                "trace.service_name {:?} must have 1 to 256 characters",
                self.service_name
            )));
        }
        let url = self.traces_url();
        let ok = url
            .parse::<http::Uri>()
            .ok()
            .filter(|u| u.scheme_str() == Some("http") && u.host().is_some());
        if ok.is_none() {
            return Err(invalid(format!(
                "trace.endpoint {:?} is not an http:// URL (pdgate sends OTLP over plain \
                 HTTP with JSON, a collector's port 4318; for TLS run a collector agent beside it)",
                self.endpoint
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_settings_are_checked() {
        type Tweak = fn(&mut TraceConfig);
        let cases: &[(Tweak, &str)] = &[
            (|t| t.sample_ratio = f64::NAN, "trace.sample_ratio = NaN"),
            (|t| t.sample_ratio = 1.5, "trace.sample_ratio = 1.5"),
            (|t| t.sample_ratio = -0.1, "trace.sample_ratio = -0.1"),
            (|t| t.max_batch_spans = 0, "trace.max_batch_spans = 0"),
            (|t| t.max_queue_spans = 0, "trace.max_queue_spans = 0"),
            (|t| t.export_interval_ms = 0, "trace.export_interval_ms = 0"),
            (
                |t| t.export_timeout_ms = 1_000_000,
                "trace.export_timeout_ms",
            ),
            (|t| t.service_name = String::new(), "trace.service_name"),
            (
                |t| t.endpoint = "https://c:4318".into(),
                "not an http:// URL",
            ),
            (|t| t.endpoint = "c:4318".into(), "not an http:// URL"),
            (|t| t.endpoint = String::new(), "not an http:// URL"),
        ];
        for (tweak, want) in cases {
            let mut t = TraceConfig::default();
            tweak(&mut t);
            let err = t.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{err} does not contain {want}");
        }
        TraceConfig::default().validate().unwrap();
    }

    #[test]
    fn spans_go_to_v1_traces_under_the_endpoint() {
        let cases = [
            ("http://c:4318", "http://c:4318/v1/traces"),
            ("http://c:4318/", "http://c:4318/v1/traces"),
            ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
            ("http://c/otlp", "http://c/otlp/v1/traces"),
        ];
        for (endpoint, want) in cases {
            let t = TraceConfig {
                endpoint: endpoint.into(),
                ..TraceConfig::default()
            };
            assert_eq!(t.traces_url(), want);
            t.validate().unwrap();
        }
    }
}
