//! `sessions list/show/resume/suspend` and `ledger show`: the operator's view of sessions and
//! the overrides.

use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::store::{self};

use super::state::StateAccess;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Override {
    Resume,
    Suspend,
}

pub(super) fn operator_override(
    source: &ConfigSource,
    key: &str,
    what: Override,
) -> Result<(), Failure> {
    let state = StateAccess::open(source)?;
    let before = state
        .query(async |store| match what {
            Override::Resume => store.operator_resume(key).await,
            Override::Suspend => store.operator_suspend(key).await,
        })?
        .flatten()
        .ok_or_else(|| Failure::runtime(format!("no session {key:?}")))?;
    store::StateDir::new(&state.state_dir)
        .restore_ownership()
        .map_err(|err| {
            Failure::state(format!(
                "{}: cannot restore ownership: {err}",
                state.state_dir.display()
            ))
        })?;
    match what {
        Override::Resume => {
            println!("session {key}: resumed (was {before}); its ledger entry is cleared");
        }
        Override::Suspend => println!("session {key}: suspended (was {before})"),
    }
    Ok(())
}

pub(super) fn ledger_show(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let ledger = StateAccess::open(source)?
        .query(async |store| store.resume_ledger().await)?
        .unwrap_or_default();
    if json {
        print!("{}", String::from_utf8_lossy(&ledger.to_json()));
        return Ok(());
    }
    println!("{:<48} {:>8}  LAST ATTEMPT", "SESSION", "ATTEMPTS");
    for (key, entry) in &ledger.sessions {
        println!("{key:<48} {:>8}  {}", entry.attempts, entry.last_attempt);
    }
    Ok(())
}

pub(super) fn sessions_list(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let sessions = StateAccess::open(source)?
        .query(async |store| store.sessions().await)?
        .unwrap_or_default();
    if json {
        println!("{:#}", serde_json::json!(sessions));
        return Ok(());
    }
    println!(
        "{:<40} {:<16} {:<15} {:>5} {:>6}  LAST TURN",
        "SESSION", "ROUTE", "STATE", "TURNS", "QUEUED"
    );
    for s in sessions {
        println!(
            "{:<40} {:<16} {:<15} {:>5} {:>6}  {}",
            s.key,
            s.route,
            s.state,
            s.turns,
            s.queued,
            s.last_turn_status.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

pub(super) fn sessions_show(source: &ConfigSource, key: &str, json: bool) -> Result<(), Failure> {
    let found = StateAccess::open(source)?
        .query(async |store| Ok((store.session(key).await?, store.transcript(key).await?)))?;
    let Some((Some(session), transcript)) = found else {
        return Err(Failure::runtime(format!("no session {key:?}")));
    };
    if json {
        println!(
            "{:#}",
            serde_json::json!({"session": session, "transcript": transcript})
        );
        return Ok(());
    }
    println!(
        "session {}  route {}  state {}{}  turns {}",
        session.key,
        session.route,
        session.state,
        session
            .reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default(),
        session.turns
    );
    for row in transcript {
        println!("{}", render_entry(&row.body));
    }
    Ok(())
}

/// One transcript entry as a readable block: who said what, which tool ran with what.
pub(super) fn render_entry(body: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
    match body["kind"].as_str() {
        Some("tool_start") => format!(
            "  -> tool {} {} [{}]",
            text(&body["name"]),
            body["arguments"],
            text(&body["call_id"])
        ),
        Some("message") => {
            let message = &body["message"];
            let role = text(&message["role"]);
            let mut block = match role.as_str() {
                "tool" => format!(
                    "  <- tool result [{}]: {}",
                    text(&message["tool_call_id"]),
                    text(&message["content"])
                ),
                _ => format!("{role}: {}", text(&message["content"])),
            };
            for call in message["tool_calls"].as_array().into_iter().flatten() {
                block.push_str(&format!(
                    "\n  assistant calls {}({}) [{}]",
                    text(&call["function"]["name"]),
                    text(&call["function"]["arguments"]),
                    text(&call["id"])
                ));
            }
            block
        }
        _ => body.to_string(),
    }
}
