//! Reading stored rows, the same way in both backends: each column by its name, fallibly.
//!
//! A row that does not decode (a NULL where a value belongs, a type that changed, a state this
//! agentgate does not know) is a [`StoreError::Decode`] that names the column, never a panic:
//! with `panic = "abort"` a panic on a stored row would end the daemon at every start, on every
//! node, in a crash loop that the retry ledger cannot bound. The decoders below are shared, so
//! a row type is read in one place whichever backend holds it.

use super::StoreError;
use super::approval::ApprovalRow;
use super::model::{
    ClaimedTurn, DeliveryCounts, DeliveryRow, Event, EventRow, InterruptedSession, LiveCounts,
    PendingDelivery, SessionRow, TranscriptRow, TurnRow,
};
use super::rewind::{RewindFrom, RewindOf};
use super::states::{Continuation, ResumeReason};
use crate::usage::{Spending, Spent, Usage, UsageDay, UsageReport};

/// What a column may be read as: the types both drivers convert.
pub(crate) trait Column:
    rusqlite::types::FromSql + for<'a> tokio_postgres::types::FromSql<'a>
{
}

impl<T> Column for T where T: rusqlite::types::FromSql + for<'a> tokio_postgres::types::FromSql<'a> {}

/// A row of either backend.
pub(crate) trait StoredRow {
    /// The column `name`, converted to `T`.
    fn column<T: Column>(&self, name: &'static str) -> Result<T, StoreError>;

    /// A count or step number, stored as a 64-bit integer.
    fn number<T: TryFrom<i64>>(&self, name: &'static str) -> Result<T, StoreError> {
        let value: i64 = self.column(name)?;
        T::try_from(value).map_err(|_| StoreError::Decode {
            column: name,
            reason: format!("{value} is out of range"),
        })
    }
}

impl StoredRow for rusqlite::Row<'_> {
    fn column<T: Column>(&self, name: &'static str) -> Result<T, StoreError> {
        self.get(name).map_err(|err| StoreError::Decode {
            column: name,
            reason: err.to_string(),
        })
    }
}

impl StoredRow for tokio_postgres::Row {
    fn column<T: Column>(&self, name: &'static str) -> Result<T, StoreError> {
        self.try_get(name).map_err(|err| StoreError::Decode {
            column: name,
            reason: err.to_string(),
        })
    }
}

/// `name` and `n` of a grouped count (`SELECT x AS name, count(*) AS n ... GROUP BY x`).
pub(crate) fn counted<K: Column, R: StoredRow + ?Sized>(row: &R) -> Result<(K, i64), StoreError> {
    Ok((row.column("name")?, row.column("n")?))
}

impl Event {
    /// The columns of `sql::EVENT_COLUMNS`.
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<Event, StoreError> {
        Ok(Event {
            id: row.column("id")?,
            route: row.column("route")?,
            session_key: row.column("session_key")?,
            event_type: row.column("event_type")?,
            delivery_id: row.column("delivery_id")?,
            headers: row.column("headers")?,
            payload: row.column("payload")?,
            trace_parent: row.column("trace_parent")?,
        })
    }
}

impl ClaimedTurn {
    /// The columns of `sql::CLAIM_COLUMNS`, claimed as `turn_id`.
    pub(crate) fn decode<R: StoredRow + ?Sized>(
        row: &R,
        turn_id: String,
    ) -> Result<ClaimedTurn, StoreError> {
        let reason: Option<String> = row.column("resume_reason")?;
        let rewound: Option<String> = row.column("rewind_from")?;
        let first_of_rewind: Option<String> = row.column("rewind_turn")?;
        Ok(ClaimedTurn {
            turn_id: first_of_rewind.unwrap_or(turn_id),
            event: Event::decode(row)?,
            continues: reason.as_deref().map(Continuation::from_sql),
            internal: row.column("internal")?,
            alone: row.column("run_alone")?,
            rewound: rewound.as_deref().and_then(RewindFrom::from_sql),
        })
    }
}

impl RewindOf {
    /// The `rewind_session` and `rewind_entry` columns of an event: `None` unless a rewind or
    /// fork queued it.
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<Option<RewindOf>, StoreError> {
        let session: Option<String> = row.column("rewind_session")?;
        let entry: Option<i64> = row.column("rewind_entry")?;
        Ok(session
            .zip(entry)
            .map(|(session, entry)| RewindOf { session, entry }))
    }
}

impl TranscriptRow {
    /// A row of `sql::TRANSCRIPT_SQL`; its body is JSON as written (kept as text if it is not).
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<TranscriptRow, StoreError> {
        let body: String = row.column("body")?;
        let event_id: Option<String> = row.column("id")?;
        let seq = row.column("seq")?;
        Ok(TranscriptRow {
            seq,
            n: seq,
            superseded_by: row.column("superseded_by")?,
            turn_id: row.column("turn_id")?,
            kind: row.column("kind")?,
            body: serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)),
            created_at: row.column("created_at")?,
            event: event_id.map(|_| Event::decode(row)).transpose()?,
        })
    }
}

impl ApprovalRow {
    /// The columns of `approval::APPROVAL_COLUMNS`.
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<ApprovalRow, StoreError> {
        let arguments: String = row.column("arguments")?;
        Ok(ApprovalRow {
            id: row.column("id")?,
            event_id: row.column("event_id")?,
            session: row.column("session_key")?,
            route: row.column("route")?,
            turn_id: row.column("turn_id")?,
            call_id: row.column("call_id")?,
            tool: row.column("tool")?,
            arguments: serde_json::from_str(&arguments).map_err(|err| StoreError::Decode {
                column: "arguments",
                reason: err.to_string(),
            })?,
            status: row.column("status")?,
            requested_at: row.column("requested_at")?,
            expires_at: row.column("expires_at")?,
            decided_at: row.column("decided_at")?,
            decided_by: row.column("decided_by")?,
            note: row.column("note")?,
            link_secret: row.column("link_secret")?,
        })
    }
}

impl InterruptedSession {
    /// The columns of `sql::INTERRUPTED_COLUMNS`.
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<InterruptedSession, StoreError> {
        let reason: String = row.column("reason")?;
        Ok(InterruptedSession {
            session_key: row.column("key")?,
            route: row.column("route")?,
            reason: ResumeReason::from_sql(&reason),
            turn_id: row.column("turn_id")?,
            event_id: row.column("event_id")?,
            steps: row.number("steps")?,
            started_at: row.column("started_at")?,
            crashed_with: row.number("crashed_with")?,
        })
    }
}

impl Spent {
    /// The columns of `sql::USAGE_SUMS`.
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<Spent, StoreError> {
        Ok(Spent {
            usage: Usage {
                input_tokens: row.number("input_tokens")?,
                cached_input_tokens: row.number("cached_input_tokens")?,
                output_tokens: row.number("output_tokens")?,
            },
            unknown_steps: row.number("unknown_steps")?,
            estimated_tokens: row.number("estimated_tokens")?,
        })
    }
}

impl Spending {
    /// The columns of `sql::HELD_SUMS`: what reservations hold, as tokens of prompts and replies.
    pub(crate) fn decode_held<R: StoredRow + ?Sized>(row: &R) -> Result<Spending, StoreError> {
        let held = |input: &'static str, output: &'static str| -> Result<Spent, StoreError> {
            Ok(Spent {
                usage: Usage {
                    input_tokens: row.number(input)?,
                    cached_input_tokens: 0,
                    output_tokens: row.number(output)?,
                },
                unknown_steps: 0,
                estimated_tokens: 0,
            })
        };
        Ok(Spending {
            turn: held("turn_input", "turn_output")?,
            session: held("session_input", "session_output")?,
            day: held("day_input", "day_output")?,
            route_day: held("route_input", "route_output")?,
        })
    }
}

impl UsageDay {
    /// A row of `sql::USAGE_BY_DAY_SQL`.
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<UsageDay, StoreError> {
        Ok(UsageDay {
            route: row.column("route")?,
            day: row.column("day")?,
            spent: Spent::decode(row)?,
        })
    }
}

impl LiveCounts {
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<LiveCounts, StoreError> {
        Ok(LiveCounts {
            queued: row.column("queued")?,
            resume_pending: row.column("resume_pending")?,
            suspended: row.column("suspended")?,
            approvals_pending: row.column("approvals_pending")?,
        })
    }
}

impl DeliveryCounts {
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<DeliveryCounts, StoreError> {
        Ok(DeliveryCounts {
            pending: row.column("pending")?,
            failed: row.column("failed")?,
        })
    }
}

impl SessionRow {
    /// A row of `sql::SESSION_SQL`.
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<SessionRow, StoreError> {
        Ok(SessionRow {
            key: row.column("key")?,
            route: row.column("route")?,
            state: row.column("state")?,
            reason: row.column("reason")?,
            last_turn_id: row.column("last_turn_id")?,
            last_turn_status: row.column("last_turn_status")?,
            turns: row.column("turns")?,
            queued: row.column("queued")?,
            updated_at: row.column("updated_at")?,
            usage: None,
            spent: None,
        })
    }
}

impl EventRow {
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<EventRow, StoreError> {
        Ok(EventRow {
            id: row.column("id")?,
            route: row.column("route")?,
            session: row.column("session_key")?,
            event_type: row.column("event_type")?,
            status: row.column("status")?,
            delivery_id: row.column("delivery_id")?,
            received_at: row.column("received_at")?,
            origin: row.column("origin")?,
            replay_of: row.column("replay_of")?,
            rewind_of: RewindOf::decode(row)?,
        })
    }
}

impl TurnRow {
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<TurnRow, StoreError> {
        Ok(TurnRow {
            id: row.column("id")?,
            status: row.column("status")?,
            reason: row.column("reason")?,
            steps: row.column("steps")?,
            started_at: row.column("started_at")?,
            finished_at: row.column("finished_at")?,
            error: row.column("error")?,
            usage: UsageReport::of(Spent::decode(row)?, None),
        })
    }
}

impl DeliveryRow {
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<DeliveryRow, StoreError> {
        Ok(DeliveryRow {
            event_id: row.column("event_id")?,
            route: row.column("route")?,
            session: row.column("session_key")?,
            status: row.column("status")?,
            attempts: row.column("attempts")?,
            next_attempt_at: row.column("next_attempt_at")?,
            last_error: row.column("last_error")?,
            updated_at: row.column("updated_at")?,
        })
    }
}

impl PendingDelivery {
    pub(crate) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<PendingDelivery, StoreError> {
        Ok(PendingDelivery {
            event_id: row.column("event_id")?,
            route: row.column("route")?,
            session_key: row.column("session_key")?,
            body: row.column("body")?,
            attempts: row.number("attempts")?,
            trace_parent: row.column("trace_parent")?,
        })
    }
}

impl super::model::EventDetail {
    /// A row of `sql::EVENT_SQL`; its turns and delivery are read on their own.
    pub(crate) fn decode<R: StoredRow + ?Sized>(
        row: &R,
    ) -> Result<super::model::EventDetail, StoreError> {
        let payload: Vec<u8> = row.column("payload")?;
        let headers: String = row.column("headers")?;
        let trace_parent: Option<String> = row.column("trace_parent")?;
        Ok(super::model::EventDetail {
            // `00-TRACE-SPAN-FLAGS`.
            trace_id: trace_parent.and_then(|t| t.split('-').nth(1).map(str::to_string)),
            event: EventRow::decode(row)?,
            payload: super::model::payload_value(&payload),
            headers: serde_json::from_str(&headers).unwrap_or_default(),
            turns: Vec::new(),
            delivery: None,
            replayed_as: Vec::new(),
            usage: UsageReport::default(),
        })
    }
}
