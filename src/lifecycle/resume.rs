//! Startup resume: every interrupted session is resumed, suspended or abandoned, and says so.
//!
//! Each resume passes the retry ledger first: its count is incremented and made durable before
//! the session's event is queued again. A session over `resume_max_attempts` is suspended instead,
//! one interrupted longer ago than `resume_window` is abandoned; both end with a delivered status.
//! Admission failures (malformed or unwritable ledger) dispatch nothing and are logged per session.

use std::sync::Arc;

use crate::config::RuntimeSettings;
use crate::lifecycle::journal;
use crate::session::Sessions;
use crate::store::ledger::LedgerFile;
use crate::store::{InterruptedSession, Store, TurnEnd, now_millis};

/// Decides and carries out what happens to each interrupted session.
pub(crate) async fn resume_interrupted(
    store: Store,
    ledger: Arc<LedgerFile>,
    runtime: RuntimeSettings,
    sessions: Arc<Sessions>,
    deliveries: Arc<tokio::sync::Notify>,
) {
    let interrupted = match store.interrupted_sessions().await {
        Ok(list) => list,
        Err(err) => {
            tracing::error!(error = %err, "cannot list interrupted sessions; none is resumed");
            return;
        }
    };
    let window_ms = i64::try_from(runtime.resume_window.as_millis()).unwrap_or(i64::MAX);
    for session in interrupted {
        let outcome = if now_millis() - session.started_at > window_ms {
            abandon(&store, &session).await
        } else {
            admit(&store, &ledger, &session, runtime.resume_max_attempts).await
        };
        if let Err(err) = outcome {
            tracing::error!(session_key = %session.session_key, event_id = %session.event_id,
                error = %err, "cannot settle the interrupted session; it stays resume_pending");
        }
        sessions.wake();
        deliveries.notify_one();
    }
}

fn end(session: &InterruptedSession, event_status: &'static str, error: String) -> TurnEnd {
    TurnEnd {
        turn_id: session.turn_id.clone(),
        event_id: session.event_id.clone(),
        session_key: session.session_key.clone(),
        route: session.route.clone(),
        turn_status: "interrupted",
        event_status,
        reason: Some(session.reason.clone()),
        output: None,
        error: Some(error),
        steps: session.steps,
    }
}

async fn abandon(store: &Store, session: &InterruptedSession) -> Result<(), String> {
    let error = format!(
        "the turn was interrupted ({}) longer ago than resume_window; it is not resumed",
        session.reason
    );
    store
        .finish_turn(end(session, "abandoned", error))
        .await
        .map_err(|err| err.to_string())?;
    tracing::warn!(message_id = journal::MESSAGE_ABANDONED, session_key = %session.session_key,
        event_id = %session.event_id, route = %session.route, turn_id = %session.turn_id,
        reason = %session.reason, "interrupted session abandoned: older than resume_window");
    Ok(())
}

async fn admit(
    store: &Store,
    ledger: &Arc<LedgerFile>,
    session: &InterruptedSession,
    max_attempts: u32,
) -> Result<(), String> {
    let counted = {
        let ledger = ledger.clone();
        let key = session.session_key.clone();
        tokio::task::spawn_blocking(move || ledger.count_resume(&key))
            .await
            .map_err(|err| err.to_string())?
    };
    let attempt = match counted {
        Ok(attempt) => attempt,
        Err(err) => {
            // Fail closed: without a durable count there is no resume.
            tracing::error!(session_key = %session.session_key, event_id = %session.event_id,
                route = %session.route, error = %err,
                "resume refused: the retry ledger could not count it");
            return Ok(());
        }
    };
    if attempt > u64::from(max_attempts) {
        let error = format!(
            "suspended after {max_attempts} resume(s): the session was interrupted ({}) every time",
            session.reason
        );
        store
            .finish_turn(end(session, "suspended", error))
            .await
            .map_err(|err| err.to_string())?;
        tracing::error!(message_id = journal::MESSAGE_SUSPENDED, session_key = %session.session_key,
            event_id = %session.event_id, route = %session.route, turn_id = %session.turn_id,
            attempts = max_attempts, "session suspended: it keeps being interrupted");
        // Only now that the suspension is committed does the entry go.
        let ledger = ledger.clone();
        let key = session.session_key.clone();
        if let Ok(Err(err)) = tokio::task::spawn_blocking(move || ledger.clear(&key)).await {
            tracing::warn!(session_key = %session.session_key, error = %err,
                "cannot remove the suspended session's ledger entry");
        }
        return Ok(());
    }
    store
        .requeue_for_resume(session)
        .await
        .map_err(|err| err.to_string())?;
    tracing::info!(message_id = journal::MESSAGE_RESUMED, session_key = %session.session_key,
        event_id = %session.event_id, route = %session.route, turn_id = %session.turn_id,
        reason = %session.reason, attempt, max_attempts, "interrupted session resumed");
    Ok(())
}
