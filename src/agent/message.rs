//! Chat messages in the OpenAI Chat Completions shape, which every backend speaks and the
//! transcript stores.

use serde::{Deserialize, Deserializer, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Role {
    System,
    User,
    Assistant,
    Tool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Message {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_empty"
    )]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FunctionCall {
    pub name: String,
    /// JSON text, as the API carries it. Some servers send an object; it is kept as its JSON text.
    #[serde(deserialize_with = "arguments_as_text", default)]
    pub arguments: String,
}

fn function_type() -> String {
    "function".to_string()
}

fn null_as_empty<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<ToolCall>, D::Error> {
    Ok(Option::<Vec<ToolCall>>::deserialize(deserializer)?.unwrap_or_default())
}

fn arguments_as_text<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    Ok(match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(text) => text,
        serde_json::Value::Null => String::new(),
        other @ (serde_json::Value::Bool(_)
        | serde_json::Value::Number(_)
        | serde_json::Value::Array(_)
        | serde_json::Value::Object(_)) => other.to_string(),
    })
}

impl Message {
    pub(crate) fn text(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: Some(content.into()),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// An assistant message that asks for one call of `name`.
    #[cfg(test)]
    pub(crate) fn asking_for(id: &str, name: &str, arguments: &str) -> Message {
        Message {
            role: Role::Assistant,
            content: None,
            tool_calls: vec![ToolCall {
                id: id.into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.into(),
                    arguments: arguments.into(),
                },
            }],
            tool_call_id: None,
        }
    }

    pub(crate) fn tool_result(call_id: &str, content: impl Into<String>) -> Message {
        Message {
            role: Role::Tool,
            content: Some(content.into()),
            tool_calls: Vec::new(),
            tool_call_id: Some(call_id.to_string()),
        }
    }

    /// The text content, trimmed; `None` when absent or blank.
    pub(crate) fn visible_text(&self) -> Option<&str> {
        self.content
            .as_deref()
            .map(str::trim)
            .filter(|text| !text.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_may_be_text_or_an_object() {
        let text: Message = serde_json::from_str(
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"df","arguments":"{\"path\":\"/\"}"}}]}"#,
        )
        .expect("text arguments");
        let object: Message = serde_json::from_str(
            r#"{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"df","arguments":{"path":"/"}}}]}"#,
        )
        .expect("object arguments");
        assert_eq!(text.tool_calls[0].function.arguments, r#"{"path":"/"}"#);
        assert_eq!(object.tool_calls[0].function.arguments, r#"{"path":"/"}"#);
        let null_calls: Message =
            serde_json::from_str(r#"{"role":"assistant","content":"hi","tool_calls":null}"#)
                .expect("null tool_calls");
        assert!(null_calls.tool_calls.is_empty());
    }
}
