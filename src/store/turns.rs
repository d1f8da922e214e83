//! A turn's transactions, written once for both backends: its start, each committed step, the
//! budget reservation before each model request, its pause for a person's decision, its
//! interruption, its end; and the internal event queued as a session's next turn.
//!
//! Each is one script of statements over [`TurnTx`], run inside the transaction the backend
//! opened, so the two backends cannot write a turn differently. The statements they can both run
//! are in `sql.rs`; a backend supplies only what it writes its own way: the text of a few
//! statements ([`TurnTx`]'s constants: how a delivery replaces an earlier one, what a session
//! releases with its turn, which reservations still count), the rows that name its node (a
//! turn's start, an internal event, a reservation), which events a claim may still take, and
//! what precedes a script (PostgreSQL: the session's lease is checked in the same transaction,
//! or the reservation lock taken; a recovery ends a turn whose lease is gone).

use super::approval::{APPROVAL_ENTRY, NewApproval};
use super::model::{ClaimedTurn, Event, Fits, RenderDelivery, Reservation, Reserving, TurnEnd};
use super::row::StoredRow;
use super::sql::{
    APPEND_SQL, AWAIT_EVENT_SQL, DAY_USAGE_SQL, EVENT_USAGE_SQL, FINISH_EVENT_SQL,
    FINISH_JOINED_SQL, FINISH_TURN_SQL, INSERT_APPROVAL_SQL, INTERRUPT_TURN_SQL, JOINED_EVENTS_SQL,
    RELEASE_SQL, ROUTE_DAY_USAGE_SQL, SESSION_USAGE_SQL, START_EVENT_SQL,
    SUSPENDED_EVENT_WAITS_SQL, TURN_STEPS_SQL, reserved_values, step_usage_values,
};
use super::states::{ResumeReason, SessionState, StopReason};
use super::tx::{Param, Tx, Values};
use super::{RewindOf, StoreError, now_millis};
use crate::usage::{Spending, Spent};

/// What a backend writes its own way, within the scripts below.
pub(super) trait TurnTx: Tx {
    /// `$1` session key, `$2` its state after the turn, `$3` reason, `$4` now: the session no
    /// longer runs the turn (`sql::END_SESSION_SET`, and on PostgreSQL its lease goes).
    const END_SESSION_SQL: &'static str;
    /// `$1` event id (or an approval request's id), `$2` route, `$3` session key, `$4` body,
    /// `$5` now: a pending delivery, replacing an earlier one of the same id.
    const QUEUE_DELIVERY_SQL: &'static str;
    /// `$1` session key, `$2` reason, `$3` now: the session waits for a resume (an operator's
    /// suspension stays in force; on PostgreSQL the lease goes, so another node may resume it).
    const INTERRUPT_SESSION_SQL: &'static str;
    /// Coalescing: `sql::JOIN_QUEUED_SET` after the backend's `UPDATE events`.
    const JOIN_QUEUED_SQL: &'static str;
    /// `sql::HELD_SUMS` over the reservations that still count (PostgreSQL: those whose node
    /// renewed them within `lease_ttl`; SQLite: all, which only this process makes).
    const HELD_SQL: &'static str;

    /// What a claim looks at: an event that may start a turn, as the backend found it.
    type Candidate;

    /// The turn `candidate`'s event starts, if it may still start one now.
    async fn claimable(
        &self,
        candidate: &Self::Candidate,
    ) -> Result<Option<ClaimedTurn>, StoreError>;

    /// The turn's row and its session's running state (PostgreSQL: with this node's lease),
    /// from [`Start`]'s values.
    async fn start_rows(&self, start: &Start<'_>) -> Result<(), StoreError>;

    /// Inserts the queued internal event (PostgreSQL: naming this node), from
    /// [`InternalEvent`]'s values.
    async fn insert_internal(&self, event: &InternalEvent<'_>) -> Result<(), StoreError>;

    /// Inserts a budget reservation: `$1` turn id, `$2` event id, `$3` session key, `$4` route,
    /// `$5` when it was made (its day), `$6` prompt tokens, `$7` reply tokens (PostgreSQL adds
    /// its node and when the reservation expires unless renewed; SQLite's never expire).
    async fn insert_reservation(&self, values: &[&(dyn Param + Sync); 7])
    -> Result<(), StoreError>;
}

/// A claimed turn starting at `now`.
pub(super) struct Start<'a> {
    pub turn: &'a ClaimedTurn,
    pub now: i64,
}

impl Start<'_> {
    /// `$1` turn id, `$2` session key, `$3` event id, `$4` now: the backend's `START_TURN_SQL`
    /// (PostgreSQL adds its node).
    pub(super) fn turn_values(&self) -> [&(dyn Param + Sync); 4] {
        let event = &self.turn.event;
        [&self.turn.turn_id, &event.session_key, &event.id, &self.now]
    }

    /// `$1` session key, `$2` turn id, `$3` now: the backend's `START_SESSION_SQL` (PostgreSQL
    /// adds its node and the lease's length).
    pub(super) fn session_values(&self) -> [&(dyn Param + Sync); 3] {
        [&self.turn.event.session_key, &self.turn.turn_id, &self.now]
    }
}

/// An internal event (a background job's completion), queued at `now`.
pub(super) struct InternalEvent<'a> {
    pub id: &'a str,
    pub session_key: &'a str,
    pub route: &'a str,
    pub event_type: &'a str,
    pub payload: Vec<u8>,
    pub now: i64,
}

impl InternalEvent<'_> {
    /// `$1` id, `$2` route, `$3` session key, `$4` event type, `$5` payload, `$6` now: the
    /// backend's `INSERT_INTERNAL_SQL` (PostgreSQL adds its node).
    pub(super) fn values(&self) -> [&(dyn Param + Sync); 6] {
        [
            &self.id,
            &self.route,
            &self.session_key,
            &self.event_type,
            &self.payload,
            &self.now,
        ]
    }
}

/// Starts a turn for each of `candidates` whose event may still start one; the turns started.
pub(super) async fn claim<X: TurnTx>(
    tx: &X,
    candidates: &[X::Candidate],
) -> Result<Vec<ClaimedTurn>, StoreError> {
    let mut claimed = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        let Some(turn) = tx.claimable(candidate).await? else {
            continue;
        };
        let now = now_millis();
        tx.run(START_EVENT_SQL, &[&turn.event.id, &now]).await?;
        tx.start_rows(&Start { turn: &turn, now }).await?;
        claimed.push(turn);
    }
    Ok(claimed)
}

/// Commits transcript entries of a running turn, in order, with its step count and what the
/// step spent.
pub(super) async fn append(
    tx: &impl TurnTx,
    session_key: &str,
    turn_id: &str,
    entries: &[(&'static str, String)],
    steps: u32,
    spent: Spent,
) -> Result<(), StoreError> {
    let now = now_millis();
    for (kind, body) in entries {
        tx.run(APPEND_SQL, &[&session_key, &turn_id, kind, body, &now])
            .await?;
    }
    let [input, cached, output, unknown, estimated] = step_usage_values(spent);
    let steps = i64::from(steps);
    let values: [&(dyn Param + Sync); 7] = [
        &turn_id, &steps, &input, &cached, &output, &unknown, &estimated,
    ];
    tx.run(TURN_STEPS_SQL, &values).await?;
    // The reply's usage is committed: what its request held is settled.
    if spent != Spent::default() {
        tx.run(RELEASE_SQL, &[&turn_id]).await?;
    }
    Ok(())
}

/// Before a model request: reads what `reservation`'s windows spent and what other requests
/// hold in them, and reserves it if `fits` allows their sum, replacing the turn's earlier
/// reservation. The caller makes reservations one at a time (SQLite: the writer; PostgreSQL: an
/// advisory lock), so each sees the ones before it.
pub(super) async fn reserve<X: TurnTx>(
    tx: &X,
    reservation: &Reservation,
    fits: &Fits,
) -> Result<Reserving, StoreError> {
    let Reservation {
        turn_id,
        event_id,
        session_key,
        route,
        day_start,
        tokens,
        counted,
    } = reservation;
    tx.run(RELEASE_SQL, &[turn_id]).await?;
    // What is held is read before what was spent. A reply's step settles its reservation and
    // records its usage in one commit, which on PostgreSQL (each statement its own snapshot,
    // the step not under the reservation lock) can land between the two reads: read in this
    // order, the reply is then counted twice (held, then spent), never not at all.
    let held = tx
        .row(
            X::HELD_SQL,
            &[event_id, session_key, route, day_start],
            |row| Spending::decode_held(row),
        )
        .await?
        .only(*counted);
    let spent = async |wanted: bool, sql: &str, values: &Values<'_>| {
        if !wanted {
            return Ok::<_, StoreError>(Spent::default());
        }
        tx.row(sql, values, |row| Spent::decode(row)).await
    };
    let spent = Spending {
        turn: spent(counted.turn, EVENT_USAGE_SQL, &[event_id]).await?,
        session: spent(counted.session, SESSION_USAGE_SQL, &[session_key]).await?,
        day: spent(counted.day, DAY_USAGE_SQL, &[day_start]).await?,
        route_day: spent(counted.route_day, ROUTE_DAY_USAGE_SQL, &[day_start, route]).await?,
    };
    let reserved = fits(&spent.plus(&held));
    if reserved {
        let [input, output] = reserved_values(*tokens);
        let made_at = now_millis();
        tx.insert_reservation(&[
            turn_id,
            event_id,
            session_key,
            route,
            &made_at,
            &input,
            &output,
        ])
        .await?;
    }
    Ok(Reserving {
        spent,
        held,
        reserved,
    })
}

/// Coalescing: the queued events of `head`'s session and route that arrived within `window_ms`
/// after it join it; every event joined to it so far, oldest first.
pub(super) async fn join<X: TurnTx>(
    tx: &X,
    head: &Event,
    window_ms: i64,
) -> Result<Vec<Event>, StoreError> {
    let values: [&(dyn Param + Sync); 5] = [
        &head.id,
        &head.session_key,
        &head.route,
        &now_millis(),
        &window_ms,
    ];
    tx.run(X::JOIN_QUEUED_SQL, &values).await?;
    tx.rows(JOINED_EVENTS_SQL, &[&head.id], |row| Event::decode(row))
        .await
}

/// Ends a turn's rows: the turn, its event's terminal status, its session and its delivery,
/// whose body `render` makes; the events that joined it end with it.
pub(super) async fn finish<X: TurnTx>(
    tx: &X,
    end: &TurnEnd,
    render: RenderDelivery,
) -> Result<(), StoreError> {
    let now = now_millis();
    let reason = end.reason.map(StopReason::sql);
    let (status, steps) = (end.turn_status.sql(), i64::from(end.steps));
    tx.run(RELEASE_SQL, &[&end.turn_id]).await?;
    let values: [&(dyn Param + Sync); 7] = [
        &end.turn_id,
        &status,
        &reason,
        &end.output,
        &end.error,
        &steps,
        &now,
    ];
    tx.run(FINISH_TURN_SQL, &values).await?;
    let event_status = end.terminal.event_status().sql();
    let rewind_of = tx
        .maybe_row(
            FINISH_EVENT_SQL,
            &[&end.event_id, &event_status, &now],
            |row| RewindOf::decode(row),
        )
        .await?;
    let end = &end.rewinding(rewind_of.flatten());
    let state = end.terminal.session_state().sql();
    tx.run(
        X::END_SESSION_SQL,
        &[&end.session_key, &state, &reason, &now],
    )
    .await?;
    let spent = tx
        .row(EVENT_USAGE_SQL, &[&end.event_id], |row| Spent::decode(row))
        .await?;
    let body = render.body(end, spent)?;
    let values: [&(dyn Param + Sync); 5] =
        [&end.event_id, &end.route, &end.session_key, &body, &now];
    tx.run(X::QUEUE_DELIVERY_SQL, &values).await?;
    // The events that joined it end with it, each delivered (what the turn spent is on its own
    // event's delivery).
    let joined = tx
        .rows(
            FINISH_JOINED_SQL,
            &[&end.event_id, &event_status, &now],
            |row| row.column::<String>("id"),
        )
        .await?;
    for event_id in joined {
        let body = render.body(&end.for_joined(&event_id), Spent::default())?;
        let values: [&(dyn Param + Sync); 5] =
            [&event_id, &end.route, &end.session_key, &body, &now];
        tx.run(X::QUEUE_DELIVERY_SQL, &values).await?;
    }
    Ok(())
}

/// Pauses a turn on a call that waits for a decision: the request, its transcript entry, the
/// turn interrupted, its event and session awaiting the decision, and the request's delivery.
pub(super) async fn await_approval<X: TurnTx>(
    tx: &X,
    request: &NewApproval,
    steps: u32,
) -> Result<(), StoreError> {
    let row = &request.row;
    let now = row.requested_at;
    let arguments = row.arguments.to_string();
    let values: [&(dyn Param + Sync); 11] = [
        &row.id,
        &row.event_id,
        &row.session,
        &row.route,
        &row.turn_id,
        &row.call_id,
        &row.tool,
        &arguments,
        &row.requested_at,
        &row.expires_at,
        &row.link_secret,
    ];
    tx.run(INSERT_APPROVAL_SQL, &values).await?;
    let body = row.entry().body()?;
    let values: [&(dyn Param + Sync); 5] =
        [&row.session, &row.turn_id, &APPROVAL_ENTRY, &body, &now];
    tx.run(APPEND_SQL, &values).await?;
    let (reason, steps) = (StopReason::AwaitingApproval.sql(), i64::from(steps));
    tx.run(INTERRUPT_TURN_SQL, &[&row.turn_id, &reason, &steps, &now])
        .await?;
    tx.run(AWAIT_EVENT_SQL, &[&row.event_id, &now]).await?;
    // The request's own delivery, keyed by its id (the event's result is delivered later).
    let values: [&(dyn Param + Sync); 5] =
        [&row.id, &row.route, &row.session, &request.delivery, &now];
    tx.run(X::QUEUE_DELIVERY_SQL, &values).await?;
    let state = SessionState::AwaitingApproval.sql();
    tx.run(
        X::END_SESSION_SQL,
        &[&row.session, &state, &None::<&str>, &now],
    )
    .await?;
    Ok(())
}

/// Leaves a running turn to be resumed: interrupted, its session waiting for a resume (or, if
/// an operator suspended it, its event queued as a resume for `sessions resume`).
pub(super) async fn interrupt<X: TurnTx>(
    tx: &X,
    turn_id: &str,
    session_key: &str,
    reason: ResumeReason,
    steps: u32,
) -> Result<(), StoreError> {
    let now = now_millis();
    let (reason, steps) = (StopReason::Resume(reason).sql(), i64::from(steps));
    tx.run(INTERRUPT_TURN_SQL, &[&turn_id, &reason, &steps, &now])
        .await?;
    tx.run(X::INTERRUPT_SESSION_SQL, &[&session_key, &reason, &now])
        .await?;
    tx.run(
        SUSPENDED_EVENT_WAITS_SQL,
        &[&turn_id, &reason, &session_key, &now],
    )
    .await?;
    Ok(())
}

/// Queues an internal event (a background job's completion) as the session's next turn; its
/// id.
pub(super) async fn enqueue_internal(
    tx: &impl TurnTx,
    session_key: &str,
    route: &str,
    event_type: &str,
    payload: &serde_json::Value,
) -> Result<String, StoreError> {
    let id = uuid::Uuid::now_v7().to_string();
    tx.insert_internal(&InternalEvent {
        id: &id,
        session_key,
        route,
        event_type,
        payload: payload.to_string().into_bytes(),
        now: now_millis(),
    })
    .await?;
    Ok(id)
}
