//! [`Outbox`] on SQLite: terminal results waiting to be delivered, with their attempts and next
//! due time. Rows are written in the transaction that ends a turn (`turns::finish_in`), so a
//! result is never lost between "turn finished" and "delivery queued", and retries survive
//! restarts.

use const_format::concatcp;

use super::{SqliteStore, execute, query};
use crate::store::model::{DeliveryAttempt, PendingDelivery};
use crate::store::sql::RECORD_ATTEMPT_SQL;
use crate::store::states::PENDING;
use crate::store::{Outbox, StoreError, now_millis};

/// `$1` now, `$2` limit, `$3` the routes to skip, as a JSON array.
const DUE_SQL: &str = concatcp!(
    "SELECT event_id, route, session_key, body, attempts,
            (SELECT e.trace_parent FROM events e WHERE e.id = deliveries.event_id) AS trace_parent
     FROM deliveries
     WHERE status = ",
    PENDING,
    " AND next_attempt_at <= $1
       AND route NOT IN (SELECT value FROM json_each($3))
     ORDER BY next_attempt_at LIMIT $2"
);

const RECORD_SQL: &str = concatcp!(RECORD_ATTEMPT_SQL, " WHERE event_id = $1");

#[async_trait::async_trait]
impl Outbox for SqliteStore {
    async fn due_deliveries(
        &self,
        limit: usize,
        skip_routes: Vec<String>,
    ) -> Result<Vec<PendingDelivery>, StoreError> {
        let skipped = serde_json::Value::from(skip_routes).to_string();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read(move |connection| {
            query(
                connection,
                DUE_SQL,
                &[&now_millis(), &limit, &skipped],
                |row| PendingDelivery::decode(row),
            )
        })
        .await
    }

    async fn record_delivery_attempt(
        &self,
        event_id: &str,
        outcome: DeliveryAttempt,
    ) -> Result<(), StoreError> {
        let event_id = event_id.to_string();
        self.write(move |connection| {
            let now = now_millis();
            let (status, next, error) = outcome.columns(now);
            execute(
                connection,
                RECORD_SQL,
                &[&event_id, &status.sql(), &next, &error, &now],
            )?;
            Ok(())
        })
        .await
    }
}
