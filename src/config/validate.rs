//! Validation: every number a setting takes is checked against its range (so nothing
//! downstream can panic or overflow on it), then settings that only make sense together;
//! the error names the key, the value and the allowed range (with the helpers of
//! `config/mod.rs`, which the sections' own validators share).

use super::*;

impl Config {
    /// Checks values that types alone cannot: every number against the range it may take
    /// (so that nothing downstream can panic or overflow on it: a deadline added to the
    /// clock, a semaphore's permits, a health interval turned into a `Duration`), then
    /// settings that only make sense together. The error names the key, the value and
    /// the allowed range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (i, p) in self.prefill.iter().enumerate() {
            if let Err(e) = crate::url::parse_base_url(&p.url) {
                return Err(invalid(format!("prefill[{i}].url {:?}: {e}", p.url)));
            }
            if p.bootstrap_port == Some(0) {
                return Err(out_of_range(
                    &format!("prefill[{i}].bootstrap_port"),
                    0,
                    "1..=65535",
                ));
            }
            models::check_worker_model(&format!("prefill[{i}].model"), p.model.as_deref())?;
        }
        for (i, d) in self.decode.iter().enumerate() {
            if let Err(e) = crate::url::parse_base_url(&d.url) {
                return Err(invalid(format!("decode[{i}].url {:?}: {e}", d.url)));
            }
            models::check_worker_model(&format!("decode[{i}].model"), d.model.as_deref())?;
        }
        models::check_regular_workers(&self.worker)?;
        self.models.validate()?;
        let (s, t, h, b, a, bs, u, r, p) = (
            &self.server,
            &self.timeouts,
            &self.health,
            &self.breaker,
            &self.admission,
            &self.bootstrap,
            &self.upstream,
            &self.retry,
            &self.policy,
        );
        range("server.max_body_bytes", s.max_body_bytes, 1, MAX_BYTES)?;
        range(
            "server.header_read_timeout_secs",
            s.header_read_timeout_secs,
            1,
            DAY,
        )?;
        range(
            "server.body_read_timeout_secs",
            s.body_read_timeout_secs,
            1,
            DAY,
        )?;
        range("server.drain_secs", s.drain_secs, 0, DAY)?;
        range("server.listen_backlog", s.listen_backlog, 1, 65_535)?;
        range("log.buffer_lines", self.log.buffer_lines, 1, 16_777_216)?;
        range("server.worker_threads", s.worker_threads, 0, 1024)?;
        off_or_at_least(
            "server.large_body_bytes_per_sec",
            s.large_body_bytes_per_sec,
        )?;
        range("server.max_connections", s.max_connections, 0, 1 << 24)?;
        range("server.idle_timeout_secs", s.idle_timeout_secs, 1, DAY)?;
        range("timeouts.connect_ms", t.connect_ms, 1, 600_000)?;
        range("timeouts.prefill_secs", t.prefill_secs, 1, DAY)?;
        range(
            "timeouts.decode_first_byte_secs",
            t.decode_first_byte_secs,
            1,
            DAY,
        )?;
        range("timeouts.stream_idle_secs", t.stream_idle_secs, 1, DAY)?;
        range("timeouts.request_secs", t.request_secs, 1, 7 * DAY)?;
        range("retry.max_retries", r.max_retries, 0, 16)?;
        range("retry.max_stream_moves", r.max_stream_moves, 0, 8)?;
        range("retry.move_wait_ms", r.move_wait_ms, 0, 600_000)?;
        range(
            "retry.mid_stream_gap_ceiling_ms",
            r.mid_stream_gap_ceiling_ms,
            10,
            3_600_000,
        )?;
        range_f("retry.budget_ratio", r.budget_ratio, 0.0, 10.0)?;
        range(
            "retry.budget_min_reserve",
            r.budget_min_reserve,
            0,
            1_000_000,
        )?;
        range(
            "retry.budget_move_reserve",
            r.budget_move_reserve,
            0,
            1_000_000,
        )?;
        range_f("health.interval_secs", h.interval_secs, 0.01, DAY as f64)?;
        range_f("health.timeout_secs", h.timeout_secs, 0.01, 3600.0)?;
        range("health.failure_threshold", h.failure_threshold, 1, 1000)?;
        range("health.success_threshold", h.success_threshold, 1, 1000)?;
        range(
            "health.unhealthy_interval_ms",
            h.unhealthy_interval_ms,
            10,
            3_600_000,
        )?;
        range("breaker.failure_threshold", b.failure_threshold, 0, 1000)?;
        range("breaker.open_ms", b.open_ms, 1, DAY * 1000)?;
        // (An open time above the cap is used as is: the cap only bounds the doubling.)
        range("breaker.max_open_ms", b.max_open_ms, 1, DAY * 1000)?;
        range_f("breaker.max_ejection_ratio", b.max_ejection_ratio, 0.0, 1.0)?;
        let permits = tokio::sync::Semaphore::MAX_PERMITS;
        range("admission.max_in_flight", a.max_in_flight, 0, permits)?;
        range("admission.max_queue", a.max_queue, 0, permits)?;
        range(
            "admission.max_bytes_in_flight",
            a.max_bytes_in_flight,
            1 << 20,
            MAX_BYTES,
        )?;
        range(
            "admission.queue_timeout_ms",
            a.queue_timeout_ms,
            1,
            3_600_000,
        )?;
        range(
            "admission.engine_bootstrap_timeout_secs",
            a.engine_bootstrap_timeout_secs,
            1,
            86_400,
        )?;
        range("admission.replicas", a.replicas, 0, 1024)?;
        if a.replica_selector().is_some() && (a.replicas > 0 || a.replica_index.is_some()) {
            return Err(invalid(format!(
                "admission.replica_selector (--replica-selector) counts the replicas and finds this \
                 replica's index from Kubernetes: admission.replicas (--replicas) = {} and \
                 admission.replica_index (--replica-index) = {:?} must be left unset with it \
                 (one source of the count)",
                a.replicas, a.replica_index
            )));
        }
        range_f(
            "admission.prefill_backlog_max_secs",
            a.prefill_backlog_max_secs,
            0.0,
            3600.0,
        )?;
        if let Some(i) = a.replica_index {
            if i >= a.replicas {
                return Err(invalid(format!(
                    "admission.replica_index = {i} is not an index among admission.replicas = {} (0..replicas)",
                    a.replicas
                )));
            }
        }
        range(
            "bootstrap.heartbeat_interval_ms",
            bs.heartbeat_interval_ms,
            10,
            600_000,
        )?;
        range(
            "bootstrap.heartbeat_max_failures",
            bs.heartbeat_max_failures,
            1,
            1000,
        )?;
        range(
            "bootstrap.refresh_interval_ms",
            bs.refresh_interval_ms,
            10,
            3_600_000,
        )?;
        range_f("bootstrap.refresh_jitter", bs.refresh_jitter, 0.0, 0.5)?;
        range_f(
            "bootstrap.max_route_reads_per_sec",
            bs.max_route_reads_per_sec,
            0.01,
            100_000.0,
        )?;
        range("bootstrap.freshness_ms", bs.freshness_ms, 1, 3_600_000)?;
        range(
            "bootstrap.preflight_timeout_ms",
            bs.preflight_timeout_ms,
            1,
            60_000,
        )?;
        range("bootstrap.http_timeout_ms", bs.http_timeout_ms, 1, 600_000)?;
        range(
            "upstream.pool_max_idle_per_host",
            u.pool_max_idle_per_host,
            0,
            65_536,
        )?;
        range(
            "upstream.pool_idle_timeout_secs",
            u.pool_idle_timeout_secs,
            0,
            DAY,
        )?;
        range(
            "upstream.max_answer_bytes",
            u.max_answer_bytes,
            1,
            MAX_BYTES,
        )?;
        range(
            "upstream.max_stream_logprob_bytes",
            u.max_stream_logprob_bytes,
            1,
            MAX_BYTES,
        )?;
        range(
            "upstream.max_stream_logprob_total_bytes",
            u.max_stream_logprob_total_bytes,
            1,
            usize::MAX,
        )?;
        off_or_at_least(
            "upstream.stream_logprob_bytes_per_sec",
            u.stream_logprob_bytes_per_sec,
        )?;
        range_f(
            "policy.cache_aware_balance_factor",
            p.cache_aware_balance_factor,
            1.0,
            1000.0,
        )?;
        range("policy.cache_aware_vnodes", p.cache_aware_vnodes, 1, 1024)?;
        range("policy.cache_aware_slack", p.cache_aware_slack, 0, 64)?;
        if p.load_poll_interval_ms != 0 {
            range(
                "policy.load_poll_interval_ms",
                p.load_poll_interval_ms,
                10,
                3_600_000,
            )?;
        }
        // Settings that only make sense together.
        if t.decode_first_byte_secs >= t.request_secs {
            return Err(invalid(format!(
                "timeouts.decode_first_byte_secs = {} must be below timeouts.request_secs = {}: \
                 the request timeout covers everything before the first byte, so the \
                 first-byte deadline could never fire",
                t.decode_first_byte_secs, t.request_secs
            )));
        }
        // `memory::ByteBudget::largest_charge` (config stays below `memory`).
        if a.max_bytes_in_flight - a.max_bytes_in_flight / 8 < s.max_body_bytes {
            return Err(invalid(format!(
                "admission.max_bytes_in_flight = {} must be at least 8/7 of \
                 server.max_body_bytes = {}: a body of the largest size allowed would never \
                 fit (a large request may fill 7/8 of the budget)",
                a.max_bytes_in_flight, s.max_body_bytes
            )));
        }
        self.log.filter()?;
        progress::validate(&self.progress)?;
        self.capacity.validate()?;
        self.affinity.validate()?;
        self.trace.validate()?;
        ops::validate(self)?;
        models::validate_settings(self)
    }
}
