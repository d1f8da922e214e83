//! The control socket (Unix, mode 0660): metrics, status and operator overrides for a running
//! daemon. It is a separate listener so that operator access is governed by file permissions,
//! never by the webhook port.

use std::sync::Arc;

use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use super::api::{
    Accepting, DaemonStatus, EventsPage, OperatorAnswer, SandboxStatus, SessionDocument,
    SessionsPage, StatusDocument, ToolsDocument, TurnCounts, UsageDocument, UsageLimits,
};
use super::capacity::Capacity;
use super::console::state::ConsoleState;
use super::query::{Query, page, percent_decode};
use super::response::{HttpResponse, error, json_response};
use crate::agent::catalog;
use crate::agent::mcp::McpServers;
use crate::config::{ReloadReport, Settings, Shared};
use crate::deliver::DeliveryHandle;
use crate::logging;
use crate::metrics;
use crate::operator::OperatorAction;
use crate::session::Sessions;
use crate::store::approval::Verdict;
use crate::store::{
    EventDetail, EventFilter, EventStatus, SessionState, StatusSummary, Store, StoreError,
};

/// Why the control socket could not answer a request (503).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ControlError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the daemon is stopping")]
    Stopping,
}

/// How long `cancel` waits for the cancelled turn to commit its end before it answers 202.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long `GET /v1/tools` waits for an MCP server that is still starting.
const TOOLS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A reload asked for over the control socket: the daemon answers on the enclosed channel.
pub(crate) type ReloadRequest = oneshot::Sender<ReloadReport>;

pub(crate) struct Control {
    pub store: Store,
    pub sessions: Arc<Sessions>,
    pub settings: Arc<Shared<Settings>>,
    pub capacity: Arc<Capacity>,
    pub mcp: Arc<McpServers>,
    /// Rung when the console queues a failed delivery again.
    pub deliveries: DeliveryHandle,
    /// The console's form key and live transcripts.
    pub console: ConsoleState,
    /// To the daemon's signal loop, which carries out reloads one at a time.
    pub reload_requests: mpsc::Sender<ReloadRequest>,
    /// Where `agentgate send` reaches the webhook listener from this machine (its address, an
    /// unspecified one as loopback); `None` when it serves HTTPS, whose certificate names a host.
    pub webhook_url: Option<String>,
}

impl Control {
    async fn summary(&self) -> Result<StatusSummary, ControlError> {
        Ok(self.store.status_summary().await?)
    }

    /// Answers one request of the connection whose peer is `peer` (the connecting process's
    /// Unix user, or its uid when it has no name).
    pub(super) async fn answer(
        &self,
        request: Request<hyper::body::Incoming>,
        peer: &str,
    ) -> HttpResponse {
        let path = request.uri().path().to_string();
        let method = request.method().clone();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let result = match (&method, segments.as_slice()) {
            (&Method::GET, ["metrics"]) => self.metrics().await,
            (&Method::GET, ["v1", "status"]) => self.status().await,
            (&Method::GET, ["v1", "sessions"]) => self.sessions(request.uri().query()).await,
            (&Method::GET, ["v1", "events"]) => self.events(request.uri().query()).await,
            (&Method::GET, ["v1", "events", id]) => self.event(&percent_decode(id)).await,
            (&Method::GET, ["v1", "sessions", key]) => self.session(&percent_decode(key)).await,
            (&Method::POST, ["v1", "reload"]) => self.reload().await,
            (&Method::GET, ["v1", "tools"]) => self.tools(request.uri().query()).await,
            (&Method::GET, ["v1", "usage"]) => self.usage(request.uri().query()).await,
            (&Method::GET, ["v1", "approvals"]) => self.approvals(request.uri().query()).await,
            (&Method::GET, ["v1", "approvals", id]) => self.approval(&percent_decode(id)).await,
            (&Method::POST, ["v1", "approvals", id, "approve"]) => {
                let id = percent_decode(id);
                self.decide(&id, Verdict::Approve, peer, request).await
            }
            (&Method::POST, ["v1", "approvals", id, "deny"]) => {
                let id = percent_decode(id);
                self.decide(&id, Verdict::Deny, peer, request).await
            }
            (&Method::POST, ["v1", "routes", route, "send"]) => {
                self.send(&percent_decode(route), request).await
            }
            (&Method::POST, ["v1", "sessions", key, action]) => {
                match OperatorAction::from_name(action) {
                    Some(action) => {
                        self.operator_action(&percent_decode(key), action, peer)
                            .await
                    }
                    None => Ok(not_found(&method, &path)),
                }
            }
            _ => Ok(not_found(&method, &path)),
        };
        result.unwrap_or_else(|err| {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                &err.to_string(),
            )
        })
    }

    /// Whether a webhook would be accepted now, and why not.
    fn accepting(&self) -> Accepting {
        if self.store.is_writable() {
            let runtime = &self.settings.get().config.runtime;
            Accepting::from_refusal(self.capacity.refusal(runtime))
        } else {
            Accepting::refused("the state cannot be written durably")
        }
    }

    async fn status(&self) -> Result<HttpResponse, ControlError> {
        let document = self.status_document().await?;
        Ok(json_response(StatusCode::OK, &json!(document)))
    }

    /// What `GET /v1/status` answers (and the console's overview shows).
    pub(super) async fn status_document(&self) -> Result<StatusDocument, ControlError> {
        let summary = self.summary().await?;
        let writable = self.store.is_writable();
        let accepting = self.accepting();
        let daemon = DaemonStatus {
            running: true,
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

    /// `POST /v1/routes/{route}/send[?delivery_id=ID][&event_type=T]`: `agentgate send` without
    /// `--url`. The daemon signs the body with the route's secret and posts it to its own webhook
    /// listener, so the command needs neither the secret (a systemd credential only the service
    /// reads) nor the address (under socket activation only the daemon knows what systemd
    /// passed). Answers with what the listener answered.
    async fn send(
        &self,
        route_name: &str,
        request: Request<hyper::body::Incoming>,
    ) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(request.uri().query());
        let settings = self.settings.get();
        let Some(route) = settings
            .config
            .routes
            .iter()
            .find(|route| route.name == route_name)
        else {
            return Ok(error(
                StatusCode::NOT_FOUND,
                "no_route",
                &format!("no route {route_name:?} in the running config"),
            ));
        };
        let Some(base) = &self.webhook_url else {
            return Ok(error(
                StatusCode::CONFLICT,
                "https_listener",
                "the webhook listener serves HTTPS, whose certificate names a host: pass --url https://HOST:PORT",
            ));
        };
        let limit = usize::try_from(settings.config.server.max_body).unwrap_or(usize::MAX);
        let Ok(body) = http_body_util::Limited::new(request.into_body(), limit)
            .collect()
            .await
            .map(http_body_util::Collected::to_bytes)
        else {
            return Ok(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                &format!("the payload is over [server] max_body ({limit} bytes) or was cut off"),
            ));
        };
        let delivery_id = query
            .get("delivery_id")
            .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        let url = format!("{base}{}", route.path);
        let event_type = query.get("event_type");
        Ok(
            match super::post_signed_webhook(url, route, body, &delivery_id, event_type.as_deref())
                .await
            {
                Ok(answer) => json_response(StatusCode::OK, &json!(answer)),
                Err(message) => error(StatusCode::BAD_GATEWAY, "listener_unreachable", &message),
            },
        )
    }

    /// `GET /v1/sessions[?limit=N][&after=KEY]`: a page of sessions in key order, and the
    /// cursor of the next page (`null` on the last one).
    async fn sessions(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(query);
        let limit = match query.limit() {
            Ok(limit) => limit,
            Err(refusal) => return Ok(*refusal),
        };
        let sessions = self
            .store
            .sessions_page(query.get("after"), limit + 1)
            .await?;
        let (sessions, next) = page(sessions, limit, |session| session.key.clone());
        Ok(json_response(
            StatusCode::OK,
            &json!(SessionsPage { sessions, next }),
        ))
    }

    /// `GET /v1/sessions/{key}`: the session and its transcript, as `sessions show --json`.
    async fn session(&self, key: &str) -> Result<HttpResponse, ControlError> {
        Ok(match self.session_document(key).await? {
            Some(document) => json_response(StatusCode::OK, &json!(document)),
            None => no_session(key),
        })
    }

    /// One session with its transcript and what it spent, priced (`GET /v1/sessions/{key}`
    /// and the console's session page).
    pub(super) async fn session_document(
        &self,
        key: &str,
    ) -> Result<Option<SessionDocument>, ControlError> {
        let Some(mut session) = self.store.session(key).await? else {
            return Ok(None);
        };
        let price = self.settings.get().config.model.price;
        session.usage = session.usage.map(|usage| usage.priced(price.as_ref()));
        let transcript = crate::session::transcript(&self.store, key, i64::MIN).await?;
        Ok(Some(SessionDocument {
            session,
            transcript,
        }))
    }

    /// `GET /v1/usage?since=MS[&route=R]`: `agentgate usage --json` from the first UTC day of
    /// `since` (unix ms; default: the last 7 days).
    async fn usage(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(query);
        let since = match query.get("since").map(|text| text.parse::<i64>()) {
            None => crate::usage::default_usage_since(crate::store::now_millis()),
            Some(Ok(since)) => crate::usage::day_start(since),
            Some(Err(_)) => {
                return Ok(error(
                    StatusCode::BAD_REQUEST,
                    "bad_since",
                    "since must be a time in unix milliseconds",
                ));
            }
        };
        let days = self.store.usage_by_day(since).await?;
        let limits = UsageLimits::of(&self.settings.get().config);
        let route = query.get("route");
        let document = UsageDocument::of(days, since, route.as_deref(), &limits);
        Ok(json_response(StatusCode::OK, &json!(document)))
    }

    /// `GET /v1/events/{id}`: the event as `events show --json` shows it; `404` if unknown.
    async fn event(&self, id: &str) -> Result<HttpResponse, ControlError> {
        Ok(match self.event_detail(id).await? {
            Some(detail) => json_response(StatusCode::OK, &json!(detail)),
            None => no_event(id),
        })
    }

    /// One event with its turns, delivery and what it spent, priced (`GET /v1/events/{id}`
    /// and the console's event page).
    pub(super) async fn event_detail(&self, id: &str) -> Result<Option<EventDetail>, ControlError> {
        let Some(mut detail) = self.store.event(id).await? else {
            return Ok(None);
        };
        let price = self.settings.get().config.model.price;
        detail.usage = detail.usage.priced(price.as_ref());
        Ok(Some(detail))
    }

    /// `GET /v1/events[?status=S][&route=R][&session=KEY][&limit=N][&before=ID]`: a page of
    /// events, newest first, and the cursor of the next page (`null` on the last one).
    async fn events(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(query);
        let limit = match query.limit() {
            Ok(limit) => limit,
            Err(refusal) => return Ok(*refusal),
        };
        let status = match query.get("status") {
            None => None,
            Some(name) => match EventStatus::from_name(&name) {
                Some(status) => Some(status),
                None => {
                    return Ok(error(
                        StatusCode::BAD_REQUEST,
                        "bad_status",
                        &format!("unknown event status {name:?}"),
                    ));
                }
            },
        };
        let events = self
            .store
            .events(EventFilter {
                status,
                route: query.get("route"),
                session: query.get("session"),
                limit: limit + 1,
                before: query.get("before"),
            })
            .await?;
        let (events, next) = page(events, limit, |event| event.id.clone());
        Ok(json_response(
            StatusCode::OK,
            &json!(EventsPage { events, next }),
        ))
    }

    /// `GET /v1/tools[?route=R]`: what `agentgate tools list` shows, from the running servers.
    async fn tools(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let route = Query::parse(query).get("route");
        let settings = self.settings.get();
        Ok(
            match catalog::listing(&settings.config, &self.mcp, route.as_deref(), TOOLS_WAIT).await
            {
                Ok((tools, problems)) => {
                    json_response(StatusCode::OK, &json!(ToolsDocument { tools, problems }))
                }
                Err(message) => error(StatusCode::NOT_FOUND, "no_route", &message),
            },
        )
    }

    async fn metrics(&self) -> Result<HttpResponse, ControlError> {
        let summary = self.summary().await?;
        let text = metrics::render(&metrics::Snapshot {
            summary: &summary,
            turns_running: self.sessions.running_count(),
            store_writable: self.store.is_writable(),
            accepting: self.accepting().ok,
        });
        let mut response = http::Response::new(http_body_util::Full::new(bytes::Bytes::from(text)));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(metrics::CONTENT_TYPE),
        );
        Ok(response)
    }

    /// `POST /v1/reload`: 200 with the report when the new config is in effect, 422 with the
    /// report (its findings and the reason) when it was refused.
    async fn reload(&self) -> Result<HttpResponse, ControlError> {
        let (requester, answer) = oneshot::channel();
        self.reload_requests
            .send(requester)
            .await
            .map_err(|_| ControlError::Stopping)?;
        let report = answer.await.map_err(|_| ControlError::Stopping)?;
        let status = if report.applied {
            StatusCode::OK
        } else {
            StatusCode::UNPROCESSABLE_ENTITY
        };
        Ok(json_response(status, &json!(report)))
    }

    /// `POST /v1/sessions/{key}/{resume|suspend|cancel}`: the daemon acts at once, logs the
    /// action with its `MESSAGE_ID` and counts it.
    pub(super) async fn operator_action(
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
}

pub(super) fn not_found(method: &Method, path: &str) -> HttpResponse {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        &format!("no control endpoint {method} {path}"),
    )
}

pub(super) fn no_event(id: &str) -> HttpResponse {
    error(
        StatusCode::NOT_FOUND,
        "no_event",
        &format!("no event {id:?}"),
    )
}

pub(super) fn no_session(key: &str) -> HttpResponse {
    error(
        StatusCode::NOT_FOUND,
        "no_session",
        &format!("no session {key:?}"),
    )
}

impl Control {
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
            crate::session::approval::decided(&self.sessions, row);
        }
        Ok(denied)
    }
}
