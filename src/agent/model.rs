//! Model backends behind one interface: an OpenAI-compatible HTTP endpoint, an external command,
//! or a replay of recorded replies (a cassette).
//!
//! Transient failures of the HTTP backend (429, 5xx, connection errors, timeouts) are retried here
//! with exponential backoff and jitter, honouring `Retry-After`, so the turn above sees either a
//! reply or a final error. A reply that cannot be parsed is reported as `Malformed`: the turn
//! records it as a step the model can recover from.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::catalog::OfferedTool;
use super::endpoint::{self, AnsweredBy, Endpoint, Server};
use super::message::{Message, Role};
use super::process::{Aborted, Child, Limits};
use crate::config::{ModelBackend, ModelSettings};
use crate::telemetry::Span;
use crate::usage::Usage;

/// The demo cassette bundled with agentgate, used by `backend = "replay"` without a `cassette`.
const BUNDLED_CASSETTE: &str = include_str!("../../examples/triage.cassette.jsonl");
const BACKOFF_BASE: Duration = Duration::from_millis(500);
const BACKOFF_CAP: Duration = Duration::from_secs(30);
const RETRY_AFTER_CAP: Duration = Duration::from_secs(120);
/// An endpoint's "retrying" lines: at most one every 10 s, as a delivery target's.
static RETRY_LINES: std::sync::LazyLock<crate::logging::RepeatedLines> =
    std::sync::LazyLock::new(|| crate::logging::RepeatedLines::new(Duration::from_secs(10)));
/// The most a model's reply may take, from an endpoint or a command backend: a reply is held in
/// memory and its message stored, so a model that writes without end (a loop, a hostile
/// endpoint) fails its request instead. Bound the tokens too, with `[model] params` `max_tokens`.
const REPLY_CAP: usize = 4 << 20;
/// The most of an error answer read for its log line.
const ERROR_ANSWER_CAP: usize = 64 << 10;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ModelError {
    /// The model could not be reached or refused, after the configured retries.
    #[error("model unavailable: {0}")]
    Unavailable(String),
    /// The model answered, but not with a usable assistant message.
    #[error("model reply unusable: {0}")]
    Malformed(String),
}

impl ModelError {
    /// The error's kind in a word, for a span's `error.type`.
    pub(crate) const fn kind(&self) -> &'static str {
        match self {
            ModelError::Unavailable(_) => "unavailable",
            ModelError::Malformed(_) => "malformed",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ModelSetupError {
    #[error("model.cassette {path}: {message}")]
    Cassette { path: String, message: String },
    #[error("model: cannot build the HTTP client: {0}")]
    Client(String),
    #[error("--record {path}: {source}")]
    Record {
        path: PathBuf,
        source: std::io::Error,
    },
}

enum Backend {
    /// The primary endpoint, then the `fallback` ones.
    OpenAi {
        endpoints: Vec<Endpoint>,
    },
    Command {
        argv: Vec<String>,
    },
    Replay {
        replies: Vec<Message>,
    },
}

/// Whether the model may call the tools a request shows it. The tools are sent either way, so
/// that the request's early bytes (which chat templates render the tools into) stay the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ToolUse {
    /// The server's default (`tool_choice` is not sent).
    Allowed,
    /// `tool_choice: "none"`: the turn's last step, which asks for the answer.
    Forbidden,
}

/// One request to one endpoint, as its `chat` span describes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attempt<'a> {
    /// The model asked for (`command` and `replay` for those backends).
    pub model: &'a str,
    pub server: Option<&'a Server>,
    /// A `fallback` endpoint, asked because those before it failed.
    pub fallback: bool,
}

/// A model's answer: the assistant message, the tokens it cost when the server says, the
/// endpoint that answered (openai backend) and what the server said of its reply.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub message: Message,
    pub usage: Option<Usage>,
    pub answered_by: Option<AnsweredBy>,
    pub response: ResponseFacts,
}

/// What an OpenAI-compatible server says of its reply besides the message, when it says it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ResponseFacts {
    /// The completion's `id`.
    pub id: Option<String>,
    /// Each choice's `finish_reason`.
    pub finish_reasons: Vec<String>,
    pub system_fingerprint: Option<String>,
    pub service_tier: Option<String>,
}

impl Reply {
    /// A reply of a backend that reports neither usage nor an endpoint.
    fn of(message: Message) -> Reply {
        Reply {
            message,
            usage: None,
            answered_by: None,
            response: ResponseFacts::default(),
        }
    }
}

/// A Chat Completions answer as read off the wire.
struct Completion {
    message: Message,
    usage: Option<Usage>,
    /// The model the server names in its reply.
    model: Option<String>,
    response: ResponseFacts,
}

/// A configured model. Cheap to share behind an `Arc`.
pub(crate) struct Model {
    backend: Backend,
    request_timeout: Duration,
    max_retries: u32,
    outage_wait: Duration,
    /// `[model] params`, merged into every chat request.
    params: serde_json::Map<String, serde_json::Value>,
    tool_calls_in_content: bool,
    recorder: Option<Mutex<std::fs::File>>,
    /// `max_concurrent_requests`: a burst of turns queues here, in order, instead of
    /// overloading the model server.
    slots: Arc<tokio::sync::Semaphore>,
}

/// Parses a cassette: one assistant message (JSON) per line; blank lines are skipped.
pub(crate) fn parse_cassette(text: &str) -> Result<Vec<Message>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            let message: Message =
                serde_json::from_str(line).map_err(|err| format!("line {}: {err}", index + 1))?;
            if message.role != Role::Assistant {
                return Err(format!("line {}: not an assistant message", index + 1));
            }
            Ok(message)
        })
        .collect()
}

impl Model {
    /// Builds the backend. `record` (openai only) appends every reply to a cassette file.
    pub(crate) fn new(
        settings: &ModelSettings,
        record: Option<&Path>,
    ) -> Result<Model, ModelSetupError> {
        let backend = match &settings.backend {
            ModelBackend::OpenAi {
                base_url,
                model,
                api_key,
                fallback,
            } => {
                let client = crate::tls::http_client()
                    .map_err(ModelSetupError::Client)?
                    .timeout(settings.request_timeout)
                    .build()
                    .map_err(|err| ModelSetupError::Client(err.to_string()))?;
                let primary =
                    Endpoint::new(client.clone(), base_url, model, api_key.clone(), false);
                let fallbacks = fallback.iter().map(|endpoint| {
                    Endpoint::new(
                        client.clone(),
                        &endpoint.base_url,
                        &endpoint.model,
                        endpoint.api_key.clone(),
                        true,
                    )
                });
                Backend::OpenAi {
                    endpoints: std::iter::once(primary).chain(fallbacks).collect(),
                }
            }
            ModelBackend::Command { argv } => Backend::Command { argv: argv.clone() },
            ModelBackend::Replay { cassette } => {
                let (text, name) = match cassette {
                    Some(path) => (
                        std::fs::read_to_string(path).map_err(|err| ModelSetupError::Cassette {
                            path: path.display().to_string(),
                            message: err.to_string(),
                        })?,
                        path.display().to_string(),
                    ),
                    None => (BUNDLED_CASSETTE.to_string(), "<bundled>".to_string()),
                };
                let replies =
                    parse_cassette(&text).map_err(|message| ModelSetupError::Cassette {
                        path: name,
                        message,
                    })?;
                Backend::Replay { replies }
            }
        };
        let recorder = match record {
            None => None,
            Some(path) => Some(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| ModelSetupError::Record {
                        path: path.to_path_buf(),
                        source,
                    })?,
            )),
        };
        Ok(Model {
            backend,
            request_timeout: settings.request_timeout,
            max_retries: settings.max_retries,
            outage_wait: settings.outage_wait,
            params: settings.params.clone(),
            tool_calls_in_content: settings.tool_calls_in_content,
            recorder,
            slots: Arc::new(tokio::sync::Semaphore::new(
                settings
                    .max_concurrent_requests
                    .min(tokio::sync::Semaphore::MAX_PERMITS),
            )),
        })
    }

    /// Waits for a request slot (tokio's semaphore is fair: first come, first served). The
    /// caller holds it for one `complete`.
    pub(crate) async fn slot(&self) -> tokio::sync::OwnedSemaphorePermit {
        loop {
            // The semaphore is never closed; should that change, waiting again is harmless.
            if let Ok(permit) = self.slots.clone().acquire_owned().await {
                return permit;
            }
        }
    }

    /// `model.outage_wait`: how long a turn waits for the model when it is unavailable after
    /// its retries, before the turn fails.
    pub(crate) fn outage_wait(&self) -> Duration {
        self.outage_wait
    }

    /// Whether this is a replay (its replies are labelled as such wherever they are shown).
    pub(crate) fn is_replay(&self) -> bool {
        matches!(self.backend, Backend::Replay { .. })
    }

    /// Asks the model for the next assistant message. Each request to an endpoint is traced in
    /// the span `trace` starts for it (a failed one is marked so and ended); the span of the
    /// request that gave the result comes back with it, for the reply's attributes.
    pub(crate) async fn complete(
        &self,
        messages: &[Message],
        tools: &[OfferedTool],
        tool_use: ToolUse,
        trace: &(dyn Fn(&Attempt<'_>) -> Span + Sync),
    ) -> (Result<Reply, ModelError>, Span) {
        let (reply, span) = match &self.backend {
            Backend::OpenAi { endpoints } => {
                self.complete_openai(endpoints, messages, tools, tool_use, trace)
                    .await
            }
            Backend::Command { argv } => {
                let span = trace(&Attempt {
                    model: "command",
                    server: None,
                    fallback: false,
                });
                let reply = self.complete_command(argv, messages, tools, tool_use).await;
                (reply.map(Reply::of), span)
            }
            Backend::Replay { replies } => {
                let span = trace(&Attempt {
                    model: "replay",
                    server: None,
                    fallback: false,
                });
                (Ok(Reply::of(replay(replies, messages))), span)
            }
        };
        (reply.map(|reply| self.finish_reply(reply, tools)), span)
    }

    /// Records `reply` (`--record`) and reads a tool call written as its text, when
    /// `tool_calls_in_content` says so.
    fn finish_reply(&self, mut reply: Reply, tools: &[OfferedTool]) -> Reply {
        if let Some(recorder) = &self.recorder
            && let Ok(mut file) = recorder.lock()
            && let Ok(line) = serde_json::to_string(&reply.message)
        {
            // Recording is best effort: a failed write must not fail the turn.
            let _ = writeln!(file, "{line}");
        }
        if self.tool_calls_in_content {
            let offered: Vec<&str> = tools.iter().map(|tool| tool.name.as_str()).collect();
            reply.message = super::textcall::call_in_content(reply.message, &offered);
        }
        reply
    }

    /// Asks the endpoints in order (`endpoint::in_order`), each with its retries, until one
    /// answers; a reply that cannot be used is not asked again elsewhere.
    async fn complete_openai(
        &self,
        endpoints: &[Endpoint],
        messages: &[Message],
        tools: &[OfferedTool],
        tool_use: ToolUse,
        trace: &(dyn Fn(&Attempt<'_>) -> Span + Sync),
    ) -> (Result<Reply, ModelError>, Span) {
        let mut failures = Vec::new();
        let mut last = Span::off();
        for endpoint in endpoint::in_order(endpoints) {
            let span = trace(&Attempt {
                model: &endpoint.model,
                server: endpoint.server.as_ref(),
                fallback: endpoint.fallback,
            });
            let body = request_body(&endpoint.model, &self.params, messages, tools, tool_use);
            match self.complete_http(endpoint, &body).await {
                Ok(completion) => {
                    endpoint.answered();
                    if endpoint.fallback {
                        tracing::warn!(endpoint = %endpoint.shown, model = %endpoint.model,
                            "a fallback model endpoint answered");
                    }
                    let reply = Reply {
                        message: completion.message,
                        usage: completion.usage,
                        answered_by: Some(endpoint.answered_by(completion.model)),
                        response: completion.response,
                    };
                    return (Ok(reply), span);
                }
                Err(err @ ModelError::Malformed(_)) => return (Err(err), span),
                Err(err @ ModelError::Unavailable(_)) => {
                    if endpoints.len() > 1 {
                        endpoint.failed();
                    }
                    span.fail(err.kind(), &err.to_string());
                    if let ModelError::Unavailable(reason) = err {
                        failures.push(reason);
                    }
                    last = span;
                }
            }
        }
        let failed = ModelError::Unavailable(failures.join("; then "));
        (Err(failed), last)
    }

    async fn complete_http(
        &self,
        endpoint: &Endpoint,
        body: &serde_json::Value,
    ) -> Result<Completion, ModelError> {
        // Errors name the endpoint as `shown` (scheme and host): its URL may hold a secret.
        let (url, shown) = (&endpoint.url, &endpoint.shown);
        let mut attempt = 0;
        loop {
            let mut request = endpoint.client.post(url).json(body);
            if let Some(key) = &endpoint.api_key {
                request = request.bearer_auth(String::from_utf8_lossy(key.expose()));
            }
            let failure = match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(|s| Duration::from_secs(s).min(RETRY_AFTER_CAP));
                    if status.is_success() {
                        let bytes = match read_capped(response, REPLY_CAP).await {
                            Ok(Capped::Whole(bytes)) => bytes,
                            Ok(Capped::Over) => {
                                return Err(ModelError::Malformed(format!(
                                    "{shown} sent a reply of more than {REPLY_CAP} bytes"
                                )));
                            }
                            Err(err) => {
                                return Err(ModelError::Unavailable(format!(
                                    "{shown}: reading the reply: {}",
                                    crate::tls::request_failure(&err, "the reply stalled")
                                )));
                            }
                        };
                        return parse_completion(&bytes);
                    }
                    let retryable = status.as_u16() == 429 || status.is_server_error();
                    let text = match read_capped(response, ERROR_ANSWER_CAP).await {
                        Ok(Capped::Whole(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
                        Ok(Capped::Over) | Err(_) => String::new(),
                    };
                    let summary = format!(
                        "{shown} {}: {}",
                        crate::tls::answered(status),
                        one_line(&text, 200)
                    );
                    if !retryable {
                        return Err(ModelError::Unavailable(summary));
                    }
                    (summary, retry_after)
                }
                Err(err) => (
                    format!(
                        "{shown}: {}",
                        crate::tls::request_failure(&err, "no answer within model.request_timeout")
                    ),
                    None,
                ),
            };
            if attempt >= self.max_retries {
                return Err(ModelError::Unavailable(format!(
                    "{} (after {} retries)",
                    failure.0, self.max_retries
                )));
            }
            let delay = failure.1.unwrap_or_else(|| backoff(attempt));
            if let Some(left_out) = RETRY_LINES.due(url) {
                tracing::warn!(attempt = attempt + 1, delay_ms = delay.as_millis() as u64, error = %failure.0, left_out, "model request failed; retrying");
            }
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    async fn complete_command(
        &self,
        argv: &[String],
        messages: &[Message],
        tools: &[OfferedTool],
        tool_use: ToolUse,
    ) -> Result<Message, ModelError> {
        let Some(child) = Child::new(argv) else {
            return Err(ModelError::Unavailable("model.command is empty".into()));
        };
        let program = child.program().to_string();
        let mut input = json!({"messages": messages, "tools": tool_definitions(tools)});
        if tool_use == ToolUse::Forbidden {
            input["tool_choice"] = json!("none");
        }
        let input = input.to_string();
        let limits = Limits {
            timeout: self.request_timeout,
            output_cap: REPLY_CAP,
        };
        let output = match child
            .run(input.into_bytes(), limits, &CancellationToken::new())
            .await
        {
            Ok(finished) => finished,
            Err(Aborted::NotStarted(message)) => return Err(ModelError::Unavailable(message)),
            Err(Aborted::Cancelled) => {
                return Err(ModelError::Unavailable(format!("{program} was stopped")));
            }
        };
        if output.timed_out {
            return Err(ModelError::Unavailable(format!(
                "{program} did not answer within model.request_timeout"
            )));
        }
        let status = output
            .status
            .map_err(|err| ModelError::Unavailable(format!("{program}: {err}")))?;
        if !status.success() {
            return Err(ModelError::Unavailable(format!(
                "{program} exited with {status}: {}",
                one_line(&String::from_utf8_lossy(&output.stderr.bytes), 200)
            )));
        }
        if output.stdout.truncated {
            return Err(ModelError::Malformed(format!(
                "{program} printed more than {REPLY_CAP} bytes"
            )));
        }
        let mut message: Message = serde_json::from_slice(&output.stdout.bytes).map_err(|err| {
            ModelError::Malformed(format!("{program} printed no assistant message: {err}"))
        })?;
        message.role = Role::Assistant;
        Ok(message)
    }
}

fn one_line(text: &str, limit: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    flat.chars().take(limit).collect()
}

/// Exponential backoff with ±50% jitter.
fn backoff(attempt: u32) -> Duration {
    crate::clock::backoff(BACKOFF_BASE, BACKOFF_CAP, attempt, 1.0)
}

fn tool_definitions(tools: &[OfferedTool]) -> Vec<serde_json::Value> {
    tools
        .iter()
        .map(|tool| {
            json!({
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                }
            })
        })
        .collect()
}

/// A Chat Completions request: `params` (`[model] params`, checked to hold none of the keys set
/// here), then the model, the messages and the tools, and `tool_choice: "none"` when no call
/// may be made. The tools are the same on every step of a turn, the last included: chat
/// templates render them right after the system text, so leaving them out would change the
/// prompt's early bytes and cost the server's prompt cache.
fn request_body(
    model: &str,
    params: &serde_json::Map<String, serde_json::Value>,
    messages: &[Message],
    tools: &[OfferedTool],
    tool_use: ToolUse,
) -> serde_json::Value {
    let mut body = serde_json::Value::Object(params.clone());
    body["model"] = json!(model);
    body["messages"] = json!(messages);
    if !tools.is_empty() {
        body["tools"] = serde_json::Value::Array(tool_definitions(tools));
        if tool_use == ToolUse::Forbidden {
            body["tool_choice"] = json!("none");
        }
    }
    body
}

/// Reads `choices[0].message` of a Chat Completions response, its `usage` and its `model`.
fn parse_completion(bytes: &[u8]) -> Result<Completion, ModelError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|err| ModelError::Malformed(format!("not JSON: {err}")))?;
    let message = value
        .pointer("/choices/0/message")
        .cloned()
        .ok_or_else(|| ModelError::Malformed("no choices[0].message in the reply".into()))?;
    let mut message: Message = serde_json::from_value(message)
        .map_err(|err| ModelError::Malformed(format!("choices[0].message: {err}")))?;
    message.role = Role::Assistant;
    let text = |key: &str| value[key].as_str().map(str::to_string);
    let finish_reasons = value["choices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|choice| choice["finish_reason"].as_str().map(str::to_string))
        .collect();
    Ok(Completion {
        message,
        usage: Usage::of_reply(&value),
        model: text("model"),
        response: ResponseFacts {
            id: text("id"),
            finish_reasons,
            system_fingerprint: text("system_fingerprint"),
            service_tier: text("service_tier"),
        },
    })
}

/// The cassette reply for this point of the turn: the n-th reply, where n counts the assistant
/// messages since the last user message.
fn replay(replies: &[Message], messages: &[Message]) -> Message {
    let position = messages
        .iter()
        .rev()
        .take_while(|m| m.role != Role::User)
        .filter(|m| m.role == Role::Assistant)
        .count();
    replies.get(position).cloned().unwrap_or_else(|| {
        Message::text(
            Role::Assistant,
            "[replay] The recorded conversation ends here; no further replies are on the cassette.",
        )
    })
}

/// A response body read up to a cap.
enum Capped {
    Whole(Vec<u8>),
    /// It was longer; the rest was not read.
    Over,
}

/// Reads `response`'s body, stopping (and dropping the connection) once it passes `cap`.
async fn read_capped(mut response: reqwest::Response, cap: usize) -> reqwest::Result<Capped> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > cap {
            return Ok(Capped::Over);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Capped::Whole(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_cassette_parses() {
        let replies = parse_cassette(BUNDLED_CASSETTE).expect("bundled cassette");
        assert!(replies.iter().any(|m| !m.tool_calls.is_empty()));
        assert!(
            replies
                .last()
                .and_then(|m| m.visible_text())
                .is_some_and(|t| t.starts_with("[replay]"))
        );
    }

    #[test]
    fn cassette_errors_name_the_line() {
        let err = parse_cassette("{\"role\":\"assistant\",\"content\":\"a\"}\n\nnot json\n")
            .expect_err("bad line");
        assert!(err.starts_with("line 3:"), "{err}");
    }

    #[test]
    fn completion_parsing() {
        let ok = parse_completion(
            br#"{"model":"m-1","choices":[{"message":{"role":"assistant","content":"hi"}}]}"#,
        )
        .expect("valid");
        assert_eq!(ok.message.visible_text(), Some("hi"));
        assert_eq!((ok.usage, ok.model.as_deref()), (None, Some("m-1")));
        assert_eq!(ok.response, ResponseFacts::default());
        let full = parse_completion(
            br#"{"id":"chatcmpl-7","model":"m","system_fingerprint":"b1","service_tier":"default",
                "choices":[{"finish_reason":"tool_calls","message":{"role":"assistant","content":null}}]}"#,
        )
        .expect("valid");
        assert_eq!(
            full.response,
            ResponseFacts {
                id: Some("chatcmpl-7".into()),
                finish_reasons: vec!["tool_calls".into()],
                system_fingerprint: Some("b1".into()),
                service_tier: Some("default".into()),
            }
        );
        assert!(matches!(
            parse_completion(b"<html>"),
            Err(ModelError::Malformed(_))
        ));
        assert!(matches!(
            parse_completion(b"{\"choices\":[]}"),
            Err(ModelError::Malformed(_))
        ));
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        assert!(backoff(0) <= Duration::from_millis(750));
        assert!(backoff(20) <= BACKOFF_CAP.mul_f64(1.5));
    }
}
