//! Executes a turn's actions: model calls, tool runs and commits, in the order the state machine
//! gives them, committing every transcript entry before the next action starts.
//!
//! A turn ends one of three ways: finished (completed or failed, with its delivery queued in the
//! same commit), interrupted by a newer event (`on_busy = "interrupt"`: failed, delivered), or
//! cancelled by the drain (left `resume_pending` for the next start).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::approval;
use super::budget::Warned;
use super::jobs::{BackgroundJobs, Job, internal_chain};
use super::transcript::{
    ReplyFacts, StepFacts, decisions, exchanged_bytes, messages_of, settle_unanswered,
    unfinished_calls,
};
use super::turn::{Action, Entry, GatedCall, Input, Outcome, TurnMachine};
use super::{Sessions, TurnControl};
use super::{history, prompt};
use crate::agent::catalog::{Catalog, OfferedTool, Runs};
use crate::agent::mcp::McpServers;
use crate::agent::message::Message;
use crate::agent::model::{Attempt, Model, ModelError, Reply, ToolUse};
use crate::agent::tools::{self, ToolAbort};
use crate::config::{RouteSettings, RuntimeSettings, Settings, Shared};
use crate::deliver::{self, DeliveryHandle};
use crate::logging;
use crate::metrics;
use crate::store::{
    ClaimedTurn, Continuation, ResumeReason, RewindFrom, StopReason, Store, StoreError, TurnEnd,
    TurnStatus,
};
use crate::telemetry::Span;
use crate::usage::{Spent, Usage};
pub(super) use inputs::grouped_by_event;
use reserve::Budgeted;

mod inputs;
mod reserve;
mod spans;

/// Pause between attempts to commit a step while the store cannot write.
const COMMIT_RETRY: Duration = Duration::from_secs(1);

/// The first pause of a turn waiting out a model outage; each next one doubles, up to the last.
const OUTAGE_FIRST_PAUSE: Duration = Duration::from_millis(500);
const OUTAGE_LAST_PAUSE: Duration = Duration::from_secs(30);

/// How long a turn waits for an MCP server it offers tools of that is still starting.
const MCP_START_WAIT: Duration = Duration::from_secs(30);

/// What every turn needs; shared by all of them.
pub(crate) struct TurnContext {
    pub store: Store,
    /// The config and templates; a reload swaps them, a running turn keeps its snapshot.
    pub settings: Arc<Shared<Settings>>,
    pub model: Arc<Model>,
    pub sessions: Arc<Sessions>,
    /// Wakes the deliverer when a result is queued.
    pub deliveries: DeliveryHandle,
    /// Fired when the drain's time is up: running turns stop and are left for resume.
    pub cancel_turns: CancellationToken,
    /// Where `background = true` tools run.
    pub jobs: BackgroundJobs,
    /// The MCP servers whose tools routes offer.
    pub mcp: Arc<McpServers>,
    /// Budget windows already warned about.
    pub budget_warnings: Warned,
}

/// Why a turn stopped before its state machine finished it.
enum Stop {
    Interrupted,
    Cancelled,
    Shutdown,
    Idle,
    /// This node has not renewed the session's lease for most of `lease_ttl` (cut off from
    /// PostgreSQL, or another node holds it now).
    LeaseAtRisk,
}

/// The error an operator-cancelled turn's event ends with.
const CANCELLED_BY_OPERATOR: &str = "cancelled by operator";

struct Running<'a> {
    context: &'a TurnContext,
    settings: &'a Settings,
    turn: &'a ClaimedTurn,
    route: &'a RouteSettings,
    control: &'a TurnControl,
    /// When the turn was claimed, for its duration metric.
    started: Instant,
    /// `invoke_agent <route>`, the parent of the turn's model requests and tool calls.
    span: &'a Span,
    /// What the turn's replies reported they spent, for its span.
    usage: std::sync::Mutex<Usage>,
}

impl TurnContext {
    /// Runs one claimed turn to its end.
    pub(crate) async fn run(&self, turn: ClaimedTurn, control: &TurnControl) {
        let started = Instant::now();
        let event = &turn.event;
        let settings = self.settings.get();
        let span = spans::turn_span(&turn, &settings.config.model);
        let progress = TurnProgress {
            steps: 0,
            started,
            span: &span,
        };
        let Some(route) = settings.route(&event.route) else {
            let error = format!("route {} is no longer configured", event.route);
            self.finish(&turn, Outcome::Failed { error }, None, progress)
                .await;
            return;
        };
        // A chain of internal turns (a job whose result starts the job again) ends here.
        let chain = internal_chain(&turn);
        let budget = settings.config.runtime.max_internal_turns;
        if chain > budget {
            tracing::warn!(
                chain,
                budget,
                "internal turn not run: the chain reached runtime.max_internal_turns"
            );
            let error = format!(
                "not run: this is internal turn {chain} in a row since the session's last webhook, \
                 past runtime.max_internal_turns ({budget}); background jobs that keep starting \
                 themselves end here"
            );
            self.finish(&turn, Outcome::Failed { error }, None, progress)
                .await;
            return;
        }
        logging::event_line!("turn started");
        let running = Running {
            context: self,
            settings: &settings,
            turn: &turn,
            route,
            control,
            started,
            span: &span,
            usage: std::sync::Mutex::default(),
        };
        running.drive().await;
    }

    async fn finish(
        &self,
        turn: &ClaimedTurn,
        outcome: Outcome,
        stop: Option<StopReason>,
        progress: TurnProgress<'_>,
    ) {
        let TurnProgress {
            steps,
            started,
            span,
        } = progress;
        let event = &turn.event;
        let completed_resume =
            matches!(outcome, Outcome::Completed { .. }) && turn.continues.is_some();
        let (turn_status, terminal) = outcome.statuses(stop);
        let (output, error) = match outcome {
            Outcome::Completed { output } => (Some(output), None),
            Outcome::Failed { error } => (None, Some(error)),
            Outcome::NoFinalAnswer { error, why, found } => {
                metrics::turn_without_answer(&event.route);
                tracing::warn!(steps, detail = %why,
                    "the model gave no final answer within max_turn_steps; the turn fails with what its tools found");
                (found, Some(error))
            }
        };
        span.set("agentgate.turn.status", turn_status.sql());
        if let Some(error) = &error {
            span.fail(turn_status.sql(), error);
        }
        let end = TurnEnd {
            turn_id: turn.turn_id.clone(),
            event_id: event.id.clone(),
            session_key: event.session_key.clone(),
            route: event.route.clone(),
            turn_status,
            terminal,
            reason: stop,
            output,
            error: error.clone(),
            steps,
            rewind_of: None,
        };
        let price = self.settings.get().config.model.price;
        if !self
            .commit(|store| {
                let end = end.clone();
                async move { store.finish_turn(end, deliver::body::renderer(price)).await }
            })
            .await
        {
            return;
        }
        self.deliveries.result_queued();
        metrics::turn_ended(&event.route, turn_status, started.elapsed());
        if completed_resume {
            // Only after the completion is committed: the entry is the crash-loop evidence.
            if let Err(err) = self.store.clear_resume_count(&event.session_key).await {
                tracing::warn!(error = %err, "cannot clear the session's retry ledger entry");
            }
        }
        match error {
            None => logging::event_line!(steps, "turn completed"),
            Some(error) => tracing::warn!(steps, error = %error, "turn failed"),
        }
    }

    /// Retries a store operation until it succeeds (`Some`) or the turns are being cancelled
    /// (`None`): a step that is not durable must not be followed by the next one, and a store
    /// that is briefly unavailable (a database failover) must not fail the turn. A lost lease
    /// ends the turn here at once (`None`): another node has taken the session over.
    async fn retrying<T, F, Fut>(&self, what: &str, attempt: F) -> Option<T>
    where
        F: Fn(Store) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        loop {
            match attempt(self.store.clone()).await {
                Ok(value) => return Some(value),
                Err(err @ StoreError::LeaseLost { .. }) => {
                    tracing::error!(error = %err, "turn stopped: its session was taken over");
                    return None;
                }
                Err(err) => {
                    tracing::error!(error = %err, "cannot {what}; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(COMMIT_RETRY) => {}
                        () = self.cancel_turns.cancelled() => return None,
                    }
                }
            }
        }
    }

    async fn commit<F, Fut>(&self, attempt: F) -> bool
    where
        F: Fn(Store) -> Fut,
        Fut: std::future::Future<Output = Result<(), StoreError>>,
    {
        self.retrying("commit a turn step", attempt).await.is_some()
    }
}

/// The largest a single message of a turn's conversation may be on `route`: an event or tool
/// output beyond it is cut (docs/reference.md, the route's `history`).
pub(super) fn message_cap(route: &RouteSettings) -> usize {
    (route.history.max_bytes / 2).max(1024)
}

/// The conversation a turn starts from: the route's system message, then the session's
/// earlier `turns` (grouped by event, oldest first, from its `skipped`-th turn on) within the
/// route's history bounds. A past turn that ended with a call unanswered (it failed or was
/// cancelled mid-call) still shows every call with a result: the API refuses a call without
/// one.
pub(super) fn opening(
    route: &RouteSettings,
    system: &str,
    turns: Vec<Vec<Entry>>,
    skipped: usize,
) -> Vec<Message> {
    let message_cap = message_cap(route);
    let past = turns
        .into_iter()
        .map(|entries| history::PastTurn {
            messages: settle_unanswered(messages_of(&entries)),
        })
        .collect();
    let mut messages = vec![prompt::system_message(route, system)];
    messages.extend(
        history::select(past, route.history, skipped)
            .into_iter()
            .map(|message| history::bounded(message, message_cap)),
    );
    messages
}

/// The state machine of a turn that starts from `messages` (its own start at `turn_start`),
/// offering `catalog`, within the `[runtime]` limits; call keys start with `key_prefix`.
/// Calls of the catalog's gated tools wait for a decision, none taken yet.
pub(super) fn machine_for(
    runtime: &RuntimeSettings,
    catalog: &Catalog,
    messages: Vec<Message>,
    key_prefix: &str,
    turn_start: usize,
) -> TurnMachine {
    TurnMachine::new(runtime.max_turn_steps, messages, catalog.schemas())
        .limit_tool_calls(runtime.max_tool_calls_per_reply)
        .limit_repeated_calls(runtime.max_repeated_tool_calls)
        .call_keys(key_prefix)
        .turn_starts_at(turn_start)
        .mcp_servers(catalog.mcp_servers())
        .approvals(catalog.gated(), Vec::new())
}

/// What a failed transcript read retries, in its log line.
const READING: &str = "read the session's transcript";

/// How far a turn got: its model calls so far, when it was claimed, and its span.
#[derive(Clone, Copy)]
struct TurnProgress<'a> {
    steps: u32,
    started: Instant,
    span: &'a Span,
}

impl Running<'_> {
    fn progress(&self, steps: u32) -> TurnProgress<'_> {
        TurnProgress {
            steps,
            started: self.started,
            span: self.span,
        }
    }

    /// Builds the conversation, commits the new event's message, then runs the machine. Each
    /// step returns `None` when the turn already ended (stopped, failed, or its commit was
    /// given up because the turns are being cancelled).
    async fn drive(&self) {
        spans::record_turn_span(&self.context.store, self.turn, self.span).await;
        let Some(catalog) = self.offered_tools().await else {
            return;
        };
        let Some((system, prompt_text)) = self.rendered_texts().await else {
            return;
        };
        let Some(continues) = self.continues().await else {
            return;
        };
        // A rewind to a model reply asks the model again within the turn of that reply, whose
        // entries before it stand (docs/reference.md, "Rewind and fork"), until it records an
        // entry of its own; then, if it is cut off, it resumes as any other turn.
        let rewound_reply = continues.is_none() && self.turn.rewound == Some(RewindFrom::Reply);
        // A resumed turn continues the last one: that one is shown whole, whatever the limits.
        let own_last = continues.is_some() || rewound_reply;
        let Some((mut turns, skipped)) = self.past_turns(own_last).await else {
            return;
        };
        let interrupted = if own_last {
            turns.pop().unwrap_or_default()
        } else {
            Vec::new()
        };
        let message_cap = message_cap(self.route);
        let mut messages = opening(self.route, &system, turns, skipped);
        let turn_start = messages.len();
        messages.extend(
            messages_of(&interrupted)
                .into_iter()
                .map(|message| history::bounded(message, message_cap)),
        );
        let machine = |messages| {
            machine_for(
                &self.settings.config.runtime,
                &catalog,
                messages,
                &self.turn.turn_id,
                turn_start,
            )
            .approvals(catalog.gated(), decisions(&interrupted))
        };
        let (machine, first) = match continues {
            None if rewound_reply => {
                let mut machine = machine(messages);
                let first = machine.start_resumed(unfinished_calls(&interrupted), |_| false, None);
                (machine, first)
            }
            None => {
                let Some(new_events) = self.record_new_events(&prompt_text).await else {
                    return;
                };
                messages.extend(
                    new_events
                        .into_iter()
                        .map(|message| history::bounded(message, message_cap)),
                );
                let mut machine = machine(messages);
                let first = machine.start();
                (machine, first)
            }
            Some(continuation) => {
                let mut machine = machine(messages);
                let note = match continuation {
                    Continuation::Resumed(reason) => Some(prompt::resume_note(self.route, reason)),
                    Continuation::Decided => None,
                };
                // A tool that is no longer offered is not known to be safe to run again.
                let first = machine.start_resumed(
                    unfinished_calls(&interrupted),
                    |name| catalog.get(name).is_some_and(|tool| tool.rerun.is_safe()),
                    note,
                );
                (machine, first)
            }
        };
        self.run(machine, first, &catalog).await;
    }

    /// Commits the request for `call`'s decision, with the turn taken off its slot after `steps`
    /// steps, and says so.
    async fn await_approval(&self, call: GatedCall, steps: u32) {
        let request = approval::request(self.settings, self.turn, call);
        let committed = self
            .context
            .commit(|store| {
                let request = request.clone();
                async move { store.await_approval(request, steps).await }
            })
            .await;
        if committed {
            // The request is in the outbox: it goes out now, as a turn's result does.
            self.context.deliveries.result_queued();
            approval::requested(&request);
            spans::approval_requested(self.span, &request.row);
        }
    }

    /// Carries out the machine's actions in order, feeding each result back, until it finishes
    /// or the turn is stopped.
    async fn run(&self, mut machine: TurnMachine, first: Vec<Action>, catalog: &Catalog) {
        let mut actions: VecDeque<Action> = first.into();
        // What the last model reply spent and who answered it: committed with its entry.
        let mut unrecorded = ReplyFacts::default();
        while let Some(action) = actions.pop_front() {
            let input = match action {
                Action::Record(entry) => {
                    // Entries with no action between them share one commit; the next action still
                    // starts only after all of them are durable.
                    let mut entries = vec![entry];
                    while let Some(Action::Record(_)) = actions.front() {
                        if let Some(Action::Record(next)) = actions.pop_front() {
                            entries.push(next);
                        }
                    }
                    let facts = std::mem::take(&mut unrecorded);
                    let spent = facts.attach(&mut entries);
                    if !self.record(&entries, machine.steps(), spent).await {
                        return;
                    }
                    continue;
                }
                Action::Finish(outcome) => {
                    self.context
                        .finish(self.turn, outcome, None, self.progress(machine.steps()))
                        .await;
                    return;
                }
                Action::AwaitApproval(call) => {
                    self.await_approval(call, machine.steps()).await;
                    return;
                }
                Action::Refused(refused) => {
                    metrics::tool_call(&refused.tool, refused.reason.label());
                    tracing::warn!(tool = %refused.tool, reason = refused.reason.label(),
                        detail = %refused.detail, "tool call refused; the model is told why");
                    spans::tool_refused(self.span, &refused.tool, refused.reason.label());
                    continue;
                }
                Action::CallModel { last_step } => {
                    let tools = catalog.tools();
                    let before = match self.reserve_budget(machine.messages(), tools).await {
                        Budgeted::Go(before) => before,
                        Budgeted::Gone => return,
                        Budgeted::Stopped(stop) => {
                            self.stopped(stop, machine.steps()).await;
                            return;
                        }
                        Budgeted::Exceeded(error) => {
                            let progress = self.progress(machine.steps());
                            let outcome = Outcome::Failed { error };
                            self.context
                                .finish(self.turn, outcome, None, progress)
                                .await;
                            return;
                        }
                    };
                    let tool_use = if last_step {
                        ToolUse::Forbidden
                    } else {
                        ToolUse::Allowed
                    };
                    let input = self
                        .call_model(machine.messages(), tools, tool_use, &mut unrecorded)
                        .await;
                    let replied = matches!(input, Ok(Input::ModelReplied(_)));
                    self.settle_budget(before, replied.then_some(unrecorded.spent))
                        .await;
                    input
                }
                Action::RunTool {
                    call_id,
                    name,
                    arguments,
                    key,
                } => {
                    let span = catalog.get(&name).map_or_else(Span::off, |tool| {
                        spans::tool_span(self.span, tool, &call_id, &arguments)
                    });
                    let input = self
                        .run_tool(catalog, call_id, &name, &arguments, &key, &span)
                        .await;
                    spans::record_tool_result(&span, &input);
                    input
                }
            };
            match input {
                Ok(input) => actions.extend(machine.on(input)),
                Err(stop) => {
                    self.stopped(stop, machine.steps()).await;
                    return;
                }
            }
        }
    }

    async fn record(&self, entries: &[Entry], steps: u32, spent: Spent) -> bool {
        let Ok(rows) = entries
            .iter()
            .map(|entry| serde_json::to_string(entry).map(|body| (entry.kind(), body)))
            .collect::<Result<Vec<_>, _>>()
        else {
            return false;
        };
        let turn = self.turn;
        self.context
            .commit(|store| {
                let rows = rows.clone();
                async move {
                    store
                        .append_transcript(
                            &turn.event.session_key,
                            &turn.turn_id,
                            rows,
                            steps,
                            spent,
                        )
                        .await
                }
            })
            .await
    }

    /// Waits for `work` unless the turn is interrupted, cancelled, or makes no progress in time.
    async fn guarded<T>(&self, work: impl std::future::Future<Output = T>) -> Result<T, Stop> {
        let idle = self.settings.config.runtime.turn_idle_timeout;
        self.unless_stopped(tokio::time::timeout(idle, work))
            .await?
            .map_err(|_| Stop::Idle)
    }

    /// Waits for `work` unless the turn is interrupted or cancelled. For waits that are not a
    /// lack of progress (a model slot, an outage): they do not count toward turn_idle_timeout.
    async fn unless_stopped<T>(
        &self,
        work: impl std::future::Future<Output = T>,
    ) -> Result<T, Stop> {
        tokio::select! {
            result = work => Ok(result),
            () = self.control.interrupt.cancelled() => Err(Stop::Interrupted),
            () = self.control.cancel.cancelled() => Err(Stop::Cancelled),
            () = self.context.cancel_turns.cancelled() => Err(Stop::Shutdown),
            () = lease_at_risk(&self.context.store, &self.turn.event.session_key) => {
                Err(Stop::LeaseAtRisk)
            }
        }
    }

    /// One model step. A model that is unavailable after its retries is waited for, with
    /// backoff, for up to `model.outage_wait` from its first failure (docs/reference.md,
    /// "Model outages"): a short outage costs a delay, not the event. The wait uses no step.
    /// What the reply spent and who answered it go to `facts`.
    async fn call_model(
        &self,
        messages: &[Message],
        tools: &[OfferedTool],
        tool_use: ToolUse,
        facts: &mut ReplyFacts,
    ) -> Result<Input, Stop> {
        let model = &self.context.model;
        let (asked_at, asking_since) = (crate::clock::now_millis(), Instant::now());
        let mut outage: Option<(Instant, Duration)> = None;
        let session = &self.turn.event.session_key;
        let trace = |attempt: &Attempt<'_>| {
            spans::chat_span(
                self.span,
                &self.settings.config.model,
                attempt,
                session,
                messages,
            )
        };
        loop {
            let (reply, span) = {
                let _slot = self.unless_stopped(model.slot()).await?;
                let asked = Instant::now();
                let asking = model.complete(messages, tools, tool_use, &trace);
                let reply = self.guarded(asking).await?;
                metrics::model_request(asked.elapsed());
                reply
            };
            if let Err(err) = &reply {
                span.fail(err.kind(), &err.to_string());
            }
            let err = match reply {
                Ok(reply) => {
                    spans::record_reply(&span, &reply);
                    self.add_to_turn_span(&reply);
                    let step = Spent::of_reply(reply.usage, exchanged_bytes(messages, &reply));
                    let price = self.settings.config.model.price.as_ref();
                    metrics::model_usage(&self.turn.event.route, step, price);
                    facts.spent.add(step);
                    facts.answered_by = reply.answered_by;
                    facts.step = Some(StepFacts {
                        asked_at,
                        took_ms: u64::try_from(asking_since.elapsed().as_millis())
                            .unwrap_or(u64::MAX),
                        usage: reply.usage,
                        estimated_tokens: step.estimated_tokens,
                    });
                    if let Some((since, _)) = outage {
                        tracing::info!(
                            waited_ms = since.elapsed().as_millis() as u64,
                            "the model answers again; the turn goes on"
                        );
                    }
                    return Ok(Input::ModelReplied(reply.message));
                }
                Err(ModelError::Malformed(reason)) => return Ok(Input::ModelMalformed(reason)),
                Err(err @ ModelError::Unavailable(_)) => err,
            };
            let (since, pause) = outage.get_or_insert_with(|| {
                tracing::warn!(error = %err, outage_wait = ?model.outage_wait(),
                    "the model is unavailable; the turn waits for it (model.outage_wait)");
                (Instant::now(), OUTAGE_FIRST_PAUSE)
            });
            let left = model.outage_wait().saturating_sub(since.elapsed());
            if left.is_zero() {
                return Ok(Input::ModelUnavailable(format!(
                    "{err}; waited {:?} for it (model.outage_wait)",
                    model.outage_wait()
                )));
            }
            self.unless_stopped(tokio::time::sleep((*pause).min(left)))
                .await?;
            *pause = (*pause * 2).min(OUTAGE_LAST_PAUSE);
        }
    }

    /// Adds what `reply` spent to the turn's span, with why the model stopped (the last reply's
    /// reasons are the turn's).
    fn add_to_turn_span(&self, reply: &Reply) {
        spans::record_finish_reasons(self.span, &reply.response);
        let Some(usage) = reply.usage else {
            return;
        };
        if let Ok(mut total) = self.usage.lock() {
            total.add(usage);
            spans::record_usage(self.span, &total);
        }
    }

    async fn run_tool(
        &self,
        catalog: &Catalog,
        call_id: String,
        name: &str,
        arguments: &serde_json::Value,
        key: &str,
        span: &Span,
    ) -> Result<Input, Stop> {
        let tool = match catalog.get(name).map(|offered| &offered.runs) {
            None => {
                return Ok(Input::ToolFinished {
                    call_id,
                    result: format!("error: tool {name:?} is not configured"),
                });
            }
            Some(Runs::Mcp { server, tool }) => {
                let call = server.call(catalog.servers(), tool, arguments, key, span.traceparent());
                let outcome = self.guarded(call).await?;
                metrics::tool_call(name, outcome.result());
                return Ok(Input::ToolFinished {
                    call_id,
                    result: outcome.into_result(&server.name),
                });
            }
            Some(Runs::Command(tool)) => tool,
        };
        if tool.background {
            let job = Job {
                tool: tool.clone(),
                hidden: self.settings.config.hidden.clone(),
                arguments: arguments.clone(),
                key: key.to_string(),
                session_key: self.turn.event.session_key.clone(),
                route: self.turn.event.route.clone(),
                chain: internal_chain(self.turn) + 1,
            };
            let result = self.context.jobs.start(job, &self.settings.config.runtime);
            return Ok(Input::ToolFinished { call_id, result });
        }
        // The tool process is killed when the turn is interrupted or cancelled.
        let kill = CancellationToken::new();
        let _kill_on_exit = kill.clone().drop_guard();
        let outcome = self
            .guarded(tools::run(
                tool,
                &self.settings.config.hidden,
                arguments,
                key,
                &kill,
            ))
            .await?;
        let result = match outcome {
            Ok(outcome) => {
                metrics::tool_call(&tool.name, outcome.result());
                serde_json::to_string(&outcome).unwrap_or_default()
            }
            Err(ToolAbort::Cancelled) => {
                metrics::tool_call(&tool.name, "cancelled");
                "error: the tool was cancelled".to_string()
            }
        };
        Ok(Input::ToolFinished { call_id, result })
    }

    async fn stopped(&self, stop: Stop, steps: u32) {
        let (error, reason) = match stop {
            Stop::Interrupted => (
                "interrupted by a newer event for this session (on_busy = \"interrupt\")"
                    .to_string(),
                StopReason::Interrupted,
            ),
            Stop::Cancelled => (CANCELLED_BY_OPERATOR.to_string(), StopReason::Cancelled),
            Stop::Idle => (
                format!(
                    "no progress for turn_idle_timeout ({:?}): no model reply and no tool output",
                    self.settings.config.runtime.turn_idle_timeout
                ),
                StopReason::IdleTimeout,
            ),
            Stop::Shutdown => {
                self.span.set("agentgate.turn.status", "resume_pending");
                return self.leave_for_resume(steps).await;
            }
            Stop::LeaseAtRisk => {
                self.span.set("agentgate.turn.status", "cut_off");
                return self.leave_cut_off(steps).await;
            }
        };
        self.context
            .finish(
                self.turn,
                Outcome::Failed { error },
                Some(reason),
                self.progress(steps),
            )
            .await;
    }

    /// This node has not renewed the session's lease for most of `lease_ttl` (cut off from the
    /// store, or the lease is another node's now): the turn's tools were stopped (dropping them
    /// kills them) before the lease could expire, so nothing of it runs once another node
    /// resumes the session. When the store answers again the turn is left
    /// `resume_pending` as crashed, for a resume here or elsewhere; if another node has taken
    /// the session over meanwhile, that commit is refused and the turn just ends here.
    async fn leave_cut_off(&self, steps: u32) {
        let turn = self.turn;
        tracing::error!(
            "this node could not renew the session's lease for most of store.lease_ttl (cut off \
             from PostgreSQL, or another node holds it now): the turn's tools were stopped so \
             that none runs once another node resumes the session"
        );
        metrics::turn_ended(
            &turn.event.route,
            TurnStatus::Interrupted,
            self.started.elapsed(),
        );
        let left = self
            .context
            .commit(|store| async move {
                store
                    .interrupt_for_resume(
                        &turn.turn_id,
                        &turn.event.session_key,
                        ResumeReason::Crashed,
                        steps,
                    )
                    .await
            })
            .await;
        if left {
            tracing::warn!("the store answers again; the cut-off turn is left for resume");
        }
    }

    /// The drain ran out of time: the turn is left `resume_pending` for the next start.
    async fn leave_for_resume(&self, steps: u32) {
        let turn = self.turn;
        let committed = self
            .context
            .store
            .interrupt_for_resume(
                &turn.turn_id,
                &turn.event.session_key,
                ResumeReason::ShutdownTimeout,
                steps,
            )
            .await;
        metrics::turn_ended(
            &turn.event.route,
            TurnStatus::Interrupted,
            self.started.elapsed(),
        );
        match committed {
            Ok(()) => tracing::warn!(
                message_id = crate::logging::MESSAGE_DRAIN_TIMEOUT,
                "turn did not finish within drain_timeout; marked resume_pending"
            ),
            Err(err) => tracing::error!(error = %err,
                "cannot mark the turn resume_pending; it is found running at the next start and resumed as crashed"),
        }
    }
}

/// Resolves once `store` says this node's lease on `session_key` is at risk (polled: the
/// heartbeat's view), never with one node.
async fn lease_at_risk(store: &Store, session_key: &str) {
    if store.failover_interval().is_none() {
        return std::future::pending().await;
    }
    while !store.lease_at_risk(session_key) {
        tokio::time::sleep(LEASE_CHECK).await;
    }
}

/// How often a running turn looks whether its node's leases are at risk.
const LEASE_CHECK: Duration = Duration::from_millis(100);
