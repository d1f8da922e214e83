//! [`Recovery`] on SQLite: turns a crash cut off, and the admission of interrupted sessions
//! through the retry ledger file (`store::admission` decides; this file reads and writes).

use const_format::concatcp;
use rusqlite::Connection;

use super::turns::finish_in;
use super::{SqliteStore, execute, query, query_one, value};
use crate::store::admission::{self, AdmissionSteps};
use crate::store::ledger::LedgerFile;
use crate::store::model::{InterruptedSession, RenderDelivery, TurnEnd};
use crate::store::sql::{INTERRUPTED_COLUMNS, REQUEUE_EVENT_SQL, REQUEUE_SESSION_SQL};
use crate::store::states::{
    CRASHED, QUEUED, RESUME_PENDING, SUSPENDED, TURN_INTERRUPTED, TURN_RUNNING,
};
use crate::store::{Ledger, Recovery, Settled, Settlement, StoreError, now_millis};

/// `$1` now: the sessions of turns still `running` wait for a resume (an operator's suspension
/// stays in force).
const CRASHED_SESSIONS_SQL: &str = concatcp!(
    "UPDATE sessions SET state = ",
    RESUME_PENDING,
    ", reason = ",
    CRASHED,
    ", updated_at = $1
     WHERE key IN (SELECT session_key FROM turns WHERE status = ",
    TURN_RUNNING,
    ") AND state <> ",
    SUSPENDED
);

/// `$1` now, `$2` how many turns the crash cut off.
const CRASHED_TURNS_SQL: &str = concatcp!(
    "UPDATE turns SET status = ",
    TURN_INTERRUPTED,
    ", reason = ",
    CRASHED,
    ", finished_at = $1, crashed_with = $2 WHERE status = ",
    TURN_RUNNING
);

const INTERRUPTED_SQL: &str = concatcp!(
    "SELECT ",
    INTERRUPTED_COLUMNS,
    " FROM sessions s JOIN turns t ON t.id = s.last_turn_id
     WHERE s.state = ",
    RESUME_PENDING,
    " ORDER BY t.started_at"
);

const RUNNING_TURNS_SQL: &str = concatcp!(
    "SELECT count(*) AS running FROM turns WHERE status = ",
    TURN_RUNNING
);

/// `$1` now: the events of turns still `running` in sessions an operator suspended wait, queued
/// as crash resumes, for `sessions resume`.
const CRASHED_SUSPENDED_EVENTS_SQL: &str = concatcp!(
    "UPDATE events SET status = ",
    QUEUED,
    ", resume_reason = ",
    CRASHED,
    ", updated_at = $1
     WHERE id IN (SELECT t.event_id FROM turns t JOIN sessions s ON s.key = t.session_key
                  WHERE t.status = ",
    TURN_RUNNING,
    " AND s.state = ",
    SUSPENDED,
    ")"
);

/// At start, every turn still `running` was cut off by one crash, which each records.
fn crashed_in(connection: &Connection) -> Result<usize, StoreError> {
    let now = now_millis();
    let together: i64 = query_one(connection, RUNNING_TURNS_SQL, &[], |row| {
        value(row, "running")
    })?;
    // What the last run's requests held: none of them is in flight any more.
    execute(connection, "DELETE FROM budget_reservations", &[])?;
    execute(connection, CRASHED_SUSPENDED_EVENTS_SQL, &[&now])?;
    execute(connection, CRASHED_SESSIONS_SQL, &[&now])?;
    execute(connection, CRASHED_TURNS_SQL, &[&now, &together])
}

fn requeue_in(
    connection: &Connection,
    session: &InterruptedSession,
    alone: bool,
) -> Result<(), StoreError> {
    let now = now_millis();
    execute(
        connection,
        REQUEUE_EVENT_SQL,
        &[&session.event_id, &session.reason.sql(), &now, &alone],
    )?;
    execute(
        connection,
        REQUEUE_SESSION_SQL,
        &[&session.session_key, &now],
    )?;
    Ok(())
}

/// The steps of admission on SQLite: the count in the ledger file (under its lock, replaced by
/// an fsync'd rename), each database change its own group-commit write.
struct Steps<'a> {
    store: &'a SqliteStore,
    render: RenderDelivery,
}

#[async_trait::async_trait]
impl AdmissionSteps for Steps<'_> {
    async fn record_resume(
        &mut self,
        session_key: &str,
        counts: bool,
    ) -> Result<Result<u64, String>, StoreError> {
        let key = session_key.to_string();
        let counted = self
            .store
            .with_ledger(move |ledger| ledger.record_resume(&key, counts))
            .await?;
        Ok(counted.map_err(|err| err.to_string()))
    }

    async fn end(&mut self, end: TurnEnd) -> Result<(), StoreError> {
        let render = self.render;
        self.store
            .write(move |connection| finish_in(connection, &end, render))
            .await
    }

    async fn forget_resumes(&mut self, session_key: &str) -> Result<(), StoreError> {
        // The suspension is committed; an entry left behind only gives the session's next
        // interruption fewer tries, so it is a warning, not a failure of the settlement.
        if let Err(err) = self.store.clear_resume_count(session_key).await {
            tracing::warn!(session_key = %session_key, error = %err,
                "cannot remove the suspended session's ledger entry");
        }
        Ok(())
    }

    async fn requeue(
        &mut self,
        session: &InterruptedSession,
        alone: bool,
    ) -> Result<(), StoreError> {
        let session = session.clone();
        self.store
            .write(move |connection| requeue_in(connection, &session, alone))
            .await
    }
}

#[async_trait::async_trait]
impl Recovery for SqliteStore {
    async fn mark_crashed_turns(&self) -> Result<usize, StoreError> {
        self.write(crashed_in).await
    }

    async fn interrupted_sessions(&self) -> Result<Vec<InterruptedSession>, StoreError> {
        self.read(|connection| {
            query(connection, INTERRUPTED_SQL, &[], |row| {
                InterruptedSession::decode(row)
            })
        })
        .await
    }

    async fn settle_interrupted(
        &self,
        session: &InterruptedSession,
        settlement: Settlement,
        render: RenderDelivery,
    ) -> Result<Settled, StoreError> {
        let mut steps = Steps {
            store: self,
            render,
        };
        admission::settle(&mut steps, session, settlement).await
    }

    async fn clear_resume_count(&self, session_key: &str) -> Result<(), StoreError> {
        let key = session_key.to_string();
        self.with_ledger(move |ledger| ledger.clear(&key))
            .await?
            .map_err(|err| StoreError::Ledger(err.to_string()))
    }

    async fn resume_ledger(&self) -> Result<Ledger, StoreError> {
        self.with_ledger(LedgerFile::load)
            .await?
            .map_err(|err| StoreError::Ledger(err.to_string()))
    }
}
