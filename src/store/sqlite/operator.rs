//! [`Operator`] on SQLite: `sessions resume|suspend|rewind|fork`, `events replay`, `deliveries
//! retry`.

use const_format::concatcp;
use rusqlite::Connection;

use super::{SqliteStore, execute, query_optional, value};
use crate::store::model::RetryTarget;
use crate::store::rewind::{self, EntryFacts, RewindEvent, RewindSteps, SessionFacts};
use crate::store::sql::{
    FORK_ENTRIES_SQL, FORK_SESSION_SQL, REPLAY_SQL, REQUEUE_STOPPED_EVENT_SQL, RESUME_SESSION_SQL,
    RETRY_SQL, REWIND_ENTRY_SQL, REWIND_EVENT_SQL, REWIND_SESSION_SQL, SEND_PENDING_NOW_SQL,
    SESSION_STATE_SQL, SUPERSEDE_SQL,
};
use crate::store::states::{OPERATOR, SUSPENDED, SessionState};
use crate::store::{
    Operator, Recovery, RewindRefusal, RewindRequest, Rewound, StoreError, now_millis,
};

/// `$1` session key, `$2` now.
const SUSPEND_SQL: &str = concatcp!(
    "UPDATE sessions SET state = ",
    SUSPENDED,
    ", reason = ",
    OPERATOR,
    ", updated_at = $2 WHERE key = $1"
);

fn session_state(connection: &Connection, key: &str) -> Result<Option<SessionState>, StoreError> {
    query_optional(connection, SESSION_STATE_SQL, &[&key], |row| {
        value(row, "state")
    })
}

/// A suspended session becomes idle again (its queued events run); an interrupted one
/// (`resume_pending`) has its event queued again as a resume. Returns the state the session was
/// in, or `None` if there is no such session.
fn resume_in(connection: &Connection, key: &str) -> Result<Option<SessionState>, StoreError> {
    let Some(state) = session_state(connection, key)? else {
        return Ok(None);
    };
    let now = now_millis();
    execute(connection, REQUEUE_STOPPED_EVENT_SQL, &[&key, &now])?;
    execute(connection, RESUME_SESSION_SQL, &[&key, &now])?;
    Ok(Some(state))
}

fn suspend_in(connection: &Connection, key: &str) -> Result<Option<SessionState>, StoreError> {
    let Some(state) = session_state(connection, key)? else {
        return Ok(None);
    };
    execute(connection, SUSPEND_SQL, &[&key, &now_millis()])?;
    Ok(Some(state))
}

#[async_trait::async_trait]
impl Operator for SqliteStore {
    async fn operator_resume(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        self.clear_resume_count(key).await?;
        let key = key.to_string();
        self.write(move |connection| resume_in(connection, &key))
            .await
    }

    async fn operator_suspend(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        let key = key.to_string();
        self.write(move |connection| suspend_in(connection, &key))
            .await
    }

    async fn replay_event(&self, id: &str) -> Result<Option<String>, StoreError> {
        let (original, copy) = (id.to_string(), uuid::Uuid::now_v7().to_string());
        self.write(move |connection| {
            let inserted = execute(connection, REPLAY_SQL, &[&original, &copy, &now_millis()])?;
            Ok((inserted == 1).then(|| copy.clone()))
        })
        .await
    }

    async fn retry_deliveries(&self, target: RetryTarget) -> Result<u64, StoreError> {
        self.write(move |connection| {
            let now = now_millis();
            let updated = match &target {
                RetryTarget::One(id) => {
                    execute(connection, RETRY_SQL, &[&Some(id.as_str()), &now])?
                }
                RetryTarget::AllFailed => execute(connection, RETRY_SQL, &[&None::<&str>, &now])?,
                RetryTarget::Pending { route } => {
                    execute(connection, SEND_PENDING_NOW_SQL, &[&route.as_deref(), &now])?
                }
            };
            Ok(updated as u64)
        })
        .await
    }

    async fn rewind(
        &self,
        request: RewindRequest,
    ) -> Result<Result<Rewound, RewindRefusal>, StoreError> {
        // The steps run on the writer thread, inside its transaction; none of them waits.
        self.write(move |connection| {
            futures::executor::block_on(rewind::apply(&mut RewindOn { connection }, &request))
        })
        .await
    }
}

/// A rewind's reads and writes, on the writer's transaction.
struct RewindOn<'c> {
    connection: &'c Connection,
}

impl RewindSteps for RewindOn<'_> {
    async fn session(&mut self, key: &str) -> Result<Option<SessionFacts>, StoreError> {
        query_optional(self.connection, REWIND_SESSION_SQL, &[&key], |row| {
            SessionFacts::decode(row)
        })
    }

    async fn entry(&mut self, key: &str, n: i64) -> Result<Option<EntryFacts>, StoreError> {
        query_optional(self.connection, REWIND_ENTRY_SQL, &[&key, &n], |row| {
            EntryFacts::decode(row)
        })
    }

    async fn create_session(&mut self, key: &str, route: &str) -> Result<bool, StoreError> {
        let created = execute(
            self.connection,
            FORK_SESSION_SQL,
            &[&key, &route, &now_millis()],
        )?;
        Ok(created == 1)
    }

    async fn copy_entries(&mut self, from: &str, to: &str, before: i64) -> Result<(), StoreError> {
        execute(self.connection, FORK_ENTRIES_SQL, &[&from, &to, &before])?;
        Ok(())
    }

    async fn supersede(&mut self, key: &str, from: i64, turn_id: &str) -> Result<u64, StoreError> {
        let marked = execute(self.connection, SUPERSEDE_SQL, &[&key, &from, &turn_id])?;
        Ok(marked as u64)
    }

    async fn queue(&mut self, event: RewindEvent<'_>) -> Result<(), StoreError> {
        let now = now_millis();
        let values = event
            .values(&now)
            .map(|value| value as &dyn rusqlite::ToSql);
        execute(self.connection, REWIND_EVENT_SQL, &values)?;
        Ok(())
    }
}
