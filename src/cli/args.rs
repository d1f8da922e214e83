//! The command-line definition (clap): every command, flag and help text.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::ConfigSource;

#[derive(Debug, Parser)]
#[command(
    name = "agentgate",
    version,
    about = "Turns webhooks into durable AI-agent work",
    long_about = "agentgate accepts webhooks on a systemd-held socket, makes each event durable before \
                  acknowledging it, runs it as a turn of an agent session, and delivers the result. \
                  Interrupted turns resume on the next start."
)]
pub(super) struct Cli {
    #[command(subcommand)]
    pub(super) command: Command,
}

#[derive(Debug, clap::Args)]
pub(super) struct ConfigArg {
    /// Config file [default: $AGENTGATE_CONFIG, else /etc/agentgate/agentgate.toml]
    #[arg(long, value_name = "PATH")]
    pub(super) config: Option<PathBuf>,
}

impl ConfigArg {
    pub(super) fn source(&self) -> ConfigSource {
        ConfigSource::resolve(self.config.as_deref())
    }
}

#[derive(Debug, Subcommand)]
pub(super) enum Command {
    /// Run the daemon in the foreground (under systemd: Type=notify)
    Serve {
        #[command(flatten)]
        config: ConfigArg,
        /// Append every model reply to this cassette file (replay it with backend = "replay")
        #[arg(long, value_name = "CASSETTE")]
        record: Option<PathBuf>,
    },
    /// Repair the state directory before a start
    Reconcile {
        #[command(flatten)]
        config: ConfigArg,
        /// Print what would be done and change nothing
        #[arg(long)]
        dry_run: bool,
    },
    /// Validate the config, print findings, exit 0 or 78
    CheckConfig(ConfigArg),
    /// Ask the running daemon to re-read its config; exit 0 when applied, 78 when refused
    Reload(ConfigArg),
    /// Summarize the daemon and its state
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// List, show, resume, suspend or cancel sessions
    #[command(subcommand)]
    Sessions(SessionsCommand),
    /// Inspect the retry ledger
    #[command(subcommand)]
    Ledger(LedgerCommand),
    /// Generate the man page or shell completions (used by the package build)
    #[command(subcommand, hide = true)]
    Generate(GenerateCommand),
    /// Sign a payload the way ROUTE verifies it and POST it
    Send {
        #[command(flatten)]
        config: ConfigArg,
        /// The route name (a key under [routes])
        route: String,
        /// JSON payload, or @FILE to read it from a file [default: {}]
        #[arg(long, value_name = "JSON|@FILE")]
        data: Option<String>,
        /// Base URL of the listener [default: http://<server.listen>]
        #[arg(long, value_name = "BASE")]
        url: Option<String>,
        /// Delivery id to send [default: a new one]
        #[arg(long, value_name = "ID")]
        delivery_id: Option<String>,
        /// Event type header for schemes that carry one [default: the route's first `events` entry]
        #[arg(long, value_name = "TYPE")]
        event_type: Option<String>,
    },
}

/// Files generated from this command-line definition, for packaging.
#[derive(Debug, Subcommand)]
pub(super) enum GenerateCommand {
    /// agentgate(1) and a page per subcommand (agentgate-serve(1), ...), written into DIR
    Manpages { dir: PathBuf },
    /// Shell completions on stdout
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
pub(super) enum SessionsCommand {
    /// List sessions with state, last turn and attempts
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
    /// Show a session and its transcript
    Show {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
        #[arg(long)]
        json: bool,
    },
    /// Clear the session's ledger entry and run it again, its interrupted event first
    Resume {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
    },
    /// Stop the session: no further turn starts until it is resumed
    Suspend {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
    },
    /// Cancel the running turn: its tools are killed and its event ends failed
    Cancel {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
    },
}

#[derive(Debug, Subcommand)]
pub(super) enum LedgerCommand {
    /// Print the retry ledger
    Show {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
}
