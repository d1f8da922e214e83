//! The metric families, grouped by what they are about, and their labels: each group
//! registers its own, so adding a metric is an edit in one place.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use super::{DeliveryResult, ResumeOutcome, SpanOutcome};
use crate::operator::{OperatorAction, Rerun};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteCode {
    pub(super) route: String,
    pub(super) code: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteCodeReason {
    pub(super) route: String,
    pub(super) code: u16,
    /// The refusal's error code (`unauthorized`, `payload_too_large`, ...): a fixed set.
    pub(super) reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ListenerCodeReason {
    /// `control`, `metrics` or `console`.
    pub(super) listener: &'static str,
    pub(super) code: u16,
    /// The refusal's error code, else the status's reason phrase: a fixed set.
    pub(super) reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteTemplate {
    pub(super) route: String,
    pub(super) template: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteStatus {
    pub(super) route: String,
    pub(super) status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteKind {
    pub(super) route: String,
    pub(super) kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ListenerState {
    pub(super) listener: String,
    pub(super) state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteBudget {
    pub(super) route: String,
    pub(super) budget: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteLabel {
    pub(super) route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ToolResult {
    pub(super) tool: String,
    pub(super) result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ToolDecision {
    pub(super) tool: String,
    pub(super) decision: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct McpOutcome {
    pub(super) mcp_server: String,
    pub(super) outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct McpServerLabel {
    pub(super) mcp_server: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ToolLabel {
    pub(super) tool: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ResultLabel {
    pub(super) result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabel {
    pub(super) reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ActionLabel {
    pub(super) action: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct OutcomeLabel {
    pub(super) outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StatusLabel {
    pub(super) status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StateLabel {
    pub(super) state: String,
}

/// What the webhook listener answered and holds.
pub(super) struct Webhooks {
    pub(super) http_requests: Family<RouteCode, Counter>,
    pub(super) refusals: Family<RouteCodeReason, Counter>,
    pub(super) template_fallbacks: Family<RouteTemplate, Counter>,
    pub(super) accept_duration: Histogram,
    pub(super) tls_handshake_failures: Counter,
    pub(super) large_body_slots: Gauge,
    pub(super) idle_connections_closed: Family<ListenerState, Counter>,
    pub(super) peer_connections_refused: Counter,
    pub(super) accepting: Gauge,
}

/// How turns ended, and what resumed or overrode them.
pub(super) struct Turns {
    pub(super) turns: Family<RouteStatus, Counter>,
    pub(super) turn_duration: Histogram,
    pub(super) resumes: Family<ReasonLabel, Counter>,
    pub(super) operator_actions: Family<ActionLabel, Counter>,
    pub(super) turns_running: Gauge,
}

/// What model requests took and spent, against the budgets.
pub(super) struct Model {
    pub(super) model_request_duration: Histogram,
    pub(super) model_tokens: Family<RouteKind, Counter>,
    pub(super) model_cost: Family<RouteLabel, Counter<f64, AtomicU64>>,
    pub(super) replies_without_usage: Family<RouteLabel, Counter>,
    pub(super) budget_warnings: Family<RouteBudget, Counter>,
    pub(super) budget_exceeded: Family<RouteBudget, Counter>,
    pub(super) turns_without_answer: Family<RouteLabel, Counter>,
}

/// Tool calls, and the approvals some of them wait for.
pub(super) struct Tools {
    pub(super) tool_calls: Family<ToolResult, Counter>,
    pub(super) approval_requests: Family<ToolLabel, Counter>,
    pub(super) approvals: Family<ToolDecision, Counter>,
    pub(super) approvals_pending: Gauge,
    pub(super) approval_wait: Histogram,
    pub(super) mcp_over_bound: Family<McpOutcome, Counter>,
    pub(super) mcp_too_large: Family<McpServerLabel, Counter>,
    pub(super) mcp_not_reading: Family<McpServerLabel, Counter>,
}

/// The stored state as the gauges read it at a scrape, the outbox, and the journal.
pub(super) struct State {
    pub(super) events: Family<StatusLabel, Gauge>,
    pub(super) sessions: Family<StateLabel, Gauge>,
    pub(super) outbox: Family<StateLabel, Gauge>,
    pub(super) deliveries: Family<ResultLabel, Counter>,
    pub(super) store_writable: Gauge,
    pub(super) log_lines_skipped: Counter,
    pub(super) trace_spans: Family<OutcomeLabel, Counter>,
    pub(super) console_refusals: Family<ReasonLabel, Counter>,
    pub(super) control_refusals: Family<ListenerCodeReason, Counter>,
    pub(super) console_live_reads: Counter,
    pub(super) follow_reads: Counter,
}

impl Webhooks {
    pub(super) fn register(registry: &mut Registry) -> Webhooks {
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
        let idle_connections_closed = Family::<ListenerState, Counter>::default();
        registry.register(
            "idle_connections_closed",
            "Idle or stalled connections closed because every connection slot of their listener was taken, to serve a new one, by listener and what the connection was doing (idle, head, body)",
            idle_connections_closed.clone(),
        );
        let peer_connections_refused = Counter::default();
        registry.register(
            "peer_connections_refused",
            "Webhook connections closed at once because their peer address already held server.max_connections_per_peer, none of them idle",
            peer_connections_refused.clone(),
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
            idle_connections_closed,
            peer_connections_refused,
            accepting,
        }
    }
}

impl Turns {
    pub(super) fn register(registry: &mut Registry) -> Turns {
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
            "Operator overrides applied (resume, suspend, cancel, rewind, fork) or refused (rewind_refused, fork_refused)",
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
        let reruns = Rerun::ALL.into_iter().flat_map(|r| [r.name(), r.refused()]);
        for action in OperatorAction::ALL
            .map(OperatorAction::name)
            .into_iter()
            .chain(reruns)
        {
            let _ = operator_actions.get_or_create(&ActionLabel {
                action: action.to_string(),
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
    pub(super) fn register(registry: &mut Registry) -> Model {
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
        let turns_without_answer = Family::default();
        registry.register(
            "turns_without_answer",
            "Turns that failed because the model gave no final answer within max_turn_steps, by route",
            turns_without_answer.clone(),
        );
        Model {
            model_request_duration,
            model_tokens,
            model_cost,
            replies_without_usage,
            budget_warnings,
            budget_exceeded,
            turns_without_answer,
        }
    }
}

impl Tools {
    pub(super) fn register(registry: &mut Registry) -> Tools {
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
        let mcp_over_bound = Family::default();
        registry.register(
            "mcp_over_bound",
            "MCP calls that found all of a stdio server's max_instances processes running, by \
             server and outcome (waited, refused)",
            mcp_over_bound.clone(),
        );
        let mcp_too_large = Family::default();
        registry.register(
            "mcp_messages_too_large",
            "MCP messages over the size bounds (1 MiB, 16,384 objects and arrays), by server: \
             each ended its connection unread",
            mcp_too_large.clone(),
        );
        let mcp_not_reading = Family::default();
        registry.register(
            "mcp_servers_not_reading",
            "MCP servers that left more than 1,024 replies to their requests, or 4 MiB of them, \
             unread, by server: each ended its connection",
            mcp_not_reading.clone(),
        );
        Tools {
            tool_calls,
            approval_requests,
            approvals,
            approvals_pending,
            approval_wait,
            mcp_over_bound,
            mcp_too_large,
            mcp_not_reading,
        }
    }
}

impl State {
    pub(super) fn register(registry: &mut Registry) -> State {
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
        let trace_spans = Family::default();
        registry.register(
            "trace_spans",
            "Spans of traces, by outcome: ended, exported, or dropped by a failed export ([telemetry])",
            trace_spans.clone(),
        );
        for outcome in SpanOutcome::ALL {
            let _ = trace_spans.get_or_create(&OutcomeLabel {
                outcome: outcome.label().to_string(),
            });
        }
        let console_refusals = Family::default();
        registry.register(
            "console_refusals",
            "Console requests refused, by reason: host, cross_site, form_token, not_logged_in, wrong_token",
            console_refusals.clone(),
        );
        let control_refusals = Family::default();
        registry.register(
            "control_refusals",
            "Requests refused (4xx, 5xx) on the control socket, the metrics listener and the console's, by listener, status code and reason",
            control_refusals.clone(),
        );
        let console_live_reads = Counter::default();
        registry.register(
            "console_live_reads",
            "Store reads made by the console's live transcripts (each after a commit of its session)",
            console_live_reads.clone(),
        );
        let follow_reads = Counter::default();
        registry.register(
            "follow_reads",
            "Store reads made by sessions followed over the control socket (each after a commit of its session)",
            follow_reads.clone(),
        );
        State {
            events,
            sessions,
            outbox,
            deliveries,
            store_writable,
            log_lines_skipped,
            trace_spans,
            console_refusals,
            control_refusals,
            console_live_reads,
            follow_reads,
        }
    }
}
