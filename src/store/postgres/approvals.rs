//! [`Approvals`] on PostgreSQL: any node decides. A decision locks its request's row
//! (`FOR UPDATE`), so of two nodes deciding at once the second finds it decided; the turn it
//! queues is claimed by whichever node is free.

use const_format::concatcp;

use super::PostgresStore;
use crate::store::approval::{self, ApprovalRow, Decided, Decision};
use crate::store::sql::{
    APPROVAL_SQL, APPROVALS_SQL, DUE_TO_EXPIRE_SQL, DUE_TO_WARN_SQL, SESSION_PENDING_SQL,
};
use crate::store::{Approvals, StoreError, now_millis};

const LOCK_APPROVAL_SQL: &str = concatcp!(APPROVAL_SQL, " FOR UPDATE");
const LOCK_DUE_SQL: &str = concatcp!(DUE_TO_EXPIRE_SQL, " FOR UPDATE SKIP LOCKED");
const LOCK_SESSION_PENDING_SQL: &str = concatcp!(SESSION_PENDING_SQL, " FOR UPDATE");

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
        self.in_transaction(async |tx| approval::decide(tx, LOCK_APPROVAL_SQL, id, decision).await)
            .await
    }

    async fn expire_approvals(&self) -> Result<Vec<ApprovalRow>, StoreError> {
        self.in_transaction(async |tx| approval::expire(tx, LOCK_DUE_SQL).await)
            .await
    }

    async fn deny_session_approvals(
        &self,
        session_key: &str,
        decision: Decision,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        self.in_transaction(async |tx| {
            approval::settle_selected(tx, LOCK_SESSION_PENDING_SQL, &[&session_key], &decision)
                .await
        })
        .await
    }
}
