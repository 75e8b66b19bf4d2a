//! The deployable manifests under `docker/k8s`:
//! - every YAML document is a Kubernetes object whose typed form (k8s-openapi) serialises
//!   back to exactly the document, so a misspelled or misplaced field (which serde would
//!   drop without a word) fails;
//! - every file belongs to a kustomization, every kustomization builds (with the builder in
//!   [`kustomize`], checked against `kubectl kustomize` where kubectl is installed);
//! - each build fits together: pdgate's flags and mounted pdgate.toml parse and validate,
//!   the probes, ports, Prometheus annotations, grace period and RBAC agree with that
//!   config, Services select pods that have their ports, and discovery's selectors find
//!   the engine pods, whose ports and bootstrap annotation agree with the engines' flags;
//!   the engine pools' autoscalers target them and read only series pdgate exports
//!   ([`autoscaling`], with `promtool check rules` on every query).

mod autoscaling;
pub(crate) mod docker;
mod fleet;
mod kustomize;
mod monitoring;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use pdgate::config::Config;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use kustomize::{first_difference, key, KUSTOMIZATION};

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docker/k8s")
}

// ---- typed round trip ----

type RoundTrip = fn(&Value) -> Result<Value, serde_json::Error>;

fn typed<K: DeserializeOwned + Serialize>(v: &Value) -> Result<Value, serde_json::Error> {
    serde_json::to_value(serde_json::from_value::<K>(v.clone())?)
}

/// Every (apiVersion, kind) the manifests may use; any other fails the test. No Secret:
/// the manifests need none and commit none.
const KINDS: &[(&str, &str, RoundTrip)] = &[
    ("v1", "Namespace", typed::<Namespace>),
    ("v1", "ServiceAccount", typed::<ServiceAccount>),
    ("v1", "ConfigMap", typed::<ConfigMap>),
    ("v1", "Service", typed::<Service>),
    ("apps/v1", "Deployment", typed::<Deployment>),
    ("apps/v1", "StatefulSet", typed::<StatefulSet>),
    ("rbac.authorization.k8s.io/v1", "Role", typed::<Role>),
    (
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        typed::<RoleBinding>,
    ),
    (
        "rbac.authorization.k8s.io/v1",
        "ClusterRole",
        typed::<ClusterRole>,
    ),
    (
        "rbac.authorization.k8s.io/v1",
        "ClusterRoleBinding",
        typed::<ClusterRoleBinding>,
    ),
    (
        "policy/v1",
        "PodDisruptionBudget",
        typed::<PodDisruptionBudget>,
    ),
    (
        "autoscaling/v2",
        "HorizontalPodAutoscaler",
        typed::<HorizontalPodAutoscaler>,
    ),
    (
        "networking.k8s.io/v1",
        "NetworkPolicy",
        typed::<NetworkPolicy>,
    ),
    (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        typed::<monitoring::ServiceMonitor>,
    ),
    (
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        typed::<autoscaling::PrometheusRule>,
    ),
    (
        "keda.sh/v1alpha1",
        "ScaledObject",
        typed::<autoscaling::ScaledObject>,
    ),
];

/// `Ok` when the document parses into its typed struct and serialises back to itself.
fn round_trip(doc: &Value) -> Result<(), String> {
    let api = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    let (_, _, rt) = KINDS
        .iter()
        .find(|(a, k, _)| *a == api && *k == kind)
        .ok_or_else(|| format!("{api} {kind} is not a kind the manifests may use"))?;
    let back = rt(doc).map_err(|e| format!("{kind}: {e}"))?;
    match first_difference(doc, &back, "") {
        None => Ok(()),
        Some(d) => Err(format!(
            "{kind} {}: not kept by the typed struct (misspelled or misplaced?): {d}",
            doc["metadata"]["name"]
        )),
    }
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read docker/k8s")
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(p);
        }
    }
}

fn manifest_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    yaml_files(&k8s_dir(), &mut files);
    assert!(
        files.len() > 10,
        "docker/k8s has {} YAML files",
        files.len()
    );
    files
}

#[test]
fn every_document_round_trips_through_its_typed_struct() {
    let mut checked = BTreeSet::new();
    for f in manifest_files() {
        if f.file_name().is_some_and(|n| n == KUSTOMIZATION) {
            continue; // parsed strictly by kustomize::load
        }
        let docs = kustomize::yaml_docs(&f).unwrap();
        assert!(!docs.is_empty(), "{}: no document", f.display());
        for d in &docs {
            if let Err(e) = round_trip(d) {
                panic!("{}: {e}", f.display());
            }
            checked.insert(d["kind"].as_str().unwrap_or_default().to_string());
        }
    }
    // Every kind of the table occurs at least once (so each entry is exercised).
    let all: BTreeSet<String> = KINDS.iter().map(|(_, k, _)| k.to_string()).collect();
    assert_eq!(checked, all);
}

/// A field serde would drop silently, put where a typo would: the round trip must see it.
#[test]
fn the_round_trip_catches_a_misspelled_field() {
    let f = k8s_dir().join("base/deployment.yaml");
    let doc = kustomize::yaml_docs(&f).unwrap().remove(0);
    round_trip(&doc).unwrap();
    let c = "/spec/template/spec/containers/0";
    let cases: &[(&str, &str)] = &[
        ("/spec/template/spec", "terminationGracePeriodSecond"),
        (c, "readinesProbe"),
        (&format!("{c}/securityContext"), "readOnlyRootFileSystem"),
        (&format!("{c}/livenessProbe/httpGet"), "paht"),
        ("/spec/template/metadata", "annotation"),
        ("/metadata", "namespce"),
        ("", "specc"),
    ];
    for (at, field) in cases {
        let mut bad = doc.clone();
        let obj = bad.pointer_mut(at).and_then(Value::as_object_mut).unwrap();
        obj.insert(field.to_string(), Value::from(1));
        let e = round_trip(&bad).expect_err(field);
        assert!(e.contains(field), "{field}: {e}");
    }
    // A wrong type is a parse error, not a silent change.
    let mut bad = doc.clone();
    *bad.pointer_mut("/spec/replicas").unwrap() = Value::from("two");
    assert!(round_trip(&bad).is_err());
}

// ---- builds ----

/// Which engines a build runs.
#[derive(Clone, Copy, PartialEq)]
enum Engines {
    None,
    /// `pdgate sim --role ...` pods.
    Sim,
    /// `python3 -m sglang.launch_server` pods.
    Sglang,
}

/// Every buildable kustomization (kind `Kustomization`) and what it must contain.
struct Root {
    dir: &'static str,
    /// pdgate watches every namespace (ClusterRole) rather than its own.
    all_namespaces: bool,
    /// Secrets the pods mount that the build does not create (made by hand).
    external_secrets: &'static [&'static str],
    engines: Engines,
}

const ROOTS: &[Root] = &[
    Root {
        dir: "base",
        all_namespaces: false,
        external_secrets: &[],
        engines: Engines::None,
    },
    Root {
        dir: "overlays/all-namespaces",
        all_namespaces: true,
        external_secrets: &[],
        engines: Engines::None,
    },
    Root {
        dir: "overlays/sim-fleet",
        all_namespaces: false,
        external_secrets: &[],
        engines: Engines::Sim,
    },
    Root {
        dir: "examples/production",
        all_namespaces: false,
        external_secrets: &[],
        engines: Engines::None,
    },
    Root {
        dir: "examples/sglang-pd",
        all_namespaces: false,
        external_secrets: &[],
        engines: Engines::Sglang,
    },
    Root {
        dir: "examples/autoscaling-keda",
        all_namespaces: false,
        external_secrets: &[],
        engines: Engines::Sglang,
    },
    Root {
        dir: "examples/autoscaling-hpa",
        all_namespaces: false,
        external_secrets: &[],
        engines: Engines::Sglang,
    },
];

fn build(root: &Root) -> (Vec<Value>, BTreeSet<PathBuf>) {
    let mut files = BTreeSet::new();
    let objs = kustomize::build(&k8s_dir().join(root.dir), &mut files)
        .unwrap_or_else(|e| panic!("{}: {e}", root.dir));
    (objs, files)
}

#[test]
fn every_file_belongs_to_a_checked_kustomization() {
    // Every kustomization of kind Kustomization is a root of the table.
    let mut roots = BTreeSet::new();
    let mut used = BTreeSet::new();
    for f in manifest_files() {
        if f.file_name().is_some_and(|n| n == KUSTOMIZATION) {
            let dir = f.parent().unwrap();
            let k = kustomize::load(dir).unwrap();
            if k.kind == "Kustomization" {
                let rel = dir.strip_prefix(k8s_dir()).unwrap();
                roots.insert(rel.to_string_lossy().into_owned());
            }
        }
    }
    let table: BTreeSet<String> = ROOTS.iter().map(|r| r.dir.to_string()).collect();
    assert_eq!(roots, table, "kustomizations vs the ROOTS table");
    for r in ROOTS {
        used.extend(build(r).1);
    }
    // ... and every YAML file is read by one of their builds.
    for f in manifest_files() {
        let f = f.canonicalize().unwrap();
        assert!(used.contains(&f), "{}: in no kustomization", f.display());
    }
}

#[test]
fn the_builds_match_kubectl_kustomize() {
    for r in ROOTS {
        let (ours, _) = build(r);
        let Some(theirs) = kustomize::kubectl_kustomize(&k8s_dir().join(r.dir)) else {
            eprintln!("kubectl not installed: the builder is not cross-checked");
            return;
        };
        let theirs = theirs.unwrap_or_else(|e| panic!("kubectl kustomize {}: {e}", r.dir));
        let by_key = |objs: Vec<Value>| -> BTreeMap<_, _> {
            objs.into_iter().map(|o| (key(&o), o)).collect()
        };
        let (ours, theirs) = (by_key(ours), by_key(theirs));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{}",
            r.dir
        );
        for (k, o) in &ours {
            if let Some(d) = first_difference(o, &theirs[k], "") {
                panic!("{}: {k:?} differs from kubectl kustomize: {d}", r.dir);
            }
        }
    }
}

#[test]
fn pdgate_toml_in_every_configmap_parses_and_validates() {
    let mut n = 0;
    for f in manifest_files() {
        if f.file_name().is_some_and(|n| n == KUSTOMIZATION) {
            continue;
        }
        for d in kustomize::yaml_docs(&f).unwrap() {
            if d["kind"] != "ConfigMap" {
                continue;
            }
            let cm: ConfigMap = serde_json::from_value(d).unwrap();
            for (name, text) in cm.data.iter().flatten() {
                if !name.ends_with(".toml") {
                    continue;
                }
                let cfg = Config::from_toml(text)
                    .and_then(|c| c.validate().map(|()| c))
                    .unwrap_or_else(|e| panic!("{}: {name}: {e}", f.display()));
                assert!(cfg.discovery.enabled, "{}: {name}", f.display());
                // The same text with a misspelled key is refused.
                let bad = text.replace("drain_secs", "drain_sec");
                assert_ne!(&bad, text);
                assert!(Config::from_toml(&bad).is_err());
                n += 1;
            }
        }
    }
    assert!(n > 0, "no pdgate.toml in any ConfigMap");
}

#[test]
fn each_build_fits_together() {
    for r in ROOTS {
        let (objs, _) = build(r);
        if let Err(e) = fleet::Fleet::new(r, &objs).and_then(|f| f.check()) {
            panic!("{}: {e}", r.dir);
        }
    }
}
