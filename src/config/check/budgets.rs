//! `[budgets]` and each route's `budget`: limits that can be enforced, or an error.

use super::Checker;
use crate::config::raw::RawBudgets;
use crate::config::settings::{BudgetLimits, RouteSettings};
use crate::usage::Price;

impl Checker<'_> {
    /// The limits under `prefix`: token counts whole and positive, dollars positive, `warn_at`
    /// a share above 0 and at most 1.
    pub(in crate::config) fn budget_limits(
        &mut self,
        prefix: &str,
        raw: Option<RawBudgets>,
    ) -> BudgetLimits {
        let Some(raw) = raw else {
            return BudgetLimits::default();
        };
        let mut tokens = |key: &str, value: Option<i64>| -> Option<u64> {
            let value = value?;
            match u64::try_from(value) {
                Ok(count) if count > 0 => Some(count),
                _ => {
                    self.error(
                        &format!("{prefix}.{key}"),
                        format!("{value} must be a positive whole number of tokens"),
                    );
                    None
                }
            }
        };
        let turn_tokens = tokens("turn_tokens", raw.turn_tokens);
        let session_tokens = tokens("session_tokens", raw.session_tokens);
        let daily_tokens = tokens("daily_tokens", raw.daily_tokens);
        let mut share = |key: &str, value: Option<f64>, most: f64, what: &str| -> Option<f64> {
            let value = value?;
            if value.is_finite() && value > 0.0 && value <= most {
                return Some(value);
            }
            self.error(
                &format!("{prefix}.{key}"),
                format!("{value} must be {what}"),
            );
            None
        };
        let dollars = "a positive number of US dollars";
        BudgetLimits {
            turn_tokens,
            session_tokens,
            daily_tokens,
            turn_usd: share("turn_usd", raw.turn_usd, f64::MAX, dollars),
            session_usd: share("session_usd", raw.session_usd, f64::MAX, dollars),
            daily_usd: share("daily_usd", raw.daily_usd, f64::MAX, dollars),
            warn_at: share("warn_at", raw.warn_at, 1.0, "a share above 0 and at most 1"),
        }
    }

    /// A limit in dollars cannot be enforced without `[model] price`: an error, not a budget
    /// that silently never stops anything.
    pub(super) fn dollar_budgets_need_a_price(
        &mut self,
        budgets: &BudgetLimits,
        routes: &[RouteSettings],
        price: Option<&Price>,
    ) {
        if price.is_some() {
            return;
        }
        let scopes = std::iter::once(("budgets".to_string(), budgets)).chain(
            routes
                .iter()
                .map(|route| (format!("routes.{}.budget", route.name), &route.budget)),
        );
        for (scope, limits) in scopes {
            if limits.has_dollars() {
                self.error(
                    &scope,
                    "a budget in dollars needs [model] price (US dollars per million tokens) to be enforced",
                );
            }
        }
    }
}
