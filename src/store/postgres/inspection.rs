//! [`Inspection`] on PostgreSQL: what `status`, `sessions`, `events` and `deliveries` show, with
//! the shared SQL (`store::sql`) and, in `status`, the nodes.

use std::collections::BTreeMap;

use const_format::concatcp;

use super::PostgresStore;
use super::connect::{Cached, bounded};
use crate::store::model::{
    ApprovalCounts, DeliveryCounts, DeliveryRow, EventDetail, EventFilter, EventRow, LiveCounts,
    SessionRow, StatusSummary, TranscriptRow, TranscriptTail, TurnRow,
};
use crate::store::row::StoredRow;
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

pub(super) const QUEUED_BY_ROUTE_SQL: &str =
    concatcp!(QUEUED_BY_ROUTE_SELECT, QUEUED_BY_ROUTE_WHERE);

#[async_trait::async_trait]
impl Inspection for PostgresStore {
    async fn live_counts(&self) -> Result<LiveCounts, StoreError> {
        self.fetch_one(LIVE_COUNTS_SQL, &[], LiveCounts::decode)
            .await
    }

    async fn queued_by_route(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.fetch(QUEUED_BY_ROUTE_SQL, &[], counted).await
    }

    async fn status_summary(&self) -> Result<StatusSummary, StoreError> {
        bounded(async {
            let client = self.client().await?;
            let by_status = client
                .rows(EVENTS_BY_STATUS_SQL, &[])
                .await?
                .iter()
                .map(counted)
                .collect::<Result<BTreeMap<_, _>, _>>()?;
            let by_state = client
                .rows(SESSIONS_BY_STATE_SQL, &[])
                .await?
                .iter()
                .map(counted)
                .collect::<Result<BTreeMap<_, _>, _>>()?;
            let deliveries = DeliveryCounts::decode(&client.row(DELIVERY_COUNTS_SQL, &[]).await?)?;
            let nodes = self.nodes(&client).await?;
            let today = client
                .rows(USAGE_BY_DAY_SQL, &[&day_start(now_millis())])
                .await?
                .iter()
                .map(UsageDay::decode)
                .collect::<Result<Vec<_>, _>>()?;
            Ok(StatusSummary::from_counts(
                by_status,
                by_state,
                deliveries,
                Some(nodes),
                UsageDay::total(&today),
                ApprovalCounts {
                    pending: client.row(PENDING_COUNT_SQL, &[]).await?.column("n")?,
                },
            ))
        })
        .await
    }

    async fn sessions(&self) -> Result<Vec<SessionRow>, StoreError> {
        self.fetch(SESSIONS_SQL, &[], SessionRow::decode).await
    }

    async fn sessions_page(&self, filter: SessionFilter) -> Result<Vec<SessionRow>, StoreError> {
        let state = filter.state.map(SessionState::sql);
        let pattern = filter.key_pattern();
        self.fetch(
            SESSIONS_PAGE_SQL,
            &[
                &filter.after,
                &filter.limit,
                &state,
                &filter.route,
                &pattern,
            ],
            SessionRow::decode,
        )
        .await
    }

    async fn session(&self, key: &str) -> Result<Option<SessionRow>, StoreError> {
        let Some(mut session) = self
            .fetch_optional(ONE_SESSION_SQL, &[&key], SessionRow::decode)
            .await?
        else {
            return Ok(None);
        };
        let spent = self
            .fetch_one(SESSION_USAGE_SQL, &[&key], Spent::decode)
            .await?;
        session.usage = Some(UsageReport::of(spent, None));
        session.spent = Some(spent);
        Ok(Some(session))
    }

    async fn transcript_tail(
        &self,
        session_key: &str,
        limit: i64,
    ) -> Result<TranscriptTail, StoreError> {
        let rows = self
            .fetch(
                TRANSCRIPT_TAIL_SQL,
                &[&session_key, &EVENT_ENTRY, &(limit + 1)],
                TranscriptRow::decode,
            )
            .await?;
        Ok(TranscriptTail::of(rows, limit))
    }

    async fn event_transcript(
        &self,
        event_id: &str,
        limit: i64,
    ) -> Result<Vec<TranscriptRow>, StoreError> {
        self.fetch(
            EVENT_TRANSCRIPT_SQL,
            &[&event_id, &EVENT_ENTRY, &limit],
            TranscriptRow::decode,
        )
        .await
    }

    async fn usage_by_day(&self, since: i64) -> Result<Vec<UsageDay>, StoreError> {
        self.fetch(USAGE_BY_DAY_SQL, &[&since], UsageDay::decode)
            .await
    }

    async fn events(&self, filter: EventFilter) -> Result<Vec<EventRow>, StoreError> {
        let status = filter.status.map(EventStatus::sql);
        self.fetch(
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
            EventRow::decode,
        )
        .await
    }

    async fn event(&self, id: &str) -> Result<Option<EventDetail>, StoreError> {
        let Some(mut detail) = self
            .fetch_optional(EVENT_SQL, &[&id], EventDetail::decode)
            .await?
        else {
            return Ok(None);
        };
        detail.turns = self.fetch(EVENT_TURNS_SQL, &[&id], TurnRow::decode).await?;
        detail.delivery = self
            .fetch_optional(EVENT_DELIVERY_SQL, &[&id], DeliveryRow::decode)
            .await?;
        detail.replayed_as = self
            .fetch(EVENT_REPLAYS_SQL, &[&id], |row| row.column("id"))
            .await?;
        let spent = self
            .fetch_one(EVENT_USAGE_SQL, &[&id], Spent::decode)
            .await?;
        detail.usage = UsageReport::of(spent, None);
        Ok(Some(detail))
    }

    async fn deliveries(
        &self,
        state: Option<DeliveryState>,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, StoreError> {
        let status = state.map(DeliveryState::sql);
        self.fetch(DELIVERIES_SQL, &[&status, &limit], DeliveryRow::decode)
            .await
    }
}
