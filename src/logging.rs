//! Logging: journald with filterable fields under systemd, stderr otherwise.
//!
//! Under systemd every event's fields (`EVENT_ID`, `SESSION_KEY`, `ROUTE`, `TURN_ID`,
//! `DELIVERY_ID`) become journal fields without a prefix, so `journalctl -u agentgate
//! SESSION_KEY=…` finds a session's lines, and lifecycle events carry a stable `MESSAGE_ID` that
//! the catalog in `packaging/` explains.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// An event was made durable and acknowledged.
pub(crate) const MESSAGE_ACCEPTED: &str = "b7f154d7dfdf46c28b5b7998d4708050";

/// An interrupted session was admitted for resume.
pub(crate) const MESSAGE_RESUMED: &str = "5df92f03ee62438e85af6662fff2217f";
/// A session was suspended after `resume_max_attempts` resumes.
pub(crate) const MESSAGE_SUSPENDED: &str = "8d3eabf1daca478eac1e887be8e77a46";
/// An interrupted session older than `resume_window` was abandoned.
pub(crate) const MESSAGE_ABANDONED: &str = "6a213c63dcba4a4084d8903d2692e40c";
/// `reconcile` moved a malformed retry ledger to quarantine and wrote a repaired one.
pub(crate) const MESSAGE_LEDGER_QUARANTINED: &str = "7e28c6dc83aa474ea8de22650fa5aed3";
/// `reconcile` moved a damaged database to quarantine; the daemon starts a new one.
pub(crate) const MESSAGE_DATABASE_QUARANTINED: &str = "8785c08fc9764396ba145ce7a0c9615f";
/// A turn did not finish within `drain_timeout` and was left for resume.
pub(crate) const MESSAGE_DRAIN_TIMEOUT: &str = "227513bade8c4853a9b43df1e4e36359";

/// The operator resumed a session (`sessions resume`).
pub(crate) const MESSAGE_OPERATOR_RESUMED: &str = "7416ee7898a9431690ced8193360227b";
/// The operator suspended a session (`sessions suspend`).
pub(crate) const MESSAGE_OPERATOR_SUSPENDED: &str = "edcec10b073e46c1af472b6ca6e53c23";
/// The operator cancelled a session's running turn (`sessions cancel`).
pub(crate) const MESSAGE_OPERATOR_CANCELLED: &str = "21225f76e7564e6d8df082b2fd4275e0";

/// The span of everything logged about one event: its lines carry `EVENT_ID`, `SESSION_KEY` and
/// `ROUTE` as journal fields without repeating them.
/// The spans have the level ERROR so that no level filter disables them: a warning must keep its
/// event's fields whatever `AGENTGATE_LOG` says.
pub(crate) fn event_span(event_id: &str, session_key: &str, route: &str) -> tracing::Span {
    tracing::error_span!("event", event_id, session_key, route)
}

/// The span of one turn: the event's fields and `TURN_ID`.
pub(crate) fn turn_span(
    event_id: &str,
    session_key: &str,
    route: &str,
    turn_id: &str,
) -> tracing::Span {
    tracing::error_span!("turn", event_id, session_key, route, turn_id)
}

/// Where log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogTarget {
    /// The daemon: journald when its stream is attached, else stderr.
    Daemon,
    /// Command-line tools: always stderr.
    Terminal,
}

/// `AGENTGATE_LOG` if set, else `default`, with the MCP SDK's own lines at warnings: agentgate
/// logs what an operator needs of its MCP servers itself (started, down, tools changed).
fn filter(default: &str) -> EnvFilter {
    EnvFilter::try_from_env("AGENTGATE_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},rmcp=warn")))
}

/// Installs the global subscriber. Safe to call once per process.
pub(crate) fn init(target: LogTarget) {
    if target == LogTarget::Daemon
        && std::env::var_os("JOURNAL_STREAM").is_some()
        && let Ok(layer) = tracing_journald::layer()
    {
        let layer = layer
            .with_field_prefix(None)
            .with_syslog_identifier("agentgate".to_string());
        let _ = tracing_subscriber::registry()
            .with(filter("info"))
            .with(layer)
            .try_init();
        return;
    }
    let default = match target {
        LogTarget::Daemon => "info",
        LogTarget::Terminal => "warn",
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter(default))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}
