//! A session's transcript as turns read it back: the entries a turn commits, and what a resume
//! and every later turn make of them. An interrupted run leaves calls without results; a resume
//! must know which (to re-run or settle them), and every request must show each call with
//! exactly one result, whatever crashed when, since chat APIs refuse a call without one.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::endpoint::AnsweredBy;
use crate::agent::message::{Message, Role};
use crate::agent::model::Reply;
use crate::store::EVENT_ENTRY;
use crate::store::approval::{APPROVAL_ENTRY, ApprovalEntry};
use crate::store::states::ApprovalStatus;
use crate::usage::{Spent, Usage};

/// One model request of a turn, as its reply's entry records it (the console's steps and
/// timeline, docs/reference.md, "Console").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StepFacts {
    /// When the request was made (Unix milliseconds), waits for a model slot included.
    pub asked_at: i64,
    /// From then until the reply, outage waits included.
    pub took_ms: u64,
    /// The tokens the server reported; none: it reported no usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// For a reply without usage, the tokens estimated for it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub estimated_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What a message of agentgate's own is, as its entry records it (docs/reference.md,
/// "Console").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Mark {
    /// A resumed turn's note that its run was interrupted.
    Resumed,
    /// An event that joined the turn's event (the route's `coalesce`).
    Coalesced,
    /// The note before the turn's last model request (`runtime.max_turn_steps`).
    LastStep,
    /// Another note to the model: a reply that could not be used, or was empty.
    Note,
}

/// A transcript entry. Messages are what the model sees; a tool start marks a call as begun, so
/// a crash between start and result is visible afterwards. The event that starts a turn is
/// recorded by reference: its message is rendered again from the stored event with the prompt
/// template it was first rendered with, so the payload is kept once, in the event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Entry {
    Message {
        message: Message,
        /// For a model reply: the endpoint and model that answered.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answered_by: Option<AnsweredBy>,
        /// For a model reply: when it was asked for, how long it took and what it spent (none
        /// on replies recorded before steps were).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        step: Option<StepFacts>,
        /// For a message of agentgate's own: what it is (none on the model's and the tools'
        /// messages, and on notes recorded before marks were).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mark: Option<Mark>,
    },
    Event {
        event_id: String,
        /// The route's `prompt` template when the turn ran (a reload may change the route's).
        template: String,
        /// The nonce of the event's markers (none for events recorded before nonces were).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
    },
    ToolStart {
        call_id: String,
        name: String,
        arguments: Value,
        /// The call's idempotency key: the same when an interrupted call is run again.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        /// The MCP server the tool comes from, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mcp_server: Option<String>,
    },
    /// A call that waits for an operator's decision, and (a later entry) the decision.
    Approval(ApprovalEntry),
}

impl Entry {
    /// A message entry, with no endpoint recorded.
    pub(crate) fn message(message: Message) -> Entry {
        Entry::Message {
            message,
            answered_by: None,
            step: None,
            mark: None,
        }
    }

    /// A message of agentgate's own, marked as what it is.
    pub(crate) fn marked(message: Message, mark: Mark) -> Entry {
        Entry::Message {
            message,
            answered_by: None,
            step: None,
            mark: Some(mark),
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Entry::Message { .. } => "message",
            Entry::Event { .. } => EVENT_ENTRY,
            Entry::ToolStart { .. } => "tool_start",
            Entry::Approval(_) => APPROVAL_ENTRY,
        }
    }
}

/// The decisions recorded in `transcript` (requests still pending are left out).
pub(crate) fn decisions(transcript: &[Entry]) -> Vec<ApprovalEntry> {
    transcript
        .iter()
        .filter_map(|entry| match entry {
            Entry::Approval(approval) if approval.status != ApprovalStatus::Pending => {
                Some(approval.clone())
            }
            Entry::Approval(_)
            | Entry::Message { .. }
            | Entry::Event { .. }
            | Entry::ToolStart { .. } => None,
        })
        .collect()
}

/// A tool call the interrupted run asked for but has no recorded result.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct UnfinishedCall {
    pub call_id: String,
    pub name: String,
    pub arguments: String,
    /// Its start was recorded: it may have run, in part or in full.
    pub started: bool,
    /// The key its recorded start carried.
    pub key: Option<String>,
}

/// The calls in `transcript` (in order) that have no recorded result.
pub(crate) fn unfinished_calls(transcript: &[Entry]) -> Vec<UnfinishedCall> {
    let mut calls: Vec<UnfinishedCall> = Vec::new();
    for entry in transcript {
        match entry {
            Entry::Message { message, .. } if message.role == Role::Assistant => {
                calls.extend(message.tool_calls.iter().map(|call| UnfinishedCall {
                    call_id: call.id.clone(),
                    name: call.function.name.clone(),
                    arguments: call.function.arguments.clone(),
                    started: false,
                    key: None,
                }));
            }
            Entry::Message { message, .. } if message.role == Role::Tool => {
                calls.retain(|call| Some(&call.call_id) != message.tool_call_id.as_ref());
            }
            Entry::ToolStart { call_id, key, .. } => {
                for call in calls.iter_mut().filter(|call| &call.call_id == call_id) {
                    call.started = true;
                    call.key.clone_from(key);
                }
            }
            Entry::Message { .. } | Entry::Event { .. } | Entry::Approval(_) => {}
        }
    }
    calls
}

/// `messages` with a result for every call: a call of an assistant message that no tool message
/// answers before the conversation moves on (its turn failed, or was cancelled, mid-call) gets
/// one that says so, right after the results it has. Chat APIs refuse a call without a result,
/// and the model must not take an unanswered call for one that did nothing.
pub(crate) fn settle_unanswered(messages: Vec<Message>) -> Vec<Message> {
    let mut settled = Vec::with_capacity(messages.len());
    let mut open: Vec<String> = Vec::new();
    let close = |open: &mut Vec<String>, settled: &mut Vec<Message>| {
        for call_id in open.drain(..) {
            settled.push(Message::tool_result(&call_id, UNANSWERED_RESULT));
        }
    };
    for message in messages {
        match message.role {
            Role::Tool => {
                open.retain(|id| Some(id) != message.tool_call_id.as_ref());
            }
            Role::Assistant | Role::User | Role::System => {
                close(&mut open, &mut settled);
                open.extend(message.tool_calls.iter().map(|call| call.id.clone()));
            }
        }
        settled.push(message);
    }
    close(&mut open, &mut settled);
    settled
}

/// The result shown for a call of an earlier turn that recorded none.
const UNANSWERED_RESULT: &str =
    "no result was recorded: the turn ended before this call finished, so its outcome is unknown";

/// The result recorded for a non-idempotent call that was cut off while it ran.
pub(crate) fn interrupted_result(name: &str) -> String {
    format!(
        "interrupted: agentgate stopped while the tool {name:?} was running, so its outcome is unknown \
         (it may have completed, in part or in full). It was not run again because it is not marked \
         idempotent. Check its effect before you repeat it."
    )
}

/// The conversation messages among transcript entries (tool starts are bookkeeping).
pub(super) fn messages_of(entries: &[Entry]) -> Vec<Message> {
    entries
        .iter()
        .filter_map(|entry| match entry {
            Entry::Message { message, .. } => Some(message.clone()),
            Entry::ToolStart { .. } | Entry::Event { .. } | Entry::Approval(_) => None,
        })
        .collect()
}

/// The bytes of a model request's messages and of its reply: what a reply without usage is
/// estimated from (`usage::BYTES_PER_TOKEN`). Computed only for such replies.
pub(super) fn exchanged_bytes(messages: &[Message], reply: &Reply) -> u64 {
    if reply.usage.is_some() {
        return 0;
    }
    let bytes = |value: serde_json::Result<Vec<u8>>| value.map_or(0, |bytes| bytes.len() as u64);
    bytes(serde_json::to_vec(messages)) + bytes(serde_json::to_vec(&reply.message))
}

/// What a model reply leaves for the commit of its entry: its usage, its endpoint, and when it
/// was asked for and how long it took.
#[derive(Default)]
pub(super) struct ReplyFacts {
    pub(super) spent: Spent,
    pub(super) answered_by: Option<AnsweredBy>,
    pub(super) step: Option<StepFacts>,
}

impl ReplyFacts {
    /// Puts the endpoint and the step's facts on the reply's entry (the first assistant message
    /// among `entries`), and returns what the reply spent, which the same commit records.
    pub(super) fn attach(self, entries: &mut [Entry]) -> Spent {
        let assistant = entries.iter_mut().find_map(|entry| match entry {
            Entry::Message {
                message,
                answered_by,
                step,
                ..
            } if message.role == Role::Assistant => Some((answered_by, step)),
            Entry::Message { .. }
            | Entry::Event { .. }
            | Entry::ToolStart { .. }
            | Entry::Approval(_) => None,
        });
        if let Some((answered_by, step)) = assistant {
            *answered_by = self.answered_by;
            *step = self.step;
        }
        self.spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_no_result_answers_is_settled_before_the_conversation_goes_on() {
        let messages = vec![
            Message::text(Role::User, "go"),
            Message::asking_for("c1", "lookup", "{}"),
            Message::text(Role::User, "next"),
            Message::asking_for("c2", "lookup", "{}"),
            Message::tool_result("c2", "ok"),
            Message::asking_for("c3", "lookup", "{}"),
        ];
        let settled = settle_unanswered(messages);
        let shape: Vec<(Role, Option<&str>)> = settled
            .iter()
            .map(|m| (m.role, m.tool_call_id.as_deref()))
            .collect();
        assert_eq!(
            shape,
            [
                (Role::User, None),
                (Role::Assistant, None),
                (Role::Tool, Some("c1")),
                (Role::User, None),
                (Role::Assistant, None),
                (Role::Tool, Some("c2")),
                (Role::Assistant, None),
                (Role::Tool, Some("c3")),
            ]
        );
        assert!(
            settled[2]
                .content
                .as_deref()
                .is_some_and(|text| text.contains("no result was recorded"))
        );
    }
}
