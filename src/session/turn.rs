//! The turn state machine: what happens next in a turn, with no I/O.
//!
//! The machine takes inputs (a model reply, a tool result) and returns actions (record this entry,
//! call the model, run this tool, finish). The runner executes the actions in order and commits
//! every `Record` before it executes the next action, which is what makes "every step committed"
//! hold. Keeping the decisions here makes every edge case (unknown tool, bad arguments, empty
//! reply, step limit) a plain unit test.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde_json::Value;

pub(crate) use super::transcript::Entry;
use super::transcript::{Mark, UnfinishedCall, interrupted_result};
use crate::agent::message::{Message, Role};
use crate::agent::textcall;
use crate::schema;
use crate::store::approval::ApprovalEntry;
use crate::store::{ApprovalStatus, StopReason, Terminal, TurnStatus};

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    Completed {
        output: String,
    },
    Failed {
        error: String,
    },
    /// The turn's last step gave no answer (only a tool call, in `tool_calls` or written as
    /// text, or nothing usable): it fails with an `error` that starts with [`NO_FINAL_ANSWER`]
    /// (and is exactly that unless the last reply could not be used), and its delivery carries
    /// what the turn's tool calls returned (`found`), never the reply as if it answered.
    NoFinalAnswer {
        error: String,
        /// What the last step gave instead, for the journal.
        why: String,
        found: Option<String>,
    },
}

/// The error of a turn whose last step gave no answer.
pub(crate) const NO_FINAL_ANSWER: &str = "no final answer within max_turn_steps";

impl Outcome {
    /// The statuses a turn that ended with this outcome leaves: its own and its event's. A turn
    /// stopped early (`stop`) is `interrupted`; its event still ends `failed`, which is delivered.
    pub(crate) fn statuses(&self, stop: Option<StopReason>) -> (TurnStatus, Terminal) {
        match (self, stop) {
            (Outcome::Completed { .. }, _) => (TurnStatus::Completed, Terminal::Completed),
            (Outcome::Failed { .. } | Outcome::NoFinalAnswer { .. }, None) => {
                (TurnStatus::Failed, Terminal::Failed)
            }
            (Outcome::Failed { .. } | Outcome::NoFinalAnswer { .. }, Some(_)) => {
                (TurnStatus::Interrupted, Terminal::Failed)
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Commit this entry before going on.
    Record(Entry),
    /// Ask the model, with the conversation so far and the route's tools. On the turn's last
    /// step (`last_step`) the same tools are sent, so that the request's early bytes stay those
    /// the server has cached, but no call may be made (`tool_choice: "none"`): the model is asked
    /// to answer with what it has, and a call it writes anyway does not run.
    CallModel {
        last_step: bool,
    },
    RunTool {
        call_id: String,
        name: String,
        arguments: Value,
        /// The call's idempotency key (`AGENTGATE_TOOL_CALL_ID`, or MCP `_meta`).
        key: String,
    },
    Finish(Outcome),
    /// A call the model asked for was not run (its result, which says why, is recorded):
    /// log and count it.
    Refused(RefusedCall),
    /// A call of a tool that needs an operator's decision: commit the request and pause the
    /// turn; it continues (a new run) once the decision is taken.
    AwaitApproval(GatedCall),
}

/// A call that waits for an operator's decision.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GatedCall {
    pub call_id: String,
    pub name: String,
    pub arguments: Value,
}

/// A tool call the turn refused to run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RefusedCall {
    /// The tool's name, when the route offers it; [`NOT_OFFERED`] for a name the model made
    /// up, which must not become a metric label or fill the journal.
    pub tool: String,
    pub reason: CallRefusal,
    /// Why, for the journal: without the argument values.
    pub detail: String,
}

/// The tool of a refused call whose name the route does not offer.
pub(crate) const NOT_OFFERED: &str = "(not offered)";

/// How a name the model wrote is quoted back to it and to the journal: as a string literal, at
/// most [`QUOTED_NAME_BYTES`] of it.
fn quoted_name(name: &str) -> String {
    let mut shown = name.to_string();
    match crate::untrusted::cut(&mut shown, QUOTED_NAME_BYTES) {
        0 => format!("{name:?}"),
        _ => format!("{shown:?}... ({} bytes)", name.len()),
    }
}

/// The names a route offers are OpenAI function names, at most 64 ASCII characters: a longer
/// one was made up.
const QUOTED_NAME_BYTES: usize = 64;

/// Why a tool call was not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallRefusal {
    /// The route offers no tool of that name.
    UnknownTool,
    /// The arguments are not JSON.
    NotJson,
    /// The arguments do not match the tool's parameter schema.
    InvalidArguments,
    /// The same call already ran as often as one turn allows.
    Repeated,
    /// The reply asked for more calls than `max_tool_calls_per_reply`: this one and the rest.
    TooManyInReply,
    /// The reply came at the turn's last step, where no call runs.
    LastStep,
    /// An operator denied it.
    Denied,
    /// Nobody decided within `approval_timeout`.
    Expired,
}

impl CallRefusal {
    /// The `result` label of `agentgate_tool_calls_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            CallRefusal::UnknownTool => "unknown_tool",
            CallRefusal::NotJson => "not_json",
            CallRefusal::InvalidArguments => "invalid",
            CallRefusal::Repeated => "repeated",
            CallRefusal::TooManyInReply => "too_many",
            CallRefusal::LastStep => "last_step",
            CallRefusal::Denied => "denied",
            CallRefusal::Expired => "expired",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Input {
    ModelReplied(Message),
    /// The reply could not be used (not JSON, no message); the model gets to try again.
    ModelMalformed(String),
    /// The model is unavailable after its retries; the turn fails.
    ModelUnavailable(String),
    ToolFinished {
        call_id: String,
        result: String,
    },
}

struct PendingCall {
    call_id: String,
    name: String,
    arguments: Value,
    /// The key of the interrupted run this call repeats; a new call gets a new one.
    key: Option<String>,
    /// It needs an operator's decision that is not taken yet.
    awaits_decision: bool,
}

/// Whether an admitted call may run.
enum Gate {
    Open,
    /// It waits for an operator's decision.
    Ask,
    /// Decided against: the reason, what the model is told, what the journal is told.
    Closed(CallRefusal, String, String),
}

/// The note before a turn's last model request, in which no tool call runs.
const LAST_STEP_NOTE: &str = "[agentgate] Last step of this turn (runtime.max_turn_steps): a \
tool call will not run. Give your final answer now, in plain text, with what you have found.";

/// What a turn without a final answer delivers of each tool result, and of all of them, at most.
const FOUND_RESULT_MAX: usize = 2 * 1024;
const FOUND_MAX: usize = 16 * 1024;

/// One turn's state.
pub(crate) struct TurnMachine {
    max_steps: u32,
    /// Tool calls of one reply that run; the rest get an error result.
    max_tool_calls: usize,
    /// Identical calls one turn runs; later ones are not run.
    max_repeated_calls: u32,
    /// How often each call (tool, canonical arguments) ran in this turn.
    repeats: BTreeMap<(String, String), u32>,
    steps: u32,
    messages: Vec<Message>,
    /// Where this turn's own messages start in `messages` (after the system text and history).
    turn_start: usize,
    tools: BTreeMap<String, schema::Parameters>,
    pending: VecDeque<PendingCall>,
    /// A resume's note, recorded right before the next model call.
    note: Option<Message>,
    /// Call keys are `<prefix>.<n>`, n counting this turn's calls.
    key_prefix: String,
    calls_started: u32,
    /// Tools that come from an MCP server, by the name the model calls them, with the server.
    mcp_servers: BTreeMap<String, String>,
    /// Tools whose calls wait for an operator's decision.
    gated: BTreeSet<String>,
    /// Decisions taken on the calls of the run this one continues; used by `start_resumed`
    /// only, so that a decision lets exactly the call it was asked for run.
    decided: Vec<ApprovalEntry>,
}

impl TurnMachine {
    /// `messages` is the conversation the turn starts from (history, then the new input).
    /// `tools` maps the route's tool names to their compiled parameter schemas.
    pub(crate) fn new(
        max_steps: u32,
        messages: Vec<Message>,
        tools: BTreeMap<String, schema::Parameters>,
    ) -> TurnMachine {
        TurnMachine {
            max_steps,
            max_tool_calls: usize::MAX,
            max_repeated_calls: u32::MAX,
            repeats: BTreeMap::new(),
            steps: 0,
            messages,
            turn_start: 0,
            tools,
            pending: VecDeque::new(),
            note: None,
            key_prefix: String::new(),
            calls_started: 0,
            mcp_servers: BTreeMap::new(),
            gated: BTreeSet::new(),
            decided: Vec::new(),
        }
    }

    /// Calls of the `gated` tools wait for an operator's decision; `decided` are the decisions
    /// taken on the calls of the run this one continues.
    pub(crate) fn approvals(
        mut self,
        gated: BTreeSet<String>,
        decided: Vec<ApprovalEntry>,
    ) -> TurnMachine {
        self.gated = gated;
        self.decided = decided;
        self
    }

    /// Call keys start with `prefix` (the turn's id, unique among turns), so every call of
    /// every turn gets its own.
    pub(crate) fn call_keys(mut self, prefix: &str) -> TurnMachine {
        self.key_prefix = prefix.to_string();
        self
    }

    /// This turn's own messages (its event, or the run it resumes) start at `index` of the
    /// conversation: before them are the system text and the session's history.
    pub(crate) fn turn_starts_at(mut self, index: usize) -> TurnMachine {
        self.turn_start = index;
        self
    }

    /// Marks the tools that come from an MCP server (model name → server) in the transcript.
    pub(crate) fn mcp_servers(mut self, servers: BTreeMap<String, String>) -> TurnMachine {
        self.mcp_servers = servers;
        self
    }

    /// Runs at most `max` tool calls of one reply; the rest get an error result saying so, so
    /// that one reply cannot fan out without bound.
    /// Identical calls (same tool, same arguments) that one turn runs; later ones are not run.
    pub(crate) fn limit_repeated_calls(mut self, max: u32) -> TurnMachine {
        self.max_repeated_calls = max;
        self
    }

    pub(crate) fn limit_tool_calls(mut self, max: usize) -> TurnMachine {
        self.max_tool_calls = max;
        self
    }

    /// The conversation to send to the model.
    pub(crate) fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Model calls made so far.
    pub(crate) fn steps(&self) -> u32 {
        self.steps
    }

    pub(crate) fn start(&mut self) -> Vec<Action> {
        self.ask_model()
    }

    /// Starts a resumed turn. Unfinished calls are settled first: a started call of a tool that
    /// is not idempotent gets an "interrupted, outcome unknown" result and is never re-run; an
    /// idempotent one, or one that never started, runs (a gated one as its decision says). Then
    /// `note`, if any, is recorded and the model is asked to go on.
    pub(crate) fn start_resumed(
        &mut self,
        unfinished: Vec<UnfinishedCall>,
        may_run_again: impl Fn(&str) -> bool,
        note: Option<Message>,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        for call in unfinished {
            if call.started && !may_run_again(&call.name) {
                let result = interrupted_result(&call.name);
                actions.push(self.record(Message::tool_result(&call.call_id, result)));
                continue;
            }
            let arguments = call.arguments.clone();
            actions.extend(self.admit(call.call_id, call.name, &arguments, call.key));
        }
        self.decided.clear();
        self.note = note;
        actions.extend(self.after_tools());
        actions
    }

    pub(crate) fn on(&mut self, input: Input) -> Vec<Action> {
        match input {
            Input::ModelReplied(reply) => {
                self.steps += 1;
                self.on_reply(reply)
            }
            Input::ModelMalformed(reason) => {
                self.steps += 1;
                let note = Message::text(
                    Role::User,
                    format!(
                        "Your previous reply could not be used ({reason}). Reply again with a tool call or a final answer."
                    ),
                );
                let mut actions = vec![self.record_marked(note, Mark::Note)];
                actions.extend(self.next_model_call(&reason));
                actions
            }
            Input::ModelUnavailable(error) => vec![Action::Finish(Outcome::Failed { error })],
            Input::ToolFinished { call_id, result } => {
                let mut actions = vec![self.record(Message::tool_result(&call_id, result))];
                actions.extend(self.after_tools());
                actions
            }
        }
    }

    fn record(&mut self, message: Message) -> Action {
        self.messages.push(message.clone());
        Action::Record(Entry::message(message))
    }

    /// Records a message of agentgate's own, marked as what it is.
    fn record_marked(&mut self, message: Message, mark: Mark) -> Action {
        self.messages.push(message.clone());
        Action::Record(Entry::marked(message, mark))
    }

    fn on_reply(&mut self, reply: Message) -> Vec<Action> {
        if self.steps >= self.max_steps {
            return self.past_the_last_step(reply);
        }
        if reply.tool_calls.is_empty() {
            return if let Some(output) = reply.visible_text().map(str::to_string) {
                vec![
                    self.record(reply),
                    Action::Finish(Outcome::Completed { output }),
                ]
            } else {
                let note = Message::text(
                    Role::User,
                    "Your reply was empty. Call a tool or give your final answer.",
                );
                let mut actions = vec![self.record(reply), self.record_marked(note, Mark::Note)];
                actions.extend(self.next_model_call("the model kept replying with nothing"));
                actions
            };
        }
        let mut reply = reply;
        let own = self.messages.get(self.turn_start..).unwrap_or_default();
        distinct_call_ids(&mut reply, own);
        let calls = reply.tool_calls.clone();
        let asked = calls.len();
        let mut actions = vec![self.record(reply)];
        for (index, call) in calls.into_iter().enumerate() {
            let name = call.function.name.clone();
            if index >= self.max_tool_calls {
                let max = self.max_tool_calls;
                actions.extend(self.refuse(
                    &call.id,
                    name,
                    CallRefusal::TooManyInReply,
                    format!(
                        "not run: this reply asked for {asked} tool calls and at most {max} run \
                         per reply (runtime.max_tool_calls_per_reply); ask for fewer at a time"
                    ),
                    format!("the reply asked for {asked} calls, {max} run"),
                ));
                continue;
            }
            actions.extend(self.admit(call.id, name, &call.function.arguments, None));
        }
        actions.extend(self.after_tools());
        actions
    }

    /// Queues the call to run, or records for the model why it is not run and reports the
    /// refusal: a tool this route does not offer, arguments that are not JSON or do not match
    /// the tool's schema.
    fn admit(
        &mut self,
        call_id: String,
        name: String,
        arguments: &str,
        key: Option<String>,
    ) -> Vec<Action> {
        let checked = self
            .check_call(&name, arguments)
            .and_then(|arguments| self.count_repeat(&name, arguments));
        let gated = checked.and_then(|arguments| match self.gate(&call_id, &name, &arguments) {
            Gate::Open => Ok((arguments, false)),
            Gate::Ask => Ok((arguments, true)),
            Gate::Closed(reason, for_model, detail) => Err((reason, for_model, detail)),
        });
        match gated {
            Ok((arguments, awaits_decision)) => {
                self.pending.push_back(PendingCall {
                    call_id,
                    name,
                    arguments,
                    key,
                    awaits_decision,
                });
                Vec::new()
            }
            Err((reason, for_model, detail)) => {
                self.refuse(&call_id, name, reason, for_model, detail)
            }
        }
    }

    /// Records for the model why the call is not run (`for_model`) and reports the refusal.
    fn refuse(
        &mut self,
        call_id: &str,
        name: String,
        reason: CallRefusal,
        for_model: String,
        detail: String,
    ) -> Vec<Action> {
        let tool = if self.tools.contains_key(&name) {
            name
        } else {
            NOT_OFFERED.to_string()
        };
        vec![
            self.record(Message::tool_result(call_id, format!("error: {for_model}"))),
            Action::Refused(RefusedCall {
                tool,
                reason,
                detail,
            }),
        ]
    }

    /// Whether a call of `name` with `arguments` may run: at once (no decision needed, or
    /// approved), after a decision, or not at all (denied, expired). Only a decision taken on
    /// this very call (its id, tool and arguments) counts.
    fn gate(&self, call_id: &str, name: &str, arguments: &Value) -> Gate {
        if !self.gated.contains(name) {
            return Gate::Open;
        }
        let decision = self.decided.iter().rev().find(|decision| {
            decision.call_id == call_id && decision.tool == name && decision.arguments == *arguments
        });
        let Some(decision) = decision else {
            return Gate::Ask;
        };
        let by = decision.by.as_deref().unwrap_or("an operator");
        match decision.status {
            ApprovalStatus::Pending => Gate::Ask,
            ApprovalStatus::Approved => Gate::Open,
            ApprovalStatus::Denied => Gate::Closed(
                CallRefusal::Denied,
                format!(
                    "denied by operator ({by}): {}. The call did not run; do not try it again.",
                    decision.note.as_deref().unwrap_or("no reason given")
                ),
                format!("denied by {by}"),
            ),
            ApprovalStatus::Expired => Gate::Closed(
                CallRefusal::Expired,
                "expired: nobody decided on this call within runtime.approval_timeout, so it \
                 did not run. Do not try it again in this turn."
                    .to_string(),
                "no decision within runtime.approval_timeout".to_string(),
            ),
        }
    }

    /// `arguments` again if this exact call (tool and arguments) has not yet run as often as a
    /// turn allows; counts it.
    fn count_repeat(
        &mut self,
        name: &str,
        arguments: Value,
    ) -> Result<Value, (CallRefusal, String, String)> {
        let ran = self
            .repeats
            .entry((name.to_string(), arguments.to_string()))
            .or_insert(0);
        if *ran >= self.max_repeated_calls {
            let times = self.max_repeated_calls;
            return Err((
                CallRefusal::Repeated,
                format!(
                    "not run: the same call already ran {times} time(s) in this turn; its result \
                     is above. Use that result, or give your final answer."
                ),
                format!("the same call already ran {times} time(s) in this turn"),
            ));
        }
        *ran += 1;
        Ok(arguments)
    }

    /// The call's arguments, or why it may not run: the reason, what the model is told, and
    /// what the journal is told.
    fn check_call(
        &self,
        name: &str,
        arguments: &str,
    ) -> Result<Value, (CallRefusal, String, String)> {
        let Some(parameters) = self.tools.get(name) else {
            let known: Vec<&str> = self.tools.keys().map(String::as_str).collect();
            let problem = format!(
                "tool {} is not available on this route (available: {})",
                quoted_name(name),
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            );
            return Err((CallRefusal::UnknownTool, problem.clone(), problem));
        };
        let arguments: Value = if arguments.trim().is_empty() {
            Value::Object(Default::default())
        } else {
            serde_json::from_str(arguments).map_err(|err| {
                let problem = format!("the arguments are not valid JSON: {err}");
                (CallRefusal::NotJson, problem.clone(), problem)
            })?
        };
        parameters.validate(&arguments).map_err(|mismatch| {
            (
                CallRefusal::InvalidArguments,
                format!(
                    "not run: the arguments do not match the tool's parameters: {}",
                    mismatch.for_model
                ),
                mismatch.for_log,
            )
        })?;
        Ok(arguments)
    }

    /// Runs the next pending tool call, or asks the model again when all are done.
    fn after_tools(&mut self) -> Vec<Action> {
        match self.pending.pop_front() {
            Some(call) if call.awaits_decision => vec![Action::AwaitApproval(GatedCall {
                call_id: call.call_id,
                name: call.name,
                arguments: call.arguments,
            })],
            Some(call) => {
                let key = call.key.unwrap_or_else(|| {
                    self.calls_started += 1;
                    format!("{}.{}", self.key_prefix, self.calls_started)
                });
                vec![
                    Action::Record(Entry::ToolStart {
                        call_id: call.call_id.clone(),
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                        key: Some(key.clone()),
                        mcp_server: self.mcp_servers.get(&call.name).cloned(),
                    }),
                    Action::RunTool {
                        call_id: call.call_id,
                        name: call.name,
                        arguments: call.arguments,
                        key,
                    },
                ]
            }
            None => self.next_model_call("the model was still calling tools"),
        }
    }

    fn next_model_call(&mut self, why: &str) -> Vec<Action> {
        if self.steps >= self.max_steps {
            return vec![self.no_final_answer(why, format!("{NO_FINAL_ANSWER}: {why}"))];
        }
        let mut actions = Vec::new();
        if let Some(note) = self.note.take() {
            actions.push(self.record_marked(note, Mark::Resumed));
        }
        actions.extend(self.ask_model());
        actions
    }

    /// The next model request; on the turn's last one, a note asks for the answer (appended,
    /// like every note, so the request starts with the bytes of the one before).
    fn ask_model(&mut self) -> Vec<Action> {
        if self.steps + 1 < self.max_steps {
            return vec![Action::CallModel { last_step: false }];
        }
        vec![
            self.record_marked(Message::text(Role::User, LAST_STEP_NOTE), Mark::LastStep),
            Action::CallModel { last_step: true },
        ]
    }

    /// The reply to the turn's last step. Its calls do not run (each gets a result that says
    /// so, so the transcript has one for every call). It answers only with text that is not
    /// itself a tool call; otherwise the turn ends without a final answer.
    fn past_the_last_step(&mut self, reply: Message) -> Vec<Action> {
        let output = reply
            .visible_text()
            .filter(|text| !textcall::is_written_call(text))
            .map(str::to_string);
        let why = match (&output, reply.tool_calls.is_empty(), reply.visible_text()) {
            (Some(_), _, _) => "",
            (None, false, _) => "the last reply only called tools",
            (None, true, Some(_)) => "the last reply only wrote a tool call as text",
            (None, true, None) => "the last reply was empty",
        };
        let calls: Vec<(String, String)> = (reply.tool_calls.iter())
            .map(|call| (call.id.clone(), call.function.name.clone()))
            .collect();
        let mut actions = vec![self.record(reply)];
        for (call_id, name) in calls {
            actions.extend(self.refuse(
                &call_id,
                name,
                CallRefusal::LastStep,
                "not run: the turn reached its last step".to_string(),
                "asked for at the turn's last step".to_string(),
            ));
        }
        actions.push(match output {
            Some(output) => Action::Finish(Outcome::Completed { output }),
            None => self.no_final_answer(why, NO_FINAL_ANSWER.to_string()),
        });
        actions
    }

    /// The end of a turn whose last step gave no answer: failed, with what its tools found.
    fn no_final_answer(&self, why: &str, error: String) -> Action {
        Action::Finish(Outcome::NoFinalAnswer {
            error,
            why: format!("{why} (max_turn_steps = {})", self.max_steps),
            found: self.found(),
        })
    }

    /// What this turn's tool calls returned, each result cut to [`FOUND_RESULT_MAX`] and all of
    /// them to about [`FOUND_MAX`]; calls that did not run are left out. `None` without any.
    fn found(&self) -> Option<String> {
        let own = self.messages.get(self.turn_start..).unwrap_or_default();
        let calls: BTreeMap<&str, &crate::agent::message::FunctionCall> = own
            .iter()
            .flat_map(|message| &message.tool_calls)
            .map(|call| (call.id.as_str(), &call.function))
            .collect();
        let results: Vec<String> = own
            .iter()
            .filter(|message| message.role == Role::Tool)
            .filter_map(|message| {
                let result = message.content.as_deref()?;
                if result.starts_with("error: not run") {
                    return None;
                }
                let call = calls.get(message.tool_call_id.as_deref()?)?;
                let mut result = result.to_string();
                let left_out = crate::untrusted::cut(&mut result, FOUND_RESULT_MAX);
                if left_out > 0 {
                    result.push_str(&format!(" [{left_out} more bytes]"));
                }
                Some(format!("- {}({}): {result}", call.name, call.arguments))
            })
            .collect();
        if results.is_empty() {
            return None;
        }
        let mut text = format!(
            "[agentgate] {NO_FINAL_ANSWER}: the model gave no final answer. What this turn's tool calls returned:"
        );
        for (index, result) in results.iter().enumerate() {
            if text.len() + result.len() > FOUND_MAX {
                text.push_str(&format!("\n({} more not shown)", results.len() - index));
                break;
            }
            text.push('\n');
            text.push_str(result);
        }
        Some(text)
    }
}

#[cfg(test)]
#[path = "turn_tests.rs"]
mod tests;

/// Gives each call of a reply an id no other call of its turn has (`earlier` are the turn's
/// messages so far): a call that repeats an id becomes `ID-2`, `ID-3`... A decision on a gated
/// call is taken on its id, tool and arguments, so an identical call under an id already used
/// (a model, or a server taking ids from the model's text, can write that, in one reply or a
/// later one) would run again on the same approval; renumbered, it asks for its own. The
/// reply is recorded with the ids it ran under.
fn distinct_call_ids(reply: &mut Message, earlier: &[Message]) {
    let mut seen: BTreeSet<String> = earlier
        .iter()
        .flat_map(|message| &message.tool_calls)
        .map(|call| call.id.clone())
        .collect();
    for call in &mut reply.tool_calls {
        let mut id = call.id.clone();
        let mut number = 1;
        while !seen.insert(id.clone()) {
            number += 1;
            id = format!("{}-{number}", call.id);
        }
        call.id = id;
    }
}
