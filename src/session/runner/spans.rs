//! The spans of a turn, with the OpenTelemetry GenAI attributes (docs/reference.md, "Traces"):
//! `invoke_agent <route>` for the turn, under the request span stored with its event, and
//! `chat <model>` and `execute_tool <tool>` under it. The `gen_ai.*` names are written here,
//! not taken from the semantic-conventions crate, which deprecated them while they are
//! experimental.

use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;

use crate::agent::catalog::{OfferedTool, Runs};
use crate::agent::model::Reply;
use crate::config::{ModelBackend, ModelSettings};
use crate::session::turn::Input;
use crate::store::{ApprovalRow, ClaimedTurn, Store};
use crate::telemetry::{self, Span, SpanStart};

/// The model a request asks for, as spans name it.
fn requested_model(settings: &ModelSettings) -> &str {
    match &settings.backend {
        ModelBackend::OpenAi { model, .. } => model,
        ModelBackend::Command { .. } => "command",
        ModelBackend::Replay { .. } => "replay",
    }
}

/// `invoke_agent <route>`: the turn, in its event's trace. A turn that runs again (resumed after
/// a crash or a drain, or after an approval) is another span of the same trace.
pub(super) fn turn_span(turn: &ClaimedTurn, model: &ModelSettings) -> Span {
    let event = &turn.event;
    telemetry::span_under(event.trace_parent.as_deref(), || {
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", "invoke_agent"),
            KeyValue::new("gen_ai.agent.name", event.route.clone()),
            KeyValue::new("gen_ai.conversation.id", event.session_key.clone()),
            KeyValue::new("gen_ai.request.model", requested_model(model).to_string()),
            KeyValue::new("agentgate.event.id", event.id.clone()),
            KeyValue::new("agentgate.turn.id", turn.turn_id.clone()),
        ];
        if let Some(continues) = turn.continues {
            attributes.push(KeyValue::new("agentgate.turn.continues", continues.label()));
        }
        SpanStart {
            name: format!("invoke_agent {}", event.route),
            kind: SpanKind::Internal,
            attributes,
        }
    })
}

/// Records the turn's span with its turn, and links the span to the earlier run of the event it
/// continues (a run cut off by a crash or the drain, or one that waited for a decision). A store
/// that cannot record it costs the link, not the turn.
pub(super) async fn record_turn_span(store: &Store, turn: &ClaimedTurn, span: &Span) {
    let Some(traceparent) = span.traceparent() else {
        return;
    };
    match store
        .record_turn_span(&turn.event.id, &turn.turn_id, &traceparent)
        .await
    {
        Ok(Some(earlier)) => span.link_to(&earlier),
        Ok(None) => {}
        Err(err) => tracing::debug!(error = %err,
            "the turn's span is not recorded: a later run of its event will not link to it"),
    }
}

/// `chat <model>`: one model request.
pub(super) fn chat_span(turn: &Span, model: &ModelSettings) -> Span {
    turn.child(|| {
        let model = requested_model(model);
        SpanStart {
            name: format!("chat {model}"),
            kind: SpanKind::Client,
            attributes: vec![
                KeyValue::new("gen_ai.operation.name", "chat"),
                KeyValue::new("gen_ai.request.model", model.to_string()),
            ],
        }
    })
}

/// What a model reply says of itself: who answered and what it cost.
pub(super) fn record_reply(span: &Span, reply: &Reply) {
    if let Some(answered) = &reply.answered_by {
        span.set("gen_ai.response.model", answered.model.clone());
        span.set("server.address", answered.endpoint.clone());
    }
    if let Some(usage) = &reply.usage {
        span.set("gen_ai.usage.input_tokens", saturating(usage.input_tokens));
        span.set(
            "gen_ai.usage.output_tokens",
            saturating(usage.output_tokens),
        );
        span.set(
            "gen_ai.usage.cache_read.input_tokens",
            saturating(usage.cached_input_tokens),
        );
    }
    span.content("gen_ai.output.messages", || {
        serde_json::to_string(&reply.message).unwrap_or_default()
    });
}

/// `execute_tool <tool>`: one tool call; an MCP tool's span carries the `mcp.*` attributes.
pub(super) fn tool_span(
    turn: &Span,
    tool: &OfferedTool,
    call_id: &str,
    arguments: &serde_json::Value,
) -> Span {
    let span = turn.child(|| {
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", "execute_tool"),
            KeyValue::new("gen_ai.tool.name", tool.name.clone()),
            KeyValue::new("gen_ai.tool.call.id", call_id.to_string()),
            KeyValue::new("gen_ai.tool.type", "function"),
        ];
        match &tool.runs {
            Runs::Mcp { connection, tool } => attributes.extend([
                KeyValue::new("mcp.method.name", "tools/call"),
                KeyValue::new("agentgate.mcp.server", connection.server.clone()),
                KeyValue::new("agentgate.mcp.tool", tool.clone()),
            ]),
            Runs::Command(_) => {}
        }
        SpanStart {
            name: format!("execute_tool {}", tool.name),
            kind: SpanKind::Internal,
            attributes,
        }
    });
    span.content("gen_ai.tool.call.arguments", || arguments.to_string());
    span
}

/// What a tool call gave the model: an error result marks the span failed.
pub(super) fn record_tool_result<E>(span: &Span, input: &Result<Input, E>) {
    let Ok(Input::ToolFinished { result, .. }) = input else {
        return;
    };
    if result.starts_with("error:") {
        span.fail("tool_error", "the tool call ended in an error");
    }
    span.content("gen_ai.tool.call.result", || result.clone());
}

/// A tool call waits for an operator's decision: the turn ends here, and its continuation,
/// once decided, is another `invoke_agent` span of the same trace.
pub(super) fn approval_requested(turn: &Span, request: &ApprovalRow) {
    turn.event(
        "agentgate.approval.requested",
        vec![
            KeyValue::new("agentgate.approval.id", request.id.clone()),
            KeyValue::new("gen_ai.tool.name", request.tool.clone()),
            KeyValue::new("gen_ai.tool.call.id", request.call_id.clone()),
        ],
    );
}

/// A tool call the turn refused to run (arguments against the schema, a repeated call, ...).
pub(super) fn tool_refused(turn: &Span, tool: &str, reason: &'static str) {
    turn.event(
        "agentgate.tool.refused",
        vec![
            KeyValue::new("gen_ai.tool.name", tool.to_string()),
            KeyValue::new("agentgate.refusal.reason", reason),
        ],
    );
}

fn saturating(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}
