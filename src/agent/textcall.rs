//! Tool calls written as text (`[model] tool_calls_in_content = true`).
//!
//! Small local models (Qwen2.5-Coder 0.5B under llama.cpp, for one) often answer a tool call with
//! the call's JSON in `content` instead of in `tool_calls`, and the server passes it on as text:
//! the turn would end with the JSON as its answer. With the setting on, a reply whose whole
//! content is one call of an offered tool, `{"name": …, "arguments": {…}}`, bare or in a
//! ```` ```json ```` fence, becomes that call. Anything else stays text: more than one object,
//! other keys, a tool the route does not offer, prose around the JSON.

use serde_json::Value;

use super::message::{FunctionCall, Message, ToolCall};

/// `reply` with the call its content spells, when it spells exactly one call of a tool in
/// `offered`; otherwise `reply` as it is.
pub(crate) fn call_in_content(reply: Message, offered: &[&str]) -> Message {
    if !reply.tool_calls.is_empty() {
        return reply;
    }
    let Some(call) = reply
        .content
        .as_deref()
        .and_then(|content| spelled_call(content, offered))
    else {
        return reply;
    };
    Message {
        content: None,
        tool_calls: vec![call],
        ..reply
    }
}

/// Whether `content` is nothing but a tool call written as text: one call-shaped object
/// (`{"name": …, "arguments": …}`), or a list of them, bare or in a fence, of any tool, offered
/// or not. A reply like that is no answer, whatever `tool_calls_in_content` says.
pub(crate) fn is_written_call(content: &str) -> bool {
    match serde_json::from_str::<Value>(unfenced(content.trim())) {
        Ok(Value::Array(items)) => {
            !items.is_empty() && items.iter().all(|item| call_shaped(item).is_some())
        }
        Ok(value) => call_shaped(&value).is_some(),
        Err(_) => false,
    }
}

/// The tool name of a call-shaped object: a string `name`, and no key but `name` and
/// `arguments`.
fn call_shaped(value: &Value) -> Option<&str> {
    let Value::Object(object) = value else {
        return None;
    };
    if object.keys().any(|key| key != "name" && key != "arguments") {
        return None;
    }
    object.get("name")?.as_str()
}

fn spelled_call(content: &str, offered: &[&str]) -> Option<ToolCall> {
    let value = serde_json::from_str::<Value>(unfenced(content.trim())).ok()?;
    let name = call_shaped(&value)?;
    let object = value.as_object()?;
    if !offered.contains(&name) {
        return None;
    }
    let arguments = match object.get("arguments") {
        None => "{}".to_string(),
        Some(Value::String(text)) => text.clone(),
        Some(value @ Value::Object(_)) => value.to_string(),
        Some(_) => return None,
    };
    let id = uuid::Uuid::new_v4().simple().to_string();
    Some(ToolCall {
        id: format!("call_in_content_{}", &id[..12]),
        kind: "function".to_string(),
        function: FunctionCall {
            name: name.to_string(),
            arguments,
        },
    })
}

/// The text inside one ``` fence (with or without a `json` tag) that is all of `text`, else
/// `text`.
fn unfenced(text: &str) -> &str {
    let Some(inner) = text.strip_prefix("```").and_then(|t| t.strip_suffix("```")) else {
        return text;
    };
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    inner.trim()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::message::Role;

    fn reply(content: &str) -> Message {
        Message::text(Role::Assistant, content)
    }

    #[test]
    fn a_whole_content_call_of_an_offered_tool_becomes_that_call() {
        for content in [
            r#"{"name": "disk_usage", "arguments": {"path": "/"}}"#,
            "```json\n{\"name\": \"disk_usage\", \"arguments\": {\"path\": \"/\"}}\n```",
            "```\n{\"name\": \"disk_usage\", \"arguments\": \"{\\\"path\\\": \\\"/\\\"}\"}\n```",
        ] {
            let converted = call_in_content(reply(content), &["disk_usage"]);
            assert_eq!(converted.content, None, "{content}");
            assert_eq!(converted.tool_calls.len(), 1);
            let call = &converted.tool_calls[0].function;
            assert_eq!(call.name, "disk_usage");
            let arguments: Value = serde_json::from_str(&call.arguments).expect("JSON");
            assert_eq!(arguments, serde_json::json!({"path": "/"}));
        }
    }

    #[test]
    fn a_written_call_of_any_tool_is_no_answer() {
        for content in [
            r#"{"name": "rm_rf", "arguments": {}}"#,
            "```json\n{\"name\": \"disk_usage\", \"arguments\": {\"path\": \"/\"}}\n```",
            r#"[{"name": "a"}, {"name": "b", "arguments": {}}]"#,
        ] {
            assert!(is_written_call(content), "{content}");
        }
        for content in [
            "The disk is 93% full.",
            r#"I will call {"name": "disk_usage", "arguments": {}} now"#,
            r#"{"name": "disk_usage", "arguments": {}, "note": "x"}"#,
            r#"{"disk": "93%"}"#,
            "[]",
        ] {
            assert!(!is_written_call(content), "{content}");
        }
    }

    #[test]
    fn anything_else_stays_text() {
        for content in [
            "The disk is 93% full.",
            r#"I will call {"name": "disk_usage", "arguments": {}} now"#,
            r#"{"name": "rm_rf", "arguments": {}}"#,
            r#"{"name": "disk_usage", "arguments": {}, "note": "x"}"#,
            r#"[{"name": "disk_usage", "arguments": {}}]"#,
            r#"{"name": "disk_usage", "arguments": 5}"#,
        ] {
            let kept = call_in_content(reply(content), &["disk_usage"]);
            assert_eq!(kept.content.as_deref(), Some(content));
            assert!(kept.tool_calls.is_empty(), "{content}");
        }
    }
}
