//! [`Approvals`] on SQLite: each decision, with its transcript entry and the queueing of its
//! turn, is one write of the writer thread, so two decisions of one request are serialized and
//! the second finds it decided.

use rusqlite::Connection;

use super::{SqliteStore, on_writer, query, query_optional};
use crate::store::approval::{self, ApprovalRow, Decided, Decision};
use crate::store::sql::{
    APPROVAL_SQL, APPROVALS_SQL, DUE_TO_EXPIRE_SQL, DUE_TO_WARN_SQL, SESSION_PENDING_SQL,
};
use crate::store::{Approvals, StoreError, now_millis};

#[async_trait::async_trait]
impl Approvals for SqliteStore {
    async fn approvals(
        &self,
        pending_only: bool,
        limit: i64,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        self.read(move |connection| {
            query(connection, APPROVALS_SQL, &[&pending_only, &limit], |row| {
                ApprovalRow::decode(row)
            })
        })
        .await
    }

    async fn approval(&self, id: &str) -> Result<Option<ApprovalRow>, StoreError> {
        let id = id.to_string();
        self.read(move |connection| {
            query_optional(connection, APPROVAL_SQL, &[&id], |row| {
                ApprovalRow::decode(row)
            })
        })
        .await
    }

    async fn approvals_to_warn(&self, limit: i64) -> Result<Vec<ApprovalRow>, StoreError> {
        self.read(move |connection| {
            query(
                connection,
                DUE_TO_WARN_SQL,
                &[&now_millis(), &limit],
                |row| ApprovalRow::decode(row),
            )
        })
        .await
    }

    async fn decide_approval(&self, id: &str, decision: Decision) -> Result<Decided, StoreError> {
        let id = id.to_string();
        self.write(move |connection| {
            on_writer(connection, async |tx| {
                approval::decide(tx, APPROVAL_SQL, &id, decision.clone()).await
            })
        })
        .await
    }

    async fn expire_approvals(&self) -> Result<Vec<ApprovalRow>, StoreError> {
        let due = |connection: &Connection, limit: i64| {
            query(
                connection,
                DUE_TO_EXPIRE_SQL,
                &[&now_millis(), &limit],
                |row| ApprovalRow::decode(row),
            )
        };
        // Looked for on a reader first: the sweep's usual round finds nothing, and then costs
        // the writer (and so the accepts) nothing.
        if self
            .read(move |connection| due(connection, 1))
            .await?
            .is_empty()
        {
            return Ok(Vec::new());
        }
        self.write(|connection| {
            on_writer(connection, async |tx| {
                approval::expire(tx, DUE_TO_EXPIRE_SQL).await
            })
        })
        .await
    }

    async fn deny_session_approvals(
        &self,
        session_key: &str,
        decision: Decision,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        let key = session_key.to_string();
        self.write(move |connection| {
            on_writer(connection, async |tx| {
                approval::settle_selected(tx, SESSION_PENDING_SQL, &[&key], &decision).await
            })
        })
        .await
    }
}
