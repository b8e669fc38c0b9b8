//! Throw-away PKI for the local control plane: a CA, the API server's serving certificate, client
//! certificates and the service-account signing key, all generated fresh for each control plane.

use std::net::{IpAddr, Ipv4Addr};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};

/// Failure to generate key material.
#[derive(Debug, thiserror::Error)]
#[error("generating {what}: {source}")]
pub struct PkiError {
    what: &'static str,
    #[source]
    source: rcgen::Error,
}

/// A PEM-encoded certificate and its private key.
#[derive(Clone)]
pub struct CertPair {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The private key, PKCS#8 PEM.
    pub key_pem: String,
}

impl std::fmt::Debug for CertPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertPair").finish_non_exhaustive()
    }
}

/// A certificate authority that can issue serving and client certificates.
pub struct CertificateAuthority {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .finish_non_exhaustive()
    }
}

fn ctx(what: &'static str) -> impl FnOnce(rcgen::Error) -> PkiError {
    move |source| PkiError { what, source }
}

fn serial() -> SerialNumber {
    SerialNumber::from_slice(&rand::random::<[u8; 16]>()[..])
}

impl CertificateAuthority {
    /// Creates a new self-signed CA with the given common name.
    ///
    /// # Errors
    /// When key generation or signing fails.
    pub fn new(common_name: &str) -> Result<Self, PkiError> {
        let key = KeyPair::generate().map_err(ctx("CA key"))?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(serial());
        let cert = params.self_signed(&key).map_err(ctx("CA certificate"))?;
        Ok(Self {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a TLS serving certificate for loopback (`127.0.0.1`, `::1`, `localhost`) plus
    /// `extra_dns` names and `extra_ips`.
    ///
    /// # Errors
    /// When key generation or signing fails.
    pub fn serving_cert(
        &self,
        common_name: &str,
        extra_dns: &[&str],
        extra_ips: &[IpAddr],
    ) -> Result<CertPair, PkiError> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        let mut sans = vec![
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::IpAddress(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)),
            SanType::DnsName("localhost".try_into().map_err(ctx("SAN localhost"))?),
        ];
        for name in extra_dns {
            sans.push(SanType::DnsName(
                (*name)
                    .try_into()
                    .map_err(ctx("DNS subject alternative name"))?,
            ));
        }
        sans.extend(extra_ips.iter().copied().map(SanType::IpAddress));
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        self.issue(params, "serving certificate")
    }

    /// Issues a client certificate: `common_name` is the Kubernetes user name, `organizations`
    /// its groups.
    ///
    /// # Errors
    /// When key generation or signing fails.
    pub fn client_cert(
        &self,
        common_name: &str,
        organizations: &[&str],
    ) -> Result<CertPair, PkiError> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        for org in organizations {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *org);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        self.issue(params, "client certificate")
    }

    fn issue(
        &self,
        mut params: CertificateParams,
        what: &'static str,
    ) -> Result<CertPair, PkiError> {
        params.serial_number = Some(serial());
        let key = KeyPair::generate().map_err(ctx(what))?;
        let cert = params.signed_by(&key, &self.issuer).map_err(ctx(what))?;
        Ok(CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A key pair for signing service-account tokens: (private key PEM, public key PEM).
///
/// # Errors
/// When key generation fails.
pub fn service_account_key() -> Result<(String, String), PkiError> {
    let key = KeyPair::generate().map_err(ctx("service-account signing key"))?;
    Ok((key.serialize_pem(), key.public_key_pem()))
}
