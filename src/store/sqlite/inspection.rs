//! [`Inspection`] on SQLite: what `status`, `sessions`, `events` and `deliveries` show, read on
//! reader connections with the shared SQL (`store::sql`).

use std::collections::BTreeMap;

use const_format::concatcp;

use rusqlite::Connection;

use super::{SqliteStore, query, query_one, query_optional, value};
use crate::store::model::{
    ApprovalCounts, DeliveryCounts, DeliveryRow, EventDetail, EventFilter, EventRow, LiveCounts,
    SessionRow, StatusSummary, TranscriptRow, TranscriptTail, TurnRow,
};
use crate::store::row::counted;
use crate::store::sql::{
    DELIVERIES_SQL, DELIVERY_COUNTS_SQL, EVENT_DELIVERY_SQL, EVENT_REPLAYS_SQL, EVENT_SQL,
    EVENT_TRANSCRIPT_SQL, EVENT_TURNS_SQL, EVENT_USAGE_SQL, EVENTS_BY_STATUS_SQL, EVENTS_SQL,
    LIVE_COUNTS_SQL, ONE_SESSION_SQL, PENDING_COUNT_SQL, QUEUED_BY_ROUTE_SELECT,
    QUEUED_BY_ROUTE_WHERE, SESSION_USAGE_SQL, SESSIONS_BY_STATE_SQL, SESSIONS_PAGE_SQL,
    SESSIONS_SQL, TRANSCRIPT_TAIL_SQL, USAGE_BY_DAY_SQL,
};
use crate::store::states::{DeliveryState, EventStatus, SessionState};
use crate::store::{EVENT_ENTRY, Inspection, SessionFilter, StoreError, now_millis};
use crate::usage::{Spent, UsageDay, UsageReport, day_start};

/// Each route's queued events, from the index that holds the route (`INDEXED BY`: SQLite would
/// rather take `events_by_status` and read every queued event's row for its route).
pub(super) const QUEUED_BY_ROUTE_SQL: &str = concatcp!(
    QUEUED_BY_ROUTE_SELECT,
    " INDEXED BY events_queued_by_route",
    QUEUED_BY_ROUTE_WHERE
);

fn summary_in(connection: &Connection) -> Result<StatusSummary, StoreError> {
    let by_status: BTreeMap<_, _> =
        query(connection, EVENTS_BY_STATUS_SQL, &[], |row| counted(row))?
            .into_iter()
            .collect();
    let by_state: BTreeMap<_, _> =
        query(connection, SESSIONS_BY_STATE_SQL, &[], |row| counted(row))?
            .into_iter()
            .collect();
    let deliveries = query_one(connection, DELIVERY_COUNTS_SQL, &[], |row| {
        DeliveryCounts::decode(row)
    })?;
    let today = usage_in(connection, day_start(now_millis()))?;
    Ok(StatusSummary::from_counts(
        by_status,
        by_state,
        deliveries,
        None,
        UsageDay::total(&today),
        ApprovalCounts {
            pending: query_one(connection, PENDING_COUNT_SQL, &[], |row| value(row, "n"))?,
        },
    ))
}

fn usage_in(connection: &Connection, since: i64) -> Result<Vec<UsageDay>, StoreError> {
    query(connection, USAGE_BY_DAY_SQL, &[&since], |row| {
        UsageDay::decode(row)
    })
}

fn event_in(connection: &Connection, id: &str) -> Result<Option<EventDetail>, StoreError> {
    let Some(mut detail) = query_optional(connection, EVENT_SQL, &[&id], |row| {
        EventDetail::decode(row)
    })?
    else {
        return Ok(None);
    };
    detail.turns = query(connection, EVENT_TURNS_SQL, &[&id], |row| {
        TurnRow::decode(row)
    })?;
    detail.delivery = query_optional(connection, EVENT_DELIVERY_SQL, &[&id], |row| {
        DeliveryRow::decode(row)
    })?;
    detail.replayed_as = query(connection, EVENT_REPLAYS_SQL, &[&id], |row| {
        value(row, "id")
    })?;
    let spent = query_one(connection, EVENT_USAGE_SQL, &[&id], |row| {
        Spent::decode(row)
    })?;
    detail.usage = UsageReport::of(spent, None);
    Ok(Some(detail))
}

#[async_trait::async_trait]
impl Inspection for SqliteStore {
    async fn live_counts(&self) -> Result<LiveCounts, StoreError> {
        self.read(|connection| {
            query_one(connection, LIVE_COUNTS_SQL, &[], |row| {
                LiveCounts::decode(row)
            })
        })
        .await
    }

    async fn queued_by_route(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.read(|connection| query(connection, QUEUED_BY_ROUTE_SQL, &[], |row| counted(row)))
            .await
    }

    async fn status_summary(&self) -> Result<StatusSummary, StoreError> {
        self.read(summary_in).await
    }

    async fn sessions(&self) -> Result<Vec<SessionRow>, StoreError> {
        self.read(|connection| query(connection, SESSIONS_SQL, &[], |row| SessionRow::decode(row)))
            .await
    }

    async fn sessions_page(&self, filter: SessionFilter) -> Result<Vec<SessionRow>, StoreError> {
        self.read(move |connection| {
            let state = filter.state.map(SessionState::sql);
            let pattern = filter.key_pattern();
            query(
                connection,
                SESSIONS_PAGE_SQL,
                &[
                    &filter.after,
                    &filter.limit,
                    &state,
                    &filter.route,
                    &pattern,
                ],
                |row| SessionRow::decode(row),
            )
        })
        .await
    }

    async fn session(&self, key: &str) -> Result<Option<SessionRow>, StoreError> {
        let key = key.to_string();
        self.read(move |connection| {
            let Some(mut session) = query_optional(connection, ONE_SESSION_SQL, &[&key], |row| {
                SessionRow::decode(row)
            })?
            else {
                return Ok(None);
            };
            let spent = query_one(connection, SESSION_USAGE_SQL, &[&key], |row| {
                Spent::decode(row)
            })?;
            session.usage = Some(UsageReport::of(spent, None));
            session.spent = Some(spent);
            Ok(Some(session))
        })
        .await
    }

    async fn transcript_tail(
        &self,
        session_key: &str,
        limit: i64,
    ) -> Result<TranscriptTail, StoreError> {
        let key = session_key.to_string();
        self.read(move |connection| {
            let rows = query(
                connection,
                TRANSCRIPT_TAIL_SQL,
                &[&key, &EVENT_ENTRY, &(limit + 1)],
                |row| TranscriptRow::decode(row),
            )?;
            Ok(TranscriptTail::of(rows, limit))
        })
        .await
    }

    async fn event_transcript(
        &self,
        event_id: &str,
        limit: i64,
    ) -> Result<Vec<TranscriptRow>, StoreError> {
        let id = event_id.to_string();
        self.read(move |connection| {
            query(
                connection,
                EVENT_TRANSCRIPT_SQL,
                &[&id, &EVENT_ENTRY, &limit],
                |row| TranscriptRow::decode(row),
            )
        })
        .await
    }

    async fn usage_by_day(&self, since: i64) -> Result<Vec<UsageDay>, StoreError> {
        self.read(move |connection| usage_in(connection, since))
            .await
    }

    async fn events(&self, filter: EventFilter) -> Result<Vec<EventRow>, StoreError> {
        self.read(move |connection| {
            let status = filter.status.map(EventStatus::sql);
            query(
                connection,
                EVENTS_SQL,
                &[
                    &status,
                    &filter.route,
                    &filter.session,
                    &filter.limit,
                    &filter.before,
                    &filter.since,
                    &filter.until,
                    &filter.delivery_id,
                ],
                |row| EventRow::decode(row),
            )
        })
        .await
    }

    async fn event(&self, id: &str) -> Result<Option<EventDetail>, StoreError> {
        let id = id.to_string();
        self.read(move |connection| event_in(connection, &id)).await
    }

    async fn deliveries(
        &self,
        state: Option<DeliveryState>,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, StoreError> {
        let status = state.map(DeliveryState::sql);
        self.read(move |connection| {
            query(connection, DELIVERIES_SQL, &[&status, &limit], |row| {
                DeliveryRow::decode(row)
            })
        })
        .await
    }
}
