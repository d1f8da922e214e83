//! Traces against the real binary: an in-test OTLP/HTTP collector receives the export, decoded
//! with the official protobuf definitions (`opentelemetry-proto`), and the span tree of a turn is
//! checked: names, kinds, parents, GenAI attributes, and the `traceparent` that deliveries and
//! MCP requests carry.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::mcp::PythonServer;
use common::stub::{Reply, Stub};
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use serde_json::json;

const TURN_LIMIT: Duration = Duration::from_secs(30);
/// The sender's trace: the webhook request's span is its child.
const SENDER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SENDER_SPAN: &str = "00f067aa0ba902b7";

/// One span as the collector received it; ids in hex, attribute values as text.
#[derive(Debug, Clone)]
struct Exported {
    name: String,
    kind: i32,
    trace_id: String,
    span_id: String,
    parent: String,
    attributes: HashMap<String, String>,
    events: Vec<String>,
    /// (trace id, span id) of each link.
    links: Vec<(String, String)>,
}

impl Exported {
    fn attribute(&self, key: &str) -> &str {
        self.attributes.get(key).map_or("", String::as_str)
    }
}

/// An attribute value as text; an array as a JSON list of its items' texts.
fn text(value: Option<Value>) -> String {
    match value {
        Some(Value::StringValue(text)) => text,
        Some(Value::IntValue(number)) => number.to_string(),
        Some(Value::BoolValue(flag)) => flag.to_string(),
        Some(Value::DoubleValue(number)) => number.to_string(),
        Some(Value::ArrayValue(array)) => {
            let items: Vec<String> = array
                .values
                .into_iter()
                .map(|item| text(item.value))
                .collect();
            json!(items).to_string()
        }
        other => format!("{other:?}"),
    }
}

/// `reply` as a server that names its completion `id` and says it stopped for `finish`.
fn identified(reply: Reply, id: &str, finish: &str) -> Reply {
    let mut body: serde_json::Value = serde_json::from_str(&reply.body).expect("a JSON reply");
    body["id"] = json!(id);
    body["choices"][0]["finish_reason"] = json!(finish);
    body["system_fingerprint"] = json!("b6990-cpu");
    Reply {
        body: body.to_string(),
        ..reply
    }
}

/// The request parameters the spans must carry, as `[model] params`.
const PARAMS: &str = "params = { temperature = 0.2, max_tokens = 256, seed = 7, top_p = 0.9, \
    top_k = 40, presence_penalty = 0.5, stop = [\"END\"] }\n";

/// Every span the collector received, decoded as OTLP/HTTP protobuf.
fn exported(collector: &Stub) -> Vec<Exported> {
    let mut spans = Vec::new();
    for request in collector.requests() {
        assert_eq!(request.path, "/v1/traces");
        assert_eq!(
            request.header("content-type"),
            Some("application/x-protobuf")
        );
        let export = ExportTraceServiceRequest::decode(&request.body[..]).expect("OTLP protobuf");
        for resource in export.resource_spans {
            for scope in resource.scope_spans {
                for span in scope.spans {
                    spans.push(Exported {
                        name: span.name,
                        kind: span.kind,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent: hex(&span.parent_span_id),
                        attributes: span
                            .attributes
                            .into_iter()
                            .map(|kv| (kv.key, text(kv.value.and_then(|v| v.value))))
                            .collect(),
                        events: span.events.into_iter().map(|e| e.name).collect(),
                        links: span
                            .links
                            .iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                            .collect(),
                    });
                }
            }
        }
    }
    spans
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn named<'a>(spans: &'a [Exported], prefix: &str) -> Vec<&'a Exported> {
    spans
        .iter()
        .filter(|s| s.name.starts_with(prefix))
        .collect()
}

fn one<'a>(spans: &'a [Exported], name: &str) -> &'a Exported {
    let found = named(spans, name);
    assert_eq!(found.len(), 1, "one span {name:?} in {spans:#?}");
    found[0]
}

/// The span id in a `traceparent` (`00-TRACE-SPAN-FLAGS`).
fn span_of(traceparent: &str) -> &str {
    traceparent.split('-').nth(2).unwrap_or("")
}

fn config(model: &Stub, receiver: &Stub, collector: &str, extra: &str) -> String {
    format!(
        r#"{model_section}
[tools.echo]
description = "Echo the arguments"
command = ["/bin/cat"]
parameters = {{ type = "object", properties = {{ text = {{ type = "string", maxLength = 100 }} }}, required = ["text"] }}

[routes.alerts]
path = "/hooks/alerts"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
tools = ["echo"{extra_tools}]
deliver = {{ kind = "http", url = "{receiver}/results" }}

[telemetry]
otlp_endpoint = "{collector}"
{extra}
"#,
        model_section = model.model_section(),
        receiver = receiver.url(),
        extra_tools = if extra.contains("[mcp.web]") {
            ", \"web.shout\""
        } else {
            ""
        },
    )
}

fn collector() -> Stub {
    Stub::start(|_, _| Reply::raw(200, ""))
}

/// A turn with two command tool calls, an MCP call and a delivery is one trace under the
/// sender's `traceparent`, with the GenAI spans and attributes; the delivery and the MCP
/// request carry their own span's `traceparent`; no content without `capture_content`.
#[test]
#[expect(clippy::too_many_lines, reason = "one turn's trace, span by span")]
fn a_turn_is_one_trace_under_the_sender_s_traceparent() {
    if !common::mcp::servers_or_skip("a_turn_is_one_trace_under_the_sender_s_traceparent") {
        return;
    }
    let workspace = Workspace::new();
    let server = PythonServer::start(&workspace);
    let two_calls = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "echo", "arguments": "{\"text\":\"one\"}"}},
        {"id": "call-2", "type": "function",
         "function": {"name": "echo", "arguments": "{\"text\":\"two\"}"}},
        {"id": "call-4", "type": "function",
         "function": {"name": "echo", "arguments": json!({"text": "x".repeat(200)}).to_string()}}]});
    let model = Stub::scripted(vec![
        identified(Reply::completion(two_calls), "chatcmpl-1", "tool_calls").with_usage(120, 0, 7),
        identified(
            Reply::tool_call("call-3", "web__shout", json!({"text": "hi"})),
            "chatcmpl-2",
            "tool_calls",
        )
        .with_usage(150, 100, 5),
        identified(Reply::answer("done"), "chatcmpl-3", "stop").with_usage(170, 140, 2),
    ]);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let collector = collector();
    let text = config(
        &model,
        &receiver,
        &collector.url(),
        &format!(
            "{}\n[console]\ntrace_url = \"http://127.0.0.1:16686/trace/{{trace_id}}\"\n",
            server.config(&workspace)
        ),
    )
    .replace("max_retries = 0\n", &format!("max_retries = 0\n{PARAMS}"));
    workspace.write_config(&text);
    let daemon = workspace.start();
    let traceparent = format!("00-{SENDER_TRACE}-{SENDER_SPAN}-01");
    let response = daemon.post_json(
        "/hooks/alerts",
        &[("traceparent", &traceparent)],
        &json!({"session": "db-1", "alert": "disk full"}).to_string(),
    );
    assert_eq!(response.status, 202, "{response:?}");
    let event_id = response.event_id();
    assert_eq!(workspace.wait_terminal(&event_id, TURN_LIMIT), "completed");
    wait_until("the delivery", TURN_LIMIT, || {
        !receiver.requests().is_empty()
    });
    let shown = workspace.cli_json(&["events", "show", &event_id, "--json"]);
    assert_eq!(shown["trace_id"], SENDER_TRACE, "{shown}");
    let page = control_request(
        &workspace.path().join("control.sock"),
        "GET",
        &format!("/console/events/{event_id}"),
    );
    let link = format!("href=\"http://127.0.0.1:16686/trace/{SENDER_TRACE}\"");
    // The page escapes `/` in attributes as `&#x2f;`, which a browser reads as `/`.
    let html = page.body.replace("&#x2f;", "/");
    assert!(
        html.contains(&link),
        "the event page links its trace: {html}"
    );
    assert!(daemon.terminate().success());

    let spans = exported(&collector);
    assert!(
        spans.iter().all(|s| s.trace_id == SENDER_TRACE),
        "every span is in the sender's trace: {spans:#?}"
    );
    let request = one(&spans, "POST /hooks/alerts");
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert_eq!(request.parent, SENDER_SPAN);
    assert_eq!(request.attribute("http.response.status_code"), "202");
    let turn = one(&spans, "invoke_agent alerts");
    assert_eq!(turn.parent, request.span_id);
    assert_eq!(turn.attribute("gen_ai.operation.name"), "invoke_agent");
    assert_eq!(turn.attribute("gen_ai.provider.name"), "openai");
    assert_eq!(turn.attribute("gen_ai.agent.name"), "alerts");
    assert_eq!(turn.attribute("gen_ai.conversation.id"), "db-1");
    assert_eq!(turn.attribute("gen_ai.request.model"), "stub");
    assert_request_parameters(turn);
    // The turn's usage is the sum of its replies'; it stopped for its last reply's reason.
    let usage = [
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
        "gen_ai.usage.cache_read.input_tokens",
    ];
    assert_eq!(usage.map(|key| turn.attribute(key)), ["440", "14", "240"]);
    assert_eq!(
        turn.attribute("gen_ai.response.finish_reasons"),
        r#"["stop"]"#
    );
    assert_eq!(turn.attribute("agentgate.turn.status"), "completed");
    assert!(
        turn.links.is_empty(),
        "a first run links to nothing: {turn:?}"
    );
    // The call against the schema (maxLength) did not run: an event of the turn, not a span.
    assert_eq!(turn.events, ["agentgate.tool.refused"]);

    let mut chats = named(&spans, "chat stub");
    assert_eq!(chats.len(), 3, "{spans:#?}");
    for chat in &chats {
        assert_eq!(chat.parent, turn.span_id);
        assert_eq!(chat.kind, SpanKind::Client as i32);
        assert_eq!(chat.attribute("gen_ai.operation.name"), "chat");
        assert_eq!(chat.attribute("gen_ai.provider.name"), "openai");
        assert_eq!(chat.attribute("gen_ai.request.model"), "stub");
        assert_eq!(chat.attribute("gen_ai.conversation.id"), "db-1");
        assert_eq!(chat.attribute("openai.api.type"), "chat_completions");
        assert_eq!(chat.attribute("server.address"), "127.0.0.1");
        assert_eq!(chat.attribute("server.port"), model.addr.port().to_string());
        assert_eq!(
            chat.attribute("openai.response.system_fingerprint"),
            "b6990-cpu"
        );
        assert_request_parameters(chat);
        assert!(!chat.attributes.contains_key("gen_ai.input.messages"));
        assert!(!chat.attributes.contains_key("gen_ai.output.messages"));
        assert!(!chat.attributes.contains_key("agentgate.model.fallback"));
    }
    chats.sort_by_key(|chat| chat.attribute("gen_ai.response.id").to_string());
    let replies: Vec<[&str; 4]> = chats
        .iter()
        .map(|c| {
            [
                "gen_ai.response.id",
                "gen_ai.response.finish_reasons",
                "gen_ai.usage.input_tokens",
                "gen_ai.usage.cache_read.input_tokens",
            ]
            .map(|key| c.attribute(key))
        })
        .collect();
    assert_eq!(
        replies,
        [
            ["chatcmpl-1", r#"["tool_calls"]"#, "120", "0"],
            ["chatcmpl-2", r#"["tool_calls"]"#, "150", "100"],
            ["chatcmpl-3", r#"["stop"]"#, "170", "140"],
        ]
    );

    let tools = named(&spans, "execute_tool ");
    let mut calls: Vec<(&str, &str)> = tools
        .iter()
        .map(|t| {
            assert_eq!(t.parent, turn.span_id);
            assert!(!t.attributes.contains_key("gen_ai.tool.call.arguments"));
            (
                t.attribute("gen_ai.tool.name"),
                t.attribute("gen_ai.tool.call.id"),
            )
        })
        .collect();
    calls.sort();
    assert_eq!(
        calls,
        [
            ("echo", "call-1"),
            ("echo", "call-2"),
            ("web__shout", "call-3")
        ]
    );
    let mcp = one(&spans, "execute_tool web__shout");
    assert_eq!(mcp.attribute("mcp.method.name"), "tools/call");
    assert_eq!(server.traceparents().len(), 1);
    assert_eq!(span_of(&server.traceparents()[0]), mcp.span_id);
    // The HTTP request carries the same context as a header, for the server's HTTP layer.
    assert_eq!(server.header_traceparents(), server.traceparents());

    let delivery = one(&spans, "deliver alerts");
    assert_eq!(delivery.parent, request.span_id);
    assert_eq!(delivery.kind, SpanKind::Client as i32);
    let sent = receiver.requests()[0]
        .header("traceparent")
        .map(str::to_string)
        .unwrap_or_default();
    assert!(sent.starts_with(&format!("00-{SENDER_TRACE}-")), "{sent}");
    assert_eq!(span_of(&sent), delivery.span_id);
}

/// The request parameters of [`PARAMS`], as the GenAI conventions name them.
fn assert_request_parameters(span: &Exported) {
    let parameters = [
        ("gen_ai.request.temperature", "0.2"),
        ("gen_ai.request.max_tokens", "256"),
        ("gen_ai.request.seed", "7"),
        ("gen_ai.request.top_p", "0.9"),
        ("gen_ai.request.top_k", "40"),
        ("gen_ai.request.presence_penalty", "0.5"),
        ("gen_ai.request.stop_sequences", r#"["END"]"#),
    ];
    for (key, value) in parameters {
        assert_eq!(span.attribute(key), value, "{key} of {span:#?}");
    }
    assert!(
        !span
            .attributes
            .contains_key("gen_ai.request.frequency_penalty")
    );
}

/// A request the primary cannot answer goes to the fallback endpoint: each is a `chat` span of
/// its own, named after the model it asked, with its own server; the primary's failed, the
/// fallback's carries the answer and the model its server named.
#[test]
fn a_fallback_s_answer_is_in_a_span_of_the_fallback_model() {
    let workspace = Workspace::new();
    let primary = Stub::start(|_, _| Reply::json(503, json!({"error": "overloaded"})));
    let fallback = Stub::start(|_, _| {
        let reply = identified(Reply::answer("from the fallback"), "chatcmpl-f", "stop");
        let mut body: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON");
        body["model"] = json!("fallback-model-q4");
        Reply::json(200, body).with_usage(30, 0, 4)
    });
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let collector = collector();
    let text = config(&primary, &receiver, &collector.url(), "").replace(
        "max_retries = 0\n",
        &format!(
            "max_retries = 0\nfallback = [{{ base_url = \"{}/v1\", model = \"fallback-model\" }}]\n",
            fallback.url()
        ),
    );
    workspace.write_config(&text);
    let daemon = workspace.start();
    let response = daemon.post_json(
        "/hooks/alerts",
        &[],
        &json!({"session": "db-4", "alert": "disk full"}).to_string(),
    );
    assert_eq!(response.status, 202, "{response:?}");
    assert_eq!(
        workspace.wait_terminal(&response.event_id(), TURN_LIMIT),
        "completed"
    );
    assert!(daemon.terminate().success());
    let spans = exported(&collector);
    let turn = one(&spans, "invoke_agent alerts");
    let asked = one(&spans, "chat stub");
    assert_eq!(asked.parent, turn.span_id);
    assert_eq!(asked.attribute("gen_ai.request.model"), "stub");
    assert_eq!(
        asked.attribute("server.port"),
        primary.addr.port().to_string()
    );
    assert_eq!(asked.attribute("error.type"), "unavailable");
    assert!(!asked.attributes.contains_key("gen_ai.response.id"));
    let answered = one(&spans, "chat fallback-model");
    assert_eq!(answered.parent, turn.span_id);
    assert_eq!(answered.kind, SpanKind::Client as i32);
    assert_eq!(answered.attribute("gen_ai.provider.name"), "openai");
    assert_eq!(answered.attribute("gen_ai.request.model"), "fallback-model");
    assert_eq!(
        answered.attribute("gen_ai.response.model"),
        "fallback-model-q4"
    );
    assert_eq!(answered.attribute("gen_ai.response.id"), "chatcmpl-f");
    assert_eq!(answered.attribute("server.address"), "127.0.0.1");
    assert_eq!(
        answered.attribute("server.port"),
        fallback.addr.port().to_string()
    );
    assert_eq!(answered.attribute("agentgate.model.fallback"), "true");
    assert_eq!(answered.attribute("gen_ai.usage.input_tokens"), "30");
    assert!(!answered.attributes.contains_key("error.type"));
}

/// A turn cut off by kill -9 and resumed by the next process continues the event's trace: the
/// resumed turn is a child of the request span stored with the event.
#[test]
fn a_turn_resumed_after_kill_9_continues_its_trace() {
    let workspace = Workspace::new();
    let model = Stub::start(|_, index| {
        if index == 0 {
            Reply::answer("too late").after(Duration::from_secs(300))
        } else {
            Reply::answer("done")
        }
    });
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let collector = collector();
    workspace.write_config(&config(&model, &receiver, &collector.url(), ""));
    let daemon = workspace.start();
    let response = daemon.post_json(
        "/hooks/alerts",
        &[],
        &json!({"session": "db-2", "alert": "disk full"}).to_string(),
    );
    assert_eq!(response.status, 202, "{response:?}");
    let event_id = response.event_id();
    // The request span is exported in the background while the first model request hangs.
    wait_until("the request span at the collector", TURN_LIMIT, || {
        !named(&exported(&collector), "POST /hooks/alerts").is_empty()
    });
    wait_until("the first model request", TURN_LIMIT, || {
        !model.requests().is_empty()
    });
    daemon.kill9();

    let daemon = workspace.start();
    assert_eq!(workspace.wait_terminal(&event_id, TURN_LIMIT), "completed");
    assert!(daemon.terminate().success());
    let spans = exported(&collector);
    let request = one(&spans, "POST /hooks/alerts");
    let resumed = one(&spans, "invoke_agent alerts");
    assert_eq!(resumed.trace_id, request.trace_id);
    assert_eq!(resumed.parent, request.span_id);
    assert_eq!(resumed.attribute("agentgate.turn.continues"), "crashed");
    // The interrupted run's span never ended (the process was killed), so it was never
    // exported; the resumed run links to it, by the id recorded with its turn.
    assert_eq!(resumed.links.len(), 1, "{resumed:?}");
    assert_eq!(resumed.links[0].0, request.trace_id);
    assert_ne!(resumed.links[0].1, resumed.span_id);
    let delivery = one(&spans, "deliver alerts");
    assert_eq!(delivery.trace_id, request.trace_id);
}

/// A collector that refuses connections costs spans, never webhooks: every event is accepted
/// and completed, the lost spans are counted, and the journal says so.
#[test]
fn a_dead_collector_costs_spans_not_work() {
    let workspace = Workspace::new();
    let model = Stub::scripted(vec![Reply::answer("done")]);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    workspace.write_config(&config(&model, &receiver, &dead, ""));
    let daemon = workspace.start();
    let ids: Vec<String> = (0..5)
        .map(|n| {
            let response = daemon.post_json(
                "/hooks/alerts",
                &[],
                &json!({"session": format!("s{n}"), "alert": "x"}).to_string(),
            );
            assert_eq!(response.status, 202, "{response:?}");
            response.event_id()
        })
        .collect();
    for id in &ids {
        assert_eq!(workspace.wait_terminal(id, TURN_LIMIT), "completed");
    }
    let dropped = || {
        workspace
            .metrics()
            .lines()
            .find(|line| line.starts_with("agentgate_trace_spans_total{outcome=\"dropped\"}"))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    wait_until("spans counted as dropped", TURN_LIMIT, || dropped() > 0.0);
    daemon.wait_for_log("the trace collector did not take spans");
    assert!(daemon.terminate().success());
}

/// With `capture_content`, messages, arguments and results become attributes, each cut to 8 KiB;
/// the model's API key is in none of them.
#[test]
fn captured_content_is_bounded_and_holds_no_secret() {
    let workspace = Workspace::new();
    let model = Stub::scripted(vec![
        Reply::tool_call("call-1", "zeros", json!({})),
        Reply::answer("done"),
    ]);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let collector = collector();
    let text = config(
        &model,
        &receiver,
        &collector.url(),
        "capture_content = true",
    )
    .replace(
        "model = \"stub\"\n",
        "model = \"stub\"\napi_key = { env = \"TEST_MODEL_KEY\" }\n",
    )
    .replace("tools = [\"echo\"", "tools = [\"zeros\", \"echo\"")
    .replace(
        "[routes.alerts]",
        "[tools.zeros]\ndescription = \"Counts to 5,000 (23 kB)\"\n\
             command = [\"/usr/bin/seq\", \"1\", \"5000\"]\n\n[routes.alerts]",
    );
    workspace.write_config(&text);
    let daemon = workspace.start_with_env(&[("TEST_MODEL_KEY", "sk-never-in-a-span")]);
    let response = daemon.post_json(
        "/hooks/alerts",
        &[],
        &json!({"session": "db-3", "alert": "disk full on db-3"}).to_string(),
    );
    assert_eq!(response.status, 202, "{response:?}");
    assert_eq!(
        workspace.wait_terminal(&response.event_id(), TURN_LIMIT),
        "completed"
    );
    assert!(daemon.terminate().success());
    let spans = exported(&collector);
    let first_chat = named(&spans, "chat stub")
        .into_iter()
        .find(|chat| chat.attribute("gen_ai.output.messages").contains("zeros"))
        .expect("the chat span whose reply called the tool");
    // Messages in the conventions' schema: a role and its parts.
    let input: serde_json::Value =
        serde_json::from_str(first_chat.attribute("gen_ai.input.messages")).expect("JSON");
    assert_eq!(input[0]["role"], "system", "{input}");
    assert_eq!(input[0]["parts"][0]["type"], "text");
    assert_eq!(input[1]["role"], "user");
    assert!(
        input[1]["parts"][0]["content"]
            .as_str()
            .is_some_and(|text| text.contains("disk full on db-3")),
        "{input}"
    );
    let output: serde_json::Value =
        serde_json::from_str(first_chat.attribute("gen_ai.output.messages")).expect("JSON");
    assert_eq!(
        output,
        json!([{"role": "assistant", "finish_reason": "stop", "parts": [
            {"type": "tool_call", "id": "call-1", "name": "zeros", "arguments": {}}]}])
    );
    let second_chat = named(&spans, "chat stub")
        .into_iter()
        .find(|chat| chat.attribute("gen_ai.output.messages").contains("done"))
        .expect("the chat span of the answer");
    let input: serde_json::Value =
        serde_json::from_str(second_chat.attribute("gen_ai.input.messages")).expect("JSON");
    let result = &input[3]["parts"][0];
    assert_eq!(
        (&input[3]["role"], &result["type"], &result["id"]),
        (
            &json!("tool"),
            &json!("tool_call_response"),
            &json!("call-1")
        ),
        "{input}"
    );
    let tool = one(&spans, "execute_tool zeros");
    assert_eq!(tool.attribute("gen_ai.tool.call.arguments"), "{}");
    let result = tool.attribute("gen_ai.tool.call.result");
    assert!(result.len() < 8 * 1024 + 64, "{} bytes", result.len());
    assert!(result.ends_with(" more bytes]"), "{result}");
    for span in &spans {
        for value in span.attributes.values() {
            assert!(!value.contains("sk-never-in-a-span"), "{span:?}");
        }
    }
}

/// `[telemetry]` and `[console]` are checked: a collector that is not an http(s) URL, a share
/// outside 0..1, a console on TCP without a token and a trace link without `{trace_id}` are
/// errors; a console on a public address or with a short token is accepted with a warning.
#[test]
fn check_config_checks_telemetry_and_console() {
    let workspace = Workspace::new();
    workspace.write_config(
        "[telemetry]\notlp_endpoint = \"collector:4318\"\nsample_ratio = 1.5\n\n\
         [console]\nlisten = \"127.0.0.1:8788\"\ntrace_url = \"http://jaeger:16686/trace/\"\n",
    );
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout);
    assert_eq!(checked.status.code(), Some(78), "{checked:?}");
    for key in [
        "telemetry.otlp_endpoint",
        "telemetry.sample_ratio",
        "console.listen",
        "console.trace_url",
    ] {
        assert!(said.contains(key), "{key}: {said}");
    }
    workspace.write_config(
        "[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\nsample_ratio = 0.25\n\n\
         [console]\nenabled = true\nlisten = \"0.0.0.0:8788\"\ntoken = \"short\"\n\
         trace_url = \"http://127.0.0.1:16686/trace/{trace_id}\"\n",
    );
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout);
    assert_eq!(checked.status.code(), Some(0), "{checked:?}");
    assert!(said.contains("not a loopback address"), "{said}");
    assert!(said.contains("shorter than 16"), "{said}");
    assert!(!said.contains("console.trace_url"), "{said}");
}
