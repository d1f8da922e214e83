//! The spans of a turn, with the attributes of the OpenTelemetry GenAI semantic conventions
//! (docs/reference.md, "Traces"): `invoke_agent <route>` for the turn, under the request span
//! stored with its event, and `chat <model>` (one per request to one endpoint) and
//! `execute_tool <tool>` under it. The `gen_ai.*` names are written here, not taken from the
//! semantic-conventions crate, which deprecated them while they are experimental.
//!
//! A turn also has a `tracing` span (`logging::turn_span`), and the two are built side by side
//! on purpose, not bridged by a `tracing` layer (tracing-opentelemetry):
//! - The OTLP tree outlives the process. A turn's parent is the request span stored with its
//!   event, and a turn that runs again (after a restart, a crash, a drain, an approval) links to
//!   the span its earlier run recorded in the store. A layer takes parents from the spans
//!   entered in this process, so every turn span would still need its parent and link set from
//!   the store by hand: the bridge would save nothing here.
//! - They go to different readers. The `tracing` span gives every journal line its
//!   `EVENT_ID`, `SESSION_KEY`, `ROUTE` and `TURN_ID`, always; these spans carry typed
//!   `gen_ai.*` attributes (arrays, counts, span kinds) and, with `capture_content`, what
//!   senders wrote, only while traces are on and sampled. Bridged, a field of one would be a
//!   field of the other: content could reach the journal, and every library's spans (hyper,
//!   h2, rustls, rmcp) the collector, unless each were filtered out again.
//! - With traces off these spans cost nothing (`Span::off`); a layer would run on every span.

use opentelemetry::trace::SpanKind;
use opentelemetry::{Array, KeyValue, StringValue, Value};
use serde_json::json;

use crate::agent::catalog::{OfferedTool, Runs};
use crate::agent::message::{Message, Role};
use crate::agent::model::{Attempt, Reply, ResponseFacts};
use crate::config::{ModelBackend, ModelSettings};
use crate::session::turn::Input;
use crate::store::{ApprovalRow, ClaimedTurn, Store};
use crate::telemetry::{self, Span, SpanStart};
use crate::usage::Usage;

/// The model a request asks for, as spans name it.
fn requested_model(settings: &ModelSettings) -> &str {
    match &settings.backend {
        ModelBackend::OpenAi { model, .. } => model,
        ModelBackend::Command { .. } => "command",
        ModelBackend::Replay { .. } => "replay",
    }
}

/// `gen_ai.provider.name`: `openai` for the Chat Completions API, whichever server speaks it
/// (`server.address` and `gen_ai.response.model` say which); custom values for the backends
/// that are no provider.
fn provider(settings: &ModelSettings) -> &'static str {
    match &settings.backend {
        ModelBackend::OpenAi { .. } => "openai",
        ModelBackend::Command { .. } => "agentgate.command",
        ModelBackend::Replay { .. } => "agentgate.replay",
    }
}

/// The request parameters the conventions name, from `[model] params` (sent with every request
/// of the openai backend, and only there).
fn request_parameters(settings: &ModelSettings) -> Vec<KeyValue> {
    let ModelBackend::OpenAi { .. } = settings.backend else {
        return Vec::new();
    };
    let params = &settings.params;
    let mut attributes = Vec::new();
    let number = |key: &str| params.get(key).and_then(serde_json::Value::as_f64);
    let whole = |key: &str| params.get(key).and_then(serde_json::Value::as_i64);
    for (key, name) in [
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("top_k", "gen_ai.request.top_k"),
        ("frequency_penalty", "gen_ai.request.frequency_penalty"),
        ("presence_penalty", "gen_ai.request.presence_penalty"),
    ] {
        if let Some(value) = number(key) {
            attributes.push(KeyValue::new(name, value));
        }
    }
    if let Some(max) = whole("max_completion_tokens").or_else(|| whole("max_tokens")) {
        attributes.push(KeyValue::new("gen_ai.request.max_tokens", max));
    }
    if let Some(seed) = whole("seed") {
        attributes.push(KeyValue::new("gen_ai.request.seed", seed));
    }
    if let Some(choices) = whole("n").filter(|n| *n != 1) {
        attributes.push(KeyValue::new("gen_ai.request.choice.count", choices));
    }
    let stop: Vec<StringValue> = match params.get("stop") {
        Some(serde_json::Value::String(one)) => vec![one.clone().into()],
        Some(serde_json::Value::Array(many)) => many
            .iter()
            .filter_map(|item| Some(item.as_str()?.to_string().into()))
            .collect(),
        _ => Vec::new(),
    };
    if !stop.is_empty() {
        attributes.push(strings("gen_ai.request.stop_sequences", stop));
    }
    let format = params
        .get("response_format")
        .and_then(|f| f["type"].as_str());
    if let Some(output) = match format {
        Some("json_object" | "json_schema") => Some("json"),
        Some("text") => Some("text"),
        _ => None,
    } {
        attributes.push(KeyValue::new("gen_ai.output.type", output));
    }
    if let Some(tier) = params.get("service_tier").and_then(|t| t.as_str()) {
        attributes.push(KeyValue::new(
            "openai.request.service_tier",
            tier.to_string(),
        ));
    }
    attributes
}

fn strings(key: &'static str, values: Vec<StringValue>) -> KeyValue {
    KeyValue::new(key, Value::Array(Array::String(values)))
}

/// `invoke_agent <route>`: the turn, in its event's trace. A turn that runs again (resumed after
/// a crash or a drain, or after an approval) is another span of the same trace.
pub(super) fn turn_span(turn: &ClaimedTurn, model: &ModelSettings) -> Span {
    let event = &turn.event;
    telemetry::span_under(event.trace_parent.as_deref(), || {
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", "invoke_agent"),
            KeyValue::new("gen_ai.provider.name", provider(model)),
            KeyValue::new("gen_ai.agent.name", event.route.clone()),
            KeyValue::new("gen_ai.conversation.id", event.session_key.clone()),
            KeyValue::new("gen_ai.request.model", requested_model(model).to_string()),
            KeyValue::new("agentgate.event.id", event.id.clone()),
            KeyValue::new("agentgate.turn.id", turn.turn_id.clone()),
        ];
        attributes.extend(request_parameters(model));
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

/// `chat <model>`: one request to one endpoint (`attempt`), of the session `conversation`, with
/// `messages`. A request a fallback endpoint answers is a span of its own, named after the
/// fallback's model, after the failed one of the endpoint before it.
pub(super) fn chat_span(
    turn: &Span,
    model: &ModelSettings,
    attempt: &Attempt<'_>,
    conversation: &str,
    messages: &[Message],
) -> Span {
    let span = turn.child(|| {
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", "chat"),
            KeyValue::new("gen_ai.provider.name", provider(model)),
            KeyValue::new("gen_ai.request.model", attempt.model.to_string()),
            KeyValue::new("gen_ai.conversation.id", conversation.to_string()),
        ];
        if let Some(server) = attempt.server {
            attributes.push(KeyValue::new("server.address", server.address.clone()));
            attributes.push(KeyValue::new("server.port", i64::from(server.port)));
        }
        if let ModelBackend::OpenAi { .. } = model.backend {
            attributes.push(KeyValue::new("openai.api.type", "chat_completions"));
        }
        if attempt.fallback {
            attributes.push(KeyValue::new("agentgate.model.fallback", true));
        }
        attributes.extend(request_parameters(model));
        SpanStart {
            name: format!("chat {}", attempt.model),
            kind: SpanKind::Client,
            attributes,
        }
    });
    span.content("gen_ai.input.messages", || input_messages(messages));
    span
}

/// What a model reply says of itself: which model answered, the completion's id, why it
/// stopped, and what it cost.
pub(super) fn record_reply(span: &Span, reply: &Reply) {
    if let Some(answered) = &reply.answered_by {
        span.set("gen_ai.response.model", answered.model.clone());
    }
    let response = &reply.response;
    if let Some(id) = &response.id {
        span.set("gen_ai.response.id", id.clone());
    }
    record_finish_reasons(span, response);
    if let Some(fingerprint) = &response.system_fingerprint {
        span.set("openai.response.system_fingerprint", fingerprint.clone());
    }
    if let Some(tier) = &response.service_tier {
        span.set("openai.response.service_tier", tier.clone());
    }
    if let Some(usage) = &reply.usage {
        record_usage(span, usage);
    }
    span.content("gen_ai.output.messages", || {
        let finish_reason = response
            .finish_reasons
            .first()
            .map_or("stop", String::as_str);
        let mut message = semconv_message(&reply.message);
        message["finish_reason"] = json!(finish_reason);
        json!([message]).to_string()
    });
}

/// Why the model stopped: one reply's reasons on its `chat` span, the last reply's on the turn's.
pub(super) fn record_finish_reasons(span: &Span, response: &ResponseFacts) {
    if !response.finish_reasons.is_empty() {
        let reasons = response
            .finish_reasons
            .iter()
            .cloned()
            .map(StringValue::from);
        span.set(
            "gen_ai.response.finish_reasons",
            Value::Array(Array::String(reasons.collect())),
        );
    }
}

/// Token counts: one reply's on its `chat` span, or the sum of the turn's on `invoke_agent`.
pub(super) fn record_usage(span: &Span, usage: &Usage) {
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

/// The most of one text (a message's, a tool result) in a content attribute, so that one long
/// tool result does not crowd out the rest of the conversation.
const PART_MAX: usize = 2 * 1024;

/// `messages` in the conventions' input-messages schema, as JSON that stays whole within the
/// content attributes' bound: the newest messages that fit, in order, each text cut to
/// [`PART_MAX`].
fn input_messages(messages: &[Message]) -> String {
    let mut kept = Vec::new();
    let mut size = "[]".len();
    for message in messages.iter().rev() {
        let one = semconv_message(message).to_string();
        if size + one.len() + 1 > telemetry::CONTENT_MAX {
            break;
        }
        size += one.len() + 1;
        kept.push(one);
    }
    kept.reverse();
    format!("[{}]", kept.join(","))
}

/// `text` cut to [`PART_MAX`] bytes, saying how much was left out.
fn part(text: &str) -> String {
    let mut text = text.to_string();
    let left_out = crate::untrusted::cut(&mut text, PART_MAX);
    if left_out > 0 {
        text.push_str(&format!("… [{left_out} more bytes]"));
    }
    text
}

/// One message as the conventions write it: text, tool calls (with their arguments as JSON
/// where they parse) and tool results become `text`, `tool_call` and `tool_call_response` parts.
fn semconv_message(message: &Message) -> serde_json::Value {
    let role = match message.role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let mut parts = Vec::new();
    match (&message.role, &message.content) {
        (Role::Tool, content) => parts.push(json!({
            "type": "tool_call_response",
            "id": message.tool_call_id,
            "response": part(content.as_deref().unwrap_or_default()),
        })),
        (_, Some(content)) => parts.push(json!({"type": "text", "content": part(content)})),
        (_, None) => {}
    }
    for call in &message.tool_calls {
        let arguments = serde_json::from_str::<serde_json::Value>(&call.function.arguments)
            .unwrap_or_else(|_| json!(call.function.arguments));
        parts.push(json!({"type": "tool_call", "id": call.id,
            "name": call.function.name, "arguments": arguments}));
    }
    json!({"role": role, "parts": parts})
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
            Runs::Mcp { server, tool } => attributes.extend([
                KeyValue::new("mcp.method.name", "tools/call"),
                KeyValue::new("agentgate.mcp.server", server.name.clone()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelBackend;

    fn openai(params: serde_json::Value) -> ModelSettings {
        ModelSettings {
            backend: ModelBackend::OpenAi {
                base_url: "http://127.0.0.1:8080/v1".into(),
                model: "m".into(),
                api_key: None,
                fallback: Vec::new(),
            },
            request_timeout: std::time::Duration::from_secs(1),
            max_retries: 0,
            outage_wait: std::time::Duration::ZERO,
            params: params.as_object().cloned().unwrap_or_default(),
            tool_calls_in_content: false,
            max_concurrent_requests: 1,
            price: None,
        }
    }

    #[test]
    fn request_parameters_are_named_as_the_conventions_name_them() {
        let settings = openai(json!({"temperature": 0, "max_completion_tokens": 99,
            "max_tokens": 5, "n": 1, "stop": "END", "response_format": {"type": "json_object"},
            "service_tier": "auto", "mirostat": 2}));
        let named: Vec<(String, String)> = request_parameters(&settings)
            .into_iter()
            .map(|kv| (kv.key.to_string(), kv.value.to_string()))
            .collect();
        let expected = [
            ("gen_ai.request.temperature", "0"),
            ("gen_ai.request.max_tokens", "99"),
            ("gen_ai.request.stop_sequences", "[\"END\"]"),
            ("gen_ai.output.type", "json"),
            ("openai.request.service_tier", "auto"),
        ];
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(named, expected);
        let command = ModelSettings {
            backend: ModelBackend::Command { argv: vec![] },
            ..settings
        };
        assert!(
            request_parameters(&command).is_empty(),
            "only sent to openai"
        );
    }

    #[test]
    fn captured_messages_stay_valid_json_within_the_bound() {
        let mut messages = vec![Message::text(Role::System, "rules")];
        for n in 0..40 {
            messages.push(Message::text(Role::User, format!("event {n}")));
            messages.push(Message::tool_result(&format!("c{n}"), "y".repeat(5000)));
        }
        let text = input_messages(&messages);
        assert!(text.len() <= telemetry::CONTENT_MAX, "{}", text.len());
        let parsed: serde_json::Value = serde_json::from_str(&text).expect("whole JSON");
        let kept = parsed.as_array().expect("a list");
        assert!(!kept.is_empty());
        let newest = &kept[kept.len() - 1]["parts"][0];
        assert_eq!(newest["id"], "c39");
        assert!(
            newest["response"]
                .as_str()
                .is_some_and(|r| r.ends_with("more bytes]") && r.len() < PART_MAX + 40)
        );
    }
}
