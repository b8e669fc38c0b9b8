//! The links' key file: read when it changes, its keys put in the ring the page and the
//! controllers seal and open with.

use capm_api::link_token::{KeyRing, Keys};

/// The key file is read up to this size (a Secret holds at most 1 MiB; a key line is ~45 bytes).
const MAX_KEY_FILE_BYTES: u64 = 64 * 1024;

/// The key list's file, and what was last read from it.
#[derive(Debug)]
pub struct KeyFile {
    path: std::path::PathBuf,
    last: Option<Vec<u8>>,
}

impl KeyFile {
    /// The key list in `path`, not read yet.
    pub fn new(path: std::path::PathBuf) -> Self {
        Self { path, last: None }
    }

    /// The key list, if the file changed since the last call (the first call always reads).
    ///
    /// # Errors
    /// The file cannot be read, or holds no usable key list (the error names no key); the
    /// next call reads it again.
    pub fn load(&mut self) -> anyhow::Result<Option<Keys>> {
        let path = self.path.display();
        let mut bytes = Vec::new();
        std::fs::File::open(&self.path)
            .and_then(|f| {
                std::io::Read::read_to_end(
                    &mut std::io::Read::take(f, MAX_KEY_FILE_BYTES + 1),
                    &mut bytes,
                )
            })
            .map_err(|e| anyhow::anyhow!("reading {path}: {e}"))?;
        if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
            anyhow::bail!("{path} is larger than {MAX_KEY_FILE_BYTES} bytes");
        }
        if self.last.as_ref() == Some(&bytes) {
            return Ok(None);
        }
        let keys = Keys::parse(&String::from_utf8_lossy(&bytes))
            .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
        self.last = Some(bytes);
        Ok(Some(keys))
    }
}

/// The key file and the ring its keys go to, for [`crate::reload`]: a Secret's keys rotate
/// without a restart, a broken file keeps the keys in use.
#[derive(Debug)]
pub struct KeyReload {
    /// The file.
    pub file: KeyFile,
    /// Where its keys go.
    pub ring: KeyRing,
}

impl crate::reload::Reload for KeyReload {
    fn what(&self) -> String {
        "the fulfilment keys".to_owned()
    }

    fn reload(&mut self) -> anyhow::Result<bool> {
        Ok(match self.file.load()? {
            Some(keys) => {
                self.ring.replace(keys);
                true
            }
            None => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use capm_api::link_token::{Claims, Kind};

    use super::*;

    const KEY_A: &str = "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=";
    const KEY_B: &str = "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkI=";

    #[tokio::test]
    async fn a_rotated_key_file_is_used_and_a_broken_one_ignored() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), KEY_A).unwrap();
        let mut keys = KeyFile::new(file.path().to_owned());
        let ring = KeyRing::new(keys.load().unwrap().unwrap());
        assert!(keys.load().unwrap().is_none(), "unchanged");
        let stop = tokio_util::sync::CancellationToken::new();
        let reload = KeyReload {
            file: keys,
            ring: ring.clone(),
        };
        let task = tokio::spawn(crate::reload::watch(
            vec![Box::new(reload)],
            std::time::Duration::from_millis(20),
            stop.clone(),
        ));
        let claims = Claims::new(Kind::MailgunCluster, "ns", "c", "u", "<m@d>", u64::MAX);
        let old = ring.current().seal(&claims).unwrap();
        std::fs::write(file.path(), format!("{KEY_B}\n{KEY_A}\n")).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ring.current().len() != 2 {
            assert!(std::time::Instant::now() < deadline, "not reloaded");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_ne!(ring.current().seal(&claims).unwrap(), old);
        assert!(ring.current().open(&old, SystemTime::now()).is_ok());
        // A broken file keeps the keys in use.
        std::fs::write(file.path(), "not a key").unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(ring.current().len(), 2);
        stop.cancel();
        task.await.unwrap();
        let broken = KeyFile::new(file.path().to_owned())
            .load()
            .unwrap_err()
            .to_string();
        assert!(broken.contains("line 1"), "{broken}");
        assert!(
            !broken.contains(KEY_A) && !broken.contains("not a key"),
            "{broken}"
        );
    }
}
