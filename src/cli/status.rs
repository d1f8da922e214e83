//! `status`: the daemon and its state in one screen, or as JSON.

use crate::output::{out, outln};
use std::path::Path;

use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::store::NodeState;
use crate::store::{DaemonLock, StatusSummary};

use super::control::DaemonClient;
use super::state::StateAccess;

pub(super) fn status(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    // A user who may not read the state (a member of the daemon's group) gets the daemon's own
    // summary from the control socket.
    let daemon = DaemonClient::new(source)?;
    if daemon.state_unreadable() {
        return match daemon.request(http::Method::GET, "/v1/status")? {
            Some(answer) if answer.status.is_success() => {
                daemon_status(&answer.body, json);
                Ok(())
            }
            _ => Err(super::control::no_daemon_for_unreadable_state()),
        };
    }
    let state = StateAccess::open(source)?;
    let summary = state
        .query(async |store| store.status_summary().await)?
        .unwrap_or_default();
    let running = DaemonLock::is_held(&state.state_dir)
        || summary
            .nodes
            .iter()
            .flatten()
            .any(|node| node.state == NodeState::Running);
    // The ledger as the next resume will see it: a malformed one blocks every resume.
    let ledger = match state.query(async |store| store.resume_ledger().await) {
        Ok(ledger) => serde_json::json!({
            "sessions": ledger.map_or(0, |ledger| ledger.sessions.len()),
            "valid": true
        }),
        Err(err) => serde_json::json!({"valid": false, "error": err.to_string()}),
    };
    let mcp = if running {
        mcp_servers(&daemon)
    } else {
        serde_json::Value::Null
    };
    if json {
        let document = serde_json::json!({
            "version": crate::VERSION,
            "daemon": {"running": running},
            "state_dir": state.state_dir,
            "events": summary.events,
            "sessions": summary.sessions,
            "deliveries": summary.deliveries,
            "ledger": ledger,
            "nodes": summary.nodes,
            "mcp": mcp,
        });
        outln!("{document:#}");
    } else {
        out!("{}", render_status(&state.state_dir, running, &summary));
        match ledger["valid"].as_bool() {
            Some(true) => outln!(
                "ledger:     {} session(s) with resume counts",
                ledger["sessions"]
            ),
            _ => outln!(
                "ledger:     UNUSABLE, no resume is dispatched: {}",
                ledger["error"].as_str().unwrap_or("")
            ),
        }
        for (name, server) in mcp.as_object().into_iter().flatten() {
            match server["state"].as_str() {
                Some("ready") => outln!("mcp:        {name} ready ({} tools)", server["tools"]),
                Some("down") => outln!(
                    "mcp:        {name} DOWN, its tools are not offered: {}",
                    server["error"].as_str().unwrap_or("")
                ),
                other => outln!("mcp:        {name} {}", other.unwrap_or("unknown")),
            }
        }
        for node in summary.nodes.iter().flatten() {
            outln!(
                "node:       {} ({}, pid {}, {}) leases: {}",
                node.name,
                node.id,
                node.pid,
                node.state,
                if node.leases.is_empty() {
                    "none".to_string()
                } else {
                    node.leases.join(", ")
                }
            );
        }
    }
    Ok(())
}

/// The running daemon's MCP servers and their states, from its control socket; null when it
/// does not answer.
fn mcp_servers(daemon: &DaemonClient) -> serde_json::Value {
    match daemon.request(http::Method::GET, "/v1/status") {
        Ok(Some(answer)) if answer.status.is_success() => answer.body["mcp"].clone(),
        _ => serde_json::Value::Null,
    }
}

/// `status` from the daemon's `/v1/status`, for a user who cannot read the state: the same
/// document, without the ledger, which only the state holds.
fn daemon_status(body: &serde_json::Value, json: bool) {
    let mut document = body.clone();
    document["version"] = serde_json::json!(crate::VERSION);
    document["ledger"] =
        serde_json::json!({"valid": null, "error": "the state is not readable by this user"});
    if json {
        outln!("{document:#}");
        return;
    }
    let breakdown = |counts: &serde_json::Value| {
        counts
            .as_object()
            .map(|counts| {
                counts
                    .iter()
                    .map(|(name, n)| format!("{name} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    outln!("agentgate:  {}", crate::VERSION);
    outln!("daemon:     running (pid {})", body["daemon"]["pid"]);
    outln!(
        "events:     {} total ({})",
        body["events"]["total"],
        breakdown(&body["events"]["by_status"])
    );
    outln!(
        "sessions:   {} total ({})",
        body["sessions"]["total"],
        breakdown(&body["sessions"]["by_state"])
    );
    outln!(
        "deliveries: {} pending, {} failed",
        body["deliveries"]["pending"],
        body["deliveries"]["failed"]
    );
    outln!("ledger:     not shown: the state is not readable by this user");
}

pub(super) fn render_status(state_dir: &Path, running: bool, summary: &StatusSummary) -> String {
    format!(
        "agentgate:  {}\ndaemon:     {}\nstate:      {}\nevents:     {} total ({})\nsessions:   {} total ({})\ndeliveries: {} pending, {} failed\n",
        crate::VERSION,
        if running { "running" } else { "not running" },
        state_dir.display(),
        summary.events.total,
        breakdown(&summary.events.by_status),
        summary.sessions.total,
        breakdown(&summary.sessions.by_state),
        summary.deliveries.pending,
        summary.deliveries.failed,
    )
}

/// `name n, name n, ...` of a count by status or state.
fn breakdown<K: std::fmt::Display>(counts: &std::collections::BTreeMap<K, i64>) -> String {
    counts
        .iter()
        .map(|(name, n)| format!("{name} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}
