//! [`Accepting`] on SQLite: the durable accept with delivery-id dedup, internal events, and
//! retention.

use const_format::concatcp;
use rusqlite::Connection;

use super::{SqliteStore, execute, on_writer, query, query_optional, value};
use crate::store::model::{AcceptOutcome, DedupWindow, NewEvent};
use crate::store::sql::{
    DELETE_EVENT_SQL, ORIGINAL_SQL, PRUNABLE_EVENTS_SQL, PRUNE_BATCH, PRUNE_DEDUP_SQL,
    PRUNE_SESSIONS_SQL,
};
use crate::store::states::{BACKGROUND, IDLE, QUEUED};
use crate::store::turns;
use crate::store::{Accepting, StoreError, now_millis};

/// `$1` route, `$2` delivery id, `$3` event id, `$4` now.
pub(super) const REMEMBER_DELIVERY_SQL: &str =
    "INSERT OR REPLACE INTO dedup (route, delivery_id, event_id, seen_at) VALUES ($1, $2, $3, $4)";

/// `$1` id ... `$7` payload, `$8` now.
pub(super) const INSERT_EVENT_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, trace_parent)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, ",
    QUEUED,
    ", $8, $9)"
);

/// `$1` key, `$2` route, `$3` now, `$4` the seq of the event just inserted: a new session's
/// only queued event, so its queue head (an existing session's head was kept by the event's
/// trigger).
pub(super) const INSERT_SESSION_SQL: &str = concatcp!(
    "INSERT OR IGNORE INTO sessions (key, route, state, created_at, updated_at, queue_head)
     VALUES ($1, $2, ",
    IDLE,
    ", $3, $3, $4)"
);

/// `$1` id, `$2` route, `$3` session key, `$4` event type, `$5` payload, `$6` now.
pub(super) const INSERT_INTERNAL_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, origin)
     VALUES ($1, $2, $3, $4, NULL, '{}', $5, $6, ",
    QUEUED,
    ", $6, ",
    BACKGROUND,
    ")"
);

/// Pages given back to the file system per pruned batch: a few milliseconds of page moves.
const INCREMENTAL_VACUUM_SQL: &str = "PRAGMA incremental_vacuum(256)";

fn accept_in(connection: &Connection, new: &NewEvent) -> Result<AcceptOutcome, StoreError> {
    let (event, now) = (&new.event, now_millis());
    if let Some(delivery_id) = &event.delivery_id {
        let original = query_optional(
            connection,
            ORIGINAL_SQL,
            &[&event.route, delivery_id, &new.dedup_window.start(now)],
            |row| value::<String>(row, "event_id"),
        )?;
        if let Some(original) = original {
            return Ok(AcceptOutcome::Duplicate { original });
        }
        execute(
            connection,
            REMEMBER_DELIVERY_SQL,
            &[&event.route, delivery_id, &event.id, &now],
        )?;
    }
    execute(
        connection,
        INSERT_EVENT_SQL,
        &[
            &event.id,
            &event.route,
            &event.session_key,
            &event.event_type,
            &event.delivery_id,
            &event.headers,
            &event.payload,
            &now,
            &event.trace_parent,
        ],
    )?;
    let seq = connection.last_insert_rowid();
    execute(
        connection,
        INSERT_SESSION_SQL,
        &[&event.session_key, &event.route, &now, &seq],
    )?;
    Ok(AcceptOutcome::Accepted)
}

/// One retention batch, in the writer's transaction.
fn prune_finished_in(connection: &Connection, before: i64) -> Result<usize, StoreError> {
    let ids = query(
        connection,
        PRUNABLE_EVENTS_SQL,
        &[&before, &PRUNE_BATCH],
        |row| value::<String>(row, "id"),
    )?;
    for id in &ids {
        for sql in DELETE_EVENT_SQL {
            execute(connection, sql, &[id])?;
        }
    }
    execute(connection, PRUNE_SESSIONS_SQL, &[&before, &PRUNE_BATCH])?;
    // Give freed pages back to the file system (databases created with auto_vacuum =
    // INCREMENTAL; a no-op on older ones, whose free pages are reused instead), but only once
    // free pages outnumber used ones: under steady traffic new events reuse the pages retention
    // frees, and moving live pages to fill holes would only cost accepts their latency. So the
    // file stops growing at about twice the retained data, and shrinks when traffic drops.
    if !ids.is_empty() {
        let free: i64 = connection.query_row("PRAGMA freelist_count", [], |row| row.get(0))?;
        let total: i64 = connection.query_row("PRAGMA page_count", [], |row| row.get(0))?;
        if free * 2 > total {
            connection.execute_batch(INCREMENTAL_VACUUM_SQL)?;
        }
    }
    Ok(ids.len())
}

#[async_trait::async_trait]
impl Accepting for SqliteStore {
    async fn accept(&self, event: NewEvent) -> Result<AcceptOutcome, StoreError> {
        self.write(move |connection| accept_in(connection, &event))
            .await
    }

    async fn enqueue_internal(
        &self,
        session_key: &str,
        route: &str,
        event_type: &str,
        payload: serde_json::Value,
    ) -> Result<String, StoreError> {
        let (session_key, route, event_type) = (
            session_key.to_string(),
            route.to_string(),
            event_type.to_string(),
        );
        self.write(move |connection| {
            on_writer(connection, async |tx| {
                turns::enqueue_internal(tx, &session_key, &route, &event_type, &payload).await
            })
        })
        .await
    }

    async fn original_of(
        &self,
        route: &str,
        delivery_id: &str,
        window: DedupWindow,
    ) -> Result<Option<String>, StoreError> {
        let (route, delivery_id) = (route.to_string(), delivery_id.to_string());
        let since = window.start(now_millis());
        self.read(move |connection| {
            query_optional(
                connection,
                ORIGINAL_SQL,
                &[&route, &delivery_id, &since],
                |row| value(row, "event_id"),
            )
        })
        .await
    }

    async fn prune_finished(&self, before: i64) -> Result<usize, StoreError> {
        self.write(move |connection| prune_finished_in(connection, before))
            .await
    }

    async fn prune_dedup(&self, window: DedupWindow) -> Result<usize, StoreError> {
        let before = window.start(now_millis());
        self.write(move |connection| execute(connection, PRUNE_DEDUP_SQL, &[&before]))
            .await
    }
}
