//! Where a worker came from (who may change or remove it) and why it takes no new
//! requests: each drain reason has one owner, so one never undoes another.

/// Where a worker came from: who may change or remove it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerSource {
    /// The config file or the command line (reload owns it).
    Static,
    /// `POST /workers` or `/add_worker` on the admin API.
    Admin,
    /// A Kubernetes pod found by discovery (discovery owns it).
    Discovered(PodRef),
}

impl WorkerSource {
    pub fn label(&self) -> &'static str {
        match self {
            WorkerSource::Static => "static",
            WorkerSource::Admin => "admin",
            WorkerSource::Discovered(_) => "discovered",
        }
    }
}

/// The pod behind a discovered worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// Why a worker takes no new requests. Each reason is set and cleared by its own owner,
/// so one never undoes another: a pod's readiness coming back does not undo an operator's
/// drain, and an operator's undrain does not put an unready pod back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drain {
    /// An operator drained it (admin API).
    pub operator: bool,
    /// Its pod is not ready (discovery).
    pub unready: bool,
    /// It is being removed.
    pub leaving: bool,
}

impl Drain {
    pub fn any(self) -> bool {
        self.operator || self.unready || self.leaving
    }
}

/// Who sets a [`Drain`] reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainBy {
    Operator,
    Unready,
    Leaving,
}

impl DrainBy {
    /// Its name in logs: `operator`, `pod_unready`, `leaving`.
    pub fn label(self) -> &'static str {
        match self {
            DrainBy::Operator => "operator",
            DrainBy::Unready => "pod_unready",
            DrainBy::Leaving => "leaving",
        }
    }
}
