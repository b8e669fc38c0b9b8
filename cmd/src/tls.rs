//! Serving certificates: the webhook's and the diagnostics endpoint's, re-read from disk when
//! the files change; or, for diagnostics without a certificate directory, a self-signed one
//! made at start (as controller-runtime does).
//!
//! The process's reloader ([`crate::reload`]) looks at the files' metadata (modification time,
//! size, inode: a Kubernetes Secret volume swaps a symlink, cert-manager rewrites files) and
//! reloads on any change, so a renewed certificate is served within its interval, without a
//! restart; handshakes only read the pair in use. A pair that does not load (for example a
//! half-written update) is logged and the previous one kept.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, PoisonError, RwLock},
    time::SystemTime,
};

use rustls::{
    ServerConfig,
    crypto::{CryptoProvider, ring},
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};

/// Why the certificate could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or parsed.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The key does not fit the certificate, or rustls refused them.
    #[error("tls.crt/tls.key: {0}")]
    Pair(String),
}

type Stamp = [(SystemTime, u64, u64); 2];

/// Serves the current `tls.crt` / `tls.key` of a directory.
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<(Stamp, Arc<CertifiedKey>)>,
}

fn stamp(paths: [&Path; 2]) -> Result<Stamp, TlsError> {
    let one = |path: &Path| {
        let m = std::fs::metadata(path).map_err(|e| TlsError::File {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Ok((
            m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            m.len(),
            m.ino(),
        ))
    };
    Ok([one(paths[0])?, one(paths[1])?])
}

fn load(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, TlsError> {
    let file_err = |path: &Path| {
        let path = path.to_owned();
        move |e: rustls::pki_types::pem::Error| TlsError::File {
            path,
            reason: e.to_string(),
        }
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(file_err(cert))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(file_err(cert))?;
    if chain.is_empty() {
        return Err(TlsError::File {
            path: cert.to_owned(),
            reason: "no certificate in the file".into(),
        });
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(file_err(key))?;
    CertifiedKey::from_der(chain, key_der, provider).map_err(|e| TlsError::Pair(e.to_string()))
}

impl ReloadingCert {
    /// Loads `dir/tls.crt` and `dir/tls.key`.
    ///
    /// # Errors
    /// When they cannot be read, parsed, or do not belong together.
    pub fn new(dir: &Path) -> Result<Self, TlsError> {
        let provider = Arc::new(ring::default_provider());
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let before = stamp([&cert, &key])?;
        let pair = load(&cert, &key, &provider)?;
        Ok(Self {
            cert,
            key,
            provider,
            current: RwLock::new((before, Arc::new(pair))),
        })
    }

    /// A rustls server configuration (HTTP/1.1) that serves this certificate.
    ///
    /// # Errors
    /// When the crypto provider supports no safe protocol version (not expected with ring).
    pub fn server_config(self: Arc<Self>) -> Result<ServerConfig, rustls::Error> {
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self);
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }

    /// Loads the pair again if the files changed: `Ok(true)` when it did.
    fn reload(&self) -> Result<bool, TlsError> {
        let now = stamp([&self.cert, &self.key])?;
        if now
            == self
                .current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .0
        {
            return Ok(false);
        }
        let pair = Arc::new(load(&self.cert, &self.key, &self.provider)?);
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = (now, pair);
        Ok(true)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .1
                .clone(),
        )
    }
}

/// A certificate directory for [`crate::reload`].
#[derive(Debug)]
pub struct CertReload(pub Arc<ReloadingCert>);

impl crate::reload::Reload for CertReload {
    fn what(&self) -> String {
        "a serving certificate".to_owned()
    }

    /// Only the files' metadata is read each time: a renewed certificate is served within a
    /// second.
    fn interval(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }

    fn reload(&mut self) -> anyhow::Result<bool> {
        self.0
            .reload()
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.0.cert.display()))
    }
}

/// A rustls server configuration (HTTP/1.1) with a new self-signed certificate for `names`
/// (DNS names or IP addresses), valid from now for about a year. Clients must skip
/// verification or pin it: nothing signs it.
///
/// # Errors
/// When a name is unusable or key generation fails.
pub fn self_signed_server_config(names: Vec<String>) -> Result<ServerConfig, TlsError> {
    let pair = |e: &dyn std::fmt::Display| TlsError::Pair(format!("self-signed: {e}"));
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(names).map_err(|e| pair(&e))?;
    let key = PrivateKeyDer::try_from(signing_key.serialize_der()).map_err(|e| pair(&e))?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| pair(&e))?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)
        .map_err(|e| pair(&e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_self_signed_config_serves_one_certificate() {
        let config = self_signed_server_config(vec!["localhost".into(), "127.0.0.1".into()])
            .expect("config");
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
