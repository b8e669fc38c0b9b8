//! The mail ledger: what the mail servers received, judged per object. Built only from the
//! servers' own records (the Message-Id of each stored message, in arrival order) and from which
//! of our objects still exist; never from the provider's annotations or status. The soak test
//! and the ClusterClass and sharding tests judge their mail with it. The mails of a
//! `MailgunRemediation` (issue 56: its repair mail, reminders and "no longer needed" mail) are
//! kept apart, per object ([`Ledger::repairs`]): they follow other rules than a request and its
//! release ([`Ledger::check_repairs`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

/// Which of our kinds a Message-Id names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `MailgunCluster`.
    Cluster,
    /// `MailgunMachine`.
    Machine,
}

impl Kind {
    /// The Kubernetes kind.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cluster => "MailgunCluster",
            Self::Machine => "MailgunMachine",
        }
    }

    /// The `controller` label of the provider's metrics for this kind.
    pub fn controller(self) -> &'static str {
        match self {
            Self::Cluster => "mailguncluster",
            Self::Machine => "mailgunmachine",
        }
    }

    /// Both kinds.
    pub const ALL: [Kind; 2] = [Kind::Cluster, Kind::Machine];
}

/// Which mail of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Which {
    /// The request mail (`capm_api::names::message_id`).
    Request,
    /// The "no longer needed" mail (`capm_api::names::deletion_message_id`).
    Release,
}

/// The mail backend a lane uses: it decides which duplicates can be legitimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Mailgun's HTTP API: the provider can ask whether a Message-Id was accepted, so a
    /// duplicate is always a violation.
    Mailgun,
    /// SMTP: a resend with the same Message-Id after an unknown outcome is allowed when the
    /// provider counted it (`capm_mail_resends_total`).
    Smtp,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Mailgun => "mailgun",
            Self::Smtp => "smtp",
        })
    }
}

/// One object's identity.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Object {
    /// Its kind.
    pub kind: Kind,
    /// Its UID.
    pub uid: String,
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind.name(), self.uid)
    }
}

/// Reads a Message-Id of ours: `<kind.uid@domain>` (request) or `<kind-deleted.uid@domain>`
/// (release), as `capm_api::names` makes them.
pub fn parse_message_id(id: &str, domain: &str) -> Option<(Object, Which)> {
    let inner = id.trim().strip_prefix('<')?.strip_suffix('>')?;
    let local = inner.strip_suffix(domain)?.strip_suffix('@')?;
    let (kind, uid) = local.split_once('.')?;
    let (kind, which) = match kind {
        "mailguncluster" => (Kind::Cluster, Which::Request),
        "mailgunmachine" => (Kind::Machine, Which::Request),
        "mailguncluster-deleted" => (Kind::Cluster, Which::Release),
        "mailgunmachine-deleted" => (Kind::Machine, Which::Release),
        _ => return None,
    };
    (!uid.is_empty()).then(|| {
        (
            Object {
                kind,
                uid: uid.to_owned(),
            },
            which,
        )
    })
}

/// Which mail of a `MailgunRemediation` (issue 56).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RepairMail {
    /// The repair mail (`capm_api::names::message_id` of the kind).
    Repair,
    /// Reminder `n` (`capm_api::names::reminder_message_id`), threaded to the repair mail.
    Reminder(u8),
    /// The "no longer needed" mail (`capm_api::names::deletion_message_id` of the kind).
    NoLongerNeeded,
}

/// Reads a Message-Id of a `MailgunRemediation`'s mail: `<mailgunremediation.uid@domain>`,
/// `<mailgunremediation-reminder-n.uid@domain>` or `<mailgunremediation-deleted.uid@domain>`.
/// Returns the object's UID and which mail.
pub fn parse_repair_message_id(id: &str, domain: &str) -> Option<(String, RepairMail)> {
    let inner = id.trim().strip_prefix('<')?.strip_suffix('>')?;
    let local = inner.strip_suffix(domain)?.strip_suffix('@')?;
    let (kind, uid) = local.split_once('.')?;
    let which = match kind.strip_prefix("mailgunremediation")? {
        "" => RepairMail::Repair,
        "-deleted" => RepairMail::NoLongerNeeded,
        reminder => RepairMail::Reminder(reminder.strip_prefix("-reminder-")?.parse().ok()?),
    };
    (!uid.is_empty()).then(|| (uid.to_owned(), which))
}

/// A mail as a server stored it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Position in the server's store (arrival order).
    pub seq: usize,
    /// The Message-Id header as stored.
    pub message_id: String,
    /// The subject, for reports.
    pub subject: String,
}

/// What the ledger knows of one object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    /// Arrival positions of its request mails.
    pub requests: Vec<usize>,
    /// Arrival positions of its release mails.
    pub releases: Vec<usize>,
    /// A subject seen, for reports.
    pub subject: String,
}

/// The ledger of one lane (one backend).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    /// Which backend received these.
    pub backend: Backend,
    /// Per object, in UID order.
    pub entries: BTreeMap<Object, Entry>,
    /// The mails of each `MailgunRemediation`, by its UID, in arrival order: (arrival position,
    /// which mail).
    pub repairs: BTreeMap<String, Vec<(usize, RepairMail)>>,
    /// Mails whose Message-Id is not one of ours.
    pub foreign: Vec<Received>,
}

impl Ledger {
    /// Builds the ledger from everything one server stored.
    pub fn build(backend: Backend, domain: &str, mails: &[Received]) -> Self {
        let mut entries: BTreeMap<Object, Entry> = BTreeMap::new();
        let mut foreign = Vec::new();
        let mut repairs: BTreeMap<String, Vec<(usize, RepairMail)>> = BTreeMap::new();
        for mail in mails {
            if let Some((uid, which)) = parse_repair_message_id(&mail.message_id, domain) {
                repairs.entry(uid).or_default().push((mail.seq, which));
                continue;
            }
            match parse_message_id(&mail.message_id, domain) {
                Some((object, which)) => {
                    let entry = entries.entry(object).or_default();
                    match which {
                        Which::Request => entry.requests.push(mail.seq),
                        Which::Release => entry.releases.push(mail.seq),
                    }
                    if entry.subject.is_empty() || which == Which::Request {
                        entry.subject.clone_from(&mail.subject);
                    }
                }
                None => foreign.push(mail.clone()),
            }
        }
        Self {
            backend,
            entries,
            repairs,
            foreign,
        }
    }

    /// How many copies of `which` mail of the `MailgunRemediation` `uid` arrived.
    pub fn repair_mails(&self, uid: &str, which: RepairMail) -> usize {
        self.repairs
            .get(uid)
            .map_or(0, |mails| mails.iter().filter(|(_, w)| *w == which).count())
    }

    /// Whether a request mail of `object` was accepted.
    pub fn requested(&self, object: &Object) -> bool {
        self.entries
            .get(object)
            .is_some_and(|e| !e.requests.is_empty())
    }

    /// Copies of one Message-Id beyond the first, per kind (raw duplicates).
    pub fn extra_copies(&self) -> BTreeMap<Kind, usize> {
        let mut out = BTreeMap::new();
        for (object, entry) in &self.entries {
            let extra =
                entry.requests.len().saturating_sub(1) + entry.releases.len().saturating_sub(1);
            *out.entry(object.kind).or_insert(0) += extra;
        }
        out
    }

    /// Judges the ledger. `live` are the objects that exist and are not being deleted,
    /// `pending` those still being deleted (their release is not judged yet: a paused
    /// `Cluster` holds them), `resends` the provider's `capm_mail_resends_total` per kind,
    /// summed over every process of the lane (each read before it was killed and at the end).
    pub fn check(
        &self,
        live: &BTreeSet<Object>,
        pending: &BTreeSet<Object>,
        resends: &BTreeMap<Kind, u64>,
    ) -> Vec<Violation> {
        let mut out = Vec::new();
        for mail in &self.foreign {
            out.push(Violation::Foreign(mail.clone()));
        }
        for (object, entry) in &self.entries {
            let v = |rule| Violation::Object {
                rule,
                object: object.clone(),
                entry: entry.clone(),
            };
            if self.backend == Backend::Mailgun && entry.requests.len() > 1 {
                out.push(v(Rule::DuplicateRequest));
            }
            if self.backend == Backend::Mailgun && entry.releases.len() > 1 {
                out.push(v(Rule::DuplicateRelease));
            }
            if !entry.releases.is_empty() {
                match entry.requests.first() {
                    None => out.push(v(Rule::ReleaseWithoutRequest)),
                    Some(first) if entry.releases[0] < *first => {
                        out.push(v(Rule::ReleaseBeforeRequest));
                    }
                    Some(_) => {}
                }
                if live.contains(object) {
                    out.push(v(Rule::ReleaseOfLiveObject));
                }
            }
            if !entry.requests.is_empty()
                && entry.releases.is_empty()
                && !live.contains(object)
                && !pending.contains(object)
            {
                out.push(v(Rule::MissingRelease));
            }
        }
        if self.backend == Backend::Smtp {
            let extra = self.extra_copies();
            for kind in Kind::ALL {
                let extra = extra.get(&kind).copied().unwrap_or(0);
                let counted = resends.get(&kind).copied().unwrap_or(0);
                if extra as u64 > counted {
                    let duplicated = self
                        .entries
                        .iter()
                        .filter(|(o, e)| {
                            o.kind == kind && (e.requests.len() > 1 || e.releases.len() > 1)
                        })
                        .map(|(o, e)| (o.clone(), e.clone()))
                        .collect();
                    out.push(Violation::UnaccountedResends {
                        kind,
                        extra,
                        counted,
                        duplicated,
                    });
                }
            }
        }
        out
    }
}

/// What the soak knows of one `MailgunRemediation` it made, for [`Ledger::check_repairs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairFacts {
    /// The reminders its strategy allows.
    pub reminders: u8,
    /// Its Machine was never built (no `providerID`): no mail is owed, ever.
    pub unbuilt: bool,
    /// When a human answered, or the health check deleted the object: the mails whose records
    /// the object carried then (each may still arrive: its attempt was under way). Nothing else
    /// may come after, but the "no longer needed" mail of an unanswered deletion (in the list
    /// then).
    pub cut: Option<Vec<RepairMail>>,
}

/// A broken rule of a `MailgunRemediation`'s mails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairViolation {
    /// The object's UID.
    pub uid: String,
    /// What is wrong.
    pub rule: &'static str,
    /// Its mails, in arrival order.
    pub mails: Vec<(usize, RepairMail)>,
}

impl fmt::Display for RepairViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: MailgunRemediation {}: mails (arrival, which) {:?}",
            self.rule, self.uid, self.mails
        )
    }
}

impl Ledger {
    /// Judges the mails of the `MailgunRemediation`s the soak made (`made`, by UID): each of
    /// its mails at most once (SMTP: copies beyond the first within the provider's counted
    /// `resends` of the kind, over all objects), in the flow's order (a reminder after the
    /// repair mail and the reminder before it, the "no longer needed" mail after the repair
    /// mail), no reminder beyond the strategy's, no mail for a Machine never built, none after
    /// the cut but those under way then; and no remediation mail of an object it did not make.
    pub fn check_repairs(
        &self,
        made: &BTreeMap<String, RepairFacts>,
        resends: u64,
    ) -> Vec<RepairViolation> {
        let mut out = Vec::new();
        let mut extra = 0u64;
        for (uid, mails) in &self.repairs {
            let mut broken = |rule| {
                out.push(RepairViolation {
                    uid: uid.clone(),
                    rule,
                    mails: mails.clone(),
                });
            };
            let Some(facts) = made.get(uid) else {
                broken("UnknownRemediation");
                continue;
            };
            let first =
                |which: RepairMail| mails.iter().find(|(_, w)| *w == which).map(|(seq, _)| *seq);
            let copies = |which: RepairMail| mails.iter().filter(|(_, w)| *w == which).count();
            let kinds: BTreeSet<RepairMail> = mails.iter().map(|(_, w)| *w).collect();
            for which in &kinds {
                let n = copies(*which) as u64;
                extra += n - 1;
                if n > 1 && self.backend == Backend::Mailgun {
                    broken("DuplicateRepairMail");
                }
            }
            if facts.unbuilt && !mails.is_empty() {
                broken("MailForUnbuiltMachine");
            }
            let repair = first(RepairMail::Repair);
            for which in &kinds {
                let before = match which {
                    RepairMail::Repair => continue,
                    RepairMail::Reminder(n) if *n > facts.reminders => {
                        broken("ReminderBeyondStrategy");
                        continue;
                    }
                    RepairMail::Reminder(1) | RepairMail::NoLongerNeeded => repair,
                    RepairMail::Reminder(n) => first(RepairMail::Reminder(n - 1)),
                };
                let at = first(*which);
                let in_order = match which {
                    // The "no longer needed" mail is owed when the repair mail may have gone
                    // out: after a crash its attempt may never have reached the server.
                    RepairMail::NoLongerNeeded => before.is_none_or(|b| Some(b) < at),
                    _ => before.is_some_and(|b| Some(b) < at),
                };
                if !in_order {
                    broken("RepairMailOutOfOrder");
                }
            }
            if let Some(cut) = &facts.cut
                && kinds.iter().any(|w| !cut.contains(w))
            {
                broken("MailAfterTheCut");
            }
        }
        if self.backend == Backend::Smtp && extra > resends {
            out.push(RepairViolation {
                uid: format!("(all: {extra} extra copies, {resends} resends counted)"),
                rule: "UnaccountedRepairResends",
                mails: Vec::new(),
            });
        }
        out
    }
}

/// Which per-object rule was broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Mailgun accepted the request mail more than once.
    DuplicateRequest,
    /// Mailgun accepted the release mail more than once.
    DuplicateRelease,
    /// A release mail for an object whose request mail was never accepted.
    ReleaseWithoutRequest,
    /// The release mail arrived before the request mail.
    ReleaseBeforeRequest,
    /// A release mail for an object that still exists (and is not being deleted).
    ReleaseOfLiveObject,
    /// The object is gone, its request was accepted, and no release mail came.
    MissingRelease,
}

/// A broken ledger rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A per-object rule.
    Object {
        /// Which.
        rule: Rule,
        /// The object.
        object: Object,
        /// Its mails.
        entry: Entry,
    },
    /// More SMTP copies of one kind's Message-Ids than the provider counted resends.
    UnaccountedResends {
        /// The kind.
        kind: Kind,
        /// Copies beyond the first, over all Message-Ids of that kind.
        extra: usize,
        /// `capm_mail_resends_total` of that kind's controller.
        counted: u64,
        /// The objects with more than one copy of a mail.
        duplicated: Vec<(Object, Entry)>,
    },
    /// A mail whose Message-Id is not one of ours.
    Foreign(Received),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Object {
                rule,
                object,
                entry,
            } => write!(
                f,
                "{rule:?}: {object} ({:?}): request mails at {:?}, release mails at {:?}",
                entry.subject, entry.requests, entry.releases
            ),
            Self::UnaccountedResends {
                kind,
                extra,
                counted,
                duplicated,
            } => {
                write!(
                    f,
                    "UnaccountedResends: {extra} duplicate SMTP copies of {} mails, but \
                     capm_mail_resends_total{{controller=\"{}\"}} counted {counted}:",
                    kind.name(),
                    kind.controller()
                )?;
                for (object, entry) in duplicated {
                    write!(
                        f,
                        "\n      {object} ({:?}): requests at {:?}, releases at {:?}",
                        entry.subject, entry.requests, entry.releases
                    )?;
                }
                Ok(())
            }
            Self::Foreign(mail) => write!(
                f,
                "Foreign: mail #{} with Message-Id {:?} ({:?}) is not ours",
                mail.seq, mail.message_id, mail.subject
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "mg.soak.test";

    fn mail(seq: usize, id: String) -> Received {
        Received {
            seq,
            message_id: id,
            subject: format!("mail {seq}"),
        }
    }

    fn req(kind: &str, uid: &str) -> String {
        capm_api::names::message_id(kind, uid, D)
    }

    fn rel(kind: &str, uid: &str) -> String {
        capm_api::names::deletion_message_id(kind, uid, D)
    }

    fn obj(kind: Kind, uid: &str) -> Object {
        Object {
            kind,
            uid: uid.into(),
        }
    }

    fn rules(v: &[Violation]) -> Vec<Rule> {
        v.iter()
            .filter_map(|v| match v {
                Violation::Object { rule, .. } => Some(*rule),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn parses_the_ids_capm_api_makes() {
        assert_eq!(
            parse_message_id(&req("MailgunCluster", "u-1"), D),
            Some((obj(Kind::Cluster, "u-1"), Which::Request))
        );
        assert_eq!(
            parse_message_id(&rel("MailgunMachine", "u-2"), D),
            Some((obj(Kind::Machine, "u-2"), Which::Release))
        );
        assert_eq!(parse_message_id("<mailguncluster.u@other.test>", D), None);
        assert_eq!(parse_message_id("<x.u@mg.soak.test>", D), None);
        assert_eq!(parse_message_id("mailguncluster.u@mg.soak.test", D), None);
    }

    #[test]
    fn parses_the_remediation_ids_and_keeps_them_apart() {
        let kind = "MailgunRemediation";
        let repair = req(kind, "r-1");
        // As `capm_api::names::reminder_message_id` makes it.
        let reminder = format!("<mailgunremediation-reminder-2.r-1@{D}>");
        let done = rel(kind, "r-1");
        assert_eq!(
            parse_repair_message_id(&repair, D),
            Some(("r-1".into(), RepairMail::Repair))
        );
        assert_eq!(
            parse_repair_message_id(&reminder, D),
            Some(("r-1".into(), RepairMail::Reminder(2)))
        );
        assert_eq!(
            parse_repair_message_id(&done, D),
            Some(("r-1".into(), RepairMail::NoLongerNeeded))
        );
        assert_eq!(
            parse_repair_message_id(&req("MailgunMachine", "m"), D),
            None
        );
        assert_eq!(
            parse_repair_message_id("<mailgunremediation-reminder-x.u@mg.soak.test>", D),
            None
        );
        assert_eq!(parse_message_id(&reminder, D), None);
        let mails = [
            mail(1, repair),
            mail(2, req("MailgunMachine", "m")),
            mail(3, reminder),
            mail(4, done),
        ];
        let ledger = Ledger::build(Backend::Mailgun, D, &mails);
        assert!(ledger.foreign.is_empty(), "{:?}", ledger.foreign);
        assert_eq!(ledger.entries.len(), 1);
        assert_eq!(
            ledger.repairs["r-1"],
            vec![
                (1, RepairMail::Repair),
                (3, RepairMail::Reminder(2)),
                (4, RepairMail::NoLongerNeeded)
            ]
        );
        assert_eq!(ledger.repair_mails("r-1", RepairMail::Repair), 1);
        assert_eq!(ledger.repair_mails("r-1", RepairMail::Reminder(1)), 0);
    }

    #[test]
    fn every_repair_rule_fires() {
        let kind = "MailgunRemediation";
        let reminder = |n: u8, uid: &str| format!("<mailgunremediation-reminder-{n}.{uid}@{D}>");
        let mails = [
            // ok: the repair mail, two reminders, the "no longer needed" mail.
            mail(1, req(kind, "ok")),
            mail(2, reminder(1, "ok")),
            mail(3, reminder(2, "ok")),
            mail(4, rel(kind, "ok")),
            mail(5, req(kind, "dup")),
            mail(6, req(kind, "dup")),
            mail(7, reminder(1, "early")),
            mail(8, req(kind, "early")),
            mail(9, req(kind, "skipped")),
            mail(10, reminder(2, "skipped")),
            mail(11, req(kind, "unbuilt")),
            mail(12, req(kind, "many")),
            mail(13, reminder(2, "many")),
            // Answered after its repair mail: reminder 1 was not under way.
            mail(14, req(kind, "answered")),
            mail(15, reminder(1, "answered")),
            mail(16, req(kind, "stranger")),
        ];
        let facts = |reminders, unbuilt, cut: Option<Vec<RepairMail>>| RepairFacts {
            reminders,
            unbuilt,
            cut,
        };
        let made: BTreeMap<String, RepairFacts> = [
            (
                "ok",
                facts(
                    3,
                    false,
                    Some(vec![
                        RepairMail::Repair,
                        RepairMail::Reminder(1),
                        RepairMail::Reminder(2),
                        RepairMail::NoLongerNeeded,
                    ]),
                ),
            ),
            ("dup", facts(3, false, None)),
            ("early", facts(3, false, None)),
            ("skipped", facts(3, false, None)),
            ("unbuilt", facts(3, true, None)),
            ("many", facts(1, false, None)),
            ("answered", facts(3, false, Some(vec![RepairMail::Repair]))),
        ]
        .into_iter()
        .map(|(uid, f)| (uid.to_owned(), f))
        .collect();
        let found = |backend, resends| {
            let ledger = Ledger::build(backend, D, &mails);
            let mut found: Vec<(&str, String)> = (ledger.check_repairs(&made, resends).into_iter())
                .map(|v| (v.rule, v.uid))
                .collect();
            found.sort();
            found
        };
        let expected = |first: Option<&'static str>| {
            let mut out: Vec<(&str, String)> = first
                .map(|r| ("dup", r))
                .into_iter()
                .map(|(uid, r)| (r, uid.to_owned()))
                .collect();
            out.extend(
                [
                    ("MailAfterTheCut", "answered"),
                    ("RepairMailOutOfOrder", "early"),
                    ("ReminderBeyondStrategy", "many"),
                    ("RepairMailOutOfOrder", "skipped"),
                    ("UnknownRemediation", "stranger"),
                    ("MailForUnbuiltMachine", "unbuilt"),
                ]
                .map(|(r, uid)| (r, uid.to_owned())),
            );
            out.sort();
            out
        };
        assert_eq!(
            found(Backend::Mailgun, 0),
            expected(Some("DuplicateRepairMail"))
        );
        // SMTP: the duplicate is a counted resend, or it is not.
        assert_eq!(found(Backend::Smtp, 1), expected(None));
        let mut unaccounted = expected(None);
        unaccounted.push((
            "UnaccountedRepairResends",
            "(all: 1 extra copies, 0 resends counted)".to_owned(),
        ));
        unaccounted.sort();
        assert_eq!(found(Backend::Smtp, 0), unaccounted);
    }

    #[test]
    fn a_clean_history_passes() {
        let mails = [
            mail(1, req("MailgunCluster", "a")),
            mail(2, req("MailgunMachine", "m")),
            mail(3, rel("MailgunMachine", "m")),
        ];
        let ledger = Ledger::build(Backend::Mailgun, D, &mails);
        let live = BTreeSet::from([obj(Kind::Cluster, "a")]);
        assert!(
            ledger
                .check(&live, &BTreeSet::new(), &BTreeMap::new())
                .is_empty()
        );
    }

    #[test]
    fn every_rule_fires() {
        let mails = [
            mail(1, req("MailgunCluster", "dup")),
            mail(2, req("MailgunCluster", "dup")),
            mail(3, rel("MailgunMachine", "never-requested")),
            mail(4, req("MailgunMachine", "gone")),
            mail(5, rel("MailgunCluster", "late")),
            mail(6, req("MailgunCluster", "late")),
            mail(7, req("MailgunMachine", "alive")),
            mail(8, rel("MailgunMachine", "alive")),
            mail(9, "<someone@else.test>".into()),
        ];
        let ledger = Ledger::build(Backend::Mailgun, D, &mails);
        let live = BTreeSet::from([obj(Kind::Cluster, "dup"), obj(Kind::Machine, "alive")]);
        let v = ledger.check(&live, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(
            rules(&v),
            vec![
                Rule::DuplicateRequest,
                Rule::ReleaseBeforeRequest,
                Rule::ReleaseOfLiveObject,
                Rule::MissingRelease,
                Rule::ReleaseWithoutRequest,
            ],
            "{v:#?}"
        );
        assert!(v.iter().any(|v| matches!(v, Violation::Foreign(_))));
    }

    #[test]
    fn an_object_still_being_deleted_is_not_judged_yet() {
        let mails = [mail(1, req("MailgunMachine", "m"))];
        let ledger = Ledger::build(Backend::Mailgun, D, &mails);
        let pending = BTreeSet::from([obj(Kind::Machine, "m")]);
        assert!(
            ledger
                .check(&BTreeSet::new(), &pending, &BTreeMap::new())
                .is_empty()
        );
        assert_eq!(
            rules(&ledger.check(&BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new())),
            vec![Rule::MissingRelease]
        );
    }

    #[test]
    fn smtp_duplicates_need_counted_resends() {
        let mails = [
            mail(1, req("MailgunCluster", "a")),
            mail(2, req("MailgunCluster", "a")),
            mail(3, req("MailgunMachine", "m")),
            mail(4, rel("MailgunMachine", "m")),
            mail(5, rel("MailgunMachine", "m")),
        ];
        let ledger = Ledger::build(Backend::Smtp, D, &mails);
        let live = BTreeSet::from([obj(Kind::Cluster, "a")]);
        let counted = BTreeMap::from([(Kind::Cluster, 1), (Kind::Machine, 1)]);
        assert!(ledger.check(&live, &BTreeSet::new(), &counted).is_empty());
        let short = BTreeMap::from([(Kind::Cluster, 1)]);
        let v = ledger.check(&live, &BTreeSet::new(), &short);
        assert!(
            matches!(
                v.as_slice(),
                [Violation::UnaccountedResends {
                    kind: Kind::Machine,
                    extra: 1,
                    counted: 0,
                    ..
                }]
            ),
            "{v:#?}"
        );
        // The same history over Mailgun: both duplicates are violations, counters or not.
        let ledger = Ledger::build(Backend::Mailgun, D, &mails);
        assert_eq!(
            rules(&ledger.check(&live, &BTreeSet::new(), &counted)),
            vec![Rule::DuplicateRequest, Rule::DuplicateRelease]
        );
    }
}
