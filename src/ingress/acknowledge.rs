//! The words of a 2xx answer, chosen for the sender that reads them.
//!
//! Most senders read JSON: `202 {"event_id","session","status":"accepted"}`, `200` duplicate,
//! `200` ignored (docs/reference.md, "HTTP"). Slack is different for the two kinds of request it
//! sends as forms: a slash command and an interaction (`block_actions`, a modal's submission)
//! must be answered `200`, and a slash command's answer is shown to the user who typed it. So
//! those get a `200` worded for Slack: a short ephemeral line for a command, an empty body for an
//! interaction. What is stored and run is the same either way.

use bytes::Bytes;
use http::StatusCode;
use http::header::CONTENT_TYPE;
use http_body_util::Full;
use serde_json::json;

use super::payload::Encoding;
use super::response::{HttpResponse, json_response};
use crate::sender::{self, Answers};
use crate::signature::VerifyScheme;

/// What a 2xx answer says, before it is worded for its sender.
pub(super) enum Acknowledged {
    Accepted { event_id: String, session: String },
    Duplicate { original: String },
    Ignored { event_type: String },
}

/// Marks the answer to an event that was accepted (whatever its status code), for the
/// acceptance latency histogram.
#[derive(Clone, Copy)]
pub(super) struct AcceptedEvent;

/// Who reads the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reader {
    /// Every sender but the two below: JSON, `202` for a new event.
    Json,
    /// A Slack slash command: `200`, and a line the user who typed it sees.
    SlackCommand,
    /// A Slack interaction (a button, a modal): `200` with an empty body.
    SlackInteraction,
}

impl Reader {
    pub(super) fn of(scheme: VerifyScheme, encoding: Encoding) -> Reader {
        match (sender::profile(scheme).answers, encoding) {
            (Answers::Json, _) | (Answers::Slack, Encoding::Json) => Reader::Json,
            (Answers::Slack, Encoding::FormPayload) => Reader::SlackInteraction,
            (Answers::Slack, Encoding::FormFields) => Reader::SlackCommand,
        }
    }

    pub(super) fn answer(self, acknowledged: Acknowledged) -> HttpResponse {
        let accepted = matches!(acknowledged, Acknowledged::Accepted { .. });
        let mut response = match self {
            Reader::Json => json_answer(acknowledged),
            Reader::SlackCommand => json_response(
                StatusCode::OK,
                &json!({"response_type": "ephemeral", "text": slack_line(&acknowledged)}),
            ),
            Reader::SlackInteraction => {
                let mut response = HttpResponse::new(Full::new(Bytes::new()));
                response
                    .headers_mut()
                    .insert(CONTENT_TYPE, http::HeaderValue::from_static("text/plain"));
                response
            }
        };
        if accepted {
            response.extensions_mut().insert(AcceptedEvent);
        }
        response
    }
}

fn json_answer(acknowledged: Acknowledged) -> HttpResponse {
    match acknowledged {
        Acknowledged::Accepted { event_id, session } => json_response(
            StatusCode::ACCEPTED,
            &json!({"event_id": event_id, "session": session, "status": "accepted"}),
        ),
        Acknowledged::Duplicate { original } => json_response(
            StatusCode::OK,
            &json!({"event_id": original, "status": "duplicate"}),
        ),
        Acknowledged::Ignored { event_type } => json_response(
            StatusCode::OK,
            &json!({"status": "ignored", "event_type": event_type}),
        ),
    }
}

/// The line a Slack user sees after typing a slash command.
fn slack_line(acknowledged: &Acknowledged) -> String {
    match acknowledged {
        Acknowledged::Accepted { event_id, .. } => {
            format!("Received: the agent is working on it (event {event_id}).")
        }
        Acknowledged::Duplicate { original } => {
            format!("Already received (event {original}).")
        }
        Acknowledged::Ignored { event_type } => {
            format!("{event_type} is not handled here.")
        }
    }
}
