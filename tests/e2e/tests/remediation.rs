//! Remediation by mail (issue 56; docs/proposals/remediation-by-mail.md), end to end with the
//! real Cluster API core manager: its MachineHealthCheck controller creates a
//! `MailgunRemediation` from the `MailgunRemediationTemplate` its `remediation.templateRef`
//! names, the provider mails a human, and its MachineSet replaces a Machine handed back.
//!
//! One environment: the chart (with the fulfilment page on) and the provider as its
//! Deployment runs it, Cluster API, the test control plane and bootstrap providers, one Cluster
//! whose `<cluster>-kubeconfig` Secret makes the management API server play the workload cluster
//! (as in `health_checks.rs`). Each story has its own MachineDeployment, template and health check
//! (they select only their own pool), and they run at once. The human builds each worker by
//! running its request mail's command; the test then writes the Node a kubelet would (its
//! `spec.providerID` the MailgunMachine's), and flips its `Ready` condition through the status
//! subresource: the health checks watch `Ready=False` for 1 s. (A healthy worker is known by
//! its health check's `currentHealthy`: with a `templateRef`, Cluster API v1.14.2 writes
//! `HealthCheckSucceeded=True` only on a Machine whose remediation object it deletes.) The strategies' durations are
//! the shortest the CRD accepts (`answerTimeout`, `repairTimeout`: 1m).
//!
//! 1. A Node goes NotReady: one `MailgunRemediation` as the health check makes it (named like the
//!    Machine, a non-controller ownerReference to it, the cluster-name label, cloned from the
//!    template), one repair mail; answered `Repaired` in headless Chromium through the repair
//!    mail's link to the page; the Node Ready again: the health check deletes the object, the
//!    Machine keeps its UID, no release mail, no other mail. (A mail without the link fails the
//!    story at its end, after the rest was shown with a link minted as the provider mints it.)
//! 2. `CannotRepair` by the mail's `kubectl patch`: the MachineSet replaces the Machine (one
//!    release, one new request), exactly one repair mail.
//! 3. No answer, `reminders: 1`: the repair mail and one reminder threaded to it
//!    (`In-Reply-To`, `References`, `Re:`, the repair mail's link), then the hand-back (`NoAnswer`): exactly two mails.
//! 4. `Repaired`, the Node stays NotReady: handed back after `repairTimeout` (`RepairTimedOut`).
//! 5. The Node recovers before any answer: one "no longer needed" mail, threaded.
//! 6. The storm setup of `health_checks.rs` (30 s startup timeout, workers nobody builds) with
//!    the template: no Machine replaced and no mail in 3 timeouts; the objects wait
//!    (`WaitingForFulfilment`).
//! 7. Two Machines unhealthy at once (their Nodes' `Ready=False` from the same instant): both
//!    get an object on the health check's same pass and both are mailed. Cluster API creates at
//!    most the objects of one pass: a Machine found unhealthy on a later pass, while another's
//!    object exists, gets none until a pass lists it first (`patchUnhealthyTargets` returns
//!    when an object exists; see the design). With `unhealthyLessThanOrEqualTo` then exceeded
//!    (`RemediationAllowed=False`), a timed hand-back waits (`HandBackHeld`) and a `CannotRepair`
//!    goes through. The held one still waits while the replacement has no Node (Cluster API
//!    counts a Machine not yet started as unhealthy), and goes through once the human built it
//!    and the health check allows remediation again.
//! 8. Every hand-back (stories 2, 3, 4, 7): the Machine's version just before the provider's
//!    write and the one it wrote (from a watch of every version) differ only in
//!    `OwnerRemediated`, v1beta2 and the deprecated v1beta1 copy: every other condition, the spec,
//!    labels and annotations as they were.
//!
//! Every story counts its mails at the Mailgun contract server, per Message-Id
//! (`capm_e2e::ledger`).

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, bail, ensure};
use capm_api::{
    link_token::{DEFAULT_VALIDITY, KeyRing, Keys, Links},
    owner_remediated::HANDED_BACK_REASON,
};
use capm_e2e::{
    CHART_NAMESPACE as NS, FULLNAME, RELEASE,
    browser::{self, Visit, chromium, link_in, page_says},
    create_namespace, create_object, create_secret, dynamic_api, eventually, free_port,
    fulfil_command, helm_chart,
    ledger::{Ledger, RepairMail},
    mailgun_ledger, mailgun_mails, mailgun_values, start_capi_manager, start_routed_chart_provider,
    topology::{self, TestProviders},
};
use capm_mail_servers::{MailgunServer, StoredMessage};
use capm_test_support::{ControlPlane, Options};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::{
    Api, Client, ResourceExt,
    api::{DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams},
};
use serde_json::{Value, json};

const USER_NS: &str = "team-repair";
const DOMAIN: &str = "mg.repair.example.com";
const RECIPIENT: &str = "datacentre-team@example.com";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";
const CAPI: &str = "cluster.x-k8s.io";
const CLUSTER: &str = "repair";
const POOL_LABEL: &str = "e2e.capm.example.com/pool";
/// A test key (32 bytes, base64): the page's links are sealed with it.
const KEY: &str = "cmVtZWRpYXRpb24tZTJlLWtleS1vZi10aGlydHktdHdv";
/// The storm story's node startup timeout (the shortest Cluster API's webhook accepts).
const STARTUP_TIMEOUT_SECONDS: u64 = 30;
/// How long a story waits for something the provider or Cluster API does at once.
const SOON: Duration = Duration::from_secs(60);
/// How long a story waits for something 1m timers do (the shortest strategy durations).
const TIMED: Duration = Duration::from_secs(150);

/// The environment every story shares.
struct World {
    cp: ControlPlane,
    admin: Client,
    mailgun: MailgunServer,
    dir: PathBuf,
    /// The fulfilment page's public URL.
    page: String,
    /// Every version of every Machine of the namespace, in the order the API server wrote them.
    history: Arc<Mutex<Vec<DynamicObject>>>,
}

fn conditions(object: &Value) -> Vec<Value> {
    object["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn condition(object: &Value, type_: &str) -> Option<Value> {
    conditions(object).into_iter().find(|c| c["type"] == type_)
}

fn condition_is(object: &Value, type_: &str, status: &str) -> bool {
    condition(object, type_).is_some_and(|c| c["status"] == status)
}

fn phase(object: &DynamicObject) -> String {
    object.data["status"]["phase"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Seconds-precise RFC 3339 now, as a kubelet writes its condition times.
fn now() -> Result<String> {
    Ok(jiff::Timestamp::now()
        .round(jiff::Unit::Second)?
        .to_string())
}

impl World {
    fn api(&self, group: &str, version: &str, kind: &str) -> Api<DynamicObject> {
        dynamic_api(&self.admin, USER_NS, group, version, kind)
    }

    fn machines(&self) -> Api<DynamicObject> {
        self.api(CAPI, "v1beta2", "Machine")
    }

    fn remediations(&self) -> Api<DynamicObject> {
        self.api(INFRA, "v1beta1", "MailgunRemediation")
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.admin.clone())
    }

    fn ledger(&self) -> Result<Ledger> {
        mailgun_ledger(&self.mailgun, DOMAIN)
    }

    fn messages(&self) -> Result<Vec<StoredMessage>> {
        Ok(self.mailgun.messages()?)
    }

    /// The stored mail with this Message-Id, and its text.
    fn mail(&self, message_id: &str) -> Result<Option<StoredMessage>> {
        Ok(self.messages()?.into_iter().find(|m| m.id == message_id))
    }

    /// Runs a `kubectl` command line (as split by [`fulfil_command`]) as the admin.
    fn kubectl(&self, command: &[String]) -> Result<String> {
        ensure!(
            command.first().map(String::as_str) == Some("kubectl"),
            "{command:?}"
        );
        let mut kubectl = self.cp.kubectl()?;
        kubectl.args(&command[1..]);
        capm_e2e::run(&mut kubectl, &command.join(" "))
    }

    /// Sets the Node's `Ready` condition, changed at `at`.
    async fn set_ready(&self, node: &str, ready: bool, at: &str) -> Result<()> {
        let (status, reason) = if ready {
            ("True", "KubeletReady")
        } else {
            ("False", "KubeletNotReady")
        };
        self.nodes()
            .patch_status(
                node,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": [{
                    "type": "Ready", "status": status, "reason": reason,
                    "message": format!("set by the remediation test: {reason}"),
                    "lastHeartbeatTime": at, "lastTransitionTime": at,
                }]}})),
            )
            .await
            .with_context(|| format!("setting Node {node} Ready={status}"))?;
        Ok(())
    }

    /// The versions of the Machine `uid` the watch saw.
    fn versions(&self, uid: &str) -> Vec<DynamicObject> {
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        history
            .iter()
            .filter(|m| m.uid().as_deref() == Some(uid))
            .cloned()
            .collect()
    }

    /// Story 8: waits until the provider handed the Machine `uid` back (its `OwnerRemediated`
    /// with the provider's reason, as the watch saw it), and checks that its write changed
    /// nothing else. Returns the condition it wrote.
    async fn handed_back(&self, uid: &str, within: Duration) -> Result<Value> {
        let (before, after) = eventually(
            within,
            &format!("the Machine {uid} handed back (OwnerRemediated {HANDED_BACK_REASON})"),
            || async {
                let versions = self.versions(uid);
                let at = versions.iter().position(|m| {
                    condition(&m.data, "OwnerRemediated")
                        .is_some_and(|c| c["reason"] == HANDED_BACK_REASON)
                });
                Ok(match at {
                    Some(0) => bail!("the watch saw no version of {uid} before its hand-back"),
                    Some(i) => Some((versions[i - 1].clone(), versions[i].clone())),
                    None => None,
                })
            },
        )
        .await?;
        let written = condition(&after.data, "OwnerRemediated").context("no OwnerRemediated")?;
        ensure!(
            written["status"] == "False",
            "OwnerRemediated not False: {written}"
        );
        let v1beta1 = after.data["status"]["deprecated"]["v1beta1"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "OwnerRemediated")
            .cloned();
        ensure!(
            v1beta1
                .as_ref()
                .is_some_and(|c| c["status"] == "False" && c["reason"] == HANDED_BACK_REASON),
            "the deprecated v1beta1 OwnerRemediated not written with the hand-back: {v1beta1:?}"
        );
        let (was, is) = (rest_of_machine(&before), rest_of_machine(&after));
        if was != is {
            bail!(
                "story 8: the hand-back of Machine {} changed more than OwnerRemediated \
                 (resourceVersion {:?} -> {:?}):\n  before: {was}\n  after:  {is}",
                after.name_any(),
                before.resource_version(),
                after.resource_version()
            );
        }
        Ok(written)
    }

    /// Waits until the Machine `uid` is gone and its pool has `replicas` other Machines; returns
    /// them.
    async fn replaced(&self, pool: &str, uid: &str, replicas: usize) -> Result<Vec<DynamicObject>> {
        eventually(
            TIMED,
            &format!("the MachineSet replacing Machine {uid}"),
            || async {
                let machines = self.pool_machines(pool).await?;
                let gone = machines.iter().all(|m| m.uid().as_deref() != Some(uid));
                Ok((gone && machines.len() == replicas).then_some(machines))
            },
        )
        .await
    }

    async fn pool_machines(&self, pool: &str) -> Result<Vec<DynamicObject>> {
        Ok(self
            .machines()
            .list(&ListParams::default().labels(&format!("{POOL_LABEL}={pool}")))
            .await?
            .items)
    }

    /// Waits for the MachineHealthCheck's `MailgunRemediation` of `machine`, checks it is as
    /// the health check makes one, and returns it.
    async fn remediation_of(&self, machine: &Built, template: &str) -> Result<DynamicObject> {
        let api = self.remediations();
        let object = eventually(
            SOON,
            &format!("the MailgunRemediation of Machine {}", machine.machine),
            || async { Ok(api.get_opt(&machine.machine).await?) },
        )
        .await?;
        let owners = object.owner_references();
        ensure!(
            owners.iter().any(|o| o.kind == "Machine"
                && o.name == machine.machine
                && o.uid == machine.machine_uid
                && o.controller != Some(true)),
            "not owned by Machine {} ({}): {owners:?}",
            machine.machine,
            machine.machine_uid
        );
        ensure!(
            object
                .labels()
                .get("cluster.x-k8s.io/cluster-name")
                .map(String::as_str)
                == Some(CLUSTER),
            "the cluster-name label: {:?}",
            object.labels()
        );
        ensure!(
            object
                .annotations()
                .get("cluster.x-k8s.io/cloned-from-name")
                .map(String::as_str)
                == Some(template),
            "not cloned from the template {template}: {:?}",
            object.annotations()
        );
        Ok(object)
    }

    /// Waits for the repair mail of the remediation `uid`.
    async fn repair_mail(&self, uid: &str) -> Result<StoredMessage> {
        let id = format!("<mailgunremediation.{uid}@{DOMAIN}>");
        eventually(SOON, &format!("the repair mail {id}"), || async {
            self.mail(&id)
        })
        .await
    }

    /// The remediation `uid`'s mails so far: (repair, reminders, no longer needed).
    fn repair_counts(&self, uid: &str) -> Result<(usize, usize, usize)> {
        let ledger = self.ledger()?;
        let reminders = (1..=3)
            .map(|n| ledger.repair_mails(uid, RepairMail::Reminder(n)))
            .sum();
        Ok((
            ledger.repair_mails(uid, RepairMail::Repair),
            reminders,
            ledger.repair_mails(uid, RepairMail::NoLongerNeeded),
        ))
    }

    /// Five seconds on, the remediation `uid` has had exactly `want` mails: (repair, reminders,
    /// no longer needed). The wait gives a mail that should not come the time to come.
    async fn counts_stay(&self, uid: &str, want: (usize, usize, usize)) -> Result<()> {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let counts = self.repair_counts(uid)?;
        ensure!(
            counts == want,
            "(repair, reminders, no longer needed) mails: {counts:?}, not {want:?}"
        );
        Ok(())
    }

    /// Waits until the health check deleted the remediation `name` (and its finalizer went).
    async fn remediation_gone(&self, name: &str) -> Result<()> {
        eventually(
            SOON,
            &format!("the MailgunRemediation {name} gone"),
            || async {
                Ok(self
                    .remediations()
                    .get_opt(name)
                    .await?
                    .is_none()
                    .then_some(()))
            },
        )
        .await
    }

    /// The MailgunMachine `uid`'s (request, release) mails so far.
    fn machine_counts(&self, uid: &str) -> Result<(usize, usize)> {
        let ledger = self.ledger()?;
        Ok(ledger
            .entries
            .iter()
            .find(|(o, _)| o.uid == uid)
            .map_or((0, 0), |(_, e)| (e.requests.len(), e.releases.len())))
    }

    /// Waits until the remediation `name` shows `want`; returns it.
    async fn phase_becomes(
        &self,
        name: &str,
        want: &str,
        within: Duration,
    ) -> Result<DynamicObject> {
        let api = self.remediations();
        let found = eventually(
            within,
            &format!("MailgunRemediation {name} {want}"),
            || async {
                let object = api.get(name).await?;
                Ok((phase(&object) == want).then_some(object))
            },
        )
        .await;
        match found {
            Ok(object) => Ok(object),
            Err(e) => {
                let now = api.get_opt(name).await?;
                Err(e.context(format!(
                    "its status now: {}",
                    now.map_or_else(|| "gone".to_owned(), |o| o.data["status"].to_string())
                )))
            }
        }
    }
}

/// The Machine without what the hand-back may change (`OwnerRemediated`, v1beta2 and v1beta1)
/// and without what every write changes (resourceVersion, managedFields).
fn rest_of_machine(machine: &DynamicObject) -> Value {
    let mut data = machine.data.clone();
    let drop_owner_remediated = |list: &mut Value| {
        if let Some(list) = list.as_array_mut() {
            list.retain(|c| c["type"] != "OwnerRemediated");
        }
    };
    drop_owner_remediated(&mut data["status"]["conditions"]);
    if data["status"]["deprecated"]["v1beta1"]["conditions"].is_array() {
        drop_owner_remediated(&mut data["status"]["deprecated"]["v1beta1"]["conditions"]);
    }
    json!({
        "labels": machine.labels(),
        "annotations": machine.annotations(),
        "finalizers": machine.finalizers(),
        "data": data,
    })
}

/// A built worker: its Machine, MailgunMachine and Node.
#[derive(Debug, Clone)]
struct Built {
    machine: String,
    machine_uid: String,
    infra_uid: String,
    node: String,
    provider_id: String,
}

/// One story's MachineDeployment, `MailgunRemediationTemplate` and MachineHealthCheck, all
/// named `name` and selecting only the pool `name`.
async fn create_pool(
    world: &World,
    name: &str,
    replicas: usize,
    strategy: Value,
    checks: Value,
    trigger_if: Option<Value>,
) -> Result<()> {
    let admin = &world.admin;
    let create = |group: &str, version: &str, kind: &str, spec: Value| {
        create_object(admin, USER_NS, group, version, kind, name, spec)
    };
    topology::create_templates(admin, USER_NS, name).await?;
    create(
        INFRA,
        "v1beta1",
        "MailgunMachineTemplate",
        json!({"template": {"spec": {
            "priority": "Urgent", "request": format!("A worker of pool {name} please"),
            "requester": "cluster-admin@example.com",
        }}}),
    )
    .await?;
    create(INFRA, "v1beta1", "MailgunRemediationTemplate", json!({"template": {"spec": {
        "request": format!("A worker of pool {name} is unhealthy.\nPower-cycle it, check its cable."),
        "strategy": strategy,
    }}}))
    .await?;
    let mut remediation = json!({"templateRef": {
        "apiVersion": format!("{INFRA}/v1beta1"), "kind": "MailgunRemediationTemplate", "name": name,
    }});
    if let Some(trigger_if) = trigger_if {
        remediation["triggerIf"] = trigger_if;
    }
    create(
        CAPI,
        "v1beta2",
        "MachineHealthCheck",
        json!({
            "clusterName": CLUSTER,
            "selector": {"matchLabels": {POOL_LABEL: name}},
            "checks": checks,
            "remediation": remediation,
        }),
    )
    .await?;
    create(
        CAPI,
        "v1beta2",
        "MachineDeployment",
        topology::machine_deployment(CLUSTER, POOL_LABEL, name, replicas),
    )
    .await?;
    Ok(())
}

/// The health checks of every story but the storm: a Node `Ready=False` for 1 s.
fn ready_checks() -> Value {
    json!({"unhealthyNodeConditions": [{"type": "Ready", "status": "False", "timeoutSeconds": 1}]})
}

/// The shortest strategy the CRD accepts, with `reminders`.
fn quick(reminders: u8) -> Value {
    json!({"answerTimeout": "1m", "reminders": reminders, "repairTimeout": "1m"})
}

/// The human builds the worker `machine` of `pool` (its request mail's command) and the test
/// writes its Node, Ready: waits until the Machine has its Node.
async fn build_machine(world: &World, pool: &str, machine: &DynamicObject) -> Result<Built> {
    let infra = world.api(INFRA, "v1beta1", "MailgunMachine");
    let infra_name = machine.data["spec"]["infrastructureRef"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let mm = eventually(SOON, &format!("MailgunMachine {infra_name}"), || async {
        Ok(infra.get_opt(&infra_name).await?)
    })
    .await?;
    let infra_uid = mm.uid().context("no UID")?;
    let id = format!("<mailgunmachine.{infra_uid}@{DOMAIN}>");
    let body = eventually(SOON, &format!("the request mail {id}"), || async {
        Ok(mailgun_mails(&world.mailgun)?
            .into_iter()
            .find(|(m, _)| m.message_id == id)
            .map(|(_, body)| body))
    })
    .await?;
    let provider_id = format!("mailgun://{pool}/{}", machine.name_any());
    let command = fulfil_command(
        &body,
        &[("<scheme>://<id>", &provider_id), ("<ip>", "192.0.2.10")],
    )?;
    world.kubectl(&command)?;
    let node = format!("{}-node", machine.name_any());
    let object: Node = serde_json::from_value(
        json!({"metadata": {"name": node}, "spec": {"providerID": provider_id}}),
    )?;
    world
        .nodes()
        .create(&PostParams::default(), &object)
        .await?;
    world.set_ready(&node, true, &now()?).await?;
    let b = Built {
        machine: machine.name_any(),
        machine_uid: machine.uid().context("no UID")?,
        infra_uid,
        node,
        provider_id,
    };
    let found = eventually(
        SOON,
        &format!("Machine {} with Node {}", b.machine, b.node),
        || async {
            let m = world.machines().get(&b.machine).await?;
            Ok((m.data["status"]["nodeRef"]["name"] == b.node.as_str()).then_some(()))
        },
    )
    .await;
    if let Err(e) = found {
        let m = world.machines().get(&b.machine).await?;
        return Err(e.context(format!(
            "providerID {}, nodeRef {}, conditions {}",
            m.data["spec"]["providerID"],
            m.data["status"]["nodeRef"],
            m.data["status"]["conditions"]
        )));
    }
    Ok(b)
}

/// The human builds every worker of `pool` (its request mail's command) and the test writes its
/// Node, Ready: waits until each Machine has its Node and passes its health check.
async fn build_pool(world: &World, pool: &str, replicas: usize) -> Result<Vec<Built>> {
    let machines = eventually(SOON, &format!("{replicas} Machines of {pool}"), || async {
        let machines = world.pool_machines(pool).await?;
        let named = machines
            .iter()
            .all(|m| m.data["spec"]["infrastructureRef"]["name"].is_string());
        Ok((machines.len() == replicas && named).then_some(machines))
    })
    .await?;
    let mut built = Vec::new();
    for machine in &machines {
        built.push(build_machine(world, pool, machine).await?);
    }
    // The health check counts them healthy. (It does not mark them: with a `templateRef`,
    // Cluster API v1.14.2 sets `HealthCheckSucceeded` on a healthy Machine only when it has a
    // remediation object to delete: `patchHealthyTargets` skips the others.)
    let checks = world.api(CAPI, "v1beta2", "MachineHealthCheck");
    eventually(
        SOON,
        &format!("the {pool} health check counting {replicas} healthy"),
        || async {
            let c = checks.get(pool).await?;
            Ok((c.data["status"]["currentHealthy"] == replicas
                && c.data["status"]["expectedMachines"] == replicas)
                .then_some(()))
        },
    )
    .await?;
    Ok(built)
}

/// The single worker of a one-replica pool remediated with `strategy`, built, then its Node
/// NotReady: its remediation checked as the health check makes it; the repair mail (exactly one
/// so far) and the remediation's UID.
async fn one_unhealthy(
    world: &World,
    pool: &str,
    strategy: Value,
) -> Result<(Built, StoredMessage, String)> {
    create_pool(world, pool, 1, strategy, ready_checks(), None).await?;
    let built = build_pool(world, pool, 1).await?.remove(0);
    world.set_ready(&built.node, false, &now()?).await?;
    let remediation = world.remediation_of(&built, pool).await?;
    let uid = remediation.uid().context("no UID")?;
    let mail = world.repair_mail(&uid).await?;
    ensure!(
        mail.subject
            == format!(
                "[Urgent] Machine {} of Cluster {CLUSTER} needs repair",
                built.machine
            ),
        "the repair mail's subject: {:?}",
        mail.subject
    );
    let body = mail.text.clone().unwrap_or_default();
    for want in [
        format!("Machine: {}", built.machine),
        format!("Node: {}", built.node),
        format!("Provider ID: {}", built.provider_id),
        "Power-cycle it, check its cable.".to_owned(),
        format!(
            "kubectl patch mailgunremediation {} -n {USER_NS}",
            built.machine
        ),
    ] {
        ensure!(
            body.contains(&want),
            "{want:?} not in the repair mail:\n{body}"
        );
    }
    Ok((built, mail, uid))
}

/// The `kubectl patch` line of a repair mail whose answer is `result`.
fn answer_command(mail: &StoredMessage, result: &str, why: &str) -> Result<Vec<String>> {
    let body = mail.text.clone().unwrap_or_default();
    let line = body
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("kubectl patch") && l.contains(&format!("\"{result}\"")))
        .with_context(|| format!("no kubectl line answering {result} in the mail:\n{body}"))?;
    fulfil_command(line, &[("<why>", why)])
}

/// Story 1.
async fn story_1(world: &World) -> Result<String> {
    let (built, mail, uid) =
        one_unhealthy(world, "s1", json!({"answerTimeout": "1h", "reminders": 1})).await?;
    // The page's link: the mail's, or (when the mail carries none) as the provider mints it for
    // the object's recorded repair mail, so that the rest of the story is still shown; the
    // story fails at its end then.
    let body = mail.text.clone().unwrap_or_default();
    let (link, mailed) = match link_in(&body) {
        Ok(link) => {
            ensure!(link.starts_with(&world.page), "a link elsewhere: {link}");
            (link, true)
        }
        Err(_) => {
            let recorded = world
                .phase_becomes(&built.machine, "WaitingForAnswer", SOON)
                .await?;
            let links = Links {
                base_url: world.page.clone(),
                validity: DEFAULT_VALIDITY,
                keys: KeyRing::new(Keys::parse(KEY).map_err(|e| anyhow::anyhow!("{e}"))?),
            };
            let link = links
                .repair_link(&recorded.metadata, DOMAIN, SystemTime::now())
                .context("no repair link for the recorded repair mail")?;
            (link, false)
        }
    };
    let report = browser::browse(&Visit {
        link: &link,
        screenshots: &world.dir.join("screenshots"),
        prefix: "repair",
        fill: &[("Message", "Reseated the power cable.")],
        select: &[("result", "Repaired")],
        refused: None,
        proxy: None,
    })?;
    page_says(
        &report,
        "request",
        "A machine needs repair",
        &[&built.machine, "Power-cycle it, check its cable."],
    )?;
    page_says(
        &report,
        "submitted",
        "Recorded",
        &["Repaired", "Reseated the power cable."],
    )?;
    page_says(&report, "again", "Already answered", &["Repaired"])?;
    let answered = world.remediations().get(&built.machine).await?;
    ensure!(
        answered.data["spec"]["answer"]
            == json!({"result": "Repaired", "message": "Reseated the power cable."}),
        "the stored answer: {}",
        answered.data["spec"]
    );
    world
        .phase_becomes(&built.machine, "WaitingForRepair", SOON)
        .await?;
    // Repaired: the Node Ready again, the health check deletes the object.
    world.set_ready(&built.node, true, &now()?).await?;
    world.remediation_gone(&built.machine).await?;
    let machine = world.machines().get(&built.machine).await?;
    ensure!(
        machine.uid().as_deref() == Some(built.machine_uid.as_str()),
        "the Machine was replaced"
    );
    world.counts_stay(&uid, (1, 0, 0)).await?;
    let machine_mails = world.machine_counts(&built.infra_uid)?;
    ensure!(
        machine_mails == (1, 0),
        "(request, release) of the MailgunMachine: {machine_mails:?}"
    );
    ensure!(
        mailed,
        "the repair mail carries no link to the fulfilment page, which is on (fulfilment.url \
         {}): the rest of the story held with a link the test minted for the recorded repair \
         mail (answered Repaired in Chromium, the object deleted by the health check, the \
         Machine kept, 1 repair mail, no release). The mail:\n{body}",
        world.page
    );
    Ok(
        "answered Repaired in Chromium through the repair mail's link; object deleted by the MHC, \
        Machine kept, 1 repair mail, no release"
            .into(),
    )
}

/// Story 2 (and 8).
async fn story_2(world: &World) -> Result<String> {
    let (built, mail, uid) =
        one_unhealthy(world, "s2", json!({"answerTimeout": "1h", "reminders": 1})).await?;
    world.kubectl(&answer_command(
        &mail,
        "CannotRepair",
        "The mainboard is dead.",
    )?)?;
    let written = world.handed_back(&built.machine_uid, SOON).await?;
    let machines = world.replaced("s2", &built.machine_uid, 1).await?;
    let new_infra = machines[0].data["spec"]["infrastructureRef"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let new_uid = world
        .api(INFRA, "v1beta1", "MailgunMachine")
        .get(&new_infra)
        .await?
        .uid()
        .context("no UID")?;
    eventually(
        SOON,
        "the old worker's release and the new one's request",
        || async {
            Ok((world.machine_counts(&built.infra_uid)? == (1, 1)
                && world.machine_counts(&new_uid)? == (1, 0))
                .then_some(()))
        },
    )
    .await?;
    world.counts_stay(&uid, (1, 0, 0)).await?;
    Ok(format!(
        "CannotRepair by kubectl: handed back ({}), replaced: 1 release, 1 new request, 1 repair mail",
        written["message"]
    ))
}

/// Story 3 (and 8).
async fn story_3(world: &World) -> Result<String> {
    let (built, first, uid) = one_unhealthy(world, "s3", quick(1)).await?;
    let asked = Instant::now();
    let id = format!("<mailgunremediation-reminder-1.{uid}@{DOMAIN}>");
    let reminder = eventually(TIMED, &format!("the reminder {id}"), || async {
        world.mail(&id)
    })
    .await?;
    let after = asked.elapsed();
    ensure!(
        after >= Duration::from_secs(50),
        "the reminder came {after:?} after the repair mail"
    );
    ensure!(
        reminder.headers.get("In-Reply-To") == Some(&first.id),
        "the reminder's In-Reply-To: {:?}",
        reminder.headers
    );
    ensure!(
        reminder
            .headers
            .get("References")
            .is_some_and(|r| r.contains(&first.id)),
        "the reminder's References: {:?}",
        reminder.headers
    );
    // Reminders carry the repair mail's link (when it has one).
    if let Ok(link) = link_in(first.text.as_deref().unwrap_or_default()) {
        let text = reminder.text.clone().unwrap_or_default();
        ensure!(
            text.contains(&link),
            "the reminder does not carry the repair mail's link {link}:\n{text}"
        );
    }
    ensure!(
        reminder.subject == format!("Re: {}", first.subject),
        "the reminder's subject: {:?}",
        reminder.subject
    );
    let written = world.handed_back(&built.machine_uid, TIMED).await?;
    let handed = asked.elapsed();
    world.replaced("s3", &built.machine_uid, 1).await?;
    world.counts_stay(&uid, (1, 1, 0)).await?;
    Ok(format!(
        "no answer: repair mail, reminder after {after:.0?} (threaded), hand-back after {handed:.0?} ({}), exactly 2 mails",
        written["message"]
    ))
}

/// Story 4 (and 8).
async fn story_4(world: &World) -> Result<String> {
    let (built, mail, uid) = one_unhealthy(
        world,
        "s4",
        json!({"answerTimeout": "1h", "reminders": 1, "repairTimeout": "1m"}),
    )
    .await?;
    world.kubectl(&answer_command(&mail, "Repaired", "")?)?;
    let answered = Instant::now();
    world
        .phase_becomes(&built.machine, "WaitingForRepair", SOON)
        .await?;
    let written = world.handed_back(&built.machine_uid, TIMED).await?;
    let after = answered.elapsed();
    ensure!(
        after >= Duration::from_secs(50),
        "handed back {after:?} after the answer"
    );
    world.replaced("s4", &built.machine_uid, 1).await?;
    let counts = world.repair_counts(&uid)?;
    ensure!(
        counts == (1, 0, 0),
        "(repair, reminders, no longer needed) mails: {counts:?}"
    );
    Ok(format!(
        "Repaired, Node still NotReady: handed back {after:.0?} after the answer ({})",
        written["message"]
    ))
}

/// Story 5.
async fn story_5(world: &World) -> Result<String> {
    let (built, first, uid) =
        one_unhealthy(world, "s5", json!({"answerTimeout": "1h", "reminders": 1})).await?;
    world
        .phase_becomes(&built.machine, "WaitingForAnswer", SOON)
        .await?;
    world.set_ready(&built.node, true, &now()?).await?;
    let id = format!("<mailgunremediation-deleted.{uid}@{DOMAIN}>");
    let done = eventually(SOON, &format!("the no longer needed mail {id}"), || async {
        world.mail(&id)
    })
    .await?;
    ensure!(
        done.headers.get("In-Reply-To") == Some(&first.id)
            && done
                .headers
                .get("References")
                .is_some_and(|r| r.contains(&first.id)),
        "the no longer needed mail is not threaded to the repair mail: {:?}",
        done.headers
    );
    world.remediation_gone(&built.machine).await?;
    world.counts_stay(&uid, (1, 0, 1)).await?;
    let machine = world.machines().get(&built.machine).await?;
    ensure!(
        machine.uid().as_deref() == Some(built.machine_uid.as_str()),
        "the Machine was replaced"
    );
    ensure!(
        world.machine_counts(&built.infra_uid)? == (1, 0),
        "a release mail for a kept Machine"
    );
    Ok(
        "recovered before an answer: 1 repair, 1 no longer needed mail (threaded), Machine kept"
            .into(),
    )
}

/// Story 6.
async fn story_6(world: &World) -> Result<String> {
    const REPLICAS: usize = 2;
    let checks = json!({
        "nodeStartupTimeoutSeconds": STARTUP_TIMEOUT_SECONDS,
        "unhealthyNodeConditions": [{"type": "Ready", "status": "False", "timeoutSeconds": 1}],
    });
    create_pool(
        world,
        "s6",
        REPLICAS,
        json!({"unfulfilled": "Wait"}),
        checks,
        None,
    )
    .await?;
    // The two request mails; nobody builds the workers.
    let machines = eventually(SOON, "the storm pool's request mails", || async {
        let machines = world.pool_machines("s6").await?;
        let ledger = world.ledger()?;
        let infra = world.api(INFRA, "v1beta1", "MailgunMachine");
        let mut uids = Vec::new();
        for m in &machines {
            let name = m.data["spec"]["infrastructureRef"]["name"]
                .as_str()
                .unwrap_or_default();
            if let Some(mm) = infra.get_opt(name).await? {
                uids.push(mm.uid().unwrap_or_default());
            }
        }
        let all = uids.len() == REPLICAS
            && uids.iter().all(|u| {
                ledger
                    .entries
                    .iter()
                    .any(|(o, e)| &o.uid == u && !e.requests.is_empty())
            });
        Ok(all.then_some((machines, uids)))
    })
    .await?;
    let (machines, infra_uids) = machines;
    let mut machine_uids: Vec<String> = machines.iter().filter_map(ResourceExt::uid).collect();
    machine_uids.sort();
    // The startup timeout runs out: the health check makes its objects, which wait.
    let first = eventually(TIMED, "a MailgunRemediation of the storm pool", || async {
        for m in &machines {
            if let Some(r) = world.remediations().get_opt(&m.name_any()).await? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    })
    .await?;
    world
        .phase_becomes(&first.name_any(), "WaitingForFulfilment", SOON)
        .await?;
    let quiet = Duration::from_secs(3 * STARTUP_TIMEOUT_SECONDS);
    let t = Instant::now();
    while t.elapsed() < quiet {
        let mut now: Vec<String> = world
            .pool_machines("s6")
            .await?
            .iter()
            .filter_map(ResourceExt::uid)
            .collect();
        now.sort();
        ensure!(
            now == machine_uids,
            "a storm Machine replaced {:.0?} into the quiet window: {machine_uids:?} -> {now:?}",
            t.elapsed()
        );
        for m in world.pool_machines("s6").await? {
            ensure!(
                condition(&m.data, "OwnerRemediated").is_none()
                    && m.metadata.deletion_timestamp.is_none(),
                "storm Machine {} handed back or deleted: {}",
                m.name_any(),
                m.data["status"]
            );
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let ledger = world.ledger()?;
    for uid in &infra_uids {
        let counts = world.machine_counts(uid)?;
        ensure!(
            counts == (1, 0),
            "storm MailgunMachine {uid}: (request, release) {counts:?}"
        );
    }
    let mut objects = 0;
    for m in &machines {
        if let Some(r) = world.remediations().get_opt(&m.name_any()).await? {
            objects += 1;
            let uid = r.uid().unwrap_or_default();
            ensure!(
                !ledger.repairs.contains_key(&uid),
                "a storm remediation was mailed: {:?}",
                ledger.repairs.get(&uid)
            );
            let p = phase(&r);
            ensure!(
                p == "WaitingForFulfilment",
                "storm remediation {} is {p:?}",
                r.name_any()
            );
        }
    }
    Ok(format!(
        "storm setup with the template: over {quiet:?} (3 startup timeouts) no Machine replaced, no mail; \
         {objects} of {REPLICAS} unbuilt Machines got an object (the objects of one health check pass), all WaitingForFulfilment"
    ))
}

/// Story 7 (and 8).
async fn story_7(world: &World) -> Result<String> {
    create_pool(
        world,
        "s7",
        2,
        json!({"answerTimeout": "1m", "reminders": 0, "repairTimeout": "1m"}),
        ready_checks(),
        Some(json!({"unhealthyLessThanOrEqualTo": 2})),
    )
    .await?;
    let built = build_pool(world, "s7", 2).await?;
    // Both Nodes NotReady from the same instant: the health check finds both unhealthy on one
    // pass.
    let at = now()?;
    for b in &built {
        world.set_ready(&b.node, false, &at).await?;
    }
    let mut objects = Vec::new();
    for b in &built {
        let object = world.remediation_of(b, "s7").await.with_context(|| {
            "two Machines unhealthy from the same instant, but the health check created the \
             object of only one (Cluster API creates at most one pass's objects)"
        })?;
        let uid = object.uid().context("no UID")?;
        world.repair_mail(&uid).await?;
        objects.push((b.clone(), object, uid));
    }
    let asked = Instant::now();
    // The brake: more unhealthy Machines than the health check allows to remediate.
    let checks = world.api(CAPI, "v1beta2", "MachineHealthCheck");
    checks
        .patch(
            "s7",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"remediation": {"triggerIf": {"unhealthyLessThanOrEqualTo": 1}}}}),
            ),
        )
        .await?;
    eventually(
        SOON,
        "the s7 health check's RemediationAllowed=False",
        || async {
            let c = checks.get("s7").await?;
            Ok(condition_is(&c.data, "RemediationAllowed", "False").then_some(()))
        },
    )
    .await?;
    let (a, b) = (&objects[0], &objects[1]);
    // A human's CannotRepair goes through the brake.
    world
        .remediations()
        .patch(
            &a.0.machine,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"answer": {"result": "CannotRepair", "message": "Burnt."}}}),
            ),
        )
        .await?;
    world.handed_back(&a.0.machine_uid, SOON).await?;
    // The other's timed hand-back (no answer, no reminders, answerTimeout 1m) waits.
    world
        .phase_becomes(&b.0.machine, "HandBackHeld", TIMED)
        .await?;
    let held_after = asked.elapsed();
    let machine = world.machines().get(&b.0.machine).await?;
    ensure!(
        condition(&machine.data, "OwnerRemediated")
            .is_none_or(|c| c["reason"] != HANDED_BACK_REASON),
        "the held Machine was handed back: {}",
        machine.data["status"]
    );
    ensure!(
        world
            .versions(&b.0.machine_uid)
            .iter()
            .all(|m| condition(&m.data, "OwnerRemediated")
                .is_none_or(|c| c["reason"] != HANDED_BACK_REASON)),
        "a held hand-back was written"
    );
    // The first is replaced; its replacement has no Node yet and is not counted unhealthy
    // within its startup timeout: one unhealthy of at most one, the brake releases.
    let machines = world.replaced("s7", &a.0.machine_uid, 2).await?;
    // Cluster API counts a Machine not yet started (no Node) as unhealthy too: the brake holds
    // until the human builds the replacement.
    let replacement = machines
        .iter()
        .find(|m| m.uid().as_deref() != Some(b.0.machine_uid.as_str()))
        .context("no replacement")?;
    let held_still = world.remediations().get(&b.0.machine).await?;
    ensure!(
        phase(&held_still) == "HandBackHeld",
        "the held hand-back before the replacement was built: {}",
        held_still.data["status"]
    );
    build_machine(world, "s7", replacement).await?;
    eventually(
        TIMED,
        "the s7 health check's RemediationAllowed=True",
        || async {
            let c = checks.get("s7").await?;
            Ok(condition_is(&c.data, "RemediationAllowed", "True").then_some(()))
        },
    )
    .await?;
    world.handed_back(&b.0.machine_uid, TIMED).await?;
    for (_, _, uid) in &objects {
        let counts = world.repair_counts(uid)?;
        ensure!(
            counts == (1, 0, 0),
            "(repair, reminders, no longer needed) mails of {uid}: {counts:?}"
        );
    }
    Ok(format!(
        "two unhealthy from one instant: both objects on one pass, both mailed; brake on: CannotRepair \
         handed back at once, the timed hand-back held ({held_after:.0?} after the mails) until the brake released"
    ))
}

/// Runs story `n`, timing it.
async fn timed(
    n: u8,
    story: impl std::future::Future<Output = Result<String>>,
) -> (u8, Duration, Result<String>) {
    let t = Instant::now();
    let result = story.await;
    (n, t.elapsed(), result)
}

/// Records every version of every Machine of the namespace, in order, until aborted.
fn record_machines(world: &World) -> tokio::task::JoinHandle<()> {
    let (api, history) = (world.machines(), Arc::clone(&world.history));
    tokio::spawn(async move {
        let mut version = "0".to_owned();
        loop {
            let stream = match api.watch(&WatchParams::default(), &version).await {
                Ok(stream) => stream,
                Err(e) => {
                    eprintln!("watching Machines: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(WatchEvent::Added(m) | WatchEvent::Modified(m) | WatchEvent::Deleted(m)) => {
                        version = m.resource_version().unwrap_or_default();
                        history.lock().unwrap_or_else(|e| e.into_inner()).push(m);
                    }
                    Ok(WatchEvent::Bookmark(b)) => version = b.metadata.resource_version,
                    Ok(WatchEvent::Error(e)) => {
                        eprintln!("watching Machines: {e:?}: versions may be missing");
                        break;
                    }
                    Err(e) => {
                        eprintln!("watching Machines: {e}");
                        break;
                    }
                }
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn machine_health_checks_remediate_by_mail() -> Result<()> {
    let chromium = chromium()?;
    ensure!(chromium.exists());
    let work = tempfile::tempdir()?;
    let dir = work.path().to_owned();
    let cp = ControlPlane::start(Options::default()).await?;
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;
    topology::install_crds(&admin).await?;
    let mailgun = MailgunServer::start("key-remediation-e2e-not-logged", DOMAIN)?;
    let port = free_port()?;
    let world = World {
        cp,
        admin,
        mailgun,
        dir: dir.clone(),
        page: format!("http://127.0.0.1:{port}"),
        history: Arc::default(),
    };
    let result = run(&world, &dir, port).await;
    if let Err(e) = &result {
        capm_e2e::report_failure(e, &dir, &["capi-manager.log", "provider.log"], 60);
        if let Some(keep) = std::env::var_os("CAPM_KEEP_LOGS") {
            capm_e2e::keep_logs(&dir, Path::new(&keep))?;
        }
    }
    result
}

async fn run(world: &World, dir: &Path, port: u16) -> Result<()> {
    let started = Instant::now();
    let admin = &world.admin;
    // The chart with the page on, its keys in a Secret; the provider as its Deployment runs it.
    create_namespace(admin, NS, true).await?;
    create_secret(
        admin,
        NS,
        "mailgun-credentials",
        &[("api-key", world.mailgun.api_key())],
    )
    .await?;
    create_secret(admin, NS, "capm-fulfilment-keys", &[("keys", KEY)]).await?;
    let values = dir.join("values.yaml");
    std::fs::write(
        &values,
        format!(
            "{}fulfilment:\n  url: {}\n  port: {port}\n  keysSecret: {{name: capm-fulfilment-keys}}\n",
            mailgun_values(RECIPIENT, DOMAIN, &world.mailgun.base_url()),
            world.page
        ),
    )?;
    helm_chart(world.cp.kubeconfig(), "install", RELEASE, NS, &values, &[])?;
    let provider = start_routed_chart_provider(&world.cp, admin, NS, FULLNAME, dir).await?;
    create_namespace(admin, USER_NS, false).await?;
    let recorder = record_machines(world);
    let capi = start_capi_manager(world.cp.kubeconfig(), dir)?;
    let _providers = TestProviders::start(admin, USER_NS);

    // The "workload" cluster's kubeconfig, as a control plane provider writes it.
    let mut secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("{CLUSTER}-kubeconfig"), "labels": {"cluster.x-k8s.io/cluster-name": CLUSTER}},
        "type": "cluster.x-k8s.io/secret",
    }))?;
    secret.string_data = Some(
        [(
            "value".to_owned(),
            std::fs::read_to_string(world.cp.kubeconfig())?,
        )]
        .into(),
    );
    Api::<Secret>::namespaced(admin.clone(), USER_NS)
        .create(&PostParams::default(), &secret)
        .await?;

    // The Cluster, fulfilled by the human from its request mail.
    topology::create_cluster(
        admin,
        USER_NS,
        CLUSTER,
        "One cluster please",
        "cluster-admin@example.com",
    )
    .await?;
    let body = eventually(
        Duration::from_secs(90),
        "the cluster request mail",
        || async {
            provider.proc.check_alive()?;
            capi.check_alive()?;
            Ok(mailgun_mails(&world.mailgun)?
                .into_iter()
                .find(|(m, _)| {
                    m.subject
                        .contains(&format!("New Cluster {CLUSTER} requested"))
                })
                .map(|(_, body)| body))
        },
    )
    .await?;
    world.kubectl(&fulfil_command(
        &body,
        &[("<host>", "api.repair.example.com")],
    )?)?;
    let clusters = world.api(CAPI, "v1beta2", "Cluster");
    eventually(
        Duration::from_secs(90),
        "the Cluster ready, its control plane initialized",
        || async {
            let c = clusters.get(CLUSTER).await?;
            Ok((condition_is(&c.data, "InfrastructureReady", "True")
                && condition_is(&c.data, "ControlPlaneInitialized", "True"))
            .then_some(()))
        },
    )
    .await?;
    println!("environment ready in {:.1?}", started.elapsed());

    let stories = Instant::now();
    let all = tokio::join!(
        timed(1, story_1(world)),
        timed(2, story_2(world)),
        timed(3, story_3(world)),
        timed(4, story_4(world)),
        timed(5, story_5(world)),
        timed(6, story_6(world)),
        timed(7, story_7(world)),
    );
    let results = [all.0, all.1, all.2, all.3, all.4, all.5, all.6];
    recorder.abort();
    provider.proc.check_alive()?;
    capi.check_alive()?;
    let mut failed = Vec::new();
    for (n, took, result) in &results {
        match result {
            Ok(summary) => println!("story {n}: ok in {took:.1?}: {summary}"),
            Err(e) => {
                println!("story {n}: FAILED after {took:.1?}: {e:#}");
                failed.push(*n);
            }
        }
    }
    // Nothing else was mailed: every mail is a request or release of ours or a remediation's.
    let ledger = world.ledger()?;
    ensure!(
        ledger.foreign.is_empty(),
        "mails not ours: {:?}",
        ledger.foreign
    );
    for (uid, mails) in &ledger.repairs {
        let mut seen = mails.iter().map(|(_, w)| *w).collect::<Vec<_>>();
        let n = seen.len();
        seen.sort();
        seen.dedup();
        ensure!(
            seen.len() == n,
            "MailgunRemediation {uid}: a mail twice: {mails:?}"
        );
    }
    println!(
        "stories in {:.1?}, the whole file in {:.1?}",
        stories.elapsed(),
        started.elapsed()
    );
    if !failed.is_empty() {
        bail!("stories {failed:?} failed (above)");
    }
    Ok(())
}
