//! `agentgate what-if`: a recorded event's turn run again under another config, with no side
//! effect, to compare the two runs.
//!
//! The turn is decided by the same state machine, conversation and tool checks as a real turn
//! (`runner` builds them for both); only what executes the machine's actions differs. Nothing is
//! committed, no delivery is queued, and no tool process is ever started: a call that the
//! recorded turn made with the same tool and arguments gets the result it got then, and any
//! other call is not run, the model being told that its outcome is unknown. Calls of gated tools
//! are never asked for: they are answered from the recording as well, or not run.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;
use serde_json::Value;

use super::runner::{grouped_by_event, machine_for, message_cap, opening};
use super::transcript::{exchanged_bytes, messages_of};
use super::turn::{Action, Entry, Input, Outcome, TurnMachine};
use super::{history, prompt};
use crate::agent::catalog::{Catalog, OfferedTool};
use crate::agent::mcp::McpServers;
use crate::agent::message::{Message, Role};
use crate::agent::model::{Attempt, Model, ModelError, ToolUse};
use crate::config::{McpServerSettings, McpTransport, RouteSettings, Settings, ToolRef};
use crate::store::{EVENT_ENTRY, Event, EventStatus, Store, StoreError, TranscriptRow};
use crate::telemetry::Span;
use crate::usage::{Price, Spent, UsageReport};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// One recorded event, as the snapshot holds it: what it was, the session's turns before it,
/// and what its own turn did.
pub(crate) struct Recording {
    pub(crate) event: Event,
    status: EventStatus,
    /// The session's earlier turns, grouped by event, oldest first (resolved as a turn sees
    /// them).
    history: Vec<Vec<Entry>>,
    /// The entries of this event's turn (and of its resumes).
    entries: Vec<Entry>,
    steps: u32,
    usage: UsageReport,
}

/// What became of a tool call in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum CallResult {
    /// The recorded turn ran it.
    Ran,
    /// The what-if run got the result the recorded turn got for the same call.
    Recorded,
    /// The what-if run did not run it: its outcome was unknown to the model.
    NotRun,
}

/// One tool call of a run, in the order the run made it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct CallReport {
    pub(crate) name: String,
    pub(crate) arguments: Value,
    pub(crate) result: CallResult,
}

/// A run of an event's turn, recorded or new (docs/reference.md, "what-if").
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Run {
    pub(crate) status: String,
    /// The final answer of a completed run.
    pub(crate) answer: Option<String>,
    pub(crate) tool_calls: Vec<CallReport>,
    pub(crate) steps: u32,
    pub(crate) usage: UsageReport,
    /// Why a failed run failed, for the text report.
    #[serde(skip)]
    pub(crate) error: Option<String>,
    /// What the run could not offer or do as the daemon would, for the text report.
    #[serde(skip)]
    pub(crate) notes: Vec<String>,
}

impl Run {
    /// Tokens, input and output, that it spent.
    pub(crate) fn tokens(&self) -> u64 {
        self.usage.input_tokens + self.usage.output_tokens
    }

    /// Whether `other` ended differently: its status, its answer or the calls it made.
    pub(crate) fn differs_from(&self, other: &Run) -> bool {
        let calls = |run: &Run| -> Vec<(String, Value)> {
            run.tool_calls
                .iter()
                .map(|call| (call.name.clone(), call.arguments.clone()))
                .collect()
        };
        self.status != other.status || self.answer != other.answer || calls(self) != calls(other)
    }

    fn failed(error: String, notes: Vec<String>) -> Run {
        Run {
            status: EventStatus::Failed.to_string(),
            answer: None,
            tool_calls: Vec::new(),
            steps: 0,
            usage: UsageReport::default(),
            error: Some(error),
            notes,
        }
    }
}

/// The recorded event `event_id` from the snapshot `store`: `Ok(None)` when there is no such
/// event, `Err` text when it has no recorded turn to compare with.
pub(crate) async fn recording(
    store: &Store,
    event_id: &str,
    price: Option<&Price>,
) -> Result<Option<Result<Recording, String>>, StoreError> {
    let Some(detail) = store.event(event_id).await? else {
        return Ok(None);
    };
    let rows = store.transcript(&detail.event.session, i64::MIN).await?;
    let is_own_entry = |row: &TranscriptRow| {
        row.kind == EVENT_ENTRY
            && row.body.get("event_id").and_then(Value::as_str) == Some(event_id)
    };
    let Some(start) = rows.iter().position(is_own_entry) else {
        return Ok(Some(Err(format!(
            "event {event_id} has no recorded turn of its own (status {}; an event that \
             joined another's turn has none)",
            detail.event.status
        ))));
    };
    let mut rows = rows;
    prompt::resolve_event_rows(&mut rows[..start]);
    let mut own = rows.split_off(start);
    let Some(event) = own.first_mut().and_then(|row| row.event.take()) else {
        return Ok(Some(Err(format!("event {event_id} is no longer stored"))));
    };
    let entries = grouped_by_event(own).into_iter().next().unwrap_or_default();
    let steps = detail
        .turns
        .iter()
        .map(|turn| u32::try_from(turn.steps).unwrap_or(0))
        .sum();
    Ok(Some(Ok(Recording {
        event,
        status: detail.event.status,
        history: grouped_by_event(rows),
        entries,
        steps,
        usage: detail.usage.priced(price),
    })))
}

impl Recording {
    /// The recorded run: its event's status, the answer of its last reply, and every call it
    /// started.
    pub(crate) fn run(&self) -> Run {
        let messages = messages_of(&self.entries);
        let answer = match self.status {
            EventStatus::Completed => messages
                .iter()
                .rev()
                .find(|message| message.role == Role::Assistant)
                .and_then(Message::visible_text)
                .map(str::to_string),
            EventStatus::Queued
            | EventStatus::Running
            | EventStatus::AwaitingApproval
            | EventStatus::Joined
            | EventStatus::Failed
            | EventStatus::Abandoned
            | EventStatus::Suspended => None,
        };
        let tool_calls = self
            .started_calls()
            .map(|(name, arguments, _)| CallReport {
                name: name.to_string(),
                arguments: arguments.clone(),
                result: CallResult::Ran,
            })
            .collect();
        Run {
            status: self.status.to_string(),
            answer,
            tool_calls,
            steps: self.steps,
            usage: self.usage,
            error: None,
            notes: Vec::new(),
        }
    }

    /// The calls the recorded turn started, with the result each got (none when it was cut
    /// off), in order.
    fn started_calls(&self) -> impl Iterator<Item = (&str, &Value, Option<&str>)> {
        self.entries.iter().filter_map(|entry| match entry {
            Entry::ToolStart {
                call_id,
                name,
                arguments,
                ..
            } => {
                let result = self.entries.iter().find_map(|entry| match entry {
                    Entry::Message { message, .. }
                        if message.role == Role::Tool
                            && message.tool_call_id.as_ref() == Some(call_id) =>
                    {
                        message.content.as_deref()
                    }
                    Entry::Message { .. }
                    | Entry::Event { .. }
                    | Entry::ToolStart { .. }
                    | Entry::Approval(_) => None,
                });
                Some((name.as_str(), arguments, result))
            }
            Entry::Message { .. } | Entry::Event { .. } | Entry::Approval(_) => None,
        })
    }

    /// What the recorded turn got for a call of `name` with `arguments`, if it made one.
    fn recorded_result(&self, name: &str, arguments: &Value) -> Option<String> {
        self.started_calls()
            .filter(|(called, with, _)| *called == name && *with == arguments)
            .find_map(|(_, _, result)| result.map(str::to_string))
    }
}

/// What the model is told of a call that a what-if run does not run.
fn not_run_result(name: &str, gated: bool) -> String {
    let why = if gated {
        "it needs an operator's approval, which is never asked for here"
    } else {
        "the recorded turn did not make this call"
    };
    format!(
        "not run: this turn is a what-if run that starts no tool, and {why}, so the call of \
         {name:?} did not run and its outcome is unknown. Go on without its result."
    )
}

/// How long a what-if run waits for an MCP server over HTTP to answer its listing.
const MCP_LIST_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What what-if runs use: the config to try, its model, and its MCP servers over HTTP (whose
/// tools are listed, never called: a listing starts nothing). Servers that are processes
/// (stdio) are never started, so their tools are not offered.
pub(crate) struct Trial {
    settings: Settings,
    model: Model,
    servers: McpServers,
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Trial {
    /// Connects to the config's MCP servers over HTTP; must run within the async runtime.
    pub(crate) fn start(settings: Settings, model: Model) -> Trial {
        let tracker = TaskTracker::new();
        let stop = CancellationToken::new();
        let servers = McpServers::new(tracker.clone(), stop.clone());
        let remote: BTreeMap<String, McpServerSettings> = settings
            .config
            .mcp
            .iter()
            .filter(|(_, server)| is_remote(server))
            .map(|(name, server)| (name.clone(), server.clone()))
            .collect();
        servers.apply(&remote, &settings.config.hidden);
        Trial {
            settings,
            model,
            servers,
            tracker,
            stop,
        }
    }

    /// Disconnects from the MCP servers.
    pub(crate) async fn close(self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// The tools `route` offers in a what-if run, and a note for each MCP server whose tools
    /// are left out.
    async fn catalog(&self, route: &RouteSettings) -> (Catalog, Vec<String>) {
        let config = &self.settings.config;
        let mut notes = Vec::new();
        let mut listable = route.clone();
        listable.tools.retain(|entry| match entry {
            ToolRef::Command(_) => true,
            ToolRef::Mcp { server, .. } => {
                let remote = config.mcp.get(server).is_none_or(is_remote);
                let note = format!(
                    "the tools of MCP server {server:?} are not offered: it is a process, and \
                     what-if starts none"
                );
                if !remote && !notes.contains(&note) {
                    notes.push(note);
                }
                remote
            }
        });
        let (catalog, problems) =
            Catalog::for_route(&listable, config, &self.servers, MCP_LIST_WAIT).await;
        notes.extend(problems);
        (catalog, notes)
    }

    /// Runs the recorded event's turn again under the route of the same name, answering tool
    /// calls from the recording, and returns the new run.
    pub(crate) async fn rerun(&self, recorded: &Recording) -> Run {
        let (settings, event) = (&self.settings, &recorded.event);
        let Some(route) = settings.route(&event.route) else {
            let error = format!("route {} is not in the new config", event.route);
            return Run::failed(error, Vec::new());
        };
        let (catalog, notes) = self.catalog(route).await;
        let rendered = prompt::with_event_context(event, |context| {
            let system = settings.templates.system(context.route)?;
            let prompt = settings.templates.prompt(context)?;
            Ok::<_, String>((system, prompt))
        });
        let (system, prompt_text) = match rendered {
            Ok(texts) => texts,
            Err(error) => return Run::failed(error, notes),
        };
        let mut messages = opening(route, &system, recorded.history.clone(), 0);
        let turn_start = messages.len();
        let first = prompt::event_message(
            &event.route,
            &event.event_type,
            &event.id,
            &prompt_text,
            &prompt::new_nonce(),
        );
        messages.push(history::bounded(first, message_cap(route)));
        let runtime = &settings.config.runtime;
        let machine = machine_for(runtime, &catalog, messages, "what-if", turn_start);
        let mut run = self.drive(machine, &catalog, recorded).await;
        run.notes = notes;
        run
    }

    /// Carries out the machine's actions until it finishes: model requests to the new model,
    /// tool calls answered from the recording.
    async fn drive(
        &self,
        mut machine: TurnMachine,
        catalog: &Catalog,
        recorded: &Recording,
    ) -> Run {
        let mut actions: VecDeque<Action> = machine.start().into();
        let mut calls = Vec::new();
        let mut spent = Spent::default();
        let price = self.settings.config.model.price;
        while let Some(action) = actions.pop_front() {
            let input = match action {
                Action::Record(_) | Action::Refused(_) => continue,
                Action::Finish(outcome) => {
                    let (status, answer, error) = match outcome {
                        Outcome::Completed { output } => {
                            (EventStatus::Completed, Some(output), None)
                        }
                        Outcome::Failed { error } | Outcome::NoFinalAnswer { error, .. } => {
                            (EventStatus::Failed, None, Some(error))
                        }
                    };
                    return Run {
                        status: status.to_string(),
                        answer,
                        tool_calls: calls,
                        steps: machine.steps(),
                        usage: UsageReport::of(spent, price.as_ref()),
                        error,
                        notes: Vec::new(),
                    };
                }
                Action::CallModel { last_step } => {
                    let tool_use = if last_step {
                        ToolUse::Forbidden
                    } else {
                        ToolUse::Allowed
                    };
                    let messages = machine.messages();
                    ask(&self.model, messages, catalog.tools(), tool_use, &mut spent).await
                }
                Action::RunTool {
                    call_id,
                    name,
                    arguments,
                    ..
                } => answer(recorded, &mut calls, call_id, name, arguments, false),
                Action::AwaitApproval(call) => answer(
                    recorded,
                    &mut calls,
                    call.call_id,
                    call.name,
                    call.arguments,
                    true,
                ),
            };
            actions.extend(machine.on(input));
        }
        // The machine always ends with `Finish`; a run without one failed.
        Run::failed("the turn ended without an outcome".to_string(), Vec::new())
    }
}

/// Whether `server` is reached over the network (listing its tools starts no process).
fn is_remote(server: &McpServerSettings) -> bool {
    match server.transport {
        McpTransport::Http { .. } => true,
        McpTransport::Stdio { .. } => false,
    }
}

/// A call's result from the recording, or "not run"; the call goes into `calls`.
fn answer(
    recorded: &Recording,
    calls: &mut Vec<CallReport>,
    call_id: String,
    name: String,
    arguments: Value,
    gated: bool,
) -> Input {
    let (result, outcome) = match recorded.recorded_result(&name, &arguments) {
        Some(result) => (result, CallResult::Recorded),
        None => (not_run_result(&name, gated), CallResult::NotRun),
    };
    calls.push(CallReport {
        name,
        arguments,
        result: outcome,
    });
    Input::ToolFinished { call_id, result }
}

/// One model request, its usage added to `spent`. A model that is unavailable after its
/// retries fails the run at once: a what-if does not wait out an outage.
async fn ask(
    model: &Model,
    messages: &[Message],
    tools: &[OfferedTool],
    tool_use: ToolUse,
    spent: &mut Spent,
) -> Input {
    let (reply, _span) = model
        .complete(messages, tools, tool_use, &|_: &Attempt<'_>| Span::off())
        .await;
    match reply {
        Ok(reply) => {
            spent.add(Spent::of_reply(
                reply.usage,
                exchanged_bytes(messages, &reply),
            ));
            Input::ModelReplied(reply.message)
        }
        Err(ModelError::Malformed(reason)) => Input::ModelMalformed(reason),
        Err(err @ ModelError::Unavailable(_)) => Input::ModelUnavailable(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn start(call_id: &str, arguments: Value) -> Entry {
        Entry::ToolStart {
            call_id: call_id.to_string(),
            name: "lookup".to_string(),
            arguments,
            key: None,
            mcp_server: None,
        }
    }

    fn recording(entries: Vec<Entry>) -> Recording {
        Recording {
            event: Event {
                id: "e1".to_string(),
                route: "alerts".to_string(),
                session_key: "s".to_string(),
                event_type: String::new(),
                delivery_id: None,
                headers: "{}".to_string(),
                payload: b"{}".to_vec(),
                trace_parent: None,
            },
            status: EventStatus::Completed,
            history: Vec::new(),
            entries,
            steps: 3,
            usage: UsageReport::default(),
        }
    }

    #[test]
    fn the_recorded_run_has_its_started_calls_and_last_answer() {
        let entries = vec![
            Entry::message(Message::asking_for("c1", "lookup", r#"{"host":"a"}"#)),
            start("c1", json!({"host": "a"})),
            // Cut off: started, no result; then made again and answered.
            Entry::message(Message::asking_for("c2", "lookup", r#"{"host":"a"}"#)),
            start("c2", json!({"host": "a"})),
            Entry::message(Message::tool_result("c2", "found a")),
            Entry::message(Message::text(Role::Assistant, " a is fine ")),
        ];
        let recorded = recording(entries);
        let run = recorded.run();
        assert_eq!(run.status, "completed");
        assert_eq!(run.answer.as_deref(), Some("a is fine"));
        assert_eq!(run.tool_calls.len(), 2);
        assert!(
            run.tool_calls
                .iter()
                .all(|call| call.result == CallResult::Ran)
        );
        assert_eq!(
            recorded.recorded_result("lookup", &json!({"host": "a"})),
            Some("found a".to_string())
        );
        assert_eq!(
            recorded.recorded_result("lookup", &json!({"host": "b"})),
            None
        );
    }

    #[test]
    fn runs_differ_by_status_answer_or_calls_not_by_usage() {
        let run = recording(Vec::new()).run();
        let mut other = run.clone();
        other.steps = 9;
        other.usage.output_tokens = 100;
        assert!(!run.differs_from(&other));
        other.tool_calls.push(CallReport {
            name: "lookup".to_string(),
            arguments: json!({}),
            result: CallResult::Recorded,
        });
        assert!(run.differs_from(&other));
        let mut failed = run.clone();
        failed.status = "failed".to_string();
        assert!(run.differs_from(&failed));
    }
}
