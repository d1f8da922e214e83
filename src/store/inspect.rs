//! What the operator commands read and change beyond sessions: accepted events with their turns
//! and deliveries (`events list/show/replay`) and the outbox (`deliveries list/retry`). The SQL
//! is shared by both backends (`$N` parameters, `CAST(… AS TEXT)` where a parameter may be NULL),
//! so the two cannot answer differently.

use const_format::concatcp;
use serde::Serialize;

use super::states::{DELIVERY_FAILED, PENDING, QUEUED};

/// `events list` filters; `None` matches everything.
#[derive(Debug, Clone, Default)]
pub(crate) struct EventFilter {
    pub status: Option<String>,
    pub route: Option<String>,
    pub session: Option<String>,
    pub limit: i64,
    /// Only events older than this one (a page's cursor: the last event of the page before).
    pub before: Option<String>,
}

/// An accepted (or internal) event as the operator sees it, without its payload.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct EventRow {
    pub id: String,
    pub route: String,
    pub session: String,
    pub event_type: String,
    pub status: String,
    pub delivery_id: Option<String>,
    /// Unix milliseconds.
    pub received_at: i64,
    /// `webhook`, or `background` for a background job's completion.
    pub origin: String,
    /// The event this one is a replay of (`events replay`).
    pub replay_of: Option<String>,
}

/// `events show`: the event, what it carried, and what became of it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct EventDetail {
    #[serde(flatten)]
    pub event: EventRow,
    /// The payload as stored: JSON when it parses, else its text.
    pub payload: serde_json::Value,
    /// The headers as stored (lower-case names, credentials removed).
    pub headers: serde_json::Value,
    pub turns: Vec<TurnRow>,
    pub delivery: Option<DeliveryRow>,
}

/// One turn of an event.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TurnRow {
    pub id: String,
    pub status: String,
    pub reason: Option<String>,
    pub steps: i64,
    pub started_at: i64,
    pub finished_at: Option<i64>,
    pub error: Option<String>,
}

/// One outbox row.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DeliveryRow {
    pub event_id: String,
    pub route: String,
    pub session: String,
    pub status: String,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub last_error: Option<String>,
    pub updated_at: i64,
}

/// Which failed deliveries `deliveries retry` sends again.
#[derive(Debug, Clone)]
pub(crate) enum RetryTarget {
    One(String),
    AllFailed,
}

const EVENT_COLUMNS: &str =
    "id, route, session_key, event_type, status, delivery_id, received_at, origin, replay_of";

/// `$1` status, `$2` route, `$3` session, `$5` the event to list only older ones than (each may
/// be NULL), `$4` limit.
pub(crate) const EVENTS_SQL: &str = concatcp!(
    "SELECT ",
    EVENT_COLUMNS,
    " FROM events
     WHERE (CAST($1 AS TEXT) IS NULL OR status = $1)
       AND (CAST($2 AS TEXT) IS NULL OR route = $2)
       AND (CAST($3 AS TEXT) IS NULL OR session_key = $3)
       AND (CAST($5 AS TEXT) IS NULL OR seq < (SELECT b.seq FROM events b WHERE b.id = $5))
     ORDER BY seq DESC LIMIT $4"
);

/// `$1` event id: the row and its payload and headers (columns 9 and 10).
pub(crate) const EVENT_SQL: &str = concatcp!(
    "SELECT ",
    EVENT_COLUMNS,
    ", payload, headers FROM events WHERE id = $1"
);

/// `$1` event id.
pub(crate) const EVENT_TURNS_SQL: &str =
    "SELECT id, status, reason, steps, started_at, finished_at, error
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

/// The status text `deliveries list --failed` selects.
pub(crate) const FAILED_STATUS: &str = super::states::DeliveryState::Failed.sql();

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

/// A stored payload as JSON, or as text when it is not JSON.
pub(crate) fn payload_value(payload: &[u8]) -> serde_json::Value {
    serde_json::from_slice(payload).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(payload).into_owned())
    })
}
