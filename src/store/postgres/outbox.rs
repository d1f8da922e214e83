//! The outbox: deliveries due, and the record of each attempt.

use super::*;

#[async_trait::async_trait]
impl Outbox for PostgresStore {
    async fn due_deliveries(
        &self,
        limit: usize,
        skip_routes: Vec<String>,
    ) -> Result<Vec<PendingDelivery>, StoreError> {
        let rows = self
            .select(
                concatcp!("UPDATE deliveries SET lease_owner = $1, lease_expires_at = agentgate_now_ms() + $2
                 WHERE event_id IN (
                     SELECT event_id FROM deliveries
                     WHERE status = ", PENDING, " AND next_attempt_at <= $3
                       AND (lease_owner IS NULL OR lease_expires_at < agentgate_now_ms())
                       AND NOT (route = ANY($5))
                     ORDER BY next_attempt_at LIMIT $4
                     FOR UPDATE SKIP LOCKED)
                 RETURNING event_id, route, session_key, body, attempts, next_attempt_at"),
                &[
                    &self.shared.node_id,
                    &self.shared.lease_ttl_ms,
                    &now_millis(),
                    &(limit as i64),
                    &skip_routes,
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
}
