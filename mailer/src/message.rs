//! The message model: what a backend sends, validated once when it is built.
//!
//! Every field that ends up in a mail header (addresses, subject, Message-Id, tags, variables) is
//! checked for characters that could start a new header line (CR, LF, NUL and every other control
//! character), so a caller's input can never inject `Bcc:` or a second body. Only the text body may
//! contain line breaks.

use std::{collections::BTreeMap, fmt, str::FromStr};

use lettre::message::Mailbox;

/// At most this many tags per message (Mailgun's limit; SMTP does not care).
pub const MAX_TAGS: usize = 3;
/// Longest tag Mailgun accepts, in bytes.
pub const MAX_TAG_LEN: usize = 128;
/// Mailgun's limit for options, custom headers and variables together, in bytes.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;
/// Longest subject accepted, in characters (the SMTP line limit).
pub const MAX_SUBJECT_CHARS: usize = 998;
/// Longest Message-Id accepted, brackets included.
pub const MAX_MESSAGE_ID_LEN: usize = 250;

/// Why a message (or one of its parts) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// A required field was not set.
    #[error("{field}: required")]
    Missing {
        /// The field's name (`from`, `to`, `messageId`, ...).
        field: &'static str,
    },
    /// A field contains a control character (CR, LF, NUL, ...) that could inject a header.
    #[error(
        "{field}: contains a control character (U+{code:04X}); line breaks are only allowed in the body"
    )]
    ControlCharacter {
        /// The field's name.
        field: &'static str,
        /// The offending character's code point.
        code: u32,
    },
    /// A field does not have the required form.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field's name.
        field: &'static str,
        /// What is wrong, without repeating the value.
        reason: String,
    },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> MessageError {
    MessageError::Invalid {
        field,
        reason: reason.into(),
    }
}

fn check_no_control(field: &'static str, value: &str) -> Result<(), MessageError> {
    match value.chars().find(|c| c.is_control()) {
        Some(c) => Err(MessageError::ControlCharacter {
            field,
            code: u32::from(c),
        }),
        None => Ok(()),
    }
}

/// `atext` of RFC 5322 plus `.`: what `dot-atom-text` is made of.
fn is_atext_or_dot(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-/=?^_`{|}~.".contains(c)
}

fn is_dot_atom_text(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(is_atext_or_dot)
        && !s.starts_with('.')
        && !s.ends_with('.')
        && !s.contains("..")
}

/// An RFC 5322 Message-Id in its bracketed form, `<left@right>`, with both sides `dot-atom-text`.
///
/// Backends send it as the `Message-ID` header (SMTP) or `h:Message-Id` (Mailgun), so the caller
/// chooses it and can later ask whether a message with this id was accepted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(String);

impl MessageId {
    /// Builds `<local@domain>` from its two halves.
    ///
    /// # Errors
    /// [`MessageError`] naming `messageId` when either half is not `dot-atom-text`.
    pub fn new(local: &str, domain: &str) -> Result<Self, MessageError> {
        Self::parse(&format!("<{local}@{domain}>"))
    }

    /// Parses the bracketed form `<left@right>`.
    ///
    /// # Errors
    /// [`MessageError`] naming `messageId` when the text is not of that form.
    pub fn parse(s: &str) -> Result<Self, MessageError> {
        const FIELD: &str = "messageId";
        check_no_control(FIELD, s)?;
        if s.len() > MAX_MESSAGE_ID_LEN {
            return Err(invalid(
                FIELD,
                format!("longer than {MAX_MESSAGE_ID_LEN} bytes"),
            ));
        }
        let inner = s
            .strip_prefix('<')
            .and_then(|s| s.strip_suffix('>'))
            .ok_or_else(|| invalid(FIELD, "must have the form <left@right>"))?;
        let (left, right) = inner
            .split_once('@')
            .ok_or_else(|| invalid(FIELD, "must have the form <left@right>"))?;
        if !is_dot_atom_text(left) || !is_dot_atom_text(right) {
            return Err(invalid(
                FIELD,
                "both sides of @ must be non-empty dot-atom text (letters, digits, !#$%&'*+-/=?^_`{|}~ and single inner dots)",
            ));
        }
        Ok(Self(s.to_owned()))
    }

    /// The id with its angle brackets, as sent in headers: `<left@right>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id without angle brackets, as Mailgun's events API expects it: `left@right`.
    pub fn without_brackets(&self) -> &str {
        &self.0[1..self.0.len() - 1]
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for MessageId {
    type Err = MessageError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

fn parse_mailbox(field: &'static str, value: &str) -> Result<Mailbox, MessageError> {
    check_no_control(field, value)?;
    value
        .parse::<Mailbox>()
        .map_err(|e| invalid(field, format!("not a valid e-mail address ({e})")))
}

/// Whether `address` is a plain e-mail address, the only form the API admits as a requester:
/// a dot-atom local part of ASCII `atext` (no leading, trailing or doubled dot) of at most 64
/// characters, `@`, and a domain of at least two labels of ASCII letters, digits and inner
/// hyphens, each 1 to 63 characters; at most 254 characters in all. No quoted local parts, IP
/// literals or Unicode (lettre accepts those; the API does not). `capm-api`'s requester pattern
/// and this function are tested on the same table (`api/testdata/requesters.json`).
pub fn is_plain_address(address: &str) -> bool {
    let Some((local, domain)) = address.split_once('@') else {
        return false;
    };
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    address.len() <= 254
        && local.len() <= 64
        && is_dot_atom_text(local)
        && domain.split('.').count() >= 2
        && domain.split('.').all(label)
}

fn parse_sender(value: &str) -> Result<Mailbox, MessageError> {
    parse_plain("from", value)
}

/// A mailbox whose address is plain and exactly what lettre will send (`from`, `replyTo`).
fn parse_plain(field: &'static str, value: &str) -> Result<Mailbox, MessageError> {
    let mailbox = parse_mailbox(field, value)?;
    // The address as written (lettre normalises, e.g. drops the quotes of a quoted local
    // part) must be plain and be exactly what lettre will send.
    let written = match value.strip_suffix('>') {
        Some(rest) => rest.rsplit_once('<').map_or("", |(_, address)| address),
        None => value,
    };
    if !is_plain_address(written) || mailbox.email.to_string() != written {
        return Err(invalid(
            field,
            "not a plain e-mail address (local@domain.tld: no quotes, IP literals, Unicode, \
             spaces or leading, trailing or doubled dots)",
        ));
    }
    Ok(mailbox)
}

fn check_tag(tag: &str) -> Result<(), MessageError> {
    const FIELD: &str = "tags";
    check_no_control(FIELD, tag)?;
    if tag.is_empty() {
        return Err(invalid(FIELD, "a tag must not be empty"));
    }
    if !tag.is_ascii() {
        return Err(invalid(FIELD, "tags must be ASCII"));
    }
    if tag.len() > MAX_TAG_LEN {
        return Err(invalid(
            FIELD,
            format!("a tag is longer than {MAX_TAG_LEN} bytes"),
        ));
    }
    Ok(())
}

fn check_variable(name: &str, value: &str) -> Result<(), MessageError> {
    if name.is_empty() {
        return Err(invalid("variables", "a variable name must not be empty"));
    }
    check_no_control("variables", name)?;
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(invalid(
            "variables",
            "variable names may only contain ASCII letters, digits, '-', '_' and '.'",
        ));
    }
    check_no_control("variables", value)
}

/// A validated mail: build it with [`Message::builder`].
///
/// # Example
/// ```no_run
/// use capm_mailer::Message;
///
/// let message = Message::builder()
///     .from("Cluster requests <capm@mg.example.com>")
///     .reply_to("dev@example.com")
///     .to("ops@example.com")
///     .subject("[Urgent] New Cluster demo requested")
///     .text("Hello! One cluster please.\n\n3 nodes")
///     .message_id("<uid-1234@capm.example.com>")
///     .tag("cluster-request")
///     .variable("cluster", "default/demo")
///     .build()?;
/// # Ok::<(), capm_mailer::MessageError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    from: Mailbox,
    reply_to: Option<Mailbox>,
    to: Vec<Mailbox>,
    subject: String,
    text: String,
    message_id: MessageId,
    in_reply_to: Option<MessageId>,
    tags: Vec<String>,
    variables: BTreeMap<String, String>,
}

impl Message {
    /// Starts building a message.
    pub fn builder() -> MessageBuilder {
        MessageBuilder::default()
    }

    /// The sender.
    pub fn from(&self) -> &Mailbox {
        &self.from
    }

    /// Where replies go (the person the mail speaks for), if not to the sender.
    pub fn reply_to(&self) -> Option<&Mailbox> {
        self.reply_to.as_ref()
    }

    /// The recipients (at least one).
    pub fn to(&self) -> &[Mailbox] {
        &self.to
    }

    /// The subject line (may be empty, never contains a line break).
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The plain-text body.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The caller-chosen Message-Id.
    pub fn message_id(&self) -> &MessageId {
        &self.message_id
    }

    /// The mail this one follows up (`In-Reply-To` and `References`), if any: mail clients
    /// show the two in one thread.
    pub fn in_reply_to(&self) -> Option<&MessageId> {
        self.in_reply_to.as_ref()
    }

    /// Tags (Mailgun `o:tag`; SMTP `X-Mailgun-Tag`).
    pub fn tags(&self) -> &[String] {
        &self.tags
    }

    /// Custom variables (Mailgun `v:<name>`; SMTP `X-Mailgun-Variables`).
    pub fn variables(&self) -> &BTreeMap<String, String> {
        &self.variables
    }
}

/// Collects a [`Message`]'s fields; [`MessageBuilder::build`] validates them all.
#[derive(Debug, Clone, Default)]
pub struct MessageBuilder {
    from: Option<String>,
    reply_to: Option<String>,
    to: Vec<String>,
    subject: Option<String>,
    text: Option<String>,
    message_id: Option<String>,
    in_reply_to: Option<String>,
    tags: Vec<String>,
    variables: Vec<(String, String)>,
}

impl MessageBuilder {
    /// Sets the sender: `user@domain` or `Name <user@domain>` (required), an address of the
    /// sending side (its domain the one the backend signs for, so the mail passes DMARC). The
    /// address must be plain (see [`is_plain_address`]).
    pub fn from(mut self, from: impl Into<String>) -> Self {
        self.from = Some(from.into());
        self
    }

    /// Sets `Reply-To` (optional): the person the mail speaks for (the requester), whose
    /// domain's DMARC policy would make receivers refuse the mail if it were in `From`. Plain,
    /// as `from`.
    pub fn reply_to(mut self, reply_to: impl Into<String>) -> Self {
        self.reply_to = Some(reply_to.into());
        self
    }

    /// Adds a recipient (at least one is required).
    pub fn to(mut self, to: impl Into<String>) -> Self {
        self.to.push(to.into());
        self
    }

    /// Sets the subject (optional, empty by default).
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// Sets the plain-text body (required; may contain line breaks).
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.text = Some(text.into());
        self
    }

    /// Sets the Message-Id, bracketed: `<left@right>` (required).
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Makes the mail a follow-up of the mail whose Message-Id (bracketed) is `id`: both its
    /// `In-Reply-To` and its `References` name it (RFC 5322 section 3.6.4), so mail clients
    /// thread the two.
    pub fn in_reply_to(mut self, id: impl Into<String>) -> Self {
        self.in_reply_to = Some(id.into());
        self
    }

    /// Adds a tag (at most [`MAX_TAGS`], ASCII, at most [`MAX_TAG_LEN`] bytes each).
    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.tags.push(tag.into());
        self
    }

    /// Adds a custom variable; names are ASCII letters, digits, `-`, `_` and `.`.
    pub fn variable(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.variables.push((name.into(), value.into()));
        self
    }

    /// Validates every field and returns the message.
    ///
    /// # Errors
    /// A [`MessageError`] naming the first field that is missing or invalid.
    pub fn build(self) -> Result<Message, MessageError> {
        let from = parse_sender(&self.from.ok_or(MessageError::Missing { field: "from" })?)?;
        let reply_to = self
            .reply_to
            .as_deref()
            .map(|r| parse_plain("replyTo", r))
            .transpose()?;
        if self.to.is_empty() {
            return Err(MessageError::Missing { field: "to" });
        }
        let to = self
            .to
            .iter()
            .map(|t| parse_mailbox("to", t))
            .collect::<Result<Vec<_>, _>>()?;
        let subject = self.subject.unwrap_or_default();
        check_no_control("subject", &subject)?;
        if subject.chars().count() > MAX_SUBJECT_CHARS {
            return Err(invalid(
                "subject",
                format!("longer than {MAX_SUBJECT_CHARS} characters"),
            ));
        }
        let text = self.text.ok_or(MessageError::Missing { field: "text" })?;
        if let Some(c) = text
            .chars()
            .find(|c| c.is_control() && !matches!(c, '\r' | '\n' | '\t'))
        {
            return Err(MessageError::ControlCharacter {
                field: "text",
                code: u32::from(c),
            });
        }
        let message_id = MessageId::parse(
            &self
                .message_id
                .ok_or(MessageError::Missing { field: "messageId" })?,
        )?;
        let in_reply_to = self
            .in_reply_to
            .as_deref()
            .map(MessageId::parse)
            .transpose()?;
        if in_reply_to.as_ref() == Some(&message_id) {
            return Err(invalid("inReplyTo", "a mail cannot follow up itself"));
        }
        if self.tags.len() > MAX_TAGS {
            return Err(invalid("tags", format!("at most {MAX_TAGS} tags")));
        }
        for tag in &self.tags {
            check_tag(tag)?;
        }
        let mut variables = BTreeMap::new();
        for (name, value) in self.variables {
            check_variable(&name, &value)?;
            if variables.insert(name, value).is_some() {
                return Err(invalid("variables", "a variable name is used twice"));
            }
        }
        let metadata: usize = self.tags.iter().map(String::len).sum::<usize>()
            + variables
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
            + message_id.as_str().len()
            + in_reply_to.as_ref().map_or(0, |id| id.as_str().len());
        if metadata > MAX_METADATA_BYTES {
            return Err(invalid(
                "variables",
                format!(
                    "tags, variables and Message-Id together exceed {MAX_METADATA_BYTES} bytes"
                ),
            ));
        }
        Ok(Message {
            from,
            reply_to,
            to,
            subject,
            text,
            message_id,
            in_reply_to,
            tags: self.tags,
            variables,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn base() -> MessageBuilder {
        Message::builder()
            .from("Dev <dev@example.com>")
            .to("ops@example.com")
            .subject("[Urgent] New Cluster demo requested")
            .text("Hello! One cluster please.\r\n\r\nthree nodes\n")
            .message_id("<abc.123@capm.example.com>")
    }

    #[test]
    fn a_valid_message_builds() {
        let m = base()
            .to("second@example.com")
            .tag("cluster-request")
            .variable("cluster", "default/demo")
            .build()
            .unwrap();
        assert_eq!(m.to().len(), 2);
        assert_eq!(m.from().email.to_string(), "dev@example.com");
        assert_eq!(
            m.message_id().without_brackets(),
            "abc.123@capm.example.com"
        );
        assert_eq!(m.variables()["cluster"], "default/demo");
    }

    #[test]
    fn missing_fields_are_named() {
        let e = Message::builder().build().unwrap_err();
        assert_eq!(e, MessageError::Missing { field: "from" });
        let e = Message::builder().from("a@b.c").build().unwrap_err();
        assert_eq!(e, MessageError::Missing { field: "to" });
        let e = Message::builder()
            .from("a@b.c")
            .to("d@e.f")
            .build()
            .unwrap_err();
        assert_eq!(e, MessageError::Missing { field: "text" });
        let e = Message::builder()
            .from("a@b.c")
            .to("d@e.f")
            .text("x")
            .build()
            .unwrap_err();
        assert_eq!(e, MessageError::Missing { field: "messageId" });
    }

    #[test]
    fn header_injection_is_refused_in_every_header_field() {
        let cases: Vec<(&str, MessageBuilder)> = vec![
            ("subject", base().subject("hi\r\nBcc: evil@example.com")),
            ("subject", base().subject("hi\nBcc: evil@example.com")),
            ("subject", base().subject("hi\0")),
            (
                "from",
                base().from("dev@example.com\r\nBcc: evil@example.com"),
            ),
            ("to", base().to("ops@example.com\nBcc: evil@example.com")),
            (
                "messageId",
                base().message_id("<a@b>\r\nBcc: evil@example.com"),
            ),
            ("tags", base().tag("t\r\nX: y")),
            ("variables", base().variable("n\nX", "v")),
            (
                "variables",
                base().variable("n", "v\r\nBcc: evil@example.com"),
            ),
        ];
        for (field, builder) in cases {
            let err = builder.build().unwrap_err();
            assert!(
                matches!(err, MessageError::ControlCharacter { field: f, .. } if f == field),
                "{field}: {err}"
            );
            assert!(err.to_string().starts_with(field), "{err}");
        }
    }

    #[test]
    fn invalid_addresses_are_refused() {
        for bad in ["", "no-at-sign", "a@", "@b", "a b@c.d", "<a@b.c"] {
            let err = base().to(bad).build().unwrap_err();
            assert!(
                matches!(err, MessageError::Invalid { field: "to", .. }),
                "{bad}: {err}"
            );
        }
    }

    /// The same table the API's validation and the API server are held to
    /// (`api/testdata/requesters.json`): a requester admission lets in must build as `from`,
    /// one it refuses must not, bare or behind a display name.
    #[test]
    fn requester_table_matches_admission() {
        let table: Vec<(String, bool, String)> =
            serde_json::from_str(include_str!("../../api/testdata/requesters.json")).unwrap();
        let mut wrong = Vec::new();
        for (address, admitted, why) in &table {
            let named = format!("Requester <{address}>");
            // A display-name form is a mailbox, not a requester: only its address part counts.
            let forms: &[&str] = if address.contains('<') {
                &[named.as_str()]
            } else {
                &[address.as_str(), named.as_str()]
            };
            for form in forms {
                let built = base().from(*form).build();
                if built.is_ok() != *admitted {
                    wrong.push(format!("{form:?} ({why}): {:?}", built.as_ref().err()));
                }
                if let Err(e) = built {
                    assert!(
                        matches!(
                            e,
                            MessageError::Invalid { field: "from", .. }
                                | MessageError::ControlCharacter { field: "from", .. }
                                | MessageError::Missing { field: "from" }
                        ),
                        "{form:?}: {e}"
                    );
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "disagree with admission:\n{}",
            wrong.join("\n")
        );
    }

    #[test]
    fn message_ids_must_be_bracketed_dot_atoms() {
        for good in ["<a@b>", "<uid-1.2@capm.example.com>", "<a+b=c@x>"] {
            MessageId::parse(good).unwrap();
        }
        for bad in [
            "a@b", "<a@b", "<ab>", "<@b>", "<a@>", "<a b@c>", "<a@b@c>", "<.a@b>", "<a..b@c>",
            "<a@b>x",
        ] {
            assert!(MessageId::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(MessageId::new("x", "y.z").unwrap().as_str(), "<x@y.z>");
    }

    #[test]
    fn tag_and_variable_limits() {
        let err = base()
            .tag("a")
            .tag("b")
            .tag("c")
            .tag("d")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("at most 3 tags"), "{err}");
        assert!(base().tag("x".repeat(129)).build().is_err());
        assert!(base().tag("").build().is_err());
        assert!(base().tag("é").build().is_err());
        assert!(base().variable("a b", "v").build().is_err());
        assert!(base().variable("", "v").build().is_err());
        assert!(
            base()
                .variable("a", "1")
                .variable("a", "2")
                .build()
                .is_err()
        );
        let err = base()
            .variable("big", "x".repeat(20_000))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("16384"), "{err}");
    }

    #[test]
    fn a_follow_up_names_a_valid_first_mail_other_than_itself() {
        let m = base()
            .in_reply_to("<first@capm.example.com>")
            .build()
            .unwrap();
        assert_eq!(
            m.in_reply_to().map(MessageId::as_str),
            Some("<first@capm.example.com>")
        );
        assert_eq!(base().build().unwrap().in_reply_to(), None);
        assert!(
            base()
                .in_reply_to("first@capm.example.com")
                .build()
                .is_err()
        );
        let err = base()
            .in_reply_to("<abc.123@capm.example.com>")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("inReplyTo"), "{err}");
    }

    #[test]
    fn body_may_contain_newlines_but_not_nul() {
        assert!(base().text("a\r\nb\n\tc").build().is_ok());
        let err = base().text("a\0b").build().unwrap_err();
        assert!(matches!(
            err,
            MessageError::ControlCharacter { field: "text", .. }
        ));
    }

    proptest! {
        #[test]
        fn no_built_subject_contains_a_line_break(s in "\\PC*[\r\n\u{0}]\\PC*") {
            prop_assert!(base().subject(s).build().is_err());
        }

        #[test]
        fn parsed_message_ids_round_trip(l in "[a-z0-9]{1,10}(\\.[a-z0-9]{1,10}){0,2}", d in "[a-z]{1,10}(\\.[a-z]{1,5}){0,2}") {
            let id = MessageId::new(&l, &d).unwrap();
            prop_assert_eq!(id.without_brackets(), format!("{l}@{d}"));
            prop_assert_eq!(MessageId::parse(id.as_str()).unwrap(), id);
        }
    }
}
