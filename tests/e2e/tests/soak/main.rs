//! The standing adversarial soak test (issue 13): randomized rounds against a local control
//! plane with the real Cluster API core manager, two provider replicas with leader election per
//! mail backend, and a mail ledger built only from what the mail servers received.
//!
//! # What a run does
//! One control plane (etcd, kube-apiserver, kube-controller-manager), the Cluster API CRDs and
//! core manager, our CRDs, and two *lanes* that run side by side: one with the Mailgun contract
//! server, one with the SMTP server, each in its own namespace with two replicas of the provider
//! (`--leader-elect`, a Lease in the lane's namespace, 5 s mail timeouts); a replica that exits
//! (for example after losing its Lease) is started again, as its Deployment would. Each cluster
//! has its own `MailgunMachineTemplate` (Cluster API makes the `Cluster` an owner of it) and its
//! `MachineDeployment` carries `bootstrap.dataSecretName`, so no bootstrap provider is needed. A round plans, per lane and from the seed only, 2 to 5
//! operations with random gaps: create a `Cluster` + `MailgunCluster` + `MachineDeployment`,
//! delete a `Cluster`, scale a `MachineDeployment` (also down right after up, e.g. 0→3 then at
//! once 3→1), pause or unpause a `Cluster`; and, at random moments, a backend fault for 2-6 s
//! (see below), SIGKILL of the leading replica (restarted like a Deployment would), or SIGSTOP of
//! it for 15-25 s so the standby takes the Lease, then SIGCONT (a freeze of an odd number of
//! seconds strikes mid-send when it can: the leader stops itself at its next commit point, with
//! the request on the wire, through the `before-commit` failpoint armed by file; if no send
//! reaches it within 3 s, an outside SIGSTOP as for the others); and, for both lanes at once,
//! a kube-apiserver restart (SIGKILL, same flags, etcd data kept: the watches cannot resume and
//! re-list); and a network partition of the leading replica for 3-20 s (each replica reaches the
//! API server only through a TCP proxy of its own, which closes every connection while cut;
//! beyond the 10 s renew deadline the standby takes over).
//!
//! # Tenants (issue 33)
//! The Mailgun lane has two tenants besides the provider's own configuration: each a
//! `MailgunClusterIdentity` (this lane's namespace allowed) on its own contract server with its
//! own domain and key, read from a Secret in the lane's namespace (`--identity-secret-namespace`).
//! A created cluster's `MailgunCluster` names one of them or none (a third each, from the seed);
//! its machines follow it. At random moments, while mails are in flight: a tenant's key is
//! rotated in its Secret (the account key and the domain sending key take turns, so lookups
//! lose and regain their read rights), or a tenant's identity is deleted for 2-8 s and created
//! again. Besides the ledger rules, every mail must be on the server of the identity its
//! cluster names (`WrongBackend`). A write in the quiet window that changes only delivery
//! tracking (`MailDelivered`, `status.mail`) is delivery news on the poller's own schedule (a
//! rotated key makes a tenant's open mails untrackable at its next question), not a violation,
//! unless one object gets more than three (`DeliveryFlap`). A human plays along: every
//! request mail of a `MailgunCluster` is fulfilled with the command it gives
//! (`spec.controlPlaneEndpoint`), which lets Cluster API provision the cluster and the machines
//! be requested. After the last round every `Cluster` is unpaused and deleted and the checks run
//! once more.
//!
//! # Remediation (issue 56)
//! Both lanes also remediate, from a generator of their own (seeded from the seed, so the
//! operations above are those the seed gave before). In some rounds the soak plays a
//! MachineHealthCheck: it picks a Machine (one whose request went out) of a cluster made in an
//! earlier round that stays unpaused, half the time of the lane's own `repair-pool` (made in
//! round 1 with three machines, left alone by the other operations: a scale-down deletes
//! unhealthy Machines first, so remediated ones elsewhere rarely live to a reminder), has the
//! human build it (its `MailgunMachine`'s `providerID`; one in five stays never built), sets
//! its `HealthCheckSucceeded=False` (server-side apply, that condition only) and makes its
//! `MailgunRemediation` as the health check does (named like the Machine, an ownerReference to
//! it; `answerTimeout: 1m`, `reminders: 3`). One to five rounds later its fate comes: the human answers `CannotRepair` (handed back at once: the MachineSet replaces the
//! Machine), or `Repaired` and the health check finds the Machine healthy and deletes the
//! object, or the Machine recovers before any answer (deleted: one "no longer needed" mail);
//! or nobody answers (reminders a minute apart, then a timed hand-back), or its Machine goes
//! first (scaled away, its cluster deleted). A round is not settled while a remediation of an
//! unpaused cluster is handed back or deleted and not gone, or built and its repair mail not
//! recorded, and it waits out a remediation deadline (`Ready`'s `until …`) that would fall in
//! the quiet window, whose check covers the remediations too. The rules of their mails, per
//! object (Message-Ids `<mailgunremediation[-reminder-N|-deleted].uid@domain>`): at most one
//! repair mail, one of each reminder (none beyond the strategy's) and one "no longer needed"
//! mail (SMTP: copies within the counted resends of `mailgunremediation`); a reminder after the
//! repair mail and the reminder before it, the "no longer needed" mail after the repair mail;
//! no mail for a Machine never built; and after an answer or the health check's deletion, no
//! mail but those whose records the object carried at that moment (attempts under way) and the
//! "no longer needed" mail of a deletion nobody answered (`MailAfterTheCut`).
//!
//! # Backend faults (consistent with the ledger)
//! - *refuse*: a definitive answer before acceptance, nothing stored. SMTP: 451 to DATA;
//!   Mailgun: 429 with `Retry-After: 1`, or 500 without storing (the client cannot tell, but the
//!   events API can).
//! - *hang*: the server stores the message and then never answers (accepted; the client sees an
//!   unknown outcome after its timeout). SMTP also: a connection that is never greeted (nothing
//!   stored).
//! - *slow*: answers 0.5-2.5 s late, well within the 5 s client timeout.
//!
//! # When a round is over
//! The round waits (up to 150 s) until its intent is reached: deleted `Cluster`s and all their
//! objects are gone; every unpaused `Cluster`'s `MailgunCluster` was requested (its request mail
//! is in the ledger), fulfilled and provisioned, and its `MachineDeployment` has exactly
//! `replicas` `MailgunMachine`s, each requested. Paused `Cluster`s are left alone. (A `Cluster`
//! deleted before Cluster API adopted its `MailgunCluster` leaves that one without owner, as
//! Kubernetes does; the human then deletes it too.) Not getting
//! there is itself a violation (`NotSettled`, with what is missing). Then it waits 1 s and
//! watches every `MailgunCluster` and `MailgunMachine` of the lane for 3 s: any write is a
//! violation (`WritesWhenQuiet`, with the field managers whose `managedFields` entries moved).
//!
//! # The ledger rules
//! Per object (kind + UID, read from the Message-Id `<kind.uid@domain>`; the release mail's is
//! `capm_api::names::deletion_message_id`, `<kind-deleted.uid@domain>`), over everything the
//! lane's server ever stored, in arrival order:
//! - at most one request and at most one release mail;
//! - a release only after an accepted request (`ReleaseWithoutRequest`, `ReleaseBeforeRequest`);
//! - no release for an object that still exists and is not being deleted;
//! - every accepted request of an object that is gone was released (`MissingRelease`);
//! - no object of ours left with our finalizer after its `Cluster` was deleted (part of the
//!   round's intent: a leftover fails as `NotSettled`).
//!
//! Duplicates are counted raw, per Message-Id. **Mailgun**: any duplicate is a violation (the
//! provider can ask the events API before sending again). **SMTP**: a duplicate with the same
//! Message-Id is unavoidable when a process sent and died (or hung) before recording it; it is
//! allowed only when the provider accounted for it: per kind, the copies beyond the first, over
//! all of that kind's Message-Ids, must not exceed `capm_mail_resends_total{controller=<kind>}`
//! summed over every provider process of the lane (read from `/metrics` right before a process
//! is killed, and at the end of each round). More copies than counted resends is
//! `UnaccountedResends`.
//!
//! # Reproducing
//! The seed is printed first; `SOAK_SEED=<n>` replays the same plan (the same operations in
//! the same order with the same gaps; process timing still varies). `SOAK_ROUNDS` (default 20)
//! sets the number of rounds; `make soak ROUNDS=200` runs a long one. A violation prints the
//! seed, the round, that round's action log, the offending ledger entries and the provider log
//! lines that name the objects, then fails. With `SOAK_KEEP_GOING=1` it reports each new
//! violation and carries on, failing at the end (to survey a seed). Everything (processes, namespaces, the control
//! plane) is removed also on failure.

mod world;

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use capm_e2e::{env_u64, ledger};
use rand::{Rng as _, RngExt as _, SeedableRng, rngs::StdRng};

use world::{Lane, Plan, Round, World};

/// Mixed into the seed for the remediation lane's generator.
const REPAIR_SEED_SALT: u64 = 0x5245_5041_4952;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak() -> Result<()> {
    let seed = match env_u64("SOAK_SEED")? {
        Some(seed) => seed,
        None => rand::rng().next_u64() % 1_000_000,
    };
    let rounds = env_u64("SOAK_ROUNDS")?.unwrap_or(20);
    let keep_going = env_u64("SOAK_KEEP_GOING")?.is_some_and(|v| v != 0);
    println!("soak: seed {seed} (replay with SOAK_SEED={seed}), {rounds} rounds");
    let begun = Instant::now();
    let world = World::start().await?;
    println!("soak: set up in {:.1} s", begun.elapsed().as_secs_f64());
    let mut lanes = vec![
        Lane::start(&world, ledger::Backend::Mailgun).await?,
        Lane::start(&world, ledger::Backend::Smtp).await?,
    ];
    let mut rng = StdRng::seed_from_u64(seed);
    // The remediation lane draws from its own generator: a seed's other operations stay what
    // they were before it.
    let mut repair_rng = StdRng::seed_from_u64(seed ^ REPAIR_SEED_SALT);
    let mut longest = Duration::ZERO;
    let mut failed = Vec::new();
    let result = async {
        for round in 1..=rounds {
            let plans: Vec<Plan> = lanes
                .iter_mut()
                .map(|lane| {
                    let mut plan = lane.plan(&mut rng, round);
                    lane.plan_remediations(&mut repair_rng, round, &mut plan);
                    plan
                })
                .collect();
            let restart = rng
                .random_bool(0.08)
                .then(|| Duration::from_millis(rng.random_range(0..4000)));
            let spec = Round {
                seed,
                number: round,
                teardown: false,
                keep_going,
            };
            let (took, passed) = world::run_round(&world, &lanes, plans, restart, &spec).await?;
            longest = longest.max(took);
            if !passed {
                failed.push(format!("round {round}"));
            }
        }
        let plans: Vec<Plan> = lanes.iter_mut().map(Lane::plan_teardown).collect();
        let (_, passed) = world::run_round(
            &world,
            &lanes,
            plans,
            None,
            &Round {
                seed,
                number: rounds,
                teardown: true,
                keep_going,
            },
        )
        .await?;
        if !passed {
            failed.push("the teardown".to_owned());
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    // Read before stopping: the summary includes the live replicas' resend counters.
    let mails: Vec<String> = lanes.iter().map(Lane::summary).collect();
    let weakened: Vec<String> = lanes.iter().filter_map(Lane::weakened).collect();
    for lane in &lanes {
        lane.stop();
    }
    result?;
    if !weakened.is_empty() {
        bail!("soak: seed {seed}: {}", weakened.join("; "));
    }
    if !failed.is_empty() {
        bail!(
            "soak: seed {seed}: violations in {} (each reported above)",
            failed.join(", ")
        );
    }
    println!(
        "soak: seed {seed}: {rounds} rounds and the teardown passed in {:.1} s (longest round \
         {:.1} s); {}",
        begun.elapsed().as_secs_f64(),
        longest.as_secs_f64(),
        mails.join("; ")
    );
    if lanes.iter().any(|l| l.mail_count() == 0) {
        bail!("a lane received no mail at all: the soak exercised nothing");
    }
    Ok(())
}
