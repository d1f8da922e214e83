//! Events: the durable accept with delivery-id dedup, and the summaries that `status` reads.

use super::*;
use crate::store::model::{AcceptOutcome, Counts, LiveCounts, NewEvent, NodeRow, StatusSummary};
use crate::store::states::{IDLE, LIVE_COUNTS_SQL, QUEUED};
use const_format::concatcp;
use std::collections::BTreeMap;

use rusqlite::{Connection, OptionalExtension, params};

use crate::store::now_millis;

/// One retention batch (see `store::retention`), in the writer's transaction. Named parameters:
/// SQLite numbers `$N` by first appearance.
fn prune_finished_in(connection: &Connection, before: i64) -> rusqlite::Result<usize> {
    use crate::store::retention::{
        DELETE_EVENT_SQL, PRUNABLE_EVENTS_SQL, PRUNE_BATCH, PRUNE_SESSIONS_SQL,
    };
    use rusqlite::named_params;
    let ids = connection
        .prepare_cached(PRUNABLE_EVENTS_SQL)?
        .query_map(named_params! {"$1": before, "$2": PRUNE_BATCH}, |row| {
            row.get::<_, String>(0)
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    for id in &ids {
        for sql in DELETE_EVENT_SQL {
            connection
                .prepare_cached(sql)?
                .execute(named_params! {"$1": id})?;
        }
    }
    connection
        .prepare_cached(PRUNE_SESSIONS_SQL)?
        .execute(named_params! {"$1": before, "$2": PRUNE_BATCH})?;
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

/// Pages given back to the file system per pruned batch: a few milliseconds of page moves.
const INCREMENTAL_VACUUM_SQL: &str = "PRAGMA incremental_vacuum(256)";

/// The event a delivery id was first accepted as, within the dedup window.
const ORIGINAL_SQL: &str =
    "SELECT event_id FROM dedup WHERE route = ?1 AND delivery_id = ?2 AND seen_at >= ?3";

pub(super) fn accept_in(
    connection: &Connection,
    new: &NewEvent,
) -> rusqlite::Result<AcceptOutcome> {
    let (event, now) = (&new.event, now_millis());
    if let Some(delivery_id) = &event.delivery_id {
        let original: Option<String> = connection
            .prepare_cached(ORIGINAL_SQL)?
            .query_row(params![event.route, delivery_id, new.dedup_since], |row| {
                row.get(0)
            })
            .optional()?;
        if let Some(original) = original {
            return Ok(AcceptOutcome::Duplicate { original });
        }
        connection
            .prepare_cached(
                "INSERT OR REPLACE INTO dedup (route, delivery_id, event_id, seen_at) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![event.route, delivery_id, event.id, now])?;
    }
    connection
        .prepare_cached(concatcp!(
            "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                                 received_at, status, updated_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ",
            QUEUED,
            ", ?8)"
        ))?
        .execute(params![
            event.id,
            event.route,
            event.session_key,
            event.event_type,
            event.delivery_id,
            event.headers,
            event.payload,
            now
        ])?;
    connection
        .prepare_cached(concatcp!(
            "INSERT OR IGNORE INTO sessions (key, route, state, created_at, updated_at)
             VALUES (?1, ?2, ",
            IDLE,
            ", ?3, ?3)"
        ))?
        .execute(params![event.session_key, event.route, now])?;
    Ok(AcceptOutcome::Accepted)
}

pub(super) fn enqueue_internal_in(
    connection: &Connection,
    event_id: &str,
    session_key: &str,
    route: &str,
    event_type: &str,
    payload: &serde_json::Value,
) -> rusqlite::Result<()> {
    connection.execute(
        concatcp!(
            "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                             received_at, status, updated_at, origin)
         VALUES (?1, ?2, ?3, ?4, NULL, '{}', ?5, ?6, ",
            QUEUED,
            ", ?6, 'background')"
        ),
        params![
            event_id,
            route,
            session_key,
            event_type,
            payload.to_string().into_bytes(),
            now_millis()
        ],
    )?;
    Ok(())
}

fn grouped(connection: &Connection, sql: &str) -> rusqlite::Result<BTreeMap<String, i64>> {
    let mut statement = connection.prepare(sql)?;
    let rows = statement.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?;
    rows.collect()
}

impl LiveCounts {
    pub(crate) fn query(connection: &Connection) -> rusqlite::Result<LiveCounts> {
        connection.query_row(LIVE_COUNTS_SQL, [], |row| {
            Ok(LiveCounts {
                queued: row.get(0)?,
                resume_pending: row.get(1)?,
                suspended: row.get(2)?,
            })
        })
    }
}

impl StatusSummary {
    /// The summary out of events by status and sessions by state.
    pub(crate) fn from_counts(
        by_status: BTreeMap<String, i64>,
        by_state: BTreeMap<String, i64>,
        deliveries: crate::store::DeliveryCounts,
        nodes: Option<Vec<NodeRow>>,
    ) -> StatusSummary {
        StatusSummary {
            events: Counts {
                total: by_status.values().sum(),
                by_status,
                by_state: BTreeMap::new(),
            },
            sessions: Counts {
                total: by_state.values().sum(),
                by_status: BTreeMap::new(),
                by_state,
            },
            deliveries,
            nodes,
        }
    }

    pub(super) fn query(connection: &Connection) -> rusqlite::Result<StatusSummary> {
        let by_status = grouped(
            connection,
            "SELECT status, count(*) FROM events WHERE origin = 'webhook' GROUP BY status",
        )?;
        let by_state = grouped(
            connection,
            "SELECT state, count(*) FROM sessions GROUP BY state",
        )?;
        let deliveries = crate::store::DeliveryCounts::query(connection)?;
        Ok(StatusSummary::from_counts(
            by_status, by_state, deliveries, None,
        ))
    }
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
            enqueue_internal_in(
                connection,
                &event_id,
                &session_key,
                &route,
                &event_type,
                &payload,
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
            connection
                .prepare_cached(ORIGINAL_SQL)?
                .query_row(params![route, delivery_id, since], |row| row.get(0))
                .optional()
        })
        .await
    }

    async fn prune_finished(&self, before: i64) -> Result<usize, StoreError> {
        self.write(move |connection| prune_finished_in(connection, before))
            .await
    }

    async fn prune_dedup(&self, before: i64) -> Result<usize, StoreError> {
        self.write(move |connection| {
            connection.execute(
                "DELETE FROM dedup WHERE seen_at < ?1",
                rusqlite::params![before],
            )
        })
        .await
    }
}
