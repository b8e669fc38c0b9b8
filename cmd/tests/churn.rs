//! Churn (issue 34): thousands of objects come and go through the real binary, and what the
//! process keeps returns to where it was.
//!
//! Each round creates pairs (a `Cluster` and its `MailgunCluster`) that are mailed, then deleted
//! and released, and `MailgunCluster`s without an owner that are deleted at once (never mailed).
//! After every round:
//! - the per-object ledger holds no live object (`capm_remembered_objects{state="live"}` is 0)
//!   and its tombstones are bounded by the objects that went;
//! - the ledger has exactly one request and one release per mailed object;
//! - the process's anonymous resident memory (`RssAnon`: the heap, not the binary's pages) is
//!   measured after glibc gave back the free memory its arenas keep (`malloc_trim`, through gdb:
//!   [`capm_test_support::process::trimmed_rss_anon`]). Untrimmed, equal rounds end 5.2 or
//!   8.0 MiB apart by how the frees fell, with the same 2.1-2.3 MB in use: that is the
//!   allocator, not the provider, and a test of it fails at random. Round 1 grows the stores,
//!   the connection pools and the allocator's arenas to their working size; a leak shows as
//!   growth from round to round. The test asserts the last round ends within [`LEAK_MARGIN`] of
//!   the first: with [`ROUNDS`] − 1 rounds of [`PAIRS`] + [`GHOSTS`] objects in between, that is
//!   under 1 KiB per object that came and went.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use capm_api::{names, v1beta1::MailgunCluster};
use capm_mail_servers::MailgunServer;
use capm_test_support::{TestNamespace, wait::eventually};
use common::{Backend, DOMAIN, KEY, Launch, Provider, create_pair, namespace};
use futures::{StreamExt, stream};
use kube::{
    Api, ResourceExt,
    api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams},
};
use serde_json::json;

/// Rounds of churn.
const ROUNDS: usize = 4;
/// Pairs per round that are mailed, deleted and released.
const PAIRS: usize = 300;
/// Owner-less `MailgunCluster`s per round, deleted right after they are created.
const GHOSTS: usize = 100;
/// How much the heap may end above round 1's level after the rounds between.
const LEAK_MARGIN: u64 = 1024 * 1024;
/// How long one round's objects may take to be mailed, or to be released and gone.
const WITHIN: Duration = Duration::from_secs(300);
/// Objects created at once.
const AT_ONCE: usize = 16;

const MIB: f64 = 1024.0 * 1024.0;

/// One line of `/proc/<pid>/status`, in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    capm_test_support::process::status_bytes(pid, field)
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

fn clusters(ns: &TestNamespace) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Cluster",
    ));
    Api::namespaced_with(ns.client.clone(), &ns.name, &ar)
}

/// Waits until `check` accepts the namespace's `MailgunCluster`s; panics with `what` after
/// [`WITHIN`].
async fn wait_for(ns: &TestNamespace, what: &str, check: impl Fn(&[MailgunCluster]) -> bool) {
    let api = ns.api::<MailgunCluster>();
    let deadline = Instant::now() + WITHIN;
    loop {
        let list = api.list(&ListParams::default()).await.unwrap().items;
        if check(&list) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {WITHIN:?} ({} objects left)",
            list.len()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One round: pairs mailed then deleted and released, ghosts created and deleted at once.
async fn round(ns: &TestNamespace, r: usize) {
    stream::iter(0..PAIRS)
        .map(|i| async move { create_pair(ns, &format!("r{r}-{i}")).await })
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    let api = ns.api::<MailgunCluster>();
    stream::iter(0..GHOSTS)
        .map(|i| {
            let api = api.clone();
            async move {
                let ghost: MailgunCluster = serde_json::from_value(json!({
                    "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                    "kind": "MailgunCluster",
                    "metadata": { "name": format!("ghost-{r}-{i}") },
                    "spec": { "priority": "Urgent", "request": "Never mind.", "requester": "dev@example.com" }
                }))
                .unwrap();
                let name = ghost.name_any();
                api.create(&PostParams::default(), &ghost).await.unwrap();
                api.delete(&name, &DeleteParams::default()).await.unwrap();
            }
        })
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    wait_for(ns, &format!("round {r}: every pair mailed"), |list| {
        list.iter()
            .filter(|o| names::request_recorded_sent(o.annotations()))
            .count()
            == PAIRS
    })
    .await;
    let all = ListParams::default();
    api.delete_collection(&DeleteParams::default(), &all)
        .await
        .unwrap();
    clusters(ns)
        .delete_collection(&DeleteParams::default(), &all)
        .await
        .unwrap();
    wait_for(
        ns,
        &format!("round {r}: every object released and gone"),
        |list| list.is_empty(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_returns_to_its_level_after_thousands_of_objects_come_and_go() {
    let ns = namespace("churn").await;
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    let provider = Provider::launch(
        &ns,
        &Backend::Mailgun(&mailgun),
        &Launch {
            log_filter: Some("warn"),
            ..Launch::default()
        },
    );
    let pid = provider.pid();
    let ready = || async { provider.probe("/readyz") == Some(200) };
    eventually(Duration::from_secs(60), "the provider ready", ready).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = status_bytes(pid, "RssAnon:");

    let mut levels = Vec::new();
    for r in 1..=ROUNDS {
        let started = Instant::now();
        round(&ns, r).await;
        // The last reconciles and the poller's wake-ups settle.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let untrimmed = status_bytes(pid, "RssAnon:");
        let level = capm_test_support::process::trimmed_rss_anon(pid)
            .unwrap_or_else(|e| panic!("round {r}: {e}"));
        let live = provider.metric_with("capm_remembered_objects", &["state=\"live\""]);
        let tombstones = provider.metric_with("capm_remembered_objects", &["state=\"tombstone\""]);
        eprintln!(
            "round {r}: {} objects came and went in {:.1} s; heap {:.1} MiB trimmed ({:.1} MiB \
             before; idle {:.1} MiB), peak RSS {:.1} MiB; remembered: {live} live, \
             {tombstones} tombstones",
            PAIRS * 2 + GHOSTS,
            started.elapsed().as_secs_f64(),
            level as f64 / MIB,
            untrimmed as f64 / MIB,
            idle as f64 / MIB,
            status_bytes(pid, "VmHWM:") as f64 / MIB,
        );
        assert_eq!(
            live, 0.0,
            "round {r}: nothing is remembered of gone objects"
        );
        assert!(
            tombstones <= (r * (PAIRS + GHOSTS)) as f64,
            "round {r}: at most one tombstone per gone object: {tombstones}"
        );
        levels.push(level);
    }

    // One request and one release per mailed object, nothing for a ghost.
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for mail in mailgun.messages().unwrap() {
        *per_id.entry(mail.id).or_default() += 1;
    }
    assert_eq!(
        per_id.len(),
        ROUNDS * PAIRS * 2,
        "a request and a release per pair"
    );
    assert!(
        per_id.values().all(|&n| n == 1),
        "no mail twice: {:?}",
        per_id.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );

    let (first, last) = (levels[0], levels[ROUNDS - 1]);
    eprintln!(
        "heap: idle {:.1} MiB, after round 1 {:.1} MiB, after round {ROUNDS} {:.1} MiB \
         ({:+.0} KiB over {} objects since round 1)",
        idle as f64 / MIB,
        first as f64 / MIB,
        last as f64 / MIB,
        (last as f64 - first as f64) / 1024.0,
        (ROUNDS - 1) * (PAIRS * 2 + GHOSTS),
    );
    assert!(
        last <= first + LEAK_MARGIN,
        "the heap grew from round 1 ({first} bytes) to round {ROUNDS} ({last} bytes)"
    );
}
