//! One transcript entry as people read it: the event with its payload, the model's text, each
//! tool call as a card with its result laid out, and approvals, resumes, notes and superseded
//! entries marked as such, with the entry's raw JSON one click away. The session page and the
//! live stream both render an entry here (`entry.html`), so the two never differ; every value
//! is escaped by the template engine, since all of it may be a stranger's text.

use std::collections::HashMap;

use minijinja::context;
use serde::Serialize;
use serde_json::Value;

use crate::agent::endpoint::AnsweredBy;
use crate::session::{Mark, StepFacts};
use crate::store::TranscriptRow;

/// Output longer than this many lines or bytes is folded in a `<details>`.
const FOLD_LINES: usize = 12;
const FOLD_BYTES: usize = 2048;

/// The tool names of the calls seen so far, by call id: a result entry names its call's tool.
#[derive(Default)]
pub(super) struct CallNames(HashMap<String, String>);

/// The HTML of `row` (inside its list item), or a note when the template fails.
pub(super) fn render(row: &TranscriptRow, names: &mut CallNames) -> String {
    let view = view(row, names);
    super::html("entry.html", context! { entry => view })
        .unwrap_or_else(|err| format!("<p>this entry could not be shown: {err}</p>"))
}

/// What `entry.html` shows of one entry.
#[derive(Serialize, Default)]
struct EntryView {
    n: i64,
    kind: String,
    turn_id: String,
    created_at: String,
    superseded_by: Option<String>,
    /// For a model reply: who answered, and the step's time and tokens.
    answered: Option<AnsweredView>,
    /// What kind of marked entry it is (resume, coalesced event, approval, note), if any.
    mark: Option<String>,
    role: Option<String>,
    text: Option<String>,
    event: Option<EventView>,
    calls: Vec<CallView>,
    result: Option<ResultView>,
    started: Option<CallView>,
    approval: Option<ApprovalView>,
    /// The entry's JSON, pretty-printed.
    raw: String,
}

#[derive(Serialize)]
struct AnsweredView {
    model: String,
    fallback: bool,
    took_ms: Option<u64>,
    usage: Option<crate::usage::Usage>,
}

#[derive(Serialize)]
struct EventView {
    id: String,
    route: String,
    event_type: String,
    sender: Option<String>,
    payload: String,
}

#[derive(Serialize)]
struct CallView {
    id: String,
    name: String,
    arguments: String,
    mcp_server: Option<String>,
}

#[derive(Serialize)]
struct ResultView {
    call_id: String,
    name: Option<String>,
    /// Laid out when the result is a command's outcome; else `text`.
    outcome: Option<OutcomeView>,
    text: Option<Output>,
}

#[derive(Serialize)]
struct OutcomeView {
    exit_status: Option<i64>,
    signal: Option<i64>,
    timed_out: bool,
    error: Option<String>,
    stdout: Output,
    stderr: Output,
}

/// A block of output, and whether it is long enough to fold.
#[derive(Serialize)]
struct Output {
    text: String,
    long: bool,
    lines: usize,
}

#[derive(Serialize)]
struct ApprovalView {
    tool: String,
    status: String,
    by: Option<String>,
    note: Option<String>,
    arguments: String,
}

/// Who answered a model reply, as its entry `body` records it.
pub(super) fn answered_by(body: &Value) -> Option<AnsweredBy> {
    serde_json::from_value(body["answered_by"].clone()).ok()
}

/// The step a model reply's entry `body` records: when, how long, what it spent.
pub(super) fn step_facts(body: &Value) -> Option<StepFacts> {
    serde_json::from_value(body["step"].clone()).ok()
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

fn text_of(value: &Value) -> Option<String> {
    value.as_str().map(str::to_string)
}

fn output(text: String) -> Output {
    let lines = text.lines().count();
    Output {
        long: lines > FOLD_LINES || text.len() > FOLD_BYTES,
        lines,
        text,
    }
}

/// Arguments as the model sent them (a JSON string), pretty-printed when they parse.
fn arguments(value: &Value) -> String {
    match value {
        Value::String(text) => serde_json::from_str::<Value>(text)
            .map_or_else(|_| text.clone(), |parsed| pretty(&parsed)),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Array(_) | Value::Object(_) => {
            pretty(value)
        }
    }
}

/// Whether the session page offers a rewind and a fork at `row`: an event entry or an assistant
/// message that no rewind superseded (docs/reference.md, "Rewind and fork").
pub(super) fn is_rerun_point(row: &TranscriptRow) -> bool {
    row.superseded_by.is_none()
        && crate::store::rerun_start(&row.kind, row.body["message"]["role"].as_str()).is_ok()
}

fn view(row: &TranscriptRow, names: &mut CallNames) -> EntryView {
    let body = &row.body;
    let mut view = EntryView {
        n: row.n,
        kind: row.kind.clone(),
        turn_id: row.turn_id.clone(),
        created_at: crate::store::rfc3339(row.created_at),
        superseded_by: row.superseded_by.clone(),
        raw: pretty(body),
        ..EntryView::default()
    };
    match row.kind.as_str() {
        "event" => view.event = row.event.as_ref().map(event_view),
        "tool_start" => {
            let call = call_view(body, "call_id", "name", "arguments");
            names.0.insert(call.id.clone(), call.name.clone());
            view.started = Some(call);
        }
        "approval" => {
            let status = text_of(&body["status"]).unwrap_or_default();
            view.mark = Some(format!("approval {status}"));
            view.approval = Some(ApprovalView {
                tool: text_of(&body["tool"]).unwrap_or_default(),
                status,
                by: text_of(&body["by"]),
                note: text_of(&body["note"]),
                arguments: arguments(&body["arguments"]),
            });
        }
        _ => {}
    }
    if body.get("message").is_some() {
        message_view(&mut view, body, names);
    }
    view
}

fn event_view(event: &crate::store::Event) -> EventView {
    let payload = serde_json::from_slice::<Value>(&event.payload).map_or_else(
        |_| String::from_utf8_lossy(&event.payload).into_owned(),
        |parsed| pretty(&parsed),
    );
    let parsed: Value = serde_json::from_slice(&event.payload).unwrap_or_default();
    let sender = [
        "/sender/login",
        "/sender/name",
        "/sender",
        "/user/login",
        "/user/name",
    ]
    .iter()
    .find_map(|pointer| parsed.pointer(pointer).and_then(Value::as_str))
    .map(str::to_string);
    EventView {
        id: event.id.clone(),
        route: event.route.clone(),
        event_type: event.event_type.clone(),
        sender,
        payload,
    }
}

fn call_view(value: &Value, id: &str, name: &str, args: &str) -> CallView {
    CallView {
        id: text_of(&value[id]).unwrap_or_default(),
        name: text_of(&value[name]).unwrap_or_default(),
        arguments: arguments(&value[args]),
        mcp_server: text_of(&value["mcp_server"]),
    }
}

fn message_view(view: &mut EntryView, body: &Value, names: &mut CallNames) {
    let message = &body["message"];
    let role = text_of(&message["role"]).unwrap_or_default();
    let content = text_of(&message["content"]);
    if let Some(calls) = message["tool_calls"].as_array() {
        for call in calls {
            let mut card = call_view(&call["function"], "name", "name", "arguments");
            card.id = text_of(&call["id"]).unwrap_or_default();
            names.0.insert(card.id.clone(), card.name.clone());
            view.calls.push(card);
        }
    }
    if role == "tool" {
        let call_id = text_of(&message["tool_call_id"]).unwrap_or_default();
        let text = content.unwrap_or_default();
        let outcome = serde_json::from_str::<Value>(&text)
            .ok()
            .filter(|value| value.get("stdout").is_some() || value.get("exit_status").is_some())
            .map(|value| OutcomeView {
                exit_status: value["exit_status"].as_i64(),
                signal: value["signal"].as_i64(),
                timed_out: value["timed_out"].as_bool().unwrap_or(false),
                error: text_of(&value["error"]),
                stdout: output(text_of(&value["stdout"]).unwrap_or_default()),
                stderr: output(text_of(&value["stderr"]).unwrap_or_default()),
            });
        view.result = Some(ResultView {
            name: names.0.get(&call_id).cloned(),
            call_id,
            text: outcome.is_none().then(|| output(text)),
            outcome,
        });
    } else {
        if view.kind != "event" {
            let recorded = serde_json::from_value::<Mark>(body["mark"].clone()).ok();
            let mark = recorded.or_else(|| content.as_deref().and_then(worded_mark));
            view.mark = mark.map(|mark| mark_label(mark).to_string());
        }
        view.text = content;
    }
    if role == "assistant" {
        let step = step_facts(body);
        view.answered = answered_by(body).map(|by| AnsweredView {
            model: by.model,
            fallback: by.fallback,
            took_ms: step.map(|step| step.took_ms),
            usage: step.and_then(|step| step.usage),
        });
    }
    view.role = Some(role);
}

/// How a marked entry is labelled.
fn mark_label(mark: Mark) -> &'static str {
    match mark {
        Mark::Resumed => "resumed after an interruption",
        Mark::Coalesced => "coalesced event",
        Mark::LastStep => "last step",
        Mark::Note => "note",
    }
}

/// What a message of agentgate's own recorded without a mark (before marks were) is, from its
/// wording.
fn worded_mark(text: &str) -> Option<Mark> {
    let note = text.strip_prefix("[agentgate] ")?;
    Some(if note.contains("interrupted") {
        Mark::Resumed
    } else if note.starts_with("A webhook event follows") {
        Mark::Coalesced
    } else if note.contains("last step") {
        Mark::LastStep
    } else {
        Mark::Note
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(n: i64, kind: &str, body: Value) -> TranscriptRow {
        TranscriptRow {
            seq: n,
            n,
            superseded_by: None,
            turn_id: "t1".into(),
            kind: kind.into(),
            body,
            created_at: 0,
            event: None,
        }
    }

    /// Approvals, resumes, coalesced events and superseded entries are marked; a long output is
    /// folded; the result names its call's tool from an earlier entry.
    #[test]
    fn marked_entries_and_long_output() {
        let mut names = CallNames::default();
        let call = json!({"kind": "message", "message": {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\":1}"}}]}});
        assert!(render(&row(1, "message", call), &mut names).contains("&quot;q&quot;: 1"));
        let stdout = "line\n".repeat(FOLD_LINES + 1);
        let outcome = json!({"exit_status": 3, "signal": null, "stdout": stdout, "stderr": "oops"});
        let result = json!({"kind": "message", "message": {"role": "tool", "tool_call_id": "c1",
            "content": outcome.to_string()}});
        let shown = render(&row(2, "message", result), &mut names);
        assert!(
            shown.contains("result of <code class=\"tool-name\">lookup</code>"),
            "{shown}"
        );
        assert!(
            shown.contains("exit status <span class=\"bad\">3</span>"),
            "{shown}"
        );
        assert!(
            shown.contains("<details class=\"output stdout\"><summary>stdout (13 lines)"),
            "{shown}"
        );
        assert!(
            shown.contains("<pre class=\"output stderr\">oops</pre>"),
            "{shown}"
        );
        let approval = json!({"kind": "approval", "approval_id": "a1", "call_id": "c1",
            "tool": "deploy", "arguments": {}, "status": "denied", "by": "ops", "expires_at": 0});
        let shown = render(&row(3, "approval", approval), &mut names);
        assert!(
            shown.contains("<strong class=\"mark\">approval denied</strong>"),
            "{shown}"
        );
        for (text, mark) in [
            (
                "[agentgate] The previous run of this task was interrupted (x) and is now resumed.",
                "resumed after an interruption",
            ),
            (
                "[agentgate] A webhook event follows. Its data ends only at </e>.",
                "coalesced event",
            ),
            (
                "[agentgate] This is the last step of this turn",
                "last step",
            ),
        ] {
            let note = json!({"kind": "message", "message": {"role": "user", "content": text}});
            let shown = render(&row(4, "message", note), &mut names);
            assert!(
                shown.contains(&format!("<strong class=\"mark\">{mark}</strong>")),
                "an entry recorded before marks were: {shown}"
            );
        }
        // A recorded mark is what the entry is, whatever its wording.
        for (mark, label) in [
            (Mark::Resumed, "resumed after an interruption"),
            (Mark::Coalesced, "coalesced event"),
            (Mark::LastStep, "last step"),
            (Mark::Note, "note"),
        ] {
            let message = crate::agent::message::Message::text(
                crate::agent::message::Role::User,
                "[agentgate] interrupted, last step",
            );
            let entry = crate::session::turn::Entry::marked(message, mark);
            let body = serde_json::to_value(&entry).expect("an entry is JSON");
            let shown = render(&row(4, "message", body), &mut names);
            assert!(
                shown.contains(&format!("<strong class=\"mark\">{label}</strong>")),
                "{shown}"
            );
        }
        let mut rewound = row(
            5,
            "message",
            json!({"kind": "message", "message": {"role": "assistant", "content": "hi"}}),
        );
        rewound.superseded_by = Some("t2".into());
        let shown = render(&rewound, &mut names);
        assert!(
            shown.contains("superseded by turn <code>t2</code>"),
            "{shown}"
        );
        assert!(shown.contains("<div class=\"text\">hi</div>"), "{shown}");
    }

    /// A rewind or fork is offered at an event entry and at an assistant message, not at a tool
    /// result, a note, an approval or an entry a rewind superseded.
    #[test]
    fn rerun_points_are_events_and_answers_not_superseded() {
        let said =
            |role: &str| json!({"kind": "message", "message": {"role": role, "content": "x"}});
        let event = row(1, "event", json!({"kind": "event", "event_id": "e1"}));
        let answer = row(2, "message", said("assistant"));
        let mut superseded = row(3, "message", said("assistant"));
        superseded.superseded_by = Some("t2".into());
        let offered: Vec<bool> = [
            &event,
            &answer,
            &superseded,
            &row(4, "message", said("tool")),
            &row(5, "message", said("user")),
            &row(
                6,
                "approval",
                json!({"kind": "approval", "status": "approved"}),
            ),
            &row(7, "tool_start", json!({"kind": "tool_start", "name": "df"})),
        ]
        .into_iter()
        .map(is_rerun_point)
        .collect();
        assert_eq!(offered, [true, true, false, false, false, false, false]);
    }
}
