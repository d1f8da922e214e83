//! The console's pages: each reads what the control API serves (the same documents, priced the
//! same way) and renders it.

use minijinja::{Value, context};

use super::entry::{self, CallNames};
use super::{Console, Door, SCRIPT, STYLESHEET, see_other, with_headers};
use super::{charts, turns};
use crate::ingress::api::UsageLimits;
use crate::ingress::control::{ControlError, no_event, no_session, not_found};
use crate::ingress::operations::Entries;
use crate::ingress::query::{Query, page, percent_decode};
use crate::ingress::response::HttpResponse;
use crate::store::{DeliveryState, EventFilter, EventStatus};
use crate::usage::{DAY_MS, day_start};

/// Rows on one page of a list.
const PER_PAGE: i64 = 100;
/// Approval requests the page lists at most.
const APPROVALS_SHOWN: i64 = 200;
/// The latest transcript entries a session page shows (the command line shows all).
const ENTRIES_SHOWN: i64 = 500;
/// The transcript entries of an event's turns its page reads at most, for their steps and
/// timelines.
const EVENT_ENTRIES_READ: i64 = 2000;
/// Deliveries of each state the page lists at most (failed first).
const DELIVERIES_SHOWN: i64 = 200;

impl Console {
    /// `GET /console/...`: the page at `segments` (after `console`).
    pub(super) async fn page(
        &self,
        segments: &[&str],
        query: Option<&str>,
        door: Door,
    ) -> HttpResponse {
        let query = Query::parse(query);
        let page = match segments {
            [] | [""] => self.overview(door).await,
            ["style.css"] => Ok(with_headers(
                STYLESHEET.to_string(),
                "text/css; charset=utf-8",
            )),
            ["live.js"] => Ok(with_headers(
                SCRIPT.to_string(),
                "text/javascript; charset=utf-8",
            )),
            ["login"] => Ok(match door {
                Door::Listen => self.render("login.html", context! {}, door),
                Door::Socket => see_other("/console/"),
            }),
            ["sessions"] => self.sessions_page(&query, door).await,
            ["sessions", key] => self.session_page(&percent_decode(key), door).await,
            ["events"] => self.events_page(&query, door).await,
            ["events", id] => self.event_page(&percent_decode(id), door).await,
            ["deliveries"] => self.deliveries_page(door).await,
            ["approvals"] => self.approvals_page(door).await,
            ["ledger"] => self.ledger_page(door).await,
            ["what-if"] => Ok(self.what_if_list(door).await),
            ["what-if", name] => Ok(self.what_if_report(&percent_decode(name), door).await),
            _ => Ok(not_found(
                &http::Method::GET,
                &format!("/console/{}", segments.join("/")),
            )),
        };
        page.unwrap_or_else(|err| {
            self.refused_page(
                http::StatusCode::SERVICE_UNAVAILABLE,
                &err.to_string(),
                door,
            )
        })
    }

    /// The status figures, and what the daemon did since it started, per minute.
    async fn overview(&self, door: Door) -> Result<HttpResponse, ControlError> {
        let status = self.ops.status_document().await?;
        let done = crate::metrics::activity();
        let minutes = self.started.elapsed().as_secs() / 60;
        let rates = [
            ("webhooks accepted", done.accepted),
            ("webhooks refused", done.refused),
            ("turns completed", done.turns_completed),
            ("turns failed, interrupted or cancelled", done.turns_failed),
            ("results delivered", done.delivered),
            ("delivery attempts failed", done.delivery_failures),
        ]
        .map(|(what, total)| {
            let per_minute = format!("{:.1}", total as f64 / minutes.max(1) as f64);
            context! { what, total, per_minute }
        });
        let (hour, day) = charts::activity(&crate::metrics::recent::last_day());
        let now = crate::store::now_millis();
        let since = day_start(now) - (charts::DAYS - 1) * DAY_MS;
        let days = self.ops.store.usage_by_day(since).await?;
        let limits = UsageLimits::of(&self.ops.settings.get().config);
        let spending = charts::spending(&days, &limits, now);
        let values = context! { status, rates, minutes, hour, day, spending };
        Ok(self.render("overview.html", values, door))
    }

    /// A page of sessions, filtered by `state` and `route` (within the page).
    async fn sessions_page(&self, query: &Query, door: Door) -> Result<HttpResponse, ControlError> {
        let (state, route) = (query.get("state"), query.get("route"));
        let rows = self
            .ops
            .store
            .sessions_page(query.get("after"), PER_PAGE + 1)
            .await?;
        let (rows, next) = page(rows, PER_PAGE, |s| s.key.clone());
        let sessions: Vec<_> = rows
            .into_iter()
            .filter(|s| state.as_deref().is_none_or(|state| s.state.sql() == state))
            .filter(|s| route.as_deref().is_none_or(|route| s.route == route))
            .collect();
        let values = context! { sessions, next, state, route };
        Ok(self.render("sessions.html", values, door))
    }

    async fn session_page(&self, key: &str, door: Door) -> Result<HttpResponse, ControlError> {
        let shown = Entries::Latest(ENTRIES_SHOWN);
        Ok(match self.ops.session_document(key, shown).await? {
            Some((document, earlier)) => {
                let first_seq = document.transcript.first().map_or(1, |entry| entry.seq);
                let last_seq = document.transcript.last().map(|entry| entry.seq);
                let mut names = CallNames::default();
                let shown_entries: Vec<Value> = document
                    .transcript
                    .iter()
                    .map(|row| Value::from_safe_string(entry::render(row, &mut names)))
                    .collect();
                let values = context! {
                    first_seq, last_seq, earlier, shown => ENTRIES_SHOWN, shown_entries,
                    ..Value::from_serialize(&document)
                };
                self.render("session.html", values, door)
            }
            None => no_session(key),
        })
    }

    /// A page of events, newest first, filtered by `status`, `route` and `session`.
    async fn events_page(&self, query: &Query, door: Door) -> Result<HttpResponse, ControlError> {
        let status_name = query.get("status").filter(|name| !name.is_empty());
        let status = status_name.as_deref().and_then(EventStatus::from_name);
        let filter = EventFilter {
            status,
            route: query.get("route").filter(|route| !route.is_empty()),
            session: query.get("session").filter(|key| !key.is_empty()),
            limit: PER_PAGE + 1,
            before: query.get("before"),
        };
        let (route, session) = (filter.route.clone(), filter.session.clone());
        let unknown_status = status_name.is_some() && status.is_none();
        let events = if unknown_status {
            Vec::new()
        } else {
            self.ops.store.events(filter).await?
        };
        let (events, next) = page(events, PER_PAGE, |event| event.id.clone());
        let values = context! {
            events, next, status => status_name, route, session, unknown_status,
        };
        Ok(self.render("events.html", values, door))
    }

    /// An event, with each of its turns' steps and timeline.
    async fn event_page(&self, id: &str, door: Door) -> Result<HttpResponse, ControlError> {
        let Some(event) = self.ops.event_detail(id).await? else {
            return Ok(no_event(id));
        };
        let entries = self
            .ops
            .store
            .event_transcript(id, EVENT_ENTRIES_READ + 1)
            .await?;
        let more_entries = entries.len() as i64 > EVENT_ENTRIES_READ;
        let settings = self.ops.settings.get();
        let turns = turns::views(
            &event.turns,
            &entries[..entries.len().min(EVENT_ENTRIES_READ as usize)],
            event.delivery.as_ref(),
            settings.config.model.price.as_ref(),
        );
        let trace_link = event
            .trace_id
            .as_deref()
            .and_then(|id| settings.config.console.trace_link(id));
        let values =
            context! { event, turns, trace_link, more_entries, shown => EVENT_ENTRIES_READ };
        Ok(self.render("event.html", values, door))
    }

    /// The outbox: failed deliveries first, then pending, then the latest delivered.
    async fn deliveries_page(&self, door: Door) -> Result<HttpResponse, ControlError> {
        let mut groups = Vec::new();
        for state in [
            DeliveryState::Failed,
            DeliveryState::Pending,
            DeliveryState::Delivered,
        ] {
            let rows = self
                .ops
                .store
                .deliveries(Some(state), DELIVERIES_SHOWN)
                .await?;
            groups.push(context! { state => state.sql(), rows });
        }
        Ok(self.render("deliveries.html", context! { groups }, door))
    }

    async fn approvals_page(&self, door: Door) -> Result<HttpResponse, ControlError> {
        let approvals = self.ops.store.approvals(true, APPROVALS_SHOWN).await?;
        Ok(self.render("approvals.html", context! { approvals }, door))
    }

    /// The retry ledger: how often each session was resumed.
    async fn ledger_page(&self, door: Door) -> Result<HttpResponse, ControlError> {
        let ledger = self.ops.store.resume_ledger().await?;
        let entries: Vec<_> = ledger
            .sessions
            .iter()
            .map(|(key, entry)| context! { key, attempts => entry.attempts, last_attempt => entry.last_attempt })
            .collect();
        let threshold = self.ops.settings.get().config.runtime.resume_max_attempts;
        Ok(self.render("ledger.html", context! { entries, threshold }, door))
    }
}
