//! The listeners the control endpoints are served on: the control socket (everything, to whom
//! its file permissions allow), `[server] metrics_listen` (`GET /metrics` alone) and `[console]
//! listen` (the console alone, to a browser logged in with its token). Each bounds its
//! connections and closes idle ones.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

use super::AcceptBackoff;
use super::connection::Stream;
use super::console::{ConsoleBody, Door, boxed, see_other};
use super::control::{Control, not_found};
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
                control.console_handshake_failed();
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

    /// The next connection, with its peer's Unix user (the TCP listeners have none).
    async fn accept(&self) -> std::io::Result<(Accepted, String)> {
        Ok(match self {
            ControlListener::Socket(listener) => {
                let stream = listener.accept().await?.0;
                let peer = peer_user(&stream);
                (Accepted::Ready(Box::new(stream)), peer)
            }
            ControlListener::Metrics(listener) | ControlListener::Console(listener, None) => {
                let stream = listener.accept().await?.0;
                (Accepted::Ready(Box::new(stream)), String::new())
            }
            ControlListener::Console(listener, Some(acceptor)) => {
                let stream = listener.accept().await?.0;
                (Accepted::Handshake(stream, acceptor.clone()), String::new())
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
        request: Request<hyper::body::Incoming>,
        peer: &str,
        serves: Serves,
    ) -> http::Response<ConsoleBody> {
        let path = request.uri().path();
        let console = path == "/console" || path.starts_with("/console/");
        let metrics = request.method() == Method::GET && path == "/metrics";
        match serves {
            Serves::Everything if console => self.console_request(request, Door::Socket).await,
            Serves::Console if console => self.console_request(request, Door::Listen).await,
            Serves::Console if path == "/" => boxed(see_other("/console/")),
            Serves::Everything => boxed(self.answer(request, peer).await),
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
/// it new ones wait in the backlog. Operators' commands and a scraper need a handful: the bound
/// keeps a flood from taking the descriptors that turns, tools and the store need.
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
        // hyper's header timer also runs while a connection waits for its next request, so it
        // closes idle connections too.
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(header_timeout);
        loop {
            let permit = tokio::select! {
                () = shutdown.cancelled() => return,
                permit = slots.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
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
            let opening = control.clone();
            let control = control.clone();
            let peer: Arc<str> = peer.into();
            let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                let control = control.clone();
                let peer = peer.clone();
                async move { Ok::<_, Infallible>(control.serve(request, &peer, serves).await) }
            });
            let http = http.clone();
            tokio::spawn(async move {
                if let Some(stream) = accepted.opened(header_timeout, &opening).await {
                    let _ = http.serve_connection(TokioIo::new(stream), service).await;
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
    let settings = control.settings.get();
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
