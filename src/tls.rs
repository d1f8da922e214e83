//! TLS for the webhook listener (`[server] tls`) and every outbound connection (the model,
//! deliveries, MCP servers over HTTP, PostgreSQL): rustls with the ring provider, configured here
//! once so that every client verifies servers the same way and no process-wide default provider
//! has to be installed.

use std::sync::Arc;

use crate::secret::Secret;

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

/// A client configuration that encrypts but does not authenticate the server: what libpq's
/// `sslmode=prefer` does, and what a PostgreSQL URL without `sslmode` gets when no `store.ca_file`
/// names the server's CA (the daemon warns about it for a server off this machine). It protects
/// against a passive listener, not against an active one.
pub(crate) fn encryption_only_config() -> Result<rustls::ClientConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(
        rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptionOnly(provider)))
            .with_no_client_auth(),
    )
}

/// Accepts any certificate, but checks the handshake's signatures with it, so the session keys
/// are the server's own (see [`encryption_only_config`]).
#[derive(Debug)]
struct EncryptionOnly(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for EncryptionOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls_pki_types::CertificateDer<'_>,
        _intermediates: &[rustls_pki_types::CertificateDer<'_>],
        _server_name: &rustls_pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The public web roots (Mozilla's, as compiled into `webpki-roots`).
pub(crate) fn web_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    roots
}

/// `[server] tls`: the certificate chain and its private key, PEM.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TlsSettings {
    pub cert: Secret,
    pub key: Secret,
}

/// The webhook socket's TLS: `settings`' certificate chain and key, HTTP/2 and HTTP/1.1 offered
/// by ALPN. Errors name what is wrong, never the key's bytes.
pub(crate) fn server_config(settings: &TlsSettings) -> Result<Arc<rustls::ServerConfig>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(settings.cert.expose())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| format!("cert: not a PEM certificate chain: {err}"))?;
    if chain.is_empty() {
        return Err("cert: no certificate in it".to_string());
    }
    let key = PrivateKeyDer::from_pem_slice(settings.key.expose())
        .map_err(|err| format!("key: not a PEM private key: {err}"))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|err| format!("TLS setup: {err}"))?
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .map_err(|err| format!("the key does not fit the certificate: {err}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The console listener's TLS (`[console] tls`): as the webhook socket's, but HTTP/1.1 alone,
/// which is what the console serves.
pub(crate) fn http1_server_config(
    settings: &TlsSettings,
) -> Result<Arc<rustls::ServerConfig>, String> {
    let mut config = Arc::unwrap_or_clone(server_config(settings)?);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The roots outbound HTTPS trusts: the public web roots, and the machine's own trust store
/// (on Debian `/etc/ssl/certs`, where `update-ca-certificates` puts a private CA; also
/// `SSL_CERT_FILE` and `SSL_CERT_DIR`), read once. A certificate of the store that rustls cannot
/// use is skipped: the others still count.
fn outbound_roots() -> rustls::RootCertStore {
    static ROOTS: std::sync::OnceLock<rustls::RootCertStore> = std::sync::OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let mut roots = web_roots();
            let (_added, _skipped) =
                roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            roots
        })
        .clone()
}

/// An HTTP client builder whose TLS verifies servers against the public web roots and the
/// machine's trust store, and which follows no redirect: every outbound request goes to the
/// address the config names, and a `3xx` is that request's answer (docs/reference.md,
/// "Outbound requests"). Followed, a redirect would re-send a delivery's signed body, a model
/// request's conversation or an MCP call to wherever the answering server points, loopback
/// routes and metadata addresses included.
pub(crate) fn http_client() -> Result<reqwest::ClientBuilder, String> {
    let config = client_config(outbound_roots()).map_err(|err| format!("TLS setup: {err}"))?;
    Ok(reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(format!("agentgate/{}", crate::VERSION)))
}

/// How an answer that is not a success reads in an error: its status code, and for a redirect
/// that it was not followed.
pub(crate) fn answered(status: reqwest::StatusCode) -> String {
    if status.is_redirection() {
        format!("answered {} (a redirect: not followed)", status.as_u16())
    } else {
        format!("answered {}", status.as_u16())
    }
}

/// As [`http_client`], for a client that blocks its thread: the trace exporter's, which sends
/// from a thread of its own. Built on a thread of its own too, since it starts (and on drop
/// stops) a runtime of its own, which a thread of the daemon's runtime may not.
pub(crate) fn blocking_http_client(
    timeout: std::time::Duration,
) -> Result<reqwest::blocking::Client, String> {
    let config = client_config(outbound_roots()).map_err(|err| format!("TLS setup: {err}"))?;
    std::thread::spawn(move || {
        reqwest::blocking::Client::builder()
            .use_preconfigured_tls(config)
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timeout)
            .user_agent(format!("agentgate/{}", crate::VERSION))
            .build()
            .map_err(|err| format!("HTTP client: {err}"))
    })
    .join()
    .map_err(|_| "the HTTP client could not be built".to_string())?
}

/// Why an outbound request failed, in one line: what failed (`timed_out` for a timeout, "cannot
/// connect", "request failed") and its innermost cause (a certificate the trusted roots do not
/// vouch for, a refused connection), never the URL, which may be a secret.
pub(crate) fn request_failure(err: &reqwest::Error, timed_out: &str) -> String {
    use std::error::Error;
    if err.is_timeout() {
        return timed_out.to_string();
    }
    let what = if err.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    let mut innermost: Option<&dyn Error> = None;
    let mut cause = err.source();
    while let Some(next) = cause {
        innermost = Some(next);
        cause = next.source();
    }
    match innermost {
        Some(cause) => format!("{what}: {cause}"),
        None => what.to_string(),
    }
}
