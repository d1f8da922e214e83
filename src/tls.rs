//! TLS for every outbound connection (the model, deliveries, MCP servers over HTTP, PostgreSQL):
//! rustls with the ring provider, configured here once so that every client verifies servers the
//! same way and no process-wide default provider has to be installed.

use std::sync::Arc;

/// A client configuration that verifies servers against `roots`.
pub(crate) fn client_config(
    roots: rustls::RootCertStore,
) -> Result<rustls::ClientConfig, rustls::Error> {
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// The public web roots (Mozilla's, as compiled into `webpki-roots`).
pub(crate) fn web_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    roots
}

/// An HTTP client builder whose TLS verifies servers against the public web roots.
pub(crate) fn http_client() -> Result<reqwest::ClientBuilder, String> {
    let config = client_config(web_roots()).map_err(|err| format!("TLS setup: {err}"))?;
    Ok(reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .user_agent(concat!("agentgate/", env!("CARGO_PKG_VERSION"))))
}
