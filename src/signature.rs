//! Webhook signature schemes: verification for the listener and signing for `agentgate send` and
//! outbound deliveries.
//!
//! Every scheme verifies the raw body bytes before anything is parsed or stored, compares in
//! constant time, and never echoes an expected value in an error. Signing lives beside verifying so
//! the two cannot drift apart.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::secret::Secret;

/// The verification schemes: the one list of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VerifyScheme {
    Github,
    Standard,
    Stripe,
    Slack,
    Gitlab,
    Bearer,
    HmacSha256,
    None,
}

impl VerifyScheme {
    /// Whether the scheme names an event type (a header, or a payload field its senders always
    /// set); `bearer`, `hmac-sha256` and `none` do not.
    pub(crate) fn has_event_type(self) -> bool {
        !matches!(
            self,
            VerifyScheme::Bearer | VerifyScheme::HmacSha256 | VerifyScheme::None
        )
    }

    /// Every scheme, in the order the docs list them.
    pub(crate) const ALL: [VerifyScheme; 8] = [
        VerifyScheme::Github,
        VerifyScheme::Standard,
        VerifyScheme::Stripe,
        VerifyScheme::Slack,
        VerifyScheme::Gitlab,
        VerifyScheme::Bearer,
        VerifyScheme::HmacSha256,
        VerifyScheme::None,
    ];

    /// The scheme's name in the config (`verify.scheme`).
    pub(crate) const fn name(self) -> &'static str {
        match self {
            VerifyScheme::Github => "github",
            VerifyScheme::Standard => "standard",
            VerifyScheme::Stripe => "stripe",
            VerifyScheme::Slack => "slack",
            VerifyScheme::Gitlab => "gitlab",
            VerifyScheme::Bearer => "bearer",
            VerifyScheme::HmacSha256 => "hmac-sha256",
            VerifyScheme::None => "none",
        }
    }

    pub(crate) fn parse(name: &str) -> Option<VerifyScheme> {
        VerifyScheme::ALL
            .into_iter()
            .find(|scheme| scheme.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct VerifySettings {
    pub scheme: VerifyScheme,
    /// The key bytes as the scheme uses them (`standard`: the decoded `whsec_` key).
    pub key: Option<Secret>,
    /// More keys that verify too (`verify.secrets`, for rotating a secret without downtime);
    /// `key` is the first of them, the one `send` signs with.
    pub other_keys: Vec<Secret>,
    /// `hmac-sha256`: the header that carries the signature.
    pub header: String,
}

/// How far a signed timestamp may be from now, either way.
pub(crate) const TIMESTAMP_TOLERANCE_SECS: u64 = 300;

/// Why a request failed verification. Every variant answers 401; the text is safe to return.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum VerifyError {
    #[error("missing {0} header")]
    Missing(&'static str),
    #[error("signature does not match")]
    Mismatch,
    #[error("token does not match")]
    WrongToken,
    #[error("malformed {0} header")]
    Malformed(&'static str),
    #[error("timestamp is outside the allowed window of {TIMESTAMP_TOLERANCE_SECS} s")]
    Stale,
}

impl VerifyError {
    /// The refusal's reason label (`agentgate_refusals_total`): which check failed, so that an
    /// operator can tell a wrong secret from a sender's clock that is off.
    pub(crate) const fn reason(&self) -> &'static str {
        match self {
            VerifyError::Missing(_) => "signature_missing",
            VerifyError::Mismatch => "signature_mismatch",
            VerifyError::WrongToken => "token_mismatch",
            VerifyError::Malformed(_) => "signature_malformed",
            VerifyError::Stale => "timestamp_stale",
        }
    }
}

type HmacSha256 = Hmac<Sha256>;

/// Standard base64 that decodes with or without `=` padding.
const BASE64_PADDING_OPTIONAL: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length; new_from_slice cannot fail for it.
    let Ok(mut mac) = HmacSha256::new_from_slice(key) else {
        unreachable!("HMAC takes keys of any length")
    };
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

fn equal(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// Decodes a Standard Webhooks `whsec_<base64>` secret into its HMAC key.
pub(crate) fn decode_standard_secret(secret: &Secret) -> Result<Secret, String> {
    let text = std::str::from_utf8(secret.expose())
        .map_err(|_| "a standard webhook secret must be text: whsec_<base64>".to_string())?;
    let encoded = text
        .strip_prefix("whsec_")
        .ok_or_else(|| "a standard webhook secret must start with whsec_".to_string())?;
    // The official libraries accept the key with or without base64 padding.
    let key = BASE64_PADDING_OPTIONAL
        .decode(encoded)
        .map_err(|_| "a standard webhook secret must be whsec_ followed by base64".to_string())?;
    if key.is_empty() {
        return Err("a standard webhook secret decodes to an empty key".to_string());
    }
    Ok(secret.derive(key))
}

/// The Standard Webhooks `v1` signature of `id.timestamp.body` (without the `v1,` prefix).
pub(crate) fn standard_signature(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let timestamp = timestamp.to_string();
    let mac = hmac_sha256(
        key,
        &[id.as_bytes(), b".", timestamp.as_bytes(), b".", body],
    );
    BASE64.encode(mac)
}

fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, VerifyError> {
    let value = headers.get(name).ok_or(VerifyError::Missing(name))?;
    value.to_str().map_err(|_| VerifyError::Malformed(name))
}

fn first_header<'a>(
    headers: &'a HeaderMap,
    names: [&'static str; 2],
) -> Result<&'a str, VerifyError> {
    match header(headers, names[0]) {
        Err(VerifyError::Missing(_)) => header(headers, names[1]),
        other => other,
    }
}

fn check_timestamp(text: &str, name: &'static str, now: u64) -> Result<u64, VerifyError> {
    let timestamp: u64 = text
        .trim()
        .parse()
        .map_err(|_| VerifyError::Malformed(name))?;
    if timestamp.abs_diff(now) > TIMESTAMP_TOLERANCE_SECS {
        return Err(VerifyError::Stale);
    }
    Ok(timestamp)
}

/// Verifies `body` and `headers` against the route's scheme. `now` is unix seconds.
pub(crate) fn verify(
    settings: &VerifySettings,
    headers: &HeaderMap,
    body: &[u8],
    now: u64,
) -> Result<(), VerifyError> {
    let key = match (&settings.key, settings.scheme) {
        (_, VerifyScheme::None) => return Ok(()),
        (Some(key), _) => key.expose(),
        // The config refuses every other scheme without a secret; refuse here too, to fail closed.
        (None, _) => return Err(VerifyError::Mismatch),
    };
    let first = verify_with(settings, key, headers, body, now);
    match first {
        // Another key can only help where this one did not match.
        Err(VerifyError::Mismatch | VerifyError::WrongToken) => settings
            .other_keys
            .iter()
            .find(|other| verify_with(settings, other.expose(), headers, body, now).is_ok())
            .map_or(first, |_| Ok(())),
        decided => decided,
    }
}

/// What can be decided from the headers alone, before the body is read: a missing or malformed
/// signature header, a stale timestamp, a token that does not match. A signature computed over
/// the body cannot be checked yet: it passes here and `verify` checks it with the body. So a
/// request that cannot pass never gets to send its body.
pub(crate) fn precheck(
    settings: &VerifySettings,
    headers: &HeaderMap,
    now: u64,
) -> Result<(), VerifyError> {
    match verify(settings, headers, &[], now) {
        Err(VerifyError::Mismatch) => Ok(()),
        decided => decided,
    }
}

/// Verifies with one key.
fn verify_with(
    settings: &VerifySettings,
    key: &[u8],
    headers: &HeaderMap,
    body: &[u8],
    now: u64,
) -> Result<(), VerifyError> {
    match settings.scheme {
        VerifyScheme::None => Ok(()),
        VerifyScheme::Github => {
            let value = header(headers, "x-hub-signature-256")?;
            let hex_mac = value
                .strip_prefix("sha256=")
                .ok_or(VerifyError::Malformed("x-hub-signature-256"))?;
            let given = hex::decode(hex_mac).map_err(|_| VerifyError::Mismatch)?;
            let expected = hmac_sha256(key, &[body]);
            check(equal(&given, &expected))
        }
        VerifyScheme::HmacSha256 => {
            let name = settings.header.to_ascii_lowercase();
            let value = headers
                .get(name.as_str())
                .ok_or(VerifyError::Missing("signature"))?
                .to_str()
                .map_err(|_| VerifyError::Malformed("signature"))?;
            let hex_mac = value.strip_prefix("sha256=").unwrap_or(value);
            let given = hex::decode(hex_mac.trim()).map_err(|_| VerifyError::Mismatch)?;
            check(equal(&given, &hmac_sha256(key, &[body])))
        }
        VerifyScheme::Standard => {
            let id = first_header(headers, ["webhook-id", "svix-id"])?;
            let timestamp_text = first_header(headers, ["webhook-timestamp", "svix-timestamp"])?;
            let signatures = first_header(headers, ["webhook-signature", "svix-signature"])?;
            let timestamp = check_timestamp(timestamp_text, "webhook-timestamp", now)?;
            let expected = standard_signature(key, id, timestamp, body);
            let matched = signatures
                .split_whitespace()
                .filter_map(|entry| entry.strip_prefix("v1,"))
                .fold(false, |found, given| {
                    found | equal(given.as_bytes(), expected.as_bytes())
                });
            check(matched)
        }
        VerifyScheme::Stripe => {
            let value = header(headers, "stripe-signature")?;
            let mut timestamp = None;
            let mut candidates = Vec::new();
            for item in value.split(',') {
                match item.trim().split_once('=') {
                    Some(("t", t)) => timestamp = Some(t),
                    Some(("v1", sig)) => candidates.push(sig),
                    _ => {}
                }
            }
            let timestamp = timestamp.ok_or(VerifyError::Malformed("stripe-signature"))?;
            let timestamp = check_timestamp(timestamp, "stripe-signature", now)?;
            let expected = hex::encode(hmac_sha256(
                key,
                &[timestamp.to_string().as_bytes(), b".", body],
            ));
            let matched = candidates.iter().fold(false, |found, given| {
                found | equal(given.as_bytes(), expected.as_bytes())
            });
            check(matched)
        }
        VerifyScheme::Slack => {
            let timestamp_text = header(headers, "x-slack-request-timestamp")?;
            let given = header(headers, "x-slack-signature")?;
            let timestamp = check_timestamp(timestamp_text, "x-slack-request-timestamp", now)?;
            let expected = format!(
                "v0={}",
                hex::encode(hmac_sha256(
                    key,
                    &[b"v0:", timestamp.to_string().as_bytes(), b":", body]
                ))
            );
            check(equal(given.as_bytes(), expected.as_bytes()))
        }
        VerifyScheme::Gitlab => {
            let given = header(headers, "x-gitlab-token")?;
            check_token(equal(given.as_bytes(), key))
        }
        VerifyScheme::Bearer => {
            let value = header(headers, "authorization")?;
            // The scheme name is case-insensitive (RFC 9110 §11.1).
            let token = value
                .split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, token)| token)
                .ok_or(VerifyError::Malformed("authorization"))?;
            check_token(equal(token.trim().as_bytes(), key))
        }
    }
}

fn check_token(matched: bool) -> Result<(), VerifyError> {
    if matched {
        Ok(())
    } else {
        Err(VerifyError::WrongToken)
    }
}

fn check(matched: bool) -> Result<(), VerifyError> {
    if matched {
        Ok(())
    } else {
        Err(VerifyError::Mismatch)
    }
}

/// Every header of a webhook that a route verifying with `verify` accepts: the content type,
/// `delivery_id` as `Idempotency-Key`, the scheme's signature, and `event_type` where the scheme
/// carries one. What `agentgate send` posts, signed by the CLI with `--url` and by the daemon
/// otherwise.
pub(crate) fn webhook_headers(
    verify: &VerifySettings,
    body: &[u8],
    delivery_id: &str,
    event_type: Option<&str>,
) -> Vec<(String, String)> {
    let now = crate::clock::now_seconds();
    let mut headers = vec![
        ("content-type".to_string(), "application/json".to_string()),
        ("idempotency-key".to_string(), delivery_id.to_string()),
    ];
    headers.extend(sign(verify, body, now, delivery_id));
    if let (Some(header), Some(event_type)) = (event_type_header(verify.scheme), event_type) {
        headers.push((header.to_string(), event_type.to_string()));
    }
    headers
}

/// The headers that carry `body` signed the way `settings` verifies it, plus the scheme's own
/// delivery-id header where it has one (GitHub, Standard Webhooks).
pub(crate) fn sign(
    settings: &VerifySettings,
    body: &[u8],
    now: u64,
    delivery_id: &str,
) -> Vec<(String, String)> {
    let Some(key) = settings.key.as_ref().map(Secret::expose) else {
        return Vec::new();
    };
    let hex_mac = |parts: &[&[u8]]| hex::encode(hmac_sha256(key, parts));
    let timestamp = now.to_string();
    let pairs: Vec<(&str, String)> = match settings.scheme {
        VerifyScheme::None => Vec::new(),
        VerifyScheme::Github => vec![
            (
                "x-hub-signature-256",
                format!("sha256={}", hex_mac(&[body])),
            ),
            ("x-github-delivery", delivery_id.to_string()),
        ],
        VerifyScheme::HmacSha256 => vec![(
            settings.header.as_str(),
            format!("sha256={}", hex_mac(&[body])),
        )],
        VerifyScheme::Standard => vec![
            ("webhook-id", delivery_id.to_string()),
            ("webhook-timestamp", timestamp.clone()),
            (
                "webhook-signature",
                format!("v1,{}", standard_signature(key, delivery_id, now, body)),
            ),
        ],
        VerifyScheme::Stripe => vec![(
            "stripe-signature",
            format!(
                "t={now},v1={}",
                hex_mac(&[timestamp.as_bytes(), b".", body])
            ),
        )],
        VerifyScheme::Slack => vec![
            ("x-slack-request-timestamp", timestamp.clone()),
            (
                "x-slack-signature",
                format!(
                    "v0={}",
                    hex_mac(&[b"v0:", timestamp.as_bytes(), b":", body])
                ),
            ),
        ],
        VerifyScheme::Gitlab => vec![("x-gitlab-token", String::from_utf8_lossy(key).into_owned())],
        VerifyScheme::Bearer => vec![(
            "authorization",
            format!("Bearer {}", String::from_utf8_lossy(key)),
        )],
    };
    pairs
        .into_iter()
        .map(|(name, value)| (name.to_ascii_lowercase(), value))
        .collect()
}

/// The header (lower-case) that names the event type under this scheme, if it has one.
/// An approval link's token (docs/reference.md, "Approvals"): the HMAC, keyed with the
/// request's own random secret, of the action, the request's id and the hash of its arguments.
/// A link so decides only the request, the arguments and the way it was made for.
pub(crate) fn approval_token(
    secret: &str,
    action: &str,
    approval_id: &str,
    arguments: &serde_json::Value,
) -> String {
    let hash = arguments_hash(arguments);
    hex::encode(hmac_sha256(
        secret.as_bytes(),
        &[
            action.as_bytes(),
            b":",
            approval_id.as_bytes(),
            b":",
            hash.as_bytes(),
        ],
    ))
}

/// Whether `token` is the token of that link, compared in constant time.
pub(crate) fn approval_token_matches(
    secret: &str,
    action: &str,
    approval_id: &str,
    arguments: &serde_json::Value,
    token: &str,
) -> bool {
    equal(
        approval_token(secret, action, approval_id, arguments).as_bytes(),
        token.as_bytes(),
    )
}

/// The SHA-256 of a call's arguments (their JSON text), hex.
pub(crate) fn arguments_hash(arguments: &serde_json::Value) -> String {
    use sha2::Digest;
    hex::encode(Sha256::digest(arguments.to_string().as_bytes()))
}

pub(crate) fn event_type_header(scheme: VerifyScheme) -> Option<&'static str> {
    match scheme {
        VerifyScheme::Github => Some("x-github-event"),
        VerifyScheme::Gitlab => Some("x-gitlab-event"),
        VerifyScheme::Standard
        | VerifyScheme::Stripe
        | VerifyScheme::Slack
        | VerifyScheme::Bearer
        | VerifyScheme::HmacSha256
        | VerifyScheme::None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn settings(scheme: VerifyScheme, secret: &[u8]) -> VerifySettings {
        VerifySettings {
            scheme,
            key: Some(Secret::for_tests(secret)),
            other_keys: Vec::new(),
            header: "X-Signature".into(),
        }
    }

    fn headers<N: AsRef<str>, V: AsRef<str>>(pairs: &[(N, V)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            let name = http::HeaderName::from_bytes(name.as_ref().as_bytes()).expect("header name");
            map.append(
                name,
                HeaderValue::from_str(value.as_ref()).expect("header value"),
            );
        }
        map
    }

    #[test]
    fn github_vector() {
        let s = settings(VerifyScheme::Github, b"It's a Secret to Everybody");
        let h = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        assert_eq!(verify(&s, &h, b"Hello, World!", 0), Ok(()));
        assert_eq!(
            verify(&s, &h, b"Hello, World?", 0),
            Err(VerifyError::Mismatch)
        );
        assert_eq!(
            verify(&s, &HeaderMap::new(), b"Hello, World!", 0),
            Err(VerifyError::Missing("x-hub-signature-256"))
        );
    }

    #[test]
    fn precheck_decides_what_the_headers_decide_and_leaves_the_rest_to_the_body() {
        let github = settings(VerifyScheme::Github, b"It's a Secret to Everybody");
        assert_eq!(
            precheck(&github, &HeaderMap::new(), 0),
            Err(VerifyError::Missing("x-hub-signature-256"))
        );
        assert_eq!(
            precheck(&github, &headers(&[("x-hub-signature-256", "md5=00")]), 0),
            Err(VerifyError::Malformed("x-hub-signature-256"))
        );
        // A signature over the body: only the body can tell.
        let signed = headers(&[("x-hub-signature-256", "sha256=00")]);
        assert_eq!(precheck(&github, &signed, 0), Ok(()));
        assert_eq!(
            verify(&github, &signed, b"{}", 0),
            Err(VerifyError::Mismatch)
        );
        let bearer = settings(VerifyScheme::Bearer, b"right");
        assert_eq!(
            precheck(&bearer, &headers(&[("authorization", "Bearer wrong")]), 0),
            Err(VerifyError::WrongToken)
        );
        assert_eq!(
            precheck(&bearer, &headers(&[("authorization", "Bearer right")]), 0),
            Ok(())
        );
        assert_eq!(
            precheck(
                &standard_settings(),
                &standard_headers("v1,AAAA"),
                1_649_367_553 + 3_600
            ),
            Err(VerifyError::Stale)
        );
    }

    const STANDARD_BODY: &[u8] = br#"{"email":"test@example.com","username":"test_user"}"#;
    const STANDARD_SIG: &str = "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=";

    fn standard_settings() -> VerifySettings {
        let raw = Secret::for_tests(b"whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD");
        VerifySettings {
            scheme: VerifyScheme::Standard,
            key: Some(decode_standard_secret(&raw).expect("decode")),
            other_keys: Vec::new(),
            header: String::new(),
        }
    }

    fn standard_headers(signature: &str) -> HeaderMap {
        headers(&[
            ("webhook-id", "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk"),
            ("webhook-timestamp", "1649367553"),
            ("webhook-signature", signature),
        ])
    }

    #[test]
    fn standard_vector_rotation_and_window() {
        let s = standard_settings();
        assert_eq!(
            s.key.as_ref().map(|k| hex::encode(k.expose())),
            Some("0b6155b0140886bb1c0a195020c57e6f9b1262ca686fba03".to_string())
        );
        let now = 1_649_367_553;
        assert_eq!(
            verify(&s, &standard_headers(STANDARD_SIG), STANDARD_BODY, now),
            Ok(())
        );
        let rotated = format!("v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= {STANDARD_SIG}");
        assert_eq!(
            verify(&s, &standard_headers(&rotated), STANDARD_BODY, now),
            Ok(())
        );
        for offset in [299i64, -299] {
            let at = (now as i64 + offset) as u64;
            assert_eq!(
                verify(&s, &standard_headers(STANDARD_SIG), STANDARD_BODY, at),
                Ok(())
            );
        }
        for offset in [301i64, -301] {
            let at = (now as i64 + offset) as u64;
            assert_eq!(
                verify(&s, &standard_headers(STANDARD_SIG), STANDARD_BODY, at),
                Err(VerifyError::Stale)
            );
        }
    }

    #[test]
    fn standard_undecoded_key_signature_does_not_verify() {
        let wrong = "v1,n6rJjo/CnEaFyJ+uWWflwGkHSGocTY6bAD6ImjhpG8E=";
        assert_eq!(
            verify(
                &standard_settings(),
                &standard_headers(wrong),
                STANDARD_BODY,
                1_649_367_553
            ),
            Err(VerifyError::Mismatch)
        );
    }

    #[test]
    fn stripe_vectors() {
        let body = br#"{"id":"evt_test","object":"event"}"#;
        let now = 1_700_000_000;
        let s = settings(VerifyScheme::Stripe, b"whsec_test_secret");
        let h = headers(&[(
            "stripe-signature",
            "t=1700000000,v1=8042376f6ca064adbe037642a718227dfd59047137eb49497a54c49eb0cfb724",
        )]);
        assert_eq!(verify(&s, &h, body, now), Ok(()));
        let s = settings(
            VerifyScheme::Stripe,
            b"whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
        );
        let good = headers(&[(
            "stripe-signature",
            "t=1700000000,v0=00,v1=b79b54984a0cc0cb613be9caaff23976ef0bc1c0e3e01197cd4e9c51637d8b76",
        )]);
        assert_eq!(verify(&s, &good, body, now), Ok(()));
        let decoded_key = headers(&[(
            "stripe-signature",
            "t=1700000000,v1=1abd79d043aad971f3d900af436375336f69c2fedbe6ebdf9191894556818df8",
        )]);
        assert_eq!(
            verify(&s, &decoded_key, body, now),
            Err(VerifyError::Mismatch)
        );
        assert_eq!(verify(&s, &good, body, now + 301), Err(VerifyError::Stale));
    }

    #[test]
    fn slack_vector() {
        let body = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        let s = settings(VerifyScheme::Slack, b"8f742231b10e8888abcd99yyyzzz85a5");
        let h = headers(&[
            ("x-slack-request-timestamp", "1531420618"),
            (
                "x-slack-signature",
                "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503",
            ),
        ]);
        assert_eq!(verify(&s, &h, body, 1_531_420_618), Ok(()));
        assert_eq!(
            verify(&s, &h, body, 1_531_420_618 + 400),
            Err(VerifyError::Stale)
        );
    }

    #[test]
    fn standard_secrets_decode_with_or_without_padding() {
        let padded = Secret::for_tests(b"whsec_dGVzdA==");
        let unpadded = Secret::for_tests(b"whsec_dGVzdA");
        assert_eq!(
            decode_standard_secret(&padded).map(|key| key.expose().to_vec()),
            Ok(b"test".to_vec())
        );
        assert_eq!(
            decode_standard_secret(&unpadded).map(|key| key.expose().to_vec()),
            Ok(b"test".to_vec())
        );
    }

    #[test]
    fn every_key_of_a_rotation_verifies_and_only_those() {
        let mut rotating = settings(VerifyScheme::Github, b"new-secret");
        rotating.other_keys = vec![Secret::for_tests(b"old-secret")];
        let body = b"{}";
        let signed_with = |key: &[u8]| {
            headers(&[(
                "x-hub-signature-256",
                &format!("sha256={}", hex::encode(hmac_sha256(key, &[body]))),
            )])
        };
        assert_eq!(
            verify(&rotating, &signed_with(b"new-secret"), body, 0),
            Ok(())
        );
        assert_eq!(
            verify(&rotating, &signed_with(b"old-secret"), body, 0),
            Ok(())
        );
        assert_eq!(
            verify(&rotating, &signed_with(b"other"), body, 0),
            Err(VerifyError::Mismatch)
        );
        assert_eq!(
            verify(&rotating, &HeaderMap::new(), body, 0),
            Err(VerifyError::Missing("x-hub-signature-256"))
        );
    }

    #[test]
    fn token_schemes() {
        let gitlab = settings(VerifyScheme::Gitlab, b"tok");
        assert_eq!(
            verify(&gitlab, &headers(&[("x-gitlab-token", "tok")]), b"{}", 0),
            Ok(())
        );
        assert_eq!(
            verify(&gitlab, &headers(&[("x-gitlab-token", "tok2")]), b"{}", 0),
            Err(VerifyError::WrongToken),
            "a token is not a signature: the error says which it was"
        );
        let bearer = settings(VerifyScheme::Bearer, b"tok");
        assert_eq!(
            verify(
                &bearer,
                &headers(&[("authorization", "Bearer tok")]),
                b"",
                0
            ),
            Ok(())
        );
        assert!(verify(&bearer, &headers(&[("authorization", "Basic tok")]), b"", 0).is_err());
    }

    #[test]
    fn hmac_header_scheme_accepts_plain_and_prefixed_hex() {
        let s = settings(VerifyScheme::HmacSha256, b"k");
        let mac = hex::encode(hmac_sha256(b"k", &[b"body"]));
        let plain = headers(&[("x-signature", &mac)]);
        let prefixed = headers(&[("x-signature", &format!("sha256={mac}"))]);
        assert_eq!(verify(&s, &plain, b"body", 0), Ok(()));
        assert_eq!(verify(&s, &prefixed, b"body", 0), Ok(()));
        assert_eq!(verify(&s, &plain, b"bodx", 0), Err(VerifyError::Mismatch));
    }

    #[test]
    fn every_scheme_verifies_what_it_signs() {
        let now = 1_700_000_000;
        for scheme in [
            VerifyScheme::Github,
            VerifyScheme::Stripe,
            VerifyScheme::Slack,
            VerifyScheme::Gitlab,
            VerifyScheme::Bearer,
            VerifyScheme::HmacSha256,
        ] {
            let s = settings(scheme, b"secret-key");
            let signed = headers(&sign(&s, b"{\"a\":1}", now, "d-1"));
            assert_eq!(verify(&s, &signed, b"{\"a\":1}", now), Ok(()), "{scheme:?}");
        }
        let s = standard_settings();
        let signed = headers(&sign(&s, STANDARD_BODY, now, "msg_1"));
        assert_eq!(verify(&s, &signed, STANDARD_BODY, now), Ok(()));
    }
}
