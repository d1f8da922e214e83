//! [`Turns`] on PostgreSQL: claims under `FOR UPDATE SKIP LOCKED`, every commit of a turn fenced
//! by its session's lease, and what this backend writes its own way in a turn's scripts
//! (`store::turns`): the lease and the node in the session and turn rows.

use const_format::concatcp;
use deadpool_postgres::GenericClient;

use super::accepting::INSERT_INTERNAL_SQL;
use super::connect::Cached;
use super::{InTx, PostgresStore};
use crate::store::approval::NewApproval;
use crate::store::model::{
    Claim, ClaimedTurn, EVENT_ENTRY, Event, Fits, RenderDelivery, Reservation, Reserving,
    TranscriptRow, TurnEnd,
};
use crate::store::now_millis;
use crate::store::row::StoredRow;
use crate::store::sql::{
    CLAIM_COLUMNS, EARLIER_TURN_SPAN_SQL, END_SESSION_SET, EVENT_HAS_TRANSCRIPT_SQL, HELD_SUMS,
    HISTORY_TURN_START_SQL, HISTORY_TURNS_SQL, JOIN_QUEUED_SET, RECORD_TURN_SPAN_SQL, RELEASE_SQL,
    TRANSCRIPT_SQL,
};
use crate::store::states::{
    IDLE, PENDING, QUEUED, RESUME_PENDING, ResumeReason, SESSION_RUNNING, SUSPENDED, TURN_RUNNING,
};
use crate::store::turns::{self, InternalEvent, Start, TurnTx};
use crate::store::tx::{Param, Tx};
use crate::store::{StoreError, Turns};
use crate::usage::Spent;

/// `$1` limit: the idle sessions with queued events, oldest head first (one partial index;
/// sessions that cannot run are never read); sessions another node is claiming right now are
/// skipped, not waited for. Each with its queue head, the seq of its oldest queued event.
pub(super) const RUNNABLE_SESSIONS_SQL: &str = concatcp!(
    "SELECT s.key AS key, s.queue_head AS head FROM sessions s
     WHERE s.state = ",
    IDLE,
    " AND s.queue_head IS NOT NULL
     ORDER BY s.queue_head LIMIT $1
     FOR UPDATE OF s SKIP LOCKED"
);

/// As [`RUNNABLE_SESSIONS_SQL`], with the routes' priorities counted as waiting. `$1` limit,
/// `$2` the priorities (a JSON object of route name to priority), `$3` the waiting one step is
/// worth. Every idle session with a queued event is read and sorted, so this is used only when
/// some route has a priority. Each session's head is looked up by its seq (a correlated
/// subquery: as a join, PostgreSQL with statistics hashes the whole events table).
pub(super) const PRIORITY_SESSIONS_SQL: &str = concatcp!(
    "SELECT s.key AS key, s.queue_head AS head FROM sessions s
     WHERE s.state = ",
    IDLE,
    " AND s.queue_head IS NOT NULL
     ORDER BY (SELECT e.received_at - coalesce(($2::text::jsonb ->> e.route)::bigint, 0) * $3
               FROM events e WHERE e.seq = s.queue_head),
              s.queue_head
     LIMIT $1
     FOR UPDATE OF s SKIP LOCKED"
);

/// The seqs of the events that must run alone (a few at most, after a crash), from their
/// partial index, as an array computed once: the idle sessions whose head is one of them are
/// then found by it in `sessions_runnable`. Written so that the planner has no other way: as a
/// join, PostgreSQL without statistics hashes every runnable session to meet these few events.
const ALONE_HEADS: &str = concatcp!(
    "FROM sessions s
     WHERE s.state = ",
    IDLE,
    " AND s.queue_head = ANY (ARRAY(SELECT e.seq FROM events e WHERE e.status = ",
    QUEUED,
    " AND e.run_alone))"
);

/// The idle session whose head is the oldest event that must run alone, unless another node
/// is claiming it right now. `$1` limit (so that it reads as the runnable sessions do).
pub(super) const ALONE_SESSIONS_SQL: &str = concatcp!(
    "SELECT s.key AS key, s.queue_head AS head ",
    ALONE_HEADS,
    " ORDER BY s.queue_head LIMIT $1 FOR UPDATE OF s SKIP LOCKED"
);

/// The same, only to look: no lock.
pub(super) const ALONE_WAITING_SQL: &str =
    concatcp!("SELECT EXISTS (SELECT 1 ", ALONE_HEADS, ") AS waiting");

/// Coalescing: `JOIN_QUEUED_SET`.
pub(super) const JOIN_QUEUED_SQL: &str = concatcp!("UPDATE events", JOIN_QUEUED_SET);

/// `$1` a locked session's queue head: its oldest queued event, by its seq (asked as "the
/// session's first queued event by seq", PostgreSQL may walk the queue in seq order).
pub(super) const HEAD_EVENT_SQL: &str = concatcp!(
    "SELECT ",
    CLAIM_COLUMNS,
    " FROM events WHERE seq = $1 AND status = ",
    QUEUED
);

/// `$1` turn id, `$2` session key, `$3` event id, `$4` now, `$5` node name.
pub(super) const START_TURN_SQL: &str = concatcp!(
    "INSERT INTO turns (id, session_key, event_id, status, started_at, node)
     VALUES ($1, $2, $3, ",
    TURN_RUNNING,
    ", $4, $5)"
);

/// `$1` session key, `$2` turn id, `$3` now, `$4` this node, `$5` the lease's length.
pub(super) const START_SESSION_SQL: &str = concatcp!(
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

/// The advisory lock that makes budget reservations one at a time across nodes.
const RESERVATION_LOCK: i64 = 0x6167_6275_6467_6574;

/// `$1` turn id, `$2` event id, `$3` session key, `$4` route, `$5` when it was made (its day),
/// `$6` prompt tokens, `$7` reply tokens, `$8` this node, `$9` `lease_ttl` in milliseconds.
const RESERVE_SQL: &str = "INSERT INTO budget_reservations
         (turn_id, event_id, session_key, route, made_at, input_tokens, output_tokens, node, expires_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, agentgate_now_ms() + $9)";

/// What live reservations hold: those whose node renewed them within `lease_ttl`.
const HELD_SQL: &str = concatcp!(HELD_SUMS, " WHERE expires_at > agentgate_now_ms()");

/// A locked idle session's queue head (its oldest queued event's seq), and whether the claim
/// takes events that must run alone or those that may run beside others.
pub(super) struct Head {
    seq: i64,
    alone: bool,
}

impl PostgresStore {
    /// Locks the idle sessions `claim` looks at, in `tx`; their heads.
    async fn heads(
        tx: &deadpool_postgres::Transaction<'_>,
        claim: &Claim,
    ) -> Result<Vec<Head>, StoreError> {
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
        let alone = *claim == Claim::Alone;
        sessions
            .iter()
            .map(|session| {
                Ok(Head {
                    seq: session.column("head")?,
                    alone,
                })
            })
            .collect()
    }
}

impl<C: GenericClient + Sync> TurnTx for InTx<'_, C> {
    const END_SESSION_SQL: &'static str = END_SESSION_SQL;
    const QUEUE_DELIVERY_SQL: &'static str = QUEUE_DELIVERY_SQL;
    const INTERRUPT_SESSION_SQL: &'static str = INTERRUPT_SESSION_SQL;
    const JOIN_QUEUED_SQL: &'static str = JOIN_QUEUED_SQL;
    const HELD_SQL: &'static str = HELD_SQL;

    /// Locked in this transaction: no other node claims it meanwhile.
    type Candidate = Head;

    async fn claimable(&self, head: &Head) -> Result<Option<ClaimedTurn>, StoreError> {
        let turn = self
            .maybe_row(HEAD_EVENT_SQL, &[&head.seq], |row| {
                ClaimedTurn::decode(row, uuid::Uuid::now_v7().to_string())
            })
            .await?;
        Ok(turn.filter(|turn| turn.alone == head.alone))
    }

    async fn start_rows(&self, start: &Start<'_>) -> Result<(), StoreError> {
        let shared = &self.store.shared;
        let (node, lease) = (&shared.node_id, &shared.lease_ttl_ms);
        self.run_adding(START_TURN_SQL, &start.turn_values(), &[&shared.node_name])
            .await?;
        let asked_at = now_millis();
        self.run_adding(START_SESSION_SQL, &start.session_values(), &[node, lease])
            .await?;
        // Recorded before the claim commits: should it not, no turn of this node runs the
        // session, and the entry ages out unread.
        shared
            .leases
            .set([start.turn.event.session_key.as_str()], asked_at);
        Ok(())
    }

    async fn insert_internal(&self, event: &InternalEvent<'_>) -> Result<(), StoreError> {
        let node = &self.store.shared.node_name;
        self.run_adding(INSERT_INTERNAL_SQL, &event.values(), &[node])
            .await?;
        Ok(())
    }

    /// It expires `lease_ttl` after the last renewal by this node's heartbeat.
    async fn insert_reservation(
        &self,
        values: &[&(dyn Param + Sync); 7],
    ) -> Result<(), StoreError> {
        let shared = &self.store.shared;
        let (node, lease) = (&shared.node_id, &shared.lease_ttl_ms);
        self.run_adding(RESERVE_SQL, values, &[node, lease]).await?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Turns for PostgresStore {
    async fn claim_turns(&self, claim: Claim) -> Result<Vec<ClaimedTurn>, StoreError> {
        self.in_transaction(async |tx| {
            let heads = PostgresStore::heads(tx.tx, &claim).await?;
            turns::claim(tx, &heads).await
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
        self.in_lease(session_key, async |tx| {
            turns::append(tx, session_key, turn_id, &entries, steps, spent).await
        })
        .await
    }

    async fn reserve_budget(
        &self,
        reservation: Reservation,
        fits: Fits,
    ) -> Result<Reserving, StoreError> {
        self.in_transaction(async |tx| {
            // One reservation at a time on every node: each sees what the ones before it hold.
            tx.run("SELECT pg_advisory_xact_lock($1)", &[&RESERVATION_LOCK])
                .await?;
            tx.run(
                "DELETE FROM budget_reservations WHERE expires_at <= agentgate_now_ms()",
                &[],
            )
            .await?;
            turns::reserve(tx, &reservation, &fits).await
        })
        .await
    }

    async fn release_budget(&self, turn_id: &str) -> Result<(), StoreError> {
        self.execute_one(RELEASE_SQL, &[&turn_id]).await.map(drop)
    }

    async fn finish_turn(&self, end: TurnEnd, render: RenderDelivery) -> Result<(), StoreError> {
        self.in_lease(&end.session_key, async |tx| {
            turns::finish(tx, &end, render).await
        })
        .await
    }

    async fn join_queued(&self, head: &Event, window_ms: i64) -> Result<Vec<Event>, StoreError> {
        self.in_lease(&head.session_key, async |tx| {
            turns::join(tx, head, window_ms).await
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
        self.in_lease(session_key, async |tx| {
            turns::interrupt(tx, turn_id, session_key, reason, steps).await
        })
        .await
    }

    async fn await_approval(&self, request: NewApproval, steps: u32) -> Result<(), StoreError> {
        self.in_lease(&request.row.session, async |tx| {
            turns::await_approval(tx, &request, steps).await
        })
        .await
    }

    async fn event_has_transcript(&self, event_id: &str) -> Result<bool, StoreError> {
        self.fetch_one(EVENT_HAS_TRANSCRIPT_SQL, &[&event_id], |row| {
            row.column("found")
        })
        .await
    }

    async fn history_turns(&self, session_key: &str) -> Result<i64, StoreError> {
        self.fetch_one(HISTORY_TURNS_SQL, &[&session_key], |row| {
            row.column("turns")
        })
        .await
    }

    async fn history_turn_start(
        &self,
        session_key: &str,
        nth: i64,
    ) -> Result<Option<i64>, StoreError> {
        self.fetch_optional(HISTORY_TURN_START_SQL, &[&session_key, &nth], |row| {
            row.column("seq")
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
