//! A small `kustomize build` for the manifests under `docker/k8s`: resources (files and
//! directories), components, JSON 6902 patches and `namespace`, which is all they use.
//! Every other kustomization field is refused (`deny_unknown_fields`), so a manifest cannot
//! start using a feature this builder would silently skip; where `kubectl` is installed the
//! tests also compare this builder's output with `kubectl kustomize`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

pub const KUSTOMIZATION: &str = "kustomization.yaml";

/// Every YAML document of a file (empty documents are skipped), as JSON values. Duplicate
/// keys are an error (serde-saphyr's default).
pub fn yaml_docs(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_docs(&text).map_err(|e| format!("{}: {e}", path.display()))
}

pub fn parse_docs(text: &str) -> Result<Vec<Value>, String> {
    serde_saphyr::from_multiple::<Value>(text).map_err(|e| e.to_string())
}

/// The kustomization fields the manifests use.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Kustomization {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub resources: Vec<String>,
    #[serde(default)]
    pub components: Vec<String>,
    #[serde(default)]
    pub patches: Vec<PatchRef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchRef {
    pub target: Target,
    #[serde(default)]
    pub patch: Option<String>,
    #[serde(default)]
    pub path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub version: Option<String>,
    pub kind: String,
    pub name: String,
}

/// One JSON 6902 operation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Op {
    op: String,
    path: String,
    #[serde(default)]
    value: Option<Value>,
}

pub fn load(dir: &Path) -> Result<Kustomization, String> {
    let path = dir.join(KUSTOMIZATION);
    let mut docs = yaml_docs(&path)?;
    if docs.len() != 1 {
        return Err(format!("{}: one document expected", path.display()));
    }
    let k: Kustomization =
        serde_json::from_value(docs.remove(0)).map_err(|e| format!("{}: {e}", path.display()))?;
    let want = match k.kind.as_str() {
        "Kustomization" => "kustomize.config.k8s.io/v1beta1",
        "Component" => "kustomize.config.k8s.io/v1alpha1",
        other => return Err(format!("{}: kind {other}", path.display())),
    };
    if k.api_version != want {
        return Err(format!(
            "{}: {} needs apiVersion {want}, not {}",
            path.display(),
            k.kind,
            k.api_version
        ));
    }
    Ok(k)
}

/// Builds the kustomization in `dir` (of kind `Kustomization`). `files` collects every file
/// the build read, kustomization files included.
pub fn build(dir: &Path, files: &mut BTreeSet<PathBuf>) -> Result<Vec<Value>, String> {
    let mut objs = Vec::new();
    accumulate(dir, "Kustomization", &mut objs, files)?;
    Ok(objs)
}

/// Kustomize's order: the resources, then each component (its resources, then its patches
/// over everything so far), then this kustomization's patches, then its namespace.
fn accumulate(
    dir: &Path,
    kind: &str,
    objs: &mut Vec<Value>,
    files: &mut BTreeSet<PathBuf>,
) -> Result<(), String> {
    let k = load(dir)?;
    if k.kind != kind {
        return Err(format!(
            "{}: a {kind} expected, not {}",
            dir.display(),
            k.kind
        ));
    }
    files.insert(canonical(&dir.join(KUSTOMIZATION))?);
    for r in &k.resources {
        let p = dir.join(r);
        if p.is_dir() {
            let mut sub = Vec::new();
            accumulate(&p, "Kustomization", &mut sub, files)?;
            objs.extend(sub);
        } else {
            files.insert(canonical(&p)?);
            objs.extend(yaml_docs(&p)?);
        }
    }
    for c in &k.components {
        accumulate(&dir.join(c), "Component", objs, files)?;
    }
    for p in &k.patches {
        let ops = match (&p.patch, &p.path) {
            (Some(text), None) => parse_docs(text)?,
            (None, Some(path)) => {
                let path = dir.join(path);
                files.insert(canonical(&path)?);
                yaml_docs(&path)?
            }
            _ => return Err(format!("{}: a patch needs patch or path", dir.display())),
        };
        let [Value::Array(ops)] = ops.as_slice() else {
            return Err(format!("{}: a JSON 6902 patch is one list", dir.display()));
        };
        let ops: Vec<Op> = ops
            .iter()
            .map(|o| serde_json::from_value(o.clone()).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let mut hits = 0;
        for o in objs.iter_mut().filter(|o| targets(&p.target, o)) {
            hits += 1;
            for op in &ops {
                apply(o, op).map_err(|e| format!("{}: patch {}: {e}", dir.display(), op.path))?;
            }
        }
        if hits != 1 {
            return Err(format!(
                "{}: patch target {:?} matches {hits} objects, not one",
                dir.display(),
                p.target
            ));
        }
    }
    if let Some(ns) = &k.namespace {
        set_namespace(objs, ns);
    }
    Ok(())
}

fn canonical(p: &Path) -> Result<PathBuf, String> {
    p.canonicalize()
        .map_err(|e| format!("{}: {e} (referenced by a kustomization)", p.display()))
}

fn targets(t: &Target, o: &Value) -> bool {
    let api = o["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api.rsplit_once('/').unwrap_or(("", api));
    o["kind"] == t.kind.as_str()
        && o["metadata"]["name"] == t.name.as_str()
        && t.group.as_deref().is_none_or(|g| g == group)
        && t.version.as_deref().is_none_or(|v| v == version)
}

fn apply(doc: &mut Value, op: &Op) -> Result<(), String> {
    let (parent, last) = op.path.rsplit_once('/').ok_or("not a JSON pointer")?;
    let last = last.replace("~1", "/").replace("~0", "~");
    let value = || op.value.clone().ok_or("no value");
    let at = doc.pointer_mut(parent).ok_or("no such parent")?;
    match (op.op.as_str(), at) {
        ("add", Value::Array(a)) if last == "-" => a.push(value()?),
        ("add", Value::Array(a)) => {
            let i = index(&last, a.len() + 1)?;
            a.insert(i, value()?);
        }
        ("replace", Value::Array(a)) => {
            let i = index(&last, a.len())?;
            a[i] = value()?;
        }
        ("remove", Value::Array(a)) => {
            a.remove(index(&last, a.len())?);
        }
        ("add", Value::Object(m)) => {
            m.insert(last, value()?);
        }
        ("replace", Value::Object(m)) if m.contains_key(&last) => {
            m.insert(last, value()?);
        }
        ("remove", Value::Object(m)) => {
            m.remove(&last).ok_or("no such member")?;
        }
        (op, _) => return Err(format!("{op} does not apply here")),
    }
    Ok(())
}

fn index(s: &str, len: usize) -> Result<usize, String> {
    s.parse::<usize>()
        .ok()
        .filter(|i| *i < len)
        .ok_or_else(|| format!("index {s} out of range"))
}

/// Kinds without a namespace.
pub const CLUSTER_SCOPED: &[&str] = &["Namespace", "ClusterRole", "ClusterRoleBinding"];

/// Kustomize's namespace transformer, as far as these manifests need it: namespaced
/// objects move to `ns`, and so do ServiceAccount subjects of role bindings that name no
/// namespace or `default`.
fn set_namespace(objs: &mut [Value], ns: &str) {
    for o in objs {
        let kind = o["kind"].as_str().unwrap_or_default().to_string();
        if !CLUSTER_SCOPED.contains(&kind.as_str()) {
            o["metadata"]["namespace"] = Value::from(ns);
        }
        if kind == "RoleBinding" || kind == "ClusterRoleBinding" {
            if let Some(subjects) = o["subjects"].as_array_mut() {
                for s in subjects {
                    let old = s["namespace"].as_str().unwrap_or("default");
                    if s["kind"] == "ServiceAccount" && old == "default" {
                        s["namespace"] = Value::from(ns);
                    }
                }
            }
        }
    }
}

/// `kubectl kustomize dir`, when kubectl is installed (`None` otherwise).
pub fn kubectl_kustomize(dir: &Path) -> Option<Result<Vec<Value>, String>> {
    let out = match std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(Err(e.to_string())),
        Ok(out) => out,
    };
    if !out.status.success() {
        return Some(Err(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    Some(parse_docs(&String::from_utf8_lossy(&out.stdout)))
}

/// An object's identity in a build: kind, namespace, name.
pub fn key(o: &Value) -> (String, String, String) {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    (
        s(&o["kind"]),
        s(&o["metadata"]["namespace"]),
        s(&o["metadata"]["name"]),
    )
}

/// The first place where two JSON values differ, as a JSON pointer with both sides.
pub fn first_difference(a: &Value, b: &Value, at: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let here = format!("{at}/{k}");
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => first_difference(u, v, &here),
                    (u, v) => Some(format!("{here}: {u:?} vs {v:?}")),
                }
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (u, v))| first_difference(u, v, &format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some(format!("{at}: {a} vs {b}")),
    }
}
