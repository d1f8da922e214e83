//! A route whose `deploy` tool waits for an operator's approval, for the tests that decide from
//! the console (tests/console.rs, tests/browser.rs).

use serde_json::json;

use super::stub::{Reply, Stub};

/// A model that asks for `deploy` once, then answers `answer`.
pub fn deploying_model(answer: &'static str) -> Stub {
    Stub::start(move |request, _| {
        let body = request.json();
        let last = body["messages"].as_array().and_then(|m| m.last()).cloned();
        match last {
            Some(message) if message["role"] == "tool" => Reply::answer(answer),
            _ => Reply::tool_call("call-1", "deploy", json!({"target": "prod"})),
        }
    })
}

/// The route `ops` (session from `payload.session`) with the gated `deploy` tool, delivering
/// to `receiver`; `extra` is appended.
pub fn approval_config(model: &Stub, receiver: &Stub, extra: &str) -> String {
    format!(
        r#"[model]
backend = "openai"
base_url = "{model}/v1"
model = "stub-model"
request_timeout = "5s"

[tools.deploy]
description = "Deploy to a target"
command = ["/bin/echo", "deployed"]
parameters = {{ type = "object", properties = {{ target = {{ type = "string" }} }}, required = ["target"] }}
approval = true
sandbox = "none"

[routes.ops]
path = "/hooks/ops"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
tools = ["deploy"]
deliver = {{ kind = "http", url = "{receiver}/results" }}
{extra}"#,
        model = model.url(),
        receiver = receiver.url(),
    )
}
