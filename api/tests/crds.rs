//! Integration tests against a real kube-apiserver (the shared local control plane of
//! `capm-test-support`): the CRDs install, the samples are accepted, invalid objects are rejected
//! with messages naming the field, and the API server converts between versions through our
//! webhook served over TLS from this process.
//!
//! Every test installs the CRDs with `conversion.strategy: Webhook` pointing at one webhook
//! server per test binary, so tests running in parallel see the same CRDs.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    sync::{Arc, OnceLock},
    time::Duration,
};

use capm_api::{
    crd::{WebhookTarget, crds, with_webhook_conversion},
    names::CONVERSION_DATA_ANNOTATION,
    v1alpha1, v1beta1,
};
use capm_test_support::{TestNamespace, install_crds, pki::CertificateAuthority};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kube::{
    Api,
    api::{DynamicObject, Patch, PatchParams, PostParams},
    core::{ApiResource, GroupVersionKind},
};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_rustls::{
    TlsAcceptor,
    rustls::{
        ServerConfig,
        crypto::ring,
        pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    },
};

struct Webhook {
    url: String,
    ca_pem: String,
}

/// Starts (once per binary) the conversion webhook on a loopback TLS port, on a thread with its
/// own runtime so it outlives every test's runtime.
fn webhook() -> &'static Webhook {
    static WEBHOOK: OnceLock<Webhook> = OnceLock::new();
    WEBHOOK.get_or_init(|| {
        let ca = CertificateAuthority::new("capm-api test webhook CA").expect("CA");
        let pair = ca
            .serving_cert("capm-api webhook", &[], &[IpAddr::V4(Ipv4Addr::LOCALHOST)])
            .expect("serving cert");
        let certs = CertificateDer::pem_slice_iter(pair.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("cert PEM");
        let key = PrivateKeyDer::from_pem_slice(pair.key_pem.as_bytes()).expect("key PEM");
        let config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocols")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("server config");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                loop {
                    let Ok((tcp, _)) = listener.accept().await else {
                        continue;
                    };
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        // The manager binary serves these with axum; the test only needs the
                        // reviews' answers.
                        let service =
                            service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                                let validate =
                                    req.uri().path() == capm_api::admission::VALIDATE_PATH;
                                let body = http_body_util::BodyExt::collect(req.into_body())
                                    .await
                                    .map(http_body_util::Collected::to_bytes)
                                    .unwrap_or_default();
                                let answer = if validate {
                                    capm_api::admission::review_json(&body)
                                        .map_err(|e| e.to_string())
                                } else {
                                    capm_api::webhook::review_json(&body).map_err(|e| e.to_string())
                                };
                                match answer {
                                    Ok(json) => http::Response::builder()
                                        .header("content-type", "application/json")
                                        .body(http_body_util::Full::new(bytes::Bytes::from(json))),
                                    Err(e) => http::Response::builder()
                                        .status(400)
                                        .body(http_body_util::Full::new(bytes::Bytes::from(e))),
                                }
                            });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(tls), service)
                            .await;
                    });
                }
            });
        });
        Webhook {
            url: format!("https://127.0.0.1:{port}/convert"),
            ca_pem: ca.cert_pem().to_owned(),
        }
    })
}

/// The identity the chart's annotation policy is told is the provider's, in these tests.
const PROVIDER: &str = "system:serviceaccount:capm-system:capm-cluster-api-provider-mailgun";

/// The chart's admission objects (templates/admission.yaml, rendered by Helm as `helm install`
/// would), the webhook pointed at this binary's server instead of the chart's Service.
fn admission_objects() -> Vec<DynamicObject> {
    static OBJECTS: OnceLock<Vec<DynamicObject>> = OnceLock::new();
    OBJECTS
        .get_or_init(|| {
            let chart = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../charts/cluster-api-provider-mailgun");
            let helm = capm_test_support::process::binary("helm").expect("helm (make tools)");
            let home = std::env::temp_dir().join("capm-api-test-helm");
            let out = std::process::Command::new(helm)
                .env("HELM_CACHE_HOME", home.join("cache"))
                .env("HELM_CONFIG_HOME", home.join("config"))
                .env("HELM_DATA_HOME", home.join("data"))
                .env_remove("KUBECONFIG")
                .args(["template", "capm"])
                .arg(&chart)
                .args([
                    "--namespace",
                    "capm-system",
                    "--show-only",
                    "templates/admission.yaml",
                ])
                .args(["--set", "mail.recipient=ops@example.com"])
                .args(["--set", "mail.mailgun.domain=mg.example.com"])
                .args(["--set", "mail.mailgun.apiKeySecret.name=key"])
                .output()
                .expect("helm template");
            assert!(
                out.status.success(),
                "helm template: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let hook = webhook();
            let url = hook
                .url
                .replace("/convert", capm_api::admission::VALIDATE_PATH);
            let text = String::from_utf8(out.stdout).expect("utf-8");
            let mut objects = Vec::new();
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let value = Value::deserialize(doc).expect("YAML");
                if value.is_null() {
                    continue;
                }
                let mut value = value;
                if value["kind"] == "ValidatingWebhookConfiguration" {
                    for webhook in value["webhooks"].as_array_mut().expect("webhooks") {
                        webhook["clientConfig"] = json!({
                            "url": url,
                            "caBundle": base64(hook.ca_pem.as_bytes()),
                        });
                    }
                }
                objects.push(serde_json::from_value(value).expect("object"));
            }
            assert_eq!(
                objects.len(),
                7,
                "webhook, three policies and their bindings"
            );
            objects
        })
        .clone()
}

fn base64(bytes: &[u8]) -> String {
    serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec()))
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .expect("base64")
}

/// Applies the chart's admission objects (server-side apply; unchanged objects are a no-op).
async fn install_admission(client: &kube::Client) {
    for object in admission_objects() {
        let kind = object.types.as_ref().expect("types").kind.clone();
        let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", &kind);
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk));
        let name = object.metadata.name.clone().expect("name");
        api.patch(
            &name,
            &PatchParams::apply("capm-api-tests").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {kind} {name}: {e}"));
    }
}

/// A client in `ns` acting as `user` in `groups` (impersonated by the admin).
async fn client_as(ns: &TestNamespace, user: &str, groups: &[&str]) -> kube::Client {
    let mut config = ns.control_plane().config().await.expect("config");
    config.default_namespace = ns.name.clone();
    config.auth_info.impersonate = Some(user.to_owned());
    config.auth_info.impersonate_groups = Some(groups.iter().map(|g| (*g).to_owned()).collect());
    kube::Client::try_from(config).expect("client")
}

/// Lets `user` do what a namespace's developer may: create, update and patch our kinds.
async fn grant_developer(ns: &TestNamespace, user: &str) {
    let role = object(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "mailgun-developer", "namespace": ns.name},
        "rules": [{"apiGroups": [capm_api::GROUP], "resources": ["*"],
                   "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}],
    }));
    let binding = object(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": format!("mailgun-developer-{user}"), "namespace": ns.name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "mailgun-developer"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }));
    for (kind, obj) in [("Role", role), ("RoleBinding", binding)] {
        let gvk = GroupVersionKind::gvk("rbac.authorization.k8s.io", "v1", kind);
        let api: Api<DynamicObject> =
            Api::namespaced_with(ns.client.clone(), &ns.name, &ApiResource::from_gvk(&gvk));
        api.patch(
            obj.metadata.name.as_deref().expect("name"),
            &PatchParams::apply("capm-api-tests").force(),
            &Patch::Apply(&obj),
        )
        .await
        .expect("RBAC");
    }
}

/// A namespace in the shared control plane, with our CRDs installed (webhook conversion).
async fn setup(prefix: &str) -> TestNamespace {
    let ns = TestNamespace::create(prefix).await.expect("namespace");
    let hook = webhook();
    let crds: Vec<_> = crds()
        .expect("crds")
        .into_iter()
        .map(|crd| {
            with_webhook_conversion(
                crd,
                WebhookTarget::Url(hook.url.clone()),
                hook.ca_pem.as_bytes(),
            )
        })
        .collect();
    install_crds(&ns.client, &crds).await.expect("install CRDs");
    install_admission(&ns.client).await;
    ns
}

fn api(ns: &TestNamespace, version: &str, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(capm_api::GROUP, version, kind);
    let plural = format!("{}s", kind.to_lowercase());
    let resource = ApiResource::from_gvk_with_plural(&gvk, &plural);
    Api::namespaced_with(ns.client.clone(), &ns.name, &resource)
}

fn object(value: Value) -> DynamicObject {
    serde_json::from_value(value).expect("dynamic object")
}

/// Creating right after a CRD update can race the API server's discovery of the new schema;
/// retry "not found" a few times.
async fn create(api: &Api<DynamicObject>, value: Value) -> Result<DynamicObject, kube::Error> {
    let obj = object(value);
    let mut last = None;
    for _ in 0..20 {
        match api.create(&PostParams::default(), &obj).await {
            Err(kube::Error::Api(e)) if e.code == 404 => {
                last = Some(kube::Error::Api(e));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            other => return other,
        }
    }
    Err(last.expect("retried"))
}

fn cluster(name: &str, version: &str) -> Value {
    json!({
        "apiVersion": format!("infrastructure.cluster.x-k8s.io/{version}"),
        "kind": "MailgunCluster",
        "metadata": {"name": name},
        "spec": {"priority": "Urgent", "request": "One cluster please.\nThanks.", "requester": "ops@example.com"},
    })
}

fn machine(name: &str, version: &str) -> Value {
    json!({
        "apiVersion": format!("infrastructure.cluster.x-k8s.io/{version}"),
        "kind": "MailgunMachine",
        "metadata": {"name": name},
        "spec": {"priority": "BusinessCritical", "request": "One machine", "requester": "ops@example.com"},
    })
}

fn with(mut base: Value, pointer: &str, value: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').expect("pointer");
    base.pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .expect("parent")
        .insert(key.to_owned(), value);
    base
}

fn error_message(result: Result<DynamicObject, kube::Error>) -> String {
    match result {
        Ok(obj) => panic!("accepted: {obj:?}"),
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422, "{e:?}");
            e.message
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

fn samples() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/samples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("samples dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

#[tokio::test]
async fn crds_are_established_and_every_sample_is_accepted() {
    let ns = setup("api-samples").await;
    let cp = ns.control_plane();
    cp.install_capi_crds().await.expect("Cluster API CRDs");
    let files = samples();
    assert_eq!(files.len(), 13, "{files:?}");
    for file in files {
        let path = file.to_string_lossy().into_owned();
        let mut last = None;
        for _ in 0..20 {
            match cp.kubectl_output(&["create", "-n", &ns.name, "-f", &path]) {
                Ok(out) => {
                    last = None;
                    assert!(out.contains("created"), "{path}: {out}");
                    break;
                }
                Err(e) => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        if let Some(e) = last {
            panic!("{path} rejected: {e}");
        }
    }
    let table = cp
        .kubectl_output(&["get", "mgc", "-n", &ns.name])
        .expect("kubectl get");
    let header = table.lines().next().unwrap_or_default();
    for column in ["NAME", "CLUSTER", "PRIORITY", "PROVISIONED", "MAIL", "AGE"] {
        assert!(header.contains(column), "{header}");
    }
    let all = cp
        .kubectl_output(&["get", "cluster-api", "-n", &ns.name, "-o", "name"])
        .expect("kubectl get category");
    assert!(all.contains("mailgunmachinetemplate"), "{all}");
    assert!(all.contains("mailgunremediationtemplate"), "{all}");
}

#[tokio::test]
async fn kubectl_explain_shows_the_field_docs() {
    let ns = setup("api-explain").await;
    let cp = ns.control_plane();
    let mut out = String::new();
    for _ in 0..40 {
        match cp.kubectl_output(&[
            "explain",
            "mailgunclusters.spec",
            "--api-version=infrastructure.cluster.x-k8s.io/v1beta1",
        ]) {
            Ok(o) if o.contains("controlPlaneEndpoint") => {
                out = o;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    for needle in [
        "requester (required, immutable): e-mail address",
        "controlPlaneEndpoint (optional, set-once)",
        "priority (required, immutable)",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    let status = cp
        .kubectl_output(&[
            "explain",
            "mailgunmachines.status.mail.state",
            "--api-version=infrastructure.cluster.x-k8s.io/v1beta1",
        ])
        .expect("explain");
    assert!(status.contains("Pending"), "{status}");
}

/// The requester table the Rust validation and the mail builder are held to
/// (`api/testdata/requesters.json`), against the real API server: what it admits, the mail
/// builder accepts, and the other way round.
#[tokio::test]
async fn requester_table_matches_the_api_server() {
    let ns = setup("api-requesters").await;
    let clusters = api(&ns, "v1beta1", "MailgunCluster");
    let table: Vec<(String, bool, String)> =
        serde_json::from_str(include_str!("../testdata/requesters.json")).expect("table");
    let mut wrong = Vec::new();
    for (i, (address, admitted, why)) in table.iter().enumerate() {
        let name = format!("r{i}");
        let result = create(
            &clusters,
            with(cluster(&name, "v1beta1"), "/spec/requester", json!(address)),
        )
        .await;
        match (result, admitted) {
            (Ok(_), true) => {}
            (Err(kube::Error::Api(e)), false) if e.code == 422 => {
                assert!(
                    e.message.contains("spec.requester"),
                    "{address:?}: {}",
                    e.message
                );
            }
            (result, _) => wrong.push(format!("{address:?} ({why}): {result:?}")),
        }
    }
    assert!(
        wrong.is_empty(),
        "the API server disagrees with the table:\n{}",
        wrong.join("\n")
    );
}

#[tokio::test]
async fn invalid_objects_are_rejected_naming_the_field() {
    let ns = setup("api-invalid").await;
    let clusters = api(&ns, "v1beta1", "MailgunCluster");
    let machines = api(&ns, "v1beta1", "MailgunMachine");
    let alpha_clusters = api(&ns, "v1alpha1", "MailgunCluster");
    let templates = api(&ns, "v1beta1", "MailgunMachineTemplate");
    let c = || cluster("c", "v1beta1");
    let m = || machine("m", "v1beta1");
    let ep = |host: Value, port: Value| json!({"host": host, "port": port});
    let creates: Vec<(&str, &Api<DynamicObject>, Value, &str)> = vec![
        (
            "bad enum",
            &clusters,
            with(c(), "/spec/priority", json!("Whenever")),
            "spec.priority",
        ),
        (
            "bad enum (v1alpha1)",
            &alpha_clusters,
            with(cluster("c", "v1alpha1"), "/spec/priority", json!("Soon")),
            "spec.priority",
        ),
        (
            "not an e-mail",
            &clusters,
            with(c(), "/spec/requester", json!("nobody")),
            "spec.requester",
        ),
        (
            "CRLF header injection",
            &clusters,
            with(c(), "/spec/requester", json!("a@b.com\r\nBcc: x@y.com")),
            "spec.requester",
        ),
        (
            "LF header injection",
            &machines,
            with(m(), "/spec/requester", json!("a@b.com\nBcc: x@y.com")),
            "spec.requester",
        ),
        (
            "display name",
            &clusters,
            with(c(), "/spec/requester", json!("Me <a@b.com>")),
            "spec.requester",
        ),
        (
            "oversize requester",
            &clusters,
            with(
                c(),
                "/spec/requester",
                json!(format!("{}@example.com", "a".repeat(250))),
            ),
            "spec.requester",
        ),
        (
            "empty request",
            &clusters,
            with(c(), "/spec/request", json!("")),
            "spec.request",
        ),
        (
            "oversize request",
            &clusters,
            with(c(), "/spec/request", json!("x".repeat(4097))),
            "spec.request",
        ),
        (
            "control character in request",
            &clusters,
            with(c(), "/spec/request", json!("a\u{1b}[31m")),
            "spec.request",
        ),
        (
            "missing requester",
            &clusters,
            json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunCluster", "metadata": {"name": "c"}, "spec": {"priority": "Urgent", "request": "r"}}),
            "spec.requester",
        ),
        (
            "port 0",
            &clusters,
            with(c(), "/spec/controlPlaneEndpoint", ep(json!("h"), json!(0))),
            "spec.controlPlaneEndpoint.port",
        ),
        (
            "port 65536",
            &clusters,
            with(
                c(),
                "/spec/controlPlaneEndpoint",
                ep(json!("h"), json!(65536)),
            ),
            "spec.controlPlaneEndpoint.port",
        ),
        (
            "empty host",
            &clusters,
            with(
                c(),
                "/spec/controlPlaneEndpoint",
                ep(json!(""), json!(6443)),
            ),
            "spec.controlPlaneEndpoint.host",
        ),
        (
            "oversize host",
            &clusters,
            with(
                c(),
                "/spec/controlPlaneEndpoint",
                ep(json!("a".repeat(254)), json!(6443)),
            ),
            "spec.controlPlaneEndpoint.host",
        ),
        (
            "space in host",
            &clusters,
            with(
                c(),
                "/spec/controlPlaneEndpoint",
                ep(json!("a b"), json!(6443)),
            ),
            "spec.controlPlaneEndpoint.host",
        ),
        (
            "providerID without scheme",
            &machines,
            with(m(), "/spec/providerID", json!("machine-1")),
            "spec.providerID",
        ),
        (
            "oversize providerID",
            &machines,
            with(
                m(),
                "/spec/providerID",
                json!(format!("x://{}", "a".repeat(600))),
            ),
            "spec.providerID",
        ),
        (
            "bad address type",
            &machines,
            with(
                m(),
                "/spec/addresses",
                json!([{"type": "PublicIP", "address": "1.2.3.4"}]),
            ),
            "spec.addresses[0].type",
        ),
        (
            "too many addresses",
            &machines,
            with(
                m(),
                "/spec/addresses",
                json!(vec![json!({"type": "Hostname", "address": "h"}); 17]),
            ),
            "spec.addresses",
        ),
        (
            "providerID in a template",
            &templates,
            json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunMachineTemplate", "metadata": {"name": "t"},
            "spec": {"template": {"spec": {"priority": "Urgent", "request": "r", "requester": "a@b.co", "providerID": "x://1"}}}}),
            "spec.template.spec.providerID",
        ),
    ];
    for (what, api, value, field) in &creates {
        let message = error_message(create(api, value.clone()).await);
        assert!(
            message.contains(field),
            "{what}: message does not name {field}: {message}"
        );
    }

    // Updates: immutable and set-once fields.
    let base = with(c(), "/metadata/name", json!("upd"));
    create(&clusters, base).await.expect("create");
    let merge = |patch: Value| Patch::Merge(patch);
    let pp = PatchParams::default();
    let updates: Vec<(&str, Value, &str)> = vec![
        (
            "change priority",
            json!({"spec": {"priority": "BusinessCritical"}}),
            "priority is immutable",
        ),
        (
            "change request",
            json!({"spec": {"request": "more"}}),
            "request is immutable",
        ),
        (
            "change requester",
            json!({"spec": {"requester": "x@example.org"}}),
            "requester is immutable",
        ),
    ];
    for (what, patch, expected) in &updates {
        let message = error_message(clusters.patch("upd", &pp, &merge(patch.clone())).await);
        assert!(message.contains(expected), "{what}: {message}");
    }
    clusters
        .patch(
            "upd",
            &pp,
            &merge(json!({"spec": {"controlPlaneEndpoint": {"host": "h", "port": 6443}}})),
        )
        .await
        .expect("setting the endpoint once is allowed");
    for (what, patch) in [
        (
            "change endpoint",
            json!({"spec": {"controlPlaneEndpoint": {"host": "other", "port": 6443}}}),
        ),
        (
            "unset endpoint",
            json!({"spec": {"controlPlaneEndpoint": null}}),
        ),
    ] {
        let message = error_message(clusters.patch("upd", &pp, &merge(patch)).await);
        assert!(
            message.contains("spec.controlPlaneEndpoint") && message.contains("set-once"),
            "{what}: {message}"
        );
    }

    create(&machines, with(m(), "/metadata/name", json!("upd")))
        .await
        .expect("create");
    machines
        .patch(
            "upd",
            &pp,
            &merge(json!({"spec": {"providerID": "x://1", "failureDomain": "fd"}})),
        )
        .await
        .expect("setting providerID once is allowed");
    for (what, patch, field) in [
        (
            "change providerID",
            json!({"spec": {"providerID": "x://2"}}),
            "spec.providerID",
        ),
        (
            "unset providerID",
            json!({"spec": {"providerID": null}}),
            "spec.providerID",
        ),
        (
            "change failureDomain",
            json!({"spec": {"failureDomain": "other"}}),
            "spec.failureDomain",
        ),
    ] {
        let message = error_message(machines.patch("upd", &pp, &merge(patch)).await);
        assert!(
            message.contains(field) && message.contains("set-once"),
            "{what}: {message}"
        );
    }
    let alpha_machines = api(&ns, "v1alpha1", "MailgunMachine");
    let message = error_message(
        alpha_machines
            .patch("upd", &pp, &merge(json!({"spec": {"providerID": "x://3"}})))
            .await,
    );
    assert!(
        message.contains("spec.providerID"),
        "v1alpha1 set-once: {message}"
    );

    let template = json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunMachineTemplate", "metadata": {"name": "t"},
        "spec": {"template": {"spec": {"priority": "Urgent", "request": "r", "requester": "a@b.co"}}}});
    create(&templates, template).await.expect("template");
    let message = error_message(
        templates
            .patch(
                "t",
                &pp,
                &merge(json!({"spec": {"template": {"spec": {"request": "other"}}}})),
            )
            .await,
    );
    assert!(
        message.contains("spec.template") && message.contains("immutable"),
        "{message}"
    );
}

/// Issue 45: a selector requirement needs values exactly when Kubernetes' does (`NotIn` without
/// values would otherwise read as "every namespace").
#[tokio::test]
async fn identity_selector_requirements_need_values_as_in_kubernetes() {
    let ns = setup("api-selector").await;
    let gvk = GroupVersionKind::gvk(capm_api::GROUP, "v1beta1", "MailgunClusterIdentity");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "mailgunclusteridentities");
    let identities: Api<DynamicObject> = Api::all_with(ns.client.clone(), &resource);
    let identity = |name: String, requirement: Value| {
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunClusterIdentity",
               "metadata": {"name": name},
               "spec": {"smtp": {"url": "smtp://relay.example.com"}, "from": "a@example.com",
                        "recipients": ["ops@example.com"],
                        "allowedNamespaces": {"selector": {"matchExpressions": [requirement]}}}})
    };
    let refused = [
        json!({"key": "team", "operator": "NotIn"}),
        json!({"key": "team", "operator": "NotIn", "values": []}),
        json!({"key": "team", "operator": "In"}),
        json!({"key": "team", "operator": "Exists", "values": ["a"]}),
        json!({"key": "team", "operator": "DoesNotExist", "values": ["a"]}),
    ];
    for (i, requirement) in refused.into_iter().enumerate() {
        let name = format!("{}-refused-{i}", ns.name);
        let message = error_message(create(&identities, identity(name, requirement.clone())).await);
        assert!(
            message.contains("spec.allowedNamespaces.selector.matchExpressions[0].values")
                && message.contains("required (not empty) for In and NotIn"),
            "{requirement}: {message}"
        );
    }
    for (i, requirement) in [
        json!({"key": "team", "operator": "NotIn", "values": ["b"]}),
        json!({"key": "team", "operator": "In", "values": ["a"]}),
        json!({"key": "team", "operator": "Exists"}),
        json!({"key": "team", "operator": "DoesNotExist", "values": []}),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("{}-accepted-{i}", ns.name);
        create(&identities, identity(name.clone(), requirement.clone()))
            .await
            .unwrap_or_else(|e| panic!("{requirement}: {e}"));
        identities
            .delete(&name, &Default::default())
            .await
            .expect("delete");
    }
}

#[tokio::test]
async fn the_api_server_converts_through_the_webhook_losslessly() {
    let ns = setup("api-convert").await;
    let beta = api(&ns, "v1beta1", "MailgunCluster");
    let alpha = api(&ns, "v1alpha1", "MailgunCluster");
    let pp = PatchParams::default();

    // Created as v1beta1 with fields v1alpha1 cannot hold, read as v1alpha1, and back.
    let created = create(
        &beta,
        with(
            cluster("beta", "v1beta1"),
            "/spec/controlPlaneEndpoint",
            json!({"host": "api.example.com", "port": 6443}),
        ),
    )
    .await
    .expect("create v1beta1");
    let status = json!({"status": {
        "initialization": {"provisioned": true},
        "observedGeneration": 1,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Provisioned", "message": "",
                        "lastTransitionTime": "2026-01-02T03:04:05Z", "observedGeneration": 1}],
        "mail": {"messageID": "<id@example.com>", "state": "Sent", "sentAt": "2026-01-02T03:04:05Z"},
    }});
    beta.patch_status("beta", &pp, &Patch::Merge(status))
        .await
        .expect("status");
    let as_alpha: v1alpha1::MailgunCluster = serde_json::from_value(
        serde_json::to_value(alpha.get("beta").await.expect("get as v1alpha1")).expect("json"),
    )
    .expect("v1alpha1 decodes");
    assert_eq!(as_alpha.status.as_ref().map(|s| s.ready), Some(true));
    assert_eq!(
        as_alpha.status.as_ref().and_then(|s| s.response.as_deref()),
        Some("<id@example.com>")
    );
    assert!(
        as_alpha
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(CONVERSION_DATA_ANNOTATION))
    );
    let stored: v1beta1::MailgunCluster = serde_json::from_value(
        serde_json::to_value(beta.get("beta").await.expect("get as v1beta1")).expect("json"),
    )
    .expect("v1beta1 decodes");
    assert!(
        stored
            .metadata
            .annotations
            .as_ref()
            .is_none_or(|a| !a.contains_key(CONVERSION_DATA_ANNOTATION))
    );
    assert_eq!(
        stored.spec.control_plane_endpoint,
        Some(v1beta1::ApiEndpoint {
            host: "api.example.com".into(),
            port: 6443
        })
    );
    let s = stored.status.clone().expect("status");
    assert_eq!(
        s.mail.as_ref().and_then(|m| m.state),
        Some(v1beta1::MailState::Sent)
    );
    assert_eq!(s.conditions.as_ref().map(Vec::len), Some(1));
    assert_eq!(s.observed_generation, Some(1));
    assert_eq!(created.metadata.uid, stored.metadata.uid);

    // An update through v1alpha1 keeps the v1beta1-only spec fields. Status keeps what v1alpha1
    // can say (the annotation never carries status: issue 14); the controller rebuilds the rest.
    alpha
        .patch(
            "beta",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .expect("label through v1alpha1");
    let after: v1beta1::MailgunCluster = serde_json::from_value(
        serde_json::to_value(beta.get("beta").await.expect("get")).expect("json"),
    )
    .expect("decodes");
    assert_eq!(after.spec, stored.spec);
    let s = after.status.clone().expect("status");
    assert_eq!(s.initialization.and_then(|i| i.provisioned), Some(true));
    assert_eq!(
        s.mail.as_ref().and_then(|m| m.message_id.as_deref()),
        Some("<id@example.com>")
    );
    assert_eq!(s.conditions, None);
    assert_eq!(
        after
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("touched"))
            .map(String::as_str),
        Some("yes")
    );

    // Created as v1alpha1, read as v1beta1, and back: every field kept.
    create(&alpha, cluster("alpha", "v1alpha1"))
        .await
        .expect("create v1alpha1");
    alpha
        .patch_status(
            "alpha",
            &pp,
            &Patch::Merge(json!({"status": {"ready": true, "response": "<a@b>"}})),
        )
        .await
        .expect("v1alpha1 status");
    let up: v1beta1::MailgunCluster = serde_json::from_value(
        serde_json::to_value(beta.get("alpha").await.expect("get")).expect("json"),
    )
    .expect("decodes");
    assert_eq!(up.spec.requester, "ops@example.com");
    assert_eq!(up.spec.request, "One cluster please.\nThanks.");
    let s = up.status.expect("status");
    assert_eq!(s.initialization.and_then(|i| i.provisioned), Some(true));
    assert_eq!(s.mail.and_then(|m| m.message_id).as_deref(), Some("<a@b>"));
    let down: v1alpha1::MailgunCluster = serde_json::from_value(
        serde_json::to_value(alpha.get("alpha").await.expect("get")).expect("json"),
    )
    .expect("decodes");
    assert_eq!(down.spec.priority, v1alpha1::Priority::Urgent);
    assert_eq!(
        down.status,
        Some(v1alpha1::MailgunClusterStatus {
            response: Some("<a@b>".into()),
            ready: true
        })
    );

    // Machines: v1beta1-only spec fields survive a v1alpha1 read.
    let mbeta = api(&ns, "v1beta1", "MailgunMachine");
    let malpha = api(&ns, "v1alpha1", "MailgunMachine");
    create(
        &mbeta,
        with(
            with(
                machine("m", "v1beta1"),
                "/spec/failureDomain",
                json!("rack-1"),
            ),
            "/spec/addresses",
            json!([{"type": "InternalIP", "address": "10.0.0.1"}]),
        ),
    )
    .await
    .expect("machine");
    let m_alpha = malpha.get("m").await.expect("get as v1alpha1");
    assert!(m_alpha.data["spec"].get("failureDomain").is_none());
    let m_beta = mbeta.get("m").await.expect("get as v1beta1");
    assert_eq!(m_beta.data["spec"]["failureDomain"], "rack-1");
    assert_eq!(m_beta.data["spec"]["addresses"][0]["type"], "InternalIP");
}

fn refused(result: Result<DynamicObject, kube::Error>) -> String {
    match result {
        Ok(obj) => panic!("accepted: {:?}", obj.metadata),
        Err(kube::Error::Api(e)) => {
            assert!((400..500).contains(&e.code), "{e:?}");
            e.message
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

/// Issue 14 item 1: what arrives through v1alpha1 (the conversion-data annotation) obeys every
/// v1beta1 rule, set-once included; the annotation never carries status.
#[tokio::test]
async fn tampered_conversion_data_is_refused_and_never_carries_status() {
    let ns = setup("api-tamper").await;
    let beta = api(&ns, "v1beta1", "MailgunCluster");
    let alpha = api(&ns, "v1alpha1", "MailgunCluster");
    let alpha_machines = api(&ns, "v1alpha1", "MailgunMachine");
    let beta_machines = api(&ns, "v1beta1", "MailgunMachine");
    let pp = PatchParams::default();
    let data = |value: Value| {
        Patch::Merge(json!({"metadata": {"annotations": {CONVERSION_DATA_ANNOTATION: value}}}))
    };
    create(
        &beta,
        with(
            cluster("set", "v1beta1"),
            "/spec/controlPlaneEndpoint",
            json!({"host": "api.example.com", "port": 6443}),
        ),
    )
    .await
    .expect("create");
    create(&beta, cluster("unset", "v1beta1"))
        .await
        .expect("create");

    // Changing and removing a set-once field through the annotation.
    for (what, value) in [
        (
            "changed",
            json!(r#"{"controlPlaneEndpoint":{"host":"api.evil.example","port":1}}"#),
        ),
        ("removed", json!("{}")),
        ("unreadable", json!("not json")),
        ("deleted annotation", Value::Null),
    ] {
        let message = refused(alpha.patch("set", &pp, &data(value)).await);
        assert!(
            message.contains("spec.controlPlaneEndpoint"),
            "{what}: {message}"
        );
    }
    // A value the v1beta1 schema forbids, on an object that has none yet.
    let evil =
        json!(r#"{"controlPlaneEndpoint":{"host":"bad host\r\nBcc: x@evil.example","port":0}}"#);
    let message = refused(alpha.patch("unset", &pp, &data(evil.clone())).await);
    assert!(
        message.contains("spec.controlPlaneEndpoint.host"),
        "{message}"
    );
    assert!(
        message.contains("spec.controlPlaneEndpoint.port"),
        "{message}"
    );
    // The same through a v1alpha1 create.
    let mut obj = cluster("created", "v1alpha1");
    obj["metadata"]["annotations"] = json!({CONVERSION_DATA_ANNOTATION: evil});
    let message = refused(create(&alpha, obj).await);
    assert!(
        message.contains("spec.controlPlaneEndpoint.host"),
        "{message}"
    );
    // A machine's failure domain.
    create(
        &beta_machines,
        with(
            machine("m", "v1beta1"),
            "/spec/failureDomain",
            json!("rack-1"),
        ),
    )
    .await
    .expect("machine");
    let message = refused(
        alpha_machines
            .patch("m", &pp, &data(json!(r#"{"failureDomain":"rack-2"}"#)))
            .await,
    );
    assert!(message.contains("spec.failureDomain"), "{message}");

    // Status in the annotation is ignored, on the main resource and on /status.
    let hacked = json!(
        r#"{"status":{"conditions":[{"type":"Hacked","status":"True","reason":"not a reason!","message":"","lastTransitionTime":"2026-01-02T03:04:05Z"}],"mail":{"state":"Sent"}}}"#
    );
    alpha
        .patch("unset", &pp, &data(hacked.clone()))
        .await
        .expect("label-free patch");
    alpha
        .patch_status(
            "unset",
            &pp,
            &Patch::Merge(
                json!({"metadata": {"annotations": {CONVERSION_DATA_ANNOTATION: hacked}},
                                 "status": {"ready": false}}),
            ),
        )
        .await
        .expect("status through v1alpha1");
    let stored = beta.get("unset").await.expect("get");
    let status = stored.data.get("status").cloned().unwrap_or(Value::Null);
    assert!(status.get("conditions").is_none(), "{status}");
    assert!(status.pointer("/mail/state").is_none(), "{status}");
    assert!(
        stored
            .metadata
            .annotations
            .as_ref()
            .is_none_or(|a| !a.contains_key(CONVERSION_DATA_ANNOTATION)),
        "{:?}",
        stored.metadata.annotations
    );

    // Untouched, the annotation round-trips: v1alpha1 writes keep working.
    alpha
        .patch(
            "set",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"ok": "yes"}}})),
        )
        .await
        .expect("label through v1alpha1");
    let stored = beta.get("set").await.expect("get");
    assert_eq!(
        stored.data["spec"]["controlPlaneEndpoint"]["host"],
        "api.example.com"
    );
}

/// Issue 14 (defence for item 5): only the provider's identity may add, change or remove our
/// annotations; privileged users (clusterctl move) may create objects carrying them.
#[tokio::test]
async fn only_the_provider_writes_our_annotations() {
    let ns = setup("api-annotations").await;
    grant_developer(&ns, "mallory").await;
    grant_developer(&ns, PROVIDER).await;
    let mallory = client_as(&ns, "mallory", &["team-a"]).await;
    let provider = client_as(&ns, PROVIDER, &["system:serviceaccounts"]).await;
    let kinds = |client: &kube::Client, version: &str, kind: &str| {
        let gvk = GroupVersionKind::gvk(capm_api::GROUP, version, kind);
        let plural = format!("{}s", kind.to_lowercase());
        Api::<DynamicObject>::namespaced_with(
            client.clone(),
            &ns.name,
            &ApiResource::from_gvk_with_plural(&gvk, &plural),
        )
    };
    let as_mallory = kinds(&mallory, "v1beta1", "MailgunCluster");
    let as_mallory_alpha = kinds(&mallory, "v1alpha1", "MailgunCluster");
    let as_mallory_machines = kinds(&mallory, "v1beta1", "MailgunMachine");
    let as_provider = kinds(&provider, "v1beta1", "MailgunCluster");
    let as_admin = api(&ns, "v1beta1", "MailgunCluster");
    let pp = PatchParams::default();
    let sent = capm_api::names::MAIL_SENT_ANNOTATION;
    let intent = capm_api::names::MAIL_INTENT_ANNOTATION;
    let annotate =
        |key: &str, value: Value| Patch::Merge(json!({"metadata": {"annotations": {key: value}}}));

    // A forged record at creation (the policy takes a moment to become active).
    let mut forged = cluster("forged", "v1beta1");
    forged["metadata"]["annotations"] = json!({sent: "<forged@evil.example>"});
    let mut message = None;
    for _ in 0..100 {
        match create(&as_mallory, forged.clone()).await {
            Ok(_) => {
                as_admin
                    .delete("forged", &Default::default())
                    .await
                    .expect("delete");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => {
                message = Some(refused(other));
                break;
            }
        }
    }
    let message = message.expect("the policy never became active");
    assert!(
        message.contains("metadata.annotations") && message.contains(sent),
        "{message}"
    );
    let mut machine_forged = machine("mforged", "v1beta1");
    machine_forged["metadata"]["annotations"] =
        json!({capm_api::names::DELETION_MAIL_SENT_ANNOTATION: "x"});
    refused(create(&as_mallory_machines, machine_forged).await);
    // Issue 56: a hand-made MailgunRemediation carrying a repair mail's record (a link's
    // check reads it).
    let mut remediation_forged = remediation("rforged");
    remediation_forged["metadata"]["annotations"] = json!({capm_api::names::MAIL_ANNOTATION: "{}"});
    let message = refused(
        create(
            &kinds(&mallory, "v1beta1", "MailgunRemediation"),
            remediation_forged,
        )
        .await,
    );
    assert!(
        message.contains(capm_api::names::MAIL_ANNOTATION),
        "{message}"
    );
    // And each reminder's record: not at creation, and neither added, changed nor removed
    // later by anyone but the provider.
    let as_mallory_remediations = kinds(&mallory, "v1beta1", "MailgunRemediation");
    let as_provider_remediations = kinds(&provider, "v1beta1", "MailgunRemediation");
    for reminder in capm_api::names::REMINDER_MAIL_ANNOTATIONS {
        let mut forged = remediation("rreminder");
        forged["metadata"]["annotations"] = json!({reminder: "{}"});
        let message = refused(create(&as_mallory_remediations, forged).await);
        assert!(message.contains(reminder), "{message}");
    }
    create(&as_mallory_remediations, remediation("r"))
        .await
        .expect("a clean remediation");
    let [first, second, _] = capm_api::names::REMINDER_MAIL_ANNOTATIONS;
    let message = refused(
        as_mallory_remediations
            .patch("r", &pp, &annotate(second, json!("{}")))
            .await,
    );
    assert!(message.contains(second), "{message}");
    as_provider_remediations
        .patch("r", &pp, &annotate(first, json!("{}")))
        .await
        .expect("the provider writes a reminder's record");
    for (what, value) in [
        ("changed", json!("{\"forged\":1}")),
        ("removed", Value::Null),
    ] {
        let message = refused(
            as_mallory_remediations
                .patch("r", &pp, &annotate(first, value))
                .await,
        );
        assert!(message.contains(first), "{what}: {message}");
    }

    // Added, changed and removed after creation.
    create(&as_mallory, cluster("c", "v1beta1"))
        .await
        .expect("clean create");
    let message = refused(
        as_mallory
            .patch("c", &pp, &annotate(intent, json!("x")))
            .await,
    );
    assert!(message.contains(intent), "{message}");
    refused(
        as_mallory
            .patch("c", &pp, &annotate(CONVERSION_DATA_ANNOTATION, json!("{}")))
            .await,
    );
    refused(
        as_mallory_alpha
            .patch("c", &pp, &annotate(sent, json!("x")))
            .await,
    );
    as_provider
        .patch(
            "c",
            &pp,
            &annotate(intent, json!("<mailguncluster.u@mg.example.com>")),
        )
        .await
        .expect("the provider writes its record");
    refused(
        as_mallory
            .patch("c", &pp, &annotate(intent, json!("other")))
            .await,
    );
    refused(
        as_mallory
            .patch("c", &pp, &annotate(intent, Value::Null))
            .await,
    );
    // Everything else stays the user's.
    as_mallory
        .patch("c", &pp, &annotate("example.com/note", json!("mine")))
        .await
        .expect("other annotations are the user's");
    as_mallory_alpha
        .patch(
            "c",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}}})),
        )
        .await
        .expect("labels through v1alpha1");
    as_provider
        .patch("c", &pp, &annotate(intent, Value::Null))
        .await
        .expect("the provider removes its record");

    // clusterctl move: a privileged user creates objects with our records, and only creates.
    let mut moved = cluster("moved", "v1beta1");
    moved["metadata"]["annotations"] = json!({sent: "<mailguncluster.u@mg.example.com>"});
    create(&as_admin, moved)
        .await
        .expect("system:masters may create with our records");
    refused(
        as_admin
            .patch("moved", &pp, &annotate(sent, json!("changed")))
            .await,
    );
}

fn remediation(name: &str) -> Value {
    json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunRemediation",
        "metadata": {"name": name},
        "spec": {"request": "Power-cycle it."},
    })
}

fn remediation_template(name: &str, template: Value) -> Value {
    json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunRemediationTemplate",
        "metadata": {"name": name},
        "spec": {"template": template},
    })
}

/// A merge patch of `spec` on the MailgunRemediation `name`: the API server's message, or `None`
/// when it was accepted.
async fn patch_spec(api: &Api<DynamicObject>, name: &str, spec: Value) -> Option<String> {
    match api
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await
    {
        Ok(_) => None,
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422, "{e:?}");
            Some(e.message)
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

#[tokio::test]
async fn remediations_take_their_defaults_and_keep_their_answer_and_strategy() {
    let ns = setup("api-remediation").await;
    let remediations = api(&ns, "v1beta1", "MailgunRemediation");
    let created = create(&remediations, remediation("worker-0"))
        .await
        .expect("a remediation with only its request");
    // The API server fills in what the template (or a hand) left out.
    let spec = &created.data["spec"];
    assert_eq!(spec["priority"], "Urgent", "{spec}");
    assert_eq!(
        spec["strategy"],
        json!({"answerTimeout": "24h", "reminders": 1, "repairTimeout": "1h", "unfulfilled": "Wait"}),
    );
    assert!(spec.get("answer").is_none(), "{spec}");
    let decoded: v1beta1::MailgunRemediation =
        serde_json::from_value(serde_json::to_value(&created).expect("JSON")).expect("typed");
    assert_eq!(
        decoded.spec.strategy,
        v1beta1::RemediationStrategy::default()
    );

    // The strategy is immutable.
    let refused = patch_spec(
        &remediations,
        "worker-0",
        json!({"strategy": {"reminders": 3}}),
    )
    .await
    .expect("a changed strategy is refused");
    assert!(refused.contains("strategy is immutable"), "{refused}");
    // The answer: set once, then neither changed nor removed.
    assert_eq!(
        patch_spec(
            &remediations,
            "worker-0",
            json!({"answer": {"result": "Repaired", "message": "Reseated the cable."}})
        )
        .await,
        None
    );
    for (what, answer) in [
        ("changed", json!({"result": "CannotRepair"})),
        ("removed", Value::Null),
    ] {
        let refused = patch_spec(&remediations, "worker-0", json!({"answer": answer}))
            .await
            .unwrap_or_else(|| panic!("an answer {what} was accepted"));
        assert!(refused.contains("answer is set-once"), "{what}: {refused}");
        assert!(refused.contains("spec.answer"), "{what}: {refused}");
    }

    // Bounds, each refused naming its field.
    let r = || remediation("bad");
    for (what, value, field) in [
        (
            "five reminders",
            with(r(), "/spec/strategy", json!({"reminders": 5})),
            "spec.strategy.reminders",
        ),
        (
            "an answer timeout under a minute",
            with(r(), "/spec/strategy", json!({"answerTimeout": "30s"})),
            "spec.strategy.answerTimeout",
        ),
        (
            "a repair timeout in days",
            with(r(), "/spec/strategy", json!({"repairTimeout": "2d"})),
            "spec.strategy.repairTimeout",
        ),
        (
            "an unknown answer",
            with(r(), "/spec/answer", json!({"result": "Replaced"})),
            "spec.answer.result",
        ),
        (
            "an unknown strategy for unbuilt machines",
            with(r(), "/spec/strategy", json!({"unfulfilled": "Replace"})),
            "spec.strategy.unfulfilled",
        ),
        (
            "a request with an escape character",
            with(r(), "/spec/request", json!("Reboot \u{1b}[2J it")),
            "spec.request",
        ),
        (
            "no request",
            json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunRemediation",
                   "metadata": {"name": "bad"}, "spec": {}}),
            "spec.request",
        ),
    ] {
        let message = error_message(create(&remediations, value).await);
        assert!(message.contains(field), "{what}: {message}");
    }

    // Templates: neither an answer nor the provider's record annotations.
    let templates = api(&ns, "v1beta1", "MailgunRemediationTemplate");
    let spec = json!({"request": "Power-cycle it.", "strategy": {"answerTimeout": "4h"}});
    create(
        &templates,
        remediation_template(
            "fine",
            json!({"metadata": {"annotations": {"team.example.com/pager": "workers"}}, "spec": spec}),
        ),
    )
    .await
    .expect("a template with its own annotation");
    // Immutable as the other templates (the chart's template-immutable policy; the policy
    // takes a moment to become active).
    let changed = json!({"template": {"spec": {"request": "Reboot it."}}});
    let mut message = None;
    for _ in 0..100 {
        message = patch_spec(&templates, "fine", changed.clone()).await;
        if message.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let message = message.expect("a changed template was accepted");
    assert!(message.contains("a template is immutable"), "{message}");
    for (what, template, field, says) in [
        (
            "an answer",
            json!({"spec": {"request": "x", "answer": {"result": "Repaired"}}}),
            "spec.template.spec.answer",
            "every remediation gets its own",
        ),
        (
            "a record annotation",
            json!({"metadata": {"annotations": {"mailgun.infrastructure.cluster.x-k8s.io/mail": "{}"}}, "spec": spec}),
            "spec.template.metadata.annotations",
            "they are its records",
        ),
    ] {
        let message =
            error_message(create(&templates, remediation_template("bad", template)).await);
        assert!(
            message.contains(field) && message.contains(says),
            "{what}: {message}"
        );
    }
}

fn machines(ns: &TestNamespace) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "Machine");
    Api::namespaced_with(
        ns.client.clone(),
        &ns.name,
        &ApiResource::from_gvk_with_plural(&gvk, "machines"),
    )
}

/// A Machine `name` with the conditions other controllers wrote (v1beta2 and deprecated v1beta1).
async fn unhealthy_machine(api: &Api<DynamicObject>, name: &str) -> Value {
    create(
        api,
        json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": name},
            "spec": {"clusterName": "c", "bootstrap": {"dataSecretName": "b"},
                     "infrastructureRef": {"apiGroup": capm_api::GROUP, "kind": "MailgunMachine", "name": name}},
        }),
    )
    .await
    .expect("a Machine");
    let status = json!({"status": {
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "NotReady", "message": "* NodeHealthy: not ready", "lastTransitionTime": "2026-11-28T10:00:00Z"},
            {"type": "HealthCheckSucceeded", "status": "False", "reason": "UnhealthyNode", "message": "Condition Ready on Node is reporting status Unknown for more than 5m0s", "lastTransitionTime": "2026-11-28T10:05:00Z"},
            {"type": "ExternallyRemediated", "status": "False", "reason": "WaitingForRemediation", "message": "", "lastTransitionTime": "2026-11-28T10:05:01Z"},
        ],
        "deprecated": {"v1beta1": {"conditions": [
            {"type": "Ready", "status": "False", "severity": "Warning", "reason": "NodeNotReady", "lastTransitionTime": "2026-11-28T10:00:00Z"},
        ]}},
    }});
    serde_json::to_value(
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(status))
            .await
            .expect("status"),
    )
    .expect("JSON")
}

async fn apply_hand_back(
    api: &Api<DynamicObject>,
    name: &str,
    patch: Value,
) -> Result<DynamicObject, kube::Error> {
    let patch: json_patch::Patch = serde_json::from_value(patch).expect("a JSON Patch");
    api.patch_status(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
}

#[tokio::test]
async fn a_hand_back_sets_one_condition_and_leaves_every_other_as_it_was() {
    use capm_api::owner_remediated::{OWNER_REMEDIATED, condition_is, hand_back_patch};
    let ns = setup("api-hand-back").await;
    ns.control_plane()
        .install_capi_crds()
        .await
        .expect("Cluster API CRDs");
    let api = machines(&ns);
    let before = unhealthy_machine(&api, "m-0").await;
    let patch = hand_back_patch(
        &before,
        "Handed back by MailgunRemediation m-0: CannotRepair",
        "2026-11-28T11:00:00Z",
    )
    .expect("read from the API server")
    .expect("not handed back yet");
    let after = serde_json::to_value(
        apply_hand_back(&api, "m-0", patch.clone())
            .await
            .expect("the hand-back"),
    )
    .expect("JSON");
    let conditions = after["status"]["conditions"]
        .as_array()
        .expect("conditions");
    assert_eq!(
        &conditions[..3],
        before["status"]["conditions"]
            .as_array()
            .expect("before")
            .as_slice(),
        "another controller's condition changed"
    );
    assert_eq!(conditions.len(), 4);
    assert!(condition_is(&after, OWNER_REMEDIATED, "False"), "{after}");
    let old = after["status"]["deprecated"]["v1beta1"]["conditions"]
        .as_array()
        .expect("v1beta1 conditions");
    assert_eq!(
        old[0],
        before["status"]["deprecated"]["v1beta1"]["conditions"][0]
    );
    assert_eq!(old[1]["type"], OWNER_REMEDIATED);
    // Handed back already: nothing more to write.
    assert_eq!(
        hand_back_patch(&after, "again", "2026-11-28T12:00:00Z"),
        Ok(None)
    );

    // A patch built from a version someone has since written over is refused whole.
    let before = unhealthy_machine(&api, "m-1").await;
    let stale = hand_back_patch(&before, "stale", "2026-11-28T11:00:00Z")
        .expect("read")
        .expect("a patch");
    api.patch_status(
        "m-1",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "Ready", "message": "", "lastTransitionTime": "2026-11-28T10:30:00Z"}]}})),
    )
    .await
    .expect("another controller's write");
    let err = apply_hand_back(&api, "m-1", stale.clone())
        .await
        .expect_err("a stale hand-back");
    assert!(
        matches!(&err, kube::Error::Api(e) if e.code == 422 || e.code == 409),
        "{err}"
    );
    let now = serde_json::to_value(api.get("m-1").await.expect("m-1")).expect("JSON");
    assert!(!condition_is(&now, OWNER_REMEDIATED, "False"), "{now}");

    // A namesake made since (the Machine replaced): refused by its UID.
    api.delete("m-1", &Default::default())
        .await
        .expect("delete");
    for _ in 0..40 {
        if api.get_opt("m-1").await.expect("get").is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let namesake = unhealthy_machine(&api, "m-1").await;
    let mut by_name = stale;
    by_name[1]["value"] = namesake["metadata"]["resourceVersion"].clone();
    let err = apply_hand_back(&api, "m-1", by_name)
        .await
        .expect_err("a hand-back of the Machine's namesake");
    assert!(
        matches!(&err, kube::Error::Api(e) if e.code == 422 || e.code == 409),
        "{err}"
    );
}
