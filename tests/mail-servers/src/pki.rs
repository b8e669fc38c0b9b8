//! Throw-away TLS material for the test servers: a CA and a server certificate for
//! `127.0.0.1` and `localhost`, written as PEM files into a directory.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Why test certificates could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// Key generation or signing failed.
    #[error("generating {what}: {source}")]
    Generate {
        /// Which certificate or key.
        what: &'static str,
        /// Why.
        #[source]
        source: rcgen::Error,
    },
    /// A PEM file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// PEM files of a fresh CA and a server certificate it signed.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate (what clients trust).
    pub ca_cert: PathBuf,
    /// The server certificate (SANs `127.0.0.1`, `localhost`).
    pub server_cert: PathBuf,
    /// The server's private key.
    pub server_key: PathBuf,
}

fn generate(what: &'static str) -> impl FnOnce(rcgen::Error) -> PkiError {
    move |source| PkiError::Generate { what, source }
}

fn write(path: PathBuf, pem: &str) -> Result<PathBuf, PkiError> {
    std::fs::write(&path, pem).map_err(|source| PkiError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

impl TestPki {
    /// Generates a CA and a server certificate and writes `ca.pem`, `server.pem` and
    /// `server-key.pem` into `dir`.
    ///
    /// # Errors
    /// [`PkiError`] when generating or writing fails.
    pub fn generate(dir: &Path) -> Result<Self, PkiError> {
        let ca_key = KeyPair::generate().map_err(generate("CA key"))?;
        let mut ca = CertificateParams::default();
        ca.distinguished_name
            .push(DnType::CommonName, "capm test mail CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca
            .self_signed(&ca_key)
            .map_err(generate("CA certificate"))?;
        let issuer = Issuer::new(ca, ca_key);

        let key = KeyPair::generate().map_err(generate("server key"))?;
        let mut server = CertificateParams::default();
        server
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server.subject_alt_names = vec![
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::DnsName("localhost".try_into().map_err(generate("server SAN"))?),
        ];
        server.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = server
            .signed_by(&key, &issuer)
            .map_err(generate("server certificate"))?;
        Ok(Self {
            ca_cert: write(dir.join("ca.pem"), &ca_cert.pem())?,
            server_cert: write(dir.join("server.pem"), &cert.pem())?,
            server_key: write(dir.join("server-key.pem"), &key.serialize_pem())?,
        })
    }
}
