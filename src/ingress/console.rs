//! The web console on the control socket (docs/reference.md, "Console"): pages of what the
//! control API serves, for an operator's browser that reaches the socket through
//! `ssh -L 8788:/run/agentgate/control.sock`.
//!
//! Pages are rendered on the server with every value HTML-escaped, since a payload, a header, a
//! session key or a tool's output is a stranger's text. They use no script and no asset from
//! elsewhere, and a Content-Security-Policy forbids both. This version is read-only: decisions
//! and session actions are made with the command line.

use std::sync::LazyLock;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;
use minijinja::{AutoEscape, Environment, Value, context};

use super::control::{Control, ControlError, no_event, no_session};
use super::query::{Query, page, path_segment, percent_decode};
use super::response::{HttpResponse, error};

/// The pages, by template name, embedded in the binary.
const TEMPLATES: [(&str, &str); 6] = [
    ("layout.html", include_str!("console/layout.html")),
    ("overview.html", include_str!("console/overview.html")),
    ("sessions.html", include_str!("console/sessions.html")),
    ("session.html", include_str!("console/session.html")),
    ("event.html", include_str!("console/event.html")),
    ("approvals.html", include_str!("console/approvals.html")),
];

const STYLESHEET: &str = include_str!("console/style.css");

/// What a page may load: its own stylesheet, nothing else; forms post only to the console.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; form-action 'self'; \
     frame-ancestors 'none'; base-uri 'none'";

/// Sessions on one page of the list.
const SESSIONS_PER_PAGE: i64 = 100;
/// Approval requests the page lists at most.
const APPROVALS_SHOWN: i64 = 200;

static PAGES: LazyLock<Environment<'static>> = LazyLock::new(|| {
    let mut pages = Environment::new();
    pages.set_auto_escape_callback(|_| AutoEscape::Html);
    pages.add_filter("time", |millis: i64| crate::store::rfc3339(millis));
    pages.add_filter("pretty", |value: Value| {
        serde_json::to_string_pretty(&value).unwrap_or_default()
    });
    pages.add_filter("urlencode", |text: String| path_segment(&text));
    for (name, source) in TEMPLATES {
        // Fixed at build time; the unit test renders every page, so one that does not parse
        // fails the build's tests, not a request.
        if let Err(err) = pages.add_template(name, source) {
            tracing::error!(template = name, error = %err, "console page does not parse");
        }
    }
    pages
});

impl Control {
    /// `GET /console/...`: the page at `segments` (after `console`), or `None` for a path the
    /// console does not have.
    pub(super) async fn console(
        &self,
        segments: &[&str],
        query: Option<&str>,
    ) -> Option<Result<HttpResponse, ControlError>> {
        Some(match segments {
            [] | [""] => overview(self).await,
            ["style.css"] => Ok(stylesheet()),
            ["sessions"] => sessions(self, &Query::parse(query)).await,
            ["sessions", key] => session(self, &percent_decode(key)).await,
            ["events", id] => event(self, &percent_decode(id)).await,
            ["approvals"] => approvals(self).await,
            _ => return None,
        })
    }
}

async fn overview(control: &Control) -> Result<HttpResponse, ControlError> {
    let status = control.status_document().await?;
    Ok(render("overview.html", context! { status }))
}

/// A page of sessions, filtered by `state` and `route` (within the page).
async fn sessions(control: &Control, query: &Query) -> Result<HttpResponse, ControlError> {
    let (state, route) = (query.get("state"), query.get("route"));
    let rows = control
        .store
        .sessions_page(query.get("after"), SESSIONS_PER_PAGE + 1)
        .await?;
    let (rows, next) = page(rows, SESSIONS_PER_PAGE, |s| s.key.clone());
    let sessions: Vec<_> = rows
        .into_iter()
        .filter(|s| state.as_deref().is_none_or(|state| s.state.sql() == state))
        .filter(|s| route.as_deref().is_none_or(|route| s.route == route))
        .collect();
    Ok(render(
        "sessions.html",
        context! { sessions, next, state, route },
    ))
}

async fn session(control: &Control, key: &str) -> Result<HttpResponse, ControlError> {
    Ok(match control.session_document(key).await? {
        Some(document) => render("session.html", Value::from_serialize(&document)),
        None => no_session(key),
    })
}

async fn event(control: &Control, id: &str) -> Result<HttpResponse, ControlError> {
    Ok(match control.event_detail(id).await? {
        Some(event) => render("event.html", context! { event }),
        None => no_event(id),
    })
}

async fn approvals(control: &Control) -> Result<HttpResponse, ControlError> {
    let approvals = control.store.approvals(true, APPROVALS_SHOWN).await?;
    Ok(render("approvals.html", context! { approvals }))
}

/// The page `name` with `values`.
fn html(name: &str, values: Value) -> Result<String, minijinja::Error> {
    let values = context! { version => crate::VERSION, ..values };
    PAGES.get_template(name)?.render(values)
}

/// The page `name` with `values`, and the headers that keep it to itself.
fn render(name: &str, values: Value) -> HttpResponse {
    match html(name, values) {
        Ok(html) => with_headers(html, "text/html; charset=utf-8"),
        Err(err) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "console_page",
            &format!("the page could not be rendered: {err}"),
        ),
    }
}

fn stylesheet() -> HttpResponse {
    with_headers(STYLESHEET.to_string(), "text/css; charset=utf-8")
}

fn with_headers(body: String, content_type: &'static str) -> HttpResponse {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    let headers = response.headers_mut();
    let fixed = [
        (http::header::CONTENT_TYPE, content_type),
        (
            http::header::CONTENT_SECURITY_POLICY,
            CONTENT_SECURITY_POLICY,
        ),
        (http::header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (http::header::REFERRER_POLICY, "no-referrer"),
        (http::header::CACHE_CONTROL, "no-store"),
    ];
    for (name, value) in fixed {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_parses_and_escapes_what_it_shows() {
        for (name, _) in TEMPLATES {
            assert!(PAGES.get_template(name).is_ok(), "{name}");
        }
        let planted = "<script>alert(1)</script>";
        let event = serde_json::json!({
            "id": planted, "route": "r", "session": planted, "event_type": planted,
            "status": "completed", "received_at": 0, "turns": [],
            "headers": {"x": planted}, "payload": {"body": planted},
        });
        let html = html(
            "event.html",
            context! { event => Value::from_serialize(&event) },
        )
        .expect("the event page renders");
        assert!(html.contains("&lt;script&gt;"), "{html}");
        assert!(!html.contains("<script>"), "{html}");
        assert!(html.contains("/console/sessions/%3Cscript%3Ealert%281%29%3C%2Fscript%3E"));
    }
}
