//! Logging: journald with filterable fields under systemd, stderr otherwise.
//!
//! Under systemd every event's fields (`EVENT_ID`, `SESSION_KEY`, `ROUTE`, `TURN_ID`,
//! `DELIVERY_ID`) become journal fields without a prefix, so `journalctl -u agentgate
//! SESSION_KEY=…` finds a session's lines, and lifecycle events carry a stable `MESSAGE_ID` that
//! the catalog in `packaging/` explains.

use std::io::IsTerminal;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// An event was made durable and acknowledged.
pub(crate) const MESSAGE_ACCEPTED: &str = "b7f154d7dfdf46c28b5b7998d4708050";

/// An interrupted session was admitted for resume.
pub(crate) const MESSAGE_RESUMED: &str = "5df92f03ee62438e85af6662fff2217f";
/// A session was suspended after `resume_max_attempts` resumes.
pub(crate) const MESSAGE_SUSPENDED: &str = "8d3eabf1daca478eac1e887be8e77a46";
/// An interrupted session older than `resume_window` was abandoned.
pub(crate) const MESSAGE_ABANDONED: &str = "6a213c63dcba4a4084d8903d2692e40c";
/// `reconcile` moved a malformed retry ledger to quarantine and wrote a repaired one.
pub(crate) const MESSAGE_LEDGER_QUARANTINED: &str = "7e28c6dc83aa474ea8de22650fa5aed3";
/// `reconcile` moved a damaged database to quarantine; the daemon starts a new one.
pub(crate) const MESSAGE_DATABASE_QUARANTINED: &str = "8785c08fc9764396ba145ce7a0c9615f";
/// A turn did not finish within `drain_timeout` and was left for resume.
pub(crate) const MESSAGE_DRAIN_TIMEOUT: &str = "227513bade8c4853a9b43df1e4e36359";

/// The operator resumed a session (`sessions resume`).
pub(crate) const MESSAGE_OPERATOR_RESUMED: &str = "7416ee7898a9431690ced8193360227b";
/// The operator suspended a session (`sessions suspend`).
pub(crate) const MESSAGE_OPERATOR_SUSPENDED: &str = "edcec10b073e46c1af472b6ca6e53c23";
/// The operator cancelled a session's running turn (`sessions cancel`).
pub(crate) const MESSAGE_OPERATOR_CANCELLED: &str = "21225f76e7564e6d8df082b2fd4275e0";
/// The operator reran a session from a transcript entry (`sessions rewind|fork`).
pub(crate) const MESSAGE_OPERATOR_RERUN: &str = "e6d605b8597d43bc83fde185614d01e3";
/// A tool call waits for an operator's decision (`approval = true`).
pub(crate) const MESSAGE_APPROVAL_REQUESTED: &str = "3f0a9c51d2b84e6f9a7c1e5d08b4f2a6";
/// An approval request was decided (approved, denied or expired).
pub(crate) const MESSAGE_APPROVAL_DECIDED: &str = "c4e81b7a90f34d2a8b6e2f1d93a5c707";
/// Once a minute, when anything happened: what the daemon did in that minute.
pub(crate) const MESSAGE_SUMMARY: &str = "b9407274a51241d6a2033e70e2f89303";

/// The level of the per-event lines (event accepted, turn started and completed, result
/// delivered): `[runtime] event_log_level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum EventLogLevel {
    #[default]
    Info,
    Debug,
}

/// At most `per_second` lines a second; the rest are counted. Lock-free, because per-event
/// lines are written on the accept path. The window is approximate at its edges (two threads
/// may both start a new second), which only matters to within a line or two.
pub(crate) struct LineBudget {
    per_second: AtomicU32,
    epoch: Instant,
    second: AtomicU64,
    written: AtomicU32,
    skipped: AtomicU64,
}

impl LineBudget {
    pub(crate) fn new(per_second: u32) -> LineBudget {
        LineBudget {
            per_second: AtomicU32::new(per_second),
            epoch: Instant::now(),
            second: AtomicU64::new(0),
            written: AtomicU32::new(0),
            skipped: AtomicU64::new(0),
        }
    }

    /// `Some(lines left out since the last one admitted)` if this line may be written; 0 per
    /// second means no limit.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let per_second = self.per_second.load(Ordering::Relaxed);
        if per_second == 0 {
            return Some(self.skipped.swap(0, Ordering::Relaxed));
        }
        let now = now.saturating_duration_since(self.epoch).as_secs();
        if self.second.swap(now, Ordering::Relaxed) != now {
            self.written.store(0, Ordering::Relaxed);
        }
        if self.written.fetch_add(1, Ordering::Relaxed) < per_second {
            Some(self.skipped.swap(0, Ordering::Relaxed))
        } else {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// A line about something that may repeat fast (an accept that keeps failing, a collector that
/// is down, a refusal): at most one every `every`; the rest are counted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OneLineEvery {
    every: Duration,
    last: Option<Instant>,
    left_out: u64,
}

impl OneLineEvery {
    pub(crate) const fn new(every: Duration) -> OneLineEvery {
        OneLineEvery {
            every,
            last: None,
            left_out: 0,
        }
    }

    /// `Some(lines left out since the last)` when a line is due now; else the line is counted
    /// as left out.
    pub(crate) fn due(&mut self) -> Option<u64> {
        self.due_at(Instant::now())
    }

    fn due_at(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < self.every)
        {
            self.left_out += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.left_out))
    }
}

/// A warning that repeats for as long as something outside stays down (a delivery target, a
/// model endpoint): [`OneLineEvery`] per key. Keys are few (routes, endpoints), so the map stays
/// small.
pub(crate) struct RepeatedLines {
    every: Duration,
    lines: std::sync::Mutex<std::collections::HashMap<String, OneLineEvery>>,
}

impl RepeatedLines {
    pub(crate) fn new(every: Duration) -> RepeatedLines {
        RepeatedLines {
            every,
            lines: std::sync::Mutex::default(),
        }
    }

    /// `Some(lines left out since the last)` when a line of `key` is due now.
    pub(crate) fn due(&self, key: &str) -> Option<u64> {
        let mut lines = crate::locks::lock(&self.lines);
        if let Some(line) = lines.get_mut(key) {
            return line.due();
        }
        let mut line = OneLineEvery::new(self.every);
        let due = line.due();
        lines.insert(key.to_string(), line);
        due
    }

    /// `key` is well again: its next failure is written at once. Whether it had failed.
    pub(crate) fn clear(&self, key: &str) -> bool {
        let mut lines = crate::locks::lock(&self.lines);
        lines.remove(key).is_some()
    }
}

/// The per-event lines' level and budgets, set at start and on every reload. Lines that others
/// make the daemon write (what a library warns of, what an MCP server writes to stderr) have a
/// budget of their own, so that however many of them come, an event's own lines (accepted,
/// turn started, completed, delivered) are still written.
struct EventLines {
    debug: AtomicBool,
    budget: LineBudget,
    from_outside: LineBudget,
}

static EVENT_LINES: LazyLock<EventLines> = LazyLock::new(|| EventLines {
    debug: AtomicBool::new(false),
    budget: LineBudget::new(DEFAULT_EVENT_LINES_PER_SECOND),
    from_outside: LineBudget::new(DEFAULT_EVENT_LINES_PER_SECOND),
});

/// `[runtime] event_log_max_per_second` when the config sets none.
pub(crate) const DEFAULT_EVENT_LINES_PER_SECOND: u32 = 300;

/// Applies `[runtime] event_log_level` and `event_log_max_per_second`.
pub(crate) fn configure_event_lines(level: EventLogLevel, per_second: u32) {
    EVENT_LINES
        .debug
        .store(level == EventLogLevel::Debug, Ordering::Relaxed);
    for budget in [&EVENT_LINES.budget, &EVENT_LINES.from_outside] {
        budget.per_second.store(per_second, Ordering::Relaxed);
    }
}

/// How the next per-event line is written: `None` when it is left out (over the budget; it is
/// counted). Lines at debug are not budgeted: they reach the journal only when the operator
/// asks for debug lines.
pub(crate) fn event_line_level() -> Option<EventLogLevel> {
    line_level(&EVENT_LINES.budget)
}

/// [`event_line_level`] for a line whose words come from outside (an MCP server's stderr),
/// within the budget of such lines.
pub(crate) fn outside_line_level() -> Option<EventLogLevel> {
    line_level(&EVENT_LINES.from_outside)
}

fn line_level(budget: &LineBudget) -> Option<EventLogLevel> {
    if EVENT_LINES.debug.load(Ordering::Relaxed) {
        return Some(EventLogLevel::Debug);
    }
    if budget.admit().is_some() {
        return Some(EventLogLevel::Info);
    }
    LINES_SKIPPED.inc();
    None
}

/// Per-event lines left out so far; `metrics` registers it (`agentgate_log_lines_skipped_total`)
/// and the summary line reads it.
static LINES_SKIPPED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// The counter of per-event lines left out (a handle on the one counter).
pub(crate) fn lines_skipped() -> Counter {
    LINES_SKIPPED.clone()
}

/// Writes a per-event line at the operator's chosen level, within the per-event line budget
/// (docs/reference.md, "Journal"). Takes what `tracing::info!` takes.
macro_rules! event_line {
    (from_outside; $($line:tt)+) => {
        $crate::logging::event_line!(@at $crate::logging::outside_line_level(), $($line)+)
    };
    (@at $level:expr, $($line:tt)+) => {
        match $level {
            Some($crate::logging::EventLogLevel::Info) => ::tracing::info!($($line)+),
            Some($crate::logging::EventLogLevel::Debug) => ::tracing::debug!($($line)+),
            None => {}
        }
    };
    ($($line:tt)+) => {
        $crate::logging::event_line!(@at $crate::logging::event_line_level(), $($line)+)
    };
}
pub(crate) use event_line;

/// The span of everything logged about one event: its lines carry `EVENT_ID`, `SESSION_KEY` and
/// `ROUTE` as journal fields without repeating them.
/// The spans have the level ERROR so that no level filter disables them: a warning must keep its
/// event's fields whatever `AGENTGATE_LOG` says.
pub(crate) fn event_span(event_id: &str, session_key: &str, route: &str) -> tracing::Span {
    tracing::error_span!("event", event_id, session_key, route)
}

/// The span of one turn: the event's fields and `TURN_ID`.
pub(crate) fn turn_span(
    event_id: &str,
    session_key: &str,
    route: &str,
    turn_id: &str,
) -> tracing::Span {
    tracing::error_span!("turn", event_id, session_key, route, turn_id)
}

/// Lines of the libraries agentgate uses (hyper, h2, rustls, rmcp, …) have the budget of lines
/// from outside (the per-event rate, on its own): a flood of misbehaving connections that each make a library warn can then not
/// use up journald's allowance, which would drop the daemon's own warnings. What is left out is
/// counted in `agentgate_log_lines_skipped_total` like any per-event line.
struct LibraryLines;

impl<S> tracing_subscriber::layer::Filter<S> for LibraryLines {
    fn enabled(
        &self,
        _: &tracing::Metadata<'_>,
        _: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        true
    }

    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        if event.metadata().target().starts_with("agentgate") {
            return true;
        }
        if EVENT_LINES.from_outside.admit().is_some() {
            return true;
        }
        LINES_SKIPPED.inc();
        false
    }
}

/// Where log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogTarget {
    /// The daemon: journald when its stream is attached, else stderr.
    Daemon,
    /// Command-line tools: always stderr.
    Terminal,
}

/// `AGENTGATE_LOG` if set, else `default`, without the MCP SDK's own lines: agentgate logs what
/// an operator needs of its MCP servers itself (started, down, tools changed, why), and the
/// SDK's lines print its errors whole, which may repeat a server's URL and the token in it.
fn filter(default: &str) -> EnvFilter {
    EnvFilter::try_from_env("AGENTGATE_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},rmcp=off")))
}

/// Installs the global subscriber. Safe to call once per process.
pub(crate) fn init(target: LogTarget) {
    if target == LogTarget::Daemon
        && std::env::var_os("JOURNAL_STREAM").is_some()
        && let Ok(layer) = tracing_journald::layer()
    {
        let layer = layer
            .with_field_prefix(None)
            .with_syslog_identifier("agentgate".to_string());
        let _ = tracing_subscriber::registry()
            .with(filter("info"))
            .with(layer.with_filter(LibraryLines))
            .try_init();
        return;
    }
    let default = match target {
        LogTarget::Daemon => "info",
        LogTarget::Terminal => "warn",
    };
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    let _ = tracing_subscriber::registry()
        .with(filter(default))
        .with(layer.with_filter(LibraryLines))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_budget_admits_its_rate_and_says_how_many_were_left_out() {
        let budget = LineBudget::new(10);
        let start = budget.epoch;
        let admitted = (0..100)
            .filter(|_| budget.admit_at(start).is_some())
            .count();
        assert_eq!(admitted, 10);
        let next = budget.admit_at(start + std::time::Duration::from_secs(1));
        assert_eq!(next, Some(90));
        let unlimited = LineBudget::new(0);
        assert!((0..1000).all(|_| unlimited.admit_at(start).is_some()));
    }

    #[test]
    fn one_line_every_interval_says_how_many_were_left_out() {
        let every = Duration::from_secs(10);
        let mut lines = OneLineEvery::new(every);
        let start = Instant::now();
        assert_eq!(lines.due_at(start), Some(0));
        assert_eq!(lines.due_at(start + Duration::from_secs(3)), None);
        assert_eq!(lines.due_at(start + Duration::from_secs(9)), None);
        assert_eq!(lines.due_at(start + every), Some(2));
        assert_eq!(lines.due_at(start + every), None);
        assert_eq!(lines.due_at(start + every * 3), Some(1));
    }

    /// Counts the lines that reach it.
    struct Counting(std::sync::Arc<AtomicU64>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Counting {
        fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_library_flood_is_budgeted_and_agentgate_lines_are_not() {
        let written = std::sync::Arc::new(AtomicU64::new(0));
        let subscriber = tracing_subscriber::registry()
            .with(Counting(written.clone()).with_filter(LibraryLines));
        let skipped_before = LINES_SKIPPED.get();
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..10_000 {
                tracing::warn!(target: "h2::proto::connection", "connection error");
            }
            let flood = written.swap(0, Ordering::Relaxed);
            // The budget (300 a second) is shared with other tests' lines: at most a few seconds'.
            assert!(flood <= 1_200, "{flood} library lines written");
            for _ in 0..1_000 {
                tracing::warn!(target: "agentgate::ingress", "our own warning");
            }
        });
        assert_eq!(written.load(Ordering::Relaxed), 1_000);
        assert!(LINES_SKIPPED.get() - skipped_before >= 8_800);
    }
}
