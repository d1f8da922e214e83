//! Prometheus metrics for `GET /metrics` on the control socket.
//!
//! Counters and histograms are updated where things happen (a request answered, a turn ended, a
//! delivery attempted); gauges are read from the store at each scrape, so they agree with
//! `agentgate status`. One set exists per process: every task records into it without being
//! handed a registry. Labels are bounded: routes, tools and codes come from the config and the
//! protocol, never from senders (no session keys or paths as labels).

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::registry::Registry;

use crate::operator::{OperatorAction, Rerun};
use crate::store::StatusSummary;
use crate::store::{ApprovalStatus, ResumeReason, TurnStatus};
use crate::usage::{Price, Spent};

mod families;
pub(crate) mod recent;

use families::{
    ActionLabel, McpOutcome, McpServerLabel, Model, ReasonLabel, ResultLabel, RouteBudget,
    RouteCode, RouteCodeReason, RouteKind, RouteLabel, RouteStatus, RouteTemplate, State,
    StateLabel, StatusLabel, ToolDecision, ToolLabel, ToolResult, Tools, Turns, Webhooks,
};

/// The content type of the exposition: Prometheus text format 0.0.4 (see [`legacy_text`]).
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every metric, by what it is about, in the registry that renders them.
struct Metrics {
    registry: Registry,
    webhooks: Webhooks,
    turns: Turns,
    model: Model,
    tools: Tools,
    state: State,
    totals: Totals,
}

/// Running totals for the journal's summary line, which needs sums across labels that a
/// `Family` does not give.
#[derive(Default)]
struct Totals {
    accepted: AtomicU64,
    refused: AtomicU64,
    turns_completed: AtomicU64,
    turns_failed: AtomicU64,
    delivered: AtomicU64,
    delivery_failures: AtomicU64,
}

/// What the daemon did, as totals since it started (or, from `since`, over a stretch of time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Activity {
    pub accepted: u64,
    pub refused: u64,
    pub turns_completed: u64,
    /// Turns that ended any other way (failed, interrupted by a newer event, cancelled).
    pub turns_failed: u64,
    pub delivered: u64,
    /// Delivery attempts that failed (retried or given up).
    pub delivery_failures: u64,
    pub log_lines_skipped: u64,
}

impl Activity {
    /// What happened between `earlier` and this.
    pub(crate) fn since(self, earlier: Activity) -> Activity {
        Activity {
            accepted: self.accepted - earlier.accepted,
            refused: self.refused - earlier.refused,
            turns_completed: self.turns_completed - earlier.turns_completed,
            turns_failed: self.turns_failed - earlier.turns_failed,
            delivered: self.delivered - earlier.delivered,
            delivery_failures: self.delivery_failures - earlier.delivery_failures,
            log_lines_skipped: self.log_lines_skipped - earlier.log_lines_skipped,
        }
    }

    pub(crate) fn is_quiet(&self) -> bool {
        *self == Activity::default()
    }
}

/// The totals so far.
pub(crate) fn activity() -> Activity {
    let totals = &METRICS.totals;
    let read = |total: &AtomicU64| total.load(Ordering::Relaxed);
    Activity {
        accepted: read(&totals.accepted),
        refused: read(&totals.refused),
        turns_completed: read(&totals.turns_completed),
        turns_failed: read(&totals.turns_failed),
        delivered: read(&totals.delivered),
        delivery_failures: read(&totals.delivery_failures),
        log_lines_skipped: METRICS.state.log_lines_skipped.get(),
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::with_prefix("agentgate");
        Metrics {
            webhooks: Webhooks::register(&mut registry),
            turns: Turns::register(&mut registry),
            model: Model::register(&mut registry),
            tools: Tools::register(&mut registry),
            state: State::register(&mut registry),
            registry,
            totals: Totals::default(),
        }
    }
}

/// An idle or stalled connection of `listener` was closed to make room for a new one; `state`
/// says what it was doing (`idle`, `head`, `body`).
pub(crate) fn idle_connection_closed(listener: &str, state: &str) {
    METRICS
        .webhooks
        .idle_connections_closed
        .get_or_create(&families::ListenerState {
            listener: listener.to_string(),
            state: state.to_string(),
        })
        .inc();
}

/// A webhook connection was closed at once: its peer held `max_connections_per_peer`.
pub(crate) fn peer_connection_refused() {
    METRICS.webhooks.peer_connections_refused.inc();
}

/// A large-body slot was taken (`1`) or given back (`-1`).
pub(crate) fn large_body_slots(change: i64) {
    METRICS.webhooks.large_body_slots.inc_by(change);
}

/// A webhook connection's TLS handshake failed or timed out.
pub(crate) fn tls_handshake_failed() {
    METRICS.webhooks.tls_handshake_failures.inc();
}

/// A webhook request was answered with `code`; `route` is empty for unknown paths.
pub(crate) fn http_request(route: &str, code: u16) {
    METRICS
        .webhooks
        .http_requests
        .get_or_create(&RouteCode {
            route: route.to_string(),
            code,
        })
        .inc();
    if code >= 400 {
        METRICS.totals.refused.fetch_add(1, Ordering::Relaxed);
        recent::refused();
    }
}

/// A webhook request was refused with `code` for `reason` (its error code).
pub(crate) fn refusal(route: &str, code: u16, reason: &str) {
    METRICS
        .webhooks
        .refusals
        .get_or_create(&RouteCodeReason {
            route: route.to_string(),
            code,
            reason: reason.to_string(),
        })
        .inc();
}

/// A verified event's `template` could not be evaluated; its default was used.
pub(crate) fn template_fallback(route: &str, template: &str) {
    METRICS
        .webhooks
        .template_fallbacks
        .get_or_create(&RouteTemplate {
            route: route.to_string(),
            template: template.to_string(),
        })
        .inc();
}

/// A webhook was made durable and acknowledged `elapsed` after it arrived.
pub(crate) fn accepted(elapsed: Duration) {
    METRICS
        .webhooks
        .accept_duration
        .observe(elapsed.as_secs_f64());
    METRICS.totals.accepted.fetch_add(1, Ordering::Relaxed);
    recent::accepted();
}

/// A turn ended with `status` after `elapsed`.
pub(crate) fn turn_ended(route: &str, status: TurnStatus, elapsed: Duration) {
    METRICS
        .turns
        .turns
        .get_or_create(&RouteStatus {
            route: route.to_string(),
            status: status.sql().to_string(),
        })
        .inc();
    let total = match status {
        TurnStatus::Completed => &METRICS.totals.turns_completed,
        TurnStatus::Running | TurnStatus::Failed | TurnStatus::Interrupted => {
            &METRICS.totals.turns_failed
        }
    };
    total.fetch_add(1, Ordering::Relaxed);
    METRICS.turns.turn_duration.observe(elapsed.as_secs_f64());
    recent::turn_ended(status == TurnStatus::Completed, elapsed);
}

/// A turn of `route` failed because its last step gave no answer.
pub(crate) fn turn_without_answer(route: &str) {
    METRICS
        .model
        .turns_without_answer
        .get_or_create(&RouteLabel {
            route: route.to_string(),
        })
        .inc();
}

/// The model replied (or gave up) after `elapsed`.
pub(crate) fn model_request(elapsed: Duration) {
    METRICS
        .model
        .model_request_duration
        .observe(elapsed.as_secs_f64());
}

/// A model reply spent `step` (at `price`, when there is one).
pub(crate) fn model_usage(route: &str, step: Spent, price: Option<&Price>) {
    let usage = step.usage;
    let kinds = [
        ("input", usage.input_tokens),
        ("cached_input", usage.cached_input_tokens),
        ("output", usage.output_tokens),
    ];
    for (kind, tokens) in kinds {
        let label = RouteKind {
            route: route.to_string(),
            kind,
        };
        METRICS
            .model
            .model_tokens
            .get_or_create(&label)
            .inc_by(tokens);
    }
    let route = RouteLabel {
        route: route.to_string(),
    };
    if step.unknown_steps > 0 {
        METRICS
            .model
            .replies_without_usage
            .get_or_create(&route)
            .inc_by(step.unknown_steps);
    }
    if let Some(price) = price {
        METRICS
            .model
            .model_cost
            .get_or_create(&route)
            .inc_by(usage.cost(price));
    }
}

/// `budget` (its config key) of a turn of `route` passed its `warn_at` share.
pub(crate) fn budget_warning(route: &str, budget: &str) {
    METRICS
        .model
        .budget_warnings
        .get_or_create(&route_budget(route, budget))
        .inc();
}

/// A turn of `route` ended because `budget` was used up.
pub(crate) fn budget_exceeded(route: &str, budget: &str) {
    METRICS
        .model
        .budget_exceeded
        .get_or_create(&route_budget(route, budget))
        .inc();
}

fn route_budget(route: &str, budget: &str) -> RouteBudget {
    RouteBudget {
        route: route.to_string(),
        budget: budget.to_string(),
    }
}

/// A tool call ended with `result`.
pub(crate) fn tool_call(tool: &str, result: &str) {
    METRICS
        .tools
        .tool_calls
        .get_or_create(&ToolResult {
            tool: tool.to_string(),
            result: result.to_string(),
        })
        .inc();
}

/// What became of a call that found all of its MCP server's processes running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OverBound {
    /// One ended within the server's timeout, and the call got it.
    Waited,
    /// None ended in time: the call was not made.
    Refused,
}

impl OverBound {
    /// The `outcome` label of `agentgate_mcp_over_bound_total`.
    fn label(self) -> &'static str {
        match self {
            OverBound::Waited => "waited",
            OverBound::Refused => "refused",
        }
    }
}

/// A call of MCP server `server` found all its processes running.
pub(crate) fn mcp_over_bound(server: &str, outcome: OverBound) {
    METRICS
        .tools
        .mcp_over_bound
        .get_or_create(&McpOutcome {
            mcp_server: server.to_string(),
            outcome: outcome.label().to_string(),
        })
        .inc();
}

/// Why agentgate ended a stdio MCP server's connection without reading on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum McpCut {
    /// It sent a message over the size bounds.
    TooLarge,
    /// It sent requests and left too many replies unread.
    NotReading,
}

/// Agentgate ended MCP server `server`'s connection, for `why`.
pub(crate) fn mcp_connection_cut(server: &str, why: McpCut) {
    let family = match why {
        McpCut::TooLarge => &METRICS.tools.mcp_too_large,
        McpCut::NotReading => &METRICS.tools.mcp_not_reading,
    };
    family
        .get_or_create(&McpServerLabel {
            mcp_server: server.to_string(),
        })
        .inc();
}

/// A call of `tool` waits for an operator's decision.
pub(crate) fn approval_requested(tool: &str) {
    METRICS
        .tools
        .approval_requests
        .get_or_create(&ToolLabel {
            tool: tool.to_string(),
        })
        .inc();
}

/// An approval request of `tool` was decided (`decision`: approved, denied, expired) after
/// waiting `waited`.
pub(crate) fn approval_decided(tool: &str, decision: ApprovalStatus, waited: Duration) {
    METRICS
        .tools
        .approvals
        .get_or_create(&ToolDecision {
            tool: tool.to_string(),
            decision: decision.sql().to_string(),
        })
        .inc();
    METRICS.tools.approval_wait.observe(waited.as_secs_f64());
}

/// How a delivery attempt ended: the `result` label of `agentgate_deliveries_total`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum DeliveryResult {
    Delivered,
    Retry,
    Failed,
}

impl DeliveryResult {
    const ALL: [DeliveryResult; 3] = [
        DeliveryResult::Delivered,
        DeliveryResult::Retry,
        DeliveryResult::Failed,
    ];

    fn label(self) -> &'static str {
        match self {
            DeliveryResult::Delivered => "delivered",
            DeliveryResult::Retry => "retry",
            DeliveryResult::Failed => "failed",
        }
    }
}

/// What became of a span of a trace (`[telemetry]`): the `outcome` label of
/// `agentgate_trace_spans_total`. Spans ended but neither exported nor dropped by a failed
/// export are still queued, or were dropped because the queue was full.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SpanOutcome {
    Ended,
    Exported,
    Dropped,
}

impl SpanOutcome {
    const ALL: [SpanOutcome; 3] = [
        SpanOutcome::Ended,
        SpanOutcome::Exported,
        SpanOutcome::Dropped,
    ];

    fn label(self) -> &'static str {
        match self {
            SpanOutcome::Ended => "ended",
            SpanOutcome::Exported => "exported",
            SpanOutcome::Dropped => "dropped",
        }
    }
}

/// `spans` spans of traces met `outcome`.
pub(crate) fn trace_spans(outcome: SpanOutcome, spans: u64) {
    METRICS
        .state
        .trace_spans
        .get_or_create(&families::OutcomeLabel {
            outcome: outcome.label().to_string(),
        })
        .inc_by(spans);
}

/// A console request was refused for `reason` (docs/reference.md, "Console").
pub(crate) fn console_refusal(reason: &str) {
    METRICS
        .state
        .console_refusals
        .get_or_create(&ReasonLabel {
            reason: reason.to_string(),
        })
        .inc();
}

/// A request on the control socket, the metrics listener or the console's was refused with
/// `code` for `reason` (docs/reference.md, "Metrics").
pub(crate) fn control_refusal(listener: &'static str, code: u16, reason: &'static str) {
    METRICS
        .state
        .control_refusals
        .get_or_create(&families::ListenerCodeReason {
            listener,
            code,
            reason,
        })
        .inc();
}

/// A live transcript read the store (docs/reference.md, "Console").
pub(crate) fn console_live_read() {
    METRICS.state.console_live_reads.inc();
}

/// A session followed over the control socket read the store (docs/reference.md, "Metrics").
pub(crate) fn follow_read() {
    METRICS.state.follow_reads.inc();
}

/// The store reads live transcripts made so far.
#[cfg(test)]
pub(crate) fn console_live_reads() -> u64 {
    METRICS.state.console_live_reads.get()
}

/// How an interrupted session was settled at start: the `reason` label of
/// `agentgate_resumes_total`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ResumeOutcome {
    Resumed(ResumeReason),
    Abandoned,
    Suspended,
    /// The ledger could not count it, so it was not dispatched.
    Refused,
}

impl ResumeOutcome {
    const ALL: [ResumeOutcome; 5] = [
        ResumeOutcome::Resumed(ResumeReason::Crashed),
        ResumeOutcome::Resumed(ResumeReason::ShutdownTimeout),
        ResumeOutcome::Abandoned,
        ResumeOutcome::Suspended,
        ResumeOutcome::Refused,
    ];

    fn label(self) -> &'static str {
        match self {
            ResumeOutcome::Resumed(reason) => reason.sql(),
            ResumeOutcome::Abandoned => "abandoned",
            ResumeOutcome::Suspended => "suspended",
            ResumeOutcome::Refused => "refused",
        }
    }
}

/// A delivery attempt ended with `result`.
pub(crate) fn delivery(result: DeliveryResult) {
    METRICS
        .state
        .deliveries
        .get_or_create(&ResultLabel {
            result: result.label().to_string(),
        })
        .inc();
    let total = match result {
        DeliveryResult::Delivered => &METRICS.totals.delivered,
        DeliveryResult::Retry | DeliveryResult::Failed => &METRICS.totals.delivery_failures,
    };
    total.fetch_add(1, Ordering::Relaxed);
}

/// An interrupted session was settled at start.
pub(crate) fn resume(outcome: ResumeOutcome) {
    METRICS
        .turns
        .resumes
        .get_or_create(&ReasonLabel {
            reason: outcome.label().to_string(),
        })
        .inc();
}

/// The operator applied `action` to a session.
pub(crate) fn operator_action(action: OperatorAction) {
    METRICS
        .turns
        .operator_actions
        .get_or_create(&ActionLabel {
            action: action.name().to_string(),
        })
        .inc();
}

/// A rerun of a session (`sessions rewind|fork`), done or refused.
pub(crate) fn operator_rerun(rerun: Rerun, done: bool) {
    let action = if done { rerun.name() } else { rerun.refused() };
    METRICS
        .turns
        .operator_actions
        .get_or_create(&ActionLabel {
            action: action.to_string(),
        })
        .inc();
}

/// What the gauges show at a scrape.
pub(crate) struct Snapshot<'a> {
    pub(crate) summary: &'a StatusSummary,
    pub(crate) turns_running: usize,
    pub(crate) store_writable: bool,
    /// Whether a webhook would be accepted now.
    pub(crate) accepting: bool,
}

/// The text exposition, with the gauges set from `snapshot`.
pub(crate) fn render(snapshot: &Snapshot<'_>) -> String {
    let metrics = &*METRICS;
    metrics.state.events.clear();
    for (status, count) in &snapshot.summary.events.by_status {
        metrics
            .state
            .events
            .get_or_create(&StatusLabel {
                status: status.to_string(),
            })
            .set(*count);
    }
    metrics.state.sessions.clear();
    for (state, count) in &snapshot.summary.sessions.by_state {
        metrics
            .state
            .sessions
            .get_or_create(&StateLabel {
                state: state.to_string(),
            })
            .set(*count);
    }
    metrics
        .turns
        .turns_running
        .set(i64::try_from(snapshot.turns_running).unwrap_or(i64::MAX));
    for (state, count) in [
        ("pending", snapshot.summary.deliveries.pending),
        ("failed", snapshot.summary.deliveries.failed),
    ] {
        metrics
            .state
            .outbox
            .get_or_create(&StateLabel {
                state: state.to_string(),
            })
            .set(count);
    }
    metrics
        .tools
        .approvals_pending
        .set(snapshot.summary.approvals.pending);
    metrics
        .state
        .store_writable
        .set(i64::from(snapshot.store_writable));
    metrics
        .webhooks
        .accepting
        .set(i64::from(snapshot.accepting));
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &metrics.registry);
    legacy_text(&text)
}

/// Turns the OpenMetrics text that prometheus-client writes into Prometheus text format 0.0.4.
///
/// The documented metric names include both `agentgate_deliveries_total` (a counter) and
/// `agentgate_deliveries` (a gauge). OpenMetrics names a counter's family without `_total`, so
/// there both would be one family `agentgate_deliveries` and a scrape would fail. Format 0.0.4
/// names the counter family `agentgate_deliveries_total`, which keeps them apart: counters'
/// `HELP`/`TYPE` lines get their `_total` name, and the `UNIT` and `EOF` lines, which 0.0.4 does
/// not have, are dropped.
fn legacy_text(open_metrics: &str) -> String {
    let mut text = String::with_capacity(open_metrics.len());
    // Each family is a block that starts with its HELP line; its TYPE line says whether it is a
    // counter.
    let mut block: Vec<&str> = Vec::new();
    let flush = |block: &mut Vec<&str>, text: &mut String| {
        let counter = block
            .iter()
            .any(|line| line.starts_with("# TYPE ") && line.ends_with(" counter"));
        for line in block.drain(..) {
            let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
                let (name, tail) = line.strip_prefix(prefix)?.split_once(' ')?;
                counter.then(|| format!("{prefix}{name}_total {tail}"))
            });
            text.push_str(renamed.as_deref().unwrap_or(line));
            text.push('\n');
        }
    };
    for line in open_metrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        if line.starts_with("# HELP ") {
            flush(&mut block, &mut text);
        }
        block.push(line);
    }
    flush(&mut block, &mut text);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_families_take_their_total_names_so_a_gauge_of_the_same_stem_stays_apart() {
        let open_metrics = "# HELP agentgate_deliveries Delivery attempts.\n\
            # TYPE agentgate_deliveries counter\n\
            agentgate_deliveries_total{result=\"delivered\"} 3\n\
            # HELP agentgate_deliveries Outbox rows.\n\
            # TYPE agentgate_deliveries gauge\n\
            agentgate_deliveries{state=\"pending\"} 1\n\
            # HELP agentgate_accept_duration_seconds Accept.\n\
            # TYPE agentgate_accept_duration_seconds histogram\n\
            # UNIT agentgate_accept_duration_seconds seconds\n\
            agentgate_accept_duration_seconds_count 0\n\
            # EOF\n";
        let text = legacy_text(open_metrics);
        assert!(text.contains("# TYPE agentgate_deliveries_total counter\n"));
        assert!(text.contains("# HELP agentgate_deliveries_total Delivery attempts.\n"));
        assert!(text.contains("# TYPE agentgate_deliveries gauge\n"));
        assert!(
            !text.contains("# UNIT") && !text.contains("# EOF"),
            "{text}"
        );
    }

    #[test]
    fn every_documented_family_is_exposed() {
        // Labelled families appear once they have a member.
        http_request("github", 202);
        refusal("github", 401, "timestamp_stale");
        template_fallback("github", "session");
        turn_ended("github", TurnStatus::Completed, Duration::from_secs(2));
        tool_call("disk_usage", "ok");
        delivery(DeliveryResult::Delivered);
        resume(ResumeOutcome::Resumed(ResumeReason::Crashed));
        approval_requested("deploy");
        approval_decided("deploy", ApprovalStatus::Approved, Duration::from_secs(90));
        console_refusal("form_token");
        let mut summary = StatusSummary::default();
        summary
            .events
            .by_status
            .insert(crate::store::EventStatus::Queued, 2);
        summary
            .sessions
            .by_state
            .insert(crate::store::SessionState::Idle, 1);
        let text = render(&Snapshot {
            summary: &summary,
            turns_running: 0,
            store_writable: true,
            accepting: true,
        });
        for family in [
            "# TYPE agentgate_http_requests_total counter",
            "# TYPE agentgate_accepting gauge",
            "# TYPE agentgate_refusals_total counter",
            "# TYPE agentgate_template_fallbacks_total counter",
            "# TYPE agentgate_accept_duration_seconds histogram",
            "# TYPE agentgate_turns_total counter",
            "# TYPE agentgate_turn_duration_seconds histogram",
            "# TYPE agentgate_model_request_duration_seconds histogram",
            "# TYPE agentgate_tool_calls_total counter",
            "# TYPE agentgate_deliveries_total counter",
            "# TYPE agentgate_resumes_total counter",
            "# TYPE agentgate_events gauge",
            "# TYPE agentgate_sessions gauge",
            "# TYPE agentgate_turns_running gauge",
            "# TYPE agentgate_deliveries gauge",
            "# TYPE agentgate_store_writable gauge",
            "# TYPE agentgate_approval_requests_total counter",
            "# TYPE agentgate_approvals_total counter",
            "# TYPE agentgate_console_refusals_total counter",
            "# TYPE agentgate_approvals_pending gauge",
            "# TYPE agentgate_large_body_slots_in_use gauge",
            "# TYPE agentgate_approval_decision_seconds histogram",
        ] {
            assert!(text.contains(family), "{family} missing from:\n{text}");
        }
        assert!(text.contains("agentgate_http_requests_total{route=\"github\",code=\"202\"} 1"));
        assert!(text.contains("agentgate_store_writable 1"));
    }
}
