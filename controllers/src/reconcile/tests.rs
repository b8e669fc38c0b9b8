//! Step-order tests: one reconcile of a `MailgunCluster` against a fake API server (a kube
//! `Client` over a `tower-test` mock service) and a `mockall` mailer, asserting the exact
//! sequence of API requests and sends the pass makes.
//!
//! The fake API server keeps the one object in JSON: merge patches apply to it (a patch naming
//! another `resourceVersion` gets 409, as the real one answers), the status subresource takes
//! only `status`, and the object disappears once it is being deleted without finalizers. Mails
//! and requests go to one log, so their interleaving is checked too.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use capm_api::{
    capi::{Cluster, Machine},
    names::{self, conditions, reasons},
    v1beta1::MailgunCluster,
};
use capm_mailer::{MockMailer, SendReceipt};
use http::{Request, Response, StatusCode};
use kube::{
    Client,
    client::Body,
    runtime::{controller::Action, reflector, watcher::Event},
};
use serde_json::{Value, json};

use super::reconcile;
use crate::{
    Config, Leadership, Metrics,
    context::{Ctx, ReconcileError},
    events::Events,
    sendonce::records::{self, Sent},
};

const NS: &str = "ns";
const NAME: &str = "mgc";
const UID: &str = "mgc-uid";
const CLUSTER_UID: &str = "cluster-uid";
const DOMAIN: &str = "example.com";
const OBJECT_PATH: &str =
    "/apis/infrastructure.cluster.x-k8s.io/v1beta1/namespaces/ns/mailgunclusters/mgc";
const STATUS_PATH: &str =
    "/apis/infrastructure.cluster.x-k8s.io/v1beta1/namespaces/ns/mailgunclusters/mgc/status";
const CLUSTER_PATH: &str = "/apis/cluster.x-k8s.io/v1beta2/namespaces/ns/clusters/owner";
const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/ns/events";

/// What the pass did, in order: `"<METHOD> <path>"` for an API request, `"send <Message-Id>"`
/// for a mail handed to the backend.
type Log = Arc<Mutex<Vec<String>>>;

fn logged(log: &Log) -> Vec<String> {
    log.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The JSON merge patch of RFC 7386.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

/// The API server's side: the object, the owner, the bodies it was sent.
struct Server {
    object: Option<Value>,
    owner: Value,
    resource_version: u64,
    /// The body of every request, in order (`Null` for none).
    bodies: Vec<Value>,
}

fn status_response(code: u16, reason: &str) -> (StatusCode, Value) {
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": reason, "reason": reason, "code": code,
        }),
    )
}

impl Server {
    fn answer(&mut self, method: &str, path: &str, body: &Value) -> (StatusCode, Value) {
        match (method, path) {
            ("GET", CLUSTER_PATH) => {
                let mut meta = json!({
                    "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                });
                meta["metadata"] = self.owner["metadata"].clone();
                (StatusCode::OK, meta)
            }
            ("POST", EVENTS_PATH) => (StatusCode::CREATED, body.clone()),
            ("PATCH", OBJECT_PATH | STATUS_PATH) => {
                let Some(object) = self.object.as_mut() else {
                    return status_response(404, "NotFound");
                };
                let expected = &body["metadata"]["resourceVersion"];
                if !expected.is_null() && *expected != object["metadata"]["resourceVersion"] {
                    return status_response(409, "Conflict");
                }
                let patch = if path == STATUS_PATH {
                    json!({ "status": body["status"] })
                } else {
                    let mut patch = body.clone();
                    if let Some(p) = patch.as_object_mut() {
                        p.remove("status");
                    }
                    patch
                };
                merge(object, &patch);
                self.resource_version += 1;
                object["metadata"]["resourceVersion"] = json!(self.resource_version.to_string());
                let answer = object.clone();
                let finalizers = object["metadata"]["finalizers"]
                    .as_array()
                    .map_or(0, Vec::len);
                if !object["metadata"]["deletionTimestamp"].is_null() && finalizers == 0 {
                    self.object = None;
                }
                (StatusCode::OK, answer)
            }
            _ => status_response(404, "NotFound"),
        }
    }
}

/// A kube `Client` whose requests the fake [`Server`] answers, logging each to `log`.
fn fake_api(object: &MailgunCluster, owner: &Cluster, log: Log) -> (Client, Arc<Mutex<Server>>) {
    let server = Arc::new(Mutex::new(Server {
        object: Some(serde_json::to_value(object).expect("the object serializes")),
        owner: serde_json::to_value(owner).expect("the owner serializes"),
        resource_version: 10,
        bodies: Vec::new(),
    }));
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let answering = Arc::clone(&server);
    tokio::spawn(async move {
        while let Some((request, respond)) = handle.next_request().await {
            let method = request.method().to_string();
            let path = request.uri().path().to_owned();
            let bytes = request
                .into_body()
                .collect_bytes()
                .await
                .unwrap_or_default();
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            log.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(format!("{method} {path}"));
            let (code, answer) = {
                let mut server = answering.lock().unwrap_or_else(|e| e.into_inner());
                server.bodies.push(body.clone());
                server.answer(&method, &path, &body)
            };
            let response = Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&answer).unwrap_or_default()))
                .expect("a valid response");
            respond.send_response(response);
        }
    });
    (Client::new(service, "default"), server)
}

fn config() -> Config {
    crate::config::tests::for_tests(DOMAIN)
}

/// The owner `Cluster` "owner", naming `NAME` as its infrastructure.
fn owner(paused: bool) -> Cluster {
    serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": { "name": "owner", "namespace": NS, "uid": CLUSTER_UID },
        "spec": {
            "paused": paused,
            "infrastructureRef": {
                "apiGroup": capm_api::GROUP, "kind": "MailgunCluster", "name": NAME,
            },
        },
    }))
    .expect("a valid Cluster")
}

/// A `MailgunCluster` owned by the Cluster whose UID is `owner_uid`.
fn object(owner_uid: &str) -> MailgunCluster {
    serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunCluster",
        "metadata": {
            "name": NAME, "namespace": NS, "uid": UID, "generation": 1,
            "resourceVersion": "10",
            "ownerReferences": [{
                "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                "name": "owner", "uid": owner_uid,
            }],
        },
        "spec": { "priority": "Urgent", "request": "one please", "requester": "dev@example.com" },
    }))
    .expect("a valid MailgunCluster")
}

/// `obj` being deleted, with our finalizer.
fn deleting(mut obj: MailgunCluster) -> MailgunCluster {
    obj.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now(),
    ));
    obj.metadata.finalizers = Some(vec![names::CLUSTER_FINALIZER.to_owned()]);
    obj
}

/// A mailer that accepts every mail, logging it, and tracks no delivery.
fn accepting(log: &Log) -> MockMailer {
    let mut mailer = MockMailer::new();
    let log = Arc::clone(log);
    mailer.expect_send().returning(move |message| {
        let id = message.message_id().as_str().to_owned();
        log.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(format!("send {id}"));
        Ok(SendReceipt {
            message_id: id,
            response: "Queued. Thank you.".into(),
        })
    });
    mailer.expect_backend().return_const("mock");
    mailer
        .expect_tracking()
        .return_const(capm_mailer::Tracking::Untracked(None));
    mailer
}

/// A mailer that must not be asked anything.
fn silent() -> MockMailer {
    let mut mailer = MockMailer::new();
    mailer.expect_send().never();
    mailer.expect_lookup().never();
    mailer
}

/// What one reconcile did.
struct Outcome {
    result: Result<Action, ReconcileError>,
    log: Vec<String>,
    /// The body of each API request (not of the sends), in order.
    bodies: Vec<Value>,
    /// The object as the API server has it afterwards (`None`: gone).
    object: Option<Value>,
}

/// One reconcile of `obj` with `owner` in the (listed) Cluster cache.
async fn reconcile_once(
    obj: MailgunCluster,
    owner: Cluster,
    mailer: MockMailer,
    log: Log,
) -> Outcome {
    let (client, server) = fake_api(&obj, &owner, Arc::clone(&log));
    let (clusters, mut cluster_writer) = reflector::store::<Cluster>();
    let (machines, mut machine_writer) = reflector::store::<Machine>();
    cluster_writer.apply_watcher_event(&Event::Init);
    cluster_writer.apply_watcher_event(&Event::InitApply(owner));
    cluster_writer.apply_watcher_event(&Event::InitDone);
    machine_writer.apply_watcher_event(&Event::Init);
    machine_writer.apply_watcher_event(&Event::InitDone);
    let ctx = Arc::new(Ctx::new(
        client.clone(),
        Arc::new(mailer),
        Events::new(client, "mailguncluster", "t"),
        config(),
        Leadership::unelected("t"),
        Metrics::register(&prometheus::Registry::new()).expect("metrics register"),
        crate::kinds::tests::stores(clusters, machines),
        crate::poller::tests::wakes().0,
    ));
    ctx.wait_for_capi_lists();
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        reconcile(Arc::new(obj), Arc::clone(&ctx)),
    )
    .await
    .expect("the reconcile finished");
    let server = server.lock().unwrap_or_else(|e| e.into_inner());
    Outcome {
        result,
        log: logged(&log),
        bodies: server.bodies.clone(),
        object: server.object.clone(),
    }
}

impl Outcome {
    /// The pass ended well and waits for the next change of the object.
    fn waits_for_a_change(&self) {
        assert!(
            matches!(&self.result, Ok(a) if *a == Action::await_change()),
            "{:?} after {:?}",
            self.result,
            self.log
        );
    }
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

fn request_id() -> String {
    names::message_id("MailgunCluster", UID, DOMAIN)
}

fn deletion_id() -> String {
    names::deletion_message_id("MailgunCluster", UID, DOMAIN)
}

/// The request's record as a pass that mailed it leaves it.
fn mailed(mut obj: MailgunCluster) -> MailgunCluster {
    let id = request_id();
    let sent = Sent {
        message_id: Some(id.clone()),
        backend_id: id.clone(),
        at: Some(k8s_openapi::jiff::Timestamp::now()),
        identity: None,
    };
    obj.metadata.annotations = Some(
        [(
            names::MAIL_ANNOTATION.to_owned(),
            records::sent_value(&id, &sent),
        )]
        .into_iter()
        .collect(),
    );
    obj
}

#[tokio::test]
async fn a_paused_cluster_writes_paused_status_only_and_mails_nothing() {
    let log = Log::default();
    let done = reconcile_once(object(CLUSTER_UID), owner(true), silent(), log).await;
    done.waits_for_a_change();
    assert_eq!(done.log, [format!("PATCH {STATUS_PATH}")]);
    let status = &done.bodies[0]["status"];
    assert_eq!(condition(status, conditions::PAUSED)["status"], "True");
    assert_eq!(condition(status, conditions::READY)["status"], "False");
    assert_eq!(
        condition(status, conditions::READY)["reason"],
        reasons::PAUSED
    );
    assert!(condition(status, conditions::MAIL_SENT).is_null());
    // No finalizer, no record: a paused object is not touched.
    let object = done.object.expect("the object is still there");
    assert!(object["metadata"]["finalizers"].is_null());
    assert!(object["metadata"]["annotations"].is_null());
}

#[tokio::test]
async fn an_owner_reference_naming_another_uid_blocks_ready_and_mails_nothing() {
    let log = Log::default();
    let done = reconcile_once(object("someone-else"), owner(false), silent(), log).await;
    done.waits_for_a_change();
    assert_eq!(done.log, [format!("PATCH {STATUS_PATH}")]);
    let ready = condition(&done.bodies[0]["status"], conditions::READY);
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], reasons::OWNER_MISMATCH);
    // The owner is not judged paused or not: the pass stopped before.
    assert!(condition(&done.bodies[0]["status"], conditions::PAUSED).is_null());
    let object = done.object.expect("the object is still there");
    assert!(object["metadata"]["finalizers"].is_null());
}

#[tokio::test]
async fn a_first_pass_writes_the_intent_then_mails_once_then_records_it() {
    let log = Log::default();
    let done = reconcile_once(object(CLUSTER_UID), owner(false), accepting(&log), log).await;
    done.waits_for_a_change();
    assert_eq!(
        done.log,
        [
            format!("GET {CLUSTER_PATH}"),
            format!("PATCH {OBJECT_PATH}"),
            format!("send {}", request_id()),
            format!("PATCH {OBJECT_PATH}"),
            format!("POST {EVENTS_PATH}"),
            format!("PATCH {STATUS_PATH}"),
        ]
    );
    // The intent: fenced by the version read, with our finalizer, before the send.
    let intent = &done.bodies[1]["metadata"];
    assert_eq!(intent["resourceVersion"], "10");
    assert_eq!(intent["finalizers"], json!([names::CLUSTER_FINALIZER]));
    assert!(
        intent["annotations"][names::MAIL_ANNOTATION]
            .as_str()
            .is_some_and(|r| r.contains("\"sending\""))
    );
    // The sent record: not fenced (a concurrent change must not lose it).
    let sent = &done.bodies[2]["metadata"];
    assert!(sent["resourceVersion"].is_null());
    assert!(
        sent["annotations"][names::MAIL_ANNOTATION]
            .as_str()
            .is_some_and(|r| r.contains("\"sent\""))
    );
    assert_eq!(done.bodies[3]["reason"], reasons::MAIL_SENT);
    let status = &done.bodies[4]["status"];
    assert_eq!(condition(status, conditions::MAIL_SENT)["status"], "True");
    assert_eq!(status["mail"]["messageID"], request_id());
}

#[tokio::test]
async fn a_deletion_before_any_send_removes_the_finalizer_and_mails_nothing() {
    let log = Log::default();
    let done = reconcile_once(deleting(object(CLUSTER_UID)), owner(false), silent(), log).await;
    done.waits_for_a_change();
    // One write, fenced by the version read; no status write for an object that is gone.
    assert_eq!(done.log, [format!("PATCH {OBJECT_PATH}")]);
    assert_eq!(
        done.bodies[0]["metadata"],
        json!({ "resourceVersion": "10", "finalizers": [] })
    );
    assert!(done.object.is_none(), "the object is gone");
}

#[tokio::test]
async fn a_deletion_after_the_request_went_out_mails_the_release_then_removes_the_finalizer() {
    let log = Log::default();
    let done = reconcile_once(
        deleting(mailed(object(CLUSTER_UID))),
        owner(false),
        accepting(&log),
        log,
    )
    .await;
    done.waits_for_a_change();
    assert_eq!(
        done.log,
        [
            format!("PATCH {OBJECT_PATH}"),
            format!("send {}", deletion_id()),
            format!("PATCH {OBJECT_PATH}"),
            format!("POST {EVENTS_PATH}"),
            format!("PATCH {OBJECT_PATH}"),
        ]
    );
    // The release's intent, fenced, before its send; the request's record is left alone.
    let intent = &done.bodies[0]["metadata"];
    assert_eq!(intent["resourceVersion"], "10");
    let annotations = intent["annotations"].as_object().expect("annotations");
    assert_eq!(
        annotations.keys().collect::<Vec<_>>(),
        [names::DELETION_MAIL_ANNOTATION]
    );
    assert!(
        done.bodies[1]["metadata"]["annotations"][names::DELETION_MAIL_ANNOTATION]
            .as_str()
            .is_some_and(|r| r.contains("\"sent\""))
    );
    assert_eq!(done.bodies[2]["reason"], reasons::DELETION_MAIL_SENT);
    // The finalizer goes last, fenced by the version of the sent record's write.
    assert_eq!(
        done.bodies[3]["metadata"],
        json!({ "resourceVersion": "12", "finalizers": [] })
    );
    assert!(done.object.is_none(), "the object is gone");
}
