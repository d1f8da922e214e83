//! Request bodies an answer did not need, read to their end on HTTP/2.
//!
//! A webhook can be refused from its headers alone (`413` from `content-length`, `401`, `404`),
//! and its body is then never read. On HTTP/1.1 the connection closes after the answer. On
//! HTTP/2 the stream would be reset after the answer (`RST_STREAM` with `NO_ERROR`, which
//! RFC 9113 §8.1 allows), and common clients (curl 7.88, Python's h2) report that reset as a
//! framing error and never show the answer. So on HTTP/2 a body dropped before its end is read
//! to its end in the background and thrown away, bounded in bytes, in time and in how many are
//! read at once; past those bounds the stream is reset as before. Nothing of it is kept: each
//! frame is released as it arrives, so this costs bandwidth, never memory.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::Semaphore;

/// Bytes of one unneeded body read and thrown away before its stream is reset instead.
const DISCARD_BYTES: usize = 16 * 1024 * 1024;
/// How long one unneeded body is read before its stream is reset instead.
const DISCARD_TIME: Duration = Duration::from_secs(10);
/// Unneeded bodies read at once, across all connections.
static DISCARDING: Semaphore = Semaphore::const_new(64);

/// A request body that, dropped before its end on HTTP/2, is read to its end and discarded.
pub(super) struct Unread<B: Body<Data = Bytes> + Unpin + Send + 'static> {
    body: Option<B>,
    http2: bool,
}

impl<B: Body<Data = Bytes> + Unpin + Send + 'static> Unread<B> {
    pub(super) fn new(body: B, version: http::Version) -> Unread<B> {
        Unread {
            body: Some(body),
            http2: version == http::Version::HTTP_2,
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin + Send + 'static> Body for Unread<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.body.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl<B: Body<Data = Bytes> + Unpin + Send + 'static> Drop for Unread<B> {
    fn drop(&mut self) {
        let Some(body) = self.body.take() else {
            return;
        };
        if !self.http2 || body.is_end_stream() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(permit) = DISCARDING.try_acquire() else {
            return;
        };
        runtime.spawn(async move {
            let _permit = permit;
            let _ = tokio::time::timeout(DISCARD_TIME, discard(body)).await;
        });
    }
}

/// Reads `body` to its end, or to [`DISCARD_BYTES`], keeping nothing.
async fn discard<B: Body<Data = Bytes> + Unpin>(mut body: B) {
    let mut left = DISCARD_BYTES;
    while let Some(Ok(frame)) = body.frame().await {
        let size = frame.data_ref().map_or(0, Bytes::len);
        left = left.saturating_sub(size);
        if left == 0 {
            return;
        }
    }
}
