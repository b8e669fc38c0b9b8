//! Whether this process may still act as the leader, judged by its own monotonic clock.
//!
//! Leader election is not a fencing mechanism: a leader frozen (SIGSTOP, a long GC-like stall, a
//! VM pause) keeps believing it leads until its renew loop runs again, while another replica has
//! already taken the Lease over. The writes guarded by `resourceVersion` fence the API server; a
//! mail backend has no such fence. So, right before every send and again at its commit point
//! (as the backends' [`CommitGate`](capm_mailer::CommitGate)), the controllers ask
//! [`Leadership::may_act`]: less than the renew deadline must have passed since the start of this
//! process's last successful renewal. A standby takes the Lease over only after it has seen the
//! Lease unchanged for the lease duration, which is longer than the renew deadline, so a send
//! that passes this check started before any other replica could lead. The standby's side
//! ([`Leadership::handover`]) and the window left open: docs/how-it-works.md.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// This process's standing as the one replica that may send mail. Cheap to clone.
#[derive(Clone)]
pub struct Leadership {
    inner: Arc<Inner>,
}

struct Inner {
    identity: String,
    /// `None` without leader election: the only replica always acts.
    elected: Option<Elected>,
}

struct Elected {
    lease_duration: Duration,
    renew_deadline: Duration,
    /// Start of the last successful acquire or renew round; `None` before the first.
    renewed: Mutex<Option<Instant>>,
}

impl Leadership {
    /// No leader election: this process is the only replica and always acts.
    pub fn unelected(identity: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                identity: identity.into(),
                elected: None,
            }),
        }
    }

    /// Leader election on a Lease with these timings. Acts only after [`Self::renewed`].
    pub fn elected(
        identity: impl Into<String>,
        lease_duration: Duration,
        renew_deadline: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                identity: identity.into(),
                elected: Some(Elected {
                    lease_duration,
                    renew_deadline,
                    renewed: Mutex::new(None),
                }),
            }),
        }
    }

    /// The Lease holder identity this process writes (also recorded with each mail intent).
    pub fn identity(&self) -> &str {
        &self.inner.identity
    }

    /// Records a successful acquire or renew round that **started** at `started` (the start,
    /// not the end: the API server may have applied the write any time in between).
    pub fn renewed(&self, started: Instant) {
        if let Some(elected) = &self.inner.elected {
            let mut renewed = crate::lock(&elected.renewed);
            if renewed.is_none_or(|at| at < started) {
                *renewed = Some(started);
            }
        }
    }

    /// Forgets every renewal: this process no longer leads.
    pub fn lost(&self) {
        if let Some(elected) = &self.inner.elected {
            *crate::lock(&elected.renewed) = None;
        }
    }

    /// True when this process may send now: unelected, or less than the renew deadline has
    /// passed (monotonic clock) since its last successful renewal started.
    pub fn may_act(&self) -> bool {
        self.may_act_at(Instant::now())
    }

    fn may_act_at(&self, now: Instant) -> bool {
        match &self.inner.elected {
            None => true,
            Some(elected) => crate::lock(&elected.renewed)
                .is_some_and(|at| now.saturating_duration_since(at) < elected.renew_deadline),
        }
    }

    /// How long an intent written by another holder may still be acted on by that holder:
    /// lease duration + renew deadline with leader election, zero without (there is no other
    /// replica).
    pub fn handover(&self) -> Duration {
        self.inner
            .elected
            .as_ref()
            .map_or(Duration::ZERO, |e| e.lease_duration + e.renew_deadline)
    }
}

impl capm_mailer::CommitGate for Leadership {
    fn may_commit(&self) -> Result<(), String> {
        // The exactly-once tests freeze the process here: mid-send, before the commit point.
        crate::failpoint::hit("before-commit");
        if self.may_act() {
            Ok(())
        } else {
            Err(format!(
                "{} has not renewed its Lease within the renew deadline",
                self.identity()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unelected_always_acts_and_has_no_handover() {
        let l = Leadership::unelected("me");
        assert!(l.may_act());
        assert_eq!(l.handover(), Duration::ZERO);
        assert_eq!(l.identity(), "me");
    }

    #[test]
    fn elected_acts_only_within_the_renew_deadline_of_the_last_renewal() {
        let l = Leadership::elected("me", Duration::from_secs(15), Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(!l.may_act_at(t0), "never renewed");
        l.renewed(t0);
        assert!(l.may_act_at(t0 + Duration::from_secs(9)));
        assert!(!l.may_act_at(t0 + Duration::from_secs(10)));
        // An older round finishing late does not move the renewal back.
        l.renewed(t0 + Duration::from_secs(5));
        l.renewed(t0 + Duration::from_secs(1));
        assert!(l.may_act_at(t0 + Duration::from_secs(14)));
        assert!(!l.may_act_at(t0 + Duration::from_secs(15)));
        l.lost();
        assert!(!l.may_act_at(t0 + Duration::from_secs(6)));
        assert_eq!(l.handover(), Duration::from_secs(25));
    }

    #[test]
    fn the_commit_gate_is_the_same_check() {
        use capm_mailer::CommitGate;
        assert!(Leadership::unelected("me").may_commit().is_ok());
        let l = Leadership::elected("me", Duration::from_secs(15), Duration::from_secs(10));
        let refused = l.may_commit().unwrap_err();
        assert!(refused.contains("me has not renewed"), "{refused}");
        l.renewed(Instant::now());
        assert!(l.may_commit().is_ok());
        l.lost();
        assert!(l.may_commit().is_err());
    }
}
