//! The web console (docs/reference.md, "Console"): pages of what the control API serves, and
//! the operator's actions as forms, for a browser that reaches the control socket through
//! `ssh -L 8788:/run/agentgate/control.sock`, or `[console] listen` with the token.
//!
//! Pages are rendered on the server with every value HTML-escaped, since a payload, a header, a
//! session key or a tool's output is a stranger's text. They load nothing from elsewhere, and a
//! Content-Security-Policy forbids it. One small script of the console's own makes a session's
//! transcript live; without it, every page still reads and every action still works. Who may
//! use the console, and how its forms stay its own, is `guard`.

mod actions;
mod charts;
mod entry;
mod guard;
mod live;
mod pages;
mod turns;
mod whatif;

use std::convert::Infallible;
use std::sync::LazyLock;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use minijinja::{AutoEscape, Environment, Value, context};

pub(crate) use guard::Door;
use guard::{COOKIE, ConsoleKey, Logins, Refusal};

use super::body::BodyError;
use super::connection::RequestBody;
use super::follow::Streams;
use super::operations::Operations;
use super::query::{Query, path_segment};
use super::response::{Counted, HttpResponse, RefusalReason, request_timeout};

/// A console answer: a page, or the live transcript's stream.
pub(crate) type ConsoleBody = UnsyncBoxBody<Bytes, Infallible>;
pub(crate) type ConsoleResponse = Response<ConsoleBody>;

/// The pages, by template name, embedded in the binary.
const TEMPLATES: [(&str, &str); 20] = [
    ("layout.html", include_str!("layout.html")),
    ("overview.html", include_str!("overview.html")),
    ("sessions.html", include_str!("sessions.html")),
    ("session.html", include_str!("session.html")),
    ("entry.html", include_str!("entry.html")),
    ("events.html", include_str!("events.html")),
    ("event_table.html", include_str!("event_table.html")),
    ("routes.html", include_str!("routes.html")),
    ("route.html", include_str!("route.html")),
    ("event.html", include_str!("event.html")),
    ("deliveries.html", include_str!("deliveries.html")),
    ("approvals.html", include_str!("approvals.html")),
    ("ledger.html", include_str!("ledger.html")),
    ("whatif_list.html", include_str!("whatif_list.html")),
    ("whatif.html", include_str!("whatif.html")),
    ("login.html", include_str!("login.html")),
    ("refused.html", include_str!("refused.html")),
    // The approval links' pages, on the webhook listener (`ingress/approval_link.rs`).
    ("link_layout.html", include_str!("link_layout.html")),
    ("link_confirm.html", include_str!("link_confirm.html")),
    ("link_decided.html", include_str!("link_decided.html")),
];

const STYLESHEET: &str = include_str!("style.css");
const SCRIPT: &str = include_str!("live.js");

/// What a page may load: its own stylesheet and script, and the live transcript from its own
/// origin; forms post only to the console.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; script-src 'self'; \
     connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

static PAGES: LazyLock<Environment<'static>> = LazyLock::new(|| {
    let mut pages = Environment::new();
    pages.set_auto_escape_callback(|_| AutoEscape::Html);
    pages.add_filter("time", |millis: i64| crate::store::rfc3339(millis));
    pages.add_filter("pretty", |value: Value| {
        serde_json::to_string_pretty(&value).unwrap_or_default()
    });
    pages.add_filter("urlencode", |text: String| path_segment(&text));
    pages.add_filter("seconds", seconds);
    pages.add_filter("usd", |cost: f64| format!("{cost:.6}"));
    for (name, source) in TEMPLATES {
        // Fixed at build time; the unit test renders every page, so one that does not parse
        // fails the build's tests, not a request.
        if let Err(err) = pages.add_template(name, source) {
            tracing::error!(template = name, error = %err, "console page does not parse");
        }
    }
    pages
});

/// The console: its pages and forms over what the operator reads and does (`Operations`, as
/// the control API serves them), and what it keeps for the daemon's run.
pub(crate) struct Console {
    ops: Operations,
    /// The key of this run's form tokens.
    key: ConsoleKey,
    /// The logins on `[console] listen`, and the failed ones by address.
    logins: Logins,
    /// The slots of followed sessions: live transcripts and `sessions follow`.
    streams: Streams,
    /// When the daemon started: the overview's rates are since then.
    started: Instant,
}

impl Console {
    /// The slots of followed sessions, which `GET /v1/sessions/{key}/follow` shares.
    pub(in crate::ingress) fn streams(&self) -> &Streams {
        &self.streams
    }

    pub(crate) fn new(ops: Operations) -> Result<Console, getrandom::Error> {
        Ok(Console {
            ops,
            key: ConsoleKey::generate()?,
            logins: Logins::default(),
            streams: Streams::new(),
            started: Instant::now(),
        })
    }

    /// A request under `/console/` that came in at `door`: whether it may be served is decided
    /// here (see `guard`), then a page, the live stream or an action answers it.
    pub(super) async fn request(
        &self,
        request: Request<RequestBody>,
        door: Door,
        peer: Option<std::net::IpAddr>,
    ) -> ConsoleResponse {
        // The settings in effect, held (not copied: they include the TLS key) for the request.
        let settings = self.ops.settings.get();
        let console = &settings.config.console;
        let path = request.uri().path().to_string();
        let segments: Vec<&str> = path.trim_matches('/').split('/').skip(1).collect();
        if !console.enabled {
            return boxed(super::control::not_found(request.method(), &path));
        }
        let public = matches!(segments.as_slice(), ["login"] | ["style.css"]);
        let refusal = match door {
            Door::Socket if !guard::loopback_host(request.headers()) => Some(Refusal::Host),
            Door::Listen if !public => match &console.token {
                Some(token) if self.logins.logged_in(token, request.headers()) => None,
                _ if request.method() == Method::GET => return boxed(see_other("/console/login")),
                _ => Some(Refusal::NotLoggedIn),
            },
            Door::Socket | Door::Listen => None,
        };
        let refusal = refusal.or_else(|| {
            (request.method() == Method::POST && !guard::same_origin(request.headers()))
                .then_some(Refusal::CrossSite)
        });
        if let Some(refusal) = refusal {
            return boxed(self.refuse(refusal, door, &path));
        }
        let query = request.uri().query().map(str::to_string);
        match (request.method(), segments.as_slice()) {
            (&Method::GET, ["sessions", key, "live"]) => {
                let after = live::start_after(request.headers(), query.as_deref());
                self.live_transcript(&super::query::percent_decode(key), after)
                    .await
            }
            (&Method::GET, _) => boxed(self.page(&segments, query.as_deref(), door).await),
            (&Method::POST, ["login"]) => boxed(self.login(request, door, peer, console).await),
            (&Method::POST, ["logout"]) => {
                self.logins.log_out(request.headers());
                boxed(actions::logged_out(console.tls.is_some()))
            }
            (&Method::POST, _) => boxed(self.act(&segments, request, door).await),
            _ => boxed(super::response::error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "the console answers GET and POST",
            )),
        }
    }

    /// Counts and logs the refusal, and tells the browser why (a login refused, on the login
    /// page again).
    fn refuse(&self, refusal: Refusal, door: Door, path: &str) -> HttpResponse {
        self.key.refused(refusal, door, path);
        let (status, page) = match refusal {
            Refusal::NotLoggedIn | Refusal::WrongToken => (StatusCode::UNAUTHORIZED, "login.html"),
            Refusal::Throttled => (StatusCode::TOO_MANY_REQUESTS, "login.html"),
            Refusal::Host | Refusal::CrossSite | Refusal::FormToken | Refusal::Tls => {
                (StatusCode::FORBIDDEN, "refused.html")
            }
        };
        let values = context! { message => refusal.message(), status => status.as_u16() };
        let mut page = self.render(page, values, door);
        *page.status_mut() = status;
        page.extensions_mut().insert(Counted);
        page
    }

    /// A connection to `[console] listen` that never got through its TLS handshake: counted and
    /// logged as the console's refusals are.
    pub(crate) fn handshake_failed(&self) {
        self.key.refused(Refusal::Tls, Door::Listen, "");
    }

    /// A page that says why something was not done, with status `status`.
    fn refused_page(&self, status: StatusCode, message: &str, door: Door) -> HttpResponse {
        let mut page = self.render(
            "refused.html",
            context! { message, status => status.as_u16() },
            door,
        );
        *page.status_mut() = status;
        page.extensions_mut().insert(RefusalReason {
            reason: "action_refused",
            message: message.to_string(),
        });
        page
    }

    /// The page `name` with `values`, and the headers that keep it to itself.
    fn render(&self, name: &str, values: Value, door: Door) -> HttpResponse {
        let values = context! {
            version => crate::VERSION,
            csrf => self.key.form_token(),
            logout => door == Door::Listen && name != "login.html",
            ..values
        };
        match html(name, values) {
            Ok(html) => with_headers(html, "text/html; charset=utf-8"),
            Err(err) => super::response::error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "console_page",
                &format!("the page could not be rendered: {err}"),
            ),
        }
    }
}

/// The page `name` with `values`, every value HTML-escaped: the console's own, and the approval
/// links' pages, which the webhook listener serves with headers of their own.
pub(crate) fn html(name: &str, values: Value) -> Result<String, minijinja::Error> {
    PAGES.get_template(name)?.render(values)
}

/// A duration of `millis` milliseconds as people read it: `850 ms`, `12.3 s`.
fn seconds(millis: i64) -> String {
    if millis.abs() < 1000 {
        format!("{millis} ms")
    } else {
        format!("{:.1} s", millis as f64 / 1000.0)
    }
}

/// A page as the console's answer body.
pub(super) fn boxed(response: HttpResponse) -> ConsoleResponse {
    response.map(|body| body.map_err(|never| match never {}).boxed_unsync())
}

/// `303 See Other` to `location` (after a form, to the page that shows what it did).
pub(super) fn see_other(location: &str) -> HttpResponse {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(location) = HeaderValue::from_str(location) {
        response
            .headers_mut()
            .insert(http::header::LOCATION, location);
    }
    response
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
        // Not `no-referrer`: with it a browser sends `Origin: null` on the console's own forms,
        // and the origin check needs the real one. Other sites get no referrer.
        (http::header::REFERRER_POLICY, "same-origin"),
        (http::header::CACHE_CONTROL, "no-store"),
    ];
    for (name, value) in fixed {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

impl Console {
    /// The fields of a form body (`application/x-www-form-urlencoded`), at most `MAX_FORM`
    /// bytes: `None` for a longer one or one that is not text, `Err` (`408`) for one that did
    /// not come in time.
    async fn form(&self, request: Request<RequestBody>) -> Result<Option<Query>, HttpResponse> {
        /// A console form holds a token, an id and a note of at most 2,000 characters.
        const MAX_FORM: usize = 16 * 1024;
        let body = match self.ops.read_body(request.into_body(), MAX_FORM).await {
            Ok(body) => body,
            Err(BodyError::TimedOut) => return Err(request_timeout()),
            Err(BodyError::TooLarge | BodyError::Unreadable | BodyError::NoSlot) => {
                return Ok(None);
            }
        };
        Ok(std::str::from_utf8(&body)
            .ok()
            .map(|text| Query::parse(Some(text))))
    }
}

/// The `Set-Cookie` value that logs a browser in (`Some`) or out (`None`): only for the
/// console's paths, never sent by another site's requests, out of reach of scripts, and over
/// HTTPS only when the console speaks it (`secure`).
fn login_cookie_header(value: Option<&str>, secure: bool) -> String {
    let attributes = if secure {
        "Path=/console; HttpOnly; SameSite=Strict; Secure"
    } else {
        "Path=/console; HttpOnly; SameSite=Strict"
    };
    match value {
        Some(value) => format!("{COOKIE}={value}; {attributes}"),
        None => format!("{COOKIE}=; Max-Age=0; {attributes}"),
    }
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
        let html = PAGES
            .get_template("event.html")
            .and_then(|page| page.render(context! { event => Value::from_serialize(&event) }))
            .expect("the event page renders");
        assert!(html.contains("&lt;script&gt;"), "{html}");
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(html.contains("/console/sessions/%3Cscript%3Ealert%281%29%3C%2Fscript%3E"));
    }

    /// With `trace_url`, each turn's timeline links to the event's trace.
    #[test]
    fn a_timeline_links_to_the_trace() {
        let event = serde_json::json!({"id": "e1", "session": "s", "received_at": 0, "turns": []});
        let turn = serde_json::json!({"id": "t1", "status": "completed", "started_at": 0,
            "took_ms": 5, "usage": {"cost_usd": null}, "steps": [], "steps_took_ms": 0, "timeline": [],
            "axis_ms": 5});
        let render = |trace_link: Option<&str>| {
            let values = context! { event => Value::from_serialize(&event),
            turns => Value::from_serialize([&turn]), trace_link };
            PAGES
                .get_template("event.html")
                .and_then(|page| page.render(values))
                .expect("the event page renders")
        };
        let linked = render(Some("https://traces.example/t/0af7"));
        assert!(
            linked.contains(
                "<h4>Timeline · <a href=\"https:&#x2f;&#x2f;traces.example&#x2f;t&#x2f;0af7\""
            ),
            "{linked}"
        );
        assert!(!render(None).contains("the trace</a>"));
    }
}
