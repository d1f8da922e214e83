//! [`Operator`] on PostgreSQL: `sessions resume|suspend`, `events replay`, `deliveries retry`;
//! any node takes them.

use const_format::concatcp;

use super::PostgresStore;
use super::connect::{Cached, bounded};
use super::recovery::FORGET_RESUMES_SQL;
use crate::store::model::RetryTarget;
use crate::store::row::StoredRow;
use crate::store::sql::{
    REPLAY_SQL, REQUEUE_STOPPED_EVENT_SQL, RESUME_SESSION_SQL, RETRY_SQL, SEND_PENDING_NOW_SQL,
};
use crate::store::states::{OPERATOR, SUSPENDED, SessionState};
use crate::store::{Operator, StoreError, now_millis};

/// `$1` session key.
const LOCK_SESSION_SQL: &str = "SELECT state FROM sessions WHERE key = $1 FOR UPDATE";

/// `$1` session key, `$2` now: answers the state the session was in.
const SUSPEND_SQL: &str = concatcp!(
    "UPDATE sessions n SET state = ",
    SUSPENDED,
    ", reason = ",
    OPERATOR,
    ", updated_at = $2
     FROM sessions o WHERE n.key = $1 AND o.key = n.key
     RETURNING o.state AS state"
);

#[async_trait::async_trait]
impl Operator for PostgresStore {
    async fn operator_resume(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let Some(row) = tx.maybe_row(LOCK_SESSION_SQL, &[&key]).await? else {
                return Ok(None);
            };
            let state: SessionState = row.column("state")?;
            let now = now_millis();
            tx.run(FORGET_RESUMES_SQL, &[&key]).await?;
            tx.run(REQUEUE_STOPPED_EVENT_SQL, &[&key, &now]).await?;
            tx.run(RESUME_SESSION_SQL, &[&key, &now]).await?;
            tx.commit().await?;
            Ok(Some(state))
        })
        .await
    }

    async fn operator_suspend(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        self.fetch_optional(SUSPEND_SQL, &[&key, &now_millis()], |row| {
            row.column("state")
        })
        .await
    }

    async fn replay_event(&self, id: &str) -> Result<Option<String>, StoreError> {
        let copy = uuid::Uuid::now_v7().to_string();
        let inserted = self
            .execute_one(REPLAY_SQL, &[&id, &copy, &now_millis()])
            .await?;
        Ok((inserted == 1).then_some(copy))
    }

    async fn retry_deliveries(&self, target: RetryTarget) -> Result<u64, StoreError> {
        let now = now_millis();
        match &target {
            RetryTarget::One(id) => {
                self.execute_one(RETRY_SQL, &[&Some(id.as_str()), &now])
                    .await
            }
            RetryTarget::AllFailed => self.execute_one(RETRY_SQL, &[&None::<&str>, &now]).await,
            RetryTarget::Pending { route } => {
                self.execute_one(SEND_PENDING_NOW_SQL, &[&route.as_deref(), &now])
                    .await
            }
        }
    }
}
