//! One listener type for every socket agentgate serves HTTP on: the webhook socket, the control
//! socket, `[server] metrics_listen`, `[console] listen`, and the `503`s of a daemon that stands
//! by on the first two.
//!
//! Each of them owes the same things to the machine it runs on, so they are written once here:
//! accept, backing off while the process is out of descriptors (such errors repeat at once);
//! bound the connections served at once, closing the one idle or stalled the longest for a new
//! one, else letting new ones wait in the kernel's backlog, so that a crowd holding connections
//! open keeps no valid client waiting and takes no descriptor the turns need; give each
//! connection its clock; and make the TLS handshake, where the listener speaks TLS, on the
//! connection's own task within `header_timeout`, so that a slow handshake holds up no other.
//! What is served on a connection is the caller's ([`Serve`]).
//!
//! Nothing here binds: a listener is made from a socket that systemd passed (by its
//! `FileDescriptorName`), that the daemon bound from the config, or that a test bound and
//! handed over, so that a test never races another process for a port.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::connection::{ConnectionClock, OpenConnections, Registration, Stream};
use crate::config::Shared;

/// A listening socket of either kind, and who is at the other end of what it accepts.
pub(super) trait Socket: Send + Sync + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The peer: an address on TCP, the Unix user on a Unix socket.
    type Peer: Send + 'static;
    fn accept(&self) -> impl Future<Output = std::io::Result<(Self::Stream, Self::Peer)>> + Send;
}

impl Socket for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    type Peer = SocketAddr;
    async fn accept(&self) -> std::io::Result<(tokio::net::TcpStream, SocketAddr)> {
        let (stream, peer) = tokio::net::TcpListener::accept(self).await?;
        // Answers are small and written whole: waiting to coalesce them only adds latency.
        let _ = stream.set_nodelay(true);
        Ok((stream, peer))
    }
}

impl Socket for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    type Peer = String;
    async fn accept(&self) -> std::io::Result<(tokio::net::UnixStream, String)> {
        let stream = tokio::net::UnixListener::accept(self).await?.0;
        let peer = peer_user(&stream);
        Ok((stream, peer))
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

/// A TCP socket, bound or passed, made ready for the async runtime.
pub(super) fn tcp(socket: std::net::TcpListener) -> std::io::Result<tokio::net::TcpListener> {
    socket.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(socket)
}

/// A Unix socket, bound or passed, made ready for the async runtime.
pub(super) fn unix(
    socket: std::os::unix::net::UnixListener,
) -> std::io::Result<tokio::net::UnixListener> {
    socket.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(socket)
}

/// Whether a listener speaks TLS, and with which certificate.
pub(super) enum Tls {
    Plain,
    /// The same certificate for the listener's life (`[console] tls`).
    Fixed(tokio_rustls::TlsAcceptor),
    /// The certificate of the config in effect when a connection opens (`[server] tls`, which a
    /// reload renews).
    Current(Arc<Shared<Option<tokio_rustls::TlsAcceptor>>>),
}

impl Tls {
    fn acceptor(&self) -> Option<tokio_rustls::TlsAcceptor> {
        match self {
            Tls::Plain => None,
            Tls::Fixed(acceptor) => Some(acceptor.clone()),
            Tls::Current(current) => (*current.get()).clone(),
        }
    }
}

/// How a new connection is counted, or that it is refused.
pub(super) enum Admission {
    /// Counted against its address (`server.max_connections_per_peer`).
    Counted(IpAddr),
    /// Not counted against anything but the listener's bound.
    Uncounted,
    /// Closed at once (the caller logged and counted why).
    Refused,
}

/// An admitted connection: its bytes (before any TLS handshake), its clock, and its place among
/// the listener's open connections, which may close it to make room.
pub(super) struct Accepted<IO> {
    pub(super) stream: IO,
    /// The listener's TLS, when it speaks TLS: the handshake is the connection's to make.
    pub(super) tls: Option<tokio_rustls::TlsAcceptor>,
    pub(super) clock: Arc<ConnectionClock>,
    pub(super) registration: Registration,
}

/// What a listener serves.
pub(super) trait Serve<S: Socket> {
    /// Whether a connection from `peer` is served, given the listener's `open` connections:
    /// by default it is, counted against nothing but the listener's bound.
    fn admit(&self, _peer: &S::Peer, _open: &OpenConnections) -> Admission {
        Admission::Uncounted
    }
    /// Serves one admitted connection, on its own task.
    fn connection(
        &self,
        accepted: Accepted<S::Stream>,
        peer: S::Peer,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// A connection's bytes once it is open: plain, or after the TLS handshake.
pub(super) enum Opened<IO> {
    Plain(IO),
    Tls(Box<tokio_rustls::server::TlsStream<IO>>),
}

impl<IO: AsyncRead + AsyncWrite + Unpin + Send + 'static> Opened<IO> {
    /// Whether the client chose HTTP/2 by ALPN.
    pub(super) fn chose_http2(&self) -> bool {
        match self {
            Opened::Plain(_) => false,
            Opened::Tls(stream) => stream.get_ref().1.alpn_protocol() == Some(b"h2"),
        }
    }

    pub(super) fn into_stream(self) -> Box<dyn Stream> {
        match self {
            Opened::Plain(stream) => Box::new(stream),
            Opened::Tls(stream) => stream,
        }
    }
}

/// Opens `stream`: as it is without `tls`, else after a handshake within `within`. The error
/// says why a handshake failed, for the caller to log and count.
pub(super) async fn handshake<IO: AsyncRead + AsyncWrite + Unpin>(
    stream: IO,
    tls: Option<tokio_rustls::TlsAcceptor>,
    within: Duration,
) -> Result<Opened<IO>, String> {
    let Some(acceptor) = tls else {
        return Ok(Opened::Plain(stream));
    };
    match tokio::time::timeout(within, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => Ok(Opened::Tls(Box::new(stream))),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err("no TLS handshake within server.header_timeout".to_string()),
    }
}

/// A listening socket with its name (in logs and metrics), its bound and its TLS.
pub(super) struct Listener<S> {
    pub(super) socket: S,
    pub(super) name: &'static str,
    pub(super) max_connections: usize,
    pub(super) tls: Tls,
}

impl<S: Socket> Listener<S> {
    /// Serves connections with `serve` until `shutdown` fires. A connection accepted before
    /// then is served even while the listener stops, if a slot frees within
    /// [`STOPPING_SLOT_WAIT`]: dropping it would reset a client that connected in time.
    pub(super) async fn run(self, serve: impl Serve<S>, shutdown: CancellationToken) {
        let slots = Arc::new(Semaphore::new(self.max_connections));
        let open = Arc::new(OpenConnections::new(self.name));
        let mut backoff = AcceptBackoff::default();
        let mut at_limit_since: Option<Instant> = None;
        loop {
            // Accepted before its slot: at the limit the one connection that waits for a slot
            // is the one that makes an idle connection close (the rest wait in the backlog).
            let (stream, peer) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = self.socket.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(err) => {
                        backoff.failed(self.name, &err).await;
                        continue;
                    }
                },
            };
            backoff.succeeded();
            let counted = match serve.admit(&peer, &open) {
                Admission::Counted(address) => Some(address),
                Admission::Uncounted => None,
                Admission::Refused => continue,
            };
            let permit = tokio::select! {
                permit = next_slot(&slots, &open, self.max_connections, &mut at_limit_since) => permit,
                () = stopped_for(&shutdown, STOPPING_SLOT_WAIT) => None,
            };
            let Some(permit) = permit else {
                return;
            };
            if let Some(since) = at_limit_since.take() {
                tracing::info!(
                    listener = self.name,
                    waited_ms = u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX),
                    "connections below their limit again"
                );
            }
            let clock = ConnectionClock::new();
            let accepted = Accepted {
                stream,
                tls: self.tls.acceptor(),
                registration: open.register(clock.clone(), counted),
                clock,
            };
            let connection = serve.connection(accepted, peer);
            tokio::spawn(async move {
                connection.await;
                drop::<OwnedSemaphorePermit>(permit);
            });
        }
    }
}

/// How long a connection accepted just before the listener stops may wait for a slot: long
/// enough for an idle connection to be closed for it, short enough that connections which do
/// not end (a `sessions follow` stream) cannot hold up the stop.
const STOPPING_SLOT_WAIT: Duration = Duration::from_secs(5);

/// Resolves `wait` after `shutdown` fired.
async fn stopped_for(shutdown: &CancellationToken, wait: Duration) {
    shutdown.cancelled().await;
    tokio::time::sleep(wait).await;
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
    at_limit_since: &mut Option<Instant>,
) -> Option<OwnedSemaphorePermit> {
    loop {
        if slots.available_permits() == 0 && !open.close_quietest(None) && at_limit_since.is_none()
        {
            *at_limit_since = Some(Instant::now());
            tracing::warn!(
                listener = open.listener,
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

/// What a listener does when `accept` fails (EMFILE, ENFILE, ENOBUFS): such errors repeat at once
/// until something frees resources, so retrying immediately spins a core and floods the journal.
/// Each failure waits longer (up to a second), and a failure is logged at most once a second with
/// the number of failures since the last line.
struct AcceptBackoff {
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
    async fn failed(&mut self, listener: &str, err: &std::io::Error) {
        if let Some(left_out) = self.lines.due() {
            tracing::warn!(listener, error = %err, failures = left_out + 1,
                retry_in = ?self.delay, "accept failed; backing off");
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(ACCEPT_BACKOFF_MAX);
    }

    fn succeeded(&mut self) {
        self.delay = ACCEPT_BACKOFF_FIRST;
    }
}
