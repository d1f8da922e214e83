//! The operator views of events and the outbox, and `events replay` / `deliveries retry`, with
//! the SQL the SQLite store runs.

use tokio_postgres::Row;

use super::PostgresStore;
use crate::store::inspect::{
    DELIVERIES_SQL, EVENT_DELIVERY_SQL, EVENT_SQL, EVENT_TURNS_SQL, EVENTS_SQL, FAILED_STATUS,
    REPLAY_SQL, RETRY_SQL, payload_value,
};
use crate::store::{
    DeliveryRow, EventDetail, EventFilter, EventRow, RetryTarget, StoreError, TurnRow, now_millis,
};

fn event_row(row: &Row) -> EventRow {
    EventRow {
        id: row.get(0),
        route: row.get(1),
        session: row.get(2),
        event_type: row.get(3),
        status: row.get(4),
        delivery_id: row.get(5),
        received_at: row.get(6),
        origin: row.get(7),
        replay_of: row.get(8),
    }
}

fn delivery_row(row: &Row) -> DeliveryRow {
    DeliveryRow {
        event_id: row.get(0),
        route: row.get(1),
        session: row.get(2),
        status: row.get(3),
        attempts: row.get(4),
        next_attempt_at: row.get(5),
        last_error: row.get(6),
        updated_at: row.get(7),
    }
}

impl PostgresStore {
    pub(super) async fn events_matching(
        &self,
        filter: EventFilter,
    ) -> Result<Vec<EventRow>, StoreError> {
        let rows = self
            .select(
                EVENTS_SQL,
                &[
                    &filter.status,
                    &filter.route,
                    &filter.session,
                    &filter.limit,
                ],
            )
            .await?;
        Ok(rows.iter().map(event_row).collect())
    }

    pub(super) async fn event_detail(&self, id: &str) -> Result<Option<EventDetail>, StoreError> {
        let Some(row) = self.select_optional(EVENT_SQL, &[&id]).await? else {
            return Ok(None);
        };
        let turns = self
            .select(EVENT_TURNS_SQL, &[&id])
            .await?
            .iter()
            .map(|row| TurnRow {
                id: row.get(0),
                status: row.get(1),
                reason: row.get(2),
                steps: row.get(3),
                started_at: row.get(4),
                finished_at: row.get(5),
                error: row.get(6),
            })
            .collect();
        let delivery = self
            .select_optional(EVENT_DELIVERY_SQL, &[&id])
            .await?
            .as_ref()
            .map(delivery_row);
        Ok(Some(EventDetail {
            event: event_row(&row),
            payload: payload_value(row.get::<_, &[u8]>(9)),
            headers: serde_json::from_str(row.get::<_, &str>(10)).unwrap_or_default(),
            turns,
            delivery,
        }))
    }

    pub(super) async fn outbox(
        &self,
        failed_only: bool,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, StoreError> {
        let status = failed_only.then_some(FAILED_STATUS);
        let rows = self.select(DELIVERIES_SQL, &[&status, &limit]).await?;
        Ok(rows.iter().map(delivery_row).collect())
    }

    pub(super) async fn replay(&self, id: &str) -> Result<Option<String>, StoreError> {
        let copy = uuid::Uuid::now_v7().to_string();
        let inserted = self
            .execute_one(REPLAY_SQL, &[&id, &copy, &now_millis()])
            .await?;
        Ok((inserted == 1).then_some(copy))
    }

    pub(super) async fn retry(&self, target: RetryTarget) -> Result<u64, StoreError> {
        let event_id = match target {
            RetryTarget::One(id) => Some(id),
            RetryTarget::AllFailed => None,
        };
        self.execute_one(RETRY_SQL, &[&event_id, &now_millis()])
            .await
    }
}
