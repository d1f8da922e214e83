//! Backend-neutral data: what the rest of agentgate hands to durable state and gets back from
//! it, the same whichever backend keeps it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::StoreError;
use super::rewind::{RewindFrom, RewindOf};
use super::states::{
    Continuation, DeliveryState, EventOrigin, EventStatus, NodeState, ResumeReason, SessionState,
    StopReason, Terminal, TurnStatus,
};
use crate::usage::{Counted, Price, Spending, Spent, Usage, UsageReport, UsageToday};

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
    /// The W3C `traceparent` of the request's span when traces are on: every later span of the
    /// event (turns, deliveries) is in its trace, in this process or the next.
    pub trace_parent: Option<String>,
}

/// An event about to be made durable.
#[derive(Debug, Clone)]
pub(crate) struct NewEvent {
    pub event: Event,
    /// How long a delivery id seen before makes this one a duplicate.
    pub dedup_window: DedupWindow,
}

/// `[runtime] dedup_window`: a delivery id seen on a route within it makes a later delivery of
/// that id a duplicate; older ones are forgotten (docs/reference.md, "Event types and dedup
/// keys").
#[derive(Debug, Clone, Copy)]
pub(crate) struct DedupWindow(pub std::time::Duration);

impl DedupWindow {
    /// The window's start (unix ms) as of `now`: ids seen at or after it count.
    pub(crate) fn start(self, now: i64) -> i64 {
        now.saturating_sub(i64::try_from(self.0.as_millis()).unwrap_or(i64::MAX))
    }
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
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct StatusSummary {
    pub events: EventCounts,
    pub sessions: SessionCounts,
    pub deliveries: DeliveryCounts,
    /// With the PostgreSQL backend: the nodes sharing the database, and their leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Vec<NodeRow>>,
    /// What model replies spent today (UTC), without cost (the store knows no price).
    pub usage: UsageToday,
    /// Tool calls waiting for an operator's decision.
    #[serde(default)]
    pub approvals: ApprovalCounts,
}

/// Approval requests, for `status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct ApprovalCounts {
    pub pending: i64,
}

impl StatusSummary {
    /// The summary out of its counts and what today spent.
    pub(crate) fn from_counts(
        by_status: BTreeMap<EventStatus, i64>,
        by_state: BTreeMap<SessionState, i64>,
        deliveries: DeliveryCounts,
        nodes: Option<Vec<NodeRow>>,
        today: Spent,
        approvals: ApprovalCounts,
    ) -> StatusSummary {
        StatusSummary {
            events: EventCounts {
                total: by_status.values().sum(),
                by_status,
            },
            sessions: SessionCounts {
                total: by_state.values().sum(),
                by_state,
            },
            deliveries,
            nodes,
            usage: UsageToday {
                today: UsageReport::of(today, None),
            },
            approvals,
        }
    }
}

/// Accepted webhooks (duplicates and internal events excluded), by status.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct EventCounts {
    pub total: i64,
    #[serde(default)]
    pub by_status: BTreeMap<EventStatus, i64>,
}

/// Sessions by state.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct SessionCounts {
    pub total: i64,
    #[serde(default)]
    pub by_state: BTreeMap<SessionState, i64>,
}

/// A node of a PostgreSQL-backed cluster, as `status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
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

/// The few counts the daemon reports to systemd every few seconds. Each is an index range
/// count, so they stay cheap however many events are stored (unlike [`StatusSummary`]).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LiveCounts {
    pub queued: i64,
    pub resume_pending: i64,
    pub suspended: i64,
    /// Tool calls waiting for an operator's decision.
    pub approvals_pending: i64,
}

#[derive(Debug, Clone)]
pub(crate) struct PendingDelivery {
    pub event_id: String,
    pub route: String,
    pub session_key: String,
    pub body: String,
    pub attempts: u32,
    /// The event's `traceparent`: the attempt's span is in its trace.
    pub trace_parent: Option<String>,
}

/// Pending and permanently failed deliveries, for `status`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
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
    /// Set when this run continues an earlier one: resumes an interrupted run, or goes on
    /// after an operator's decision.
    pub continues: Option<Continuation>,
    /// Queued by agentgate itself (a background job's result), not by a sender.
    pub internal: bool,
    /// Runs with no other turn beside it on this node (a resume after a crash), so that a crash
    /// during it is pinned on it and cuts off nothing else.
    pub alone: bool,
    /// Queued by `sessions rewind` or `sessions fork`: where its turn starts.
    pub rewound: Option<RewindFrom>,
}

/// Which queued events a claim takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Up to this many events that may run beside others, the longest waiting first.
    Beside(usize),
    /// As [`Claim::Beside`], with routes' `priority` counted: each step of it counts as
    /// [`PRIORITY_STEP_MS`] of waiting (docs/reference.md, "Priority"). `priorities` is a JSON
    /// object of route name to priority, naming the routes whose priority is not 0.
    BesideByPriority {
        limit: usize,
        priorities: std::sync::Arc<str>,
    },
    /// The oldest event that must run alone, if its session is idle.
    Alone,
}

/// The waiting one step of a route's `priority` is worth: an event of priority 10 goes before
/// any of priority 0 that waited less than 10 minutes longer, and after those that waited more,
/// so a busy high-priority route never starves the others.
pub(crate) const PRIORITY_STEP_MS: i64 = 60_000;

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
    /// How many turns the crash that cut this one off cut off in all, itself included (on
    /// PostgreSQL: of the node that died). 1 for a drain's interruption, and for turns marked
    /// before this was recorded.
    pub crashed_with: u32,
}

impl InterruptedSession {
    /// Whether this interruption can be pinned on the session and so counts toward
    /// `resume_max_attempts`: a drain's always; a crash only when the turn ran alone, since a
    /// crash that cut off several turns may have been caused by any of them
    /// (docs/reference.md, "Crash loops and bystanders").
    pub(crate) fn is_pinned(&self) -> bool {
        match self.reason {
            ResumeReason::ShutdownTimeout => true,
            ResumeReason::Crashed => self.crashed_with <= 1,
        }
    }

    /// Whether the session may have crashed the process: its resume runs alone, so that a
    /// crash during it cuts off nothing else and is pinned on it (docs/reference.md, "Crash
    /// loops and bystanders"). A drain's interruption is no such sign.
    pub(crate) fn is_suspect(&self) -> bool {
        match self.reason {
            ResumeReason::ShutdownTimeout => false,
            ResumeReason::Crashed => true,
        }
    }

    fn ended(&self, terminal: Terminal, error: String) -> TurnEnd {
        TurnEnd {
            turn_id: self.turn_id.clone(),
            event_id: self.event_id.clone(),
            session_key: self.session_key.clone(),
            route: self.route.clone(),
            turn_status: TurnStatus::Interrupted,
            terminal,
            reason: Some(StopReason::Resume(self.reason)),
            output: None,
            error: Some(error),
            steps: self.steps,
            rewind_of: None,
        }
    }

    /// The end of a session interrupted longer ago than `resume_window`.
    pub(crate) fn abandoned(&self) -> TurnEnd {
        let error = format!(
            "the turn was interrupted ({}) longer ago than resume_window; it is not resumed",
            self.reason
        );
        self.ended(Terminal::Abandoned, error)
    }

    /// The end of a session that needed more than `max_attempts` resumes.
    pub(crate) fn suspended(&self, max_attempts: u32) -> TurnEnd {
        let error = format!(
            "suspended after {max_attempts} resume(s): the session was interrupted ({}) every time",
            self.reason
        );
        self.ended(Terminal::Suspended, error)
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
    /// How the event ends.
    pub terminal: Terminal,
    pub reason: Option<StopReason>,
    pub output: Option<String>,
    pub error: Option<String>,
    pub steps: u32,
    /// What the event reruns, when a rewind or fork queued it (the store fills it in as it ends
    /// the event).
    pub rewind_of: Option<RewindOf>,
}

impl TurnEnd {
    /// The same end, of an event that reruns `rewind_of`.
    pub(crate) fn rewinding(&self, rewind_of: Option<RewindOf>) -> TurnEnd {
        TurnEnd {
            rewind_of,
            ..self.clone()
        }
    }

    /// The same end, for an event that joined this turn's event (`coalesce`): its delivery says
    /// which turn handled it.
    pub(crate) fn for_joined(&self, event_id: &str) -> TurnEnd {
        TurnEnd {
            event_id: event_id.to_string(),
            ..self.clone()
        }
    }
}

/// Renders the body of a turn's outbound delivery: `deliver::body::renderer`, which the callers
/// that end turns hand to the store (the wire format belongs to deliver, and the store must not
/// import it). The store calls it inside the transaction that ends the turn, with what all the
/// event's turns spent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RenderDelivery {
    pub render: fn(&TurnEnd, &UsageReport) -> serde_json::Result<String>,
    /// The price usage is shown at (`[model] price`).
    pub price: Option<Price>,
}

impl RenderDelivery {
    pub(crate) fn body(&self, end: &TurnEnd, spent: Spent) -> Result<String, StoreError> {
        let usage = UsageReport::of(spent, self.price.as_ref());
        (self.render)(end, &usage).map_err(|err| StoreError::Render(err.to_string()))
    }
}

/// What a model request of a running turn may spend, reserved against its budgets before it is
/// sent (docs/reference.md, "Budgets"): held until the reply's usage is committed with its step
/// (or the turn ends, or the request fails and it is released), so that requests in flight at
/// once, on any node, are counted by each other's budget checks.
#[derive(Debug, Clone)]
pub(crate) struct Reservation {
    /// A turn makes one request at a time: its reservation replaces its earlier one.
    pub turn_id: String,
    pub event_id: String,
    pub session_key: String,
    pub route: String,
    /// The first millisecond of the UTC day that the daily budgets count.
    pub day_start: i64,
    /// At most what the request may spend: its prompt's tokens and its reply's.
    pub tokens: Usage,
    /// The parts of the spending the turn's budgets count (only those are read).
    pub counted: Counted,
}

/// What a reservation found, in the windows its budgets count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Reserving {
    /// What the committed steps spent.
    pub spent: Spending,
    /// What other requests in flight hold.
    pub held: Spending,
    /// Whether the request's reservation was made.
    pub reserved: bool,
}

/// Whether a request may be reserved, given what is spent and held in its windows together.
pub(crate) type Fits = std::sync::Arc<dyn Fn(&Spending) -> bool + Send + Sync>;

/// One transcript row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TranscriptRow {
    pub seq: i64,
    /// The entry's number in its session, from 1 in commit order (its `seq`): what `sessions
    /// rewind --to` and `sessions fork --at` name.
    #[serde(default)]
    pub n: i64,
    /// The turn of the rewind that superseded it: the turns after it do not see it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded_by: Option<String>,
    pub turn_id: String,
    pub kind: String,
    pub body: serde_json::Value,
    pub created_at: i64,
    /// For an `event` entry, the stored event it refers to: its message is rendered from this.
    #[serde(skip)]
    pub event: Option<Event>,
}

/// The latest entries of a session's transcript (the console's session page).
#[derive(Debug, Clone, Default)]
pub(crate) struct TranscriptTail {
    /// Oldest first.
    pub rows: Vec<TranscriptRow>,
    /// Whether the session has entries before these.
    pub earlier: bool,
}

impl TranscriptTail {
    /// The tail of `limit` entries from up to `limit + 1` read newest first.
    pub(crate) fn of(mut newest_first: Vec<TranscriptRow>, limit: i64) -> TranscriptTail {
        let earlier = newest_first.len() > usize::try_from(limit).unwrap_or(0);
        if earlier {
            newest_first.pop();
        }
        newest_first.reverse();
        TranscriptTail {
            rows: newest_first,
            earlier,
        }
    }
}

/// The transcript entry kind that refers to its turn's event (see `session::turn::Entry`).
pub(crate) const EVENT_ENTRY: &str = "event";

/// A session as `sessions list` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SessionRow {
    pub key: String,
    pub route: String,
    pub state: SessionState,
    pub reason: Option<String>,
    pub last_turn_id: Option<String>,
    pub last_turn_status: Option<TurnStatus>,
    pub turns: i64,
    pub queued: i64,
    pub updated_at: i64,
    /// What all its turns spent: only for one session (`sessions show`), not in lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageReport>,
    /// The same with the estimate of replies without usage, as its budgets count it.
    #[serde(skip)]
    pub spent: Option<Spent>,
}

/// `events list` filters; `None` matches everything.
#[derive(Debug, Clone, Default)]
pub(crate) struct EventFilter {
    pub status: Option<EventStatus>,
    pub route: Option<String>,
    pub session: Option<String>,
    pub limit: i64,
    /// Only events older than this one (a page's cursor: the last event of the page before).
    pub before: Option<String>,
    /// Received at or after this time (unix ms).
    pub since: Option<i64>,
    /// Received at or before this time (unix ms).
    pub until: Option<i64>,
    /// The sender's delivery id (the dedup key).
    pub delivery_id: Option<String>,
}

/// Which sessions a page of `GET /v1/sessions` and the console's list holds: each set field must
/// match.
#[derive(Debug, Clone, Default)]
pub(crate) struct SessionFilter {
    /// Only keys after this one (a page's cursor: the last key of the page before).
    pub after: Option<String>,
    pub state: Option<SessionState>,
    pub route: Option<String>,
    /// Text the key holds, whatever its case.
    pub key_contains: Option<String>,
    pub limit: i64,
}

impl SessionFilter {
    /// `key_contains` as the `LIKE` pattern `SESSIONS_PAGE_SQL` takes: lower case, with `%`,
    /// `_` and the escape `\` itself escaped, so the text matches only as written.
    pub(crate) fn key_pattern(&self) -> Option<String> {
        self.key_contains.as_deref().map(|text| {
            let mut pattern = String::from("%");
            for c in text.to_lowercase().chars() {
                if matches!(c, '%' | '_' | '\\') {
                    pattern.push('\\');
                }
                pattern.push(c);
            }
            pattern.push('%');
            pattern
        })
    }
}

/// An accepted (or internal) event as the operator sees it, without its payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct EventRow {
    pub id: String,
    pub route: String,
    pub session: String,
    pub event_type: String,
    pub status: EventStatus,
    pub delivery_id: Option<String>,
    /// Unix milliseconds.
    pub received_at: i64,
    pub origin: EventOrigin,
    /// The event this one is a replay of (`events replay`).
    pub replay_of: Option<String>,
    /// The session and entry it reruns, when `sessions rewind` or `sessions fork` queued it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewind_of: Option<RewindOf>,
}

/// `events show`: the event, what it carried, and what became of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct EventDetail {
    #[serde(flatten)]
    pub event: EventRow,
    /// The payload as stored: JSON when it parses, else its text.
    pub payload: serde_json::Value,
    /// The headers as stored (lower-case names, credentials removed).
    pub headers: serde_json::Value,
    pub turns: Vec<TurnRow>,
    pub delivery: Option<DeliveryRow>,
    /// The copies `events replay` made of this event, oldest first.
    pub replayed_as: Vec<String>,
    /// What all its turns spent.
    pub usage: UsageReport,
    /// The trace its spans are in, when traces were on as it arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

/// One turn of an event.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TurnRow {
    pub id: String,
    pub status: TurnStatus,
    pub reason: Option<String>,
    pub steps: i64,
    pub started_at: i64,
    pub finished_at: Option<i64>,
    pub error: Option<String>,
    /// What the turn's model replies spent.
    pub usage: UsageReport,
}

/// One outbox row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DeliveryRow {
    pub event_id: String,
    pub route: String,
    pub session: String,
    pub status: DeliveryState,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub last_error: Option<String>,
    pub updated_at: i64,
}

/// Which deliveries `deliveries retry` sends again.
#[derive(Debug, Clone)]
pub(crate) enum RetryTarget {
    /// This failed one, with a fresh attempt budget.
    One(String),
    /// Every failed one, each with a fresh attempt budget.
    AllFailed,
    /// The pending ones (of one route, or all), now instead of at their backoff's end; they keep
    /// their attempt counts.
    Pending { route: Option<String> },
}

/// A stored payload as JSON, or as text when it is not JSON.
pub(crate) fn payload_value(payload: &[u8]) -> serde_json::Value {
    serde_json::from_slice(payload).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(payload).into_owned())
    })
}
