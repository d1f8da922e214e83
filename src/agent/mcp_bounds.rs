//! What an MCP server may make the daemon hold and spend, on either transport, and what says
//! why a connection was ended over it.
//!
//! The MCP SDK answers every request a server sends (a `ping`, say), and holds each reply in
//! memory until its transport has written it: to a stdio server's stdin, which the server may
//! leave unread, or in a POST to an HTTP server, which the server may leave unanswered (the SDK
//! sends one reply POST at a time, and queues the rest). A server that sends requests without
//! reading the replies would grow that queue without bound: until the call ends, or for as long
//! as the daemon runs on the connection that lists its tools. So every connection goes through
//! [`Watched`], which counts the replies not yet written, whatever the transport, and ends the
//! connection past [`REPLIES_WAITING_MAX`] of them or [`REPLIES_WAITING_BYTES_MAX`] bytes (a
//! reply repeats its request's id, which may be as long as a message). Counting what waits,
//! rather than what the server sent while a write waited, leaves no way around it: a server
//! that reads a little now and then still owes every reply it has not read. The call in flight
//! fails at once, and it, `status` and the journal say why ([`CutOff`]);
//! `agentgate_mcp_servers_not_reading_total` counts it.
//!
//! Each message a server sends costs the daemon its parsing and handling, so the transports
//! read a server's lines (stdio, `mcp_stdio.rs`) or events (HTTP, `mcp_http.rs`), each of its
//! messages among them, no faster than [`MESSAGES_PER_SECOND`], and their bytes no faster than
//! [`BYTES_PER_SECOND`] ([`ServerPaces`], `pace.rs`): a server that floods is slowed, not cut
//! off, and costs a small part of a core instead of one.
//!
//! A stdio server's output is bounded message by message too (`mcp_stdio.rs`); an HTTP
//! server's by the SDK's response limits.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use rmcp::RoleClient;
use rmcp::model::JsonRpcMessage;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use tokio_util::sync::CancellationToken;

use super::pace::{Shared, shared};
use crate::metrics::McpCut;

/// The largest message an MCP server may send: a tool listing of hundreds of tools fits many
/// times over, and a call's result is cut to 64 KiB for the model anyway.
pub(crate) const MESSAGE_MAX: usize = 1024 * 1024;

/// The most JSON objects and arrays one message may hold. Parsed, each takes hundreds of bytes
/// whatever its size on the wire (`{"":0}` is 7 bytes; the map it becomes, more than 500), so
/// the byte bound alone lets a line of tiny or deeply nested objects take a few hundred MB: a
/// call's result of a thousand content blocks, or a listing of a hundred tools with their
/// schemas, holds a few thousand.
pub(crate) const CONTAINERS_MAX: usize = 16 * 1024;

/// The most replies that may wait to be written to a server. A server that reads what it is
/// sent has a few at most (its requests are answered at once); a thousand is far past any
/// burst of pings.
pub(crate) const REPLIES_WAITING_MAX: usize = 1024;

/// The most bytes of replies that may wait to be written to a server.
pub(crate) const REPLIES_WAITING_BYTES_MAX: usize = 4 * MESSAGE_MAX;

/// How many messages a second are read from a server, past a burst of as many: a call's result,
/// a listing's pages and a stream of progress notifications are far below it.
pub(crate) const MESSAGES_PER_SECOND: u64 = 1_000;

/// How many bytes a second are read from a server, past a burst of as many: eight of the
/// largest messages. Parsed at this rate, messages of any size cost a small part of a core.
pub(crate) const BYTES_PER_SECOND: u64 = 8 * MESSAGE_MAX as u64;

/// How long reading a server's event streams may take, in microseconds a second, past a burst
/// of as many: 2.5 % of a core (what the HTTP layer spends to read those bytes comes on top).
/// The SSE parser reads on past comment lines, and past blank lines that end no event, without
/// returning, so neither bytes nor events measure what a stream of them costs; the time its
/// reading takes does.
pub(crate) const READING_MICROS_PER_SECOND: u64 = 25_000;

/// A server's stderr lines are read no faster than this many a second, past a burst of as many:
/// far more than the journal is given of them, and little of a core.
pub(crate) const STDERR_LINES_PER_SECOND: u64 = 1_000;

/// And its stderr's bytes no faster than this many, past a burst of as many: a line without end
/// is read (and dropped past its first 512 bytes) at this rate.
pub(crate) const STDERR_BYTES_PER_SECOND: u64 = 1024 * 1024;

/// One server's paces, shared by everything read from it: its listing connection, each turn's
/// process of it (a stdio server), each event stream (HTTP). Paced per connection, a server that
/// floods from every turn's process at once would cost as many times the rate.
#[derive(Clone)]
pub(crate) struct ServerPaces {
    /// Lines of a stdio server's output, events of an HTTP server's streams.
    pub(crate) lines: Shared,
    /// Bytes of either.
    pub(crate) bytes: Shared,
    /// Microseconds of reading event streams.
    pub(crate) reading: Shared,
    pub(crate) stderr_lines: Shared,
    pub(crate) stderr_bytes: Shared,
}

impl Default for ServerPaces {
    fn default() -> Self {
        let pace = |per_second| shared(per_second, per_second);
        Self {
            lines: pace(MESSAGES_PER_SECOND),
            bytes: pace(BYTES_PER_SECOND),
            reading: pace(READING_MICROS_PER_SECOND),
            stderr_lines: pace(STDERR_LINES_PER_SECOND),
            stderr_bytes: pace(STDERR_BYTES_PER_SECOND),
        }
    }
}

/// Says why a connection was cut, once it was; shared by what cuts it (the bounds) and the
/// connection, which says why a call failed.
#[derive(Clone)]
pub(crate) struct CutOff(Arc<Cut>);

struct Cut {
    server: String,
    why: OnceLock<McpCut>,
    /// The connection's: cancelled when it ends, for whatever reason.
    closed: CancellationToken,
}

impl CutOff {
    /// For server `server`'s connection, which `closed` ends.
    pub(crate) fn new(server: &str, closed: CancellationToken) -> Self {
        Self(Arc::new(Cut {
            server: server.to_string(),
            why: OnceLock::new(),
            closed,
        }))
    }

    /// What the server did that ended its connection, in words ("sent …"), if it was cut.
    pub(crate) fn why(&self) -> Option<String> {
        self.0.why.get().copied().map(what_it_did)
    }

    /// Ends the connection for `why`: the journal says so and it is counted, once; the call in
    /// flight fails, and so does every write to the server.
    pub(crate) fn cut(&self, why: McpCut) {
        if self.0.why.set(why).is_ok() {
            tracing::warn!(mcp_server = %self.0.server,
                "the MCP server {}: its connection is closed, and a call in flight fails",
                what_it_did(why));
            crate::metrics::mcp_connection_cut(&self.0.server, why);
        }
        self.0.closed.cancel();
    }
}

/// What a server did that got its connection cut for `why`.
fn what_it_did(why: McpCut) -> String {
    match why {
        McpCut::TooLarge => format!(
            "sent a message larger than {} KiB or of more than {CONTAINERS_MAX} JSON objects \
             and arrays",
            MESSAGE_MAX / 1024
        ),
        McpCut::NotReading => format!(
            "sent requests without reading the replies (more than {REPLIES_WAITING_MAX} \
             replies, or {} KiB of them, waited for it)",
            REPLIES_WAITING_BYTES_MAX / 1024
        ),
    }
}

/// A connection's transport, counting the replies that wait to be written.
pub(crate) struct Watched<T> {
    inner: T,
    waiting: Arc<Waiting>,
    cut_off: CutOff,
}

/// The replies that wait to be written, and their bytes.
#[derive(Default)]
struct Waiting {
    replies: AtomicUsize,
    bytes: AtomicUsize,
}

/// A reply not yet written: counted in [`Waiting`] until its send ends.
struct Owed {
    waiting: Arc<Waiting>,
    bytes: usize,
}

impl Drop for Owed {
    fn drop(&mut self) {
        self.waiting.replies.fetch_sub(1, Ordering::Relaxed);
        self.waiting.bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Why a send through [`Watched`] failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WatchedError<E> {
    #[error(transparent)]
    Transport(E),
    #[error("the connection to the MCP server was closed")]
    Closed,
}

impl<T> Watched<T> {
    /// `inner`, cut with `cut_off` once too many replies wait.
    pub(crate) fn new(inner: T, cut_off: CutOff) -> Self {
        Self {
            inner,
            waiting: Arc::default(),
            cut_off,
        }
    }

    /// Counts `item` in if it is a reply; cuts the connection if that is one too many.
    fn owe(&self, item: &TxJsonRpcMessage<RoleClient>) -> Option<Owed> {
        if !matches!(item, JsonRpcMessage::Response(_) | JsonRpcMessage::Error(_)) {
            return None;
        }
        let bytes = serde_json::to_vec(item).map_or(0, |text| text.len());
        let replies = self.waiting.replies.fetch_add(1, Ordering::Relaxed) + 1;
        let total = self.waiting.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if replies > REPLIES_WAITING_MAX || total > REPLIES_WAITING_BYTES_MAX {
            self.cut_off.cut(McpCut::NotReading);
        }
        Some(Owed {
            waiting: self.waiting.clone(),
            bytes,
        })
    }
}

impl<T: Transport<RoleClient>> Transport<RoleClient> for Watched<T> {
    type Error = WatchedError<T::Error>;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let owed = self.owe(&item);
        let closed = self.cut_off.0.closed.clone();
        let send = self.inner.send(item);
        async move {
            let _owed = owed;
            // A send that waits for a server that does not read ends with the connection: the
            // SDK waits for every send before it lets a connection go.
            tokio::select! {
                biased;
                () = closed.cancelled() => Err(WatchedError::Closed),
                sent = send => sent.map_err(WatchedError::Transport),
            }
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleClient>> {
        let closed = self.cut_off.0.closed.clone();
        tokio::select! {
            biased;
            () = closed.cancelled() => None,
            received = self.inner.receive() => received,
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        self.inner.close().await.map_err(WatchedError::Transport)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmcp::model::{ClientResult, NumberOrString};

    /// A server that reads nothing: every send waits for ever.
    struct Deaf;

    impl Transport<RoleClient> for Deaf {
        type Error = std::io::Error;

        fn send(
            &mut self,
            _item: TxJsonRpcMessage<RoleClient>,
        ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
            std::future::pending()
        }

        async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleClient>> {
            std::future::pending().await
        }

        async fn close(&mut self) -> Result<(), Self::Error> {
            Ok(())
        }
    }

    fn reply(id: &str) -> TxJsonRpcMessage<RoleClient> {
        JsonRpcMessage::response(ClientResult::empty(()), NumberOrString::String(id.into()))
    }

    fn deaf() -> (Watched<Deaf>, CutOff, CancellationToken) {
        let closed = CancellationToken::new();
        let cut_off = CutOff::new("test", closed.clone());
        (Watched::new(Deaf, cut_off.clone()), cut_off, closed)
    }

    /// Sends `item` in a task of its own, as the MCP SDK does.
    fn spawned(
        transport: &mut Watched<Deaf>,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> tokio::task::JoinHandle<Result<(), WatchedError<std::io::Error>>> {
        tokio::spawn(transport.send(item))
    }

    #[tokio::test]
    async fn replies_that_wait_are_bounded_and_the_waiting_sends_fail_once_cut() {
        let (mut transport, cut_off, closed) = deaf();
        let mut sends = Vec::new();
        for n in 0..REPLIES_WAITING_MAX {
            sends.push(spawned(&mut transport, reply(&n.to_string())));
        }
        tokio::task::yield_now().await;
        assert!(sends.iter().all(|send| !send.is_finished()));
        assert!(cut_off.why().is_none() && !closed.is_cancelled());
        sends.push(spawned(&mut transport, reply("one too many")));
        assert!(
            cut_off
                .why()
                .is_some_and(|why| why.contains("without reading the replies"))
        );
        for send in sends {
            assert!(matches!(send.await, Ok(Err(WatchedError::Closed))));
        }
        assert!(transport.receive().await.is_none());
    }

    #[tokio::test]
    async fn replies_that_were_written_are_not_counted_and_requests_never_are() {
        let (mut transport, cut_off, _) = deaf();
        for n in 0..3 * REPLIES_WAITING_MAX {
            // Dropped: the send ended.
            drop(transport.send(reply(&n.to_string())));
        }
        let ping = JsonRpcMessage::request(
            rmcp::model::ClientRequest::PingRequest(Default::default()),
            NumberOrString::Number(1),
        );
        let mut sends = Vec::new();
        for _ in 0..3 * REPLIES_WAITING_MAX {
            sends.push(spawned(&mut transport, ping.clone()));
        }
        assert!(cut_off.why().is_none());
    }

    #[tokio::test]
    async fn replies_that_wait_are_bounded_in_bytes_too() {
        let (mut transport, cut_off, _) = deaf();
        let long = "x".repeat(MESSAGE_MAX / 2);
        let mut sends = Vec::new();
        for _ in 0..7 {
            sends.push(spawned(&mut transport, reply(&long)));
        }
        assert!(cut_off.why().is_none());
        sends.push(spawned(&mut transport, reply(&long)));
        assert!(cut_off.why().is_some());
    }
}
