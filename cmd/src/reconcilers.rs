//! The controllers, run by the manager as one task: directly, or under leader election while
//! this replica holds the Lease. Losing the Lease is handled here only: the in-flight reconciles
//! are aborted at once (a replica that no longer leads must not finish its work) and the task
//! fails, which stops the process.

use std::{sync::Arc, time::Duration};

use anyhow::anyhow;
use capm_controllers::Leadership;
use capm_mailer::Mailer;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::lease_elector::Elector;

/// Everything the controllers run with.
pub struct Controllers {
    /// The API client.
    pub client: kube::Client,
    /// The gate the controllers check before every send and write.
    pub leadership: Leadership,
    /// The mail backend.
    pub mailer: Arc<dyn Mailer>,
    /// Where their Events go: the process's one `Events`.
    pub events: capm_controllers::Events,
    /// Their configuration.
    pub config: capm_controllers::Config,
    /// Their metrics.
    pub metrics: capm_controllers::Metrics,
    /// How long in-flight reconciles may take to finish after shutdown.
    pub timeout: Duration,
}

impl Controllers {
    /// Runs the controllers until `stop`, under `elector` when given.
    ///
    /// # Errors
    /// The controllers failed or overran the shutdown timeout, or the Lease was lost.
    pub async fn run(
        self,
        elector: Option<Elector>,
        stop: CancellationToken,
    ) -> anyhow::Result<()> {
        match elector {
            None => self.until(&stop, &CancellationToken::new()).await,
            Some(elector) => self.lead(elector, stop).await,
        }
    }

    /// Stands by until this replica leads, then runs the controllers while renewing the Lease;
    /// releases it when they stop.
    async fn lead(self, mut elector: Elector, stop: CancellationToken) -> anyhow::Result<()> {
        info!(
            identity = elector.identity(),
            "Waiting to become the leader"
        );
        if !elector.acquire(&stop).await {
            return Ok(());
        }
        let lost = CancellationToken::new();
        let running = self.until(&stop, &lost);
        tokio::pin!(running);
        let result = tokio::select! {
            reason = elector.hold() => {
                error!(reason = %reason, "Lost the leader Lease; aborting the controllers");
                lost.cancel();
                let _ = running.await;
                return Err(anyhow!("leader election lost: {reason}"));
            }
            result = &mut running => result,
        };
        if let Err(e) = elector.release().await {
            warn!(error = %e, "Could not release the leader Lease; it expires by itself");
        }
        result
    }

    /// Runs the controllers until `stop`, then waits at most the shutdown timeout for their
    /// in-flight reconciles; when `abort` fires, aborts them at once instead.
    async fn until(
        self,
        stop: &CancellationToken,
        abort: &CancellationToken,
    ) -> anyhow::Result<()> {
        let timeout = self.timeout;
        info!("Starting the controllers");
        let mut task = tokio::spawn(capm_controllers::run(
            self.client,
            self.mailer,
            self.events,
            self.config,
            self.leadership,
            self.metrics,
            stop.clone().cancelled_owned(),
        ));
        let aborted =
            |during: &str| anyhow!("leadership lost{during}: in-flight reconciles aborted");
        let finished = tokio::select! {
            biased;
            () = abort.cancelled() => {
                task.abort();
                let _ = task.await;
                return Err(aborted(""));
            }
            finished = &mut task => finished,
            () = stop.cancelled() => tokio::select! {
                biased;
                () = abort.cancelled() => {
                    task.abort();
                    let _ = task.await;
                    return Err(aborted(" during shutdown"));
                }
                finished = tokio::time::timeout(timeout, &mut task) => match finished {
                    Ok(finished) => finished,
                    Err(_) => {
                        task.abort();
                        return Err(anyhow!(
                            "the controllers did not stop within the shutdown timeout ({timeout:?})"
                        ));
                    }
                },
            },
        };
        match finished {
            Ok(Ok(())) if stop.is_cancelled() => {
                info!("The controllers stopped");
                Ok(())
            }
            Ok(Ok(())) => Err(anyhow!("the controllers stopped unexpectedly")),
            Ok(Err(e)) => Err(anyhow::Error::new(e).context("the controllers failed")),
            Err(e) => Err(anyhow!("the controllers' task failed: {e}")),
        }
    }
}
