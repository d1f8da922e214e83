//! The daemon's life: bootstrap, serving, reload, and an orderly stop.
//!
//! [`serve`] is the wiring and nothing else; each step lives in its own file. `bootstrap.rs`
//! does everything that must happen before anything is accepted. The daemon then runs as a set
//! of long-lived tasks, each a value with a `run(shutdown)` future that the drain starts with the
//! token of the stage that stops it: the webhook listener (ingress), the control and metrics
//! listeners (ingress/control), `resume.rs`, the scheduler (session), the deliverer (deliver) and
//! `periodic.rs`. While it serves, `signals.rs` waits for a stop and carries out reloads
//! (`reload.rs`); the stop is `drain.rs`: no new connections (systemd keeps the socket, so
//! clients wait for the next instance), in-flight requests finish, running turns get
//! `drain_timeout`, and what is still running then is left `resume_pending` for the next start.

mod bootstrap;
mod drain;
mod notify;
mod periodic;
mod reload;
mod resume;
mod signals;

use std::path::Path;
use std::sync::Arc;

use crate::agent::mcp::McpServers;
use crate::config::{self, Config, ConfigSource, Settings, Shared, StoreSettings};
use crate::deliver::Deliverer;
use crate::exit::Failure;
use crate::ingress::capacity::{Capacity, CapacityWatch};
use crate::ingress::control::{Control, ControlServer};
use crate::ingress::{self, Ingress, Listeners, WebhookListener};
use crate::session::{JobSlots, Scheduler, Sessions, TurnContext};
use bootstrap::Bootstrap;
use drain::{Budgets, Drain, Stage, Stages};
use periodic::{Health, Retention, Summary};
use reload::Reloader;
use resume::Resumer;
use signals::StopSignals;

/// `agentgate serve` with the config loaded from `source` (which a reload reads again): runs
/// until SIGTERM or SIGINT. `record` appends every model reply to a cassette file.
pub(crate) fn serve(
    source: &ConfigSource,
    loaded: config::Loaded,
    record: Option<&Path>,
) -> Result<(), Failure> {
    let Bootstrap {
        config,
        lock: _lock,
        listeners,
        runtime,
    } = Bootstrap::prepare(source, loaded)?;
    runtime.block_on(run(source, config, listeners, record))
}

/// Opens the store, starts every task on the drain, says READY, serves until a stop signal,
/// and drains.
async fn run(
    source: &ConfigSource,
    config: Config,
    listeners: Listeners,
    record: Option<&Path>,
) -> Result<(), Failure> {
    // Before anything that can wait: a signal that arrives early is never lost.
    let mut stop_signals = StopSignals::install()?;
    let Some(store) = stop_signals
        .unless_stopped(bootstrap::open_store(&config))
        .await
        .transpose()?
    else {
        tracing::info!("stopped before the store could be opened");
        return Ok(());
    };
    let model = bootstrap::open_model(&config, record)?;
    reload::apply_log_settings(&config.runtime);

    let runtime = config.runtime.clone();
    let server = config.server.clone();
    let budgets = Budgets::new(runtime.drain_timeout);
    let webhook_addr = listeners.webhook.local_addr().ok();
    let state_dir = config.state_dir.clone();
    // With PostgreSQL the events live on the database server's disk, not in the state directory.
    let measured_disk = matches!(config.store, StoreSettings::Sqlite).then(|| state_dir.clone());
    let settings = Arc::new(Shared::new(Settings::new(config).map_err(Failure::config)?));

    // The handles the tasks share.
    let drain = Drain::new();
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
    let deliveries = deliverer.handle();
    // Stopped at stage 6, after the turns that use them.
    let mcp = Arc::new(McpServers::new(
        drain.tracker(),
        drain.token(Stage::StopBackground),
    ));
    let (reload_requests, reloads) = tokio::sync::mpsc::channel(4);
    let control = Arc::new(Control {
        store: store.clone(),
        sessions: sessions.clone(),
        settings: settings.clone(),
        mcp: mcp.clone(),
        reload_requests,
        webhook_url: webhook_addr
            .filter(|_| server.tls.is_none())
            .map(ingress::local_url),
    });
    let scheduler = Scheduler::new(
        Arc::new(TurnContext {
            store: store.clone(),
            settings: settings.clone(),
            model,
            sessions: sessions.clone(),
            deliveries: deliveries.clone(),
            cancel_turns: drain.token(Stage::CancelTurns),
            background_jobs: drain.tracker(),
            stop_background_jobs: drain.token(Stage::StopBackground),
            job_slots: Arc::new(JobSlots::default()),
            mcp: mcp.clone(),
        }),
        runtime.max_concurrent_turns,
    );
    let turns = scheduler.turns();

    // Everything that can refuse the config has; only now is the previous run's state changed.
    let recovered = stop_signals
        .unless_stopped(bootstrap::recover_previous_run(&store, &state_dir))
        .await;
    if recovered.transpose()?.is_none() {
        tracing::info!("stopped before the previous run's turns could be marked");
        store.release().await;
        return Ok(());
    }
    // In the background: a server that is slow to start or cannot start delays nothing.
    mcp.apply(&settings.get().config.mcp);

    // The tasks, each stopped by its stage of the drain.
    let metrics_listen = server.metrics_listen;
    let listener = WebhookListener {
        listener: listeners.webhook,
        ingress: ingress.clone(),
        server,
        finish_within: budgets.requests,
    };
    let listener = drain.start(Stage::StopAccepting, |stop| listener.run(stop));
    for control_server in ControlServer::bind_all(listeners.control, metrics_listen, &control).await
    {
        drain.start(Stage::StopAccepting, |stop| control_server.run(stop));
    }
    let resumer = Resumer {
        store: store.clone(),
        runtime,
        sessions: sessions.clone(),
        deliveries,
    };
    drain.start(Stage::StopAccepting, |stop| resumer.run(stop));
    let scheduler = drain.start(Stage::StopAccepting, |stop| scheduler.run(stop));
    let deliverer = drain.start(Stage::FlushDeliveries, |stop| deliverer.run(stop));
    let retention = Retention {
        store: store.clone(),
        settings: settings.clone(),
    };
    drain.start(Stage::StopBackground, |stop| retention.run(stop));
    let health = Health {
        store: store.clone(),
        sessions,
    };
    drain.start(Stage::StopBackground, |stop| health.run(stop));
    drain.start(Stage::StopBackground, |stop| Summary.run(stop));
    let capacity_watch = CapacityWatch {
        capacity,
        store: store.clone(),
        settings: settings.clone(),
        state_dir: measured_disk,
    };
    drain.start(Stage::StopBackground, |stop| capacity_watch.run(stop));

    tracing::info!(
        version = crate::VERSION,
        listen = %webhook_addr.map(|addr| addr.to_string()).unwrap_or_default(),
        socket_activated = listeners.activated,
        state_dir = %state_dir.display(),
        "agentgate {} is accepting webhooks", crate::VERSION
    );
    // READY first; the live counts follow from the health task.
    notify::ready("accepting webhooks");

    let reloader = Reloader {
        source: source.clone(),
        settings,
        ingress,
        mcp,
        webhook_addr,
    };
    stop_signals.wait(&reloader, reloads).await;

    let stages = Stages {
        listener,
        scheduler,
        turns,
        deliverer,
    };
    let drained = drain.run(budgets, stages).await;
    store.release().await;
    drained.map_err(Failure::runtime)
}
