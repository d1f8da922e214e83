//! The daemon's life: bootstrap, serving, reload, and an orderly stop.
//!
//! Bootstrap happens on the main thread before the async runtime exists (config, state directory
//! lock, inherited sockets), so every startup problem exits with its own sysexits status and one
//! line that says what is wrong, before anything is accepted. The stop drains: no new
//! connections (systemd keeps the socket, so clients wait for the next instance), in-flight
//! requests finish, running turns get `drain_timeout`, and what is still running then is left
//! `resume_pending` for the next start.

mod drain;
mod notify;
mod resume;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::agent::mcp::McpServers;
use crate::agent::model::Model;
use crate::config::{
    self, ConfigError, ConfigSource, LocatedFinding, ReloadReport, RuntimeSettings, SecretCheck,
    Settings, Shared,
};
use crate::deliver::Deliverer;
use crate::exit::Failure;
use crate::ingress::capacity::{self, Capacity};
use crate::ingress::control::{self, Control, ControlListener, ReloadRequest};
use crate::ingress::{self, Ingress, ListenError};
use crate::session::{self, JobSlots, Sessions, TurnContext};
use crate::store::{self, DaemonLock, Store};
use crate::{logging, metrics};
use drain::Drain;

/// How often delivery ids older than `dedup_window` are forgotten.
const DEDUP_PRUNE_INTERVAL: Duration = Duration::from_secs(3600);
/// The longest pause between two retention rounds.
const PRUNE_INTERVAL: Duration = Duration::from_secs(300);
/// The pause between two retention batches.
const PRUNE_PAUSE: Duration = Duration::from_millis(10);
/// How often the summary line is written (when anything happened).
const SUMMARY_INTERVAL: Duration = Duration::from_secs(60);
/// `STATUS=` is refreshed this often when there is no watchdog to piggyback on.
const STATUS_INTERVAL: Duration = Duration::from_secs(5);

/// Everything the running daemon shares between its tasks.
struct Daemon {
    source: ConfigSource,
    settings: Arc<Shared<Settings>>,
    store: Store,
    ingress: Arc<Ingress>,
    sessions: Arc<Sessions>,
    /// The MCP servers, which a reload adds, removes and restarts.
    mcp: Arc<McpServers>,
    /// The webhook listener's address, for the checks a reload repeats.
    webhook_addr: Option<std::net::SocketAddr>,
}

/// `agentgate serve` with the config loaded from `source` (which a reload reads again): runs
/// until SIGTERM or SIGINT. `record` appends every model reply to a
/// cassette file.
pub(crate) fn serve(
    source: &ConfigSource,
    loaded: config::Loaded,
    record: Option<&std::path::Path>,
) -> Result<(), Failure> {
    for finding in &loaded.warnings {
        tracing::warn!("{}", LocatedFinding { source, finding });
    }
    let config = loaded.config;
    if *source == ConfigSource::Embedded {
        tracing::warn!(
            "no config file at {}; running on the embedded quickstart defaults (state in {})",
            config::DEFAULT_CONFIG_PATH,
            config.state_dir.display()
        );
    }
    raise_open_file_limit();
    // Before any thread exists: nothing inherited from the parent reaches a tool.
    let inherited = crate::sys::keep_inherited_descriptors_from_children();
    if inherited > 0 {
        tracing::debug!(
            count = inherited,
            "inherited descriptors marked close-on-exec"
        );
    }
    store::ensure_state_dir(&config.state_dir).map_err(Failure::state)?;
    let _lock = DaemonLock::acquire(&config.state_dir).map_err(Failure::state)?;
    let listeners = ingress::take_listeners(&config).map_err(|err| match err {
        ListenError::Bind { .. } => Failure::unavailable(err),
        _ => Failure::config(err),
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("agentgate")
        .build()
        .map_err(|err| Failure::runtime(format!("cannot start the async runtime: {err}")))?;
    let store = runtime.block_on(open_store(&config))?;
    let model = Arc::new(Model::new(&config.model, record).map_err(Failure::config)?);
    if model.is_replay() {
        tracing::warn!(
            "the model is a replay of recorded replies (backend = \"replay\"), not a live model"
        );
    }
    let runtime_settings = config.runtime.clone();
    apply_log_settings(&runtime_settings);
    let server_settings = config.server.clone();
    let metrics_listen = config.server.metrics_listen;
    let state_dir = config.state_dir.clone();
    // With PostgreSQL the events live on the database server's disk, not in the state directory.
    let measured_disk =
        matches!(config.store, config::StoreSettings::Sqlite).then(|| state_dir.clone());
    let settings = Arc::new(Shared::new(Settings::new(config).map_err(Failure::config)?));
    let sessions = Arc::new(Sessions::default());
    let capacity = Arc::new(Capacity::new());
    let ingress = Arc::new(
        Ingress::new(
            settings.get(),
            store.clone(),
            sessions.clone(),
            capacity.clone(),
        )
        .map_err(Failure::config)?,
    );
    let deliveries = Arc::new(Notify::new());
    let deliverer = Arc::new(
        Deliverer::new(store.clone(), settings.clone(), deliveries.clone())
            .map_err(Failure::runtime)?,
    );
    let drain = Drain::new();
    // Stopped at stage 6, after the turns that use them.
    let mcp = Arc::new(McpServers::new(drain.tracker(), drain.stop_background()));
    let turn_context = Arc::new(TurnContext {
        store: store.clone(),
        settings: settings.clone(),
        model,
        sessions: sessions.clone(),
        deliveries: deliveries.clone(),
        cancel_turns: drain.cancel_turns(),
        background_jobs: drain.tracker(),
        stop_background_jobs: drain.stop_background(),
        job_slots: Arc::new(JobSlots::default()),
        mcp: mcp.clone(),
    });
    let daemon = Arc::new(Daemon {
        source: source.clone(),
        settings,
        store: store.clone(),
        ingress: ingress.clone(),
        sessions: sessions.clone(),
        mcp: mcp.clone(),
        webhook_addr: listeners.webhook.local_addr().ok(),
    });
    let budgets = drain::Budgets::new(runtime_settings.drain_timeout);
    runtime.block_on(async move {
        let stop_signals = StopSignals::install()?;
        let (reload_requests, reloads) = tokio::sync::mpsc::channel(4);
        let address = listeners
            .webhook
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        // Turns found running were cut off by a crash; mark them before any new turn starts.
        match store.mark_crashed_turns().await {
            Ok(0) => {}
            Ok(count) => tracing::warn!(
                count,
                "turns were running when agentgate last stopped; they are resumed as crashed"
            ),
            Err(err) => return Err(Failure::state(format!("cannot mark crashed turns: {err}"))),
        }
        // Before any tool or MCP server starts: what a killed earlier run left behind goes.
        let leftovers =
            crate::agent::tools::claim_and_reap_leftovers(&daemon.settings.get().config.state_dir);
        if leftovers > 0 {
            tracing::warn!(
                count = leftovers,
                "killed processes that tools of the previous run left behind"
            );
        }
        // In the background: a server that is slow to start or cannot start delays nothing.
        mcp.apply(&daemon.settings.get().config.mcp);
        let stop_accepting = drain.stop_accepting();
        let serves_https = server_settings.tls.is_some();
        let listener = tokio::spawn(async move {
            ingress::serve(
                listeners.webhook,
                ingress,
                &server_settings,
                stop_accepting,
                budgets.requests,
            )
            .await
        });
        let control = Arc::new(Control {
            store: store.clone(),
            sessions: sessions.clone(),
            settings: daemon.settings.clone(),
            mcp,
            reload_requests,
            webhook_url: daemon
                .webhook_addr
                .filter(|_| !serves_https)
                .map(ingress::local_url),
        });
        if let Some(addr) = metrics_listen {
            // Like the control socket, a metrics address that cannot be bound is no reason to
            // stop serving webhooks.
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => {
                    drain.spawn(control::serve(
                        ControlListener::Metrics(listener),
                        control.clone(),
                        drain.stop_accepting(),
                    ));
                }
                Err(err) => tracing::error!(error = %err,
                    "cannot listen on {addr} (server.metrics_listen); metrics are on the control socket only"),
            }
        }
        if let Some(listener) = listeners.control {
            match ControlListener::socket(listener) {
                Ok(listener) => {
                    drain.spawn(control::serve(listener, control, drain.stop_accepting()));
                }
                Err(err) => tracing::error!(error = %err,
                    "cannot serve the control socket; the daemon serves webhooks without it"),
            }
        }
        drain.spawn(resume::settle_interrupted_sessions(
            store.clone(),
            runtime_settings.clone(),
            sessions.clone(),
            deliveries,
            drain.stop_accepting(),
        ));
        drain.spawn(prune(
            store.clone(),
            daemon.settings.clone(),
            drain.stop_background(),
        ));
        let turns = TaskTracker::new();
        let scheduler = tokio::spawn(session::schedule(
            turn_context,
            runtime_settings.max_concurrent_turns,
            drain.stop_accepting(),
            turns.clone(),
        ));
        let deliverer = tokio::spawn(deliverer.run(drain.stop_delivering()));
        drain.spawn(health(daemon.clone(), drain.stop_background()));
        drain.spawn(summarize(drain.stop_background()));
        drain.spawn(capacity::watch(
            capacity,
            store.clone(),
            daemon.settings.clone(),
            measured_disk,
            drain.stop_background(),
        ));
        tracing::info!(
            version = crate::VERSION,
            listen = %address,
            socket_activated = listeners.activated,
            state_dir = %state_dir.display(),
            "agentgate {} is accepting webhooks", crate::VERSION
        );
        // READY first; the live counts follow from the health task.
        notify::ready("accepting webhooks");

        stop_signals.wait(&daemon, reloads).await;

        let stages = drain::Stages {
            listener,
            scheduler,
            turns,
            deliverer,
        };
        let drained = drain.run(budgets, stages).await;
        store.release().await;
        drained.map_err(Failure::runtime)
    })
}

impl Daemon {
    /// One line for `STATUS=`: what is running, queued, waiting to resume, suspended.
    async fn status_line(&self) -> String {
        let running = self.sessions.running_count();
        let counts = self.store.live_counts().await.unwrap_or_default();
        let mut line = format!(
            "{running} running, {} queued, {} resume-pending, {} suspended",
            counts.queued, counts.resume_pending, counts.suspended,
        );
        if !self.store.is_writable() {
            line.push_str("; state NOT writable: answering 503");
        }
        line
    }

    /// SIGHUP or `agentgate reload`: re-reads the config and runs every check a start runs. A
    /// config that fails one is refused and the old one stays.
    fn reload(&self) -> ReloadReport {
        notify::reloading();
        let mut report = ReloadReport::default();
        match self.checked_settings(&mut report) {
            Ok(settings) => {
                config::list_changes(&self.settings.get().config, &settings.config, &mut report);
                self.settings.replace(settings);
                apply_log_settings(&self.settings.get().config.runtime);
                self.ingress.reload(self.settings.get());
                self.mcp.apply(&self.settings.get().config.mcp);
                report.applied = true;
                tracing::info!(
                    routes = self.settings.get().config.routes.len(),
                    changed = %report.changed.join(", "),
                    "config reloaded"
                );
                if !report.at_restart.is_empty() {
                    tracing::warn!(at_restart = %report.at_restart.join(", "),
                        "these changed settings take effect at the next restart");
                }
            }
            Err(reason) => {
                tracing::error!(reason = %reason, "config reload refused; still serving on the previous config");
                report.refused = Some(reason);
            }
        }
        notify::ready(if report.applied {
            "reloaded"
        } else {
            "reload refused; serving on the previous config"
        });
        report
    }

    /// The new config's settings, if it passes every start-time check; its findings go into
    /// `report` either way.
    fn checked_settings(&self, report: &mut ReloadReport) -> Result<Settings, String> {
        let loaded = match config::load(&self.source, SecretCheck::Required) {
            Ok(loaded) => loaded,
            Err(ConfigError::Invalid {
                source_name,
                findings,
            }) => {
                for finding in &findings {
                    let line = LocatedFinding {
                        source: &source_name,
                        finding,
                    }
                    .to_string();
                    tracing::error!("{line}");
                    report.findings.push(line);
                }
                return Err(format!("{source_name} has errors"));
            }
            Err(unreadable) => return Err(unreadable.to_string()),
        };
        for finding in &loaded.warnings {
            let line = LocatedFinding {
                source: &self.source,
                finding,
            }
            .to_string();
            tracing::warn!("{line}");
            report.findings.push(line);
        }
        if let Some(addr) = self.webhook_addr {
            ingress::refuse_unsigned_off_loopback(&loaded.config, addr)
                .map_err(|err| err.to_string())?;
        }
        Settings::new(loaded.config)
    }
}

/// SIGTERM and SIGINT stop the daemon; SIGHUP reloads. Installed before READY, so a signal that
/// arrives early is never lost; after the first stop signal, further ones change nothing (the
/// drain's commits always happen).
struct StopSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> Result<StopSignals, Failure> {
        let install = |kind| {
            signal(kind).map_err(|err| Failure::runtime(format!("cannot handle signals: {err}")))
        };
        Ok(StopSignals {
            terminate: install(SignalKind::terminate())?,
            interrupt: install(SignalKind::interrupt())?,
            hangup: install(SignalKind::hangup())?,
        })
    }

    /// Waits for a stop signal, carrying out reloads (SIGHUP, or a request from the control
    /// socket that waits for the report) meanwhile.
    async fn wait(mut self, daemon: &Daemon, mut reloads: mpsc::Receiver<ReloadRequest>) {
        loop {
            tokio::select! {
                _ = self.terminate.recv() => return,
                _ = self.interrupt.recv() => return,
                _ = self.hangup.recv() => {
                    daemon.reload();
                }
                Some(requester) = reloads.recv() => {
                    // The requester may have given up waiting; the reload happened anyway.
                    let _ = requester.send(daemon.reload());
                }
            }
        }
    }
}

/// Watchdog pings and `STATUS=` updates. A ping is sent only when this task ran on time and the
/// store's writer thread answered: a wedged event loop or writer stops the pings, and systemd
/// restarts the daemon.
async fn health(daemon: Arc<Daemon>, stop: CancellationToken) {
    let watchdog = notify::watchdog_interval();
    let interval = watchdog.map_or(STATUS_INTERVAL, |w| w / 3);
    let mut last = Instant::now();
    notify::status(&daemon.status_line().await);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let late = last.elapsed() > interval * 2;
        last = Instant::now();
        let writer_alive = tokio::time::timeout(interval, daemon.store.answers())
            .await
            .unwrap_or(false);
        let mut status = daemon.status_line().await;
        if late {
            status = format!("event loop ran late; {status}");
        }
        if !writer_alive {
            status = format!("WEDGED: the state writer does not answer; {status}");
        }
        notify::status(&status);
        if watchdog.is_some() && writer_alive && !late {
            notify::watchdog();
        }
    }
}

/// Opens the configured store. A database server that cannot be reached yet is waited for
/// (the sockets stay with systemd meanwhile, so clients wait rather than being refused); a
/// store that cannot work (bad settings, unusable state directory) is a failure at once.
async fn open_store(config: &config::Config) -> Result<Store, Failure> {
    let mut delay = Duration::from_millis(250);
    loop {
        match Store::open(&config.store, &config.state_dir).await {
            Ok(store) => return Ok(store),
            Err(err) if err.is_transient() => {
                tracing::warn!(error = %err, retry_in = ?delay, "cannot open the PostgreSQL store yet");
                notify::status(&format!("waiting for PostgreSQL: {err}"));
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(err) => return Err(Failure::from(err)),
        }
    }
}

/// Retention and dedup pruning until `stop`: finished work older than `[store] retention` is
/// deleted batch by batch (each a short transaction, so accepts never wait long behind it), and
/// delivery ids older than `dedup_window` are forgotten. Both settings are read anew each round,
/// so a reload applies them.
async fn prune(store: Store, settings: Arc<Shared<Settings>>, stop: CancellationToken) {
    let mut last_dedup_prune: Option<Instant> = None;
    while !stop.is_cancelled() {
        let config = &settings.get().config;
        let (retention, dedup_window) = (config.retention, config.runtime.dedup_window);
        let cutoff = store::now_millis() - i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let mut deleted = 0;
        loop {
            match store.prune_finished(cutoff).await {
                Ok(0) => break,
                Ok(count) => deleted += count,
                Err(err) => {
                    tracing::warn!(error = %err, "could not delete finished work past retention");
                    break;
                }
            }
            if stop.is_cancelled() {
                return;
            }
            // Let accepts and turns have the writer between batches: a round deletes a few
            // thousand events a second at most, spread out, instead of holding the writer in
            // one long stretch.
            tokio::time::sleep(PRUNE_PAUSE).await;
        }
        if deleted > 0 {
            tracing::info!(
                events = deleted,
                retention = %humantime::format_duration(retention),
                "deleted finished events past retention, with their turns, transcripts and deliveries"
            );
        }
        if last_dedup_prune.is_none_or(|at| at.elapsed() >= DEDUP_PRUNE_INTERVAL) {
            last_dedup_prune = Some(Instant::now());
            let window_ms = i64::try_from(dedup_window.as_millis()).unwrap_or(i64::MAX);
            match store.prune_dedup(store::now_millis() - window_ms).await {
                Ok(0) => {}
                Ok(count) => tracing::info!(count, "forgot delivery ids older than dedup_window"),
                Err(err) => tracing::warn!(error = %err, "could not prune delivery ids"),
            }
        }
        // A short retention (minutes, as in tests and soaks) is checked often; a long one every
        // few minutes.
        let pause = (retention / 4).clamp(Duration::from_secs(1), PRUNE_INTERVAL);
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(pause) => {}
        }
    }
}

fn apply_log_settings(runtime: &RuntimeSettings) {
    logging::configure_event_lines(runtime.event_log_level, runtime.event_log_max_per_second);
}

/// Once a minute, when anything happened, one line with the minute's figures. Per-event lines
/// may be left out under load (docs/reference.md, "Journal"); this line is not, so the journal
/// still tells how much went through.
async fn summarize(stop: CancellationToken) {
    let mut last = metrics::activity();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(SUMMARY_INTERVAL) => {}
        }
        let now = metrics::activity();
        let minute = now.since(last);
        last = now;
        if minute.is_quiet() {
            continue;
        }
        let left_out = if minute.log_lines_skipped > 0 {
            format!(
                "; {} per-event lines left out (runtime.event_log_max_per_second)",
                minute.log_lines_skipped
            )
        } else {
            String::new()
        };
        tracing::info!(
            message_id = logging::MESSAGE_SUMMARY,
            accepted = minute.accepted,
            refused = minute.refused,
            turns_completed = minute.turns_completed,
            turns_failed = minute.turns_failed,
            delivered = minute.delivered,
            delivery_failures = minute.delivery_failures,
            log_lines_skipped = minute.log_lines_skipped,
            "in the last minute: {} events accepted, {} webhooks refused, {} turns completed, {} \
             ended otherwise, {} results delivered, {} delivery attempts failed{left_out}",
            minute.accepted,
            minute.refused,
            minute.turns_completed,
            minute.turns_failed,
            minute.delivered,
            minute.delivery_failures,
        );
    }
}

/// Raises the soft limit on open files to the hard limit: connections, the store and tool pipes
/// all take descriptors, and the soft default (1,024) is far below `server.max_connections`.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %err, "cannot raise the open-file limit");
            }
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "cannot read the open-file limit"),
    }
}
