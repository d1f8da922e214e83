//! The daemon's life: bootstrap, serving, and an orderly stop.
//!
//! Bootstrap happens on the main thread before the async runtime exists (config, state directory
//! lock, inherited sockets), so every startup problem exits with its own sysexits status and one
//! line that says what is wrong, before anything is accepted.

pub(crate) mod journal;
mod resume;

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::agent::model::Model;
use crate::config::{self, ConfigError, ConfigSource, LocatedFinding};
use crate::deliver::Deliverer;
use crate::exit::Failure;
use crate::ingress::{self, Ingress, ListenError};
use crate::session::{self, Sessions, TurnContext};
use crate::store::ledger::LedgerFile;
use crate::store::{self, DaemonLock, Store};
use crate::template::RouteTemplates;

/// How often delivery ids older than `dedup_window` are forgotten.
const DEDUP_PRUNE_INTERVAL: Duration = Duration::from_secs(3600);
/// How long in-flight HTTP requests may take to finish at shutdown.
const REQUEST_FINISH_TIMEOUT: Duration = Duration::from_secs(10);
/// After the drain timeout, how long cancelled turns get to commit their `resume_pending` state.
const CANCEL_COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Prints each finding on its own line and turns an invalid config into exit status 78.
pub(crate) fn load_config(source: &ConfigSource) -> Result<config::Loaded, Failure> {
    match config::load(source) {
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

/// `agentgate serve`: runs until SIGTERM or SIGINT. `record` appends every model reply to a
/// cassette file.
pub(crate) fn serve(
    source: &ConfigSource,
    record: Option<&std::path::Path>,
) -> Result<(), Failure> {
    let loaded = load_config(source)?;
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
    store::ensure_state_dir(&config.state_dir).map_err(Failure::state)?;
    let _lock = DaemonLock::acquire(&config.state_dir).map_err(Failure::state)?;
    let listeners = ingress::take_listeners(&config).map_err(|err| match err {
        ListenError::Bind { .. } => Failure::unavailable(err),
        _ => Failure::config(err),
    })?;
    let store = Store::open(&config.state_dir).map_err(Failure::state)?;
    let templates = Arc::new(RouteTemplates::compile(&config.routes).map_err(Failure::config)?);
    let model = Arc::new(Model::new(&config.model, record).map_err(Failure::config)?);
    if model.is_replay() {
        tracing::warn!(
            "the model is a replay of recorded replies (backend = \"replay\"), not a live model"
        );
    }
    let config = Arc::new(config);
    let sessions = Arc::new(Sessions::default());
    let ingress = Arc::new(Ingress::new(
        &config,
        store.clone(),
        templates.clone(),
        sessions.clone(),
    ));
    let deliveries = Arc::new(Notify::new());
    let deliverer = Arc::new(
        Deliverer::new(store.clone(), config.clone(), deliveries.clone())
            .map_err(Failure::runtime)?,
    );
    let cancel_turns = CancellationToken::new();
    let ledger = Arc::new(LedgerFile::new(&config.state_dir));
    let turn_context = Arc::new(TurnContext {
        ledger: ledger.clone(),
        store: store.clone(),
        config: config.clone(),
        templates,
        model,
        sessions,
        deliveries,
        cancel_turns: cancel_turns.clone(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("agentgate")
        .build()
        .map_err(|err| Failure::runtime(format!("cannot start the async runtime: {err}")))?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        let address = listeners
            .webhook
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let server = tokio::spawn(ingress::serve(
            listeners.webhook,
            ingress,
            config.server.header_timeout,
            shutdown.clone(),
            REQUEST_FINISH_TIMEOUT,
        ));
        // Turns found running were cut off by a crash; mark them before any new turn starts.
        match store.mark_crashed_turns().await {
            Ok(0) => {}
            Ok(count) => tracing::warn!(count, "turns were running when agentgate last stopped; they are resumed as crashed"),
            Err(err) => return Err(Failure::state(format!("cannot mark crashed turns: {err}"))),
        }
        tokio::spawn(resume::resume_interrupted(
            store.clone(),
            ledger,
            config.runtime.clone(),
            turn_context.sessions.clone(),
            turn_context.deliveries.clone(),
        ));
        tokio::spawn(prune_dedup(store, config.runtime.dedup_window));
        let stop_claiming = CancellationToken::new();
        let turns = TaskTracker::new();
        let scheduler = tokio::spawn(session::schedule(
            turn_context,
            config.runtime.max_concurrent_turns,
            stop_claiming.clone(),
            turns.clone(),
        ));
        let stop_delivering = CancellationToken::new();
        let delivery = tokio::spawn(deliverer.run(stop_delivering.clone()));
        tracing::info!(
            listen = %address,
            socket_activated = listeners.activated,
            state_dir = %config.state_dir.display(),
            routes = config.routes.len(),
            "agentgate is accepting webhooks"
        );
        wait_for_stop_signal().await?;
        tracing::info!("stopping: no new connections; finishing in-flight requests and running turns");
        shutdown.cancel();
        stop_claiming.cancel();
        let _ = scheduler.await;
        turns.close();
        if tokio::time::timeout(config.runtime.drain_timeout, turns.wait()).await.is_err() {
            tracing::warn!(running = turns.len(), "drain_timeout reached; cancelling the turns still running");
            cancel_turns.cancel();
            if tokio::time::timeout(CANCEL_COMMIT_TIMEOUT, turns.wait()).await.is_err() {
                tracing::error!("cancelled turns did not commit in time; they resume as crashed at the next start");
            }
        }
        stop_delivering.cancel();
        let _ = delivery.await;
        match server.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(Failure::runtime(format!("webhook listener failed: {err}"))),
            Err(err) => Err(Failure::runtime(format!("webhook listener task failed: {err}"))),
        }
    })
}

async fn wait_for_stop_signal() -> Result<(), Failure> {
    let install = |kind| {
        signal(kind).map_err(|err| Failure::runtime(format!("cannot handle signals: {err}")))
    };
    let mut terminate = install(SignalKind::terminate())?;
    let mut interrupt = install(SignalKind::interrupt())?;
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    Ok(())
}

async fn prune_dedup(store: Store, window: Duration) {
    let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
    loop {
        match store.prune_dedup(store::now_millis() - window_ms).await {
            Ok(0) => {}
            Ok(count) => tracing::info!(count, "forgot delivery ids older than dedup_window"),
            Err(err) => tracing::warn!(error = %err, "could not prune delivery ids"),
        }
        tokio::time::sleep(DEDUP_PRUNE_INTERVAL).await;
    }
}
