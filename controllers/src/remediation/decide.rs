//! The remediation's decision as a pure function: what is known of the object, its Machine, its
//! mails and the clock → the one next thing to do (docs/proposals/remediation-by-mail.md, the
//! state table). [`decide`] touches nothing; the reconcile performs the answer and asks again.

use std::time::Duration;

use capm_api::v1beta1::{AnswerResult, HandBackReason, RemediationPhase, Unfulfilled};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::sendonce::Which;

/// What is believed about the object's Machine (nothing the object says: the live Machine).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MachineView {
    /// No Machine of the object's name whose UID is the object's Machine ownerReference (a
    /// hand-made object, or one whose Machine was replaced since): why, for the status.
    NotBelieved(String),
    /// The Machine's Cluster is paused.
    Paused,
    /// The object's Machine.
    Believed {
        /// Its own `HealthCheckSucceeded` is `False`.
        unhealthy: bool,
        /// Its `MailgunMachine` has a `providerID`: somebody built it.
        fulfilled: bool,
    },
}

/// What is known of one mail, from its durable record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mail {
    /// No record: never attempted.
    None,
    /// Every attempt was refused before the backend accepted anything: it never went out.
    Refused,
    /// Refused, and this process saw the backend refuse it for good at the object's current
    /// attempt (generation, retry annotation): not tried again now.
    GivenUp,
    /// An intent without a sent record: it may have gone out (the send-once layer settles it).
    Pending,
    /// Accepted by the backend at this time.
    Sent(Timestamp),
}

impl Mail {
    /// It went out, or may have.
    fn may_have_gone_out(self) -> bool {
        matches!(self, Self::Pending | Self::Sent(_))
    }
}

/// What the MachineHealthCheck that selects the Machine says of remediation now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Brake {
    /// Not asked yet (asked only when a timed hand-back is due).
    Unknown,
    /// `RemediationAllowed` is not `False` (or no health check selects the Machine).
    Released,
    /// `RemediationAllowed=False`: `maxUnhealthy`/`unhealthyRange` is exceeded.
    Held,
}

/// The strategy, its durations parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strategy {
    pub answer_timeout: Duration,
    pub reminders: u8,
    pub repair_timeout: Duration,
    pub unfulfilled: Unfulfilled,
}

/// Everything [`decide`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    pub machine: MachineView,
    pub strategy: Strategy,
    /// The answer, and when the provider first saw it.
    pub answer: Option<(AnswerResult, Timestamp)>,
    /// The repair mail (the object's request mail).
    pub repair: Mail,
    /// Reminders 1 to `strategy.reminders`, in order.
    pub reminders: Vec<Mail>,
    /// The "no longer needed" mail.
    pub no_longer_needed: Mail,
    /// Our status says the Machine was handed back.
    pub handed_back: bool,
    pub brake: Brake,
    /// The object is being deleted (by the MachineHealthCheck: the Machine is healthy again,
    /// or by the garbage collector: the Machine is gone).
    pub deleting: bool,
    pub now: Timestamp,
}

/// The one next thing to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Not believed, or nothing asked of anyone yet: phase `Pending`, no mail. The message
    /// says why.
    Pending(String),
    /// The Machine was never built and the strategy says `Wait`: no mail, no hand-back.
    WaitForFulfilment,
    /// Send this mail (at most once: through the send-once layer), then decide again.
    Send(Which),
    /// Nothing until `until` (or a change): the phase to show.
    Wait {
        phase: RemediationPhase,
        until: Timestamp,
    },
    /// Nothing until something changes (the MachineHealthCheck deletes the object, the
    /// cluster is unpaused); the phase stays what it was, or this one when there was none.
    Idle(RemediationPhase),
    /// A timed hand-back is due: ask the MachineHealthCheck whether it allows remediation, and
    /// decide again.
    CheckBrake(HandBackReason),
    /// A timed hand-back waits while the MachineHealthCheck allows no remediation.
    Hold(HandBackReason),
    /// Hand the Machine back to its owner now (`OwnerRemediated=False`; never a mail).
    HandBack {
        reason: HandBackReason,
        /// Held by the brake (a timer's decision), as opposed to a human's or the strategy's.
        timed: bool,
    },
    /// Handed back already: nothing more, ever.
    HandedBack,
    /// Being deleted and no mail is owed (any more): remove our finalizer.
    Release,
}

/// The next thing to do for one remediation. Pure: same facts, same answer.
pub fn decide(f: &Facts) -> Next {
    if f.deleting {
        return on_deletion(f);
    }
    let (unhealthy, fulfilled) = match &f.machine {
        MachineView::NotBelieved(why) => return Next::Pending(why.clone()),
        MachineView::Paused if f.repair == Mail::None => {
            return Next::Pending("the Machine's Cluster is paused".into());
        }
        MachineView::Paused => return Next::Idle(RemediationPhase::WaitingForAnswer),
        MachineView::Believed {
            unhealthy,
            fulfilled,
        } => (*unhealthy, *fulfilled),
    };
    if f.handed_back {
        return Next::HandedBack;
    }
    match f.answer {
        Some((AnswerResult::CannotRepair, _)) => {
            return Next::HandBack {
                reason: HandBackReason::CannotRepair,
                timed: false,
            };
        }
        Some((AnswerResult::Repaired, _)) if !unhealthy => {
            return Next::Idle(RemediationPhase::WaitingForRepair);
        }
        Some((AnswerResult::Repaired, at)) => {
            let until = after(at, f.strategy.repair_timeout);
            if f.now < until {
                return Next::Wait {
                    phase: RemediationPhase::WaitingForRepair,
                    until,
                };
            }
            return timed(f, HandBackReason::RepairTimedOut);
        }
        None => {}
    }
    if !unhealthy {
        return match f.repair {
            Mail::None | Mail::Refused | Mail::GivenUp => {
                Next::Pending("the Machine is not unhealthy".into())
            }
            Mail::Pending | Mail::Sent(_) => Next::Idle(RemediationPhase::WaitingForAnswer),
        };
    }
    if f.repair == Mail::None && !fulfilled {
        return match f.strategy.unfulfilled {
            Unfulfilled::Wait => Next::WaitForFulfilment,
            Unfulfilled::GiveUp => Next::HandBack {
                reason: HandBackReason::NotFulfilled,
                timed: false,
            },
        };
    }
    let mut last = match f.repair {
        Mail::Sent(at) => at,
        Mail::None | Mail::Refused | Mail::GivenUp | Mail::Pending => {
            return Next::Send(Which::Request);
        }
    };
    let due = usize::from(f.strategy.reminders);
    for (n, reminder) in (1..).zip(f.reminders.iter().take(due)) {
        // When this reminder is due, and when the answer it asks for would be late.
        let (due_at, late_at) = (
            after(last, f.strategy.answer_timeout),
            after(last, f.strategy.answer_timeout.saturating_mul(2)),
        );
        match *reminder {
            Mail::Sent(at) => last = at,
            // An attempt under way is finished whatever the clock says.
            Mail::Pending => return Next::Send(Which::Reminder(n)),
            // A reminder that cannot go out does not hold the flow: it is tried (refused for
            // a while: with backoff) until the answer it waited for would have been late, then
            // counted as gone out when it was due.
            Mail::Refused if f.now < late_at => return Next::Send(Which::Reminder(n)),
            Mail::GivenUp if f.now < late_at => return waiting_for_answer(late_at),
            Mail::Refused | Mail::GivenUp => last = due_at,
            Mail::None => {
                return if f.now < due_at {
                    waiting_for_answer(due_at)
                } else {
                    Next::Send(Which::Reminder(n))
                };
            }
        }
    }
    let until = after(last, f.strategy.answer_timeout);
    if f.now < until {
        return waiting_for_answer(until);
    }
    timed(f, HandBackReason::NoAnswer)
}

/// During deletion: the "no longer needed" mail when a repair mail went out (or may have) and
/// nobody answered nor was the Machine handed back; then our finalizer goes.
fn on_deletion(f: &Facts) -> Next {
    let owed = f.repair.may_have_gone_out() && f.answer.is_none() && !f.handed_back;
    if owed && !matches!(f.no_longer_needed, Mail::Sent(_)) {
        Next::Send(Which::Deletion)
    } else {
        Next::Release
    }
}

/// A timed hand-back: through the brake.
fn timed(f: &Facts, reason: HandBackReason) -> Next {
    match f.brake {
        Brake::Unknown => Next::CheckBrake(reason),
        Brake::Held => Next::Hold(reason),
        Brake::Released => Next::HandBack {
            reason,
            timed: true,
        },
    }
}

fn waiting_for_answer(until: Timestamp) -> Next {
    Next::Wait {
        phase: RemediationPhase::WaitingForAnswer,
        until,
    }
}

/// `at` + `d`, saturating at the end of time.
fn after(at: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|d| at.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

/// The phase a [`Next`] shows (`None`: the one the object had).
pub fn phase(next: &Next) -> Option<RemediationPhase> {
    Some(match next {
        Next::Pending(_) => RemediationPhase::Pending,
        Next::WaitForFulfilment => RemediationPhase::WaitingForFulfilment,
        Next::Send(Which::Request | Which::Reminder(_)) => RemediationPhase::WaitingForAnswer,
        Next::Send(Which::Deletion) => RemediationPhase::NoLongerNeeded,
        Next::Wait { phase, .. } => *phase,
        Next::Hold(_) => RemediationPhase::HandBackHeld,
        Next::HandBack { .. } | Next::HandedBack => RemediationPhase::HandedBack,
        Next::Idle(_) | Next::CheckBrake(_) | Next::Release => return None,
    })
}

/// A Go duration as the CRD's pattern allows it (`24h`, `1h30m`, `1.5h`, `90s`, `500ms`), to
/// the millisecond.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut millis = 0f64;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&i| i > 0)?;
        let value: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let (unit, scale) = [
            ("ms", 1.0),
            ("h", 3_600_000.0),
            ("m", 60_000.0),
            ("s", 1000.0),
        ]
        .into_iter()
        .find(|(unit, _)| rest.starts_with(unit))?;
        millis += value * scale;
        rest = &rest[unit.len()..];
    }
    Duration::try_from_secs_f64(millis.round() / 1000.0).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(3600);

    fn at(minutes: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + minutes * 60).unwrap()
    }

    fn believed() -> MachineView {
        MachineView::Believed {
            unhealthy: true,
            fulfilled: true,
        }
    }

    /// A believed, unhealthy, built Machine, nothing mailed, one reminder allowed, at minute 0.
    fn base() -> Facts {
        Facts {
            machine: believed(),
            strategy: Strategy {
                answer_timeout: T,
                reminders: 1,
                repair_timeout: Duration::from_secs(600),
                unfulfilled: Unfulfilled::Wait,
            },
            answer: None,
            repair: Mail::None,
            reminders: vec![Mail::None],
            no_longer_needed: Mail::None,
            handed_back: false,
            brake: Brake::Unknown,
            deleting: false,
            now: at(0),
        }
    }

    fn wait(phase: RemediationPhase, until: Timestamp) -> Next {
        Next::Wait { phase, until }
    }

    /// The design's state table, row by row: (what, facts, next).
    #[test]
    fn the_state_table() {
        use HandBackReason::*;
        use RemediationPhase::*;
        let unfulfilled = |unfulfilled| Facts {
            machine: MachineView::Believed {
                unhealthy: true,
                fulfilled: false,
            },
            strategy: Strategy {
                unfulfilled,
                ..base().strategy
            },
            ..base()
        };
        let mailed = Facts {
            repair: Mail::Sent(at(0)),
            now: at(10),
            ..base()
        };
        let reminded = Facts {
            reminders: vec![Mail::Sent(at(60))],
            now: at(70),
            ..mailed.clone()
        };
        let repaired = Facts {
            answer: Some((AnswerResult::Repaired, at(20))),
            now: at(25),
            ..mailed.clone()
        };
        let rows: Vec<(&str, Facts, Next)> = vec![
            (
                "a hand-made object (wrong owner UID)",
                Facts {
                    machine: MachineView::NotBelieved("not its Machine".into()),
                    ..base()
                },
                Next::Pending("not its Machine".into()),
            ),
            (
                "a stale object (its Machine replaced since) after its mails",
                Facts {
                    machine: MachineView::NotBelieved("replaced".into()),
                    ..reminded.clone()
                },
                Next::Pending("replaced".into()),
            ),
            (
                "a healthy Machine",
                Facts {
                    machine: MachineView::Believed {
                        unhealthy: false,
                        fulfilled: true,
                    },
                    ..base()
                },
                Next::Pending("the Machine is not unhealthy".into()),
            ),
            (
                "a paused cluster before any mail",
                Facts {
                    machine: MachineView::Paused,
                    ..base()
                },
                Next::Pending("the Machine's Cluster is paused".into()),
            ),
            (
                "never built, Wait",
                unfulfilled(Unfulfilled::Wait),
                Next::WaitForFulfilment,
            ),
            (
                "never built, GiveUp: at once, not held",
                Facts {
                    brake: Brake::Held,
                    ..unfulfilled(Unfulfilled::GiveUp)
                },
                Next::HandBack {
                    reason: NotFulfilled,
                    timed: false,
                },
            ),
            ("built: the repair mail", base(), Next::Send(Which::Request)),
            (
                "a repair mail under way is finished",
                Facts {
                    repair: Mail::Pending,
                    ..base()
                },
                Next::Send(Which::Request),
            ),
            (
                "mailed: waiting for an answer",
                mailed.clone(),
                wait(WaitingForAnswer, at(60)),
            ),
            (
                "answerTimeout after the repair mail: reminder 1",
                Facts {
                    now: at(60),
                    ..mailed.clone()
                },
                Next::Send(Which::Reminder(1)),
            ),
            (
                "after the reminder: waiting again",
                reminded.clone(),
                wait(WaitingForAnswer, at(120)),
            ),
            (
                "answerTimeout after the last reminder: a timed hand-back, the brake asked",
                Facts {
                    now: at(120),
                    ..reminded.clone()
                },
                Next::CheckBrake(NoAnswer),
            ),
            (
                "no answer, the brake released",
                Facts {
                    now: at(120),
                    brake: Brake::Released,
                    ..reminded.clone()
                },
                Next::HandBack {
                    reason: NoAnswer,
                    timed: true,
                },
            ),
            (
                "no answer, RemediationAllowed=False: held",
                Facts {
                    now: at(500),
                    brake: Brake::Held,
                    ..reminded.clone()
                },
                Next::Hold(NoAnswer),
            ),
            (
                "CannotRepair: at once, not held",
                Facts {
                    answer: Some((AnswerResult::CannotRepair, at(5))),
                    brake: Brake::Held,
                    ..mailed.clone()
                },
                Next::HandBack {
                    reason: CannotRepair,
                    timed: false,
                },
            ),
            (
                "Repaired: waiting for the repair",
                repaired.clone(),
                wait(WaitingForRepair, at(30)),
            ),
            (
                "Repaired and healthy: the MachineHealthCheck deletes the object",
                Facts {
                    machine: MachineView::Believed {
                        unhealthy: false,
                        fulfilled: true,
                    },
                    now: at(500),
                    ..repaired.clone()
                },
                Next::Idle(WaitingForRepair),
            ),
            (
                "Repaired, still unhealthy after repairTimeout",
                Facts {
                    now: at(30),
                    brake: Brake::Released,
                    ..repaired.clone()
                },
                Next::HandBack {
                    reason: RepairTimedOut,
                    timed: true,
                },
            ),
            (
                "repair timed out, RemediationAllowed=False: held",
                Facts {
                    now: at(30),
                    brake: Brake::Held,
                    ..repaired.clone()
                },
                Next::Hold(RepairTimedOut),
            ),
            (
                "handed back: nothing more",
                Facts {
                    handed_back: true,
                    now: at(900),
                    ..reminded.clone()
                },
                Next::HandedBack,
            ),
            (
                "healthy again before an answer: wait for the deletion, no reminder",
                Facts {
                    machine: MachineView::Believed {
                        unhealthy: false,
                        fulfilled: true,
                    },
                    now: at(500),
                    ..mailed.clone()
                },
                Next::Idle(WaitingForAnswer),
            ),
            (
                "deleted before an answer: no longer needed",
                Facts {
                    deleting: true,
                    ..mailed.clone()
                },
                Next::Send(Which::Deletion),
            ),
            (
                "deleted when the repair mail may have gone out",
                Facts {
                    deleting: true,
                    repair: Mail::Pending,
                    ..base()
                },
                Next::Send(Which::Deletion),
            ),
            (
                "deleted, no longer needed sent",
                Facts {
                    deleting: true,
                    no_longer_needed: Mail::Sent(at(11)),
                    ..mailed.clone()
                },
                Next::Release,
            ),
            (
                "deleted after an answer: no mail",
                Facts {
                    deleting: true,
                    ..repaired.clone()
                },
                Next::Release,
            ),
            (
                "deleted after a hand-back: no mail",
                Facts {
                    deleting: true,
                    handed_back: true,
                    ..mailed.clone()
                },
                Next::Release,
            ),
            (
                "deleted, never mailed (or every attempt refused)",
                Facts {
                    deleting: true,
                    repair: Mail::Refused,
                    ..base()
                },
                Next::Release,
            ),
        ];
        for (what, facts, next) in rows {
            assert_eq!(decide(&facts), next, "{what}");
        }
    }

    #[test]
    fn reminders_follow_each_answer_timeout_up_to_the_strategy() {
        let mut f = Facts {
            repair: Mail::Sent(at(0)),
            strategy: Strategy {
                reminders: 3,
                ..base().strategy
            },
            reminders: vec![Mail::None; 3],
            ..base()
        };
        for n in 1..=3u8 {
            let previous = i64::from(n - 1) * 60;
            f.now = at(previous + 59);
            assert_eq!(
                decide(&f),
                wait(RemediationPhase::WaitingForAnswer, at(previous + 60))
            );
            f.now = at(previous + 60);
            assert_eq!(decide(&f), Next::Send(Which::Reminder(n)));
            f.reminders[usize::from(n - 1)] = Mail::Sent(at(previous + 60));
        }
        f.now = at(240);
        assert_eq!(decide(&f), Next::CheckBrake(HandBackReason::NoAnswer));
        // Without reminders: the hand-back follows the repair mail's timeout.
        let none = Facts {
            strategy: Strategy {
                reminders: 0,
                ..base().strategy
            },
            reminders: vec![],
            repair: Mail::Sent(at(0)),
            now: at(60),
            ..base()
        };
        assert_eq!(decide(&none), Next::CheckBrake(HandBackReason::NoAnswer));
    }

    /// A reminder the backend refuses (for good, or for its whole wait) does not hold the
    /// hand-back: it is counted as gone out when it was due.
    #[test]
    fn a_refused_reminder_does_not_hold_the_hand_back() {
        use HandBackReason::NoAnswer;
        let refused = |mail, minute| Facts {
            repair: Mail::Sent(at(0)),
            reminders: vec![mail],
            now: at(minute),
            ..base()
        };
        let late = || wait(RemediationPhase::WaitingForAnswer, at(120));
        for (what, facts, next) in [
            (
                "refused, within its wait: tried again",
                refused(Mail::Refused, 90),
                Next::Send(Which::Reminder(1)),
            ),
            (
                "refused for good: the wait runs out",
                refused(Mail::GivenUp, 61),
                late(),
            ),
            (
                "refused for its whole wait: the hand-back",
                refused(Mail::Refused, 120),
                Next::CheckBrake(NoAnswer),
            ),
            (
                "refused for good, its wait over: the hand-back",
                Facts {
                    brake: Brake::Released,
                    ..refused(Mail::GivenUp, 120)
                },
                Next::HandBack {
                    reason: NoAnswer,
                    timed: true,
                },
            ),
            (
                "refused for good, its wait over: the next reminder",
                Facts {
                    strategy: Strategy {
                        reminders: 2,
                        ..base().strategy
                    },
                    reminders: vec![Mail::GivenUp, Mail::None],
                    ..refused(Mail::GivenUp, 120)
                },
                Next::Send(Which::Reminder(2)),
            ),
            (
                "the next reminder's wait counts from the refused one's due time",
                Facts {
                    strategy: Strategy {
                        reminders: 2,
                        ..base().strategy
                    },
                    reminders: vec![Mail::Refused, Mail::Sent(at(125))],
                    ..refused(Mail::Refused, 150)
                },
                wait(RemediationPhase::WaitingForAnswer, at(185)),
            ),
        ] {
            assert_eq!(decide(&facts), next, "{what}");
        }
    }

    #[test]
    fn an_answer_is_never_followed_by_a_mail() {
        for answer in [AnswerResult::Repaired, AnswerResult::CannotRepair] {
            for now in [at(0), at(59), at(61), at(1000)] {
                let f = Facts {
                    answer: Some((answer, at(1))),
                    repair: Mail::Sent(at(0)),
                    brake: Brake::Released,
                    now,
                    ..base()
                };
                assert!(!matches!(decide(&f), Next::Send(_)), "{answer:?} at {now}");
            }
        }
    }

    #[test]
    fn phases_shown() {
        assert_eq!(
            phase(&Next::Send(Which::Reminder(2))),
            Some(RemediationPhase::WaitingForAnswer)
        );
        assert_eq!(
            phase(&Next::Hold(HandBackReason::NoAnswer)),
            Some(RemediationPhase::HandBackHeld)
        );
        assert_eq!(phase(&Next::Release), None);
    }

    #[test]
    fn go_durations() {
        let s = Duration::from_secs;
        for (text, d) in [
            ("24h", Some(s(86_400))),
            ("1h30m", Some(s(5400))),
            ("90m", Some(s(5400))),
            ("1.5h", Some(s(5400))),
            ("45s", Some(s(45))),
            ("500ms", Some(Duration::from_millis(500))),
            ("1m", Some(s(60))),
            ("", None),
            ("h", None),
            ("10", None),
            ("10d", None),
            ("-1h", None),
        ] {
            assert_eq!(parse_duration(text), d, "{text}");
        }
    }
}
