//! [`Accepting`] on SQLite: the durable accept with delivery-id dedup, internal events, and
//! retention.

use const_format::concatcp;
use rusqlite::Connection;

use super::{SqliteStore, execute, query, query_optional, value};
use crate::store::model::{AcceptOutcome, NewEvent};
use crate::store::sql::{
    DELETE_EVENT_SQL, ORIGINAL_SQL, PRUNABLE_EVENTS_SQL, PRUNE_BATCH, PRUNE_DEDUP_SQL,
    PRUNE_SESSIONS_SQL,
};
use crate::store::states::{IDLE, QUEUED};
use crate::store::{Accepting, StoreError, now_millis};

/// `$1` route, `$2` delivery id, `$3` event id, `$4` now.
const REMEMBER_DELIVERY_SQL: &str =
    "INSERT OR REPLACE INTO dedup (route, delivery_id, event_id, seen_at) VALUES ($1, $2, $3, $4)";

/// `$1` id ... `$7` payload, `$8` now.
const INSERT_EVENT_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, trace_parent)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, ",
    QUEUED,
    ", $8, $9)"
);

/// `$1` key, `$2` route, `$3` now.
const INSERT_SESSION_SQL: &str = concatcp!(
    "INSERT OR IGNORE INTO sessions (key, route, state, created_at, updated_at)
     VALUES ($1, $2, ",
    IDLE,
    ", $3, $3)"
);

/// `$1` id, `$2` route, `$3` session key, `$4` event type, `$5` payload, `$6` now.
const INSERT_INTERNAL_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, origin)
     VALUES ($1, $2, $3, $4, NULL, '{}', $5, $6, ",
    QUEUED,
    ", $6, 'background')"
);

/// Pages given back to the file system per pruned batch: a few milliseconds of page moves.
const INCREMENTAL_VACUUM_SQL: &str = "PRAGMA incremental_vacuum(256)";

fn accept_in(connection: &Connection, new: &NewEvent) -> Result<AcceptOutcome, StoreError> {
    let (event, now) = (&new.event, now_millis());
    if let Some(delivery_id) = &event.delivery_id {
        let original = query_optional(
            connection,
            ORIGINAL_SQL,
            &[&event.route, delivery_id, &new.dedup_since],
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
    execute(
        connection,
        INSERT_SESSION_SQL,
        &[&event.session_key, &event.route, &now],
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
        let id = uuid::Uuid::now_v7().to_string();
        let (event_id, session_key, route, event_type) = (
            id.clone(),
            session_key.to_string(),
            route.to_string(),
            event_type.to_string(),
        );
        self.write(move |connection| {
            execute(
                connection,
                INSERT_INTERNAL_SQL,
                &[
                    &event_id,
                    &route,
                    &session_key,
                    &event_type,
                    &payload.to_string().into_bytes(),
                    &now_millis(),
                ],
            )
        })
        .await?;
        Ok(id)
    }

    async fn original_of(
        &self,
        route: &str,
        delivery_id: &str,
        since: i64,
    ) -> Result<Option<String>, StoreError> {
        let (route, delivery_id) = (route.to_string(), delivery_id.to_string());
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

    async fn prune_dedup(&self, before: i64) -> Result<usize, StoreError> {
        self.write(move |connection| execute(connection, PRUNE_DEDUP_SQL, &[&before]))
            .await
    }
}
