//! The flags' value parsers: each refuses a value with a reason, and the caller names the flag.

use std::{
    fmt,
    net::{Ipv4Addr, SocketAddr},
    sync::LazyLock,
    time::Duration,
};

use clap::{
    Arg, ArgAction,
    builder::{BoolishValueParser, PossibleValuesParser, TypedValueParser, ValueParser},
};

use super::{Field, SettingsError, invalid};

/// A plain address, the same rule as `MailgunCluster.spec.requester`.
static ADDRESS: LazyLock<Option<regex::Regex>> =
    LazyLock::new(|| regex::Regex::new(capm_api::validation::REQUESTER_PATTERN).ok());

/// Why one of this module's value parsers refused a value; the caller names the flag.
#[derive(Debug)]
pub(super) struct Refused(pub(super) String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

pub(super) fn recipient(value: &str) -> Result<String, Refused> {
    let address = value.trim();
    if ADDRESS.as_ref().is_some_and(|re| re.is_match(address)) {
        Ok(address.to_owned())
    } else {
        Err(Refused(format!("{address:?} is not an e-mail address")))
    }
}

pub(super) fn namespace(value: &str) -> Result<String, Refused> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if ok {
        Ok(value.to_owned())
    } else {
        Err(Refused(format!(
            "{value:?} is not a namespace name (lower-case letters, digits, '-')"
        )))
    }
}

pub(super) fn check_dns_subdomain(field: Field, value: &str) -> Result<(), SettingsError> {
    let ok = !value.is_empty()
        && value.len() <= 253
        && value.split('.').all(|part| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{value:?} is not an object name (lower-case letters, digits, '-', '.')"),
        ))
    }
}

pub(super) fn label_value(value: &str) -> Result<String, Refused> {
    let ok = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value.starts_with(|c: char| c.is_ascii_alphanumeric())
        && value.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(value.to_owned())
    } else {
        Err(Refused(format!(
            "{value:?} is not a label value (at most 63 letters, digits, '-', '_', '.')"
        )))
    }
}

pub(super) fn log_filter(value: &str) -> Result<String, Refused> {
    match tracing_subscriber::EnvFilter::try_new(value) {
        Ok(_) => Ok(value.to_owned()),
        Err(e) => Err(Refused(format!("{value:?}: {e}"))),
    }
}

/// `0` disables; `:8080` means every interface, as in controller-runtime.
pub(super) fn bind_address(field: Field, value: &str) -> Result<Option<SocketAddr>, SettingsError> {
    if value == "0" {
        return Ok(None);
    }
    let parsed = match value.strip_prefix(':') {
        Some(port) => port
            .parse::<u16>()
            .ok()
            .map(|port| SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))),
        None => value.parse::<SocketAddr>().ok(),
    };
    parsed.map(Some).ok_or_else(|| {
        invalid(
            field,
            format!("{value:?} is not host:port (e.g. 127.0.0.1:8080 or :8080), or 0 to disable"),
        )
    })
}

/// `30s`, `2m`, `1h`, `500ms`, `1m30s` (jiff's friendly format, without calendar units: a day
/// is not always 24 hours) or plain seconds.
pub(super) fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).ok();
    }
    let signed: jiff::SignedDuration = text.parse().ok()?;
    Duration::try_from(signed).ok()
}

/// `duration` as a flag shows its default and [`parse_duration`] reads it back: `720h`, `30s`,
/// `1h 30m` (jiff's friendly format, hours as the largest unit).
pub(super) fn duration_text(duration: Duration) -> String {
    match jiff::SignedDuration::try_from(duration) {
        Ok(signed) => format!("{signed:#}"),
        Err(_) => format!("{}s", duration.as_secs()),
    }
}

/// [`parse_duration`] as a flag's value parser.
pub(super) fn duration(text: &str) -> Result<Duration, Refused> {
    parse_duration(text)
        .ok_or_else(|| Refused(format!("{text:?} is not a duration like 30s, 2m or 500ms")))
}

/// A MailgunClusterIdentity's `allowedNamespaces` as JSON, with the rules its schema has.
pub(super) fn allowed_namespaces(
    text: &str,
) -> Result<capm_api::v1beta1::AllowedNamespaces, Refused> {
    let allowed: capm_api::v1beta1::AllowedNamespaces =
        serde_json::from_str(text).map_err(|e| {
            Refused(format!(
                "not allowedNamespaces JSON ({{\"list\": [...], \"selector\": {{...}}}}): {e}"
            ))
        })?;
    for name in allowed.list.iter().flatten() {
        namespace(name)?;
    }
    let selector = allowed.selector.as_ref();
    if let Some(bad) = selector
        .and_then(|s| s.match_expressions.as_ref())
        .into_iter()
        .flatten()
        .find(|r| !r.is_valid())
    {
        return Err(Refused(format!(
            "selector requirement on {:?}: values are required (not empty) for In and NotIn, \
             empty for Exists and DoesNotExist",
            bad.key
        )));
    }
    Ok(allowed)
}

/// `host`, `host:port`, `[IPv6]` or `[IPv6]:port` (the identities' allow-lists), lower-cased.
pub(super) fn host_entry(text: &str) -> Result<String, Refused> {
    let entry = text.trim().to_ascii_lowercase();
    match capm_mailer::parse_host_entry(&entry) {
        Some((_, port)) if port != Some(0) => Ok(entry),
        _ => Err(Refused(format!(
            "{text:?} is not a host, host:port or [IPv6]:port"
        ))),
    }
}

/// A flag taking one of a library's enum values by its name in configuration (the mailer's
/// `MailgunRegion`, `MailgunEventsApi`): the enum stays the library's, with no copy here.
pub(super) fn one_of<T: Copy + Send + Sync + 'static>(
    all: &'static [T],
    name: fn(T) -> &'static str,
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(all.iter().map(|v| name(*v))).try_map(move |given| {
        all.iter()
            .copied()
            .find(|v| name(*v) == given)
            .ok_or_else(|| Refused(format!("{given:?} is not one of the values")))
    })
}

/// The one shape of every boolean flag, applied to each flag whose value is a `bool`: `--flag`
/// alone means true, `--flag=false` (or `no`, `off`, `0`) false; the variable takes the same
/// words. Its declaration gives the default (`default_value_t`), or none for an `Option<bool>`.
pub(super) fn switch(arg: Arg) -> Arg {
    if arg.get_value_parser().type_id() != ValueParser::bool().type_id() {
        return arg;
    }
    arg.action(ArgAction::Set)
        .value_name("BOOL")
        .num_args(0..=1)
        .require_equals(true)
        .default_missing_value("true")
        .value_parser(BoolishValueParser::new())
}
