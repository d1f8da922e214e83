//! agentgate: a systemd-native gateway that turns webhooks into durable AI-agent work.
//!
//! Data flows through the modules in this order: `ingress` (sockets, HTTP) hands an event that
//! `signature` verified to `store` (SQLite with group commit, or PostgreSQL), which makes it
//! durable before the listener answers; `session` schedules durable events as turns, which call
//! the model and tools of `agent`, commit every step to `store`, and end with a result that
//! `deliver` sends from the outbox. `lifecycle` owns the daemon's bootstrap and its stop
//! (`lifecycle::drain`); `reconcile` repairs state before a start; `cli` is the command line.
//! `config`, `signature`, `secret`, `template`, `tls`, `logging`, `clock`, `locks`, `operator`
//! (what an operator can do to a session) and `output` (stdout for commands) serve every layer
//! and import none of them; the top-level modules import one another without a cycle (tests/layout.rs).

#![deny(unsafe_code)]

/// The version agentgate reports (`--version`, `status`, the journal at start): the Debian
/// package's version when the package build sets `AGENTGATE_PACKAGE_VERSION`, so the binary never
/// says another version than the package installed; else the crate's.
pub(crate) const VERSION: &str = match option_env!("AGENTGATE_PACKAGE_VERSION") {
    Some(version) => version,
    None => env!("CARGO_PKG_VERSION"),
};

mod agent;
mod cli;
mod clock;
mod config;
mod deliver;
mod exit;
mod ingress;
mod lifecycle;
mod locks;
mod logging;
mod metrics;
mod operator;
mod output;
mod reconcile;
mod schema;
mod secret;
mod sender;
mod session;
mod signature;
mod store;
#[expect(
    unsafe_code,
    reason = "what no safe API offers, in one module (its doc lists each)"
)]
mod sys;
mod telemetry;
mod template;
mod tls;
mod untrusted;
mod usage;

#[cfg(feature = "fuzzing")]
pub mod fuzzing;

/// Runs the `agentgate` command line and returns its exit status.
pub fn main() -> std::process::ExitCode {
    cli::main()
}
