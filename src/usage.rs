//! What model replies cost: tokens as the model server reports them with each reply
//! (`usage`), and dollars at the configured `[model] price`.
//!
//! A reply's tokens are committed with its step, summed on its turn; every figure shown (an
//! event's, a session's, a day's, a delivery's) is a sum of turns, and its cost is computed
//! when shown, from the price in effect. A reply without `usage` is counted as a step of unknown
//! usage, never as zero tokens.

use serde::{Deserialize, Serialize};

/// Tokens of one reply, or a sum of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Usage {
    /// Every prompt token, cached ones included (as `prompt_tokens` counts them).
    pub input_tokens: u64,
    /// The part of `input_tokens` the server served from its prompt cache.
    pub cached_input_tokens: u64,
    pub output_tokens: u64,
}

/// The most tokens one reply's usage counts (2^32, thousands of times any context window).
const MAX_REPLY_TOKENS: u64 = 1 << 32;

impl Usage {
    /// The `usage` of a Chat Completions reply (`prompt_tokens`, `completion_tokens`,
    /// `prompt_tokens_details.cached_tokens`), if it has one.
    pub(crate) fn of_reply(reply: &serde_json::Value) -> Option<Usage> {
        let usage = reply.get("usage")?;
        // A count past any real reply's is the server's error (or a hostile one's): capped, so
        // that sums over days of replies stay far from overflowing.
        let count = |pointer: &str| {
            (usage.pointer(pointer))
                .and_then(serde_json::Value::as_u64)
                .map(|count| count.min(MAX_REPLY_TOKENS))
        };
        Some(Usage {
            input_tokens: count("/prompt_tokens")?,
            cached_input_tokens: count("/prompt_tokens_details/cached_tokens").unwrap_or(0),
            output_tokens: count("/completion_tokens").unwrap_or(0),
        })
    }

    pub(crate) fn add(&mut self, other: Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.cached_input_tokens =
            (self.cached_input_tokens).saturating_add(other.cached_input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
    }

    /// Its cost in US dollars at `price`.
    pub(crate) fn cost(&self, price: &Price) -> f64 {
        let uncached = self.input_tokens.saturating_sub(self.cached_input_tokens);
        let million = 1_000_000.0;
        (uncached as f64 * price.input_per_mtok
            + self.cached_input_tokens as f64 * price.cached_input_per_mtok
            + self.output_tokens as f64 * price.output_per_mtok)
            / million
    }
}

/// What replies spent: their reported tokens, how many reported none, and an estimate of the
/// tokens of those. One reply's, one committed step's (nothing for a step that records no
/// reply), or a sum of turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Spent {
    pub usage: Usage,
    pub unknown_steps: u64,
    /// Tokens estimated for the replies without usage, at [`BYTES_PER_TOKEN`]: what token
    /// budgets count for them (docs/reference.md, "Budgets").
    pub estimated_tokens: u64,
}

/// The estimate of a reply without usage: its request's and its reply's bytes, this many to a
/// token (about what tokenizers make of English text and JSON).
pub(crate) const BYTES_PER_TOKEN: u64 = 4;

impl Spent {
    /// What a reply spent, as its server reported it; `None`: not reported, estimated from the
    /// bytes of the request and the reply.
    pub(crate) fn of_reply(reported: Option<Usage>, request_and_reply_bytes: u64) -> Spent {
        match reported {
            Some(usage) => Spent {
                usage,
                unknown_steps: 0,
                estimated_tokens: 0,
            },
            None => Spent {
                usage: Usage::default(),
                unknown_steps: 1,
                estimated_tokens: request_and_reply_bytes.div_ceil(BYTES_PER_TOKEN),
            },
        }
    }

    pub(crate) fn add(&mut self, other: Spent) {
        self.usage.add(other.usage);
        self.unknown_steps = self.unknown_steps.saturating_add(other.unknown_steps);
        self.estimated_tokens = self.estimated_tokens.saturating_add(other.estimated_tokens);
    }

    /// Input and output tokens, estimated ones included: what token budgets count.
    pub(crate) fn budget_tokens(&self) -> u64 {
        (self.usage.input_tokens)
            .saturating_add(self.usage.output_tokens)
            .saturating_add(self.estimated_tokens)
    }

    /// The cost at `price`, estimated tokens at the input rate: what dollar budgets count.
    pub(crate) fn budget_usd(&self, price: &Price) -> f64 {
        self.usage.cost(price) + self.estimated_tokens as f64 * price.input_per_mtok / 1_000_000.0
    }
}

/// `[model] price`: US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Price {
    pub input_per_mtok: f64,
    pub cached_input_per_mtok: f64,
    pub output_per_mtok: f64,
}

/// Usage as it is shown: events, sessions, `status`, deliveries and `agentgate usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct UsageReport {
    pub input_tokens: u64,
    pub cached_input_tokens: u64,
    pub output_tokens: u64,
    /// `null` without a `[model] price`.
    pub cost_usd: Option<f64>,
    /// Replies that reported no usage: their tokens are not in the figures above.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unknown_steps: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl UsageReport {
    pub(crate) fn of(spent: Spent, price: Option<&Price>) -> UsageReport {
        // The estimate of replies without usage is for budgets; figures show reported tokens.
        let Spent {
            usage,
            unknown_steps,
            estimated_tokens: _,
        } = spent;
        UsageReport {
            input_tokens: usage.input_tokens,
            cached_input_tokens: usage.cached_input_tokens,
            output_tokens: usage.output_tokens,
            cost_usd: price.map(|price| usage.cost(price)),
            unknown_steps,
        }
    }
}

impl UsageReport {
    /// The same figures with their cost at `price` (`None`: no price, no cost).
    pub(crate) fn priced(self, price: Option<&Price>) -> UsageReport {
        let usage = Usage {
            input_tokens: self.input_tokens,
            cached_input_tokens: self.cached_input_tokens,
            output_tokens: self.output_tokens,
        };
        UsageReport {
            cost_usd: price.map(|price| usage.cost(price)),
            ..self
        }
    }
}

/// "1200 input (1000 cached), 80 output, $0.0012": the figures in one line for terminals.
impl std::fmt::Display for UsageReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} input ({} cached), {} output",
            self.input_tokens, self.cached_input_tokens, self.output_tokens
        )?;
        if let Some(cost) = self.cost_usd {
            write!(f, ", ${cost:.4}")?;
        }
        if self.unknown_steps > 0 {
            write!(f, ", {} replies without usage", self.unknown_steps)?;
        }
        Ok(())
    }
}

/// `status`'s usage: what today (UTC) spent so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct UsageToday {
    pub today: UsageReport,
}

/// What the turns of one route that started on one UTC day spent.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct UsageDay {
    pub route: String,
    /// Days since 1970-01-01 (UTC).
    pub day: i64,
    pub spent: Spent,
}

impl UsageDay {
    /// What all of `days` spent.
    pub(crate) fn total(days: &[UsageDay]) -> Spent {
        let mut total = Spent::default();
        for day in days {
            total.add(day.spent);
        }
        total
    }
}

/// What a turn's budgets count: what every run of its event, its session, today (UTC) on all
/// routes and today on its route spent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Spending {
    pub turn: Spent,
    pub session: Spent,
    pub day: Spent,
    pub route_day: Spent,
}

impl Spending {
    /// Each part of `self` with the same part of `other` added.
    pub(crate) fn plus(&self, other: &Spending) -> Spending {
        let sum = |mut mine: Spent, theirs: Spent| {
            mine.add(theirs);
            mine
        };
        Spending {
            turn: sum(self.turn, other.turn),
            session: sum(self.session, other.session),
            day: sum(self.day, other.day),
            route_day: sum(self.route_day, other.route_day),
        }
    }

    /// The parts `counted` names; the others zero.
    pub(crate) fn only(self, counted: Counted) -> Spending {
        let part = |wanted: bool, spent: Spent| if wanted { spent } else { Spent::default() };
        Spending {
            turn: part(counted.turn, self.turn),
            session: part(counted.session, self.session),
            day: part(counted.day, self.day),
            route_day: part(counted.route_day, self.route_day),
        }
    }
}

/// Which parts of a [`Spending`] a turn's budgets count: only those are summed (each is a query
/// before every model request); the others stay zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counted {
    pub turn: bool,
    pub session: bool,
    pub day: bool,
    pub route_day: bool,
}

/// How much of a daily budget today used (`agentgate usage`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct BudgetUse {
    /// The config key: `budgets.daily_tokens`, `routes.NAME.budget.daily_usd`, ...
    pub budget: String,
    pub limit: f64,
    /// Today (UTC) so far, in the budget's unit (tokens, or US dollars).
    pub used: f64,
}

/// The daily budgets (`[budgets]` for all routes, each route's for its own) against `today`'s
/// rows. A dollar budget without a price is left out (check-config refuses one).
pub(crate) fn daily_budget_use(
    global: &BudgetLimits,
    routes: &[(String, BudgetLimits)],
    today: &[UsageDay],
    price: Option<&Price>,
) -> Vec<BudgetUse> {
    let mut scopes = vec![("budgets".to_string(), *global, UsageDay::total(today))];
    for (route, limits) in routes {
        let days: Vec<UsageDay> = today
            .iter()
            .filter(|day| &day.route == route)
            .cloned()
            .collect();
        scopes.push((
            format!("routes.{route}.budget"),
            *limits,
            UsageDay::total(&days),
        ));
    }
    let mut used = Vec::new();
    for (scope, limits, spent) in scopes {
        if let Some(limit) = limits.daily_tokens {
            used.push(BudgetUse {
                budget: format!("{scope}.daily_tokens"),
                limit: limit as f64,
                used: spent.budget_tokens() as f64,
            });
        }
        if let (Some(limit), Some(price)) = (limits.daily_usd, price) {
            used.push(BudgetUse {
                budget: format!("{scope}.daily_usd"),
                limit,
                used: spent.budget_usd(price),
            });
        }
    }
    used
}

/// The session budgets (`session_tokens`, `session_usd`) of a session of `route` whose turns
/// spent `spent`: the route's own `budget` where it sets one, else `[budgets]`. A dollar budget
/// without a price is left out (check-config refuses one).
pub(crate) fn session_budget_use(
    global: &BudgetLimits,
    route: &str,
    own: &BudgetLimits,
    spent: Spent,
    price: Option<&Price>,
) -> Vec<BudgetUse> {
    let scope = |from_route: bool, name: &str| {
        if from_route {
            format!("routes.{route}.budget.{name}")
        } else {
            format!("budgets.{name}")
        }
    };
    let mut used = Vec::new();
    let tokens = own
        .session_tokens
        .map(|limit| (limit, true))
        .or(global.session_tokens.map(|limit| (limit, false)));
    if let Some((limit, from_route)) = tokens {
        used.push(BudgetUse {
            budget: scope(from_route, "session_tokens"),
            limit: limit as f64,
            used: spent.budget_tokens() as f64,
        });
    }
    let dollars = own
        .session_usd
        .map(|limit| (limit, true))
        .or(global.session_usd.map(|limit| (limit, false)));
    if let (Some((limit, from_route)), Some(price)) = (dollars, price) {
        used.push(BudgetUse {
            budget: scope(from_route, "session_usd"),
            limit,
            used: spent.budget_usd(price),
        });
    }
    used
}

/// Milliseconds in a day: UTC days are counted in whole multiples of it since the epoch.
pub(crate) const DAY_MS: i64 = 86_400_000;

/// What `agentgate usage` counts from by default: the last 7 UTC days, today included.
pub(crate) fn default_usage_since(now_ms: i64) -> i64 {
    day_start(now_ms) - 6 * DAY_MS
}

/// The first millisecond of the UTC day of `now_ms`.
pub(crate) fn day_start(now_ms: i64) -> i64 {
    now_ms.div_euclid(DAY_MS).saturating_mul(DAY_MS)
}

/// `[budgets]` or a route's `budget` (docs/reference.md, "Budgets"). In a route's, `turn_*`,
/// `session_*` and `warn_at` replace the `[budgets]` ones for its turns, and `daily_*` cap the
/// route's own day.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct BudgetLimits {
    pub turn_tokens: Option<u64>,
    pub turn_usd: Option<f64>,
    pub session_tokens: Option<u64>,
    pub session_usd: Option<f64>,
    pub daily_tokens: Option<u64>,
    pub daily_usd: Option<f64>,
    /// The share of a budget at which a warning is logged; `None`: the default (0.8).
    pub warn_at: Option<f64>,
}

impl BudgetLimits {
    /// Whether a limit is in dollars (it needs `[model] price`).
    pub(crate) fn has_dollars(&self) -> bool {
        self.turn_usd.is_some() || self.session_usd.is_some() || self.daily_usd.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A reply that claims absurd counts cannot overflow the sums that budgets check: each
    /// count is capped, and the sums saturate.
    #[test]
    fn absurd_usage_neither_overflows_nor_wraps_a_budget() {
        let reply = json!({"usage": {"prompt_tokens": u64::MAX, "completion_tokens": u64::MAX}});
        let usage = Usage::of_reply(&reply).expect("usage");
        assert_eq!(usage.input_tokens, MAX_REPLY_TOKENS);
        let mut spent = Spent {
            usage: Usage {
                input_tokens: u64::MAX,
                cached_input_tokens: 0,
                output_tokens: u64::MAX,
            },
            unknown_steps: 1,
            estimated_tokens: 2,
        };
        assert_eq!(spent.budget_tokens(), u64::MAX);
        spent.usage.add(usage);
        assert_eq!(spent.usage.input_tokens, u64::MAX);
        // A day asked for by the control socket's `since`: no overflow (test builds check).
        assert!(day_start(i64::MIN) <= 0);
    }

    #[test]
    fn a_reply_s_usage_is_read_and_a_missing_one_is_none() {
        let reply = json!({"usage": {"prompt_tokens": 1200, "completion_tokens": 80,
            "prompt_tokens_details": {"cached_tokens": 1000}}});
        assert_eq!(
            Usage::of_reply(&reply),
            Some(Usage {
                input_tokens: 1200,
                cached_input_tokens: 1000,
                output_tokens: 80
            })
        );
        assert_eq!(Usage::of_reply(&json!({"choices": []})), None);
    }

    #[test]
    fn cached_input_is_priced_at_its_own_rate() {
        let usage = Usage {
            input_tokens: 1_000_000,
            cached_input_tokens: 400_000,
            output_tokens: 100_000,
        };
        let price = Price {
            input_per_mtok: 0.15,
            cached_input_per_mtok: 0.075,
            output_per_mtok: 0.60,
        };
        let cost = usage.cost(&price);
        assert!(
            (cost - (0.6 * 0.15 + 0.4 * 0.075 + 0.1 * 0.60)).abs() < 1e-9,
            "{cost}"
        );
    }
}
