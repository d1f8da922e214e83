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

mod accepting;
mod approvals;
mod connect;
mod coordination;
mod inspection;
mod operator;
mod outbox;
#[cfg(test)]
mod plans;
mod recovery;
mod schema;
mod turns;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};
use tokio_util::sync::CancellationToken;

use crate::config::PostgresSettings;
use crate::store::model::{AcceptOutcome, NewEvent};
use crate::store::tx::{Tx, Values};
use crate::store::{StoreError, now_millis};
use connect::{Cached, Transport, bounded, encryption_only_connector, local_hosts, tls_connector};

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
    /// When this node last set each of its sessions' leases.
    leases: coordination::Leases,
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
        let transport = Transport::of(config.get_ssl_mode(), settings.ca_file.as_deref());
        let local = local_hosts(&config);
        let manager = match transport {
            Transport::Plain => Manager::from_config(config, NoTls, manager_config),
            Transport::Verified => {
                let tls = tls_connector(settings.ca_file.as_deref())?;
                Manager::from_config(config, tls, manager_config)
            }
            Transport::EncryptedOnly => {
                Manager::from_config(config, encryption_only_connector()?, manager_config)
            }
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
                leases: coordination::Leases::default(),
                accepts,
                stop: CancellationToken::new(),
            }),
        };
        if let Some(receiver) = receiver {
            bounded(store.migrate()).await?;
            if !local {
                store.warn_of_transport(transport).await;
            }
            bounded(store.register()).await?;
            let receiver = Arc::new(Mutex::new(receiver));
            for _ in 0..ACCEPT_WRITERS {
                tokio::spawn(store.clone().accept_writer(receiver.clone()));
            }
            tokio::spawn(store.clone().heartbeat(settings.lease_ttl));
        }
        Ok(store)
    }

    /// Says in the journal when the connection to a server off this machine is not encrypted, or
    /// encrypted without the server authenticated.
    async fn warn_of_transport(&self, transport: Transport) {
        let encrypted = self
            .fetch_one(
                "SELECT coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false) AS ssl",
                &[],
                |row| crate::store::row::StoredRow::column::<bool>(row, "ssl"),
            )
            .await;
        match (encrypted, transport) {
            (Ok(false), _) => tracing::warn!(
                "the connection to PostgreSQL is not encrypted, and the server is on another \
                 machine: its traffic (events, transcripts, the password) crosses the network \
                 in clear; enable TLS on the server and set sslmode=require with store.ca_file"
            ),
            (Ok(true), Transport::EncryptedOnly) => tracing::warn!(
                "the connection to PostgreSQL is encrypted, but the server is not authenticated \
                 (no sslmode, no store.ca_file): set sslmode=require and store.ca_file to its CA"
            ),
            (Ok(true), Transport::Verified | Transport::Plain) => {}
            (Err(err), _) => {
                tracing::warn!(error = %err, "could not tell whether the connection to PostgreSQL is encrypted");
            }
        }
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

    /// One query on a pooled connection, bounded in time, every row decoded.
    async fn fetch<T>(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        decode: impl Fn(&Row) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        let rows = bounded(async { self.client().await?.rows(sql, params).await }).await?;
        rows.iter().map(decode).collect()
    }

    /// One query that answers at most one row.
    async fn fetch_optional<T>(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        decode: impl Fn(&Row) -> Result<T, StoreError>,
    ) -> Result<Option<T>, StoreError> {
        let row = bounded(async { self.client().await?.maybe_row(sql, params).await }).await?;
        row.as_ref().map(decode).transpose()
    }

    /// One query that answers exactly one row.
    async fn fetch_one<T>(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        decode: impl Fn(&Row) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let row = bounded(async { self.client().await?.row(sql, params).await }).await?;
        decode(&row)
    }

    /// Runs `script` in one transaction, and commits it once the script succeeded.
    async fn in_transaction<T>(
        &self,
        script: impl AsyncFnOnce(&InTx<'_, deadpool_postgres::Transaction<'_>>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let done = script(&InTx {
                tx: &tx,
                store: self,
            })
            .await;
            // A failed script's locks go before its error is answered: the drop only queues
            // the rollback, and a claim made meanwhile (`SKIP LOCKED`) would pass rows by.
            let done = match done {
                Ok(done) => done,
                Err(err) => {
                    if let Err(rollback) = tx.rollback().await {
                        tracing::warn!(error = %rollback, "rolling back a failed transaction");
                    }
                    return Err(err);
                }
            };
            tx.commit().await?;
            Ok(done)
        })
        .await
    }

    /// As [`PostgresStore::in_transaction`], in a transaction that first renews `session_key`'s
    /// lease, which this node must hold (else [`StoreError::LeaseLost`], and nothing is written).
    async fn in_lease<T>(
        &self,
        session_key: &str,
        script: impl AsyncFnOnce(&InTx<'_, deadpool_postgres::Transaction<'_>>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let asked_at = now_millis();
        let done = self
            .in_transaction(async move |tx| {
                self.hold_lease(tx.tx, session_key).await?;
                script(tx).await
            })
            .await?;
        self.shared.leases.set([session_key], asked_at);
        Ok(done)
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

/// One open transaction, as the scripts written once for both backends run it
/// (`store::turns`), or a pooled connection for a script of one statement; `store` names this
/// node in the rows that carry it.
struct InTx<'a, C> {
    tx: &'a C,
    store: &'a PostgresStore,
}

/// The values of a shared statement, as the driver takes them.
fn bound<'v>(values: &'v Values<'v>) -> Vec<&'v (dyn ToSql + Sync)> {
    values
        .iter()
        .map(|value| *value as &(dyn ToSql + Sync))
        .collect()
}

impl<C: GenericClient + Sync> InTx<'_, C> {
    /// Runs `sql` with the values a script gives, followed by `own`: this node's, which only
    /// this backend's rows carry.
    async fn run_adding(
        &self,
        sql: &str,
        values: &Values<'_>,
        own: &Values<'_>,
    ) -> Result<u64, StoreError> {
        let values: Vec<&(dyn ToSql + Sync)> = values
            .iter()
            .chain(own)
            .map(|value| *value as &(dyn ToSql + Sync))
            .collect();
        self.tx.run(sql, &values).await
    }
}

impl<C: GenericClient + Sync> Tx for InTx<'_, C> {
    type Row<'r> = Row;

    async fn run(&self, sql: &str, values: &Values<'_>) -> Result<u64, StoreError> {
        self.tx.run(sql, &bound(values)).await
    }

    async fn rows<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Row) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        let rows = self.tx.rows(sql, &bound(values)).await?;
        rows.iter().map(decode).collect()
    }

    async fn maybe_row<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Row) -> Result<T, StoreError>,
    ) -> Result<Option<T>, StoreError> {
        let row = self.tx.maybe_row(sql, &bound(values)).await?;
        row.as_ref().map(decode).transpose()
    }

    async fn row<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Row) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        decode(&self.tx.row(sql, &bound(values)).await?)
    }
}
