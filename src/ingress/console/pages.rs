//! The console's pages: each reads what the control API serves (the same documents, priced the
//! same way) and renders it.

use minijinja::{Value, context};

use super::entry::{self, CallNames};
use super::{Console, Door, SCRIPT, STYLESHEET, see_other, with_headers};
use super::{charts, turns};
use crate::config::ToolRef;
use crate::ingress::api::{UsageDocument, UsageLimits};
use crate::ingress::control::{ControlError, no_event, no_session, not_found};
use crate::ingress::operations::Entries;
use crate::ingress::query::{Query, page, percent_decode};
use crate::ingress::response::HttpResponse;
use crate::store::{DeliveryState, EventFilter, EventStatus, SessionState};
use crate::usage::{DAY_MS, day_start};

/// Rows on one page of a list.
const PER_PAGE: i64 = 100;
/// The latest events a route's page lists.
const ROUTE_EVENTS_SHOWN: i64 = 20;
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
            ["routes"] => self.routes_page(door).await,
            ["routes", name] => self.route_page(&percent_decode(name), door).await,
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

    /// A page of the sessions that match the query (`state`, `route`, `key`), in key order.
    async fn sessions_page(&self, query: &Query, door: Door) -> Result<HttpResponse, ControlError> {
        let (sessions, next, problem) = match query.session_filter(PER_PAGE + 1) {
            Ok(filter) => {
                let rows = self.ops.store.sessions_page(filter).await?;
                let (rows, next) = page(rows, PER_PAGE, |s| s.key.clone());
                (rows, next, None)
            }
            Err(bad) => (Vec::new(), None, Some(bad.message)),
        };
        let states = SessionState::ALL.map(SessionState::sql);
        let values = context! {
            sessions, next, problem, states, routes => self.route_names(),
            state => query.given("state"), route => query.given("route"), key => query.given("key"),
            filter => query.kept(&["state", "route", "key"]),
        };
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
                let rerun_points: Vec<bool> = document
                    .transcript
                    .iter()
                    .map(entry::is_rerun_point)
                    .collect();
                let values = context! {
                    first_seq, last_seq, earlier, shown => ENTRIES_SHOWN, shown_entries,
                    rerun_points, ..Value::from_serialize(&document)
                };
                self.render("session.html", values, door)
            }
            None => no_session(key),
        })
    }

    /// A page of the events that match the query (`status`, `route`, `session`,
    /// `delivery_id`, `since`, `until`), newest first.
    async fn events_page(&self, query: &Query, door: Door) -> Result<HttpResponse, ControlError> {
        const FIELDS: [&str; 6] = [
            "status",
            "route",
            "session",
            "delivery_id",
            "since",
            "until",
        ];
        let (events, next, problem) = match query.event_filter(PER_PAGE + 1) {
            Ok(filter) => {
                let rows = self.ops.store.events(filter).await?;
                let (rows, next) = page(rows, PER_PAGE, |event| event.id.clone());
                (rows, next, None)
            }
            Err(bad) => (Vec::new(), None, Some(bad.message)),
        };
        let statuses = EventStatus::ALL.map(EventStatus::sql);
        let given: std::collections::BTreeMap<&str, String> = FIELDS
            .iter()
            .filter_map(|name| Some((*name, query.given(name)?)))
            .collect();
        let values = context! {
            events, next, problem, statuses, routes => self.route_names(), given,
            filter => query.kept(&FIELDS),
        };
        Ok(self.render("events.html", values, door))
    }

    /// The configured routes, each with its queued events.
    async fn routes_page(&self, door: Door) -> Result<HttpResponse, ControlError> {
        let queued: std::collections::BTreeMap<String, i64> = self
            .ops
            .store
            .queued_by_route()
            .await?
            .into_iter()
            .collect();
        let settings = self.ops.settings.get();
        let routes: Vec<Value> = settings
            .config
            .routes
            .iter()
            .map(|route| {
                let queued = queued.get(&route.name).copied().unwrap_or(0);
                context! { name => route.name, path => route.path, queued }
            })
            .collect();
        Ok(self.render("routes.html", context! { routes }, door))
    }

    /// One route: what the config says of it, its latest events, what it spent in the last
    /// days and its budgets.
    async fn route_page(&self, name: &str, door: Door) -> Result<HttpResponse, ControlError> {
        let settings = self.ops.settings.get();
        let Some(route) = settings.config.routes.iter().find(|r| r.name == name) else {
            return Ok(not_found(
                &http::Method::GET,
                &format!("/console/routes/{name}"),
            ));
        };
        let events = self
            .ops
            .store
            .events(EventFilter {
                route: Some(name.to_string()),
                limit: ROUTE_EVENTS_SHOWN,
                ..EventFilter::default()
            })
            .await?;
        let since = day_start(crate::store::now_millis()) - (charts::DAYS - 1) * DAY_MS;
        let days = self.ops.store.usage_by_day(since).await?;
        let usage = UsageDocument::of(days, since, Some(name), &UsageLimits::of(&settings.config));
        let tools: Vec<String> = route.tools.iter().map(ToolRef::to_string).collect();
        let values = context! {
            name, path => route.path, scheme => route.verify.scheme.name(), tools,
            priority => route.priority, interactive => route.interactive,
            on_busy => format!("{:?}", route.on_busy).to_lowercase(),
            events, shown => ROUTE_EVENTS_SHOWN, usage,
        };
        Ok(self.render("route.html", values, door))
    }

    /// The names of the configured routes, for the lists' filters.
    fn route_names(&self) -> Vec<String> {
        let settings = self.ops.settings.get();
        settings
            .config
            .routes
            .iter()
            .map(|r| r.name.clone())
            .collect()
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
