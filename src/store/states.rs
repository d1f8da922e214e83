//! The states of events, sessions, turns and deliveries, and why a turn is resumed.
//!
//! Each state is a type, and its text in the database is written in exactly one place: the
//! `sql` function of its enum, matched exhaustively. SQL statements of both backends use the
//! quoted constants below (built at compile time), never a literal of their own, so that a new
//! state is one edit that the compiler then follows everywhere. Text read back is parsed by the
//! same names (serde's, checked against `sql` by a test). docs/reference.md lists what each
//! state means.

use const_format::concatcp;
use serde::{Deserialize, Serialize};

/// The state whose database text is `text` (its serde name, which is its `sql` text).
fn parse<T: serde::de::DeserializeOwned>(text: &str) -> Option<T> {
    T::deserialize(serde::de::value::StrDeserializer::<serde::de::value::Error>::new(text)).ok()
}

/// An accepted event: waiting, running as a turn, or ended in one of the terminal statuses that
/// are delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum EventStatus {
    Queued,
    Running,
    /// Its turn waits for an operator's decision on a tool call.
    AwaitingApproval,
    /// It joined a queued event of its session (the route's `coalesce`): that event's turn
    /// handles it, and it ends with that turn.
    Joined,
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
            EventStatus::AwaitingApproval => "awaiting_approval",
            EventStatus::Joined => "joined",
            EventStatus::Completed => "completed",
            EventStatus::Failed => "failed",
            EventStatus::Abandoned => "abandoned",
            EventStatus::Suspended => "suspended",
        }
    }
}

/// Where an event came from. A replay keeps its original's origin (and records `replay_of`).
/// Accepted events are written with the column's default (`webhook`, set by the schema).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum EventOrigin {
    /// Accepted from a sender (the webhook listener, `agentgate send`).
    Webhook,
    /// Queued by agentgate itself: a background tool job's result, for its session.
    Background,
}

impl EventOrigin {
    pub(crate) const fn sql(self) -> &'static str {
        match self {
            EventOrigin::Webhook => "webhook",
            EventOrigin::Background => "background",
        }
    }
}

/// How an accepted event ends: each of these is delivered, exactly once per event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Terminal {
    Completed,
    Failed,
    /// Interrupted longer ago than `resume_window`.
    Abandoned,
    /// Its session needed more resumes than `resume_max_attempts`.
    Suspended,
}

impl Terminal {
    pub(crate) const fn event_status(self) -> EventStatus {
        match self {
            Terminal::Completed => EventStatus::Completed,
            Terminal::Failed => EventStatus::Failed,
            Terminal::Abandoned => EventStatus::Abandoned,
            Terminal::Suspended => EventStatus::Suspended,
        }
    }

    /// The state the event's session is left in.
    pub(crate) const fn session_state(self) -> SessionState {
        match self {
            Terminal::Completed | Terminal::Failed | Terminal::Abandoned => SessionState::Idle,
            Terminal::Suspended => SessionState::Suspended,
        }
    }

    /// Whether retention may delete an event that ended so, once its result is delivered. A
    /// suspended event is kept: its session's resume runs it again. `sql::PRUNABLE_EVENTS_SQL`
    /// lists these, which a test checks (a new status fails to compile here until it is placed).
    #[cfg(test)]
    pub(crate) const fn prunable(self) -> bool {
        match self {
            Terminal::Completed | Terminal::Failed | Terminal::Abandoned => true,
            Terminal::Suspended => false,
        }
    }
}

/// A session: whether a turn of it may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum SessionState {
    Idle,
    Running,
    ResumePending,
    Suspended,
    /// Its turn waits for an operator's decision; later events queue behind it.
    AwaitingApproval,
}

impl SessionState {
    /// Every state, in the order a list offers them (a test checks none is missing).
    pub(crate) const ALL: [SessionState; 5] = [
        SessionState::Idle,
        SessionState::Running,
        SessionState::ResumePending,
        SessionState::Suspended,
        SessionState::AwaitingApproval,
    ];

    pub(crate) const fn sql(self) -> &'static str {
        match self {
            SessionState::Idle => "idle",
            SessionState::Running => "running",
            SessionState::ResumePending => "resume_pending",
            SessionState::Suspended => "suspended",
            SessionState::AwaitingApproval => "awaiting_approval",
        }
    }
}

/// One run of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ResumeReason {
    /// The process died with the turn running.
    Crashed,
    /// The drain's `drain_timeout` ran out.
    ShutdownTimeout,
}

impl ResumeReason {
    #[cfg(test)]
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
        parse(text).unwrap_or(ResumeReason::Crashed)
    }
}

/// Why a claimed event runs again rather than for the first time (its `resume_reason` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Continuation {
    /// Its turn was interrupted (a crash, the drain) and is resumed.
    Resumed(ResumeReason),
    /// Its turn waited for an operator's decision, which is now taken: it continues.
    Decided,
}

impl Continuation {
    /// The `resume_reason` text of an event queued after a decision.
    pub(crate) const DECIDED_SQL: &'static str = "decided";

    /// Why the turn runs again, in words (its column's text).
    pub(crate) const fn label(self) -> &'static str {
        match self {
            Continuation::Resumed(reason) => reason.sql(),
            Continuation::Decided => Continuation::DECIDED_SQL,
        }
    }

    pub(crate) fn from_sql(text: &str) -> Continuation {
        if text == Continuation::DECIDED_SQL {
            Continuation::Decided
        } else {
            Continuation::Resumed(ResumeReason::from_sql(text))
        }
    }
}

/// Both backends read an event's status and a session's state straight into the type; text this
/// agentgate does not know is an error (the schema check refuses a newer database before it
/// gets here).
macro_rules! stored_as_text {
    ($state:ty, $what:literal) => {
        impl rusqlite::types::FromSql for $state {
            fn column_result(
                value: rusqlite::types::ValueRef<'_>,
            ) -> rusqlite::types::FromSqlResult<Self> {
                let text = value.as_str()?;
                parse(text)
                    .ok_or_else(|| rusqlite::types::FromSqlError::Other(unknown_state($what, text)))
            }
        }

        impl<'a> tokio_postgres::types::FromSql<'a> for $state {
            fn from_sql(
                ty: &tokio_postgres::types::Type,
                raw: &'a [u8],
            ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
                let text = <&str as tokio_postgres::types::FromSql>::from_sql(ty, raw)?;
                parse(text).ok_or_else(|| unknown_state($what, text))
            }

            fn accepts(ty: &tokio_postgres::types::Type) -> bool {
                <&str as tokio_postgres::types::FromSql>::accepts(ty)
            }
        }
    };
}

stored_as_text!(SessionState, "session state");
stored_as_text!(EventStatus, "event status");
stored_as_text!(TurnStatus, "turn status");
stored_as_text!(DeliveryState, "delivery status");
stored_as_text!(ApprovalStatus, "approval status");
stored_as_text!(EventOrigin, "event origin");

fn unknown_state(what: &str, text: &str) -> Box<dyn std::error::Error + Sync + Send> {
    format!("unknown {what} {text:?}").into()
}

/// A state is shown (CLI, logs, metric labels) by its stored name.
macro_rules! shown_as_text {
    ($($state:ty),*) => {$(
        impl std::fmt::Display for $state {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.sql())
            }
        }
    )*};
}

shown_as_text!(
    EventStatus,
    SessionState,
    TurnStatus,
    DeliveryState,
    ResumeReason,
    ApprovalStatus,
    EventOrigin
);

impl EventStatus {
    /// Every status, in the order a list offers them (a test checks none is missing).
    pub(crate) const ALL: [EventStatus; 8] = [
        EventStatus::Queued,
        EventStatus::Running,
        EventStatus::AwaitingApproval,
        EventStatus::Joined,
        EventStatus::Completed,
        EventStatus::Failed,
        EventStatus::Abandoned,
        EventStatus::Suspended,
    ];

    /// The status named `name` (as `events list --status` and `/v1/events?status=` take it).
    pub(crate) fn from_name(name: &str) -> Option<EventStatus> {
        parse(name)
    }
}

impl SessionState {
    /// The state named `name` (as `/v1/sessions?state=` takes it).
    pub(crate) fn from_name(name: &str) -> Option<SessionState> {
        parse(name)
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
    /// Paused on a tool call that waits for an operator's decision.
    AwaitingApproval,
}

impl StopReason {
    pub(crate) const fn sql(self) -> &'static str {
        match self {
            StopReason::Interrupted => "interrupted",
            StopReason::Cancelled => "cancelled",
            StopReason::IdleTimeout => "idle_timeout",
            StopReason::Resume(reason) => reason.sql(),
            StopReason::AwaitingApproval => "awaiting_approval",
        }
    }
}

/// A result in the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
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

/// Where an approval request stands: waiting, or decided one of three ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ApprovalStatus {
    Pending,
    /// The call runs, once, with the arguments shown.
    Approved,
    /// The call does not run; the model is told why.
    Denied,
    /// Nobody decided within `approval_timeout`: the call does not run.
    Expired,
}

impl ApprovalStatus {
    #[cfg(test)]
    const ALL: [ApprovalStatus; 4] = [
        ApprovalStatus::Pending,
        ApprovalStatus::Approved,
        ApprovalStatus::Denied,
        ApprovalStatus::Expired,
    ];

    pub(crate) const fn sql(self) -> &'static str {
        match self {
            ApprovalStatus::Pending => "pending",
            ApprovalStatus::Approved => "approved",
            ApprovalStatus::Denied => "denied",
            ApprovalStatus::Expired => "expired",
        }
    }
}

/// A node of a PostgreSQL scale-out, as `status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
pub(crate) const EVENT_AWAITING: &str = concatcp!("'", EventStatus::AwaitingApproval.sql(), "'");
pub(crate) const EVENT_JOINED: &str = concatcp!("'", EventStatus::Joined.sql(), "'");
pub(crate) const SESSION_AWAITING: &str = concatcp!("'", SessionState::AwaitingApproval.sql(), "'");
pub(crate) const DECIDED: &str = concatcp!("'", Continuation::DECIDED_SQL, "'");
pub(crate) const WEBHOOK: &str = concatcp!("'", EventOrigin::Webhook.sql(), "'");
pub(crate) const BACKGROUND: &str = concatcp!("'", EventOrigin::Background.sql(), "'");
pub(crate) const APPROVAL_PENDING: &str = concatcp!("'", ApprovalStatus::Pending.sql(), "'");

#[cfg(test)]
mod tests {
    use super::*;

    const TERMINALS: [Terminal; 4] = [
        Terminal::Completed,
        Terminal::Failed,
        Terminal::Abandoned,
        Terminal::Suspended,
    ];

    /// `ALL` lists every variant once, in place: a new one does not compile here until it is
    /// placed, and a place left out or taken twice fails.
    #[test]
    fn every_list_of_states_is_complete() {
        let event_place = |status: EventStatus| match status {
            EventStatus::Queued => 0,
            EventStatus::Running => 1,
            EventStatus::AwaitingApproval => 2,
            EventStatus::Joined => 3,
            EventStatus::Completed => 4,
            EventStatus::Failed => 5,
            EventStatus::Abandoned => 6,
            EventStatus::Suspended => 7,
        };
        let session_place = |state: SessionState| match state {
            SessionState::Idle => 0,
            SessionState::Running => 1,
            SessionState::ResumePending => 2,
            SessionState::Suspended => 3,
            SessionState::AwaitingApproval => 4,
        };
        for (place, status) in EventStatus::ALL.into_iter().enumerate() {
            assert_eq!(event_place(status), place);
        }
        for (place, state) in SessionState::ALL.into_iter().enumerate() {
            assert_eq!(session_place(state), place);
        }
    }

    #[test]
    fn every_state_reads_back_what_it_writes() {
        for state in SessionState::ALL {
            assert_eq!(parse::<SessionState>(state.sql()), Some(state));
        }
        for status in EventStatus::ALL {
            assert_eq!(parse::<EventStatus>(status.sql()), Some(status));
        }
        for status in ApprovalStatus::ALL {
            assert_eq!(parse::<ApprovalStatus>(status.sql()), Some(status));
        }
        for reason in ResumeReason::ALL {
            assert_eq!(ResumeReason::from_sql(reason.sql()), reason);
        }
        for origin in [EventOrigin::Webhook, EventOrigin::Background] {
            assert_eq!(parse::<EventOrigin>(origin.sql()), Some(origin));
        }
        assert_eq!(WEBHOOK, "'webhook'");
        assert_eq!(BACKGROUND, "'background'");
        assert_eq!(parse::<SessionState>("lost"), None);
        assert_eq!(QUEUED, "'queued'");
        assert_eq!(RESUME_PENDING, "'resume_pending'");
    }

    /// A terminal status is delivered under the name of the event status it leaves.
    #[test]
    fn terminal_statuses_are_event_statuses() {
        for terminal in TERMINALS {
            assert_eq!(
                serde_json::to_value(terminal).ok(),
                serde_json::to_value(terminal.event_status()).ok()
            );
        }
    }
}
