//! The daemon's periodic tasks: health (watchdog and `STATUS=`), retention, the summary line,
//! and the console's charts kept across a restart.
//!
//! None of them is on the path of an event; each runs until the drain's last stage, and a round
//! that fails is logged and tried again at the next one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::notify;
use crate::config::{Settings, Shared};
use crate::ingress::capacity::Capacity;
use crate::session::Sessions;
use crate::store::{self, DedupWindow, Store};
use crate::{logging, metrics};

/// How often delivery ids older than `dedup_window` are forgotten.
const DEDUP_PRUNE_INTERVAL: Duration = Duration::from_secs(3600);
/// The longest pause between two retention rounds.
const PRUNE_INTERVAL: Duration = Duration::from_secs(300);
/// The pause between two retention batches.
const PRUNE_PAUSE: Duration = Duration::from_millis(10);
/// How often the summary line is written (when anything happened).
const SUMMARY_INTERVAL: Duration = Duration::from_secs(60);
/// How often the charts' last day is written to the state directory (and when the daemon
/// stops): a crash loses at most this much of it.
const KEEP_ACTIVITY_INTERVAL: Duration = Duration::from_secs(300);
/// `STATUS=` is refreshed this often when there is no watchdog to piggyback on.
const STATUS_INTERVAL: Duration = Duration::from_secs(5);

/// Watchdog pings and `STATUS=` updates.
pub(super) struct Health {
    pub store: Store,
    pub sessions: Arc<Sessions>,
    /// Whether webhooks are refused for space or backlog, read with the settings in effect.
    pub capacity: Arc<Capacity>,
    pub settings: Arc<Shared<Settings>>,
}

impl Health {
    /// Pings the watchdog and refreshes `STATUS=` until `stop`. A ping is sent only when this
    /// task ran on time and the store's writer thread answered: a wedged event loop or writer
    /// stops the pings, and systemd restarts the daemon.
    pub(super) async fn run(self, stop: CancellationToken) {
        let watchdog = notify::watchdog_interval();
        let interval = watchdog.map_or(STATUS_INTERVAL, |w| w / 3);
        let mut last = Instant::now();
        notify::status(&self.status_line().await);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let late = last.elapsed() > interval * 2;
            last = Instant::now();
            let writer_alive = tokio::time::timeout(interval, self.store.answers())
                .await
                .unwrap_or(false);
            let mut status = self.status_line().await;
            if late {
                status = format!("event loop ran late; {status}");
            }
            if !writer_alive {
                status = format!("WEDGED: the state writer does not answer; {status}");
            }
            notify::status(&status);
            if watchdog.is_some() && writer_alive && !late {
                notify::watchdog();
            }
        }
    }

    /// One line for `STATUS=`: what is running, queued, waiting to resume, suspended.
    async fn status_line(&self) -> String {
        let running = self.sessions.running_count();
        let counts = self.store.live_counts().await.unwrap_or_default();
        let mut line = format!(
            "{running} running, {} queued, {} resume-pending, {} suspended, {} awaiting approval",
            counts.queued, counts.resume_pending, counts.suspended, counts.approvals_pending,
        );
        if !self.store.is_writable() {
            line.push_str("; state NOT writable: answering 503");
        } else if let Some(refusal) = self.capacity.refusal(&self.settings.get().config.runtime) {
            line.push_str(&format!("; refusing webhooks (503): {refusal}"));
        }
        line
    }
}

/// Retention and dedup pruning.
pub(super) struct Retention {
    pub store: Store,
    pub settings: Arc<Shared<Settings>>,
}

impl Retention {
    /// Prunes until `stop`: finished work older than `[store] retention` is deleted batch by
    /// batch (each a short transaction, so accepts never wait long behind it), and delivery ids
    /// older than `dedup_window` are forgotten. Both settings are read anew each round, so a
    /// reload applies them.
    pub(super) async fn run(self, stop: CancellationToken) {
        let store = &self.store;
        let mut last_dedup_prune: Option<Instant> = None;
        while !stop.is_cancelled() {
            let config = &self.settings.get().config;
            let (retention, dedup_window) = (config.retention, config.runtime.dedup_window);
            let cutoff =
                store::now_millis() - i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
            let mut deleted = 0;
            loop {
                match store.prune_finished(cutoff).await {
                    Ok(0) => break,
                    Ok(count) => deleted += count,
                    Err(err) => {
                        tracing::warn!(error = %err, "could not delete finished work past retention");
                        break;
                    }
                }
                if stop.is_cancelled() {
                    return;
                }
                // Let accepts and turns have the writer between batches: a round deletes a few
                // thousand events a second at most, spread out, instead of holding the writer in
                // one long stretch.
                tokio::time::sleep(PRUNE_PAUSE).await;
            }
            if deleted > 0 {
                tracing::info!(
                    events = deleted,
                    retention = %humantime::format_duration(retention),
                    "deleted finished events past retention, with their turns, transcripts and deliveries"
                );
            }
            if last_dedup_prune.is_none_or(|at| at.elapsed() >= DEDUP_PRUNE_INTERVAL) {
                last_dedup_prune = Some(Instant::now());
                match store.prune_dedup(DedupWindow(dedup_window)).await {
                    Ok(0) => {}
                    Ok(count) => {
                        tracing::info!(count, "forgot delivery ids older than dedup_window");
                    }
                    Err(err) => tracing::warn!(error = %err, "could not prune delivery ids"),
                }
            }
            // A short retention (minutes, as in tests and soaks) is checked often; a long one
            // every few minutes.
            let pause = (retention / 4).clamp(Duration::from_secs(1), PRUNE_INTERVAL);
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }
}

/// Approval requests nobody decides: a warning at `EXPIRY_WARNING` of `approval_timeout`, then
/// expiry, after which the turn goes on without the call.
pub(super) struct Expiry {
    pub store: Store,
    pub settings: Arc<Shared<Settings>>,
    pub sessions: Arc<Sessions>,
}

/// Requests near expiry warned about in one round at most (the nearest first).
const WARN_SCAN: i64 = 1_000;

impl Expiry {
    /// Expires and warns until `stop`, checking about twenty times per `approval_timeout`
    /// (between a quarter second and half a minute).
    pub(super) async fn run(self, stop: CancellationToken) {
        let mut warned: std::collections::HashSet<String> = Default::default();
        while !stop.is_cancelled() {
            match crate::session::approval::expire_due(&self.store, &self.sessions).await {
                Ok(_) => {}
                Err(err) => tracing::warn!(error = %err, "could not expire approval requests"),
            }
            self.warn(&mut warned).await;
            let timeout = self.settings.get().config.runtime.approval_timeout;
            let pause = (timeout / 20).clamp(Duration::from_millis(250), Duration::from_secs(30));
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Warns, once each, about pending requests past 80 % of their time (only those are read).
    /// `warned` keeps the ids warned about that are still near expiry and pending, so it is
    /// bounded by them.
    async fn warn(&self, warned: &mut std::collections::HashSet<String>) {
        let Ok(near) = self.store.approvals_to_warn(WARN_SCAN).await else {
            return;
        };
        let now = store::now_millis();
        let ids: std::collections::HashSet<&str> = near.iter().map(|row| row.id.as_str()).collect();
        warned.retain(|id| ids.contains(id.as_str()));
        for row in near {
            if !warned.insert(row.id.clone()) {
                continue;
            }
            tracing::warn!(
                session_key = %row.session, event_id = %row.event_id, approval_id = %row.id,
                tool = %row.tool, expires_in_ms = row.expires_at - now,
                "approval request expires soon without a decision; the call will not run"
            );
        }
    }
}

/// How often memory the allocator holds free is given back to the kernel.
const TRIM_INTERVAL: Duration = Duration::from_secs(5);

/// Every few seconds, the memory the allocator holds free goes back to the kernel, so that
/// what a flood of connections took does not stay with the process after it (docs/reference.md,
/// "Threat model"). On a blocking thread: with a large heap a trim takes a moment.
pub(super) struct MemoryTrim;

impl MemoryTrim {
    pub(super) async fn run(self, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(TRIM_INTERVAL) => {}
            }
            let _ = tokio::task::spawn_blocking(crate::sys::release_free_memory).await;
        }
    }
}

/// Once a minute, when anything happened, one line with the minute's figures. Per-event lines
/// may be left out under load (docs/reference.md, "Journal"); this line is not, so the journal
/// still tells how much went through.
pub(super) struct Summary;

impl Summary {
    pub(super) async fn run(self, stop: CancellationToken) {
        let mut last = metrics::activity();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(SUMMARY_INTERVAL) => {}
            }
            let now = metrics::activity();
            let minute = now.since(last);
            last = now;
            if minute.is_quiet() {
                continue;
            }
            let left_out = if minute.log_lines_skipped > 0 {
                format!(
                    "; {} per-event lines left out (runtime.event_log_max_per_second)",
                    minute.log_lines_skipped
                )
            } else {
                String::new()
            };
            tracing::info!(
                message_id = logging::MESSAGE_SUMMARY,
                accepted = minute.accepted,
                refused = minute.refused,
                turns_completed = minute.turns_completed,
                turns_failed = minute.turns_failed,
                delivered = minute.delivered,
                delivery_failures = minute.delivery_failures,
                log_lines_skipped = minute.log_lines_skipped,
                "in the last minute: {} events accepted, {} webhooks refused, {} turns completed, \
                 {} ended otherwise, {} results delivered, {} delivery attempts failed{left_out}",
                minute.accepted,
                minute.refused,
                minute.turns_completed,
                minute.turns_failed,
                minute.delivered,
                minute.delivery_failures,
            );
        }
    }
}

/// The console's charts of the last day (`metrics::recent`), kept in the state directory, so
/// that a restart does not empty them.
pub(super) struct KeepActivity {
    pub files: store::StateDir,
}

/// The activity file: the minutes of the last day in which anything happened.
#[derive(serde::Serialize, serde::Deserialize)]
struct KeptActivity {
    version: u32,
    minutes: Vec<metrics::recent::Minute>,
}

const KEPT_ACTIVITY_VERSION: u32 = 1;

impl KeepActivity {
    /// Puts back what the last run kept. A file that cannot be read is a warning: the charts
    /// start empty, and the next write replaces it.
    pub(super) fn restore(&self) {
        let path = self.files.activity();
        let problem = match self.files.read(&path) {
            Ok(None) => return,
            Ok(Some(bytes)) => match serde_json::from_slice::<KeptActivity>(&bytes) {
                Ok(kept) if kept.version == KEPT_ACTIVITY_VERSION => {
                    metrics::recent::restore(&kept.minutes);
                    return;
                }
                Ok(kept) => format!("version {} is not {KEPT_ACTIVITY_VERSION}", kept.version),
                Err(err) => err.to_string(),
            },
            Err(err) => err.to_string(),
        };
        tracing::warn!(file = %path.display(), error = %problem,
            "the console's charts start empty: the last run's activity file cannot be read");
    }

    /// Writes the last day every `KEEP_ACTIVITY_INTERVAL`, and once more at `stop`.
    pub(super) async fn run(self, stop: CancellationToken) {
        loop {
            let stopping = tokio::select! {
                () = stop.cancelled() => true,
                () = tokio::time::sleep(KEEP_ACTIVITY_INTERVAL) => false,
            };
            self.write().await;
            if stopping {
                return;
            }
        }
    }

    async fn write(&self) {
        let kept = KeptActivity {
            version: KEPT_ACTIVITY_VERSION,
            minutes: metrics::recent::kept(),
        };
        let files = self.files.clone();
        let written = tokio::task::spawn_blocking(move || {
            let bytes = serde_json::to_vec(&kept).map_err(std::io::Error::other)?;
            files.replace_activity(&bytes)
        })
        .await
        .unwrap_or_else(|err| Err(std::io::Error::other(err)));
        if let Err(err) = written {
            tracing::warn!(file = %self.files.activity().display(), error = %err,
                "cannot keep the console's charts; a restart would empty them");
        }
    }
}
