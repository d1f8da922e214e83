//! The state as the operator reads it and the operator's actions on it, shared by the control
//! API and the console so that each is a layer of HTTP over the same reads and actions: the
//! store, priced by the settings in effect, the daemon's own figures, and the overrides
//! (`sessions resume|suspend|cancel|rewind|fork`, `events replay`, `deliveries retry`, approvals), each
//! logged and counted once whoever asked.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use serde_json::json;

use super::api::{
    Accepting, DaemonStatus, OperatorAnswer, RerunAnswer, SandboxStatus, SessionDocument,
    StatusDocument, TurnCounts, UsageLimits,
};
use super::body::{BodyError, BodySlots, body_timeout};
use super::capacity::Capacity;
use super::connection::RequestBody;
use super::control::{ControlError, no_session};
use super::response::{HttpResponse, error, json_response};
use crate::agent::mcp::McpServers;
use crate::config::{Settings, Shared};
use crate::deliver::DeliveryHandle;
use crate::logging;
use crate::metrics;
use crate::operator::{OperatorAction, Rerun};
use crate::session::Sessions;
use crate::session::approval::{self, Outcome};
use crate::store::approval::Verdict;
use crate::store::{
    EventDetail, RetryTarget, RewindRefusal, RewindRequest, SessionState, StatusSummary, Store,
    TranscriptTail,
};

/// How long `cancel` waits for the cancelled turn to commit its end before it answers 202.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How much of a session's transcript a session document carries.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Entries {
    All,
    Latest(i64),
}

/// What the control API and the console read and act on. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Operations {
    pub(crate) store: Store,
    pub(crate) sessions: Arc<Sessions>,
    pub(crate) settings: Arc<Shared<Settings>>,
    pub(crate) capacity: Arc<Capacity>,
    pub(crate) mcp: Arc<McpServers>,
    /// Rung when a failed delivery is queued again.
    pub(crate) deliveries: DeliveryHandle,
    /// What the bodies of the control, metrics and console listeners hold, together.
    pub(crate) body_slots: Arc<BodySlots>,
}

impl Operations {
    /// A request body of at most `limit` bytes, read as the webhook listener reads one: its
    /// memory bounded, and within four times `header_timeout` (else [`BodyError::TimedOut`],
    /// answered `408`).
    pub(super) async fn read_body(
        &self,
        body: RequestBody,
        limit: usize,
    ) -> Result<Bytes, BodyError> {
        let timeout = body_timeout(&self.settings.get().config.server);
        self.body_slots.read(body, limit, None, timeout).await
    }

    pub(crate) async fn summary(&self) -> Result<StatusSummary, ControlError> {
        let summary = self.store.status_summary().await?;
        crate::metrics::recent::deliveries_pending(summary.deliveries.pending);
        Ok(summary)
    }

    /// Whether a webhook would be accepted now, and why not.
    pub(crate) fn accepting(&self) -> Accepting {
        if self.store.is_writable() {
            let runtime = &self.settings.get().config.runtime;
            Accepting::from_refusal(self.capacity.refusal(runtime))
        } else {
            Accepting::refused("the state cannot be written durably")
        }
    }

    /// What `GET /v1/status` answers (and the console's overview shows).
    pub(crate) async fn status_document(&self) -> Result<StatusDocument, ControlError> {
        let summary = self.summary().await?;
        let writable = self.store.is_writable();
        let accepting = self.accepting();
        let daemon = DaemonStatus {
            running: true,
            not_serving: None,
            pid: Some(std::process::id()),
            writable: Some(writable),
        };
        let price = self.settings.get().config.model.price;
        let mut document = StatusDocument::of(summary, daemon, accepting, price.as_ref());
        document.turns = Some(TurnCounts {
            running: self.sessions.running_count(),
        });
        document.mcp = Some(self.mcp.status());
        document.sandbox = Some(SandboxStatus::probed());
        Ok(document)
    }

    /// One session with its transcript (`All` of it, or the `Latest(n)` entries) and what it
    /// spent, priced, and whether it has entries before those it carries (`GET
    /// /v1/sessions/{key}` and the console's session page).
    pub(crate) async fn session_document(
        &self,
        key: &str,
        entries: Entries,
    ) -> Result<Option<(SessionDocument, bool)>, ControlError> {
        let Some(mut session) = self.store.session(key).await? else {
            return Ok(None);
        };
        let limits = UsageLimits::of(&self.settings.get().config);
        session.usage = session
            .usage
            .map(|usage| usage.priced(limits.price.as_ref()));
        let tail = match entries {
            Entries::All => TranscriptTail {
                rows: crate::session::transcript(&self.store, key, i64::MIN).await?,
                earlier: false,
            },
            Entries::Latest(limit) => {
                crate::session::transcript_tail(&self.store, key, limit).await?
            }
        };
        let document = SessionDocument {
            budgets: limits.session_use(&session),
            session,
            transcript: tail.rows,
        };
        Ok(Some((document, tail.earlier)))
    }

    /// One event with its turns, delivery and what it spent, priced (`GET /v1/events/{id}`
    /// and the console's event page).
    pub(crate) async fn event_detail(&self, id: &str) -> Result<Option<EventDetail>, ControlError> {
        let Some(mut detail) = self.store.event(id).await? else {
            return Ok(None);
        };
        let price = self.settings.get().config.model.price;
        detail.usage = detail.usage.priced(price.as_ref());
        for turn in &mut detail.turns {
            turn.usage = turn.usage.priced(price.as_ref());
        }
        Ok(Some(detail))
    }

    /// Queues the deliveries of `target` again for `actor` (the control API's peer, or the
    /// console) and wakes the deliverer; returns how many.
    pub(crate) async fn retry(
        &self,
        target: RetryTarget,
        actor: &str,
    ) -> Result<u64, ControlError> {
        let queued = self.store.retry_deliveries(target).await?;
        if queued > 0 {
            self.deliveries.result_queued();
            tracing::info!(queued, actor = %actor,
                "deliveries queued again by the operator");
        }
        Ok(queued)
    }

    /// Accepts a copy of event `id` as a new event for `actor` and wakes the scheduler; returns
    /// the copy's id, `None` when there is no such event.
    pub(crate) async fn replay(
        &self,
        id: &str,
        actor: &str,
    ) -> Result<Option<String>, ControlError> {
        let Some(copy) = self.store.replay_event(id).await? else {
            return Ok(None);
        };
        self.sessions.wake();
        tracing::info!(event_id = %id, copy = %copy, actor = %actor,
            "event replayed by the operator as a new event");
        Ok(Some(copy))
    }

    /// `POST /v1/sessions/{key}/{rewind|fork}`: queues the turn that reruns the session from
    /// an entry (docs/reference.md, "Rewind and fork") and wakes the scheduler; logs it with the
    /// entries it superseded, and counts it. A refusal is logged and counted too, and answered
    /// with its one-line reason: `404` for an unknown session, `409` for a busy one or a fork
    /// into an existing key, `422` for an entry that cannot be rerun.
    pub(crate) async fn rerun(
        &self,
        request: RewindRequest,
        actor: &str,
    ) -> Result<HttpResponse, ControlError> {
        let rerun = if request.fork_as.is_some() {
            Rerun::Fork
        } else {
            Rerun::Rewind
        };
        let (key, entry) = (request.session.clone(), request.entry);
        let rewound = match self.store.rewind(request).await? {
            Ok(rewound) => rewound,
            Err(refusal) => {
                metrics::operator_rerun(rerun, false);
                tracing::warn!(session_key = %key, entry, action = rerun.name(), actor = %actor,
                    reason = %refusal, "rerun of a session refused");
                let (status, code) = match &refusal {
                    RewindRefusal::NoSession(_) => (StatusCode::NOT_FOUND, "no_session"),
                    RewindRefusal::Busy { .. } | RewindRefusal::Queued(_) => {
                        (StatusCode::CONFLICT, "busy")
                    }
                    RewindRefusal::Exists(_) => (StatusCode::CONFLICT, "exists"),
                    RewindRefusal::NoEntry { .. }
                    | RewindRefusal::NotRerunnable { .. }
                    | RewindRefusal::Superseded { .. }
                    | RewindRefusal::EventGone { .. } => {
                        (StatusCode::UNPROCESSABLE_ENTITY, "bad_entry")
                    }
                };
                return Ok(error(status, code, &refusal.to_string()));
            }
        };
        self.sessions.wake();
        metrics::operator_rerun(rerun, true);
        tracing::warn!(
            message_id = logging::MESSAGE_OPERATOR_RERUN,
            session_key = %key, entry, action = rerun.name(), turn_id = %rewound.turn_id,
            event_id = %rewound.event_id, runs_in = %rewound.session,
            superseded = rewound.superseded, actor = %actor,
            "session rerun by the operator from a transcript entry; the entries from it on are superseded by the new turn"
        );
        Ok(json_response(
            StatusCode::OK,
            &json!(RerunAnswer {
                session: key,
                action: rerun.name().to_string(),
                entry,
                turn_id: rewound.turn_id,
                event_id: rewound.event_id,
                runs_in: rewound.session,
                superseded: rewound.superseded,
            }),
        ))
    }

    /// `POST /v1/sessions/{key}/{resume|suspend|cancel}`: the daemon acts at once, logs the
    /// action with its `MESSAGE_ID` and counts it.
    pub(crate) async fn operator_action(
        &self,
        key: &str,
        action: OperatorAction,
        peer: &str,
    ) -> Result<HttpResponse, ControlError> {
        let previous = match action {
            OperatorAction::Resume => self.store.operator_resume(key).await,
            OperatorAction::Suspend => self.store.operator_suspend(key).await,
            OperatorAction::Cancel => return self.cancel(key, peer).await,
        }?;
        let Some(previous) = previous else {
            return Ok(no_session(key));
        };
        if action == OperatorAction::Suspend {
            self.deny_pending(key, peer, action).await?;
        }
        self.sessions.wake();
        metrics::operator_action(action);
        if action == OperatorAction::Resume {
            tracing::info!(
                message_id = logging::MESSAGE_OPERATOR_RESUMED,
                session_key = %key, previous_state = %previous, actor = %peer,
                "session resumed by the operator; its ledger entry is cleared and its interrupted event runs again"
            );
        } else {
            tracing::warn!(
                message_id = logging::MESSAGE_OPERATOR_SUSPENDED,
                session_key = %key, previous_state = %previous, actor = %peer,
                "session suspended by the operator; no turn of it starts until it is resumed"
            );
        }
        Ok(json_response(
            StatusCode::OK,
            &json!(OperatorAnswer {
                session: key.to_string(),
                action: action.name().to_string(),
                previous_state: Some(previous),
                turn_id: None,
                ended: None,
            }),
        ))
    }

    /// Cancels the session's running turn and waits (briefly) until its end is committed. A
    /// session whose turn waits for a decision has its requests denied instead: the turn goes
    /// on without the calls.
    async fn cancel(&self, key: &str, peer: &str) -> Result<HttpResponse, ControlError> {
        let Some(session) = self.store.session(key).await? else {
            return Ok(no_session(key));
        };
        if session.state == SessionState::AwaitingApproval {
            let denied = self.deny_pending(key, peer, OperatorAction::Cancel).await?;
            metrics::operator_action(OperatorAction::Cancel);
            return Ok(json_response(
                StatusCode::OK,
                &json!(OperatorAnswer {
                    session: key.to_string(),
                    action: OperatorAction::Cancel.name().to_string(),
                    previous_state: Some(session.state),
                    turn_id: denied.first().map(|row| row.turn_id.clone()),
                    ended: Some(false),
                }),
            ));
        }
        let Some((turn_id, ended)) = self.sessions.cancel(key) else {
            return Ok(error(
                StatusCode::CONFLICT,
                "not_running",
                &format!("session {key:?} has no turn running on this daemon"),
            ));
        };
        metrics::operator_action(OperatorAction::Cancel);
        tracing::warn!(
            message_id = logging::MESSAGE_OPERATOR_CANCELLED,
            session_key = %key, turn_id = %turn_id, actor = %peer,
            "running turn cancelled by the operator; its tools are killed and its event ends failed"
        );
        let ended = tokio::time::timeout(CANCEL_WAIT, ended.cancelled())
            .await
            .is_ok();
        Ok(json_response(
            if ended {
                StatusCode::OK
            } else {
                StatusCode::ACCEPTED
            },
            &json!(OperatorAnswer {
                session: key.to_string(),
                action: OperatorAction::Cancel.name().to_string(),
                previous_state: None,
                turn_id: Some(turn_id),
                ended: Some(ended),
            }),
        ))
    }

    /// Denies the session's pending approval requests as `action` does, decided by `peer`; the
    /// turn goes on without the calls.
    async fn deny_pending(
        &self,
        key: &str,
        peer: &str,
        action: OperatorAction,
    ) -> Result<Vec<crate::store::ApprovalRow>, ControlError> {
        let Some(why) = action.denial() else {
            return Ok(Vec::new());
        };
        let decision = crate::store::Decision::denied(peer, why);
        let denied = self.store.deny_session_approvals(key, decision).await?;
        for row in &denied {
            approval::decided(&self.sessions, row);
        }
        Ok(denied)
    }

    /// The decision `verdict` on request `id`, taken `by` with `note`, against the routes of the
    /// config in effect (the control API's, and the console's).
    pub(crate) async fn take_decision(
        &self,
        id: &str,
        verdict: Verdict,
        by: &str,
        note: Option<String>,
    ) -> Result<Outcome, ControlError> {
        let settings = self.settings.get();
        let decision = (by.to_string(), note);
        Ok(approval::decide(
            &self.store,
            &settings.config,
            &self.sessions,
            id,
            verdict,
            decision,
        )
        .await?)
    }
}
