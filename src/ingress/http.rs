//! The webhook request path: route, limit, verify, parse, dedup, persist, and only then answer.
//!
//! Each step that can refuse a request does so before any later step runs, so nothing
//! unauthenticated, oversized or malformed reaches the disk, and the 202 is written only after the
//! store reports the commit that holds the event.

#![expect(
    clippy::result_large_err,
    reason = "a refusal here is the HTTP response itself, built once per refused request; \
              boxing it would only add an allocation to every refusal"
)]

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{ALLOW, CONTENT_LENGTH, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use serde_json::json;

use super::acknowledge::{AcceptedEvent, Acknowledged, Reader};
use super::body::{BodyError, BodySlots, body_timeout};
use super::capacity::{self, Capacity};
use super::payload::{decode_content, parse_payload};
use super::ratelimit::TokenBucket;
use super::response::{
    HttpResponse, RefusalReason, error, json_response, refused, request_timeout, unavailable_for,
};
use crate::clock;
use crate::config::{RouteSettings, Settings, Shared};
use crate::logging::{self, LineBudget};
use crate::metrics;
use crate::sender;
use crate::session::Sessions;
use crate::signature;
use crate::store::{AcceptOutcome, DedupWindow, Event, NewEvent, Store};
use crate::telemetry;
use crate::template::EventContext;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;

struct Route {
    settings: RouteSettings,
    limiter: Option<TokenBucket>,
}

/// The routes of one config, by path, with that config's templates.
struct Routing {
    settings: Arc<Settings>,
    routes: HashMap<String, Route>,
}

impl Routing {
    fn new(settings: Arc<Settings>) -> Routing {
        let routes = settings
            .config
            .routes
            .iter()
            .map(|route| {
                let runtime = Route {
                    limiter: route.rate_limit.map(TokenBucket::new),
                    settings: route.clone(),
                };
                (route.path.clone(), runtime)
            })
            .collect();
        Routing { settings, routes }
    }
}

/// Everything the listener needs to answer webhooks: routes by path, templates and the store.
pub(crate) struct Ingress {
    /// Refusal lines, at most `REFUSAL_LINES_PER_SECOND`: a flood of bad requests is counted in
    /// full (`agentgate_http_requests_total`) but cannot flood the journal; the next admitted
    /// line says how many were left out before it.
    refusal_log: LineBudget,
    body_slots: BodySlots,
    routing: Shared<Routing>,
    store: Store,
    sessions: Arc<Sessions>,
    capacity: Arc<Capacity>,
    /// `[server] tls`: new connections take the acceptor of the config in effect, so a reload
    /// serves a renewed certificate.
    pub(super) tls: Arc<Shared<Option<tokio_rustls::TlsAcceptor>>>,
    /// How long a body may take once its headers arrived: `header_timeout` as the listener
    /// started with it, which sets the headers' own timer too.
    body_timeout: std::time::Duration,
}

/// The TLS acceptor of `settings`, if it sets `[server] tls`.
fn acceptor_for(settings: &Settings) -> Result<Option<tokio_rustls::TlsAcceptor>, String> {
    settings
        .config
        .server
        .tls
        .as_ref()
        .map(|tls| {
            crate::tls::server_config(tls)
                .map(tokio_rustls::TlsAcceptor::from)
                .map_err(|problem| format!("server.tls: {problem}"))
        })
        .transpose()
}

impl Ingress {
    pub(crate) fn new(
        settings: Arc<Settings>,
        store: Store,
        sessions: Arc<Sessions>,
        capacity: Arc<Capacity>,
    ) -> Result<Ingress, String> {
        Ok(Ingress {
            body_timeout: body_timeout(&settings.config.server),
            refusal_log: LineBudget::new(REFUSAL_LINES_PER_SECOND),
            body_slots: BodySlots::new(),
            tls: Arc::new(Shared::new(acceptor_for(&settings)?)),
            routing: Shared::new(Routing::new(settings)),
            store,
            sessions,
            capacity,
        })
    }

    /// Switches to a reloaded config; requests in flight finish on the one they started with.
    pub(crate) fn reload(&self, settings: Arc<Settings>) {
        // The reload's checks built the same TLS configuration; should it fail now, the
        // certificate in use stays rather than the socket losing TLS.
        match acceptor_for(&settings) {
            Ok(acceptor) => self.tls.replace(acceptor),
            Err(problem) => {
                tracing::error!(problem = %problem, "the new TLS configuration cannot be used; keeping the old one");
            }
        }
        self.routing.replace(Routing::new(settings));
    }

    /// How many connections `peer` may hold at once (`max_connections_per_peer`), as the
    /// settings in effect say; `None` for a trusted proxy, which carries everyone's connections.
    pub(crate) fn peer_limit(&self, peer: std::net::IpAddr) -> Option<usize> {
        let routing = self.routing.get();
        let server = &routing.settings.config.server;
        (!is_trusted(&server.trusted_proxies, peer)).then_some(server.max_connections_per_peer)
    }

    /// A connection closed at once: `peer`'s address already holds `limit` connections, none
    /// of them idle. Counted, and logged within the refusal lines' budget.
    pub(crate) fn peer_refused(&self, peer: SocketAddr, limit: usize) {
        metrics::peer_connection_refused();
        if let Some(suppressed) = self.refusal_log.admit() {
            tracing::warn!(peer = %peer.ip(), max_connections_per_peer = limit,
                suppressed_before = suppressed,
                "webhook connection refused: its address holds server.max_connections_per_peer connections");
        }
    }

    /// A request refused before any route saw it: counted and logged as the listener's other
    /// refusals.
    pub(crate) fn refused_unrouted(&self, peer: SocketAddr, refusal: Unrouted) {
        let (code, reason) = (refusal.code(), refusal.reason());
        match refusal {
            Unrouted::Malformed | Unrouted::TooLarge => metrics::http_request("", code),
            // Nothing was answered: the connection was closed.
            Unrouted::HeadTimeout => {}
        }
        metrics::refusal("", code, reason);
        if let Some(suppressed) = self.refusal_log.admit() {
            tracing::warn!(peer = %peer.ip(), status = code, reason = reason,
                suppressed_before = suppressed,
                "webhook refused ({code}): the request's head {}", refusal.what());
        }
    }

    /// A connection whose TLS handshake failed or never came: counted, and logged within the
    /// refusal log's rate.
    pub(crate) fn tls_refused(&self, peer: SocketAddr, reason: &str) {
        metrics::tls_handshake_failed();
        if let Some(suppressed) = self.refusal_log.admit() {
            tracing::warn!(peer = %peer, reason = %reason, suppressed, "TLS handshake refused");
        }
    }

    /// Answers one request from `peer`. Never fails: every problem is an HTTP status with a JSON
    /// body. Every answer is counted by route and code, and every refusal is logged with the
    /// route, the peer and the reason.
    pub(crate) async fn handle<B>(
        self: Arc<Self>,
        request: Request<B>,
        peer: SocketAddr,
    ) -> Result<HttpResponse, Infallible>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let arrived = Instant::now();
        // One config for the whole request, even if a reload lands meanwhile.
        let routing = self.routing.get();
        let trusted = &routing.settings.config.server.trusted_proxies;
        // Kept for a refusal line, and only from a trusted proxy: the common request pays nothing.
        let forwarded: Vec<HeaderValue> = if is_trusted(trusted, peer.ip()) {
            request
                .headers()
                .get_all(X_FORWARDED_FOR)
                .iter()
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let route = routing
            .routes
            .get(request.uri().path())
            .map(|route| route.settings.name.clone())
            .unwrap_or_default();
        let path = request.uri().path().to_string();
        let span = request_span(&request, &route);
        let response = match self.answer(request, &routing, span.traceparent()).await {
            Ok(response) | Err(response) => response,
        };
        let status = response.status();
        span.set("http.response.status_code", i64::from(status.as_u16()));
        if status.is_server_error() {
            span.fail(status.as_str(), "the webhook was not accepted");
        }
        metrics::http_request(&route, status.as_u16());
        if response.extensions().get::<AcceptedEvent>().is_some() {
            metrics::accepted(arrived.elapsed());
        }
        let refusal = response.extensions().get::<RefusalReason>();
        if let Some(reason) = refusal {
            metrics::refusal(&route, status.as_u16(), reason.reason);
        }
        if (status.is_client_error() || status.is_server_error())
            && let Some(suppressed) = self.refusal_log.admit()
        {
            let message = refusal.map_or("", |reason| reason.message.as_str());
            let peer = client_address(peer, &forwarded, trusted);
            // The reason in the message too: `journalctl -o cat` shows only the message.
            tracing::warn!(route = %route, peer = %peer, path = %path, status = status.as_u16(),
                reason = %message, suppressed_before = suppressed,
                "webhook refused ({}): {message}", status.as_u16());
        }
        Ok(response)
    }

    /// `trace_parent`: the request span's, stored with the event it becomes.
    async fn answer<B>(
        &self,
        request: Request<B>,
        routing: &Routing,
        trace_parent: Option<String>,
    ) -> Result<HttpResponse, HttpResponse>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        if let Some(health) = self.health(&request, routing) {
            return Ok(health);
        }
        let config = &routing.settings.config;
        if config.server.public_url.is_some() && request.uri().path().starts_with("/approvals/") {
            return super::approval_link::answer(request, &self.store, config, &self.sessions)
                .await;
        }
        let route = route_for(&request, routing)?;
        let settings = &route.settings;
        let (headers, body) = self.read_verified(request, settings).await?;
        let (payload, payload_bytes, encoding) =
            parse_payload(&headers, body, settings.verify.scheme)?;
        let reader = Reader::of(settings.verify.scheme, encoding);
        if let Some(answer) = (sender::profile(settings.verify.scheme).handshake)(&payload) {
            // A sender's setup request (Slack's `url_verification`): nothing is stored or run.
            return Ok(json_response(StatusCode::OK, &answer));
        }
        let visible = visible_headers(&headers, settings);
        let event_id = uuid::Uuid::now_v7().to_string();
        let described = Described::new(routing, settings, &headers, &visible, &payload, &event_id);
        let event_type = described.event_type();
        if let Some(events) = &settings.events
            && !events.iter().any(|e| e == &event_type)
        {
            return Ok(reader.answer(Acknowledged::Ignored { event_type }));
        }
        if let Some(limiter) = &route.limiter
            && let Err(wait) = limiter.take(Instant::now())
        {
            return Err(rate_limited(settings, wait));
        }
        let (delivery_id, session_key) = described.identity(&event_type);
        let event = Event {
            id: event_id.clone(),
            route: settings.name.clone(),
            session_key,
            event_type,
            delivery_id,
            headers: serde_json::to_string(&visible).unwrap_or_else(|_| "{}".to_string()),
            payload: payload_bytes.to_vec(),
            trace_parent,
        };
        let acknowledged = self.accept(routing, settings, event).await?;
        Ok(reader.answer(acknowledged))
    }

    /// `/healthz` and `/readyz`, which every path answers before routing.
    fn health<B>(&self, request: &Request<B>, routing: &Routing) -> Option<HttpResponse> {
        let probe = matches!(request.method(), &Method::GET | &Method::HEAD);
        match request.uri().path() {
            "/healthz" if probe => Some(json_response(StatusCode::OK, &json!({"status": "ok"}))),
            "/readyz" if probe => {
                let runtime = &routing.settings.config.runtime;
                Some(if !self.store.is_writable() {
                    unavailable("state cannot be written durably")
                } else if let Some(reason) = self.capacity.refusal(runtime) {
                    unavailable_for(&reason, capacity::RETRY_AFTER_SECONDS)
                } else {
                    json_response(StatusCode::OK, &json!({"status": "ready"}))
                })
            }
            _ => None,
        }
    }

    /// The body of a request to `settings`' route, as the sender signed it, verified: the
    /// declared length and the headers are checked before a byte of the body is read, the
    /// body's size is bounded while it arrives, and its signature is checked before it is
    /// parsed. Returns the request headers and the body with its content encoding removed.
    async fn read_verified<B>(
        &self,
        request: Request<B>,
        settings: &RouteSettings,
    ) -> Result<(HeaderMap, Bytes), HttpResponse>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let declared_length = request
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared_length.is_some_and(|length| length > settings.max_body) {
            return Err(too_large(settings));
        }
        // Refused from the headers when they already decide it: the body is never read.
        signature::precheck(&settings.verify, request.headers(), clock::now_seconds())
            .map_err(|err| unauthorized(&err))?;
        let (parts, body) = request.into_parts();
        let limit = usize::try_from(settings.max_body).unwrap_or(usize::MAX);
        let received = self
            .body_slots
            .read(body, limit, declared_length, self.body_timeout)
            .await
            .map_err(|err| body_refused(err, settings))?;
        let body = decode_content(&parts.headers, &received, settings.max_body)?;
        let now = clock::now_seconds();
        // A sender may sign the payload before or after compressing it: either is authentic.
        signature::verify(&settings.verify, &parts.headers, &body, now)
            .or_else(|err| {
                if body == received {
                    Err(err)
                } else {
                    signature::verify(&settings.verify, &parts.headers, &received, now)
                }
            })
            .map_err(|err| unauthorized(&err))?;
        Ok((parts.headers, body))
    }

    /// Makes `event` durable and says so (accepted, or a duplicate), or refuses with 503 when
    /// new events are refused (backpressure, low disk) or the store cannot commit.
    async fn accept(
        &self,
        routing: &Routing,
        settings: &RouteSettings,
        event: Event,
    ) -> Result<Acknowledged, HttpResponse> {
        let config = &routing.settings.config;
        let dedup_window = DedupWindow(config.runtime.dedup_window);
        if let Some(reason) = self
            .capacity
            .refusal(&config.runtime)
            .or_else(|| self.capacity.route_refusal(settings, config))
        {
            return self
                .refuse_new(
                    settings,
                    event.delivery_id.as_deref(),
                    dedup_window,
                    &reason,
                )
                .await;
        }
        let (event_id, session_key) = (event.id.clone(), event.session_key.clone());
        let delivery_id = event.delivery_id.clone().unwrap_or_default();
        match self
            .store
            .accept(NewEvent {
                event,
                dedup_window,
            })
            .await
        {
            Ok(AcceptOutcome::Accepted) => {
                self.capacity.accepted(&settings.name);
                self.sessions
                    .event_accepted(&self.store, &session_key, settings.on_busy);
                logging::event_line!(
                    message_id = crate::logging::MESSAGE_ACCEPTED,
                    event_id = %event_id,
                    session_key = %session_key,
                    route = %settings.name,
                    delivery_id = %delivery_id,
                    "event accepted"
                );
                Ok(Acknowledged::Accepted {
                    event_id,
                    session: session_key,
                })
            }
            Ok(AcceptOutcome::Duplicate { original }) => Ok(Acknowledged::Duplicate { original }),
            Err(err) => {
                tracing::error!(route = %settings.name, error = %err, "event refused: not durable");
                Err(unavailable("state cannot be written durably"))
            }
        }
    }
}

/// The `SERVER` span of a request to a webhook route (none for other paths), under the sender's
/// `traceparent` when it sent one.
fn request_span<B>(request: &Request<B>, route: &str) -> telemetry::Span {
    if route.is_empty() {
        return telemetry::Span::off();
    }
    let parent = request
        .headers()
        .get(telemetry::TRACEPARENT)
        .and_then(|value| value.to_str().ok());
    let (method, path) = (request.method().as_str(), request.uri().path());
    telemetry::span_under(parent, || telemetry::SpanStart {
        name: format!("{method} {path}"),
        kind: SpanKind::Server,
        attributes: vec![
            KeyValue::new("http.request.method", method.to_string()),
            KeyValue::new("http.route", path.to_string()),
            KeyValue::new("url.path", path.to_string()),
            KeyValue::new("agentgate.route", route.to_string()),
        ],
    })
}

/// The route at the request's path, which takes POST only.
fn route_for<'r, B>(request: &Request<B>, routing: &'r Routing) -> Result<&'r Route, HttpResponse> {
    let path = request.uri().path();
    let route = routing.routes.get(path).ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("no route at {path}"),
        )
    })?;
    if request.method() != Method::POST {
        let mut response = error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            &format!("{path} accepts POST only"),
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("POST"));
        return Err(response);
    }
    Ok(route)
}

fn too_large(settings: &RouteSettings) -> HttpResponse {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        &format!(
            "body is larger than route {}'s limit of {} bytes",
            settings.name, settings.max_body
        ),
    )
}

fn body_refused(err: BodyError, settings: &RouteSettings) -> HttpResponse {
    match err {
        BodyError::TooLarge => too_large(settings),
        BodyError::Unreadable => error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the body could not be read",
        ),
        BodyError::NoSlot => unavailable("too many large bodies are being received; retry shortly"),
        BodyError::TimedOut => request_timeout(),
    }
}

fn rate_limited(settings: &RouteSettings, wait: std::time::Duration) -> HttpResponse {
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        &format!("route {} is over its rate_limit", settings.name),
    );
    let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
    if let Ok(value) = http::HeaderValue::from_str(&seconds.to_string()) {
        response.headers_mut().insert(RETRY_AFTER, value);
    }
    response
}

/// What the route's templates (or its scheme's defaults) make of a verified event.
///
/// docs/reference.md, "Templates": a template that cannot be evaluated for this payload (an
/// undefined field, a type error) falls back (`event_type` and `delivery_id` to the scheme's,
/// `session` to the event's own session `<route>:<event_id>`), with a warning and a count: an
/// authentic sender is never refused for the shape of its payload, since senders disable hooks
/// and drop notifications after 4xx answers.
struct Described<'a> {
    templates: &'a crate::template::RouteTemplates,
    settings: &'a RouteSettings,
    headers: &'a HeaderMap,
    context: EventContext<'a>,
}

impl<'a> Described<'a> {
    fn new(
        routing: &'a Routing,
        settings: &'a RouteSettings,
        headers: &'a HeaderMap,
        visible: &'a BTreeMap<String, String>,
        payload: &'a serde_json::Value,
        event_id: &'a str,
    ) -> Described<'a> {
        Described {
            templates: &routing.settings.templates,
            settings,
            headers,
            context: EventContext {
                payload,
                headers: visible,
                event_type: "",
                route: &settings.name,
                event_id,
                delivery_id: None,
            },
        }
    }

    fn fallback(&self, template: &'static str, problem: &str) {
        metrics::template_fallback(&self.settings.name, template);
        tracing::warn!(route = %self.settings.name, event_id = %self.context.event_id, template,
            problem = %problem, "template cannot be evaluated for this payload; using its default");
    }

    fn event_type(&self) -> String {
        self.templates
            .optional_text("event_type", &self.context)
            .unwrap_or_else(|problem| {
                self.fallback("event_type", &problem);
                None
            })
            .unwrap_or_else(|| event_type(self.settings, self.headers, self.context.payload))
    }

    /// The event's dedup key and session key, once its type is known.
    fn identity(&self, event_type: &str) -> (Option<String>, String) {
        let typed = EventContext {
            event_type,
            ..self.context
        };
        let delivery_id = self
            .templates
            .optional_text("delivery_id", &typed)
            .unwrap_or_else(|problem| {
                self.fallback("delivery_id", &problem);
                None
            })
            .map(sender::dedup_key)
            .or_else(|| {
                sender::delivery_id(self.settings.verify.scheme, self.headers, typed.payload)
            });
        let context = EventContext {
            delivery_id: delivery_id.as_deref(),
            ..typed
        };
        let session_key = self
            .templates
            .session_key(&context)
            .unwrap_or_else(|problem| {
                self.fallback("session", &problem);
                format!("{}:{}", self.settings.name, context.event_id)
            });
        (delivery_id, session_key)
    }
}

impl Ingress {
    /// Backpressure: a new event is refused with 503, but a redelivery of one already accepted
    /// still gets its 200 duplicate answer.
    async fn refuse_new(
        &self,
        settings: &RouteSettings,
        delivery_id: Option<&str>,
        dedup_window: DedupWindow,
        reason: &str,
    ) -> Result<Acknowledged, HttpResponse> {
        if let Some(delivery_id) = delivery_id
            && let Ok(Some(original)) = self
                .store
                .original_of(&settings.name, delivery_id, dedup_window)
                .await
        {
            return Ok(Acknowledged::Duplicate { original });
        }
        Err(unavailable_for(reason, capacity::RETRY_AFTER_SECONDS))
    }
}

/// The scheme's event header, else the type its payload names, else "".
fn event_type(
    settings: &RouteSettings,
    headers: &HeaderMap,
    payload: &serde_json::Value,
) -> String {
    signature::event_type_header(settings.verify.scheme)
        .and_then(|name| headers.get(name))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| sender::payload_event_type(settings.verify.scheme, payload))
        .unwrap_or_default()
}

/// Request headers as templates and transcripts may see them: lower-case, credentials removed.
fn visible_headers(headers: &HeaderMap, route: &RouteSettings) -> BTreeMap<String, String> {
    headers
        .iter()
        .filter(|(name, _)| {
            !sender::is_hidden_header(name.as_str(), &route.verify, &route.hidden_headers)
        })
        .map(|(name, value)| {
            (
                name.as_str().to_string(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect()
}

const REFUSAL_LINES_PER_SECOND: u32 = 10;

const X_FORWARDED_FOR: &str = "x-forwarded-for";

pub(super) fn is_trusted(trusted: &[ipnet::IpNet], ip: std::net::IpAddr) -> bool {
    trusted.iter().any(|network| network.contains(&ip))
}

/// The client a request comes from, for its refusal line: `peer`, unless `peer` is a trusted
/// reverse proxy, in which case the nearest address in its `X-Forwarded-For` values
/// (`forwarded`) that is not a trusted proxy (each proxy appends the address it got the request
/// from, so the addresses to the right are the trusted ones). Without trusted proxies the header
/// is ignored: anyone can send it.
fn client_address(peer: SocketAddr, forwarded: &[HeaderValue], trusted: &[ipnet::IpNet]) -> String {
    if !is_trusted(trusted, peer.ip()) {
        return peer.to_string();
    }
    let hops: Vec<std::net::IpAddr> = forwarded
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|hop| hop.trim().parse().ok())
        .collect();
    hops.iter()
        .rev()
        .find(|ip| !is_trusted(trusted, **ip))
        .or(hops.first())
        .map_or_else(|| peer.to_string(), |ip| format!("{ip} (via {peer})"))
}

/// 401, counted with the check that failed as its reason.
fn unauthorized(err: &signature::VerifyError) -> HttpResponse {
    refused(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        err.reason(),
        &err.to_string(),
    )
}

fn unavailable(message: &str) -> HttpResponse {
    unavailable_for(message, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forwarded(value: &str) -> Vec<HeaderValue> {
        vec![HeaderValue::from_str(value).expect("value")]
    }

    #[test]
    fn x_forwarded_for_counts_only_from_a_trusted_proxy() {
        let proxy: SocketAddr = "10.0.0.5:40000".parse().expect("addr");
        let trusted: Vec<ipnet::IpNet> = vec!["10.0.0.0/8".parse().expect("net")];
        let spoofed = forwarded("1.2.3.4, 203.0.113.9, 10.0.0.7");
        // From the trusted proxy: the nearest untrusted hop, not what the client claimed.
        assert_eq!(
            client_address(proxy, &spoofed, &trusted),
            "203.0.113.9 (via 10.0.0.5:40000)"
        );
        // From anyone else, or with no trusted proxies: the header is ignored.
        let direct: SocketAddr = "198.51.100.1:5000".parse().expect("addr");
        assert_eq!(
            client_address(direct, &spoofed, &trusted),
            "198.51.100.1:5000"
        );
        assert_eq!(client_address(proxy, &spoofed, &[]), "10.0.0.5:40000");
        assert_eq!(client_address(proxy, &[], &trusted), "10.0.0.5:40000");
    }
}

/// Why a request was refused before any route saw it: by the HTTP layer (hyper answers a head
/// it cannot parse with `400`, one too large with `431`), or because its head did not come
/// within `header_timeout` (the connection is closed, answering nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unrouted {
    Malformed,
    TooLarge,
    HeadTimeout,
}

impl Unrouted {
    /// The refusal hyper's connection error stands for; `None` for a client gone or idle.
    pub(crate) fn of(error: &hyper::Error) -> Option<Unrouted> {
        if error.is_parse_too_large() {
            Some(Unrouted::TooLarge)
        } else if error.is_parse() {
            Some(Unrouted::Malformed)
        } else {
            None
        }
    }

    fn code(self) -> u16 {
        match self {
            Unrouted::Malformed => 400,
            Unrouted::TooLarge => 431,
            Unrouted::HeadTimeout => 408,
        }
    }

    /// The `reason` label of `agentgate_refusals_total`.
    fn reason(self) -> &'static str {
        match self {
            Unrouted::Malformed => "malformed_request",
            Unrouted::TooLarge => "head_too_large",
            Unrouted::HeadTimeout => "header_timeout",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Unrouted::Malformed => "cannot be parsed (answered by the HTTP layer)",
            Unrouted::TooLarge => "is too large (answered by the HTTP layer)",
            Unrouted::HeadTimeout => {
                "did not come within server.header_timeout; the connection was closed"
            }
        }
    }
}
