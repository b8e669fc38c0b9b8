//! The rules the CRD schema enforces, as Rust.
//!
//! The API server rejects invalid objects with the OpenAPI and CEL rules in the CRDs. An object
//! can still reach the controller without having passed them (created under an older CRD,
//! restored from a backup, converted from `v1alpha1`), so the controller runs
//! [`Validate::validate`] / [`Validate::validate_update`] and reports what it finds instead of
//! mailing garbage. The limits and patterns below are used by both the schema attributes and
//! these checks, so the two cannot drift apart; the tests and the integration tests against a
//! real API server hold them to the same table of invalid objects.
//!
//! Only the storage version ([`crate::v1beta1`]) implements [`Validate`]: convert a `v1alpha1`
//! object first ([`crate::conversion`]). Errors name fields by their JSON path (for example
//! `spec.requester`), like the API server does.

use std::sync::LazyLock;

use regex::Regex;

use crate::v1beta1::{
    ApiEndpoint, MachineAddress, MailgunCluster, MailgunClusterSpec, MailgunClusterTemplate,
    MailgunMachine, MailgunMachineSpec, MailgunMachineTemplate, MailgunRemediation,
    TemplateMetadata,
};

pub use crate::limits::*;

/// One violated rule, naming the field by its JSON path.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    /// A required value is missing or empty.
    #[error("{path}: Required value")]
    Required {
        /// JSON path of the field.
        path: String,
    },
    /// A string is longer than allowed.
    #[error("{path}: Too long: must have at most {max} characters, has {actual}")]
    TooLong {
        /// JSON path of the field.
        path: String,
        /// The limit.
        max: usize,
        /// The value's length in characters.
        actual: usize,
    },
    /// A list or map has more entries than allowed.
    #[error("{path}: Too many: must have at most {max} items, has {actual}")]
    TooMany {
        /// JSON path of the field.
        path: String,
        /// The limit.
        max: usize,
        /// The number of entries.
        actual: usize,
    },
    /// A value has the wrong format.
    #[error("{path}: Invalid value: {reason}")]
    Invalid {
        /// JSON path of the field.
        path: String,
        /// What is wrong, in words.
        reason: String,
    },
    /// An immutable field changed.
    #[error("{path}: Invalid value: {field} is immutable")]
    Immutable {
        /// JSON path of the field.
        path: String,
        /// The field's JSON name.
        field: String,
    },
    /// A set-once field was changed or removed after being set.
    #[error(
        "{path}: Forbidden: {field} is set-once: it can be set when empty but never changed or removed"
    )]
    SetOnce {
        /// JSON path of the field.
        path: String,
        /// The field's JSON name.
        field: String,
    },
    /// A field that must not be set is set.
    #[error("{path}: Forbidden: {reason}")]
    Forbidden {
        /// JSON path of the field.
        path: String,
        /// Why it must not be set.
        reason: String,
    },
}

impl FieldError {
    /// The JSON path of the offending field, e.g. `spec.requester`.
    pub fn path(&self) -> &str {
        match self {
            Self::Required { path }
            | Self::TooLong { path, .. }
            | Self::TooMany { path, .. }
            | Self::Invalid { path, .. }
            | Self::Immutable { path, .. }
            | Self::SetOnce { path, .. }
            | Self::Forbidden { path, .. } => path,
        }
    }
}

/// Validation of one kind, mirroring its CRD schema.
pub trait Validate {
    /// Every rule a new object must satisfy; empty when valid.
    fn validate(&self) -> Vec<FieldError>;

    /// Every rule an update from `old` to `new` must satisfy, including
    /// [`Validate::validate`] on `new`; empty when valid.
    fn validate_update(old: &Self, new: &Self) -> Vec<FieldError>;
}

fn compile(pattern: &str) -> Regex {
    // The patterns are constants covered by unit tests; they cannot fail at run time.
    #[allow(clippy::expect_used)]
    Regex::new(pattern).expect("constant pattern compiles")
}

static REQUESTER: LazyLock<Regex> = LazyLock::new(|| compile(REQUESTER_PATTERN));
static REQUEST: LazyLock<Regex> = LazyLock::new(|| compile(REQUEST_PATTERN));
static HOST: LazyLock<Regex> = LazyLock::new(|| compile(HOST_PATTERN));
static PROVIDER_ID: LazyLock<Regex> = LazyLock::new(|| compile(PROVIDER_ID_PATTERN));
static PRINTABLE: LazyLock<Regex> = LazyLock::new(|| compile(FAILURE_DOMAIN_PATTERN));

/// Checks one string: non-empty if `min > 0`, at most `max` characters, matching `pattern`.
fn check_string(
    errors: &mut Vec<FieldError>,
    path: &str,
    value: &str,
    min: usize,
    max: u32,
    pattern: &Regex,
    what: &str,
) {
    let len = value.chars().count();
    let max = max as usize;
    if len < min {
        if len == 0 {
            errors.push(FieldError::Required { path: path.into() });
        } else {
            errors.push(FieldError::Invalid {
                path: path.into(),
                reason: format!("must have at least {min} characters"),
            });
        }
    } else if len > max {
        errors.push(FieldError::TooLong {
            path: path.into(),
            max,
            actual: len,
        });
    } else if !pattern.is_match(value) {
        errors.push(FieldError::Invalid {
            path: path.into(),
            reason: format!("must be {what}"),
        });
    }
}

/// The text rule of a request, and of a repair request's answer.
const TEXT: &str = "text without control characters (other than tab and line breaks), Unicode line or paragraph separators, or bidirectional controls";

/// What a mail asks for: 1 to [`MAX_REQUEST_LENGTH`] characters of [`TEXT`].
fn check_request(errors: &mut Vec<FieldError>, path: &str, request: &str) {
    check_string(errors, path, request, 1, MAX_REQUEST_LENGTH, &REQUEST, TEXT);
}

fn check_request_fields(
    errors: &mut Vec<FieldError>,
    prefix: &str,
    request: &str,
    requester: &str,
) {
    check_request(errors, &format!("{prefix}.request"), request);
    let before = errors.len();
    check_string(
        errors,
        &format!("{prefix}.requester"),
        requester,
        3,
        MAX_REQUESTER_LENGTH,
        &REQUESTER,
        "a plain e-mail address (local@domain.tld: no quotes, IP literals, Unicode, spaces or \
         leading, trailing or doubled dots)",
    );
    if errors.len() == before
        && requester
            .find('@')
            .is_some_and(|at| at > MAX_REQUESTER_LOCAL_LENGTH)
    {
        errors.push(FieldError::Invalid {
            path: format!("{prefix}.requester"),
            reason: format!(
                "the local part (before @) must have at most {MAX_REQUESTER_LOCAL_LENGTH} characters"
            ),
        });
    }
}

fn check_endpoint(errors: &mut Vec<FieldError>, path: &str, endpoint: &ApiEndpoint) {
    check_string(
        errors,
        &format!("{path}.host"),
        &endpoint.host,
        1,
        MAX_HOST_LENGTH,
        &HOST,
        "a DNS name or an IP address",
    );
    if !(1..=65535).contains(&endpoint.port) {
        errors.push(FieldError::Invalid {
            path: format!("{path}.port"),
            reason: format!("must be between 1 and 65535, got {}", endpoint.port),
        });
    }
}

fn check_addresses(errors: &mut Vec<FieldError>, path: &str, addresses: &[MachineAddress]) {
    if addresses.len() > MAX_ADDRESSES as usize {
        errors.push(FieldError::TooMany {
            path: path.into(),
            max: MAX_ADDRESSES as usize,
            actual: addresses.len(),
        });
    }
    for (i, address) in addresses.iter().enumerate() {
        check_string(
            errors,
            &format!("{path}[{i}].address"),
            &address.address,
            1,
            MAX_ADDRESS_LENGTH,
            &PRINTABLE,
            "printable ASCII without spaces",
        );
    }
}

fn check_template_metadata(errors: &mut Vec<FieldError>, path: &str, meta: &TemplateMetadata) {
    for (name, map) in [("labels", &meta.labels), ("annotations", &meta.annotations)] {
        let Some(map) = map else { continue };
        let max = MAX_TEMPLATE_METADATA_ENTRIES as usize;
        if map.len() > max {
            errors.push(FieldError::TooMany {
                path: format!("{path}.{name}"),
                max,
                actual: map.len(),
            });
        }
        for (key, value) in map {
            let len = value.chars().count();
            let max = MAX_TEMPLATE_METADATA_VALUE_LENGTH as usize;
            if len > max {
                errors.push(FieldError::TooLong {
                    path: format!("{path}.{name}.{key}"),
                    max,
                    actual: len,
                });
            }
            if name == "annotations"
                && key
                    .strip_prefix(crate::names::ANNOTATION_PREFIX)
                    .is_some_and(|rest| rest.starts_with('/'))
            {
                errors.push(FieldError::Forbidden {
                    path: format!("{path}.annotations.{key}"),
                    reason: format!(
                        "annotations under {}/ are the provider's records: a template must not \
                         stamp them onto the objects it creates",
                        crate::names::ANNOTATION_PREFIX
                    ),
                });
            }
        }
    }
}

fn check_cluster_spec(errors: &mut Vec<FieldError>, prefix: &str, spec: &MailgunClusterSpec) {
    check_request_fields(errors, prefix, &spec.request, &spec.requester);
    if let Some(endpoint) = &spec.control_plane_endpoint {
        check_endpoint(errors, &format!("{prefix}.controlPlaneEndpoint"), endpoint);
    }
}

fn check_machine_spec(errors: &mut Vec<FieldError>, prefix: &str, spec: &MailgunMachineSpec) {
    check_request_fields(errors, prefix, &spec.request, &spec.requester);
    if let Some(id) = &spec.provider_id {
        check_string(
            errors,
            &format!("{prefix}.providerID"),
            id,
            1,
            MAX_PROVIDER_ID_LENGTH,
            &PROVIDER_ID,
            "<scheme>://<id> in printable ASCII without spaces",
        );
    }
    if let Some(domain) = &spec.failure_domain {
        check_string(
            errors,
            &format!("{prefix}.failureDomain"),
            domain,
            1,
            MAX_FAILURE_DOMAIN_LENGTH,
            &PRINTABLE,
            "printable ASCII without spaces",
        );
    }
    if let Some(addresses) = &spec.addresses {
        check_addresses(errors, &format!("{prefix}.addresses"), addresses);
    }
}

fn immutable<T: PartialEq>(
    errors: &mut Vec<FieldError>,
    prefix: &str,
    field: &str,
    old: &T,
    new: &T,
) {
    if old != new {
        errors.push(FieldError::Immutable {
            path: format!("{prefix}.{field}"),
            field: field.into(),
        });
    }
}

fn set_once<T: PartialEq>(
    errors: &mut Vec<FieldError>,
    prefix: &str,
    field: &str,
    old: &Option<T>,
    new: &Option<T>,
) {
    if old.is_some() && old != new {
        errors.push(FieldError::SetOnce {
            path: format!("{prefix}.{field}"),
            field: field.into(),
        });
    }
}

impl Validate for MailgunCluster {
    fn validate(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        check_cluster_spec(&mut errors, "spec", &self.spec);
        errors
    }

    fn validate_update(old: &Self, new: &Self) -> Vec<FieldError> {
        let mut errors = new.validate();
        let (o, n) = (&old.spec, &new.spec);
        immutable(&mut errors, "spec", "priority", &o.priority, &n.priority);
        immutable(&mut errors, "spec", "request", &o.request, &n.request);
        immutable(&mut errors, "spec", "requester", &o.requester, &n.requester);
        set_once(
            &mut errors,
            "spec",
            "controlPlaneEndpoint",
            &o.control_plane_endpoint,
            &n.control_plane_endpoint,
        );
        errors
    }
}

impl Validate for MailgunMachine {
    fn validate(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        check_machine_spec(&mut errors, "spec", &self.spec);
        errors
    }

    fn validate_update(old: &Self, new: &Self) -> Vec<FieldError> {
        let mut errors = new.validate();
        let (o, n) = (&old.spec, &new.spec);
        immutable(&mut errors, "spec", "priority", &o.priority, &n.priority);
        immutable(&mut errors, "spec", "request", &o.request, &n.request);
        immutable(&mut errors, "spec", "requester", &o.requester, &n.requester);
        set_once(
            &mut errors,
            "spec",
            "providerID",
            &o.provider_id,
            &n.provider_id,
        );
        set_once(
            &mut errors,
            "spec",
            "failureDomain",
            &o.failure_domain,
            &n.failure_domain,
        );
        errors
    }
}

impl Validate for MailgunClusterTemplate {
    fn validate(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let template = &self.spec.template;
        if let Some(meta) = &template.metadata {
            check_template_metadata(&mut errors, "spec.template.metadata", meta);
        }
        check_cluster_spec(&mut errors, "spec.template.spec", &template.spec);
        errors
    }

    fn validate_update(old: &Self, new: &Self) -> Vec<FieldError> {
        let mut errors = new.validate();
        immutable(
            &mut errors,
            "spec",
            "template",
            &old.spec.template,
            &new.spec.template,
        );
        errors
    }
}

impl Validate for MailgunMachineTemplate {
    fn validate(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let template = &self.spec.template;
        if let Some(meta) = &template.metadata {
            check_template_metadata(&mut errors, "spec.template.metadata", meta);
        }
        check_machine_spec(&mut errors, "spec.template.spec", &template.spec);
        if template.spec.provider_id.is_some() {
            errors.push(FieldError::Forbidden {
                path: "spec.template.spec.providerID".into(),
                reason: "providerID must not be set in a template: every machine gets its own"
                    .into(),
            });
        }
        errors
    }

    fn validate_update(old: &Self, new: &Self) -> Vec<FieldError> {
        let mut errors = new.validate();
        immutable(
            &mut errors,
            "spec",
            "template",
            &old.spec.template,
            &new.spec.template,
        );
        errors
    }
}

/// The rules of a `MailgunRemediation` a writer can break: its request, its answer's message,
/// the immutable priority, request and strategy, and the set-once answer. (The strategy's
/// durations and bounds are the schema's alone: nothing but a template sets them.)
impl Validate for MailgunRemediation {
    fn validate(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        check_request(&mut errors, "spec.request", &self.spec.request);
        if let Some(message) = self.spec.answer.as_ref().and_then(|a| a.message.as_ref()) {
            check_string(
                &mut errors,
                "spec.answer.message",
                message,
                0,
                MAX_ANSWER_MESSAGE_LENGTH,
                &REQUEST,
                TEXT,
            );
        }
        errors
    }

    fn validate_update(old: &Self, new: &Self) -> Vec<FieldError> {
        let mut errors = new.validate();
        let (o, n) = (&old.spec, &new.spec);
        immutable(&mut errors, "spec", "priority", &o.priority, &n.priority);
        immutable(&mut errors, "spec", "request", &o.request, &n.request);
        immutable(&mut errors, "spec", "strategy", &o.strategy, &n.strategy);
        set_once(&mut errors, "spec", "answer", &o.answer, &n.answer);
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1beta1::{
        MachineAddressType, MailgunClusterTemplateResource, MailgunClusterTemplateSpec,
        MailgunMachineTemplateResource, MailgunMachineTemplateSpec, Priority,
    };

    #[test]
    fn a_remediation_answer_is_bounded_clean_and_set_once() {
        use crate::v1beta1::{AnswerResult, MailgunRemediationSpec, RemediationAnswer};
        let old = MailgunRemediation::new(
            "m-0",
            MailgunRemediationSpec {
                priority: Priority::Urgent,
                request: "Power-cycle it.".into(),
                strategy: Default::default(),
                answer: None,
            },
        );
        let answered = |message: &str| {
            let mut new = old.clone();
            new.spec.answer = Some(RemediationAnswer {
                result: AnswerResult::Repaired,
                message: Some(message.into()),
            });
            new
        };
        let ok = answered("Replaced the PSU.\r\nBack up.");
        assert_eq!(MailgunRemediation::validate_update(&old, &ok), []);
        let paths = |new: &MailgunRemediation, base: &MailgunRemediation| {
            MailgunRemediation::validate_update(base, new)
                .iter()
                .map(|e| e.path().to_owned())
                .collect::<Vec<_>>()
        };
        let long = "x".repeat(MAX_ANSWER_MESSAGE_LENGTH as usize + 1);
        assert_eq!(paths(&answered(&long), &old), ["spec.answer.message"]);
        assert_eq!(
            paths(&answered("a\u{202e}b"), &old),
            ["spec.answer.message"]
        );
        assert_eq!(paths(&answered("bell\u{7}"), &old), ["spec.answer.message"]);
        // Set once: another answer, or none, after one.
        let mut other = ok.clone();
        other.spec.answer = Some(RemediationAnswer {
            result: AnswerResult::CannotRepair,
            message: None,
        });
        assert_eq!(paths(&other, &ok), ["spec.answer"]);
        let mut removed = ok.clone();
        removed.spec.answer = None;
        assert_eq!(paths(&removed, &ok), ["spec.answer"]);
        let mut strategy = ok.clone();
        strategy.spec.strategy.reminders = 3;
        assert_eq!(paths(&strategy, &ok), ["spec.strategy"]);
    }

    fn cluster() -> MailgunCluster {
        MailgunCluster::new(
            "c",
            MailgunClusterSpec {
                priority: Priority::Urgent,
                request: "One cluster please.\n\tThanks!".into(),
                requester: "ops.team+k8s@mail.example.com".into(),
                control_plane_endpoint: None,
                identity_ref: None,
            },
        )
    }

    fn machine() -> MailgunMachine {
        MailgunMachine::new(
            "m",
            MailgunMachineSpec {
                priority: Priority::BusinessCritical,
                request: "One machine".into(),
                requester: "ops@example.com".into(),
                provider_id: None,
                failure_domain: None,
                addresses: None,
            },
        )
    }

    fn endpoint(host: &str, port: i32) -> Option<ApiEndpoint> {
        Some(ApiEndpoint {
            host: host.into(),
            port,
        })
    }

    #[test]
    fn patterns_compile() {
        for p in [
            REQUESTER_PATTERN,
            REQUEST_PATTERN,
            HOST_PATTERN,
            PROVIDER_ID_PATTERN,
            FAILURE_DOMAIN_PATTERN,
            ADDRESS_PATTERN,
        ] {
            assert!(Regex::new(p).is_ok(), "{p}");
        }
    }

    #[test]
    fn valid_objects_pass() {
        assert_eq!(cluster().validate(), vec![]);
        let mut c = cluster();
        c.spec.control_plane_endpoint = endpoint("fd00::1", 6443);
        assert_eq!(c.validate(), vec![]);
        let mut m = machine();
        m.spec.provider_id = Some("mailgun:///rack-1/m-0".into());
        m.spec.failure_domain = Some("rack-1".into());
        m.spec.addresses = Some(vec![MachineAddress {
            type_: MachineAddressType::InternalIp,
            address: "10.0.0.1".into(),
        }]);
        assert_eq!(m.validate(), vec![]);
    }

    #[test]
    fn invalid_clusters_are_rejected_naming_the_field() {
        type Mutate = fn(&mut MailgunCluster);
        let table: &[(&str, Mutate, &str)] = &[
            ("empty request", |c| c.spec.request.clear(), "spec.request"),
            (
                "oversize request",
                |c| c.spec.request = "x".repeat(4097),
                "spec.request",
            ),
            (
                "NUL in request",
                |c| c.spec.request = "a\0b".into(),
                "spec.request",
            ),
            (
                "ESC in request",
                |c| c.spec.request = "a\u{1b}[31m".into(),
                "spec.request",
            ),
            (
                "U+2028 in request",
                |c| c.spec.request = "a\u{2028}b".into(),
                "spec.request",
            ),
            (
                "U+0085 in request",
                |c| c.spec.request = "a\u{85}b".into(),
                "spec.request",
            ),
            (
                "right-to-left override in request",
                |c| c.spec.request = "kubectl \u{202e}dorp sn eteled".into(),
                "spec.request",
            ),
            (
                "isolate in request",
                |c| c.spec.request = "a\u{2066}b\u{2069}".into(),
                "spec.request",
            ),
            (
                "not an e-mail",
                |c| c.spec.requester = "nobody".into(),
                "spec.requester",
            ),
            (
                "no dot in domain",
                |c| c.spec.requester = "a@localhost".into(),
                "spec.requester",
            ),
            (
                "CRLF injection",
                |c| c.spec.requester = "a@b.com\r\nBcc: x@y.com".into(),
                "spec.requester",
            ),
            (
                "LF injection",
                |c| c.spec.requester = "a@b.com\nBcc:x@y.com".into(),
                "spec.requester",
            ),
            (
                "display name",
                |c| c.spec.requester = "Me <a@b.com>".into(),
                "spec.requester",
            ),
            (
                "oversize requester",
                |c| c.spec.requester = format!("{}@example.com", "a".repeat(250)),
                "spec.requester",
            ),
            (
                "empty host",
                |c| c.spec.control_plane_endpoint = endpoint("", 6443),
                "spec.controlPlaneEndpoint.host",
            ),
            (
                "space in host",
                |c| c.spec.control_plane_endpoint = endpoint("a b", 6443),
                "spec.controlPlaneEndpoint.host",
            ),
            (
                "oversize host",
                |c| c.spec.control_plane_endpoint = endpoint(&"a".repeat(254), 6443),
                "spec.controlPlaneEndpoint.host",
            ),
            (
                "port 0",
                |c| c.spec.control_plane_endpoint = endpoint("h", 0),
                "spec.controlPlaneEndpoint.port",
            ),
            (
                "port 65536",
                |c| c.spec.control_plane_endpoint = endpoint("h", 65536),
                "spec.controlPlaneEndpoint.port",
            ),
        ];
        for (what, mutate, path) in table {
            let mut c = cluster();
            mutate(&mut c);
            let errors = c.validate();
            assert_eq!(errors.len(), 1, "{what}: {errors:?}");
            assert_eq!(errors[0].path(), *path, "{what}");
            assert!(
                errors[0].to_string().starts_with(path),
                "{what}: {}",
                errors[0]
            );
        }
    }

    /// The requester table shared with the API server test (`tests/crds.rs`) and the mail
    /// builder (`capm-mailer`): what admission lets in, the mail builder must accept.
    #[test]
    fn requester_table_matches_the_rust_validation() {
        let table: Vec<(String, bool, String)> =
            serde_json::from_str(include_str!("../testdata/requesters.json")).expect("table");
        let mut wrong = Vec::new();
        for (address, admitted, why) in &table {
            let mut c = cluster();
            c.spec.requester.clone_from(address);
            let errors = c.validate();
            if errors.is_empty() != *admitted {
                wrong.push(format!("{address:?} ({why}): {errors:?}"));
            }
            if !errors.is_empty() {
                assert!(
                    errors.iter().all(|e| e.path() == "spec.requester"),
                    "{address:?}: {errors:?}"
                );
            }
        }
        assert!(
            wrong.is_empty(),
            "disagree with the table:\n{}",
            wrong.join("\n")
        );
    }

    #[test]
    fn invalid_machines_are_rejected_naming_the_field() {
        type Mutate = fn(&mut MailgunMachine);
        let table: &[(&str, Mutate, &str)] = &[
            (
                "providerID without scheme",
                |m| m.spec.provider_id = Some("machine-1".into()),
                "spec.providerID",
            ),
            (
                "providerID with space",
                |m| m.spec.provider_id = Some("x://a b".into()),
                "spec.providerID",
            ),
            (
                "empty providerID",
                |m| m.spec.provider_id = Some(String::new()),
                "spec.providerID",
            ),
            (
                "oversize providerID",
                |m| m.spec.provider_id = Some(format!("x://{}", "a".repeat(600))),
                "spec.providerID",
            ),
            (
                "failureDomain with LF",
                |m| m.spec.failure_domain = Some("a\nb".into()),
                "spec.failureDomain",
            ),
            (
                "empty address",
                |m| {
                    m.spec.addresses = Some(vec![MachineAddress {
                        type_: MachineAddressType::Hostname,
                        address: String::new(),
                    }])
                },
                "spec.addresses[0].address",
            ),
            (
                "too many addresses",
                |m| {
                    m.spec.addresses = Some(vec![
                        MachineAddress {
                            type_: MachineAddressType::Hostname,
                            address: "h".into()
                        };
                        17
                    ])
                },
                "spec.addresses",
            ),
            (
                "bad requester",
                |m| m.spec.requester = "a@@b.com".into(),
                "spec.requester",
            ),
        ];
        for (what, mutate, path) in table {
            let mut m = machine();
            mutate(&mut m);
            let errors = m.validate();
            assert_eq!(errors.len(), 1, "{what}: {errors:?}");
            assert_eq!(errors[0].path(), *path, "{what}");
        }
    }

    #[test]
    fn updates_respect_immutable_and_set_once_fields() {
        let old = cluster();
        let mut new = old.clone();
        new.spec.priority = Priority::ExtremelyUrgent;
        new.spec.request = "more".into();
        new.spec.requester = "x@example.org".into();
        let paths: Vec<_> = MailgunCluster::validate_update(&old, &new)
            .iter()
            .map(|e| e.path().to_owned())
            .collect();
        assert_eq!(paths, ["spec.priority", "spec.request", "spec.requester"]);

        // unset -> set is allowed; change and unset are not.
        let mut set = old.clone();
        set.spec.control_plane_endpoint = endpoint("h", 6443);
        assert_eq!(MailgunCluster::validate_update(&old, &set), vec![]);
        assert_eq!(MailgunCluster::validate_update(&set, &set), vec![]);
        let mut changed = set.clone();
        changed.spec.control_plane_endpoint = endpoint("h", 443);
        let unset = old.clone();
        for new in [changed, unset] {
            let errors = MailgunCluster::validate_update(&set, &new);
            assert!(
                matches!(&errors[..], [FieldError::SetOnce { path, .. }] if path == "spec.controlPlaneEndpoint"),
                "{errors:?}"
            );
        }

        let old = machine();
        let mut set = old.clone();
        set.spec.provider_id = Some("x://1".into());
        set.spec.failure_domain = Some("fd".into());
        assert_eq!(MailgunMachine::validate_update(&old, &set), vec![]);
        let mut changed = set.clone();
        changed.spec.provider_id = Some("x://2".into());
        changed.spec.failure_domain = None;
        changed.spec.addresses = Some(vec![]); // addresses stay mutable
        let paths: Vec<_> = MailgunMachine::validate_update(&set, &changed)
            .iter()
            .map(|e| e.path().to_owned())
            .collect();
        assert_eq!(paths, ["spec.providerID", "spec.failureDomain"]);
    }

    #[test]
    fn templates_are_immutable_and_machine_templates_have_no_provider_id() {
        let c = cluster();
        let old = MailgunClusterTemplate::new(
            "t",
            MailgunClusterTemplateSpec {
                template: MailgunClusterTemplateResource {
                    metadata: None,
                    spec: c.spec.clone(),
                },
            },
        );
        let mut new = old.clone();
        new.spec.template.metadata = Some(TemplateMetadata::default());
        let errors = MailgunClusterTemplate::validate_update(&old, &new);
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].path(), "spec.template");

        let mut spec = machine().spec;
        spec.provider_id = Some("x://1".into());
        let t = MailgunMachineTemplate::new(
            "t",
            MailgunMachineTemplateSpec {
                template: MailgunMachineTemplateResource {
                    metadata: Some(TemplateMetadata {
                        labels: Some([("k".to_owned(), "v".repeat(5000))].into()),
                        annotations: None,
                    }),
                    spec,
                },
            },
        );
        let paths: Vec<_> = t.validate().iter().map(|e| e.path().to_owned()).collect();
        assert_eq!(
            paths,
            [
                "spec.template.metadata.labels.k",
                "spec.template.spec.providerID"
            ]
        );
        let mut forged = t.clone();
        forged.spec.template.spec.provider_id = None;
        forged.spec.template.metadata = Some(TemplateMetadata {
            labels: None,
            annotations: Some(
                [
                    (
                        crate::names::MAIL_SENT_ANNOTATION.to_owned(),
                        "x".to_owned(),
                    ),
                    (
                        "mailgun.infrastructure.cluster.x-k8s.io.example/x".to_owned(),
                        "y".to_owned(),
                    ),
                ]
                .into(),
            ),
        });
        let paths: Vec<_> = forged
            .validate()
            .iter()
            .map(|e| e.path().to_owned())
            .collect();
        assert_eq!(
            paths,
            [format!(
                "spec.template.metadata.annotations.{}",
                crate::names::MAIL_SENT_ANNOTATION
            )]
        );
    }
}
