//! The live transcript: `GET /console/sessions/{key}/live` is a stream of server-sent events,
//! one `entry` per transcript entry as it is committed and a `state` when the session's state
//! changes, for the session page's script. The stream resumes where the browser left off
//! (`Last-Event-ID` is the last entry's seq). How it follows the session, and the bound on
//! streams, are `ingress::follow`'s.

use bytes::Bytes;
use http::HeaderMap;
use serde::Serialize;

use super::entry::{self, CallNames};
use super::{Console, ConsoleResponse};
use crate::ingress::follow::Changes;
use crate::ingress::query::Query;
use crate::store::{SessionState, Store, StoreError, TranscriptRow};

/// The longest entry sent; a longer one is replaced by a note (the page has all of it).
const ENTRY_HTML_MAX: usize = 512 * 1024;

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

/// One transcript entry as the page's script shows it: rendered as the page renders it
/// (`entry::render`, every value escaped).
#[derive(Serialize)]
struct LiveEntry<'a> {
    seq: i64,
    n: i64,
    kind: &'a str,
    html: String,
    /// Whether the page offers a rewind and a fork at this entry.
    rerun: bool,
}

impl Console {
    /// The stream of session `key`'s transcript after `after`.
    pub(super) async fn live_transcript(&self, key: &str, after: i64) -> ConsoleResponse {
        let changes = LiveFrames {
            after,
            last_state: None,
            names: CallNames::default(),
        };
        self.streams
            .follow(
                &self.ops.store,
                key,
                changes,
                "text/event-stream",
                "reload the page later",
            )
            .await
    }
}

/// What the page's script is sent: the entries after `after`, and the state when it is not
/// `last_state`; `names` are the tools of the calls sent so far, for their results' cards.
struct LiveFrames {
    after: i64,
    last_state: Option<(SessionState, Option<String>)>,
    names: CallNames,
}

impl Changes for LiveFrames {
    const KEEPALIVE: &'static [u8] = b": keepalive\n\n";

    async fn read(&mut self, store: &Store, key: &str) -> Result<Vec<Bytes>, StoreError> {
        crate::metrics::console_live_read();
        let rows = crate::session::transcript(store, key, self.after).await?;
        let mut frames: Vec<Bytes> = rows
            .iter()
            .map(|row| entry_frame(row, &mut self.names))
            .collect();
        self.after = rows.last().map_or(self.after, |row| row.seq);
        crate::metrics::console_live_read();
        if let Some(session) = store.session(key).await? {
            let state = (session.state, session.reason);
            if self.last_state.as_ref() != Some(&state) {
                frames.push(state_frame(&state));
                self.last_state = Some(state);
            }
        }
        Ok(frames)
    }
}

fn entry_frame(row: &TranscriptRow, names: &mut CallNames) -> Bytes {
    let mut html = entry::render(row, names);
    if html.len() > ENTRY_HTML_MAX {
        html = format!(
            "<p class=\"meta\">#{} is too long to show here: reload the page to see it</p>",
            row.n
        );
    }
    let entry = LiveEntry {
        seq: row.seq,
        n: row.n,
        kind: &row.kind,
        html,
        rerun: entry::is_rerun_point(row),
    };
    let data = serde_json::to_string(&entry).unwrap_or_default();
    Bytes::from(format!("id: {}\nevent: entry\ndata: {data}\n\n", row.seq))
}

fn state_frame(state: &(SessionState, Option<String>)) -> Bytes {
    let data = serde_json::json!({"state": state.0.sql(), "reason": state.1});
    Bytes::from(format!("event: state\ndata: {data}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StoreSettings;
    use crate::ingress::follow::{MAX_STREAMS as STREAMS, send_changes};
    use crate::store::{Claim, DedupWindow, Event, NewEvent};
    use crate::usage::Spent;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::sync::{Semaphore, mpsc};

    async fn step(store: &Store, key: &str, turn_id: &str, text: &str) {
        let body = serde_json::json!({"kind": "message", "message": {"role": "assistant", "content": text}});
        store
            .append_transcript(
                key,
                turn_id,
                vec![("message", body.to_string())],
                1,
                Spent::default(),
            )
            .await
            .expect("a step commits");
    }

    /// The next frame that is not a keepalive.
    async fn next_frame(stream: &mut mpsc::Receiver<Bytes>) -> String {
        loop {
            let frame = stream.recv().await.expect("the stream runs");
            let frame = String::from_utf8_lossy(&frame).to_string();
            if !frame.starts_with(": keepalive") {
                return frame;
            }
        }
    }

    /// Sixteen live transcripts of a quiet session read nothing, however long they wait (in
    /// paused time), nor when another session commits; a step of their session reaches each
    /// at once after its commit, before any poll could have found it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn live_transcripts_read_the_store_only_when_their_session_commits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&StoreSettings::Sqlite, dir.path())
            .await
            .expect("open");
        for key in ["watched", "other"] {
            let event = Event {
                id: format!("e-{key}"),
                route: "r".into(),
                session_key: key.into(),
                event_type: String::new(),
                delivery_id: None,
                headers: "{}".into(),
                trace_parent: None,
                payload: b"{}".to_vec(),
            };
            let accepted = store
                .accept(NewEvent {
                    event,
                    dedup_window: DedupWindow(Duration::MAX),
                })
                .await;
            accepted.expect("accept");
        }
        let turns = store.claim_turns(Claim::Beside(2)).await.expect("claim");
        let turn = |key: &str| {
            let turn = turns.iter().find(|turn| turn.event.session_key == key);
            turn.map(|turn| turn.turn_id.clone()).expect("claimed")
        };
        step(&store, "watched", &turn("watched"), "first").await;
        let slots = Arc::new(Semaphore::new(STREAMS));
        let mut streams = Vec::new();
        for _ in 0..STREAMS {
            let (sender, receiver) = mpsc::channel(8);
            let permit = slots.clone().try_acquire_owned().expect("a slot");
            let changes = LiveFrames {
                after: i64::MIN,
                last_state: None,
                names: CallNames::default(),
            };
            let task = send_changes(store.clone(), "watched".into(), changes, sender, permit);
            tokio::spawn(task);
            streams.push(receiver);
        }
        for stream in &mut streams {
            assert!(next_frame(stream).await.contains("first"));
            assert!(next_frame(stream).await.contains("event: state"));
        }
        let opened = crate::metrics::console_live_reads();

        tokio::time::sleep(Duration::from_secs(120)).await;
        step(&store, "other", &turn("other"), "elsewhere").await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            crate::metrics::console_live_reads(),
            opened,
            "a quiet session reads nothing"
        );

        step(&store, "watched", &turn("watched"), "second").await;
        for stream in &mut streams {
            let shown = tokio::time::timeout(Duration::from_millis(50), next_frame(stream)).await;
            assert!(shown.expect("shown at once").contains("second"));
        }
        assert_eq!(
            crate::metrics::console_live_reads(),
            opened + 2 * STREAMS as u64,
            "one read of the transcript and one of the state per stream"
        );
    }
}
