//! Connections: TLS, the statement cache, error conversion, and the bound on every operation.

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::OPERATION_TIMEOUT;
use crate::store::StoreError;

/// How connections to the server are protected, from the URL's `sslmode` and `store.ca_file`
/// (docs/reference.md, `[store]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transport {
    /// `sslmode=disable`.
    Plain,
    /// TLS with the server's certificate verified (`sslmode=require`, or a `ca_file`); with
    /// `sslmode=prefer` plaintext still when the server offers no TLS.
    Verified,
    /// No `sslmode` (libpq's `prefer`) and no `ca_file`: TLS when the server offers it,
    /// encrypted but the server not authenticated, as libpq does; plaintext when it does not.
    EncryptedOnly,
}

impl Transport {
    #[expect(
        clippy::wildcard_enum_match_arm,
        reason = "SslMode is open-ended: a mode a later tokio-postgres adds gets the strictest"
    )]
    pub(super) fn of(
        mode: tokio_postgres::config::SslMode,
        ca_file: Option<&std::path::Path>,
    ) -> Transport {
        use tokio_postgres::config::SslMode;
        match mode {
            SslMode::Disable => Transport::Plain,
            SslMode::Prefer if ca_file.is_none() => Transport::EncryptedOnly,
            // `require`, `prefer` with a CA to verify against, and any mode a later
            // tokio-postgres adds: the strictest.
            _ => Transport::Verified,
        }
    }
}

/// A rustls connector that encrypts without authenticating the server ([`Transport::EncryptedOnly`]).
pub(super) fn encryption_only_connector()
-> Result<tokio_postgres_rustls::MakeRustlsConnect, StoreError> {
    let config = crate::tls::encryption_only_config()
        .map_err(|err| StoreError::Setup(format!("TLS: {err}")))?;
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// Whether every host of the URL is on this machine (a Unix socket, `localhost` or a loopback
/// address), where an unencrypted connection exposes nothing to a network.
pub(super) fn local_hosts(config: &tokio_postgres::Config) -> bool {
    config
        .get_hostaddrs()
        .iter()
        .all(std::net::IpAddr::is_loopback)
        && config.get_hosts().iter().all(|host| match host {
            tokio_postgres::config::Host::Tcp(name) => {
                name == "localhost"
                    || name
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            }
            tokio_postgres::config::Host::Unix(_) => true,
        })
}

/// A rustls connector that verifies the server against `ca_file`, else the public web roots.
pub(super) fn tls_connector(
    ca_file: Option<&std::path::Path>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, StoreError> {
    let roots = match ca_file {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            use rustls_pki_types::pem::PemObject;
            let failed = |err: &dyn std::fmt::Display| {
                StoreError::Setup(format!("store.ca_file {}: {err}", path.display()))
            };
            for certificate in
                rustls_pki_types::CertificateDer::pem_file_iter(path).map_err(|err| failed(&err))?
            {
                roots
                    .add(certificate.map_err(|err| failed(&err))?)
                    .map_err(|err| failed(&err))?;
            }
            if roots.is_empty() {
                return Err(failed(&"no certificate in the file"));
            }
            roots
        }
        None => crate::tls::web_roots(),
    };
    let config =
        crate::tls::client_config(roots).map_err(|err| StoreError::Setup(format!("TLS: {err}")))?;
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// Statements through the connection's statement cache: each SQL text is parsed once per
/// connection, then only bound and executed.
pub(super) trait Cached: GenericClient {
    async fn run(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, StoreError> {
        let statement = self.prepare_cached(sql).await?;
        Ok(self.execute(&statement, params).await?)
    }

    async fn rows(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let statement = self.prepare_cached(sql).await?;
        Ok(self.query(&statement, params).await?)
    }

    async fn row(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Row, StoreError> {
        let statement = self.prepare_cached(sql).await?;
        Ok(self.query_one(&statement, params).await?)
    }

    async fn maybe_row(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError> {
        let statement = self.prepare_cached(sql).await?;
        Ok(self.query_opt(&statement, params).await?)
    }
}

impl<C: GenericClient> Cached for C {}

/// An error with its causes, in one line ("error performing TLS handshake: invalid peer
/// certificate: UnknownIssuer"), so the operator sees why and not only what.
fn with_causes(err: &dyn std::error::Error) -> String {
    let mut line = err.to_string();
    let mut cause = err.source();
    while let Some(source) = cause {
        let text = source.to_string();
        if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
        cause = source.source();
    }
    line
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(err: tokio_postgres::Error) -> StoreError {
        StoreError::ServerUnavailable(with_causes(&err))
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(err: deadpool_postgres::PoolError) -> StoreError {
        StoreError::ServerUnavailable(format!("no connection: {}", with_causes(&err)))
    }
}

/// Bounds an operation in time: a database that does not answer is unavailable.
pub(super) async fn bounded<T>(
    operation: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(OPERATION_TIMEOUT, operation)
        .await
        .map_err(|_| {
            StoreError::ServerUnavailable(format!("no answer within {OPERATION_TIMEOUT:?}"))
        })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_postgres::config::SslMode;

    #[test]
    fn the_url_and_ca_file_decide_the_transport() {
        let ca = std::path::Path::new("/etc/ssl/pg-ca.pem");
        assert_eq!(Transport::of(SslMode::Disable, Some(ca)), Transport::Plain);
        assert_eq!(
            Transport::of(SslMode::Prefer, None),
            Transport::EncryptedOnly
        );
        assert_eq!(
            Transport::of(SslMode::Prefer, Some(ca)),
            Transport::Verified
        );
        assert_eq!(Transport::of(SslMode::Require, None), Transport::Verified);
    }

    #[test]
    fn only_hosts_on_this_machine_are_local() {
        let local = |url: &str| local_hosts(&url.parse().expect("a URL"));
        assert!(local("postgres://agentgate@localhost/agentgate"));
        assert!(local("postgres://agentgate@127.0.0.1:5433/agentgate"));
        assert!(local("host=/run/postgresql user=agentgate"));
        assert!(!local("postgres://agentgate@db.example.com/agentgate"));
        assert!(!local("postgres://agentgate@10.0.0.5/agentgate"));
        assert!(!local("host=localhost,db2.example.com user=agentgate"));
    }
}
