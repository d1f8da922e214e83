//! Approvals around the turn (docs/reference.md, "Approvals"): pausing a turn on a call that
//! needs an operator's decision, taking the decision, and expiring what nobody decided.
//!
//! The turn core decides which calls wait (`turn::Action::AwaitApproval`); `request` makes the
//! request that the runner commits in the same transaction that takes the turn off its slot,
//! and `requested` says so. Nothing of
//! the turn stays in memory while it waits: a decision (`decide`, or `expire_due` when its time
//! ran out) queues the event again, and the next run reads the decision from the transcript.

use std::time::Duration;

use super::Sessions;
use super::turn::GatedCall;
use crate::agent::catalog;
use crate::config::{Config, Settings};
use crate::logging;
use crate::metrics;
use crate::store::approval::{AGENTGATE, Verdict};
use crate::store::{
    ApprovalRow, ApprovalStatus, ClaimedTurn, Decided, Decision, NewApproval, Store, StoreError,
    now_millis, rfc3339,
};

/// What a decision asked for over the control socket (or a link, or the console) became.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Recorded as asked.
    Decided(Decided),
    /// Not recorded as asked: the route no longer offers the tool (a reload removed it). The
    /// request is denied by agentgate instead, so the turn goes on and the model is told.
    ToolGone(ApprovalRow),
}

/// Takes the decision `verdict` on approval `id`, made `by` with `note`, and says so (log line,
/// metrics, the scheduler woken for the turn that continues). An approval of a tool the route
/// no longer offers is refused.
pub(crate) async fn decide(
    store: &Store,
    config: &Config,
    sessions: &Sessions,
    id: &str,
    verdict: Verdict,
    decision: (String, Option<String>),
) -> Result<Outcome, StoreError> {
    let (by, note) = decision;
    // An approval of a tool the route no longer offers becomes agentgate's denial.
    let gone = match verdict {
        Verdict::Approve => store
            .approval(id)
            .await?
            .filter(|row| !catalog::still_offered(config, &row.route, &row.tool)),
        Verdict::Deny => None,
    };
    let decision = match &gone {
        Some(row) => Decision::denied(
            AGENTGATE,
            format!(
                "the tool {:?} is no longer offered by route {:?} (the configuration changed)",
                row.tool, row.route
            ),
        ),
        None => Decision {
            status: verdict.status(),
            by,
            note,
        },
    };
    let outcome = store.decide_approval(id, decision).await?;
    match &outcome {
        Decided::Taken(row) | Decided::Expired(row) => decided(sessions, row),
        Decided::Unknown | Decided::Already(_) => {}
    }
    Ok(match (gone, outcome) {
        (Some(_), Decided::Taken(row)) => Outcome::ToolGone(row),
        (Some(_), other @ (Decided::Unknown | Decided::Already(_) | Decided::Expired(_)))
        | (None, other) => Outcome::Decided(other),
    })
}

/// Expires the pending requests whose time ran out, in batches; each one's turn continues.
pub(crate) async fn expire_due(store: &Store, sessions: &Sessions) -> Result<usize, StoreError> {
    let mut expired = 0;
    loop {
        let batch = store.expire_approvals().await?;
        if batch.is_empty() {
            return Ok(expired);
        }
        expired += batch.len();
        for row in &batch {
            decided(sessions, row);
        }
    }
}

/// Logs and counts a decision that was recorded, and wakes the scheduler for its turn.
pub(crate) fn decided(sessions: &Sessions, row: &ApprovalRow) {
    let waited = row
        .decided_at
        .unwrap_or(row.requested_at)
        .saturating_sub(row.requested_at);
    metrics::approval_decided(
        &row.tool,
        row.status,
        Duration::from_millis(u64::try_from(waited).unwrap_or(0)),
    );
    let decided_by = row.decided_by.as_deref().unwrap_or("");
    match row.status {
        ApprovalStatus::Approved => tracing::info!(
            message_id = logging::MESSAGE_APPROVAL_DECIDED,
            session_key = %row.session, event_id = %row.event_id, approval_id = %row.id,
            tool = %row.tool, decision = %row.status, decided_by,
            "approval request approved; the call runs and the turn continues"
        ),
        ApprovalStatus::Denied | ApprovalStatus::Expired | ApprovalStatus::Pending => {
            tracing::warn!(
                message_id = logging::MESSAGE_APPROVAL_DECIDED,
                session_key = %row.session, event_id = %row.event_id, approval_id = %row.id,
                tool = %row.tool, decision = %row.status, decided_by,
                "approval request not approved; the call does not run and the turn continues"
            );
        }
    }
    sessions.wake();
}

/// The approval request for `call` of `turn`, with its delivery (the runner commits it).
pub(super) fn request(settings: &Settings, turn: &ClaimedTurn, call: GatedCall) -> NewApproval {
    let now = now_millis();
    let timeout = settings.config.runtime.approval_timeout;
    let event = &turn.event;
    let row = ApprovalRow {
        id: uuid::Uuid::now_v7().to_string(),
        event_id: event.id.clone(),
        session: event.session_key.clone(),
        route: event.route.clone(),
        turn_id: turn.turn_id.clone(),
        call_id: call.call_id,
        tool: call.name,
        arguments: call.arguments,
        status: ApprovalStatus::Pending,
        requested_at: now,
        expires_at: now.saturating_add(millis(timeout)),
        decided_at: None,
        decided_by: None,
        note: None,
        link_secret: format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        ),
    };
    let delivery = request_delivery(&row, settings.config.server.public_url.as_deref());
    NewApproval { row, delivery }
}

/// Logs and counts a request its turn committed.
pub(super) fn requested(request: &NewApproval) {
    metrics::approval_requested(&request.row.tool);
    tracing::warn!(
        message_id = logging::MESSAGE_APPROVAL_REQUESTED,
        approval_id = %request.row.id, tool = %request.row.tool,
        expires_at = %rfc3339(request.row.expires_at),
        "tool call waits for an operator's decision (agentgate approvals approve|deny {})",
        request.row.id
    );
}

/// The `approval_request` delivery of `request`, with its approve and deny links when the
/// listener has a `public_url`.
fn request_delivery(request: &ApprovalRow, public_url: Option<&str>) -> String {
    let link = |action: &str| public_url.map(|base| link_url(base, request, action));
    serde_json::json!({
        "kind": "approval_request",
        "approval_id": request.id,
        "event_id": request.event_id,
        "route": request.route,
        "session": request.session,
        "tool": request.tool,
        "arguments": request.arguments,
        "expires_at": rfc3339(request.expires_at),
        "approve_url": link(APPROVE),
        "deny_url": link(DENY),
    })
    .to_string()
}

/// The actions a link takes, as its path names them.
pub(crate) const APPROVE: &str = "approve";
pub(crate) const DENY: &str = "deny";

/// `{public_url}/approvals/{id}/{action}?h=..&t=..`: `h` names the arguments (the start of
/// their hash), `t` is the token that only agentgate can make (`signature::approval_token`).
fn link_url(base: &str, request: &ApprovalRow, action: &str) -> String {
    let hash = crate::signature::arguments_hash(&request.arguments);
    let token = crate::signature::approval_token(
        &request.link_secret,
        action,
        &request.id,
        &request.arguments,
    );
    format!(
        "{base}/approvals/{}/{action}?h={}&t={token}",
        request.id,
        &hash[..LINK_HASH_CHARS]
    )
}

/// The hex characters of the arguments' hash a link carries.
pub(crate) const LINK_HASH_CHARS: usize = 16;

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
