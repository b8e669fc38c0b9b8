//! TLS client configuration shared by the backends: rustls with the ring provider, explicitly,
//! so no process-wide default provider has to be installed.

use std::sync::Arc;

use rustls_platform_verifier::BuilderVerifierExt;

/// A client config that trusts what the platform trusts (the system CA store on Linux).
pub(crate) fn platform_client_config() -> Result<rustls::ClientConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_platform_verifier()?
        .with_no_client_auth())
}
