//! [`Recovery`] on PostgreSQL: turns whose node stopped renewing its lease, and the admission of
//! interrupted sessions (`store::admission` decides; this file reads and writes). The retry
//! ledger is a table whose row is counted under a row lock in the transaction that re-queues
//! the resume, so the count is durable before the resume can run, cluster-wide.

use const_format::concatcp;

use super::connect::{Cached, bounded};
use super::{InTx, PostgresStore};
use crate::store::admission::{self, AdmissionSteps};
use crate::store::ledger::now_rfc3339;
use crate::store::model::{InterruptedSession, RenderDelivery, TurnEnd};
use crate::store::row::StoredRow;
use crate::store::sql::{INTERRUPTED_COLUMNS, REQUEUE_EVENT_SQL, REQUEUE_SESSION_SQL};
use crate::store::states::{
    CRASHED, RESUME_PENDING, SESSION_RUNNING, TURN_INTERRUPTED, TURN_RUNNING,
};
use crate::store::turns;
use crate::store::{Ledger, Recovery, Settled, Settlement, StoreError, now_millis};

/// `$1` now: the running sessions of a node whose leases have all expired, and their turns,
/// were cut off by one crash of that node (a node id is one process), which each turn records
/// with how many it cut off. Waiting for the node's last lease keeps the turns one crash cut
/// off together; a session another node is settling right now is skipped.
const LOST_TURNS_SQL: &str = concatcp!(
    "WITH dead AS (
         SELECT s.key, s.lease_owner FROM sessions s
         WHERE s.state = ",
    SESSION_RUNNING,
    " AND s.lease_expires_at < agentgate_now_ms()
           AND NOT EXISTS (SELECT 1 FROM sessions o
                           WHERE o.lease_owner = s.lease_owner AND o.state = ",
    SESSION_RUNNING,
    "                            AND o.lease_expires_at >= agentgate_now_ms())
         FOR UPDATE OF s SKIP LOCKED),
     together AS (SELECT lease_owner, count(*) AS cut FROM dead GROUP BY lease_owner),
     lost AS (
         UPDATE sessions SET state = ",
    RESUME_PENDING,
    ", reason = ",
    CRASHED,
    ", updated_at = $1,
             lease_owner = NULL, lease_expires_at = NULL
         FROM dead WHERE sessions.key = dead.key
         RETURNING sessions.last_turn_id, dead.lease_owner)
     UPDATE turns SET status = ",
    TURN_INTERRUPTED,
    ", reason = ",
    CRASHED,
    ", finished_at = $1, crashed_with = together.cut
     FROM lost JOIN together ON together.lease_owner = lost.lease_owner
     WHERE turns.id = lost.last_turn_id AND turns.status = ",
    TURN_RUNNING
);

/// Sessions waiting for a resume that no node holds.
const INTERRUPTED_SQL: &str = concatcp!(
    "SELECT ",
    INTERRUPTED_COLUMNS,
    " FROM sessions s JOIN turns t ON t.id = s.last_turn_id
     WHERE s.state = ",
    RESUME_PENDING,
    " AND s.lease_owner IS NULL
     ORDER BY t.started_at"
);

/// `$1` session key, `$2` its interrupted turn: whoever locks the session settles it; the
/// others skip it.
const LOCK_INTERRUPTED_SQL: &str = concatcp!(
    "SELECT 1 AS locked FROM sessions
     WHERE key = $1 AND state = ",
    RESUME_PENDING,
    " AND last_turn_id = $2
     FOR UPDATE SKIP LOCKED"
);

/// `$1` session key, `$2` now (RFC 3339), `$3` what it adds to the count (1, or 0 for a resume
/// that does not count): one more resume, recorded under the row's lock.
const RECORD_RESUME_SQL: &str =
    "INSERT INTO resume_ledger (session_key, attempts, last_attempt) VALUES ($1, $3, $2)
     ON CONFLICT (session_key) DO UPDATE
         SET attempts = resume_ledger.attempts + $3, last_attempt = EXCLUDED.last_attempt
     RETURNING attempts";

/// `$1` session key.
pub(super) const FORGET_RESUMES_SQL: &str = "DELETE FROM resume_ledger WHERE session_key = $1";

const LEDGER_SQL: &str =
    "SELECT session_key, attempts, last_attempt FROM resume_ledger ORDER BY session_key";

/// The steps of admission on PostgreSQL: all in the caller's transaction, which holds the
/// session's row lock.
struct Steps<'a> {
    tx: &'a deadpool_postgres::Transaction<'a>,
    store: &'a PostgresStore,
    render: RenderDelivery,
}

#[async_trait::async_trait]
impl AdmissionSteps for Steps<'_> {
    async fn record_resume(
        &mut self,
        session_key: &str,
        counts: bool,
    ) -> Result<Result<u64, String>, StoreError> {
        let added = i64::from(counts);
        let row = self
            .tx
            .row(RECORD_RESUME_SQL, &[&session_key, &now_rfc3339(), &added])
            .await?;
        Ok(Ok(row.number("attempts")?))
    }

    async fn end(&mut self, end: TurnEnd) -> Result<(), StoreError> {
        let tx = InTx {
            tx: self.tx,
            store: self.store,
        };
        turns::finish(&tx, &end, self.render).await
    }

    async fn forget_resumes(&mut self, session_key: &str) -> Result<(), StoreError> {
        self.tx.run(FORGET_RESUMES_SQL, &[&session_key]).await?;
        Ok(())
    }

    async fn requeue(
        &mut self,
        session: &InterruptedSession,
        alone: bool,
    ) -> Result<(), StoreError> {
        let now = now_millis();
        self.tx
            .run(
                REQUEUE_EVENT_SQL,
                &[&session.event_id, &session.reason.sql(), &now, &alone],
            )
            .await?;
        self.tx
            .run(REQUEUE_SESSION_SQL, &[&session.session_key, &now])
            .await?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Recovery for PostgresStore {
    async fn mark_crashed_turns(&self) -> Result<usize, StoreError> {
        let lost = self.execute_one(LOST_TURNS_SQL, &[&now_millis()]).await?;
        Ok(usize::try_from(lost).unwrap_or(usize::MAX))
    }

    async fn interrupted_sessions(&self) -> Result<Vec<InterruptedSession>, StoreError> {
        self.fetch(INTERRUPTED_SQL, &[], InterruptedSession::decode)
            .await
    }

    async fn settle_interrupted(
        &self,
        session: &InterruptedSession,
        settlement: Settlement,
        render: RenderDelivery,
    ) -> Result<Settled, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let locked = tx
                .maybe_row(
                    LOCK_INTERRUPTED_SQL,
                    &[&session.session_key, &session.turn_id],
                )
                .await?;
            if locked.is_none() {
                return Ok(Settled::NotInterrupted);
            }
            let settled = {
                let mut steps = Steps {
                    tx: &tx,
                    store: self,
                    render,
                };
                admission::settle(&mut steps, session, settlement).await?
            };
            tx.commit().await?;
            Ok(settled)
        })
        .await
    }

    async fn clear_resume_count(&self, session_key: &str) -> Result<(), StoreError> {
        self.execute_one(FORGET_RESUMES_SQL, &[&session_key])
            .await?;
        Ok(())
    }

    async fn resume_ledger(&self) -> Result<Ledger, StoreError> {
        let entries = self
            .fetch(LEDGER_SQL, &[], |row| {
                Ok((
                    row.column::<String>("session_key")?,
                    row.number::<u64>("attempts")?,
                    row.column::<String>("last_attempt")?,
                ))
            })
            .await?;
        let mut ledger = Ledger::default();
        for (key, attempts, last_attempt) in entries {
            ledger.insert(&key, attempts, last_attempt);
        }
        Ok(ledger)
    }
}
