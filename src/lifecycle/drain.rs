//! The stop sequence, in one place.
//!
//! A SIGTERM must never lose acknowledged work and must never hang: systemd waits for us only as
//! long as we keep extending the stop timeout, and an operator waits for `systemctl stop`. So the
//! drain runs fixed stages in order, each with a written budget, and what a stage cannot finish in
//! its budget is left in durable state for the next start:
//!
//! 1. stop claiming: the scheduler and the resumes start no new turn, but webhooks are still
//!    accepted and acknowledged (durably, as always: their turns run in the next process), so a
//!    restart never makes a sender wait;
//! 2. running turns finish (`drain_timeout`);
//! 3. stop accepting: listeners close (systemd keeps the sockets, clients wait for the next
//!    process) and in-flight HTTP requests finish (`REQUEST_FINISH`);
//! 4. turns still running are cancelled and commit `resume_pending` (`CANCEL_COMMIT`);
//! 5. the outbox flushes what is due (`DELIVERY_FLUSH`); undelivered results stay in the outbox;
//! 6. background tool jobs are stopped, each recorded for its session, and the periodic tasks end
//!    (`BACKGROUND_STOP`);
//! 7. hand over: the store gives back what this process holds (PostgreSQL: its delivery leases
//!    and budget reservations, so that other nodes need not wait for them to expire;
//!    `STORE_RELEASE`), and the last spans are exported (`TRACE_FLUSH`). Left undone, leases
//!    expire and spans are lost; no work is.
//!
//! Every long-lived task has the same shape: a value whose `run(shutdown)` future ends once the
//! token it was given fires (plus, where others need to reach it, a cloneable handle such as
//! `Sessions` or `DeliveryHandle`). [`Drain::start`] spawns it on the drain's one [`TaskTracker`]
//! with the token of the stage that stops it, a child of the drain's root token.

use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::notify;
use crate::store::Store;

/// Stage 3: how long in-flight HTTP requests may take to finish.
pub(super) const REQUEST_FINISH: Duration = Duration::from_secs(10);
/// Stage 4: how long cancelled turns get to commit their `resume_pending` state.
const CANCEL_COMMIT: Duration = Duration::from_secs(10);
/// Stage 5: how long due deliveries may take; an attempt cut off is repeated at the next start.
const DELIVERY_FLUSH: Duration = Duration::from_secs(5);
/// Stage 6: how long background jobs get to record that they were cut off.
const BACKGROUND_STOP: Duration = Duration::from_secs(5);
/// Stage 7: how long the store may take to give back this process's leases.
const STORE_RELEASE: Duration = Duration::from_secs(3);
/// Stage 7: how long the last spans may take to reach the collector.
const TRACE_FLUSH: Duration = Duration::from_secs(2);
/// While draining, systemd's stop timeout is pushed out by this much at every heartbeat.
const EXTENSION: Duration = Duration::from_secs(10);
const HEARTBEAT: Duration = Duration::from_secs(2);

/// The budgets of the stages, and their sum.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budgets {
    pub requests: Duration,
    pub turns: Duration,
    pub cancel_commit: Duration,
    pub deliveries: Duration,
    pub background: Duration,
    pub handover: Duration,
}

impl Budgets {
    pub(crate) fn new(drain_timeout: Duration) -> Budgets {
        Budgets {
            requests: REQUEST_FINISH,
            turns: drain_timeout,
            cancel_commit: CANCEL_COMMIT,
            deliveries: DELIVERY_FLUSH,
            background: BACKGROUND_STOP,
            handover: STORE_RELEASE + TRACE_FLUSH,
        }
    }

    /// The longest the drain can take; the stop-timeout extension never reaches past it.
    pub(crate) fn total(&self) -> Duration {
        self.requests
            + self.turns
            + self.cancel_commit
            + self.deliveries
            + self.background
            + self.handover
    }
}

/// The stages a task can be stopped at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Stage 1: the scheduler and the resumes stop claiming.
    StopClaiming,
    /// Stage 3: listeners stop accepting.
    StopAccepting,
    /// Stage 4: running turns stop and are left for resume.
    CancelTurns,
    /// Stage 5: the deliverer sends what is due and stops.
    FlushDeliveries,
    /// Stage 6: background jobs and periodic tasks end.
    StopBackground,
}

/// The daemon's shutdown: one root token with a child per stage, and one tracker for every
/// long-lived task.
pub(crate) struct Drain {
    root: CancellationToken,
    claiming: CancellationToken,
    accepting: CancellationToken,
    turns: CancellationToken,
    delivering: CancellationToken,
    background: CancellationToken,
    tracker: TaskTracker,
}

impl Drain {
    pub(crate) fn new() -> Drain {
        let root = CancellationToken::new();
        Drain {
            claiming: root.child_token(),
            accepting: root.child_token(),
            turns: root.child_token(),
            delivering: root.child_token(),
            background: root.child_token(),
            root,
            tracker: TaskTracker::new(),
        }
    }

    /// The token that fires when `stage` begins.
    pub(crate) fn token(&self, stage: Stage) -> CancellationToken {
        match stage {
            Stage::StopClaiming => &self.claiming,
            Stage::StopAccepting => &self.accepting,
            Stage::CancelTurns => &self.turns,
            Stage::FlushDeliveries => &self.delivering,
            Stage::StopBackground => &self.background,
        }
        .clone()
    }

    /// Starts a long-lived task: `run` gets the token of the stage that stops it, and the
    /// task runs on the drain's tracker, which stage 6 waits for.
    pub(crate) fn start<R, F>(&self, stage: Stage, run: R) -> JoinHandle<F::Output>
    where
        R: FnOnce(CancellationToken) -> F,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(run(self.token(stage)))
    }

    /// The tracker background tool jobs and MCP servers are spawned on, so that stage 6 waits
    /// for them.
    pub(crate) fn tracker(&self) -> TaskTracker {
        self.tracker.clone()
    }

    /// Runs the stages in order. `scheduler`, `listener` and `deliverer` are the tasks of stages
    /// 1, 3 and 5; `turns` tracks the running turns; `store` is handed over in stage 7.
    pub(crate) async fn run(&self, budgets: Budgets, stages: Stages) -> Result<(), String> {
        let started = Instant::now();
        let deadline = started + budgets.total();
        let extend = tokio::spawn(async move {
            // Never past the sum of the budgets: a drain that overruns it is stuck, and systemd's
            // own timeout should then end it.
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return;
                }
                notify::extend_timeout(EXTENSION.min(left + HEARTBEAT));
                tokio::time::sleep(HEARTBEAT).await;
            }
        });
        notify::stopping();
        tracing::info!(
            budget = ?budgets.total(),
            "stopping: no new turns; webhooks are still accepted while the running turns finish"
        );

        // 1. Stop claiming.
        self.claiming.cancel();
        let _ = stages.scheduler.await;

        // 2. Running turns finish, up to drain_timeout, while webhooks are still accepted.
        stages.turns.close();
        let finished = tokio::time::timeout(budgets.turns, stages.turns.wait())
            .await
            .is_ok();

        // 3. Stop accepting; in-flight requests finish meanwhile.
        self.accepting.cancel();
        if !finished {
            tracing::warn!(
                running = stages.turns.len(),
                "drain_timeout reached; cancelling the turns still running"
            );
            // 4. Cancel and commit resume_pending.
            self.turns.cancel();
            if tokio::time::timeout(budgets.cancel_commit, stages.turns.wait())
                .await
                .is_err()
            {
                tracing::error!(
                    "cancelled turns did not commit in time; they resume as crashed at the next start"
                );
            }
        }
        let served = stages.listener.await;

        // 5. A bounded flush of the outbox.
        self.delivering.cancel();
        let mut deliverer = stages.deliverer;
        if tokio::time::timeout(budgets.deliveries, &mut deliverer)
            .await
            .is_err()
        {
            deliverer.abort();
            tracing::warn!(
                budget = ?budgets.deliveries,
                "deliveries still in progress at the end of the flush; they stay in the outbox and are sent at the next start"
            );
        }

        // 6. Background jobs record that they were cut off; periodic tasks end.
        self.background.cancel();
        self.tracker.close();
        if tokio::time::timeout(budgets.background, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                remaining = self.tracker.len(),
                "background tasks did not stop in time"
            );
        }
        self.root.cancel();

        // 7. Hand over what this process holds, and the last spans.
        hand_over(&stages.store).await;
        extend.abort();
        tracing::info!(took = ?started.elapsed(), "drain finished");
        match served {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(format!("webhook listener failed: {err}")),
            Err(err) => Err(format!("webhook listener task failed: {err}")),
        }
    }
}

/// The tasks the drain stops in order.
pub(crate) struct Stages {
    /// The webhook listener; resolves once in-flight requests finished (stage 3).
    pub listener: JoinHandle<std::io::Result<()>>,
    /// The scheduler; resolves once it stopped claiming (stage 1).
    pub scheduler: JoinHandle<()>,
    /// The running turns (stages 2 and 4).
    pub turns: TaskTracker,
    /// The deliverer (stage 5).
    pub deliverer: JoinHandle<()>,
    /// The store, which gives back this process's leases (stage 7).
    pub store: Store,
}

/// Stage 7: the store gives back this process's leases (`STORE_RELEASE`), then the last spans
/// are exported (`TRACE_FLUSH`).
async fn hand_over(store: &Store) {
    let status = "stopping: handing the store's leases back and exporting the last spans";
    notify::status(status);
    tracing::info!(budget = ?(STORE_RELEASE + TRACE_FLUSH), "{status}");
    if tokio::time::timeout(STORE_RELEASE, store.release())
        .await
        .is_err()
    {
        tracing::warn!(
            budget = ?STORE_RELEASE,
            "the store's leases were not handed back in time; other nodes take them when they expire"
        );
    }
    // The exporter bounds itself; the wait for its thread is bounded too, in case it does not.
    let traces = tokio::task::spawn_blocking(|| crate::telemetry::stop(TRACE_FLUSH));
    if tokio::time::timeout(TRACE_FLUSH, traces).await.is_err() {
        tracing::warn!(budget = ?TRACE_FLUSH, "the last spans were not exported in time");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The unit's `TimeoutStopSec` is the sum of the stage budgets with the default
    /// `drain_timeout` (20 s), so that systemd's own timeout and the drain's extension agree.
    #[test]
    fn the_unit_s_stop_timeout_is_the_sum_of_the_budgets() {
        let unit = include_str!("../../systemd/agentgate.service");
        let seconds = unit
            .lines()
            .find_map(|line| line.strip_prefix("TimeoutStopSec="))
            .and_then(|value| value.trim().parse::<u64>().ok())
            .expect("the unit sets TimeoutStopSec in seconds");
        let budgets = Budgets::new(Duration::from_secs(20));
        assert_eq!(Duration::from_secs(seconds), budgets.total());
    }
}
