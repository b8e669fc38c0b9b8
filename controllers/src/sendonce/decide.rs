//! The send-once decision as a pure function: what is known → what to do next.
//!
//! [`decide`] is called with the facts of one mail (its durable records, this process's standing
//! as leader, the owner's state, what this process remembers of earlier attempts and, after a
//! [`Step::Lookup`], the backend's answer) and returns the one next step. The executor in
//! [`super::execute`] performs the step and asks again; nothing here touches the network.

use std::time::Duration;

use capm_mailer::Lookup;

use super::records::IntentState;

/// Why a send is not started now (not a failure: the reconcile waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Withheld {
    /// This process cannot prove it still leads (no renewal within the renew deadline).
    NotLeading,
    /// The owner is being deleted (or is gone): a request now would be for infrastructure nobody
    /// will use.
    OwnerDeleting,
    /// The backend refused this mail permanently; retried once on a new generation, a new
    /// retry annotation value or a restart.
    PermanentlyRefused,
    /// An earlier attempt failed; the per-object backoff has not run out.
    Backoff(Duration),
}

/// The facts [`decide`] needs about one mail.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    /// A valid sent record exists.
    pub sent: bool,
    /// The valid intent, if any.
    pub intent: Option<IntentFacts>,
    /// This process may act as the leader now.
    pub leading: bool,
    /// For the request mail: the owner is being deleted or gone.
    pub owner_deleting: bool,
    /// Our finalizer is on the object.
    pub has_finalizer: bool,
    /// This process saw the backend refuse this mail permanently at the object's current
    /// generation.
    pub permanently_refused: bool,
    /// Time left of the per-object backoff after a failed attempt (zero: none).
    pub backoff_left: Duration,
    /// The backend's answer to a lookup made for this decision.
    pub lookup: Option<Lookup>,
    /// How long the backend has been answering "not found" for this mail, if it has.
    pub not_found_for: Option<Duration>,
    /// How long "not found" must persist before it is trusted (event stores lag).
    pub lookup_grace: Duration,
}

/// What [`decide`] knows about an intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntentFacts {
    /// What the last attempt is known to have done.
    pub state: IntentState,
    /// How long another holder that wrote this intent may still be acting on it (zero when we
    /// wrote it, or it is older than the hand-over window).
    pub foreign_wait: Duration,
}

/// The one next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A sent record exists: nothing to do.
    Done,
    /// Do not send now.
    Withhold(Withheld),
    /// Write a fresh intent (and our finalizer, and clear any sent record that is not ours) in
    /// one `resourceVersion`-guarded write, then send.
    WriteIntent,
    /// Our finalizer is missing under an existing intent: add it before anything else.
    EnsureFinalizer,
    /// Every earlier attempt was refused: mark the intent `sending` again (guarded write: the
    /// fence), then send.
    Rearm,
    /// Another holder wrote the intent recently and may still be sending: wait this long.
    AwaitHandover(Duration),
    /// The outcome of an earlier attempt is unknown: ask the backend.
    Lookup,
    /// The backend has the mail: record it as sent; do not send.
    RecordFound,
    /// The backend has no record; start trusting that only after the grace period.
    StartLookupGrace(Duration),
    /// The backend still has no record; this much of the grace period is left.
    AwaitLookupGrace(Duration),
    /// The outcome stays unknown and cannot be learnt (or "not found" outlived the grace):
    /// send again with the same Message-Id (counted).
    Resend,
}

/// The next step for one mail. Pure: same facts, same step.
pub fn decide(f: &Facts) -> Step {
    if f.sent {
        return Step::Done;
    }
    if !f.leading {
        return Step::Withhold(Withheld::NotLeading);
    }
    let Some(intent) = f.intent else {
        if f.owner_deleting {
            return Step::Withhold(Withheld::OwnerDeleting);
        }
        return Step::WriteIntent;
    };
    if !f.has_finalizer {
        return Step::EnsureFinalizer;
    }
    match intent.state {
        IntentState::Refused => {
            if f.permanently_refused {
                Step::Withhold(Withheld::PermanentlyRefused)
            } else if f.owner_deleting {
                Step::Withhold(Withheld::OwnerDeleting)
            } else if !f.backoff_left.is_zero() {
                Step::Withhold(Withheld::Backoff(f.backoff_left))
            } else {
                Step::Rearm
            }
        }
        IntentState::Sending => {
            if !intent.foreign_wait.is_zero() {
                return Step::AwaitHandover(intent.foreign_wait);
            }
            match f.lookup {
                None => Step::Lookup,
                Some(Lookup::Accepted { .. }) => Step::RecordFound,
                Some(Lookup::NotFound) => match f.not_found_for {
                    None => Step::StartLookupGrace(f.lookup_grace),
                    Some(d) if d < f.lookup_grace => Step::AwaitLookupGrace(f.lookup_grace - d),
                    Some(_) if !f.backoff_left.is_zero() => {
                        Step::Withhold(Withheld::Backoff(f.backoff_left))
                    }
                    Some(_) => Step::Resend,
                },
                Some(Lookup::Unsupported) if !f.backoff_left.is_zero() => {
                    Step::Withhold(Withheld::Backoff(f.backoff_left))
                }
                Some(Lookup::Unsupported) => Step::Resend,
            }
        }
    }
}

/// How long another holder may still act on an intent it wrote: the hand-over window
/// (`handover`: lease duration + renew deadline) minus the intent's age. Zero when `writer` is
/// this process. The age is the smaller of the one the intent's own time gives (by the
/// writer's clock) and the time since this process first saw the intent (which is never more
/// than the true age): a writer whose clock runs behind cannot shorten the wait, one whose
/// clock runs ahead only lengthens it.
pub fn foreign_wait(
    writer: Option<&str>,
    me: &str,
    age_by_record: Option<Duration>,
    first_seen_ago: Duration,
    handover: Duration,
) -> Duration {
    if writer == Some(me) {
        return Duration::ZERO;
    }
    let age = age_by_record.map_or(first_seen_ago, |a| a.min(first_seen_ago));
    handover.saturating_sub(age)
}

/// Whether deleting an object must send the release ("no longer needed") mail, from what is
/// known about its request mail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The request went out (sent record), or may have (intent `sending`, outcome unknown):
    /// release. A spurious release costs less than infrastructure nobody uses.
    Needed,
    /// No request was ever attempted, or every attempt was refused: nothing to release.
    NotNeeded,
}

/// See [`Release`].
pub fn release_needed(request_sent: bool, request_intent: Option<IntentState>) -> Release {
    match (request_sent, request_intent) {
        (true, _) | (false, Some(IntentState::Sending)) => Release::Needed,
        (false, None | Some(IntentState::Refused)) => Release::NotNeeded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(10);

    fn base() -> Facts {
        Facts {
            sent: false,
            intent: None,
            leading: true,
            owner_deleting: false,
            has_finalizer: true,
            permanently_refused: false,
            backoff_left: Duration::ZERO,
            lookup: None,
            not_found_for: None,
            lookup_grace: GRACE,
        }
    }

    fn with_intent(state: IntentState) -> Facts {
        Facts {
            intent: Some(IntentFacts {
                state,
                foreign_wait: Duration::ZERO,
            }),
            ..base()
        }
    }

    #[test]
    fn a_sent_record_ends_everything_even_when_not_leading() {
        for f in [
            Facts {
                sent: true,
                ..base()
            },
            Facts {
                sent: true,
                leading: false,
                ..with_intent(IntentState::Sending)
            },
            Facts {
                sent: true,
                has_finalizer: false,
                ..with_intent(IntentState::Refused)
            },
        ] {
            assert_eq!(decide(&f), Step::Done);
        }
    }

    #[test]
    fn nothing_is_sent_or_written_without_leading() {
        for f in [
            base(),
            with_intent(IntentState::Sending),
            with_intent(IntentState::Refused),
        ] {
            let f = Facts {
                leading: false,
                ..f
            };
            assert_eq!(decide(&f), Step::Withhold(Withheld::NotLeading));
        }
    }

    #[test]
    fn a_fresh_request_starts_only_while_the_owner_lives() {
        assert_eq!(decide(&base()), Step::WriteIntent);
        let f = Facts {
            owner_deleting: true,
            ..base()
        };
        assert_eq!(decide(&f), Step::Withhold(Withheld::OwnerDeleting));
    }

    #[test]
    fn an_intent_without_our_finalizer_gets_it_first() {
        for state in [IntentState::Sending, IntentState::Refused] {
            let f = Facts {
                has_finalizer: false,
                ..with_intent(state)
            };
            assert_eq!(decide(&f), Step::EnsureFinalizer);
        }
    }

    #[test]
    fn refused_intents_are_rearmed_unless_permanent_owner_deleting_or_backing_off() {
        assert_eq!(decide(&with_intent(IntentState::Refused)), Step::Rearm);
        let f = Facts {
            permanently_refused: true,
            ..with_intent(IntentState::Refused)
        };
        assert_eq!(decide(&f), Step::Withhold(Withheld::PermanentlyRefused));
        let f = Facts {
            owner_deleting: true,
            ..with_intent(IntentState::Refused)
        };
        assert_eq!(decide(&f), Step::Withhold(Withheld::OwnerDeleting));
        let left = Duration::from_secs(3);
        let f = Facts {
            backoff_left: left,
            ..with_intent(IntentState::Refused)
        };
        assert_eq!(decide(&f), Step::Withhold(Withheld::Backoff(left)));
    }

    #[test]
    fn another_holders_recent_intent_is_not_a_crash() {
        let wait = Duration::from_secs(7);
        let mut f = with_intent(IntentState::Sending);
        f.intent = Some(IntentFacts {
            state: IntentState::Sending,
            foreign_wait: wait,
        });
        assert_eq!(decide(&f), Step::AwaitHandover(wait));
        // Even an answer from the backend does not matter until the window has passed.
        f.lookup = Some(Lookup::Unsupported);
        assert_eq!(decide(&f), Step::AwaitHandover(wait));
    }

    #[test]
    fn an_unknown_outcome_is_looked_up_first() {
        assert_eq!(decide(&with_intent(IntentState::Sending)), Step::Lookup);
        let f = Facts {
            lookup: Some(Lookup::Accepted {
                event: "accepted".into(),
            }),
            ..with_intent(IntentState::Sending)
        };
        assert_eq!(decide(&f), Step::RecordFound);
    }

    #[test]
    fn not_found_is_trusted_only_after_the_grace() {
        let nf = Facts {
            lookup: Some(Lookup::NotFound),
            ..with_intent(IntentState::Sending)
        };
        assert_eq!(decide(&nf), Step::StartLookupGrace(GRACE));
        let f = Facts {
            not_found_for: Some(Duration::from_secs(4)),
            ..nf.clone()
        };
        assert_eq!(decide(&f), Step::AwaitLookupGrace(Duration::from_secs(6)));
        let f = Facts {
            not_found_for: Some(GRACE),
            ..nf.clone()
        };
        assert_eq!(decide(&f), Step::Resend);
        let f = Facts {
            not_found_for: Some(GRACE),
            backoff_left: Duration::from_secs(1),
            ..nf
        };
        assert_eq!(
            decide(&f),
            Step::Withhold(Withheld::Backoff(Duration::from_secs(1)))
        );
    }

    #[test]
    fn a_backend_that_cannot_answer_gets_the_same_message_id_again_after_backoff() {
        let f = Facts {
            lookup: Some(Lookup::Unsupported),
            ..with_intent(IntentState::Sending)
        };
        assert_eq!(decide(&f), Step::Resend);
        let f = Facts {
            backoff_left: Duration::from_secs(2),
            ..f
        };
        assert_eq!(
            decide(&f),
            Step::Withhold(Withheld::Backoff(Duration::from_secs(2)))
        );
    }

    #[test]
    fn foreign_wait_takes_the_safer_of_the_record_and_first_sight() {
        let h = Duration::from_secs(25);
        let s = Duration::from_secs;
        assert_eq!(
            foreign_wait(Some("me"), "me", Some(s(1)), s(0), h),
            Duration::ZERO
        );
        // Written 5 s ago by its clock, seen for 30 s: 20 s left.
        assert_eq!(foreign_wait(Some("old"), "me", Some(s(5)), s(30), h), s(20));
        // Written 40 s ago by its clock (a clock behind ours?), seen for 10 s: 15 s left.
        assert_eq!(
            foreign_wait(Some("old"), "me", Some(s(40)), s(10), h),
            s(15)
        );
        assert_eq!(
            foreign_wait(Some("old"), "me", Some(s(40)), s(30), h),
            Duration::ZERO
        );
        // No time recorded (an earlier version's intent): first sight only.
        assert_eq!(foreign_wait(None, "me", None, s(10), h), s(15));
        assert_eq!(
            foreign_wait(Some("old"), "me", Some(s(5)), s(0), Duration::ZERO),
            Duration::ZERO
        );
    }

    #[test]
    fn release_follows_what_may_have_gone_out() {
        assert_eq!(release_needed(true, None), Release::Needed);
        assert_eq!(
            release_needed(true, Some(IntentState::Refused)),
            Release::Needed
        );
        assert_eq!(
            release_needed(false, Some(IntentState::Sending)),
            Release::Needed
        );
        assert_eq!(
            release_needed(false, Some(IntentState::Refused)),
            Release::NotNeeded
        );
        assert_eq!(release_needed(false, None), Release::NotNeeded);
    }
}
