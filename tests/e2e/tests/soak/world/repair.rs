//! The remediation lane (issue 56): the soak plays the MachineHealthCheck (a Machine's
//! `HealthCheckSucceeded`, the `MailgunRemediation` it makes, its deletion once the Machine is
//! healthy again) and the human who answers; the provider mails, reminds and hands back.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use anyhow::Result;
use capm_api::{names, records::Which};
use capm_e2e::ledger::{RepairFacts, RepairMail};
use kube::{
    ResourceExt,
    api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams},
};
use rand::{RngExt as _, rngs::StdRng};
use serde_json::{Value, json};

use super::{CAPI_GROUP, FIELD_MANAGER, INFRA_GROUP, Lane, MAX_REPLICAS, Op, Plan, lock, retry};

/// The reminders each remediation's strategy allows (at the shortest `answerTimeout`, 1m: a
/// remediation nobody answers is handed back about 4 minutes after its repair mail).
pub const REMINDERS: u8 = 3;
/// The remediation lane's own cluster (its machines live until they are remediated: a scale
/// down deletes unhealthy Machines first, and no other operation touches it), made in round 1,
/// deleted by the teardown.
pub const REPAIR_POOL: &str = "repair-pool";
/// The field manager of the health check the soak plays.
const HEALTH_CHECK: &str = "capm-soak-health-check";
/// How long a remediation waits for a Machine of its cluster whose request went out.
const FIND_MACHINE: Duration = Duration::from_secs(8);

/// What happens to a remediation some rounds after it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// The human answers `CannotRepair`: handed back at once, the MachineSet replaces it.
    CannotRepair,
    /// The human answers `Repaired`, and the health check finds the Machine healthy and
    /// deletes the object.
    Repaired,
    /// The Machine recovers before any answer: the health check deletes the object.
    Recovers,
    /// Nobody answers: reminders, then a timed hand-back (unless its Machine goes first).
    Ignored,
}

/// A `MailgunRemediation` the soak made.
pub struct Remedy {
    /// Its name (its Machine's).
    pub name: String,
    pub uid: String,
    pub cluster: String,
    /// What its mails are judged by.
    pub facts: RepairFacts,
    /// Resolved (answered or deleted by the soak).
    pub resolved: Option<Fate>,
}

impl Lane {
    /// Plans this round's remediation work, from the remediation lane's own generator (so the
    /// other operations of a seed stay what they were): in round 1 the pool; the fates due
    /// now, then, sometimes, a new remediation of a Machine of a cluster made in an earlier
    /// round (its machines are requested by now) that stays unpaused with machines, the pool
    /// for half of them.
    pub fn plan_remediations(&mut self, rng: &mut StdRng, round: u64, plan: &mut Plan) {
        if round == 1 {
            let replicas = MAX_REPLICAS;
            let intent = super::ClusterIntent {
                paused: false,
                replicas,
            };
            self.intent.insert(REPAIR_POOL.to_owned(), intent);
            let cluster = REPAIR_POOL.to_owned();
            let create = Op::Create {
                cluster,
                replicas,
                tenant: None,
            };
            plan.ops.insert(0, create);
        }
        let due: Vec<(u64, u32, Fate)> = self
            .fates
            .iter()
            .filter(|f| f.0 <= round)
            .copied()
            .collect();
        self.fates.retain(|f| f.0 > round);
        for (_, number, fate) in due {
            plan.ops.push(Op::Resolve { number, fate });
        }
        if !rng.random_bool(0.5) {
            return;
        }
        let this_round = format!("r{round}c");
        let fresh = |c: &str| c.starts_with(&this_round) || (round == 1 && c == REPAIR_POOL);
        let clusters: Vec<&String> = (self.intent.iter())
            .filter(|(c, i)| !i.paused && i.replicas > 0 && !fresh(c))
            .map(|(c, _)| c)
            .collect();
        if clusters.is_empty() {
            return;
        }
        let pool = clusters.iter().any(|c| c.as_str() == REPAIR_POOL) && rng.random_bool(0.5);
        let cluster = if pool {
            REPAIR_POOL.to_owned()
        } else {
            clusters[rng.random_range(0..clusters.len())].clone()
        };
        self.next_remedy += 1;
        let number = self.next_remedy;
        let fate = match rng.random_range(0..100u32) {
            0..25 => Fate::CannotRepair,
            25..45 => Fate::Repaired,
            45..70 => Fate::Recovers,
            _ => Fate::Ignored,
        };
        if fate != Fate::Ignored {
            self.fates
                .push((round + rng.random_range(1..=5), number, fate));
        }
        plan.ops.push(Op::Remediate {
            number,
            cluster,
            pick: rng.random_range(0..MAX_REPLICAS),
            built: rng.random_bool(0.8),
        });
    }

    fn remediations(&self) -> kube::Api<DynamicObject> {
        self.api(INFRA_GROUP, "v1beta1", "MailgunRemediation")
    }

    fn capi_machines(&self) -> kube::Api<DynamicObject> {
        self.api(CAPI_GROUP, "v1beta2", "Machine")
    }

    /// The Machines of `cluster` a health check could find unhealthy now: not being deleted,
    /// without a remediation, their `MailgunMachine` requested; by name, with their
    /// `MailgunMachine`'s name and whether it was built already (an earlier remediation's).
    /// `None` when some are still to come (no Machine yet, or one not yet requested).
    async fn remediable(&self, cluster: &str) -> Option<Vec<(DynamicObject, String, bool)>> {
        let machines = self.list(&self.capi_machines()).await?;
        let infra = self.list(&self.infra(super::Kind::Machine)).await?;
        let taken = self.list(&self.remediations()).await?;
        let of_cluster: Vec<DynamicObject> = machines
            .into_iter()
            .filter(|m| m.data["spec"]["clusterName"] == cluster)
            .filter(|m| m.metadata.deletion_timestamp.is_none())
            .collect();
        let none_yet = of_cluster.is_empty();
        let free: Vec<DynamicObject> = of_cluster
            .into_iter()
            .filter(|m| !taken.iter().any(|r| r.name_any() == m.name_any()))
            .collect();
        let all = free.len();
        let mut out: Vec<(DynamicObject, String, bool)> = free
            .into_iter()
            .filter_map(|m| {
                let name = m.data["spec"]["infrastructureRef"]["name"]
                    .as_str()?
                    .to_owned();
                let requested = infra.iter().find(|o| {
                    o.name_any() == name
                        && o.metadata.deletion_timestamp.is_none()
                        && names::request_recorded_sent(o.annotations())
                })?;
                let built = requested.data["spec"]["providerID"].is_string();
                Some((m, name, built))
            })
            .collect();
        out.sort_by_key(|(m, ..)| m.name_any());
        let to_come = none_yet || out.len() < all;
        (!to_come).then_some(out)
    }

    /// Sets the Machine's `HealthCheckSucceeded` as a MachineHealthCheck does (its own field
    /// manager, that one condition).
    async fn set_health(&self, machine: &str, healthy: bool) -> Result<()> {
        let (status, reason, message) = if healthy {
            ("True", "HealthCheckSucceeded", "")
        } else {
            (
                "False",
                "UnhealthyNode",
                "Condition Ready on Node is reporting status False for more than 1s",
            )
        };
        let now = jiff::Timestamp::now()
            .round(jiff::Unit::Second)?
            .to_string();
        let apply = json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": machine},
            "status": {"conditions": [{"type": "HealthCheckSucceeded", "status": status,
                "reason": reason, "message": message, "lastTransitionTime": now}]},
        });
        let api = self.capi_machines();
        let params = PatchParams::apply(HEALTH_CHECK).force();
        let patch = Patch::Apply(&apply);
        retry("setting HealthCheckSucceeded", || {
            api.patch_status(machine, &params, &patch)
        })
        .await
        .map(drop)
    }

    /// A Machine of `cluster` found unhealthy, and its `MailgunRemediation` as the health check
    /// makes it; when `built`, the human built it first (its `providerID`), else no mail is owed.
    pub(super) async fn remediate(
        &self,
        number: u32,
        cluster: &str,
        pick: u32,
        built: bool,
    ) -> Result<()> {
        let deadline = Instant::now() + FIND_MACHINE;
        let found = loop {
            match self.remediable(cluster).await {
                Some(candidates) if !candidates.is_empty() => {
                    break Some(candidates[pick as usize % candidates.len()].clone());
                }
                Some(_) => break None,
                None if Instant::now() >= deadline => break None,
                None => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        let Some((machine, infra, built_before)) = found else {
            self.note(format!(
                "remediation {number}: no Machine of {cluster} to remediate; skipped"
            ));
            return Ok(());
        };
        let name = machine.name_any();
        let built = built || built_before;
        let skipped = |e: anyhow::Error| {
            // Its Machine went meanwhile (scaled away, its cluster deleted).
            self.note(format!(
                "remediation {number}: {name} not remediated: {e:#}"
            ));
            Ok(())
        };
        if built && !built_before {
            let patch = json!({"spec": {"providerID": format!("soak://{name}")}});
            let infra_api = self.infra(super::Kind::Machine);
            if let Err(e) = self.patch(&infra_api, &infra, patch).await {
                return skipped(e);
            }
        }
        if let Err(e) = self.set_health(&name, false).await {
            return skipped(e);
        }
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunRemediation",
            "metadata": {"name": name, "namespace": self.ns,
                "labels": {names::CLUSTER_NAME_LABEL: cluster},
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                    "name": name, "uid": machine.uid()}]},
            "spec": {"request": format!("Soak: repair {name}, please."),
                "strategy": {"answerTimeout": "1m", "reminders": REMINDERS, "repairTimeout": "1m"}},
        }))?;
        let (api, pp) = (self.remediations(), PostParams::default());
        let created = match retry("creating a remediation", || api.create(&pp, &object)).await {
            Ok(created) => created,
            // A retry after the API server took it.
            Err(e) if super::is_status(&e, 409) => {
                retry("reading a remediation", || api.get(&name)).await?
            }
            Err(e) => return Err(e),
        };
        let uid = created.uid().unwrap_or_default();
        self.note(format!(
            "remediation {number}: Machine {name} of {cluster} unhealthy ({}); MailgunRemediation {uid}",
            if built { "built" } else { "never built" }
        ));
        let facts = RepairFacts {
            reminders: REMINDERS,
            unbuilt: !built,
            cut: None,
        };
        let remedy = Remedy {
            name,
            uid,
            cluster: cluster.to_owned(),
            facts,
            resolved: None,
        };
        lock(&self.remedies).insert(number, remedy);
        Ok(())
    }

    /// Plays a remediation's fate: the human's answer, the health check's deletion. The object
    /// as the answer or the deletion left it says which mails were under way: nothing else may
    /// come.
    pub(super) async fn resolve(&self, number: u32, fate: Fate) -> Result<()> {
        let Some((name, uid)) = lock(&self.remedies)
            .get(&number)
            .map(|r| (r.name.clone(), r.uid.clone()))
        else {
            return Ok(()); // never made: no Machine was found for it
        };
        let api = self.remediations();
        let live = retry("reading a remediation", || api.get_opt(&name)).await?;
        if live.as_ref().and_then(ResourceExt::uid).as_deref() != Some(uid.as_str())
            || live.is_some_and(|o| o.metadata.deletion_timestamp.is_some())
        {
            self.note(format!(
                "remediation {number}: {name} gone or going; {fate:?} skipped"
            ));
            return Ok(());
        }
        let mut cut = None;
        if let Some(result) = match fate {
            Fate::CannotRepair => Some("CannotRepair"),
            Fate::Repaired => Some("Repaired"),
            Fate::Recovers | Fate::Ignored => None,
        } {
            let answer = json!({"metadata": {"uid": uid}, "spec": {"answer": {"result": result, "message": "soak"}}});
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            let patch = Patch::Merge(&answer);
            let answered = match retry("answering", || api.patch(&name, &params, &patch)).await {
                Ok(answered) => answered,
                // Gone meanwhile (its Machine went), or another object of the name now.
                Err(e) if super::is_status(&e, 404) || super::is_status(&e, 409) => {
                    self.note(format!(
                        "remediation {number}: {name} gone; {fate:?} skipped"
                    ));
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            cut = Some(under_way(answered.annotations(), false));
            self.note(format!("remediation {number}: {name} answered {result}"));
        }
        if matches!(fate, Fate::Repaired | Fate::Recovers) {
            if let Err(e) = self.set_health(&name, true).await {
                // Its Machine went meanwhile: so does the object.
                self.note(format!(
                    "remediation {number}: {name} not made healthy: {e:#}"
                ));
                return Ok(());
            }
            let dp = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: Some(uid.clone()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            let deleted = retry("deleting a remediation", || api.delete(&name, &dp)).await;
            if let Some(o) = deleted.ok().and_then(|d| d.left()) {
                let answered = cut.is_some();
                let now = under_way(o.annotations(), !answered);
                cut = Some(cut.map_or(now.clone(), |mut c: Vec<RepairMail>| {
                    c.extend(now);
                    c
                }));
            }
            self.note(format!(
                "remediation {number}: {name} healthy again; deleted"
            ));
        }
        if let Some(r) = lock(&self.remedies).get_mut(&number) {
            r.facts.cut = cut.or(r.facts.cut.take());
            r.resolved = Some(fate);
        }
        Ok(())
    }

    /// The remediations the soak made, by UID, for the ledger.
    pub(super) fn repair_facts(&self) -> BTreeMap<String, RepairFacts> {
        lock(&self.remedies)
            .values()
            .map(|r| (r.uid.clone(), r.facts.clone()))
            .collect()
    }

    /// What keeps the remediations from being settled: an object of a deleted cluster, one
    /// deleted or handed back and not gone yet (its Machine is being replaced), a built one
    /// not yet mailed, one whose status does not show what the provider last decided (a
    /// paused cluster's: no deadline; a never built one's: waiting for fulfilment).
    pub(super) async fn remediations_unsettled(
        &self,
        paused: &BTreeMap<String, bool>,
    ) -> Vec<String> {
        let Some(objects) = self.list(&self.remediations()).await else {
            return vec!["the API server does not answer".into()];
        };
        let made = lock(&self.remedies)
            .values()
            .map(|r| {
                (
                    r.uid.clone(),
                    (r.cluster.clone(), r.facts.unbuilt, r.resolved),
                )
            })
            .collect::<BTreeMap<_, _>>();
        let mut missing = Vec::new();
        for o in &objects {
            let uid = o.uid().unwrap_or_default();
            let Some((cluster, unbuilt, resolved)) = made.get(&uid) else {
                continue;
            };
            let name = o.name_any();
            let ready = condition(&o.data, "Ready");
            let reason = ready.map_or("", |c| c["reason"].as_str().unwrap_or_default());
            let message = ready.map_or("", |c| c["message"].as_str().unwrap_or_default());
            let why = match paused.get(cluster) {
                None => Some("of a deleted Cluster, still there"),
                _ if o.metadata.deletion_timestamp.is_some() => Some("being deleted"),
                Some(true)
                    if message.starts_with("until ")
                        || reason == names::reasons::WAITING_FOR_FULFILMENT =>
                {
                    Some("its Cluster is paused, its status does not say so yet")
                }
                Some(true) => None,
                Some(false) if o.data["status"]["phase"] == "HandedBack" => {
                    Some("handed back, its Machine not replaced yet")
                }
                Some(false) if *resolved == Some(Fate::CannotRepair) => {
                    Some("answered CannotRepair, not handed back yet")
                }
                Some(false) if *unbuilt => (reason != names::reasons::WAITING_FOR_FULFILMENT)
                    .then_some("never built, not shown waiting for fulfilment yet"),
                Some(false) => (!names::request_recorded_sent(o.annotations())
                    || !o.data["status"]["mail"]["messageID"].is_string()
                    || !message.starts_with("until "))
                .then_some("its repair mail not sent and shown yet"),
            };
            if let Some(why) = why {
                missing.push(format!("MailgunRemediation {name} ({uid}): {why}"));
            }
        }
        missing
    }

    /// How long until the earliest deadline of a remediation (a reminder or a timed hand-back)
    /// that falls within `window` from now, if one does: a write it causes is not a write
    /// when quiet.
    pub(super) async fn deadline_within(&self, window: Duration) -> Option<Duration> {
        let objects = self.list(&self.remediations()).await?;
        let now = jiff::Timestamp::now();
        objects
            .iter()
            .filter_map(|o| {
                let message = condition(&o.data, "Ready")?["message"].as_str()?;
                let until: jiff::Timestamp = message.strip_prefix("until ")?.parse().ok()?;
                let left = Duration::try_from(until.duration_since(now)).unwrap_or_default();
                (left <= window).then_some(left)
            })
            .min()
    }
}

/// The condition `type_` of an object's status.
fn condition<'v>(object: &'v Value, type_: &str) -> Option<&'v Value> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// The mails whose records `annotations` carry (each may have gone out, or may still), and the
/// "no longer needed" mail when `owes_release` (a deletion nobody answered).
fn under_way(annotations: &BTreeMap<String, String>, owes_release: bool) -> Vec<RepairMail> {
    let mut mails: Vec<RepairMail> = [Which::Request, Which::Deletion]
        .into_iter()
        .chain((1..=REMINDERS).map(Which::Reminder))
        .filter(|w| annotations.contains_key(w.record_key()))
        .map(|w| match w {
            Which::Request => RepairMail::Repair,
            Which::Deletion => RepairMail::NoLongerNeeded,
            Which::Reminder(n) => RepairMail::Reminder(n),
        })
        .collect();
    if owes_release {
        mails.push(RepairMail::NoLongerNeeded);
    }
    mails
}

impl Lane {
    /// One line about the remediations: how many were made and resolved, and their mails.
    pub(super) fn remediation_summary(&self, ledger: &capm_e2e::ledger::Ledger) -> String {
        let remedies = lock(&self.remedies);
        let resolved = remedies.values().filter(|r| r.resolved.is_some()).count();
        let mut mails: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, which) in ledger.repairs.values().flatten() {
            let label = match which {
                RepairMail::Repair => "repair",
                RepairMail::Reminder(_) => "reminder",
                RepairMail::NoLongerNeeded => "no longer needed",
            };
            *mails.entry(label).or_default() += 1;
        }
        format!(
            "{} remediations ({resolved} answered or recovered), their mails {mails:?}",
            remedies.len()
        )
    }
}
