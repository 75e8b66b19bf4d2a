//! `pdgate check` with Kubernetes discovery: the fake API server (`support::fake_kube`)
//! holds the pods, simulated engines are their endpoints (pod IP 127.0.0.1, each engine on
//! its own container port `http`). A discovered fleet is probed like a static one, every
//! pod the router would not use has its row, an API server out of reach or RBAC that
//! forbids listing is a ✗ with a fix, and the binary's exit codes and `--json`.

use std::process::Output;

use pdgate::check::{self, CheckOptions, KubeSource, Report};
use pdgate::config::{Config, DecodeWorkerConfig, DiscoveryConfig};
use pdgate::types::Role;
use pdgate_sim::{EngineConfig, SimEngine};

use crate::support::common::{fast_config, fast_engine};
use crate::support::fake_kube::{self, FakeKube};

const NS: &str = "llm";
const PREFILL_SELECTOR: &str = "app=sglang,role in (prefill,both)";
const DECODE_SELECTOR: &str = "app=sglang,role in (decode,both)";
const ANNOTATION: &str = "sglang.ai/bootstrap-port";

fn labels(role: &'static str) -> [(&'static str, &'static str); 2] {
    [("app", "sglang"), ("role", role)]
}

fn discovery_config() -> DiscoveryConfig {
    DiscoveryConfig {
        enabled: true,
        prefill_selector: Some(PREFILL_SELECTOR.into()),
        decode_selector: Some(DECODE_SELECTOR.into()),
        namespace: Some(NS.into()),
        port_name: Some("http".into()),
        ..DiscoveryConfig::default()
    }
}

fn config() -> Config {
    let mut cfg = fast_config();
    cfg.discovery = discovery_config();
    cfg
}

async fn engine(role: Role) -> SimEngine {
    let cfg = match role {
        Role::Prefill => EngineConfig::prefill(2),
        Role::Decode => EngineConfig::decode(2),
        Role::Regular => EngineConfig::regular(2),
    };
    pdgate_sim::spawn(fast_engine(cfg)).await.expect("engine")
}

/// A ready pod of `role` (the label value) for `e`, with `annotation` as its bootstrap
/// port when given.
fn pod(
    name: &str,
    role: &'static str,
    e: &SimEngine,
    annotation: Option<String>,
) -> k8s_openapi::api::core::v1::Pod {
    let mut p = fake_kube::pod(name, &labels(role), e.addr().port());
    p.metadata.annotations = annotation.map(|v| [(ANNOTATION.to_string(), v)].into());
    p
}

fn bootstrap(e: &SimEngine) -> Option<String> {
    e.bootstrap_port().map(|p| p.to_string())
}

async fn run(kube: &FakeKube, cfg: &Config, opts: CheckOptions) -> Report {
    check::run_with(
        cfg,
        opts,
        KubeSource::Config(Box::new(kube.config(NS).await)),
    )
    .await
}

/// The check named `name` of `target`.
fn find<'a>(r: &'a Report, target: &str, name: &str) -> &'a check::Check {
    r.checks
        .iter()
        .find(|c| c.target == target && c.name == name)
        .unwrap_or_else(|| panic!("no {name} check for {target}:\n{}", r.table()))
}

/// A healthy discovered fleet (one prefill annotated, one not; one decode) for the tests
/// that need one.
struct Fleet {
    kube: FakeKube,
    engines: Vec<SimEngine>,
}

async fn healthy_fleet() -> Fleet {
    let kube = FakeKube::start().await;
    let p0 = engine(Role::Prefill).await;
    let p1 = engine(Role::Prefill).await;
    let d0 = engine(Role::Decode).await;
    kube.create(NS, pod("prefill-0", "prefill", &p0, bootstrap(&p0)));
    kube.create(NS, pod("prefill-1", "prefill", &p1, None));
    kube.create(NS, pod("decode-0", "decode", &d0, None));
    Fleet {
        kube,
        engines: vec![p0, p1, d0],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_discovered_fleet_is_probed_like_a_static_one() {
    let f = healthy_fleet().await;
    let report = run(
        &f.kube,
        &config(),
        CheckOptions {
            probe_request: true,
        },
    )
    .await;
    assert!(report.ok, "{}", report.table());
    let d = find(&report, "fleet", "discovery");
    assert!(
        d.detail.contains("namespace llm")
            && d.detail.contains(&format!(
                "--prefill-selector {PREFILL_SELECTOR:?}: 2 pod(s), 2 used"
            ))
            && d.detail.contains(&format!(
                "--decode-selector {DECODE_SELECTOR:?}: 1 pod(s), 1 used"
            )),
        "{}",
        d.detail
    );
    // Each pod is an engine with every per-engine check, under its pod's name.
    for (target, url, checks) in [
        (
            "llm/prefill-0",
            f.engines[0].url(),
            &[
                "pod",
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
            ][..],
        ),
        (
            "llm/prefill-1",
            f.engines[1].url(),
            &["pod", "bootstrap_health", "rank_route[1]"][..],
        ),
        (
            "llm/decode-0",
            f.engines[2].url(),
            &["pod", "reachable", "role", "engine"][..],
        ),
    ] {
        for name in checks {
            assert!(find(&report, target, name).ok, "{}", report.table());
        }
        assert!(
            find(&report, target, "pod").detail.contains(&url),
            "{}",
            report.table()
        );
    }
    // The annotation's port is used when present; else /server_info tells.
    let via = |t| find(&report, t, "bootstrap_health").detail.clone();
    assert!(
        via("llm/prefill-0").contains("from the pod's annotation"),
        "{}",
        via("llm/prefill-0")
    );
    assert!(
        via("llm/prefill-1").contains("from /server_info"),
        "{}",
        via("llm/prefill-1")
    );
    assert!(find(&report, "fleet", "prefill_configured")
        .detail
        .contains("0 static, 2 discovered"));
    assert!(find(&report, "fleet", "page_size")
        .detail
        .contains("on every prefill/decode pair"));
    // The end-to-end probe went through the discovered engines.
    assert!(find(&report, "fleet", "probe_request").ok);
    assert!(
        f.engines[2].stats().requests_total > 0,
        "the decode pod served nothing"
    );
    // One LIST per role (paged), no watch.
    let requests = f.kube.requests();
    assert!(!requests.is_empty());
    assert!(
        requests.iter().all(|r| !r.contains("watch=")),
        "{requests:?}"
    );
}

/// What a case expects of one target's row.
struct Row {
    target: &'static str,
    name: &'static str,
    ok: bool,
    detail: &'static str,
    fix: Option<&'static str>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_the_router_would_not_use_have_their_rows() {
    let kube = FakeKube::start().await;
    let p0 = engine(Role::Prefill).await;
    let d0 = engine(Role::Decode).await;
    let d_static = engine(Role::Decode).await;
    let spare = engine(Role::Decode).await;
    kube.create(NS, pod("prefill-0", "prefill", &p0, bootstrap(&p0)));
    kube.create(NS, pod("decode-0", "decode", &d0, None));
    // Labelled for both roles.
    kube.create(NS, pod("both-0", "both", &spare, None));
    // A bootstrap-port annotation that is not a port.
    kube.create(
        NS,
        pod(
            "prefill-1",
            "prefill",
            &spare,
            Some("eight-nine-nine-eight".into()),
        ),
    );
    // Labelled prefill, but its engine is a decode.
    kube.create(NS, pod("prefill-2", "prefill", &spare, None));
    // Not ready, terminating, not running yet.
    let mut unready = pod("decode-1", "decode", &spare, None);
    fake_kube::set_ready(&mut unready, false);
    kube.create(NS, unready);
    kube.create(NS, pod("decode-2", "decode", &spare, None));
    kube.terminate(NS, "decode-2", 30);
    let mut pending = pod("decode-3", "decode", &spare, None);
    if let Some(st) = pending.status.as_mut() {
        st.phase = Some("Pending".into());
        st.pod_ip = None;
    }
    kube.create(NS, pending);
    // At the URL of a static decode.
    kube.create(NS, pod("decode-4", "decode", &d_static, None));
    let mut cfg = config();
    cfg.decode.push(DecodeWorkerConfig {
        url: d_static.url(),
        model: None,
    });

    let report = run(&kube, &cfg, CheckOptions::default()).await;
    let rows = [
        Row {
            target: "fleet",
            name: "discovery",
            ok: true,
            detail: "2 used",
            fix: None,
        },
        Row {
            target: "llm/both-0",
            name: "pod",
            ok: false,
            detail:
                "prefill and decode pod not used: matches both the prefill and the decode selector",
            fix: Some("exactly one selector"),
        },
        Row {
            target: "llm/prefill-1",
            name: "pod",
            ok: false,
            detail: "bootstrap-port annotation \"eight-nine-nine-eight\" is not a port",
            fix: Some("set the pod's sglang.ai/bootstrap-port annotation"),
        },
        Row {
            target: "llm/prefill-2",
            name: "role",
            ok: false,
            detail: "disaggregation_mode decode; discovered as a prefill",
            fix: Some("matches --prefill-selector: correct its labels"),
        },
        Row {
            target: "llm/decode-1",
            name: "pod",
            ok: true,
            detail: "is not Ready: not used",
            fix: None,
        },
        Row {
            target: "llm/decode-2",
            name: "pod",
            ok: true,
            detail: "terminating (grace 30s)",
            fix: None,
        },
        Row {
            target: "llm/decode-3",
            name: "pod",
            ok: true,
            detail: "not used yet: not running (phase Pending)",
            fix: None,
        },
        Row {
            target: "llm/decode-4",
            name: "pod",
            ok: false,
            detail: "its URL is already a static worker's",
            fix: Some("remove the static --decode"),
        },
        Row {
            target: "llm/prefill-0",
            name: "bootstrap_registered",
            ok: true,
            detail: "every rank registered",
            fix: None,
        },
        Row {
            target: "llm/decode-0",
            name: "engine",
            ok: true,
            detail: "DP 2",
            fix: None,
        },
        Row {
            target: "fleet",
            name: "decode_configured",
            ok: true,
            detail: "2 decode engine(s): 1 static, 1 discovered",
            fix: None,
        },
        Row {
            target: "fleet",
            name: "prefill_configured",
            ok: true,
            detail: "2 prefill engine(s): 0 static, 2 discovered",
            fix: None,
        },
    ];
    for r in &rows {
        let c = find(&report, r.target, r.name);
        assert_eq!(c.ok, r.ok, "{} {}:\n{}", r.target, r.name, report.table());
        assert!(
            c.detail.contains(r.detail),
            "{} {}: {}",
            r.target,
            r.name,
            c.detail
        );
        match (r.fix, &c.fix) {
            (Some(want), Some(got)) => {
                assert!(got.contains(want), "{} {}: {got}", r.target, r.name)
            }
            (None, None) => {}
            (want, got) => panic!("{} {}: fix {got:?}, want {want:?}", r.target, r.name),
        }
    }
    // Exactly those ✗, and pods that are not used are not probed.
    let mut failed: Vec<(String, String)> = report
        .checks
        .iter()
        .filter(|c| !c.ok)
        .map(|c| (c.target.clone(), c.name.clone()))
        .collect();
    failed.sort();
    let want: Vec<(String, String)> = [
        ("llm/both-0", "pod"),
        ("llm/decode-4", "pod"),
        ("llm/prefill-1", "pod"),
        ("llm/prefill-2", "role"),
    ]
    .map(|(t, n)| (t.to_string(), n.to_string()))
    .to_vec();
    assert_eq!(failed, want, "{}", report.table());
    for t in [
        "llm/both-0",
        "llm/decode-1",
        "llm/decode-2",
        "llm/decode-3",
        "llm/decode-4",
        "llm/prefill-1",
    ] {
        let names: Vec<&str> = report
            .checks
            .iter()
            .filter(|c| c.target == t)
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(names, ["pod"], "{t} was probed:\n{}", report.table());
    }
    for c in &report.checks {
        assert_eq!(c.ok, c.fix.is_none(), "{c:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_failures_and_empty_selectors_are_discovery_rows() {
    let kube = FakeKube::start().await;
    let p0 = engine(Role::Prefill).await;
    kube.create(NS, pod("prefill-0", "prefill", &p0, None));
    // The decode selector matches nothing: a ✗ naming it, and no decode at all.
    let report = run(&kube, &config(), CheckOptions::default()).await;
    let d = find(&report, "fleet", "discovery");
    assert!(
        !d.ok && d.detail.contains("a selector matches no pod"),
        "{}",
        report.table()
    );
    let fix = d.fix.as_deref().unwrap_or_default();
    assert!(
        fix.contains(&format!("kubectl get pods -n llm -l '{DECODE_SELECTOR}'"))
            && fix.contains("--decode-selector")
            && !fix.contains("--prefill-selector"),
        "{fix}"
    );
    assert!(!find(&report, "fleet", "decode_configured").ok);
    assert!(find(&report, "llm/prefill-0", "bootstrap_registered").ok);

    // RBAC without `list pods`.
    kube.set_forbidden(true);
    let report = run(&kube, &config(), CheckOptions::default()).await;
    let d = find(&report, "fleet", "discovery");
    assert!(
        !d.ok && d.detail.contains("403") && d.detail.contains("cannot list"),
        "{}",
        d.detail
    );
    assert!(
        d.fix.as_deref().is_some_and(
            |f| f.starts_with("grant pods get/list/watch: apply docker/k8s/base/rbac.yaml")
        ),
        "{:?}",
        d.fix
    );
    assert_eq!(
        report.failures(),
        ["discovery", "prefill_configured", "decode_configured"],
        "{}",
        report.table()
    );
}

async fn pdgate(args: &[&str], kubeconfig: &std::path::Path) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_pdgate"))
        .arg("check")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .await
        .expect("run pdgate")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const FLAGS: &[&str] = &[
    "--service-discovery",
    "--service-discovery-namespace",
    NS,
    "--prefill-selector",
    PREFILL_SELECTOR,
    "--decode-selector",
    DECODE_SELECTOR,
    "--service-discovery-port-name",
    "http",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_checks_a_discovered_fleet() {
    let f = healthy_fleet().await;
    let kc = f.kube.kubeconfig(NS);
    // JSON: every row ✓, the discovery and pod rows included.
    let mut args = FLAGS.to_vec();
    args.push("--json");
    let out = pdgate(&args, &kc).await;
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("JSON report");
    assert_eq!(v["ok"], true, "{v}");
    let checks = v["checks"].as_array().expect("checks");
    let row = |t: &str, n: &str| {
        checks
            .iter()
            .find(|c| c["target"] == t && c["name"] == n)
            .cloned()
    };
    let d = row("fleet", "discovery").expect("the discovery row");
    assert!(
        d["detail"]
            .as_str()
            .is_some_and(|s| s.contains("namespace llm")),
        "{d}"
    );
    assert!(d["fix"].is_null());
    for t in ["llm/prefill-0", "llm/prefill-1", "llm/decode-0"] {
        assert_eq!(row(t, "pod").expect("pod row")["ok"], true, "{v}");
        assert_eq!(row(t, "server_info").expect("probed")["ok"], true, "{v}");
    }

    // The table.
    let out = pdgate(FLAGS, &kc).await;
    let table = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{table}");
    assert!(table.starts_with("✓ fleet"), "{table}");
    assert!(table.contains("✓ llm/prefill-0  pod "), "{table}");
    assert!(table.contains(" 0 failed\n"), "{table}");

    // A pod that is misconfigured: exit 1, its row and fix in the table.
    let spare = engine(Role::Prefill).await;
    f.kube
        .create(NS, pod("prefill-2", "prefill", &spare, Some("0".into())));
    let out = pdgate(FLAGS, &kc).await;
    let table = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(
        table.contains("✗ llm/prefill-2  pod ") && table.contains("    fix: set the pod's"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_reports_an_api_server_out_of_reach_and_refuses_a_bad_selector() {
    let kube = FakeKube::start().await;
    let kc = kube.kubeconfig(NS);
    kube.set_down(true);
    let out = pdgate(FLAGS, &kc).await;
    let table = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(
        table.contains("✗ fleet  discovery ") && table.contains("cannot reach the API server"),
        "{table}"
    );
    assert!(
        table.contains("    fix: check the API server's address"),
        "{table}"
    );
    // No client configuration at all.
    let out = pdgate(FLAGS, std::path::Path::new("/nonexistent/kubeconfig")).await;
    let table = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(
        table.contains("    fix: give pdgate a Kubernetes client configuration"),
        "{table}"
    );
    // A malformed selector: a config error naming its flag, nothing probed.
    let mut args = FLAGS.to_vec();
    args.extend(["--decode-selector", "role notin x"]);
    let out = pdgate(&args, &kc).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stdout(&out).is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--decode-selector"), "{err}");
}
