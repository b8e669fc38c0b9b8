//! The watch/cache pipeline: one per kind, the same for both ([`controller`]), and the Cluster
//! API watches they share ([`capi_triggers`]), whose stores are listed before any reconcile
//! judges an owner.

mod capi_triggers;
mod controller;
mod identity_triggers;
mod lists;
mod remediation_triggers;
mod resync;
mod trim;

use std::{future::Future, sync::Arc};

use capm_api::{
    capi::{Cluster, Machine},
    v1beta1::{MailgunCluster, MailgunClusterIdentity, MailgunMachine, MailgunRemediation},
};
use capm_mailer::Mailer;
use futures::{FutureExt, channel::mpsc};
use kube::{Api, Client, Resource, api::ListParams, runtime::reflector};
use tracing::info;

use self::capi_triggers::CapiWatches;
use crate::{
    Config, Error, Leadership, Metrics, context::Ctx, events::Events, poller::WakeSenders,
    watch::scoped,
};

/// Runs the three controllers (the remediations' when its kind is installed) until `shutdown` resolves, publishing their Events through `events`
/// (the process's one [`Events`]). `leadership` is consulted before every write and send (an
/// unelected process is its own leader: [`Leadership::unelected`]).
#[allow(clippy::too_many_arguments)]
pub async fn run(
    client: Client,
    mailer: Arc<dyn Mailer>,
    events: Events,
    config: Config,
    leadership: Leadership,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    config.validate()?;
    preflight(&client, &config).await?;
    let shutdown = shutdown.shared();

    let capi = CapiWatches::new();
    let (mailgun_clusters, mailgun_machines) = (reflector::store(), reflector::store());
    let (clusters, cluster_wakes) = mpsc::unbounded();
    let (machines, machine_wakes) = mpsc::unbounded();
    let (remediations, remediation_wakes) = mpsc::unbounded();
    let ctx = Arc::new(Ctx::new(
        client.clone(),
        mailer,
        events,
        config.clone(),
        leadership,
        metrics,
        capi.stores(mailgun_clusters.0.clone(), mailgun_machines.0.clone()),
        WakeSenders {
            clusters,
            machines,
            remediations,
        },
    ));
    ctx.wait_for_capi_lists();
    let (clusters, machines) = (
        controller::controller(
            &ctx,
            &capi,
            mailgun_clusters,
            cluster_wakes,
            shutdown.clone(),
        ),
        controller::controller(
            &ctx,
            &capi,
            mailgun_machines,
            machine_wakes,
            shutdown.clone(),
        ),
    );
    let remediations = remediations_installed(&client, &config).await.then(|| {
        let own = reflector::store();
        controller::controller(&ctx, &capi, own, remediation_wakes, shutdown.clone())
    });
    let capi = capi.run(client, config.clone(), shutdown.clone());
    let poller = ctx.poller.clone().run(shutdown.clone());
    // Absent values read as such ("all", "none"), not as Rust's `Some("…")`.
    info!(
        namespace = config.namespace.as_deref().unwrap_or("all"),
        watch_filter = config.watch_filter.as_deref().unwrap_or("none"),
        concurrency = config.concurrency,
        sync_period = ?config.sync_period,
        "Controllers started"
    );
    let remediations = async move {
        if let Some(run) = remediations {
            run.await;
        }
    };
    tokio::join!(clusters, machines, remediations, capi, poller);
    info!("Controllers stopped");
    Ok(())
}

/// Whether `MailgunRemediation`s can be listed (`crd::remediation_crds()` installed, listing
/// allowed): without them remediation by mail is off and the other two controllers run alone.
async fn remediations_installed(client: &Client, config: &Config) -> bool {
    let api = scoped::<MailgunRemediation>(client, config);
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(_) => true,
        Err(error) => {
            info!(%error, "MailgunRemediations cannot be listed: remediation by mail is off");
            false
        }
    }
}

/// Fails start-up with a clear message when a kind the provider watches cannot be listed (its
/// CRD missing, or listing not allowed).
async fn preflight(client: &Client, config: &Config) -> Result<(), Error> {
    async fn listable<K>(api: Api<K>, what: &str, hint: &str) -> Result<(), Error>
    where
        K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let listed = api.list_metadata(&ListParams::default().limit(1)).await;
        let context = format!("listing {what} ({hint})");
        listed
            .map(drop)
            .map_err(|source| Error::Kube { context, source })
    }
    let ours = "are the provider's CRDs installed and is listing allowed?";
    let capi = "are the Cluster API CRDs installed?";
    let (clusters, machines) = (scoped(client, config), scoped(client, config));
    listable::<MailgunCluster>(clusters, "MailgunClusters", ours).await?;
    listable::<MailgunMachine>(machines, "MailgunMachines", ours).await?;
    let identities = Api::<MailgunClusterIdentity>::all(client.clone());
    listable(identities, "MailgunClusterIdentities", ours).await?;
    let (clusters, machines) = (scoped(client, config), scoped(client, config));
    listable::<Cluster>(clusters, "cluster.x-k8s.io/v1beta2 Clusters", capi).await?;
    listable::<Machine>(machines, "cluster.x-k8s.io/v1beta2 Machines", capi).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `MailgunCluster` in namespace `ns` for the pipeline's tests.
    pub(super) fn test_object(name: &str, uid: &str, rv: &str) -> MailgunCluster {
        let mut o = MailgunCluster::new(
            name,
            serde_json::from_value(serde_json::json!({
                "priority": "Urgent", "request": "r", "requester": "a@example.com",
            }))
            .expect("a valid spec"),
        );
        o.metadata.namespace = Some("ns".into());
        o.metadata.uid = Some(uid.into());
        o.metadata.resource_version = Some(rv.into());
        o
    }
}
