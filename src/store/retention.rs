//! Retention: finished work older than `[store] retention` is deleted, so the state stops
//! growing with the traffic it has seen.
//!
//! Only finished events go: `completed`, `failed` and `abandoned`, and only once their result is
//! delivered. A queued, running or interrupted event, a `suspended` one (its session's resume
//! runs it again) and any event whose result is still pending or failed in the outbox stay,
//! whatever their age. An event goes with its turns, their transcript steps and its delivery;
//! a session goes once it is idle, has no event left and has not changed within the retention.
//! Later turns of a session see only what is retained.
//!
//! Deletion runs in small batches, each its own short transaction, so the writer is never held
//! for long; the SQL is shared by both backends.

use const_format::concatcp;

use super::states::{DELIVERED, EVENT_ABANDONED, EVENT_COMPLETED, EVENT_FAILED, IDLE};

/// Events deleted per transaction: small, because an accept that arrives meanwhile waits for it
/// (50 events with their turns and transcripts take about a millisecond on SQLite).
pub(crate) const PRUNE_BATCH: i64 = 50;

/// `$1` the cutoff (unix ms), `$2` the batch size: finished events whose result is delivered.
pub(crate) const PRUNABLE_EVENTS_SQL: &str = concatcp!(
    "SELECT e.id FROM events e
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

/// `$1` an event id: its transcript steps, turns, delivery and the event itself, in that order.
pub(crate) const DELETE_EVENT_SQL: [&str; 4] = [
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
