//! The outbox: terminal results waiting to be delivered, with their attempts and next due time.
//! Rows are written in the same transaction that ends a turn, so a result is never lost between
//! "turn finished" and "delivery queued", and retries survive restarts.

use super::*;
use crate::store::model::{DeliveryAttempt, DeliveryCounts, PendingDelivery};
use crate::store::states::{DELIVERY_FAILED, PENDING};
use const_format::concatcp;
use rusqlite::{Connection, params};

use crate::store::now_millis;

impl DeliveryCounts {
    pub(crate) fn query(connection: &Connection) -> rusqlite::Result<DeliveryCounts> {
        connection.query_row(
            concatcp!(
                "SELECT COALESCE(SUM(status = ",
                PENDING,
                "), 0), COALESCE(SUM(status = ",
                DELIVERY_FAILED,
                "), 0) FROM deliveries"
            ),
            [],
            |row| {
                Ok(DeliveryCounts {
                    pending: row.get(0)?,
                    failed: row.get(1)?,
                })
            },
        )
    }
}

pub(super) fn due_in(
    connection: &Connection,
    limit: usize,
    skip_routes: &[String],
) -> rusqlite::Result<Vec<PendingDelivery>> {
    let skipped = serde_json::to_string(skip_routes).unwrap_or_else(|_| "[]".to_string());
    connection
        .prepare_cached(concatcp!(
            "SELECT event_id, route, session_key, body, attempts FROM deliveries
             WHERE status = ",
            PENDING,
            " AND next_attempt_at <= ?1
               AND route NOT IN (SELECT value FROM json_each(?3))
             ORDER BY next_attempt_at LIMIT ?2"
        ))?
        .query_map(params![now_millis(), limit as i64, skipped], |row| {
            Ok(PendingDelivery {
                event_id: row.get(0)?,
                route: row.get(1)?,
                session_key: row.get(2)?,
                body: row.get(3)?,
                attempts: row.get(4)?,
            })
        })?
        .collect()
}

pub(super) fn record_attempt_in(
    connection: &Connection,
    event_id: &str,
    outcome: &DeliveryAttempt,
) -> rusqlite::Result<()> {
    let now = now_millis();
    let (status, next, error) = outcome.columns(now);
    connection
        .prepare_cached(
            "UPDATE deliveries SET status = ?2, attempts = attempts + 1, next_attempt_at = ?3,
                 last_error = ?4, updated_at = ?5
             WHERE event_id = ?1",
        )?
        .execute(params![event_id, status.sql(), next, error, now])?;
    Ok(())
}

#[async_trait::async_trait]
impl Outbox for SqliteStore {
    async fn due_deliveries(
        &self,
        limit: usize,
        skip_routes: Vec<String>,
    ) -> Result<Vec<PendingDelivery>, StoreError> {
        self.read(move |connection| due_in(connection, limit, &skip_routes))
            .await
    }

    async fn record_delivery_attempt(
        &self,
        event_id: &str,
        outcome: DeliveryAttempt,
    ) -> Result<(), StoreError> {
        let event_id = event_id.to_string();
        self.write(move |connection| record_attempt_in(connection, &event_id, &outcome))
            .await
    }
}
