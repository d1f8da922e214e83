//! [`Approvals`] on PostgreSQL: any node decides. A decision locks its request's row
//! (`FOR UPDATE`), so of two nodes deciding at once the second finds it decided; the turn it
//! queues is claimed by whichever node is free.

use const_format::concatcp;

use super::PostgresStore;
use super::connect::{Cached, bounded};
use crate::store::approval::{APPROVAL_ENTRY, ApprovalRow, Decided, Decision, taking};
use crate::store::sql::{
    APPEND_SQL, APPROVAL_SQL, APPROVALS_SQL, CONTINUE_EVENT_SQL, CONTINUE_SESSION_SQL, DECIDE_SQL,
    DUE_TO_EXPIRE_SQL, DUE_TO_WARN_SQL, EXPIRE_BATCH, SESSION_PENDING_SQL,
};
use crate::store::{Approvals, StoreError, now_millis};

const LOCK_APPROVAL_SQL: &str = concatcp!(APPROVAL_SQL, " FOR UPDATE");
const LOCK_DUE_SQL: &str = concatcp!(DUE_TO_EXPIRE_SQL, " FOR UPDATE SKIP LOCKED");
const LOCK_SESSION_PENDING_SQL: &str = concatcp!(SESSION_PENDING_SQL, " FOR UPDATE");

/// Records `decision` on the pending `row`, appends it to the transcript of the turn that asked,
/// and queues that turn to continue once nothing else of its event is pending.
async fn settle(
    tx: &deadpool_postgres::Transaction<'_>,
    mut row: ApprovalRow,
    decision: Decision,
    now: i64,
) -> Result<ApprovalRow, StoreError> {
    let body = row.record(decision, now)?;
    tx.run(
        DECIDE_SQL,
        &[&row.id, &row.status.sql(), &row.decided_by, &now, &row.note],
    )
    .await?;
    tx.run(
        APPEND_SQL,
        &[&row.session, &row.turn_id, &APPROVAL_ENTRY, &body, &now],
    )
    .await?;
    tx.run(CONTINUE_EVENT_SQL, &[&row.event_id, &now]).await?;
    tx.run(CONTINUE_SESSION_SQL, &[&row.session, &now]).await?;
    Ok(row)
}

impl PostgresStore {
    /// Settles, in one transaction, the pending rows `sql` locks with `params` as `decision`.
    async fn settle_selected(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        decision: &Decision,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let rows = tx.rows(sql, params).await?;
            let now = now_millis();
            let mut settled = Vec::with_capacity(rows.len());
            for row in &rows {
                let row = ApprovalRow::decode(row)?;
                settled.push(settle(&tx, row, decision.clone(), now).await?);
            }
            tx.commit().await?;
            Ok(settled)
        })
        .await
    }
}

#[async_trait::async_trait]
impl Approvals for PostgresStore {
    async fn approvals(
        &self,
        pending_only: bool,
        limit: i64,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        self.fetch(APPROVALS_SQL, &[&pending_only, &limit], |row| {
            ApprovalRow::decode(row)
        })
        .await
    }

    async fn approval(&self, id: &str) -> Result<Option<ApprovalRow>, StoreError> {
        self.fetch_optional(APPROVAL_SQL, &[&id], ApprovalRow::decode)
            .await
    }

    async fn approvals_to_warn(&self, limit: i64) -> Result<Vec<ApprovalRow>, StoreError> {
        self.fetch(
            DUE_TO_WARN_SQL,
            &[&now_millis(), &limit],
            ApprovalRow::decode,
        )
        .await
    }

    async fn decide_approval(&self, id: &str, decision: Decision) -> Result<Decided, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let Some(row) = tx.maybe_row(LOCK_APPROVAL_SQL, &[&id]).await? else {
                return Ok(Decided::Unknown);
            };
            let row = ApprovalRow::decode(&row)?;
            let now = now_millis();
            let Some((decision, answer)) = taking(&row, decision, now) else {
                return Ok(Decided::Already(row));
            };
            let decided = answer(settle(&tx, row, decision, now).await?);
            tx.commit().await?;
            Ok(decided)
        })
        .await
    }

    async fn expire_approvals(&self) -> Result<Vec<ApprovalRow>, StoreError> {
        self.settle_selected(
            LOCK_DUE_SQL,
            &[&now_millis(), &EXPIRE_BATCH],
            &Decision::expired(),
        )
        .await
    }

    async fn deny_session_approvals(
        &self,
        session_key: &str,
        decision: Decision,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        self.settle_selected(LOCK_SESSION_PENDING_SQL, &[&session_key], &decision)
            .await
    }
}
