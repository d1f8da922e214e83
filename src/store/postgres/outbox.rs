//! [`Outbox`] on PostgreSQL: deliveries due, each leased to the node that sends it, and the
//! record of each attempt.

use const_format::concatcp;

use super::PostgresStore;
use crate::store::model::{DeliveryAttempt, PendingDelivery};
use crate::store::row::StoredRow;
use crate::store::sql::RECORD_ATTEMPT_SQL;
use crate::store::states::PENDING;
use crate::store::{Outbox, StoreError, now_millis};

/// `$1` this node, `$2` the lease's length, `$3` now, `$4` limit, `$5` the routes to skip.
const DUE_SQL: &str = concatcp!(
    "UPDATE deliveries SET lease_owner = $1, lease_expires_at = agentgate_now_ms() + $2
     WHERE event_id IN (
         SELECT event_id FROM deliveries
         WHERE status = ",
    PENDING,
    " AND next_attempt_at <= $3
           AND (lease_owner IS NULL OR lease_expires_at < agentgate_now_ms())
           AND NOT (route = ANY($5))
         ORDER BY next_attempt_at LIMIT $4
         FOR UPDATE SKIP LOCKED)
     RETURNING event_id, route, session_key, body, attempts, next_attempt_at,
               (SELECT e.trace_parent FROM events e WHERE e.id = deliveries.event_id) AS trace_parent"
);

const RECORD_SQL: &str = concatcp!(
    RECORD_ATTEMPT_SQL,
    ", lease_owner = NULL, lease_expires_at = NULL WHERE event_id = $1"
);

#[async_trait::async_trait]
impl Outbox for PostgresStore {
    async fn due_deliveries(
        &self,
        limit: usize,
        skip_routes: Vec<String>,
    ) -> Result<Vec<PendingDelivery>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut due = self
            .fetch(
                DUE_SQL,
                &[
                    &self.shared.node_id,
                    &self.shared.lease_ttl_ms,
                    &now_millis(),
                    &limit,
                    &skip_routes,
                ],
                |row| {
                    Ok((
                        row.column::<i64>("next_attempt_at")?,
                        PendingDelivery::decode(row)?,
                    ))
                },
            )
            .await?;
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
        self.execute_one(RECORD_SQL, &[&event_id, &status.sql(), &next, &error, &now])
            .await?;
        Ok(())
    }
}
