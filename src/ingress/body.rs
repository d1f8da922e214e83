//! Reading request bodies with bounded memory.
//!
//! A webhook's signature can only be checked once its whole body is in memory, so an
//! unauthenticated sender decides how much memory its request holds, and for how long (up to
//! the body timeout). Each body is read into a buffer that grows with what actually arrived,
//! never with what `Content-Length` promised. The first [`SMALL_BODY`] bytes of any body are
//! read freely: nearly every webhook fits, and a crowd of stalled connections that each sent a
//! little costs little. A body larger than that needs one of [`LARGE_BODY_SLOTS`] slots before
//! more of it is read; while it waits, nothing more is read and the sender is held back by TCP.
//! So stalled large bodies hold at most `LARGE_BODY_SLOTS × max_body` between them (64 MiB at
//! the default `max_body`), where they could otherwise hold `max_connections × max_body`, and
//! they never delay a small webhook. See docs/reference.md, "Threat model".

use std::sync::atomic::{AtomicBool, Ordering};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Limited};
use tokio::sync::Semaphore;

/// Bytes of a body read without a large-body slot.
pub(super) const SMALL_BODY: usize = 16 * 1024;
/// Bodies larger than [`SMALL_BODY`] read at once.
pub(super) const LARGE_BODY_SLOTS: usize = 64;

/// Why a body could not be read.
#[derive(Debug)]
pub(super) enum BodyError {
    /// Larger than the route's `max_body`.
    TooLarge,
    /// The connection failed while the body arrived.
    Unreadable,
}

/// The large-body slots of one listener.
pub(super) struct BodySlots(Semaphore);

impl BodySlots {
    pub(super) fn new() -> BodySlots {
        BodySlots(Semaphore::new(LARGE_BODY_SLOTS))
    }

    /// Reads `body` (at most `limit` bytes; `declared` is its `Content-Length`, if any),
    /// with `waiting` set while it waits for a slot: should the body timeout cut it off then,
    /// the server, not the sender, was the bottleneck.
    pub(super) async fn read<B>(
        &self,
        body: B,
        limit: usize,
        declared: Option<u64>,
        waiting: &AtomicBool,
    ) -> Result<Bytes, BodyError>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let mut body = std::pin::pin!(Limited::new(body, limit));
        // The chunks as they arrived: a body of one chunk (nearly every webhook) is never copied.
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut received = 0;
        // `Some` once the body has waited for its slot (and holds it until the body is read).
        let mut slot = None;
        // A body that says it is large waits for its slot before any of it is read.
        let large = |length: u64| usize::try_from(length).map_or(true, |n| n > SMALL_BODY);
        if declared.is_some_and(large) {
            slot = Some(self.wait(waiting).await);
        }
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| {
                if err
                    .downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    BodyError::TooLarge
                } else {
                    BodyError::Unreadable
                }
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            received += data.len();
            if slot.is_none() && received > SMALL_BODY {
                slot = Some(self.wait(waiting).await);
            }
            chunks.push(data);
        }
        Ok(match chunks.len() {
            0 => Bytes::new(),
            1 => chunks.swap_remove(0),
            _ => {
                let mut body = BytesMut::with_capacity(received);
                for chunk in chunks {
                    body.extend_from_slice(&chunk);
                }
                body.freeze()
            }
        })
    }

    async fn wait(&self, waiting: &AtomicBool) -> Option<tokio::sync::SemaphorePermit<'_>> {
        waiting.store(true, Ordering::Relaxed);
        // The semaphore is never closed; were it, the body would be read without a slot.
        let permit = self.0.acquire().await.ok();
        waiting.store(false, Ordering::Relaxed);
        permit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[tokio::test]
    async fn a_large_body_waits_for_a_slot_and_a_small_one_does_not() {
        let slots = BodySlots::new();
        let taken = slots.0.acquire_many(LARGE_BODY_SLOTS as u32).await;
        assert!(taken.is_ok());
        let waiting = AtomicBool::new(false);
        let large = Full::new(Bytes::from(vec![b' '; SMALL_BODY + 1]));
        let read = slots.read(large, 1 << 20, Some(SMALL_BODY as u64 + 1), &waiting);
        let timed_out = tokio::time::timeout(std::time::Duration::from_millis(50), read).await;
        assert!(timed_out.is_err(), "a large body was read without a slot");
        assert!(waiting.load(Ordering::Relaxed));

        // Undeclared length: the slot is needed once the body grows past SMALL_BODY.
        let waiting = AtomicBool::new(false);
        let unsized_large = Full::new(Bytes::from(vec![b' '; SMALL_BODY + 1]));
        let read = slots.read(unsized_large, 1 << 20, None, &waiting);
        let timed_out = tokio::time::timeout(std::time::Duration::from_millis(50), read).await;
        assert!(timed_out.is_err(), "a large body was read without a slot");
        assert!(waiting.load(Ordering::Relaxed));

        let small = Full::new(Bytes::from_static(b"{\"small\":true}"));
        let waiting = AtomicBool::new(false);
        let read = slots.read(small, 1 << 20, Some(14), &waiting);
        assert_eq!(
            read.await.ok(),
            Some(Bytes::from_static(b"{\"small\":true}"))
        );
        drop(taken);
    }

    /// A body that arrives in several chunks, as a chunked upload does.
    struct Chunks(std::collections::VecDeque<Bytes>);

    impl hyper::body::Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Ready(
                self.0
                    .pop_front()
                    .map(|chunk| Ok(hyper::body::Frame::data(chunk))),
            )
        }
    }

    #[tokio::test]
    async fn chunks_are_joined_in_order() {
        let slots = BodySlots::new();
        let chunks = Chunks(
            [&b"{\"a\":"[..], b"[1,", b"2]}"]
                .into_iter()
                .map(Bytes::from_static)
                .collect(),
        );
        let read = slots
            .read(chunks, 1 << 20, None, &AtomicBool::new(false))
            .await;
        assert_eq!(read.ok(), Some(Bytes::from_static(b"{\"a\":[1,2]}")));
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_too_large() {
        let slots = BodySlots::new();
        let body = Full::new(Bytes::from(vec![b' '; 100]));
        let read = slots.read(body, 10, None, &AtomicBool::new(false)).await;
        assert!(matches!(read, Err(BodyError::TooLarge)));
    }
}
