//! The config's parsing and validation, table-driven.

use super::*;

#[test]
fn unknown_keys_are_named() {
    let err = Config::from_toml("[server]\nprot = 1\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("prot"), "{err}");
    let err = Config::from_toml("[timeouts]\nprefill_secs = \"x\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("prefill_secs"), "{err}");
}

#[test]
fn full_file_parses_and_validates() {
    let cfg = Config::from_toml(
        r#"
        [server]
        port = 9000
        [[prefill]]
        url = "http://10.0.0.1:30000"
        bootstrap_port = 8998
        [[decode]]
        url = "http://10.0.0.2:30001"
        [policy]
        prefill = "random"
        [contract]
        mode = "pinned"
        "#,
    )
    .unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.server.port, 9000);
    assert_eq!(cfg.policy.prefill, PolicyKind::Random);
    assert_eq!(cfg.policy.decode, PolicyKind::RoundRobin);
    assert_eq!(cfg.contract.mode, ContractMode::Pinned);
    assert_eq!(cfg.prefill[0].bootstrap_port, Some(8998));
}

#[test]
fn the_example_file_loads() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/pdgate.example.toml");
    let cfg = Config::load(&path).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.prefill.len(), 2);
    assert_eq!(cfg.decode.len(), 2);
}

/// SGLang and vLLM serve with uvicorn's `timeout_keep_alive=5`: pdgate must give up an
/// idle engine connection before the engine closes it, by default and in the example.
#[test]
fn idle_engine_connections_expire_before_the_engines_keep_alive() {
    const UVICORN_KEEP_ALIVE_SECS: u64 = 5;
    let default = UpstreamConfig::default().pool_idle_timeout_secs;
    assert!(default < UVICORN_KEEP_ALIVE_SECS, "{default}");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/pdgate.example.toml");
    let example = Config::load(&path).unwrap().upstream.pool_idle_timeout_secs;
    assert_eq!(example, default);
}

#[test]
fn bad_values_are_named() {
    let mut cfg = Config::default();
    cfg.health.failure_threshold = 0;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("health.failure_threshold"), "{err}");
    let mut cfg = Config::default();
    cfg.decode.push(DecodeWorkerConfig {
        url: "ftp://x".into(),
        model: None,
    });
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("decode[0].url"), "{err}");
}

#[test]
fn values_that_would_panic_are_refused_with_key_value_and_range() {
    type Tweak = fn(&mut Config);
    let cases: &[(Tweak, &str)] = &[
        (
            |c| c.admission.max_in_flight = usize::MAX,
            "admission.max_in_flight = 18446744073709551615 is out of range (allowed: 0..=",
        ),
        (
            |c| c.health.interval_secs = 1e300,
            "health.interval_secs = 1000000000000000",
        ),
        (
            |c| c.health.timeout_secs = f64::INFINITY,
            "health.timeout_secs = inf is out of range",
        ),
        (
            |c| c.health.interval_secs = -1.0,
            "health.interval_secs = -1 is out of range (allowed: 0.01..=86400)",
        ),
        (
            |c| c.timeouts.request_secs = u64::MAX,
            "timeouts.request_secs = 18446744073709551615 is out of range (allowed: 1..=604800)",
        ),
        (
            |c| c.timeouts.stream_idle_secs = u64::MAX,
            "timeouts.stream_idle_secs = 18446744073709551615",
        ),
        (
            |c| c.server.drain_secs = u64::MAX,
            "server.drain_secs = 18446744073709551615",
        ),
        (
            |c| c.breaker.max_open_ms = u64::MAX,
            "breaker.max_open_ms = 18446744073709551615 is out of range (allowed: 1..=86400000)",
        ),
        (
            |c| c.health.unhealthy_interval_ms = 0,
            "health.unhealthy_interval_ms = 0 is out of range (allowed: 10..=3600000)",
        ),
        (
            |c| c.retry.budget_min_reserve = u32::MAX,
            "retry.budget_min_reserve = 4294967295",
        ),
        (
            |c| c.timeouts.decode_first_byte_secs = 600,
            "timeouts.decode_first_byte_secs = 600 must be below timeouts.request_secs = 600",
        ),
        (
            |c| c.progress.eject_after_stalls = 1,
            "progress.eject_after_stalls = 1 is out of range (allowed: 2..=1000)",
        ),
        (
            |c| c.progress.window = 65,
            "progress.window = 65 is out of range (allowed: 1..=64)",
        ),
        (
            |c| c.progress.multiplier = f64::NAN,
            "progress.multiplier = NaN is out of range",
        ),
        (
            |c| c.progress.prefill_floor_ms = 40_000,
            "progress.prefill_floor_ms = 40000 must not be above progress.prefill_ceiling_ms = 30000",
        ),
        (
            |c| c.server.large_body_bytes_per_sec = 1000,
            "server.large_body_bytes_per_sec = 1000 is out of range (allowed: 0 (no limit) or 65536..)",
        ),
        (
            |c| c.upstream.stream_logprob_bytes_per_sec = 1,
            "upstream.stream_logprob_bytes_per_sec = 1 is out of range",
        ),
    ];
    for (tweak, want) in cases {
        let mut cfg = Config::default();
        tweak(&mut cfg);
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(want), "{err} does not contain {want}");
    }
    // Within range on both ends is fine.
    let mut cfg = Config::default();
    cfg.admission.max_in_flight = tokio::sync::Semaphore::MAX_PERMITS;
    cfg.health.interval_secs = 86_400.0;
    cfg.timeouts.request_secs = 7 * 86_400;
    cfg.server.large_body_bytes_per_sec = 0;
    cfg.upstream.stream_logprob_bytes_per_sec = 64 << 10;
    cfg.validate().unwrap();
    assert_eq!(cfg.health.interval(), Duration::from_secs(86_400));
}

#[test]
fn policy_keys_parse_and_are_checked() {
    let cfg = Config::from_toml(
        "[policy]\nprefill = \"cache_aware\"\ndecode = \"power_of_two\"\n\
         cache_aware_balance_factor = 1.5\ncache_aware_vnodes = 40\nload_poll_interval_ms = 250\n",
    )
    .unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.policy.prefill, PolicyKind::CacheAware);
    assert_eq!(cfg.policy.decode, PolicyKind::PowerOfTwo);
    assert_eq!(cfg.policy.cache_aware_vnodes, 40);
    assert_eq!(
        cfg.policy.load_poll_interval(),
        Some(Duration::from_millis(250))
    );
    assert_eq!(
        Config::default().policy.load_poll_interval(),
        Some(Duration::from_secs(1)),
        "on by default"
    );
    let err = Config::from_toml("[policy]\ncache_aware_vnode = 3\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("cache_aware_vnode"), "{err}");
    for (key, f) in [
        (
            "policy.cache_aware_balance_factor",
            (|c: &mut Config| c.policy.cache_aware_balance_factor = 0.9) as fn(&mut Config),
        ),
        ("policy.cache_aware_balance_factor", |c| {
            c.policy.cache_aware_balance_factor = f64::NAN
        }),
        ("policy.cache_aware_vnodes", |c| {
            c.policy.cache_aware_vnodes = 0
        }),
        ("policy.load_poll_interval_ms", |c| {
            c.policy.load_poll_interval_ms = 5
        }),
    ] {
        let mut cfg = Config::default();
        f(&mut cfg);
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key), "{err}");
    }
}

/// Two listeners on one address are refused at start, naming both settings and the flags
/// that move them; port 0 (a free port each) and distinct addresses are fine.
#[test]
fn listeners_need_an_address_each() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let mut cfg = Config::default();
    cfg.admin.port = cfg.server.port;
    let err = cfg.validate().unwrap_err().to_string();
    for part in ["server.port", "admin.port", "--port", "--admin-port"] {
        assert!(err.contains(part), "{err}");
    }
    // 0.0.0.0 overlaps every address of the port.
    cfg.server.host = ip("0.0.0.0");
    assert!(cfg.validate().is_err());
    cfg.server.host = ip("127.0.0.1");
    cfg.admin.host = ip("127.0.0.2");
    assert!(cfg.validate().is_ok(), "two addresses, one port");
    cfg.admin.enabled = false;
    cfg.admin.host = ip("127.0.0.1");
    assert!(cfg.validate().is_ok(), "no admin listener");
    let mut cfg = Config::default();
    cfg.metrics_listener.enabled = true;
    cfg.metrics_listener.port = cfg.server.port;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(
        err.contains("metrics_listener.port") && err.contains("--prometheus-port"),
        "{err}"
    );
    let mut cfg = Config::default();
    cfg.server.port = 0;
    cfg.admin.port = 0;
    assert!(cfg.validate().is_ok(), "port 0 picks a free port each");
}

#[test]
fn the_replica_count_has_one_source() {
    // (replicas, replica_index, replica_selector, the error's words, or None: valid)
    type Case<'a> = (u32, Option<u32>, Option<&'a str>, Option<&'a str>);
    let cases: &[Case] = &[
        (0, None, None, None),
        (3, Some(2), None, None),
        (3, None, None, None),
        (0, None, Some("app.kubernetes.io/name=pdgate"), None),
        // Empty is off: the static count applies.
        (3, Some(0), Some(" "), None),
        (
            3,
            None,
            Some("app=pdgate"),
            Some("admission.replica_selector (--replica-selector) counts the replicas"),
        ),
        (
            0,
            Some(0),
            Some("app=pdgate"),
            Some("admission.replica_index (--replica-index) = Some(0) must be left unset"),
        ),
        (
            3,
            Some(3),
            None,
            Some("admission.replica_index = 3 is not an index among admission.replicas = 3"),
        ),
        (
            1025,
            None,
            None,
            Some("admission.replicas = 1025 is out of range"),
        ),
    ];
    for (replicas, index, sel, want) in cases {
        let mut cfg = Config::default();
        cfg.admission.replicas = *replicas;
        cfg.admission.replica_index = *index;
        cfg.admission.replica_selector = sel.map(str::to_string);
        match (cfg.validate(), want) {
            (Ok(()), None) => {}
            (Err(e), Some(w)) => assert!(e.to_string().contains(w), "{e} lacks {w}"),
            (got, _) => panic!("{replicas} {index:?} {sel:?}: {got:?}"),
        }
    }
    let cfg = Config::from_toml("[admission]\nreplica_selector = \" app=pdgate \"\n").unwrap();
    assert_eq!(cfg.admission.replica_selector(), Some("app=pdgate"));
}
