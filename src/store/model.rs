//! Backend-neutral data: what the rest of agentgate hands to durable state and gets back from
//! it, the same whichever backend keeps it.

use std::collections::BTreeMap;

use serde::Serialize;

use super::states::{
    DeliveryState, EventStatus, NodeState, ResumeReason, SessionState, StopReason, TurnStatus,
};

/// An event as the listener verified it. The same record is made durable, claimed for a turn,
/// and read back when a later turn's transcript refers to it.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub id: String,
    pub route: String,
    pub session_key: String,
    pub event_type: String,
    pub delivery_id: Option<String>,
    /// JSON object of the request headers (lower-case names, credentials removed).
    pub headers: String,
    pub payload: Vec<u8>,
}

/// An event about to be made durable.
#[derive(Debug, Clone)]
pub(crate) struct NewEvent {
    pub event: Event,
    /// Delivery ids seen at or after this time (unix ms) count as duplicates.
    pub dedup_since: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AcceptOutcome {
    Accepted,
    /// The delivery id was seen within the dedup window; this is the original event id.
    Duplicate {
        original: String,
    },
}

/// Counts for `agentgate status`.
#[derive(Debug, Default, Serialize)]
pub(crate) struct StatusSummary {
    pub events: Counts,
    pub sessions: Counts,
    pub deliveries: super::DeliveryCounts,
    /// With the PostgreSQL backend: the nodes sharing the database, and their leases.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Vec<NodeRow>>,
}

/// A node of a PostgreSQL-backed cluster, as `status` shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct NodeRow {
    pub name: String,
    /// This run of the node (a restart is a new one): the owner named in leases.
    pub id: String,
    pub pid: i64,
    pub started_at: i64,
    pub heartbeat_at: i64,
    pub state: NodeState,
    /// Sessions whose turn this node runs now.
    pub leases: Vec<String>,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct Counts {
    pub total: i64,
    #[serde(rename = "by_status", skip_serializing_if = "BTreeMap::is_empty")]
    pub by_status: BTreeMap<String, i64>,
    #[serde(rename = "by_state", skip_serializing_if = "BTreeMap::is_empty")]
    pub by_state: BTreeMap<String, i64>,
}

/// The few counts the daemon reports to systemd every few seconds. Each is an index range
/// count, so they stay cheap however many events are stored (unlike [`StatusSummary`]).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LiveCounts {
    pub queued: i64,
    pub resume_pending: i64,
    pub suspended: i64,
}

#[derive(Debug, Clone)]
pub(crate) struct PendingDelivery {
    pub event_id: String,
    pub route: String,
    pub session_key: String,
    pub body: String,
    pub attempts: u32,
}

/// Pending and permanently failed deliveries, for `status`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(crate) struct DeliveryCounts {
    pub pending: i64,
    pub failed: i64,
}

#[derive(Debug, Clone)]
pub(crate) enum DeliveryAttempt {
    Delivered,
    Retry { at: i64, error: String },
    GaveUp { error: String },
}

impl DeliveryAttempt {
    /// The row's new status, next attempt time and last error.
    pub(super) fn columns(&self, now: i64) -> (DeliveryState, i64, Option<&str>) {
        match self {
            DeliveryAttempt::Delivered => (DeliveryState::Delivered, now, None),
            DeliveryAttempt::Retry { at, error } => (DeliveryState::Pending, *at, Some(error)),
            DeliveryAttempt::GaveUp { error } => (DeliveryState::Failed, now, Some(error)),
        }
    }
}

/// An event claimed for a new turn.
#[derive(Debug, Clone)]
pub(crate) struct ClaimedTurn {
    pub turn_id: String,
    pub event: Event,
    /// Set when this run resumes an interrupted one.
    pub resume_reason: Option<ResumeReason>,
    /// Queued by agentgate itself (a background job's result), not by a sender.
    pub internal: bool,
}

/// A session left `resume_pending` by a drain or a crash.
#[derive(Debug, Clone)]
pub(crate) struct InterruptedSession {
    pub session_key: String,
    pub route: String,
    pub reason: ResumeReason,
    pub turn_id: String,
    pub event_id: String,
    pub steps: u32,
    /// When the interrupted turn started (unix ms).
    pub started_at: i64,
}

impl InterruptedSession {
    fn ended(&self, event_status: EventStatus, error: String) -> TurnEnd {
        TurnEnd {
            turn_id: self.turn_id.clone(),
            event_id: self.event_id.clone(),
            session_key: self.session_key.clone(),
            route: self.route.clone(),
            turn_status: TurnStatus::Interrupted,
            event_status,
            reason: Some(StopReason::Resume(self.reason)),
            output: None,
            error: Some(error),
            steps: self.steps,
        }
    }

    /// The end of a session interrupted longer ago than `resume_window`.
    pub(crate) fn abandoned(&self) -> TurnEnd {
        let error = format!(
            "the turn was interrupted ({}) longer ago than resume_window; it is not resumed",
            self.reason
        );
        self.ended(EventStatus::Abandoned, error)
    }

    /// The end of a session that needed more than `max_attempts` resumes.
    pub(crate) fn suspended(&self, max_attempts: u32) -> TurnEnd {
        let error = format!(
            "suspended after {max_attempts} resume(s): the session was interrupted ({}) every time",
            self.reason
        );
        self.ended(EventStatus::Suspended, error)
    }
}

/// How a turn ended, for its rows.
#[derive(Debug, Clone)]
pub(crate) struct TurnEnd {
    pub turn_id: String,
    pub event_id: String,
    pub session_key: String,
    pub route: String,
    pub turn_status: TurnStatus,
    /// The event's terminal status: `completed`, `failed`, `abandoned` or `suspended`.
    pub event_status: EventStatus,
    pub reason: Option<StopReason>,
    pub output: Option<String>,
    pub error: Option<String>,
    pub steps: u32,
}

impl TurnEnd {
    /// The state the session is left in.
    pub(crate) fn session_state(&self) -> SessionState {
        if self.event_status == EventStatus::Suspended {
            SessionState::Suspended
        } else {
            SessionState::Idle
        }
    }
}

/// Renders the body of a turn's outbound delivery: `deliver::body::render`, which the callers
/// that end turns hand to the store (the wire format belongs to deliver, and the store must not
/// import it). The store calls it inside the transaction that ends the turn.
pub(crate) type RenderDelivery = fn(&TurnEnd) -> serde_json::Result<String>;

/// One transcript row.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TranscriptRow {
    pub seq: i64,
    pub turn_id: String,
    pub kind: String,
    pub body: serde_json::Value,
    pub created_at: i64,
    /// For an `event` entry, the stored event it refers to: its message is rendered from this.
    #[serde(skip)]
    pub event: Option<Event>,
}

/// The transcript entry kind that refers to its turn's event (see `session::turn::Entry`).
pub(crate) const EVENT_ENTRY: &str = "event";

/// A session's transcript, oldest first: each row, then (for an `event` entry) the event it
/// refers to, joined through the turn. Both backends run it, with their own placeholders for the
/// session key and for `EVENT_ENTRY`.
pub(super) fn transcript_query(session_key: &str, event_entry: &str) -> String {
    format!(
        "SELECT t.seq, t.turn_id, t.kind, t.body, t.created_at,
                e.id, e.route, e.session_key, e.event_type, e.delivery_id, e.headers, e.payload
         FROM transcript t
         LEFT JOIN turns u ON t.kind = {event_entry} AND u.id = t.turn_id
         LEFT JOIN events e ON e.id = u.event_id
         WHERE t.session_key = {session_key} ORDER BY t.seq"
    )
}

impl TranscriptRow {
    /// A stored entry; its body is JSON as written (kept as text if it is not).
    pub(super) fn new(
        seq: i64,
        turn_id: String,
        kind: String,
        body: String,
        created_at: i64,
        event: Option<Event>,
    ) -> Self {
        TranscriptRow {
            seq,
            turn_id,
            kind,
            body: serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)),
            created_at,
            event,
        }
    }
}

/// A session as `sessions list` shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SessionRow {
    pub key: String,
    pub route: String,
    pub state: SessionState,
    pub reason: Option<String>,
    pub last_turn_id: Option<String>,
    pub last_turn_status: Option<String>,
    pub turns: i64,
    pub queued: i64,
    pub updated_at: i64,
}
