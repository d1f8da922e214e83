//! Durable state, behind one contract with two backends.
//!
//! Only this module touches state files or the database server. [`Backend`] is what the rest of
//! agentgate may ask of durable state; [`Store`] dispatches it to the backend the config names:
//! - SQLite (the default): one node, `state_dir/agentgate.db`, group commit through one writer
//!   thread, and the file ledger (`ledger.json` under an fs4 lock, replaced by atomic renames);
//! - PostgreSQL: any number of nodes share one database. Sessions and deliveries are owned by
//!   leases, the retry ledger is a table counted in the transaction that claims the resume, and a
//!   node that stops renewing its leases has its turns resumed elsewhere as `crashed`.
//!
//! Either way a write's future resolves only after its transaction committed, which is what lets
//! the listener answer 202 only for durable events.

mod admission;
pub(crate) mod approval;
mod atomic;
mod commits;
#[cfg(test)]
mod contract;
pub(crate) mod ledger;
mod lock;
mod model;
mod postgres;
mod reports;
mod rewind;
mod row;
mod sql;
mod sqlite;
mod state_dir;
pub(crate) mod states;
mod turns;
mod tx;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use crate::config::StoreSettings;
use crate::usage::{Spent, UsageDay};
pub(crate) use states::{
    ApprovalStatus, Continuation, DeliveryState, EventStatus, NodeState, ResumeReason,
    SessionState, StopReason, Terminal, TurnStatus,
};

pub(crate) use approval::{ApprovalRow, Decided, Decision, NewApproval};
pub(crate) use atomic::is_stale_temp;
pub(crate) use commits::Commits;
pub(crate) use ledger::Ledger;
pub(crate) use lock::{DaemonLock, LockError};
pub(crate) use model::{
    AcceptOutcome, ApprovalCounts, Claim, ClaimedTurn, DedupWindow, DeliveryAttempt,
    DeliveryCounts, DeliveryRow, EVENT_ENTRY, Event, EventCounts, EventDetail, EventFilter,
    EventRow, Fits, InterruptedSession, LiveCounts, NewEvent, NodeRow, PendingDelivery,
    RenderDelivery, Reservation, Reserving, RetryTarget, SessionCounts, SessionFilter, SessionRow,
    StatusSummary, TranscriptRow, TranscriptTail, TurnEnd, TurnRow,
};
pub(crate) use rewind::{RewindFrom, RewindOf, RewindRefusal, RewindRequest, Rewound, rerun_start};
pub(crate) use sqlite::{backup, check_database, session_keys};

pub(crate) use state_dir::{LEDGER_FILE, StateDir};

#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    #[error("state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("database {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("database {path}: {source}")]
    Migration {
        path: PathBuf,
        source: sqlite::MigrationError,
    },
    /// A write was refused by what is under the store (a full disk, failing fsync): the same
    /// write may work later.
    #[error("state cannot be written durably: {0}")]
    Unavailable(String),
    /// A part of the store is gone (its writer thread, a blocking task): nothing will work
    /// until a restart.
    #[error("the store stopped working: {0} ended")]
    Stopped(String),
    #[error("database query failed: {0}")]
    Query(#[from] rusqlite::Error),
    #[error("retry ledger: {0}")]
    Ledger(String),
    /// The database server failed a request or could not be reached: the same request may work
    /// later.
    #[error("PostgreSQL: {0}")]
    ServerUnavailable(String),
    /// The store cannot be used as configured (bad URL or CA file, a schema newer than this
    /// agentgate): retrying will not help.
    #[error("PostgreSQL store: {0}")]
    Setup(String),
    /// Another node took the session over (this node's lease expired): the turn must stop.
    #[error("session {session_key}: the lease is held by another node now")]
    LeaseLost { session_key: String },
    /// A stored row does not read back as this agentgate expects (see `row.rs`).
    #[error("stored row: column {column}: {reason}")]
    Decode {
        column: &'static str,
        reason: String,
    },
    /// The body of a delivery could not be rendered.
    #[error("delivery body: {0}")]
    Render(String),
}

/// What a [`StoreError`] means for whoever met it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// The store cannot work as configured: retrying will not help (exit 78).
    Config,
    /// The database server could not be reached or did not answer: the same request may work
    /// later, so it is waited for (at start) or answered 503/69, never taken as broken state.
    ServerDown,
    /// A write was refused by what is under the store (a full disk, failing fsync): the same
    /// write may work later.
    WriteRefused,
    /// The state itself, or this process's part of the store, cannot be used (exit 73).
    Broken,
}

impl StoreError {
    pub(crate) fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Setup(_) => ErrorKind::Config,
            StoreError::ServerUnavailable(_) => ErrorKind::ServerDown,
            StoreError::Unavailable(_) => ErrorKind::WriteRefused,
            // A statement (not the commit) that met the full disk or an I/O error.
            StoreError::Query(rusqlite::Error::SqliteFailure(failure, _))
                if matches!(
                    failure.code,
                    rusqlite::ErrorCode::DiskFull | rusqlite::ErrorCode::SystemIoFailure
                ) =>
            {
                ErrorKind::WriteRefused
            }
            StoreError::Query(_)
            | StoreError::StateDir { .. }
            | StoreError::Open { .. }
            | StoreError::Migration { .. }
            | StoreError::Stopped(_)
            | StoreError::Ledger(_)
            | StoreError::LeaseLost { .. }
            | StoreError::Decode { .. }
            | StoreError::Render(_) => ErrorKind::Broken,
        }
    }

    /// See [`ErrorKind::ServerDown`].
    pub(crate) fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::ServerDown
    }

    /// A write was refused for a reason outside agentgate that may clear (a full disk, failing
    /// fsync, an unreachable database server): the same write may work later.
    pub(crate) fn is_write_refused(&self) -> bool {
        match self.kind() {
            ErrorKind::WriteRefused | ErrorKind::ServerDown => true,
            ErrorKind::Config | ErrorKind::Broken => false,
        }
    }
}

/// Unix time in milliseconds, as every stored time is kept.
pub(crate) use crate::clock::now_millis;

/// A stored time (unix ms) as RFC 3339, UTC, to the second; times before 1970 as 1970, and
/// after year 9999 (which RFC 3339 cannot write) as its last second.
pub(crate) fn rfc3339(millis: i64) -> String {
    let millis = millis.clamp(0, LAST_RFC3339_MS);
    let since_epoch = Duration::from_millis(u64::try_from(millis).unwrap_or(0));
    humantime::format_rfc3339_seconds(UNIX_EPOCH + since_epoch).to_string()
}

/// 9999-12-31T23:59:59Z, in unix milliseconds.
const LAST_RFC3339_MS: i64 = 253_402_300_799_000;

/// The terms an interrupted session is settled by (`[runtime]`, read at every settlement); the
/// rule that applies them is `admission::settle`'s.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settlement {
    /// A turn that started longer ago than this is not resumed: its event ends `abandoned`.
    pub resume_window: Duration,
    /// Counted resumes of a session past this suspend it.
    pub max_attempts: u32,
}

/// What became of an interrupted session.
#[derive(Debug, Clone)]
pub(crate) enum Settled {
    Abandoned,
    /// Queued again as resume number `attempt` (to run alone after a crash).
    Resumed {
        attempt: u64,
    },
    /// Queued again to run alone, not counted: the crash cut off `crashed_with` turns, so it
    /// cannot be pinned on this one. `attempts` is the session's count so far.
    ResumedAlone {
        attempts: u64,
        crashed_with: u32,
    },
    Suspended,
    /// The retry ledger could not count the resume, so nothing was dispatched (fail closed).
    Refused(String),
    /// Another node settled it first, or an operator did.
    NotInterrupted,
}

/// Everything agentgate asks of durable state, whichever backend keeps it, one trait per concern.
/// Each write commits before its future resolves.
pub(crate) trait Backend:
    Accepting + Turns + Recovery + Outbox + Inspection + Operator + Coordination + Approvals
{
}

impl<T> Backend for T where
    T: Accepting + Turns + Recovery + Outbox + Inspection + Operator + Coordination + Approvals
{
}

/// Making events durable.
#[async_trait::async_trait]
pub(crate) trait Accepting: Send + Sync {
    /// Makes `event` durable, or reports the original of a duplicate delivery id.
    async fn accept(&self, event: NewEvent) -> Result<AcceptOutcome, StoreError>;
    /// Queues an internal event (a background job's completion) as the session's next turn.
    async fn enqueue_internal(
        &self,
        session_key: &str,
        route: &str,
        event_type: &str,
        payload: serde_json::Value,
    ) -> Result<String, StoreError>;
    /// Forgets delivery ids last seen before `window`.
    async fn prune_dedup(&self, window: DedupWindow) -> Result<usize, StoreError>;
    /// Retention: deletes one batch of finished work older than `before` (unix ms), and
    /// returns how many events went; 0 when nothing is left to delete.
    async fn prune_finished(&self, before: i64) -> Result<usize, StoreError>;
    /// The event first accepted with `delivery_id` on `route` within `window`, if any: a
    /// redelivery gets its 200 even while new events are refused.
    async fn original_of(
        &self,
        route: &str,
        delivery_id: &str,
        window: DedupWindow,
    ) -> Result<Option<String>, StoreError>;
}

/// Claiming events as turns and committing their steps and ends.
#[async_trait::async_trait]
pub(crate) trait Turns: Send + Sync {
    /// Claims events, the oldest queued one of each idle session, oldest first: with
    /// `Claim::Beside(limit)` up to `limit` that may run beside others, with `Claim::Alone` the
    /// oldest that must run alone.
    async fn claim_turns(&self, claim: Claim) -> Result<Vec<ClaimedTurn>, StoreError>;
    /// Coalescing (`routes.NAME.coalesce`): the queued events of `head`'s session and route that
    /// arrived within `window_ms` after it join it, and every event joined to it so far is
    /// returned, oldest first. They end with `head`'s turn: `finish_turn` gives each the same
    /// terminal status and a delivery of its own.
    async fn join_queued(&self, head: &Event, window_ms: i64) -> Result<Vec<Event>, StoreError>;
    /// Whether an event that must run alone is the next of an idle session (claims of others
    /// wait while one does, so that it can run alone).
    async fn waiting_to_run_alone(&self) -> Result<bool, StoreError>;
    /// Commits transcript entries of a running turn, in order, in one transaction.
    async fn append_transcript(
        &self,
        session_key: &str,
        turn_id: &str,
        entries: Vec<(&'static str, String)>,
        steps: u32,
        spent: Spent,
    ) -> Result<(), StoreError>;
    /// Before a model request: what its turn's budgets count (what every run of its event, its
    /// session, and the turns started since its day's start on all routes and on its route
    /// spent, and what other requests in flight hold in those windows), and its reservation
    /// when `fits` allows it given their sum. Atomic with every other reservation, on every
    /// node; replaces the turn's earlier reservation. The reservation counts until the step
    /// that records the reply is committed (`append_transcript` with what it spent), the turn
    /// ends, `release_budget`, or (PostgreSQL) its node stops renewing it for `lease_ttl`; a
    /// restart of SQLite's only process clears them all.
    async fn reserve_budget(
        &self,
        reservation: Reservation,
        fits: Fits,
    ) -> Result<Reserving, StoreError>;
    /// Gives up the reservation of `turn_id`: its request got no reply.
    async fn release_budget(&self, turn_id: &str) -> Result<(), StoreError>;
    /// Ends a turn: its row, its event's terminal status, its session's state and its delivery,
    /// whose body `render` makes.
    async fn finish_turn(&self, end: TurnEnd, render: RenderDelivery) -> Result<(), StoreError>;
    /// Leaves a running turn to be resumed: interrupted, its session `resume_pending` with
    /// `reason`, its event open.
    async fn interrupt_for_resume(
        &self,
        turn_id: &str,
        session_key: &str,
        reason: ResumeReason,
        steps: u32,
    ) -> Result<(), StoreError>;
    /// Pauses a running turn on a call that waits for an operator's decision: commits the
    /// request with its transcript entry; the turn is interrupted (`awaiting_approval`), its
    /// event and session await the decision, and the session's lease (PostgreSQL) is released.
    async fn await_approval(&self, request: NewApproval, steps: u32) -> Result<(), StoreError>;
    /// Whether any run of `event_id` recorded a transcript entry.
    async fn event_has_transcript(&self, event_id: &str) -> Result<bool, StoreError>;
    /// Records the `traceparent` of the span of `turn_id`, a turn of `event_id`, and returns
    /// the one the event's latest earlier turn recorded: the span a resumed turn links to.
    async fn record_turn_span(
        &self,
        event_id: &str,
        turn_id: &str,
        traceparent: &str,
    ) -> Result<Option<String>, StoreError>;
    /// How many turns a session's history counts (its event entries no rewind superseded).
    async fn history_turns(&self, session_key: &str) -> Result<i64, StoreError>;
    /// Where the session's `nth` such turn (from 0, oldest first) starts: the seq of its event
    /// entry; `None` when there are not that many.
    async fn history_turn_start(
        &self,
        session_key: &str,
        nth: i64,
    ) -> Result<Option<i64>, StoreError>;
    /// A session's transcript after the entry `after_seq` (`i64::MIN`: all of it).
    async fn transcript(
        &self,
        session_key: &str,
        after_seq: i64,
    ) -> Result<Vec<TranscriptRow>, StoreError>;
}

/// Interrupted sessions: crash marking, admission through the retry ledger.
#[async_trait::async_trait]
pub(crate) trait Recovery: Send + Sync {
    /// Turns whose process is gone (found at start; with leases, expired) become interrupted
    /// `crashed`, their sessions `resume_pending`. Returns how many.
    async fn mark_crashed_turns(&self) -> Result<usize, StoreError>;
    /// Sessions waiting for a resume, with their interrupted turn.
    async fn interrupted_sessions(&self) -> Result<Vec<InterruptedSession>, StoreError>;
    /// Abandons, resumes or suspends an interrupted session; a resume is counted durably in the
    /// retry ledger before its event is queued again. An abandoned or suspended session's event
    /// ends with a delivery whose body `render` makes.
    async fn settle_interrupted(
        &self,
        session: &InterruptedSession,
        settlement: Settlement,
        render: RenderDelivery,
    ) -> Result<Settled, StoreError>;
    /// A resumed session completed: its retry ledger entry goes.
    async fn clear_resume_count(&self, session_key: &str) -> Result<(), StoreError>;
    /// The retry ledger as the next admission will see it.
    async fn resume_ledger(&self) -> Result<Ledger, StoreError>;
}

/// Results waiting to be delivered.
#[async_trait::async_trait]
pub(crate) trait Outbox: Send + Sync {
    /// Deliveries due now, oldest first, each to be sent by this node alone.
    /// Up to `limit` due deliveries, oldest first, of routes other than `skip_routes` (those
    /// whose target has as many deliveries in flight as it may).
    async fn due_deliveries(
        &self,
        limit: usize,
        skip_routes: Vec<String>,
    ) -> Result<Vec<PendingDelivery>, StoreError>;
    /// Records an attempt: delivered, retry later, or failed for good.
    async fn record_delivery_attempt(
        &self,
        event_id: &str,
        outcome: DeliveryAttempt,
    ) -> Result<(), StoreError>;
}

/// What `status` and `sessions` show.
#[async_trait::async_trait]
pub(crate) trait Inspection: Send + Sync {
    /// The counts for `STATUS=`.
    async fn live_counts(&self) -> Result<LiveCounts, StoreError>;
    /// Queued events by route.
    async fn queued_by_route(&self) -> Result<Vec<(String, i64)>, StoreError>;
    /// The counts for `agentgate status` (and, with leases, the nodes).
    async fn status_summary(&self) -> Result<StatusSummary, StoreError>;
    async fn sessions(&self) -> Result<Vec<SessionRow>, StoreError>;
    /// Up to `filter.limit` sessions that match `filter`, in key order: a page of
    /// `GET /v1/sessions` and of the console's list.
    async fn sessions_page(&self, filter: SessionFilter) -> Result<Vec<SessionRow>, StoreError>;
    /// One session, with what its turns spent.
    async fn session(&self, key: &str) -> Result<Option<SessionRow>, StoreError>;
    /// The latest `limit` entries of a session's transcript, and whether it has earlier ones.
    async fn transcript_tail(
        &self,
        session_key: &str,
        limit: i64,
    ) -> Result<TranscriptTail, StoreError>;
    /// The first `limit` transcript entries of event `event_id`'s turns, oldest first.
    async fn event_transcript(
        &self,
        event_id: &str,
        limit: i64,
    ) -> Result<Vec<TranscriptRow>, StoreError>;
    /// What turns started since `since` (unix ms) spent, by route and UTC day.
    async fn usage_by_day(&self, since: i64) -> Result<Vec<UsageDay>, StoreError>;
    /// `events list`: newest first.
    async fn events(&self, filter: EventFilter) -> Result<Vec<EventRow>, StoreError>;
    /// `events show`.
    async fn event(&self, id: &str) -> Result<Option<EventDetail>, StoreError>;
    /// `deliveries list`: newest first; only those in `state`, when given.
    async fn deliveries(
        &self,
        state: Option<DeliveryState>,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, StoreError>;
}

/// The operator's overrides.
#[async_trait::async_trait]
pub(crate) trait Operator: Send + Sync {
    /// `sessions resume KEY`: clears the ledger entry; a suspended session becomes idle, an
    /// interrupted one is queued again. Returns the state it was in, `None` if unknown.
    async fn operator_resume(&self, key: &str) -> Result<Option<SessionState>, StoreError>;
    /// `sessions suspend KEY`: no further turn starts until it is resumed.
    async fn operator_suspend(&self, key: &str) -> Result<Option<SessionState>, StoreError>;
    /// `events replay ID`: queues a copy of the event as a new one that records what it
    /// replays. Returns the new event id, `None` if there is no such event.
    async fn replay_event(&self, id: &str) -> Result<Option<String>, StoreError>;
    /// `deliveries retry`: failed deliveries get a fresh attempt budget and are due at once;
    /// pending ones are due at once. Returns how many.
    async fn retry_deliveries(&self, target: RetryTarget) -> Result<u64, StoreError>;
    /// `sessions rewind` and `sessions fork` (`rewind.rs`): queues the turn that reruns the
    /// session from the entry, or says why not.
    async fn rewind(
        &self,
        request: RewindRequest,
    ) -> Result<Result<Rewound, RewindRefusal>, StoreError>;
}

/// Approval requests: listing and deciding them (docs/reference.md, "Approvals").
#[async_trait::async_trait]
pub(crate) trait Approvals: Send + Sync {
    /// Up to `limit` requests, oldest first; only pending ones with `pending_only`.
    async fn approvals(
        &self,
        pending_only: bool,
        limit: i64,
    ) -> Result<Vec<ApprovalRow>, StoreError>;
    async fn approval(&self, id: &str) -> Result<Option<ApprovalRow>, StoreError>;
    /// Takes a decision on a pending request and queues its turn to continue, with the decision
    /// in its transcript, in one transaction; a request past its time is expired instead.
    async fn decide_approval(&self, id: &str, decision: Decision) -> Result<Decided, StoreError>;
    /// Up to `limit` pending requests past 80 % of their time, the nearest to expiry first.
    async fn approvals_to_warn(&self, limit: i64) -> Result<Vec<ApprovalRow>, StoreError>;
    /// Expires a batch of pending requests whose time ran out (their turns continue); returns
    /// them, none when there is nothing left to expire.
    async fn expire_approvals(&self) -> Result<Vec<ApprovalRow>, StoreError>;
    /// Denies the session's pending requests with `decision` (an operator suspended or
    /// cancelled it); returns them.
    async fn deny_session_approvals(
        &self,
        session_key: &str,
        decision: Decision,
    ) -> Result<Vec<ApprovalRow>, StoreError>;
}

/// The store's own health, and work shared between nodes.
#[async_trait::async_trait]
pub(crate) trait Coordination: Send + Sync {
    /// Whether the store's own machinery responds (the watchdog's check): a wedged writer stops
    /// the watchdog pings, an unreachable database server does not.
    async fn answers(&self) -> bool;
    /// `on_busy = "interrupt"` for a session whose turn may run on another node: asks its owner
    /// to interrupt it. (One node interrupts its own turns directly.)
    async fn request_interrupt(&self, session_key: &str) -> Result<(), StoreError>;
    /// Sessions of this node's running turns that another node asked to interrupt; each request
    /// is returned once.
    async fn interrupts_requested(&self) -> Result<Vec<String>, StoreError>;
    /// The daemon is stopping: hands this node's remaining leases back.
    async fn release(&self);
    /// Whether the last write (or probe) succeeded: `/readyz` and the 503s follow it.
    fn is_writable(&self) -> bool;
    /// How often interrupted sessions are looked for again after start: `None` when only a
    /// start can find them (one node), else the sweep that takes over other nodes' work.
    fn failover_interval(&self) -> Option<Duration>;
    /// Whether this node has not renewed its lease on `session_key` for most of `lease_ttl`
    /// (PostgreSQL: cut off from the database, or the session is another node's now): the
    /// session's running turn must stop its tools before another node can take it over. Never
    /// with one node.
    fn lease_at_risk(&self, session_key: &str) -> bool;
}

/// A handle to durable state: the configured [`Backend`], and the commits this process made
/// to it (`commits.rs`). Cheap to clone.
#[derive(Clone)]
pub(crate) struct Store {
    backend: Arc<dyn Backend>,
    commits: Commits,
}

impl std::ops::Deref for Store {
    type Target = dyn Backend;

    fn deref(&self) -> &(dyn Backend + 'static) {
        self.backend.as_ref()
    }
}

impl Store {
    fn of(backend: impl Backend + 'static, shared: bool) -> Store {
        Store {
            backend: Arc::new(backend),
            commits: Commits::new(shared),
        }
    }

    /// Opens the configured backend for the daemon (creating and migrating as needed).
    pub(crate) async fn open(
        settings: &StoreSettings,
        state_dir: &Path,
    ) -> Result<Store, StoreError> {
        match settings {
            StoreSettings::Sqlite => Ok(Store::of(sqlite::SqliteStore::open(state_dir)?, false)),
            StoreSettings::Postgres(postgres) => Ok(Store::of(
                postgres::PostgresStore::open(postgres, true).await?,
                true,
            )),
        }
    }

    /// Opens existing state for an operator command: never creates a database. `None` when the
    /// SQLite state directory has no database yet.
    pub(crate) async fn attach(
        settings: &StoreSettings,
        state_dir: &Path,
    ) -> Result<Option<Store>, StoreError> {
        match settings {
            StoreSettings::Sqlite => Ok(
                sqlite::SqliteStore::attach(state_dir)?.map(|backend| Store::of(backend, false))
            ),
            StoreSettings::Postgres(postgres) => Ok(Some(Store::of(
                postgres::PostgresStore::open(postgres, false).await?,
                true,
            ))),
        }
    }
}

/// Creates the state directory (0750) if it is missing, durably.
pub(crate) fn ensure_state_dir(state_dir: &Path) -> Result<(), StoreError> {
    StateDir::new(state_dir)
        .ensure()
        .map_err(|source| StoreError::StateDir {
            path: state_dir.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any stored time has an RFC 3339 form, past year 9999 included (a request's `since`, an
    /// expiry computed from a long setting): never a panic.
    #[test]
    fn every_time_has_an_rfc3339_form() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(-5), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(253_402_300_800_000), "9999-12-31T23:59:59Z");
        assert_eq!(rfc3339(i64::MAX), "9999-12-31T23:59:59Z");
    }

    fn sqlite_failure(code: std::ffi::c_int) -> StoreError {
        StoreError::Query(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(code),
            None,
        ))
    }

    /// A start waits out refused writes, and only those: a store that stopped working, or a
    /// query that is wrong, will not get better by waiting.
    #[test]
    fn only_writes_that_may_work_later_count_as_refused() {
        assert!(StoreError::Unavailable("database or disk is full".into()).is_write_refused());
        assert!(StoreError::ServerUnavailable("connection refused".into()).is_write_refused());
        assert!(sqlite_failure(rusqlite::ffi::SQLITE_FULL).is_write_refused());
        assert!(sqlite_failure(rusqlite::ffi::SQLITE_IOERR).is_write_refused());
        assert!(!StoreError::Stopped("the writer thread".into()).is_write_refused());
        assert!(!sqlite_failure(rusqlite::ffi::SQLITE_CONSTRAINT).is_write_refused());
        assert!(!StoreError::Setup("bad URL".into()).is_write_refused());
    }
}
