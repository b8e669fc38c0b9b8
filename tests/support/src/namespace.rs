//! A fresh namespace and client for each test.

use k8s_openapi::{
    NamespaceResourceScope, api::core::v1::Namespace,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, Resource,
    api::{DeleteParams, ObjectMeta, PostParams},
};

use crate::{ControlPlane, Error, install_crds, shared};

/// A namespace created for one test, deleted (in the background) when dropped.
pub struct TestNamespace {
    /// The namespace name: the prefix plus a random suffix.
    pub name: String,
    /// An admin client, created on the test's own runtime, defaulting to this namespace.
    pub client: Client,
    control_plane: &'static ControlPlane,
}

impl TestNamespace {
    /// Creates `<prefix>-<random>` in the [shared](crate::shared) control plane.
    ///
    /// # Errors
    /// When the control plane is not available or the namespace cannot be created.
    pub async fn create(prefix: &str) -> Result<Self, Error> {
        Self::create_with_labels(prefix, &[]).await
    }

    /// Like [`TestNamespace::create`], with labels on the namespace (for example Pod Security
    /// levels).
    ///
    /// # Errors
    /// When the control plane is not available or the namespace cannot be created.
    pub async fn create_with_labels(prefix: &str, labels: &[(&str, &str)]) -> Result<Self, Error> {
        let control_plane = shared()?;
        let client = control_plane.client().await?;
        let suffix: String = (0..6)
            .map(|_| char::from(b'a' + rand::random_range(0..26u8)))
            .collect();
        let name = format!("{prefix}-{suffix}");
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .chain([("capm.test/owner".to_owned(), "capm-test-support".to_owned())])
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .map_err(Error::kube(format!("creating namespace {name}")))?;
        let mut config = control_plane.config().await?;
        config.default_namespace = name.clone();
        let client = Client::try_from(config).map_err(Error::kube("building a client"))?;
        Ok(Self {
            name,
            client,
            control_plane,
        })
    }

    /// Like [`TestNamespace::create`], with `crds` applied (and Established) and the Cluster API
    /// CRDs installed in the control plane. Applying unchanged CRDs is a no-op, and the Cluster
    /// API CRDs are installed once per process, so every test can call this.
    ///
    /// # Errors
    /// When the namespace cannot be created or a CRD not installed.
    pub async fn create_with_crds(
        prefix: &str,
        crds: &[CustomResourceDefinition],
    ) -> Result<Self, Error> {
        static CAPI_CRDS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        let ns = Self::create(prefix).await?;
        install_crds(&ns.client, crds).await?;
        CAPI_CRDS
            .get_or_try_init(|| ns.control_plane.install_capi_crds())
            .await?;
        Ok(ns)
    }

    /// An `Api` for a namespaced kind in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// The control plane this namespace lives in.
    pub fn control_plane(&self) -> &'static ControlPlane {
        self.control_plane
    }
}

impl std::fmt::Debug for TestNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNamespace")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // The test's runtime may be shutting down: delete from a thread with its own runtime.
        let name = std::mem::take(&mut self.name);
        let control_plane = self.control_plane;
        let deleting = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(client) = control_plane.client().await {
                    let _ = Api::<Namespace>::all(client)
                        .delete(&name, &DeleteParams::background())
                        .await;
                }
            });
        });
        let _ = deleting.join();
    }
}
