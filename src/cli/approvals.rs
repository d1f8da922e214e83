//! `approvals list|show|approve|deny`: tool calls waiting for an operator's decision
//! (docs/reference.md, "Approvals").
//!
//! While the daemon runs, decisions go through its control socket, which records the caller's
//! Unix user from the socket itself and wakes the turn at once. Without a daemon the decision is
//! committed to the state directly (by this process's user), and the turn continues at the next
//! start.

use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::ingress::api::{ApprovalsPage, DecisionRequest};
use crate::output::{Table, outln};
use crate::store::approval::Verdict;
use crate::store::rfc3339;
use crate::store::{ApprovalRow, Decided, Decision};

use super::control::{self, ControlAnswer, DaemonClient};
use super::state::StateAccess;

/// Requests listed at most.
const LIST_MAX: i64 = 1000;

/// `approvals list`: the pending requests, oldest first.
pub(super) fn approvals_list(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let approvals = if daemon.state_unreadable() {
        match daemon.request(http::Method::GET, "/v1/approvals")? {
            Some(answer) if answer.status.is_success() => {
                answer.document::<ApprovalsPage>()?.approvals
            }
            Some(answer) => return Err(Failure::unavailable(answer.message())),
            None => return Err(control::no_daemon_for_unreadable_state()),
        }
    } else {
        let state = StateAccess::open(source)?;
        state
            .query(async |store| store.approvals(true, LIST_MAX).await)?
            .unwrap_or_default()
    };
    if json {
        outln!("{:#}", serde_json::json!(ApprovalsPage { approvals }));
        return Ok(());
    }
    let mut table = Table::new(&["ID", "TOOL", "SESSION", "EXPIRES"]);
    for row in &approvals {
        table.row(vec![
            row.id.clone(),
            text(&row.tool),
            text(&row.session),
            rfc3339(row.expires_at),
        ]);
    }
    table.print();
    Ok(())
}

/// `approvals show ID`: one request, with its arguments and its decision if taken.
pub(super) fn approvals_show(source: &ConfigSource, id: &str, json: bool) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let row = if daemon.state_unreadable() {
        let path = format!("/v1/approvals/{}", control::path_segment(id));
        match daemon.request(http::Method::GET, &path)? {
            Some(answer) if answer.status.is_success() => Some(answer.document::<ApprovalRow>()?),
            Some(answer) if answer.status == http::StatusCode::NOT_FOUND => None,
            Some(answer) => return Err(Failure::unavailable(answer.message())),
            None => return Err(control::no_daemon_for_unreadable_state()),
        }
    } else {
        let state = StateAccess::open(source)?;
        state
            .query(async |store| store.approval(id).await)?
            .flatten()
    };
    let row = row.ok_or_else(|| Failure::runtime(format!("no approval request {id:?}")))?;
    if json {
        outln!("{:#}", serde_json::json!(row));
    } else {
        print_row(&row);
    }
    Ok(())
}

fn print_row(row: &ApprovalRow) {
    outln!("approval   {}", row.id);
    outln!("tool       {}", text(&row.tool));
    outln!("arguments  {}", text(&row.arguments.to_string()));
    outln!("session    {}", text(&row.session));
    outln!("event      {}", row.event_id);
    outln!("route      {}", text(&row.route));
    outln!("requested  {}", rfc3339(row.requested_at));
    outln!("expires    {}", rfc3339(row.expires_at));
    outln!("status     {}", row.status);
    if let Some(by) = &row.decided_by {
        outln!(
            "decided    {} by {}",
            row.decided_at.map(rfc3339).unwrap_or_default(),
            text(by)
        );
    }
    if let Some(note) = &row.note {
        outln!("note       {}", text(note));
    }
}

/// `approvals approve|deny ID`: exit 0 when decided as asked, 1 when the request is no longer
/// pending ("already decided", "expired") or unknown.
pub(super) fn approvals_decide(
    source: &ConfigSource,
    id: &str,
    verdict: Verdict,
    note: Option<String>,
) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let daemon_running = daemon.runs();
    let action = match verdict {
        Verdict::Approve => "approve",
        Verdict::Deny => "deny",
    };
    if daemon_running || daemon.state_unreadable() {
        let body = match verdict {
            Verdict::Approve => DecisionRequest { note, reason: None },
            Verdict::Deny => DecisionRequest {
                note: None,
                reason: note,
            },
        };
        let path = format!("/v1/approvals/{}/{action}", control::path_segment(id));
        let body = serde_json::to_vec(&body).map_err(|err| Failure::runtime(err.to_string()))?;
        return match daemon.post(&path, body)? {
            Some(answer) => report(&answer),
            None => Err(Failure::unavailable(format!(
                "no daemon answers on the control socket {} (server.control_socket)",
                daemon.location.control_socket.display()
            ))),
        };
    }
    drop(daemon);
    let decision = Decision {
        status: verdict.status(),
        by: current_user(),
        note,
    };
    let state = StateAccess::open(source)?;
    let decided = state
        .query(async |store| store.decide_approval(id, decision).await)?
        .ok_or_else(|| Failure::runtime(format!("no approval request {id:?}")))?;
    state.restore_ownership()?;
    match decided {
        Decided::Taken(row) => {
            outln!(
                "approval {id}: {}; the turn continues at the daemon's next start",
                row.status
            );
            Ok(())
        }
        Decided::Unknown => Err(Failure::runtime(format!("no approval request {id:?}"))),
        Decided::Already(row) => Err(Failure::runtime(format!(
            "approval {id} is already decided: {} by {}",
            row.status,
            row.decided_by.as_deref().unwrap_or("?")
        ))),
        Decided::Expired(_) => Err(Failure::runtime(format!(
            "approval {id} expired without a decision (runtime.approval_timeout)"
        ))),
    }
}

/// The daemon's answer to a decision, as a line (decided) or a failure (exit 1, or 75 when
/// the daemon could not reach its state).
fn report(answer: &ControlAnswer) -> Result<(), Failure> {
    match answer.status.as_u16() {
        200 => {
            let row = answer.document::<ApprovalRow>()?;
            outln!(
                "approval {}: {} by {}; the turn continues",
                row.id,
                row.status,
                row.decided_by.as_deref().unwrap_or("?")
            );
            Ok(())
        }
        503 => Err(Failure::temporary(answer.message())),
        _ => Err(Failure::runtime(answer.message())),
    }
}

/// This process's Unix user, by name (else its uid).
pub(super) fn current_user() -> String {
    crate::operator::user_name(nix::unistd::getuid().as_raw())
}

/// Text from a payload or a model, as a terminal may show it.
fn text(value: &str) -> String {
    crate::untrusted::for_terminal(value)
}
