//! The command-line definition (clap): every command, flag and help text.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::ConfigSource;
use crate::store::EventStatus;

/// `--status S`: an event status by its name.
fn parse_event_status(name: &str) -> Result<EventStatus, String> {
    EventStatus::from_name(name).ok_or_else(|| {
        format!(
            "unknown status {name:?}; use queued, running, awaiting_approval, joined, \
             completed, failed, abandoned or suspended"
        )
    })
}

fn parse_since(text: &str) -> Result<std::time::Duration, String> {
    crate::config::parse_duration(text)
}

#[derive(Debug, Parser)]
#[command(
    name = "agentgate",
    version = crate::VERSION,
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
    /// Accepted events: list, show, replay
    #[command(subcommand)]
    Events(EventsCommand),
    /// The outbox: list deliveries, retry failed ones
    #[command(subcommand)]
    Deliveries(DeliveriesCommand),
    /// The tools routes offer
    #[command(subcommand)]
    Tools(ToolsCommand),
    /// Tool calls waiting for an operator's decision: list, show, approve, deny
    #[command(subcommand)]
    Approvals(ApprovalsCommand),
    /// Tokens and cost by route and UTC day, against the budgets
    Usage {
        #[command(flatten)]
        config: ConfigArg,
        /// Only this route
        #[arg(long, value_name = "R", conflicts_with = "session")]
        route: Option<String>,
        /// From the UTC day this long ago (e.g. 30d) [default: the last 7 days]
        #[arg(long, value_name = "DURATION", value_parser = parse_since, conflicts_with = "session")]
        since: Option<std::time::Duration>,
        /// What one session's turns spent, against its session budgets
        #[arg(long, value_name = "KEY")]
        session: Option<String>,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Run recorded events again under another config without side effects, and compare
    WhatIf(WhatIfArgs),
    /// Copy the state (database and ledger) into the new directory PATH while the daemon runs
    Backup {
        #[command(flatten)]
        config: ConfigArg,
        path: PathBuf,
    },
    /// Generate the man page or shell completions (used by the package build)
    #[command(subcommand, hide = true)]
    Generate(GenerateCommand),
    /// Run the one tool call on the connection systemd passes as stdin (agentgate-tool@.service)
    #[command(hide = true)]
    ToolExec,
    /// Sign a payload the way ROUTE verifies it and POST it
    Send {
        #[command(flatten)]
        config: ConfigArg,
        /// The route name (a key under [routes]); with --schedule, the schedule file names it
        #[arg(required_unless_present = "schedule")]
        route: Option<String>,
        /// Post the schedule schedules/NAME.toml beside the config file (route and payload),
        /// with the delivery id schedule:NAME:<the time of its timer's fire> (now when run by
        /// hand; agentgate-schedule@NAME.service runs this)
        #[arg(long, value_name = "NAME", conflicts_with_all = ["data", "delivery_id", "event_type"])]
        schedule: Option<String>,
        /// JSON payload, or @FILE to read it from a file [default: {}]
        #[arg(long, value_name = "JSON|@FILE")]
        data: Option<String>,
        /// Post to the listener at BASE, signed with the secrets this user can read [default:
        /// through the running daemon, which signs and posts to the listener it serves]
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
    /// agentgate(8) and agentgate.toml(5) from the reference, and a page per subcommand
    /// (agentgate-serve(1), ...), written into DIR
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
    /// Run the session again from transcript entry N (an event entry or an assistant message);
    /// the entries from N on are superseded. Prints the new turn id
    Rewind {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
        /// The entry to run again from, as `sessions show` numbers it
        #[arg(long = "to", value_name = "N")]
        to: i64,
    },
    /// Copy the entries before N into the new session NEWKEY and run its turn from entry N
    /// there; KEY is left as it is. Prints the new turn id
    Fork {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
        /// The entry to run again from, as `sessions show` numbers it
        #[arg(long = "at", value_name = "N")]
        at: i64,
        /// The new session's key
        #[arg(long = "as", value_name = "NEWKEY")]
        as_key: String,
    },
    /// Print the transcript, then each entry as it is committed, until interrupted
    Follow {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
    },
}

#[derive(Debug, Subcommand)]
pub(super) enum EventsCommand {
    /// Accepted events, newest first
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only events with this status (queued, running, awaiting_approval, joined, completed,
        /// failed, abandoned, suspended)
        #[arg(long, value_name = "S", value_parser = parse_event_status)]
        status: Option<EventStatus>,
        /// Only events of this route
        #[arg(long, value_name = "R")]
        route: Option<String>,
        /// Only events of this session
        #[arg(long, value_name = "KEY")]
        session: Option<String>,
        /// At most this many
        #[arg(long, value_name = "N", default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// An event's payload, stored headers, turns and delivery
    Show {
        #[command(flatten)]
        config: ConfigArg,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Accept a copy of an event (or of each event --status selects) as a new one; prints the
    /// new event id (in bulk: one "ORIGINAL COPY" line per event)
    Replay {
        #[command(flatten)]
        config: ConfigArg,
        /// The event to replay
        #[arg(required_unless_present = "status", conflicts_with_all = ["status", "since", "route"])]
        id: Option<String>,
        /// Replay every event with this status (e.g. failed)
        #[arg(long, value_name = "S", value_parser = parse_event_status)]
        status: Option<EventStatus>,
        /// Only events received within this long (e.g. 1h)
        #[arg(long, value_name = "DURATION", value_parser = parse_since)]
        since: Option<std::time::Duration>,
        /// Only events of this route
        #[arg(long, value_name = "R")]
        route: Option<String>,
        /// In bulk, replay at most this many (the newest); says so when more matched
        #[arg(long, value_name = "N", default_value_t = 1000)]
        limit: usize,
    },
}

#[derive(Debug, Subcommand)]
pub(super) enum DeliveriesCommand {
    /// Deliveries, newest first, with each pending one's next attempt
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only the failed ones
        #[arg(long, conflicts_with = "pending")]
        failed: bool,
        /// Only the pending ones
        #[arg(long)]
        pending: bool,
        /// At most this many
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Send a failed delivery (ID, the event id) or every failed one again, with a fresh attempt
    /// budget; or every pending one now instead of at its backoff's end
    Retry {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(required_unless_present_any = ["failed", "pending"], conflicts_with_all = ["failed", "pending"])]
        id: Option<String>,
        /// Every failed delivery
        #[arg(long, conflicts_with = "pending")]
        failed: bool,
        /// Every pending delivery, now
        #[arg(long)]
        pending: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(super) enum ApprovalsCommand {
    /// Pending approval requests, oldest first
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
    /// One request: the tool, its arguments, the session and event, and the decision if taken
    Show {
        #[command(flatten)]
        config: ConfigArg,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Let the call run, once, with the arguments shown
    Approve {
        #[command(flatten)]
        config: ConfigArg,
        id: String,
        /// A note recorded with the decision
        #[arg(long, value_name = "TEXT")]
        note: Option<String>,
    },
    /// Refuse the call; the model is told "denied by operator" with the reason
    Deny {
        #[command(flatten)]
        config: ConfigArg,
        id: String,
        /// Why, recorded and shown to the model
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub(super) enum ToolsCommand {
    /// Every tool, with its schema and whether it is idempotent
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only the tools this route offers
        #[arg(long, value_name = "R")]
        route: Option<String>,
        #[arg(long)]
        json: bool,
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

/// `what-if`: which recorded events run again under which config (docs/reference.md, "what-if").
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["events", "route"])))]
pub(super) struct WhatIfArgs {
    /// The config to try (NEW); the state is found through --live-config
    #[arg(long, value_name = "NEW")]
    pub(super) config: PathBuf,
    /// The config in effect, which says where the state is [default: $AGENTGATE_CONFIG, else
    /// /etc/agentgate/agentgate.toml]
    #[arg(long, value_name = "PATH")]
    pub(super) live_config: Option<PathBuf>,
    /// A recorded event to run again (repeat for more)
    #[arg(long = "event", value_name = "ID", conflicts_with_all = ["route", "since", "limit"])]
    pub(super) events: Vec<String>,
    /// The latest recorded events of this route
    #[arg(long, value_name = "R")]
    pub(super) route: Option<String>,
    /// Only events received within this long (e.g. 7d)
    #[arg(long, value_name = "DURATION", value_parser = parse_since)]
    pub(super) since: Option<std::time::Duration>,
    /// At most this many events (the newest) [default: 20]
    #[arg(long, value_name = "N")]
    pub(super) limit: Option<usize>,
    /// Print JSON
    #[arg(long)]
    pub(super) json: bool,
    /// Exit 1 when any event's run changed
    #[arg(long)]
    pub(super) fail_on_change: bool,
    /// Also keep the report in the state directory's what-if/, for the console
    #[arg(long)]
    pub(super) save: bool,
}
