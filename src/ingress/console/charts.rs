//! The overview's charts: small SVG drawn on the server (no script, no inline style) of the last
//! hour minute by minute and the last day hour by hour (webhooks accepted and refused, turns
//! completed and not, turn durations, deliveries pending), from the minutes `metrics::recent`
//! keeps, and of each of the last days' spending against each daily budget, from the store.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::ingress::api::UsageLimits;
use crate::metrics::recent::{MINUTES, Minute};
use crate::usage::{DAY_MS, UsageDay, daily_budget_use, day_start};

/// A chart's drawing area, in the SVG's own units.
const WIDTH: f64 = 600.0;
const HEIGHT: f64 = 120.0;
/// Room left around the lines.
const PAD: f64 = 8.0;
/// Days of spending shown, today included.
pub(super) const DAYS: i64 = 7;

/// One chart: its series on one scale, and the budget it is held against, if any.
#[derive(Serialize)]
pub(super) struct Chart {
    /// The element's id: what the chart shows, over which span.
    id: String,
    title: String,
    /// The first and last point's labels, under the axis.
    from: String,
    to: String,
    /// The top of the scale, in the chart's unit.
    top: String,
    series: Vec<Series>,
    limit: Option<Limit>,
}

#[derive(Serialize)]
struct Series {
    /// Its CSS class, and its name in the legend.
    name: &'static str,
    /// `x,y` pairs for the polyline.
    line: String,
    points: Vec<Point>,
}

#[derive(Serialize)]
struct Point {
    x: String,
    y: String,
    value: String,
    /// When it is for (UTC), for its tooltip.
    at: String,
}

/// A budget's line across the chart.
#[derive(Serialize)]
struct Limit {
    name: String,
    y: String,
    value: String,
}

/// What one span of minutes shows on the activity charts: a minute of the hour, or an hour of
/// the day.
struct Slice {
    at: String,
    minute: Minute,
}

/// The activity charts of the last hour (per minute) and of the last day (per hour).
pub(super) fn activity(minutes: &[Minute]) -> (Vec<Chart>, Vec<Chart>) {
    let hour: Vec<Slice> = minutes
        .iter()
        .skip(MINUTES.saturating_sub(60))
        .map(|minute| Slice {
            at: clock(minute.at * 60_000),
            minute: *minute,
        })
        .collect();
    let day: Vec<Slice> = minutes
        .chunks(60)
        .map(|hour| {
            let mut sum = Minute::default();
            for minute in hour {
                sum.add(minute);
            }
            let first = hour.first().map_or(0, |minute| minute.at);
            Slice {
                at: clock(first * 60_000),
                minute: sum,
            }
        })
        .collect();
    (
        activity_charts("hour", &hour, "minute"),
        activity_charts("day", &day, "hour"),
    )
}

fn activity_charts(span: &str, slices: &[Slice], per: &str) -> Vec<Chart> {
    let count = |value: u64| Some(value as f64);
    let percentile = |q: f64| move |m: &Minute| m.duration_percentile(q).map(|ms| ms as f64);
    let p50 = percentile(0.5);
    let p95 = percentile(0.95);
    vec![
        chart(
            format!("webhooks-{span}"),
            format!("Webhooks per {per}"),
            slices,
            &[
                ("accepted", &|m: &Minute| count(m.accepted)),
                ("refused", &|m: &Minute| count(m.refused)),
            ],
        ),
        chart(
            format!("turns-{span}"),
            format!("Turns per {per}"),
            slices,
            &[
                ("completed", &|m: &Minute| count(m.turns_completed)),
                ("failed", &|m: &Minute| count(m.turns_failed)),
            ],
        ),
        chart(
            format!("durations-{span}"),
            format!("Turn duration per {per}, ms (p50, p95)"),
            slices,
            &[("p50", &p50), ("p95", &p95)],
        ),
        chart(
            format!("deliveries-{span}"),
            format!("Deliveries pending, as last read each {per}"),
            slices,
            &[("pending", &|m: &Minute| {
                m.deliveries_pending.map(|n| n as f64)
            })],
        ),
    ]
}

/// What a series reads of a slice: its value, or none (left out).
type Reading<'a> = dyn Fn(&Minute) -> Option<f64> + 'a;

/// A chart of `series` over `slices`; a slice a series has no value for is left out of it.
fn chart(
    id: String,
    title: String,
    slices: &[Slice],
    series: &[(&'static str, &Reading<'_>)],
) -> Chart {
    let values: Vec<Vec<Option<f64>>> = series
        .iter()
        .map(|(_, value)| slices.iter().map(|slice| value(&slice.minute)).collect())
        .collect();
    let ats: Vec<&str> = slices.iter().map(|slice| slice.at.as_str()).collect();
    let names: Vec<&'static str> = series.iter().map(|(name, _)| *name).collect();
    draw(id, title, &ats, &names, &values, None)
}

/// Lays out `values` (one row per series, one column per `ats`) on one scale that also holds
/// `limit`.
fn draw(
    id: String,
    title: String,
    ats: &[&str],
    names: &[&'static str],
    values: &[Vec<Option<f64>>],
    limit: Option<(String, f64)>,
) -> Chart {
    let top = values
        .iter()
        .flatten()
        .flatten()
        .copied()
        .chain(limit.as_ref().map(|(_, value)| *value))
        .fold(0.0, f64::max);
    let scale = if top > 0.0 { top } else { 1.0 };
    let y = |value: f64| HEIGHT - PAD - value / scale * (HEIGHT - 2.0 * PAD);
    let step = (WIDTH - 2.0 * PAD) / ats.len().saturating_sub(1).max(1) as f64;
    let series = names
        .iter()
        .zip(values)
        .map(|(name, row)| {
            let points: Vec<Point> = row
                .iter()
                .enumerate()
                .filter_map(|(index, value)| {
                    let value = (*value)?;
                    Some(Point {
                        x: format!("{:.1}", PAD + index as f64 * step),
                        y: format!("{:.1}", y(value)),
                        value: number(value),
                        at: ats.get(index).copied().unwrap_or_default().to_string(),
                    })
                })
                .collect();
            let line = points
                .iter()
                .map(|point| format!("{},{}", point.x, point.y))
                .collect::<Vec<_>>()
                .join(" ");
            Series { name, line, points }
        })
        .collect();
    Chart {
        id,
        title,
        from: ats.first().copied().unwrap_or_default().to_string(),
        to: ats.last().copied().unwrap_or_default().to_string(),
        top: number(top),
        series,
        limit: limit.map(|(name, value)| Limit {
            name,
            y: format!("{:.1}", y(value)),
            value: number(value),
        }),
    }
}

/// The spending charts of the last `DAYS` days, today included: tokens (as budgets count them)
/// and, with a price, dollars per day of all routes against `[budgets]`' daily budgets, then
/// each route's daily budget against its own spending. `days` are the store's rows since then.
pub(super) fn spending(days: &[UsageDay], limits: &UsageLimits, now_ms: i64) -> Vec<Chart> {
    let today = day_start(now_ms) / DAY_MS;
    let span: Vec<i64> = (today - DAYS + 1..=today).collect();
    let labels: Vec<String> = span
        .iter()
        .map(|day| crate::store::rfc3339(day * DAY_MS)[..10].to_string())
        .collect();
    let ats: Vec<&str> = labels.iter().map(String::as_str).collect();
    let rows =
        |day: i64| -> Vec<UsageDay> { days.iter().filter(|row| row.day == day).cloned().collect() };
    let price = limits.price.as_ref();
    let mut charts = Vec::new();
    let totals: Vec<_> = span
        .iter()
        .map(|day| UsageDay::total(&rows(*day)))
        .collect();
    let tokens = totals
        .iter()
        .map(|spent| Some(spent.budget_tokens() as f64))
        .collect();
    let global_limit =
        |name: &str, limit: Option<f64>| limit.map(|limit| (format!("budgets.{name}"), limit));
    charts.push(draw(
        "tokens-days".into(),
        "Tokens per day, all routes".into(),
        &ats,
        &["tokens"],
        &[tokens],
        global_limit(
            "daily_tokens",
            limits.budgets.daily_tokens.map(|n| n as f64),
        ),
    ));
    if let Some(price) = price {
        let dollars = totals
            .iter()
            .map(|spent| Some(spent.budget_usd(price)))
            .collect();
        charts.push(draw(
            "usd-days".into(),
            "US dollars per day, all routes".into(),
            &ats,
            &["usd"],
            &[dollars],
            global_limit("daily_usd", limits.budgets.daily_usd),
        ));
    }
    // Each route's daily budgets, as `usage` counts them, day by day.
    let mut budgets: BTreeMap<String, (f64, Vec<Option<f64>>)> = BTreeMap::new();
    for (index, day) in span.iter().enumerate() {
        let uses = daily_budget_use(&Default::default(), &limits.routes, &rows(*day), price);
        for used in uses {
            let entry = budgets
                .entry(used.budget)
                .or_insert_with(|| (used.limit, vec![None; span.len()]));
            if let Some(slot) = entry.1.get_mut(index) {
                *slot = Some(used.used);
            }
        }
    }
    for (budget, (limit, values)) in budgets {
        charts.push(draw(
            format!("budget-{budget}"),
            format!("{budget} per day"),
            &ats,
            &["used"],
            &[values],
            Some((budget, limit)),
        ));
    }
    charts
}

/// `hh:mm` (UTC) of `millis`.
fn clock(millis: i64) -> String {
    let time = crate::store::rfc3339(millis);
    time.get(11..16).unwrap_or_default().to_string()
}

/// A value as the charts label it: whole numbers as such, others with up to four decimals.
fn number(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.0}")
    } else {
        let text = format!("{value:.4}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hour has a point per minute, the day a point per hour; a minute without turns has no
    /// duration, and one without a reading no pending deliveries.
    #[test]
    fn an_hour_has_sixty_points_and_a_day_twenty_four() {
        let mut minutes: Vec<Minute> = (0..MINUTES as i64)
            .map(|at| Minute {
                at,
                ..Minute::default()
            })
            .collect();
        minutes[MINUTES - 1].accepted = 3;
        minutes[MINUTES - 1].durations[0] = 2;
        minutes[MINUTES - 61].refused = 4;
        let (hour, day) = activity(&minutes);
        let points = |id: &str, series: usize| {
            let chart = hour.iter().chain(&day).find(|chart| chart.id == id);
            let chart = chart.expect(id);
            chart.series[series]
                .points
                .iter()
                .map(|point| point.value.clone())
                .collect::<Vec<_>>()
        };
        let accepted = points("webhooks-hour", 0);
        assert_eq!(accepted.len(), 60);
        assert_eq!(accepted.last().map(String::as_str), Some("3"));
        assert!(points("webhooks-hour", 1).iter().all(|value| value == "0"));
        assert_eq!(points("webhooks-day", 1).len(), 24);
        assert_eq!(points("webhooks-day", 1)[22], "4");
        assert_eq!(points("durations-hour", 0), ["100"]);
        assert!(points("deliveries-day", 0).is_empty());
    }
}
