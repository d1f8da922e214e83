//! The listeners the control endpoints are served on: the control socket (everything, to whom
//! its file permissions allow), `[server] metrics_listen` (`GET /metrics` alone) and `[console]
//! listen` (the console alone, to a browser logged in with its token). Each bounds its
//! connections and closes idle ones; at its bound, the connection idle or stalled (in its head or
//! its body) the longest is closed for a new one, as on the webhook listener, so that a crowd of
//! unauthenticated connections cannot keep an operator waiting. Bodies are read as there too:
//! within four times `header_timeout`, else `408` (see `body`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

use super::connection::{
    Answering, Clocked, ConnectionClock, OpenConnections, RequestBody, Stream, Watched,
};
use super::console::{ConsoleBody, Door, boxed, see_other};
use super::control::{Control, not_found};
use super::{AcceptBackoff, next_slot};
use crate::config::ServerSettings;

/// A listener the control endpoints are served on.
enum ControlListener {
    /// The control socket: every endpoint, governed by the socket file's permissions.
    Socket(tokio::net::UnixListener),
    /// `[server] metrics_listen`: `GET /metrics` alone, since Prometheus cannot scrape a Unix
    /// socket and the operator endpoints must stay behind the socket's permissions.
    Metrics(tokio::net::TcpListener),
    /// `[console] listen`: the console alone, to a browser logged in with the console token;
    /// HTTPS with `[console] tls`.
    Console(tokio::net::TcpListener, Option<tokio_rustls::TlsAcceptor>),
}

/// An accepted connection: ready to serve, or a TLS handshake to make first (on the
/// connection's own task, so that a slow one holds up no other).
enum Accepted {
    Ready(Box<dyn Stream>),
    Handshake(tokio::net::TcpStream, tokio_rustls::TlsAcceptor),
}

impl Accepted {
    /// The stream to serve, once its TLS handshake (if any) is done within `header_timeout`;
    /// `None`, counted and logged, when it is not.
    async fn opened(self, header_timeout: Duration, control: &Control) -> Option<Box<dyn Stream>> {
        match self {
            Accepted::Ready(stream) => Some(stream),
            Accepted::Handshake(stream, acceptor) => {
                if let Ok(Ok(stream)) =
                    tokio::time::timeout(header_timeout, acceptor.accept(stream)).await
                {
                    return Some(Box::new(stream));
                }
                control.console.handshake_failed();
                None
            }
        }
    }
}

impl ControlListener {
    fn socket(listener: std::os::unix::net::UnixListener) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(ControlListener::Socket(tokio::net::UnixListener::from_std(
            listener,
        )?))
    }

    fn name(&self) -> &'static str {
        match self {
            ControlListener::Socket(_) => "control",
            ControlListener::Metrics(_) => "metrics",
            ControlListener::Console(..) => "console",
        }
    }

    /// The next connection, with its peer: the Unix user on the control socket, the address on
    /// a TCP listener.
    async fn accept(&self) -> std::io::Result<(Accepted, String)> {
        Ok(match self {
            ControlListener::Socket(listener) => {
                let stream = listener.accept().await?.0;
                let peer = peer_user(&stream);
                (Accepted::Ready(Box::new(stream)), peer)
            }
            ControlListener::Metrics(listener) | ControlListener::Console(listener, None) => {
                let (stream, peer) = listener.accept().await?;
                (Accepted::Ready(Box::new(stream)), peer.ip().to_string())
            }
            ControlListener::Console(listener, Some(acceptor)) => {
                let (stream, peer) = listener.accept().await?;
                let accepted = Accepted::Handshake(stream, acceptor.clone());
                (accepted, peer.ip().to_string())
            }
        })
    }
}

/// What a listener serves.
#[derive(Debug, Clone, Copy)]
enum Serves {
    Everything,
    Metrics,
    Console,
}

impl Control {
    /// Answers one request on a listener that serves `serves`.
    async fn serve(
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

/// The Unix user of the process at the other end of `stream` (`SO_PEERCRED`), by name, else
/// `uid N`; "unknown" when the kernel does not say.
fn peer_user(stream: &tokio::net::UnixStream) -> String {
    let Ok(credentials) = stream.peer_cred() else {
        return "unknown".to_string();
    };
    crate::operator::user_name(credentials.uid())
}

/// Connections served at once on each listener (the control socket, metrics, the console); past
/// it the one idle the longest is closed for a new one, else new ones wait in the backlog.
/// Operators' commands and a scraper need a handful: the bound keeps a flood from taking the
/// descriptors that turns, tools and the store need.
const MAX_CONTROL_CONNECTIONS: usize = 64;

/// A control, metrics or console listener task.
pub(crate) struct ControlServer {
    listener: ControlListener,
    control: Arc<Control>,
    /// A request head must come within this, and an idle connection is closed after it.
    header_timeout: Duration,
}

impl ControlServer {
    /// The control socket (when systemd passed it or it could be bound) and the metrics
    /// listener (when `server.metrics_listen` is set and can be bound). Neither is a reason to
    /// stop serving webhooks: what cannot be served is logged and left out.
    pub(crate) async fn bind_all(
        socket: Option<std::os::unix::net::UnixListener>,
        server: &ServerSettings,
        control: &Arc<Control>,
    ) -> Vec<ControlServer> {
        let mut servers = Vec::new();
        let header_timeout = server.header_timeout;
        if let Some(addr) = server.metrics_listen {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => servers.push(ControlServer {
                    listener: ControlListener::Metrics(listener),
                    control: control.clone(),
                    header_timeout,
                }),
                Err(err) => tracing::error!(error = %err,
                    "cannot listen on {addr} (server.metrics_listen); metrics are on the control socket only"),
            }
        }
        if let Some(listener) = console_listener(control).await {
            servers.push(ControlServer {
                listener,
                control: control.clone(),
                header_timeout,
            });
        }
        if let Some(socket) = socket {
            match ControlListener::socket(socket) {
                Ok(listener) => servers.push(ControlServer {
                    listener,
                    control: control.clone(),
                    header_timeout,
                }),
                Err(err) => tracing::error!(error = %err,
                    "cannot serve the control socket; the daemon serves webhooks without it"),
            }
        }
        servers
    }

    /// Serves the control endpoints on the listener until `shutdown`.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let ControlServer {
            listener,
            control,
            header_timeout,
        } = self;
        let serves = match listener {
            ControlListener::Socket(_) => Serves::Everything,
            ControlListener::Metrics(_) => Serves::Metrics,
            ControlListener::Console(..) => Serves::Console,
        };
        let mut backoff = AcceptBackoff::default();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONTROL_CONNECTIONS));
        let open = Arc::new(OpenConnections::new(listener.name()));
        let mut at_limit_since = None;
        // hyper's header timer also runs while a connection waits for its next request, so it
        // closes idle connections too.
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(header_timeout);
        loop {
            // Accepted before its slot: at the limit the one connection that waits for a slot
            // is the one that makes an idle connection close (the rest wait in the backlog).
            let (accepted, peer) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        backoff.failed(listener.name(), &err).await;
                        continue;
                    }
                },
            };
            backoff.succeeded();
            let permit = tokio::select! {
                () = shutdown.cancelled() => return,
                permit = next_slot(&slots, &open, MAX_CONTROL_CONNECTIONS, &mut at_limit_since) => match permit {
                    Some(permit) => permit,
                    None => return,
                },
            };
            at_limit_since = None;
            let clock = ConnectionClock::new();
            let registration = open.register(clock.clone(), None);
            let opening = control.clone();
            let control = control.clone();
            let peer: Arc<str> = peer.into();
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
            let http = http.clone();
            tokio::spawn(async move {
                if let Some(stream) = accepted.opened(header_timeout, &opening).await {
                    let io = TokioIo::new(Clocked::new(stream, clock));
                    // Closed to make room only while idle, or in a head or bodies that stop.
                    tokio::select! {
                        _ = http.serve_connection(io, service) => {}
                        () = registration.close.cancelled() => {}
                    }
                }
                drop(permit);
            });
        }
    }
}

/// `[console] listen` bound, with its TLS when `[console] tls` is set; `None` (logged) when it
/// is not set or cannot be served. A console that should speak TLS and cannot is not served in
/// plain HTTP instead.
async fn console_listener(control: &Control) -> Option<ControlListener> {
    let settings = control.ops.settings.get();
    let console = &settings.config.console;
    let addr = console.listen.filter(|_| console.token.is_some())?;
    let tls = match console.tls.as_ref().map(crate::tls::http1_server_config) {
        None => None,
        Some(Ok(config)) => Some(tokio_rustls::TlsAcceptor::from(config)),
        Some(Err(problem)) => {
            tracing::error!("console.tls: {problem}; the console is on the control socket only");
            return None;
        }
    };
    match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => Some(ControlListener::Console(listener, tls)),
        Err(err) => {
            tracing::error!(error = %err,
                "cannot listen on {addr} (console.listen); the console is on the control socket only");
            None
        }
    }
}
