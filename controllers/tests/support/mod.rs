//! A namespace on the real control plane, our CRDs and the Cluster API CRDs installed, a Mailgun
//! contract server, and the controllers running in-process on that namespace.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use capm_api::v1beta1::{MailgunCluster, MailgunMachine};
use capm_controllers::{Config, Metrics};
use capm_mail_servers::MailgunServer;
use capm_mailer::{MailerConfig, MailgunConfig, SecretSource};
use capm_test_support::TestNamespace;
use kube::{
    Api,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use tokio::sync::oneshot;

pub const DOMAIN: &str = "mg.example.com";
pub const API_KEY: &str = "key-contract-test";
pub const RECIPIENT: &str = "ops@example.com";

/// The stop signal and the task of running controllers.
type Running = (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), capm_controllers::Error>>,
);

pub struct Env {
    pub ns: TestNamespace,
    pub mailgun: MailgunServer,
    pub registry: prometheus::Registry,
    /// The controllers' leadership at their next start (unelected: they always act).
    pub leadership: capm_controllers::Leadership,
    key_file: tempfile::NamedTempFile,
    running: Option<Running>,
}

impl Env {
    pub async fn new(prefix: &str) -> Self {
        Self::with_crds(prefix, capm_api::crd::crds().unwrap()).await
    }

    /// [`Env::new`] with these CRDs installed (ours and more: the remediation kinds).
    pub async fn with_crds(
        prefix: &str,
        crds: Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>,
    ) -> Self {
        let ns = TestNamespace::create_with_crds(prefix, &crds)
            .await
            .unwrap();
        let mailgun = MailgunServer::start(API_KEY, DOMAIN).unwrap();
        let key_file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(key_file.path(), API_KEY).unwrap();
        Self {
            ns,
            mailgun,
            registry: prometheus::Registry::new(),
            leadership: capm_controllers::Leadership::unelected("test"),
            key_file,
            running: None,
        }
    }

    pub fn config(&self) -> Config {
        Config {
            recipients: vec![RECIPIENT.into()],
            mail_from: format!("capm@{DOMAIN}"),
            message_id_domain: DOMAIN.into(),
            fulfilment: None,
            namespace: Some(self.ns.name.clone()),
            watch_filter: None,
            concurrency: 10,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            lookup_grace: Duration::from_secs(1),
            delivery_poll_base: Duration::from_secs(30),
            delivery_poll_max: Duration::from_secs(30 * 60),
            delivery_retention: Duration::from_secs(72 * 3600),
            sync_period: Duration::from_secs(10 * 3600),
            identity_secret_namespace: None,
            tenancy: capm_controllers::Tenancy {
                default_allowed: capm_api::v1beta1::AllowedNamespaces::default(),
                require_identity_ref: false,
                hosts: capm_mailer::AllowedHosts {
                    mailgun: capm_mailer::AllowedHosts::default_mailgun(),
                    smtp: Vec::new(),
                },
                release_timeout: capm_controllers::DEFAULT_RELEASE_TIMEOUT,
            },
        }
    }

    pub fn mailer(&self) -> Arc<dyn capm_mailer::Mailer> {
        self.mailer_on(capm_mailer::MailgunEventsApi::Logs)
    }

    /// A Mailgun mailer asking `api` about lookups and deliveries.
    pub fn mailer_on(&self, api: capm_mailer::MailgunEventsApi) -> Arc<dyn capm_mailer::Mailer> {
        let mut cfg =
            MailgunConfig::new(DOMAIN, SecretSource::File(self.key_file.path().to_owned()));
        cfg.events_api = api;
        cfg.base_url = Some(self.mailgun.base_url());
        cfg.request_timeout_seconds = 2.0;
        capm_mailer::build(&MailerConfig::Mailgun(cfg)).unwrap()
    }

    /// Starts the controllers (again, after [`Env::stop`]) with fresh metrics.
    pub async fn start(&mut self) {
        self.start_with(self.config()).await;
    }

    pub async fn start_with(&mut self, config: Config) {
        let mailer = self.mailer();
        self.start_with_mailer(config, mailer).await;
    }

    /// Starts the controllers with a mailer of the test's choosing (for example one that plays
    /// a race around the real one).
    pub async fn start_with_mailer(
        &mut self,
        config: Config,
        mailer: Arc<dyn capm_mailer::Mailer>,
    ) {
        assert!(self.running.is_none(), "already running");
        self.registry = prometheus::Registry::new();
        let metrics = Metrics::register(&self.registry).unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(capm_controllers::run(
            self.ns.client.clone(),
            mailer,
            capm_controllers::Events::new(self.ns.client.clone(), "t", "t"),
            config,
            self.leadership.clone(),
            metrics,
            async move {
                let _ = rx.await;
            },
        ));
        self.running = Some((tx, handle));
    }

    /// Stops the controllers and waits until they returned.
    pub async fn stop(&mut self) {
        let (tx, handle) = self.running.take().expect("running");
        let _ = tx.send(());
        tokio::time::timeout(Duration::from_secs(30), handle)
            .await
            .expect("controllers stop within 30 s")
            .unwrap()
            .unwrap();
    }

    pub fn clusters(&self) -> Api<MailgunCluster> {
        self.ns.api()
    }

    pub fn machines(&self) -> Api<MailgunMachine> {
        self.ns.api()
    }

    pub fn capi(&self, kind: &str) -> Api<DynamicObject> {
        let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", kind));
        Api::namespaced_with(self.ns.client.clone(), &self.ns.name, &ar)
    }

    pub fn mails(&self) -> Vec<capm_mail_servers::StoredMessage> {
        self.mailgun.messages().unwrap()
    }

    pub async fn create_mailgun_cluster(&self, name: &str) -> MailgunCluster {
        let obj: MailgunCluster = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": "MailgunCluster",
            "metadata": { "name": name },
            "spec": { "priority": "Urgent", "request": "Three nodes, please.", "requester": "dev@example.com" }
        }))
        .unwrap();
        self.clusters()
            .create(&PostParams::default(), &obj)
            .await
            .unwrap()
    }

    /// Creates a Cluster pointing at MailgunCluster `name` and sets the owner reference on the
    /// MailgunCluster, as the Cluster API core controller does.
    pub async fn create_owner_cluster(&self, name: &str, paused: bool) -> DynamicObject {
        let cluster = self.create_cluster(name, paused).await;
        self.set_owner("MailgunCluster", name, &cluster).await;
        cluster
    }

    pub async fn create_cluster(&self, name: &str, paused: bool) -> DynamicObject {
        let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
            "cluster.x-k8s.io",
            "v1beta2",
            "Cluster",
        ));
        let obj = DynamicObject::new(name, &ar).data(json!({
            "spec": {
                "paused": paused,
                "infrastructureRef": { "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MailgunCluster", "name": name }
            }
        }));
        self.capi("Cluster")
            .create(&PostParams::default(), &obj)
            .await
            .unwrap()
    }

    pub async fn set_owner(&self, kind: &str, name: &str, owner: &DynamicObject) {
        let owner_kind = owner.types.as_ref().unwrap().kind.clone();
        let patch = json!({ "metadata": { "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": owner_kind,
            "name": owner.metadata.name, "uid": owner.metadata.uid, "controller": true, "blockOwnerDeletion": true
        }]}});
        let pp = PatchParams::default();
        match kind {
            "MailgunCluster" => drop(
                self.clusters()
                    .patch(name, &pp, &Patch::Merge(&patch))
                    .await
                    .unwrap(),
            ),
            _ => drop(
                self.machines()
                    .patch(name, &pp, &Patch::Merge(&patch))
                    .await
                    .unwrap(),
            ),
        }
    }

    /// Fulfils MailgunCluster `name`'s request as the human does: sets its
    /// `spec.controlPlaneEndpoint` (10.1.2.3:6443).
    pub async fn fulfil_cluster(&self, name: &str) {
        self.clusters()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({ "spec": { "controlPlaneEndpoint": { "host": "10.1.2.3", "port": 6443 } } }),
                ),
            )
            .await
            .unwrap();
    }

    /// Sets `status.initialization.infrastructureProvisioned` on Cluster `name`, as the Cluster
    /// API core manager does once the infrastructure is provisioned.
    pub async fn mark_infrastructure_provisioned(&self, name: &str) {
        self.capi("Cluster")
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({ "status": { "initialization": { "infrastructureProvisioned": true } } }),
                ),
            )
            .await
            .unwrap();
    }

    pub async fn patch_cluster_spec(&self, name: &str, spec: Value) {
        self.capi("Cluster")
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": spec })),
            )
            .await
            .unwrap();
    }

    /// The value of a counter or gauge in this run's registry, summed over label sets matching
    /// `label` (name, value).
    pub fn metric(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric().iter())
            .filter(|m| {
                label.is_none_or(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == k && l.value() == v)
                })
            })
            .map(|m| m.get_counter().get_value() + m.get_gauge().get_value())
            .sum()
    }
}

/// How long the controllers' tests wait for what a reconcile should reach.
pub const PATIENCE: Duration = Duration::from_secs(30);

pub use capm_test_support::wait::eventually;

pub fn condition<'a>(
    conditions: &'a Option<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>>,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    conditions.as_ref()?.iter().find(|c| c.type_ == type_)
}
