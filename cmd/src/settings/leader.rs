//! Leader election on a Lease (`--leader-elect*`, controller-runtime's defaults).

use std::time::Duration;

use super::{
    SettingsError, in_cluster_namespace, invalid,
    values::{check_dns_subdomain, duration, namespace},
};

/// Leader election's flags.
// The field docs are `--help` texts, written for a terminal, not for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
#[derive(Debug, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Elect a leader on a Lease so only one replica reconciles.
    #[arg(long, env = "LEADER_ELECT", default_value_t = true)]
    pub leader_elect: bool,

    /// Namespace of the leader-election Lease [default: $POD_NAMESPACE, else the in-cluster
    /// namespace, else `default`].
    #[arg(long, env = "LEADER_ELECTION_NAMESPACE", value_name = "NAMESPACE")]
    pub leader_election_namespace: Option<String>,

    /// Name of the leader-election Lease.
    #[arg(
        long,
        env = "LEADER_ELECTION_ID",
        value_name = "NAME",
        default_value = "cluster-api-provider-mailgun-leader"
    )]
    pub leader_election_id: String,

    /// How long a Lease is valid after its last renewal; longer than the renew deadline.
    #[arg(long, env = "LEADER_ELECT_LEASE_DURATION", value_name = "DURATION", default_value = "15s", value_parser = duration)]
    pub leader_elect_lease_duration: Duration,

    /// How long the leader keeps trying to renew before it gives up; longer than the retry period.
    #[arg(long, env = "LEADER_ELECT_RENEW_DEADLINE", value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub leader_elect_renew_deadline: Duration,

    /// How often candidates try to acquire the Lease and the leader renews it.
    #[arg(long, env = "LEADER_ELECT_RETRY_PERIOD", value_name = "DURATION", default_value = "2s", value_parser = duration)]
    pub leader_elect_retry_period: Duration,
}

/// Leader-election parameters (controller-runtime's defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderElection {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// How long a Lease is valid after its last renewal: 15 s.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up: 10 s.
    pub renew_deadline: Duration,
    /// How often candidates try to acquire and the leader renews: 2 s.
    pub retry_period: Duration,
}

/// The election, checked (its timings even when it is off); `None` when off.
pub(super) fn resolve(
    flags: Flags,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<LeaderElection>, SettingsError> {
    let (lease_duration, renew_deadline, retry_period) = (
        flags.leader_elect_lease_duration,
        flags.leader_elect_renew_deadline,
        flags.leader_elect_retry_period,
    );
    if renew_deadline >= lease_duration {
        return Err(invalid(
            field!(leader_elect_renew_deadline),
            format!(
                "must be shorter than {}",
                field!(leader_elect_lease_duration)
            ),
        ));
    }
    if retry_period.is_zero() || retry_period >= renew_deadline {
        return Err(invalid(
            field!(leader_elect_retry_period),
            format!(
                "must be positive and shorter than {}",
                field!(leader_elect_renew_deadline)
            ),
        ));
    }
    if !flags.leader_elect {
        return Ok(None);
    }
    let namespace = flags
        .leader_election_namespace
        .or_else(|| env("POD_NAMESPACE"))
        .or_else(in_cluster_namespace)
        .unwrap_or_else(|| "default".to_owned());
    let namespace =
        self::namespace(&namespace).map_err(|r| invalid(field!(leader_election_namespace), r.0))?;
    check_dns_subdomain(field!(leader_election_id), &flags.leader_election_id)?;
    Ok(Some(LeaderElection {
        namespace,
        name: flags.leader_election_id,
        lease_duration,
        renew_deadline,
        retry_period,
    }))
}
