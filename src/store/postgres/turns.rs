//! [`Turns`] on PostgreSQL: claims under `FOR UPDATE SKIP LOCKED`, and every commit of a turn
//! fenced by its session's lease.

use const_format::concatcp;

use super::PostgresStore;
use super::connect::{Cached, bounded};
use crate::store::approval::{APPROVAL_ENTRY, NewApproval};
use crate::store::model::{
    Claim, ClaimedTurn, EVENT_ENTRY, Event, RenderDelivery, TranscriptRow, TurnEnd,
};
use crate::store::row::StoredRow;
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

/// `$1` limit: the idle sessions with queued events, oldest head first (one partial index;
/// sessions that cannot run are never read); sessions another node is claiming right now are
/// skipped, not waited for.
const RUNNABLE_SESSIONS_SQL: &str = concatcp!(
    "SELECT s.key AS key FROM sessions s
     WHERE s.state = ",
    IDLE,
    " AND s.queue_head IS NOT NULL
     ORDER BY s.queue_head LIMIT $1
     FOR UPDATE OF s SKIP LOCKED"
);

/// As [`RUNNABLE_SESSIONS_SQL`], with the routes' priorities counted as waiting. `$1` limit,
/// `$2` the priorities (a JSON object of route name to priority), `$3` the waiting one step is
/// worth. Every idle session with a queued event is read and sorted, so this is used only when
/// some route has a priority.
const PRIORITY_SESSIONS_SQL: &str = concatcp!(
    "SELECT s.key AS key FROM sessions s JOIN events e ON e.seq = s.queue_head
     WHERE s.state = ",
    IDLE,
    " AND s.queue_head IS NOT NULL
     ORDER BY e.received_at - coalesce(($2::text::jsonb ->> e.route)::bigint, 0) * $3, s.queue_head
     LIMIT $1
     FOR UPDATE OF s SKIP LOCKED"
);

/// The session of the oldest event that must run alone and is the next of an idle session,
/// from the partial index of such events (a few at most, after a crash), unless another node is
/// claiming it right now. `$1` limit (so that it reads as the runnable sessions do).
const ALONE_SESSIONS_SQL: &str = concatcp!(
    "SELECT s.key AS key FROM events e JOIN sessions s ON s.key = e.session_key
     WHERE e.status = ",
    QUEUED,
    " AND e.run_alone AND s.state = ",
    IDLE,
    " AND s.queue_head = e.seq
     ORDER BY e.seq LIMIT $1
     FOR UPDATE OF s SKIP LOCKED"
);

/// The same, only to look: no lock.
const ALONE_WAITING_SQL: &str = concatcp!(
    "SELECT EXISTS (SELECT 1 FROM events e JOIN sessions s ON s.key = e.session_key
     WHERE e.status = ",
    QUEUED,
    " AND e.run_alone AND s.state = ",
    IDLE,
    " AND s.queue_head = e.seq) AS waiting"
);

/// `$1` session key: its oldest queued event.
const HEAD_EVENT_SQL: &str = concatcp!(
    "SELECT ",
    CLAIM_COLUMNS,
    " FROM events WHERE session_key = $1 AND status = ",
    QUEUED,
    " ORDER BY seq LIMIT 1"
);

/// `$1` turn id, `$2` session key, `$3` event id, `$4` now, `$5` node name.
const START_TURN_SQL: &str = concatcp!(
    "INSERT INTO turns (id, session_key, event_id, status, started_at, node)
     VALUES ($1, $2, $3, ",
    TURN_RUNNING,
    ", $4, $5)"
);

/// `$1` session key, `$2` turn id, `$3` now, `$4` this node, `$5` the lease's length.
const START_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = ",
    SESSION_RUNNING,
    ", reason = NULL, last_turn_id = $2, updated_at = $3,
         lease_owner = $4, lease_expires_at = agentgate_now_ms() + $5,
         interrupt_requested = false
     WHERE key = $1"
);

/// The lease goes with the turn's end.
const END_SESSION_SQL: &str = concatcp!(
    END_SESSION_SET,
    ", lease_owner = NULL, lease_expires_at = NULL WHERE key = $1"
);

/// `$1` event id, `$2` route, `$3` session key, `$4` body, `$5` now.
const QUEUE_DELIVERY_SQL: &str = concatcp!(
    "INSERT INTO deliveries (event_id, route, session_key, body, status, attempts, next_attempt_at,
                             created_at, updated_at)
     VALUES ($1, $2, $3, $4, ",
    PENDING,
    ", 0, $5, $5, $5)
     ON CONFLICT (event_id) DO UPDATE SET body = EXCLUDED.body, status = ",
    PENDING,
    ", attempts = 0,
         next_attempt_at = EXCLUDED.next_attempt_at, updated_at = EXCLUDED.updated_at,
         lease_owner = NULL, lease_expires_at = NULL"
);

/// `$1` session key, `$2` reason, `$3` now. The lease goes with it: another node resumes the
/// session at once. An operator's suspension stays in force: the interrupted event waits for
/// `sessions resume`.
const INTERRUPT_SESSION_SQL: &str = concatcp!(
    "UPDATE sessions SET state = CASE WHEN state = ",
    SUSPENDED,
    " THEN state ELSE ",
    RESUME_PENDING,
    " END, reason = CASE WHEN state = ",
    SUSPENDED,
    " THEN reason ELSE $2 END, updated_at = $3,
         lease_owner = NULL, lease_expires_at = NULL
     WHERE key = $1"
);

/// Ends a turn's rows: the turn, its event's terminal status, its session (lease released) and
/// its delivery, as one part of the caller's transaction.
pub(super) async fn finish_rows(
    tx: &deadpool_postgres::Transaction<'_>,
    end: &TurnEnd,
    render: RenderDelivery,
) -> Result<(), StoreError> {
    let now = now_millis();
    let reason = end.reason.map(StopReason::sql);
    tx.run(
        FINISH_TURN_SQL,
        &[
            &end.turn_id,
            &end.turn_status.sql(),
            &reason,
            &end.output,
            &end.error,
            &i64::from(end.steps),
            &now,
        ],
    )
    .await?;
    tx.run(
        FINISH_EVENT_SQL,
        &[&end.event_id, &end.terminal.event_status().sql(), &now],
    )
    .await?;
    tx.run(
        END_SESSION_SQL,
        &[
            &end.session_key,
            &end.terminal.session_state().sql(),
            &reason,
            &now,
        ],
    )
    .await?;
    let spent = Spent::decode(&tx.row(EVENT_USAGE_SQL, &[&end.event_id]).await?)?;
    let body = render.body(end, spent)?;
    tx.run(
        QUEUE_DELIVERY_SQL,
        &[&end.event_id, &end.route, &end.session_key, &body, &now],
    )
    .await?;
    // The events that joined it end with it, each delivered (what the turn spent is on its own
    // event's delivery).
    let joined = tx
        .rows(
            FINISH_JOINED_SQL,
            &[&end.event_id, &end.terminal.event_status().sql(), &now],
        )
        .await?;
    for row in joined {
        let event_id: String = row.column("id")?;
        let body = render.body(&end.for_joined(&event_id), Spent::default())?;
        tx.run(
            QUEUE_DELIVERY_SQL,
            &[&event_id, &end.route, &end.session_key, &body, &now],
        )
        .await?;
    }
    Ok(())
}

impl PostgresStore {
    /// Claims the head event of each locked session, in the caller's transaction.
    async fn claim_in(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        claim: &Claim,
    ) -> Result<Vec<ClaimedTurn>, StoreError> {
        let count = |limit: &usize| i64::try_from(*limit).unwrap_or(i64::MAX);
        let step = crate::store::model::PRIORITY_STEP_MS;
        let sessions = match claim {
            Claim::Beside(limit) => tx.rows(RUNNABLE_SESSIONS_SQL, &[&count(limit)]).await?,
            Claim::BesideByPriority { limit, priorities } => {
                let priorities: &str = priorities;
                tx.rows(PRIORITY_SESSIONS_SQL, &[&count(limit), &priorities, &step])
                    .await?
            }
            Claim::Alone => tx.rows(ALONE_SESSIONS_SQL, &[&1i64]).await?,
        };
        let mut claimed = Vec::with_capacity(sessions.len());
        for session in sessions {
            let session_key: String = session.column("key")?;
            let Some(row) = tx.maybe_row(HEAD_EVENT_SQL, &[&session_key]).await? else {
                continue;
            };
            let turn = ClaimedTurn::decode(&row, uuid::Uuid::now_v7().to_string())?;
            if turn.alone != (*claim == Claim::Alone) {
                continue;
            }
            let (event, now) = (&turn.event, now_millis());
            tx.run(START_EVENT_SQL, &[&event.id, &now]).await?;
            tx.run(
                START_TURN_SQL,
                &[
                    &turn.turn_id,
                    &event.session_key,
                    &event.id,
                    &now,
                    &self.shared.node_name,
                ],
            )
            .await?;
            tx.run(
                START_SESSION_SQL,
                &[
                    &event.session_key,
                    &turn.turn_id,
                    &now,
                    &self.shared.node_id,
                    &self.shared.lease_ttl_ms,
                ],
            )
            .await?;
            claimed.push(turn);
        }
        Ok(claimed)
    }
}

#[async_trait::async_trait]
impl Turns for PostgresStore {
    async fn claim_turns(&self, claim: Claim) -> Result<Vec<ClaimedTurn>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let claimed = self.claim_in(&tx, &claim).await?;
            tx.commit().await?;
            Ok(claimed)
        })
        .await
    }

    async fn waiting_to_run_alone(&self) -> Result<bool, StoreError> {
        self.fetch_one(ALONE_WAITING_SQL, &[], |row| row.column("waiting"))
            .await
    }

    async fn append_transcript(
        &self,
        session_key: &str,
        turn_id: &str,
        entries: Vec<(&'static str, String)>,
        steps: u32,
        spent: Spent,
    ) -> Result<(), StoreError> {
        let [input, cached, output, unknown, estimated] = step_usage_values(spent);
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, session_key).await?;
            let now = now_millis();
            for (kind, body) in &entries {
                tx.run(APPEND_SQL, &[&session_key, &turn_id, kind, body, &now])
                    .await?;
            }
            tx.run(
                TURN_STEPS_SQL,
                &[
                    &turn_id,
                    &i64::from(steps),
                    &input,
                    &cached,
                    &output,
                    &unknown,
                    &estimated,
                ],
            )
            .await?;
            tx.commit().await?;
            Ok(())
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
        bounded(async {
            let client = self.client().await?;
            let spent =
                async |wanted: bool,
                       sql: &str,
                       values: &[&(dyn tokio_postgres::types::ToSql + Sync)]| {
                    if !wanted {
                        return Ok::<_, StoreError>(Spent::default());
                    }
                    Spent::decode(&client.row(sql, values).await?)
                };
            Ok(Spending {
                turn: spent(counted.turn, EVENT_USAGE_SQL, &[&event_id]).await?,
                session: spent(counted.session, SESSION_USAGE_SQL, &[&session_key]).await?,
                day: spent(counted.day, DAY_USAGE_SQL, &[&since]).await?,
                route_day: spent(counted.route_day, ROUTE_DAY_USAGE_SQL, &[&since, &route]).await?,
            })
        })
        .await
    }

    async fn finish_turn(&self, end: TurnEnd, render: RenderDelivery) -> Result<(), StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, &end.session_key).await?;
            finish_rows(&tx, &end, render).await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn join_queued(&self, head: &Event, window_ms: i64) -> Result<Vec<Event>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, &head.session_key).await?;
            tx.run(
                JOIN_QUEUED_SQL,
                &[
                    &head.id,
                    &head.session_key,
                    &head.route,
                    &now_millis(),
                    &window_ms,
                ],
            )
            .await?;
            let rows = tx.rows(JOINED_EVENTS_SQL, &[&head.id]).await?;
            tx.commit().await?;
            rows.iter().map(Event::decode).collect()
        })
        .await
    }

    async fn interrupt_for_resume(
        &self,
        turn_id: &str,
        session_key: &str,
        reason: ResumeReason,
        steps: u32,
    ) -> Result<(), StoreError> {
        let reason = StopReason::Resume(reason).sql();
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, session_key).await?;
            let now = now_millis();
            tx.run(
                INTERRUPT_TURN_SQL,
                &[&turn_id, &reason, &i64::from(steps), &now],
            )
            .await?;
            tx.run(INTERRUPT_SESSION_SQL, &[&session_key, &reason, &now])
                .await?;
            tx.run(
                SUSPENDED_EVENT_WAITS_SQL,
                &[&turn_id, &reason, &session_key, &now],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn await_approval(&self, request: NewApproval, steps: u32) -> Result<(), StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, &request.row.session).await?;
            let now = request.row.requested_at;
            tx.run(
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
            )
            .await?;
            let body = request.row.entry().body()?;
            tx.run(
                APPEND_SQL,
                &[
                    &request.row.session,
                    &request.row.turn_id,
                    &APPROVAL_ENTRY,
                    &body,
                    &now,
                ],
            )
            .await?;
            let reason = StopReason::AwaitingApproval.sql();
            tx.run(
                INTERRUPT_TURN_SQL,
                &[&request.row.turn_id, &reason, &i64::from(steps), &now],
            )
            .await?;
            tx.run(AWAIT_EVENT_SQL, &[&request.row.event_id, &now])
                .await?;
            // The request's own delivery, keyed by its id (the event's result comes later).
            tx.run(
                QUEUE_DELIVERY_SQL,
                &[
                    &request.row.id,
                    &request.row.route,
                    &request.row.session,
                    &request.delivery,
                    &now,
                ],
            )
            .await?;
            tx.run(
                END_SESSION_SQL,
                &[
                    &request.row.session,
                    &SessionState::AwaitingApproval.sql(),
                    &None::<&str>,
                    &now,
                ],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn event_has_transcript(&self, event_id: &str) -> Result<bool, StoreError> {
        self.fetch_one(EVENT_HAS_TRANSCRIPT_SQL, &[&event_id], |row| {
            row.column("found")
        })
        .await
    }

    async fn record_turn_span(
        &self,
        event_id: &str,
        turn_id: &str,
        traceparent: &str,
    ) -> Result<Option<String>, StoreError> {
        let earlier = self
            .fetch_optional(EARLIER_TURN_SPAN_SQL, &[&event_id, &turn_id], |row| {
                row.column("trace_span")
            })
            .await?;
        self.execute_one(RECORD_TURN_SPAN_SQL, &[&turn_id, &traceparent])
            .await?;
        Ok(earlier)
    }

    async fn transcript(
        &self,
        session_key: &str,
        after_seq: i64,
    ) -> Result<Vec<TranscriptRow>, StoreError> {
        self.fetch(
            TRANSCRIPT_SQL,
            &[&session_key, &EVENT_ENTRY, &after_seq],
            TranscriptRow::decode,
        )
        .await
    }
}
