//! agentgate: a systemd-native gateway that turns webhooks into durable AI-agent work.
//!
//! Data flows through the modules in this order: `ingress` (sockets, HTTP, signatures) hands a
//! verified event to `store` (SQLite with group commit), which makes it durable before the listener
//! answers; `session` schedules durable events as turns, which call the model and tools of `agent`,
//! commit every step to `store`, and end with a result that `deliver` sends from the outbox.
//! `lifecycle` owns the daemon's bootstrap and orderly stop; `cli` is the command line.

#![forbid(unsafe_code)]

mod agent;
mod cli;
mod config;
mod deliver;
mod exit;
mod ingress;
mod lifecycle;
mod reconcile;
mod session;
mod store;
mod template;

#[cfg(feature = "fuzzing")]
pub mod fuzzing;

/// Runs the `agentgate` command line and returns its exit status.
pub fn main() -> std::process::ExitCode {
    cli::main()
}
