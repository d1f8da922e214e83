//! Turns and their transcript: claiming the next event of an idle session, committing each step,
//! and ending a turn together with its event's terminal status and its outbox row.

use super::*;
use crate::store::model::{
    ClaimedTurn, EVENT_ENTRY, Event, InterruptedSession, RenderDelivery, SessionRow, TranscriptRow,
    TurnEnd, transcript_query,
};
use crate::store::states::{
    CRASHED, EVENT_RUNNING, IDLE, OPERATOR, PENDING, QUEUED, REQUEUE_STOPPED_EVENT_SQL,
    RESUME_PENDING, RESUME_SESSION_SQL, ResumeReason, SESSION_RUNNING, SESSION_SQL,
    SESSIONS_PAGE_SQL, SUSPENDED, SessionState, StopReason, TURN_INTERRUPTED, TURN_RUNNING,
};
use const_format::concatcp;
use rusqlite::{Connection, OptionalExtension, params};

use crate::store::now_millis;

/// Candidates for the next turns: queued events in arrival order with their session's state.
/// Read on a reader connection, so a long backlog costs the writer (and so accepts) nothing.
/// The oldest queued event of each idle session, oldest first. Sessions that cannot run (busy,
/// suspended, resume-pending) are never read, so a deep queue behind them costs nothing here.
const CANDIDATES_SQL: &str = concatcp!(
    "
    SELECT e.id, e.seq, e.session_key
    FROM sessions s JOIN events e ON e.seq = s.queue_head
    WHERE s.state = ",
    IDLE,
    " AND s.queue_head IS NOT NULL
    ORDER BY s.queue_head
    LIMIT ?1"
);

/// A queued event that may start a turn: the oldest queued event of an idle session.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    event_id: String,
    seq: i64,
    session_key: String,
}

pub(super) fn candidates_in(
    connection: &Connection,
    limit: usize,
) -> rusqlite::Result<Vec<Candidate>> {
    let mut statement = connection.prepare_cached(CANDIDATES_SQL)?;
    let rows = statement.query_map(params![i64::try_from(limit).unwrap_or(i64::MAX)], |row| {
        Ok(Candidate {
            event_id: row.get(0)?,
            seq: row.get(1)?,
            session_key: row.get(2)?,
        })
    })?;
    rows.collect()
}

/// Claims the candidates that are still claimable now (the writer's view is the truth: a
/// candidate may have been claimed, or a resume queued ahead of it, since it was read).
pub(super) fn claim_in(
    connection: &Connection,
    candidates: &[Candidate],
) -> rusqlite::Result<Vec<ClaimedTurn>> {
    let now = now_millis();
    let mut claimed = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        let still_first: bool = connection
            .prepare_cached(concatcp!(
                "SELECT NOT EXISTS (SELECT 1 FROM events WHERE status = ",
                QUEUED,
                " AND session_key = ?1 AND seq < ?2)
                    AND EXISTS (SELECT 1 FROM events WHERE id = ?3 AND status = ",
                QUEUED,
                ")
                    AND EXISTS (SELECT 1 FROM sessions WHERE key = ?1 AND state = ",
                IDLE,
                ")"
            ))?
            .query_row(
                params![candidate.session_key, candidate.seq, candidate.event_id],
                |row| row.get(0),
            )?;
        if !still_first {
            continue;
        }
        let (event, resume_reason, internal) = connection
            .prepare_cached(
                "SELECT id, route, session_key, event_type, delivery_id, headers, payload, resume_reason,
                        origin <> 'webhook'
                 FROM events WHERE id = ?1",
            )?
            .query_row(params![candidate.event_id], |row| {
                Ok((
                    event_from(row, 0)?,
                    row.get::<_, Option<String>>(7)?
                        .as_deref()
                        .map(ResumeReason::from_sql),
                    row.get(8)?,
                ))
            })?;
        let turn_id = uuid::Uuid::now_v7().to_string();
        connection
            .prepare_cached(concatcp!(
                "UPDATE events SET status = ",
                EVENT_RUNNING,
                ", resume_reason = NULL, updated_at = ?2 WHERE id = ?1"
            ))?
            .execute(params![event.id, now])?;
        connection
            .prepare_cached(concatcp!(
                "INSERT INTO turns (id, session_key, event_id, status, started_at)
                 VALUES (?1, ?2, ?3, ",
                TURN_RUNNING,
                ", ?4)"
            ))?
            .execute(params![turn_id, event.session_key, event.id, now])?;
        connection
            .prepare_cached(concatcp!(
                "UPDATE sessions SET state = ",
                SESSION_RUNNING,
                ", reason = NULL, last_turn_id = ?2, updated_at = ?3
                 WHERE key = ?1"
            ))?
            .execute(params![event.session_key, turn_id, now])?;
        claimed.push(ClaimedTurn {
            turn_id,
            event,
            resume_reason,
            internal,
        });
    }
    Ok(claimed)
}

/// The event in the seven columns from `first` on: id, route, session key, type, delivery id,
/// headers, payload.
fn event_from(row: &rusqlite::Row<'_>, first: usize) -> rusqlite::Result<Event> {
    Ok(Event {
        id: row.get(first)?,
        route: row.get(first + 1)?,
        session_key: row.get(first + 2)?,
        event_type: row.get(first + 3)?,
        delivery_id: row.get(first + 4)?,
        headers: row.get(first + 5)?,
        payload: row.get(first + 6)?,
    })
}

pub(super) fn finish_in(
    connection: &Connection,
    end: &TurnEnd,
    render: RenderDelivery,
) -> rusqlite::Result<()> {
    let now = now_millis();
    connection
        .prepare_cached(
            "UPDATE turns SET status = ?2, reason = ?3, output = ?4, error = ?5, steps = ?6, finished_at = ?7
             WHERE id = ?1",
        )?
        .execute(params![
            end.turn_id,
            end.turn_status.sql(),
            end.reason.map(StopReason::sql),
            end.output,
            end.error,
            end.steps,
            now
        ])?;
    connection
        .prepare_cached("UPDATE events SET status = ?2, updated_at = ?3 WHERE id = ?1")?
        .execute(params![end.event_id, end.event_status.sql(), now])?;
    let session_state = end.session_state();
    connection
        // An operator's suspension made while the turn ran stays in force.
        .prepare_cached(concatcp!(
            "UPDATE sessions SET state = CASE WHEN state = ",
            SUSPENDED,
            " THEN ",
            SUSPENDED,
            " ELSE ?2 END,
                 reason = CASE WHEN state = ",
            SUSPENDED,
            " THEN reason ELSE ?3 END, updated_at = ?4
             WHERE key = ?1"
        ))?
        .execute(params![
            end.session_key,
            session_state.sql(),
            end.reason.map(StopReason::sql),
            now
        ])?;
    let body = render(end).map_err(|err| rusqlite::Error::ToSqlConversionFailure(Box::new(err)))?;
    connection
        .prepare_cached(
            concatcp!("INSERT OR REPLACE INTO deliveries
                 (event_id, route, session_key, body, status, attempts, next_attempt_at, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, ", PENDING, ", 0, ?5, ?5, ?5)"),
        )?
        .execute(params![end.event_id, end.route, end.session_key, body, now])?;
    Ok(())
}

pub(super) fn transcript_of(
    connection: &Connection,
    session_key: &str,
) -> rusqlite::Result<Vec<TranscriptRow>> {
    connection
        .prepare_cached(&transcript_query("?1", "?2"))?
        .query_map(params![session_key, EVENT_ENTRY], |row| {
            let event = match row.get::<_, Option<String>>(5)? {
                Some(_) => Some(event_from(row, 5)?),
                None => None,
            };
            Ok(TranscriptRow::new(
                row.get(0)?,
                row.get(1)?,
                row.get(2)?,
                row.get(3)?,
                row.get(4)?,
                event,
            ))
        })?
        .collect()
}

/// `sessions resume KEY`: a suspended session becomes idle again (its queued events run); an
/// interrupted one (`resume_pending`) has its event queued again as a resume. Returns the state
/// the session was in, or `None` if there is no such session.
pub(super) fn operator_resume_in(
    connection: &Connection,
    key: &str,
) -> rusqlite::Result<Option<SessionState>> {
    let Some(state) = session_state(connection, key)? else {
        return Ok(None);
    };
    let now = now_millis();
    connection.execute(REQUEUE_STOPPED_EVENT_SQL, params![key, now])?;
    connection.execute(RESUME_SESSION_SQL, params![key, now])?;
    Ok(Some(state))
}

/// `sessions suspend KEY`: no further turn of the session starts until it is resumed.
pub(super) fn operator_suspend_in(
    connection: &Connection,
    key: &str,
) -> rusqlite::Result<Option<SessionState>> {
    let Some(state) = session_state(connection, key)? else {
        return Ok(None);
    };
    connection.execute(
        concatcp!(
            "UPDATE sessions SET state = ",
            SUSPENDED,
            ", reason = ",
            OPERATOR,
            ", updated_at = ?2 WHERE key = ?1"
        ),
        params![key, now_millis()],
    )?;
    Ok(Some(state))
}

fn session_state(connection: &Connection, key: &str) -> rusqlite::Result<Option<SessionState>> {
    connection
        .query_row(
            "SELECT state FROM sessions WHERE key = ?1",
            params![key],
            |row| row.get(0),
        )
        .optional()
}

fn session_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<SessionRow> {
    Ok(SessionRow {
        key: row.get(0)?,
        route: row.get(1)?,
        state: row.get(2)?,
        reason: row.get(3)?,
        last_turn_id: row.get(4)?,
        last_turn_status: row.get(5)?,
        turns: row.get(6)?,
        queued: row.get(7)?,
        updated_at: row.get(8)?,
    })
}

pub(super) fn sessions_in(connection: &Connection) -> rusqlite::Result<Vec<SessionRow>> {
    connection
        .prepare(&format!("{SESSION_SQL} ORDER BY s.updated_at DESC"))?
        .query_map([], session_from_row)?
        .collect()
}

pub(super) fn sessions_page_in(
    connection: &Connection,
    after: Option<&str>,
    limit: i64,
) -> rusqlite::Result<Vec<SessionRow>> {
    connection
        .prepare_cached(SESSIONS_PAGE_SQL)?
        .query_map(
            rusqlite::named_params! {"$1": after, "$2": limit},
            session_from_row,
        )?
        .collect()
}

pub(super) fn session_in(
    connection: &Connection,
    key: &str,
) -> rusqlite::Result<Option<SessionRow>> {
    connection
        .prepare(&format!("{SESSION_SQL} WHERE s.key = ?1"))?
        .query_row(params![key], session_from_row)
        .optional()
}

pub(super) fn append_in(
    connection: &Connection,
    session_key: &str,
    turn_id: &str,
    entries: &[(&'static str, String)],
    steps: u32,
) -> rusqlite::Result<()> {
    let now = now_millis();
    for (kind, body) in entries {
        connection
            .prepare_cached(
                "INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at)
                 VALUES (?1, COALESCE((SELECT MAX(seq) FROM transcript WHERE session_key = ?1), 0) + 1,
                         ?2, ?3, ?4, ?5)",
            )?
            .execute(params![session_key, turn_id, kind, body, now])?;
    }
    connection
        .prepare_cached("UPDATE turns SET steps = ?2 WHERE id = ?1")?
        .execute(params![turn_id, steps])?;
    Ok(())
}

pub(super) fn interrupt_in(
    connection: &Connection,
    turn_id: &str,
    session_key: &str,
    reason: ResumeReason,
    steps: u32,
) -> rusqlite::Result<()> {
    let now = now_millis();
    let reason = StopReason::Resume(reason).sql();
    connection.execute(
        concatcp!(
            "UPDATE turns SET status = ",
            TURN_INTERRUPTED,
            ", reason = ?2, steps = ?3, finished_at = ?4 WHERE id = ?1"
        ),
        params![turn_id, reason, steps, now],
    )?;
    // An operator's suspension stays in force: the interrupted event waits for `sessions resume`.
    connection.execute(
        concatcp!(
            "UPDATE sessions SET state = ",
            RESUME_PENDING,
            ", reason = ?2, updated_at = ?3 WHERE key = ?1 AND state <> ",
            SUSPENDED
        ),
        params![session_key, reason, now],
    )?;
    Ok(())
}

/// At start, every turn still `running` was cut off by a crash.
pub(super) fn crashed_in(connection: &Connection) -> rusqlite::Result<usize> {
    let now = now_millis();
    connection.execute(
        concatcp!(
            "UPDATE sessions SET state = ",
            RESUME_PENDING,
            ", reason = ",
            CRASHED,
            ", updated_at = ?1
         WHERE key IN (SELECT session_key FROM turns WHERE status = ",
            TURN_RUNNING,
            ") AND state <> ",
            SUSPENDED
        ),
        params![now],
    )?;
    connection.execute(
        concatcp!(
            "UPDATE turns SET status = ",
            TURN_INTERRUPTED,
            ", reason = ",
            CRASHED,
            ", finished_at = ?1
         WHERE status = ",
            TURN_RUNNING
        ),
        params![now],
    )
}

pub(super) fn interrupted_in(connection: &Connection) -> rusqlite::Result<Vec<InterruptedSession>> {
    connection
        .prepare(concatcp!(
            "SELECT s.key, s.route, COALESCE(s.reason, ",
            CRASHED,
            "), t.id, t.event_id, t.steps, t.started_at
             FROM sessions s JOIN turns t ON t.id = s.last_turn_id
             WHERE s.state = ",
            RESUME_PENDING,
            "
             ORDER BY t.started_at"
        ))?
        .query_map([], |row| {
            Ok(InterruptedSession {
                session_key: row.get(0)?,
                route: row.get(1)?,
                reason: ResumeReason::from_sql(&row.get::<_, String>(2)?),
                turn_id: row.get(3)?,
                event_id: row.get(4)?,
                steps: row.get(5)?,
                started_at: row.get(6)?,
            })
        })?
        .collect()
}

/// Puts an interrupted session's event back at the head of its queue, marked as a resume.
pub(super) fn requeue_in(
    connection: &Connection,
    interrupted: &InterruptedSession,
) -> rusqlite::Result<()> {
    let now = now_millis();
    connection.execute(
        concatcp!(
            "UPDATE events SET status = ",
            QUEUED,
            ", resume_reason = ?2, updated_at = ?3 WHERE id = ?1"
        ),
        params![interrupted.event_id, interrupted.reason.sql(), now],
    )?;
    connection.execute(
        concatcp!(
            "UPDATE sessions SET state = ",
            IDLE,
            ", updated_at = ?2 WHERE key = ?1"
        ),
        params![interrupted.session_key, now],
    )?;
    Ok(())
}

/// Whether any run of `event_id` recorded a transcript entry (a run cut off between its claim
/// and its first commit did not: its resume must start from the event itself).
pub(super) fn event_has_transcript_in(
    connection: &Connection,
    event_id: &str,
) -> rusqlite::Result<bool> {
    connection.query_row(
        "SELECT EXISTS (SELECT 1 FROM transcript t JOIN turns u ON u.id = t.turn_id
                        WHERE u.event_id = ?1)",
        params![event_id],
        |row| row.get(0),
    )
}

#[async_trait::async_trait]
impl Turns for SqliteStore {
    async fn claim_turns(&self, limit: usize) -> Result<Vec<ClaimedTurn>, StoreError> {
        let candidates = self
            .read(move |connection| candidates_in(connection, limit))
            .await?;
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        self.write(move |connection| claim_in(connection, &candidates))
            .await
    }

    async fn append_transcript(
        &self,
        session_key: &str,
        turn_id: &str,
        entries: Vec<(&'static str, String)>,
        steps: u32,
    ) -> Result<(), StoreError> {
        let (session_key, turn_id) = (session_key.to_string(), turn_id.to_string());
        self.write(move |connection| append_in(connection, &session_key, &turn_id, &entries, steps))
            .await
    }

    async fn finish_turn(&self, end: TurnEnd, render: RenderDelivery) -> Result<(), StoreError> {
        self.write(move |connection| finish_in(connection, &end, render))
            .await
    }

    async fn interrupt_for_resume(
        &self,
        turn_id: &str,
        session_key: &str,
        reason: ResumeReason,
        steps: u32,
    ) -> Result<(), StoreError> {
        let (turn_id, session_key) = (turn_id.to_string(), session_key.to_string());
        self.write(move |connection| {
            interrupt_in(connection, &turn_id, &session_key, reason, steps)
        })
        .await
    }

    async fn event_has_transcript(&self, event_id: &str) -> Result<bool, StoreError> {
        let event_id = event_id.to_string();
        self.read(move |connection| event_has_transcript_in(connection, &event_id))
            .await
    }

    async fn transcript(&self, session_key: &str) -> Result<Vec<TranscriptRow>, StoreError> {
        let key = session_key.to_string();
        self.read(move |connection| transcript_of(connection, &key))
            .await
    }
}

#[async_trait::async_trait]
impl Recovery for SqliteStore {
    async fn mark_crashed_turns(&self) -> Result<usize, StoreError> {
        self.write(crashed_in).await
    }

    async fn interrupted_sessions(&self) -> Result<Vec<InterruptedSession>, StoreError> {
        self.read(interrupted_in).await
    }

    async fn settle_interrupted(
        &self,
        session: &InterruptedSession,
        settlement: Settlement,
        render: RenderDelivery,
    ) -> Result<Settled, StoreError> {
        let max_attempts = match settlement {
            Settlement::Abandon => {
                let end = session.abandoned();
                self.write(move |connection| finish_in(connection, &end, render))
                    .await?;
                return Ok(Settled::Abandoned);
            }
            Settlement::Admit { max_attempts } => max_attempts,
        };
        let key = session.session_key.clone();
        let attempt = match with_ledger(&self.ledger, move |ledger| ledger.count_resume(&key)).await
        {
            Ok(attempt) => attempt,
            Err(err) => return Ok(Settled::Refused(err.to_string())),
        };
        if attempt > u64::from(max_attempts) {
            let end = session.suspended(max_attempts);
            self.write(move |connection| finish_in(connection, &end, render))
                .await?;
            // Only now that the suspension is committed does the entry go.
            if let Err(err) = self.clear_resume_count(&session.session_key).await {
                tracing::warn!(session_key = %session.session_key, error = %err,
                    "cannot remove the suspended session's ledger entry");
            }
            return Ok(Settled::Suspended);
        }
        let interrupted = session.clone();
        self.write(move |connection| requeue_in(connection, &interrupted))
            .await?;
        Ok(Settled::Resumed { attempt })
    }

    async fn clear_resume_count(&self, session_key: &str) -> Result<(), StoreError> {
        let key = session_key.to_string();
        with_ledger(&self.ledger, move |ledger| ledger.clear(&key)).await
    }

    async fn resume_ledger(&self) -> Result<Ledger, StoreError> {
        with_ledger(&self.ledger, LedgerFile::load).await
    }
}

#[async_trait::async_trait]
impl Operator for SqliteStore {
    async fn operator_resume(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        self.clear_resume_count(key).await?;
        let key = key.to_string();
        self.write(move |connection| operator_resume_in(connection, &key))
            .await
    }

    async fn operator_suspend(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        let key = key.to_string();
        self.write(move |connection| operator_suspend_in(connection, &key))
            .await
    }

    async fn replay_event(&self, id: &str) -> Result<Option<String>, StoreError> {
        let (original, copy) = (id.to_string(), uuid::Uuid::now_v7().to_string());
        self.write(move |connection| super::inspect::replay_in(connection, &original, copy))
            .await
    }

    async fn retry_deliveries(&self, target: RetryTarget) -> Result<u64, StoreError> {
        self.write(move |connection| super::inspect::retry_in(connection, &target))
            .await
    }
}
