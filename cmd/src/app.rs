//! The manager's lifecycle: mailer and certificates first (no cluster contact before the
//! configuration is known to work), then the client, the HTTP endpoints, leader election, and
//! the controllers; on SIGTERM the reverse.

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, anyhow};
use capm_controllers::Leadership;
use capm_mailer::{InstrumentedMailer, Mailer, MailerMetrics};
use prometheus::{IntGaugeVec, Opts, Registry};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tracing::{error, info, warn};

use crate::{
    client_metrics, fulfil,
    lease_elector::Elector,
    metrics_auth, server,
    settings::{
        DiagnosticsSecurity, EndpointFlags, FulfilmentFlags, Settings, field, mailer_error,
    },
    shutdown::Shutdown,
    tls::{self, ReloadingCert},
};

/// How often `/readyz` re-checks that the API server answers.
const READINESS_INTERVAL: Duration = Duration::from_secs(5);

/// Runs the manager until SIGTERM/SIGINT (`Ok`) or a fatal error, including a lost Lease.
///
/// # Errors
/// Anything that stops the manager: a backend or certificate that cannot be set up, an
/// unreachable cluster configuration, a port in use, the controllers failing, the Lease lost, or
/// a shutdown that overran `--shutdown-timeout`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let shutdown = Shutdown::new();
    shutdown
        .on_signals()
        .context("installing signal handlers")?;
    for deprecation in &settings.deprecations {
        warn!("{deprecation}");
    }

    let registry = Registry::new();
    #[cfg(target_os = "linux")]
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .context("registering process metrics")?;
    let mailer_metrics =
        MailerMetrics::register(&registry).context("registering mailer metrics")?;
    let controller_metrics =
        capm_controllers::Metrics::register(&registry).context("registering controller metrics")?;
    let leader_gauge = IntGaugeVec::new(
        Opts::new(
            "leader_election_master_status",
            "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease.",
        ),
        &["name"],
    )?;
    registry.register(Box::new(leader_gauge.clone()))?;

    let instance = instance_name();
    let leadership = match &settings.leader_election {
        None => Leadership::unelected(instance.clone()),
        Some(params) => Leadership::elected(
            format!("{instance}_{}", random_suffix()),
            params.lease_duration,
            params.renew_deadline,
        ),
    };

    // Everything that only depends on configuration fails here, before the cluster is touched.
    // The backend asks the leadership again at each send's commit point.
    let mailer = capm_mailer::build_with_gate(&settings.mailer, Arc::new(leadership.clone()))
        .map_err(mailer_error)
        .context("setting up the mail backend")?;
    info!(backend = mailer.backend(), "Mail backend ready");
    let mailer: Arc<dyn Mailer> = Arc::new(InstrumentedMailer::new(mailer, mailer_metrics));
    let webhook_tls = match &settings.webhook {
        Some(hook) => {
            let cert = ReloadingCert::new(&hook.cert_dir)
                .map_err(|e| anyhow!("{}: {e}", field!(webhook_cert_dir in EndpointFlags)))?;
            Some(TlsAcceptor::from(Arc::new(Arc::new(cert).server_config()?)))
        }
        None => None,
    };
    let diagnostics_tls = diagnostics_tls(&settings)?;
    // The fulfilment keys, read before the cluster is touched like every other secret file.
    let fulfilment_keys = match &settings.fulfilment {
        Some(f) => {
            let mut file = fulfil::KeyFile::new(f.keys_file.clone());
            let keys = (file.load())
                .map_err(|e| anyhow!("{}: {e}", field!(fulfilment_keys_file in FulfilmentFlags)))?
                .context("the fulfilment key file")?;
            Some((file, capm_api::link_token::KeyRing::new(keys)))
        }
        None => None,
    };

    let client = kube_client(settings.kubeconfig.as_deref(), &registry).await?;

    let (open_files, raise_error) = server::raise_open_files_limit();
    if let Some(e) = raise_error {
        warn!(error = %e, open_files, "Could not raise the open files limit to its hard limit");
    }
    let page = settings
        .fulfilment
        .as_ref()
        .is_some_and(|f| f.bind.is_some());
    let cap = server::connection_cap(open_files, 3 + u64::from(page));
    info!(open_files, connections_per_server = cap, "Open files limit");
    let rejected = server::rejected_counter(&registry)?;
    let server = |name, listener, tls, limits| server::Server {
        name,
        listener,
        tls,
        limits,
        rejected: rejected.clone(),
    };
    let mut servers: Vec<JoinHandle<()>> = Vec::new();
    if let Some(diag) = &settings.diagnostics {
        let metrics = server::handlers::metrics_handler(registry.clone());
        servers.push(match diagnostics_tls {
            Some(tls) => {
                let listener = server::bind("diagnostics (HTTPS, authorized)", diag.bind).await?;
                let authorizer = Arc::new(metrics_auth::Authorizer::new(client.clone()));
                let handler = metrics_auth::secured(authorizer, metrics);
                let limits = server::Limits::plain(cap);
                server::serve(
                    server("diagnostics", listener, Some(tls), limits),
                    handler,
                    shutdown.clone(),
                )
            }
            None => {
                let listener = server::bind("diagnostics (insecure HTTP)", diag.bind).await?;
                let limits = server::Limits::plain(cap);
                server::serve(
                    server("diagnostics", listener, None, limits),
                    metrics,
                    shutdown.clone(),
                )
            }
        });
    }
    let api_reachable = Arc::new(AtomicBool::new(false));
    if let Some(address) = settings.probe_address {
        let listener = server::bind("health probes", address).await?;
        servers.push(server::serve(
            server("probes", listener, None, server::Limits::plain(cap)),
            server::handlers::probe_handler(api_reachable.clone()),
            shutdown.clone(),
        ));
    }
    if let (Some(hook), Some(tls)) = (&settings.webhook, webhook_tls) {
        let listener = server::bind("webhooks (conversion, admission)", hook.bind).await?;
        let webhook_metrics = server::webhook_metrics::WebhookMetrics::register(&registry)
            .context("registering webhook metrics")?;
        servers.push(server::serve(
            server(
                "webhook",
                listener,
                Some(tls),
                server::Limits::webhooks(cap),
            ),
            server::webhook_metrics::instrumented_webhooks(webhook_metrics),
            shutdown.clone(),
        ));
    }
    let readiness = tokio::spawn(watch_api_server(client.clone(), api_reachable));

    let mut config = settings.controllers.clone();
    // One `Events` (one kube `Recorder`) for the controllers and the fulfilment page.
    let events =
        capm_controllers::Events::new(client.clone(), "cluster-api-provider-mailgun", instance);
    let mut key_reload = None;
    if let (Some(f), Some((file, keys))) = (&settings.fulfilment, fulfilment_keys) {
        config.fulfilment = Some(capm_api::link_token::Links {
            base_url: f.url.clone(),
            validity: f.validity,
            keys: keys.clone(),
        });
        key_reload = Some(tokio::spawn(fulfil::reload_keys(
            file,
            keys.clone(),
            fulfil::KEY_RELOAD_INTERVAL,
        )));
        if let Some(bind) = f.bind {
            let listener = server::bind("fulfilment page", bind).await?;
            let page = fulfil::Page::new(
                client.clone(),
                keys,
                f,
                config.recipients.clone(),
                events.clone(),
                &registry,
            )?;
            servers.push(server::serve(
                server("fulfilment", listener, None, server::Limits::page(cap)),
                Arc::new(page).handler(),
                shutdown.clone(),
            ));
        }
    }
    let controllers = Controllers {
        client: client.clone(),
        leadership: leadership.clone(),
        mailer,
        events,
        config,
        metrics: controller_metrics,
        timeout: settings.shutdown_timeout,
    };
    let result = match settings.leader_election.clone() {
        None => controllers.run(shutdown.clone(), None).await,
        Some(params) => {
            let gauge = leader_gauge.with_label_values(&[params.name.as_str()]);
            let elector = Elector::new(client, params, leadership, gauge);
            lead(elector, controllers, shutdown.clone()).await
        }
    };

    // Stop serving: on success shutdown was requested already; on failure request it now.
    shutdown.trigger();
    readiness.abort();
    if let Some(reload) = key_reload {
        reload.abort();
    }
    for server in servers {
        let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    }
    result
}

/// The diagnostics endpoint's TLS: the certificate directory's pair, else a self-signed one;
/// `None` when diagnostics are off or insecure.
fn diagnostics_tls(settings: &Settings) -> anyhow::Result<Option<TlsAcceptor>> {
    let config = match settings.diagnostics.as_ref().map(|d| &d.security) {
        Some(DiagnosticsSecurity::Secure {
            cert_dir: Some(dir),
        }) => {
            let cert = ReloadingCert::new(dir)
                .map_err(|e| anyhow!("{}: {e}", field!(diagnostics_cert_dir in EndpointFlags)))?;
            Arc::new(cert).server_config()?
        }
        Some(DiagnosticsSecurity::Secure { cert_dir: None }) => {
            let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
            names.push(instance_name());
            tls::self_signed_server_config(names)
                .context("making the diagnostics endpoint's self-signed certificate")?
        }
        Some(DiagnosticsSecurity::Insecure) | None => return Ok(None),
    };
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

/// How long any request to the API server may wait for its answer to start. The API server
/// answers within milliseconds (a watch with its headers, a list with a page of 50); a request
/// sent on a connection that a partition left silent (no reset, no close: a load balancer that
/// dropped it) would otherwise wait forever, since kube's client has no read timeout by default.
/// Failed, the request is retried as any failed request is (a watch by its backoff, a reconcile by
/// its requeue).
const API_RESPONSE_TIMEOUT: Duration = Duration::from_secs(20);

/// The client, its requests counted in `rest_client_requests_total` and bounded by
/// [`API_RESPONSE_TIMEOUT`].
async fn kube_client(
    kubeconfig: Option<&Path>,
    registry: &Registry,
) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("--kubeconfig: reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("--kubeconfig: using {}", path.display()))?
        }
        None => kube::Config::infer().await.context(
            "finding the cluster: no --kubeconfig, $KUBECONFIG, in-cluster service account or ~/.kube/config",
        )?,
    };
    let counted = client_metrics::RequestCountLayer::register(
        registry,
        client_metrics::host_label(&config.cluster_url),
    )
    .context("registering rest_client_requests_total")?;
    Ok(kube::client::ClientBuilder::try_from(config)
        .context("building the Kubernetes client")?
        .with_layer(&counted)
        .with_layer(&tower::timeout::TimeoutLayer::new(API_RESPONSE_TIMEOUT))
        .build())
}

async fn watch_api_server(client: kube::Client, reachable: Arc<AtomicBool>) {
    let mut was = None;
    loop {
        let ok = matches!(
            tokio::time::timeout(READINESS_INTERVAL, client.apiserver_version()).await,
            Ok(Ok(_))
        );
        reachable.store(ok, Ordering::Relaxed);
        if was != Some(ok) {
            if ok {
                info!("The Kubernetes API server is reachable");
            } else {
                warn!("The Kubernetes API server is not reachable");
            }
            was = Some(ok);
        }
        tokio::time::sleep(READINESS_INTERVAL).await;
    }
}

/// The pod name (`POD_NAME`, else the host name): events' `reportingInstance` and the first part
/// of the Lease holder identity.
fn instance_name() -> String {
    std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "cluster-api-provider-mailgun".to_owned())
}

/// Distinguishes two processes with the same host name (as client-go's `_<uuid>`).
fn random_suffix() -> String {
    (0..10)
        .map(|_| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[rand::random_range(0..36)]))
        .collect()
}

struct Controllers {
    client: kube::Client,
    leadership: Leadership,
    mailer: Arc<dyn Mailer>,
    events: capm_controllers::Events,
    config: capm_controllers::Config,
    metrics: capm_controllers::Metrics,
    timeout: Duration,
}

impl Controllers {
    /// Runs the controllers until `shutdown`, then waits at most the shutdown timeout for their
    /// in-flight reconciles. When leading and `lost` fires, aborts them at once instead: a
    /// reconcile of a replica that no longer leads must not finish its work.
    async fn run(
        self,
        shutdown: Shutdown,
        lost: Option<tokio::sync::watch::Receiver<bool>>,
    ) -> anyhow::Result<()> {
        let timeout = self.timeout;
        let stop = {
            let mut shutdown = shutdown.clone();
            async move { shutdown.wait().await }
        };
        let lost = async move {
            match lost {
                Some(mut lost) => {
                    let _ = lost.wait_for(|l| *l).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::pin!(lost);
        info!("Starting the controllers");
        let mut task = tokio::spawn(capm_controllers::run(
            self.client,
            self.mailer,
            self.events,
            self.config,
            self.leadership,
            self.metrics,
            stop,
        ));
        let mut waiting = shutdown.clone();
        let finished = tokio::select! {
            finished = &mut task => Some(finished),
            () = waiting.wait() => None,
            () = &mut lost => {
                task.abort();
                let _ = task.await;
                return Err(anyhow!("leadership lost: in-flight reconciles aborted"));
            }
        };
        let finished = match finished {
            Some(finished) => finished,
            None => tokio::select! {
                finished = tokio::time::timeout(timeout, &mut task) => match finished {
                    Ok(finished) => finished,
                    Err(_) => {
                        task.abort();
                        return Err(anyhow!(
                            "the controllers did not stop within the shutdown timeout ({timeout:?})"
                        ));
                    }
                },
                () = &mut lost => {
                    task.abort();
                    let _ = task.await;
                    return Err(anyhow!("leadership lost during shutdown: in-flight reconciles aborted"));
                }
            },
        };
        match finished {
            Ok(Ok(())) if shutdown.is_triggered() => {
                info!("The controllers stopped");
                Ok(())
            }
            Ok(Ok(())) => Err(anyhow!("the controllers stopped unexpectedly")),
            Ok(Err(e)) => Err(anyhow::Error::new(e).context("the controllers failed")),
            Err(e) => Err(anyhow!("the controllers' task failed: {e}")),
        }
    }
}

/// Stands by until this replica leads, then runs the controllers while renewing the Lease.
/// Releases the Lease when the controllers stop; fails (non-zero exit) if leadership is lost.
async fn lead(
    mut elector: Elector,
    controllers: Controllers,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    info!(
        identity = elector.identity(),
        "Waiting to become the leader"
    );
    if !elector.acquire(shutdown.clone()).await {
        return Ok(());
    }
    let timeout = controllers.timeout;
    let (lost_tx, lost_rx) = tokio::sync::watch::channel(false);
    let running = controllers.run(shutdown.clone(), Some(lost_rx));
    tokio::pin!(running);
    let result = tokio::select! {
        lost = elector.hold() => {
            error!(reason = %lost, "Lost the leader Lease; aborting the controllers");
            lost_tx.send_replace(true);
            if tokio::time::timeout(timeout, running).await.is_err() {
                warn!("The controllers did not stop within the shutdown timeout");
            }
            return Err(anyhow!("leader election lost: {lost}"));
        }
        result = &mut running => result,
    };
    if let Err(e) = elector.release().await {
        warn!(error = %e, "Could not release the leader Lease; it expires by itself");
    }
    result
}
