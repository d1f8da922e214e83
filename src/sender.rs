//! What a sender's request says about its event beyond its authenticity, one profile per verify
//! scheme: the event type, the delivery id that deduplicates it, what its form bodies are, how
//! it reads the answer, its setup handshake; and which headers carry secrets (never stored,
//! never shown to templates or the model) (docs/reference.md, "Event types and dedup keys").

use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::signature::{VerifyScheme, VerifySettings};

/// How a scheme's senders shape their requests beyond the signature (`signature.rs`): the id and
/// the event type they give a delivery, what a form body without a `payload` field is, how they
/// read the answer, and a setup request they expect answered at once. One per scheme, chosen by
/// [`profile`].
pub(crate) struct Profile {
    /// The delivery id the scheme's senders give; `Idempotency-Key` is every scheme's fallback.
    delivery_id: fn(&HeaderMap, &serde_json::Value) -> Option<String>,
    /// The event type the payload names, where no header names one.
    payload_event_type: fn(&serde_json::Value) -> Option<String>,
    /// A form without a `payload` field is the payload itself, a string per field.
    pub(crate) form_fields_are_payload: bool,
    /// How the scheme's senders read a 2xx answer.
    pub(crate) answers: Answers,
    /// The answer (`200`, JSON) to a setup request, which is neither stored nor run.
    pub(crate) handshake: fn(&serde_json::Value) -> Option<serde_json::Value>,
}

/// How a sender reads the answer to an accepted, duplicate or ignored event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answers {
    /// JSON: `202` for a new event, `200` for a duplicate or an ignored one.
    Json,
    /// Slack: JSON for the Events API, but a slash command and an interaction (sent as forms)
    /// must be answered `200`, and a slash command's answer is shown to whoever typed it.
    Slack,
}

/// The profile of the senders of `scheme`.
pub(crate) fn profile(scheme: VerifyScheme) -> &'static Profile {
    match scheme {
        VerifyScheme::Github => &GITHUB,
        VerifyScheme::Standard => &STANDARD,
        VerifyScheme::Stripe => &STRIPE,
        VerifyScheme::Slack => &SLACK,
        VerifyScheme::Gitlab => &GITLAB,
        VerifyScheme::Bearer | VerifyScheme::HmacSha256 | VerifyScheme::None => &PLAIN,
    }
}

/// A sender that gives no delivery id of its own, names its event type in `payload.type` (if at
/// all), posts JSON and reads JSON.
const PLAIN: Profile = Profile {
    delivery_id: |_, _| None,
    payload_event_type: |payload| payload_text(payload, &["type"]),
    form_fields_are_payload: false,
    answers: Answers::Json,
    handshake: |_| None,
};

const GITHUB: Profile = Profile {
    delivery_id: |headers, _| header_text(headers, "x-github-delivery"),
    ..PLAIN
};

const STANDARD: Profile = Profile {
    delivery_id: |headers, _| {
        header_text(headers, "webhook-id").or_else(|| header_text(headers, "svix-id"))
    },
    ..PLAIN
};

/// Stripe signs each attempt with its own timestamp, so only the event says which one a retry
/// repeats: its `id` (a string, or a number as some senders of the scheme write it), else the
/// event itself (a digest of the payload, which a retry sends unchanged).
const STRIPE: Profile = Profile {
    delivery_id: |_, payload| {
        payload_id(payload, "id")
            .or_else(|| Some(format!("stripe-event:{}", digest(&payload.to_string()))))
    },
    ..PLAIN
};

const GITLAB: Profile = Profile {
    delivery_id: |headers, _| header_text(headers, "x-gitlab-event-uuid"),
    ..PLAIN
};

/// Slack: the Events API posts JSON with an `event_id` and the inner event's type, and checks a
/// new request URL with a `url_verification` challenge; slash commands post forms whose fields
/// are the payload, interactions a form whose `payload` field holds it. Neither carries an id: a
/// request sent again as it was (same timestamp and body, so the same signature) is the same
/// request, and only the signature's digest is stored, never the signature.
const SLACK: Profile = Profile {
    delivery_id: |headers, payload| {
        payload_id(payload, "event_id").or_else(|| {
            header_text(headers, "x-slack-signature")
                .map(|signature| format!("slack-request:{}", digest(&signature)))
        })
    },
    payload_event_type: |payload| {
        payload_text(payload, &["event", "type"])
            .or_else(|| payload_text(payload, &["type"]))
            .or_else(|| payload_text(payload, &["command"]))
    },
    form_fields_are_payload: true,
    answers: Answers::Slack,
    handshake: |payload| {
        (payload.get("type").and_then(serde_json::Value::as_str) == Some("url_verification"))
            .then(|| {
                serde_json::json!({"challenge": payload.get("challenge").cloned().unwrap_or_default()})
            })
    },
};

/// The sender's delivery id: the scheme's own, else `Idempotency-Key`, else none.
pub(crate) fn delivery_id(
    scheme: VerifyScheme,
    headers: &HeaderMap,
    payload: &serde_json::Value,
) -> Option<String> {
    (profile(scheme).delivery_id)(headers, payload)
        .or_else(|| header_text(headers, "idempotency-key"))
        .map(dedup_key)
}

/// The event type the payload of a `scheme` request names (`slack`: the inner event's type,
/// else `type`, else a slash command's name; every other scheme: `type`). Header-borne types
/// (GitHub, GitLab) are read by [`crate::signature::event_type_header`].
pub(crate) fn payload_event_type(
    scheme: VerifyScheme,
    payload: &serde_json::Value,
) -> Option<String> {
    (profile(scheme).payload_event_type)(payload)
}

/// The trimmed, non-empty text of header `name`.
fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
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

/// The id at `key` of the payload: a string as it is, a whole number as its digits; an empty
/// string or anything else is no id.
fn payload_id(payload: &serde_json::Value, key: &str) -> Option<String> {
    match payload.get(key)? {
        serde_json::Value::String(id) => Some(id.clone()).filter(|id| !id.trim().is_empty()),
        serde_json::Value::Number(number) if number.is_u64() || number.is_i64() => {
            Some(number.to_string())
        }
        serde_json::Value::Number(_)
        | serde_json::Value::Null
        | serde_json::Value::Bool(_)
        | serde_json::Value::Array(_)
        | serde_json::Value::Object(_) => None,
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

    #[test]
    fn a_stripe_event_is_its_id_a_number_s_digits_or_else_its_own_digest() {
        let headers = HeaderMap::new();
        let id = |payload: serde_json::Value| delivery_id(VerifyScheme::Stripe, &headers, &payload);
        assert_eq!(
            id(serde_json::json!({"id": "evt_1"})).as_deref(),
            Some("evt_1")
        );
        assert_eq!(id(serde_json::json!({"id": 42})).as_deref(), Some("42"));
        let unnamed = serde_json::json!({"type": "charge.failed", "created": 1});
        let first = id(unnamed.clone());
        assert!(
            first
                .as_deref()
                .is_some_and(|id| id.starts_with("stripe-event:"))
        );
        assert_eq!(id(unnamed), first, "a retry sends the same event");
        assert_ne!(
            id(serde_json::json!({"type": "charge.failed", "created": 2})),
            first
        );
        assert_ne!(id(serde_json::json!({"id": ""})).as_deref(), Some(""));
    }
}
