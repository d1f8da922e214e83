//! Ingress: the listening sockets and the HTTP server on them.
//!
//! Sockets come from systemd (socket activation, looked up by name in `LISTEN_FDNAMES`) or are
//! bound from the config. They are taken in `main` before the async runtime starts, because the
//! activation protocol is process-global state that must be read before any thread exists.

mod acknowledge;
pub(crate) mod api;
mod approval_link;
mod approvals;
mod body;
pub(crate) mod capacity;
mod connection;
mod console;
pub(crate) mod control;
pub(crate) mod control_listener;
mod follow;
mod http;
mod operations;
mod payload;
pub(crate) mod query;
mod ratelimit;
mod response;
pub(crate) mod standby;
mod unread;

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub(crate) use self::http::Ingress;
use crate::config::{Config, ServerSettings, VerifyScheme};
pub(crate) use body::BodySlots;
use connection::{
    Clocked, ConnectionClock, OpenConnections, Protocol, Stream, Watched, detect_protocol,
};
pub(crate) use console::Console;
pub(crate) use operations::Operations;

/// Body parsing, for the `request` fuzz target.
#[cfg(feature = "fuzzing")]
pub(crate) fn parse_for_fuzzing(headers: &::http::HeaderMap, body: bytes::Bytes) {
    let _ = self::payload::parse_payload(headers, body, VerifyScheme::Slack);
}

/// After "stop accepting", connections accepted just before may not have sent their request yet;
/// hyper would treat them as idle and close them. Give them this long to start.
const FIRST_REQUEST_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub(crate) enum ListenError {
    #[error("socket activation: {0}")]
    Activation(String),
    #[error("cannot listen on {addr} (server.listen): {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "route {route} has verify = none but the webhook listener {addr} is not on a loopback address"
    )]
    UnsignedOffLoopback { route: String, addr: SocketAddr },
}

/// The URL at which this machine reaches a listener on `addr`: an unspecified address (all
/// addresses, as the packaged socket listens) as the loopback address of its family.
pub(crate) fn local_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip @ (std::net::IpAddr::V4(_) | std::net::IpAddr::V6(_)) => ip,
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

pub(crate) use api::ListenerAnswer;

/// How long `agentgate send` waits for the listener's answer.
const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Posts `body` to `url` as a webhook that `route` accepts, signed with its secret (see
/// `signature::webhook_headers`): what `agentgate send` does, from the command with `--url` and
/// from the daemon otherwise. HTTPS is verified against the public web roots.
pub(crate) async fn post_signed_webhook(
    url: String,
    route: &crate::config::RouteSettings,
    body: bytes::Bytes,
    delivery_id: &str,
    event_type: Option<&str>,
) -> Result<ListenerAnswer, String> {
    let client = crate::tls::http_client()?
        .timeout(SEND_TIMEOUT)
        .build()
        .map_err(|err| format!("HTTP client: {err}"))?;
    let mut post = client.post(&url);
    // Without one given, the route's first `events` entry.
    let event_type = event_type.or_else(|| {
        route
            .events
            .as_ref()
            .and_then(|events| events.first())
            .map(String::as_str)
    });
    for (name, value) in
        crate::signature::webhook_headers(&route.verify, &body, delivery_id, event_type)
    {
        post = post.header(name, value);
    }
    let response = post.body(body).send().await.map_err(|err| {
        let failure = crate::tls::request_failure(&err, "no answer in time");
        format!("POST {url}: {failure}")
    })?;
    let status = response.status().as_u16();
    let body = response
        .text()
        .await
        .map_err(|err| format!("POST {url}: reading the answer: {err}"))?;
    Ok(ListenerAnswer { url, status, body })
}

/// The listeners, inherited or bound.
pub(crate) struct Listeners {
    pub webhook: std::net::TcpListener,
    /// `None` when it was neither passed nor could be bound (logged; the daemon runs without it).
    pub control: Option<std::os::unix::net::UnixListener>,
    pub activated: bool,
}

impl Listeners {
    /// Copies of the same sockets (close-on-exec), for answering on while the daemon cannot.
    pub(crate) fn try_clone(&self) -> std::io::Result<Listeners> {
        Ok(Listeners {
            webhook: self.webhook.try_clone()?,
            control: self
                .control
                .as_ref()
                .map(std::os::unix::net::UnixListener::try_clone)
                .transpose()?,
            activated: self.activated,
        })
    }
}

/// The sockets systemd passed (`inherited_sockets`), or else binds `server.listen` and the
/// control socket. Call before any thread exists.
pub(crate) fn take_listeners(
    config: &Config,
    inherited: Option<Listeners>,
) -> Result<Listeners, ListenError> {
    let listeners = if let Some(inherited) = inherited {
        inherited
    } else {
        let addr = config.server.listen;
        let webhook = std::net::TcpListener::bind(addr)
            .map_err(|source| ListenError::Bind { addr, source })?;
        Listeners {
            webhook,
            control: bind_control_socket(&config.server.control_socket),
            activated: false,
        }
    };
    let addr = listeners
        .webhook
        .local_addr()
        .map_err(|err| ListenError::Activation(format!("webhook socket has no address: {err}")))?;
    refuse_unsigned_off_loopback(config, addr)?;
    Ok(listeners)
}

/// `verify = none` is refused unless the webhook listener at `addr` is on a loopback address.
/// Checked at start and again by every reload.
pub(crate) fn refuse_unsigned_off_loopback(
    config: &Config,
    addr: SocketAddr,
) -> Result<(), ListenError> {
    match config
        .routes
        .iter()
        .find(|r| r.verify.scheme == VerifyScheme::None)
    {
        Some(route) if !addr.ip().is_loopback() => Err(ListenError::UnsignedOffLoopback {
            route: route.name.clone(),
            addr,
        }),
        _ => Ok(()),
    }
}

/// Binds the control socket at `path` (mode 0660), replacing a stale socket file. Failure is not
/// fatal: webhooks matter more than the control socket, so it is logged and skipped.
fn bind_control_socket(path: &Path) -> Option<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let bind = || -> std::io::Result<std::os::unix::net::UnixListener> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process answers on it",
            ));
        }
        let _ = std::fs::remove_file(path);
        let listener = std::os::unix::net::UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
        Ok(listener)
    };
    match bind() {
        Ok(listener) => Some(listener),
        Err(err) => {
            tracing::warn!(path = %path.display(), error = %err,
                "control socket unavailable (server.control_socket); continuing without it");
            None
        }
    }
}

/// Reads `LISTEN_PID`/`LISTEN_FDS`/`LISTEN_FDNAMES` and takes the sockets named `webhook` and
/// `control`. The names come from `sd-notify`; `listenfd` checks each fd's socket type and takes
/// ownership of it. Both read (and `listenfd` clears) process-global environment, which is why
/// this runs before any thread exists, and before the config is read: a config that cannot be
/// used still leaves the daemon its sockets to answer on (`standby`).
pub(crate) fn inherited_sockets() -> Result<Option<Listeners>, ListenError> {
    let named: Vec<(RawFd, String)> = sd_notify::listen_fds_with_names()
        .map_err(|err| ListenError::Activation(format!("LISTEN_FDS/LISTEN_FDNAMES: {err}")))?
        .collect();
    if named.is_empty() {
        return Ok(None);
    }
    let names_text = named
        .iter()
        .map(|(_, name)| name.as_str())
        .collect::<Vec<_>>()
        .join(":");
    let mut passed = listenfd::ListenFd::from_env();
    let mut webhook = None;
    let mut control = None;
    for (index, (fd, name)) in named.iter().enumerate() {
        let wrong_kind = |kind: &str, err: std::io::Error| {
            ListenError::Activation(format!(
                "fd {fd} named {name} is not a {kind} listening socket: {err}"
            ))
        };
        let missing = || ListenError::Activation(format!("fd {fd} ({name}) was not passed"));
        match name.as_str() {
            "webhook" => {
                let listener = passed
                    .take_tcp_listener(index)
                    .map_err(|err| wrong_kind("TCP", err))?
                    .ok_or_else(missing)?;
                webhook = Some(listener);
            }
            "control" => {
                let listener = passed
                    .take_unix_listener(index)
                    .map_err(|err| wrong_kind("Unix", err))?
                    .ok_or_else(missing)?;
                control = Some(listener);
            }
            other => {
                return Err(ListenError::Activation(format!(
                    "fd {fd} has the unknown name {other:?} (LISTEN_FDNAMES={names_text:?}); expected webhook or control"
                )));
            }
        }
    }
    let webhook = webhook.ok_or_else(|| {
        ListenError::Activation(format!(
            "no socket named webhook among LISTEN_FDNAMES={names_text:?}; set FileDescriptorName=webhook"
        ))
    })?;
    Ok(Some(Listeners {
        webhook,
        control,
        activated: true,
    }))
}

/// What a listener does when `accept` fails (EMFILE, ENFILE, ENOBUFS): such errors repeat at once
/// until something frees resources, so retrying immediately spins a core and floods the journal.
/// Each failure waits longer (up to a second), and a failure is logged at most once a second with
/// the number of failures since the last line.
pub(crate) struct AcceptBackoff {
    delay: Duration,
    lines: crate::logging::OneLineEvery,
}

impl Default for AcceptBackoff {
    fn default() -> AcceptBackoff {
        AcceptBackoff {
            delay: ACCEPT_BACKOFF_FIRST,
            lines: crate::logging::OneLineEvery::new(ACCEPT_BACKOFF_MAX),
        }
    }
}

const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

impl AcceptBackoff {
    pub(crate) async fn failed(&mut self, listener: &str, err: &std::io::Error) {
        if let Some(left_out) = self.lines.due() {
            tracing::warn!(listener, error = %err, failures = left_out + 1,
                retry_in = ?self.delay, "accept failed; backing off");
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(ACCEPT_BACKOFF_MAX);
    }

    pub(crate) fn succeeded(&mut self) {
        self.delay = ACCEPT_BACKOFF_FIRST;
    }
}

/// The webhook listener task. Its handle is the [`Ingress`] it serves, which a reload updates.
pub(crate) struct WebhookListener {
    pub listener: std::net::TcpListener,
    pub ingress: Arc<Ingress>,
    pub server: ServerSettings,
    /// How long in-flight requests may take to finish once `shutdown` fired.
    pub finish_within: Duration,
}

impl WebhookListener {
    /// Serves webhooks until `shutdown` fires, then stops accepting and lets in-flight requests
    /// finish (for at most `finish_within`). At most `server.max_connections` connections are
    /// served at once: past that, the one idle or stalled the longest is closed for a new one,
    /// or, with none such, new ones wait (one accepted, the rest in the kernel's backlog), so a
    /// flood of connections can neither take the file descriptors that turns and the store need
    /// nor keep a valid sender waiting.
    pub(crate) async fn run(self, shutdown: CancellationToken) -> std::io::Result<()> {
        let WebhookListener {
            listener,
            ingress,
            server,
            finish_within,
        } = self;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let graceful = GracefulShutdown::new();
        let mut backoff = AcceptBackoff::default();
        let protocols = Protocols::for_server(&server);
        let max_connections = within_descriptor_limit(server.max_connections);
        let connections = Arc::new(Semaphore::new(max_connections));
        let open = Arc::new(OpenConnections::new("webhook"));
        let mut at_limit_since: Option<std::time::Instant> = None;
        loop {
            // Accepted before its slot: at the limit the one connection that waits for a slot
            // is the one that makes an idle connection close (the rest wait in the backlog).
            let (stream, peer) = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(err) => {
                        backoff.failed("webhook", &err).await;
                        continue;
                    }
                },
            };
            backoff.succeeded();
            let limit = ingress.peer_limit(peer.ip());
            if let Some(limit) = limit
                && !room_for_peer(&open, peer.ip(), limit)
            {
                ingress.peer_refused(peer, limit);
                continue;
            }
            let counted = limit.map(|_| peer.ip());
            // An accepted connection is served even when the listener is stopping: dropping it
            // would reset a sender that connected in time.
            let Some(permit) =
                next_slot(&connections, &open, max_connections, &mut at_limit_since).await
            else {
                break;
            };
            if let Some(since) = at_limit_since.take() {
                tracing::info!(
                    waited_ms = since.elapsed().as_millis() as u64,
                    "webhook connections below server.max_connections again"
                );
            }
            let _ = stream.set_nodelay(true);
            let clock = ConnectionClock::new();
            let serving = Serving {
                ingress: ingress.clone(),
                watcher: graceful.watcher(),
                registration: open.register(clock.clone(), counted),
                clock,
                stopping: shutdown.clone(),
            };
            let protocols = protocols.clone();
            tokio::spawn(async move {
                protocols.serve(stream, peer, serving).await;
                drop(permit);
            });
        }
        drop(listener);
        tokio::time::sleep(FIRST_REQUEST_GRACE).await;
        if tokio::time::timeout(finish_within, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("in-flight requests did not finish in time; closing them");
        }
        Ok(())
    }
}

/// Descriptors kept for everything but webhook connections: the control socket and metrics
/// listener (64 each), the store, tool pipes and units, model and delivery connections.
const DESCRIPTOR_RESERVE: u64 = 512;

/// `max_connections`, lowered (with a warning) so that connections can never take the
/// descriptors the rest of the daemon needs under the process's open-file limit.
fn within_descriptor_limit(max_connections: usize) -> usize {
    use nix::sys::resource::{Resource, getrlimit};
    let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return max_connections;
    };
    let room =
        usize::try_from(soft.saturating_sub(DESCRIPTOR_RESERVE).max(16)).unwrap_or(usize::MAX);
    if max_connections > room {
        tracing::warn!(
            max_connections,
            open_file_limit = soft,
            used = room,
            "server.max_connections lowered to what the open-file limit leaves (raise LimitNOFILE=)"
        );
        room
    } else {
        max_connections
    }
}

/// Whether `peer` may open one more connection: it holds fewer than `limit`, or one of its own
/// idle or stalled connections was closed to make room. A peer cannot take the slots of others
/// (trusted proxies, which carry everyone's connections, are not counted).
fn room_for_peer(open: &OpenConnections, peer: std::net::IpAddr, limit: usize) -> bool {
    open.of_peer(peer) < limit || open.close_quietest(Some(peer))
}

/// How often, while every connection slot is taken, the idle connections are looked at again.
const SLOT_RETRY: Duration = Duration::from_millis(250);

/// A connection slot of the listener `open` serves: a free one, or one made by closing the
/// connection idle or stalled the longest (which gives its slot back at once). While none is,
/// it waits (new connections stay in the backlog), saying once that all `max_connections`
/// slots are taken. `None` only if the slots are gone.
async fn next_slot(
    slots: &Arc<Semaphore>,
    open: &OpenConnections,
    max_connections: usize,
    at_limit_since: &mut Option<std::time::Instant>,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    loop {
        if slots.available_permits() == 0 && !open.close_quietest(None) && at_limit_since.is_none()
        {
            *at_limit_since = Some(std::time::Instant::now());
            tracing::warn!(
                max_connections,
                "{} connections at {}, none idle or stalled; new ones wait in the backlog",
                open.listener,
                if open.listener == "webhook" {
                    "server.max_connections"
                } else {
                    "their limit"
                }
            );
        }
        tokio::select! {
            biased;
            permit = slots.clone().acquire_owned() => return permit.ok(),
            () = tokio::time::sleep(SLOT_RETRY) => {}
        }
    }
}

/// How long an HTTP/2 connection closed to make room may take to send its GOAWAY.
const EVICTED_FLUSH: Duration = Duration::from_millis(20);
/// How long an HTTP/2 client has to close the connection after a GOAWAY once no stream is left.
const GOAWAY_GRACE: Duration = Duration::from_secs(1);
/// How often a closing HTTP/2 connection looks whether that time is up.
const GOAWAY_CHECK: Duration = Duration::from_millis(250);

/// HTTP/2 streams open at once on one webhook connection (hyper's default is 200).
const HTTP2_MAX_STREAMS: u32 = 16;
/// What an HTTP/2 sender may send on one stream before the daemon reads it (64 KiB, the
/// protocol's default; hyper's is 1 MiB).
const HTTP2_STREAM_WINDOW: u32 = 64 * 1024;
/// The same for all streams of a connection together.
const HTTP2_CONNECTION_WINDOW: u32 = 256 * 1024;

/// How one webhook connection is served: the HTTP/1.1 and HTTP/2 connection settings.
#[derive(Clone)]
struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    header_timeout: Duration,
    keepalive_timeout: Duration,
}

impl Protocols {
    fn for_server(server: &ServerSettings) -> Protocols {
        // hyper's header timer also runs while a keep-alive connection waits for its next request:
        // it is the idle limit here, and `connection` enforces `header_timeout` (see there).
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(server.keepalive_timeout)
            .keep_alive(true);
        // Senders are not trusted before their signature is checked, which needs the whole body:
        // few streams per connection and small flow-control windows keep what one connection
        // can make the daemon hold small (body.rs bounds what all of them hold together).
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .max_concurrent_streams(HTTP2_MAX_STREAMS)
            .initial_stream_window_size(HTTP2_STREAM_WINDOW)
            .initial_connection_window_size(HTTP2_CONNECTION_WINDOW);
        Protocols {
            http1,
            http2,
            header_timeout: server.header_timeout,
            keepalive_timeout: server.keepalive_timeout,
        }
    }

    /// Serves an accepted connection until it closes. Errors here are client-side (reset,
    /// timeout); nothing is lost by dropping them.
    async fn serve(
        self,
        stream: tokio::net::TcpStream,
        peer: std::net::SocketAddr,
        serving: Serving,
    ) {
        let Serving {
            ingress,
            watcher,
            registration,
            clock,
            stopping,
        } = serving;
        let tls = ingress.tls_acceptor();
        let opened = open_connection(stream, peer, tls, self.header_timeout, &ingress).await;
        let answering = clock.clone();
        let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let (ingress, clock) = (ingress.clone(), answering.clone());
            clock.answering();
            let version = request.version();
            let request =
                request.map(|body| Watched::new(unread::Unread::new(body, version), clock.clone()));
            async move {
                let response = ingress.handle(request, peer).await;
                clock.answered();
                response
            }
        });
        match opened {
            Some((stream, Protocol::Http1)) => {
                let io = TokioIo::new(Clocked::new(stream, clock.clone()));
                let connection = watcher.watch(self.http1.serve_connection(io, service));
                // Closed to make room only while idle or stalled: dropping it then loses
                // nothing (no request of it was acknowledged).
                tokio::select! {
                    _ = connection => {}
                    () = clock.overdue(self.header_timeout) => {}
                    () = registration.close.cancelled() => {}
                }
            }
            Some((stream, Protocol::Http2)) => {
                let connection = self.http2.serve_connection(TokioIo::new(stream), service);
                let mut connection = std::pin::pin!(connection);
                // GOAWAY, then the streams under way finish: on idleness, to make room, and
                // when the listener stops (the watcher, held until the end, makes the drain
                // wait for this connection).
                let mut closing: Option<tokio::time::Instant> = None;
                loop {
                    tokio::select! {
                        _ = connection.as_mut() => break,
                        () = clock.idle_past(self.header_timeout, self.keepalive_timeout), if closing.is_none() => {}
                        // Closed to make room (idle, or every stream stalled in its body): the
                        // GOAWAY is sent, and the slot is given back at once.
                        () = registration.close.cancelled(), if closing.is_none() => {
                            connection.as_mut().graceful_shutdown();
                            let _ = tokio::time::timeout(EVICTED_FLUSH, connection.as_mut()).await;
                            break;
                        }
                        () = stopping.cancelled(), if closing.is_none() => {}
                        // A client that does not answer the GOAWAY's PING would hold the
                        // connection open: once no stream is left, it is dropped.
                        () = tokio::time::sleep(GOAWAY_CHECK), if closing.is_some() => {
                            let waited = closing.map_or(Duration::ZERO, |since| since.elapsed());
                            if waited >= GOAWAY_GRACE && clock.idle_for().is_some() {
                                break;
                            }
                            continue;
                        }
                    }
                    if closing.is_none() {
                        connection.as_mut().graceful_shutdown();
                        closing = Some(tokio::time::Instant::now());
                    }
                }
                drop(watcher);
            }
            None => {}
        }
    }
}

/// What serving one connection needs besides the protocol settings.
struct Serving {
    ingress: Arc<Ingress>,
    watcher: hyper_util::server::graceful::Watcher,
    registration: connection::Registration,
    clock: Arc<ConnectionClock>,
    /// The listener stops.
    stopping: CancellationToken,
}

/// Opens an accepted connection: the TLS handshake when the listener serves HTTPS (the protocol
/// from ALPN), else the protocol from the first bytes; both within `header_timeout`. `None`
/// when the peer did not get that far (a failed handshake is logged and counted).
async fn open_connection(
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    tls: Option<tokio_rustls::TlsAcceptor>,
    header_timeout: Duration,
    refusals: &Ingress,
) -> Option<(Box<dyn Stream>, Protocol)> {
    let Some(acceptor) = tls else {
        return detect_protocol(&stream, header_timeout)
            .await
            .map(|protocol| (Box::new(stream) as Box<dyn Stream>, protocol));
    };
    match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => {
            let protocol = if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                Protocol::Http2
            } else {
                Protocol::Http1
            };
            Some((Box::new(stream), protocol))
        }
        Ok(Err(err)) => {
            refusals.tls_refused(peer, &err.to_string());
            None
        }
        Err(_) => {
            refusals.tls_refused(peer, "no TLS handshake within server.header_timeout");
            None
        }
    }
}
