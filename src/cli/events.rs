//! `events list/show/replay`, `deliveries list/retry`, `sessions follow`, `tools list` and
//! `backup`: the operator's view of accepted work and the outbox, without SQL.
//!
//! They read and write the store directly, daemon or not: a replayed event or a retried delivery
//! is picked up by a running daemon's scheduler or deliverer within a second.

use std::path::Path;
use std::time::Duration;

use super::control::{self, DaemonClient};
use super::sessions::render_entry;
use super::state::StateAccess;
use crate::agent::catalog;
use crate::agent::mcp::McpServers;
use crate::config::{self, ConfigSource, SecretCheck, StoreSettings};
use crate::exit::Failure;
use crate::ingress::api::{EventsPage, ToolsDocument};
use crate::output::outln;
use crate::store::rfc3339 as time;
use crate::store::{self, DeliveryState, EventDetail, EventFilter, EventStatus, RetryTarget};

/// How often `sessions follow` looks for new transcript entries.
const FOLLOW_POLL: Duration = Duration::from_millis(250);
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
    let daemon = DaemonClient::new(source)?;
    let events = if daemon.state_unreadable() {
        // A member of the daemon's group: the running daemon answers for the state.
        let mut path = format!("/v1/events?limit={}", filter.limit);
        for (name, value) in [
            ("status", filter.status.map(|status| status.to_string())),
            ("route", filter.route),
            ("session", filter.session),
        ] {
            if let Some(value) = value {
                path.push_str(&format!("&{name}={}", control::path_segment(&value)));
            }
        }
        match daemon.request(http::Method::GET, &path)? {
            Some(answer) if answer.status.is_success() => answer.document::<EventsPage>()?.events,
            Some(answer) => return Err(Failure::unavailable(answer.message())),
            None => return Err(control::no_daemon_for_unreadable_state()),
        }
    } else {
        StateAccess::open(source)?
            .query(async |store| store.events(filter).await)?
            .unwrap_or_default()
    };
    if json {
        json_out(&events);
        return Ok(());
    }
    outln!(
        "{:<36}  {:<10}  {:<16}  {:<20}  {:<20}  SESSION",
        "EVENT",
        "STATUS",
        "ROUTE",
        "TYPE",
        "RECEIVED"
    );
    for event in events {
        outln!(
            "{:<36}  {:<10}  {:<16}  {:<20}  {:<20}  {}",
            event.id,
            event.status,
            event.route,
            event.event_type,
            time(event.received_at),
            event.session
        );
    }
    Ok(())
}

pub(super) fn events_show(source: &ConfigSource, id: &str, json: bool) -> Result<(), Failure> {
    let no_event = || Failure::runtime(format!("no event {id:?}"));
    let daemon = DaemonClient::new(source)?;
    let detail = if daemon.state_unreadable() {
        let path = format!("/v1/events/{}", control::path_segment(id));
        match daemon.request(http::Method::GET, &path)? {
            Some(answer) if answer.status == http::StatusCode::NOT_FOUND => return Err(no_event()),
            Some(answer) if answer.status.is_success() => answer.document::<EventDetail>()?,
            Some(answer) => return Err(Failure::unavailable(answer.message())),
            None => return Err(control::no_daemon_for_unreadable_state()),
        }
    } else {
        let state = StateAccess::open(source)?;
        let mut detail = state
            .query(async |store| store.event(id).await)?
            .flatten()
            .ok_or_else(no_event)?;
        detail.usage = detail.usage.priced(state.price.as_ref());
        detail
    };
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
    let state = StateAccess::open(source)?;
    let copy = state
        .query(async |store| store.replay_event(id).await)?
        .flatten()
        .ok_or_else(|| Failure::runtime(format!("no event {id:?}")))?;
    state.restore_ownership()?;
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
    let state = StateAccess::open(source)?;
    let (selected, more) = state
        .query(async |store| select_for_replay(store, selection).await)?
        .unwrap_or_default();
    let mut replayed = 0;
    for original in &selected {
        let copy = state.query(async |store| store.replay_event(original).await)?;
        if let Some(Some(copy)) = copy {
            outln!("{original} {copy}");
            replayed += 1;
        }
    }
    state.restore_ownership()?;
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
async fn select_for_replay(
    store: &crate::store::Store,
    selection: &ReplaySelection,
) -> Result<(Vec<String>, bool), crate::store::StoreError> {
    let cutoff = selection.since.map(|since| {
        crate::store::now_millis() - i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
    });
    let mut selected = Vec::new();
    let mut before = None;
    loop {
        let page = store
            .events(EventFilter {
                status: Some(selection.status),
                route: selection.route.clone(),
                session: None,
                limit: REPLAY_PAGE as i64,
                before: before.take(),
            })
            .await?;
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
    let deliveries = StateAccess::open(source)?
        .query(async |store| store.deliveries(state, limit).await)?
        .unwrap_or_default();
    if json {
        json_out(&deliveries);
        return Ok(());
    }
    outln!(
        "{:<36}  {:<9}  {:>8}  {:<16}  {:<20}  {:<20}  LAST ERROR",
        "EVENT",
        "STATUS",
        "ATTEMPTS",
        "ROUTE",
        "UPDATED",
        "NEXT ATTEMPT"
    );
    for delivery in deliveries {
        let next = match delivery.status {
            DeliveryState::Pending => time(delivery.next_attempt_at),
            DeliveryState::Delivered | DeliveryState::Failed => "-".to_string(),
        };
        outln!(
            "{:<36}  {:<9}  {:>8}  {:<16}  {:<20}  {:<20}  {}",
            delivery.event_id,
            delivery.status,
            delivery.attempts,
            delivery.route,
            time(delivery.updated_at),
            next,
            delivery.last_error.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

pub(super) fn deliveries_retry(source: &ConfigSource, target: RetryTarget) -> Result<(), Failure> {
    let state = StateAccess::open(source)?;
    let count = state
        .query(async |store| store.retry_deliveries(target.clone()).await)?
        .unwrap_or(0);
    state.restore_ownership()?;
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
/// until interrupted.
pub(super) fn sessions_follow(source: &ConfigSource, key: &str) -> Result<(), Failure> {
    let state = StateAccess::open(source)?;
    if state
        .query(async |store| store.session(key).await)?
        .flatten()
        .is_none()
    {
        return Err(Failure::runtime(format!("no session {key:?}")));
    }
    let mut last_seq = i64::MIN;
    loop {
        let seen = last_seq;
        let rows = state
            .query(async |store| crate::session::transcript(store, key, seen).await)?
            .unwrap_or_default();
        for row in &rows {
            outln!("{}", render_entry(&row.body));
            last_seq = row.seq;
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
    let daemon = super::control::DaemonClient::new(source)?;
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
    outln!(
        "{:<40}  {:<20}  {:<10}  {:<10}  ROUTES",
        "TOOL",
        "KIND",
        "RERUN",
        "BACKGROUND"
    );
    for tool in &tools {
        let kind = match tool["mcp_server"].as_str() {
            Some(server) => format!("mcp:{server}"),
            None => "command".to_string(),
        };
        outln!(
            "{:<40}  {:<20}  {:<10}  {:<10}  {}",
            tool["name"].as_str().unwrap_or(""),
            kind,
            tool["rerun"].as_str().unwrap_or(""),
            tool["background"],
            tool["routes"]
                .as_array()
                .map(|routes| routes
                    .iter()
                    .filter_map(|r| r.as_str())
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default()
        );
    }
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
