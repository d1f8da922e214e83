//! Sessions: which events run as turns, when, and how many at once.
//!
//! Queued events wait in the store, not in memory, so a burst of webhooks costs disk, not RAM. The
//! scheduler claims the oldest queued event of each idle session (one turn per session at a time,
//! FIFO within a session, oldest first across sessions), up to `max_concurrent_turns`, and hands
//! each to the runner. The store finds those sessions from an index of session queue heads, so
//! events waiting behind a busy or suspended session never delay another session's.

pub(crate) mod approval;
mod budget;
mod history;
mod jobs;
mod prompt;
mod runner;
mod transcript;
pub(crate) mod turn;
pub(crate) mod whatif;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub(crate) use jobs::{BackgroundJobs, JobSlots};
pub(crate) use runner::TurnContext;
pub(crate) use transcript::{Mark, StepFacts};

/// A session's transcript after the entry `after_seq` (`i64::MIN`: all of it) as every reader
/// sees it: each turn's event as the message the model saw (the store keeps a reference to the
/// event, not a copy of its payload).
pub(crate) async fn transcript(
    store: &Store,
    session_key: &str,
    after_seq: i64,
) -> Result<Vec<crate::store::TranscriptRow>, crate::store::StoreError> {
    let mut rows = store.transcript(session_key, after_seq).await?;
    prompt::resolve_event_rows(&mut rows);
    Ok(rows)
}

/// The latest `limit` entries of a session's transcript, resolved as [`transcript`] resolves
/// them, and whether it has earlier ones.
pub(crate) async fn transcript_tail(
    store: &Store,
    session_key: &str,
    limit: i64,
) -> Result<crate::store::TranscriptTail, crate::store::StoreError> {
    let mut tail = store.transcript_tail(session_key, limit).await?;
    prompt::resolve_event_rows(&mut tail.rows);
    Ok(tail)
}

/// The event message a turn starts from with markers of `nonce`, for the `markers` fuzz target.
#[cfg(feature = "fuzzing")]
pub(crate) fn event_message_for_fuzzing(prompt: &str, nonce: &str) -> String {
    prompt::event_message("route", "type", "id", prompt, nonce)
        .content
        .unwrap_or_default()
}

use crate::config::OnBusy;
use crate::locks;
use crate::logging;
use crate::store::{Claim, ClaimedTurn, Store};
use tracing::Instrument;

/// How often the scheduler looks for work even without a wake-up (a safety net, not the trigger).
const IDLE_POLL: Duration = Duration::from_secs(1);
/// Pause after a failed claim (e.g. the disk is full) before trying again.
const CLAIM_RETRY: Duration = Duration::from_secs(1);

/// How a running turn is stopped early, and how whoever stopped it learns that it ended.
#[derive(Clone, Default)]
pub(crate) struct TurnControl {
    /// A newer event of the session (`on_busy = "interrupt"`).
    pub(crate) interrupt: CancellationToken,
    /// The operator (`sessions cancel`).
    pub(crate) cancel: CancellationToken,
    /// Fired once the turn has ended and its end is committed.
    pub(crate) ended: CancellationToken,
}

/// A turn running on this node.
struct RunningTurn {
    turn_id: String,
    control: TurnControl,
    /// It runs alone: nothing else is claimed until it ends.
    alone: bool,
}

/// Shared between the listener (which reports new events) and the scheduler.
#[derive(Default)]
pub(crate) struct Sessions {
    wake: Notify,
    /// Running turns by session key.
    running: Mutex<HashMap<String, RunningTurn>>,
    /// Sessions whose turn runs on another node, which is still to be asked to interrupt it.
    to_interrupt: Mutex<InterruptRequests>,
}

/// Requests to interrupt another node's turn, made after the events that cause them were
/// acknowledged.
#[derive(Default)]
struct InterruptRequests {
    /// The sessions to ask for; one asked for twice before it is reached is asked once.
    keys: BTreeSet<String>,
    /// A task is asking for them, one session at a time.
    asking: bool,
}

impl Sessions {
    /// A new external event for `session_key` is durable: the scheduler looks for work, and with
    /// `on_busy = "interrupt"` the session's running turn is cancelled in its favour, here or (when
    /// it runs on another node) by asking its owner through the store once the event is
    /// acknowledged: the acknowledgement never waits for that request.
    pub(crate) fn event_accepted(
        self: &Arc<Self>,
        store: &Store,
        session_key: &str,
        on_busy: OnBusy,
    ) {
        self.wake.notify_one();
        if on_busy == OnBusy::Interrupt && !self.interrupt(session_key) {
            self.ask_owner_to_interrupt(store, session_key);
        }
    }

    /// Asks the node that runs `session_key`'s turn to interrupt it, in a task of its own (a
    /// session row that node holds locked must not delay a sender's 202); the request is a
    /// write to the store, which that node reads. One task asks, for one session at a time, so
    /// a burst of interrupting events holds one store connection at most.
    fn ask_owner_to_interrupt(self: &Arc<Self>, store: &Store, session_key: &str) {
        let start = {
            let mut pending = locks::lock(&self.to_interrupt);
            pending.keys.insert(session_key.to_string());
            !std::mem::replace(&mut pending.asking, true)
        };
        if start {
            let (sessions, store) = (self.clone(), store.clone());
            tokio::spawn(async move { sessions.ask_for_pending(&store).await });
        }
    }

    /// Makes the pending interrupt requests until none is left.
    async fn ask_for_pending(&self, store: &Store) {
        loop {
            let next = {
                let mut pending = locks::lock(&self.to_interrupt);
                let next = pending.keys.pop_first();
                pending.asking = next.is_some();
                next
            };
            let Some(session_key) = next else {
                return;
            };
            if let Err(err) = store.request_interrupt(&session_key).await {
                // The event is durable and queued; only the interruption is lost.
                tracing::warn!(session_key = %session_key, error = %err,
                    "cannot ask the node running this session to interrupt its turn");
            }
        }
    }

    /// Cancels the running turn of `session_key` in favour of a newer event, if it runs here.
    pub(crate) fn interrupt(&self, session_key: &str) -> bool {
        match self.lock().get(session_key) {
            Some(turn) => {
                turn.control.interrupt.cancel();
                true
            }
            None => false,
        }
    }

    /// The operator cancels the running turn of `session_key`, if it runs here: its tools are
    /// killed and its event ends `failed`. Returns the turn id and a token fired once the end is
    /// committed.
    pub(crate) fn cancel(&self, session_key: &str) -> Option<(String, CancellationToken)> {
        self.lock().get(session_key).map(|turn| {
            turn.control.cancel.cancel();
            (turn.turn_id.clone(), turn.control.ended.clone())
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, RunningTurn>> {
        locks::lock(&self.running)
    }

    /// Asks the scheduler to look for work now (an event became claimable).
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    pub(crate) fn running_count(&self) -> usize {
        self.lock().len()
    }

    fn running_alone(&self) -> bool {
        self.lock().values().any(|turn| turn.alone)
    }

    /// The turn ended. The session may already run its next turn, so only this turn is removed.
    fn finished(&self, session_key: &str, turn_id: &str) {
        let mut running = self.lock();
        if running
            .get(session_key)
            .is_some_and(|turn| turn.turn_id == turn_id)
            && let Some(turn) = running.remove(session_key)
        {
            turn.control.ended.cancel();
        }
        drop(running);
        self.wake.notify_one();
    }
}

/// The scheduler task. Its handle is [`Sessions`], through which ingress, resume and the
/// operator reach it.
pub(crate) struct Scheduler {
    context: Arc<TurnContext>,
    turns: TaskTracker,
}

impl Scheduler {
    pub(crate) fn new(context: Arc<TurnContext>) -> Scheduler {
        Scheduler {
            context,
            turns: TaskTracker::new(),
        }
    }

    /// The turns it started, which the drain waits for (and cancels) after it stopped claiming.
    pub(crate) fn turns(&self) -> TaskTracker {
        self.turns.clone()
    }

    /// Claims and starts turns until `stop_claiming` fires.
    pub(crate) async fn run(self, stop_claiming: CancellationToken) {
        let sessions = self.context.sessions.clone();
        while !stop_claiming.is_cancelled() {
            match self.next_claim().await {
                Ok(Some(claim)) => match self.context.store.claim_turns(claim).await {
                    Ok(claimed) => claimed.into_iter().for_each(|turn| self.start(turn)),
                    Err(err) => {
                        tracing::warn!(error = %err, "cannot claim queued events; retrying");
                        tokio::time::sleep(CLAIM_RETRY).await;
                    }
                },
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "cannot look for turns that must run alone; retrying");
                    tokio::time::sleep(CLAIM_RETRY).await;
                }
            }
            tokio::select! {
                () = sessions.wake.notified() => {}
                () = tokio::time::sleep(IDLE_POLL) => {}
                () = stop_claiming.cancelled() => {}
            }
        }
    }

    /// What this round claims, by [`plan_claim`]. With no free slot nothing can be claimed,
    /// alone or not, so the store is not asked: a round per accept under load costs nothing.
    async fn next_claim(&self) -> Result<Option<Claim>, crate::store::StoreError> {
        let sessions = &self.context.sessions;
        // Read each round: a reload that changes the limit or a priority applies to the next
        // claim.
        let settings = self.context.settings.get();
        let limit = settings.config.runtime.max_concurrent_turns;
        let running = sessions.running_count();
        if sessions.running_alone() || running >= limit {
            return Ok(None);
        }
        let waiting_alone = self.context.store.waiting_to_run_alone().await?;
        Ok(plan_claim(
            running,
            waiting_alone,
            limit,
            settings.priorities.clone(),
        ))
    }

    /// Runs a claimed turn on the tracker the drain waits for.
    fn start(&self, turn: ClaimedTurn) {
        let control = TurnControl::default();
        let sessions = self.context.sessions.clone();
        sessions.lock().insert(
            turn.event.session_key.clone(),
            RunningTurn {
                turn_id: turn.turn_id.clone(),
                control: control.clone(),
                alone: turn.alone,
            },
        );
        if turn.alone {
            tracing::info!(session_key = %turn.event.session_key, event_id = %turn.event.id,
                "resuming alone: a crash interrupted this turn, so nothing runs beside it");
        }
        let context = self.context.clone();
        let span = logging::turn_span(
            &turn.event.id,
            &turn.event.session_key,
            &turn.event.route,
            &turn.turn_id,
        );
        self.turns.spawn(
            async move {
                let session_key = turn.event.session_key.clone();
                let turn_id = turn.turn_id.clone();
                context.run(turn, &control).await;
                sessions.finished(&session_key, &turn_id);
            }
            .instrument(span),
        );
    }
}

/// What one round claims, with `running` turns on this node (none of them alone) and
/// `waiting_alone` saying whether a turn that must run alone waits (docs/reference.md, "Crash
/// loops and bystanders"): that turn once nothing runs, and nothing else until it has started;
/// otherwise the free slots of `limit`, with the routes' `priorities` counted when there are
/// any (`Settings::priorities`).
fn plan_claim(
    running: usize,
    waiting_alone: bool,
    limit: usize,
    priorities: Option<Arc<str>>,
) -> Option<Claim> {
    if waiting_alone {
        return (running == 0).then_some(Claim::Alone);
    }
    let free = limit.saturating_sub(running);
    if free == 0 {
        return None;
    }
    Some(match priorities {
        None => Claim::Beside(free),
        Some(priorities) => Claim::BesideByPriority {
            limit: free,
            priorities,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_that_must_run_alone_waits_for_the_others_and_holds_back_new_ones() {
        let plan = |running, waiting_alone| plan_claim(running, waiting_alone, 16, None);
        assert_eq!(plan(0, false), Some(Claim::Beside(16)));
        assert_eq!(plan(3, false), Some(Claim::Beside(13)));
        assert_eq!(plan(16, false), None);
        assert_eq!(plan(3, true), None, "the running turns finish first");
        assert_eq!(plan(0, true), Some(Claim::Alone));
    }

    #[test]
    fn priorities_are_claimed_by_only_when_a_route_has_one() {
        let priorities: Arc<str> = Arc::from(r#"{"pager":10}"#);
        assert_eq!(
            plan_claim(2, false, 16, Some(priorities.clone())),
            Some(Claim::BesideByPriority {
                limit: 14,
                priorities
            })
        );
        assert_eq!(
            plan_claim(0, true, 16, Some(Arc::from("{}"))),
            Some(Claim::Alone)
        );
    }
}
