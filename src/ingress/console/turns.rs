//! An event's turns as the event page shows them: each model request with the model that
//! answered, its tokens, cost and time, the turn's totals, and a waterfall of the turn (model
//! requests, tool calls, approval waits and the delivery on one time axis), read from the
//! transcript entries and the turn and outbox rows the store keeps. The bars are inline SVG
//! shapes sized by attributes, so the page needs no script and no inline style.

use std::collections::HashMap;

use serde::Serialize;
use serde_json::Value;

use super::entry;
use crate::store::{DeliveryRow, TranscriptRow, TurnRow};
use crate::usage::{Price, Usage, UsageReport};

/// The width of a timeline's axis, in the SVG's own units.
const AXIS: i64 = 1000;
/// The narrowest bar, so that every bar shows, however short.
const MIN_WIDTH: i64 = 2;

/// One turn of the event page.
#[derive(Serialize)]
pub(super) struct TurnView {
    id: String,
    status: String,
    reason: Option<String>,
    error: Option<String>,
    started_at: i64,
    /// From its start to its end (or its last recorded entry), in milliseconds.
    took_ms: i64,
    usage: UsageReport,
    steps: Vec<StepView>,
    /// The time of its steps, summed.
    steps_took_ms: u64,
    timeline: Vec<Bar>,
    /// The timeline's axis, in milliseconds from the turn's start.
    axis_ms: i64,
}

/// One model request of a turn.
#[derive(Serialize)]
struct StepView {
    n: i64,
    model: Option<String>,
    requested_model: Option<String>,
    endpoint: Option<String>,
    fallback: bool,
    /// `None`: the server reported no usage (or the step was recorded before steps were).
    usage: Option<Usage>,
    estimated_tokens: u64,
    cost_usd: Option<String>,
    took_ms: Option<u64>,
}

/// What a bar of the timeline stands for.
#[derive(Serialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum BarKind {
    Model,
    Tool,
    Approval,
    Delivery,
}

/// One bar: what ran, from when (milliseconds after the turn's start) for how long, and where
/// it lies on the axis.
#[derive(Serialize)]
struct Bar {
    kind: BarKind,
    label: String,
    start_ms: i64,
    took_ms: i64,
    x: i64,
    width: i64,
}

/// A span of wall-clock time (Unix milliseconds) of one turn.
struct Span {
    turn_id: String,
    kind: BarKind,
    label: String,
    from: i64,
    to: i64,
}

/// The turns of an event with their steps and timelines, from `entries` (the event's, oldest
/// first), its `delivery`, and the price in effect.
pub(super) fn views(
    turns: &[TurnRow],
    entries: &[TranscriptRow],
    delivery: Option<&DeliveryRow>,
    price: Option<&Price>,
) -> Vec<TurnView> {
    let mut spans = spans(entries);
    if let (Some(delivery), Some(last)) = (delivery, turns.last()) {
        let from = last.finished_at.unwrap_or(delivery.updated_at);
        spans.push(Span {
            turn_id: last.id.clone(),
            kind: BarKind::Delivery,
            label: format!("delivery ({})", delivery.status.sql()),
            from,
            to: delivery.updated_at.max(from),
        });
    }
    turns
        .iter()
        .map(|turn| {
            let steps: Vec<StepView> = entries
                .iter()
                .filter(|row| row.turn_id == turn.id)
                .filter_map(|row| step_view(row, price))
                .collect();
            let mine: Vec<&Span> = spans.iter().filter(|s| s.turn_id == turn.id).collect();
            let last_entry = entries
                .iter()
                .filter(|row| row.turn_id == turn.id)
                .map(|row| row.created_at)
                .max();
            let end = turn.finished_at.or(last_entry).unwrap_or(turn.started_at);
            let (timeline, axis_ms) = timeline(turn.started_at, end, &mine);
            TurnView {
                id: turn.id.clone(),
                status: turn.status.sql().to_string(),
                reason: turn.reason.clone(),
                error: turn.error.clone(),
                started_at: turn.started_at,
                took_ms: end - turn.started_at,
                usage: turn.usage,
                steps_took_ms: steps.iter().filter_map(|step| step.took_ms).sum(),
                steps,
                timeline,
                axis_ms,
            }
        })
        .collect()
}

fn step_view(row: &TranscriptRow, price: Option<&Price>) -> Option<StepView> {
    let message = row.body.get("message")?;
    if message["role"] != "assistant" {
        return None;
    }
    let answered = entry::answered_by(&row.body);
    let step = entry::step_facts(&row.body);
    let usage = step.and_then(|step| step.usage);
    Some(StepView {
        n: row.n,
        fallback: answered.as_ref().is_some_and(|by| by.fallback),
        requested_model: answered.as_ref().and_then(|by| by.requested_model.clone()),
        endpoint: answered.as_ref().map(|by| by.endpoint.clone()),
        model: answered.map(|by| by.model),
        cost_usd: usage
            .zip(price)
            .map(|(usage, price)| format!("{:.6}", usage.cost(price))),
        usage,
        estimated_tokens: step.map_or(0, |step| step.estimated_tokens),
        took_ms: step.map(|step| step.took_ms),
    })
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_string()
}

/// The spans the entries record: each model request (as its step recorded it, else from the
/// entry before), each tool call from its start (else the entry before) to its result, and each
/// approval wait from its request to its decision (or the last entry, while it waits).
fn spans(entries: &[TranscriptRow]) -> Vec<Span> {
    let mut spans = Vec::new();
    let mut previous: HashMap<&str, i64> = HashMap::new();
    // Tool calls by call id: their tool's name, and when their start was recorded.
    let mut calls: HashMap<String, (String, Option<i64>)> = HashMap::new();
    let mut waits: HashMap<String, (String, String, i64)> = HashMap::new();
    for row in entries {
        let turn = row.turn_id.as_str();
        let before = previous.get(turn).copied().unwrap_or(row.created_at);
        let span = |kind, label: String, from: i64| Span {
            turn_id: row.turn_id.clone(),
            kind,
            label,
            from,
            to: row.created_at.max(from),
        };
        let body = &row.body;
        match row.kind.as_str() {
            "tool_start" => {
                let name = text(&body["name"]);
                calls.insert(text(&body["call_id"]), (name, Some(row.created_at)));
            }
            "approval" if body["status"] == "pending" => {
                let wait = (row.turn_id.clone(), text(&body["tool"]), row.created_at);
                waits.insert(text(&body["approval_id"]), wait);
            }
            "approval" => {
                if let Some((turn_id, tool, from)) = waits.remove(&text(&body["approval_id"])) {
                    let status = text(&body["status"]);
                    let mut wait = span(
                        BarKind::Approval,
                        format!("approval of {tool}: {status}"),
                        from,
                    );
                    wait.turn_id = turn_id;
                    spans.push(wait);
                }
            }
            _ => {}
        }
        if let Some(message) = body.get("message") {
            match message["role"].as_str() {
                Some("assistant") => {
                    let step = entry::step_facts(body);
                    let model = body["answered_by"]["model"].as_str().unwrap_or("model");
                    let mut request = span(BarKind::Model, model.to_string(), before);
                    if let Some(step) = step {
                        request.from = step.asked_at;
                        request.to = step.asked_at + i64::try_from(step.took_ms).unwrap_or(0);
                    }
                    spans.push(request);
                    for call in message["tool_calls"].as_array().into_iter().flatten() {
                        let name = text(&call["function"]["name"]);
                        calls.insert(text(&call["id"]), (name, None));
                    }
                }
                Some("tool") => {
                    let (name, started) = calls
                        .remove(&text(&message["tool_call_id"]))
                        .unwrap_or_default();
                    spans.push(span(BarKind::Tool, name, started.unwrap_or(before)));
                }
                _ => {}
            }
        }
        previous.insert(turn, row.created_at);
    }
    let last = entries.last().map_or(0, |row| row.created_at);
    for (turn_id, tool, from) in waits.into_values() {
        spans.push(Span {
            turn_id,
            kind: BarKind::Approval,
            label: format!("approval of {tool}: waiting"),
            from,
            to: last.max(from),
        });
    }
    spans
}

/// The bars of `spans` in the order they started, on an axis from `start` to the last end.
fn timeline(start: i64, end: i64, spans: &[&Span]) -> (Vec<Bar>, i64) {
    let end = spans.iter().map(|span| span.to).fold(end, i64::max);
    let axis_ms = (end - start).max(1);
    let mut bars: Vec<Bar> = spans
        .iter()
        .map(|span| {
            let start_ms = (span.from - start).max(0);
            let took_ms = span.to - span.from;
            let x = (start_ms * AXIS / axis_ms).min(AXIS - MIN_WIDTH);
            Bar {
                kind: span.kind,
                label: span.label.clone(),
                start_ms,
                took_ms,
                x,
                width: (took_ms * AXIS / axis_ms).clamp(MIN_WIDTH, AXIS - x),
            }
        })
        .collect();
    bars.sort_by_key(|bar| bar.start_ms);
    (bars, axis_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bar at the very end of the axis, and one of no time, still show, inside the axis.
    #[test]
    fn every_bar_shows_inside_the_axis() {
        let span = |from, to| Span {
            turn_id: "t".into(),
            kind: BarKind::Delivery,
            label: String::new(),
            from,
            to,
        };
        let (first, last, empty) = (span(0, 1000), span(1000, 1000), span(400, 400));
        let (bars, axis_ms) = timeline(0, 1000, &[&last, &first, &empty]);
        assert_eq!(axis_ms, 1000);
        let drawn: Vec<(i64, i64)> = bars.iter().map(|bar| (bar.x, bar.width)).collect();
        assert_eq!(
            drawn,
            [(0, 1000), (400, MIN_WIDTH), (AXIS - MIN_WIDTH, MIN_WIDTH)]
        );
    }
}
