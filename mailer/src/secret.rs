//! Secrets (API keys, passwords): where configuration says to read them from. The values
//! themselves are [`secrecy::SecretString`]s: `Debug` prints `[REDACTED]`, there is no
//! `Display`, the memory is zeroed on drop, and only `expose_secret()` reveals them.

use std::path::PathBuf;

pub use secrecy::{ExposeSecret, SecretString as Secret};
use serde::{Deserialize, Serialize};

/// Where a secret comes from. Configuration never holds the value itself, so a config file or
/// its `Debug` output can be shown without leaking anything.
///
/// In configuration: `{"file": "/etc/capm/mailgun-api-key"}` or `{"env": "MAILGUN_API_KEY"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum SecretSource {
    /// A file whose content (one trailing newline removed) is the secret; e.g. a mounted
    /// Kubernetes Secret.
    File(PathBuf),
    /// An environment variable holding the secret.
    Env(String),
    /// A value already read by the caller (a Kubernetes Secret read through the API, for a
    /// mail identity). Never in a configuration file: not (de)serializable.
    #[serde(skip)]
    Value(InlineSecret),
}

/// A secret value held in memory for [`SecretSource::Value`]: redacted in `Debug`, compared by
/// value (so a rotated key is seen as a change).
#[derive(Clone)]
pub struct InlineSecret(Secret);

impl InlineSecret {
    /// Holds `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(Secret::from(value.into()))
    }
}

impl std::fmt::Debug for InlineSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[REDACTED]")
    }
}

impl PartialEq for InlineSecret {
    fn eq(&self, other: &Self) -> bool {
        self.0.expose_secret() == other.0.expose_secret()
    }
}

impl Eq for InlineSecret {}

/// Why a secret could not be read. Never contains the secret.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The secret file could not be read.
    #[error("reading secret file {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The environment variable is not set or not valid Unicode.
    #[error("environment variable {name} is not set (or not valid UTF-8)")]
    Env {
        /// The variable's name.
        name: String,
    },
    /// The secret is empty.
    #[error("secret from {0} is empty")]
    Empty(String),
}

impl SecretSource {
    /// Reads the secret now.
    ///
    /// # Errors
    /// [`SecretError`] when the file or variable cannot be read or the value is empty.
    pub fn read(&self) -> Result<Secret, SecretError> {
        let (value, origin) = match self {
            Self::File(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| SecretError::File {
                    path: path.clone(),
                    source,
                })?;
                let text = text
                    .strip_suffix('\n')
                    .map(|t| t.strip_suffix('\r').unwrap_or(t))
                    .map(str::to_owned)
                    .unwrap_or(text);
                (text, format!("file {}", path.display()))
            }
            Self::Env(name) => (
                std::env::var(name).map_err(|_| SecretError::Env { name: name.clone() })?,
                format!("environment variable {name}"),
            ),
            Self::Value(value) => (
                value.0.expose_secret().to_owned(),
                "the given value".to_owned(),
            ),
        };
        if value.is_empty() {
            return Err(SecretError::Empty(origin));
        }
        Ok(Secret::from(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted() {
        let s = Secret::from("key-supersecret");
        assert!(format!("{s:?}").contains("REDACTED"));
        assert!(!format!("{s:?}").contains("supersecret"));
        assert_eq!(s.expose_secret(), "key-supersecret");
    }

    #[test]
    fn read_from_file_strips_one_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "key-abc\n").unwrap();
        assert_eq!(
            SecretSource::File(path.clone())
                .read()
                .unwrap()
                .expose_secret(),
            "key-abc"
        );
        std::fs::write(&path, "").unwrap();
        let err = SecretSource::File(path).read().unwrap_err();
        assert!(matches!(err, SecretError::Empty(_)), "{err}");
        let err = SecretSource::File(dir.path().join("missing"))
            .read()
            .unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn missing_env_var_is_named() {
        let err = SecretSource::Env("CAPM_MAILER_TEST_SURELY_UNSET".into())
            .read()
            .unwrap_err();
        assert!(err.to_string().contains("CAPM_MAILER_TEST_SURELY_UNSET"));
    }
}
