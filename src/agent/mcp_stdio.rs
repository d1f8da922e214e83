//! What a stdio MCP server writes, bounded before the MCP SDK reads it.
//!
//! The SDK parses each line of a server's output whole, and a parsed message takes tens of
//! times its size in memory (a line of 10 MB of tiny content blocks took 600 MB): a server
//! that answers a call with such a line, or floods notifications, could take the daemon's
//! memory, and with it every route's. The SDK drops a line over its own limit (16 MiB) without
//! a word, and the call it answered would wait for its timeout. Here a line over
//! [`MESSAGE_MAX`] bytes, or of more than [`CONTAINERS_MAX`] objects and arrays (what a
//! parsed message's size follows), ends the connection at once instead: the call in flight
//! fails, and it, `status` and the journal say why ([`CutOff`]);
//! `agentgate_mcp_messages_too_large_total` counts it.
//! The HTTP transport gets the same bound from the SDK's own response limits (`mcp.rs`).
//!
//! The SDK also answers every request a server sends (a `ping`, say), and a reply that cannot
//! be written yet waits in memory with no bound: a server that sends requests without reading
//! its stdin would grow that queue until the call ends, or forever on the connection that lists
//! its tools. So the two ends are watched together ([`watched`]): more than [`SENT_UNREAD_MAX`]
//! messages, or [`SENT_UNREAD_BYTES_MAX`] bytes (a reply repeats its request's id, which may be
//! long), while a write to the server waits for it to read end the connection the same way
//! (`agentgate_mcp_servers_not_reading_total`).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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

/// The most messages a server may send while a write to it waits for it to read. A server
/// reads its stdin between calls and while it runs one, and a write waits only once 64 KiB
/// of it are unread (a pipe's buffer): a thousand replies to a server's requests, at most,
/// queue behind the one that waits.
pub(crate) const SENT_UNREAD_MAX: usize = 1024;

/// The most bytes a server may send while a write to it waits for it to read: a reply repeats
/// its request's id, and an id may be as long as a message.
pub(crate) const SENT_UNREAD_BYTES_MAX: usize = 4 * MESSAGE_MAX;

/// A server's output and its stdin, for the SDK's transport, and what says why they were cut:
/// the output fails once a line grows past [`MESSAGE_MAX`] bytes or [`CONTAINERS_MAX`] objects
/// and arrays, or once the server sent more than [`SENT_UNREAD_MAX`] messages or
/// [`SENT_UNREAD_BYTES_MAX`] bytes while a write to its stdin waited.
pub(crate) fn watched<R, W>(output: R, input: W, server: &str) -> (Bounded<R>, Watched<W>, CutOff) {
    let ends = Arc::new(Ends::default());
    let output = Bounded {
        inner: output,
        line: Line::default(),
        sent_while_waiting: Sent::default(),
        ends: ends.clone(),
        server: server.to_string(),
    };
    let cut_off = CutOff(ends.clone());
    (output, Watched { inner: input, ends }, cut_off)
}

/// Says why a connection was cut, once it was.
pub(crate) struct CutOff(Arc<Ends>);

impl CutOff {
    /// What the server did that ended its connection, in words ("sent …"), if it was cut.
    pub(crate) fn why(&self) -> Option<String> {
        self.0.cut.get().copied().map(what_it_did)
    }
}

/// What the two ends of a connection know of each other.
#[derive(Default)]
struct Ends {
    /// A write to the server waits for it to read.
    write_waits: AtomicBool,
    /// The bound the output broke: writes fail too, so that none waits on for a server that
    /// will not read (the SDK waits for every write before it lets the connection go).
    cut: OnceLock<McpCut>,
    /// Wakes the write that waits, once cut.
    writer: AtomicWaker,
}

/// A server's output, read through the bounds.
pub(crate) struct Bounded<R> {
    inner: R,
    line: Line,
    /// What was read since a write to the server started waiting.
    sent_while_waiting: Sent,
    ends: Arc<Ends>,
    server: String,
}

/// Messages and their bytes.
#[derive(Default)]
struct Sent {
    messages: usize,
    bytes: usize,
}

/// A server's stdin, telling its output's reader while a write waits for the server to read.
pub(crate) struct Watched<W> {
    inner: W,
    ends: Arc<Ends>,
}

/// What the line being read holds so far.
#[derive(Default)]
struct Line {
    bytes: usize,
    containers: usize,
    in_string: bool,
    escaped: bool,
}

impl Line {
    /// Counts `byte`, which is not a newline, in; false when the line is over a bound.
    fn take(&mut self, byte: u8) -> bool {
        self.bytes += 1;
        if self.in_string {
            match (self.escaped, byte) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => self.in_string = false,
                (false, _) => {}
            }
        } else {
            match byte {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.containers += 1,
                _ => {}
            }
        }
        self.bytes <= MESSAGE_MAX && self.containers <= CONTAINERS_MAX
    }
}

impl<R> Bounded<R> {
    /// Counts `read` (what one read returned) into the lines it continues and starts; the
    /// bound it breaks, if one. A newline ends a line (JSON text escapes the newlines of its
    /// strings), and a message.
    fn within_bounds(&mut self, read: &[u8]) -> Result<(), McpCut> {
        // Once over, the connection ends: the rest of `read` need not be counted.
        for &byte in read {
            if byte == b'\n' {
                let bytes = self.line.bytes;
                self.line = Line::default();
                self.count_message(bytes)?;
            } else if !self.line.take(byte) {
                return Err(McpCut::TooLarge);
            }
        }
        Ok(())
    }

    /// Counts a message of `bytes` in, if a write waits.
    fn count_message(&mut self, bytes: usize) -> Result<(), McpCut> {
        let sent = &mut self.sent_while_waiting;
        if self.ends.write_waits.load(Ordering::Relaxed) {
            sent.messages += 1;
            sent.bytes += bytes;
        } else {
            *sent = Sent::default();
        }
        if sent.messages > SENT_UNREAD_MAX || sent.bytes > SENT_UNREAD_BYTES_MAX {
            return Err(McpCut::NotReading);
        }
        Ok(())
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
            "sent more than {SENT_UNREAD_MAX} messages or {} KiB while it read nothing of \
             what was written to it",
            SENT_UNREAD_BYTES_MAX / 1024
        ),
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Bounded<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled
            && let Err(why) = this.within_bounds(&buf.filled()[before..])
        {
            tracing::warn!(mcp_server = %this.server,
                "the MCP server {}: its connection is closed, and a call in flight fails",
                what_it_did(why));
            crate::metrics::mcp_connection_cut(&this.server, why);
            // Set once: the read that failed ends the connection.
            let _ = this.ends.cut.set(why);
            this.ends.writer.wake();
            // A read that fails hands over nothing.
            buf.set_filled(before);
            return Poll::Ready(Err(io::Error::other("an MCP server over a bound")));
        }
        polled
    }
}

impl<W: AsyncWrite + Unpin> Watched<W> {
    /// Polls the write `poll` makes, unless the connection is cut, and notes whether it waits.
    fn write<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(Pin<&mut W>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        self.ends.writer.register(cx.waker());
        if self.ends.cut.get().is_some() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the connection to the MCP server was cut",
            )));
        }
        let polled = poll(Pin::new(&mut self.inner), cx);
        self.ends
            .write_waits
            .store(polled.is_pending(), Ordering::Relaxed);
        polled
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Watched<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .write(cx, |inner, cx| inner.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().write(cx, AsyncWrite::poll_flush)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn read_all(input: Vec<u8>) -> io::Result<usize> {
        let (mut reader, _stdin, _) = watched(input.as_slice(), tokio::io::sink(), "test");
        let mut sink = Vec::new();
        reader.read_to_end(&mut sink).await
    }

    #[tokio::test]
    async fn lines_up_to_the_bound_pass_and_a_longer_one_fails() {
        let mut fits = vec![b'x'; MESSAGE_MAX];
        fits.push(b'\n');
        fits.extend(vec![b'y'; MESSAGE_MAX]);
        fits.push(b'\n');
        assert_eq!(read_all(fits.clone()).await.ok(), Some(fits.len()));

        let mut over = b"{}\n".to_vec();
        over.extend(vec![b'x'; MESSAGE_MAX + 1]);
        over.push(b'\n');
        assert!(read_all(over).await.is_err());
    }

    #[tokio::test]
    async fn a_line_of_too_many_objects_fails_and_brackets_in_strings_do_not_count() {
        let many = |n: usize| format!("[{}]\n", vec!["{}"; n].join(",")).into_bytes();
        assert!(read_all(many(CONTAINERS_MAX - 1)).await.is_ok());
        assert!(read_all(many(CONTAINERS_MAX)).await.is_err());
        let quoted = format!(
            "[\"{}\\\"{}\"]\n",
            "{".repeat(CONTAINERS_MAX),
            "[".repeat(10)
        );
        assert!(read_all(quoted.into_bytes()).await.is_ok());
        let nested = format!("{}\n", "[".repeat(CONTAINERS_MAX + 1));
        assert!(read_all(nested.into_bytes()).await.is_err());
        // Each line counts on its own.
        let lines = many(CONTAINERS_MAX / 2).repeat(4);
        assert!(read_all(lines).await.is_ok());
    }

    #[tokio::test]
    async fn a_server_may_send_only_so_much_while_a_write_to_it_waits() {
        let messages = |n: usize| -> &'static [u8] { "{}\n".repeat(n).into_bytes().leak() };
        // The server's end of its stdin, never read: a write of more than its 16 bytes waits.
        let (_unread, stdin) = tokio::io::duplex(16);
        let (mut reader, mut writer, cut_off) =
            watched(messages(3 * SENT_UNREAD_MAX), stdin, "test");
        let mut read = Vec::new();
        // Nothing waits yet: any number of messages is read.
        assert!(reader.read_to_end(&mut read).await.is_ok());

        let mut write = Box::pin(writer.write_all(&[b'x'; 64]));
        assert!(futures::poll!(&mut write).is_pending());
        reader.inner = messages(SENT_UNREAD_MAX);
        assert!(reader.read_to_end(&mut read).await.is_ok());
        reader.inner = messages(1);
        let error = reader.read_to_end(&mut read).await.err();
        assert!(error.is_some_and(|error| error.to_string().contains("over a bound")));
        assert!(
            cut_off
                .why()
                .is_some_and(|why| why.contains("while it read nothing"))
        );
        // The write that waited fails, and so does any other.
        assert!(write.await.is_err());
        assert!(writer.write_all(b"x").await.is_err());
    }

    #[tokio::test]
    async fn a_server_may_send_only_so_many_bytes_while_a_write_to_it_waits() {
        let long = |n: usize| -> &'static [u8] {
            let line = format!("{{\"id\":\"{}\"}}\n", "x".repeat(MESSAGE_MAX / 2));
            line.repeat(n).into_bytes().leak()
        };
        let (_unread, stdin) = tokio::io::duplex(16);
        let (mut reader, mut writer, _) = watched(long(7), stdin, "test");
        let mut write = Box::pin(writer.write_all(&[b'x'; 64]));
        assert!(futures::poll!(&mut write).is_pending());
        let mut read = Vec::new();
        assert!(reader.read_to_end(&mut read).await.is_ok());
        reader.inner = long(1);
        assert!(reader.read_to_end(&mut read).await.is_err());
    }
}
