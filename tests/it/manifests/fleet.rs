//! The checks of one build of the manifests: do its objects fit together? pdgate's flags
//! and its mounted pdgate.toml parse and validate; its probes, ports, Prometheus
//! annotations, grace period, token mount and RBAC agree with that config; Services and
//! PodDisruptionBudgets select pods of the build that have their ports; discovery's
//! selectors find every engine workload as one role, and the engines' flags agree with
//! their named port and bootstrap annotation.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodTemplateSpec, Probe, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use pdgate::cli::{prefill_groups, ServeArgs};
use pdgate::config::Config;
use pdgate_sim::cli::SimArgs;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::kustomize::key;
use super::{round_trip, Engines, Root};

/// The command line of the `pdgate` binary, for `serve` and `sim` (the binary's own parser
/// lives in src/command.rs, with the same two argument structs).
#[derive(Parser)]
#[command(name = "pdgate")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Subcommand)]
// Parsed once at start: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Cmd {
    Serve(ServeArgs),
    Sim(SimArgs),
}

/// A pod template with the workload's name, namespace and replicas.
struct Pods {
    name: String,
    ns: Option<String>,
    replicas: i32,
    template: PodTemplateSpec,
}

pub struct Fleet<'a> {
    root: &'a Root,
    objs: Vec<Value>,
    workloads: Vec<Pods>,
}

pub type Res<T> = Result<T, String>;

fn get<K: DeserializeOwned>(o: &Value) -> Res<K> {
    serde_json::from_value(o.clone()).map_err(|e| format!("{:?}: {e}", key(o)))
}

impl<'a> Fleet<'a> {
    pub fn new(root: &'a Root, objs: &[Value]) -> Res<Self> {
        let mut seen = BTreeSet::new();
        let mut workloads = Vec::new();
        for o in objs {
            round_trip(o)?;
            if !seen.insert(key(o)) {
                return Err(format!("{:?} twice", key(o)));
            }
            let (meta, replicas, selector, template) = match o["kind"].as_str() {
                Some("Deployment") => {
                    let d: Deployment = get(o)?;
                    let s = d.spec.ok_or("no spec")?;
                    (d.metadata, s.replicas, s.selector, s.template)
                }
                Some("StatefulSet") => {
                    let d: StatefulSet = get(o)?;
                    let s = d.spec.ok_or("no spec")?;
                    if let Some(svc) = &s.service_name {
                        Self::find(objs, "Service", &d.metadata.namespace, svc)?;
                    }
                    (d.metadata, s.replicas, s.selector, s.template)
                }
                _ => continue,
            };
            let name = meta.name.unwrap_or_default();
            let labels = template.metadata.as_ref().and_then(|m| m.labels.clone());
            if !matches(selector.match_labels.as_ref(), labels.as_ref()) {
                return Err(format!("{name}: its selector does not match its pods"));
            }
            workloads.push(Pods {
                name,
                ns: meta.namespace,
                replicas: replicas.unwrap_or(1),
                template,
            });
        }
        Ok(Fleet {
            root,
            objs: objs.to_vec(),
            workloads,
        })
    }

    fn find<'o>(objs: &'o [Value], kind: &str, ns: &Option<String>, name: &str) -> Res<&'o Value> {
        let want = (
            kind.to_string(),
            ns.clone().unwrap_or_default(),
            name.to_string(),
        );
        objs.iter()
            .find(|o| key(o) == want)
            .ok_or_else(|| format!("no {kind} {name} in namespace {ns:?}"))
    }

    fn of_kind<K: DeserializeOwned>(&self, kind: &str) -> Res<Vec<K>> {
        self.objs
            .iter()
            .filter(|o| o["kind"] == kind)
            .map(get)
            .collect()
    }

    pub fn check(&self) -> Res<()> {
        let (router, c, cfg) = self.router()?;
        self.check_router(router, c, &cfg)?;
        self.check_rbac(router, &cfg)?;
        self.check_replica_count(router, c, &cfg)?;
        self.check_services_and_budgets()?;
        let labels = router
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.clone());
        super::autoscaling::check(&self.objs)?;
        super::monitoring::check(
            &self.objs,
            (router.name.as_str(), &router.ns),
            &labels.unwrap_or_default(),
            c,
        )?;
        self.check_engines(router, &cfg)
    }

    /// The one workload running `pdgate serve`, and its effective config (flags over the
    /// mounted pdgate.toml, validated).
    fn router(&self) -> Res<(&Pods, &Container, Config)> {
        let mut found = None;
        for w in &self.workloads {
            let spec = w.template.spec.as_ref().ok_or("no pod spec")?;
            for c in &spec.containers {
                if c.args.as_ref().and_then(|a| a.first()).map(String::as_str) != Some("serve") {
                    continue;
                }
                if found.is_some() {
                    return Err("more than one pdgate serve container".into());
                }
                found = Some((w, c, self.serve_config(w, c)?));
            }
        }
        found.ok_or_else(|| "no pdgate serve container".into())
    }

    fn serve_config(&self, w: &Pods, c: &Container) -> Res<Config> {
        let argv = expand_args(c)?;
        let m = Cli::command()
            .try_get_matches_from(std::iter::once("pdgate".to_string()).chain(argv))
            .map_err(|e| format!("{}: args: {e}", w.name))?;
        let sm = m.subcommand_matches("serve").cloned().ok_or("not serve")?;
        let Cmd::Serve(mut args) = Cli::from_arg_matches(&m)
            .map_err(|e| e.to_string())?
            .command
        else {
            return Err("not serve".into());
        };
        // The config file is the mounted ConfigMap key: write it where the test can read it.
        let tmp = match &args.config {
            None => None,
            Some(path) => {
                let (kind, name, file) = self.mounted(w, c, path)?;
                if kind != "ConfigMap" {
                    return Err(format!("{}: --config from a {kind}", path.display()));
                }
                let cm: ConfigMap = get(Self::find(&self.objs, "ConfigMap", &w.ns, &name)?)?;
                let text = cm
                    .data
                    .as_ref()
                    .and_then(|d| d.get(&file))
                    .ok_or_else(|| format!("ConfigMap {name} has no key {file}"))?;
                let tmp = std::env::temp_dir().join(format!(
                    "pdgate-manifests-{}-{}.toml",
                    std::process::id(),
                    self.root.dir.replace('/', "-")
                ));
                std::fs::write(&tmp, text).map_err(|e| e.to_string())?;
                Some(tmp)
            }
        };
        if tmp.is_some() {
            args.config.clone_from(&tmp);
        }
        let cfg = prefill_groups(&sm)
            .and_then(|groups| args.into_config(groups))
            .map_err(|e| format!("{}: {e}", w.name));
        if let Some(tmp) = tmp {
            let _ = std::fs::remove_file(tmp);
        }
        cfg
    }

    /// What a file path of container `c` is: (ConfigMap | Secret, its name, its key). The
    /// build must hold it, unless it is a Secret made by hand (`Root::external_secrets`).
    fn mounted(&self, w: &Pods, c: &Container, path: &Path) -> Res<(String, String, String)> {
        let (dir, file) = (
            path.parent().ok_or("no dir")?,
            path.file_name().ok_or("no file")?,
        );
        let file = file.to_string_lossy().into_owned();
        let m = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| Path::new(&m.mount_path) == dir && m.sub_path.is_none())
            .ok_or_else(|| format!("{}: nothing mounted at {}", c.name, dir.display()))?;
        let spec = w.template.spec.as_ref().ok_or("no pod spec")?;
        let v = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .ok_or_else(|| format!("no volume {}", m.name))?;
        if let Some(cm) = &v.config_map {
            if cm.items.is_some() {
                return Err(format!("volume {}: items remap keys; not checked", m.name));
            }
            return Ok(("ConfigMap".into(), cm.name.clone(), file));
        }
        let s = v.secret.as_ref().ok_or("neither ConfigMap nor Secret")?;
        if s.items.is_some() {
            return Err(format!("volume {}: items remap keys; not checked", m.name));
        }
        let name = s.secret_name.clone().ok_or("no secretName")?;
        if !self.root.external_secrets.contains(&name.as_str()) {
            let secret: Secret = get(Self::find(&self.objs, "Secret", &w.ns, &name)?)?;
            let has = secret.string_data.iter().flatten().any(|(k, _)| *k == file)
                || secret.data.iter().flatten().any(|(k, _)| *k == file);
            if !has {
                return Err(format!("Secret {name} has no key {file}"));
            }
        } else if self
            .objs
            .iter()
            .any(|o| o["kind"] == "Secret" && o["metadata"]["name"] == name.as_str())
        {
            return Err(format!(
                "Secret {name} is listed as external but the build has it"
            ));
        }
        Ok(("Secret".into(), name, file))
    }

    fn check_router(&self, w: &Pods, c: &Container, cfg: &Config) -> Res<()> {
        let spec = w.template.spec.as_ref().ok_or("no pod spec")?;
        let m = &cfg.metrics_listener;
        if !cfg.server.host.is_unspecified() || !m.enabled || !m.host.is_unspecified() {
            return Err("the front door and the metrics listener must be on 0.0.0.0".into());
        }
        let port = |name: &str| container_port(c, name);
        if port("http")? != i32::from(cfg.server.port) {
            return Err("container port http is not server.port".into());
        }
        if port("metrics")? != i32::from(m.port) {
            return Err("container port metrics is not metrics_listener.port".into());
        }
        // The admin API: on the pod's loopback without a token (no container port, so
        // neither a Service nor a NetworkPolicy can expose it), or on the network with its
        // token from a Secret the build mounts.
        if cfg.admin.host.is_loopback() {
            if cfg.admin.api_key.is_some() || cfg.admin.api_key_file.is_some() {
                return Err("a loopback admin listener needs no token here".into());
            }
            let exposed = c.ports.iter().flatten().any(|p| {
                p.container_port == i32::from(cfg.admin.port) || p.name.as_deref() == Some("admin")
            });
            if exposed {
                return Err("the loopback admin port is declared as a container port".into());
            }
        } else {
            let token = cfg
                .admin
                .api_key_file
                .as_ref()
                .ok_or("an admin listener on the network without admin.api_key_file")?;
            if self.mounted(w, c, token)?.0 != "Secret" {
                return Err("the admin token is not from a Secret".into());
            }
        }
        probe(c, c.readiness_probe.as_ref(), "/readiness", cfg.server.port)?;
        // Liveness is not behind the front door's connection limit.
        probe(c, c.liveness_probe.as_ref(), "/liveness", m.port)?;
        // Prometheus scrapes the metrics listener's /metrics.
        let ann = w
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.clone());
        let ann = ann.unwrap_or_default();
        let want = [
            ("prometheus.io/scrape", "true".to_string()),
            ("prometheus.io/port", m.port.to_string()),
            ("prometheus.io/path", "/metrics".to_string()),
        ];
        for (k, v) in want {
            if ann.get(k) != Some(&v) {
                return Err(format!("annotation {k} is {:?}, not {v}", ann.get(k)));
            }
        }
        // Kubernetes waits preStop, then SIGTERM; pdgate then drains for drain_secs.
        let grace = spec.termination_grace_period_seconds.unwrap_or(30);
        let pre_stop = pre_stop_secs(c)?;
        if grace <= pre_stop + cfg.server.drain_secs as i64 {
            return Err(format!(
                "terminationGracePeriodSeconds {grace} <= preStop {pre_stop} + drain_secs {}",
                cfg.server.drain_secs
            ));
        }
        let sc = c.security_context.as_ref().ok_or("no securityContext")?;
        let pod_sc = spec
            .security_context
            .as_ref()
            .ok_or("no pod securityContext")?;
        if sc.read_only_root_filesystem != Some(true)
            || sc.allow_privilege_escalation != Some(false)
            || pod_sc.run_as_non_root != Some(true)
        {
            return Err("pdgate must run non-root with a read-only root filesystem".into());
        }
        // The memory limit holds the documented bound (docs/pools-and-capacity.md, "Memory") for this config:
        // base + byte budget x factor + connections x per-connection cost.
        let limit = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("memory"))
            .ok_or("no memory limit")?;
        let limit = quantity_bytes(&limit.0)?;
        let bound = pdgate::memory::rss_bound(
            cfg.admission.max_bytes_in_flight,
            cfg.server.max_connections,
        );
        if limit < bound {
            return Err(format!(
                "memory limit {limit} bytes is below the documented bound {bound} bytes for \
                 admission.max_bytes_in_flight {} and server.max_connections {}",
                cfg.admission.max_bytes_in_flight, cfg.server.max_connections
            ));
        }
        if !cfg.discovery.enabled || cfg.discovery.all_namespaces != self.root.all_namespaces {
            return Err(format!(
                "discovery.enabled {} all_namespaces {}",
                cfg.discovery.enabled, cfg.discovery.all_namespaces
            ));
        }
        Ok(())
    }

    /// pdgate's service account may get, list and watch pods where discovery looks.
    fn check_rbac(&self, w: &Pods, cfg: &Config) -> Res<()> {
        let spec = w.template.spec.as_ref().ok_or("no pod spec")?;
        let sa = spec
            .service_account_name
            .clone()
            .ok_or("no serviceAccountName")?;
        Self::find(&self.objs, "ServiceAccount", &w.ns, &sa)?;
        let ns = w.ns.clone().unwrap_or_default();
        let is_us = |s: &k8s_openapi::api::rbac::v1::Subject, binding_ns: &str| {
            s.kind == "ServiceAccount"
                && s.name == sa
                && s.namespace.as_deref().unwrap_or(binding_ns) == ns
        };
        let rules: Vec<PolicyRule> = if cfg.discovery.all_namespaces {
            let b = self.of_kind::<ClusterRoleBinding>("ClusterRoleBinding")?;
            let b = b
                .iter()
                .find(|b| b.subjects.iter().flatten().any(|s| is_us(s, "")))
                .ok_or("no ClusterRoleBinding for pdgate's service account")?;
            let roles = self.of_kind::<ClusterRole>("ClusterRole")?;
            let r = roles
                .into_iter()
                .find(|r| {
                    b.role_ref.kind == "ClusterRole"
                        && r.metadata.name.as_deref() == Some(&b.role_ref.name)
                })
                .ok_or("the ClusterRoleBinding's ClusterRole is missing")?;
            r.rules.unwrap_or_default()
        } else {
            let b = self.of_kind::<RoleBinding>("RoleBinding")?;
            let b = b
                .iter()
                .find(|b| {
                    b.metadata.namespace.as_deref().unwrap_or_default() == ns
                        && b.subjects.iter().flatten().any(|s| is_us(s, &ns))
                })
                .ok_or("no RoleBinding for pdgate's service account")?;
            let r: Role = get(Self::find(&self.objs, "Role", &w.ns, &b.role_ref.name)?)?;
            r.rules.unwrap_or_default()
        };
        let grants = |verb: &str| {
            rules.iter().any(|r| {
                r.api_groups.iter().flatten().any(|g| g.is_empty())
                    && r.resources.iter().flatten().any(|x| x == "pods")
                    && r.verbs.iter().any(|v| v == verb)
            })
        };
        match ["get", "list", "watch"].into_iter().find(|v| !grants(v)) {
            Some(v) => Err(format!("pdgate may not {v} pods")),
            None => Ok(()),
        }
    }

    /// The replica count comes from pdgate's own pods: `admission.replica_selector` is the
    /// selector of a Service of the build that selects the pdgate pods, it selects those pods
    /// and no other workload, and the pod knows its name (`POD_NAME` from the downward API).
    /// (The RBAC that lets discovery read pods in pdgate's namespace covers it:
    /// `check_rbac`; a cluster-wide role covers it too.)
    fn check_replica_count(&self, router: &Pods, c: &Container, cfg: &Config) -> Res<()> {
        let sel = cfg
            .admission
            .replica_selector()
            .ok_or("admission.replica_selector is unset: the replica count is unknown")?;
        for w in &self.workloads {
            let labels = w
                .template
                .metadata
                .as_ref()
                .and_then(|m| m.labels.clone())
                .unwrap_or_default();
            let is_router = w.name == router.name && w.ns == router.ns;
            if selector_matches(Some(sel), &labels)? != is_router {
                return Err(format!(
                    "admission.replica_selector {sel:?} {} {}",
                    if is_router {
                        "does not select"
                    } else {
                        "selects"
                    },
                    w.name
                ));
            }
        }
        let terms: BTreeMap<String, String> = sel
            .split(',')
            .filter_map(|t| t.split_once('='))
            .map(|(k, v)| {
                (
                    k.trim().to_string(),
                    v.trim_start_matches('=').trim().to_string(),
                )
            })
            .collect();
        let own_service = self.of_kind::<Service>("Service")?.into_iter().any(|s| {
            let sel = s.spec.and_then(|sp| sp.selector);
            s.metadata.namespace == router.ns
                && sel.as_ref() == Some(&terms)
                && selects(sel.as_ref(), router)
        });
        if !own_service {
            return Err(format!(
                "admission.replica_selector {sel:?} is no Service's selector of the pdgate pods"
            ));
        }
        let pod_name = c.env.iter().flatten().find(|e| e.name == "POD_NAME");
        let from_downward_api = pod_name
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .is_some_and(|f| f.field_path == "metadata.name");
        if !from_downward_api {
            return Err("POD_NAME is not the pod's metadata.name (downward API)".into());
        }
        Ok(())
    }

    /// Services and PDBs select pods of the build, and a Service's target ports exist there.
    fn check_services_and_budgets(&self) -> Res<()> {
        for s in self.of_kind::<Service>("Service")? {
            let name = s.metadata.name.clone().unwrap_or_default();
            let spec = s.spec.ok_or("no spec")?;
            let pods: Vec<&Pods> = self
                .workloads
                .iter()
                .filter(|w| w.ns == s.metadata.namespace && selects(spec.selector.as_ref(), w))
                .collect();
            if pods.is_empty() {
                return Err(format!("Service {name} selects no pods"));
            }
            for p in spec.ports.iter().flatten() {
                let target = p.target_port.clone().unwrap_or(IntOrString::Int(p.port));
                for w in &pods {
                    let spec = w.template.spec.as_ref().ok_or("no pod spec")?;
                    let ok = spec
                        .containers
                        .iter()
                        .flat_map(|c| c.ports.iter().flatten())
                        .any(|cp| match &target {
                            IntOrString::Int(n) => cp.container_port == *n,
                            IntOrString::String(s) => cp.name.as_deref() == Some(s),
                        });
                    if !ok {
                        return Err(format!("Service {name}: {} has no port {target:?}", w.name));
                    }
                }
            }
        }
        for b in self.of_kind::<PodDisruptionBudget>("PodDisruptionBudget")? {
            let spec = b.spec.ok_or("no spec")?;
            let sel = spec.selector.and_then(|s| s.match_labels);
            if !self
                .workloads
                .iter()
                .any(|w| w.ns == b.metadata.namespace && selects(sel.as_ref(), w))
            {
                return Err("a PodDisruptionBudget selects no pods".into());
            }
        }
        Ok(())
    }

    /// Discovery's selectors find each engine workload as exactly one role, in a namespace
    /// it watches, and the engine's flags agree with its port and bootstrap annotation.
    fn check_engines(&self, router: &Pods, cfg: &Config) -> Res<()> {
        let d = &cfg.discovery;
        let mut roles = BTreeMap::<&str, i32>::new();
        for w in &self.workloads {
            let spec = w.template.spec.as_ref().ok_or("no pod spec")?;
            let labels = w
                .template
                .metadata
                .as_ref()
                .and_then(|m| m.labels.clone())
                .unwrap_or_default();
            let role = match (
                selector_matches(d.prefill_selector.as_deref(), &labels)?,
                selector_matches(d.decode_selector.as_deref(), &labels)?,
            ) {
                (true, true) => return Err(format!("{}: matches both selectors", w.name)),
                (true, false) => "prefill",
                (false, true) => "decode",
                (false, false) => continue,
            };
            if !d.all_namespaces && w.ns != router.ns {
                return Err(format!("{}: not in pdgate's namespace", w.name));
            }
            if spec.containers.len() != 1 {
                return Err(format!("{}: one engine container per pod", w.name));
            }
            let c = &spec.containers[0];
            let engine = engine_flags(self.root.engines, c)?;
            if engine.role != role {
                return Err(format!(
                    "{}: a {} engine labelled {role}",
                    w.name, engine.role
                ));
            }
            let name = d.port_name.as_deref().ok_or("discovery.port_name unset")?;
            if container_port(c, name)? != i32::from(engine.port) {
                return Err(format!(
                    "{}: port {name} is not the engine's --port",
                    w.name
                ));
            }
            probe(c, c.readiness_probe.as_ref(), "/health", engine.port)?;
            if role == "prefill" {
                let ann = w
                    .template
                    .metadata
                    .as_ref()
                    .and_then(|m| m.annotations.clone())
                    .unwrap_or_default();
                let a = ann
                    .get(&d.bootstrap_port_annotation)
                    .and_then(|v| v.parse::<u16>().ok());
                if a.is_none() || a != engine.bootstrap_port {
                    return Err(format!(
                        "{}: annotation {} is {a:?}, the engine's bootstrap port {:?}",
                        w.name, d.bootstrap_port_annotation, engine.bootstrap_port
                    ));
                }
            }
            *roles.entry(role).or_default() += w.replicas;
        }
        let want: BTreeSet<&str> = match self.root.engines {
            Engines::None => BTreeSet::new(),
            Engines::Sim | Engines::Sglang => ["decode", "prefill"].into(),
        };
        let have: BTreeSet<&str> = roles
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(r, _)| *r)
            .collect();
        if have != want {
            return Err(format!("engine roles {have:?}, expected {want:?}"));
        }
        Ok(())
    }
}

/// What an engine container says it is, from its flags.
struct EngineFlags {
    role: String,
    port: u16,
    bootstrap_port: Option<u16>,
}

fn engine_flags(engines: Engines, c: &Container) -> Res<EngineFlags> {
    let args = c.args.clone().unwrap_or_default();
    match engines {
        Engines::Sim => {
            if args.first().map(String::as_str) != Some("sim") {
                return Err(format!("{}: not pdgate sim", c.name));
            }
            // The simulator advertises the address it binds as its ranks' KV address: it
            // must be the pod's IP (0.0.0.0 would advertise 127.0.0.1).
            let host = flag(&args, "--host").ok_or("sim without --host")?;
            let var = host
                .strip_prefix("$(")
                .and_then(|h| h.strip_suffix(')'))
                .unwrap_or_default();
            let from = c.env.iter().flatten().find(|e| e.name == var);
            let field = from
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.field_ref.as_ref());
            if field.map(|f| f.field_path.as_str()) != Some("status.podIP") {
                return Err(format!("{}: --host {host} is not the pod IP", c.name));
            }
            let argv = expand_args(c)?;
            let cli = Cli::try_parse_from(std::iter::once("pdgate".to_string()).chain(argv))
                .map_err(|e| format!("{}: {e}", c.name))?;
            let Cmd::Sim(a) = cli.command else {
                return Err("not sim".into());
            };
            host_ip_ok(&a.host)?;
            let role = a.role.ok_or("sim without --role")?.to_string();
            let bootstrap_port = (role == "prefill").then_some(a.bootstrap_port);
            Ok(EngineFlags {
                role,
                port: a.port,
                bootstrap_port,
            })
        }
        Engines::Sglang => {
            let cmd = c.command.clone().unwrap_or_default();
            if !cmd.iter().any(|a| a == "sglang.launch_server") {
                return Err(format!("{}: not sglang.launch_server", c.name));
            }
            let num = |f: &str| flag(&args, f).and_then(|v| v.parse::<u16>().ok());
            Ok(EngineFlags {
                role: flag(&args, "--disaggregation-mode").ok_or("no --disaggregation-mode")?,
                port: num("--port").ok_or("no --port")?,
                bootstrap_port: num("--disaggregation-bootstrap-port"),
            })
        }
        Engines::None => Err(format!("{}: an engine in a build without engines", c.name)),
    }
}

fn host_ip_ok(host: &str) -> Res<()> {
    match host.parse::<IpAddr>() {
        Ok(ip) if !ip.is_unspecified() && !ip.is_loopback() => Ok(()),
        _ => Err(format!("sim --host {host}: not a pod IP")),
    }
}

/// `--name value` or `--name=value`.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| {
        if a == name {
            args.get(i + 1).cloned()
        } else {
            a.strip_prefix(name)
                .and_then(|r| r.strip_prefix('='))
                .map(str::to_string)
        }
    })
}

/// The container's args as the kubelet passes them: `$(VAR)` replaced from its env. A
/// reference to a variable the container does not define would stay literal: an error
/// here. A pod's IP stands in for `status.podIP`.
fn expand_args(c: &Container) -> Res<Vec<String>> {
    let env: BTreeMap<&str, String> = c
        .env
        .iter()
        .flatten()
        .map(|e| {
            let field = e.value_from.as_ref().and_then(|v| v.field_ref.as_ref());
            let v = match (&e.value, field.map(|f| f.field_path.as_str())) {
                (Some(v), _) => v.clone(),
                (None, Some("status.podIP")) => "10.244.1.7".to_string(),
                _ => format!("<{}>", e.name),
            };
            (e.name.as_str(), v)
        })
        .collect();
    c.args
        .iter()
        .flatten()
        .map(|a| {
            let mut out = String::new();
            let mut rest = a.as_str();
            while let Some(i) = rest.find("$(") {
                out.push_str(&rest[..i]);
                let end = rest[i..]
                    .find(')')
                    .ok_or_else(|| format!("unclosed $( in {a}"))?;
                let name = &rest[i + 2..i + end];
                out.push_str(
                    env.get(name)
                        .ok_or_else(|| format!("{a}: ${name} is not in env"))?,
                );
                rest = &rest[i + end + 1..];
            }
            out.push_str(rest);
            Ok(out)
        })
        .collect()
}

/// A Kubernetes memory quantity (`256Mi`, `1G`, `1048576`) in bytes.
fn quantity_bytes(q: &str) -> Res<u64> {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (num, mult) = units
        .iter()
        .find_map(|(u, m)| q.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    num.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|_| format!("memory quantity {q:?} is not understood"))
}

pub fn container_port(c: &Container, name: &str) -> Res<i32> {
    c.ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .map(|p| p.container_port)
        .ok_or_else(|| format!("{}: no container port named {name}", c.name))
}

/// An HTTP probe of `path` on `port` (named or numbered).
fn probe(c: &Container, p: Option<&Probe>, path: &str, port: u16) -> Res<()> {
    let g = p
        .and_then(|p| p.http_get.as_ref())
        .ok_or_else(|| format!("{}: no HTTP probe for {path}", c.name))?;
    let n = match &g.port {
        IntOrString::Int(n) => *n,
        IntOrString::String(s) => container_port(c, s)?,
    };
    if g.path.as_deref() != Some(path) || n != i32::from(port) {
        return Err(format!(
            "{}: probe {:?} on {n}, expected {path} on {port}",
            c.name, g.path
        ));
    }
    Ok(())
}

/// Seconds of a `sleep N` preStop hook (0 without one).
fn pre_stop_secs(c: &Container) -> Res<i64> {
    let Some(h) = c.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref()) else {
        return Ok(0);
    };
    if let Some(s) = &h.sleep {
        return Ok(s.seconds);
    }
    match h.exec.as_ref().and_then(|e| e.command.as_deref()) {
        Some([sleep, n]) if sleep == "sleep" => n.parse().map_err(|_| format!("sleep {n}")),
        other => Err(format!("{}: preStop {other:?} is not a sleep", c.name)),
    }
}

pub fn matches(
    sel: Option<&BTreeMap<String, String>>,
    labels: Option<&BTreeMap<String, String>>,
) -> bool {
    let (Some(sel), Some(labels)) = (sel, labels) else {
        return false;
    };
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn selects(sel: Option<&BTreeMap<String, String>>, w: &Pods) -> bool {
    matches(
        sel,
        w.template.metadata.as_ref().and_then(|m| m.labels.as_ref()),
    )
}

/// A label selector of equality terms (`k=v,k2==v2`), all the manifests use; the full
/// syntax is discovery's business.
fn selector_matches(sel: Option<&str>, labels: &BTreeMap<String, String>) -> Res<bool> {
    let Some(sel) = sel else { return Ok(false) };
    let mut all = true;
    for t in sel.split(',').map(str::trim) {
        let (k, v) = t
            .split_once("==")
            .or_else(|| t.split_once('='))
            .filter(|(k, _)| !k.ends_with('!'))
            .ok_or_else(|| format!("selector term {t:?}: only k=v terms are checked here"))?;
        all &= labels.get(k.trim()).map(String::as_str) == Some(v.trim());
    }
    Ok(all)
}
