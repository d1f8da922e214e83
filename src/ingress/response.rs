//! The answers the listeners give: JSON bodies, and refusals that carry why they were made (the
//! reason label of `agentgate_refusals_total` and the message of the refusal's log line).
//! Shared by the webhook listener, its payload parsing, the control socket and the standby
//! answer, so none of them needs another's module to say no.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use super::api::ErrorBody;

pub(crate) type HttpResponse = Response<Full<Bytes>>;

pub(crate) fn json_response(status: StatusCode, body: &serde_json::Value) -> HttpResponse {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

/// A refusal already counted and logged where it was decided (the console's guard).
#[derive(Clone, Copy)]
pub(super) struct Counted;

/// Why a request was refused, carried beside the response for the refusal's log line and its
/// count: the reason label (a fixed set: the error code, or the check that failed) and the
/// one-line message.
#[derive(Clone)]
pub(super) struct RefusalReason {
    pub(super) reason: &'static str,
    pub(super) message: String,
}

pub(crate) fn error(status: StatusCode, code: &'static str, message: &str) -> HttpResponse {
    refused(status, code, code, message)
}

/// A refusal whose count's `reason` says more than its error code.
pub(super) fn refused(
    status: StatusCode,
    code: &'static str,
    reason: &'static str,
    message: &str,
) -> HttpResponse {
    let body = ErrorBody {
        error: code.to_string(),
        message: message.to_string(),
    };
    let mut response = json_response(status, &json!(body));
    response.extensions_mut().insert(RefusalReason {
        reason,
        message: message.to_string(),
    });
    response
}

/// 503 with `Retry-After: seconds`.
pub(crate) fn unavailable_for(message: &str, seconds: u64) -> HttpResponse {
    let mut response = error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message);
    response
        .headers_mut()
        .insert(RETRY_AFTER, http::HeaderValue::from(seconds));
    response
}

/// `408`: a request body that did not come within four times `header_timeout`, on any listener.
/// Its connection is closed after the answer, since the rest of the body was not read.
pub(super) fn request_timeout() -> HttpResponse {
    error(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        "the body did not arrive in time",
    )
}
