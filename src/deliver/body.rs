//! The body of an outbound delivery (docs/reference.md, "Outbound deliveries"): the wire format
//! receivers parse, owned here with the rest of what deliveries send.
//!
//! The store calls [`render`] inside the transaction that ends a turn (it is handed the function,
//! so the store does not import this module), including the ends it decides itself at admission
//! (`abandoned`, `suspended`). The rendered body is kept in the outbox row and sent byte for
//! byte, so every attempt of a delivery, before and after restarts, carries the same body and
//! the same signature input.

use serde::Serialize;

use crate::store::{RenderDelivery, RewindOf, Terminal, TurnEnd};
use crate::usage::{Price, UsageReport};

/// What the store renders delivery bodies with, showing cost at `price`.
pub(crate) fn renderer(price: Option<Price>) -> RenderDelivery {
    RenderDelivery { render, price }
}

/// The body of the outbound delivery of `end`, whose event's turns spent `usage`.
fn render(end: &TurnEnd, usage: &UsageReport) -> serde_json::Result<String> {
    // A rewind reruns its own session; a fork, another one.
    let (rewind_of, fork_of) = match &end.rewind_of {
        Some(of) if of.session == end.session_key => (Some(of), None),
        Some(of) => (None, Some(of)),
        None => (None, None),
    };
    serde_json::to_string(&DeliveryBody {
        event_id: &end.event_id,
        route: &end.route,
        session: &end.session_key,
        status: end.terminal,
        output: end.output.as_deref(),
        error: end.error.as_deref(),
        turn_id: &end.turn_id,
        steps: end.steps,
        usage: DeliveryUsage {
            input_tokens: usage.input_tokens,
            cached_input_tokens: usage.cached_input_tokens,
            output_tokens: usage.output_tokens,
            cost_usd: usage.cost_usd,
        },
        rewind_of,
        fork_of,
    })
}

#[derive(Debug, Serialize)]
struct DeliveryBody<'a> {
    event_id: &'a str,
    route: &'a str,
    session: &'a str,
    status: Terminal,
    output: Option<&'a str>,
    error: Option<&'a str>,
    turn_id: &'a str,
    steps: u32,
    usage: DeliveryUsage,
    /// The session and entry a `sessions rewind` reran (only then).
    #[serde(skip_serializing_if = "Option::is_none")]
    rewind_of: Option<&'a RewindOf>,
    /// The session and entry a `sessions fork` copied from (only then).
    #[serde(skip_serializing_if = "Option::is_none")]
    fork_of: Option<&'a RewindOf>,
}

/// The `usage` of a delivery: exactly the documented keys (a count of replies without usage is
/// not part of the wire format; it is in `events show`).
#[derive(Debug, Serialize)]
struct DeliveryUsage {
    input_tokens: u64,
    cached_input_tokens: u64,
    output_tokens: u64,
    cost_usd: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TurnStatus;

    /// The keys and values receivers parse (docs/reference.md, "Outbound deliveries").
    #[test]
    fn the_body_has_exactly_the_documented_fields() {
        let end = TurnEnd {
            turn_id: "t-1".into(),
            event_id: "e-1".into(),
            session_key: "github:octo/repo#7".into(),
            route: "github".into(),
            turn_status: TurnStatus::Completed,
            terminal: Terminal::Completed,
            reason: None,
            output: Some("the answer".into()),
            error: None,
            steps: 3,
            rewind_of: None,
        };
        let usage = UsageReport {
            input_tokens: 1200,
            cached_input_tokens: 1000,
            output_tokens: 80,
            cost_usd: Some(0.5),
            unknown_steps: 1,
        };
        let body: serde_json::Value =
            serde_json::from_str(&render(&end, &usage).expect("renders")).expect("JSON");
        assert_eq!(
            body,
            serde_json::json!({
                "event_id": "e-1",
                "route": "github",
                "session": "github:octo/repo#7",
                "status": "completed",
                "output": "the answer",
                "error": null,
                "turn_id": "t-1",
                "steps": 3,
                "usage": {"input_tokens": 1200, "cached_input_tokens": 1000,
                    "output_tokens": 80, "cost_usd": 0.5},
            })
        );
    }

    /// A rerun's result says what it reran: `rewind_of` in its own session, `fork_of` in a new
    /// one.
    #[test]
    fn a_rerun_says_what_it_reran() {
        let of = RewindOf {
            session: "s".into(),
            entry: 4,
        };
        let end = |session: &str| TurnEnd {
            turn_id: "t-1".into(),
            event_id: "e-1".into(),
            session_key: session.into(),
            route: "r".into(),
            turn_status: TurnStatus::Completed,
            terminal: Terminal::Completed,
            reason: None,
            output: None,
            error: None,
            steps: 1,
            rewind_of: Some(of.clone()),
        };
        let usage = UsageReport::of(crate::usage::Spent::default(), None);
        let body = |session| -> serde_json::Value {
            serde_json::from_str(&render(&end(session), &usage).expect("renders")).expect("JSON")
        };
        let rewound = body("s");
        assert_eq!(
            rewound["rewind_of"],
            serde_json::json!({"session": "s", "entry": 4})
        );
        assert!(rewound.get("fork_of").is_none());
        let forked = body("t");
        assert_eq!(
            forked["fork_of"],
            serde_json::json!({"session": "s", "entry": 4})
        );
        assert!(forked.get("rewind_of").is_none());
    }
}
