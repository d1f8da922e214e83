//! `status`: the daemon and its state in one screen, or as JSON (`ingress::api::StatusDocument`,
//! the same document the control socket's `/v1/status` answers).

use crate::agent::mcp::McpServerStatus;
use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::ingress::api::{Accepting, DaemonStatus, LedgerStatus, StatusDocument};
use crate::output::{out, outln};
use crate::store::{DaemonLock, EventStatus, NodeState, SessionState};

use super::control::DaemonClient;
use super::state::StateAccess;

pub(super) fn status(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let document = if daemon.state_unreadable() {
        // A user who may not read the state (a member of the daemon's group) gets the daemon's
        // own document from the control socket, without the ledger, which only the state holds.
        let mut document = match ask(&daemon)? {
            Daemon::Serving(document) => *document,
            Daemon::NotServing(reason) => {
                return Err(Failure::unavailable(format!(
                    "the daemon runs but does not serve, and the state is not readable by this \
                     user: {reason}"
                )));
            }
            Daemon::Stopped => return Err(super::control::no_daemon_for_unreadable_state()),
        };
        document.ledger = Some(LedgerStatus {
            valid: None,
            sessions: None,
            error: Some("the state is not readable by this user".into()),
        });
        document
    } else {
        document_from_state(source, &daemon)?
    };
    if json {
        outln!("{:#}", serde_json::json!(document));
    } else {
        out!("{}", render(&document));
    }
    Ok(())
}

/// What the daemon is, as one value from which both the daemon line and the accepting line are
/// written.
enum Daemon {
    /// No daemon runs (nothing holds the state's lock).
    Stopped,
    /// It runs and serves: its own `/v1/status`.
    Serving(Box<StatusDocument>),
    /// It runs and answers 503 (it holds its sockets on a config error, or its start waits for
    /// the state): why.
    NotServing(String),
}

/// The document read from the state itself, with what only the running daemon knows (its MCP
/// servers, whether it accepts webhooks now) asked of it when it runs.
fn document_from_state(
    source: &ConfigSource,
    daemon: &DaemonClient,
) -> Result<StatusDocument, Failure> {
    let state = StateAccess::open(source)?;
    let summary = state
        .query(async |store| store.status_summary().await)?
        .unwrap_or_default();
    // Another node of a shared database runs, this machine's daemon need not.
    let node_runs = summary
        .nodes
        .iter()
        .flatten()
        .any(|node| node.state == NodeState::Running);
    // The ledger as the next resume will see it: a malformed one blocks every resume.
    let ledger = match state.query(async |store| store.resume_ledger().await) {
        Ok(ledger) => LedgerStatus {
            valid: Some(true),
            sessions: Some(ledger.map_or(0, |ledger| ledger.sessions.len())),
            error: None,
        },
        Err(err) => LedgerStatus {
            valid: Some(false),
            sessions: None,
            error: Some(err.to_string()),
        },
    };
    // Only a running daemon is asked: under socket activation a connection starts a stopped one.
    let local = if DaemonLock::is_held(&state.state_dir) {
        ask(daemon)?
    } else {
        Daemon::Stopped
    };
    let (daemon_status, accepting) = match &local {
        Daemon::Serving(live) => (
            DaemonStatus {
                not_serving: None,
                ..live.daemon.clone()
            },
            live.accepting.clone(),
        ),
        Daemon::NotServing(reason) => (
            DaemonStatus {
                running: true,
                not_serving: Some(reason.clone()),
                pid: None,
                writable: None,
            },
            Accepting::refused(reason.clone()),
        ),
        Daemon::Stopped => (
            DaemonStatus {
                running: node_runs,
                not_serving: None,
                pid: None,
                writable: None,
            },
            Accepting::refused(if node_runs {
                "no daemon runs on this machine (the running nodes serve)"
            } else {
                "the daemon is not running"
            }),
        ),
    };
    let mut document = StatusDocument::of(summary, daemon_status, accepting, state.price.as_ref());
    document.state_dir = Some(state.state_dir.clone());
    document.ledger = Some(ledger);
    if let Daemon::Serving(live) = local {
        document.turns = live.turns;
        document.sandbox = live.sandbox;
        document.mcp = live.mcp;
    }
    Ok(document)
}

/// Asks the daemon for its `/v1/status`: served, or answered 503 with the reason it does not
/// serve (`Stopped` when nothing answers).
fn ask(daemon: &DaemonClient) -> Result<Daemon, Failure> {
    Ok(match daemon.request(http::Method::GET, "/v1/status")? {
        Some(answer) if answer.status.is_success() => Daemon::Serving(Box::new(answer.document()?)),
        Some(answer) if answer.status == http::StatusCode::SERVICE_UNAVAILABLE => {
            Daemon::NotServing(answer.message())
        }
        Some(answer) => return Err(Failure::unavailable(answer.message())),
        None => Daemon::Stopped,
    })
}

fn render(document: &StatusDocument) -> String {
    let mut text = format!("agentgate:  {}\n", crate::VERSION);
    let daemon = match (
        document.daemon.running,
        &document.daemon.not_serving,
        document.daemon.pid,
    ) {
        (true, Some(_), _) => "running, NOT SERVING (webhooks get 503)".to_string(),
        (true, None, Some(pid)) => format!("running (pid {pid})"),
        (true, None, None) => "running".to_string(),
        (false, _, _) => "not running".to_string(),
    };
    text.push_str(&format!("daemon:     {daemon}\n"));
    // What was running when a daemon stopped did not finish: it resumes at the next start.
    let stopped = !document.daemon.running;
    if let Some(state_dir) = &document.state_dir {
        text.push_str(&format!("state:      {}\n", state_dir.display()));
    }
    text.push_str(&format!(
        "events:     {} total ({})\nsessions:   {} total ({})\ndeliveries: {} pending, {} failed\n",
        document.events.total,
        breakdown(
            &document.events.by_status,
            stopped.then_some(EventStatus::Running)
        ),
        document.sessions.total,
        breakdown(
            &document.sessions.by_state,
            stopped.then_some(SessionState::Running)
        ),
        document.deliveries.pending,
        document.deliveries.failed,
    ));
    match (&document.accepting, document.daemon.running) {
        (Accepting { ok: true, .. }, _) => text.push_str("accepting:  yes\n"),
        (Accepting { reason, .. }, true) => text.push_str(&format!(
            "accepting:  NO, webhooks get 503: {}\n",
            reason.as_deref().unwrap_or("")
        )),
        (Accepting { .. }, false) => {}
    }
    text.push_str(&format!("usage:      today {}\n", document.usage.today));
    if document.approvals.pending > 0 {
        text.push_str(&format!(
            "approvals:  {} pending (agentgate approvals list)\n",
            document.approvals.pending
        ));
    }
    if let Some(ledger) = &document.ledger {
        text.push_str(&ledger_line(ledger));
    }
    if let Some(sandbox) = &document.sandbox {
        text.push_str(&if sandbox.available {
            format!("sandbox:    {} ({})\n", sandbox.mechanism, sandbox.detail)
        } else {
            format!(
                "sandbox:    UNAVAILABLE, strict tools do not run: {}\n",
                sandbox.detail
            )
        });
        for warning in &sandbox.warnings {
            text.push_str(&format!("sandbox:    warning: {warning}\n"));
        }
    }
    for (name, server) in document.mcp.iter().flatten() {
        text.push_str(&match server {
            McpServerStatus::Ready { tools } => {
                format!("mcp:        {name} ready ({tools} tools)\n")
            }
            McpServerStatus::Down { error } => {
                format!("mcp:        {name} DOWN, its tools are not offered: {error}\n")
            }
            McpServerStatus::Starting => format!("mcp:        {name} starting\n"),
        });
    }
    for node in document.nodes.iter().flatten() {
        let leases = if node.leases.is_empty() {
            "none".to_string()
        } else {
            node.leases.join(", ")
        };
        text.push_str(&format!(
            "node:       {} ({}, pid {}, {}) leases: {leases}\n",
            node.name, node.id, node.pid, node.state
        ));
    }
    text
}

fn ledger_line(ledger: &LedgerStatus) -> String {
    match ledger.valid {
        Some(true) => format!(
            "ledger:     {} session(s) with resume counts\n",
            ledger.sessions.unwrap_or(0)
        ),
        Some(false) => format!(
            "ledger:     UNUSABLE, no resume is dispatched: {}\n",
            ledger.error.as_deref().unwrap_or("")
        ),
        None => "ledger:     not shown: the state is not readable by this user\n".to_string(),
    }
}

/// `name n, name n, ...` of a count by status or state; `interrupted` is shown as such (the
/// running status of a daemon that is not running).
fn breakdown<K: std::fmt::Display + PartialEq>(
    counts: &std::collections::BTreeMap<K, i64>,
    interrupted: Option<K>,
) -> String {
    counts
        .iter()
        .map(|(name, n)| {
            if interrupted.as_ref() == Some(name) {
                format!("interrupted {n} (they resume when the daemon starts)")
            } else {
                format!("{name} {n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}
