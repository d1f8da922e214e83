//! The budgets at a model request (docs/reference.md, "Budgets"): before it is sent, what it may
//! spend is reserved against every budget of its turn, beside what other requests in flight
//! hold, on every node; the reply's usage settles it when its step is committed, and a request
//! that gets no reply gives it back. A turn whose budget is used up ends; one whose budget is
//! only held by requests in flight waits for them to settle.

use std::sync::Arc;
use std::time::Duration;

use super::super::budget::{Budgets, Reached, request_ceiling, window_id};
use super::{READING, Running, Stop};
use crate::agent::catalog::OfferedTool;
use crate::agent::message::Message;
use crate::metrics;
use crate::store::{Fits, Reservation, now_millis};
use crate::usage::{Spending, Spent, day_start};

/// The first pause of a request waiting for room that requests in flight hold; each next one
/// doubles, up to the last.
const ROOM_FIRST_PAUSE: Duration = Duration::from_millis(50);
const ROOM_LAST_PAUSE: Duration = Duration::from_secs(1);

/// What the budgets say before a model request.
pub(super) enum Budgeted {
    /// The request may be sent; with budgets, what its windows had spent before it (for the
    /// warnings after its reply), and its reservation is held.
    Go(Option<Spending>),
    /// A budget is used up: the turn ends `failed` with this error.
    Exceeded(String),
    /// The turn was stopped while it waited for room.
    Stopped(Stop),
    /// The turns are being cancelled, or the session was taken over, while the store was read.
    Gone,
}

impl Running<'_> {
    /// Reserves what a request of `messages` and `tools` may spend against the route's
    /// budgets, waiting while requests in flight hold what is left of one. Budgets past
    /// `warn_at` are logged once per window.
    pub(super) async fn reserve_budget(
        &self,
        messages: &[Message],
        tools: &[OfferedTool],
    ) -> Budgeted {
        let config = &self.settings.config;
        let budgets = Budgets::for_route(&config.budgets, &self.route.budget);
        if budgets.is_empty() {
            return Budgeted::Go(None);
        }
        let price = config.model.price;
        let event = &self.turn.event;
        let reservation = Reservation {
            turn_id: self.turn.turn_id.clone(),
            event_id: event.id.clone(),
            session_key: event.session_key.clone(),
            route: event.route.clone(),
            day_start: day_start(now_millis()),
            tokens: request_ceiling(request_bytes(messages, tools), &config.model.params),
            counted: budgets.counted(),
        };
        let mut pause = ROOM_FIRST_PAUSE;
        loop {
            let fits: Fits = {
                let budgets = budgets.clone();
                Arc::new(move |with_held: &Spending| budgets.fit(with_held, price.as_ref()))
            };
            let Some(reserving) = self
                .context
                .retrying(READING, |store| {
                    let (reservation, fits) = (reservation.clone(), fits.clone());
                    async move { store.reserve_budget(reservation, fits).await }
                })
                .await
            else {
                return Budgeted::Gone;
            };
            let verdict = budgets.check(&reserving.spent, price.as_ref());
            self.warn(&verdict.warnings, reservation.day_start);
            if let Some(exceeded) = verdict.exceeded {
                let budget = exceeded.budget.key(&event.route);
                metrics::budget_exceeded(&event.route, &budget);
                let error = format!("budget exceeded: {}", exceeded.describe(&event.route));
                tracing::warn!(budget = %budget, error = %error,
                    "a budget is used up; the turn ends without another model request");
                return Budgeted::Exceeded(error);
            }
            if reserving.reserved {
                return Budgeted::Go(Some(reserving.spent));
            }
            // What is left of a budget is held by requests in flight: their replies settle it.
            if let Err(stop) = self.unless_stopped(tokio::time::sleep(pause)).await {
                return Budgeted::Stopped(stop);
            }
            pause = (pause * 2).min(ROOM_LAST_PAUSE);
        }
    }

    /// After a request: a reply's step adds to what its windows had spent (`before`), and the
    /// budgets it took past `warn_at` are logged; a request without a reply gives its
    /// reservation back.
    pub(super) async fn settle_budget(&self, before: Option<Spending>, replied: Option<Spent>) {
        let Some(before) = before else {
            return;
        };
        let Some(step) = replied else {
            if let Err(err) = self.context.store.release_budget(&self.turn.turn_id).await {
                tracing::warn!(error = %err,
                    "cannot give back a failed model request's budget reservation; it ends with the turn");
            }
            return;
        };
        let config = &self.settings.config;
        let budgets = Budgets::for_route(&config.budgets, &self.route.budget);
        let after = Budgets::after(&before, step);
        let verdict = budgets.check(&after, config.model.price.as_ref());
        self.warn(&verdict.warnings, day_start(now_millis()));
    }

    /// Logs and counts each budget in `warnings` the first time its window passes `warn_at`.
    fn warn(&self, warnings: &[Reached], day: i64) {
        let event = &self.turn.event;
        for reached in warnings {
            let window = window_id(reached, &event.route, &event.id, &event.session_key, day);
            if self.context.budget_warnings.first_time(window) {
                let budget = reached.budget.key(&event.route);
                metrics::budget_warning(&event.route, &budget);
                tracing::warn!(budget = %budget, detail = %reached.describe(&event.route),
                    "a budget is nearly used up (warn_at)");
            }
        }
    }
}

/// The bytes of a request's messages and tools as JSON, counted without building it.
fn request_bytes(messages: &[Message], tools: &[OfferedTool]) -> u64 {
    let mut counter = ByteCount(0);
    let _ = serde_json::to_writer(&mut counter, messages);
    for tool in tools {
        // The definition's frame (`{"type":"function","function":{...}}`) is about 64 bytes.
        counter.0 += 64 + (tool.name.len() + tool.description.len()) as u64;
        let _ = serde_json::to_writer(&mut counter, &tool.parameters);
    }
    counter.0
}

/// A writer that only counts what is written to it.
struct ByteCount(u64);

impl std::io::Write for ByteCount {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len() as u64;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
