//! Approval links on the webhook listener (docs/reference.md, "Approvals"):
//! `{public_url}/approvals/{id}/{approve|deny}?h=..&t=..`, sent in the `approval_request`
//! delivery to whoever decides.
//!
//! `GET` only shows what is asked (tool, arguments, session, event, expiry) with a confirm
//! button: chat apps and mail scanners fetch links to preview them, and a fetch must decide
//! nothing. Only the `POST` of that button decides, as "link". A link carries a token that only
//! agentgate can make, bound to the request, its arguments and its action; it works while the
//! request is pending, so once: a tampered link gets 403, a used or expired one 410.

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use super::query::Query;
use super::response::{HttpResponse, refused};
use crate::config::Config;
use crate::session::Sessions;
use crate::session::approval::{self, APPROVE, DENY, LINK_HASH_CHARS, Outcome};
use crate::store::approval::Verdict;
use crate::store::{ApprovalRow, ApprovalStatus, Decided, Store};

/// The most a confirm form's body may be (the reason field).
const MAX_FORM: usize = 8 * 1024;
/// Who a link's decision is recorded as made by.
const BY_LINK: &str = "link";

/// Answers a request under `/approvals/`: `Ok` with the page, `Err` with a refusal (logged and
/// counted by the listener like any other).
pub(super) async fn answer<B>(
    request: Request<B>,
    store: &Store,
    config: &Config,
    sessions: &Sessions,
) -> Result<HttpResponse, HttpResponse>
where
    B: hyper::body::Body<Data = Bytes> + Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let path = request.uri().path().to_string();
    let Some((id, action)) = path
        .strip_prefix("/approvals/")
        .and_then(|rest| rest.split_once('/'))
    else {
        return Err(refusal(
            StatusCode::NOT_FOUND,
            "no_approval",
            "no such link",
        ));
    };
    let verdict = match action {
        APPROVE => Verdict::Approve,
        DENY => Verdict::Deny,
        _ => {
            return Err(refusal(
                StatusCode::NOT_FOUND,
                "no_approval",
                "no such link",
            ));
        }
    };
    let row = linked_request(store, id, action, request.uri().query()).await?;
    match *request.method() {
        Method::GET | Method::HEAD => Ok(page(StatusCode::OK, &confirm_page(&row, verdict))),
        Method::POST => {
            let note = form_reason(request).await?;
            let outcome = approval::decide(
                store,
                config,
                sessions,
                &row.id,
                verdict,
                (BY_LINK.to_string(), note),
            )
            .await
            .map_err(store_unavailable)?;
            Ok(decided_page(outcome))
        }
        _ => Err(refusal(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "GET shows the request, POST decides it",
        )),
    }
}

/// The pending request `id` names, if the link's query (`h`, `t`) was made for it and for
/// `action`: else 404 (no such request), 403 (a tampered link) or 410 (decided or expired).
async fn linked_request(
    store: &Store,
    id: &str,
    action: &str,
    query: Option<&str>,
) -> Result<ApprovalRow, HttpResponse> {
    let query = Query::parse(query);
    let param = |name: &str| query.get(name).unwrap_or_default();
    let row = store
        .approval(id)
        .await
        .map_err(store_unavailable)?
        .ok_or_else(|| {
            refusal(
                StatusCode::NOT_FOUND,
                "no_approval",
                "no such approval request",
            )
        })?;
    let hash = crate::signature::arguments_hash(&row.arguments);
    let authentic = param("h") == hash[..LINK_HASH_CHARS]
        && crate::signature::approval_token_matches(
            &row.link_secret,
            action,
            &row.id,
            &row.arguments,
            &param("t"),
        );
    if !authentic {
        return Err(refusal(
            StatusCode::FORBIDDEN,
            "bad_link",
            "the link's token does not match this request and its arguments",
        ));
    }
    if row.status != ApprovalStatus::Pending || row.expires_at <= crate::store::now_millis() {
        return Err(gone(&row));
    }
    Ok(row)
}

/// The `reason` field of the confirm form, if any.
async fn form_reason<B>(request: Request<B>) -> Result<Option<String>, HttpResponse>
where
    B: hyper::body::Body<Data = Bytes> + Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let body = http_body_util::Limited::new(request.into_body(), MAX_FORM)
        .collect()
        .await
        .map_err(|_| {
            refusal(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "the form is too long",
            )
        })?
        .to_bytes();
    Ok(form_urlencoded::parse(&body)
        .find(|(key, _)| key == "reason")
        .map(|(_, value)| value.trim().to_string())
        .filter(|value| !value.is_empty()))
}

/// The answer to a confirm button's POST: the page that says what was decided, or the refusal.
fn decided_page(outcome: Outcome) -> HttpResponse {
    match outcome {
        Outcome::Decided(Decided::Taken(row)) => page(
            StatusCode::OK,
            &format!(
                "<h1>{}</h1><p>The request for <code>{}</code> is {}; the agent's turn goes on.</p>",
                escape(&row.status.to_string()),
                escape(&row.tool),
                escape(&row.status.to_string())
            ),
        ),
        Outcome::Decided(Decided::Already(row) | Decided::Expired(row)) => gone(&row),
        Outcome::Decided(Decided::Unknown) => refusal(
            StatusCode::NOT_FOUND,
            "no_approval",
            "no such approval request",
        ),
        Outcome::ToolGone(row) => refusal(
            StatusCode::CONFLICT,
            "tool_removed",
            &format!(
                "route {:?} no longer offers the tool {:?}: the request is denied",
                row.route, row.tool
            ),
        ),
    }
}

/// 410: the request is decided or expired; the link does nothing any more.
fn gone(row: &ApprovalRow) -> HttpResponse {
    let message = match row.status {
        ApprovalStatus::Pending | ApprovalStatus::Expired => {
            "this request expired without a decision; the link does nothing".to_string()
        }
        ApprovalStatus::Approved | ApprovalStatus::Denied => format!(
            "this request is already decided ({}); the link does nothing",
            row.status
        ),
    };
    refusal(StatusCode::GONE, "approval_closed", &message)
}

/// The page a `GET` shows: what is asked, and one button that decides.
fn confirm_page(row: &ApprovalRow, verdict: Verdict) -> String {
    let (title, button, reason) = match verdict {
        Verdict::Approve => ("Approve this tool call?", "Approve", ""),
        Verdict::Deny => (
            "Deny this tool call?",
            "Deny",
            "<p><label>Reason (the agent is told): <input name=\"reason\" maxlength=\"2000\"></label></p>",
        ),
    };
    let arguments =
        serde_json::to_string_pretty(&row.arguments).unwrap_or_else(|_| row.arguments.to_string());
    format!(
        "<h1>{title}</h1>
<table>
<tr><th>Tool</th><td><code>{tool}</code></td></tr>
<tr><th>Arguments</th><td><pre>{arguments}</pre></td></tr>
<tr><th>Session</th><td>{session}</td></tr>
<tr><th>Event</th><td>{event}</td></tr>
<tr><th>Route</th><td>{route}</td></tr>
<tr><th>Expires</th><td>{expires}</td></tr>
</table>
<form method=\"post\">{reason}<button type=\"submit\">{button}</button></form>",
        tool = escape(&row.tool),
        arguments = escape(&arguments),
        session = escape(&row.session),
        event = escape(&row.event_id),
        route = escape(&row.route),
        expires = crate::store::rfc3339(row.expires_at),
    )
}

/// An HTML page that loads nothing, runs nothing and is not framed or cached.
fn page(status: StatusCode, body: &str) -> HttpResponse {
    let html = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>agentgate approval</title>\
         <meta name=\"viewport\" content=\"width=device-width\"></head><body>{body}</body></html>"
    );
    let mut response = Response::new(Full::new(Bytes::from(html)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'none'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// 503: the state could not be read or written; the link still works later.
fn store_unavailable(err: crate::store::StoreError) -> HttpResponse {
    refusal(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        &err.to_string(),
    )
}

fn refusal(status: StatusCode, code: &'static str, message: &str) -> HttpResponse {
    refused(status, code, code, message)
}

/// Text for HTML: payloads and models wrote the arguments.
fn escape(text: &str) -> String {
    minijinja::HtmlEscape(&crate::untrusted::for_terminal(text)).to_string()
}
