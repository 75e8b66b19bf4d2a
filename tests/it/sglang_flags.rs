//! SGLang router flags on `pdgate serve`, against the flag lists of SGLang's router itself:
//! `tests/it/fixtures/smg-1.13-launch-help.txt` (`smg launch --help` of smg 1.13) and
//! `sglang-router-0.3.2-launch-router-help.txt` (see `tests/it/fixtures/README.md`). Every flag of that help is mapped (its pdgate setting is
//! asserted), accepted as a no-op (the config is unchanged and a start-up note names it),
//! or refused with a message naming what replaces it; a flag the table does not cover
//! fails the test.

use std::collections::BTreeSet;

use clap::{Args, Command, FromArgMatches};
use pdgate::cli::sglang::{fate, Fate, FLAGS};
use pdgate::cli::{prefill_groups, ServeArgs};
use pdgate::config::{Config, LogFormat, PolicyKind};

/// `smg launch --help` (smg 1.13) and `python -m sglang_router.launch_router --help`
/// (sglang-router 0.3.2, the package SGLang's docs still install).
const FIXTURES: &[&str] = &[
    include_str!("fixtures/smg-1.13-launch-help.txt"),
    include_str!("fixtures/sglang-router-0.3.2-launch-router-help.txt"),
];

/// Every long flag the help defines (aliases included): the option lines of argparse's
/// help, up to the description.
fn fixture_flags() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in FIXTURES
        .iter()
        .flat_map(|f| f.lines())
        .filter(|l| l.starts_with("  -"))
    {
        let def = line.split("   ").next().unwrap_or("");
        for w in def.split([' ', ',']) {
            if let Some(name) = w.strip_prefix("--") {
                if !name.is_empty() && name != "help" {
                    out.insert(name.to_string());
                }
            }
        }
    }
    out
}

type Notes = Vec<(bool, String)>;

/// `pdgate serve ARGS` as the binary parses it, up to the validated config.
fn serve(args: &[&str]) -> Result<(Config, Notes), String> {
    let cmd = ServeArgs::augment_args(Command::new("serve"));
    let m = cmd
        .try_get_matches_from(std::iter::once("serve").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    let a = ServeArgs::from_arg_matches(&m).map_err(|e| e.to_string())?;
    let notes = a.sglang_compat.notes();
    let groups = prefill_groups(&m).map_err(|e| e.to_string())?;
    a.into_config(groups)
        .map(|c| (c, notes))
        .map_err(|e| e.to_string())
}

type Check = fn(&Config) -> bool;

/// Every mapped flag: a command line and what it must set.
const MAPPED: &[(&str, &[&str], Check)] = &[
    (
        "load-monitor-interval",
        &["--load-monitor-interval", "2"],
        |c| c.policy.load_poll_interval_ms == 2000,
    ),
    (
        "disable-load-monitoring",
        &["--load-monitor-interval", "2", "--disable-load-monitoring"],
        |c| c.policy.load_poll_interval_ms == 0,
    ),
    ("host", &["--host", "0.0.0.0"], |c| {
        c.server.host.to_string() == "0.0.0.0"
    }),
    ("port", &["--port", "30080"], |c| c.server.port == 30080),
    (
        "upstream-pool-idle-timeout-secs",
        &["--upstream-pool-idle-timeout-secs", "3"],
        |c| c.upstream.pool_idle_timeout_secs == 3,
    ),
    ("policy", &["--policy", "prefix_hash"], |c| {
        c.policy.prefill == PolicyKind::CacheAware && c.policy.decode == PolicyKind::CacheAware
    }),
    (
        "prefill-policy",
        &["--policy", "random", "--prefill-policy", "power_of_two"],
        |c| c.policy.prefill == PolicyKind::PowerOfTwo && c.policy.decode == PolicyKind::Random,
    ),
    ("decode-policy", &["--decode-policy", "cache_aware"], |c| {
        c.policy.decode == PolicyKind::CacheAware
            && c.policy.prefill == Config::default().policy.prefill
    }),
    (
        "prefix-hash-load-factor",
        &["--prefix-hash-load-factor", "2.5"],
        |c| c.policy.cache_aware_balance_factor == 2.5,
    ),
    (
        "max-payload-size",
        &["--max-payload-size", "67108864"],
        |c| c.server.max_body_bytes == 64 << 20,
    ),
    (
        "stream-body-stall-timeout-secs",
        &["--stream-body-stall-timeout-secs", "45"],
        |c| c.server.body_read_timeout_secs == 45,
    ),
    (
        "prefill",
        &[
            "--prefill",
            "http://10.0.0.1:30000",
            "9000",
            "--prefill",
            "http://10.0.0.2:30000",
            "none",
        ],
        |c| {
            c.prefill.len() == 2
                && c.prefill[0].bootstrap_port == Some(9000)
                && c.prefill[1].bootstrap_port.is_none()
        },
    ),
    (
        "decode",
        &[
            "--decode",
            "http://10.0.0.3:30001",
            "--decode",
            "http://10.0.0.4:30001",
        ],
        |c| c.decode.len() == 2,
    ),
    (
        "service-discovery",
        &["--service-discovery", "--prefill-selector", "app=p"],
        |c| c.discovery.enabled,
    ),
    (
        "service-discovery-port",
        &["--service-discovery-port", "8080"],
        |c| c.discovery.port == 8080,
    ),
    (
        "service-discovery-namespace",
        &["--service-discovery-namespace", "llm"],
        |c| c.discovery.namespace.as_deref() == Some("llm"),
    ),
    (
        "prefill-selector",
        &["--prefill-selector", "app=sglang", "role=prefill"],
        |c| c.discovery.prefill_selector.as_deref() == Some("app=sglang,role=prefill"),
    ),
    (
        "decode-selector",
        &["--decode-selector", "app=sglang", "role=decode"],
        |c| c.discovery.decode_selector.as_deref() == Some("app=sglang,role=decode"),
    ),
    (
        "selector",
        &["--selector", "app=sglang", "role=worker"],
        |c| c.discovery.regular_selector.as_deref() == Some("app=sglang,role=worker"),
    ),
    (
        "worker-urls",
        &["--worker-urls", "http://w0:30000", "http://w1:30000"],
        |c| {
            c.worker
                .iter()
                .map(|w| w.url.as_str())
                .eq(["http://w0:30000", "http://w1:30000"])
        },
    ),
    ("log-level", &["--log-level", "warning"], |c| {
        c.log.filter().is_ok_and(|f| f == "warn")
    }),
    ("log-json", &["--log-json"], |c| {
        c.log.format == LogFormat::Json
    }),
    ("enable-trace", &["--enable-trace"], |c| {
        c.trace.enabled && c.trace.endpoint == "http://127.0.0.1:4318"
    }),
    (
        "otlp-traces-endpoint",
        &["--enable-trace", "--otlp-traces-endpoint", "collector:4318"],
        |c| c.trace.enabled && c.trace.traces_url() == "http://collector:4318/v1/traces",
    ),
    ("prometheus-port", &["--prometheus-port", "29100"], |c| {
        c.metrics_listener.enabled && c.metrics_listener.port == 29100
    }),
    (
        "prometheus-host",
        &[
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            "29100",
        ],
        |c| c.metrics_listener.enabled && c.metrics_listener.host.to_string() == "127.0.0.1",
    ),
    (
        "request-timeout-secs",
        &["--request-timeout-secs", "1800"],
        |c| c.timeouts.request_secs == 1800,
    ),
    (
        "shutdown-grace-period-secs",
        &["--shutdown-grace-period-secs", "12"],
        |c| c.server.drain_secs == 12,
    ),
    (
        "header-read-timeout-secs",
        &["--header-read-timeout-secs", "7"],
        |c| c.server.header_read_timeout_secs == 7,
    ),
    (
        "idle-connection-timeout-secs",
        &["--idle-connection-timeout-secs", "90"],
        |c| c.server.idle_timeout_secs == 90,
    ),
    (
        "max-concurrent-requests",
        &["--max-concurrent-requests", "0"],
        |c| c.admission.max_in_flight == 0,
    ),
    ("queue-size", &["--queue-size", "7"], |c| {
        c.admission.max_queue == 7
    }),
    ("queue-timeout-secs", &["--queue-timeout-secs", "5"], |c| {
        c.admission.queue_timeout_ms == 5000
    }),
    ("retry-max-retries", &["--retry-max-retries", "4"], |c| {
        c.retry.max_retries == 4
    }),
    ("disable-retries", &["--disable-retries"], |c| {
        c.retry.max_retries == 0 && c.retry.max_stream_moves == 0
    }),
    (
        "cb-failure-threshold",
        &["--cb-failure-threshold", "9"],
        |c| c.breaker.failure_threshold == 9,
    ),
    (
        "cb-timeout-duration-secs",
        &["--cb-timeout-duration-secs", "60"],
        |c| c.breaker.open_ms == 60_000 && c.breaker.max_open_ms >= 60_000,
    ),
    (
        "disable-circuit-breaker",
        &["--disable-circuit-breaker"],
        |c| c.breaker.failure_threshold == 0,
    ),
    (
        "health-failure-threshold",
        &["--health-failure-threshold", "4"],
        |c| c.health.failure_threshold == 4,
    ),
    (
        "health-success-threshold",
        &["--health-success-threshold", "3"],
        |c| c.health.success_threshold == 3,
    ),
    (
        "health-check-timeout-secs",
        &["--health-check-timeout-secs", "2.5"],
        |c| c.health.timeout_secs == 2.5,
    ),
    (
        "health-check-interval-secs",
        &["--health-check-interval-secs", "7"],
        |c| c.health.interval_secs == 7.0,
    ),
    ("routing-key-override", &["--routing-key-override"], |c| {
        c.affinity.sticky
    }),
    ("sticky-sessions", &["--sticky-sessions"], |c| {
        c.affinity.sticky
    }),
    ("max-idle-secs", &["--max-idle-secs", "600"], |c| {
        c.affinity.sticky_idle_secs == 600 && !c.affinity.sticky
    }),
    (
        "sticky-key-idle-secs",
        &["--sticky-sessions", "--sticky-key-idle-secs", "900"],
        |c| c.affinity.sticky_idle_secs == 900 && c.affinity.sticky,
    ),
    (
        "routing-key-headers",
        &[
            "--routing-key-headers",
            "X-Routing-Key",
            "x-smg-routing-key",
        ],
        |c| c.affinity.headers == ["x-routing-key", "x-smg-routing-key"] && !c.affinity.sticky,
    ),
    ("api-key", &["--api-key", "sk-1"], |c| {
        let k = Some("sk-1".to_string());
        c.auth.api_key == k && c.admin.api_key == k && c.upstream.api_key == k
    }),
];

#[test]
fn every_flag_of_sglang_router_is_covered() {
    let fixture = fixture_flags();
    assert!(
        fixture.len() > 200,
        "the fixture lost its flags: {}",
        fixture.len()
    );
    let table: BTreeSet<String> = FLAGS.iter().map(|f| f.name.to_string()).collect();
    let missing: Vec<&String> = fixture.difference(&table).collect();
    assert!(
        missing.is_empty(),
        "SGLang router flags without a fate: {missing:?}"
    );
    let stale: Vec<&String> = table.difference(&fixture).collect();
    assert!(
        stale.is_empty(),
        "flags in the table but not in SGLang's help: {stale:?}"
    );
    let mapped: BTreeSet<&str> = MAPPED.iter().map(|(n, _, _)| *n).collect();
    for f in FLAGS.iter().filter(|f| f.fate == Fate::Mapped) {
        assert!(
            mapped.contains(f.name),
            "--{} is mapped but has no case",
            f.name
        );
    }
}

#[test]
fn mapped_flags_set_their_setting() {
    for (name, args, check) in MAPPED {
        assert_eq!(fate(name), Some(Fate::Mapped), "--{name}");
        let (cfg, _) = serve(args).unwrap_or_else(|e| panic!("--{name}: {e}"));
        assert!(check(&cfg), "--{name} {args:?} did not set its setting");
    }
}

#[test]
fn other_flags_are_no_ops_or_refused_with_their_replacement() {
    let plain = serve(&[]).unwrap().0;
    for f in FLAGS.iter().filter(|f| f.fate != Fate::Mapped) {
        let flag = format!("--{}", f.name);
        // With and without a value: SGLang's flags take none, one or several.
        for args in [vec![flag.as_str()], vec![flag.as_str(), "1", "2"]] {
            let got = serve(&args);
            match f.fate {
                Fate::Always(why) | Fate::Ignored(why) => {
                    let (cfg, notes) = got.unwrap_or_else(|e| panic!("{flag}: {e}"));
                    assert_eq!(cfg, plain, "{flag} is a no-op but changed the config");
                    let warn = matches!(f.fate, Fate::Ignored(_));
                    assert!(
                        notes
                            .iter()
                            .any(|(w, l)| *w == warn && l.contains(&flag) && l.contains(why)),
                        "{flag}: no start-up note: {notes:?}"
                    );
                }
                Fate::Refused(why) | Fate::Only { why, .. } => {
                    let e = got.expect_err(&flag);
                    assert!(e.contains(&flag) && e.contains(why), "{flag}: {e}");
                    assert!(!e.contains("unexpected argument"), "{flag}: {e}");
                }
                Fate::Mapped => unreachable!(),
            }
        }
        if let Fate::Only { value, why } = f.fate {
            let (cfg, notes) = serve(&[&flag, value]).unwrap_or_else(|e| panic!("{flag}: {e}"));
            assert_eq!(cfg, plain, "{flag} {value}");
            assert!(
                notes.iter().any(|(_, l)| l.contains(why)),
                "{flag}: {notes:?}"
            );
        }
    }
}

#[test]
fn sglang_policies_map_or_say_what_replaces_them() {
    let cases: &[(&str, Result<PolicyKind, &str>)] = &[
        ("cache_aware", Ok(PolicyKind::CacheAware)),
        ("prefix_hash", Ok(PolicyKind::CacheAware)),
        ("round_robin", Ok(PolicyKind::RoundRobin)),
        ("power_of_two", Ok(PolicyKind::PowerOfTwo)),
        ("random", Ok(PolicyKind::Random)),
        ("manual", Err("routing key header")),
        ("consistent_hashing", Err("routing key header")),
        ("least_load", Err("power_of_two")),
        ("passthrough", Err("round_robin")),
        ("bucket", Err("round_robin")),
        ("nope", Err("not a pdgate policy")),
    ];
    for (flag, _) in [
        ("--policy", 0),
        ("--prefill-policy", 1),
        ("--decode-policy", 2),
    ] {
        for (name, want) in cases {
            match (serve(&[flag, name]), want) {
                (Ok((c, _)), Ok(p)) => {
                    let got = if flag == "--decode-policy" {
                        c.policy.decode
                    } else {
                        c.policy.prefill
                    };
                    assert_eq!(got, *p, "{flag} {name}");
                }
                (Err(e), Err(text)) => {
                    assert!(e.contains(text) && e.contains(name), "{flag} {name}: {e}")
                }
                (got, want) => panic!("{flag} {name}: {:?} vs {want:?}", got.map(|g| g.0.policy)),
            }
        }
    }
}

/// `--routing-key-headers`: no value reads no header; a name that is not a header name is
/// refused at start, naming the setting.
#[test]
fn routing_key_headers_are_checked_at_start() {
    type Case<'a> = (&'a [&'a str], Result<&'a [&'a str], &'a str>);
    let cases: &[Case] = &[
        (&["--routing-key-headers"], Ok(&[])),
        (&[], Ok(&["x-smg-routing-key", "x-session-id"])),
        (
            &["--routing-key-headers", "X-Session-Id"],
            Ok(&["x-session-id"]),
        ),
        (
            &["--routing-key-headers", "bad header"],
            Err("affinity.headers"),
        ),
        (
            &[
                "--routing-key-headers",
                "x-a",
                "x-b",
                "x-c",
                "x-d",
                "x-e",
                "x-f",
                "x-g",
                "x-h",
                "x-i",
            ],
            Err("at most 8"),
        ),
    ];
    for (args, want) in cases {
        match (serve(args), want) {
            (Ok((c, _)), Ok(h)) => assert_eq!(c.affinity.headers, *h, "{args:?}"),
            (Err(e), Err(w)) => assert!(e.contains(w), "{args:?}: {e}"),
            (got, want) => panic!("{args:?}: {:?} vs {want:?}", got.map(|g| g.0.affinity)),
        }
    }
}

/// A launch line from SGLang's PD docs, with the flags operators add, starts as is.
#[test]
fn an_sglang_pd_launch_line_is_accepted() {
    let (cfg, notes) = serve(&[
        "--pd-disaggregation",
        "--prefill",
        "http://prefill1:30000",
        "8998",
        "--prefill",
        "http://prefill2:30000",
        "--decode",
        "http://decode1:30001",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--policy",
        "cache_aware",
        "--dp-aware",
        "--prometheus-host",
        "0.0.0.0",
        "--prometheus-port",
        "29100",
        "--max-concurrent-requests",
        "-1",
        "--queue-size",
        "100",
        "--queue-timeout-secs",
        "60",
        "--retry-max-retries",
        "5",
        "--retry-initial-backoff-ms",
        "50",
        "--cb-failure-threshold",
        "10",
        "--cb-success-threshold",
        "3",
        "--worker-startup-timeout-secs",
        "1800",
        "--health-check-endpoint",
        "/health",
        "--request-id-headers",
        "x-request-id",
        "--log-level",
        "warning",
    ])
    .unwrap();
    assert_eq!(cfg.prefill.len(), 2);
    assert_eq!(
        cfg.admission.max_in_flight,
        Config::default().admission.max_in_flight,
        "-1 keeps pdgate's default"
    );
    assert_eq!(cfg.admission.max_queue, 100);
    assert!(cfg.metrics_listener.enabled);
    assert!(
        notes
            .iter()
            .any(|(w, l)| *w && l.contains("--retry-initial-backoff-ms")),
        "{notes:?}"
    );
    assert!(
        notes.iter().any(|(w, l)| !*w && l.contains("--dp-aware")),
        "{notes:?}"
    );
}

#[test]
fn the_metrics_port_may_not_be_the_admin_port() {
    let e = serve(&["--prometheus-port", "29000"]).unwrap_err();
    assert!(
        e.contains("admin.port") && e.contains("--admin-port"),
        "{e}"
    );
    assert!(serve(&["--prometheus-port", "29000", "--admin-port", "29001"]).is_ok());
}

/// The docs' table (docs/coming-from-sglang.md) names every SGLang router flag.
#[test]
fn the_docs_map_every_flag() {
    let readme = include_str!("../../docs/coming-from-sglang.md");
    let at = readme
        .find("Every SGLang router flag:")
        .expect("the docs' SGLang flag table");
    let table = &readme[at..];
    let missing: Vec<String> = fixture_flags()
        .into_iter()
        .filter(|f| !table.contains(&format!("`--{f}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "SGLang router flags missing from docs/coming-from-sglang.md: {missing:?}"
    );
}

/// `--api-key K` as SGLang's router means it, on a running router: the client key (a
/// request without it gets 401 and sends no leg), the admin token, and the key the engines
/// get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_client_key_admin_token_and_engine_key() {
    use crate::support::common::{start_with_admin, GEN};
    use pdgate_sim::EngineConfig;
    let (flags, _) = serve(&["--api-key", "sk-one"]).unwrap();
    let env = start_with_admin(
        vec![crate::support::common::fast_engine(EngineConfig::prefill(
            1,
        ))],
        vec![crate::support::common::fast_engine(EngineConfig::decode(1))],
        |c| {
            c.auth = flags.auth.clone();
            c.admin = pdgate::config::AdminConfig {
                host: c.admin.host,
                port: c.admin.port,
                ..flags.admin.clone()
            };
            c.upstream.api_key = flags.upstream.api_key.clone();
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    async fn post(
        env: &crate::support::common::Env,
        auth: Option<&str>,
    ) -> hyper::Response<hyper::body::Incoming> {
        let mut h = vec![("content-type", "application/json")];
        if let Some(a) = auth {
            h.push(("authorization", a));
        }
        env.send("POST", "/generate", &h, GEN.to_string()).await
    }
    assert_eq!(post(&env, None).await.status(), 401);
    assert_eq!(post(&env, Some("Bearer sk-other")).await.status(), 401);
    assert_eq!(
        env.cluster.decodes[0].last_generate_headers().len(),
        0,
        "a refused request sent a leg"
    );
    let ok = post(&env, Some("Bearer sk-one")).await;
    assert_eq!(ok.status(), 200);
    let _ = http_body_util::BodyExt::collect(ok.into_body()).await;
    for e in [&env.cluster.prefills[0], &env.cluster.decodes[0]] {
        let seen = e
            .last_generate_headers()
            .into_iter()
            .find(|(k, _)| k == "authorization")
            .map(|(_, v)| v);
        assert_eq!(
            seen.as_deref(),
            Some("Bearer sk-one"),
            "the engines get the key"
        );
    }
    assert_eq!(env.admin("GET", "/workers", None, "").await.0, 401);
    assert_eq!(
        env.admin("GET", "/workers", Some("sk-other"), "").await.0,
        401
    );
    assert_eq!(
        env.admin("GET", "/workers", Some("sk-one"), "").await.0,
        200
    );
}

/// `--log-level` takes SGLang's spellings and refuses what is not a level (tracing would
/// take an unknown word for a target name and silence every line).
#[test]
fn log_levels_are_sglang_spellings_or_refused() {
    let cases: &[(&str, Option<&str>)] = &[
        ("info", Some("info")),
        ("warning", Some("warn")),
        ("WARNING", Some("warn")),
        ("critical", Some("error")),
        ("error", Some("error")),
        ("debug", Some("debug")),
        ("off", Some("off")),
        ("pdgate=debug,warning", Some("pdgate=debug,warn")),
        ("pdgate::pd=trace, critical", Some("pdgate::pd=trace,error")),
        ("warnign", None),
        ("pdgate", None),
        ("pdgate=loud", None),
        ("=info", None),
        ("", None),
        (" , ", None),
    ];
    for (level, want) in cases {
        let cfg = Config {
            log: pdgate::config::LogConfig {
                level: level.to_string(),
                ..Default::default()
            },
            ..Default::default()
        };
        match (cfg.validate(), want) {
            (Ok(()), Some(w)) => assert_eq!(cfg.log.filter().unwrap(), *w, "{level:?}"),
            (Err(e), None) => assert!(e.to_string().contains("log.level"), "{level:?}: {e}"),
            (got, want) => panic!("{level:?}: {got:?}, want {want:?}"),
        }
    }
}
