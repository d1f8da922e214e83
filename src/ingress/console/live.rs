//! The live transcript: `GET /console/sessions/{key}/live` is a stream of server-sent events,
//! one `entry` per transcript entry as it is committed and a `state` when the session's state
//! changes, for the session page's script. The stream resumes where the browser left off
//! (`Last-Event-ID` is the last entry's seq).
//!
//! Each stream holds a control connection, so at most `MAX_LIVE_STREAMS` run at once (the rest
//! of the control socket stays free for the operator's commands), and each ends after
//! `STREAM_FOR`; the browser then reconnects on its own.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::state::MAX_LIVE_STREAMS;
use super::{ConsoleResponse, boxed};
use crate::ingress::control::{Control, no_session};
use crate::ingress::query::Query;
use crate::store::{Store, TranscriptRow};

/// How often a stream looks for new entries.
const POLL: Duration = Duration::from_millis(500);
/// A comment line after this long without an entry, so that proxies keep the stream open and a
/// closed browser is noticed.
const KEEPALIVE: Duration = Duration::from_secs(15);
/// How long one stream runs before the browser is asked to reconnect.
const STREAM_FOR: Duration = Duration::from_secs(600);
/// The longest entry text sent; a longer one is cut with a note (the page has all of it).
const ENTRY_TEXT_MAX: usize = 64 * 1024;

/// Where a stream starts: after the entry of `Last-Event-ID` (a reconnect), else after the
/// `after` the page was rendered with, else at the beginning.
pub(super) fn start_after(headers: &HeaderMap, query: Option<&str>) -> i64 {
    let header = headers
        .get("last-event-id")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse().ok());
    header
        .or_else(|| Query::parse(query).get("after")?.parse().ok())
        .unwrap_or(i64::MIN)
}

/// One transcript entry as the page's script shows it.
#[derive(Serialize)]
struct LiveEntry<'a> {
    seq: i64,
    kind: &'a str,
    turn_id: &'a str,
    created_at: String,
    text: String,
}

impl Control {
    /// The stream of session `key`'s transcript after `after`.
    pub(super) async fn live_transcript(&self, key: &str, after: i64) -> ConsoleResponse {
        match self.store.session(key).await {
            Ok(Some(_)) => {}
            Ok(None) => return boxed(no_session(key)),
            Err(err) => {
                return boxed(crate::ingress::response::error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &err.to_string(),
                ));
            }
        }
        let Some(permit) = self.console.live_slot() else {
            return boxed(crate::ingress::response::unavailable_for(
                &format!(
                    "{MAX_LIVE_STREAMS} live transcripts are followed already; reload the page later"
                ),
                30,
            ));
        };
        let (sender, receiver) = mpsc::channel(8);
        tokio::spawn(follow(
            self.store.clone(),
            key.to_string(),
            after,
            sender,
            permit,
        ));
        let mut response = Response::new(Stream(receiver).boxed_unsync());
        let headers = response.headers_mut();
        for (name, value) in [
            (http::header::CONTENT_TYPE, "text/event-stream"),
            (http::header::CACHE_CONTROL, "no-store"),
            (http::header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ] {
            headers.insert(name, HeaderValue::from_static(value));
        }
        response
    }
}

/// Sends `key`'s new entries and state changes to `sender` until the browser goes away, the
/// stream has run `STREAM_FOR`, or the store cannot be read.
async fn follow(
    store: Store,
    key: String,
    mut after: i64,
    sender: mpsc::Sender<Bytes>,
    _permit: OwnedSemaphorePermit,
) {
    let started = Instant::now();
    let mut last_sent = Instant::now();
    let mut last_state = None;
    while started.elapsed() < STREAM_FOR {
        let Ok(rows) = crate::session::transcript(&store, &key, after).await else {
            return;
        };
        let mut frames: Vec<Bytes> = rows.iter().map(entry_frame).collect();
        after = rows.last().map_or(after, |row| row.seq);
        if let Ok(Some(session)) = store.session(&key).await {
            let state = (session.state, session.reason);
            if last_state.as_ref() != Some(&state) {
                frames.push(state_frame(&state));
                last_state = Some(state);
            }
        }
        if frames.is_empty() && last_sent.elapsed() >= KEEPALIVE {
            frames.push(Bytes::from_static(b": keepalive\n\n"));
        }
        for frame in frames {
            if sender.send(frame).await.is_err() {
                return;
            }
            last_sent = Instant::now();
        }
        tokio::select! {
            () = sender.closed() => return,
            () = tokio::time::sleep(POLL) => {}
        }
    }
}

fn entry_frame(row: &TranscriptRow) -> Bytes {
    let mut text = serde_json::to_string_pretty(&row.body).unwrap_or_default();
    let left_out = crate::untrusted::cut(&mut text, ENTRY_TEXT_MAX);
    if left_out > 0 {
        text.push_str(&format!(
            "\n… {left_out} more bytes: reload the page to see them"
        ));
    }
    let entry = LiveEntry {
        seq: row.seq,
        kind: &row.kind,
        turn_id: &row.turn_id,
        created_at: crate::store::rfc3339(row.created_at),
        text,
    };
    let data = serde_json::to_string(&entry).unwrap_or_default();
    Bytes::from(format!("id: {}\nevent: entry\ndata: {data}\n\n", row.seq))
}

fn state_frame(state: &(crate::store::SessionState, Option<String>)) -> Bytes {
    let data = serde_json::json!({"state": state.0.sql(), "reason": state.1});
    Bytes::from(format!("event: state\ndata: {data}\n\n"))
}

/// The response body: what `follow` sends, as it sends it.
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
