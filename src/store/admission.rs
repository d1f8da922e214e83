//! The admission rule for interrupted sessions, decided here once for both backends.
//!
//! docs/reference.md ("Resume"): an interrupted session outside `resume_window` is abandoned;
//! otherwise its resume is recorded in the retry ledger first, durably, and dispatched only if
//! that write succeeded (fail closed). An interruption that can be pinned on the session (a
//! drain's, or a crash of a turn that ran alone) counts; a count above `resume_max_attempts`
//! suspends the session instead, and only once the suspension is committed does its count go.
//! A crash that cut off several turns counts against none of them. Every resume after a crash
//! runs alone, counted or not: the session is under suspicion, so its next crash, if any, is its
//! own and counts, and no other turn is cut off by it (and excused with it). The backends only read and write: each implements
//! [`AdmissionSteps`] over its own transaction (PostgreSQL: one, under the session's row lock,
//! with the ledger as a table) or its own files (SQLite: the ledger file under its fs4 lock,
//! then the database).

use std::time::Duration;

use super::model::{InterruptedSession, TurnEnd};
use super::{Settled, Settlement, StoreError, now_millis};

/// The reads and writes that settling one interrupted session needs.
#[async_trait::async_trait]
pub(super) trait AdmissionSteps: Send {
    /// Records one more resume of the session durably, adding it to the count when `counts`,
    /// and returns the count; `Err` with the reason when the ledger cannot record it (then
    /// nothing is dispatched).
    async fn record_resume(
        &mut self,
        session_key: &str,
        counts: bool,
    ) -> Result<Result<u64, String>, StoreError>;
    /// Ends the interrupted turn and its event (abandoned or suspended), with the delivery.
    async fn end(&mut self, end: TurnEnd) -> Result<(), StoreError>;
    /// The session's ledger entry goes (after its suspension is recorded).
    async fn forget_resumes(&mut self, session_key: &str) -> Result<(), StoreError>;
    /// The interrupted event goes back to the head of its session's queue, marked as a resume
    /// that runs `alone` or beside other turns.
    async fn requeue(
        &mut self,
        session: &InterruptedSession,
        alone: bool,
    ) -> Result<(), StoreError>;
}

/// Abandons, resumes or suspends `session` by the rule above.
pub(super) async fn settle(
    steps: &mut impl AdmissionSteps,
    session: &InterruptedSession,
    settlement: Settlement,
) -> Result<Settled, StoreError> {
    if !within_window(session, settlement.resume_window, now_millis()) {
        steps.end(session.abandoned()).await?;
        return Ok(Settled::Abandoned);
    }
    let max_attempts = settlement.max_attempts;
    let pinned = session.is_pinned();
    let attempt = match steps.record_resume(&session.session_key, pinned).await? {
        Ok(attempt) => attempt,
        Err(reason) => return Ok(Settled::Refused(reason)),
    };
    if !pinned {
        steps.requeue(session, true).await?;
        return Ok(Settled::ResumedAlone {
            attempts: attempt,
            crashed_with: session.crashed_with,
        });
    }
    if attempt > u64::from(max_attempts) {
        steps.end(session.suspended(max_attempts)).await?;
        steps.forget_resumes(&session.session_key).await?;
        return Ok(Settled::Suspended);
    }
    steps.requeue(session, session.is_suspect()).await?;
    Ok(Settled::Resumed { attempt })
}

/// Whether `session`'s turn, at `now` (unix milliseconds), started at most `window` ago.
fn within_window(session: &InterruptedSession, window: Duration, now: i64) -> bool {
    let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
    now.saturating_sub(session.started_at) <= window_ms
}
