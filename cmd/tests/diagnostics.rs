//! The diagnostics endpoint against the real local API server: HTTPS, tokens reviewed by the
//! API server (TokenReview), access decided by RBAC (SubjectAccessReview for `get` on the
//! non-resource URL `/metrics`).

use std::{
    net::Ipv4Addr,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use capm_test_support::{
    TestNamespace,
    pki::CertificateAuthority,
    process::{free_port, tail},
    provider::{Launch, Provider},
};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::{
    authentication::v1::{TokenRequest, TokenRequestSpec},
    core::v1::ServiceAccount,
    rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject},
};
use kube::{
    Api,
    api::{DeleteParams, ObjectMeta, PostParams},
};
use tokio::net::TcpStream;
use tokio_rustls::{
    TlsConnector,
    rustls::{
        ClientConfig, RootCertStore,
        crypto::ring,
        pki_types::{CertificateDer, ServerName, pem::PemObject},
    },
};

/// The provider binary: `$CAPM_PROVIDER_BIN` when set (a copy that a concurrent build in a shared
/// target directory cannot replace mid-run, as the end-to-end tests read it), else this build's.
fn bin() -> std::ffi::OsString {
    std::env::var_os("CAPM_PROVIDER_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_cluster-api-provider-mailgun").into())
}

fn tls_client(ca_pem: &str) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA");
    }
    let config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// `GET /metrics` over TLS with an optional bearer token: (status, body).
async fn get_metrics(
    connector: &TlsConnector,
    port: u16,
    token: Option<&str>,
) -> Result<(u16, String), Box<dyn std::error::Error + Send + Sync>> {
    let tcp = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
    let name = ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
    let tls = connector.connect(name, tcp).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    let mut req = http::Request::get("/metrics").header("host", format!("127.0.0.1:{port}"));
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let response = sender
        .send_request(req.body(Full::new(Bytes::new()))?)
        .await?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

async fn token(ns: &TestNamespace, account: &str) -> String {
    let accounts = ns.api::<ServiceAccount>();
    accounts
        .create(
            &PostParams::default(),
            &ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(account.to_owned()),
                    ..ObjectMeta::default()
                },
                ..ServiceAccount::default()
            },
        )
        .await
        .expect("service account");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .expect("token request")
        .status
        .expect("token status")
        .token
        .expect("token")
}

/// A ClusterRole granting `get` on `/metrics` to `account`; cluster-scoped, so removed by hand.
async fn grant_metrics(ns: &TestNamespace, account: &str) -> String {
    grant_metrics_named(ns, account, "metrics-reader").await
}

async fn grant_metrics_named(ns: &TestNamespace, account: &str, suffix: &str) -> String {
    let name = format!("{}-{suffix}", ns.name);
    let roles: Api<ClusterRole> = Api::all(ns.client.clone());
    roles
        .create(
            &PostParams::default(),
            &ClusterRole {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    ..ObjectMeta::default()
                },
                rules: Some(vec![PolicyRule {
                    non_resource_urls: Some(vec!["/metrics".into()]),
                    verbs: vec!["get".into()],
                    ..PolicyRule::default()
                }]),
                ..ClusterRole::default()
            },
        )
        .await
        .expect("cluster role");
    let bindings: Api<ClusterRoleBinding> = Api::all(ns.client.clone());
    bindings
        .create(
            &PostParams::default(),
            &ClusterRoleBinding {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    ..ObjectMeta::default()
                },
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: name.clone(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".into(),
                    name: account.into(),
                    namespace: Some(ns.name.clone()),
                    ..Subject::default()
                }]),
            },
        )
        .await
        .expect("cluster role binding");
    name
}

async fn revoke(ns: &TestNamespace, name: &str) {
    let _ = Api::<ClusterRoleBinding>::all(ns.client.clone())
        .delete(name, &DeleteParams::default())
        .await;
    let _ = Api::<ClusterRole>::all(ns.client.clone())
        .delete(name, &DeleteParams::default())
        .await;
}

fn start(ns: &TestNamespace, dir: &Path, port: u16, certs: Option<&Path>) -> Provider {
    Launch::new(bin(), ns.control_plane().kubeconfig())
        .env("MAILGUN_DOMAIN", "mg.example.com")
        .env("MAILGUN_API_KEY", "key-diagnostics-test")
        .env("MAIL_RECIPIENT", "ops@example.com")
        .env("RUST_LOG", "info,cluster_api_provider_mailgun=debug")
        .args([
            "--mailgun-base-url",
            "http://127.0.0.1:9",
            "--namespace",
            &ns.name,
            "--leader-elect=false",
            "--webhook-port=0",
            "--health-probe-bind-address=0",
            "--diagnostics-address",
            &format!("127.0.0.1:{port}"),
        ])
        .args(certs.map(|dir| format!("--diagnostics-cert-dir={}", dir.display())))
        .spawn(&dir.join("manager.log"))
        .expect("start the manager")
}

#[tokio::test]
async fn metrics_need_a_token_the_api_server_accepts_and_rbac_allows() {
    let ns =
        TestNamespace::create_with_crds("capm-cmd-diag", &capm_api::crd::crds().expect("crds"))
            .await
            .expect("namespace with CRDs");
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("mkdir");
    let ca = CertificateAuthority::new("capm diagnostics test CA").expect("CA");
    let pair = ca.serving_cert("diagnostics", &[], &[]).expect("cert");
    std::fs::write(certs.join("tls.crt"), &pair.cert_pem).expect("write");
    std::fs::write(certs.join("tls.key"), &pair.key_pem).expect("write");

    let allowed = token(&ns, "prometheus").await;
    let denied = token(&ns, "nosy").await;
    let role = grant_metrics(&ns, "prometheus").await;

    let port = free_port().expect("port");
    let _manager = start(&ns, dir.path(), port, Some(&certs));
    let connector = tls_client(ca.cert_pem());
    let start = Instant::now();
    let (status, body) = loop {
        match get_metrics(&connector, port, Some(&allowed)).await {
            Ok(answer) => break answer,
            Err(e) => {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "diagnostics never answered: {e}\n{}",
                    tail(&dir.path().join("manager.log"), 40)
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("process_cpu_seconds_total"), "{body}");

    let (status, body) = get_metrics(&connector, port, Some(&denied))
        .await
        .expect("GET");
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(&format!("system:serviceaccount:{}:nosy", ns.name)),
        "{body}"
    );
    assert!(!body.contains("process_cpu_seconds_total"), "{body}");

    let (status, body) = get_metrics(&connector, port, None).await.expect("GET");
    assert_eq!(status, 401, "{body}");
    let (status, _) = get_metrics(&connector, port, Some("not-a-token"))
        .await
        .expect("GET");
    assert_eq!(status, 401);

    // Refusals are cached briefly: granting the permission is seen after REFUSED_TTL (10 s),
    // not on the very next scrape, and no later than that plus a little.
    let late = grant_metrics_named(&ns, "nosy", "late").await;
    let (status, _) = get_metrics(&connector, port, Some(&denied))
        .await
        .expect("GET");
    assert_eq!(status, 403, "the refusal was not cached");
    let granted_at = Instant::now();
    loop {
        let (status, body) = get_metrics(&connector, port, Some(&denied))
            .await
            .expect("GET");
        if status == 200 {
            break;
        }
        assert_eq!(status, 403, "{body}");
        assert!(
            granted_at.elapsed() < Duration::from_secs(20),
            "a refusal outlived its cache time"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    revoke(&ns, &late).await;
    revoke(&ns, &role).await;
    let log = std::fs::read_to_string(dir.path().join("manager.log")).unwrap_or_default();
    assert!(
        !log.contains(&allowed) && !log.contains(&denied),
        "a token reached the log"
    );
}

#[tokio::test]
async fn without_a_certificate_directory_it_serves_a_self_signed_certificate() {
    let ns =
        TestNamespace::create_with_crds("capm-cmd-diag", &capm_api::crd::crds().expect("crds"))
            .await
            .expect("namespace with CRDs");
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port().expect("port");
    let _manager = start(&ns, dir.path(), port, None);
    // The self-signed certificate is made at start: nothing can verify it.
    let connector = capm_mail_servers::insecure_tls_connector().expect("TLS client");
    let start = Instant::now();
    let (status, _) = loop {
        match get_metrics(&connector, port, None).await {
            Ok(answer) => break answer,
            Err(e) => {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "diagnostics never answered: {e}\n{}",
                    tail(&dir.path().join("manager.log"), 40)
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(status, 401, "HTTPS without a token");
    // And the certificate is not one a client could trust without pinning it.
    let strict = tls_client(
        CertificateAuthority::new("unrelated CA")
            .expect("CA")
            .cert_pem(),
    );
    assert!(get_metrics(&strict, port, None).await.is_err());
}
