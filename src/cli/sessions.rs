//! `sessions list/show/resume/suspend/cancel/rewind/fork`, `reload` and `ledger show`: the
//! operator's view of sessions, and the overrides.

use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::operator::{OperatorAction, Rerun};
use crate::output::{Table, out, outln};

use super::control::{self, DaemonClient};
use super::state::StateAccess;
use crate::agent::message::Role;
use crate::config::ReloadReport;
use crate::ingress::api::{
    OperatorAnswer, RerunAnswer, RerunRequest, SessionDocument, SessionsPage,
};
use crate::session::turn::Entry;
use crate::store::{ApprovalStatus, Decision, SessionRow, TranscriptRow};

/// `sessions resume|suspend|cancel KEY`. While the daemon runs, it carries the action out itself
/// (over the control socket), so that it acts at once, logs the action and counts it. Without a
/// daemon, resume and suspend change the state directly; cancel has nothing to cancel. A stopped
/// daemon is not asked: under socket activation the connection would start it.
pub(super) fn operator_action(
    source: &ConfigSource,
    key: &str,
    action: OperatorAction,
) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let path = format!(
        "/v1/sessions/{}/{}",
        control::path_segment(key),
        action.name()
    );
    // A user who cannot read the state cannot tell whether the daemon runs: only it can act.
    let daemon_running = daemon.runs();
    let answer = if daemon_running || daemon.state_unreadable() {
        daemon.request(http::Method::POST, &path)?
    } else {
        None
    };
    match answer {
        Some(answer) => report_action(key, action, &answer),
        None if daemon_running => Err(Failure::unavailable(format!(
            "the daemon runs but its control socket {} does not answer (server.control_socket)",
            daemon.location.control_socket.display()
        ))),
        None => {
            drop(daemon);
            override_stored_state(source, key, action)
        }
    }
}

fn report_action(
    key: &str,
    action: OperatorAction,
    answer: &control::ControlAnswer,
) -> Result<(), Failure> {
    let done = || answer.document::<OperatorAnswer>();
    match (answer.status.as_u16(), action) {
        (200, OperatorAction::Resume) => outln!(
            "session {key}: resumed (was {}); its ledger entry is cleared",
            shown(done()?.previous_state)
        ),
        (200, OperatorAction::Suspend) => {
            outln!(
                "session {key}: suspended (was {})",
                shown(done()?.previous_state)
            );
        }
        (200, OperatorAction::Cancel) => outln!(
            "session {key}: turn {} cancelled; its event ended failed (cancelled by operator)",
            shown(done()?.turn_id)
        ),
        (202, OperatorAction::Cancel) => outln!(
            "session {key}: turn {} is being cancelled; it has not committed its end yet",
            shown(done()?.turn_id)
        ),
        (503, _) => return Err(Failure::temporary(answer.message())),
        _ => return Err(Failure::runtime(answer.message())),
    }
    Ok(())
}

/// A value the daemon may leave out, as a line shows it.
fn shown<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "?".to_string(), |value| value.to_string())
}

/// Resume or suspend with no daemon running: the stored state is changed directly, and the next
/// start goes by it.
fn override_stored_state(
    source: &ConfigSource,
    key: &str,
    action: OperatorAction,
) -> Result<(), Failure> {
    let resume = match action {
        OperatorAction::Suspend => false,
        OperatorAction::Resume => true,
        OperatorAction::Cancel => {
            return Err(Failure::runtime(format!(
                "no daemon is running, so session {key:?} has no running turn to cancel"
            )));
        }
    };
    let state = StateAccess::open(source)?;
    let before = state
        .query(async |store| {
            if resume {
                store.operator_resume(key).await
            } else {
                let before = store.operator_suspend(key).await?;
                if let Some(why) = action.denial() {
                    let denied = Decision::denied(&super::approvals::current_user(), why);
                    store.deny_session_approvals(key, denied).await?;
                }
                Ok(before)
            }
        })?
        .flatten()
        .ok_or_else(|| Failure::runtime(format!("no session {key:?}")))?;
    state.restore_ownership()?;
    if resume {
        outln!("session {key}: resumed (was {before}); its ledger entry is cleared");
    } else {
        outln!("session {key}: suspended (was {before})");
    }
    Ok(())
}

/// `sessions rewind KEY --to N` and `sessions fork KEY --at N --as NEWKEY`: prints the new turn
/// id. While the daemon runs (or for a user who cannot read the state) the daemon queues it, logs
/// and counts it, and starts it at once; otherwise the state is changed directly and the next
/// start runs it. A refusal exits 1 with its reason.
pub(super) fn rerun(
    source: &ConfigSource,
    key: &str,
    rerun: Rerun,
    asked: RerunRequest,
) -> Result<(), Failure> {
    let request = asked.clone().of(key, rerun).map_err(Failure::runtime)?;
    let daemon = DaemonClient::new(source)?;
    if daemon.runs() || daemon.state_unreadable() {
        let path = format!(
            "/v1/sessions/{}/{}",
            control::path_segment(key),
            rerun.name()
        );
        let body = serde_json::to_vec(&asked).map_err(|err| Failure::runtime(err.to_string()))?;
        let Some(answer) = daemon.post(&path, body)? else {
            return Err(control::no_daemon_for_unreadable_state());
        };
        return match answer.status.as_u16() {
            200 => {
                outln!("{}", answer.document::<RerunAnswer>()?.turn_id);
                Ok(())
            }
            503 => Err(Failure::temporary(answer.message())),
            _ => Err(Failure::runtime(answer.message())),
        };
    }
    drop(daemon);
    let state = StateAccess::open(source)?;
    let rewound = state
        .query(async |store| store.rewind(request).await)?
        .ok_or_else(|| Failure::runtime(format!("no session {key:?}")))?
        .map_err(|refusal| Failure::runtime(refusal.to_string()))?;
    state.restore_ownership()?;
    outln!("{}", rewound.turn_id);
    Ok(())
}

/// `agentgate reload`: asks the running daemon to re-read its config and prints its findings.
/// Exit 0 when the new config is in effect, 78 when the daemon refused it.
pub(super) fn reload(source: &ConfigSource) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let answer = daemon
        .request(http::Method::POST, "/v1/reload")?
        .ok_or_else(|| {
            Failure::unavailable(format!(
                "no daemon answers on {} (server.control_socket); nothing to reload",
                daemon.location.control_socket.display()
            ))
        })?;
    if answer.status == http::StatusCode::SERVICE_UNAVAILABLE {
        return Err(Failure::temporary(answer.message()));
    }
    let report = answer.document::<ReloadReport>()?;
    for finding in &report.findings {
        outln!("{finding}");
    }
    if !report.applied {
        return Err(Failure::config(format!(
            "reload refused, still serving on the previous config: {}",
            report.refused.as_deref().unwrap_or("see the findings")
        )));
    }
    outln!(
        "reloaded: {}",
        if report.changed.is_empty() {
            "no setting that applies now changed".to_string()
        } else {
            format!("changed {}", report.changed.join(", "))
        }
    );
    if !report.at_restart.is_empty() {
        outln!(
            "changed but waiting for a restart: {}",
            report.at_restart.join(", ")
        );
    }
    Ok(())
}

pub(super) fn ledger_show(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let ledger = super::access::Access::open(source)?.ledger()?;
    if json {
        out!("{}", String::from_utf8_lossy(&ledger.to_json()));
        return Ok(());
    }
    let mut table = Table::new(&["SESSION", "ATTEMPTS", "LAST ATTEMPT"]).right(&[1]);
    for (key, entry) in &ledger.sessions {
        table.row(vec![
            crate::untrusted::for_terminal(key),
            entry.attempts.to_string(),
            entry.last_attempt.to_string(),
        ]);
    }
    table.print();
    Ok(())
}

/// Every session, from the daemon's pages, newest first; `None` when no daemon answers. For
/// users who cannot read the state files.
fn sessions_from_daemon(daemon: &DaemonClient) -> Result<Option<Vec<SessionRow>>, Failure> {
    let mut sessions = Vec::new();
    let mut path = "/v1/sessions?limit=1000".to_string();
    loop {
        let Some(answer) = daemon.request(http::Method::GET, &path)? else {
            return Ok(None);
        };
        if !answer.status.is_success() {
            return Err(Failure::unavailable(answer.message()));
        }
        let page = answer.document::<SessionsPage>()?;
        sessions.extend(page.sessions);
        match page.next {
            Some(next) => {
                path = format!(
                    "/v1/sessions?limit=1000&after={}",
                    control::path_segment(&next)
                );
            }
            None => break,
        }
    }
    sessions.sort_by_key(|session| std::cmp::Reverse(session.updated_at));
    Ok(Some(sessions))
}

pub(super) fn sessions_list(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let sessions = if daemon.state_unreadable() {
        sessions_from_daemon(&daemon)?.ok_or_else(control::no_daemon_for_unreadable_state)?
    } else {
        StateAccess::open(source)?
            .query(async |store| store.sessions().await)?
            .unwrap_or_default()
    };
    if json {
        outln!("{:#}", serde_json::json!(sessions));
        return Ok(());
    }
    let mut table =
        Table::new(&["SESSION", "ROUTE", "STATE", "TURNS", "QUEUED", "LAST TURN"]).right(&[3, 4]);
    for session in sessions {
        table.row(vec![
            crate::untrusted::for_terminal(&session.key),
            session.route,
            session.state.to_string(),
            session.turns.to_string(),
            session.queued.to_string(),
            session
                .last_turn_status
                .map_or_else(|| "-".to_string(), |status| status.to_string()),
        ]);
    }
    table.print();
    Ok(())
}

/// The session `key` with its usage, budgets and transcript: from the state, or from the daemon
/// for a user who cannot read the state.
pub(super) fn session_document(
    source: &ConfigSource,
    key: &str,
) -> Result<SessionDocument, Failure> {
    let no_session = || Failure::runtime(format!("no session {key:?}"));
    let daemon = DaemonClient::new(source)?;
    let shown = if daemon.state_unreadable() {
        let path = format!("/v1/sessions/{}", control::path_segment(key));
        match daemon.request(http::Method::GET, &path)? {
            Some(answer) if answer.status == http::StatusCode::NOT_FOUND => {
                return Err(no_session());
            }
            Some(answer) if answer.status.is_success() => answer.document::<SessionDocument>()?,
            Some(answer) => return Err(Failure::unavailable(answer.message())),
            None => return Err(control::no_daemon_for_unreadable_state()),
        }
    } else {
        let state = StateAccess::open(source)?;
        let found = state.query(async |store| {
            Ok((
                store.session(key).await?,
                crate::session::transcript(store, key, i64::MIN).await?,
            ))
        })?;
        let Some((Some(mut session), transcript)) = found else {
            return Err(no_session());
        };
        session.usage = session
            .usage
            .map(|usage| usage.priced(state.price.as_ref()));
        SessionDocument {
            budgets: state.limits.session_use(&session),
            session,
            transcript,
        }
    };
    Ok(shown)
}

pub(super) fn sessions_show(source: &ConfigSource, key: &str, json: bool) -> Result<(), Failure> {
    let shown = session_document(source, key)?;
    if json {
        outln!("{:#}", serde_json::json!(shown));
        return Ok(());
    }
    let session = &shown.session;
    outln!(
        "session {}  route {}  state {}{}  turns {}",
        crate::untrusted::for_terminal(&session.key),
        session.route,
        session.state,
        session
            .reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default(),
        session.turns
    );
    if let Some(usage) = &session.usage {
        outln!("usage {usage}");
    }
    for budget in &shown.budgets {
        outln!("{}", super::usage::budget_line(budget, "in this session"));
    }
    for row in &shown.transcript {
        outln!("{}", numbered_entry(row));
    }
    Ok(())
}

/// A transcript entry with its number (what `sessions rewind --to` names) and, when a rewind
/// superseded it, the turn that did.
pub(super) fn numbered_entry(row: &TranscriptRow) -> String {
    let superseded = row
        .superseded_by
        .as_deref()
        .map(|turn_id| format!("[superseded by turn {turn_id}] "))
        .unwrap_or_default();
    let entry = render_entry(&row.body).replace('\n', "\n     ");
    format!("{:>4} {superseded}{entry}", row.n)
}

/// One transcript entry as a readable block: who said what, which tool ran with what. Payload and
/// tool text reach a terminal here, so control characters (escape sequences) are removed. An
/// entry this agentgate does not know is shown as its JSON.
pub(super) fn render_entry(body: &serde_json::Value) -> String {
    let text = crate::untrusted::for_terminal;
    let Ok(entry) = serde_json::from_value::<Entry>(body.clone()) else {
        return text(&body.to_string());
    };
    match entry {
        Entry::ToolStart {
            call_id,
            name,
            arguments,
            mcp_server,
            ..
        } => format!(
            "  -> {} {} {} [{}]",
            match mcp_server {
                Some(server) => format!("mcp tool (server {})", text(&server)),
                None => "tool".to_string(),
            },
            text(&name),
            text(&arguments.to_string()),
            text(&call_id)
        ),
        Entry::Message { message, .. } => {
            let content = text(message.content.as_deref().unwrap_or(""));
            let mut block = match message.role {
                Role::Tool => format!(
                    "  <- tool result [{}]: {content}",
                    text(message.tool_call_id.as_deref().unwrap_or(""))
                ),
                Role::System => format!("system: {content}"),
                Role::User => format!("user: {content}"),
                Role::Assistant => format!("assistant: {content}"),
            };
            for call in &message.tool_calls {
                block.push_str(&format!(
                    "\n  assistant calls {}({}) [{}]",
                    text(&call.function.name),
                    text(&call.function.arguments),
                    text(&call.id)
                ));
            }
            block
        }
        Entry::Event { event_id, .. } => format!("event {}", text(&event_id)),
        Entry::Approval(approval) => {
            let decided = match approval.status {
                ApprovalStatus::Pending => "waits for an operator's decision".to_string(),
                ApprovalStatus::Approved | ApprovalStatus::Denied | ApprovalStatus::Expired => {
                    format!(
                        "{} by {}{}",
                        approval.status,
                        text(approval.by.as_deref().unwrap_or("?")),
                        approval
                            .note
                            .map(|note| format!(": {}", text(&note)))
                            .unwrap_or_default()
                    )
                }
            };
            format!(
                "  ?? approval {} of {} {} [{}]: {decided}",
                text(&approval.approval_id),
                text(&approval.tool),
                text(&approval.arguments.to_string()),
                text(&approval.call_id)
            )
        }
    }
}
