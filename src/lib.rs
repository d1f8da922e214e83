//! agentgate: a systemd-native gateway that turns webhooks into durable AI-agent work.
//!
//! Data flows through the modules in this order: `ingress` (sockets, HTTP, signatures) hands a
//! verified event to `store` (SQLite with group commit), which makes it durable before the listener
//! answers. `lifecycle` owns the daemon's bootstrap and orderly stop; `cli` is the command line.

mod cli;
mod config;
mod exit;
mod ingress;
mod lifecycle;
mod store;
mod template;

/// Runs the `agentgate` command line and returns its exit status.
pub fn main() -> std::process::ExitCode {
    cli::main()
}
