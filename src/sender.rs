//! What a sender's request says about its event beyond its authenticity: the event type, the
//! delivery id that deduplicates it, and which of its headers carry secrets (never stored, never
//! shown to templates or the model). Each follows the route's verify scheme
//! (docs/reference.md, "Event types and dedup keys").

use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::signature::{VerifyScheme, VerifySettings};

/// The sender's delivery id: the scheme's header, else `Idempotency-Key`, else none.
pub(crate) fn delivery_id(
    scheme: VerifyScheme,
    headers: &HeaderMap,
    payload: &serde_json::Value,
) -> Option<String> {
    let from_header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    };
    let scheme_id = match scheme {
        VerifyScheme::Github => from_header("x-github-delivery"),
        VerifyScheme::Standard => from_header("webhook-id").or_else(|| from_header("svix-id")),
        VerifyScheme::Stripe => payload_text(payload, &["id"]),
        // Slash commands and interactivity carry no id: a request sent again as it was (same
        // timestamp and body, so the same signature) is the same request. The signature itself
        // is never stored, only its digest.
        VerifyScheme::Slack => payload_text(payload, &["event_id"]).or_else(|| {
            from_header("x-slack-signature")
                .map(|signature| format!("slack-request:{}", digest(&signature)))
        }),
        VerifyScheme::Gitlab => from_header("x-gitlab-event-uuid"),
        _ => None,
    };
    scheme_id
        .or_else(|| from_header("idempotency-key"))
        .map(dedup_key)
}

/// A delivery id as it is stored: a key of any length deduplicates, a long one by its digest.
/// An id that itself looks like a stored digest is stored by its own digest too, so that a
/// sender cannot write one that another, long id deduplicates against.
pub(crate) fn dedup_key(id: String) -> String {
    if id.len() > MAX_STORED_DELIVERY_ID || id.starts_with(DIGEST_PREFIX) {
        format!("{DIGEST_PREFIX}{}", digest(&id))
    } else {
        id
    }
}

/// SHA-256 of `text`, in hex.
fn digest(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// How a delivery id stored by its digest begins.
const DIGEST_PREFIX: &str = "sha256:";

/// Delivery ids longer than this are stored (and deduplicated) by their SHA-256.
const MAX_STORED_DELIVERY_ID: usize = 256;

/// The string at `path` in the payload, if there is one.
fn payload_text(payload: &serde_json::Value, path: &[&str]) -> Option<String> {
    path.iter()
        .try_fold(payload, |value, key| value.get(key))
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
}

/// The event type a scheme names, from the payload (`stripe`, `standard`: `type`; `slack`: the
/// inner event's type, else `type`, else a slash command's name), or `payload.type` for schemes
/// without one. Header-borne types (GitHub, GitLab) are read by [`crate::signature::event_type_header`].
pub(crate) fn payload_event_type(
    scheme: VerifyScheme,
    payload: &serde_json::Value,
) -> Option<String> {
    match scheme {
        VerifyScheme::Slack => payload_text(payload, &["event", "type"])
            .or_else(|| payload_text(payload, &["type"]))
            .or_else(|| payload_text(payload, &["command"])),
        _ => payload_text(payload, &["type"]),
    }
}

/// Headers that carry credentials or signatures (lower case): they are never stored, never shown
/// to templates or the model. A route's `hidden_headers` adds to them, and so does its
/// `hmac-sha256` header.
pub(crate) const HIDDEN_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-api-key",
    "api-key",
    "x-auth-token",
    "x-access-token",
    "x-gitlab-token",
    "x-hub-signature",
    "x-hub-signature-256",
    "stripe-signature",
    "x-slack-signature",
    "webhook-signature",
    "svix-signature",
    "x-signature",
    "private-token",
    "x-vault-token",
    "x-amz-security-token",
];

/// Parts of a header name (lower case) that mark it as a credential whatever its sender calls
/// it (`X-Deploy-Token`, `X-Client-Secret`, …): a list of names can never be complete.
const HIDDEN_NAME_PARTS: &[&str] = &[
    "token",
    "secret",
    "passw",
    "signature",
    "credential",
    "api-key",
    "apikey",
    "auth",
];

/// Whether `name` (lower case) is kept out of storage for a route verified by `settings` that
/// also hides `extra`.
pub(crate) fn is_hidden_header(name: &str, settings: &VerifySettings, extra: &[String]) -> bool {
    HIDDEN_HEADERS.contains(&name)
        || HIDDEN_NAME_PARTS.iter().any(|part| name.contains(part))
        || settings.header.eq_ignore_ascii_case(name)
        || extra.iter().any(|hidden| hidden.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_written_as_a_digest_does_not_collide_with_the_long_id_it_names() {
        let long = "x".repeat(MAX_STORED_DELIVERY_ID + 1);
        let stored = dedup_key(long.clone());
        assert!(stored.starts_with(DIGEST_PREFIX));
        assert_ne!(dedup_key(stored.clone()), stored);
        assert_eq!(dedup_key(long), stored);
        assert_eq!(dedup_key("abc".to_string()), "abc");
    }
}
