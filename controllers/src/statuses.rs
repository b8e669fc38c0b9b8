//! Our objects' statuses as the caches keep them: packed, and exactly what the API server holds.
//!
//! A reconcile starts from the status the API server holds (transition times, a delivery
//! outcome) and writes only when what it computes differs from it, so the cache must keep it.
//! Inside the cached typed objects it was the largest part of a finished object in memory: five
//! conditions of four `String`s, each a heap allocation. Here the status leaves the object on its
//! way into the cache (the objects in the reflector stores carry none) and is kept packed, by
//! UID, with the few annotations a reconcile reads: every string this provider writes (condition types, statuses, reasons, the empty message)
//! is a two-byte index into one static table, and any other text (a message with a peer's words,
//! an older release's wording, a hostile writer's) is kept whole beside it. Unpacking gives back
//! the same status, so a reconcile decides exactly as it did on the typed copy.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Mutex,
};

use capm_api::{
    names::{conditions, reasons},
    v1beta1::{Initialization, MachineAddress, MailStatus},
};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};

use capm_api::v1beta1::MailgunCluster;
use kube::ResourceExt;

use crate::{cache::READ_ANNOTATIONS, kinds::InfraKind, status::Status};

/// The strings a status of ours is made of.
const KNOWN: &[&str] = &[
    "",
    "True",
    "False",
    "Unknown",
    conditions::READY,
    conditions::PAUSED,
    conditions::MAIL_SENT,
    conditions::MAIL_DELIVERED,
    conditions::PROVISIONED,
    reasons::WAITING_FOR_OWNER,
    reasons::WAITING_FOR_CLUSTER_INFRASTRUCTURE,
    reasons::WAITING_FOR_BOOTSTRAP_DATA,
    reasons::PAUSED,
    reasons::NOT_PAUSED,
    reasons::MAIL_PENDING,
    reasons::MAIL_SENT,
    reasons::MAIL_FAILED,
    reasons::DELIVERY_PENDING,
    reasons::DELIVERY_DELAYED,
    reasons::DELIVERED,
    reasons::DELIVERY_FAILED,
    reasons::PARTLY_DELIVERED,
    reasons::DELIVERY_UNKNOWN,
    reasons::NOT_TRACKABLE,
    reasons::DELETION_MAIL_SENT,
    reasons::OWNER_MISMATCH,
    reasons::OWNER_DELETING,
    reasons::FOREIGN_RECORD,
    reasons::WAITING_FOR_FULFILLMENT,
    reasons::PROVISIONED,
    reasons::DELETING,
    reasons::INVALID_SPEC,
];

/// One condition: four strings as indexes (below `KNOWN.len()` into [`KNOWN`], from there on
/// into the status's own texts), its time and generation.
#[derive(Debug, Clone, PartialEq)]
struct PackedCondition {
    texts: [u16; 4],
    observed_generation: Option<i64>,
    last_transition_time: Timestamp,
}

/// A status, packed.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Packed {
    conditions: Option<Box<[PackedCondition]>>,
    /// The texts not in [`KNOWN`].
    others: Box<[Box<str>]>,
    mail: Option<Box<MailStatus>>,
    initialization: Option<Initialization>,
    observed_generation: Option<i64>,
    addresses: Option<Box<[MachineAddress]>>,
}

impl Packed {
    /// Packs `status`.
    pub(crate) fn pack(status: Status) -> Self {
        let mut others: Vec<Box<str>> = Vec::new();
        let mut index = |text: String| -> u16 {
            if let Some(i) = KNOWN.iter().position(|k| *k == text) {
                return i as u16;
            }
            if let Some(i) = others.iter().position(|o| **o == *text) {
                return (KNOWN.len() + i) as u16;
            }
            others.push(text.into_boxed_str());
            (KNOWN.len() + others.len() - 1) as u16
        };
        let conditions = status.conditions.map(|cs| {
            cs.into_iter()
                .map(|c| PackedCondition {
                    texts: [
                        index(c.type_),
                        index(c.status),
                        index(c.reason),
                        index(c.message),
                    ],
                    observed_generation: c.observed_generation,
                    last_transition_time: c.last_transition_time.0,
                })
                .collect()
        });
        Self {
            conditions,
            others: others.into_boxed_slice(),
            mail: status.mail.map(Box::new),
            initialization: status.initialization,
            observed_generation: status.observed_generation,
            addresses: status.addresses.map(Vec::into_boxed_slice),
        }
    }

    fn text(&self, index: u16) -> String {
        let i = usize::from(index);
        KNOWN
            .get(i)
            .copied()
            .or_else(|| self.others.get(i - KNOWN.len()).map(|s| &**s))
            .unwrap_or_default()
            .to_owned()
    }

    /// The status as it was packed.
    pub(crate) fn unpack(&self) -> Status {
        Status {
            initialization: self.initialization.clone(),
            conditions: self.conditions.as_ref().map(|cs| {
                cs.iter()
                    .map(|c| {
                        let [type_, status, reason, message] = c.texts.map(|t| self.text(t));
                        Condition {
                            type_,
                            status,
                            reason,
                            message,
                            observed_generation: c.observed_generation,
                            last_transition_time: Time(c.last_transition_time),
                        }
                    })
                    .collect()
            }),
            observed_generation: self.observed_generation,
            addresses: self.addresses.as_ref().map(|a| a.to_vec()),
            mail: self.mail.as_deref().cloned(),
        }
    }
}

struct Entry {
    /// The list round that last saw the object.
    round: u32,
    status: Packed,
    /// The annotations a reconcile reads ([`READ_ANNOTATIONS`]), by index into that list. A
    /// one-entry `BTreeMap` in the cached object took a whole B-tree leaf (over 500 bytes).
    annotations: Box<[(u8, Box<str>)]>,
}

/// What the cache keeps of an object beside the reflector store.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Kept {
    /// Its status, as the API server holds it.
    pub(crate) status: Status,
    /// Its annotations of [`READ_ANNOTATIONS`].
    pub(crate) annotations: BTreeMap<String, String>,
}

/// The packed statuses of one kind's cached objects, by UID, kept in step with its watch: set
/// by every object event, removed by its deletion, and the objects a new list no longer has
/// dropped when it completes.
#[derive(Default)]
pub struct StatusCache {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    round: u32,
    entries: HashMap<Box<str>, Entry>,
}

impl StatusCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The object `uid` now has `status` and `annotations` (of which only those a reconcile
    /// reads are kept).
    pub(crate) fn put(
        &self,
        uid: &str,
        status: Status,
        annotations: Option<BTreeMap<String, String>>,
    ) {
        let status = Packed::pack(status);
        let annotations: Box<[(u8, Box<str>)]> = annotations
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| {
                let i = READ_ANNOTATIONS.iter().position(|r| *r == k)?;
                Some((i as u8, v.into_boxed_str()))
            })
            .collect();
        let mut inner = self.lock();
        let round = inner.round;
        match inner.entries.get_mut(uid) {
            Some(entry) => {
                entry.round = round;
                entry.status = status;
                entry.annotations = annotations;
            }
            None => {
                inner.entries.insert(
                    uid.into(),
                    Entry {
                        round,
                        status,
                        annotations,
                    },
                );
            }
        }
    }

    /// The object `uid` was deleted.
    pub(crate) fn remove(&self, uid: &str) {
        self.lock().entries.remove(uid);
    }

    /// A (re-)list starts: what it does not see again is dropped at [`Self::end_list`].
    pub(crate) fn begin_list(&self) {
        let mut inner = self.lock();
        inner.round = inner.round.wrapping_add(1);
    }

    /// The list completed: objects it did not see are gone.
    pub(crate) fn end_list(&self) {
        let mut inner = self.lock();
        let round = inner.round;
        inner.entries.retain(|_, e| e.round == round);
        inner.entries.shrink_to_fit();
    }

    /// What the API server last sent for `uid`, if the watch brought it here.
    pub(crate) fn get(&self, uid: &str) -> Option<Kept> {
        self.lock().entries.get(uid).map(|e| Kept {
            status: e.status.unpack(),
            annotations: e
                .annotations
                .iter()
                .map(|(i, v)| (READ_ANNOTATIONS[usize::from(*i)].to_owned(), v.to_string()))
                .collect(),
        })
    }

    /// How many objects it holds.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the provider's cache does to a `MailgunCluster` on its way in (its status packed into
/// `statuses`, the rest trimmed as [`crate::cache`] says), for measurements of the cache.
pub fn cache_mailgun_cluster(obj: &mut MailgunCluster, statuses: &StatusCache) {
    statuses.keep(obj);
    crate::cache::trim_ours(obj);
}

impl StatusCache {
    /// Moves `obj`'s status and annotations here (the object keeps neither).
    pub(crate) fn keep<K: InfraKind>(&self, obj: &mut K) {
        let status = obj.take_status().unwrap_or_default();
        let annotations = obj.meta_mut().annotations.take();
        self.put(&obj.uid().unwrap_or_default(), status, annotations);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(message: &str, reason: &str) -> Status {
        let mut s = Status {
            observed_generation: Some(3),
            mail: Some(MailStatus {
                message_id: Some("<mailguncluster.u@mg.example.com>".into()),
                ..MailStatus::default()
            }),
            initialization: Some(Initialization {
                provisioned: Some(true),
            }),
            ..Status::default()
        };
        s.set_condition(conditions::PAUSED, false, reasons::NOT_PAUSED, "");
        s.set_condition(conditions::MAIL_SENT, false, reason, message);
        s.set_condition(conditions::READY, false, reason, message);
        s
    }

    #[test]
    fn packing_loses_nothing() {
        for s in [
            Status::default(),
            status("", reasons::MAIL_PENDING),
            status("relay said: 451 \u{fffd} try later", "SomethingElse"),
        ] {
            let packed = Packed::pack(s.clone());
            assert_eq!(packed.unpack(), s);
            assert!(!s.differs_on_the_wire(&packed.unpack()));
        }
        let mut legacy = status("", reasons::MAIL_PENDING);
        for c in legacy.conditions.iter_mut().flatten() {
            c.observed_generation = Some(2);
        }
        assert_eq!(Packed::pack(legacy.clone()).unpack(), legacy);
    }

    #[test]
    fn our_strings_take_no_room_of_their_own() {
        let packed = Packed::pack(status("", reasons::MAIL_PENDING));
        assert!(packed.others.is_empty());
        let packed = Packed::pack(status("timeout", reasons::MAIL_PENDING));
        assert_eq!(
            &*packed.others,
            [Box::from("timeout")],
            "kept once, used twice"
        );
    }

    #[test]
    fn a_new_list_drops_what_it_did_not_see() {
        let cache = StatusCache::default();
        cache.put("a", status("", reasons::MAIL_PENDING), None);
        cache.put("b", Status::default(), None);
        cache.begin_list();
        let b = status("x", reasons::MAIL_PENDING);
        let annotations: BTreeMap<String, String> = [
            (capm_api::names::MAIL_ANNOTATION, "{}"),
            (capm_api::names::PAUSED_ANNOTATION, ""),
            ("kubectl.kubernetes.io/last-applied-configuration", "{...}"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        cache.put("b", b.clone(), Some(annotations.clone()));
        cache.end_list();
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.get("a"), None);
        let kept = cache.get("b").unwrap();
        assert_eq!(kept.status, b);
        let mut read = annotations;
        read.remove("kubectl.kubernetes.io/last-applied-configuration");
        assert_eq!(kept.annotations, read, "only what a reconcile reads");
        cache.remove("b");
        assert!(cache.is_empty());
    }
}
