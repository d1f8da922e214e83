//! The daemon's life: bootstrap, serving, reload, and an orderly stop.
//!
//! [`serve`] is the wiring and nothing else; each step lives in its own file. `bootstrap.rs`
//! does everything that must happen before anything is accepted. The daemon then runs as a set
//! of long-lived tasks, each a value with a `run(shutdown)` future that the drain starts with the
//! token of the stage that stops it: the webhook listener (ingress), the control and metrics
//! listeners (ingress/control), `resume.rs`, the scheduler (session), the deliverer (deliver) and
//! `periodic.rs`. While it serves, `signals.rs` waits for a stop and carries out reloads
//! (`reload.rs`); the stop is `drain.rs`: no new turns, running turns get `drain_timeout` while
//! webhooks are still accepted, then no new connections (systemd keeps the socket, so clients
//! wait for the next instance), in-flight requests finish, and what is still running is left
//! `resume_pending` for the next start.

mod bootstrap;
mod drain;
mod notify;
mod periodic;
mod reload;
mod resume;
mod signals;
mod standby;

use std::path::Path;
use std::sync::Arc;

use crate::agent::mcp::McpServers;
use crate::config::{self, Config, ConfigSource, ServerSettings, Settings, Shared, StoreSettings};
use crate::deliver::Deliverer;
use crate::exit::Failure;
use crate::ingress::capacity::{Capacity, CapacityWatch};
use crate::ingress::control::Control;
use crate::ingress::control_listener::{ControlServer, ControlSockets};
use crate::ingress::{self, BodySlots, Console, Ingress, Listeners, Operations, WebhookListener};
use crate::session::{BackgroundJobs, JobSlots, Scheduler, Sessions, TurnContext};
use crate::store::Store;
use bootstrap::Bootstrap;
use drain::{Budgets, Drain, Stage, Stages};
use periodic::{Expiry, Health, KeepActivity, MemoryTrim, Retention, Summary};
use reload::Reloader;
use resume::Resumer;
use signals::StopSignals;
use standby::Standby;

/// `agentgate serve` with the config `load` reads from `source` (which a reload reads again):
/// runs until SIGTERM or SIGINT. `record` appends every model reply to a cassette file.
///
/// The sockets systemd passed are taken first, before the config is read: a config error under
/// socket activation by a service manager (sockets passed and `NOTIFY_SOCKET` set) is then held
/// (`standby::hold`) rather than exited on, since an exit would let the next connection start
/// the service again, in a loop. Otherwise it exits 78 as any other command does.
pub(crate) fn serve(
    source: &ConfigSource,
    load: impl FnOnce() -> Result<config::Loaded, Failure>,
    record: Option<&Path>,
) -> Result<(), Failure> {
    let inherited = ingress::inherited_sockets().map_err(Failure::config)?;
    let spare = inherited
        .as_ref()
        .filter(|_| notify::supervised())
        .and_then(|listeners| listeners.try_clone().ok());
    let started = load().and_then(|loaded| {
        let Bootstrap {
            config,
            lock: _lock,
            listeners,
            runtime,
        } = Bootstrap::prepare(source, loaded, inherited)?;
        runtime.block_on(run(source, config, listeners, record))
    });
    match (started, spare) {
        (Err(failure), Some(spare)) if failure.is_config() => {
            standby::hold(spare, &failure, source)
        }
        (started, _) => started,
    }
}

/// Opens the store, wires the handles, recovers the previous run, starts every task on the
/// drain, says READY, serves until a stop signal, and drains.
async fn run(
    source: &ConfigSource,
    config: Config,
    listeners: Listeners,
    record: Option<&Path>,
) -> Result<(), Failure> {
    // Before anything that can wait: a signal that arrives early is never lost.
    let mut stop_signals = StopSignals::install()?;
    let mut standby = Standby::new(&listeners);
    let Some(store) = stop_signals
        .unless_stopped(bootstrap::open_store(&config, &mut standby))
        .await
        .transpose()?
    else {
        tracing::info!("stopped before the store could be opened");
        return Ok(());
    };
    let model = bootstrap::open_model(&config, record)?;
    reload::apply_log_settings(&config.runtime);
    if let Err(err) = crate::telemetry::start(&config.telemetry) {
        // Traces are worth less than the work: the daemon runs without them.
        tracing::warn!(error = %err, "running without traces");
    }
    let drain = Drain::new();
    let webhook_addr = listeners.webhook.local_addr().ok();
    let state_dir = config.state_dir.clone();
    let wired = Wired::new(config, store.clone(), model, &drain, webhook_addr)?;

    // Everything that can refuse the config has; only now is the previous run's state changed.
    let recovered = stop_signals
        .unless_stopped(bootstrap::recover_previous_run(
            &store,
            &state_dir,
            &mut standby,
        ))
        .await;
    if recovered.transpose()?.is_none() {
        tracing::info!("stopped before the previous run's turns could be marked");
        store.release().await;
        return Ok(());
    }
    let activity = KeepActivity {
        files: crate::store::StateDir::new(&state_dir),
    };
    activity.restore();
    drain.start(Stage::StopBackground, |stop| activity.run(stop));
    // In the background: a server that is slow to start or cannot start delays nothing.
    let config = &wired.settings.get().config;
    wired.mcp.apply(&config.mcp, &config.hidden);
    let settings = wired.settings.clone();
    let activated = listeners.activated;
    // The daemon's own listeners take every connection from here on.
    standby.end().await;
    let Serving {
        stages,
        reloader,
        reloads,
    } = wired.start(source, &drain, listeners).await;

    tracing::info!(
        version = crate::VERSION,
        listen = %webhook_addr.map(|addr| addr.to_string()).unwrap_or_default(),
        socket_activated = activated,
        state_dir = %state_dir.display(),
        "agentgate {} is accepting webhooks", crate::VERSION
    );
    // READY first; the live counts follow from the health task.
    notify::ready("accepting webhooks");
    stop_signals.wait(&reloader, reloads).await;

    // The drain's budgets as the config says now (a reload may have changed drain_timeout).
    let budgets = Budgets::new(settings.get().config.runtime.drain_timeout);
    drain.run(budgets, stages).await.map_err(Failure::runtime)
}

/// The handles the daemon's tasks share, built from the config before anything runs; building
/// them is what can still refuse the config (exit 78).
struct Wired {
    store: Store,
    settings: Arc<Shared<Settings>>,
    server: ServerSettings,
    /// The state directory when its file system holds the events (SQLite): its free space is
    /// watched. With PostgreSQL the events live on the database server's disk.
    measured_disk: Option<std::path::PathBuf>,
    webhook_addr: Option<std::net::SocketAddr>,
    sessions: Arc<Sessions>,
    capacity: Arc<Capacity>,
    ingress: Arc<Ingress>,
    deliverer: Arc<Deliverer>,
    mcp: Arc<McpServers>,
    control: Arc<Control>,
    reloads: tokio::sync::mpsc::Receiver<ingress::control::ReloadRequest>,
    scheduler: Scheduler,
}

impl Wired {
    fn new(
        config: Config,
        store: Store,
        model: Arc<crate::agent::model::Model>,
        drain: &Drain,
        webhook_addr: Option<std::net::SocketAddr>,
    ) -> Result<Wired, Failure> {
        let server = config.server.clone();
        let measured_disk =
            matches!(config.store, StoreSettings::Sqlite).then(|| config.state_dir.clone());
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
        let deliverer =
            Arc::new(Deliverer::new(store.clone(), settings.clone()).map_err(Failure::runtime)?);
        // Stopped at stage 6, after the turns that use them.
        let mcp = Arc::new(McpServers::new(
            drain.tracker(),
            drain.token(Stage::StopBackground),
        ));
        let (reload_requests, reloads) = tokio::sync::mpsc::channel(4);
        let ops = Operations {
            store: store.clone(),
            sessions: sessions.clone(),
            settings: settings.clone(),
            capacity: capacity.clone(),
            mcp: mcp.clone(),
            deliveries: deliverer.handle(),
            body_slots: Arc::new(BodySlots::new()),
        };
        let control = Arc::new(Control {
            console: Console::new(ops.clone())
                .map_err(|err| Failure::runtime(format!("cannot draw the console's key: {err}")))?,
            ops,
            reload_requests,
            webhook_url: webhook_addr
                .filter(|_| server.tls.is_none())
                .map(ingress::local_url),
            refusal_log: ingress::control_listener::refusal_log(),
        });
        let scheduler = Scheduler::new(Arc::new(TurnContext {
            store: store.clone(),
            settings: settings.clone(),
            model,
            sessions: sessions.clone(),
            deliveries: deliverer.handle(),
            cancel_turns: drain.token(Stage::CancelTurns),
            jobs: BackgroundJobs {
                store: store.clone(),
                sessions: sessions.clone(),
                tracker: drain.tracker(),
                stop: drain.token(Stage::StopBackground),
                slots: Arc::new(JobSlots::default()),
            },
            mcp: mcp.clone(),
            budget_warnings: Default::default(),
        }));
        Ok(Wired {
            store,
            settings,
            server,
            measured_disk,
            webhook_addr,
            sessions,
            capacity,
            ingress,
            deliverer,
            mcp,
            control,
            reloads,
            scheduler,
        })
    }

    /// Starts every task on the drain, each with the token of the stage that stops it.
    async fn start(self, source: &ConfigSource, drain: &Drain, listeners: Listeners) -> Serving {
        let turns = self.scheduler.turns();
        let capacity_watch = CapacityWatch {
            capacity: self.capacity.clone(),
            store: self.store.clone(),
            settings: self.settings.clone(),
            state_dir: self.measured_disk.clone(),
        };
        // Before the first connection: the limits hold from the first webhook.
        capacity_watch.measure().await;
        drain.start(Stage::StopBackground, |stop| capacity_watch.run(stop));
        // Every listener is bound before any serves, so a client that sees /healthz answer
        // finds the control, metrics and console listeners there too.
        let sockets = ControlSockets {
            control: listeners.control,
            metrics: listeners.metrics,
            console: listeners.console,
        };
        let control_servers = ControlServer::bind_all(sockets, &self.server, &self.control).await;
        let listener = WebhookListener {
            socket: listeners.webhook,
            ingress: self.ingress.clone(),
            server: self.server.clone(),
            finish_within: drain::REQUEST_FINISH,
        };
        let listener = drain.start(Stage::StopAccepting, |stop| listener.run(stop));
        for control_server in control_servers {
            drain.start(Stage::StopAccepting, |stop| control_server.run(stop));
        }
        let resumer = Resumer {
            store: self.store.clone(),
            settings: self.settings.clone(),
            sessions: self.sessions.clone(),
            deliveries: self.deliverer.handle(),
        };
        drain.start(Stage::StopClaiming, |stop| resumer.run(stop));
        let scheduler = self.scheduler;
        let scheduler = drain.start(Stage::StopClaiming, |stop| scheduler.run(stop));
        let deliverer = self.deliverer;
        let deliverer = drain.start(Stage::FlushDeliveries, |stop| deliverer.run(stop));
        let retention = Retention {
            store: self.store.clone(),
            settings: self.settings.clone(),
        };
        drain.start(Stage::StopBackground, |stop| retention.run(stop));
        let expiry = Expiry {
            store: self.store.clone(),
            settings: self.settings.clone(),
            sessions: self.sessions.clone(),
        };
        drain.start(Stage::StopClaiming, |stop| expiry.run(stop));
        let health = Health {
            store: self.store.clone(),
            sessions: self.sessions,
            capacity: self.capacity.clone(),
            settings: self.settings.clone(),
        };
        drain.start(Stage::StopBackground, |stop| health.run(stop));
        drain.start(Stage::StopBackground, |stop| Summary.run(stop));
        drain.start(Stage::StopBackground, |stop| MemoryTrim.run(stop));

        let reloader = Reloader {
            source: source.clone(),
            settings: self.settings,
            ingress: self.ingress,
            mcp: self.mcp,
            webhook_addr: self.webhook_addr,
        };
        Serving {
            stages: Stages {
                listener,
                scheduler,
                turns,
                deliverer,
                store: self.store.clone(),
            },
            reloader,
            reloads: self.reloads,
        }
    }
}

/// A daemon whose tasks run: what the drain waits for, and what carries out reloads meanwhile.
struct Serving {
    stages: Stages,
    reloader: Reloader,
    reloads: tokio::sync::mpsc::Receiver<ingress::control::ReloadRequest>,
}
