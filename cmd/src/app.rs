//! What the process runs, one function per concern as in a Cluster API manager's `main.go`
//! (`setupChecks`, `setupReconcilers`, `setupWebhooks`): [`run`] resolves what only depends on
//! the configuration first (the mail backend, certificates, the links' keys: no cluster contact
//! before the configuration is known to work), then builds the client, and hands the servers
//! and tasks its mode asks for to the [`Manager`], which runs them until SIGTERM or a failure.

use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, anyhow};
use capm_api::link_token::{KeyRing, Links};
use capm_controllers::Leadership;
use capm_mailer::{InstrumentedMailer, Mailer, MailerMetrics};
use prometheus::{IntGaugeVec, Opts, Registry};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    client_metrics, fulfil,
    lease_elector::Elector,
    manager::Manager,
    metrics_auth,
    reconcilers::Controllers,
    reload::{self, Reload},
    server::{self, Limits},
    settings::{
        DiagnosticsSecurity, EndpointFlags, Fulfilment, FulfilmentFlags,
        Manager as ManagerSettings, Mode, PageOnly, Role, Settings, Webhook, field, mailer_error,
    },
    tls::{self, CertReload, ReloadingCert},
};

/// How often `/readyz` re-checks that the API server answers.
const READINESS_INTERVAL: Duration = Duration::from_secs(5);

/// The Events' `reportingController`.
const REPORTING_CONTROLLER: &str = "cluster-api-provider-mailgun";

/// Runs the process until SIGTERM/SIGINT (`Ok`) or a fatal error, including a lost Lease.
///
/// # Errors
/// Anything that stops the process: a backend or certificate that cannot be set up, an
/// unreachable cluster configuration, a port in use, the controllers failing, the Lease lost, or
/// a shutdown that overran `--shutdown-timeout`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
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
    match &settings.role {
        Role::All(manager) => run_all(&settings, manager, registry).await,
        Role::FulfilmentPage(page) => run_page(&settings, page, registry).await,
    }
}

/// `--mode all`: the controllers, the webhooks, the links and (unless served elsewhere) the page.
async fn run_all(
    settings: &Settings,
    all: &ManagerSettings,
    registry: Registry,
) -> anyhow::Result<()> {
    let instance = instance_name();
    let leadership = match &all.leader_election {
        None => Leadership::unelected(instance.clone()),
        Some(params) => Leadership::elected(
            format!("{instance}_{}", random_suffix()),
            params.lease_duration,
            params.renew_deadline,
        ),
    };
    let mailer = setup_mail(all, &leadership, &registry)?;
    let webhook_cert = all.webhook.as_ref().map(webhook_cert).transpose()?;
    let diagnostics_tls = diagnostics_tls(settings)?;
    let keys = all.fulfilment.as_ref().map(read_keys).transpose()?;

    let client = kube_client(settings.kubeconfig.as_deref(), &registry).await?;
    // One `Events` (one kube `Recorder`) for the controllers and the fulfilment page.
    let events =
        capm_controllers::Events::new(client.clone(), REPORTING_CONTROLLER, instance.clone());
    let page = all.fulfilment.as_ref().is_some_and(|f| f.bind.is_some());
    let mut manager = Manager::new(&registry, 3 + u64::from(page))?;
    let mut reloads: Vec<Box<dyn Reload>> = Vec::new();
    setup_diagnostics(&mut manager, settings, diagnostics_tls, &client, &registry).await?;
    setup_checks(&mut manager, settings, &client).await?;
    if let (Some(hook), Some(cert)) = (&all.webhook, webhook_cert) {
        setup_webhooks(&mut manager, hook.bind, cert, &registry, &mut reloads).await?;
    }
    let mut links = None;
    if let (Some(f), Some((file, ring))) = (&all.fulfilment, keys) {
        links = Some(Links {
            base_url: f.url.clone(),
            validity: f.validity,
            keys: ring.clone(),
        });
        if let Some(bind) = f.bind {
            let recipients = all.controllers.recipients.clone();
            let page = Page {
                settings: f,
                bind,
                recipients,
                events: events.clone(),
            };
            setup_fulfilment(&mut manager, page, &client, ring.clone(), &registry).await?;
        }
        reloads.push(Box::new(fulfil::KeyReload { file, ring }));
    }
    setup_reloader(&mut manager, reloads);
    setup_reconcilers(
        &mut manager,
        all,
        settings,
        client,
        leadership,
        mailer,
        links,
        events,
        &registry,
    )?;
    manager.run(settings.shutdown_timeout).await
}

/// `--mode fulfilment-page`: the page, the probes and `/metrics`; no mail backend, no election,
/// no webhooks, no controllers.
async fn run_page(settings: &Settings, page: &PageOnly, registry: Registry) -> anyhow::Result<()> {
    info!(
        mode = Mode::FulfilmentPage.name(),
        "Serving only the fulfilment page: no mail backend, no leader election, no webhooks, no controllers"
    );
    let diagnostics_tls = diagnostics_tls(settings)?;
    let (file, ring) = read_keys(&page.fulfilment)?;

    let client = kube_client(settings.kubeconfig.as_deref(), &registry).await?;
    let mut manager = Manager::new(&registry, 3)?;
    setup_diagnostics(&mut manager, settings, diagnostics_tls, &client, &registry).await?;
    setup_checks(&mut manager, settings, &client).await?;
    let served = Page {
        settings: &page.fulfilment,
        bind: page.bind,
        recipients: page.recipients.clone(),
        events: capm_controllers::Events::new(
            client.clone(),
            REPORTING_CONTROLLER,
            instance_name(),
        ),
    };
    setup_fulfilment(&mut manager, served, &client, ring.clone(), &registry).await?;
    setup_reloader(
        &mut manager,
        vec![Box::new(fulfil::KeyReload { file, ring })],
    );
    manager.run(settings.shutdown_timeout).await
}

/// The mail backend, which asks `leadership` again at each send's commit point.
fn setup_mail(
    all: &ManagerSettings,
    leadership: &Leadership,
    registry: &Registry,
) -> anyhow::Result<Arc<dyn Mailer>> {
    let metrics = MailerMetrics::register(registry).context("registering mailer metrics")?;
    let mailer = capm_mailer::build_with_gate(&all.mailer, Arc::new(leadership.clone()))
        .map_err(mailer_error)
        .context("setting up the mail backend")?;
    info!(backend = mailer.backend(), "Mail backend ready");
    Ok(Arc::new(InstrumentedMailer::new(mailer, metrics)))
}

/// The webhooks' certificate directory.
fn webhook_cert(hook: &Webhook) -> anyhow::Result<Arc<ReloadingCert>> {
    let cert = ReloadingCert::new(&hook.cert_dir)
        .map_err(|e| anyhow!("{}: {e}", field!(webhook_cert_dir in EndpointFlags)))?;
    Ok(Arc::new(cert))
}

/// The links' key file, read before the cluster is touched like every other secret file.
fn read_keys(f: &Fulfilment) -> anyhow::Result<(fulfil::KeyFile, KeyRing)> {
    let mut file = fulfil::KeyFile::new(f.keys_file.clone());
    let keys = (file.load())
        .map_err(|e| anyhow!("{}: {e}", field!(fulfilment_keys_file in FulfilmentFlags)))?
        .context("the fulfilment key file")?;
    Ok((file, KeyRing::new(keys)))
}

/// `/metrics` on `--diagnostics-address`: over HTTPS, each request reviewed by the API server,
/// unless diagnostics are insecure.
async fn setup_diagnostics(
    manager: &mut Manager,
    settings: &Settings,
    tls: Option<TlsAcceptor>,
    client: &kube::Client,
    registry: &Registry,
) -> anyhow::Result<()> {
    let Some(diag) = &settings.diagnostics else {
        return Ok(());
    };
    let metrics = server::handlers::metrics_routes(registry.clone());
    let (name, routes) = match &tls {
        Some(_) => {
            let authorizer = Arc::new(metrics_auth::Authorizer::new(client.clone()));
            (
                "diagnostics (HTTPS, authorized)",
                metrics_auth::secured(authorizer, metrics),
            )
        }
        None => ("diagnostics (insecure HTTP)", metrics),
    };
    info!(address = %diag.bind, "Serving {name}");
    manager
        .add_server("diagnostics", diag.bind, tls, Limits::plain().on(routes))
        .await
}

/// `/healthz` and `/readyz`, and the task that keeps `/readyz` current.
async fn setup_checks(
    manager: &mut Manager,
    settings: &Settings,
    client: &kube::Client,
) -> anyhow::Result<()> {
    let reachable = Arc::new(AtomicBool::new(false));
    if let Some(address) = settings.probe_address {
        let routes = server::handlers::probe_routes(reachable.clone());
        manager
            .add_server("probes", address, None, Limits::plain().on(routes))
            .await?;
    }
    let client = client.clone();
    manager.add_task("readiness", move |stop| {
        watch_api_server(client, reachable, stop)
    });
    Ok(())
}

/// The webhooks (`/convert`, `/validate`) over TLS.
async fn setup_webhooks(
    manager: &mut Manager,
    bind: SocketAddr,
    cert: Arc<ReloadingCert>,
    registry: &Registry,
    reloads: &mut Vec<Box<dyn Reload>>,
) -> anyhow::Result<()> {
    let tls = TlsAcceptor::from(Arc::new(cert.clone().server_config()?));
    reloads.push(Box::new(CertReload(cert)));
    let metrics = server::webhook_metrics::WebhookMetrics::register(registry)
        .context("registering webhook metrics")?;
    let routes = server::webhooks::webhook_routes(metrics);
    manager
        .add_server("webhook", bind, Some(tls), Limits::webhooks().on(routes))
        .await
}

/// What the fulfilment page is served with.
struct Page<'a> {
    settings: &'a Fulfilment,
    bind: SocketAddr,
    recipients: Vec<String>,
    /// The process's one `Events` (one kube `Recorder`), shared with the controllers.
    events: capm_controllers::Events,
}

/// The fulfilment page on its own port.
async fn setup_fulfilment(
    manager: &mut Manager,
    page: Page<'_>,
    client: &kube::Client,
    keys: KeyRing,
    registry: &Registry,
) -> anyhow::Result<()> {
    let handler = fulfil::Page::new(
        client.clone(),
        keys,
        page.settings,
        page.recipients,
        page.events,
        registry,
    )?;
    let routes = Arc::new(handler).router();
    manager
        .add_server("fulfilment", page.bind, None, Limits::page().on(routes))
        .await
}

/// One reloader for every file that changes under the process.
fn setup_reloader(manager: &mut Manager, files: Vec<Box<dyn Reload>>) {
    if files.is_empty() {
        return;
    }
    manager.add_task("reloader", move |stop| async move {
        reload::watch(files, reload::RELOAD_INTERVAL, stop).await;
        Ok(())
    });
}

/// The controllers, under leader election when it is on.
#[allow(clippy::too_many_arguments)]
fn setup_reconcilers(
    manager: &mut Manager,
    all: &ManagerSettings,
    settings: &Settings,
    client: kube::Client,
    leadership: Leadership,
    mailer: Arc<dyn Mailer>,
    links: Option<Links>,
    events: capm_controllers::Events,
    registry: &Registry,
) -> anyhow::Result<()> {
    let metrics =
        capm_controllers::Metrics::register(registry).context("registering controller metrics")?;
    let gauge = IntGaugeVec::new(
        Opts::new(
            "leader_election_master_status",
            "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease.",
        ),
        &["name"],
    )?;
    registry.register(Box::new(gauge.clone()))?;
    let elector = all.leader_election.clone().map(|params| {
        let gauge = gauge.with_label_values(&[params.name.as_str()]);
        Elector::new(client.clone(), params, leadership.clone(), gauge)
    });
    let mut config = all.controllers.clone();
    config.fulfilment = links;
    let controllers = Controllers {
        client,
        leadership,
        mailer,
        events,
        config,
        metrics,
        timeout: settings.shutdown_timeout,
    };
    manager.add_task("controllers", move |stop| controllers.run(elector, stop));
    Ok(())
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

/// Keeps `reachable` current until `stop`.
async fn watch_api_server(
    client: kube::Client,
    reachable: Arc<AtomicBool>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut was = None;
    while !stop.is_cancelled() {
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
        tokio::select! {
            () = tokio::time::sleep(READINESS_INTERVAL) => {}
            () = stop.cancelled() => {}
        }
    }
    Ok(())
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
