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

fn text(value: Option<Value>) -> String {
    match value {
        Some(Value::StringValue(text)) => text,
        Some(Value::IntValue(number)) => number.to_string(),
        Some(Value::BoolValue(flag)) => flag.to_string(),
        Some(Value::DoubleValue(number)) => number.to_string(),
        other => format!("{other:?}"),
    }
}

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
fn a_turn_is_one_trace_under_the_sender_s_traceparent() {
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
        Reply::completion(two_calls).with_usage(120, 0, 7),
        Reply::tool_call("call-3", "web__shout", json!({"text": "hi"})).with_usage(150, 100, 5),
        Reply::answer("done").with_usage(170, 140, 2),
    ]);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let collector = collector();
    workspace.write_config(&config(
        &model,
        &receiver,
        &collector.url(),
        &format!(
            "{}\n[console]\ntrace_url = \"http://127.0.0.1:16686/trace/{{trace_id}}\"\n",
            server.config(&workspace)
        ),
    ));
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
    assert_eq!(turn.attribute("gen_ai.conversation.id"), "db-1");
    assert_eq!(turn.attribute("gen_ai.request.model"), "stub");
    assert_eq!(turn.attribute("agentgate.turn.status"), "completed");
    assert!(
        turn.links.is_empty(),
        "a first run links to nothing: {turn:?}"
    );
    // The call against the schema (maxLength) did not run: an event of the turn, not a span.
    assert_eq!(turn.events, ["agentgate.tool.refused"]);

    let chats = named(&spans, "chat stub");
    assert_eq!(chats.len(), 3, "{spans:#?}");
    for chat in &chats {
        assert_eq!(chat.parent, turn.span_id);
        assert_eq!(chat.kind, SpanKind::Client as i32);
        assert_eq!(chat.attribute("gen_ai.operation.name"), "chat");
        assert!(!chat.attributes.contains_key("gen_ai.input.messages"));
    }
    let mut input_tokens: Vec<&str> = chats
        .iter()
        .map(|c| c.attribute("gen_ai.usage.input_tokens"))
        .collect();
    input_tokens.sort();
    assert_eq!(input_tokens, ["120", "150", "170"]);

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
    assert!(
        first_chat
            .attribute("gen_ai.input.messages")
            .contains("disk full on db-3"),
        "{first_chat:?}"
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
