//! The remediation's mails: the repair request, its threaded reminders and the "no longer
//! needed" mail. Every text from outside the object's own validated spec (the health check's
//! reason and message, the Node's name, the provider ID) is cleaned and bounded, as the
//! conditions and Events are; the request text keeps its lines, each cleaned.

use capm_api::{limits::MAX_REQUEST_LENGTH, v1beta1::Priority};
use capm_mailer::text::clean;

use crate::{kinds::MailText, sendonce::Which};

/// The longest health-check reason or message quoted in a mail.
const MAX_QUOTED_BYTES: usize = 512;
/// The longest name or provider ID quoted in a mail.
const MAX_NAME_BYTES: usize = 512;

/// What a remediation's mails say about its Machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct About<'a> {
    /// The object's (and so the Machine's) name and namespace.
    pub name: &'a str,
    pub namespace: &'a str,
    /// The Machine's Cluster.
    pub cluster: &'a str,
    /// The Machine's Node, if it has one.
    pub node: Option<&'a str>,
    /// The `MailgunMachine`'s `providerID`, if it has one.
    pub provider_id: Option<&'a str>,
    /// The Machine's `HealthCheckSucceeded=False` reason and message.
    pub health: Option<(&'a str, &'a str)>,
    pub priority: Priority,
    /// `spec.request`: what the human should do.
    pub request: &'a str,
    /// `spec.strategy.answerTimeout` as written, and `reminders`.
    pub answer_timeout: &'a str,
    pub reminders: u8,
    /// The fulfilment page's link for this object, when the page is on.
    pub link: Option<&'a str>,
}

/// The subject of the repair mail; the others answer it (`Re: …`), so that mail clients that
/// thread by subject as well as by `In-Reply-To` keep them together.
fn subject(about: &About<'_>) -> String {
    format!(
        "[{}] Machine {} of Cluster {} needs repair",
        about.priority,
        clean(about.name, MAX_NAME_BYTES),
        clean(about.cluster, MAX_NAME_BYTES)
    )
}

/// `spec.request` line by line, each cleaned, at most [`MAX_REQUEST_LENGTH`] bytes in all.
fn request(text: &str) -> String {
    let lines: Vec<String> = text
        .lines()
        .map(|line| clean(line, MAX_REQUEST_LENGTH as usize))
        .collect();
    let joined = lines.join("\n");
    if joined.len() <= MAX_REQUEST_LENGTH as usize {
        return joined;
    }
    let mut end = MAX_REQUEST_LENGTH as usize;
    while !joined.is_char_boundary(end) {
        end -= 1;
    }
    joined[..end].to_owned()
}

/// `kubectl patch` answering the remediation with `answer`.
fn answer_command(about: &About<'_>, answer: &str) -> String {
    format!(
        "kubectl patch mailgunremediation {} -n {} --type merge -p '{{\"spec\":{{\"answer\":{answer}}}}}'",
        about.name, about.namespace
    )
}

/// The details, the request and how to answer: the repair mail's body, and each reminder's
/// after its first line.
fn details(about: &About<'_>) -> String {
    let or_none = |v: Option<&str>, none: &str| {
        v.map_or_else(|| none.to_owned(), |v| clean(v, MAX_NAME_BYTES))
    };
    let health = about.health.map_or_else(
        || "unhealthy (no reason given)".to_owned(),
        |(reason, message)| {
            format!(
                "{}: {}",
                clean(reason, MAX_QUOTED_BYTES),
                clean(message, MAX_QUOTED_BYTES)
            )
        },
    );
    let link = about.link.map_or_else(String::new, |link| {
        format!(
            "Or answer on the page (anyone holding this mail can use the link, once; do not \
             forward it):\n\n  {link}\n\n"
        )
    });
    let next = if about.reminders == 0 {
        format!(
            "Without an answer within {}, the Machine is handed back to its owner, which replaces \
             it.",
            about.answer_timeout
        )
    } else {
        format!(
            "Without an answer, a reminder follows after {} (at most {}), then the Machine is \
             handed back to its owner, which replaces it.",
            about.answer_timeout, about.reminders
        )
    };
    format!(
        "{}\n\n\
         Machine: {} (namespace {})\n\
         Cluster: {}\n\
         Node: {}\n\
         Provider ID: {}\n\
         Health check: {health}\n\n\
         When it is repaired, say so:\n\n  {}\n\n\
         If it cannot be repaired (its owner then replaces it):\n\n  {}\n\n\
         {link}{next}\n",
        request(about.request),
        clean(about.name, MAX_NAME_BYTES),
        about.namespace,
        clean(about.cluster, MAX_NAME_BYTES),
        or_none(about.node, "none"),
        or_none(about.provider_id, "none"),
        answer_command(about, r#"{"result":"Repaired"}"#),
        answer_command(about, r#"{"result":"CannotRepair","message":"<why>"}"#),
    )
}

/// The text of `which` mail of the remediation `about`. The reminders and the "no longer
/// needed" mail answer the repair mail (the send-once layer threads them to its Message-Id).
pub fn text(about: &About<'_>, which: Which) -> MailText {
    let first = subject(about);
    match which {
        Which::Request => MailText {
            subject: first,
            body: format!("Hello! A machine needs repair.\n\n{}", details(about)),
        },
        Which::Reminder(n) => MailText {
            subject: format!("Re: {first}"),
            body: format!(
                "Reminder {n} of {}: Machine {} still needs repair, and nobody has answered \
                 yet.\n\n{}",
                about.reminders,
                clean(about.name, MAX_NAME_BYTES),
                details(about)
            ),
        },
        Which::Deletion => MailText {
            subject: format!("Re: {first}"),
            body: format!(
                "Hello again! Machine {} of Cluster {} (namespace {}) is healthy again, or gone: \
                 the repair asked for is no longer needed. Nothing to answer.\n",
                clean(about.name, MAX_NAME_BYTES),
                clean(about.cluster, MAX_NAME_BYTES),
                about.namespace
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn about() -> About<'static> {
        About {
            name: "worker-7",
            namespace: "team-a",
            cluster: "prod",
            node: Some("node-7"),
            provider_id: Some("metal://rack-3/7"),
            health: Some((
                "UnhealthyNode",
                "Condition Ready on node is reporting status False",
            )),
            priority: Priority::Urgent,
            request: "Power-cycle it.\nThen check the disks.",
            answer_timeout: "24h",
            reminders: 1,
            link: Some("https://capm.example.com/f/abc"),
        }
    }

    #[test]
    fn the_repair_mail_says_what_and_how_to_answer() {
        let mail = text(&about(), Which::Request);
        assert_eq!(
            mail.subject,
            "[Urgent] Machine worker-7 of Cluster prod needs repair"
        );
        for expected in [
            "Power-cycle it.\nThen check the disks.",
            "Machine: worker-7 (namespace team-a)",
            "Cluster: prod",
            "Node: node-7",
            "Provider ID: metal://rack-3/7",
            "Health check: UnhealthyNode: Condition Ready on node is reporting status False",
            r#"kubectl patch mailgunremediation worker-7 -n team-a --type merge -p '{"spec":{"answer":{"result":"Repaired"}}}'"#,
            r#"{"spec":{"answer":{"result":"CannotRepair","message":"<why>"}}}"#,
            "https://capm.example.com/f/abc",
            "a reminder follows after 24h (at most 1)",
        ] {
            assert!(
                mail.body.contains(expected),
                "{expected} not in {}",
                mail.body
            );
        }
        let unlinked = About {
            link: None,
            node: None,
            ..about()
        };
        let mail = text(&unlinked, Which::Request);
        assert!(!mail.body.contains("page"), "{}", mail.body);
        assert!(mail.body.contains("Node: none"));
    }

    #[test]
    fn reminders_and_no_longer_needed_answer_the_first_subject() {
        let first = text(&about(), Which::Request).subject;
        let reminder = text(&about(), Which::Reminder(1));
        assert_eq!(reminder.subject, format!("Re: {first}"));
        assert!(
            reminder
                .body
                .starts_with("Reminder 1 of 1: Machine worker-7")
        );
        assert!(reminder.body.contains("https://capm.example.com/f/abc"));
        let done = text(&about(), Which::Deletion);
        assert_eq!(done.subject, format!("Re: {first}"));
        assert!(done.body.contains("no longer needed"));
        assert!(!done.body.contains("kubectl patch"));
    }

    #[test]
    fn outside_text_is_cleaned_and_bounded() {
        let long = "x".repeat(5000);
        let hostile = About {
            health: Some((
                "Unhealthy\u{1b}[2J",
                "line\r\nBcc: evil@example.com\u{202e}",
            )),
            node: Some("node\u{7}"),
            provider_id: Some(&long),
            request: "fine\u{1b}[31m\nsecond line",
            ..about()
        };
        let mail = text(&hostile, Which::Request);
        assert!(!mail.body.contains('\u{1b}') && !mail.body.contains('\u{202e}'));
        assert!(!mail.body.contains('\u{7}') && !mail.body.contains('\r'));
        assert!(mail.body.contains("line Bcc: evil@example.com"), "one line");
        assert!(
            mail.body.contains("second line"),
            "the request keeps its lines"
        );
        assert!(mail.body.len() < 3000, "{}", mail.body.len());
        let huge = About {
            request: &long,
            ..about()
        };
        assert!(request(huge.request).len() <= MAX_REQUEST_LENGTH as usize);
    }
}
