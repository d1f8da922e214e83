//! [`Approvals`] on SQLite: each decision, with its transcript entry and the queueing of its
//! turn, is one write of the writer thread, so two decisions of one request are serialized and
//! the second finds it decided.

use rusqlite::Connection;

use super::{SqliteStore, execute, query, query_optional};
use crate::store::approval::{APPROVAL_ENTRY, ApprovalRow, Decided, Decision, taking};
use crate::store::sql::{
    APPEND_SQL, APPROVAL_SQL, APPROVALS_SQL, CONTINUE_EVENT_SQL, CONTINUE_SESSION_SQL, DECIDE_SQL,
    DUE_TO_EXPIRE_SQL, DUE_TO_WARN_SQL, EXPIRE_BATCH, SESSION_PENDING_SQL,
};
use crate::store::{Approvals, StoreError, now_millis};

/// Records `decision` on the pending `row`, appends it to the transcript of the turn that asked,
/// and queues that turn to continue once nothing else of its event is pending.
fn settle_in(
    connection: &Connection,
    mut row: ApprovalRow,
    decision: Decision,
    now: i64,
) -> Result<ApprovalRow, StoreError> {
    let body = row.record(decision, now)?;
    execute(
        connection,
        DECIDE_SQL,
        &[&row.id, &row.status.sql(), &row.decided_by, &now, &row.note],
    )?;
    execute(
        connection,
        APPEND_SQL,
        &[&row.session, &row.turn_id, &APPROVAL_ENTRY, &body, &now],
    )?;
    execute(connection, CONTINUE_EVENT_SQL, &[&row.event_id, &now])?;
    execute(connection, CONTINUE_SESSION_SQL, &[&row.session, &now])?;
    Ok(row)
}

fn decide_in(connection: &Connection, id: &str, decision: Decision) -> Result<Decided, StoreError> {
    let Some(row) = query_optional(connection, APPROVAL_SQL, &[&id], |row| {
        ApprovalRow::decode(row)
    })?
    else {
        return Ok(Decided::Unknown);
    };
    let now = now_millis();
    let Some((decision, answer)) = taking(&row, decision, now) else {
        return Ok(Decided::Already(row));
    };
    Ok(answer(settle_in(connection, row, decision, now)?))
}

/// Settles each of `rows` (pending ones) as `decision`.
fn settle_all_in(
    connection: &Connection,
    rows: Vec<ApprovalRow>,
    decision: &Decision,
) -> Result<Vec<ApprovalRow>, StoreError> {
    let now = now_millis();
    rows.into_iter()
        .map(|row| settle_in(connection, row, decision.clone(), now))
        .collect()
}

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
        self.write(move |connection| decide_in(connection, &id, decision))
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
        self.write(move |connection| {
            let rows = due(connection, EXPIRE_BATCH)?;
            settle_all_in(connection, rows, &Decision::expired())
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
            let pending = query(connection, SESSION_PENDING_SQL, &[&key], |row| {
                ApprovalRow::decode(row)
            })?;
            settle_all_in(connection, pending, &decision)
        })
        .await
    }
}
