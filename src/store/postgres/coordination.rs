//! [`Coordination`] on PostgreSQL, and the nodes and leases it rests on: a node registers,
//! renews its leases with a heartbeat, and every commit of a turn is fenced by its session's
//! lease; on_busy interrupts reach a turn on another node through its session row.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use const_format::concatcp;
use tokio_postgres::error::SqlState;

use super::connect::{Cached, bounded};
use super::{NODE_HISTORY_MS, OPERATION_TIMEOUT, PostgresStore};
use crate::locks;
use crate::store::model::NodeRow;
use crate::store::row::StoredRow;
use crate::store::states::{NodeState, SESSION_RUNNING};
use crate::store::{Coordination, StoreError, now_millis};

/// How long a renewal waits for a session row another transaction holds, in milliseconds.
const HELD_WAIT_MS: &str = "500";

/// The `key` column of `rows`.
fn keys(rows: &[tokio_postgres::Row]) -> Result<Vec<String>, StoreError> {
    rows.iter().map(|row| row.column::<String>("key")).collect()
}

/// `$1` the cutoff: node rows with a heartbeat since, or with a running session.
const NODES_SQL: &str = concatcp!(
    "SELECT n.name AS name, n.id AS id, n.pid AS pid, n.started_at AS started_at,
            n.heartbeat_at AS heartbeat_at, n.stopped_at AS stopped_at,
            COALESCE(array_agg(s.key ORDER BY s.key) FILTER (WHERE s.key IS NOT NULL), '{}')
                AS leases
     FROM nodes n
     LEFT JOIN sessions s ON s.lease_owner = n.id AND s.state = ",
    SESSION_RUNNING,
    "
     WHERE n.heartbeat_at >= $1 OR s.key IS NOT NULL
     GROUP BY n.id ORDER BY n.name, n.started_at"
);

impl PostgresStore {
    /// Adds this run of the node to `nodes` (and forgets runs long gone).
    pub(super) async fn register(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let now = now_millis();
        client
            .run(
                "INSERT INTO nodes (id, name, pid, started_at, heartbeat_at) VALUES ($1, $2, $3, $4, $4)",
                &[
                    &self.shared.node_id,
                    &self.shared.node_name,
                    &i64::from(std::process::id()),
                    &now,
                ],
            )
            .await?;
        client
            .run(
                "DELETE FROM nodes n WHERE n.heartbeat_at < $1
                     AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.lease_owner = n.id)",
                &[&(now - 24 * NODE_HISTORY_MS)],
            )
            .await?;
        tracing::info!(node = %self.shared.node_name, node_id = %self.shared.node_id,
            "joined the PostgreSQL store");
        Ok(())
    }

    /// Renews this node's leases and heartbeat; its outcome is the store's writability.
    pub(super) async fn heartbeat(self, lease_ttl: Duration) {
        let interval = (lease_ttl / 3).min(Duration::from_secs(1));
        loop {
            tokio::select! {
                () = self.shared.stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let renewed = bounded(self.renew()).await;
            if let Err(err) = &renewed {
                tracing::warn!(error = %err, "cannot renew this node's leases");
            }
            self.set_writable(renewed.is_ok());
            self.shared
                .heartbeat_round_at
                .store(now_millis(), Ordering::Release);
        }
    }

    /// Renews this node's leases in one transaction. A row another transaction holds is
    /// skipped at first, not waited for: a claim takes sessions and deliveries `FOR UPDATE SKIP
    /// LOCKED`, and a renewal queued behind a turn's commit would hold the row's lock for the
    /// moment after that commit, so a claim made right then would pass the session by. A
    /// running session skipped so is then waited for, briefly ([`PostgresStore::renew_held`]):
    /// its holder may be the accepts of a flood of events for it, round after round. The sessions renewed are recorded as of the moment the
    /// round began ([`Leases`]), once it has committed.
    pub(super) async fn renew(&self) -> Result<(), StoreError> {
        let asked_at = now_millis();
        let mut client = self.client().await?;
        let mut tx = client.transaction().await?;
        let me = &self.shared.node_id;
        let sessions = tx
            .rows(
                concatcp!(
                    "UPDATE sessions SET lease_expires_at = agentgate_now_ms() + $2
                 WHERE key IN (SELECT key FROM sessions WHERE lease_owner = $1 AND state = ",
                    SESSION_RUNNING,
                    " FOR UPDATE SKIP LOCKED)
                 RETURNING key"
                ),
                &[me, &self.shared.lease_ttl_ms],
            )
            .await?;
        let renewed = keys(&sessions)?;
        let (held, held_asked_at) = self.renew_held(&mut tx, &renewed).await?;
        tx.run(
            "UPDATE deliveries SET lease_expires_at = agentgate_now_ms() + $2
             WHERE event_id IN (SELECT event_id FROM deliveries WHERE lease_owner = $1
                                FOR UPDATE SKIP LOCKED)",
            &[me, &self.shared.lease_ttl_ms],
        )
        .await?;
        tx.run(
            "UPDATE budget_reservations SET expires_at = agentgate_now_ms() + $2
             WHERE turn_id IN (SELECT turn_id FROM budget_reservations WHERE node = $1
                               FOR UPDATE SKIP LOCKED)",
            &[me, &self.shared.lease_ttl_ms],
        )
        .await?;
        tx.run(
            "UPDATE nodes SET heartbeat_at = $2 WHERE id = $1",
            &[me, &now_millis()],
        )
        .await?;
        tx.commit().await?;
        let leases = &self.shared.leases;
        leases.set(renewed.iter().map(String::as_str), asked_at);
        leases.set(held.iter().map(String::as_str), held_asked_at);
        leases.forget_set_before(asked_at - self.shared.lease_ttl_ms);
        Ok(())
    }

    /// Renews the running sessions of this node that the first pass skipped, their rows locked
    /// (by an accept committing a new event of theirs, or this node's own commit), once the lock
    /// goes, waiting for it at most [`HELD_WAIT_MS`]: under a flood of events for one session
    /// its row is locked most of the time, and a lease skipped round after round would run out
    /// under its running turn. Returns them, with the time taken before their renewal.
    async fn renew_held(
        &self,
        tx: &mut deadpool_postgres::Transaction<'_>,
        renewed: &[String],
    ) -> Result<(Vec<String>, i64), StoreError> {
        let me = &self.shared.node_id;
        let running: i64 = tx
            .row(
                concatcp!(
                    "SELECT count(*) AS running FROM sessions WHERE lease_owner = $1 AND state = ",
                    SESSION_RUNNING
                ),
                &[me],
            )
            .await?
            .column("running")?;
        let asked_at = now_millis();
        if usize::try_from(running).unwrap_or(0) <= renewed.len() {
            return Ok((Vec::new(), asked_at));
        }
        let held = tx.savepoint("held").await?;
        held.batch_execute(concatcp!("SET LOCAL lock_timeout = ", HELD_WAIT_MS))
            .await?;
        let answer = held
            .query(
                concatcp!(
                    "UPDATE sessions SET lease_expires_at = agentgate_now_ms() + $2
                     WHERE lease_owner = $1 AND state = ",
                    SESSION_RUNNING,
                    " AND NOT (key = ANY($3)) RETURNING key"
                ),
                &[me, &self.shared.lease_ttl_ms, &renewed],
            )
            .await;
        match answer {
            Ok(rows) => {
                held.batch_execute("SET LOCAL lock_timeout = DEFAULT")
                    .await?;
                held.commit().await?;
                Ok((keys(&rows)?, asked_at))
            }
            // Still locked: the next round tries again.
            Err(err) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                held.rollback().await?;
                Ok((Vec::new(), asked_at))
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Renews the session's lease, or fails with `LeaseLost` when another node owns it now.
    pub(super) async fn hold_lease(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        session_key: &str,
    ) -> Result<(), StoreError> {
        let held = tx
            .run(
                "UPDATE sessions SET lease_expires_at = agentgate_now_ms() + $3
                 WHERE key = $1 AND lease_owner = $2",
                &[
                    &session_key,
                    &self.shared.node_id,
                    &self.shared.lease_ttl_ms,
                ],
            )
            .await?;
        if held == 0 {
            return Err(StoreError::LeaseLost {
                session_key: session_key.to_string(),
            });
        }
        Ok(())
    }

    pub(super) async fn nodes(
        &self,
        client: &deadpool_postgres::Client,
    ) -> Result<Vec<NodeRow>, StoreError> {
        let now = now_millis();
        let rows = client.rows(NODES_SQL, &[&(now - NODE_HISTORY_MS)]).await?;
        rows.iter().map(|row| self.node(row, now)).collect()
    }

    fn node(&self, row: &tokio_postgres::Row, now: i64) -> Result<NodeRow, StoreError> {
        let heartbeat_at: i64 = row.column("heartbeat_at")?;
        let stopped_at: Option<i64> = row.column("stopped_at")?;
        let state = if stopped_at.is_some() {
            NodeState::Stopped
        } else if now - heartbeat_at > self.shared.lease_ttl_ms {
            NodeState::Lost
        } else {
            NodeState::Running
        };
        Ok(NodeRow {
            name: row.column("name")?,
            id: row.column("id")?,
            pid: row.column("pid")?,
            started_at: row.column("started_at")?,
            heartbeat_at,
            state,
            // A text array, which only PostgreSQL has.
            leases: row.try_get("leases").map_err(|err| StoreError::Decode {
                column: "leases",
                reason: err.to_string(),
            })?,
        })
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
        self.fetch(
            "UPDATE sessions SET interrupt_requested = false
             WHERE lease_owner = $1 AND interrupt_requested
             RETURNING key",
            &[&self.shared.node_id],
            |row| row.column("key"),
        )
        .await
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
                    "DELETE FROM budget_reservations WHERE node = $1",
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

    /// Two thirds of the lease without a renewal: the last third is the margin in which this
    /// node's tools are killed before the lease can expire and another node resume the session.
    /// A session this node did not renew is at risk whether the database could not be reached
    /// or answered without it (another node holds the lease now).
    fn lease_at_risk(&self, session_key: &str) -> bool {
        self.shared
            .leases
            .set_at(session_key)
            .is_none_or(|set_at| now_millis() - set_at > self.shared.lease_ttl_ms * 2 / 3)
    }
}

/// The sessions whose leases this node set, each with the time taken just before the statement
/// that last set its expiry: never later than the database's own reading of its clock for that
/// expiry, however long the round took. Entries of sessions this node no longer renews age,
/// and go once they are past any lease.
#[derive(Default)]
pub(super) struct Leases(std::sync::Mutex<HashMap<String, i64>>);

impl Leases {
    /// `sessions`' leases were set at `asked_at` or later, in a transaction that committed
    /// (or, for a claim, that is about to).
    pub(super) fn set<'a>(&self, sessions: impl IntoIterator<Item = &'a str>, asked_at: i64) {
        let mut leases = locks::lock(&self.0);
        for session in sessions {
            let set_at = leases.entry(session.to_string()).or_insert(asked_at);
            *set_at = (*set_at).max(asked_at);
        }
    }

    fn set_at(&self, session_key: &str) -> Option<i64> {
        locks::lock(&self.0).get(session_key).copied()
    }

    /// Forgets leases set before `cutoff` (expired, unless renewed since).
    fn forget_set_before(&self, cutoff: i64) {
        locks::lock(&self.0).retain(|_, set_at| *set_at >= cutoff);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::PostgresStore;
    use crate::config::PostgresSettings;
    use crate::secret::Secret;
    use crate::store::contract::postgres_server::Postgres;
    use crate::store::{Coordination, StoreError, now_millis};

    /// A node on `server` (`lease_ttl` 30 s) that renews only when a test calls `renew` (no
    /// heartbeat round of its own), running turns of `sessions` (their leases expired).
    async fn renewing_only(server: &Postgres, sessions: &[&str]) -> PostgresStore {
        let settings = PostgresSettings {
            url: Secret::for_tests(server.url().as_bytes()),
            node: "renewal".into(),
            lease_ttl: Duration::from_secs(30),
            pool_size: 3,
            ca_file: None,
        };
        let store = PostgresStore::open(&settings, true).await.expect("open");
        store.shared.stop.cancel();
        let me = &store.shared.node_id;
        let rows: Vec<String> = (sessions.iter())
            .map(|key| format!("('{key}', 'r', 'running', 0, 0, '{me}', 0)"))
            .collect();
        server.value(&format!(
            "INSERT INTO sessions (key, route, state, created_at, updated_at, lease_owner, \
             lease_expires_at) VALUES {}",
            rows.join(", ")
        ));
        store
    }

    /// A renewal of `store`, started, once it waits for a lock in a statement that begins with
    /// `statement` (watched through a connection of its own, so that the test lets the lock go
    /// as soon as it waits).
    async fn renewal_waiting_at(
        store: &PostgresStore,
        statement: &str,
    ) -> tokio::task::JoinHandle<Result<(), StoreError>> {
        let renewal = tokio::spawn({
            let store = store.clone();
            async move { store.renew().await }
        });
        let watcher = store.client().await.expect("client");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let waiting: i64 = watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE wait_event_type = 'Lock' AND starts_with(query, $1)",
                    &[&statement],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if waiting == 1 {
                return renewal;
            }
            assert!(
                Instant::now() < deadline,
                "the renewal never waited at {statement}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The heartbeat never waits for a row another transaction holds: one waiting would hold
    /// the row's lock the moment that transaction commits, and a claim made then (`SKIP
    /// LOCKED`) would pass the session by. The held session is renewed by a later round.
    #[test]
    fn a_renewal_skips_a_held_session_and_renews_the_rest() {
        let Some(server) = Postgres::start("a_renewal_skips_a_held_session") else {
            return;
        };
        crate::store::contract::runtime().block_on(async {
            let store = renewing_only(&server, &["held", "free"]).await;
            let mut holder = store.client().await.expect("client");
            let held = holder.transaction().await.expect("begin");
            held.execute("SELECT 1 FROM sessions WHERE key = 'held' FOR UPDATE", &[])
                .await
                .expect("lock");
            // Without the skip, this waits until the holder ends (the server ends an idle
            // transaction after 10 s).
            tokio::time::timeout(Duration::from_secs(5), store.renew())
                .await
                .expect("the renewal waited for a held row")
                .expect("renew");
            held.rollback().await.expect("rollback");
            assert_eq!(
                server.value(
                    "SELECT string_agg(key || '=' || (lease_expires_at > 0)::text, ',' \
                     ORDER BY key) FROM sessions"
                ),
                "free=true,held=false"
            );
            // The held session was not renewed: its turn must stop its tools (its holder, if
            // it is this node's own commit, renews it and says so).
            assert!(store.lease_at_risk("held"));
            assert!(!store.lease_at_risk("free"));
        });
    }

    /// A running session whose row another transaction holds a moment (an accept's commit of
    /// an event for it) is renewed in the same round once the lock goes, not skipped: under a
    /// flood of events for one session its row is locked most of the time.
    #[test]
    fn a_renewal_waits_a_moment_for_a_running_session_s_row() {
        let Some(server) = Postgres::start("a_renewal_waits_a_moment") else {
            return;
        };
        crate::store::contract::runtime().block_on(async {
            let store = renewing_only(&server, &["busy"]).await;
            let mut holder = store.client().await.expect("client");
            let held = holder.transaction().await.expect("begin");
            held.execute("SELECT 1 FROM sessions WHERE key = 'busy' FOR UPDATE", &[])
                .await
                .expect("lock");
            let renewal = renewal_waiting_at(&store, "UPDATE sessions").await;
            held.rollback().await.expect("rollback");
            renewal.await.expect("join").expect("renew");
            assert_eq!(
                server.value("SELECT lease_expires_at > 0 FROM sessions WHERE key = 'busy'"),
                "t"
            );
            assert!(!store.lease_at_risk("busy"));
        });
    }

    /// A renewal counts from the moment it was sent, not from its answer: the database set the
    /// expiry when its UPDATE ran, so a round that took long (here, held up after the sessions'
    /// UPDATE by a lock on the node's row) must not push the node's view of its leases later
    /// than the database's, which would shrink the margin in which its tools are killed.
    #[test]
    fn a_slow_renewal_counts_from_its_start() {
        let Some(server) = Postgres::start("a_slow_renewal_counts_from_its_start") else {
            return;
        };
        crate::store::contract::runtime().block_on(async {
            let store = renewing_only(&server, &["s"]).await;
            let mut holder = store.client().await.expect("client");
            let node_row = holder.transaction().await.expect("begin");
            node_row
                .execute(
                    "SELECT 1 FROM nodes WHERE id = $1 FOR UPDATE",
                    &[&store.shared.node_id],
                )
                .await
                .expect("lock");
            let renewal = renewal_waiting_at(&store, "UPDATE nodes").await;
            let released_at = now_millis();
            node_row.rollback().await.expect("rollback");
            renewal.await.expect("join").expect("renew");
            let set_at = store.shared.leases.set_at("s").expect("renewed");
            assert!(
                set_at < released_at,
                "counted from {set_at}, after the database set the expiry (before {released_at})"
            );
            let expires_at: i64 = server
                .value("SELECT lease_expires_at FROM sessions WHERE key = 's'")
                .parse()
                .expect("a number");
            assert!(
                set_at + 30_000 <= expires_at,
                "the node counts from before the database"
            );
        });
    }
}
