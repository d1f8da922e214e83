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
mod inspect;
mod leases;
mod outbox;
mod schema;
mod turns;

use crate::store::inspect::{
    DELIVERIES_SQL, EVENT_DELIVERY_SQL, EVENT_SQL, EVENT_TURNS_SQL, EVENTS_SQL, FAILED_STATUS,
    REPLAY_SQL, RETRY_SQL, payload_value,
};
use crate::store::states::{
    CRASHED, DELIVERY_FAILED, EVENT_RUNNING, IDLE, NodeState, OPERATOR, PENDING, QUEUED,
    RESUME_PENDING, ResumeReason, SESSION_RUNNING, SUSPENDED, SessionState, StopReason,
    TURN_INTERRUPTED, TURN_RUNNING,
};
use crate::store::{DeliveryRow, EventDetail, EventFilter, EventRow, RetryTarget};
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
use crate::store::states::{
    REQUEUE_STOPPED_EVENT_SQL, RESUME_SESSION_SQL, SESSION_SQL, SESSIONS_PAGE_SQL,
};
use crate::store::{
    AcceptOutcome, Accepting, ClaimedTurn, Coordination, DeliveryAttempt, DeliveryCounts,
    Inspection, InterruptedSession, Ledger, LiveCounts, NewEvent, NodeRow, Operator, Outbox,
    PendingDelivery, Recovery, RenderDelivery, SessionRow, Settled, Settlement, StatusSummary,
    StoreError, TranscriptRow, TurnEnd, Turns,
    ledger::now_rfc3339,
    model::{EVENT_ENTRY, Event, transcript_query},
    now_millis,
    states::LIVE_COUNTS_SQL,
};
use connect::{Cached, bounded, tls_connector};

/// The longest any one database operation may take before it counts as unavailable.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);
/// The most accepts that share one transaction, and how many such transactions run at once.
const ACCEPT_BATCH: usize = 256;
const ACCEPT_WRITERS: usize = 4;
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

fn session_row(row: &tokio_postgres::Row) -> Result<SessionRow, StoreError> {
    Ok(SessionRow {
        key: row.get(0),
        route: row.get(1),
        state: row.try_get(2)?,
        reason: row.get(3),
        last_turn_id: row.get(4),
        last_turn_status: row.get(5),
        turns: row.get(6),
        queued: row.get(7),
        updated_at: row.get(8),
    })
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
impl Inspection for PostgresStore {
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
        rows.iter().map(session_row).collect()
    }

    async fn sessions_page(
        &self,
        after: Option<String>,
        limit: i64,
    ) -> Result<Vec<SessionRow>, StoreError> {
        let rows = self.select(SESSIONS_PAGE_SQL, &[&after, &limit]).await?;
        rows.iter().map(session_row).collect()
    }

    async fn session(&self, key: &str) -> Result<Option<SessionRow>, StoreError> {
        let row = self
            .select_optional(&format!("{SESSION_SQL} WHERE s.key = $1"), &[&key])
            .await?;
        row.as_ref().map(session_row).transpose()
    }

    async fn events(&self, filter: EventFilter) -> Result<Vec<EventRow>, StoreError> {
        let rows = self
            .select(
                EVENTS_SQL,
                &[
                    &filter.status,
                    &filter.route,
                    &filter.session,
                    &filter.limit,
                    &filter.before,
                ],
            )
            .await?;
        Ok(rows.iter().map(inspect::event_row).collect())
    }

    async fn event(&self, id: &str) -> Result<Option<EventDetail>, StoreError> {
        let Some(row) = self.select_optional(EVENT_SQL, &[&id]).await? else {
            return Ok(None);
        };
        let turns = self.select(EVENT_TURNS_SQL, &[&id]).await?;
        let delivery = self.select_optional(EVENT_DELIVERY_SQL, &[&id]).await?;
        Ok(Some(EventDetail {
            event: inspect::event_row(&row),
            payload: payload_value(row.get::<_, &[u8]>(9)),
            headers: serde_json::from_str(row.get::<_, &str>(10)).unwrap_or_default(),
            turns: turns.iter().map(inspect::turn_row).collect(),
            delivery: delivery.as_ref().map(inspect::delivery_row),
        }))
    }

    async fn deliveries(
        &self,
        failed_only: bool,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, StoreError> {
        let status = failed_only.then_some(FAILED_STATUS);
        let rows = self.select(DELIVERIES_SQL, &[&status, &limit]).await?;
        Ok(rows.iter().map(inspect::delivery_row).collect())
    }
}

#[async_trait::async_trait]
impl Coordination for PostgresStore {
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
