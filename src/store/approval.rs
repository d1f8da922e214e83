//! Approval requests: a tool call that waits for an operator's decision (docs/reference.md,
//! "Approvals"), as both backends keep them.
//!
//! A request is committed in the transaction that pauses its turn, and a decision in the one
//! that queues the turn to continue, each with its transcript entry. So a crash at any point
//! leaves either a pending request (decided later), or a decision whose turn is queued: never a
//! lost request, a lost decision, or a decision without its turn going on. Whether the call then
//! runs is the turn's business, under the usual rule for calls cut off by a crash: it has run at
//! most once.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::sql::{APPEND_SQL, CONTINUE_EVENT_SQL, CONTINUE_SESSION_SQL, DECIDE_SQL, EXPIRE_BATCH};
use super::states::ApprovalStatus;
use super::tx::{Param, Tx, Values};
use super::{StoreError, now_millis};

/// The transcript entry kind of a request and of its decision.
pub(crate) const APPROVAL_ENTRY: &str = "approval";

/// What the operator decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Approve,
    Deny,
}

impl Verdict {
    pub(crate) const fn status(self) -> ApprovalStatus {
        match self {
            Verdict::Approve => ApprovalStatus::Approved,
            Verdict::Deny => ApprovalStatus::Denied,
        }
    }
}

/// A gated call, as its turn pauses on it: the request (pending) and its delivery.
#[derive(Debug, Clone)]
pub(crate) struct NewApproval {
    pub row: ApprovalRow,
    /// The `approval_request` delivery to the route's target.
    pub delivery: String,
}

/// An approval request and where it stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ApprovalRow {
    pub id: String,
    pub event_id: String,
    pub session: String,
    pub route: String,
    pub turn_id: String,
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    pub status: ApprovalStatus,
    /// Unix ms.
    pub requested_at: i64,
    pub expires_at: i64,
    pub decided_at: Option<i64>,
    /// The Unix user of the CLI, "link", "console", or "agentgate" (an expiry, an operator's
    /// suspension or cancellation of the session).
    pub decided_by: Option<String>,
    /// The operator's note (approve) or reason (deny).
    pub note: Option<String>,
    /// The key of its approve and deny links (`signature::approval_token`): never shown.
    #[serde(skip)]
    pub link_secret: String,
}

impl ApprovalRow {
    /// Takes `decision` on this row at `now`, and returns the body of the transcript entry that
    /// records it.
    pub(crate) fn record(&mut self, decision: Decision, now: i64) -> Result<String, StoreError> {
        self.status = decision.status;
        self.decided_by = Some(decision.by);
        self.decided_at = Some(now);
        self.note = decision.note;
        self.entry().body()
    }

    /// The transcript entry that records this row as it stands.
    pub(crate) fn entry(&self) -> ApprovalEntry {
        ApprovalEntry {
            approval_id: self.id.clone(),
            call_id: self.call_id.clone(),
            tool: self.tool.clone(),
            arguments: self.arguments.clone(),
            status: self.status,
            by: self.decided_by.clone(),
            note: self.note.clone(),
            expires_at: self.expires_at,
        }
    }
}

/// The transcript entry of a request (`pending`) and of its decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ApprovalEntry {
    pub approval_id: String,
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    pub status: ApprovalStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    pub expires_at: i64,
}

impl ApprovalEntry {
    /// The entry as a transcript row body (`{"kind": "approval", ...}`).
    pub(crate) fn body(&self) -> Result<String, StoreError> {
        let mut value =
            serde_json::to_value(self).map_err(|err| StoreError::Render(err.to_string()))?;
        if let Value::Object(fields) = &mut value {
            fields.insert("kind".into(), Value::String(APPROVAL_ENTRY.into()));
        }
        Ok(value.to_string())
    }
}

/// A decision to take: what, by whom, with which note.
#[derive(Debug, Clone)]
pub(crate) struct Decision {
    pub status: ApprovalStatus,
    pub by: String,
    pub note: Option<String>,
}

impl Decision {
    /// A denial by `by` with `reason`.
    pub(crate) fn denied(by: &str, reason: impl Into<String>) -> Decision {
        Decision {
            status: ApprovalStatus::Denied,
            by: by.to_string(),
            note: Some(reason.into()),
        }
    }

    /// What a request past `approval_timeout` becomes.
    pub(crate) fn expired() -> Decision {
        Decision {
            status: ApprovalStatus::Expired,
            by: AGENTGATE.to_string(),
            note: Some("no decision within runtime.approval_timeout".to_string()),
        }
    }
}

/// Who decided what agentgate decided itself (an expiry, a session suspended or cancelled).
pub(crate) const AGENTGATE: &str = "agentgate";

/// What a recorded decision answers: [`Decided::Taken`] or [`Decided::Expired`].
pub(crate) type Answer = fn(ApprovalRow) -> Decided;

/// How a decision asked for meets `row` at `now`, the same for both backends: the decision to
/// record (the one asked for, or expiry when the row's time ran out first) with what to answer,
/// or `None` when the row is no longer pending.
pub(crate) fn taking(row: &ApprovalRow, asked: Decision, now: i64) -> Option<(Decision, Answer)> {
    match row.status {
        ApprovalStatus::Pending if row.expires_at <= now => {
            Some((Decision::expired(), Decided::Expired))
        }
        ApprovalStatus::Pending => Some((asked, Decided::Taken)),
        ApprovalStatus::Approved | ApprovalStatus::Denied | ApprovalStatus::Expired => None,
    }
}

/// Decides request `id` as `decision` in `tx`, reading it with `find` (`$1` the id; PostgreSQL
/// locks its row, so that of two decisions at once the second finds it decided).
pub(super) async fn decide(
    tx: &impl Tx,
    find: &str,
    id: &str,
    decision: Decision,
) -> Result<Decided, StoreError> {
    let Some(row) = tx
        .maybe_row(find, &[&id], |row| ApprovalRow::decode(row))
        .await?
    else {
        return Ok(Decided::Unknown);
    };
    let now = now_millis();
    let Some((decision, answer)) = taking(&row, decision, now) else {
        return Ok(Decided::Already(row));
    };
    Ok(answer(settle(tx, row, decision, now).await?))
}

/// Expires a batch of the pending requests whose time ran out, which `due` selects
/// (`sql::DUE_TO_EXPIRE_SQL`; PostgreSQL locks them, skipping those another node is expiring);
/// the requests as expired.
pub(super) async fn expire(tx: &impl Tx, due: &str) -> Result<Vec<ApprovalRow>, StoreError> {
    let values: [&(dyn Param + Sync); 2] = [&now_millis(), &EXPIRE_BATCH];
    settle_selected(tx, due, &values, &Decision::expired()).await
}

/// Settles as `decision` each pending request that `select` answers with `values` (expired
/// ones, or a session's); the requests as settled.
pub(super) async fn settle_selected(
    tx: &impl Tx,
    select: &str,
    values: &Values<'_>,
    decision: &Decision,
) -> Result<Vec<ApprovalRow>, StoreError> {
    let rows = tx
        .rows(select, values, |row| ApprovalRow::decode(row))
        .await?;
    let now = now_millis();
    let mut settled = Vec::with_capacity(rows.len());
    for row in rows {
        settled.push(settle(tx, row, decision.clone(), now).await?);
    }
    Ok(settled)
}

/// Records `decision` on the pending `row`, appends it to the transcript of the turn that asked,
/// and queues that turn to continue once nothing else of its event is pending.
async fn settle(
    tx: &impl Tx,
    mut row: ApprovalRow,
    decision: Decision,
    now: i64,
) -> Result<ApprovalRow, StoreError> {
    let body = row.record(decision, now)?;
    let status = row.status.sql();
    let values: [&(dyn Param + Sync); 5] = [&row.id, &status, &row.decided_by, &now, &row.note];
    tx.run(DECIDE_SQL, &values).await?;
    let values: [&(dyn Param + Sync); 5] =
        [&row.session, &row.turn_id, &APPROVAL_ENTRY, &body, &now];
    tx.run(APPEND_SQL, &values).await?;
    tx.run(CONTINUE_EVENT_SQL, &[&row.event_id, &now]).await?;
    tx.run(CONTINUE_SESSION_SQL, &[&row.session, &now]).await?;
    Ok(row)
}

/// What became of a decision.
#[derive(Debug, Clone)]
pub(crate) enum Decided {
    /// Taken: the row as decided; its turn is queued to continue.
    Taken(ApprovalRow),
    /// No approval has that id.
    Unknown,
    /// It was decided before (the row says how).
    Already(ApprovalRow),
    /// Its time ran out before this decision: it is expired now.
    Expired(ApprovalRow),
}
