//! Hot reload: a new config file applied to a running router without a restart, on SIGHUP
//! (and, with `reload.watch_ms`, when the file's contents change), and whenever a secret
//! file it names (client keys, admin token) changes (`reload.secrets_watch_ms`, 2 s).
//!
//! What reloads: policies (load polling too, for existing workers), timeouts, retry,
//! breaker and admission settings (the top level's and each model's, `[models.settings]`,
//! through `Dispatcher::reconfigured`), health and bootstrap settings, the contract mode,
//! `log.access`, the static worker lists (added workers are checked before they take
//! traffic; removed ones drain, then go) and the client API keys and the admin token. What needs a restart (a change is logged and the
//! running value kept, so the effective config — `GET /config` — always says what runs):
//! `[server]`, the admin listener's address (`admin.enabled`, `host`, `port`),
//! `[discovery]`, `admission.replica_selector` (and, while it is set, the static replica
//! count), `[upstream]`, `[reload]`, `log.format` and `log.level`.
//!
//! Invariants:
//! - An invalid file changes nothing: the old config stays whole, and the log names the
//!   key, the value and the reason (the message of [`Config::validate`] or the parser).
//! - The swap is one store per holder (the live config, the front door's dispatcher): a
//!   request in flight finishes under the config it started with; streams are not touched.
//! - Static workers are diffed as lists of entries (a changed bootstrap port is a removal
//!   plus an addition); discovered and admin-added workers are never touched by a reload.
//! - `pdgate_config_reloads_total{result="ok"|"error"}` counts every attempt.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Config, ConfigError};
use crate::fleet::WorkerSpec;
use crate::pool::WorkerSource;
use crate::router::Router;
use crate::types::Role;
use crate::url::parse_base_url;

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Sections whose change needs a restart (kept at their running values).
    pub restart_needed: Vec<&'static str>,
    /// Static workers added and removed.
    pub added: usize,
    pub removed: usize,
}

/// Builds the config to apply: the file re-read with the command line's flags over it.
pub type Source = Box<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>;

/// Applies `new` to a running router (see the module docs). On error nothing changed.
pub fn apply(router: &Router, new: Config) -> Result<Applied, ConfigError> {
    let res = apply_inner(router, new);
    crate::telemetry::config_reloaded(res.is_ok());
    match &res {
        Ok(a) => {
            tracing::info!(added = a.added, removed = a.removed, restart_needed = ?a.restart_needed, "config reloaded")
        }
        Err(e) => tracing::error!(error = %e, "config reload refused; the running config is kept"),
    }
    res
}

fn apply_inner(router: &Router, mut new: Config) -> Result<Applied, ConfigError> {
    new.validate()?;
    // (Validation parsed every worker URL: the parses below cannot fail.)
    let live = router.fleet.live();
    let old = live.load_full();
    let mut applied = Applied::default();
    keep_restart_only(&old, &mut new, &mut applied.restart_needed);
    // Static workers: entries gone, then entries new (multiset difference).
    let gone_p = minus(&old.prefill, &new.prefill);
    let new_p = minus(&new.prefill, &old.prefill);
    let gone_d = minus(&old.decode, &new.decode);
    let new_d = minus(&new.decode, &old.decode);
    let gone_r = minus(&old.worker, &new.worker);
    let new_r = minus(&new.worker, &old.worker);
    // Secrets next, staged: a keys file or admin token that cannot be read refuses the
    // whole reload before anything changed.
    let keys = router
        .keys
        .stage(&new)
        .map_err(|e| ConfigError::Invalid(format!("auth.api_keys_file: {e}")))?;
    let token = match &router.admin {
        Some(admin) => Some(
            admin
                .stage_token(&new)
                .map_err(|e| ConfigError::Invalid(format!("admin token: {e}")))?,
        ),
        None => None,
    };
    router.keys.install(keys);
    if let (Some(admin), Some(token)) = (&router.admin, token) {
        admin.install_token(token);
    }
    let new = Arc::new(new);
    live.store(new.clone());
    router.server.reconfigure(new.clone());

    for p in new_p {
        if let Ok(url) = parse_base_url(&p.url) {
            let _ = router.fleet.add_checked(WorkerSpec {
                role: Role::Prefill,
                url,
                bootstrap_port: p.bootstrap_port,
                bootstrap_host: p.bootstrap_host.clone(),
                source: WorkerSource::Static,
                model: p.model.clone(),
            });
            applied.added += 1;
        }
    }
    for d in new_d {
        if let Ok(url) = parse_base_url(&d.url) {
            let _ = router.fleet.add_checked(WorkerSpec::static_plain(
                Role::Decode,
                url,
                d.model.clone(),
            ));
            applied.added += 1;
        }
    }
    for w in new_r {
        if let Ok(url) = parse_base_url(&w.url) {
            let _ = router.fleet.add_checked(WorkerSpec::static_plain(
                Role::Regular,
                url,
                w.model.clone(),
            ));
            applied.added += 1;
        }
    }
    let within = new.admin.remove_drain();
    let gone = gone_p
        .iter()
        .map(|p| (Role::Prefill, p.url.as_str()))
        .chain(gone_d.iter().map(|d| (Role::Decode, d.url.as_str())))
        .chain(gone_r.iter().map(|w| (Role::Regular, w.url.as_str())));
    for (role, url) in gone {
        let Ok(url) = parse_base_url(url) else {
            continue;
        };
        // The oldest static worker at that URL that is not already leaving (drained by an
        // operator or not: it is removed all the same).
        let id = router
            .pool
            .load()
            .workers(role)
            .iter()
            .find(|w| {
                w.shared.source == WorkerSource::Static && w.shared.url == url && !w.facts.leaving()
            })
            .map(|w| w.shared.id);
        if let Some(id) = id {
            if router.fleet.remove(role, id, within).is_ok() {
                applied.removed += 1;
            }
        }
    }
    Ok(applied)
}

/// Sections that only take effect at start keep their running values in `new`.
fn keep_restart_only(old: &Config, new: &mut Config, changed: &mut Vec<&'static str>) {
    // The file's values, before the running ones are put back: the warning names each key.
    let (was, asked) = (
        serde_json::to_value(old).ok(),
        serde_json::to_value(&*new).ok(),
    );
    macro_rules! keep {
        ($($field:ident).+, $name:literal) => {
            if old.$($field).+ != new.$($field).+ {
                changed.push($name);
                new.$($field).+ = old.$($field).+.clone();
            }
        };
    }
    keep!(server, "server");
    keep!(admin.enabled, "admin.enabled");
    keep!(admin.host, "admin.host");
    keep!(admin.port, "admin.port");
    keep!(discovery, "discovery");
    // The replica count's watch runs from the start: a change of its selector waits for a
    // restart, and while it runs the count is its own (a static count in the file, valid
    // without the selector, is kept out too).
    if old.admission.replica_selector() != new.admission.replica_selector() {
        changed.push("admission.replica_selector");
        new.admission
            .replica_selector
            .clone_from(&old.admission.replica_selector);
    }
    if old.admission.replica_selector().is_some() {
        keep!(admission.replicas, "admission.replicas");
        keep!(admission.replica_index, "admission.replica_index");
    }
    keep!(reload, "reload");
    keep!(upstream, "upstream");
    keep!(trace, "trace");
    keep!(log.format, "log.format");
    keep!(log.level, "log.level");
    keep!(log.buffer_lines, "log.buffer_lines");
    for s in changed.iter() {
        let keys = match (&was, &asked) {
            (Some(a), Some(b)) => changed_keys(a, b, s),
            _ => vec![s.to_string()],
        };
        tracing::warn!(
            section = s,
            keys = %keys.join(", "),
            "changed in the config file, but takes effect only at a restart; the running value \
             is kept (restart pdgate to apply it)"
        );
    }
}

/// The dotted keys under `path` (`"server"`, `"admin.host"`) whose values differ between
/// two serialized configs: the leaves of a section, or `path` itself.
fn changed_keys(a: &serde_json::Value, b: &serde_json::Value, path: &str) -> Vec<String> {
    let at = |v: &serde_json::Value| {
        path.split('.')
            .try_fold(v.clone(), |v, k| v.get(k).cloned())
            .unwrap_or(serde_json::Value::Null)
    };
    let (a, b) = (at(a), at(b));
    match (a.as_object(), b.as_object()) {
        (Some(x), Some(y)) => {
            let mut keys: Vec<String> = x
                .keys()
                .chain(y.keys().filter(|k| !x.contains_key(*k)))
                .filter(|k| x.get(*k) != y.get(*k))
                .map(|k| format!("{path}.{k}"))
                .collect();
            keys.sort();
            if keys.is_empty() {
                keys.push(path.to_string());
            }
            keys
        }
        _ => vec![path.to_string()],
    }
}

/// The entries of `a` not matched one-for-one in `b`.
fn minus<T: PartialEq + Clone>(a: &[T], b: &[T]) -> Vec<T> {
    let mut left: Vec<Option<&T>> = b.iter().map(Some).collect();
    a.iter()
        .filter(
            |x| match left.iter_mut().find(|y| y.is_some_and(|y| y == *x)) {
                Some(slot) => {
                    *slot = None;
                    false
                }
                None => true,
            },
        )
        .cloned()
        .collect()
}

/// What the watch compares between two looks: the config file's bytes (when watched) and
/// each secret file's bytes.
#[derive(PartialEq)]
struct Watched {
    config: Option<Vec<u8>>,
    secrets: Vec<Option<Vec<u8>>>,
}

/// The secret files the running config names (re-read each look: a reload may name
/// others).
fn secret_files(cfg: &Config) -> Vec<PathBuf> {
    cfg.auth
        .api_keys_file
        .iter()
        .chain(cfg.admin.api_key_file.iter())
        .cloned()
        .collect()
}

fn look(config: Option<&PathBuf>, secrets: &[PathBuf]) -> Watched {
    Watched {
        config: config.and_then(|f| std::fs::read(f).ok()),
        secrets: secrets.iter().map(|f| std::fs::read(f).ok()).collect(),
    }
}

/// Reloads on SIGHUP; when `watch` is set, when the config file's contents changed; and
/// when a secret file the running config names (client keys, admin token) changed, looked
/// at every `reload.secrets_watch_ms` (a rotated Kubernetes Secret needs no signal). Runs
/// until the router shuts down (the task is dropped with the runtime).
pub fn spawn(router: Arc<Router>, source: Source, file: Option<PathBuf>, watch: Option<Duration>) {
    tokio::spawn(async move { run(&router, source, file, watch).await });
}

/// The loop [`spawn`] runs; it never returns.
pub async fn run(router: &Router, source: Source, file: Option<PathBuf>, watch: Option<Duration>) {
    let secrets_every = router.fleet.live().load().reload.secrets_watch();
    {
        #[cfg(unix)]
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "SIGHUP reload unavailable");
                None
            }
        };
        let watched_file = file.as_ref().filter(|_| watch.is_some());
        let every = match (watch.filter(|_| file.is_some()), secrets_every) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let secrets = || secret_files(&router.fleet.live().load());
        let mut last = look(watched_file, &secrets());
        loop {
            let hup_fut = async {
                #[cfg(unix)]
                if let Some(h) = hup.as_mut() {
                    h.recv().await;
                    return "sighup";
                }
                std::future::pending::<&'static str>().await
            };
            let watch_fut = async {
                match every {
                    Some(every) => {
                        tokio::time::sleep(every).await;
                        "watch"
                    }
                    None => std::future::pending().await,
                }
            };
            let why = tokio::select! {
                w = hup_fut => w,
                w = watch_fut => w,
            };
            let now = look(watched_file, &secrets());
            if why == "watch" {
                if now == last {
                    continue;
                }
                let secret = now.secrets != last.secrets;
                last = now;
                tracing::info!(
                    trigger = if secret { "secret file" } else { "config file" },
                    "reloading the config"
                );
            } else {
                last = now;
                tracing::info!(trigger = why, "reloading the config");
            }
            match source() {
                Ok(cfg) => {
                    let _ = apply(router, cfg);
                    // The files a new config names are what the next look compares.
                    last = look(watched_file, &secrets());
                }
                Err(e) => {
                    crate::telemetry::config_reloaded(false);
                    tracing::error!(error = %e, "config reload refused; the running config is kept");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{changed_keys, keep_restart_only, minus};
    use crate::config::Config;

    #[test]
    fn multiset_difference() {
        let cases: &[(&[u8], &[u8], &[u8])] = &[
            (&[1, 2, 3], &[2], &[1, 3]),
            (&[1, 1, 2], &[1], &[1, 2]),
            (&[1], &[1, 1], &[]),
            (&[], &[1], &[]),
        ];
        for (a, b, want) in cases {
            assert_eq!(&minus(a, b), want, "{a:?} - {b:?}");
        }
    }

    /// A reload's restart warning names the keys that changed, not only their section.
    #[test]
    fn restart_only_changes_are_named_by_key() {
        let old = Config::default();
        let mut new = old.clone();
        new.server.port = 9000;
        new.server.max_connections = 10;
        new.admin.port = 29001;
        new.log.level = "debug".to_string();
        let mut changed = Vec::new();
        let (a, b) = (
            serde_json::to_value(&old).unwrap(),
            serde_json::to_value(&new).unwrap(),
        );
        keep_restart_only(&old, &mut new, &mut changed);
        assert_eq!(changed, ["server", "admin.port", "log.level"]);
        assert_eq!(new, old, "the running values are kept");
        assert_eq!(
            changed_keys(&a, &b, "server"),
            ["server.max_connections", "server.port"]
        );
        assert_eq!(changed_keys(&a, &b, "admin.port"), ["admin.port"]);
        assert_eq!(changed_keys(&a, &b, "discovery"), ["discovery"]);
    }

    /// The replica selector needs a restart; while it runs, a static count in the file
    /// does not apply (the count is discovery's), and an empty selector is no change.
    #[test]
    fn the_replica_selector_and_its_count_are_kept() {
        let sel = |s: Option<&str>, replicas: u32, index: Option<u32>| {
            let mut c = Config::default();
            c.admission.replica_selector = s.map(str::to_string);
            c.admission.replicas = replicas;
            c.admission.replica_index = index;
            c
        };
        // (running, in the file, what runs after the reload, the keys named)
        let cases: Vec<(Config, Config, Config, Vec<&str>)> = vec![
            (
                sel(Some("app=pdgate"), 0, None),
                sel(None, 3, Some(1)),
                sel(Some("app=pdgate"), 0, None),
                vec![
                    "admission.replica_selector",
                    "admission.replicas",
                    "admission.replica_index",
                ],
            ),
            (
                sel(None, 2, None),
                sel(Some("app=pdgate"), 0, None),
                sel(None, 0, None),
                vec!["admission.replica_selector"],
            ),
            (
                sel(None, 2, None),
                sel(Some(""), 3, None),
                sel(Some(""), 3, None),
                vec![],
            ),
        ];
        for (old, mut new, want, keys) in cases {
            let mut changed = Vec::new();
            keep_restart_only(&old, &mut new, &mut changed);
            assert_eq!(changed, keys);
            assert_eq!(new.admission, want.admission);
        }
    }
}
