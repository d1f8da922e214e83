//! [`Turns`] on SQLite: which events a claim looks at (read on a reader, so the writer is not
//! held), what the writer's transaction writes its own way in a turn's scripts
//! (`store::turns`), and budget reservations, which only this process makes.

use const_format::concatcp;
use rusqlite::Connection;

use super::accepting::INSERT_INTERNAL_SQL;
use super::{OnWriter, SqliteStore, execute, on_writer, query, query_one, query_optional, value};
use crate::store::approval::NewApproval;
use crate::store::model::{
    Claim, ClaimedTurn, EVENT_ENTRY, Event, Fits, RenderDelivery, Reservation, Reserving,
    TranscriptRow, TurnEnd,
};
use crate::store::row::StoredRow;
use crate::store::sql::{
    CLAIM_COLUMNS, EARLIER_TURN_SPAN_SQL, END_SESSION_SET, EVENT_HAS_TRANSCRIPT_SQL, HELD_SUMS,
    HISTORY_TURN_START_SQL, HISTORY_TURNS_SQL, JOIN_QUEUED_SET, RECORD_TURN_SPAN_SQL, RELEASE_SQL,
    TRANSCRIPT_SQL,
};
use crate::store::states::{
    IDLE, PENDING, QUEUED, RESUME_PENDING, ResumeReason, SESSION_RUNNING, SUSPENDED, TURN_RUNNING,
};
use crate::store::turns::{self, InternalEvent, Start, TurnTx};
use crate::store::tx::{Param, Tx};
use crate::store::{StoreError, Turns};
use crate::usage::Spent;

/// The head event of each idle session whose head may run beside others (sessions that cannot
/// run, busy, suspended or resume-pending, are never read), for the two orders below.
const RUNNABLE_HEADS: &str = concatcp!(
    "
    SELECT e.id AS id, e.seq AS seq, e.session_key AS session_key
    FROM sessions s JOIN events e ON e.seq = s.queue_head
    WHERE s.state = ",
    IDLE,
    " AND s.queue_head IS NOT NULL AND e.run_alone = 0"
);

/// Candidates for the next turns: the oldest queued event of each idle session, oldest first,
/// unless it must run alone. Read on a reader connection, so a long backlog costs the writer
/// (and so accepts) nothing; the queue-head index stops the read at the limit, so a deep queue
/// costs nothing here. `$1` limit.
pub(super) const CANDIDATES_SQL: &str =
    concatcp!(RUNNABLE_HEADS, " ORDER BY s.queue_head LIMIT $1");

/// As [`CANDIDATES_SQL`], with the routes' priorities counted as waiting. `$1` limit, `$2` the
/// priorities (a JSON object of route name to priority; route names are letters, digits, `_`
/// and `-`), `$3` the waiting one step is worth. Every idle session with a queued event is read
/// and sorted, so this is used only when some route has a priority.
pub(super) const PRIORITY_CANDIDATES_SQL: &str = concatcp!(
    RUNNABLE_HEADS,
    " ORDER BY e.received_at - coalesce(json_extract($2, '$.\"' || e.route || '\"'), 0) * $3,
             s.queue_head
    LIMIT $1"
);

/// The oldest event that must run alone and is the next of an idle session, from the partial
/// index of such events (a few at most, after a crash). `$1` limit. Asked by the scheduler on
/// every round, so its plan is not left to SQLite: the events come from that index alone
/// (`INDEXED BY`), and each is then looked up in `sessions` (`CROSS JOIN` keeps that order).
/// Left to itself SQLite walks `events_by_status` over every queued event for the `ORDER BY`,
/// or every runnable session for the join: either reads the whole backlog.
pub(super) const ALONE_CANDIDATES_SQL: &str = concatcp!(
    "
    SELECT e.id AS id, e.seq AS seq, e.session_key AS session_key
    FROM events e INDEXED BY events_to_run_alone CROSS JOIN sessions s ON s.key = e.session_key
    WHERE e.status = ",
    QUEUED,
    " AND e.run_alone = 1 AND s.state = ",
    IDLE,
    " AND s.queue_head = e.seq
    ORDER BY e.seq
    LIMIT $1"
);

/// `$1` session key, `$2` the candidate's seq, `$3` its id: whether it may still start a turn
/// (the writer's view is the truth: it may have been claimed, or a resume queued ahead of it,
/// since it was read). The session's queued events come from their own index, never from all
/// its events (a session may have many finished ones).
pub(super) const STILL_FIRST_SQL: &str = concatcp!(
    "SELECT NOT EXISTS (SELECT 1 FROM events INDEXED BY events_queued_by_session
                        WHERE status = ",
    QUEUED,
    " AND session_key = $1 AND seq < $2)
        AND EXISTS (SELECT 1 FROM events WHERE id = $3 AND status = ",
    QUEUED,
    ")
        AND EXISTS (SELECT 1 FROM sessions WHERE key = $1 AND state = ",
    IDLE,
    ") AS still_first"
);

/// Coalescing (`JOIN_QUEUED_SET`) through the session's queued events: SQLite would take the
/// partial index of the route's queued events and walk the route's whole backlog.
pub(super) const JOIN_QUEUED_SQL: &str = concatcp!(
    "UPDATE events INDEXED BY events_queued_by_session",
    JOIN_QUEUED_SET
);

pub(super) const CLAIMED_EVENT_SQL: &str =
    concatcp!("SELECT ", CLAIM_COLUMNS, " FROM events WHERE id = $1");

/// `$1` turn id, `$2` session key, `$3` event id, `$4` now.
pub(super) const START_TURN_SQL: &str = concatcp!(
    "INSERT INTO turns (id, session_key, event_id, status, started_at)
     VALUES ($1, $2, $3, ",
    TURN_RUNNING,
    ", $4)"
);

/// `$1` session key, `$2` turn id, `$3` now.
pub(super) const START_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = ",
    SESSION_RUNNING,
    ", reason = NULL, last_turn_id = $2, updated_at = $3 WHERE key = $1"
);

const END_SESSION_SQL: &str = concatcp!(END_SESSION_SET, " WHERE key = $1");

/// `$1` event id, `$2` route, `$3` session key, `$4` body, `$5` now.
const QUEUE_DELIVERY_SQL: &str = concatcp!(
    "INSERT OR REPLACE INTO deliveries
         (event_id, route, session_key, body, status, attempts, next_attempt_at, created_at, updated_at)
     VALUES ($1, $2, $3, $4, ",
    PENDING,
    ", 0, $5, $5, $5)"
);

/// `$1` session key, `$2` reason, `$3` now. An operator's suspension stays in force: the
/// interrupted event waits for `sessions resume`.
const INTERRUPT_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = ",
    RESUME_PENDING,
    ", reason = $2, updated_at = $3 WHERE key = $1 AND state <> ",
    SUSPENDED
);

/// A queued event that may start a turn: the oldest queued event of an idle session.
#[derive(Debug, Clone)]
pub(super) struct Candidate {
    event_id: String,
    seq: i64,
    session_key: String,
}

fn candidates_in(connection: &Connection, claim: &Claim) -> Result<Vec<Candidate>, StoreError> {
    let count = |limit: &usize| i64::try_from(*limit).unwrap_or(i64::MAX);
    let (sql, limit, priorities) = match claim {
        Claim::Beside(limit) => (CANDIDATES_SQL, count(limit), None),
        Claim::BesideByPriority { limit, priorities } => {
            (PRIORITY_CANDIDATES_SQL, count(limit), Some(&**priorities))
        }
        Claim::Alone => (ALONE_CANDIDATES_SQL, 1, None),
    };
    let step = crate::store::model::PRIORITY_STEP_MS;
    let params: Vec<&dyn rusqlite::ToSql> = match &priorities {
        Some(priorities) => vec![&limit, priorities, &step],
        None => vec![&limit],
    };
    query(connection, sql, &params, |row| {
        Ok(Candidate {
            event_id: value(row, "id")?,
            seq: value(row, "seq")?,
            session_key: value(row, "session_key")?,
        })
    })
}

/// Ends a turn's rows (`store::turns::finish`) on the writer's transaction.
pub(super) fn finish_in(
    connection: &Connection,
    end: &TurnEnd,
    render: RenderDelivery,
) -> Result<(), StoreError> {
    on_writer(connection, async |tx| turns::finish(tx, end, render).await)
}

impl TurnTx for OnWriter<'_> {
    const END_SESSION_SQL: &'static str = END_SESSION_SQL;
    const QUEUE_DELIVERY_SQL: &'static str = QUEUE_DELIVERY_SQL;
    const INTERRUPT_SESSION_SQL: &'static str = INTERRUPT_SESSION_SQL;
    const JOIN_QUEUED_SQL: &'static str = JOIN_QUEUED_SQL;
    const HELD_SQL: &'static str = HELD_SUMS;

    /// Read on a reader beforehand: the writer's view decides whether it may still start.
    type Candidate = Candidate;

    async fn claimable(&self, candidate: &Candidate) -> Result<Option<ClaimedTurn>, StoreError> {
        let values: [&(dyn Param + Sync); 3] =
            [&candidate.session_key, &candidate.seq, &candidate.event_id];
        if !self
            .row(STILL_FIRST_SQL, &values, |row| row.column("still_first"))
            .await?
        {
            return Ok(None);
        }
        let turn = self
            .row(CLAIMED_EVENT_SQL, &[&candidate.event_id], |row| {
                ClaimedTurn::decode(row, uuid::Uuid::now_v7().to_string())
            })
            .await?;
        Ok(Some(turn))
    }

    async fn start_rows(&self, start: &Start<'_>) -> Result<(), StoreError> {
        self.run(START_TURN_SQL, &start.turn_values()).await?;
        self.run(START_SESSION_SQL, &start.session_values()).await?;
        Ok(())
    }

    async fn insert_internal(&self, event: &InternalEvent<'_>) -> Result<(), StoreError> {
        self.run(INSERT_INTERNAL_SQL, &event.values()).await?;
        Ok(())
    }

    /// Made by the writer, one after another; they never expire by time: only this process
    /// makes them, and a start clears them.
    async fn insert_reservation(
        &self,
        values: &[&(dyn Param + Sync); 7],
    ) -> Result<(), StoreError> {
        self.run(RESERVE_SQL, values).await?;
        Ok(())
    }
}

/// `$1` turn id, `$2` event id, `$3` session key, `$4` route, `$5` when it was made (its day),
/// `$6` prompt tokens, `$7` reply tokens: a reservation of this process, which never expires.
const RESERVE_SQL: &str = "INSERT INTO budget_reservations
         (turn_id, event_id, session_key, route, made_at, input_tokens, output_tokens, node, expires_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, '', 9223372036854775807)";

#[async_trait::async_trait]
impl Turns for SqliteStore {
    async fn claim_turns(&self, claim: Claim) -> Result<Vec<ClaimedTurn>, StoreError> {
        let candidates = self
            .read(move |connection| candidates_in(connection, &claim))
            .await?;
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        self.write(move |connection| {
            on_writer(connection, async |tx| turns::claim(tx, &candidates).await)
        })
        .await
    }

    async fn waiting_to_run_alone(&self) -> Result<bool, StoreError> {
        let found = self
            .read(|connection| candidates_in(connection, &Claim::Alone))
            .await?;
        Ok(!found.is_empty())
    }

    async fn append_transcript(
        &self,
        session_key: &str,
        turn_id: &str,
        entries: Vec<(&'static str, String)>,
        steps: u32,
        spent: Spent,
    ) -> Result<(), StoreError> {
        let (session_key, turn_id) = (session_key.to_string(), turn_id.to_string());
        self.write(move |connection| {
            on_writer(connection, async |tx| {
                turns::append(tx, &session_key, &turn_id, &entries, steps, spent).await
            })
        })
        .await
    }

    async fn reserve_budget(
        &self,
        reservation: Reservation,
        fits: Fits,
    ) -> Result<Reserving, StoreError> {
        self.write(move |connection| {
            on_writer(connection, async |tx| {
                turns::reserve(tx, &reservation, &fits).await
            })
        })
        .await
    }

    async fn release_budget(&self, turn_id: &str) -> Result<(), StoreError> {
        let turn_id = turn_id.to_string();
        self.write(move |connection| execute(connection, RELEASE_SQL, &[&turn_id]).map(drop))
            .await
    }

    async fn finish_turn(&self, end: TurnEnd, render: RenderDelivery) -> Result<(), StoreError> {
        self.write(move |connection| finish_in(connection, &end, render))
            .await
    }

    async fn join_queued(&self, head: &Event, window_ms: i64) -> Result<Vec<Event>, StoreError> {
        let head = head.clone();
        self.write(move |connection| {
            on_writer(connection, async |tx| {
                turns::join(tx, &head, window_ms).await
            })
        })
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
            on_writer(connection, async |tx| {
                turns::interrupt(tx, &turn_id, &session_key, reason, steps).await
            })
        })
        .await
    }

    async fn await_approval(&self, request: NewApproval, steps: u32) -> Result<(), StoreError> {
        self.write(move |connection| {
            on_writer(connection, async |tx| {
                turns::await_approval(tx, &request, steps).await
            })
        })
        .await
    }

    async fn event_has_transcript(&self, event_id: &str) -> Result<bool, StoreError> {
        let event_id = event_id.to_string();
        self.read(move |connection| {
            query_one(connection, EVENT_HAS_TRANSCRIPT_SQL, &[&event_id], |row| {
                value(row, "found")
            })
        })
        .await
    }

    async fn history_turns(&self, session_key: &str) -> Result<i64, StoreError> {
        let key = session_key.to_string();
        self.read(move |connection| {
            query_one(connection, HISTORY_TURNS_SQL, &[&key], |row| {
                value(row, "turns")
            })
        })
        .await
    }

    async fn history_turn_start(
        &self,
        session_key: &str,
        nth: i64,
    ) -> Result<Option<i64>, StoreError> {
        let key = session_key.to_string();
        self.read(move |connection| {
            query_optional(connection, HISTORY_TURN_START_SQL, &[&key, &nth], |row| {
                value(row, "seq")
            })
        })
        .await
    }

    async fn record_turn_span(
        &self,
        event_id: &str,
        turn_id: &str,
        traceparent: &str,
    ) -> Result<Option<String>, StoreError> {
        let (event_id, turn_id, traceparent) = (
            event_id.to_string(),
            turn_id.to_string(),
            traceparent.to_string(),
        );
        self.write(move |connection| {
            let earlier = query_optional(
                connection,
                EARLIER_TURN_SPAN_SQL,
                &[&event_id, &turn_id],
                |row| value(row, "trace_span"),
            )?;
            execute(connection, RECORD_TURN_SPAN_SQL, &[&turn_id, &traceparent])?;
            Ok(earlier)
        })
        .await
    }

    async fn transcript(
        &self,
        session_key: &str,
        after_seq: i64,
    ) -> Result<Vec<TranscriptRow>, StoreError> {
        let key = session_key.to_string();
        self.read(move |connection| {
            query(
                connection,
                TRANSCRIPT_SQL,
                &[&key, &EVENT_ENTRY, &after_seq],
                |row| TranscriptRow::decode(row),
            )
        })
        .await
    }
}
