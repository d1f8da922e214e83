//! Nodes and leases: a node registers, renews its leases with a heartbeat, and every commit of a
//! turn is fenced by its session's lease.

use super::*;

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

    pub(super) async fn renew(&self) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let me = &self.shared.node_id;
        tx.run(
            "UPDATE nodes SET heartbeat_at = $2 WHERE id = $1",
            &[me, &now_millis()],
        )
        .await?;
        tx.run(
            concatcp!(
                "UPDATE sessions SET lease_expires_at = agentgate_now_ms() + $2
             WHERE lease_owner = $1 AND state = ",
                SESSION_RUNNING
            ),
            &[me, &self.shared.lease_ttl_ms],
        )
        .await?;
        tx.run(
            "UPDATE deliveries SET lease_expires_at = agentgate_now_ms() + $2 WHERE lease_owner = $1",
            &[me, &self.shared.lease_ttl_ms],
        )
        .await?;
        tx.commit().await?;
        Ok(())
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
        let rows = client
            .rows(
                concatcp!("SELECT n.name, n.id, n.pid, n.started_at, n.heartbeat_at, n.stopped_at,
                        COALESCE(array_agg(s.key ORDER BY s.key) FILTER (WHERE s.key IS NOT NULL), '{}')
                 FROM nodes n
                 LEFT JOIN sessions s ON s.lease_owner = n.id AND s.state = ", SESSION_RUNNING, "
                 WHERE n.heartbeat_at >= $1 OR s.key IS NOT NULL
                 GROUP BY n.id ORDER BY n.name, n.started_at"),
                &[&(now - NODE_HISTORY_MS)],
            )
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                let heartbeat_at: i64 = row.get(4);
                let stopped_at: Option<i64> = row.get(5);
                let state = if stopped_at.is_some() {
                    NodeState::Stopped
                } else if now - heartbeat_at > self.shared.lease_ttl_ms {
                    NodeState::Lost
                } else {
                    NodeState::Running
                };
                NodeRow {
                    name: row.get(0),
                    id: row.get(1),
                    pid: row.get(2),
                    started_at: row.get(3),
                    heartbeat_at,
                    state,
                    leases: row.get(6),
                }
            })
            .collect())
    }
}
