//! Mail identities per tenant against the real API server: two Mailgun contract servers (two
//! domains, two accounts) and a real SMTP server (STARTTLS required, AUTH), each the backend of
//! one `MailgunClusterIdentity`, beside the provider's own (default) Mailgun backend.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{collections::BTreeMap, time::Duration};

use capm_api::{
    names::{IDENTITY_SECRET_LABEL, reasons},
    v1beta1::{MailgunCluster, MailgunClusterIdentity},
};
use capm_mail_servers::{
    DeliveryEvent, EventRule, MailgunServer, SmtpOptions, SmtpServer, SmtpTls,
};
use capm_test_support::TestNamespace;
use k8s_openapi::{
    ByteString, api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, ResourceExt,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
    },
};
use serde_json::json;
use support::{Env, PATIENCE, condition, eventually};

/// The watch-filter value of the first test's objects: only its controllers see them.
const FILTER: &str = "identity-test";
/// The watch-filter value of the second test's objects.
const BOUNDS_FILTER: &str = "identity-bounds-test";

fn cluster_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Cluster",
    ));
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// A Cluster + MailgunCluster pair in `ns`, the MailgunCluster naming `identity`, owned as
/// Cluster API owns it.
async fn create_pair(client: &kube::Client, ns: &str, name: &str, identity: Option<&str>) {
    create_pair_with(client, ns, name, identity, json!({})).await;
}

/// [`create_pair`] for the second test's controllers ([`BOUNDS_FILTER`]).
async fn create_bounded_pair(client: &kube::Client, ns: &str, name: &str, identity: Option<&str>) {
    let filter = json!({ "labels": { "cluster.x-k8s.io/watch-filter": BOUNDS_FILTER } });
    create_pair_with(client, ns, name, identity, filter).await;
}

/// As [`create_pair`], the MailgunCluster's metadata merged with `metadata` (annotations,
/// finalizers: an object as `clusterctl move` recreates it).
async fn create_pair_with(
    client: &kube::Client,
    ns: &str,
    name: &str,
    identity: Option<&str>,
    metadata: serde_json::Value,
) {
    let mut spec = json!({ "priority": "Urgent", "request": "Three nodes, please.", "requester": "dev@example.com" });
    if let Some(identity) = identity {
        spec["identityRef"] = json!({ "kind": "MailgunClusterIdentity", "name": identity });
    }
    let labels = json!({ "cluster.x-k8s.io/watch-filter": FILTER });
    let mut meta = json!({ "name": name, "labels": labels });
    let filter = metadata["labels"]["cluster.x-k8s.io/watch-filter"]
        .as_str()
        .unwrap_or(FILTER)
        .to_owned();
    for (k, v) in metadata.as_object().into_iter().flatten() {
        meta[k] = v.clone();
    }
    let infra: MailgunCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunCluster",
        "metadata": meta, "spec": spec
    }))
    .unwrap();
    Api::<MailgunCluster>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &infra)
        .await
        .unwrap();
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Cluster",
    ));
    let cluster = DynamicObject::new(name, &ar).data(json!({ "spec": {
        "infrastructureRef": { "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MailgunCluster", "name": name }
    }}));
    let mut cluster = cluster;
    cluster.metadata.labels = Some(BTreeMap::from([(
        "cluster.x-k8s.io/watch-filter".to_owned(),
        filter,
    )]));
    let cluster = cluster_api(client, ns)
        .create(&PostParams::default(), &cluster)
        .await
        .unwrap();
    let patch = json!({ "metadata": { "ownerReferences": [{
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "name": name,
        "uid": cluster.metadata.uid, "controller": true, "blockOwnerDeletion": true
    }]}});
    Api::<MailgunCluster>::namespaced(client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// `(reason, message)` of condition `type_` of MailgunCluster `name` in `ns`.
async fn reason(
    client: &kube::Client,
    ns: &str,
    name: &str,
    type_: &str,
) -> Option<(String, String)> {
    let obj = Api::<MailgunCluster>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap();
    let status = obj.status.unwrap_or_default();
    condition(&status.conditions, type_).map(|c| (c.reason.clone(), c.message.clone()))
}

/// A Secret claimed for the identity `claimed_for` (its label), holding `data`.
fn secret(name: &str, claimed_for: &str, data: &[(&str, &[u8])]) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                IDENTITY_SECRET_LABEL.to_owned(),
                claimed_for.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                .collect(),
        ),
        ..Secret::default()
    }
}

fn identity(name: &str, spec: serde_json::Value) -> MailgunClusterIdentity {
    serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunClusterIdentity",
        "metadata": { "name": name }, "spec": spec
    }))
    .unwrap()
}

/// Three tenants, each mailed through its own backend only; a namespace an identity does not
/// allow and an identity that does not exist get a condition and no mail; a rotated Secret is
/// used from the next send on, without a restart; changing `identityRef` after the mail sends
/// nothing again; the release goes through the identity the request went through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_is_mailed_through_its_own_identity_only() {
    let mut env = Env::new("mgc-identity").await;
    let client = env.ns.client.clone();
    let provider_ns = env.ns.name.clone();
    // Tenants: A (selected by label), B and C (by name), X (allowed by no identity).
    let ns_a = TestNamespace::create_with_labels("tenant-a", &[("capm.test/team", "a")])
        .await
        .unwrap();
    let ns_b = TestNamespace::create("tenant-b").await.unwrap();
    let ns_c = TestNamespace::create("tenant-c").await.unwrap();
    let ns_x = TestNamespace::create("tenant-x").await.unwrap();
    let (a, b, c, x) = (&ns_a.name, &ns_b.name, &ns_c.name, &ns_x.name);

    let mailgun_a = MailgunServer::start("key-tenant-a", "mg.tenant-a.test").unwrap();
    let mailgun_b = MailgunServer::start("key-tenant-b", "mg.tenant-b.test").unwrap();
    let smtp = SmtpServer::start(SmtpOptions {
        tls: SmtpTls::StarttlsRequired,
        auth: Some(("capm".into(), "relay-password-tenant-c".into())),
    })
    .unwrap();
    let ca = std::fs::read(smtp.ca_cert().unwrap()).unwrap();

    let secrets = Api::<Secret>::namespaced(client.clone(), &provider_ns);
    let pp = PostParams::default();
    // Tenant A: a sending key and a read-only key; B: its sending key (rotated below); C: the
    // relay's password and CA.
    let (a_send, a_read) = (mailgun_a.sending_key(), mailgun_a.read_key());
    let b_send = mailgun_b.sending_key();
    let suffix = provider_ns.rsplit('-').next().unwrap().to_owned();
    let (id_a, id_b, id_c) = (
        format!("tenant-a-{suffix}"),
        format!("tenant-b-{suffix}"),
        format!("tenant-c-{suffix}"),
    );
    for s in [
        secret(
            "tenant-a",
            &id_a,
            &[
                ("api-key", a_send.as_bytes()),
                ("read-key", a_read.as_bytes()),
            ],
        ),
        secret("tenant-b", &id_b, &[("api-key", b_send.as_bytes())]),
        secret(
            "tenant-c",
            &id_c,
            &[("password", b"relay-password-tenant-c\n"), ("ca.crt", &ca)],
        ),
    ] {
        secrets.create(&pp, &s).await.unwrap();
    }
    let identities = Api::<MailgunClusterIdentity>::all(client.clone());
    for i in [
        identity(
            &id_a,
            json!({
                "mailgun": { "domain": "mg.tenant-a.test", "baseURL": mailgun_a.base_url(),
                    "apiKeySecretRef": { "name": "tenant-a", "key": "api-key" },
                    "readKeySecretRef": { "name": "tenant-a", "key": "read-key" } },
                "recipients": ["oncall@tenant-a.test"],
                "allowedNamespaces": { "selector": { "matchLabels": { "capm.test/team": "a" } } }
            }),
        ),
        identity(
            &id_b,
            json!({
                "mailgun": { "domain": "mg.tenant-b.test", "baseURL": mailgun_b.base_url(),
                    "apiKeySecretRef": { "name": "tenant-b", "key": "api-key" } },
                "recipients": ["oncall@tenant-b.test"],
                "allowedNamespaces": { "list": [b] }
            }),
        ),
        identity(
            &id_c,
            json!({
                "smtp": { "url": smtp.url(), "username": "capm",
                    "passwordSecretRef": { "name": "tenant-c", "key": "password" },
                    "caSecretRef": { "name": "tenant-c", "key": "ca.crt" } },
                "from": "requests@relay.tenant-c.test",
                "recipients": ["oncall@tenant-c.test", "audit@tenant-c.test"],
                "allowedNamespaces": { "list": [c] }
            }),
        ),
    ] {
        identities.create(&pp, &i).await.unwrap();
    }
    // An identity without a backend is refused by the schema.
    let invalid = identities
        .create(
            &pp,
            &identity("no-backend-x", json!({ "recipients": ["a@b.test"] })),
        )
        .await
        .unwrap_err();
    assert!(
        invalid.to_string().contains("exactly one backend"),
        "{invalid}"
    );

    let mut config = env.config();
    config.namespace = None;
    config.watch_filter = Some(FILTER.into());
    config.identity_secret_namespace = Some(provider_ns.clone());
    config.tenancy.hosts.mailgun = vec![mailgun_a.addr().to_string(), mailgun_b.addr().to_string()];
    config.tenancy.hosts.smtp = vec![smtp.addr().to_string()];
    config.backoff_max = Duration::from_secs(1);
    config.delivery_poll_base = Duration::from_millis(200);
    config.delivery_poll_max = Duration::from_secs(1);
    env.start_with(config).await;

    create_pair(&client, a, "a1", Some(&id_a)).await;
    create_pair(&client, b, "b1", Some(&id_b)).await;
    create_pair(&client, c, "c1", Some(&id_c)).await;
    create_pair(&client, x, "x1", Some(&id_a)).await;
    create_pair(&client, a, "a-missing", Some("no-such-identity")).await;

    eventually(PATIENCE, "each tenant's request mailed", || async {
        mailgun_a.messages().unwrap().len() == 1
            && mailgun_b.messages().unwrap().len() == 1
            && smtp.messages().unwrap().len() == 1
    })
    .await;
    // Each through its own backend, From its own domain, to its own recipients.
    let ma = &mailgun_a.messages().unwrap()[0];
    assert_eq!(ma.from, "cluster-api-provider-mailgun@mg.tenant-a.test");
    assert_eq!(ma.to, ["oncall@tenant-a.test"]);
    assert_eq!(ma.key, "sending", "tenant A sends with its sending key");
    let mb = &mailgun_b.messages().unwrap()[0];
    assert_eq!(mb.to, ["oncall@tenant-b.test"]);
    let mc = &smtp.messages().unwrap()[0];
    assert_eq!(mc.header("From"), Some("requests@relay.tenant-c.test"));
    assert!(mc.header("To").unwrap().contains("audit@tenant-c.test"));

    // Refused ones: a condition, no mail, nowhere.
    eventually(
        PATIENCE,
        "IdentityNotAllowed and IdentityNotFound shown",
        || async {
            reason(&client, x, "x1", "MailSent")
                .await
                .is_some_and(|(r, _)| r == reasons::IDENTITY_NOT_ALLOWED)
                && reason(&client, a, "a-missing", "MailSent")
                    .await
                    .is_some_and(|(r, _)| r == reasons::IDENTITY_NOT_FOUND)
        },
    )
    .await;
    let (_, message) = reason(&client, x, "x1", "Ready").await.unwrap();
    assert!(
        message.contains(x.as_str()) && message.contains("allowedNamespaces"),
        "{message}"
    );
    assert!(
        env.mails().is_empty(),
        "the provider's own backend mailed a tenant's request"
    );
    assert_eq!(mailgun_a.messages().unwrap().len(), 1);

    // Delivery, asked of each identity's own backend: A (a read key) tracks it; B (a sending
    // key only) and C (an SMTP relay) say why they cannot.
    mailgun_a
        .add_event(&EventRule {
            message_id: ma.id.clone(),
            event: DeliveryEvent::Delivered,
            recipient: None,
            reason: None,
            code: None,
            message: None,
        })
        .unwrap();
    eventually(
        PATIENCE,
        "a1 delivered, b1 and c1 not trackable",
        || async {
            reason(&client, a, "a1", "MailDelivered")
                .await
                .is_some_and(|(r, _)| r == reasons::DELIVERED)
                && reason(&client, b, "b1", "MailDelivered")
                    .await
                    .is_some_and(|(r, _)| r == reasons::NOT_TRACKABLE)
                && reason(&client, c, "c1", "MailDelivered")
                    .await
                    .is_some_and(|(r, _)| r == reasons::NOT_TRACKABLE)
        },
    )
    .await;
    let (_, why_b) = reason(&client, b, "b1", "MailDelivered").await.unwrap();
    assert!(why_b.contains("read role"), "{why_b}");
    assert_eq!(
        env.mailgun.stats().unwrap().logs_requests,
        0,
        "the provider's own backend was asked"
    );
    // Counted per identity.
    let delivered =
        |identity: &str| env.metric("capm_mail_delivery_total", Some(("identity", identity)));
    assert_eq!(delivered(&id_a), 1.0);
    assert_eq!(delivered(&id_b), 1.0);
    assert_eq!(delivered(""), 0.0);

    // The recorded mails say which identity sent them.
    let a1 = Api::<MailgunCluster>::namespaced(client.clone(), a)
        .get("a1")
        .await
        .unwrap();
    let record = a1
        .annotations()
        .values()
        .find(|v| v.contains(&id_a))
        .cloned();
    assert!(
        record.is_some(),
        "no record names {id_a}: {:?}",
        a1.annotations()
    );

    // A rotated key: tenant B's Secret now holds its account key; the next send uses it.
    let b_account = mailgun_b.api_key().to_owned();
    secrets
        .replace(
            "tenant-b",
            &pp,
            &secret("tenant-b", &id_b, &[("api-key", b_account.as_bytes())]),
        )
        .await
        .unwrap();
    create_pair(&client, b, "b2", Some(&id_b)).await;
    eventually(PATIENCE, "b2 mailed", || async {
        mailgun_b.messages().unwrap().len() == 2
    })
    .await;
    assert_eq!(
        mailgun_b.messages().unwrap()[1].key,
        "account",
        "the rotated key was not used"
    );

    // Changing identityRef after the mail sends nothing again.
    Api::<MailgunCluster>::namespaced(client.clone(), a)
        .patch(
            "a1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "identityRef": { "kind": "MailgunClusterIdentity", "name": id_b } } })),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(mailgun_b.messages().unwrap().len(), 2);
    assert_eq!(mailgun_a.messages().unwrap().len(), 1);

    // Allowing X's namespace (a label) lets its request out, once, through identity A.
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .patch(
            x,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "capm.test/team": "a" } } })),
        )
        .await
        .unwrap();
    eventually(PATIENCE, "x1 mailed once allowed", || async {
        mailgun_a.messages().unwrap().len() == 2
    })
    .await;

    // The release of a1 goes through the identity its request went through (A), not B.
    cluster_api(&client, a)
        .delete("a1", &DeleteParams::default())
        .await
        .unwrap();
    Api::<MailgunCluster>::namespaced(client.clone(), a)
        .delete("a1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "a1 released and gone", || async {
        Api::<MailgunCluster>::namespaced(client.clone(), a)
            .get_opt("a1")
            .await
            .unwrap()
            .is_none()
    })
    .await;
    let subjects: Vec<String> = mailgun_a
        .messages()
        .unwrap()
        .iter()
        .map(|m| m.subject.clone())
        .collect();
    assert!(
        subjects
            .iter()
            .any(|s| s.contains("Cluster a1 no longer needed")),
        "{subjects:?}"
    );
    assert_eq!(
        mailgun_b.messages().unwrap().len(),
        2,
        "the release went through B"
    );
    assert!(env.mails().is_empty());

    // Moved by `clusterctl move` (the identity with it) with a pending intent that names
    // identity B: its lookup and resend go through B, under the intent's Message-Id.
    let old_id = "<mailguncluster.7f0c1d2e-0000-4000-8000-00000000beef@mg.example.com>";
    let record = json!({
        "messageId": old_id, "state": "sending", "writer": "source-cluster_abcdefghij",
        "at": "2026-01-01T00:00:00Z", "identity": id_b,
    })
    .to_string();
    create_pair_with(
        &client,
        b,
        "moved",
        Some(&id_b),
        json!({
            "annotations": { capm_api::names::MAIL_ANNOTATION: record },
            "finalizers": [capm_api::names::CLUSTER_FINALIZER],
        }),
    )
    .await;
    eventually(
        PATIENCE,
        "the moved object's request resent through B",
        || async { mailgun_b.messages().unwrap().iter().any(|m| m.id == old_id) },
    )
    .await;
    assert_eq!(
        mailgun_b
            .messages()
            .unwrap()
            .iter()
            .filter(|m| m.id == old_id)
            .count(),
        1
    );
    assert!(env.mails().is_empty() && mailgun_a.messages().unwrap().iter().all(|m| m.id != old_id));

    // No secret in any status or event.
    for (ns, name) in [(b.as_str(), "b1"), (c.as_str(), "c1"), (x.as_str(), "x1")] {
        let obj = Api::<MailgunCluster>::namespaced(client.clone(), ns)
            .get(name)
            .await
            .unwrap();
        let text = serde_json::to_string(&obj).unwrap();
        for s in [
            b_send.as_str(),
            b_account.as_str(),
            "relay-password-tenant-c",
            a_read.as_str(),
        ] {
            assert!(!text.contains(s), "a secret in {name}");
        }
    }
    env.stop().await;
    for i in [&id_a, &id_b, &id_c] {
        let _ = identities.delete(i, &DeleteParams::default()).await;
    }
}

/// Issue 45: the operator's bounds. The provider's own configuration serves only the namespaces
/// it allows; an identity may name only Secrets claimed for it and reach only the hosts the
/// operator lists (a listener off the list gets no connection); a release goes out through the
/// request's identity after the namespace lost access to it, and one that cannot go out at all
/// is given up after the (shortened) release timeout, with an Event, so the deletion finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_bounds_tenants_and_every_release_ends() {
    let mut env = Env::new("mgc-bounds").await;
    let client = env.ns.client.clone();
    let provider_ns = env.ns.name.clone();
    let ns_d = TestNamespace::create("bounds-default").await.unwrap();
    let ns_e = TestNamespace::create("bounds-else").await.unwrap();
    let ns_t = TestNamespace::create("bounds-tenant").await.unwrap();
    let (d, e, t) = (&ns_d.name, &ns_e.name, &ns_t.name);
    let tenant = MailgunServer::start("key-tenant-t", "mg.tenant-t.test").unwrap();
    // A host no identity may reach: it must never see a connection.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.set_nonblocking(true).unwrap();

    let suffix = provider_ns.rsplit('-').next().unwrap().to_owned();
    let id = |what: &str| format!("{what}-{suffix}");
    let (id_t, id_own, id_other, id_probe) = (id("t"), id("own"), id("other"), id("probe"));
    let secrets = Api::<Secret>::namespaced(client.clone(), &provider_ns);
    let pp = PostParams::default();
    let t_key = tenant.api_key().to_owned();
    let own_key = env.mailgun.api_key().to_owned();
    secrets
        .create(
            &pp,
            &secret("tenant-t", &id_t, &[("api-key", t_key.as_bytes())]),
        )
        .await
        .unwrap();
    secrets
        .create(
            &pp,
            &secret("probe", &id_probe, &[("api-key", t_key.as_bytes())]),
        )
        .await
        .unwrap();
    // The provider's own key, as an operator keeps it: claimed by no identity.
    let mut own = secret("provider-key", "x", &[("api-key", own_key.as_bytes())]);
    own.metadata.labels = None;
    secrets.create(&pp, &own).await.unwrap();

    let mailgun = |base: String, secret: &str, allowed: serde_json::Value| {
        json!({
            "mailgun": { "domain": "mg.tenant-t.test", "baseURL": base,
                "apiKeySecretRef": { "name": secret, "key": "api-key" } },
            "recipients": ["oncall@tenant-t.test"], "allowedNamespaces": allowed
        })
    };
    let probe_url = format!("http://{}", probe.local_addr().unwrap());
    // The operator's list names ports: the refusal names the probe's.
    let probe_refusal = format!(
        "spec.mailgun.baseURL: host {} is not among the hosts",
        probe.local_addr().unwrap()
    );
    let identities = Api::<MailgunClusterIdentity>::all(client.clone());
    for (name, spec) in [
        (
            &id_t,
            mailgun(tenant.base_url(), "tenant-t", json!({ "list": [t] })),
        ),
        (
            &id_own,
            mailgun(tenant.base_url(), "provider-key", json!({})),
        ),
        (&id_other, mailgun(tenant.base_url(), "tenant-t", json!({}))),
        (&id_probe, mailgun(probe_url, "probe", json!({}))),
    ] {
        identities.create(&pp, &identity(name, spec)).await.unwrap();
    }

    let mut config = env.config();
    config.namespace = None;
    config.watch_filter = Some(BOUNDS_FILTER.into());
    config.identity_secret_namespace = Some(provider_ns.clone());
    config.tenancy.hosts.mailgun = vec![tenant.addr().to_string()];
    config.tenancy.default_allowed = serde_json::from_value(json!({ "list": [d] })).unwrap();
    config.tenancy.release_timeout = Duration::from_secs(3);
    config.backoff_max = Duration::from_secs(1);
    env.start_with(config).await;

    create_bounded_pair(&client, d, "d1", None).await;
    create_bounded_pair(&client, e, "e1", None).await;
    create_bounded_pair(&client, e, "own1", Some(&id_own)).await;
    create_bounded_pair(&client, e, "other1", Some(&id_other)).await;
    create_bounded_pair(&client, e, "probe1", Some(&id_probe)).await;
    create_bounded_pair(&client, t, "t1", Some(&id_t)).await;
    create_bounded_pair(&client, t, "t2", Some(&id_t)).await;

    eventually(
        PATIENCE,
        "d1 mailed by default, t1 and t2 by the tenant",
        || async { env.mails().len() == 1 && tenant.messages().unwrap().len() == 2 },
    )
    .await;
    let refused = [
        (
            "e1",
            reasons::IDENTITY_NOT_ALLOWED,
            "the provider's own configuration does not allow namespace",
        ),
        (
            "own1",
            reasons::IDENTITY_INVALID,
            "spec.mailgun.apiKeySecretRef: Secret provider-key not found in namespace",
        ),
        (
            "other1",
            reasons::IDENTITY_INVALID,
            "spec.mailgun.apiKeySecretRef: Secret tenant-t is claimed by another identity",
        ),
        ("probe1", reasons::IDENTITY_INVALID, probe_refusal.as_str()),
    ];
    eventually(PATIENCE, "each refusal shown", || async {
        let mut all = true;
        for (name, want, _) in refused {
            all &= reason(&client, e, name, "MailSent")
                .await
                .is_some_and(|(r, _)| r == want);
        }
        all
    })
    .await;
    for (name, want, says) in refused {
        let (r, message) = reason(&client, e, name, "Ready").await.unwrap();
        assert_eq!(r, want, "{name}");
        assert!(message.contains(says), "{name}: {message}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        env.mails().len(),
        1,
        "a refused object was mailed by default"
    );
    assert_eq!(tenant.messages().unwrap().len(), 2);
    assert!(
        probe
            .accept()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "the provider connected to a host off the allow-list"
    );

    // Namespace t loses access to the identity: a release still goes through it (the request's).
    identities
        .patch(
            &id_t,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "allowedNamespaces": { "list": ["nobody"] } } })),
        )
        .await
        .unwrap();
    let gone = |name: &'static str| {
        let client = client.clone();
        async move {
            cluster_api(&client, t)
                .delete(name, &DeleteParams::default())
                .await
                .unwrap();
            Api::<MailgunCluster>::namespaced(client.clone(), t)
                .delete(name, &DeleteParams::default())
                .await
                .unwrap();
        }
    };
    gone("t1").await;
    let released = |name: &str| {
        let subject = format!("Cluster {name} no longer needed");
        tenant
            .messages()
            .unwrap()
            .iter()
            .filter(|m| m.subject.contains(&subject))
            .count()
    };
    eventually(
        PATIENCE,
        "t1 released through its request's identity and gone",
        || async {
            released("t1") == 1
                && Api::<MailgunCluster>::namespaced(client.clone(), t)
                    .get_opt("t1")
                    .await
                    .unwrap()
                    .is_none()
        },
    )
    .await;

    // The identity deleted, the default not allowed in t: t2's release cannot go out; after the
    // release timeout it is given up with an Event and the deletion finishes.
    identities
        .delete(&id_t, &DeleteParams::default())
        .await
        .unwrap();
    gone("t2").await;
    eventually(
        PATIENCE,
        "t2 waits, then is gone without a release",
        || async {
            Api::<MailgunCluster>::namespaced(client.clone(), t)
                .get_opt("t2")
                .await
                .unwrap()
                .is_none()
        },
    )
    .await;
    assert_eq!(released("t2"), 0);
    assert_eq!(
        env.mails().len(),
        1,
        "t2's release went through the default"
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), t);
    let abandoned: Vec<_> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|ev| ev.reason.as_deref() == Some(reasons::RELEASE_ABANDONED))
        .collect();
    assert_eq!(abandoned.len(), 1, "{abandoned:?}");
    assert_eq!(
        (
            env.metric("capm_release_abandoned_total", Some(("reason", "identity"))),
            env.metric("capm_release_abandoned_total", Some(("reason", "mail"))),
        ),
        (1.0, 0.0),
        "the release given up is counted under its reason"
    );
    let note = abandoned[0].note.clone().unwrap_or_default();
    assert!(
        note.contains("given up")
            && note.contains(&format!("MailgunClusterIdentity {id_t} not found")),
        "{note}"
    );

    // No secret in any status or Event.
    for (ns, name) in [
        (e.as_str(), "own1"),
        (e.as_str(), "other1"),
        (e.as_str(), "probe1"),
    ] {
        let text = serde_json::to_string(
            &Api::<MailgunCluster>::namespaced(client.clone(), ns)
                .get(name)
                .await
                .unwrap(),
        )
        .unwrap();
        assert!(
            !text.contains(&own_key) && !text.contains(&t_key),
            "a secret in {name}"
        );
    }
    assert!(!note.contains(&t_key));
    env.stop().await;
    for i in [&id_own, &id_other, &id_probe] {
        let _ = identities.delete(i, &DeleteParams::default()).await;
    }
}

/// The watch-filter value of the identity-fix test's objects.
const WAKE_FILTER: &str = "identity-wake-test";
/// The namespace label the provider's own configuration serves in the identity-fix test.
const WAKE_LABEL: &str = "capm-test-wake";

/// Polls every 20 ms until `done` (at most [`PATIENCE`]) and returns how long it took.
async fn latency<F: std::future::Future<Output = bool>>(
    what: &str,
    mut done: impl FnMut() -> F,
) -> Duration {
    let start = std::time::Instant::now();
    while !done().await {
        assert!(
            start.elapsed() < PATIENCE,
            "{what}: not within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

/// An object refused for its identity is reconciled as soon as the identity (or its claimed
/// Secret) is fixed, not after its backoff: with the backoff at 5 s doubling up to 10 minutes,
/// each object waits out three refusals (its next retry at least 20 s away) before the fix, and
/// is mailed within 5 s of it. Once with the claimed Secret created (`IdentityInvalid`), once
/// with the identity allowing the namespace (`IdentityNotAllowed`), once for an object without
/// an identity, its namespace labelled into the provider's own scope (`IdentityNotAllowed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_identity_wakes_the_objects_it_refused() {
    let mut env = Env::new("mgc-wake").await;
    let client = env.ns.client.clone();
    let ns = env.ns.name.clone();
    let tenant = MailgunServer::start("key-tenant-w", "mg.tenant-w.test").unwrap();
    let suffix = ns.rsplit('-').next().unwrap().to_owned();
    let (id_a, id_b) = (format!("wake-a-{suffix}"), format!("wake-b-{suffix}"));
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let identities = Api::<MailgunClusterIdentity>::all(client.clone());
    let pp = PostParams::default();
    let key = tenant.api_key().to_owned();
    let spec = |secret: &str, allowed: serde_json::Value| {
        json!({
            "mailgun": { "domain": "mg.tenant-w.test", "baseURL": tenant.base_url(),
                "apiKeySecretRef": { "name": secret, "key": "api-key" } },
            "recipients": ["oncall@tenant-w.test"], "allowedNamespaces": allowed
        })
    };
    // a: its Secret missing; b: its namespace not allowed.
    identities
        .create(&pp, &identity(&id_a, spec("wake-a", json!({}))))
        .await
        .unwrap();
    secrets
        .create(
            &pp,
            &secret("wake-b", &id_b, &[("api-key", key.as_bytes())]),
        )
        .await
        .unwrap();
    let nobody = json!({ "list": ["nobody"] });
    identities
        .create(&pp, &identity(&id_b, spec("wake-b", nobody)))
        .await
        .unwrap();

    let mut config = env.config();
    config.watch_filter = Some(WAKE_FILTER.into());
    config.identity_secret_namespace = Some(ns.clone());
    config.tenancy.hosts.mailgun = vec![tenant.addr().to_string()];
    config.backoff_base = Duration::from_secs(5);
    config.backoff_max = Duration::from_secs(600);
    // The provider's own configuration serves the namespaces labelled so.
    config.tenancy.default_allowed =
        serde_json::from_value(json!({ "selector": { "matchLabels": { WAKE_LABEL: "yes" } } }))
            .unwrap();
    env.start_with(config).await;

    let retries =
        |env: &Env| env.metric("workqueue_retries_total", Some(("name", "mailguncluster")));
    let filter = json!({ "labels": { "cluster.x-k8s.io/watch-filter": WAKE_FILTER } });
    let mut latencies = Vec::new();
    for (name, id, refusal) in [
        ("wa", Some(&id_a), reasons::IDENTITY_INVALID),
        ("wb", Some(&id_b), reasons::IDENTITY_NOT_ALLOWED),
        ("wd", None, reasons::IDENTITY_NOT_ALLOWED),
    ] {
        // The other object is mailed (or not yet created): every retry counted from here is
        // this object's.
        let before = retries(&env);
        create_pair_with(&client, &ns, name, id.map(String::as_str), filter.clone()).await;
        eventually(PATIENCE, "refused for its identity", || async {
            reason(&client, &ns, name, "MailSent")
                .await
                .is_some_and(|(r, _)| r == refusal)
        })
        .await;
        // Three refusals: the next retry is 20 s after the third, at the earliest.
        eventually(PATIENCE, "three refusals", || async {
            retries(&env) - before >= 3.0
        })
        .await;
        // Mails through the tenant's identity and through the provider's own.
        let count = || tenant.messages().unwrap().len() + env.mails().len();
        let mailed = count();
        match name {
            "wa" => {
                let fixed = secret("wake-a", &id_a, &[("api-key", key.as_bytes())]);
                secrets.create(&pp, &fixed).await.unwrap();
            }
            "wb" => {
                let allowed = json!({ "spec": { "allowedNamespaces": { "list": [ns] } } });
                identities
                    .patch(&id_b, &PatchParams::default(), &Patch::Merge(&allowed))
                    .await
                    .unwrap();
            }
            _ => {
                let labelled = json!({ "metadata": { "labels": { WAKE_LABEL: "yes" } } });
                Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
                    .patch(&ns, &PatchParams::default(), &Patch::Merge(&labelled))
                    .await
                    .unwrap();
            }
        }
        let took = latency("mailed after the fix", || async { count() == mailed + 1 }).await;
        println!("{name} ({refusal}): mailed {took:?} after its identity was fixed");
        assert!(
            took < Duration::from_secs(5),
            "{name} was mailed {took:?} after the fix"
        );
        assert!(
            retries(&env) - before < 4.0,
            "a fourth refusal: the object's backoff was not long"
        );
        latencies.push(took);
    }
    println!("identity-fix latencies: {latencies:?}");
    assert_eq!(
        (tenant.messages().unwrap().len(), env.mails().len()),
        (2, 1),
        "wa and wb through their identities, wd through the provider's own"
    );
    env.stop().await;
    for i in [&id_a, &id_b] {
        let _ = identities.delete(i, &DeleteParams::default()).await;
    }
}
