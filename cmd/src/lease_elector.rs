//! The Lease elector: leader election on a `coordination.k8s.io/v1` Lease, the way client-go
//! does it. It reports each round to the gate the controllers check, [`Leadership`].
//!
//! Every write is a `replace` carrying the resourceVersion that was read, so two candidates can
//! never both win the same round: the API server answers the loser with 409 Conflict. Expiry is
//! judged by the local clock (how long the Lease has gone unchanged since this process last saw
//! it change), so clock skew between nodes does not matter.
//!
//! `kube-lease-manager` was considered and not used: a standby there sleeps until the lease it
//! last read expires, so a released Lease is only taken over up to a full lease duration later;
//! the holder keeps leading while it cannot renew (no renew deadline); and renewals are patches
//! without a resourceVersion precondition.
//!
//! # Caveats
//! Leader election is not a fencing mechanism (client-go says so too): a paused leader believes
//! it leads until its renew loop runs again. So every successful round is reported to the
//! controllers' [`Leadership`] (with the instant the round **started**), and the controllers
//! check it by the monotonic clock right before every send and every write: less than the renew
//! deadline since the last renewal, or nothing happens. The writes guarded by resourceVersion
//! fence the API server; that check fences the mail backend.

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};
use prometheus::IntGauge;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use capm_controllers::Leadership;

use tokio_util::sync::CancellationToken;

use crate::settings::LeaderElection;

/// What one acquire-or-renew round found.
#[derive(Debug, PartialEq, Eq)]
enum Round {
    /// We hold the Lease now.
    Held,
    /// Another candidate holds an unexpired Lease.
    HeldBy(String),
    /// Another writer changed the Lease between our read and our write; try again.
    Conflict,
}

/// Why a leader stopped being one.
#[derive(Debug, thiserror::Error)]
pub enum Lost {
    /// Another candidate holds the Lease.
    #[error("the Lease is now held by {0}")]
    TakenBy(String),
    /// Renewals failed for longer than the renew deadline.
    #[error("could not renew the Lease within {deadline:?}{}", last_error.as_deref().map(|e| format!(" (last error: {e})")).unwrap_or_default())]
    RenewDeadline {
        /// The renew deadline.
        deadline: Duration,
        /// The last API error seen, if any.
        last_error: Option<String>,
    },
}

/// One candidate for leadership.
pub struct Elector {
    api: Api<Lease>,
    params: LeaderElection,
    identity: String,
    gauge: IntGauge,
    leadership: Leadership,
    /// The resourceVersion last seen and when (local clock) it was first seen.
    observed: Option<(String, Instant)>,
}

impl std::fmt::Debug for Elector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elector")
            .field(
                "lease",
                &format!("{}/{}", self.params.namespace, self.params.name),
            )
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

fn seconds(d: Duration) -> i32 {
    i32::try_from(d.as_secs()).unwrap_or(i32::MAX)
}

impl Elector {
    /// A candidate named by `leadership`'s identity; `gauge` is its
    /// `leader_election_master_status` series. Every successful round is reported to
    /// `leadership`.
    pub fn new(
        client: Client,
        params: LeaderElection,
        leadership: Leadership,
        gauge: IntGauge,
    ) -> Self {
        gauge.set(0);
        Self {
            api: Api::namespaced(client, &params.namespace),
            params,
            identity: leadership.identity().to_owned(),
            gauge,
            leadership,
            observed: None,
        }
    }

    /// This candidate's holder identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn observe(&mut self, resource_version: Option<&str>) {
        let rv = resource_version.unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| seen != rv) {
            self.observed = Some((rv.to_owned(), Instant::now()));
        }
    }

    async fn try_acquire_or_renew(&mut self) -> Result<Round, kube::Error> {
        let duration = seconds(self.params.lease_duration);
        let Some(mut lease) = self.api.get_opt(&self.params.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.params.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(duration),
                    acquire_time: Some(now()),
                    renew_time: Some(now()),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    self.observe(created.metadata.resource_version.as_deref());
                    Ok(Round::Held)
                }
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(Round::Conflict),
                Err(e) => Err(e),
            };
        };
        self.observe(lease.metadata.resource_version.as_deref());
        let spec = lease.spec.take().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.identity.as_str());
        if let Some(other) = holder.as_ref().filter(|_| !ours) {
            let valid_for = spec
                .lease_duration_seconds
                .and_then(|s| u64::try_from(s).ok())
                .map_or(self.params.lease_duration, Duration::from_secs);
            let unchanged_since = self
                .observed
                .as_ref()
                .map_or_else(Instant::now, |(_, at)| *at);
            if unchanged_since.elapsed() < valid_for {
                return Ok(Round::HeldBy(other.clone()));
            }
            info!(previous = %other, "The Lease expired; taking it over");
        }
        let transitions = spec.lease_transitions.unwrap_or(0);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(duration),
            acquire_time: if ours { spec.acquire_time } else { Some(now()) },
            renew_time: Some(now()),
            lease_transitions: Some(if ours {
                transitions
            } else {
                transitions.saturating_add(1)
            }),
            ..spec
        });
        match self
            .api
            .replace(&self.params.name, &PostParams::default(), &lease)
            .await
        {
            Ok(updated) => {
                self.observe(updated.metadata.resource_version.as_deref());
                Ok(Round::Held)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Round::Conflict),
            Err(e) => Err(e),
        }
    }

    /// Waits until this candidate holds the Lease (`true`), or `stop` fires first (`false`).
    pub async fn acquire(&mut self, stop: &CancellationToken) -> bool {
        let mut last_holder = None;
        loop {
            let started = Instant::now();
            match self.try_acquire_or_renew().await {
                Ok(Round::Held) => {
                    self.leadership.renewed(started.into_std());
                    self.gauge.set(1);
                    info!(identity = %self.identity, lease = %self.params.name, "Acquired the leader Lease");
                    return true;
                }
                Ok(Round::HeldBy(holder)) => {
                    if last_holder.as_ref() != Some(&holder) {
                        info!(%holder, "Another replica leads; standing by");
                        last_holder = Some(holder);
                    }
                }
                Ok(Round::Conflict) => debug!("Conflict while acquiring the Lease"),
                Err(e) => warn!(error = %e, "Could not acquire the leader Lease"),
            }
            // Jitter as client-go (up to 1.2 x the retry period) so candidates spread out.
            let jitter = self
                .params
                .retry_period
                .mul_f64(rand::random_range(0.0..1.2));
            tokio::select! {
                () = tokio::time::sleep(self.params.retry_period + jitter) => {}
                () = stop.cancelled() => return false,
            }
        }
    }

    /// Renews the Lease every retry period while this candidate leads; returns when it no longer
    /// does. Cancel-safe: dropping it just stops renewing.
    pub async fn hold(&mut self) -> Lost {
        let mut last_renewal = Instant::now();
        let mut last_error = None;
        loop {
            tokio::time::sleep(self.params.retry_period).await;
            let deadline = last_renewal + self.params.renew_deadline;
            let started = Instant::now();
            match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                Ok(Ok(Round::Held)) => {
                    self.leadership.renewed(started.into_std());
                    last_renewal = started;
                    last_error = None;
                }
                Ok(Ok(Round::HeldBy(holder))) => {
                    self.leadership.lost();
                    self.gauge.set(0);
                    return Lost::TakenBy(holder);
                }
                Ok(Ok(Round::Conflict)) => debug!("Conflict while renewing the Lease"),
                Ok(Err(e)) => {
                    warn!(error = %e, "Could not renew the leader Lease");
                    last_error = Some(e.to_string());
                }
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                self.leadership.lost();
                self.gauge.set(0);
                return Lost::RenewDeadline {
                    deadline: self.params.renew_deadline,
                    last_error,
                };
            }
        }
    }

    /// Gives the Lease up (empty holder) so another candidate can take over at once. Does
    /// nothing if another candidate holds it.
    ///
    /// # Errors
    /// When the Lease cannot be read or written.
    pub async fn release(&mut self) -> Result<(), kube::Error> {
        self.leadership.lost();
        self.gauge.set(0);
        let Some(mut lease) = self.api.get_opt(&self.params.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(now());
        spec.acquire_time = Some(now());
        self.api
            .replace(&self.params.name, &PostParams::default(), &lease)
            .await?;
        info!(identity = %self.identity, lease = %self.params.name, "Released the leader Lease");
        Ok(())
    }
}
