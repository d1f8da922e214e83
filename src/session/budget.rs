//! Budgets: whether a turn may make its next model request, decided from what was spent and
//! what requests in flight may still spend.
//!
//! Pure, like the turn machine: the store reads what the turn's event, its session, today and
//! its route's today spent (sums of committed turns, so a restart does not reset a day and every
//! node on PostgreSQL sees the same totals) and what other requests in flight hold, and this
//! module says which budget is used up, if any, whether a request fits beside those in flight,
//! how much a request may spend, and which budgets passed their warning share
//! (docs/reference.md, "Budgets").

use std::collections::HashSet;
use std::sync::Mutex;

use crate::config::BudgetLimits;
use crate::usage::{Counted, Price, Spending, Spent, Usage};

/// The reply tokens a request is reserved for when `[model] params` bounds them neither with
/// `max_tokens` nor `max_completion_tokens`.
pub(crate) const UNBOUNDED_REPLY_TOKENS: u64 = 4096;

/// Prompt tokens a request is reserved for beyond its bytes: what a chat template adds (role
/// markers, the preamble that introduces the tools).
pub(crate) const TEMPLATE_TOKENS: u64 = 256;

/// At most what a request of `request_bytes` (its messages and tools as JSON) may spend: a
/// token per byte of it plus [`TEMPLATE_TOKENS`] (a tokenizer makes no more tokens than a text
/// has bytes), and the reply's `max_tokens` (or `max_completion_tokens`) from `[model] params`,
/// else [`UNBOUNDED_REPLY_TOKENS`].
pub(crate) fn request_ceiling(
    request_bytes: u64,
    params: &serde_json::Map<String, serde_json::Value>,
) -> Usage {
    let reply = ["max_tokens", "max_completion_tokens"]
        .iter()
        .find_map(|key| params.get(*key).and_then(serde_json::Value::as_u64))
        .unwrap_or(UNBOUNDED_REPLY_TOKENS);
    Usage {
        input_tokens: request_bytes.saturating_add(TEMPLATE_TOKENS),
        cached_input_tokens: 0,
        output_tokens: reply,
    }
}

/// The share of a budget at which a warning is logged, unless `warn_at` says otherwise.
const DEFAULT_WARN_AT: f64 = 0.8;

/// What a budget counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Window {
    /// Every run of the turn's event (a resumed turn keeps what its earlier runs spent).
    Turn,
    Session,
    /// The UTC day, all routes.
    Day,
    /// The UTC day, the turn's route.
    RouteDay,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Measure {
    /// Input and output tokens (estimated for replies without usage).
    Tokens,
    /// US dollars at `[model] price`.
    Dollars,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Budget {
    pub window: Window,
    pub measure: Measure,
    pub limit: f64,
    /// Set by the route's `budget` rather than `[budgets]`.
    pub from_route: bool,
}

impl Budget {
    /// The config key that set it, as logs, errors and metrics name it.
    pub(crate) fn key(&self, route: &str) -> String {
        let name = match (self.window, self.measure) {
            (Window::Turn, Measure::Tokens) => "turn_tokens",
            (Window::Turn, Measure::Dollars) => "turn_usd",
            (Window::Session, Measure::Tokens) => "session_tokens",
            (Window::Session, Measure::Dollars) => "session_usd",
            (Window::Day | Window::RouteDay, Measure::Tokens) => "daily_tokens",
            (Window::Day | Window::RouteDay, Measure::Dollars) => "daily_usd",
        };
        if self.from_route {
            format!("routes.{route}.budget.{name}")
        } else {
            format!("budgets.{name}")
        }
    }
}

/// A budget and how much of it is used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Reached {
    pub budget: Budget,
    pub used: f64,
}

impl Reached {
    /// "budgets.turn_tokens: 1250 of 1000 tokens in this turn".
    pub(crate) fn describe(&self, route: &str) -> String {
        let budget = &self.budget;
        let window = match budget.window {
            Window::Turn => "in this turn",
            Window::Session => "in this session",
            Window::Day => "today (UTC), all routes",
            Window::RouteDay => "today (UTC) on this route",
        };
        let amounts = match budget.measure {
            Measure::Tokens => format!("{} of {} tokens", self.used, budget.limit),
            Measure::Dollars => format!("${:.4} of ${:.4}", self.used, budget.limit),
        };
        format!("{}: {amounts} {window}", budget.key(route))
    }
}

/// What the check says before a model request.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Verdict {
    /// A budget that is used up: the turn ends `failed`.
    pub exceeded: Option<Reached>,
    /// Budgets past their warning share (each is logged once per window by the caller).
    pub warnings: Vec<Reached>,
}

/// The budgets a route's turns are held to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Budgets {
    list: Vec<Budget>,
    warn_at: f64,
}

impl Budgets {
    /// `[budgets]` with the route's `budget` over it: the route's `turn_*`, `session_*` and
    /// `warn_at` replace the global ones; `daily_*` of `[budgets]` cap all routes, the route's
    /// its own day.
    pub(crate) fn for_route(global: &BudgetLimits, route: &BudgetLimits) -> Budgets {
        let tokens = |limit: Option<u64>| limit.map(|limit| (Measure::Tokens, limit as f64));
        let dollars = |limit: Option<f64>| limit.map(|limit| (Measure::Dollars, limit));
        let overridden = |own: Option<(Measure, f64)>, other: Option<(Measure, f64)>| match own {
            Some(limit) => Some((limit, true)),
            None => other.map(|limit| (limit, false)),
        };
        let candidates = [
            (
                Window::Turn,
                overridden(tokens(route.turn_tokens), tokens(global.turn_tokens)),
            ),
            (
                Window::Turn,
                overridden(dollars(route.turn_usd), dollars(global.turn_usd)),
            ),
            (
                Window::Session,
                overridden(tokens(route.session_tokens), tokens(global.session_tokens)),
            ),
            (
                Window::Session,
                overridden(dollars(route.session_usd), dollars(global.session_usd)),
            ),
            (
                Window::Day,
                tokens(global.daily_tokens).map(|limit| (limit, false)),
            ),
            (
                Window::Day,
                dollars(global.daily_usd).map(|limit| (limit, false)),
            ),
            (
                Window::RouteDay,
                tokens(route.daily_tokens).map(|limit| (limit, true)),
            ),
            (
                Window::RouteDay,
                dollars(route.daily_usd).map(|limit| (limit, true)),
            ),
        ];
        let list = candidates
            .into_iter()
            .filter_map(|(window, set)| {
                set.map(|((measure, limit), from_route)| Budget {
                    window,
                    measure,
                    limit,
                    from_route,
                })
            })
            .collect();
        Budgets {
            list,
            warn_at: route.warn_at.or(global.warn_at).unwrap_or(DEFAULT_WARN_AT),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The parts of a turn's spending these budgets count.
    pub(crate) fn counted(&self) -> Counted {
        let mut counted = Counted::default();
        for budget in &self.list {
            match budget.window {
                Window::Turn => counted.turn = true,
                Window::Session => counted.session = true,
                Window::Day => counted.day = true,
                Window::RouteDay => counted.route_day = true,
            }
        }
        counted
    }

    /// Whether a request may be sent beside those in flight: `with_held` (what was spent and
    /// what requests in flight may still spend) has used up no budget.
    pub(crate) fn fit(&self, with_held: &Spending, price: Option<&Price>) -> bool {
        self.check(with_held, price).exceeded.is_none()
    }

    /// What `before` becomes with `step` added to every window: the spending after a reply.
    pub(crate) fn after(before: &Spending, step: Spent) -> Spending {
        let each = Spending {
            turn: step,
            session: step,
            day: step,
            route_day: step,
        };
        before.plus(&each)
    }

    /// Which budget `spending` used up, if any, and which passed `warn_at` (a used-up one
    /// too: a reply may jump from below the share past the limit). A budget is used up when
    /// what was spent reached its limit: the request that crosses a limit is made, and the next
    /// is not (so a turn can overshoot by one reply; `max_tokens` in `[model] params` bounds
    /// that). A dollar budget without a price counts nothing (check-config refuses one).
    pub(crate) fn check(&self, spending: &Spending, price: Option<&Price>) -> Verdict {
        let mut verdict = Verdict::default();
        for budget in &self.list {
            let spent = match budget.window {
                Window::Turn => spending.turn,
                Window::Session => spending.session,
                Window::Day => spending.day,
                Window::RouteDay => spending.route_day,
            };
            let used = match budget.measure {
                Measure::Tokens => spent.budget_tokens() as f64,
                Measure::Dollars => match price {
                    Some(price) => spent.budget_usd(price),
                    None => continue,
                },
            };
            let reached = Reached {
                budget: *budget,
                used,
            };
            if used >= budget.limit * self.warn_at {
                verdict.warnings.push(reached);
            }
            if used >= budget.limit {
                verdict.exceeded.get_or_insert(reached);
            }
        }
        verdict
    }
}

/// Windows already warned about, so that each budget warns once per window. Bounded: when
/// full it starts over, which at worst repeats a warning.
#[derive(Debug, Default)]
pub(crate) struct Warned(Mutex<HashSet<String>>);

/// Windows remembered at most (about 100 bytes each).
const WARNED_MAX: usize = 10_000;

impl Warned {
    /// Whether `window` (a budget's key and the window's own: a turn, a session, a day) is new.
    pub(crate) fn first_time(&self, window: String) -> bool {
        let Ok(mut seen) = self.0.lock() else {
            return true;
        };
        if seen.len() >= WARNED_MAX {
            seen.clear();
        }
        seen.insert(window)
    }
}

/// The identity of `reached`'s window for `Warned`: the event, the session or the day.
pub(crate) fn window_id(
    reached: &Reached,
    route: &str,
    event: &str,
    session: &str,
    day: i64,
) -> String {
    let key = reached.budget.key(route);
    match reached.budget.window {
        Window::Turn => format!("{key} {event}"),
        Window::Session => format!("{key} {session}"),
        Window::Day | Window::RouteDay => format!("{key} {day}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::{Spent, Usage};

    fn spent(input: u64, output: u64) -> Spent {
        Spent::of_reply(
            Some(Usage {
                input_tokens: input,
                cached_input_tokens: 0,
                output_tokens: output,
            }),
            0,
        )
    }

    fn spending(turn: Spent, day: Spent) -> Spending {
        Spending {
            turn,
            session: turn,
            day,
            route_day: turn,
        }
    }

    #[test]
    fn a_route_s_limits_replace_the_global_ones_and_daily_ones_add_up() {
        let global = BudgetLimits {
            turn_tokens: Some(1000),
            daily_tokens: Some(100_000),
            ..BudgetLimits::default()
        };
        let route = BudgetLimits {
            turn_tokens: Some(500),
            daily_tokens: Some(2000),
            ..BudgetLimits::default()
        };
        let budgets = Budgets::for_route(&global, &route);
        let keys: Vec<String> = budgets.list.iter().map(|b| b.key("github")).collect();
        assert_eq!(
            keys,
            [
                "routes.github.budget.turn_tokens",
                "budgets.daily_tokens",
                "routes.github.budget.daily_tokens"
            ]
        );
        let verdict = budgets.check(&spending(spent(400, 100), spent(400, 100)), None);
        let exceeded = verdict.exceeded.map(|r| r.describe("github"));
        assert_eq!(
            exceeded.as_deref(),
            Some("routes.github.budget.turn_tokens: 500 of 500 tokens in this turn")
        );
    }

    #[test]
    fn below_a_limit_past_warn_at_is_a_warning_and_replies_without_usage_count_their_estimate() {
        let global = BudgetLimits {
            session_tokens: Some(1000),
            warn_at: Some(0.5),
            ..BudgetLimits::default()
        };
        let budgets = Budgets::for_route(&global, &BudgetLimits::default());
        let verdict = budgets.check(&spending(spent(300, 0), Spent::default()), None);
        assert_eq!(verdict, Verdict::default(), "below warn_at");
        let mut unknown = spent(300, 0);
        unknown.add(Spent::of_reply(None, 1200));
        let verdict = budgets.check(&spending(unknown, Spent::default()), None);
        assert!(verdict.exceeded.is_none());
        assert_eq!(verdict.warnings.len(), 1, "300 reported + 300 estimated");
    }

    #[test]
    fn a_reply_that_jumps_past_the_limit_also_passes_warn_at() {
        let global = BudgetLimits {
            session_tokens: Some(1000),
            ..BudgetLimits::default()
        };
        let budgets = Budgets::for_route(&global, &BudgetLimits::default());
        let before = spending(spent(550, 0), Spent::default());
        assert_eq!(budgets.check(&before, None), Verdict::default());
        let after = Budgets::after(&before, spent(500, 50));
        let verdict = budgets.check(&after, None);
        assert!(verdict.exceeded.is_some(), "{verdict:?}");
        assert_eq!(
            verdict.warnings.iter().map(|r| r.used).collect::<Vec<_>>(),
            [1100.0],
            "55 % to 110 % warns"
        );
    }

    #[test]
    fn a_request_fits_while_what_is_spent_and_held_is_below_every_limit() {
        let global = BudgetLimits {
            daily_tokens: Some(5000),
            ..BudgetLimits::default()
        };
        let budgets = Budgets::for_route(&global, &BudgetLimits::default());
        assert!(budgets.fit(&spending(Spent::default(), spent(4000, 999)), None));
        assert!(!budgets.fit(&spending(Spent::default(), spent(4000, 1000)), None));
        let bounded = serde_json::json!({"max_tokens": 300});
        let params = bounded.as_object().cloned().unwrap_or_default();
        let ceiling = request_ceiling(1000, &params);
        assert_eq!((ceiling.input_tokens, ceiling.output_tokens), (1256, 300));
        let unbounded = request_ceiling(1000, &serde_json::Map::new());
        assert_eq!(unbounded.output_tokens, UNBOUNDED_REPLY_TOKENS);
    }

    #[test]
    fn dollar_budgets_count_cost_at_the_price() {
        let global = BudgetLimits {
            daily_usd: Some(1.0),
            ..BudgetLimits::default()
        };
        let budgets = Budgets::for_route(&global, &BudgetLimits::default());
        let price = Price {
            input_per_mtok: 1.0,
            cached_input_per_mtok: 1.0,
            output_per_mtok: 1.0,
        };
        let day = spent(600_000, 400_000);
        let verdict = budgets.check(&spending(Spent::default(), day), Some(&price));
        assert!(verdict.exceeded.is_some(), "{verdict:?}");
        let verdict = budgets.check(&spending(Spent::default(), day), None);
        assert_eq!(verdict, Verdict::default(), "no price, no dollars");
    }
}
