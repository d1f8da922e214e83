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
use minijinja::context;

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
        Method::GET | Method::HEAD => Ok(confirm_page(&row, action)),
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
        Outcome::Decided(Decided::Taken(row)) => {
            let values = context! { status => row.status.to_string(), tool => shown(&row.tool) };
            page(StatusCode::OK, "link_decided.html", values)
        }
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

/// The page a `GET` shows: what is asked, and one button that decides (`action`).
fn confirm_page(row: &ApprovalRow, action: &str) -> HttpResponse {
    let arguments =
        serde_json::to_string_pretty(&row.arguments).unwrap_or_else(|_| row.arguments.to_string());
    let values = context! {
        verdict => action,
        tool => shown(&row.tool),
        arguments => shown(&arguments),
        session => shown(&row.session),
        event => shown(&row.event_id),
        route => shown(&row.route),
        expires_at => row.expires_at,
    };
    page(StatusCode::OK, "link_confirm.html", values)
}

/// The page `template` with `values` (the console's templates escape every value): a page that
/// loads nothing, runs nothing and is not framed or cached.
fn page(status: StatusCode, template: &str, values: minijinja::Value) -> HttpResponse {
    let html = match super::console::html(template, values) {
        Ok(html) => html,
        Err(err) => {
            return refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                "approval_page",
                &format!("the page could not be rendered: {err}"),
            );
        }
    };
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

/// Text a payload or a model wrote, as the page shows it: hidden characters removed (the
/// template escapes the rest).
fn shown(text: &str) -> String {
    crate::untrusted::for_terminal(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model or a payload wrote the tool's arguments (and the session key): the pages show
    /// them as text, never as markup.
    #[tokio::test]
    async fn the_pages_show_what_a_stranger_wrote_as_text() {
        let planted = "<script>alert(1)</script>";
        let row = ApprovalRow {
            id: "a1".into(),
            event_id: "e1".into(),
            session: planted.into(),
            route: "r".into(),
            turn_id: "t1".into(),
            call_id: "c1".into(),
            tool: planted.into(),
            arguments: serde_json::json!({"target": planted}),
            status: ApprovalStatus::Approved,
            requested_at: 0,
            expires_at: 0,
            decided_at: None,
            decided_by: None,
            note: None,
            link_secret: String::new(),
        };
        let confirm = confirm_page(&row, DENY);
        let decided = decided_page(Outcome::Decided(Decided::Taken(row)));
        for answer in [confirm, decided] {
            assert_eq!(answer.status(), StatusCode::OK);
            let body = answer
                .into_body()
                .collect()
                .await
                .map(http_body_util::Collected::to_bytes);
            let html = String::from_utf8(body.unwrap_or_default().to_vec()).unwrap_or_default();
            assert!(
                html.contains("&lt;script&gt;alert(1)&lt;&#x2f;script&gt;"),
                "{html}"
            );
            assert!(!html.contains("<script>"), "{html}");
        }
    }
}
