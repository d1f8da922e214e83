//! The PostgreSQL backend: any number of nodes share one database.
//!
//! Why it looks the way it does:
//! - A session is owned by a lease (`sessions.lease_owner`, `lease_expires_at`, on the database's
//!   clock). A node claims a session's next event under `FOR UPDATE SKIP LOCKED`, so two nodes never
//!   run one session and turns spread over the nodes. Every commit of a turn renews its lease and
//!   is fenced by it: a node whose lease was taken over gets [`StoreError::LeaseLost`] and stops.
//! - A node that dies stops renewing. Once its leases expire, any node's sweep marks those turns
//!   interrupted (`crashed`) and settles them through the same admission rule as a restart: the
//!   retry ledger is a table whose row is counted under a row lock in the transaction that
//!   re-queues the resume, so the count is durable before the resume can run, cluster-wide.
//! - Accepts share transactions (group commit through a few writer tasks); a 2xx still means the
//!   transaction committed on the primary, with the server's `synchronous_commit`.
//! - Every operation is bounded in time: a database that does not answer makes the listener
//!   answer 503, never hang and never 2xx.

mod accept;
mod connect;
mod leases;
mod schema;

use crate::store::states::{
    CRASHED, DELIVERY_FAILED, EVENT_RUNNING, IDLE, NodeState, OPERATOR, PENDING, QUEUED,
    RESUME_PENDING, ResumeReason, SESSION_RUNNING, SUSPENDED, SessionState, StopReason,
    TURN_INTERRUPTED, TURN_RUNNING,
};
use const_format::concatcp;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};
use tokio_util::sync::CancellationToken;

use crate::config::PostgresSettings;
use crate::store::states::{REQUEUE_STOPPED_EVENT_SQL, RESUME_SESSION_SQL, SESSION_SQL};
use crate::store::{
    AcceptOutcome, Backend, ClaimedTurn, DeliveryAttempt, DeliveryCounts, InterruptedSession,
    Ledger, LiveCounts, NewEvent, NodeRow, PendingDelivery, SessionRow, Settled, Settlement,
    StatusSummary, StoreError, TranscriptRow, TurnEnd, ledger::now_rfc3339, model::StoredEvent,
    now_millis, states::LIVE_COUNTS_SQL,
};
use connect::{Cached, bounded, tls_connector};

/// The longest any one database operation may take before it counts as unavailable.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);
/// The most accepts that share one transaction, and how many such transactions run at once.
const ACCEPT_BATCH: usize = 256;
const ACCEPT_WRITERS: usize = 4;
/// How many queued events one claim looks at, at most (as with SQLite).
const CANDIDATE_WINDOW: i64 = 2048;
/// Node rows stay visible in `status` this long after their last heartbeat.
const NODE_HISTORY_MS: i64 = 60 * 60 * 1000;

type AcceptJob = (NewEvent, oneshot::Sender<Result<AcceptOutcome, StoreError>>);

/// A handle to the shared database. Cheap to clone.
#[derive(Clone)]
pub(crate) struct PostgresStore {
    shared: Arc<Shared>,
}

struct Shared {
    pool: Pool,
    /// This run of this node: the owner named in its leases.
    node_id: String,
    node_name: String,
    lease_ttl_ms: i64,
    writable: AtomicBool,
    /// When the heartbeat last finished a round, whatever its outcome (unix ms).
    heartbeat_round_at: AtomicI64,
    /// Accepts waiting for a group commit (daemon only).
    accepts: Option<mpsc::UnboundedSender<AcceptJob>>,
    /// Stops the heartbeat at release.
    stop: CancellationToken,
}

impl PostgresStore {
    /// Connects. As the daemon (`serve`), also migrates the schema, registers this node, and
    /// starts the accept writers and the lease heartbeat.
    pub(crate) async fn open(
        settings: &PostgresSettings,
        serve: bool,
    ) -> Result<PostgresStore, StoreError> {
        let url = std::str::from_utf8(settings.url.expose())
            .ok()
            .and_then(|text| text.trim().parse::<tokio_postgres::Config>().ok())
            .ok_or_else(|| {
                // The text may hold a password: say where it came from, never what it was.
                StoreError::Setup(format!(
                    "store.url ({}) is not a PostgreSQL connection string or URL",
                    settings.url
                ))
            })?;
        let mut config = url;
        // A node frozen inside a transaction (SIGSTOP, a stalled VM) would hold its row locks and
        // block every other node's takeover: the server ends such a transaction once it has
        // been idle for about a lease.
        let idle_limit = settings
            .lease_ttl
            .clamp(Duration::from_secs(1), Duration::from_secs(10))
            .as_millis();
        let options = format!(
            "{} -c idle_in_transaction_session_timeout={idle_limit}",
            config.get_options().unwrap_or_default()
        );
        config
            .connect_timeout(Duration::from_secs(5))
            .application_name(format!("agentgate {}", settings.node))
            .options(options.trim());
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        // TLS when the URL asks for it (`sslmode=require`), always with the server's
        // certificate verified; otherwise plain connections, as libpq's `prefer` would fall back.
        let manager = if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
            let tls = tls_connector(settings.ca_file.as_deref())?;
            Manager::from_config(config, tls, manager_config)
        } else {
            Manager::from_config(config, NoTls, manager_config)
        };
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(OPERATION_TIMEOUT))
            .create_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(|err| StoreError::Setup(format!("connection pool: {err}")))?;
        let (accepts, receiver) = if serve {
            let (sender, receiver) = mpsc::unbounded_channel();
            (Some(sender), Some(receiver))
        } else {
            (None, None)
        };
        let store = PostgresStore {
            shared: Arc::new(Shared {
                pool,
                node_id: uuid::Uuid::now_v7().to_string(),
                node_name: settings.node.clone(),
                lease_ttl_ms: i64::try_from(settings.lease_ttl.as_millis()).unwrap_or(i64::MAX),
                writable: AtomicBool::new(true),
                heartbeat_round_at: AtomicI64::new(now_millis()),
                accepts,
                stop: CancellationToken::new(),
            }),
        };
        if let Some(receiver) = receiver {
            bounded(store.migrate()).await?;
            bounded(store.register()).await?;
            let receiver = Arc::new(Mutex::new(receiver));
            for _ in 0..ACCEPT_WRITERS {
                tokio::spawn(store.clone().accept_writer(receiver.clone()));
            }
            tokio::spawn(store.clone().heartbeat(settings.lease_ttl));
        }
        Ok(store)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        Ok(self.shared.pool.get().await?)
    }

    /// One statement on a pooled connection, bounded in time; the number of rows it changed.
    async fn execute_one(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        bounded(async { self.client().await?.run(sql, params).await }).await
    }

    /// One query on a pooled connection, bounded in time.
    async fn select(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        bounded(async { self.client().await?.rows(sql, params).await }).await
    }

    async fn select_one(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, StoreError> {
        bounded(async { self.client().await?.row(sql, params).await }).await
    }

    async fn select_optional(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError> {
        bounded(async { self.client().await?.maybe_row(sql, params).await }).await
    }

    fn set_writable(&self, writable: bool) {
        let was = self.shared.writable.swap(writable, Ordering::AcqRel);
        match (was, writable) {
            (true, false) => {
                tracing::error!("PostgreSQL cannot be written; answering 503 until it can again");
            }
            (false, true) => tracing::info!("PostgreSQL writes succeed again; accepting events"),
            _ => {}
        }
    }
}

/// Ends a turn's rows: the turn, its event's terminal status, its session (lease released) and
/// its delivery, as one part of the caller's transaction.
async fn finish_rows(
    tx: &deadpool_postgres::Transaction<'_>,
    end: &TurnEnd,
) -> Result<(), StoreError> {
    let now = now_millis();
    tx.run(
        "UPDATE turns SET status = $2, reason = $3, output = $4, error = $5, steps = $6, finished_at = $7
         WHERE id = $1",
        &[
            &end.turn_id,
            &end.turn_status.sql(),
            &end.reason.map(StopReason::sql),
            &end.output,
            &end.error,
            &i64::from(end.steps),
            &now,
        ],
    )
    .await?;
    tx.run(
        "UPDATE events SET status = $2, updated_at = $3 WHERE id = $1",
        &[&end.event_id, &end.event_status.sql(), &now],
    )
    .await?;
    // An operator's suspension made while the turn ran stays in force.
    tx.run(
        concatcp!(
            "UPDATE sessions SET state = CASE WHEN state = ",
            SUSPENDED,
            " THEN ",
            SUSPENDED,
            " ELSE $2 END,
             reason = CASE WHEN state = ",
            SUSPENDED,
            " THEN reason ELSE $3 END, updated_at = $4,
             lease_owner = NULL, lease_expires_at = NULL
         WHERE key = $1"
        ),
        &[
            &end.session_key,
            &end.session_state().sql(),
            &end.reason.map(StopReason::sql),
            &now,
        ],
    )
    .await?;
    let body = end
        .delivery_body()
        .map_err(|err| StoreError::Unavailable(format!("delivery body: {err}")))?;
    tx.run(
        concatcp!("INSERT INTO deliveries (event_id, route, session_key, body, status, attempts, next_attempt_at,
                                 created_at, updated_at)
         VALUES ($1, $2, $3, $4, ", PENDING, ", 0, $5, $5, $5)
         ON CONFLICT (event_id) DO UPDATE SET body = EXCLUDED.body, status = ", PENDING, ", attempts = 0,
             next_attempt_at = EXCLUDED.next_attempt_at, updated_at = EXCLUDED.updated_at,
             lease_owner = NULL, lease_expires_at = NULL"),
        &[&end.event_id, &end.route, &end.session_key, &body, &now],
    )
    .await?;
    Ok(())
}

/// Puts an interrupted session's event back at the head of its queue, marked as a resume.
async fn requeue_rows(
    tx: &deadpool_postgres::Transaction<'_>,
    event_id: &str,
    session_key: &str,
    reason: ResumeReason,
) -> Result<(), StoreError> {
    let now = now_millis();
    tx.run(
        concatcp!(
            "UPDATE events SET status = ",
            QUEUED,
            ", resume_reason = $2, updated_at = $3 WHERE id = $1"
        ),
        &[&event_id, &reason.sql(), &now],
    )
    .await?;
    tx.run(
        concatcp!(
            "UPDATE sessions SET state = ",
            IDLE,
            ", updated_at = $2 WHERE key = $1"
        ),
        &[&session_key, &now],
    )
    .await?;
    Ok(())
}

fn session_row(row: &tokio_postgres::Row) -> SessionRow {
    SessionRow {
        key: row.get(0),
        route: row.get(1),
        state: row.get(2),
        reason: row.get(3),
        last_turn_id: row.get(4),
        last_turn_status: row.get(5),
        turns: row.get(6),
        queued: row.get(7),
        updated_at: row.get(8),
    }
}

async fn grouped(
    client: &deadpool_postgres::Client,
    sql: &str,
) -> Result<std::collections::BTreeMap<String, i64>, StoreError> {
    Ok(client
        .rows(sql, &[])
        .await?
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect())
}

#[async_trait::async_trait]
impl Backend for PostgresStore {
    async fn accept(&self, event: NewEvent) -> Result<AcceptOutcome, StoreError> {
        let accepts = self.shared.accepts.as_ref().ok_or_else(|| {
            StoreError::Unavailable("this store handle does not accept events".into())
        })?;
        let (reply, answer) = oneshot::channel();
        accepts
            .send((event, reply))
            .map_err(|_| StoreError::Unavailable("the accept writers have stopped".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Unavailable("the accept writers have stopped".into()))?
    }

    async fn enqueue_internal(
        &self,
        session_key: &str,
        route: &str,
        event_type: &str,
        payload: serde_json::Value,
    ) -> Result<String, StoreError> {
        let id = uuid::Uuid::now_v7().to_string();
        self.execute_one(
            concatcp!("INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                                     received_at, status, updated_at, origin, node)
                 VALUES ($1, $2, $3, $4, NULL, '{}', $5, $6, ", QUEUED, ", $6, 'background', $7)"),
            &[
                &id,
                &route,
                &session_key,
                &event_type,
                &payload.to_string().into_bytes(),
                &now_millis(),
                &self.shared.node_name,
            ],
        )
        .await?;
        Ok(id)
    }

    async fn prune_dedup(&self, before: i64) -> Result<usize, StoreError> {
        let pruned = self
            .execute_one("DELETE FROM dedup WHERE seen_at < $1", &[&before])
            .await?;
        Ok(pruned as usize)
    }

    async fn claim_turns(&self, limit: usize) -> Result<Vec<ClaimedTurn>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            // The oldest queued event of each idle session among the oldest queued events (a
            // bounded window, so a deep backlog does not make every claim scan it), oldest
            // first; sessions another node is claiming right now are skipped, not waited for.
            let sessions = tx
                .rows(
                    concatcp!("SELECT s.key FROM sessions s
                     JOIN (SELECT session_key, min(seq) AS first_seq
                           FROM (SELECT session_key, seq FROM events WHERE status = ", QUEUED, "
                                 ORDER BY seq LIMIT $2) oldest
                           GROUP BY session_key) q ON q.session_key = s.key
                     WHERE s.state = ", IDLE, "
                     ORDER BY q.first_seq LIMIT $1
                     FOR UPDATE OF s SKIP LOCKED"),
                    &[&(limit as i64), &CANDIDATE_WINDOW],
                )
                .await?;
            let mut claimed = Vec::with_capacity(sessions.len());
            for session in sessions {
                let session_key: String = session.get(0);
                let Some(row) = tx
                    .maybe_row(
                        concatcp!("SELECT id, route, session_key, event_type, delivery_id, headers, payload, resume_reason
                         FROM events WHERE session_key = $1 AND status = ", QUEUED, " ORDER BY seq LIMIT 1"),
                        &[&session_key],
                    )
                    .await?
                else {
                    continue;
                };
                let event = StoredEvent {
                    id: row.get(0),
                    route: row.get(1),
                    session_key: row.get(2),
                    event_type: row.get(3),
                    delivery_id: row.get(4),
                    headers: row.get(5),
                    payload: row.get(6),
                    resume_reason: row.get::<_, Option<&str>>(7).map(ResumeReason::from_sql),
                };
                let turn_id = uuid::Uuid::now_v7().to_string();
                let now = now_millis();
                tx.run(
                    concatcp!("UPDATE events SET status = ", EVENT_RUNNING, ", resume_reason = NULL, updated_at = $2 WHERE id = $1"),
                    &[&event.id, &now],
                )
                .await?;
                tx.run(
                    concatcp!("INSERT INTO turns (id, session_key, event_id, status, started_at, node)
                     VALUES ($1, $2, $3, ", TURN_RUNNING, ", $4, $5)"),
                    &[&turn_id, &event.session_key, &event.id, &now, &self.shared.node_name],
                )
                .await?;
                tx.run(
                    concatcp!("UPDATE sessions SET state = ", SESSION_RUNNING, ", reason = NULL, last_turn_id = $2, updated_at = $3,
                         lease_owner = $4, lease_expires_at = agentgate_now_ms() + $5,
                         interrupt_requested = false
                     WHERE key = $1"),
                    &[
                        &event.session_key,
                        &turn_id,
                        &now,
                        &self.shared.node_id,
                        &self.shared.lease_ttl_ms,
                    ],
                )
                .await?;
                claimed.push(ClaimedTurn { turn_id, event });
            }
            tx.commit().await?;
            Ok(claimed)
        })
        .await
    }

    async fn append_transcript(
        &self,
        session_key: &str,
        turn_id: &str,
        entries: Vec<(&'static str, String)>,
        steps: u32,
    ) -> Result<(), StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, session_key).await?;
            let now = now_millis();
            for (kind, body) in &entries {
                tx.run(
                    "INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at)
                     VALUES ($1, COALESCE((SELECT max(seq) FROM transcript WHERE session_key = $1), 0) + 1,
                             $2, $3, $4, $5)",
                    &[&session_key, &turn_id, kind, body, &now],
                )
                .await?;
            }
            tx.run(
                "UPDATE turns SET steps = $2 WHERE id = $1",
                &[&turn_id, &i64::from(steps)],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn finish_turn(&self, end: TurnEnd) -> Result<(), StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, &end.session_key).await?;
            finish_rows(&tx, &end).await?;
            tx.commit().await?;
            Ok(())
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
                concatcp!(
                    "UPDATE turns SET status = ",
                    TURN_INTERRUPTED,
                    ", reason = $2, steps = $3, finished_at = $4 WHERE id = $1"
                ),
                &[&turn_id, &reason, &i64::from(steps), &now],
            )
            .await?;
            // The lease goes with it: another node resumes the session at once. An operator's
            // suspension stays in force: the interrupted event waits for `sessions resume`.
            tx.run(
                concatcp!(
                    "UPDATE sessions SET state = CASE WHEN state = ",
                    SUSPENDED,
                    " THEN state ELSE ",
                    RESUME_PENDING,
                    " END, reason = CASE WHEN state = ",
                    SUSPENDED,
                    " THEN reason ELSE $2 END, updated_at = $3,
                     lease_owner = NULL, lease_expires_at = NULL
                 WHERE key = $1"
                ),
                &[&session_key, &reason, &now],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn mark_crashed_turns(&self) -> Result<usize, StoreError> {
        let now = now_millis();
        let lost = self
            .execute_one(
                concatcp!(
                    "WITH lost AS (
                     UPDATE sessions SET state = ",
                    RESUME_PENDING,
                    ", reason = ",
                    CRASHED,
                    ", updated_at = $1,
                         lease_owner = NULL, lease_expires_at = NULL
                     WHERE state = ",
                    SESSION_RUNNING,
                    " AND lease_expires_at < agentgate_now_ms()
                     RETURNING last_turn_id)
                 UPDATE turns SET status = ",
                    TURN_INTERRUPTED,
                    ", reason = ",
                    CRASHED,
                    ", finished_at = $1
                 FROM lost WHERE turns.id = lost.last_turn_id AND turns.status = ",
                    TURN_RUNNING
                ),
                &[&now],
            )
            .await?;
        Ok(lost as usize)
    }

    async fn interrupted_sessions(&self) -> Result<Vec<InterruptedSession>, StoreError> {
        let rows = self
            .select(
                concatcp!(
                    "SELECT s.key, s.route, COALESCE(s.reason, ",
                    CRASHED,
                    "), t.id, t.event_id, t.steps, t.started_at
                 FROM sessions s JOIN turns t ON t.id = s.last_turn_id
                 WHERE s.state = ",
                    RESUME_PENDING,
                    " AND s.lease_owner IS NULL
                 ORDER BY t.started_at"
                ),
                &[],
            )
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| InterruptedSession {
                session_key: row.get(0),
                route: row.get(1),
                reason: ResumeReason::from_sql(row.get(2)),
                turn_id: row.get(3),
                event_id: row.get(4),
                steps: u32::try_from(row.get::<_, i64>(5)).unwrap_or(u32::MAX),
                started_at: row.get(6),
            })
            .collect())
    }

    async fn settle_interrupted(
        &self,
        session: &InterruptedSession,
        settlement: Settlement,
    ) -> Result<Settled, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            // Whoever locks the session settles it; the others skip it.
            let still_interrupted = tx
                .maybe_row(
                    concatcp!("SELECT 1 FROM sessions
                     WHERE key = $1 AND state = ", RESUME_PENDING, " AND last_turn_id = $2
                     FOR UPDATE SKIP LOCKED"),
                    &[&session.session_key, &session.turn_id],
                )
                .await?;
            if still_interrupted.is_none() {
                return Ok(Settled::NotInterrupted);
            }
            let max_attempts = match settlement {
                Settlement::Abandon => {
                    finish_rows(&tx, &session.abandoned()).await?;
                    tx.commit().await?;
                    return Ok(Settled::Abandoned);
                }
                Settlement::Admit { max_attempts } => max_attempts,
            };
            // The count, under the ledger row's lock, in the transaction that queues the resume.
            let attempt: i64 = tx
                .row(
                    "INSERT INTO resume_ledger (session_key, attempts, last_attempt) VALUES ($1, 1, $2)
                     ON CONFLICT (session_key) DO UPDATE
                         SET attempts = resume_ledger.attempts + 1, last_attempt = EXCLUDED.last_attempt
                     RETURNING attempts",
                    &[&session.session_key, &now_rfc3339()],
                )
                .await?
                .get(0);
            let attempt = u64::try_from(attempt).unwrap_or(u64::MAX);
            if attempt > u64::from(max_attempts) {
                finish_rows(&tx, &session.suspended(max_attempts)).await?;
                tx.run(
                    "DELETE FROM resume_ledger WHERE session_key = $1",
                    &[&session.session_key],
                )
                .await?;
                tx.commit().await?;
                return Ok(Settled::Suspended);
            }
            requeue_rows(&tx, &session.event_id, &session.session_key, session.reason).await?;
            tx.commit().await?;
            Ok(Settled::Resumed { attempt })
        })
        .await
    }

    async fn clear_resume_count(&self, session_key: &str) -> Result<(), StoreError> {
        self.execute_one(
            "DELETE FROM resume_ledger WHERE session_key = $1",
            &[&session_key],
        )
        .await?;
        Ok(())
    }

    async fn event_has_transcript(&self, event_id: &str) -> Result<bool, StoreError> {
        Ok(self
            .select_one(
                "SELECT EXISTS (SELECT 1 FROM transcript t JOIN turns u ON u.id = t.turn_id
                                WHERE u.event_id = $1)",
                &[&event_id],
            )
            .await?
            .get(0))
    }

    async fn transcript(&self, session_key: &str) -> Result<Vec<TranscriptRow>, StoreError> {
        let rows = self
            .select(
                "SELECT seq, turn_id, kind, body, created_at FROM transcript
                 WHERE session_key = $1 ORDER BY seq",
                &[&session_key],
            )
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                TranscriptRow::new(row.get(0), row.get(1), row.get(2), row.get(3), row.get(4))
            })
            .collect())
    }

    async fn due_deliveries(&self, limit: usize) -> Result<Vec<PendingDelivery>, StoreError> {
        let rows = self
            .select(
                concatcp!("UPDATE deliveries SET lease_owner = $1, lease_expires_at = agentgate_now_ms() + $2
                 WHERE event_id IN (
                     SELECT event_id FROM deliveries
                     WHERE status = ", PENDING, " AND next_attempt_at <= $3
                       AND (lease_owner IS NULL OR lease_expires_at < agentgate_now_ms())
                     ORDER BY next_attempt_at LIMIT $4
                     FOR UPDATE SKIP LOCKED)
                 RETURNING event_id, route, session_key, body, attempts, next_attempt_at"),
                &[
                    &self.shared.node_id,
                    &self.shared.lease_ttl_ms,
                    &now_millis(),
                    &(limit as i64),
                ],
            )
            .await?;
        let mut due: Vec<(i64, PendingDelivery)> = rows
            .into_iter()
            .map(|row| {
                (
                    row.get(5),
                    PendingDelivery {
                        event_id: row.get(0),
                        route: row.get(1),
                        session_key: row.get(2),
                        body: row.get(3),
                        attempts: u32::try_from(row.get::<_, i64>(4)).unwrap_or(u32::MAX),
                    },
                )
            })
            .collect();
        due.sort_by_key(|(at, _)| *at);
        Ok(due.into_iter().map(|(_, delivery)| delivery).collect())
    }

    async fn record_delivery_attempt(
        &self,
        event_id: &str,
        outcome: DeliveryAttempt,
    ) -> Result<(), StoreError> {
        let now = now_millis();
        let (status, next, error) = outcome.columns(now);
        self.execute_one(
            "UPDATE deliveries SET status = $2, attempts = attempts + 1, next_attempt_at = $3,
                     last_error = $4, updated_at = $5, lease_owner = NULL, lease_expires_at = NULL
                 WHERE event_id = $1",
            &[&event_id, &status.sql(), &next, &error, &now],
        )
        .await?;
        Ok(())
    }

    async fn live_counts(&self) -> Result<LiveCounts, StoreError> {
        let row = self.select_one(LIVE_COUNTS_SQL, &[]).await?;
        Ok(LiveCounts {
            queued: row.get(0),
            resume_pending: row.get(1),
            suspended: row.get(2),
        })
    }

    async fn status_summary(&self) -> Result<StatusSummary, StoreError> {
        bounded(async {
            let client = self.client().await?;
            let by_status = grouped(
                &client,
                "SELECT status, count(*) FROM events WHERE origin = 'webhook' GROUP BY status",
            )
            .await?;
            let by_state = grouped(
                &client,
                "SELECT state, count(*) FROM sessions GROUP BY state",
            )
            .await?;
            let deliveries = client
                .row(
                    concatcp!(
                        "SELECT count(*) FILTER (WHERE status = ",
                        PENDING,
                        "),
                            count(*) FILTER (WHERE status = ",
                        DELIVERY_FAILED,
                        ")
                     FROM deliveries"
                    ),
                    &[],
                )
                .await?;
            let deliveries = DeliveryCounts {
                pending: deliveries.get(0),
                failed: deliveries.get(1),
            };
            let nodes = self.nodes(&client).await?;
            Ok(StatusSummary::from_counts(
                by_status,
                by_state,
                deliveries,
                Some(nodes),
            ))
        })
        .await
    }

    async fn sessions(&self) -> Result<Vec<SessionRow>, StoreError> {
        let rows = self
            .select(&format!("{SESSION_SQL} ORDER BY s.updated_at DESC"), &[])
            .await?;
        Ok(rows.iter().map(session_row).collect())
    }

    async fn session(&self, key: &str) -> Result<Option<SessionRow>, StoreError> {
        let row = self
            .select_optional(&format!("{SESSION_SQL} WHERE s.key = $1"), &[&key])
            .await?;
        Ok(row.as_ref().map(session_row))
    }

    async fn operator_resume(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let Some(row) = tx
                .maybe_row(
                    "SELECT state FROM sessions WHERE key = $1 FOR UPDATE",
                    &[&key],
                )
                .await?
            else {
                return Ok(None);
            };
            let state = session_state_of(row.get(0))?;
            let now = now_millis();
            tx.run("DELETE FROM resume_ledger WHERE session_key = $1", &[&key])
                .await?;
            tx.run(REQUEUE_STOPPED_EVENT_SQL, &[&key, &now]).await?;
            tx.run(RESUME_SESSION_SQL, &[&key, &now]).await?;
            tx.commit().await?;
            Ok(Some(state))
        })
        .await
    }

    async fn operator_suspend(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        let row = self
            .select_optional(
                concatcp!(
                    "UPDATE sessions n SET state = ",
                    SUSPENDED,
                    ", reason = ",
                    OPERATOR,
                    ", updated_at = $2
                 FROM sessions o WHERE n.key = $1 AND o.key = n.key
                 RETURNING o.state"
                ),
                &[&key, &now_millis()],
            )
            .await?;
        row.map(|row| session_state_of(row.get(0))).transpose()
    }

    async fn resume_ledger(&self) -> Result<Ledger, StoreError> {
        let mut ledger = Ledger::default();
        for row in self
            .select(
                "SELECT session_key, attempts, last_attempt FROM resume_ledger ORDER BY session_key",
                &[],
            )
            .await?
        {
            let key: String = row.get(0);
            let attempts = u64::try_from(row.get::<_, i64>(1)).unwrap_or(0);
            ledger.insert(&key, attempts, row.get(2));
        }
        Ok(ledger)
    }

    /// The heartbeat keeps running, whether or not the database answers it: a database that is
    /// down is a 503 and a failing `/readyz`, not a wedged process for the watchdog to restart.
    async fn answers(&self) -> bool {
        let silent_for = now_millis() - self.shared.heartbeat_round_at.load(Ordering::Acquire);
        let round = OPERATION_TIMEOUT + Duration::from_secs(2);
        silent_for < i64::try_from(round.as_millis()).unwrap_or(i64::MAX)
    }

    async fn request_interrupt(&self, session_key: &str) -> Result<(), StoreError> {
        self.execute_one(
            concatcp!(
                "UPDATE sessions SET interrupt_requested = true
                 WHERE key = $1 AND state = ",
                SESSION_RUNNING,
                " AND lease_owner <> $2"
            ),
            &[&session_key, &self.shared.node_id],
        )
        .await?;
        Ok(())
    }

    async fn interrupts_requested(&self) -> Result<Vec<String>, StoreError> {
        let rows = self
            .select(
                "UPDATE sessions SET interrupt_requested = false
                 WHERE lease_owner = $1 AND interrupt_requested
                 RETURNING key",
                &[&self.shared.node_id],
            )
            .await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    async fn release(&self) {
        self.shared.stop.cancel();
        let released = bounded(async {
            let client = self.client().await?;
            client
                .run(
                    "UPDATE deliveries SET lease_owner = NULL, lease_expires_at = NULL WHERE lease_owner = $1",
                    &[&self.shared.node_id],
                )
                .await?;
            client
                .run(
                    "UPDATE nodes SET stopped_at = $2, heartbeat_at = $2 WHERE id = $1",
                    &[&self.shared.node_id, &now_millis()],
                )
                .await?;
            Ok(())
        })
        .await;
        if let Err(err) = released {
            tracing::warn!(error = %err, "cannot hand this node's delivery leases back; they expire");
        }
    }

    fn is_writable(&self) -> bool {
        self.shared.writable.load(Ordering::Acquire)
    }

    /// A quarter of the lease, at most a second: sessions handed back by a draining node are
    /// picked up within about a second, expired leases within `lease_ttl` plus this.
    fn failover_interval(&self) -> Option<Duration> {
        let ttl = Duration::from_millis(u64::try_from(self.shared.lease_ttl_ms).unwrap_or(0));
        Some((ttl / 4).clamp(Duration::from_millis(250), Duration::from_secs(1)))
    }
}

/// A session state read from the database; text this agentgate does not know means the schema is
/// newer than it, which the migration check should have refused.
fn session_state_of(text: &str) -> Result<SessionState, StoreError> {
    SessionState::from_sql(text)
        .ok_or_else(|| StoreError::Setup(format!("unknown session state {text:?} in the database")))
}
