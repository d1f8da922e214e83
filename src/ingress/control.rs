//! The control socket (Unix, mode 0660): metrics, status and operator overrides for a running
//! daemon. It is a separate listener so that operator access is governed by file permissions,
//! never by the webhook port.

use http::{Method, Request, StatusCode};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use super::api::{
    EventsPage, RerunRequest, SessionsPage, ToolsDocument, UsageDocument, UsageLimits,
};
use super::body::BodyError;
use super::connection::RequestBody;
use super::console::{Console, ConsoleResponse, boxed};
use super::follow::EntryLines;
use super::operations::{Entries, Operations};
use super::query::{Query, page, percent_decode};
use super::response::{HttpResponse, error, json_response, request_timeout};
use crate::agent::catalog;
use crate::config::ReloadReport;
use crate::logging::LineBudget;
use crate::metrics;
use crate::operator::{OperatorAction, Rerun};
use crate::store::approval::Verdict;
use crate::store::{DeliveryState, RetryTarget, StoreError};

/// Why the control socket could not answer a request (503).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ControlError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the daemon is stopping")]
    Stopping,
}

/// How long `GET /v1/tools` waits for an MCP server that is still starting.
const TOOLS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A reload asked for over the control socket: the daemon answers on the enclosed channel.
pub(crate) type ReloadRequest = oneshot::Sender<ReloadReport>;

pub(crate) struct Control {
    /// The reads and actions the control API serves.
    pub ops: Operations,
    /// The web console, on the control socket and `[console] listen`.
    pub console: Console,
    /// To the daemon's signal loop, which carries out reloads one at a time.
    pub reload_requests: mpsc::Sender<ReloadRequest>,
    /// Where `agentgate send` reaches the webhook listener from this machine (its address, an
    /// unspecified one as loopback); `None` when it serves HTTPS, whose certificate names a host.
    pub webhook_url: Option<String>,
    /// Bounds the lines refusals on the control listeners log.
    pub refusal_log: LineBudget,
}

impl Control {
    /// Answers one request of the connection whose peer is `peer` (the connecting process's
    /// Unix user, or its uid when it has no name).
    pub(super) async fn answer(&self, request: Request<RequestBody>, peer: &str) -> HttpResponse {
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
            (&Method::GET, ["v1", "deliveries"]) => self.deliveries(request.uri().query()).await,
            (&Method::POST, ["v1", "deliveries", "retry"]) => {
                self.retry_answer(request.uri().query(), peer).await
            }
            (&Method::POST, ["v1", "events", id, "replay"]) => {
                self.replay_answer(&percent_decode(id), peer).await
            }
            (&Method::GET, ["v1", "ledger"]) => self.ledger().await,
            (&Method::POST, ["v1", "routes", route, "send"]) => {
                self.send(&percent_decode(route), request).await
            }
            (&Method::POST, ["v1", "sessions", key, "rewind"]) => {
                self.rerun_answer(&percent_decode(key), Rerun::Rewind, request, peer)
                    .await
            }
            (&Method::POST, ["v1", "sessions", key, "fork"]) => {
                self.rerun_answer(&percent_decode(key), Rerun::Fork, request, peer)
                    .await
            }
            (&Method::POST, ["v1", "sessions", key, action]) => {
                match OperatorAction::from_name(action) {
                    Some(action) => {
                        self.ops
                            .operator_action(&percent_decode(key), action, peer)
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

    /// `GET /v1/sessions/{key}/follow[?after=SEQ]` (`agentgate sessions follow`): a stream,
    /// so answered here rather than by `answer`; `None` for any other request.
    pub(super) async fn follow(&self, request: &Request<RequestBody>) -> Option<ConsoleResponse> {
        let path = request.uri().path();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let ["v1", "sessions", key, "follow"] = segments.as_slice() else {
            return None;
        };
        if request.method() != Method::GET {
            return None;
        }
        let query = Query::parse(request.uri().query());
        let after = match query.get("after").map(|text| text.parse::<i64>()) {
            None => i64::MIN,
            Some(Ok(after)) => after,
            Some(Err(_)) => {
                let problem = "after must be a transcript entry's seq";
                return Some(boxed(error(StatusCode::BAD_REQUEST, "bad_after", problem)));
            }
        };
        let changes = EntryLines { after };
        let key = percent_decode(key);
        let streams = self.console.streams();
        let stream = streams.follow(
            &self.ops.store,
            &key,
            changes,
            "application/x-ndjson",
            "try again later",
        );
        Some(stream.await)
    }

    async fn status(&self) -> Result<HttpResponse, ControlError> {
        let document = self.ops.status_document().await?;
        Ok(json_response(StatusCode::OK, &json!(document)))
    }

    /// `POST /v1/routes/{route}/send[?delivery_id=ID][&event_type=T]`: `agentgate send` without
    /// `--url`. The daemon signs the body with the route's secret and posts it to its own webhook
    /// listener, so the command needs neither the secret (a systemd credential only the service
    /// reads) nor the address (under socket activation only the daemon knows what systemd
    /// passed). Answers with what the listener answered.
    async fn send(
        &self,
        route_name: &str,
        request: Request<RequestBody>,
    ) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(request.uri().query());
        let settings = self.ops.settings.get();
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
        let body = match self.ops.read_body(request.into_body(), limit).await {
            Ok(body) => body,
            Err(BodyError::TimedOut) => return Ok(request_timeout()),
            Err(BodyError::TooLarge | BodyError::Unreadable | BodyError::NoSlot) => {
                return Ok(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    &format!(
                        "the payload is over [server] max_body ({limit} bytes) or was cut off"
                    ),
                ));
            }
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

    /// `GET /v1/sessions[?limit=N][&after=KEY][&state=S][&route=R][&key=TEXT]`: a page of the
    /// sessions that match, in key order, and the cursor of the next page (`null` on the last
    /// one).
    async fn sessions(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(query);
        let limit = match query.limit() {
            Ok(limit) => limit,
            Err(refusal) => return Ok(*refusal),
        };
        let filter = match query.session_filter(limit + 1) {
            Ok(filter) => filter,
            Err(bad) => return Ok(bad.response()),
        };
        let sessions = self.ops.store.sessions_page(filter).await?;
        let (sessions, next) = page(sessions, limit, |session| session.key.clone());
        Ok(json_response(
            StatusCode::OK,
            &json!(SessionsPage { sessions, next }),
        ))
    }

    /// `GET /v1/sessions/{key}`: the session and its transcript, as `sessions show --json`.
    async fn session(&self, key: &str) -> Result<HttpResponse, ControlError> {
        Ok(match self.ops.session_document(key, Entries::All).await? {
            Some((document, _)) => json_response(StatusCode::OK, &json!(document)),
            None => no_session(key),
        })
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
        let days = self.ops.store.usage_by_day(since).await?;
        let limits = UsageLimits::of(&self.ops.settings.get().config);
        let route = query.get("route");
        let document = UsageDocument::of(days, since, route.as_deref(), &limits);
        Ok(json_response(StatusCode::OK, &json!(document)))
    }

    /// `GET /v1/events/{id}`: the event as `events show --json` shows it; `404` if unknown.
    async fn event(&self, id: &str) -> Result<HttpResponse, ControlError> {
        Ok(match self.ops.event_detail(id).await? {
            Some(detail) => json_response(StatusCode::OK, &json!(detail)),
            None => no_event(id),
        })
    }

    /// `GET /v1/events[?status=S][&route=R][&session=KEY][&delivery_id=ID][&since=T][&until=T]
    /// [&limit=N][&before=ID]`: a page of the events that match, newest first, and the cursor of
    /// the next page (`null` on the last one).
    async fn events(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(query);
        let limit = match query.limit() {
            Ok(limit) => limit,
            Err(refusal) => return Ok(*refusal),
        };
        let filter = match query.event_filter(limit + 1) {
            Ok(filter) => filter,
            Err(bad) => return Ok(bad.response()),
        };
        let events = self.ops.store.events(filter).await?;
        let (events, next) = page(events, limit, |event| event.id.clone());
        Ok(json_response(
            StatusCode::OK,
            &json!(EventsPage { events, next }),
        ))
    }

    /// `GET /v1/deliveries[?state=failed|pending][&limit=N]`: `deliveries list --json`, newest
    /// first.
    async fn deliveries(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(query);
        let limit = match query.limit() {
            Ok(limit) => limit,
            Err(refusal) => return Ok(*refusal),
        };
        let state = match query.get("state").as_deref() {
            None => None,
            Some("failed") => Some(DeliveryState::Failed),
            Some("pending") => Some(DeliveryState::Pending),
            Some(other) => {
                return Ok(error(
                    StatusCode::BAD_REQUEST,
                    "bad_state",
                    &format!("state {other:?} is not failed or pending"),
                ));
            }
        };
        let deliveries = self.ops.store.deliveries(state, limit).await?;
        Ok(json_response(StatusCode::OK, &json!(deliveries)))
    }

    /// `POST /v1/deliveries/retry?event=ID|failed|pending`: `deliveries retry`; answers how
    /// many were queued again, or `409` when event ID has no failed delivery.
    async fn retry_answer(
        &self,
        query: Option<&str>,
        peer: &str,
    ) -> Result<HttpResponse, ControlError> {
        let query = Query::parse(query);
        let target = match (
            query.get("event"),
            query.get("failed"),
            query.get("pending"),
        ) {
            (Some(id), None, None) => RetryTarget::One(id),
            (None, Some(_), None) => RetryTarget::AllFailed,
            (None, None, Some(_)) => RetryTarget::Pending { route: None },
            _ => {
                return Ok(error(
                    StatusCode::BAD_REQUEST,
                    "bad_target",
                    "name one of event=ID, failed or pending",
                ));
            }
        };
        let queued = self.ops.retry(target.clone(), peer).await?;
        Ok(match target {
            RetryTarget::One(id) if queued == 0 => error(
                StatusCode::CONFLICT,
                "not_failed",
                &format!("no failed delivery for event {id:?}"),
            ),
            RetryTarget::One(_) | RetryTarget::AllFailed | RetryTarget::Pending { .. } => {
                json_response(StatusCode::OK, &json!({ "queued": queued }))
            }
        })
    }

    /// `POST /v1/events/{id}/replay`: `events replay ID`; answers the copy's id.
    async fn replay_answer(&self, id: &str, peer: &str) -> Result<HttpResponse, ControlError> {
        Ok(match self.ops.replay(id, peer).await? {
            Some(copy) => json_response(StatusCode::OK, &json!({ "event_id": id, "copy": copy })),
            None => no_event(id),
        })
    }

    /// `POST /v1/sessions/{key}/rewind` `{"to": N}` and `POST /v1/sessions/{key}/fork` `{"at":
    /// N, "as": NEWKEY}`: `sessions rewind|fork`; answers the new turn.
    async fn rerun_answer(
        &self,
        key: &str,
        rerun: Rerun,
        request: Request<RequestBody>,
        peer: &str,
    ) -> Result<HttpResponse, ControlError> {
        let body = match self
            .ops
            .read_body(request.into_body(), MAX_RERUN_BODY)
            .await
        {
            Ok(body) => body,
            Err(BodyError::TimedOut) => return Ok(request_timeout()),
            Err(BodyError::TooLarge | BodyError::Unreadable | BodyError::NoSlot) => {
                return Ok(bad_rerun("the body is too long or was cut off"));
            }
        };
        let asked = serde_json::from_slice::<RerunRequest>(&body)
            .map_err(|err| err.to_string())
            .and_then(|asked| asked.of(key, rerun));
        match asked {
            Ok(request) => self.ops.rerun(request, peer).await,
            Err(message) => Ok(bad_rerun(&message)),
        }
    }

    /// `GET /v1/ledger`: the retry ledger as `ledger.json` holds it; `503` with the reason when it
    /// cannot be read.
    async fn ledger(&self) -> Result<HttpResponse, ControlError> {
        let ledger = self.ops.store.resume_ledger().await?;
        let text = ledger.to_json();
        let document: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
        Ok(json_response(StatusCode::OK, &document))
    }

    /// `GET /v1/tools[?route=R]`: what `agentgate tools list` shows, from the running servers.
    async fn tools(&self, query: Option<&str>) -> Result<HttpResponse, ControlError> {
        let route = Query::parse(query).get("route");
        let settings = self.ops.settings.get();
        Ok(
            match catalog::listing(
                &settings.config,
                &self.ops.mcp,
                route.as_deref(),
                TOOLS_WAIT,
            )
            .await
            {
                Ok((tools, problems)) => {
                    json_response(StatusCode::OK, &json!(ToolsDocument { tools, problems }))
                }
                Err(message) => error(StatusCode::NOT_FOUND, "no_route", &message),
            },
        )
    }

    async fn metrics(&self) -> Result<HttpResponse, ControlError> {
        let summary = self.ops.summary().await?;
        let text = metrics::render(&metrics::Snapshot {
            summary: &summary,
            turns_running: self.ops.sessions.running_count(),
            store_writable: self.ops.store.is_writable(),
            accepting: self.ops.accepting().ok,
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
}

/// The longest body of a rewind or fork: an entry number and a session key.
const MAX_RERUN_BODY: usize = 8 * 1024;

fn bad_rerun(message: &str) -> HttpResponse {
    error(StatusCode::BAD_REQUEST, "bad_rerun", message)
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
