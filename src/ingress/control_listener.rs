//! The listeners the control endpoints are served on: the control socket (everything, to whom
//! its file permissions allow), `[server] metrics_listen` (`GET /metrics` alone) and `[console]
//! listen` (the console alone, to a browser logged in with its token). Each is a `listener`, with
//! its bound on connections and its idle ones closed, so that a crowd of unauthenticated
//! connections cannot keep an operator waiting. Bodies are read as on the webhook listener:
//! within four times `header_timeout`, else `408` (see `body`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

use super::connection::{Answering, Clocked, RequestBody, Watched};
use super::console::{ConsoleBody, Door, boxed, see_other};
use super::control::{Control, not_found};
use super::listener::{self, Accepted, Listener, Serve, Socket, Tls, handshake};
use super::response::{Counted, RefusalReason};
use crate::config::ServerSettings;
use crate::logging::LineBudget;
use crate::metrics;

/// What a listener serves.
#[derive(Debug, Clone, Copy)]
enum Serves {
    Everything,
    Metrics,
    Console,
}

impl Serves {
    /// The `listener` label of its refusals.
    fn label(self) -> &'static str {
        match self {
            Serves::Everything => "control",
            Serves::Metrics => "metrics",
            Serves::Console => "console",
        }
    }
}

/// The budget of lines refusals on the control listeners may log: 5 a second, the rest only
/// counted (a scan of the metrics listener must not flood the journal).
pub(crate) fn refusal_log() -> LineBudget {
    LineBudget::new(5)
}

impl Control {
    /// Answers one request on a listener that serves `serves`; a refusal (4xx, 5xx) is counted
    /// and logged, unless the console's guard did both already.
    async fn serve(
        &self,
        request: Request<RequestBody>,
        peer: &str,
        serves: Serves,
    ) -> http::Response<ConsoleBody> {
        let (method, mut path) = (request.method().clone(), request.uri().path().to_string());
        let response = self.serve_unlogged(request, peer, serves).await;
        let status = response.status();
        if !(status.is_client_error() || status.is_server_error())
            || response.extensions().get::<Counted>().is_some()
        {
            return response;
        }
        let refusal = response.extensions().get::<RefusalReason>();
        let reason = refusal.map_or_else(
            || status.canonical_reason().unwrap_or("other"),
            |refusal| refusal.reason,
        );
        metrics::control_refusal(serves.label(), status.as_u16(), reason);
        if let Some(suppressed) = self.refusal_log.admit() {
            let message = refusal.map_or("", |refusal| refusal.message.as_str());
            crate::untrusted::cut(&mut path, 200);
            tracing::warn!(listener = serves.label(), peer = %peer, method = %method,
                path = %path, status = status.as_u16(), reason = reason,
                suppressed_before = suppressed,
                "{} request refused ({}): {message}", serves.label(), status.as_u16());
        }
        response
    }

    async fn serve_unlogged(
        &self,
        request: Request<RequestBody>,
        peer: &str,
        serves: Serves,
    ) -> http::Response<ConsoleBody> {
        let path = request.uri().path();
        let console = path == "/console" || path.starts_with("/console/");
        let metrics = request.method() == Method::GET && path == "/metrics";
        match serves {
            Serves::Everything if console => {
                self.console.request(request, Door::Socket, None).await
            }
            Serves::Console if console => {
                let address = peer.parse().ok();
                self.console.request(request, Door::Listen, address).await
            }
            Serves::Console if path == "/" => boxed(see_other("/console/")),
            Serves::Everything => match self.follow(&request).await {
                Some(stream) => stream,
                None => boxed(self.answer(request, peer).await),
            },
            Serves::Metrics if metrics => boxed(self.answer(request, peer).await),
            Serves::Metrics | Serves::Console => {
                boxed(not_found(request.method(), request.uri().path()))
            }
        }
    }
}

/// Connections served at once on each listener (the control socket, metrics, the console); past
/// it the one idle the longest is closed for a new one, else new ones wait in the backlog.
/// Operators' commands and a scraper need a handful: the bound keeps a flood from taking the
/// descriptors that turns, tools and the store need.
const MAX_CONTROL_CONNECTIONS: usize = 64;

/// A listener the control endpoints are served on.
enum ControlListener {
    /// The control socket: every endpoint, governed by the socket file's permissions.
    Socket(Listener<tokio::net::UnixListener>),
    /// `[server] metrics_listen`: `GET /metrics` alone, since Prometheus cannot scrape a Unix
    /// socket and the operator endpoints must stay behind the socket's permissions.
    Metrics(Listener<tokio::net::TcpListener>),
    /// `[console] listen`: the console alone, to a browser logged in with the console token;
    /// HTTPS with `[console] tls`.
    Console(Listener<tokio::net::TcpListener>),
}

/// A control, metrics or console listener task.
pub(crate) struct ControlServer {
    listener: ControlListener,
    control: Arc<Control>,
    /// A request head must come within this, and an idle connection is closed after it.
    header_timeout: Duration,
}

/// The sockets the control endpoints may be served on, as passed or bound at start.
pub(crate) struct ControlSockets {
    pub control: Option<std::os::unix::net::UnixListener>,
    /// Passed by systemd (or a test); else `server.metrics_listen` is bound.
    pub metrics: Option<std::net::TcpListener>,
    /// Passed by systemd (or a test); else `console.listen` is bound.
    pub console: Option<std::net::TcpListener>,
}

impl ControlServer {
    /// The control socket (when systemd passed it or it could be bound), the metrics listener
    /// (passed, or `server.metrics_listen` when set and it can be bound) and the console's
    /// (likewise, with `console.listen`). None is a reason to stop serving webhooks: what
    /// cannot be served is logged and left out.
    pub(crate) async fn bind_all(
        sockets: ControlSockets,
        server: &ServerSettings,
        control: &Arc<Control>,
    ) -> Vec<ControlServer> {
        let mut listeners = Vec::new();
        if let Some(socket) = metrics_socket(sockets.metrics, server).await {
            listeners.push(ControlListener::Metrics(Listener {
                socket,
                name: "metrics",
                max_connections: MAX_CONTROL_CONNECTIONS,
                tls: Tls::Plain,
            }));
        }
        if let Some(listener) = console_listener(sockets.console, control).await {
            listeners.push(ControlListener::Console(listener));
        }
        if let Some(socket) = sockets.control {
            match listener::unix(socket) {
                Ok(socket) => listeners.push(ControlListener::Socket(Listener {
                    socket,
                    name: "control",
                    max_connections: MAX_CONTROL_CONNECTIONS,
                    tls: Tls::Plain,
                })),
                Err(err) => tracing::error!(error = %err,
                    "cannot serve the control socket; the daemon serves webhooks without it"),
            }
        }
        listeners
            .into_iter()
            .map(|listener| ControlServer {
                listener,
                control: control.clone(),
                header_timeout: server.header_timeout,
            })
            .collect()
    }

    /// Serves the control endpoints on the listener until `shutdown`.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        // hyper's header timer also runs while a connection waits for its next request, so it
        // closes idle connections too.
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(self.header_timeout);
        let endpoints = |serves| Endpoints {
            control: self.control.clone(),
            serves,
            http: http.clone(),
            header_timeout: self.header_timeout,
        };
        match self.listener {
            ControlListener::Socket(listener) => {
                listener.run(&endpoints(Serves::Everything), shutdown).await;
            }
            ControlListener::Metrics(listener) => {
                listener.run(&endpoints(Serves::Metrics), shutdown).await;
            }
            ControlListener::Console(listener) => {
                listener.run(&endpoints(Serves::Console), shutdown).await;
            }
        }
    }
}

/// What a control, metrics or console listener serves its connections with.
struct Endpoints {
    control: Arc<Control>,
    serves: Serves,
    http: http1::Builder,
    header_timeout: Duration,
}

impl<S: Socket> Serve<S> for &Endpoints
where
    S::Peer: Peer,
{
    fn connection(
        &self,
        accepted: Accepted<S::Stream>,
        peer: S::Peer,
    ) -> impl Future<Output = ()> + Send + 'static {
        let Accepted {
            stream,
            tls,
            clock,
            registration,
        } = accepted;
        let (control, serves, http) = (self.control.clone(), self.serves, self.http.clone());
        let header_timeout = self.header_timeout;
        let peer: Arc<str> = peer.named().into();
        async move {
            let Ok(opened) = handshake(stream, tls, header_timeout).await else {
                control.console.handshake_failed();
                return;
            };
            let stream = opened.into_stream();
            let answering = clock.clone();
            let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                let (control, peer, clock) = (control.clone(), peer.clone(), answering.clone());
                clock.answering();
                let request = request.map(|body| Watched::new(body, clock.clone()));
                async move {
                    let answer = control.serve(request, &peer, serves).await;
                    Ok::<_, Infallible>(answer.map(|body| Answering::new(body, clock)))
                }
            });
            let io = TokioIo::new(Clocked::new(stream, clock));
            // Closed to make room only while idle, or in a head or bodies that stop.
            tokio::select! {
                _ = http.serve_connection(io, service) => {}
                () = registration.close.cancelled() => {}
            }
        }
    }
}

/// A peer as the control endpoints name it in their audit lines.
trait Peer {
    fn named(&self) -> String;
}

impl Peer for std::net::SocketAddr {
    /// The address alone: the port says nothing to whoever reads it.
    fn named(&self) -> String {
        self.ip().to_string()
    }
}

impl Peer for String {
    /// The Unix user.
    fn named(&self) -> String {
        self.clone()
    }
}

/// The metrics listener's socket: the one passed, else `server.metrics_listen` bound; `None`
/// (logged) when neither is there.
async fn metrics_socket(
    passed: Option<std::net::TcpListener>,
    server: &ServerSettings,
) -> Option<tokio::net::TcpListener> {
    if let Some(socket) = passed {
        return listener::tcp(socket)
            .inspect_err(|err| {
                tracing::error!(error = %err,
                "cannot serve the metrics socket passed; metrics are on the control socket only");
            })
            .ok();
    }
    let addr = server.metrics_listen?;
    tokio::net::TcpListener::bind(addr)
        .await
        .inspect_err(|err| {
            tracing::error!(error = %err,
            "cannot listen on {addr} (server.metrics_listen); metrics are on the control socket only");
        })
        .ok()
}

/// The console's listener: the socket passed, else `[console] listen` bound, with its TLS when
/// `[console] tls` is set; `None` (logged) when there is neither, without a token, or when it
/// cannot be served. A console that should speak TLS and cannot is not served in plain HTTP
/// instead.
async fn console_listener(
    passed: Option<std::net::TcpListener>,
    control: &Control,
) -> Option<Listener<tokio::net::TcpListener>> {
    let settings = control.ops.settings.get();
    let console = &settings.config.console;
    if console.token.is_none() {
        if passed.is_some() {
            tracing::error!(
                "a console socket was passed but console.token is not set; the console is on the control socket only"
            );
        }
        return None;
    }
    let tls = match console.tls.as_ref().map(crate::tls::http1_server_config) {
        None => Tls::Plain,
        Some(Ok(config)) => Tls::Fixed(tokio_rustls::TlsAcceptor::from(config)),
        Some(Err(problem)) => {
            tracing::error!("console.tls: {problem}; the console is on the control socket only");
            return None;
        }
    };
    let socket = match (passed, console.listen) {
        (Some(socket), _) => {
            listener::tcp(socket).map_err(|err| (err, "the console socket passed".to_string()))
        }
        (None, Some(addr)) => tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|err| (err, format!("{addr} (console.listen)"))),
        (None, None) => return None,
    };
    match socket {
        Ok(socket) => Some(Listener {
            socket,
            name: "console",
            max_connections: MAX_CONTROL_CONNECTIONS,
            tls,
        }),
        Err((err, what)) => {
            tracing::error!(error = %err,
                "cannot listen on {what}; the console is on the control socket only");
            None
        }
    }
}
