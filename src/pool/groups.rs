//! Workers grouped by what a KV handoff needs them to agree on ([`HandoffKey`]), and the
//! groups by the model clients name: computed at every snapshot rebuild, so that the
//! request path picks a prefill among its model's groups and a decode among the prefill's
//! partners from lists that are already made.
//!
//! Invariants:
//! - Every worker of a snapshot sits in exactly one group (`WorkerView::group`); a group's
//!   routable lists are the snapshot's routable workers of that group, nothing else.
//! - A group's partners are the routable workers of the other role in every group whose
//!   key is [compatible](HandoffKey::compatible) with its own (its own group included):
//!   a prefill is only ever paired with one of them.
//! - A model lists the groups whose key names it; its routable prefills are those of its
//!   groups that have a partner decode (a prefill is picked only where a partner exists),
//!   its routable decodes its groups' partner decodes. A group whose engines named no
//!   model (no `/server_info`, no override) belongs to no model.
//! - Regular (non-PD) workers sit in no group (`WorkerView::group` is [`NO_GROUP`]): they
//!   hand off nothing. They join their model by name (a model may be served by regular
//!   workers only), in its `regular_routable` list.
//! - Groups and models are in first-seen order of the workers (by role, then id), so a
//!   rebuild that changes nothing keeps every index.

use std::sync::Arc;

use super::Routable;
use crate::engine::HandoffKey;

/// The `group` of a regular worker: no handoff group (it indexes nothing).
pub const NO_GROUP: usize = usize::MAX;

/// One handoff group: workers that may be paired with each other.
#[derive(Debug)]
pub struct Group {
    pub key: Arc<HandoffKey>,
    /// Index into `Snapshot::models`, when the group names a model.
    pub model: Option<usize>,
    pub prefill_routable: Vec<Routable>,
    pub decode_routable: Vec<Routable>,
    /// Routable decodes a prefill of this group may pair with (compatible groups').
    pub partner_decodes: Vec<Routable>,
    /// Routable prefills a decode of this group may pair with (compatible groups').
    pub partner_prefills: Vec<Routable>,
}

/// One model as clients name it: the groups serving it.
#[derive(Debug)]
pub struct ModelView {
    pub name: Arc<str>,
    pub groups: Vec<usize>,
    pub prefill_routable: Vec<Routable>,
    pub decode_routable: Vec<Routable>,
    /// Routable regular (non-PD) workers of the model.
    pub regular_routable: Vec<Routable>,
    /// Workers of the model (any state), per role: `[prefill, decode, regular]`.
    pub workers: [usize; 3],
}

impl ModelView {
    /// Whether the model has PD workers at all (in any state).
    pub fn has_pd(&self) -> bool {
        self.workers[0] + self.workers[1] > 0
    }
}

/// Groups and models under construction (the snapshot builder feeds it worker by worker).
#[derive(Debug, Default)]
pub(super) struct Grouping {
    pub groups: Vec<Group>,
    pub models: Vec<ModelView>,
}

impl Grouping {
    /// The group of `key` (made on first sight) and its model's name.
    pub fn place(&mut self, key: HandoffKey) -> (usize, Option<Arc<str>>) {
        if let Some(i) = self.groups.iter().position(|g| *g.key == key) {
            let name = self.groups[i].model.map(|m| self.models[m].name.clone());
            return (i, name);
        }
        let model = key.model.as_deref().map(|name| self.model_index(name));
        let g = self.groups.len();
        if let Some(m) = model {
            self.models[m].groups.push(g);
        }
        self.groups.push(Group {
            key: Arc::new(key),
            model,
            prefill_routable: Vec::new(),
            decode_routable: Vec::new(),
            partner_decodes: Vec::new(),
            partner_prefills: Vec::new(),
        });
        (g, model.map(|m| self.models[m].name.clone()))
    }

    /// The index of the model named `name`, made on first sight.
    fn model_index(&mut self, name: &str) -> usize {
        match self.models.iter().position(|m| &*m.name == name) {
            Some(m) => m,
            None => {
                self.models.push(ModelView {
                    name: Arc::from(name),
                    groups: Vec::new(),
                    prefill_routable: Vec::new(),
                    decode_routable: Vec::new(),
                    regular_routable: Vec::new(),
                    workers: [0, 0, 0],
                });
                self.models.len() - 1
            }
        }
    }

    /// A regular worker's model (made on first sight), by the name it serves: its index and
    /// name (`None` while the engine named none).
    pub fn place_regular(&mut self, model: Option<&str>) -> (Option<usize>, Option<Arc<str>>) {
        let Some(name) = model else {
            return (None, None);
        };
        let m = self.model_index(name);
        (Some(m), Some(self.models[m].name.clone()))
    }

    /// Counts a regular worker of model `model` and lists it routable there when it is.
    pub fn add_regular(&mut self, model: Option<usize>, routable: Option<&Routable>) {
        let Some(m) = model.and_then(|m| self.models.get_mut(m)) else {
            return;
        };
        m.workers[2] += 1;
        if let Some(r) = routable {
            m.regular_routable.push(r.clone());
        }
    }

    /// Counts a worker of `group` (`role_ix`: 0 prefill, 1 decode) and lists it routable
    /// in its group when it is.
    pub fn add(&mut self, group: usize, role_ix: usize, routable: Option<&Routable>) {
        let Some(g) = self.groups.get_mut(group) else {
            return;
        };
        if let Some(m) = g.model.and_then(|m| self.models.get_mut(m)) {
            m.workers[role_ix] += 1;
        }
        if let Some(r) = routable {
            let list = if role_ix == 0 {
                &mut g.prefill_routable
            } else {
                &mut g.decode_routable
            };
            list.push(r.clone());
        }
    }

    /// Fills each group's partners and each model's routable lists (see the module
    /// docs). Returns the prefills that can be paired, all models together.
    pub fn finish(&mut self) -> Vec<Routable> {
        let n = self.groups.len();
        for g in 0..n {
            let mut decodes = Vec::new();
            let mut prefills = Vec::new();
            for h in 0..n {
                if self.groups[g].key.compatible(&self.groups[h].key) {
                    decodes.extend(self.groups[h].decode_routable.iter().cloned());
                    prefills.extend(self.groups[h].prefill_routable.iter().cloned());
                }
            }
            self.groups[g].partner_decodes = decodes;
            self.groups[g].partner_prefills = prefills;
        }
        let mut pairable = Vec::new();
        for g in &self.groups {
            let prefills: &[Routable] = if g.partner_decodes.is_empty() {
                &[]
            } else {
                &g.prefill_routable
            };
            pairable.extend(prefills.iter().cloned());
            if let Some(m) = g.model.and_then(|m| self.models.get_mut(m)) {
                m.prefill_routable.extend(prefills.iter().cloned());
                for d in &g.partner_decodes {
                    if !m.decode_routable.iter().any(|x| x.worker == d.worker) {
                        m.decode_routable.push(d.clone());
                    }
                }
            }
        }
        pairable
    }
}
