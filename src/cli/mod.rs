//! The command line: parsing (clap), dispatch, and exit statuses.
//!
//! Commands that inspect state (`status`, `sessions`, `ledger`) read the state directory directly,
//! so they work whether or not the daemon runs.

mod access;
mod approvals;
mod args;
mod check;
mod control;
mod events;
mod generate;
mod manual;
mod schedule;
mod send;
mod sessions;
mod state;
mod status;
mod usage;
mod whatif;

use std::process::ExitCode;

use clap::Parser;

use crate::config::{self, ConfigError, ConfigSource, LocatedFinding, SecretCheck};
use crate::exit::Failure;
use crate::lifecycle;
use crate::logging;

use crate::ingress::api::RerunRequest;
use crate::operator::{OperatorAction, Rerun};
use crate::store::{DeliveryState, EventFilter, RetryTarget};
use args::{
    ApprovalsCommand, Cli, Command, DeliveriesCommand, EventsCommand, LedgerCommand,
    SessionsCommand, ToolsCommand,
};
use check::check_config;
use generate::generate;
use send::{SendArguments, send};
use sessions::{ledger_show, operator_action, reload, sessions_list, sessions_show};
use status::status;

/// Parses the command line, runs the command, and maps the outcome to an exit status.
pub(crate) fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return ExitCode::from(if err.use_stderr() { 2 } else { 0 });
        }
    };
    let target = match cli.command {
        Command::Serve { .. } | Command::Reconcile { dry_run: false, .. } => {
            logging::LogTarget::Daemon
        }
        Command::Reconcile { dry_run: true, .. }
        | Command::CheckConfig(_)
        | Command::Reload(_)
        | Command::Status { .. }
        | Command::Sessions(_)
        | Command::Ledger(_)
        | Command::Events(_)
        | Command::Deliveries(_)
        | Command::Tools(_)
        | Command::Approvals(_)
        | Command::Usage { .. }
        | Command::Backup { .. }
        | Command::WhatIf(_)
        | Command::Generate(_)
        | Command::ToolExec
        | Command::Send { .. } => logging::LogTarget::Terminal,
    };
    logging::init(target);
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("agentgate: {failure}");
            ExitCode::from(failure.code)
        }
    }
}

/// The small single-threaded runtime a command needs for its store queries or requests.
fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| Failure::runtime(format!("cannot start the async runtime: {err}")))
}

/// Prints each finding on its own line and turns an invalid config into exit status 78.
pub(crate) fn load_config(
    source: &ConfigSource,
    secrets: SecretCheck,
) -> Result<config::Loaded, Failure> {
    match config::load(source, secrets) {
        Ok(loaded) => Ok(loaded),
        Err(ConfigError::Invalid {
            source_name,
            findings,
        }) => {
            for finding in &findings {
                eprintln!(
                    "{}",
                    LocatedFinding {
                        source: &source_name,
                        finding
                    }
                );
            }
            Err(Failure::config(ConfigError::Invalid {
                source_name,
                findings,
            }))
        }
        Err(err) => Err(Failure::config(err)),
    }
}

fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Serve { config, record } => {
            let source = config.source();
            lifecycle::serve(
                &source,
                || load_config(&source, SecretCheck::Required),
                record.as_deref(),
            )
        }
        Command::CheckConfig(config) => check_config(&config.source()),
        Command::Status { config, json } => status(&config.source(), json),
        Command::Usage {
            config,
            route,
            since,
            session: Some(key),
            json,
        } if route.is_none() && since.is_none() => {
            usage::session_usage(&config.source(), &key, json)
        }
        Command::Usage {
            config,
            route,
            since,
            session: _,
            json,
        } => usage::usage(&config.source(), route, since, json),
        Command::Send {
            config,
            route,
            schedule,
            data,
            url,
            delivery_id,
            event_type,
        } => {
            let source = config.source();
            let outgoing = match schedule {
                Some(name) => schedule::outgoing(&source, &name, route.as_deref())?,
                None => send::from_arguments(SendArguments {
                    route,
                    data,
                    delivery_id,
                    event_type,
                })?,
            };
            send(&source, &outgoing, url.as_deref())
        }
        Command::Reconcile { config, dry_run } => {
            let loaded = load_config(&config.source(), SecretCheck::CredentialsOptional)?;
            crate::reconcile::run(&loaded.config, dry_run)
        }
        Command::Sessions(command) => sessions_command(command),
        Command::Reload(config) => reload(&config.source()),
        Command::Approvals(command) => approvals_command(command),
        Command::Events(command) => events_command(command),
        Command::Deliveries(command) => deliveries_command(command),
        Command::Tools(ToolsCommand::List {
            config,
            route,
            json,
        }) => events::tools_list(&config.source(), route.as_deref(), json),
        Command::WhatIf(arguments) => whatif::what_if(&arguments),
        Command::Backup { config, path } => events::backup(&config.source(), &path),
        Command::Ledger(LedgerCommand::Show { config, json }) => {
            ledger_show(&config.source(), json)
        }
        Command::Generate(what) => generate(what),
        Command::ToolExec => crate::agent::unit::serve_connection().map_err(Failure::runtime),
    }
}

/// `agentgate deliveries …`.
fn deliveries_command(command: DeliveriesCommand) -> Result<(), Failure> {
    match command {
        DeliveriesCommand::List {
            config,
            failed,
            pending,
            limit,
            json,
        } => {
            let state = match (failed, pending) {
                (true, _) => Some(DeliveryState::Failed),
                (false, true) => Some(DeliveryState::Pending),
                (false, false) => None,
            };
            events::deliveries_list(&config.source(), state, limit, json)
        }
        DeliveriesCommand::Retry {
            config,
            id,
            failed,
            pending,
        } => {
            let target = match (id, pending) {
                (Some(id), _) => RetryTarget::One(id),
                (None, true) => RetryTarget::Pending { route: None },
                (None, false) if failed => RetryTarget::AllFailed,
                (None, false) => {
                    return Err(Failure::usage(
                        "deliveries retry needs ID, --failed or --pending",
                    ));
                }
            };
            events::deliveries_retry(&config.source(), target)
        }
    }
}

/// `agentgate sessions …`.
fn sessions_command(command: SessionsCommand) -> Result<(), Failure> {
    match command {
        SessionsCommand::List { config, json } => sessions_list(&config.source(), json),
        SessionsCommand::Show { config, key, json } => sessions_show(&config.source(), &key, json),
        SessionsCommand::Resume { config, key } => {
            operator_action(&config.source(), &key, OperatorAction::Resume)
        }
        SessionsCommand::Suspend { config, key } => {
            operator_action(&config.source(), &key, OperatorAction::Suspend)
        }
        SessionsCommand::Cancel { config, key } => {
            operator_action(&config.source(), &key, OperatorAction::Cancel)
        }
        SessionsCommand::Rewind { config, key, to } => {
            let asked = RerunRequest {
                to: Some(to),
                ..RerunRequest::default()
            };
            sessions::rerun(&config.source(), &key, Rerun::Rewind, asked)
        }
        SessionsCommand::Fork {
            config,
            key,
            at,
            as_key,
        } => {
            let asked = RerunRequest {
                at: Some(at),
                as_key: Some(as_key),
                ..RerunRequest::default()
            };
            sessions::rerun(&config.source(), &key, Rerun::Fork, asked)
        }
        SessionsCommand::Follow { config, key } => events::sessions_follow(&config.source(), &key),
    }
}

/// `agentgate events …`.
fn events_command(command: EventsCommand) -> Result<(), Failure> {
    match command {
        EventsCommand::List {
            config,
            status,
            route,
            session,
            limit,
            json,
        } => events::events_list(
            &config.source(),
            EventFilter {
                status,
                route,
                session,
                limit,
                before: None,
                ..EventFilter::default()
            },
            json,
        ),
        EventsCommand::Show { config, id, json } => {
            events::events_show(&config.source(), &id, json)
        }
        EventsCommand::Replay {
            config,
            id,
            status,
            since,
            route,
            limit,
        } => match (id, status) {
            (Some(id), _) => events::events_replay(&config.source(), &id),
            (None, Some(status)) => events::events_replay_matching(
                &config.source(),
                &events::ReplaySelection {
                    status,
                    since,
                    route,
                    limit,
                },
            ),
            (None, None) => Err(Failure::usage(
                "events replay needs an event id or --status",
            )),
        },
    }
}

/// `agentgate approvals …`.
fn approvals_command(command: ApprovalsCommand) -> Result<(), Failure> {
    use crate::store::approval::Verdict;
    match command {
        ApprovalsCommand::List { config, json } => {
            approvals::approvals_list(&config.source(), json)
        }
        ApprovalsCommand::Show { config, id, json } => {
            approvals::approvals_show(&config.source(), &id, json)
        }
        ApprovalsCommand::Approve { config, id, note } => {
            approvals::approvals_decide(&config.source(), &id, Verdict::Approve, note)
        }
        ApprovalsCommand::Deny { config, id, reason } => {
            approvals::approvals_decide(&config.source(), &id, Verdict::Deny, reason)
        }
    }
}
