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

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Limited};
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout_at};

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
    /// The sender did not send the body in time.
    TimedOut,
    /// No large-body slot came free in time: the server, not the sender, was the bottleneck.
    NoSlot,
}

/// The large-body slots of one listener.
pub(super) struct BodySlots(Semaphore);

impl BodySlots {
    pub(super) fn new() -> BodySlots {
        BodySlots(Semaphore::new(LARGE_BODY_SLOTS))
    }

    /// Reads `body`: at most `limit` bytes (`declared` is its `Content-Length`, if any), within
    /// `timeout`, waiting for a slot included.
    pub(super) async fn read<B>(
        &self,
        body: B,
        limit: usize,
        declared: Option<u64>,
        timeout: Duration,
    ) -> Result<Bytes, BodyError>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let deadline = Instant::now() + timeout;
        let mut body = std::pin::pin!(Limited::new(body, limit));
        // The chunks as they arrived: a body of one chunk (nearly every webhook) is never copied.
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut received = 0;
        // Held from the moment the body is known to be large until it is read.
        let mut slot = None;
        // A body that says it is large waits for its slot before any of it is read.
        if declared.is_some_and(|length| length > SMALL_BODY as u64) {
            slot = Some(self.wait(deadline).await?);
        }
        while let Some(frame) = timeout_at(deadline, body.frame())
            .await
            .map_err(|_| BodyError::TimedOut)?
        {
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
                slot = Some(self.wait(deadline).await?);
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

    async fn wait(&self, deadline: Instant) -> Result<Slot<'_>, BodyError> {
        match timeout_at(deadline, self.0.acquire()).await {
            Ok(Ok(permit)) => {
                crate::metrics::large_body_slots(1);
                Ok(Slot { _permit: permit })
            }
            // The semaphore is never closed.
            Ok(Err(_)) | Err(_) => Err(BodyError::NoSlot),
        }
    }
}

/// A large-body slot, counted in `agentgate_large_body_slots_in_use` while it is held.
struct Slot<'a> {
    /// Given back to the semaphore when the slot is dropped.
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        crate::metrics::large_body_slots(-1);
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
        let wait = Duration::from_millis(50);
        let large = Full::new(Bytes::from(vec![b' '; SMALL_BODY + 1]));
        let read = slots.read(large, 1 << 20, Some(SMALL_BODY as u64 + 1), wait);
        assert!(
            matches!(read.await, Err(BodyError::NoSlot)),
            "a large body was read without a slot"
        );

        // Undeclared length: the slot is needed once the body grows past SMALL_BODY.
        let unsized_large = Full::new(Bytes::from(vec![b' '; SMALL_BODY + 1]));
        let read = slots.read(unsized_large, 1 << 20, None, wait);
        assert!(
            matches!(read.await, Err(BodyError::NoSlot)),
            "a large body was read without a slot"
        );

        let small = Full::new(Bytes::from_static(b"{\"small\":true}"));
        let read = slots.read(small, 1 << 20, Some(14), wait);
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
            .read(chunks, 1 << 20, None, Duration::from_secs(1))
            .await;
        assert_eq!(read.ok(), Some(Bytes::from_static(b"{\"a\":[1,2]}")));
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_too_large() {
        let slots = BodySlots::new();
        let body = Full::new(Bytes::from(vec![b' '; 100]));
        let read = slots.read(body, 10, None, Duration::from_secs(1)).await;
        assert!(matches!(read, Err(BodyError::TooLarge)));
    }
}
