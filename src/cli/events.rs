//! `events list/show/replay`, `deliveries list/retry`, `sessions follow`, `tools list` and
//! `backup`: the operator's view of accepted work and the outbox, without SQL.
//!
//! They read and write the store directly, daemon or not: a replayed event or a retried delivery
//! is picked up by a running daemon's scheduler or deliverer within a second. A user who may not
//! read the state (a member of the daemon's group) goes through the running daemon instead
//! (`access.rs`).

use std::path::Path;
use std::time::Duration;

use super::access::Access;
use super::control::{DaemonClient, Streamed, no_daemon_for_unreadable_state, path_segment};
use super::sessions::numbered_entry;
use super::state::StateAccess;
use crate::agent::catalog;
use crate::agent::mcp::McpServers;
use crate::config::{self, ConfigSource, SecretCheck, StoreSettings};
use crate::exit::Failure;
use crate::ingress::api::ToolsDocument;
use crate::output::{Table, outln};
use crate::store::rfc3339 as time;
use crate::store::{self, DeliveryState, EventFilter, EventStatus, RetryTarget, TranscriptRow};

/// How often `sessions follow` reads the store itself: while no daemon runs (then only another
/// node of a shared store commits), and before it asks the daemon again after a stream ended.
const FOLLOW_POLL: Duration = Duration::from_millis(500);
/// `tools list` without a daemon: how long each MCP server may take to start.
const TOOLS_LIST_START_WAIT: Duration = Duration::from_secs(30);

fn json_out(value: &impl serde::Serialize) {
    match serde_json::to_string_pretty(value) {
        Ok(text) => outln!("{text}"),
        Err(err) => eprintln!("agentgate: cannot render JSON: {err}"),
    }
}

pub(super) fn events_list(
    source: &ConfigSource,
    filter: EventFilter,
    json: bool,
) -> Result<(), Failure> {
    let events = Access::open(source)?.events(filter)?;
    if json {
        json_out(&events);
        return Ok(());
    }
    let mut table = Table::new(&["EVENT", "STATUS", "ROUTE", "TYPE", "RECEIVED", "SESSION"]);
    for event in events {
        table.row(vec![
            event.id,
            event.status.to_string(),
            event.route,
            if event.event_type.is_empty() {
                "-".to_string()
            } else {
                crate::untrusted::for_terminal(&event.event_type)
            },
            time(event.received_at),
            crate::untrusted::for_terminal(&event.session),
        ]);
    }
    table.print();
    Ok(())
}

pub(super) fn events_show(source: &ConfigSource, id: &str, json: bool) -> Result<(), Failure> {
    let detail = Access::open(source)?
        .event(id)?
        .ok_or_else(|| Failure::runtime(format!("no event {id:?}")))?;
    if json {
        json_out(&detail);
        return Ok(());
    }
    let event = &detail.event;
    outln!(
        "event {}  route {}  status {}",
        event.id,
        event.route,
        event.status
    );
    outln!("session {}", event.session);
    outln!(
        "type {:?}  delivery id {}  received {}  origin {}",
        event.event_type,
        event.delivery_id.as_deref().unwrap_or("-"),
        time(event.received_at),
        event.origin
    );
    if let Some(of) = &event.rewind_of {
        outln!(
            "rerun of entry {} of session {}",
            of.entry,
            crate::untrusted::for_terminal(&of.session)
        );
    }
    if let Some(original) = &event.replay_of {
        outln!("replay of {original}");
    }
    if let Some(trace_id) = &detail.trace_id {
        outln!("trace {trace_id}");
    }
    if !detail.replayed_as.is_empty() {
        outln!("replayed as {}", detail.replayed_as.join(", "));
    }
    outln!("headers {}", detail.headers);
    outln!("payload {}", detail.payload);
    for turn in &detail.turns {
        outln!(
            "turn {}  {}{}  steps {}  started {}{}",
            turn.id,
            turn.status,
            turn.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default(),
            turn.steps,
            time(turn.started_at),
            turn.error
                .as_deref()
                .map(|e| format!("  error: {e}"))
                .unwrap_or_default()
        );
    }
    match &detail.delivery {
        Some(delivery) => outln!(
            "delivery {}  attempts {}{}",
            delivery.status,
            delivery.attempts,
            delivery
                .last_error
                .as_deref()
                .map(|e| format!("  last error: {e}"))
                .unwrap_or_default()
        ),
        None => outln!("delivery none yet"),
    }
    outln!("usage {}", detail.usage);
    Ok(())
}

pub(super) fn events_replay(source: &ConfigSource, id: &str) -> Result<(), Failure> {
    let access = Access::open(source)?;
    let copy = access
        .replay(id)?
        .ok_or_else(|| Failure::runtime(format!("no event {id:?}")))?;
    access.changed()?;
    outln!("{copy}");
    Ok(())
}

/// Which events `events replay --status` copies.
pub(super) struct ReplaySelection {
    pub status: EventStatus,
    /// Received within this long.
    pub since: Option<std::time::Duration>,
    pub route: Option<String>,
    /// Replayed at most, newest first.
    pub limit: usize,
}

/// Events read per page while selecting.
const REPLAY_PAGE: usize = 500;

/// `events replay --status S [--since D] [--route R]`: a copy of each selected event, newest
/// first, at most `limit`; prints "ORIGINAL COPY" per event, then how many.
pub(super) fn events_replay_matching(
    source: &ConfigSource,
    selection: &ReplaySelection,
) -> Result<(), Failure> {
    let access = Access::open(source)?;
    let (selected, more) = select_for_replay(&access, selection)?;
    let mut replayed = 0;
    for original in &selected {
        if let Some(copy) = access.replay(original)? {
            outln!("{original} {copy}");
            replayed += 1;
        }
    }
    access.changed()?;
    eprintln!(
        "replayed {replayed} {} event(s){}",
        selection.status,
        if more {
            format!("; more matched (raise --limit above {})", selection.limit)
        } else {
            String::new()
        }
    );
    Ok(())
}

/// The ids `selection` picks, newest first, and whether more matched than its limit.
fn select_for_replay(
    access: &Access,
    selection: &ReplaySelection,
) -> Result<(Vec<String>, bool), Failure> {
    let cutoff = selection.since.map(|since| {
        crate::store::now_millis() - i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
    });
    let mut selected = Vec::new();
    let mut before = None;
    loop {
        let page = access.events(EventFilter {
            status: Some(selection.status),
            route: selection.route.clone(),
            session: None,
            limit: REPLAY_PAGE as i64,
            before: before.take(),
            ..EventFilter::default()
        })?;
        let full = page.len() == REPLAY_PAGE;
        for event in page {
            if cutoff.is_some_and(|cutoff| event.received_at < cutoff) {
                return Ok((selected, false));
            }
            if selected.len() == selection.limit {
                return Ok((selected, true));
            }
            before = Some(event.id.clone());
            selected.push(event.id);
        }
        if !full {
            return Ok((selected, false));
        }
    }
}

pub(super) fn deliveries_list(
    source: &ConfigSource,
    state: Option<DeliveryState>,
    limit: i64,
    json: bool,
) -> Result<(), Failure> {
    let deliveries = Access::open(source)?.deliveries(state, limit)?;
    if json {
        json_out(&deliveries);
        return Ok(());
    }
    let mut table = Table::new(&[
        "EVENT",
        "STATUS",
        "ATTEMPTS",
        "ROUTE",
        "UPDATED",
        "NEXT ATTEMPT",
        "LAST ERROR",
    ])
    .right(&[2]);
    for delivery in deliveries {
        let next = match delivery.status {
            DeliveryState::Pending => time(delivery.next_attempt_at),
            DeliveryState::Delivered | DeliveryState::Failed => "-".to_string(),
        };
        table.row(vec![
            delivery.event_id,
            delivery.status.to_string(),
            delivery.attempts.to_string(),
            delivery.route,
            time(delivery.updated_at),
            next,
            delivery.last_error.unwrap_or_else(|| "-".to_string()),
        ]);
    }
    table.print();
    Ok(())
}

pub(super) fn deliveries_retry(source: &ConfigSource, target: RetryTarget) -> Result<(), Failure> {
    let access = Access::open(source)?;
    let count = access.retry(target.clone())?;
    access.changed()?;
    match target {
        RetryTarget::One(id) if count == 0 => Err(Failure::runtime(format!(
            "no failed delivery for event {id:?} (see `agentgate deliveries list --failed`)"
        ))),
        RetryTarget::One(id) => {
            outln!("delivery of event {id}: queued again with a fresh attempt budget");
            Ok(())
        }
        RetryTarget::AllFailed => {
            outln!("{count} failed deliveries queued again with a fresh attempt budget");
            Ok(())
        }
        RetryTarget::Pending { .. } => {
            outln!("{count} pending deliveries are due now");
            Ok(())
        }
    }
}

/// `sessions follow KEY`: what is in the transcript now, then every entry as it is committed,
/// until interrupted. While the daemon runs, it streams the entries as it commits them over the
/// control socket (`GET /v1/sessions/{key}/follow`); while none runs, the store is read every
/// `FOLLOW_POLL`, and the daemon is asked again as soon as one runs. A user who may not read
/// the state follows through the daemon alone.
pub(super) fn sessions_follow(source: &ConfigSource, key: &str) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let state = if daemon.state_unreadable() {
        None
    } else {
        Some(StateAccess::open(source)?)
    };
    let mut after = i64::MIN;
    let mut known = false;
    loop {
        // Only a running daemon is asked: under socket activation, a connection to the control
        // socket would start a stopped one.
        if state.is_none() || daemon.runs() {
            let path = format!("/v1/sessions/{}/follow?after={after}", path_segment(key));
            let streamed = daemon.lines(&path, |line| {
                let row: TranscriptRow = serde_json::from_slice(line).map_err(|err| {
                    Failure::runtime(format!(
                        "the daemon sent an entry this agentgate does not read ({err}); is it \
                         another version?"
                    ))
                })?;
                outln!("{}", numbered_entry(&row));
                after = row.seq;
                Ok(())
            })?;
            match streamed {
                Streamed::Ended => known = true,
                Streamed::NoDaemon if state.is_none() => {
                    return Err(no_daemon_for_unreadable_state());
                }
                Streamed::NoDaemon => {}
                Streamed::Refused(answer) if answer.status == http::StatusCode::NOT_FOUND => {
                    return Err(Failure::runtime(format!("no session {key:?}")));
                }
                Streamed::Refused(answer) => return Err(Failure::unavailable(answer.message())),
            }
        }
        if let Some(state) = &state {
            if !known {
                let session = state.query(async |store| store.session(key).await)?;
                if session.flatten().is_none() {
                    return Err(Failure::runtime(format!("no session {key:?}")));
                }
                known = true;
            }
            let seen = after;
            let rows = state
                .query(async |store| crate::session::transcript(store, key, seen).await)?
                .unwrap_or_default();
            for row in &rows {
                outln!("{}", numbered_entry(row));
                after = row.seq;
            }
        }
        std::thread::sleep(FOLLOW_POLL);
    }
}

/// `tools list [--route R]`: every tool a route offers, command and MCP. While the daemon runs,
/// its own servers answer (over the control socket); otherwise the MCP servers are started for
/// the listing and stopped after it.
pub(super) fn tools_list(
    source: &ConfigSource,
    route: Option<&str>,
    json: bool,
) -> Result<(), Failure> {
    let daemon = DaemonClient::new(source)?;
    let path = match route {
        Some(route) => format!(
            "/v1/tools?route={}",
            form_urlencoded::byte_serialize(route.as_bytes()).collect::<String>()
        ),
        None => "/v1/tools".to_string(),
    };
    // Only a running daemon is asked: under socket activation, a connection to the control
    // socket would start a stopped one.
    let answer = if daemon.runs() {
        daemon.request(http::Method::GET, &path)?
    } else {
        None
    };
    let (tools, problems) = match answer {
        Some(answer) if answer.status.is_success() => {
            let listing = answer.document::<ToolsDocument>()?;
            (listing.tools, listing.problems)
        }
        Some(answer) if answer.status == http::StatusCode::NOT_FOUND => {
            return Err(Failure::config(format!("{} ({source})", answer.message())));
        }
        Some(answer) => return Err(Failure::unavailable(answer.message())),
        None => {
            // No daemon: start the servers for the listing. Their secrets are needed to start
            // them; credentials are only there under systemd, so a server that needs one may
            // be reported down here.
            let config = super::load_config(source, SecretCheck::CredentialsOptional)?.config;
            daemon.block_on(async {
                let tracker = tokio_util::task::TaskTracker::new();
                let stop = tokio_util::sync::CancellationToken::new();
                let servers = McpServers::new(tracker.clone(), stop.clone());
                servers.apply(&config.mcp, &config.hidden);
                let listed =
                    catalog::listing(&config, &servers, route, TOOLS_LIST_START_WAIT).await;
                stop.cancel();
                tracker.close();
                tracker.wait().await;
                listed.map_err(|message| Failure::config(format!("{message} ({source})")))
            })?
        }
    };
    for problem in &problems {
        eprintln!("warning: {problem}");
    }
    if json {
        json_out(&tools);
        return Ok(());
    }
    let mut table = Table::new(&["TOOL", "KIND", "RERUN", "BACKGROUND", "ROUTES"]);
    for tool in &tools {
        let kind = match &tool.mcp_server {
            Some(server) => format!("mcp:{server}"),
            None => "command".to_string(),
        };
        table.row(vec![
            tool.name.clone(),
            kind,
            tool.rerun.label().to_string(),
            tool.background.to_string(),
            tool.routes.join(","),
        ]);
    }
    table.print();
    Ok(())
}

/// `backup PATH`: a consistent copy of the state into the new directory `target`.
pub(super) fn backup(source: &ConfigSource, target: &Path) -> Result<(), Failure> {
    let location = config::state_location(source).map_err(Failure::config)?;
    if matches!(location.store, StoreSettings::Postgres(_)) {
        return Err(Failure::config(
            "backup copies SQLite state; with [store] backend = \"postgres\" the state is in the \
             database: back it up with pg_dump",
        ));
    }
    let written = store::backup(&location.state_dir, target).map_err(Failure::state)?;
    for file in written {
        outln!("{}", file.display());
    }
    // On stderr: stdout lists exactly the files written.
    eprintln!(
        "not in the backup (save them with the system's configuration): the config ({source}), \
         the credentials and secret files it names, and systemd drop-ins \
         (`systemctl cat agentgate.service agentgate.socket`)"
    );
    Ok(())
}
