//! Rows of the operator views of events and the outbox (the store's `events`, `event` and
//! `deliveries`), read with the SQL the SQLite store runs.

use tokio_postgres::Row;

use crate::store::{DeliveryRow, EventRow, TurnRow};

pub(super) fn event_row(row: &Row) -> EventRow {
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

pub(super) fn delivery_row(row: &Row) -> DeliveryRow {
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

pub(super) fn turn_row(row: &Row) -> TurnRow {
    TurnRow {
        id: row.get(0),
        status: row.get(1),
        reason: row.get(2),
        steps: row.get(3),
        started_at: row.get(4),
        finished_at: row.get(5),
        error: row.get(6),
    }
}
