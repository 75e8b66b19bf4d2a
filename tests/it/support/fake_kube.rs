//! A fake Kubernetes API server for the discovery tests, on 127.0.0.1 (hyper): pod LIST and
//! WATCH as the real one answers them, so that the real `kube` client and its runtime
//! watcher run against it unchanged.
//!
//! What it serves, and how (the query parameters are the ones kube 5 sends; any other is
//! answered 400, so a protocol change shows up as a test failure):
//! - `GET /api/v1/namespaces/{ns}/pods` and `GET /api/v1/pods` (all namespaces), with a
//!   bearer token.
//! - LIST: `labelSelector` (equality, `!=`, `in`, `notin`, exists, `!key`), `limit` and
//!   `continue` (pages of at most `min(limit, page_cap)` pods, in name order, the continue
//!   token carrying the list's resourceVersion and the last key), `resourceVersion` with
//!   `resourceVersionMatch=NotOlderThan` or none. The answer's `metadata.resourceVersion`
//!   is the list's.
//! - WATCH (`watch=true`): `resourceVersion` (replays every change after it from the
//!   history, or answers an ERROR event 410 Expired when it was compacted away; `0` or
//!   empty starts with ADDED for every pod), `timeoutSeconds` (the stream ends then),
//!   `allowWatchBookmarks` (BOOKMARK events with the current resourceVersion), and
//!   `sendInitialEvents=true` + `resourceVersionMatch=NotOlderThan` (streaming lists: the
//!   pods as ADDED, then a BOOKMARK annotated `k8s.io/initial-events-end`). Events are one
//!   JSON object per line. A pod whose labels stop (start) matching a watch's selector is
//!   DELETED (ADDED) on it, as the API server's watch cache does.
//! - Faults: [`FakeKube::cut_watches`] ends every stream, [`FakeKube::expire`] sends 410
//!   Expired on every stream and compacts the history (a reconnect gets 410 too, and the
//!   client must relist), [`FakeKube::set_down`] closes every new connection (and answers 500 on a kept one),
//!   [`FakeKube::set_forbidden`] answers 403 as RBAC without `list pods` does.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde_json::{json, Value};
use tokio::sync::mpsc;

type Body = UnsyncBoxBody<Bytes, Infallible>;

pub const TOKEN: &str = "fake-kube-token";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Added,
    Modified,
    Deleted,
}

/// One change, as the history keeps it.
#[derive(Clone)]
struct Change {
    rv: u64,
    kind: Kind,
    old: Option<Pod>,
    new: Pod,
}

struct Watch {
    tx: mpsc::UnboundedSender<Bytes>,
    namespace: Option<String>,
    selector: Sel,
    bookmarks: bool,
}

#[derive(Default)]
struct State {
    rv: u64,
    pods: BTreeMap<(String, String), Pod>,
    history: Vec<Change>,
    /// A watch from a resourceVersion below this gets 410 Expired.
    oldest_rv: u64,
    watches: Vec<Watch>,
    down: bool,
    forbidden: bool,
    page_cap: usize,
    requests: Vec<String>,
    next_uid: u64,
}

/// The fake API server; stops when dropped.
pub struct FakeKube {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A running, ready pod on 127.0.0.1 whose engine listens on the container port `http`.
pub fn pod(name: &str, labels: &[(&str, &str)], port: u16) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "engine".into(),
                ports: Some(vec![ContainerPort {
                    name: Some("http".into()),
                    container_port: i32::from(port),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            termination_grace_period_seconds: Some(30),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some("127.0.0.1".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    }
}

/// Sets a pod's `Ready` condition.
pub fn set_ready(p: &mut Pod, ready: bool) {
    if let Some(cs) = p.status.as_mut().and_then(|s| s.conditions.as_mut()) {
        for c in cs.iter_mut().filter(|c| c.type_ == "Ready") {
            c.status = if ready { "True" } else { "False" }.into();
        }
    }
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn event(kind: &str, obj: &Pod) -> Bytes {
    line(&json!({"type": kind, "object": obj}))
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn respond(code: u16, v: &Value) -> hyper::Response<Body> {
    let mut r = hyper::Response::new(Full::new(Bytes::from(v.to_string())).boxed_unsync());
    *r.status_mut() = http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::BAD_REQUEST);
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn fail(code: u16, reason: &str, message: &str) -> hyper::Response<Body> {
    respond(code, &status(code, reason, message))
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'+', _, _) => out.push(b' '),
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 2;
            }
            (c, _, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(kv), String::new()),
        })
        .collect()
}

/// The fake's own reading of a label selector (kept apart from pdgate's parser, so one
/// does not vouch for the other).
#[derive(Clone, Debug, Default)]
struct Sel(Vec<Req>);

#[derive(Clone, Debug)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    Exists(String),
    Absent(String),
}

impl Sel {
    fn parse(s: &str) -> Result<Sel, String> {
        let mut parts = Vec::new();
        let (mut depth, mut start) = (0i32, 0usize);
        for (i, c) in s.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        let mut reqs = Vec::new();
        for p in parts.into_iter().map(str::trim) {
            if p.is_empty() {
                if s.trim().is_empty() {
                    continue;
                }
                return Err(format!("empty requirement in {s:?}"));
            }
            let set = |body: &str| -> BTreeSet<String> {
                body.trim_end_matches(')')
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .collect()
            };
            let req = if let Some(k) = p.strip_prefix('!') {
                Req::Absent(k.trim().to_string())
            } else if let Some((head, body)) = p.split_once('(') {
                let mut w = head.split_whitespace();
                match (w.next(), w.next(), w.next()) {
                    (Some(k), Some("in"), None) => Req::In(k.into(), set(body)),
                    (Some(k), Some("notin"), None) => Req::NotIn(k.into(), set(body)),
                    _ => return Err(format!("cannot read {p:?}")),
                }
            } else if let Some((k, v)) = p.split_once("!=") {
                Req::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = p.split_once("==").or_else(|| p.split_once('=')) {
                Req::Eq(k.trim().into(), v.trim().into())
            } else if p.contains(['<', '>', ' ']) {
                return Err(format!("the fake does not read {p:?}"));
            } else {
                Req::Exists(p.to_string())
            };
            reqs.push(req);
        }
        Ok(Sel(reqs))
    }

    fn matches(&self, p: &Pod) -> bool {
        let empty = BTreeMap::new();
        let l = p.metadata.labels.as_ref().unwrap_or(&empty);
        self.0.iter().all(|r| match r {
            Req::Eq(k, v) => l.get(k) == Some(v),
            Req::Ne(k, v) => l.get(k) != Some(v),
            Req::In(k, vs) => l.get(k).is_some_and(|v| vs.contains(v)),
            Req::NotIn(k, vs) => l.get(k).is_none_or(|v| !vs.contains(v)),
            Req::Exists(k) => l.contains_key(k),
            Req::Absent(k) => !l.contains_key(k),
        })
    }
}

fn in_scope(ns: &Option<String>, p: &Pod) -> bool {
    ns.as_ref()
        .is_none_or(|n| p.metadata.namespace.as_deref() == Some(n.as_str()))
}

impl Watch {
    /// The event a change makes on this watch, if any.
    fn event_for(&self, c: &Change) -> Option<Bytes> {
        let sees = |p: &Pod| in_scope(&self.namespace, p) && self.selector.matches(p);
        let was = c.old.as_ref().is_some_and(sees);
        let is = sees(&c.new);
        let kind = match (c.kind, was, is) {
            (Kind::Deleted, true, _) => "DELETED",
            (Kind::Added, _, true) => "ADDED",
            (Kind::Modified, true, true) => "MODIFIED",
            (Kind::Modified, false, true) => "ADDED",
            (Kind::Modified, true, false) => "DELETED",
            _ => return None,
        };
        Some(event(kind, &c.new))
    }
}

const LIST_PARAMS: &[&str] = &[
    "labelSelector",
    "limit",
    "continue",
    "resourceVersion",
    "resourceVersionMatch",
];
const WATCH_PARAMS: &[&str] = &[
    "watch",
    "labelSelector",
    "timeoutSeconds",
    "allowWatchBookmarks",
    "resourceVersion",
    "resourceVersionMatch",
    "sendInitialEvents",
];

impl FakeKube {
    pub async fn start() -> FakeKube {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(State {
            rv: 100,
            oldest_rv: 100,
            page_cap: 2,
            ..State::default()
        }));
        let st = state.clone();
        let serve = tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                // Down: connections are closed at once, as an unreachable server's are.
                if st.lock().unwrap_or_else(|e| e.into_inner()).down {
                    drop(s);
                    continue;
                }
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, Infallible>(handle(&st, req)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        let st = state.clone();
        let bookmarks = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let mut s = st.lock().unwrap_or_else(|e| e.into_inner());
                let rv = s.rv.to_string();
                let b = line(&json!({"type": "BOOKMARK", "object": {"kind": "Pod",
                    "apiVersion": "v1", "metadata": {"resourceVersion": rv}}}));
                s.watches
                    .retain(|w| !w.bookmarks || w.tx.send(b.clone()).is_ok());
            }
        });
        FakeKube {
            addr,
            state,
            tasks: vec![serve, bookmarks],
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server (context namespace `namespace`) to a fresh file.
    pub fn kubeconfig(&self, namespace: &str) -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pdgate-fake-kube-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\nusers:\n- name: fake\n  user:\n    token: {TOKEN}\n",
            self.url()
        );
        std::fs::write(&path, text).expect("kubeconfig");
        path
    }

    /// A client configuration for this server, from a kubeconfig file (not `KUBECONFIG`:
    /// the environment is the whole test process's).
    pub async fn config(&self, namespace: &str) -> kube::Config {
        let kc = kube::config::Kubeconfig::read_from(self.kubeconfig(namespace)).expect("read");
        kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("kube config")
    }

    /// A real kube client for this server ([`FakeKube::config`]).
    pub async fn client(&self, namespace: &str) -> kube::Client {
        kube::Client::try_from(self.config(namespace).await).expect("kube client")
    }

    fn commit(s: &mut State, kind: Kind, old: Option<Pod>, mut new: Pod) -> Pod {
        s.rv += 1;
        new.metadata.resource_version = Some(s.rv.to_string());
        let c = Change {
            rv: s.rv,
            kind,
            old,
            new: new.clone(),
        };
        s.watches.retain(|w| match w.event_for(&c) {
            Some(b) => w.tx.send(b).is_ok(),
            None => !w.tx.is_closed(),
        });
        s.history.push(c);
        new
    }

    /// Creates a pod in `namespace` (a fresh UID); returns the UID.
    pub fn create(&self, namespace: &str, mut p: Pod) -> String {
        self.with(|s| {
            s.next_uid += 1;
            let uid = format!("uid-{}", s.next_uid);
            p.metadata.namespace = Some(namespace.into());
            p.metadata.uid = Some(uid.clone());
            let key = (
                namespace.to_string(),
                p.metadata.name.clone().unwrap_or_default(),
            );
            assert!(!s.pods.contains_key(&key), "pod {key:?} exists");
            let p = Self::commit(s, Kind::Added, None, p);
            s.pods.insert(key, p);
            uid
        })
    }

    /// Changes a pod (MODIFIED).
    pub fn update(&self, namespace: &str, name: &str, f: impl FnOnce(&mut Pod)) {
        self.with(|s| {
            let key = (namespace.to_string(), name.to_string());
            let old = s.pods.get(&key).cloned().expect("no such pod");
            let mut new = old.clone();
            f(&mut new);
            let new = Self::commit(s, Kind::Modified, Some(old), new);
            s.pods.insert(key, new);
        })
    }

    /// Marks a pod terminating, as `kubectl delete` does first.
    pub fn terminate(&self, namespace: &str, name: &str, grace_secs: i64) {
        self.update(namespace, name, |p| {
            p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
            p.metadata.deletion_grace_period_seconds = Some(grace_secs);
        });
    }

    /// Removes a pod for good (DELETED).
    pub fn delete(&self, namespace: &str, name: &str) {
        self.with(|s| {
            let key = (namespace.to_string(), name.to_string());
            let old = s.pods.remove(&key).expect("no such pod");
            Self::commit(s, Kind::Deleted, Some(old.clone()), old);
        })
    }

    /// Removes a pod without telling any watch (an event lost on the way): only a new
    /// LIST shows it gone.
    pub fn delete_unseen(&self, namespace: &str, name: &str) {
        self.with(|s| {
            s.pods
                .remove(&(namespace.to_string(), name.to_string()))
                .expect("no such pod");
            s.rv += 1;
        })
    }

    /// Ends every open watch stream (the client reconnects from its resourceVersion).
    pub fn cut_watches(&self) {
        self.with(|s| s.watches.clear());
    }

    /// Sends 410 Expired on every open watch, closes them, and compacts the history: a
    /// watch from any earlier resourceVersion gets 410 too, so the client must relist.
    pub fn expire(&self) {
        self.with(|s| {
            s.oldest_rv = s.rv + 1;
            s.history.clear();
            let msg = format!("too old resource version: ({})", s.rv);
            let b = line(&json!({"type": "ERROR", "object": status(410, "Expired", &msg)}));
            for w in s.watches.drain(..) {
                let _ = w.tx.send(b.clone());
            }
        })
    }

    /// Closes every new connection (a kept one gets 500s) and ends the open watches
    /// while `down`.
    pub fn set_down(&self, down: bool) {
        self.with(|s| {
            s.down = down;
            if down {
                s.watches.clear();
            }
        })
    }

    /// Answers every request 403 Forbidden while `forbidden`, as the API server does for a
    /// service account without `list pods`.
    pub fn set_forbidden(&self, forbidden: bool) {
        self.with(|s| s.forbidden = forbidden)
    }

    /// Request targets (path and query) seen so far.
    pub fn requests(&self) -> Vec<String> {
        self.with(|s| s.requests.clone())
    }

    pub fn open_watches(&self) -> usize {
        self.with(|s| {
            s.watches.retain(|w| !w.tx.is_closed());
            s.watches.len()
        })
    }
}

fn handle(st: &Mutex<State>, req: hyper::Request<hyper::body::Incoming>) -> hyper::Response<Body> {
    let mut s = st.lock().unwrap_or_else(|e| e.into_inner());
    let target = req
        .uri()
        .path_and_query()
        .map_or_else(String::new, |pq| pq.to_string());
    s.requests.push(target);
    let auth_ok = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {TOKEN}"));
    if !auth_ok {
        return fail(401, "Unauthorized", "Unauthorized");
    }
    if s.down {
        // A kept-alive connection of before the outage: an internal error (kube retries
        // 429, 503 and 504 itself for minutes; a 500 reaches the watcher).
        return fail(500, "InternalError", "the fake API server is down");
    }
    let path = req.uri().path();
    if s.forbidden {
        let scope = path
            .strip_prefix("/api/v1/namespaces/")
            .and_then(|r| r.split('/').next())
            .map_or_else(
                || "at the cluster scope".to_string(),
                |ns| format!("in the namespace \"{ns}\""),
            );
        return fail(
            403,
            "Forbidden",
            &format!(
                "pods is forbidden: User \"system:serviceaccount:llm:pdgate\" cannot list \
                 resource \"pods\" in API group \"\" {scope}"
            ),
        );
    }
    let namespace = match path.split('/').collect::<Vec<_>>().as_slice() {
        ["", "api", "v1", "pods"] => None,
        ["", "api", "v1", "namespaces", ns, "pods"] => Some(ns.to_string()),
        _ => return fail(404, "NotFound", &format!("the fake serves no {path}")),
    };
    if req.method() != http::Method::GET {
        return fail(405, "MethodNotAllowed", "only GET");
    }
    let q = query(req.uri().query());
    let watching = q.get("watch").is_some_and(|v| v == "true" || v == "1");
    let allowed = if watching { WATCH_PARAMS } else { LIST_PARAMS };
    if let Some(k) = q.keys().find(|k| !allowed.contains(&k.as_str())) {
        return fail(
            400,
            "BadRequest",
            &format!("the fake does not know parameter {k}"),
        );
    }
    let selector = match Sel::parse(q.get("labelSelector").map_or("", String::as_str)) {
        Ok(sel) => sel,
        Err(e) => {
            return fail(
                400,
                "BadRequest",
                &format!("unable to parse requirement: {e}"),
            )
        }
    };
    match q.get("resourceVersionMatch").map(String::as_str) {
        None | Some("NotOlderThan") => {}
        Some(other) => {
            return fail(
                400,
                "BadRequest",
                &format!("resourceVersionMatch {other} not served"),
            )
        }
    }
    if watching {
        watch(&mut s, namespace, selector, &q)
    } else {
        list(&s, namespace, &selector, &q)
    }
}

fn list(
    s: &State,
    namespace: Option<String>,
    selector: &Sel,
    q: &BTreeMap<String, String>,
) -> hyper::Response<Body> {
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => usize::MAX,
        Some(Ok(l)) if l > 0 => l,
        Some(_) => return fail(400, "BadRequest", "bad limit"),
    };
    // A continue token: "<list rv>/<namespace>/<name>" of the last pod sent.
    let (list_rv, after) = match q.get("continue") {
        None => (s.rv, None),
        Some(tok) => {
            let mut it = tok.splitn(3, '/');
            match (
                it.next().and_then(|r| r.parse::<u64>().ok()),
                it.next(),
                it.next(),
            ) {
                (Some(rv), Some(ns), Some(name)) if rv >= s.oldest_rv => {
                    (rv, Some((ns.to_string(), name.to_string())))
                }
                (Some(_), Some(_), Some(_)) => {
                    return fail(410, "Expired", "the continue token is too old")
                }
                _ => return fail(400, "BadRequest", "bad continue token"),
            }
        }
    };
    let page = limit.min(s.page_cap.max(1));
    let mut items: Vec<&Pod> = Vec::new();
    let mut more = false;
    for (key, p) in &s.pods {
        if after.as_ref().is_some_and(|a| key <= a) {
            continue;
        }
        if !(in_scope(&namespace, p) && selector.matches(p)) {
            continue;
        }
        if items.len() == page {
            more = true;
            break;
        }
        items.push(p);
    }
    let mut meta = json!({"resourceVersion": list_rv.to_string()});
    if more {
        if let Some(last) = items.last() {
            meta["continue"] = json!(format!(
                "{list_rv}/{}/{}",
                last.metadata.namespace.as_deref().unwrap_or(""),
                last.metadata.name.as_deref().unwrap_or("")
            ));
        }
    }
    respond(
        200,
        &json!({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}),
    )
}

fn watch(
    s: &mut State,
    namespace: Option<String>,
    selector: Sel,
    q: &BTreeMap<String, String>,
) -> hyper::Response<Body> {
    let Some(timeout) = q.get("timeoutSeconds").and_then(|t| t.parse::<u64>().ok()) else {
        return fail(
            400,
            "BadRequest",
            "a watch needs timeoutSeconds (kube always sends it)",
        );
    };
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let initial = q.get("sendInitialEvents").is_some_and(|v| v == "true");
    if initial && !bookmarks {
        return fail(
            400,
            "BadRequest",
            "sendInitialEvents needs allowWatchBookmarks",
        );
    }
    let rv = q.get("resourceVersion").cloned().unwrap_or_default();
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    let w = Watch {
        tx,
        namespace,
        selector,
        bookmarks,
    };
    if rv.is_empty() || rv == "0" {
        for p in s.pods.values() {
            if in_scope(&w.namespace, p) && w.selector.matches(p) {
                let _ = w.tx.send(event("ADDED", p));
            }
        }
        if initial {
            let _ =
                w.tx.send(line(&json!({"type": "BOOKMARK", "object": {"kind": "Pod",
                "apiVersion": "v1", "metadata": {"resourceVersion": s.rv.to_string(),
                "annotations": {"k8s.io/initial-events-end": "true"}}}})));
        }
    } else {
        let Ok(from) = rv.parse::<u64>() else {
            return fail(400, "BadRequest", "bad resourceVersion");
        };
        if from + 1 < s.oldest_rv {
            // The real server opens the stream and sends the error as its only event.
            let msg = format!("too old resource version: {from} ({})", s.rv);
            let _ = w.tx.send(line(
                &json!({"type": "ERROR", "object": status(410, "Expired", &msg)}),
            ));
            drop(w);
            return stream(rx, Duration::from_secs(timeout));
        }
        for c in s.history.iter().filter(|c| c.rv > from) {
            if let Some(b) = w.event_for(c) {
                let _ = w.tx.send(b);
            }
        }
    }
    s.watches.push(w);
    stream(rx, Duration::from_secs(timeout))
}

/// The watch's body: its events, one JSON per line, until the fake drops the watch or
/// `timeoutSeconds` passes.
fn stream(rx: mpsc::UnboundedReceiver<Bytes>, within: Duration) -> hyper::Response<Body> {
    let deadline = tokio::time::Instant::now() + within;
    let body = futures_util::stream::unfold(rx, move |mut rx| async move {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(b)) => Some((Ok::<_, Infallible>(Frame::data(b)), rx)),
            _ => None,
        }
    });
    let mut r = hyper::Response::new(StreamBody::new(body).boxed_unsync());
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    r
}
