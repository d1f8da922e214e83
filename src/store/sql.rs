//! The SQL both backends run as it is, grouped by the trait it serves.
//!
//! A statement lives here when SQLite and PostgreSQL can run the same text, so the two cannot
//! answer differently; a statement only one backend can run lives in that backend's file for
//! the same trait (`sqlite/turns.rs`, `postgres/turns.rs`, ...). The transactions written once
//! for both (`turns.rs`, `approval.rs`, `rewind.rs`) run these, and a backend's own where
//! its text differs. Parameters are numbered `$N`
//! (SQLite binds them by name, see `sqlite::bind`), `CAST($N AS TEXT)` where a parameter may be
//! NULL, and every column a decoder reads has a name (`AS ...`), since rows are read by column
//! name (`row.rs`).

use const_format::concatcp;

use super::states::{
    APPROVAL_PENDING, CRASHED, DECIDED, DELIVERED, DELIVERY_FAILED, EVENT_ABANDONED,
    EVENT_AWAITING, EVENT_COMPLETED, EVENT_FAILED, EVENT_JOINED, EVENT_RUNNING, EVENT_SUSPENDED,
    IDLE, PENDING, QUEUED, RESUME_PENDING, SESSION_AWAITING, SESSION_RUNNING, SHUTDOWN_TIMEOUT,
    SUSPENDED, TURN_INTERRUPTED, TURN_RUNNING, WEBHOOK,
};
use crate::usage::{Spent, Usage};

// ---- Accepting -------------------------------------------------------------------------------

/// `$1` route, `$2` delivery id, `$3` the start of the dedup window: the event a delivery id was
/// first accepted as.
pub(crate) const ORIGINAL_SQL: &str =
    "SELECT event_id FROM dedup WHERE route = $1 AND delivery_id = $2 AND seen_at >= $3";

/// `$1` the cutoff: delivery ids last seen before it are forgotten.
pub(crate) const PRUNE_DEDUP_SQL: &str = "DELETE FROM dedup WHERE seen_at < $1";

// Retention: finished work older than `[store] retention` is deleted, so the state stops
// growing with the traffic it has seen.
//
// Only finished events go (`Terminal::prunable`: completed, failed and abandoned), and only once
// their result is delivered. A queued, running or interrupted event, a suspended one (its
// session's resume runs it again) and any event whose result is still pending or failed in the
// outbox stay, whatever their age. An event goes with its turns, their transcript steps and its
// delivery; a session goes once it is idle, has no event left and has not changed within the
// retention. Later turns of a session see only what is retained. Deletion runs in small batches,
// each its own short transaction, so the writer is never held for long.

/// Events deleted per transaction: small, because an accept that arrives meanwhile waits for it
/// (50 events with their turns and transcripts take about a millisecond on SQLite).
pub(crate) const PRUNE_BATCH: i64 = 50;

/// `$1` the cutoff (unix ms), `$2` the batch size: finished events whose result is delivered.
pub(crate) const PRUNABLE_EVENTS_SQL: &str = concatcp!(
    "SELECT e.id AS id FROM events e
     WHERE e.status IN (",
    EVENT_COMPLETED,
    ", ",
    EVENT_FAILED,
    ", ",
    EVENT_ABANDONED,
    ") AND e.updated_at < $1
       AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.event_id = e.id AND d.status <> ",
    DELIVERED,
    ")
     ORDER BY e.seq LIMIT $2"
);

/// `$1` an event id: its approval requests (with their deliveries), transcript steps, turns,
/// delivery and the event itself, in that order.
pub(crate) const DELETE_EVENT_SQL: [&str; 6] = [
    "DELETE FROM deliveries WHERE event_id IN (SELECT id FROM approvals WHERE event_id = $1)",
    "DELETE FROM approvals WHERE event_id = $1",
    "DELETE FROM transcript WHERE turn_id IN (SELECT id FROM turns WHERE event_id = $1)",
    "DELETE FROM turns WHERE event_id = $1",
    "DELETE FROM deliveries WHERE event_id = $1",
    "DELETE FROM events WHERE id = $1",
];

/// `$1` the cutoff, `$2` the batch size: idle sessions with no event left.
pub(crate) const PRUNE_SESSIONS_SQL: &str = concatcp!(
    "DELETE FROM sessions WHERE key IN (
         SELECT s.key FROM sessions s
         WHERE s.state = ",
    IDLE,
    " AND s.updated_at < $1
           AND NOT EXISTS (SELECT 1 FROM events e WHERE e.session_key = s.key)
         LIMIT $2)"
);

// ---- Turns -----------------------------------------------------------------------------------

/// The columns `Event::decode` reads, from `events`.
pub(crate) const EVENT_COLUMNS: &str =
    "id, route, session_key, event_type, delivery_id, headers, payload, trace_parent";

/// The columns a claimed turn is made of: the event, why it runs again, whether agentgate
/// queued it itself, whether it must run alone, and, for a rewind, where it starts and the id
/// its first turn takes.
pub(crate) const CLAIM_COLUMNS: &str = concatcp!(
    EVENT_COLUMNS,
    ", resume_reason, origin <> ",
    WEBHOOK,
    " AS internal, run_alone, rewind_from, rewind_turn"
);

/// Coalescing: `$1` the head event's id, `$2` its session, `$3` its route, `$4` now, `$5` the
/// window (ms): the session's queued events of the route that arrived within the window after
/// the head join it. What follows `UPDATE events` (SQLite names the index that finds them: the
/// session's queued events, never the route's).
pub(crate) const JOIN_QUEUED_SET: &str = concatcp!(
    " SET status = ",
    EVENT_JOINED,
    ", joined_to = $1, updated_at = $4
     WHERE session_key = $2 AND route = $3 AND status = ",
    QUEUED,
    " AND id <> $1
       AND received_at <= (SELECT h.received_at FROM events h WHERE h.id = $1) + $5"
);

/// `$1` the head event's id: the events joined to it, oldest first.
pub(crate) const JOINED_EVENTS_SQL: &str = concatcp!(
    "SELECT ",
    EVENT_COLUMNS,
    " FROM events WHERE joined_to = $1 ORDER BY seq"
);

/// `$1` the head event's id, `$2` its terminal status, `$3` now: the events joined to it end
/// with it; their ids.
pub(crate) const FINISH_JOINED_SQL: &str =
    "UPDATE events SET status = $2, updated_at = $3 WHERE joined_to = $1 RETURNING id";

/// `$1` turn id, `$2` status, `$3` reason, `$4` output, `$5` error, `$6` steps, `$7` now.
pub(crate) const FINISH_TURN_SQL: &str = "UPDATE turns SET status = $2, reason = $3, output = $4, error = $5, steps = $6, finished_at = $7
     WHERE id = $1";

/// `$1` event id, `$2` now. (A rewind's turn id is taken by its first turn only.)
pub(crate) const START_EVENT_SQL: &str = concatcp!(
    "UPDATE events SET status = ",
    EVENT_RUNNING,
    ", resume_reason = NULL, run_alone = false, rewind_turn = NULL, updated_at = $2 WHERE id = $1"
);
/// `$1` turn id, `$2` reason, `$3` steps, `$4` now.
pub(crate) const INTERRUPT_TURN_SQL: &str = concatcp!(
    "UPDATE turns SET status = ",
    TURN_INTERRUPTED,
    ", reason = $2, steps = $3, finished_at = $4 WHERE id = $1"
);
/// `$1` session key, `$2` its state after the turn, `$3` reason, `$4` now: the start of the
/// update (PostgreSQL also releases the lease). An operator's suspension made while the turn
/// ran stays in force.
pub(crate) const END_SESSION_SET: &str = concatcp!(
    "UPDATE sessions SET state = CASE WHEN state = ",
    SUSPENDED,
    " THEN ",
    SUSPENDED,
    " ELSE $2 END,
         reason = CASE WHEN state = ",
    SUSPENDED,
    " THEN reason ELSE $3 END, updated_at = $4"
);

/// `$1` event id, `$2` its terminal status, `$3` now; answers what it rewinds, if anything (its
/// result says so).
pub(crate) const FINISH_EVENT_SQL: &str =
    "UPDATE events SET status = $2, updated_at = $3 WHERE id = $1
     RETURNING rewind_session AS rewind_session, rewind_entry AS rewind_entry";

/// `$1` session key, `$2` turn id, `$3` kind, `$4` body, `$5` now: one transcript entry, after
/// the session's last.
pub(crate) const APPEND_SQL: &str =
    "INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at)
     VALUES ($1, COALESCE((SELECT max(seq) FROM transcript WHERE session_key = $1), 0) + 1,
             $2, $3, $4, $5)";

/// `$1` turn id, `$2` steps.
pub(crate) const TURN_STEPS_SQL: &str = "UPDATE turns SET steps = $2,
         input_tokens = input_tokens + $3, cached_input_tokens = cached_input_tokens + $4,
         output_tokens = output_tokens + $5, unknown_usage_steps = unknown_usage_steps + $6,
         estimated_tokens = estimated_tokens + $7
     WHERE id = $1";

/// The `$3`..`$7` values of `TURN_STEPS_SQL`: what the step spent.
pub(crate) fn step_usage_values(spent: Spent) -> [i64; 5] {
    let value = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    [
        value(spent.usage.input_tokens),
        value(spent.usage.cached_input_tokens),
        value(spent.usage.output_tokens),
        value(spent.unknown_steps),
        value(spent.estimated_tokens),
    ]
}

/// Sums of the turns' usage columns, as `Spent::decode` reads them (64-bit in both backends).
const USAGE_SUMS: &str = "CAST(COALESCE(SUM(u.input_tokens), 0) AS BIGINT) AS input_tokens,
         CAST(COALESCE(SUM(u.cached_input_tokens), 0) AS BIGINT) AS cached_input_tokens,
         CAST(COALESCE(SUM(u.output_tokens), 0) AS BIGINT) AS output_tokens,
         CAST(COALESCE(SUM(u.unknown_usage_steps), 0) AS BIGINT) AS unknown_steps,
         CAST(COALESCE(SUM(u.estimated_tokens), 0) AS BIGINT) AS estimated_tokens";

/// `$1` event id: what all its turns spent (a resumed event has several).
pub(crate) const EVENT_USAGE_SQL: &str =
    concatcp!("SELECT ", USAGE_SUMS, " FROM turns u WHERE u.event_id = $1");

/// `$1` session key: what all its turns spent.
pub(crate) const SESSION_USAGE_SQL: &str = concatcp!(
    "SELECT ",
    USAGE_SUMS,
    " FROM turns u WHERE u.session_key = $1"
);

/// `$1` the first millisecond counted: what turns started since then spent, all routes.
pub(crate) const DAY_USAGE_SQL: &str = concatcp!(
    "SELECT ",
    USAGE_SUMS,
    " FROM turns u WHERE u.started_at >= $1"
);

/// `$1` the first millisecond counted, `$2` a route: what its turns started since then spent.
pub(crate) const ROUTE_DAY_USAGE_SQL: &str = concatcp!(
    "SELECT ",
    USAGE_SUMS,
    " FROM turns u JOIN events e ON e.id = u.event_id WHERE u.started_at >= $1 AND e.route = $2"
);

/// `$1` the first millisecond counted: what turns started since then spent, by the route of
/// their event and the UTC day they started (`day`: days since 1970-01-01).
pub(crate) const USAGE_BY_DAY_SQL: &str = concatcp!(
    "SELECT e.route AS route, CAST(u.started_at / 86400000 AS BIGINT) AS day, ",
    USAGE_SUMS,
    " FROM turns u JOIN events e ON e.id = u.event_id
     WHERE u.started_at >= $1
     GROUP BY e.route, CAST(u.started_at / 86400000 AS BIGINT)
     ORDER BY day, route"
);

// Budget reservations: what model requests in flight may spend (docs/reference.md, "Budgets").
// The table holds one row per turn with a request in flight, so it stays as small as the
// number of running turns, and is read whole.

/// `$1` turn id: its reservation goes (settled by the step that records the reply, released,
/// or ended with its turn).
pub(crate) const RELEASE_SQL: &str = "DELETE FROM budget_reservations WHERE turn_id = $1";

/// The prompt and reply tokens of a reservation, as stored.
pub(crate) fn reserved_values(tokens: Usage) -> [i64; 2] {
    let value = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    [value(tokens.input_tokens), value(tokens.output_tokens)]
}

/// What the reservations hold in each window of a turn (as `Spending::decode_held` reads it):
/// `$1` its event id, `$2` its session key, `$3` its route, `$4` its day's first millisecond.
/// Each backend adds which reservations are live.
pub(crate) const HELD_SUMS: &str = "SELECT
         CAST(COALESCE(SUM(CASE WHEN event_id = $1 THEN input_tokens ELSE 0 END), 0) AS BIGINT) AS turn_input,
         CAST(COALESCE(SUM(CASE WHEN event_id = $1 THEN output_tokens ELSE 0 END), 0) AS BIGINT) AS turn_output,
         CAST(COALESCE(SUM(CASE WHEN session_key = $2 THEN input_tokens ELSE 0 END), 0) AS BIGINT) AS session_input,
         CAST(COALESCE(SUM(CASE WHEN session_key = $2 THEN output_tokens ELSE 0 END), 0) AS BIGINT) AS session_output,
         CAST(COALESCE(SUM(CASE WHEN made_at >= $4 THEN input_tokens ELSE 0 END), 0) AS BIGINT) AS day_input,
         CAST(COALESCE(SUM(CASE WHEN made_at >= $4 THEN output_tokens ELSE 0 END), 0) AS BIGINT) AS day_output,
         CAST(COALESCE(SUM(CASE WHEN made_at >= $4 AND route = $3 THEN input_tokens ELSE 0 END), 0) AS BIGINT) AS route_input,
         CAST(COALESCE(SUM(CASE WHEN made_at >= $4 AND route = $3 THEN output_tokens ELSE 0 END), 0) AS BIGINT) AS route_output
     FROM budget_reservations";

/// `$1` event id: whether any run of it recorded a transcript entry (a run cut off between its
/// claim and its first commit did not: its resume must start from the event itself).
pub(crate) const EVENT_HAS_TRANSCRIPT_SQL: &str =
    "SELECT EXISTS (SELECT 1 FROM transcript t JOIN turns u ON u.id = t.turn_id
                    WHERE u.event_id = $1) AS found";

/// `$1` event id, `$2` turn id: the span of the event's latest earlier turn that recorded one.
pub(crate) const EARLIER_TURN_SPAN_SQL: &str = "SELECT trace_span FROM turns
     WHERE event_id = $1 AND id <> $2 AND trace_span IS NOT NULL
     ORDER BY started_at DESC, id DESC LIMIT 1";

/// `$1` turn id, `$2` the `traceparent` of its span.
pub(crate) const RECORD_TURN_SPAN_SQL: &str = "UPDATE turns SET trace_span = $2 WHERE id = $1";

/// The columns `TranscriptRow::decode` reads, of `transcript t` and (for an `event` entry) the
/// event it refers to, `events e`.
const TRANSCRIPT_COLUMNS: &str =
    "SELECT t.seq AS seq, t.turn_id AS turn_id, t.kind AS kind, t.body AS body,
            t.created_at AS created_at, t.superseded_by AS superseded_by,
            e.id AS id, e.route AS route, e.session_key AS session_key,
            e.event_type AS event_type, e.delivery_id AS delivery_id, e.headers AS headers,
            e.payload AS payload, e.trace_parent AS trace_parent";

/// `$2` the `event` entry kind: an `event` entry's event, joined through its turn.
const ENTRY_EVENTS: &str = " LEFT JOIN turns u ON t.kind = $2 AND u.id = t.turn_id
     LEFT JOIN events e ON e.id = u.event_id";

/// `$1` session key, `$2` the `event` entry kind: a session's transcript entries.
const TRANSCRIPT_ROWS: &str = concatcp!(
    TRANSCRIPT_COLUMNS,
    " FROM transcript t",
    ENTRY_EVENTS,
    " WHERE t.session_key = $1"
);

/// `$1` event id, `$2` the `event` entry kind, `$3` a limit: the first entries of the event's
/// turns, oldest first, read from its turns (`CROSS JOIN` keeps that order in SQLite) through
/// the entries' index by turn (the console's steps and timeline of an event; the plan is pinned
/// by `store::contract::transcript`).
pub(crate) const EVENT_TRANSCRIPT_SQL: &str = concatcp!(
    TRANSCRIPT_COLUMNS,
    " FROM turns v CROSS JOIN transcript t",
    ENTRY_EVENTS,
    " WHERE v.event_id = $1 AND t.turn_id = v.id ORDER BY t.seq LIMIT $3"
);

/// As [`TRANSCRIPT_ROWS`], `$3` a seq: the entries after that one, oldest first.
pub(crate) const TRANSCRIPT_SQL: &str =
    concatcp!(TRANSCRIPT_ROWS, " AND t.seq > $3 ORDER BY t.seq");

/// As [`TRANSCRIPT_ROWS`], `$3` a limit: the latest entries, newest first, read backwards along
/// the primary key, so that a long transcript costs only the entries read (the plan is pinned
/// by `store::contract::transcript`).
pub(crate) const TRANSCRIPT_TAIL_SQL: &str =
    concatcp!(TRANSCRIPT_ROWS, " ORDER BY t.seq DESC LIMIT $3");

/// The turns a session's history counts: its event entries that no rewind superseded, each the
/// start of one turn's entries. Read from their own index (`transcript_events`, whose `WHERE`
/// these repeat word for word, literal included, so that both engines may use it), so that a
/// turn reads only the entries of the turns it may show, however long the session.
const HISTORY_TURNS_WHERE: &str = concatcp!(
    " FROM transcript WHERE session_key = $1 AND kind = '",
    super::model::EVENT_ENTRY,
    "' AND superseded_by IS NULL"
);

/// `$1` session key: how many turns its history counts.
pub(crate) const HISTORY_TURNS_SQL: &str =
    concatcp!("SELECT count(*) AS turns", HISTORY_TURNS_WHERE);

/// `$1` session key, `$2` n: where its n-th turn (from 0, oldest first) starts, the seq of its
/// event entry.
pub(crate) const HISTORY_TURN_START_SQL: &str = concatcp!(
    "SELECT seq",
    HISTORY_TURNS_WHERE,
    " ORDER BY seq LIMIT 1 OFFSET $2"
);

// ---- Recovery --------------------------------------------------------------------------------

/// `$1` event id, `$2` the resume reason, `$3` now, `$4` whether it must run alone: an
/// interrupted event goes back to the head of its session's queue, marked as a resume.
pub(crate) const REQUEUE_EVENT_SQL: &str = concatcp!(
    "UPDATE events SET status = ",
    QUEUED,
    ", resume_reason = $2, run_alone = $4, updated_at = $3 WHERE id = $1"
);

/// `$1` turn id, `$2` the resume reason, `$3` session key, `$4` now: the interrupted turn's event
/// of a session an operator suspended waits, queued as a resume, for `sessions resume` (rather
/// than reading `running` while nothing runs it).
pub(crate) const SUSPENDED_EVENT_WAITS_SQL: &str = concatcp!(
    "UPDATE events SET status = ",
    QUEUED,
    ", resume_reason = $2, updated_at = $4
     WHERE id = (SELECT event_id FROM turns WHERE id = $1)
       AND EXISTS (SELECT 1 FROM sessions WHERE key = $3 AND state = ",
    SUSPENDED,
    ")"
);

/// `$1` session key, `$2` now: the session may run its requeued event.
pub(crate) const REQUEUE_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = ",
    IDLE,
    ", updated_at = $2 WHERE key = $1"
);

/// The columns `InterruptedSession::decode` reads, from `sessions s JOIN turns t` (the last
/// turn).
pub(crate) const INTERRUPTED_COLUMNS: &str = concatcp!(
    "s.key AS key, s.route AS route, COALESCE(s.reason, ",
    CRASHED,
    ") AS reason, t.id AS turn_id, t.event_id AS event_id, t.steps AS steps,
     t.started_at AS started_at, COALESCE(t.crashed_with, 1) AS crashed_with"
);

// ---- Inspection ------------------------------------------------------------------------------

/// The counts of [`LiveCounts`](super::LiveCounts).
pub(crate) const LIVE_COUNTS_SQL: &str = concatcp!(
    "SELECT (SELECT count(*) FROM events WHERE status = ",
    QUEUED,
    ") AS queued, (SELECT count(*) FROM sessions WHERE state = ",
    RESUME_PENDING,
    ") AS resume_pending, (SELECT count(*) FROM sessions WHERE state = ",
    SUSPENDED,
    ") AS suspended, (SELECT count(*) FROM approvals WHERE status = ",
    APPROVAL_PENDING,
    ") AS approvals_pending"
);

/// Queued events by route, for each route's share of `max_queued_events`: on SQLite counted in
/// the partial index of queued events by route (`events_queued_by_route`, which holds the route:
/// no event row is read). What follows `FROM events` (SQLite names the index).
pub(crate) const QUEUED_BY_ROUTE_WHERE: &str =
    concatcp!(" WHERE status = ", QUEUED, " GROUP BY route");

/// The start of [`QUEUED_BY_ROUTE_WHERE`]'s query.
pub(crate) const QUEUED_BY_ROUTE_SELECT: &str = "SELECT route AS name, count(*) AS n FROM events";

/// Accepted webhooks by status (internal events are not accepted ones).
pub(crate) const EVENTS_BY_STATUS_SQL: &str = concatcp!(
    "SELECT status AS name, count(*) AS n FROM events WHERE origin = ",
    WEBHOOK,
    " GROUP BY status"
);

pub(crate) const SESSIONS_BY_STATE_SQL: &str =
    "SELECT state AS name, count(*) AS n FROM sessions GROUP BY state";

pub(crate) const DELIVERY_COUNTS_SQL: &str = concatcp!(
    "SELECT count(CASE WHEN status = ",
    PENDING,
    " THEN 1 END) AS pending, count(CASE WHEN status = ",
    DELIVERY_FAILED,
    " THEN 1 END) AS failed FROM deliveries"
);

/// A session row as `sessions list` shows it.
pub(crate) const SESSION_SQL: &str = concatcp!(
    "
    SELECT s.key AS key, s.route AS route, s.state AS state, s.reason AS reason,
           s.last_turn_id AS last_turn_id,
           (SELECT t.status FROM turns t WHERE t.id = s.last_turn_id) AS last_turn_status,
           (SELECT count(*) FROM turns t WHERE t.session_key = s.key) AS turns,
           (SELECT count(*) FROM events e WHERE e.session_key = s.key AND e.status = ",
    QUEUED,
    ") AS queued,
           s.updated_at AS updated_at
    FROM sessions s"
);

/// Every session, the most recently changed first.
pub(crate) const SESSIONS_SQL: &str = concatcp!(SESSION_SQL, " ORDER BY s.updated_at DESC");

/// `$1` session key.
pub(crate) const ONE_SESSION_SQL: &str = concatcp!(SESSION_SQL, " WHERE s.key = $1");

/// A page of sessions in key order: `$1` the last key of the page before, `$3` a state, `$4` a
/// route, `$5` a `LIKE` pattern for the key in lower case, with `\` its escape (each may be
/// NULL); `$2` limit.
pub(crate) const SESSIONS_PAGE_SQL: &str = concatcp!(
    SESSION_SQL,
    " WHERE (CAST($1 AS TEXT) IS NULL OR s.key > $1)
       AND (CAST($3 AS TEXT) IS NULL OR s.state = $3)
       AND (CAST($4 AS TEXT) IS NULL OR s.route = $4)
       AND (CAST($5 AS TEXT) IS NULL OR lower(s.key) LIKE $5 ESCAPE '\\')
     ORDER BY s.key LIMIT $2"
);

/// The columns `EventRow::decode` reads.
const EVENT_ROW_COLUMNS: &str = "id, route, session_key, event_type, status, delivery_id, \
     received_at, origin, replay_of, rewind_session, rewind_entry";

/// `$1` status, `$2` route, `$3` session, `$5` the event to list only older ones than, `$6` and
/// `$7` the first and the last time received (unix ms), `$8` the delivery id (each may be NULL);
/// `$4` limit.
pub(crate) const EVENTS_SQL: &str = concatcp!(
    "SELECT ",
    EVENT_ROW_COLUMNS,
    " FROM events
     WHERE (CAST($1 AS TEXT) IS NULL OR status = $1)
       AND (CAST($2 AS TEXT) IS NULL OR route = $2)
       AND (CAST($3 AS TEXT) IS NULL OR session_key = $3)
       AND (CAST($5 AS TEXT) IS NULL OR seq < (SELECT b.seq FROM events b WHERE b.id = $5))
       AND (CAST($6 AS BIGINT) IS NULL OR received_at >= $6)
       AND (CAST($7 AS BIGINT) IS NULL OR received_at <= $7)
       AND (CAST($8 AS TEXT) IS NULL OR delivery_id = $8)
     ORDER BY seq DESC LIMIT $4"
);

/// `$1` event id: the row with its payload and headers.
pub(crate) const EVENT_SQL: &str = concatcp!(
    "SELECT ",
    EVENT_ROW_COLUMNS,
    ", payload, headers, trace_parent FROM events WHERE id = $1"
);

/// `$1` event id: the copies `events replay` made of it.
pub(crate) const EVENT_REPLAYS_SQL: &str =
    "SELECT id FROM events WHERE replay_of = $1 ORDER BY received_at, id";

/// `$1` event id.
pub(crate) const EVENT_TURNS_SQL: &str =
    "SELECT id, status, reason, steps, started_at, finished_at, error,
            input_tokens, cached_input_tokens, output_tokens,
            unknown_usage_steps AS unknown_steps, estimated_tokens
     FROM turns WHERE event_id = $1 ORDER BY started_at";

const DELIVERY_COLUMNS: &str =
    "event_id, route, session_key, status, attempts, next_attempt_at, last_error, updated_at";

/// `$1` event id.
pub(crate) const EVENT_DELIVERY_SQL: &str = concatcp!(
    "SELECT ",
    DELIVERY_COLUMNS,
    " FROM deliveries WHERE event_id = $1"
);

/// `$1` status (NULL: any), `$2` limit.
pub(crate) const DELIVERIES_SQL: &str = concatcp!(
    "SELECT ",
    DELIVERY_COLUMNS,
    " FROM deliveries WHERE (CAST($1 AS TEXT) IS NULL OR status = $1)
     ORDER BY updated_at DESC LIMIT $2"
);

// ---- Outbox ----------------------------------------------------------------------------------

/// `$1` event id, `$2` status, `$3` next attempt, `$4` last error, `$5` now. (PostgreSQL adds the
/// lease columns to the same update.)
pub(crate) const RECORD_ATTEMPT_SQL: &str =
    "UPDATE deliveries SET status = $2, attempts = attempts + 1, next_attempt_at = $3,
         last_error = $4, updated_at = $5";

// ---- Operator --------------------------------------------------------------------------------

/// `sessions resume`: `$1` session key, `$2` now. The event a session was interrupted or
/// suspended on runs again as a resume (its turn's reason says why it stopped).
pub(crate) const REQUEUE_STOPPED_EVENT_SQL: &str = concatcp!(
    "UPDATE events SET status = ",
    QUEUED,
    ", resume_reason = (SELECT t.reason FROM sessions s JOIN turns t ON t.id = s.last_turn_id
                         WHERE s.key = $1),
       updated_at = $2
     WHERE id = (SELECT t.event_id FROM sessions s JOIN turns t ON t.id = s.last_turn_id
                 WHERE s.key = $1 AND t.status = ",
    TURN_INTERRUPTED,
    " AND t.reason IN (",
    CRASHED,
    ", ",
    SHUTDOWN_TIMEOUT,
    "))
       AND status IN (",
    EVENT_RUNNING,
    ", ",
    EVENT_SUSPENDED,
    ")"
);

/// `sessions resume`: `$1` session key, `$2` now. The session may run again, but a turn of it
/// that still runs keeps it busy, so that no second turn ever starts beside it, and one that
/// waits for a decision keeps it waiting, so that its later events stay behind it.
pub(crate) const RESUME_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = CASE WHEN EXISTS
         (SELECT 1 FROM turns WHERE session_key = $1 AND status = ",
    TURN_RUNNING,
    ") THEN ",
    SESSION_RUNNING,
    " WHEN EXISTS (SELECT 1 FROM approvals WHERE session_key = $1 AND status = ",
    APPROVAL_PENDING,
    ") THEN ",
    SESSION_AWAITING,
    " ELSE ",
    IDLE,
    " END, reason = NULL, updated_at = $2 WHERE key = $1"
);

/// `$1` session key.
pub(crate) const SESSION_STATE_SQL: &str = "SELECT state FROM sessions WHERE key = $1";

/// `$1` the original event id, `$2` the new id, `$3` now. The copy is a new queued event of the
/// same route, session, type, headers and payload, with no delivery id (it is not a redelivery).
pub(crate) const REPLAY_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, origin, replay_of)
     SELECT $2, route, session_key, event_type, NULL, headers, payload, $3, ",
    QUEUED,
    ", $3, origin, id FROM events WHERE id = $1"
);

/// `$1` event id (NULL: every failed delivery), `$2` now: a fresh attempt budget, due at once.
pub(crate) const RETRY_SQL: &str = concatcp!(
    "UPDATE deliveries SET status = ",
    PENDING,
    ", attempts = 0, next_attempt_at = $2, updated_at = $2
     WHERE status = ",
    DELIVERY_FAILED,
    " AND (CAST($1 AS TEXT) IS NULL OR event_id = $1)"
);

/// `$1` route (NULL: every route), `$2` now: pending deliveries are due now.
pub(crate) const SEND_PENDING_NOW_SQL: &str = concatcp!(
    "UPDATE deliveries SET next_attempt_at = $2, updated_at = $2
     WHERE status = ",
    PENDING,
    " AND next_attempt_at > $2 AND (CAST($1 AS TEXT) IS NULL OR route = $1)"
);

// ---- Rewind and fork (`rewind.rs`) -----------------------------------------------------------

/// `$1` session key: its route, state, and whether events of it are queued. (PostgreSQL locks
/// the row: `FOR UPDATE` follows.)
pub(crate) const REWIND_SESSION_SQL: &str = "SELECT route, state, queue_head IS NOT NULL AS queued
     FROM sessions WHERE key = $1";

/// `$1` session key, `$2` entry number: the entry, what superseded it, and the event of the turn
/// that recorded it.
pub(crate) const REWIND_ENTRY_SQL: &str =
    "SELECT t.kind AS kind, t.body AS body, t.superseded_by AS superseded_by, u.event_id AS event_id
     FROM transcript t LEFT JOIN turns u ON u.id = t.turn_id
     WHERE t.session_key = $1 AND t.seq = $2";

/// `$1` the new session's key, `$2` its route, `$3` now: created idle, unless it exists.
pub(crate) const FORK_SESSION_SQL: &str = concatcp!(
    "INSERT INTO sessions (key, route, state, created_at, updated_at) VALUES ($1, $2, ",
    IDLE,
    ", $3, $3) ON CONFLICT (key) DO NOTHING"
);

/// `$1` the forked session, `$2` the new one, `$3` the entry: copies of the entries before it,
/// with their numbers, turns and times.
pub(crate) const FORK_ENTRIES_SQL: &str =
    "INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at, superseded_by)
     SELECT $2, seq, turn_id, kind, body, created_at, superseded_by
     FROM transcript WHERE session_key = $1 AND seq < $3";

/// `$1` session key, `$2` the first entry, `$3` the rewinding turn: the entries from it on that
/// no rewind superseded yet.
pub(crate) const SUPERSEDE_SQL: &str = "UPDATE transcript SET superseded_by = $3
     WHERE session_key = $1 AND seq >= $2 AND superseded_by IS NULL";

/// `$1` the event copied, `$2` the new id, `$3` now, `$4` the session it runs in, `$5` the
/// session rewound, `$6` the entry, `$7` where it starts (`RewindFrom`), `$8` its first turn's
/// id: a queued copy of the event (same route, type, headers and payload; no delivery id).
pub(crate) const REWIND_EVENT_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, origin, rewind_session, rewind_entry,
                         rewind_from, rewind_turn)
     SELECT $2, route, $4, event_type, NULL, headers, payload, $3, ",
    QUEUED,
    ", $3, origin, $5, $6, $7, $8 FROM events WHERE id = $1"
);

// ---- Approvals -------------------------------------------------------------------------------

/// The columns `ApprovalRow::decode` reads.
pub(crate) const APPROVAL_COLUMNS: &str = "id, event_id, session_key, route, turn_id, call_id, \
     tool, arguments, status, requested_at, expires_at, decided_at, decided_by, note, link_secret";

/// `$1`..`$11`: id, event id, session key, route, turn id, call id, tool, arguments (JSON text),
/// requested at, expires at, link secret.
pub(crate) const INSERT_APPROVAL_SQL: &str = concatcp!(
    "INSERT INTO approvals (id, event_id, session_key, route, turn_id, call_id, tool, arguments,
                            status, requested_at, expires_at, link_secret)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, ",
    APPROVAL_PENDING,
    ", $9, $10, $11)"
);

/// `$1` event id, `$2` now.
pub(crate) const AWAIT_EVENT_SQL: &str = concatcp!(
    "UPDATE events SET status = ",
    EVENT_AWAITING,
    ", updated_at = $2 WHERE id = $1"
);

/// `$1` approval id.
pub(crate) const APPROVAL_SQL: &str =
    concatcp!("SELECT ", APPROVAL_COLUMNS, " FROM approvals WHERE id = $1");

/// `$1` only pending ones (boolean), `$2` limit: oldest first.
pub(crate) const APPROVALS_SQL: &str = concatcp!(
    "SELECT ",
    APPROVAL_COLUMNS,
    " FROM approvals WHERE (NOT $1 OR status = ",
    APPROVAL_PENDING,
    ") ORDER BY requested_at, id LIMIT $2"
);

/// `$1` approval id, `$2` status, `$3` by, `$4` at, `$5` note: decides it, if still pending.
pub(crate) const DECIDE_SQL: &str = concatcp!(
    "UPDATE approvals SET status = $2, decided_by = $3, decided_at = $4, note = $5
     WHERE id = $1 AND status = ",
    APPROVAL_PENDING
);

/// `$1` event id, `$2` now: once none of its requests is pending, the event is queued to
/// continue its turn (at the head of its session's queue: it is older than what waits behind).
pub(crate) const CONTINUE_EVENT_SQL: &str = concatcp!(
    "UPDATE events SET status = ",
    QUEUED,
    ", resume_reason = ",
    DECIDED,
    ", updated_at = $2
     WHERE id = $1 AND status = ",
    EVENT_AWAITING,
    " AND NOT EXISTS (SELECT 1 FROM approvals WHERE event_id = $1 AND status = ",
    APPROVAL_PENDING,
    ")"
);

/// `$1` session key, `$2` now: the session may run again once nothing of it awaits a decision.
pub(crate) const CONTINUE_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = ",
    IDLE,
    ", reason = NULL, updated_at = $2
     WHERE key = $1 AND state = ",
    SESSION_AWAITING,
    " AND NOT EXISTS (SELECT 1 FROM approvals WHERE session_key = $1 AND status = ",
    APPROVAL_PENDING,
    ")"
);

/// `$1` session key: its pending requests.
pub(crate) const SESSION_PENDING_SQL: &str = concatcp!(
    "SELECT ",
    APPROVAL_COLUMNS,
    " FROM approvals WHERE session_key = $1 AND status = ",
    APPROVAL_PENDING,
    " ORDER BY requested_at"
);

/// `$1` now, `$2` limit: pending requests whose time ran out.
pub(crate) const DUE_TO_EXPIRE_SQL: &str = concatcp!(
    "SELECT ",
    APPROVAL_COLUMNS,
    " FROM approvals WHERE status = ",
    APPROVAL_PENDING,
    " AND expires_at <= $1 ORDER BY expires_at LIMIT $2"
);

/// `$1` now, `$2` limit: pending requests past 80 % of their time (the expiry warning's), the
/// nearest to expiry first. Only these are read, so many requests far from expiry cost nothing.
pub(crate) const DUE_TO_WARN_SQL: &str = concatcp!(
    "SELECT ",
    APPROVAL_COLUMNS,
    " FROM approvals WHERE status = ",
    APPROVAL_PENDING,
    " AND expires_at - (expires_at - requested_at) / 5 <= $1 ORDER BY expires_at LIMIT $2"
);

/// The number of pending requests.
pub(crate) const PENDING_COUNT_SQL: &str = concatcp!(
    "SELECT count(*) AS n FROM approvals WHERE status = ",
    APPROVAL_PENDING
);

/// Requests expired per transaction of a sweep.
pub(crate) const EXPIRE_BATCH: i64 = 100;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::states::Terminal;

    /// Retention deletes exactly the terminal statuses `Terminal::prunable` names.
    #[test]
    fn retention_deletes_the_prunable_statuses_only() {
        for terminal in [
            Terminal::Completed,
            Terminal::Failed,
            Terminal::Abandoned,
            Terminal::Suspended,
        ] {
            let quoted = format!("'{}'", terminal.event_status().sql());
            assert_eq!(
                PRUNABLE_EVENTS_SQL.contains(&quoted),
                terminal.prunable(),
                "{terminal:?}"
            );
        }
    }
}
