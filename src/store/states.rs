//! The states of events, sessions, turns and deliveries, and why a turn is resumed.
//!
//! Each state is a type, and its text in the database is written in exactly one place: the
//! `sql` function of its enum. SQL statements of both backends use the quoted constants below
//! (built at compile time), never a literal of their own, so that a new state is one edit that
//! the compiler then follows everywhere. docs/reference.md lists what each state means.

use const_format::concatcp;
use serde::Serialize;

/// Finds the state whose database text is `text`.
fn parse<T: Copy>(all: &[T], sql: fn(T) -> &'static str, text: &str) -> Option<T> {
    all.iter().copied().find(|state| sql(*state) == text)
}

/// An accepted event: waiting, running as a turn, or ended in one of the terminal statuses that
/// are delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum EventStatus {
    Queued,
    Running,
    Completed,
    Failed,
    Abandoned,
    Suspended,
}

impl EventStatus {
    pub(crate) const fn sql(self) -> &'static str {
        match self {
            EventStatus::Queued => "queued",
            EventStatus::Running => "running",
            EventStatus::Completed => "completed",
            EventStatus::Failed => "failed",
            EventStatus::Abandoned => "abandoned",
            EventStatus::Suspended => "suspended",
        }
    }
}

/// A session: whether a turn of it may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum SessionState {
    Idle,
    Running,
    ResumePending,
    Suspended,
}

impl SessionState {
    const ALL: [SessionState; 4] = [
        SessionState::Idle,
        SessionState::Running,
        SessionState::ResumePending,
        SessionState::Suspended,
    ];

    pub(crate) const fn sql(self) -> &'static str {
        match self {
            SessionState::Idle => "idle",
            SessionState::Running => "running",
            SessionState::ResumePending => "resume_pending",
            SessionState::Suspended => "suspended",
        }
    }

    pub(crate) fn from_sql(text: &str) -> Option<SessionState> {
        parse(&SessionState::ALL, SessionState::sql, text)
    }
}

/// One run of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TurnStatus {
    Running,
    Completed,
    Failed,
    /// Stopped before its end: by a newer event, its idle timeout, the drain or a crash.
    Interrupted,
}

impl TurnStatus {
    pub(crate) const fn sql(self) -> &'static str {
        match self {
            TurnStatus::Running => "running",
            TurnStatus::Completed => "completed",
            TurnStatus::Failed => "failed",
            TurnStatus::Interrupted => "interrupted",
        }
    }
}

/// Why a session waits to be resumed (and why its resumed event runs again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ResumeReason {
    /// The process died with the turn running.
    Crashed,
    /// The drain's `drain_timeout` ran out.
    ShutdownTimeout,
}

impl ResumeReason {
    const ALL: [ResumeReason; 2] = [ResumeReason::Crashed, ResumeReason::ShutdownTimeout];

    pub(crate) const fn sql(self) -> &'static str {
        match self {
            ResumeReason::Crashed => "crashed",
            ResumeReason::ShutdownTimeout => "shutdown_timeout",
        }
    }

    /// A reason the database holds; an unknown one (written by a newer agentgate) counts as a
    /// crash, the reason that assumes least.
    pub(crate) fn from_sql(text: &str) -> ResumeReason {
        parse(&ResumeReason::ALL, ResumeReason::sql, text).unwrap_or(ResumeReason::Crashed)
    }
}

/// Both backends read a session's state straight into the type; text this agentgate does not know
/// is an error (the schema check refuses a newer database before it gets here).
impl rusqlite::types::FromSql for SessionState {
    fn column_result(value: rusqlite::types::ValueRef<'_>) -> rusqlite::types::FromSqlResult<Self> {
        let text = value.as_str()?;
        SessionState::from_sql(text)
            .ok_or_else(|| rusqlite::types::FromSqlError::Other(unknown_state(text)))
    }
}

impl<'a> tokio_postgres::types::FromSql<'a> for SessionState {
    fn from_sql(
        ty: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let text = <&str as tokio_postgres::types::FromSql>::from_sql(ty, raw)?;
        SessionState::from_sql(text).ok_or_else(|| unknown_state(text))
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        <&str as tokio_postgres::types::FromSql>::accepts(ty)
    }
}

fn unknown_state(text: &str) -> Box<dyn std::error::Error + Sync + Send> {
    format!("unknown session state {text:?}").into()
}

impl std::fmt::Display for SessionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.sql())
    }
}

impl std::fmt::Display for ResumeReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.sql())
    }
}

/// Why a turn stopped before its state machine ended it, as recorded on the turn row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopReason {
    /// A newer event of the session interrupted it (`on_busy = "interrupt"`).
    Interrupted,
    /// The operator cancelled it (`sessions cancel`).
    Cancelled,
    /// No progress for `turn_idle_timeout`.
    IdleTimeout,
    /// Left for a resume.
    Resume(ResumeReason),
}

impl StopReason {
    pub(crate) const fn sql(self) -> &'static str {
        match self {
            StopReason::Interrupted => "interrupted",
            StopReason::Cancelled => "cancelled",
            StopReason::IdleTimeout => "idle_timeout",
            StopReason::Resume(reason) => reason.sql(),
        }
    }
}

/// A result in the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeliveryState {
    Pending,
    Delivered,
    /// Every attempt failed; kept for the operator.
    Failed,
}

impl DeliveryState {
    pub(crate) const fn sql(self) -> &'static str {
        match self {
            DeliveryState::Pending => "pending",
            DeliveryState::Delivered => "delivered",
            DeliveryState::Failed => "failed",
        }
    }
}

/// A node of a PostgreSQL scale-out, as `status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum NodeState {
    Running,
    /// Drained and released its leases.
    Stopped,
    /// Stopped renewing its heartbeat; its leases expire and other nodes take its work over.
    Lost,
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NodeState::Running => "running",
            NodeState::Stopped => "stopped",
            NodeState::Lost => "lost",
        })
    }
}

/// The session reason recorded when an operator suspends a session.
pub(crate) const OPERATOR_REASON: &str = "operator";

// Quoted SQL literals for the statements of both backends.
pub(crate) const QUEUED: &str = concatcp!("'", EventStatus::Queued.sql(), "'");
pub(crate) const EVENT_RUNNING: &str = concatcp!("'", EventStatus::Running.sql(), "'");
pub(crate) const IDLE: &str = concatcp!("'", SessionState::Idle.sql(), "'");
pub(crate) const SESSION_RUNNING: &str = concatcp!("'", SessionState::Running.sql(), "'");
pub(crate) const RESUME_PENDING: &str = concatcp!("'", SessionState::ResumePending.sql(), "'");
pub(crate) const SUSPENDED: &str = concatcp!("'", SessionState::Suspended.sql(), "'");
pub(crate) const TURN_RUNNING: &str = concatcp!("'", TurnStatus::Running.sql(), "'");
pub(crate) const TURN_INTERRUPTED: &str = concatcp!("'", TurnStatus::Interrupted.sql(), "'");
pub(crate) const EVENT_SUSPENDED: &str = concatcp!("'", EventStatus::Suspended.sql(), "'");
pub(crate) const CRASHED: &str = concatcp!("'", ResumeReason::Crashed.sql(), "'");
pub(crate) const SHUTDOWN_TIMEOUT: &str = concatcp!("'", ResumeReason::ShutdownTimeout.sql(), "'");
pub(crate) const OPERATOR: &str = concatcp!("'", OPERATOR_REASON, "'");
pub(crate) const PENDING: &str = concatcp!("'", DeliveryState::Pending.sql(), "'");
pub(crate) const DELIVERY_FAILED: &str = concatcp!("'", DeliveryState::Failed.sql(), "'");
pub(crate) const DELIVERED: &str = concatcp!("'", DeliveryState::Delivered.sql(), "'");
pub(crate) const EVENT_COMPLETED: &str = concatcp!("'", EventStatus::Completed.sql(), "'");
pub(crate) const EVENT_FAILED: &str = concatcp!("'", EventStatus::Failed.sql(), "'");
pub(crate) const EVENT_ABANDONED: &str = concatcp!("'", EventStatus::Abandoned.sql(), "'");

/// The counts of [`LiveCounts`], in SQL that both backends run as it is.
pub(crate) const LIVE_COUNTS_SQL: &str = concatcp!(
    "SELECT (SELECT count(*) FROM events WHERE status = ",
    QUEUED,
    "), (SELECT count(*) FROM sessions WHERE state = ",
    RESUME_PENDING,
    "), (SELECT count(*) FROM sessions WHERE state = ",
    SUSPENDED,
    ")"
);

/// `sessions resume`: the event a session was interrupted or suspended on, which runs again as a
/// resume (its turn's reason says why it stopped); both backends run it as it is.
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

/// `sessions resume`: the session may run again, but a turn of it that still runs keeps it busy,
/// so that no second turn ever starts beside it.
pub(crate) const RESUME_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = CASE WHEN EXISTS
         (SELECT 1 FROM turns WHERE session_key = $1 AND status = ",
    TURN_RUNNING,
    ") THEN ",
    SESSION_RUNNING,
    " ELSE ",
    IDLE,
    " END, reason = NULL, updated_at = $2 WHERE key = $1"
);

/// A session row as `sessions list` shows it; both backends run it as it is.
pub(crate) const SESSION_SQL: &str = concatcp!(
    "
    SELECT s.key, s.route, s.state, s.reason, s.last_turn_id,
           (SELECT t.status FROM turns t WHERE t.id = s.last_turn_id),
           (SELECT count(*) FROM turns t WHERE t.session_key = s.key),
           (SELECT count(*) FROM events e WHERE e.session_key = s.key AND e.status = ",
    QUEUED,
    "),
           s.updated_at
    FROM sessions s"
);

/// A page of sessions in key order: `$1` the last key of the page before (or NULL), `$2` limit.
pub(crate) const SESSIONS_PAGE_SQL: &str = concatcp!(
    SESSION_SQL,
    " WHERE (CAST($1 AS TEXT) IS NULL OR s.key > $1) ORDER BY s.key LIMIT $2"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_reads_back_what_it_writes() {
        for state in SessionState::ALL {
            assert_eq!(SessionState::from_sql(state.sql()), Some(state));
        }
        for reason in ResumeReason::ALL {
            assert_eq!(ResumeReason::from_sql(reason.sql()), reason);
        }
        assert_eq!(SessionState::from_sql("lost"), None);
        assert_eq!(QUEUED, "'queued'");
        assert_eq!(RESUME_PENDING, "'resume_pending'");
    }
}
