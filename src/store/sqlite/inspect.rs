//! The operator views of events and the outbox, and `events replay` / `deliveries retry`.
//!
//! The shared SQL numbers its parameters `$N` for PostgreSQL; SQLite treats `$N` as a name and
//! numbers names by first appearance, so they are bound by name here, never by position.

use rusqlite::{Connection, OptionalExtension, Row, named_params, params};

use crate::store::inspect::{
    DELIVERIES_SQL, EVENT_DELIVERY_SQL, EVENT_SQL, EVENT_TURNS_SQL, EVENTS_SQL, FAILED_STATUS,
    REPLAY_SQL, RETRY_SQL, payload_value,
};
use crate::store::{
    DeliveryRow, EventDetail, EventFilter, EventRow, RetryTarget, TurnRow, now_millis,
};

fn event_row(row: &Row<'_>) -> rusqlite::Result<EventRow> {
    Ok(EventRow {
        id: row.get(0)?,
        route: row.get(1)?,
        session: row.get(2)?,
        event_type: row.get(3)?,
        status: row.get(4)?,
        delivery_id: row.get(5)?,
        received_at: row.get(6)?,
        origin: row.get(7)?,
        replay_of: row.get(8)?,
    })
}

fn delivery_row(row: &Row<'_>) -> rusqlite::Result<DeliveryRow> {
    Ok(DeliveryRow {
        event_id: row.get(0)?,
        route: row.get(1)?,
        session: row.get(2)?,
        status: row.get(3)?,
        attempts: row.get(4)?,
        next_attempt_at: row.get(5)?,
        last_error: row.get(6)?,
        updated_at: row.get(7)?,
    })
}

pub(super) fn event_in(connection: &Connection, id: &str) -> rusqlite::Result<Option<EventDetail>> {
    let Some((event, payload, headers)) = connection
        .prepare_cached(EVENT_SQL)?
        .query_row(params![id], |row| {
            Ok((
                event_row(row)?,
                row.get::<_, Vec<u8>>(9)?,
                row.get::<_, String>(10)?,
            ))
        })
        .optional()?
    else {
        return Ok(None);
    };
    let turns = connection
        .prepare_cached(EVENT_TURNS_SQL)?
        .query_map(params![id], |row| {
            Ok(TurnRow {
                id: row.get(0)?,
                status: row.get(1)?,
                reason: row.get(2)?,
                steps: row.get(3)?,
                started_at: row.get(4)?,
                finished_at: row.get(5)?,
                error: row.get(6)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let delivery = connection
        .prepare_cached(EVENT_DELIVERY_SQL)?
        .query_row(params![id], delivery_row)
        .optional()?;
    Ok(Some(EventDetail {
        event,
        payload: payload_value(&payload),
        headers: serde_json::from_str(&headers).unwrap_or_default(),
        turns,
        delivery,
    }))
}

pub(super) fn events_in(
    connection: &Connection,
    filter: &EventFilter,
) -> rusqlite::Result<Vec<EventRow>> {
    connection
        .prepare_cached(EVENTS_SQL)?
        .query_map(
            named_params! {
                "$1": filter.status, "$2": filter.route, "$3": filter.session,
                "$4": filter.limit, "$5": filter.before,
            },
            event_row,
        )?
        .collect()
}

pub(super) fn deliveries_in(
    connection: &Connection,
    failed_only: bool,
    limit: i64,
) -> rusqlite::Result<Vec<DeliveryRow>> {
    let status = failed_only.then_some(FAILED_STATUS);
    connection
        .prepare_cached(DELIVERIES_SQL)?
        .query_map(named_params! {"$1": status, "$2": limit}, delivery_row)?
        .collect()
}

/// Queues a copy of `original` as the event `copy`; `None` if there is no such event.
pub(super) fn replay_in(
    connection: &Connection,
    original: &str,
    copy: String,
) -> rusqlite::Result<Option<String>> {
    let inserted = connection
        .prepare_cached(REPLAY_SQL)?
        .execute(named_params! {"$1": original, "$2": copy, "$3": now_millis()})?;
    Ok((inserted == 1).then_some(copy))
}

pub(super) fn retry_in(connection: &Connection, target: &RetryTarget) -> rusqlite::Result<u64> {
    let event_id = match target {
        RetryTarget::One(id) => Some(id.as_str()),
        RetryTarget::AllFailed => None,
    };
    let updated = connection
        .prepare_cached(RETRY_SQL)?
        .execute(named_params! {"$1": event_id, "$2": now_millis()})?;
    Ok(updated as u64)
}
