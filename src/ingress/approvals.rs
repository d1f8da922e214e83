//! The control socket's approval endpoints (docs/reference.md, "Approvals"): `GET
//! /v1/approvals[/{id}]`, `POST /v1/approvals/{id}/{approve|deny}`. A decision records who took
//! it: the Unix user of the connecting process, from the socket's peer credentials, so that
//! nobody can claim another name by what they send.

use bytes::Bytes;
use http::{Request, StatusCode};
use serde_json::json;

use super::api::{ApprovalsPage, DecisionRequest};
use super::body::BodyError;
use super::connection::RequestBody;
use super::control::{Control, ControlError};
use super::query::Query;
use super::response::{HttpResponse, error, json_response, request_timeout};
use crate::session::approval::Outcome;
use crate::store::approval::Verdict;
use crate::store::{ApprovalRow, Decided};

/// The longest note or reason a decision may carry (over the control API and the console).
pub(super) const MAX_NOTE: usize = 2000;
/// Requests listed at most (the oldest first).
const LIST_MAX: i64 = 1000;

impl Control {
    /// `GET /v1/approvals[?all=true]`: pending requests (all of them with `all`), oldest first.
    pub(super) async fn approvals(
        &self,
        query: Option<&str>,
    ) -> Result<HttpResponse, ControlError> {
        let all = Query::parse(query).get("all").as_deref() == Some("true");
        let approvals = self.ops.store.approvals(!all, LIST_MAX).await?;
        Ok(json_response(
            StatusCode::OK,
            &json!(ApprovalsPage { approvals }),
        ))
    }

    /// `GET /v1/approvals/{id}`.
    pub(super) async fn approval(&self, id: &str) -> Result<HttpResponse, ControlError> {
        Ok(match self.ops.store.approval(id).await? {
            Some(row) => json_response(StatusCode::OK, &json!(row)),
            None => no_approval(id),
        })
    }

    /// `POST /v1/approvals/{id}/{approve|deny}` with an optional `{"note"}` / `{"reason"}`,
    /// decided by `peer` (the connecting process's user).
    pub(super) async fn decide(
        &self,
        id: &str,
        verdict: Verdict,
        peer: &str,
        request: Request<RequestBody>,
    ) -> Result<HttpResponse, ControlError> {
        let body = self
            .ops
            .read_body(request.into_body(), MAX_NOTE * 4 + 64)
            .await;
        let note = match decision_note(body, verdict) {
            Ok(note) => note,
            Err(refusal) => return Ok(*refusal),
        };
        let outcome = self.ops.take_decision(id, verdict, peer, note).await?;
        Ok(answer(id, outcome))
    }
}

/// The note or reason of a decision's body (none for an empty body); a `400` for a body that is
/// not the document, or a note longer than `MAX_NOTE`.
fn decision_note(
    body: Result<Bytes, BodyError>,
    verdict: Verdict,
) -> Result<Option<String>, Box<HttpResponse>> {
    let bad = |message: &str| Box::new(error(StatusCode::BAD_REQUEST, "bad_decision", message));
    let body = match body {
        Ok(body) => body,
        Err(BodyError::TimedOut) => return Err(Box::new(request_timeout())),
        Err(BodyError::TooLarge | BodyError::Unreadable | BodyError::NoSlot) => {
            return Err(bad("the body is too long or was cut off"));
        }
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let document: DecisionRequest = serde_json::from_slice(&body).map_err(|err| {
        bad(&format!(
            "the body must be {{\"note\"}} or {{\"reason\"}}: {err}"
        ))
    })?;
    let note = match verdict {
        Verdict::Approve => document.note.or(document.reason),
        Verdict::Deny => document.reason.or(document.note),
    };
    match note {
        Some(note) if note.chars().count() > MAX_NOTE => Err(bad(&format!(
            "the note is longer than {MAX_NOTE} characters"
        ))),
        note => Ok(note.filter(|note| !note.trim().is_empty())),
    }
}

/// The answer to a decision: `200` with the decided request, `404` for an unknown one, `409`
/// when it is no longer pending (decided before, expired, or its tool is gone).
pub(super) fn answer(id: &str, outcome: Outcome) -> HttpResponse {
    match outcome {
        Outcome::Decided(Decided::Taken(row)) => json_response(StatusCode::OK, &json!(row)),
        Outcome::Decided(Decided::Unknown) => no_approval(id),
        Outcome::Decided(Decided::Already(row)) => conflict(
            "already_decided",
            &format!(
                "approval {id} is already decided: {} by {}",
                row.status,
                row.decided_by.as_deref().unwrap_or("?")
            ),
            &row,
        ),
        Outcome::Decided(Decided::Expired(row)) => conflict(
            "expired",
            &format!("approval {id} expired without a decision (runtime.approval_timeout)"),
            &row,
        ),
        Outcome::ToolGone(row) => conflict(
            "tool_removed",
            &format!(
                "approval {id} cannot be approved: route {:?} no longer offers the tool {:?}; \
                 it is denied and the model is told",
                row.route, row.tool
            ),
            &row,
        ),
    }
}

fn conflict(code: &'static str, message: &str, row: &ApprovalRow) -> HttpResponse {
    json_response(
        StatusCode::CONFLICT,
        &json!({"error": code, "message": message, "approval": row}),
    )
}

fn no_approval(id: &str) -> HttpResponse {
    error(
        StatusCode::NOT_FOUND,
        "no_approval",
        &format!("no approval request {id:?}"),
    )
}
