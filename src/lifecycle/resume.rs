//! Resume: every interrupted session is resumed, suspended or abandoned, and says so. With one
//! node this happens at start; with a shared PostgreSQL store, also whenever another node's
//! leases expire or it hands its interrupted sessions back while draining.
//!
//! Which sessions resume, are suspended or are abandoned is the store's admission rule
//! (`store::admission`), given `resume_window` and `resume_max_attempts` as they are now; this
//! task finds the sessions, has each settled, and logs and counts the outcome. Admission
//! failures (malformed or unwritable ledger) dispatch nothing and are logged per session.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::{Settings, Shared};
use crate::deliver::{self, DeliveryHandle};
use crate::logging;
use crate::metrics::{self, ResumeOutcome};
use crate::session::Sessions;
use crate::store::{InterruptedSession, Settled, Settlement, Store};

/// The resume task.
pub(crate) struct Resumer {
    pub store: Store,
    /// Read at every settlement: `resume_window` and `resume_max_attempts` apply at once.
    pub settings: Arc<Shared<Settings>>,
    pub sessions: Arc<Sessions>,
    pub deliveries: DeliveryHandle,
}

impl Resumer {
    /// Settles the interrupted sessions found at start; with leases, keeps taking over those of
    /// nodes that stopped renewing them (or handed them back), and carries out other nodes'
    /// requests to interrupt this node's turns (`on_busy = "interrupt"`), until `stop` fires.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let Resumer {
            store, sessions, ..
        } = &self;
        loop {
            self.resume_interrupted().await;
            let Some(interval) = store.failover_interval() else {
                return;
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            match store.interrupts_requested().await {
                Ok(keys) => {
                    for key in keys {
                        sessions.interrupt(&key);
                    }
                }
                Err(err) => tracing::warn!(error = %err, "cannot read interruption requests"),
            }
            match store.mark_crashed_turns().await {
                Ok(0) => {}
                Ok(count) => tracing::warn!(
                    count,
                    "taking over turns whose node stopped renewing their leases; they resume as crashed"
                ),
                Err(err) => tracing::warn!(error = %err, "cannot look for expired leases"),
            }
        }
    }

    /// Decides and carries out what happens to each interrupted session (once per call).
    async fn resume_interrupted(&self) {
        let Resumer {
            store,
            settings,
            sessions,
            deliveries,
        } = self;
        let settings = settings.get();
        let runtime = &settings.config.runtime;
        let price = settings.config.model.price;
        let interrupted = match store.interrupted_sessions().await {
            Ok(list) => list,
            Err(err) => {
                tracing::error!(error = %err, "cannot list interrupted sessions; none is resumed");
                return;
            }
        };
        let settlement = Settlement {
            resume_window: runtime.resume_window,
            max_attempts: runtime.resume_max_attempts,
        };
        for session in interrupted {
            match store
                .settle_interrupted(&session, settlement, deliver::body::renderer(price))
                .await
            {
                Ok(settled) => report(&session, &settled, runtime.resume_max_attempts),
                Err(err) => {
                    tracing::error!(session_key = %session.session_key, event_id = %session.event_id,
                    error = %err, "cannot settle the interrupted session; it stays resume_pending");
                }
            }
            sessions.wake();
            deliveries.result_queued();
        }
    }
}

/// Logs and counts how an interrupted session was settled.
fn report(session: &InterruptedSession, settled: &Settled, max_attempts: u32) {
    match settled {
        Settled::Resumed { .. } | Settled::ResumedAlone { .. } => {
            metrics::resume(ResumeOutcome::Resumed(session.reason));
        }
        Settled::Abandoned => metrics::resume(ResumeOutcome::Abandoned),
        Settled::Suspended => metrics::resume(ResumeOutcome::Suspended),
        Settled::Refused(_) => metrics::resume(ResumeOutcome::Refused),
        Settled::NotInterrupted => {}
    }
    let InterruptedSession {
        session_key,
        event_id,
        route,
        turn_id,
        reason,
        ..
    } = session;
    match settled {
        Settled::Abandoned => tracing::warn!(message_id = logging::MESSAGE_ABANDONED,
            session_key = %session_key, event_id = %event_id, route = %route, turn_id = %turn_id,
            reason = %reason, "interrupted session abandoned: older than resume_window"),
        Settled::Suspended => tracing::error!(message_id = logging::MESSAGE_SUSPENDED,
            session_key = %session_key, event_id = %event_id, route = %route, turn_id = %turn_id,
            attempts = max_attempts, "session suspended: it keeps being interrupted"),
        // Fail closed: without a durable count there is no resume.
        Settled::Refused(error) => tracing::error!(session_key = %session_key,
            event_id = %event_id, route = %route, error = %error,
            "resume refused: the retry ledger could not count it"),
        Settled::Resumed { attempt } => tracing::info!(message_id = logging::MESSAGE_RESUMED,
            session_key = %session_key, event_id = %event_id, route = %route, turn_id = %turn_id,
            reason = %reason, attempt, max_attempts, "interrupted session resumed"),
        Settled::ResumedAlone {
            attempts,
            crashed_with,
        } => tracing::info!(message_id = logging::MESSAGE_RESUMED,
            session_key = %session_key, event_id = %event_id, route = %route, turn_id = %turn_id,
            reason = %reason, attempts, max_attempts, crashed_with,
            "interrupted session resumed alone: the crash cut off {crashed_with} turns, so it is not counted against this one"),
        Settled::NotInterrupted => tracing::debug!(session_key = %session_key,
            "interrupted session already settled elsewhere"),
    }
}
