//! Backpressure: whether new events may be accepted now.
//!
//! Events wait on disk, so nothing in memory limits how many are queued; without a limit a
//! sender with a valid secret could queue until the disk is full, and then every route would get
//! 503 from a store that can no longer write. Past `max_queued_events`, or with less free space
//! than `min_free_disk` on the state file system, new webhooks get 503 with `Retry-After` (and
//! `/readyz` fails) while the store still works: accepted events keep running, redeliveries of
//! accepted events still get their 200, and senders retry later.
//!
//! The answer is read from two atomics on every request; a watcher task refreshes them from the
//! store's index counts and `statvfs` about once a second, and each accept counts itself in
//! between, so a burst cannot overshoot by more than one refresh interval of accepts.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{Config, RouteSettings, RuntimeSettings, Settings, Shared};
use crate::store::Store;

/// How often the queue depth and free space are measured.
const REFRESH: Duration = Duration::from_secs(1);
/// What a refused sender is told to wait before retrying.
pub(super) const RETRY_AFTER_SECONDS: u64 = 30;

#[derive(Default)]
pub(crate) struct Capacity {
    /// Queued events at the last count, plus the accepts since.
    queued: AtomicU64,
    /// The same for each route.
    queued_by_route: Mutex<HashMap<String, u64>>,
    /// Free bytes on the state file system at the last look (`u64::MAX`: not measured).
    free_disk: AtomicU64,
    /// The last answer, for logging changes once.
    refusing: AtomicBool,
}

impl Capacity {
    pub(crate) fn new() -> Capacity {
        Capacity {
            free_disk: AtomicU64::new(u64::MAX),
            ..Capacity::default()
        }
    }

    /// Why new events are refused now, if they are.
    pub(crate) fn refusal(&self, runtime: &RuntimeSettings) -> Option<String> {
        let queued = self.queued.load(Ordering::Relaxed);
        if queued >= runtime.max_queued_events {
            return Some(format!(
                "{queued} events are queued (runtime.max_queued_events = {}); retry later",
                runtime.max_queued_events
            ));
        }
        let free = self.free_disk.load(Ordering::Relaxed);
        if free < runtime.min_free_disk {
            return Some(format!(
                "the state file system has {} MiB free (runtime.min_free_disk = {} MiB); retry later",
                free >> 20,
                runtime.min_free_disk >> 20
            ));
        }
        None
    }

    /// Why new events of `route` are refused now although others are not: the route holds its
    /// whole share of the queue, so that one sender's flood cannot take another's capacity.
    pub(crate) fn route_refusal(&self, route: &RouteSettings, config: &Config) -> Option<String> {
        let limit = route_limit(route, &config.runtime, config.routes.len());
        let queued = self.by_route().get(&route.name).copied().unwrap_or(0);
        (queued >= limit).then(|| {
            format!(
                "{queued} events of route {} are queued (its share of the queue is {limit}: \
                 routes.{}.max_queued_events); retry later",
                route.name, route.name
            )
        })
    }

    /// One more event of `route` is queued.
    pub(crate) fn accepted(&self, route: &str) {
        self.queued.fetch_add(1, Ordering::Relaxed);
        *self.by_route().entry(route.to_string()).or_default() += 1;
    }

    fn by_route(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        crate::locks::lock(&self.queued_by_route)
    }

    fn refresh(
        &self,
        queued: u64,
        by_route: HashMap<String, u64>,
        free_disk: Option<u64>,
        runtime: &RuntimeSettings,
    ) {
        self.queued.store(queued, Ordering::Relaxed);
        *self.by_route() = by_route;
        self.free_disk
            .store(free_disk.unwrap_or(u64::MAX), Ordering::Relaxed);
        let refusal = self.refusal(runtime);
        let was_refusing = self.refusing.swap(refusal.is_some(), Ordering::Relaxed);
        match (refusal, was_refusing) {
            (Some(reason), false) => {
                tracing::warn!(reason = %reason, "backpressure: new webhooks get 503 until this clears");
            }
            (None, true) => tracing::info!("backpressure cleared: new webhooks are accepted again"),
            _ => {}
        }
    }
}

/// How many events of `route` may be queued: its `max_queued_events`, else an even share of
/// `runtime.max_queued_events` among the `routes`; never more than the whole queue.
fn route_limit(route: &RouteSettings, runtime: &RuntimeSettings, routes: usize) -> u64 {
    let whole = runtime.max_queued_events;
    let share = whole.div_ceil(u64::try_from(routes.max(1)).unwrap_or(u64::MAX));
    route.max_queued_events.unwrap_or(share).min(whole)
}

/// The task that keeps a [`Capacity`] (its handle) current.
pub(crate) struct CapacityWatch {
    pub capacity: std::sync::Arc<Capacity>,
    pub store: Store,
    pub settings: std::sync::Arc<Shared<Settings>>,
    /// Whose free space is measured: `None` with a PostgreSQL store, whose disk is the server's.
    pub state_dir: Option<PathBuf>,
}

impl CapacityWatch {
    /// Refreshes the queued count from the store's index, and the free space of `state_dir`,
    /// until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        loop {
            self.measure().await;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(REFRESH) => {}
            }
        }
    }

    /// Measures once. Also called before the listener takes its first connection, so that a
    /// start below `min_free_disk` or over `max_queued_events` refuses from the first webhook.
    pub(crate) async fn measure(&self) {
        let current = self.settings.get();
        let runtime = &current.config.runtime;
        let free_disk = self.state_dir.as_deref().and_then(|dir| {
            nix::sys::statvfs::statvfs(dir)
                .map(|stats| stats.blocks_available() * stats.fragment_size())
                .map_err(|err| {
                    tracing::warn!(error = %err,
                        "cannot measure the free space of the state directory");
                })
                .ok()
        });
        // One count by route; the queue's whole depth is their sum.
        let by_route: HashMap<String, u64> = match self.store.queued_by_route().await {
            Ok(by_route) => by_route
                .into_iter()
                .map(|(route, queued)| (route, u64::try_from(queued).unwrap_or(0)))
                .collect(),
            Err(err) => {
                tracing::warn!(error = %err, "cannot count queued events");
                return;
            }
        };
        let queued = by_route.values().sum();
        self.capacity.refresh(queued, by_route, free_disk, runtime);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime(max_queued_events: u64, min_free_disk: u64) -> RuntimeSettings {
        RuntimeSettings {
            max_concurrent_turns: 16,
            max_turn_steps: 40,
            drain_timeout: Duration::from_secs(20),
            turn_idle_timeout: Duration::from_secs(300),
            resume_max_attempts: 3,
            resume_window: Duration::from_secs(3600),
            dedup_window: Duration::from_secs(3600),
            max_queued_events,
            event_log_level: crate::logging::EventLogLevel::Info,
            event_log_max_per_second: crate::logging::DEFAULT_EVENT_LINES_PER_SECOND,
            min_free_disk,
            max_tool_calls_per_reply: 16,
            max_repeated_tool_calls: 2,
            approval_timeout: Duration::from_secs(3600),
            max_background_jobs: 16,
            max_background_jobs_per_session: 4,
            max_internal_turns: 8,
        }
    }

    #[test]
    fn refuses_past_the_queue_limit_counting_accepts_between_refreshes() {
        let capacity = Capacity::new();
        let limits = runtime(3, 0);
        capacity.refresh(2, HashMap::new(), None, &limits);
        assert_eq!(capacity.refusal(&limits), None);
        capacity.accepted("hook");
        assert!(
            capacity
                .refusal(&limits)
                .is_some_and(|reason| reason.contains("max_queued_events"))
        );
        capacity.refresh(0, HashMap::new(), None, &limits);
        assert_eq!(capacity.refusal(&limits), None);
    }

    #[test]
    fn refuses_below_the_free_disk_floor() {
        let capacity = Capacity::new();
        let limits = runtime(100, 512 << 20);
        capacity.refresh(0, HashMap::new(), Some(100 << 20), &limits);
        assert!(
            capacity
                .refusal(&limits)
                .is_some_and(|reason| reason.contains("min_free_disk"))
        );
        capacity.refresh(0, HashMap::new(), Some(1 << 30), &limits);
        assert_eq!(capacity.refusal(&limits), None);
    }
}
