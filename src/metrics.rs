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

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::operator::OperatorAction;
use crate::store::StatusSummary;
use crate::store::{ApprovalStatus, ResumeReason, TurnStatus};
use crate::usage::{Price, Spent};

/// The content type of the exposition: Prometheus text format 0.0.4 (see [`legacy_text`]).
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteCode {
    route: String,
    code: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteCodeReason {
    route: String,
    code: u16,
    /// The refusal's error code (`unauthorized`, `payload_too_large`, ...): a fixed set.
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteTemplate {
    route: String,
    template: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteStatus {
    route: String,
    status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteKind {
    route: String,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteBudget {
    route: String,
    budget: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolResult {
    tool: String,
    result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolDecision {
    tool: String,
    decision: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabel {
    tool: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabel {
    action: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

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

/// What the webhook listener answered and holds.
struct Webhooks {
    http_requests: Family<RouteCode, Counter>,
    refusals: Family<RouteCodeReason, Counter>,
    template_fallbacks: Family<RouteTemplate, Counter>,
    accept_duration: Histogram,
    tls_handshake_failures: Counter,
    large_body_slots: Gauge,
    accepting: Gauge,
}

/// How turns ended, and what resumed or overrode them.
struct Turns {
    turns: Family<RouteStatus, Counter>,
    turn_duration: Histogram,
    resumes: Family<ReasonLabel, Counter>,
    operator_actions: Family<ActionLabel, Counter>,
    turns_running: Gauge,
}

/// What model requests took and spent, against the budgets.
struct Model {
    model_request_duration: Histogram,
    model_tokens: Family<RouteKind, Counter>,
    model_cost: Family<RouteLabel, Counter<f64, AtomicU64>>,
    replies_without_usage: Family<RouteLabel, Counter>,
    budget_warnings: Family<RouteBudget, Counter>,
    budget_exceeded: Family<RouteBudget, Counter>,
}

/// Tool calls, and the approvals some of them wait for.
struct Tools {
    tool_calls: Family<ToolResult, Counter>,
    approval_requests: Family<ToolLabel, Counter>,
    approvals: Family<ToolDecision, Counter>,
    approvals_pending: Gauge,
    approval_wait: Histogram,
}

/// The stored state as the gauges read it at a scrape, the outbox, and the journal.
struct State {
    events: Family<StatusLabel, Gauge>,
    sessions: Family<StateLabel, Gauge>,
    outbox: Family<StateLabel, Gauge>,
    deliveries: Family<ResultLabel, Counter>,
    store_writable: Gauge,
    log_lines_skipped: Counter,
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

impl Webhooks {
    fn register(registry: &mut Registry) -> Webhooks {
        let http_requests = Family::default();
        registry.register(
            "http_requests",
            "Webhook requests answered, by route and status code (route is empty for unknown paths)",
            http_requests.clone(),
        );
        let refusals = Family::default();
        registry.register(
            "refusals",
            "Webhook requests refused (4xx, 5xx), by route, status code and reason",
            refusals.clone(),
        );
        let template_fallbacks = Family::default();
        registry.register(
            "template_fallbacks",
            "Verified events whose session, event_type or delivery_id template could not be evaluated, so its default was used",
            template_fallbacks.clone(),
        );
        // 1 ms to ~16 s: an accept is an fsync'd commit; a slow one is what operators look for.
        let accept_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register_with_unit(
            "accept_duration",
            "From a webhook's arrival to its 202, including the durable commit",
            Unit::Seconds,
            accept_duration.clone(),
        );
        let tls_handshake_failures = Counter::default();
        registry.register(
            "tls_handshake_failures",
            "Webhook connections whose TLS handshake failed or did not come within header_timeout",
            tls_handshake_failures.clone(),
        );
        let large_body_slots = Gauge::default();
        registry.register(
            "large_body_slots_in_use",
            "Webhook bodies larger than 16 KiB being read now (at most 64: the others wait)",
            large_body_slots.clone(),
        );
        let accepting = Gauge::default();
        registry.register(
            "accepting",
            "1 while a webhook would be accepted (state writable, free disk above min_free_disk, queue below max_queued_events)",
            accepting.clone(),
        );
        Webhooks {
            http_requests,
            refusals,
            template_fallbacks,
            accept_duration,
            tls_handshake_failures,
            large_body_slots,
            accepting,
        }
    }
}

impl Turns {
    fn register(registry: &mut Registry) -> Turns {
        let turns = Family::default();
        registry.register(
            "turns",
            "Turns ended, by route and turn status",
            turns.clone(),
        );
        // 100 ms to ~27 min.
        let turn_duration = Histogram::new(exponential_buckets(0.1, 2.0, 15));
        registry.register_with_unit(
            "turn_duration",
            "How long turns ran, from claim to their committed end",
            Unit::Seconds,
            turn_duration.clone(),
        );
        let resumes = Family::default();
        registry.register(
            "resumes",
            "Interrupted sessions settled at start, by reason or outcome",
            resumes.clone(),
        );
        let operator_actions = Family::default();
        registry.register(
            "operator_actions",
            "Operator overrides applied (resume, suspend, cancel)",
            operator_actions.clone(),
        );
        let turns_running = Gauge::default();
        registry.register(
            "turns_running",
            "Turns running on this daemon",
            turns_running.clone(),
        );
        // Label values known in advance start at 0: a series that appears with its first event
        // would hide that event from `increase()` and `rate()`, and from the alerts built on them.
        for outcome in ResumeOutcome::ALL {
            let _ = resumes.get_or_create(&ReasonLabel {
                reason: outcome.label().to_string(),
            });
        }
        for action in OperatorAction::ALL {
            let _ = operator_actions.get_or_create(&ActionLabel {
                action: action.name().to_string(),
            });
        }
        Turns {
            turns,
            turn_duration,
            resumes,
            operator_actions,
            turns_running,
        }
    }
}

impl Model {
    fn register(registry: &mut Registry) -> Model {
        // 50 ms to ~13 min.
        let model_request_duration = Histogram::new(exponential_buckets(0.05, 2.0, 15));
        registry.register_with_unit(
            "model_request_duration",
            "How long the model took to reply to one step, retries included",
            Unit::Seconds,
            model_request_duration.clone(),
        );
        let model_tokens = Family::default();
        registry.register(
            "model_tokens",
            "Tokens of model replies as the server reported them, by route and kind \
             (input, cached_input: the cached part of input, output)",
            model_tokens.clone(),
        );
        let model_cost = Family::default();
        registry.register(
            "model_cost_usd",
            "What model replies cost in US dollars at [model] price, by route",
            model_cost.clone(),
        );
        let replies_without_usage = Family::default();
        registry.register(
            "model_replies_without_usage",
            "Model replies that reported no usage (their tokens are unknown), by route",
            replies_without_usage.clone(),
        );
        let budget_warnings = Family::default();
        registry.register(
            "budget_warnings",
            "Budgets that passed warn_at, once per budget and window, by route and budget",
            budget_warnings.clone(),
        );
        let budget_exceeded = Family::default();
        registry.register(
            "budget_exceeded",
            "Turns ended because a budget was used up, by route and budget",
            budget_exceeded.clone(),
        );
        Model {
            model_request_duration,
            model_tokens,
            model_cost,
            replies_without_usage,
            budget_warnings,
            budget_exceeded,
        }
    }
}

impl Tools {
    fn register(registry: &mut Registry) -> Tools {
        let tool_calls = Family::default();
        registry.register(
            "tool_calls",
            "Tool calls ended, by tool and result",
            tool_calls.clone(),
        );
        let approval_requests = Family::default();
        registry.register(
            "approval_requests",
            "Tool calls that waited for an operator's decision, by tool",
            approval_requests.clone(),
        );
        let approvals = Family::default();
        registry.register(
            "approvals",
            "Approval requests decided, by tool and decision (approved, denied, expired)",
            approvals.clone(),
        );
        let approvals_pending = Gauge::default();
        registry.register(
            "approvals_pending",
            "Tool calls waiting for an operator's decision",
            approvals_pending.clone(),
        );
        // 1 s to ~3 days.
        let approval_wait = Histogram::new(exponential_buckets(1.0, 2.0, 19));
        registry.register_with_unit(
            "approval_decision",
            "How long approval requests waited for their decision",
            Unit::Seconds,
            approval_wait.clone(),
        );
        Tools {
            tool_calls,
            approval_requests,
            approvals,
            approvals_pending,
            approval_wait,
        }
    }
}

impl State {
    fn register(registry: &mut Registry) -> State {
        let events = Family::default();
        registry.register("events", "Stored events by status", events.clone());
        let sessions = Family::default();
        registry.register("sessions", "Sessions by state", sessions.clone());
        let deliveries = Family::default();
        registry.register(
            "deliveries",
            "Delivery attempts, by result (delivered, retry, failed)",
            deliveries.clone(),
        );
        let outbox = Family::default();
        registry.register(
            "deliveries",
            "Outbox rows not yet delivered, by state",
            outbox.clone(),
        );
        let store_writable = Gauge::default();
        registry.register(
            "store_writable",
            "1 while events can be made durable",
            store_writable.clone(),
        );
        // Counted where lines are left out, in `logging`.
        let log_lines_skipped = crate::logging::lines_skipped();
        registry.register(
            "log_lines_skipped",
            "Per-event log lines left out because more came than runtime.event_log_max_per_second",
            log_lines_skipped.clone(),
        );
        // Label values known in advance start at 0: a series that appears with its first event
        // would hide that event from `increase()` and `rate()`, and from the alerts built on them.
        for result in DeliveryResult::ALL {
            let _ = deliveries.get_or_create(&ResultLabel {
                result: result.label().to_string(),
            });
        }
        State {
            events,
            sessions,
            outbox,
            deliveries,
            store_writable,
            log_lines_skipped,
        }
    }
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
        _ => &METRICS.totals.turns_failed,
    };
    total.fetch_add(1, Ordering::Relaxed);
    METRICS.turns.turn_duration.observe(elapsed.as_secs_f64());
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
