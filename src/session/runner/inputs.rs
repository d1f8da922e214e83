//! What a turn's first model request is made of: the tools the route offers, the rendered system
//! and prompt texts, the events that joined the turn, the session's past turns, and where a
//! resumed turn continues. Each is read (or recorded) before the turn machine starts, so that the
//! loop in the parent module deals only with actions.

use super::{MCP_START_WAIT, READING, Running};
use crate::agent::catalog::Catalog;
use crate::agent::message::{Message, Role};
use crate::session::transcript::Mark;
use crate::session::turn::{Entry, Outcome};
use crate::session::{history, prompt};
use crate::store::{Continuation, EVENT_ENTRY, Event, TranscriptRow};
use crate::usage::Spent;

impl Running<'_> {
    /// The tools the route offers in this turn (an MCP server still starting is waited for).
    pub(super) async fn offered_tools(&self) -> Option<Catalog> {
        let offered = Catalog::for_route(
            self.route,
            &self.settings.config,
            &self.context.mcp,
            MCP_START_WAIT,
        );
        match self.guarded(offered).await {
            Ok((catalog, problems)) => {
                for problem in problems {
                    tracing::warn!(problem = %problem, "a tool of the route is not offered in this turn");
                }
                Some(catalog)
            }
            Err(stop) => {
                self.stopped(stop, 0).await;
                None
            }
        }
    }

    /// The route's `system` and `prompt` texts for this event; a template that fails ends the
    /// turn `failed` with the template's error.
    pub(super) async fn rendered_texts(&self) -> Option<(String, String)> {
        let templates = &self.settings.templates;
        let rendered = prompt::with_event_context(&self.turn.event, |context| {
            let system = templates.system(context.route)?;
            let prompt = templates.prompt(context)?;
            Ok::<_, String>((system, prompt))
        });
        match rendered {
            Ok(pair) => Some(pair),
            Err(error) => {
                self.context
                    .finish(self.turn, Outcome::Failed { error }, None, self.progress(0))
                    .await;
                None
            }
        }
    }

    /// A fresh turn's start, recorded before the first model request: its event's entry, and
    /// the message of each event that joined it. Returns the messages the turn starts with (the
    /// event, rendered from `prompt_text`, then the joined ones, in order); `None` when the
    /// turn stopped because the store could not record them.
    pub(super) async fn record_new_events(&self, prompt_text: &str) -> Option<Vec<Message>> {
        let event = &self.turn.event;
        let nonce = prompt::new_nonce();
        let joined: Vec<Message> = self
            .joined_events()
            .await?
            .iter()
            .map(|event| self.joined_message(event, &nonce))
            .collect();
        let mut entries = vec![Entry::Event {
            event_id: event.id.clone(),
            template: self.route.prompt.clone(),
            nonce: Some(nonce.clone()),
        }];
        entries.extend(
            joined
                .iter()
                .map(|message| Entry::marked(message.clone(), Mark::Coalesced)),
        );
        if !self.record(&entries, 0, Spent::default()).await {
            return None;
        }
        let first = prompt::event_message(
            &event.route,
            &event.event_type,
            &event.id,
            prompt_text,
            &nonce,
        );
        Some(std::iter::once(first).chain(joined).collect())
    }

    /// The events that joined this turn's event (the route's `coalesce`), oldest first: the
    /// session's queued events of the route that arrived within the window after it. `None`
    /// when the turn stopped because the store could not say.
    pub(super) async fn joined_events(&self) -> Option<Vec<Event>> {
        let Some(window) = self.route.coalesce else {
            return Some(Vec::new());
        };
        let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
        let head = &self.turn.event;
        self.context
            .retrying(
                "join the queued events of the session",
                |store| async move { store.join_queued(head, window_ms).await },
            )
            .await
    }

    /// The message a joined event adds to the turn: its rendered prompt inside the event
    /// markers, as its own turn would have shown it, or a note when its prompt does not render.
    pub(super) fn joined_message(&self, event: &Event, nonce: &str) -> Message {
        prompt::with_event_context(event, |context| self.settings.templates.prompt(context))
            .map(|prompt| {
                prompt::event_message(&event.route, &event.event_type, &event.id, &prompt, nonce)
            })
            .unwrap_or_else(|problem| {
                Message::text(
                    Role::User,
                    format!("[agentgate] event {} cannot be shown: {problem}", event.id),
                )
            })
    }

    /// The session's transcript entries from the first turn its history may show (the turns
    /// before it are not read: [`history::never_shown`]), grouped by event, oldest first, and
    /// how many turns were not read. A group starts with the entry of its event, and the
    /// resumes of that event continue it (a resumed run records no event entry of its own), so
    /// a call made in one run and re-run in a later one stays with its result, or is settled,
    /// whichever run was cut off. A rewind to a model reply continues the group of that reply
    /// the same way. Superseded entries are left out. `own_last`: the last group is this run's
    /// own (it continues it), not an earlier turn.
    pub(super) async fn past_turns(&self, own_last: bool) -> Option<(Vec<Vec<Entry>>, usize)> {
        let key = &self.turn.event.session_key;
        let limits = self.route.history;
        let (rows, skipped) = self
            .context
            .retrying(READING, |store| async move {
                let counted = usize::try_from(store.history_turns(key).await?).unwrap_or(0);
                let skipped = history::never_shown(counted.saturating_sub(own_last.into()), limits);
                let start = match i64::try_from(skipped) {
                    Ok(0) | Err(_) => None,
                    Ok(nth) => store.history_turn_start(key, nth).await?,
                };
                // Not that many turns after all (a rewind in between): all of them.
                let (after, skipped) = start.map_or((i64::MIN, 0), |seq| (seq - 1, skipped));
                let rows = crate::session::transcript(&store, key, after).await?;
                Ok((rows, skipped))
            })
            .await?;
        Some((grouped_by_event(rows), skipped))
    }

    /// Why this run continues an earlier one, if it does. A run cut off before it committed
    /// anything left nothing to resume from: it starts afresh.
    pub(super) async fn continues(&self) -> Option<Option<Continuation>> {
        let Some(reason) = self.turn.continues else {
            return Some(None);
        };
        let event_id = &self.turn.event.id;
        let recorded = self
            .context
            .retrying(READING, |store| async move {
                store.event_has_transcript(event_id).await
            })
            .await?;
        Some(recorded.then_some(reason))
    }
}

/// Transcript `rows` (resolved, oldest first) as entries grouped by event: a group starts with
/// the entry of its event, and the resumes of that event continue it.
pub(in crate::session) fn grouped_by_event(rows: Vec<TranscriptRow>) -> Vec<Vec<Entry>> {
    let mut turns: Vec<Vec<Entry>> = Vec::new();
    // Entries a rewind superseded are history no later turn sees.
    for row in rows.into_iter().filter(|row| row.superseded_by.is_none()) {
        // An event row's body is already the message the model saw; its kind still says
        // that a new event, and so a new group, starts here.
        let starts_group = row.kind == EVENT_ENTRY;
        let Ok(entry) = serde_json::from_value::<Entry>(row.body) else {
            continue;
        };
        match turns.last_mut() {
            Some(entries) if !starts_group => entries.push(entry),
            Some(_) | None => turns.push(vec![entry]),
        }
    }
    turns
}
