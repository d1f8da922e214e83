//! [`Turns`] on SQLite: claiming the next event of an idle session, committing each step, and
//! ending a turn together with its event's terminal status and its outbox row.

use const_format::concatcp;
use rusqlite::Connection;

use super::{SqliteStore, execute, query, query_one, query_optional, value};
use crate::store::approval::{APPROVAL_ENTRY, NewApproval};
use crate::store::model::{
    Claim, ClaimedTurn, EVENT_ENTRY, Event, RenderDelivery, TranscriptRow, TurnEnd,
};
use crate::store::sql::{
    APPEND_SQL, AWAIT_EVENT_SQL, CLAIM_COLUMNS, DAY_USAGE_SQL, EARLIER_TURN_SPAN_SQL,
    END_SESSION_SET, EVENT_HAS_TRANSCRIPT_SQL, EVENT_USAGE_SQL, FINISH_EVENT_SQL,
    FINISH_JOINED_SQL, FINISH_TURN_SQL, INSERT_APPROVAL_SQL, INTERRUPT_TURN_SQL, JOIN_QUEUED_SQL,
    JOINED_EVENTS_SQL, RECORD_TURN_SPAN_SQL, ROUTE_DAY_USAGE_SQL, SESSION_USAGE_SQL,
    START_EVENT_SQL, SUSPENDED_EVENT_WAITS_SQL, TRANSCRIPT_SQL, TURN_STEPS_SQL, step_usage_values,
};
use crate::store::states::SessionState;
use crate::store::states::{
    IDLE, PENDING, QUEUED, RESUME_PENDING, ResumeReason, SESSION_RUNNING, SUSPENDED, StopReason,
    TURN_RUNNING,
};
use crate::store::{StoreError, Turns, now_millis};
use crate::usage::{Counted, Spending, Spent};

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
const CANDIDATES_SQL: &str = concatcp!(RUNNABLE_HEADS, " ORDER BY s.queue_head LIMIT $1");

/// As [`CANDIDATES_SQL`], with the routes' priorities counted as waiting. `$1` limit, `$2` the
/// priorities (a JSON object of route name to priority; route names are letters, digits, `_`
/// and `-`), `$3` the waiting one step is worth. Every idle session with a queued event is read
/// and sorted, so this is used only when some route has a priority.
const PRIORITY_CANDIDATES_SQL: &str = concatcp!(
    RUNNABLE_HEADS,
    " ORDER BY e.received_at - coalesce(json_extract($2, '$.\"' || e.route || '\"'), 0) * $3,
             s.queue_head
    LIMIT $1"
);

/// The oldest event that must run alone and is the next of an idle session, from the partial
/// index of such events (a few at most, after a crash). `$1` limit.
const ALONE_CANDIDATES_SQL: &str = concatcp!(
    "
    SELECT e.id AS id, e.seq AS seq, e.session_key AS session_key
    FROM events e JOIN sessions s ON s.key = e.session_key
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
/// since it was read).
const STILL_FIRST_SQL: &str = concatcp!(
    "SELECT NOT EXISTS (SELECT 1 FROM events WHERE status = ",
    QUEUED,
    " AND session_key = $1 AND seq < $2)
        AND EXISTS (SELECT 1 FROM events WHERE id = $3 AND status = ",
    QUEUED,
    ")
        AND EXISTS (SELECT 1 FROM sessions WHERE key = $1 AND state = ",
    IDLE,
    ") AS still_first"
);

const CLAIMED_EVENT_SQL: &str = concatcp!("SELECT ", CLAIM_COLUMNS, " FROM events WHERE id = $1");

/// `$1` turn id, `$2` session key, `$3` event id, `$4` now.
const START_TURN_SQL: &str = concatcp!(
    "INSERT INTO turns (id, session_key, event_id, status, started_at)
     VALUES ($1, $2, $3, ",
    TURN_RUNNING,
    ", $4)"
);

/// `$1` session key, `$2` turn id, `$3` now.
const START_SESSION_SQL: &str = concatcp!(
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
struct Candidate {
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

/// Claims the candidates that are still claimable now.
fn claim_in(
    connection: &Connection,
    candidates: &[Candidate],
) -> Result<Vec<ClaimedTurn>, StoreError> {
    let now = now_millis();
    let mut claimed = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        let still_first: bool = query_one(
            connection,
            STILL_FIRST_SQL,
            &[&candidate.session_key, &candidate.seq, &candidate.event_id],
            |row| value(row, "still_first"),
        )?;
        if !still_first {
            continue;
        }
        let turn_id = uuid::Uuid::now_v7().to_string();
        let turn = query_one(
            connection,
            CLAIMED_EVENT_SQL,
            &[&candidate.event_id],
            |row| ClaimedTurn::decode(row, turn_id.clone()),
        )?;
        let event = &turn.event;
        execute(connection, START_EVENT_SQL, &[&event.id, &now])?;
        execute(
            connection,
            START_TURN_SQL,
            &[&turn_id, &event.session_key, &event.id, &now],
        )?;
        execute(
            connection,
            START_SESSION_SQL,
            &[&event.session_key, &turn_id, &now],
        )?;
        claimed.push(turn);
    }
    Ok(claimed)
}

/// Ends a turn's rows: the turn, its event's terminal status, its session and its delivery.
pub(super) fn finish_in(
    connection: &Connection,
    end: &TurnEnd,
    render: RenderDelivery,
) -> Result<(), StoreError> {
    let now = now_millis();
    let reason = end.reason.map(StopReason::sql);
    execute(
        connection,
        FINISH_TURN_SQL,
        &[
            &end.turn_id,
            &end.turn_status.sql(),
            &reason,
            &end.output,
            &end.error,
            &end.steps,
            &now,
        ],
    )?;
    execute(
        connection,
        FINISH_EVENT_SQL,
        &[&end.event_id, &end.terminal.event_status().sql(), &now],
    )?;
    execute(
        connection,
        END_SESSION_SQL,
        &[
            &end.session_key,
            &end.terminal.session_state().sql(),
            &reason,
            &now,
        ],
    )?;
    let spent = query_one(connection, EVENT_USAGE_SQL, &[&end.event_id], |row| {
        Spent::decode(row)
    })?;
    let body = render.body(end, spent)?;
    execute(
        connection,
        QUEUE_DELIVERY_SQL,
        &[&end.event_id, &end.route, &end.session_key, &body, &now],
    )?;
    // The events that joined it end with it, each delivered (what the turn spent is on its own
    // event's delivery).
    let joined = query(
        connection,
        FINISH_JOINED_SQL,
        &[&end.event_id, &end.terminal.event_status().sql(), &now],
        |row| value::<String>(row, "id"),
    )?;
    for event_id in joined {
        let body = render.body(&end.for_joined(&event_id), Spent::default())?;
        execute(
            connection,
            QUEUE_DELIVERY_SQL,
            &[&event_id, &end.route, &end.session_key, &body, &now],
        )?;
    }
    Ok(())
}

/// Coalescing: the queued events of `head`'s session and route that arrived within `window_ms`
/// after it join it; every event joined to it so far, oldest first.
fn join_in(
    connection: &Connection,
    head: &Event,
    window_ms: i64,
) -> Result<Vec<Event>, StoreError> {
    execute(
        connection,
        JOIN_QUEUED_SQL,
        &[
            &head.id,
            &head.session_key,
            &head.route,
            &now_millis(),
            &window_ms,
        ],
    )?;
    query(connection, JOINED_EVENTS_SQL, &[&head.id], |row| {
        Event::decode(row)
    })
}

fn append_in(
    connection: &Connection,
    session_key: &str,
    turn_id: &str,
    entries: &[(&'static str, String)],
    steps: u32,
    spent: Spent,
) -> Result<(), StoreError> {
    let now = now_millis();
    for (kind, body) in entries {
        execute(
            connection,
            APPEND_SQL,
            &[&session_key, &turn_id, kind, body, &now],
        )?;
    }
    let [input, cached, output, unknown, estimated] = step_usage_values(spent);
    execute(
        connection,
        TURN_STEPS_SQL,
        &[
            &turn_id, &steps, &input, &cached, &output, &unknown, &estimated,
        ],
    )?;
    Ok(())
}

/// Pauses a turn on a call that waits for a decision (`Turns::await_approval`).
fn await_in(connection: &Connection, request: &NewApproval, steps: u32) -> Result<(), StoreError> {
    let now = request.row.requested_at;
    execute(
        connection,
        INSERT_APPROVAL_SQL,
        &[
            &request.row.id,
            &request.row.event_id,
            &request.row.session,
            &request.row.route,
            &request.row.turn_id,
            &request.row.call_id,
            &request.row.tool,
            &request.row.arguments.to_string(),
            &request.row.requested_at,
            &request.row.expires_at,
            &request.row.link_secret,
        ],
    )?;
    let body = request.row.entry().body()?;
    execute(
        connection,
        APPEND_SQL,
        &[
            &request.row.session,
            &request.row.turn_id,
            &APPROVAL_ENTRY,
            &body,
            &now,
        ],
    )?;
    execute(
        connection,
        INTERRUPT_TURN_SQL,
        &[
            &request.row.turn_id,
            &StopReason::AwaitingApproval.sql(),
            &steps,
            &now,
        ],
    )?;
    execute(connection, AWAIT_EVENT_SQL, &[&request.row.event_id, &now])?;
    // The request's own delivery, keyed by its id (the event's result is delivered later).
    execute(
        connection,
        QUEUE_DELIVERY_SQL,
        &[
            &request.row.id,
            &request.row.route,
            &request.row.session,
            &request.delivery,
            &now,
        ],
    )?;
    execute(
        connection,
        END_SESSION_SQL,
        &[
            &request.row.session,
            &SessionState::AwaitingApproval.sql(),
            &None::<&str>,
            &now,
        ],
    )?;
    Ok(())
}

fn interrupt_in(
    connection: &Connection,
    turn_id: &str,
    session_key: &str,
    reason: ResumeReason,
    steps: u32,
) -> Result<(), StoreError> {
    let now = now_millis();
    let reason = StopReason::Resume(reason).sql();
    execute(
        connection,
        INTERRUPT_TURN_SQL,
        &[&turn_id, &reason, &steps, &now],
    )?;
    execute(
        connection,
        INTERRUPT_SESSION_SQL,
        &[&session_key, &reason, &now],
    )?;
    execute(
        connection,
        SUSPENDED_EVENT_WAITS_SQL,
        &[&turn_id, &reason, &session_key, &now],
    )?;
    Ok(())
}

#[async_trait::async_trait]
impl Turns for SqliteStore {
    async fn claim_turns(&self, claim: Claim) -> Result<Vec<ClaimedTurn>, StoreError> {
        let candidates = self
            .read(move |connection| candidates_in(connection, &claim))
            .await?;
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        self.write(move |connection| claim_in(connection, &candidates))
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
            append_in(connection, &session_key, &turn_id, &entries, steps, spent)
        })
        .await
    }

    async fn spending(
        &self,
        event_id: &str,
        session_key: &str,
        route: &str,
        since: i64,
        counted: Counted,
    ) -> Result<Spending, StoreError> {
        let (event_id, session_key, route) = (
            event_id.to_string(),
            session_key.to_string(),
            route.to_string(),
        );
        self.read(move |connection| {
            let spent = |wanted: bool, sql: &str, values: &[&dyn rusqlite::ToSql]| {
                if !wanted {
                    return Ok(Spent::default());
                }
                query_one(connection, sql, values, |row| Spent::decode(row))
            };
            Ok(Spending {
                turn: spent(counted.turn, EVENT_USAGE_SQL, &[&event_id])?,
                session: spent(counted.session, SESSION_USAGE_SQL, &[&session_key])?,
                day: spent(counted.day, DAY_USAGE_SQL, &[&since])?,
                route_day: spent(counted.route_day, ROUTE_DAY_USAGE_SQL, &[&since, &route])?,
            })
        })
        .await
    }

    async fn finish_turn(&self, end: TurnEnd, render: RenderDelivery) -> Result<(), StoreError> {
        self.write(move |connection| finish_in(connection, &end, render))
            .await
    }

    async fn join_queued(&self, head: &Event, window_ms: i64) -> Result<Vec<Event>, StoreError> {
        let head = head.clone();
        self.write(move |connection| join_in(connection, &head, window_ms))
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

    async fn await_approval(&self, request: NewApproval, steps: u32) -> Result<(), StoreError> {
        self.write(move |connection| await_in(connection, &request, steps))
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
