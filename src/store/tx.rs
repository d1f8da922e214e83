//! One transaction of either backend, as the scripts written once for both run it
//! (`turns.rs`): a statement, of the shared SQL (`sql.rs`) or of the backend's own, bound to
//! values both drivers take, its rows read by column name (`row.rs`).
//!
//! The scripts decide what is written and in which order; a backend only hands each statement
//! to its driver, inside the transaction it opened (SQLite: the writer's batch, on the writer
//! thread; PostgreSQL: one transaction on a pooled connection).

use super::StoreError;
use super::row::StoredRow;

/// A value both drivers bind.
pub(super) trait Param: rusqlite::ToSql + tokio_postgres::types::ToSql + Sync {}

impl<T: rusqlite::ToSql + tokio_postgres::types::ToSql + Sync> Param for T {}

/// The values of one statement, `$1` first.
pub(super) type Values<'v> = [&'v (dyn Param + Sync)];

/// The statements of one open transaction.
pub(super) trait Tx {
    /// A row as the backend's driver answers it.
    type Row<'r>: StoredRow;

    /// Runs a statement; the number of rows it changed.
    async fn run(&self, sql: &str, values: &Values<'_>) -> Result<u64, StoreError>;

    /// Runs a query and decodes every row.
    async fn rows<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Self::Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError>;

    /// Runs a query and decodes its first row, if any.
    async fn maybe_row<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Self::Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Option<T>, StoreError>;

    /// Runs a query that answers one row (none is the driver's error).
    async fn row<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Self::Row<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError>;
}
