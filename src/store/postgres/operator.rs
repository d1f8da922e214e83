//! [`Operator`] on PostgreSQL: `sessions resume|suspend|rewind|fork`, `events replay`,
//! `deliveries retry`; any node takes them.

use const_format::concatcp;

use super::PostgresStore;
use super::connect::{Cached, bounded};
use super::recovery::FORGET_RESUMES_SQL;
use crate::store::model::RetryTarget;
use crate::store::rewind::{self, EntryFacts, RewindEvent, RewindSteps, SessionFacts};
use crate::store::row::StoredRow;
use crate::store::sql::{
    FORK_ENTRIES_SQL, FORK_SESSION_SQL, REPLAY_SQL, REQUEUE_STOPPED_EVENT_SQL, RESUME_SESSION_SQL,
    RETRY_SQL, REWIND_ENTRY_SQL, REWIND_EVENT_SQL, REWIND_SESSION_SQL, SEND_PENDING_NOW_SQL,
    SUPERSEDE_SQL,
};
use crate::store::states::{OPERATOR, SUSPENDED, SessionState};
use crate::store::{Operator, RewindRefusal, RewindRequest, Rewound, StoreError, now_millis};

/// `$1` session key.
const LOCK_SESSION_SQL: &str = "SELECT state FROM sessions WHERE key = $1 FOR UPDATE";

/// A rewind reads the session with its row locked: no turn of it can be claimed, on any node,
/// until the rewind has committed or given up.
const LOCK_REWOUND_SQL: &str = concatcp!(REWIND_SESSION_SQL, " FOR UPDATE");

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

    async fn rewind(
        &self,
        request: RewindRequest,
    ) -> Result<Result<Rewound, RewindRefusal>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let outcome = rewind::apply(&mut RewindIn { tx: &tx }, &request).await?;
            // A refusal may have locked the session's row: the rollback is awaited, not left
            // to the drop (which only queues it), so no claim made after the answer skips it.
            match outcome {
                Ok(_) => tx.commit().await?,
                Err(_) => tx.rollback().await?,
            }
            Ok(outcome)
        })
        .await
    }
}

/// A rewind's reads and writes, in one transaction.
struct RewindIn<'a> {
    tx: &'a deadpool_postgres::Transaction<'a>,
}

impl RewindSteps for RewindIn<'_> {
    async fn session(&mut self, key: &str) -> Result<Option<SessionFacts>, StoreError> {
        let row = self.tx.maybe_row(LOCK_REWOUND_SQL, &[&key]).await?;
        row.map(|row| SessionFacts::decode(&row)).transpose()
    }

    async fn entry(&mut self, key: &str, n: i64) -> Result<Option<EntryFacts>, StoreError> {
        let row = self.tx.maybe_row(REWIND_ENTRY_SQL, &[&key, &n]).await?;
        row.map(|row| EntryFacts::decode(&row)).transpose()
    }

    async fn create_session(&mut self, key: &str, route: &str) -> Result<bool, StoreError> {
        let created = self
            .tx
            .run(FORK_SESSION_SQL, &[&key, &route, &now_millis()])
            .await?;
        Ok(created == 1)
    }

    async fn copy_entries(&mut self, from: &str, to: &str, before: i64) -> Result<(), StoreError> {
        self.tx
            .run(FORK_ENTRIES_SQL, &[&from, &to, &before])
            .await?;
        Ok(())
    }

    async fn supersede(&mut self, key: &str, from: i64, turn_id: &str) -> Result<u64, StoreError> {
        self.tx.run(SUPERSEDE_SQL, &[&key, &from, &turn_id]).await
    }

    async fn queue(&mut self, event: RewindEvent<'_>) -> Result<(), StoreError> {
        let now = now_millis();
        let values = event
            .values(&now)
            .map(|value| value as &(dyn tokio_postgres::types::ToSql + Sync));
        self.tx.run(REWIND_EVENT_SQL, &values).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::PostgresStore;
    use crate::config::PostgresSettings;
    use crate::secret::Secret;
    use crate::store::contract::postgres_server::Postgres;
    use crate::store::{Operator, RewindRefusal, RewindRequest};

    /// A refused rewind has let its session's row go when it answers: a claim made right after
    /// (`SKIP LOCKED`, on another connection) must not pass the session by.
    #[test]
    fn a_refused_rewind_holds_no_lock_once_it_answers() {
        let Some(server) = Postgres::start("a_refused_rewind_holds_no_lock") else {
            return;
        };
        let settings = PostgresSettings {
            url: Secret::for_tests(server.url().as_bytes()),
            node: "rewind".into(),
            lease_ttl: Duration::from_secs(30),
            pool_size: 2,
            ca_file: None,
        };
        // One worker: the claimer's connection, woken last, runs first (the LIFO slot), so its
        // query goes out before anything the rewind's connection still had to send.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let store = PostgresStore::open(&settings, true).await.expect("open");
            server.value(
                "INSERT INTO sessions (key, route, state, created_at, updated_at) \
                 VALUES ('busy', 'r', 'running', 0, 0)",
            );
            let request = RewindRequest {
                session: "busy".into(),
                entry: 1,
                fork_as: None,
            };
            let claimer = store.client().await.expect("client");
            for round in 0..400 {
                let refused = store.rewind(request.clone()).await.expect("rewind");
                assert!(
                    matches!(refused, Err(RewindRefusal::Busy { .. })),
                    "{refused:?}"
                );
                let free = claimer
                    .simple_query(
                        "SELECT key FROM sessions WHERE key = 'busy' FOR UPDATE SKIP LOCKED",
                    )
                    .await
                    .expect("lock")
                    .into_iter()
                    .filter(|message| matches!(message, tokio_postgres::SimpleQueryMessage::Row(_)))
                    .count();
                assert_eq!(
                    free, 1,
                    "round {round}: the refused rewind still held the row"
                );
            }
        });
    }
}
