//! `pdgate check` against simulated engines: a healthy fleet passes every check, each
//! misconfiguration fails exactly the checks that name it, `--probe-request` sends one
//! request end to end, and the binary's exit codes and `--json` output.

use pdgate::check::{self, CheckOptions, Report};
use pdgate::config::{Config, ContractMode, DecodeWorkerConfig, PrefillWorkerConfig};
use pdgate_sim::{EngineConfig, Faults, SimCluster};

use crate::support::common::{add_sim_workers, fast_config, fast_engine};

/// How a case lists the cluster's engines in the router's configuration.
type Wire = fn(&SimCluster, &mut Config);

struct Case {
    name: &'static str,
    prefill: Vec<EngineConfig>,
    decode: Vec<EngineConfig>,
    wire: Wire,
    mode: ContractMode,
    /// The names of the checks expected to fail, in report order.
    failed: &'static [&'static str],
}

fn as_is(c: &SimCluster, cfg: &mut Config) {
    add_sim_workers(cfg, c);
}

fn with_faults(mut e: EngineConfig, faults: Faults) -> EngineConfig {
    e.faults = faults;
    e
}

async fn run_case(
    prefill: &[EngineConfig],
    decode: &[EngineConfig],
    wire: Wire,
    mode: ContractMode,
    opts: CheckOptions,
) -> Report {
    let prefill: Vec<_> = prefill.iter().cloned().map(fast_engine).collect();
    let decode: Vec<_> = decode.iter().cloned().map(fast_engine).collect();
    let cluster = SimCluster::spawn(&prefill, &decode)
        .await
        .expect("sim cluster");
    let mut cfg = fast_config();
    cfg.contract.mode = mode;
    wire(&cluster, &mut cfg);
    check::run(&cfg, opts).await
}

fn cases() -> Vec<Case> {
    let p2 = EngineConfig::prefill(2);
    let d2 = EngineConfig::decode(2);
    let modulo = ContractMode::Modulo;
    vec![
        Case {
            name: "healthy fleet",
            prefill: vec![p2.clone(), p2.clone()],
            decode: vec![d2.clone(), d2.clone()],
            wire: as_is,
            mode: modulo,
            failed: &[],
        },
        Case {
            name: "a decode engine given as a prefill",
            prefill: vec![],
            decode: vec![d2.clone(), d2.clone()],
            wire: |c, cfg| {
                cfg.prefill.push(PrefillWorkerConfig {
                    url: c.decodes[0].url(),
                    bootstrap_port: None,
                    bootstrap_host: None,
                    model: None,
                });
                cfg.decode.push(DecodeWorkerConfig {
                    url: c.decodes[1].url(),
                    model: None,
                });
            },
            mode: modulo,
            failed: &["role"],
        },
        Case {
            name: "a prefill that does not follow the bootstrap room, under modulo",
            prefill: vec![EngineConfig {
                load_balance_method: "round_robin".into(),
                ..p2.clone()
            }],
            decode: vec![d2.clone()],
            wire: as_is,
            mode: modulo,
            failed: &["load_balance_method", "contract_mode"],
        },
        Case {
            name: "the same prefill under pinned",
            prefill: vec![EngineConfig {
                load_balance_method: "round_robin".into(),
                ..p2.clone()
            }],
            decode: vec![d2.clone()],
            wire: as_is,
            mode: ContractMode::Pinned,
            failed: &[],
        },
        Case {
            name: "a prefill given another prefill's bootstrap port",
            prefill: vec![p2.clone(), p2.clone()],
            decode: vec![d2.clone()],
            wire: |c, cfg| {
                add_sim_workers(cfg, c);
                cfg.prefill[0].bootstrap_port = c.prefills[1].bootstrap_port();
                cfg.prefill.truncate(1);
            },
            mode: modulo,
            failed: &["bootstrap_owner"],
        },
        Case {
            name: "two prefills given one bootstrap server",
            prefill: vec![p2.clone(), p2.clone()],
            decode: vec![d2.clone()],
            wire: |c, cfg| {
                add_sim_workers(cfg, c);
                cfg.prefill[1].bootstrap_port = c.prefills[0].bootstrap_port();
            },
            mode: modulo,
            failed: &["bootstrap_owner", "bootstrap_shared"],
        },
        Case {
            name: "a decode serving another model",
            prefill: vec![p2.clone()],
            decode: vec![EngineConfig {
                model: "another-model".into(),
                ..d2.clone()
            }],
            wire: as_is,
            mode: modulo,
            failed: &["model", "model"],
        },
        Case {
            name: "a new weight version's prefill without its decode",
            prefill: vec![
                p2.clone(),
                EngineConfig {
                    weight_version: "v2".into(),
                    ..p2.clone()
                },
            ],
            decode: vec![d2.clone()],
            wire: as_is,
            mode: modulo,
            failed: &["model"],
        },
        Case {
            name: "a decode with a shorter context",
            prefill: vec![p2.clone()],
            decode: vec![EngineConfig {
                context_length: 1024,
                ..d2.clone()
            }],
            wire: as_is,
            mode: modulo,
            failed: &["context_length"],
        },
        Case {
            name: "a DP 1 prefill without follow_bootstrap_room, under modulo",
            prefill: vec![EngineConfig {
                load_balance_method: "round_robin".into(),
                ..EngineConfig::prefill(1)
            }],
            decode: vec![d2.clone()],
            wire: as_is,
            mode: modulo,
            failed: &[],
        },
        Case {
            name: "page size mismatch",
            prefill: vec![p2.clone()],
            decode: vec![EngineConfig {
                page_size: 16,
                ..d2.clone()
            }],
            wire: as_is,
            mode: modulo,
            failed: &["model", "page_size"],
        },
        Case {
            name: "KV dtype mismatch",
            prefill: vec![EngineConfig {
                kv_cache_dtype: "fp8_e5m2".into(),
                ..p2.clone()
            }],
            decode: vec![d2.clone()],
            wire: as_is,
            mode: modulo,
            failed: &["model", "kv_cache_dtype"],
        },
        Case {
            name: "bootstrap server down",
            prefill: vec![with_faults(
                p2.clone(),
                Faults {
                    bootstrap_down: true,
                    ..Faults::default()
                },
            )],
            decode: vec![d2.clone()],
            wire: as_is,
            mode: modulo,
            failed: &["bootstrap_health"],
        },
        Case {
            name: "a rank not registered",
            prefill: vec![with_faults(
                p2.clone(),
                Faults {
                    unregistered_ranks: vec![1],
                    ..Faults::default()
                },
            )],
            decode: vec![d2.clone()],
            wire: as_is,
            mode: modulo,
            failed: &["bootstrap_registered"],
        },
        Case {
            name: "an engine down",
            prefill: vec![p2.clone()],
            decode: vec![with_faults(
                d2.clone(),
                Faults {
                    down: true,
                    ..Faults::default()
                },
            )],
            wire: as_is,
            mode: modulo,
            failed: &["reachable"],
        },
        Case {
            name: "an unreachable URL",
            prefill: vec![p2.clone()],
            decode: vec![d2.clone()],
            wire: |c, cfg| {
                add_sim_workers(cfg, c);
                cfg.decode.push(DecodeWorkerConfig {
                    url: "http://127.0.0.1:1".into(),
                    model: None,
                });
            },
            mode: modulo,
            failed: &["reachable"],
        },
        Case {
            name: "no decode configured",
            prefill: vec![p2.clone()],
            decode: vec![],
            wire: as_is,
            mode: modulo,
            failed: &["decode_configured"],
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_misconfiguration_fails_the_checks_that_name_it() {
    for case in cases() {
        let report = run_case(
            &case.prefill,
            &case.decode,
            case.wire,
            case.mode,
            CheckOptions::default(),
        )
        .await;
        assert_eq!(
            report.failures(),
            case.failed,
            "{}:\n{}",
            case.name,
            report.table()
        );
        assert_eq!(report.ok, case.failed.is_empty(), "{}", case.name);
        for c in &report.checks {
            assert_eq!(c.ok, c.fix.is_none(), "{}: {c:?}", case.name);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixes_say_what_is_wrong() {
    // (case, wiring, the failed check, what its fix must say)
    let table: [(&str, Wire, &str, &str); 2] = [
        (
            "the bootstrap port given as the engine URL",
            |c, cfg| {
                let port = c.prefills[0].bootstrap_port().unwrap_or(0);
                cfg.prefill.push(PrefillWorkerConfig {
                    url: format!("http://127.0.0.1:{port}"),
                    bootstrap_port: None,
                    bootstrap_host: None,
                    model: None,
                });
                cfg.decode.push(DecodeWorkerConfig {
                    url: c.decodes[0].url(),
                    model: None,
                });
            },
            "server_info",
            "is a bootstrap server",
        ),
        (
            "a host that does not resolve",
            |c, cfg| {
                cfg.prefill.push(PrefillWorkerConfig {
                    url: "http://pdgate-no-such-host.invalid:30000".into(),
                    bootstrap_port: None,
                    bootstrap_host: None,
                    model: None,
                });
                cfg.decode.push(DecodeWorkerConfig {
                    url: c.decodes[0].url(),
                    model: None,
                });
            },
            "reachable",
            "does not resolve",
        ),
    ];
    for (case, wire, check, says) in table {
        let report = run_case(
            &[EngineConfig::prefill(1)],
            &[EngineConfig::decode(1)],
            wire,
            ContractMode::Modulo,
            CheckOptions::default(),
        )
        .await;
        assert_eq!(report.failures(), [check], "{case}:\n{}", report.table());
        let fix = report
            .checks
            .iter()
            .find(|c| c.name == check)
            .and_then(|c| c.fix.clone())
            .unwrap_or_default();
        assert!(fix.contains(says), "{case}: {fix}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_fleet_reports_every_probe() {
    let report = run_case(
        &[EngineConfig::prefill(2)],
        &[EngineConfig::decode(2)],
        as_is,
        ContractMode::Modulo,
        CheckOptions::default(),
    )
    .await;
    let names: Vec<&str> = report.checks.iter().map(|c| c.name.as_str()).collect();
    for want in [
        "reachable",
        "health",
        "server_info",
        "role",
        "engine",
        "load_balance_method",
        "bootstrap_health",
        "bootstrap_registered",
        "rank_route[0]",
        "rank_route[1]",
        "prefill_configured",
        "decode_configured",
        "contract_mode",
        "bootstrap_owner",
        "bootstrap_shared",
        "model",
        "context_length",
        "tp_size",
        "page_size",
        "kv_cache_dtype",
        "transfer_backend",
    ] {
        assert!(names.contains(&want), "{want} missing:\n{}", report.table());
    }
    assert!(report.ok, "{}", report.table());
    let engine = report.checks.iter().find(|c| c.name == "engine");
    let detail = engine.map(|c| c.detail.as_str()).unwrap_or_default();
    assert!(
        detail.contains("DP 2") && detail.contains("transfer backend sim"),
        "{detail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_request_sends_one_request_end_to_end() {
    let report = run_case(
        &[EngineConfig::prefill(2)],
        &[EngineConfig::decode(2)],
        as_is,
        ContractMode::Modulo,
        CheckOptions {
            probe_request: true,
        },
    )
    .await;
    assert!(report.ok, "{}", report.table());
    let last = report.checks.last().expect("checks");
    assert_eq!(last.name, "probe_request", "{}", report.table());
    assert!(last.ok, "{}", report.table());
}

async fn pdgate(args: &[String]) -> (Option<i32>, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pdgate"))
        .args(args)
        .output()
        .await
        .expect("run pdgate");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exits_0_1_2_and_writes_json() {
    let cluster = SimCluster::spawn(
        &[fast_engine(EngineConfig::prefill(2))],
        &[fast_engine(EngineConfig::decode(1))],
    )
    .await
    .expect("sim cluster");
    let p = &cluster.prefills[0];
    let port = p.bootstrap_port().expect("bootstrap port").to_string();
    let mut args: Vec<String> = ["check", "--prefill", &p.url(), &port, "--decode"]
        .map(String::from)
        .to_vec();
    args.push(cluster.decodes[0].url());
    args.push("--json".into());
    let (code, out) = pdgate(&args).await;
    assert_eq!(code, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON report");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["failed"], 0, "{v}");
    let checks = v["checks"].as_array().expect("checks");
    assert!(checks.iter().all(|c| c["ok"] == true && c["fix"].is_null()));
    assert!(checks
        .iter()
        .any(|c| c["target"] == "fleet" && c["name"] == "page_size"));

    args.extend(["--decode".to_string(), "http://127.0.0.1:1".to_string()]);
    let (code, out) = pdgate(&args).await;
    assert_eq!(code, Some(1), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON report");
    let failed: Vec<_> = v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["ok"] == false)
        .collect();
    assert_eq!(failed.len(), 1, "{v}");
    assert_eq!(failed[0]["name"], "reachable");
    assert!(failed[0]["fix"].is_string(), "{v}");

    // The table, then a config error.
    args.retain(|a| a != "--json");
    let (code, out) = pdgate(&args).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("✗ http://127.0.0.1:1") && out.contains("    fix: "),
        "{out}"
    );
    assert!(out.contains("1 failed"), "{out}");
    let (code, _) = pdgate(&[
        "check".into(),
        "--health-failure-threshold".into(),
        "0".into(),
    ])
    .await;
    assert_eq!(code, Some(2));
}

/// `pdgate check` says whether each decode keeps its own prefix cache (SGLang's
/// `--disaggregation-decode-enable-radix-cache`), as its `/server_info` reports it: a ✓
/// either way (it is a choice, not a fault), saying what decode affinity then buys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_radix_cache_is_reported() {
    let mut cached = EngineConfig::decode(2);
    cached.decode_prefix_cache_tokens = 4096;
    // (decode, words the detail must hold)
    let cases = [
        (EngineConfig::decode(2), "off: the decode receives"),
        (cached, "on (--disaggregation-decode-enable-radix-cache)"),
    ];
    for (decode, says) in cases {
        let report = run_case(
            &[EngineConfig::prefill(2)],
            &[decode],
            as_is,
            ContractMode::Modulo,
            CheckOptions::default(),
        )
        .await;
        let rows: Vec<_> = report
            .checks
            .iter()
            .filter(|c| c.name == "decode_radix_cache")
            .collect();
        assert_eq!(rows.len(), 1, "{}", report.table());
        assert!(
            rows[0].ok && rows[0].detail.contains(says),
            "{}",
            report.table()
        );
        assert!(report.ok, "{}", report.table());
    }
}
