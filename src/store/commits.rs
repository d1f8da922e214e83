//! Commits as they happen: after a write that changes a session's transcript or state commits,
//! the session's key is rung here, so that whoever shows a session live (the console's live
//! transcript) reads the store when something changed, never on a timer. The writes are the
//! store's own methods of the same names, which shadow the backend's and ring after it commits.
//!
//! Only this process's commits ring. With PostgreSQL other nodes commit too and nothing here
//! hears them, so a live view there also reads on a fallback poll (`fallback_poll`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use super::{
    ApprovalRow, Claim, ClaimedTurn, Decided, Decision, InterruptedSession, NewApproval,
    RenderDelivery, ResumeReason, SessionState, Settled, Settlement, Store, StoreError, TurnEnd,
};
use crate::usage::Spent;

/// Keys rung and not yet read by the slowest listener; past it a listener is told it lagged,
/// and reads as if its session had changed.
const BACKLOG: usize = 1024;
/// How often a live view reads a store that other nodes commit to.
const FALLBACK_POLL: Duration = Duration::from_millis(500);

/// The sessions whose commits this process made, as they are made. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Commits {
    rung: broadcast::Sender<Arc<str>>,
    /// Whether other processes commit to the same store (PostgreSQL's nodes).
    shared: bool,
}

impl Commits {
    pub(super) fn new(shared: bool) -> Commits {
        Commits {
            rung: broadcast::channel(BACKLOG).0,
            shared,
        }
    }

    /// The keys of the sessions committed from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<str>> {
        self.rung.subscribe()
    }

    /// How often a live view must read anyway: `None` when every commit rings here.
    pub(crate) fn fallback_poll(&self) -> Option<Duration> {
        self.shared.then_some(FALLBACK_POLL)
    }

    fn ring(&self, session_key: &str) {
        // Nobody listening is no error.
        let _ = self.rung.send(session_key.into());
    }

    /// Rings `session_key` when `done` committed, and hands it on.
    fn after<T>(&self, session_key: &str, done: Result<T, StoreError>) -> Result<T, StoreError> {
        if done.is_ok() {
            self.ring(session_key);
        }
        done
    }

    fn after_rows(
        &self,
        done: Result<Vec<ApprovalRow>, StoreError>,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        for row in done.iter().flatten() {
            self.ring(&row.session);
        }
        done
    }
}

/// The writes that change a session's transcript or state, each rung once committed.
impl Store {
    pub(crate) fn commits(&self) -> &Commits {
        &self.commits
    }

    pub(crate) async fn claim_turns(&self, claim: Claim) -> Result<Vec<ClaimedTurn>, StoreError> {
        let claimed = self.backend.claim_turns(claim).await;
        for turn in claimed.iter().flatten() {
            self.commits.ring(&turn.event.session_key);
        }
        claimed
    }

    pub(crate) async fn append_transcript(
        &self,
        session_key: &str,
        turn_id: &str,
        entries: Vec<(&'static str, String)>,
        steps: u32,
        spent: Spent,
    ) -> Result<(), StoreError> {
        let done = self
            .backend
            .append_transcript(session_key, turn_id, entries, steps, spent)
            .await;
        self.commits.after(session_key, done)
    }

    pub(crate) async fn finish_turn(
        &self,
        end: TurnEnd,
        render: RenderDelivery,
    ) -> Result<(), StoreError> {
        let key = end.session_key.clone();
        let done = self.backend.finish_turn(end, render).await;
        self.commits.after(&key, done)
    }

    pub(crate) async fn interrupt_for_resume(
        &self,
        turn_id: &str,
        session_key: &str,
        reason: ResumeReason,
        steps: u32,
    ) -> Result<(), StoreError> {
        let done = self
            .backend
            .interrupt_for_resume(turn_id, session_key, reason, steps)
            .await;
        self.commits.after(session_key, done)
    }

    pub(crate) async fn await_approval(
        &self,
        request: NewApproval,
        steps: u32,
    ) -> Result<(), StoreError> {
        let key = request.row.session.clone();
        let done = self.backend.await_approval(request, steps).await;
        self.commits.after(&key, done)
    }

    pub(crate) async fn settle_interrupted(
        &self,
        session: &InterruptedSession,
        settlement: Settlement,
        render: RenderDelivery,
    ) -> Result<Settled, StoreError> {
        let done = self
            .backend
            .settle_interrupted(session, settlement, render)
            .await;
        self.commits.after(&session.session_key, done)
    }

    pub(crate) async fn operator_resume(
        &self,
        key: &str,
    ) -> Result<Option<SessionState>, StoreError> {
        let done = self.backend.operator_resume(key).await;
        self.commits.after(key, done)
    }

    pub(crate) async fn operator_suspend(
        &self,
        key: &str,
    ) -> Result<Option<SessionState>, StoreError> {
        let done = self.backend.operator_suspend(key).await;
        self.commits.after(key, done)
    }

    pub(crate) async fn decide_approval(
        &self,
        id: &str,
        decision: Decision,
    ) -> Result<Decided, StoreError> {
        let decided = self.backend.decide_approval(id, decision).await;
        if let Ok(Decided::Taken(row) | Decided::Expired(row)) = &decided {
            self.commits.ring(&row.session);
        }
        decided
    }

    pub(crate) async fn expire_approvals(&self) -> Result<Vec<ApprovalRow>, StoreError> {
        let expired = self.backend.expire_approvals().await;
        self.commits.after_rows(expired)
    }

    pub(crate) async fn deny_session_approvals(
        &self,
        session_key: &str,
        decision: Decision,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        let denied = self
            .backend
            .deny_session_approvals(session_key, decision)
            .await;
        self.commits.after_rows(denied)
    }
}
