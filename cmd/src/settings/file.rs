//! The `--config` file: YAML or JSON, camelCase keys. Its `mailer` section is the mail
//! backend's configuration; every other key becomes the default of the flag it names.

use std::path::Path;

use capm_mailer::MailerConfig;

use super::SettingsError;

/// Flags the config file cannot set: the file itself, and the mail backend's flags (the file
/// has its own `mailer` section for those).
pub(super) const FLAG_ONLY: &[&str] = &[
    "help",
    "version",
    "config",
    "mail_backend",
    "mailgun_domain",
    "mailgun_api_key_file",
    "mailgun_read_key_file",
    "mailgun_region",
    "mailgun_base_url",
    "smtp_url",
    "smtp_username",
    "smtp_password_file",
    "smtp_ca_file",
    "kubeconfig",
];

pub(super) fn file_error(path: &Path, reason: String) -> SettingsError {
    SettingsError::File {
        path: path.to_owned(),
        reason,
    }
}

pub(super) fn snake_to_camel(id: &str) -> String {
    let mut parts = id.split('_');
    let mut out = parts.next().unwrap_or_default().to_owned();
    for part in parts {
        let mut chars = part.chars();
        if let Some(first) = chars.next() {
            out.extend(first.to_uppercase());
            out.push_str(chars.as_str());
        }
    }
    out
}

/// The file's `mailer` section and, for every other key, the flag it sets (by clap id,
/// snake_case) with its value(s) as the flag would take them.
pub(super) type FileSettings = (Option<MailerConfig>, Vec<(String, Vec<String>)>);

pub(super) fn read_file(path: &Path) -> Result<FileSettings, SettingsError> {
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e.to_string()))?;
    if text.trim().is_empty() {
        return Ok((None, Vec::new()));
    }
    // YAML is a superset of JSON: one parser reads both. Going through a JSON value keeps the
    // mailer's `{mailgun: {...}}` form (serde_yaml_ng would want a `!mailgun` tag).
    let value: serde_json::Value =
        serde_yaml_ng::from_str(&text).map_err(|e| file_error(path, e.to_string()))?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(file_error(path, "expected a map of settings".into()));
    };
    let mailer = match map.remove("mailer") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(serde_json::from_value(v).map_err(|e| file_error(path, e.to_string()))?),
    };
    let mut defaults = Vec::new();
    for (key, value) in map {
        let scalar = |v: serde_json::Value| match v {
            serde_json::Value::String(s) => Ok(s),
            serde_json::Value::Bool(_) | serde_json::Value::Number(_) => Ok(v.to_string()),
            other => Err(file_error(
                path,
                format!("{key}: {other} is not a single value"),
            )),
        };
        let values = match value {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(items) => {
                items.into_iter().map(scalar).collect::<Result<_, _>>()?
            }
            other => vec![scalar(other)?],
        };
        let id = key.chars().fold(String::new(), |mut id, c| {
            if c.is_ascii_uppercase() {
                id.push('_');
            }
            id.push(c.to_ascii_lowercase());
            id
        });
        defaults.push((id, values));
    }
    Ok((mailer, defaults))
}
