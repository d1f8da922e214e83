//! Connections: TLS, the statement cache, error conversion, and the bound on every operation.

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::OPERATION_TIMEOUT;
use crate::store::StoreError;

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
