//! Background tool jobs (`background = true`): a tool that returns a job id at once and runs on,
//! detached from the turn, whose end comes back to its session as an internal event. They are
//! bounded in all and per session (a model that starts jobs in a loop is refused, with a reason
//! it sees), and a chain of internal turns is counted so that it cannot go on forever.

use tracing::Instrument;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Sessions;
use crate::agent::tools::{self, ToolAbort};
use crate::config::{HiddenPaths, RuntimeSettings, ToolSettings};
use crate::metrics;
use crate::store::{ClaimedTurn, Store};

/// What a session is told of a background job that the daemon's stop cut off.
const BACKGROUND_JOB_INTERRUPTED: &str =
    "interrupted: agentgate stopped while the job ran; it was killed and its outcome is unknown";

/// Where background jobs run, and what bounds them.
pub(crate) struct BackgroundJobs {
    pub store: Store,
    pub sessions: Arc<Sessions>,
    /// The drain waits here for jobs to record their end.
    pub tracker: TaskTracker,
    /// Fired when the drain stops background jobs (after turns and deliveries).
    pub stop: CancellationToken,
    /// Jobs running now, bounded in all and per session.
    pub slots: Arc<JobSlots>,
}

/// Background jobs running now, by session.
#[derive(Default)]
pub(crate) struct JobSlots(std::sync::Mutex<std::collections::HashMap<String, usize>>);

impl JobSlots {
    /// Takes a background job slot for `session_key`, or says why there is none.
    fn take(&self, session_key: &str, runtime: &RuntimeSettings) -> Result<(), String> {
        let mut jobs = crate::locks::lock(&self.0);
        let total: usize = jobs.values().sum();
        let mine = jobs.get(session_key).copied().unwrap_or(0);
        if total >= runtime.max_background_jobs {
            return Err(format!(
                "{total} background jobs are running (runtime.max_background_jobs)"
            ));
        }
        if mine >= runtime.max_background_jobs_per_session {
            return Err(format!(
                "this session already runs {mine} background jobs \
                 (runtime.max_background_jobs_per_session); wait for one to report back"
            ));
        }
        *jobs.entry(session_key.to_string()).or_default() += 1;
        Ok(())
    }

    fn release(&self, session_key: &str) {
        let mut jobs = crate::locks::lock(&self.0);
        if let Some(count) = jobs.get_mut(session_key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                jobs.remove(session_key);
            }
        }
    }
}

/// How many internal turns in a row led to the turn's event: 0 for a webhook, else the count its
/// background job recorded when it was started.
pub(super) fn internal_chain(turn: &ClaimedTurn) -> u32 {
    if !turn.internal {
        return 0;
    }
    serde_json::from_slice::<serde_json::Value>(&turn.event.payload)
        .ok()
        .and_then(|payload| payload["chain"].as_u64())
        .and_then(|chain| u32::try_from(chain).ok())
        .unwrap_or(1)
}

/// A background job to start: what it runs, and where its result goes.
pub(super) struct Job {
    pub tool: ToolSettings,
    pub hidden: HiddenPaths,
    pub arguments: serde_json::Value,
    pub key: String,
    pub session_key: String,
    pub route: String,
    /// How many internal turns in a row its result is.
    pub chain: u32,
}

impl BackgroundJobs {
    /// Starts `job` detached from the turn, if a slot is free; returns what the turn records as
    /// the tool's result: the job id, or why the job was not started.
    pub(super) fn start(&self, job: Job, runtime: &RuntimeSettings) -> String {
        match self.slots.take(&job.session_key, runtime) {
            Ok(()) => self.spawn(job),
            Err(why) => {
                tracing::warn!(tool = %job.tool.name, reason = %why, "background job refused");
                metrics::tool_call(&job.tool.name, "refused");
                format!("error: background job not started: {why}")
            }
        }
    }

    /// Runs `job` on the tracker the drain stops last (after turns and deliveries).
    fn spawn(&self, job: Job) -> String {
        let job_id = uuid::Uuid::now_v7().to_string();
        let kill = self.stop.child_token();
        let (store, sessions, slots) = (
            self.store.clone(),
            self.sessions.clone(),
            self.slots.clone(),
        );
        let id = job_id.clone();
        // The job's lines carry the fields of the turn that started it.
        let span = tracing::Span::current();
        self.tracker.spawn(
            async move {
                // A job cut off by the drain is still reported to its session, so the agent learns
                // that it did not finish rather than waiting for a result that never comes.
                let outcome =
                    tools::run(&job.tool, &job.hidden, &job.arguments, &job.key, &kill).await;
                slots.release(&job.session_key);
                let payload = report(&id, &job, outcome);
                match store
                    .enqueue_internal(&job.session_key, &job.route, "background_job", payload)
                    .await
                {
                    Ok(event_id) => {
                        tracing::info!(queued_event_id = %event_id, job_id = %id,
                        "background job ended; its result is queued for the session");
                        sessions.wake();
                    }
                    Err(err) => {
                        tracing::error!(job_id = %id, error = %err,
                        "cannot queue the background job's result");
                    }
                }
            }
            .instrument(span),
        );
        serde_json::json!({
        "job_id": job_id,
        "status": "started in the background; its result arrives later as a new event in this session",
    })
    .to_string()
    }
}

/// The internal event's payload for how job `id` ended.
fn report(
    id: &str,
    job: &Job,
    outcome: Result<tools::ToolOutcome, ToolAbort>,
) -> serde_json::Value {
    let tool = &job.tool.name;
    match outcome {
        Ok(outcome) => {
            metrics::tool_call(tool, outcome.result());
            serde_json::json!({"job_id": id, "tool": tool, "outcome": outcome, "chain": job.chain})
        }
        Err(ToolAbort::Cancelled) => {
            metrics::tool_call(tool, "cancelled");
            tracing::warn!(job_id = %id, tool = %tool,
                "background job interrupted by the shutdown; its session is told");
            serde_json::json!({"job_id": id, "tool": tool, "outcome": null,
                "error": BACKGROUND_JOB_INTERRUPTED, "chain": job.chain})
        }
    }
}
