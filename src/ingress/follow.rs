//! A session followed as it commits: a response body that carries what changes in a session as
//! it is committed, for the console's live transcript (server-sent events, `console/live.rs`)
//! and `agentgate sessions follow` (`GET /v1/sessions/{key}/follow`, lines of JSON). Both read
//! the store when a commit of the session rings (`store::Commits`), and on the fallback poll only
//! where other nodes commit too: a quiet session costs no reads.
//!
//! Each stream holds a control connection, so at most `MAX_STREAMS` run at once over both (the
//! rest of the control socket stays free for the operator's commands), and each ends after
//! `STREAM_FOR`; the browser or the command then reconnects on its own.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, mpsc};

use super::console::{ConsoleResponse, boxed};
use super::control::no_session;
use crate::store::{Store, StoreError, TranscriptRow};

/// Sessions followed at once, over every browser and command.
pub(super) const MAX_STREAMS: usize = 16;
/// A keepalive after this long without a change, so that proxies keep the stream open and a
/// reader that went away is noticed.
const KEEPALIVE: Duration = Duration::from_secs(15);
/// How long one stream runs before its reader is asked to reconnect.
const STREAM_FOR: Duration = Duration::from_secs(600);

/// What one kind of stream sends of a session's changes.
pub(super) trait Changes: Send + 'static {
    /// What is sent after `KEEPALIVE` without a change.
    const KEEPALIVE: &'static [u8];

    /// The frames of what changed in session `key` since the last read (which moves on).
    fn read(
        &mut self,
        store: &Store,
        key: &str,
    ) -> impl Future<Output = Result<Vec<Bytes>, StoreError>> + Send;
}

/// The slots of the streams running (`MAX_STREAMS`).
pub(super) struct Streams(Arc<Semaphore>);

impl Streams {
    pub(super) fn new() -> Streams {
        Streams(Arc::new(Semaphore::new(MAX_STREAMS)))
    }

    /// A stream of session `key`'s `changes` as `content_type`: `404` for an unknown session,
    /// `503` with `busy` when every slot is taken.
    pub(super) async fn follow(
        &self,
        store: &Store,
        key: &str,
        changes: impl Changes,
        content_type: &'static str,
        busy: &str,
    ) -> ConsoleResponse {
        match store.session(key).await {
            Ok(Some(_)) => {}
            Ok(None) => return boxed(no_session(key)),
            Err(err) => {
                return boxed(super::response::error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &err.to_string(),
                ));
            }
        }
        let Ok(permit) = self.0.clone().try_acquire_owned() else {
            return boxed(super::response::unavailable_for(
                &format!("{MAX_STREAMS} sessions are followed already; {busy}"),
                30,
            ));
        };
        let (sender, receiver) = mpsc::channel(8);
        tokio::spawn(send_changes(
            store.clone(),
            key.to_string(),
            changes,
            sender,
            permit,
        ));
        let mut response = Response::new(Stream(receiver).boxed_unsync());
        let headers = response.headers_mut();
        for (name, value) in [
            (http::header::CONTENT_TYPE, content_type),
            (http::header::CACHE_CONTROL, "no-store"),
            (http::header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ] {
            headers.insert(name, HeaderValue::from_static(value));
        }
        response
    }
}

/// Sends `key`'s changes to `sender` until the reader goes away, the stream has run
/// `STREAM_FOR`, or the store cannot be read.
pub(super) async fn send_changes<C: Changes>(
    store: Store,
    key: String,
    mut changes: C,
    sender: mpsc::Sender<Bytes>,
    _permit: OwnedSemaphorePermit,
) {
    let ends = tokio::time::Instant::now() + STREAM_FOR;
    // Before the first read, so that no commit after it goes unheard.
    let mut commits = store.commits().subscribe();
    let fallback = store.commits().fallback_poll();
    loop {
        let Ok(frames) = changes.read(&store, &key).await else {
            return;
        };
        for frame in frames {
            if sender.send(frame).await.is_err() {
                return;
            }
        }
        loop {
            tokio::select! {
                () = sender.closed() => return,
                () = tokio::time::sleep_until(ends) => return,
                changed = next_commit(&mut commits, &key, fallback) => if changed {
                    break;
                } else {
                    return;
                },
                () = tokio::time::sleep(KEEPALIVE) => {
                    let keepalive = Bytes::from_static(C::KEEPALIVE);
                    if sender.send(keepalive).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// Waits for a commit of session `key` (or one that may have been: more were rung than the
/// receiver kept), or for the fallback poll's period; `false` when nothing can ring any more.
async fn next_commit(
    commits: &mut broadcast::Receiver<Arc<str>>,
    key: &str,
    fallback: Option<Duration>,
) -> bool {
    let poll = async {
        match fallback {
            Some(period) => tokio::time::sleep(period).await,
            None => std::future::pending().await,
        }
    };
    let rung = async {
        loop {
            match commits.recv().await {
                Ok(rung) if *rung == *key => return true,
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => return true,
                Err(broadcast::error::RecvError::Closed) => return false,
            }
        }
    };
    tokio::select! {
        changed = rung => changed,
        () = poll => true,
    }
}

/// `GET /v1/sessions/{key}/follow[?after=SEQ]`, for `agentgate sessions follow`: each
/// transcript entry after `after` as a line of JSON (the row as `sessions show --json` shows
/// it), as it is committed; an empty line is a keepalive.
pub(super) struct EntryLines {
    pub(super) after: i64,
}

impl Changes for EntryLines {
    const KEEPALIVE: &'static [u8] = b"\n";

    async fn read(&mut self, store: &Store, key: &str) -> Result<Vec<Bytes>, StoreError> {
        crate::metrics::follow_read();
        let rows = crate::session::transcript(store, key, self.after).await?;
        self.after = rows.last().map_or(self.after, |row| row.seq);
        Ok(rows.iter().map(entry_line).collect())
    }
}

fn entry_line(row: &TranscriptRow) -> Bytes {
    let mut line = serde_json::to_vec(row).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// The response body: what `send_changes` sends, as it sends it.
struct Stream(mpsc::Receiver<Bytes>);

impl Body for Stream {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|chunk| Ok(Frame::data(chunk))))
    }
}
