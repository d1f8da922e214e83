//! `usage`: what model replies spent, by route and UTC day (`ingress::api::UsageDocument`, the
//! same document the control socket's `/v1/usage` answers).

use std::time::Duration;

use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::ingress::api::UsageDocument;
use crate::output::outln;
use crate::store::now_millis;
use crate::usage::{BudgetUse, day_start, default_usage_since};

use super::control::{self, DaemonClient};
use super::state::StateAccess;

pub(super) fn usage(
    source: &ConfigSource,
    route: Option<String>,
    since: Option<Duration>,
    json: bool,
) -> Result<(), Failure> {
    let now = now_millis();
    let since = match since {
        Some(back) => day_start(now - i64::try_from(back.as_millis()).unwrap_or(i64::MAX / 2)),
        None => default_usage_since(now),
    };
    let daemon = DaemonClient::new(source)?;
    let document = if daemon.state_unreadable() {
        // A member of the daemon's group: the running daemon answers for the state.
        let mut path = format!("/v1/usage?since={since}");
        if let Some(route) = &route {
            path.push_str(&format!("&route={}", control::path_segment(route)));
        }
        match daemon.request(http::Method::GET, &path)? {
            Some(answer) if answer.status.is_success() => answer.document::<UsageDocument>()?,
            Some(answer) => return Err(Failure::unavailable(answer.message())),
            None => return Err(control::no_daemon_for_unreadable_state()),
        }
    } else {
        let state = StateAccess::open(source)?;
        let days = state
            .query(async |store| store.usage_by_day(since).await)?
            .unwrap_or_default();
        UsageDocument::of(days, since, route.as_deref(), &state.limits)
    };
    if json {
        outln!("{:#}", serde_json::json!(document));
        return Ok(());
    }
    outln!(
        "{:<10}  {:<16}  {:>12}  {:>12}  {:>10}  {:>10}",
        "DAY",
        "ROUTE",
        "INPUT",
        "CACHED",
        "OUTPUT",
        "COST USD"
    );
    for row in &document.days {
        let usage = &row.usage;
        outln!(
            "{:<10}  {:<16}  {:>12}  {:>12}  {:>10}  {:>10}",
            row.day,
            row.route,
            usage.input_tokens,
            usage.cached_input_tokens,
            usage.output_tokens,
            cost(usage.cost_usd)
        );
    }
    outln!("since {}: {}", document.since, document.total);
    for budget in &document.budgets {
        outln!("{}", budget_line(budget, "today"));
    }
    Ok(())
}

/// `usage --session KEY`: what the session's turns spent, against its session budgets; the
/// same figures `sessions show` gives with its transcript.
pub(super) fn session_usage(source: &ConfigSource, key: &str, json: bool) -> Result<(), Failure> {
    let shown = super::sessions::session_document(source, key)?;
    let session = &shown.session;
    if json {
        outln!(
            "{:#}",
            serde_json::json!({"session": session.key, "route": session.route,
                "usage": session.usage, "budgets": shown.budgets})
        );
        return Ok(());
    }
    outln!(
        "session {}  route {}",
        crate::untrusted::for_terminal(&session.key),
        session.route
    );
    if let Some(usage) = &session.usage {
        outln!("usage {usage}");
    }
    if shown.budgets.is_empty() {
        outln!("no session budget applies (budgets.session_tokens, budgets.session_usd)");
    }
    for budget in &shown.budgets {
        outln!("{}", budget_line(budget, "in this session"));
    }
    Ok(())
}

/// "budgets.session_tokens: 1100 of 1000 used in this session (110%)".
pub(super) fn budget_line(budget: &BudgetUse, window: &str) -> String {
    format!(
        "{}: {:.4} of {} used {window} ({:.0}%)",
        budget.budget,
        budget.used,
        budget.limit,
        100.0 * budget.used / budget.limit
    )
}

fn cost(cost_usd: Option<f64>) -> String {
    cost_usd.map_or_else(|| "-".to_string(), |cost| format!("{cost:.4}"))
}
