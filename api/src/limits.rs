//! The limits and patterns of every field, shared by the types (their schemas), the Rust
//! validation and the admission webhook. A leaf module: it imports nothing from this crate, so
//! the types and the validation both depend on it and not on each other.

use schemars::{Schema, SchemaGenerator, json_schema};

/// Maximum length of `spec.request` (characters). Also keeps CEL `self == oldSelf` cheap.
pub const MAX_REQUEST_LENGTH: u32 = 4096;
/// Maximum length of `spec.requester` (the RFC 5321 limit of a forward path).
pub const MAX_REQUESTER_LENGTH: u32 = 254;
/// Maximum length of `spec.controlPlaneEndpoint.host` (a DNS name's limit).
pub const MAX_HOST_LENGTH: u32 = 253;
/// Maximum length of `spec.providerID`.
pub const MAX_PROVIDER_ID_LENGTH: u32 = 512;
/// Maximum length of `spec.failureDomain`.
pub const MAX_FAILURE_DOMAIN_LENGTH: u32 = 256;
/// Maximum length of one machine address.
pub const MAX_ADDRESS_LENGTH: u32 = 256;
/// Maximum number of machine addresses.
pub const MAX_ADDRESSES: u32 = 16;
/// Maximum number of conditions in a status.
pub const MAX_CONDITIONS: u32 = 32;
/// Maximum length of a recorded mail id.
pub const MAX_MESSAGE_ID_LENGTH: u32 = 998;
/// Maximum number of labels or of annotations in a template's metadata.
pub const MAX_TEMPLATE_METADATA_ENTRIES: u32 = 64;
/// Maximum length of one label or annotation value in a template's metadata.
pub const MAX_TEMPLATE_METADATA_VALUE_LENGTH: u32 = 4096;
/// Maximum length of a duration (`24h`, `1h30m`).
pub const MAX_DURATION_LENGTH: u32 = 32;
/// Maximum number of reminders a remediation sends.
pub const MAX_REMINDERS: u8 = 3;
/// Maximum length of a remediation answer's message.
pub const MAX_ANSWER_MESSAGE_LENGTH: u32 = 1024;
/// Maximum length of a Machine owner's message copied into a remediation's status.
pub const MAX_OWNER_MESSAGE_LENGTH: u32 = 1024;

/// `spec.requester`: a plain e-mail address, `local@domain`: the local part a dot-atom of ASCII
/// `atext` (no leading, trailing or doubled dot; at most [`MAX_REQUESTER_LOCAL_LENGTH`]
/// characters, see [`REQUESTER_LOCAL_PART_RULE`]), the domain at least two dot-separated labels
/// of letters, digits and inner hyphens, each at most 63 characters. No quoted local parts, IP
/// literals, Unicode, spaces, angle brackets or control characters: every address admitted is
/// one the mail builder (lettre's address parser plus `capm-mailer`'s plain-address check)
/// accepts, and none of them can inject a header. `api/testdata/requesters.json` is the table
/// both are tested on.
///
/// The schema's `pattern` is evaluated by the API server with Go's RE2; this crate uses the
/// `regex` crate, which accepts the same syntax with the same meaning for this pattern.
pub const REQUESTER_PATTERN: &str = r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)+$";
/// Maximum length of the local part of `spec.requester` (RFC 5321).
pub const MAX_REQUESTER_LOCAL_LENGTH: usize = 64;
/// The CEL rule bounding the local part of `spec.requester` (an RE2 pattern cannot bound the
/// length of a repeated group); [`crate::validation::Validate`] checks the same.
pub const REQUESTER_LOCAL_PART_RULE: &str = "self.indexOf('@') <= 64";
/// `spec.request`: any text without control characters other than tab, line feed and carriage
/// return (it becomes the mail body, never a header), and without the Unicode line and
/// paragraph separators (U+2028, U+2029) and bidirectional embedding, override and isolate
/// controls (U+202A..U+202E, U+2066..U+2069): those can make the mail the human reads look
/// different from what it says (a reordered `kubectl` command, a fake line break).
pub const REQUEST_PATTERN: &str = r"^[^\x00-\x08\x0B\x0C\x0E-\x1F\x7F-\x{9F}\x{2028}\x{2029}\x{202A}-\x{202E}\x{2066}-\x{2069}]*$";
/// `spec.controlPlaneEndpoint.host`: a DNS name or an IPv4/IPv6 address (no brackets).
pub const HOST_PATTERN: &str = r"^[A-Za-z0-9.:-]+$";
/// `spec.providerID`: `<scheme>://<id>`, printable ASCII, no spaces.
pub const PROVIDER_ID_PATTERN: &str = r"^[a-z0-9][a-z0-9+.-]*://[!-~]+$";
/// `spec.failureDomain`: printable ASCII, no spaces.
pub const FAILURE_DOMAIN_PATTERN: &str = r"^[!-~]+$";
/// A machine address: printable ASCII, no spaces.
pub const ADDRESS_PATTERN: &str = r"^[!-~]+$";

/// A duration as Go's `time.ParseDuration` and CEL's `duration()` read it, limited to whole or
/// decimal numbers of hours, minutes, seconds and milliseconds (`24h`, `1h30m`, `90s`).
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$";

/// Schema of a bounded string-to-string map (template labels and annotations).
///
/// # Caveats
/// Structural schemas cannot constrain map keys; the API server validates label and annotation
/// keys only on the objects finally created from the template.
pub fn string_map_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "maxProperties": MAX_TEMPLATE_METADATA_ENTRIES,
        "additionalProperties": {
            "type": "string",
            "maxLength": MAX_TEMPLATE_METADATA_VALUE_LENGTH,
        },
    })
}
