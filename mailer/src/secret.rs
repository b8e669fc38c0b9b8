//! Secrets (API keys, passwords): where configuration says to read them from. The values
//! themselves are [`secrecy::SecretString`]s: `Debug` prints `[REDACTED]`, there is no
//! `Display`, the memory is zeroed on drop, and only `expose_secret()` reveals them.

use std::{os::unix::fs::MetadataExt, path::PathBuf, sync::Mutex, time::SystemTime};

pub use secrecy::{ExposeSecret, SecretString as Secret};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

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

    /// A [`SecretSource::Value`] holding `bytes` as text, one trailing newline removed as from a
    /// file; `None` when they are not UTF-8.
    #[must_use]
    pub fn source(bytes: Vec<u8>) -> Option<SecretSource> {
        let text = String::from_utf8(bytes).ok()?;
        Some(SecretSource::Value(Self::new(without_newline(text))))
    }
}

/// `text` without one trailing newline (`\n` or `\r\n`), as a secret file's content is read.
fn without_newline(text: String) -> String {
    text.strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t).to_owned())
        .unwrap_or(text)
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
                (without_newline(text), format!("file {}", path.display()))
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

/// What says a secret file changed: modification time, length, inode (the kubelet updates a
/// mounted Secret by swapping a symbolic link to new files).
type Stamp = (SystemTime, u64, u64);

/// A secret read again when its file changes, as serving certificates are: a key rotated in a
/// mounted Kubernetes Secret is used from the next request on, without a restart. A variable or
/// a given value is read once.
#[derive(Debug)]
pub struct LiveSecret {
    source: SecretSource,
    current: Mutex<(Option<Stamp>, Secret)>,
}

fn stamp(source: &SecretSource) -> Option<Stamp> {
    let SecretSource::File(path) = source else {
        return None;
    };
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

impl LiveSecret {
    /// Reads `source` now.
    ///
    /// # Errors
    /// As [`SecretSource::read`].
    pub fn new(source: SecretSource) -> Result<Self, SecretError> {
        let before = stamp(&source);
        let value = source.read()?;
        Ok(Self {
            source,
            current: Mutex::new((before, value)),
        })
    }

    /// The secret now: read again when its file changed; when the new file cannot be read, the
    /// previous value (with a warning).
    pub fn get(&self) -> Secret {
        let mut guard = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let now = stamp(&self.source);
        if now.is_some() && now != guard.0 {
            match self.source.read() {
                Ok(value) => {
                    info!(source = ?self.source, "Reloaded a secret file");
                    *guard = (now, value);
                }
                Err(e) => warn!(error = %e, "Keeping the previous secret"),
            }
        }
        guard.1.clone()
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
    fn a_live_secret_follows_its_file_and_keeps_the_last_good_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "key-one\n").unwrap();
        let live = LiveSecret::new(SecretSource::File(path.clone())).unwrap();
        assert_eq!(live.get().expose_secret(), "key-one");
        // As the kubelet does: new files, the name pointed at them.
        let next = dir.path().join("key.new");
        std::fs::write(&next, "key-rotated\n").unwrap();
        std::fs::rename(&next, &path).unwrap();
        assert_eq!(live.get().expose_secret(), "key-rotated");
        std::fs::write(&path, "").unwrap();
        assert_eq!(
            live.get().expose_secret(),
            "key-rotated",
            "an empty file is not a key"
        );
    }

    #[test]
    fn missing_env_var_is_named() {
        let err = SecretSource::Env("CAPM_MAILER_TEST_SURELY_UNSET".into())
            .read()
            .unwrap_err();
        assert!(err.to_string().contains("CAPM_MAILER_TEST_SURELY_UNSET"));
    }
}
