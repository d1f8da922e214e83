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
//! The HTTP transport gets the same bound from the SDK's own response limits (`mcp.rs`); the
//! replies a server leaves unread are bounded on both (`mcp_bounds.rs`).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, ReadBuf};

use super::mcp_bounds::{CONTAINERS_MAX, CutOff, MESSAGE_MAX, ServerPaces};
use super::pace::{Paced, PacedRead};
use crate::metrics::McpCut;

/// A server's output, for the SDK's transport: it fails once a line grows past
/// [`MESSAGE_MAX`] bytes or [`CONTAINERS_MAX`] objects and arrays, and `cut_off` says why; it is
/// read through the server's paces of bytes and lines (`mcp_bounds.rs`), which its other
/// readers share. Lines, not only the
/// messages the SDK hands on: it reads on past lines it cannot parse, empty ones and ones it
/// ignores, each at a cost, without returning.
pub(crate) fn bounded<R>(output: R, cut_off: CutOff, paces: &ServerPaces) -> Bounded<R> {
    Bounded {
        inner: PacedRead::sharing(output, &paces.bytes),
        line: Line::default(),
        lines: Paced::sharing(&paces.lines),
        cut_off,
    }
}

/// A server's output, read through the bounds.
pub(crate) struct Bounded<R> {
    inner: PacedRead<R>,
    line: Line,
    lines: Paced,
    cut_off: CutOff,
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
    /// Counts `read` (what one read returned) into the lines it continues and starts: how many
    /// it ended, or `None` once a line is over a bound. A newline ends a line (JSON text
    /// escapes the newlines of its strings), and a message.
    fn within_bounds(&mut self, read: &[u8]) -> Option<usize> {
        let mut ended = 0;
        // Once over, the connection ends: the rest of `read` need not be counted.
        for &byte in read {
            if byte == b'\n' {
                self.line = Line::default();
                ended += 1;
            } else if !self.line.take(byte) {
                return None;
            }
        }
        Some(ended)
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Bounded<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.lines.poll_ready(cx));
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        let Some(ended) = this.within_bounds(&buf.filled()[before..]) else {
            this.cut_off.cut(McpCut::TooLarge);
            // A read that fails hands over nothing.
            buf.set_filled(before);
            return Poll::Ready(Err(io::Error::other("an MCP server over a bound")));
        };
        this.lines.count(ended);
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::mcp_bounds::{BYTES_PER_SECOND, MESSAGES_PER_SECOND};
    use tokio::io::AsyncReadExt;
    use tokio_util::sync::CancellationToken;

    async fn read_all(input: Vec<u8>) -> io::Result<usize> {
        let cut_off = CutOff::new("test", CancellationToken::new());
        let mut reader = bounded(input.as_slice(), cut_off, &ServerPaces::default());
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

    /// What `bounded` reads of `output`, and in how many ms of the test's paused clock, which
    /// moves only when something waits.
    async fn read_paced<R: AsyncRead + Unpin>(output: R) -> (Option<u64>, u128) {
        let cut_off = CutOff::new("test", CancellationToken::new());
        let mut reader = bounded(output, cut_off, &ServerPaces::default());
        let started = tokio::time::Instant::now();
        let read = tokio::io::copy(&mut reader, &mut tokio::io::sink()).await;
        (read.ok(), started.elapsed().as_millis())
    }

    #[tokio::test(start_paused = true)]
    async fn output_is_read_at_the_pace_past_a_burst() {
        // Lines of 64 KiB: a hundred or so a second, far below the pace of lines.
        let line = format!("{}\n", "x".repeat(64 * 1024 - 1));
        let flood = line.repeat(usize::try_from(3 * BYTES_PER_SECOND).unwrap_or(0) / line.len());
        let (read, took) = read_paced(flood.as_bytes()).await;
        assert_eq!(read, Some(3 * BYTES_PER_SECOND));
        assert!((1_998..=2_001).contains(&took), "{took} ms");
    }

    /// Empty lines, which the SDK reads past without returning, are paced as lines.
    #[tokio::test(start_paused = true)]
    async fn lines_are_read_at_the_pace_past_a_burst() {
        let lines = MESSAGES_PER_SECOND;
        let (read, took) = read_paced(tokio::io::repeat(b'\n').take(3 * lines)).await;
        assert_eq!(read, Some(3 * lines));
        assert!((1_998..=2_001).contains(&took), "{took} ms");
    }
}
