//! The webhook listener: what a connection to the webhook socket is served with. HTTP/1.1 and
//! HTTP/2 (prior knowledge in cleartext, ALPN under TLS), each connection bounded in what it can
//! make the daemon hold, one address bounded in how many connections it holds, and a stop that
//! lets requests under way finish. Accepting, the listener's bound and TLS are `listener`'s.

use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio_util::sync::CancellationToken;

use super::Ingress;
use super::connection::{Clocked, OpenConnections, Protocol, Watched, detect_protocol};
use super::http::Unrouted;
use super::listener::{Accepted, Admission, Listener, Opened, Serve, Tls, handshake};
use super::unread;
use crate::config::ServerSettings;

/// After "stop accepting", connections accepted just before may not have sent their request yet;
/// hyper would treat them as idle and close them. Give them this long to start.
const FIRST_REQUEST_GRACE: Duration = Duration::from_millis(500);

/// The webhook listener task. Its handle is the [`Ingress`] it serves, which a reload updates.
pub(crate) struct WebhookListener {
    pub socket: std::net::TcpListener,
    pub ingress: Arc<Ingress>,
    pub server: ServerSettings,
    /// How long in-flight requests may take to finish once `shutdown` fired.
    pub finish_within: Duration,
}

impl WebhookListener {
    /// Serves webhooks until `shutdown` fires, then stops accepting and lets in-flight requests
    /// finish (for at most `finish_within`). At most `server.max_connections` connections are
    /// served at once (see `listener`), and one address holds at most
    /// `server.max_connections_per_peer` of them.
    pub(crate) async fn run(self, shutdown: CancellationToken) -> std::io::Result<()> {
        let WebhookListener {
            socket,
            ingress,
            server,
            finish_within,
        } = self;
        let listener = Listener {
            socket: super::listener::tcp(socket)?,
            name: "webhook",
            max_connections: within_descriptor_limit(server.max_connections),
            tls: Tls::Current(ingress.tls.clone()),
        };
        let webhooks = Webhooks {
            protocols: Protocols::for_server(&server),
            graceful: GracefulShutdown::new(),
            ingress,
            stopping: shutdown.clone(),
        };
        listener.run(&webhooks, shutdown).await;
        tokio::time::sleep(FIRST_REQUEST_GRACE).await;
        if tokio::time::timeout(finish_within, webhooks.graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("in-flight requests did not finish in time; closing them");
        }
        Ok(())
    }
}

/// What the webhook listener serves its connections with.
struct Webhooks {
    protocols: Protocols,
    ingress: Arc<Ingress>,
    /// Makes the stop wait for the connections under way.
    graceful: GracefulShutdown,
    /// The listener stops.
    stopping: CancellationToken,
}

impl Serve<tokio::net::TcpListener> for &Webhooks {
    /// A peer cannot take the slots of others: it may hold `max_connections_per_peer`
    /// connections, or one more if one of its own idle ones can be closed for it. Trusted
    /// proxies, which carry everyone's connections, are not counted.
    fn admit(&self, peer: &std::net::SocketAddr, open: &OpenConnections) -> Admission {
        let Some(limit) = self.ingress.peer_limit(peer.ip()) else {
            return Admission::Uncounted;
        };
        if open.of_peer(peer.ip()) < limit || open.close_quietest(Some(peer.ip())) {
            Admission::Counted(peer.ip())
        } else {
            self.ingress.peer_refused(*peer, limit);
            Admission::Refused
        }
    }

    fn connection(
        &self,
        accepted: Accepted<tokio::net::TcpStream>,
        peer: std::net::SocketAddr,
    ) -> impl Future<Output = ()> + Send + 'static {
        let serving = Serving {
            ingress: self.ingress.clone(),
            watcher: self.graceful.watcher(),
            stopping: self.stopping.clone(),
        };
        self.protocols.clone().serve(accepted, peer, serving)
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

/// What serving one connection needs besides the protocol settings.
struct Serving {
    ingress: Arc<Ingress>,
    watcher: Watcher,
    /// The listener stops.
    stopping: CancellationToken,
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
        accepted: Accepted<tokio::net::TcpStream>,
        peer: std::net::SocketAddr,
        serving: Serving,
    ) {
        let Accepted {
            stream,
            tls,
            clock,
            registration,
        } = accepted;
        let Serving {
            ingress,
            watcher,
            stopping,
        } = serving;
        let Some((stream, protocol)) = self.open(stream, tls, peer, &ingress).await else {
            return;
        };
        let (answering, refusals) = (clock.clone(), ingress.clone());
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
        match protocol {
            Protocol::Http1 => {
                let io = TokioIo::new(Clocked::new(stream, clock.clone()));
                let connection = watcher.watch(self.http1.serve_connection(io, service));
                // Closed to make room only while idle or stalled: dropping it then loses
                // nothing (no request of it was acknowledged).
                tokio::select! {
                    served = connection => {
                        if let Some(refusal) = served.err().as_ref().and_then(Unrouted::of) {
                            refusals.refused_unrouted(peer, refusal);
                        }
                    }
                    () = clock.overdue(self.header_timeout) => {
                        refusals.refused_unrouted(peer, Unrouted::HeadTimeout);
                    }
                    () = registration.close.cancelled() => {}
                }
            }
            Protocol::Http2 => {
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
        }
    }

    /// Opens an accepted connection: the TLS handshake when the listener serves HTTPS (the
    /// protocol from ALPN), else the protocol from the first bytes; both within
    /// `header_timeout`. `None` when the peer did not get that far (a failed handshake is
    /// logged and counted).
    async fn open(
        &self,
        stream: tokio::net::TcpStream,
        tls: Option<tokio_rustls::TlsAcceptor>,
        peer: std::net::SocketAddr,
        refusals: &Ingress,
    ) -> Option<(Box<dyn super::connection::Stream>, Protocol)> {
        match handshake(stream, tls, self.header_timeout).await {
            Ok(Opened::Plain(stream)) => {
                let protocol = detect_protocol(&stream, self.header_timeout).await?;
                Some((Box::new(stream), protocol))
            }
            Ok(opened @ Opened::Tls(_)) => {
                let protocol = if opened.chose_http2() {
                    Protocol::Http2
                } else {
                    Protocol::Http1
                };
                Some((opened.into_stream(), protocol))
            }
            Err(reason) => {
                refusals.tls_refused(peer, &reason);
                None
            }
        }
    }
}
