//! Entry points for the fuzz targets in `fuzz/` (built with the `fuzzing` feature only). Each
//! feeds arbitrary bytes to one parser and checks the properties that must hold for every input:
//! no panic, and round trips that agree with themselves.

use crate::config::{ConfigSource, Environment, Secret, SecretCheck, VerifyScheme};
use crate::signature;
use crate::signature::VerifySettings;
use crate::store::ledger;

/// The ledger parser and the salvage step: whatever parses survives a rewrite unchanged, and
/// whatever is salvaged from any input is itself a valid ledger.
pub fn ledger(data: &[u8]) {
    if let Ok(parsed) = ledger::parse(data) {
        let again = ledger::parse(&parsed.to_json()).expect("a written ledger parses");
        assert_eq!(again, parsed);
    }
    let salvaged = ledger::salvage(data);
    ledger::parse(&salvaged.to_json()).expect("a salvaged ledger is valid");
}

/// Signature verification over arbitrary headers and bodies, for every scheme; and every
/// scheme verifies what it signs.
pub fn verify(data: &[u8]) {
    let (head, body) = match data.iter().position(|b| *b == 0) {
        Some(split) => (&data[..split], &data[split + 1..]),
        None => (data, &[][..]),
    };
    let mut headers = http::HeaderMap::new();
    for line in String::from_utf8_lossy(head).lines() {
        if let Some((name, value)) = line.split_once(':')
            && let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name.trim().to_ascii_lowercase().as_bytes()),
                http::HeaderValue::from_str(value.trim()),
            )
        {
            headers.append(name, value);
        }
    }
    let now = 1_700_000_000;
    // Every scheme that checks something (`none` accepts all).
    for scheme in VerifyScheme::ALL
        .into_iter()
        .filter(|scheme| *scheme != VerifyScheme::None)
    {
        let settings = VerifySettings {
            scheme,
            key: Some(Secret::for_tests(b"fuzz-key")),
            other_keys: vec![Secret::for_tests(b"older-fuzz-key")],
            header: "X-Signature".into(),
        };
        let _ = signature::verify(&settings, &headers, body, now);
        let mut signed = http::HeaderMap::new();
        for (name, value) in signature::sign(&settings, body, now, "delivery-1") {
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(&value),
            ) {
                signed.append(name, value);
            }
        }
        assert_eq!(
            signature::verify(&settings, &signed, body, now),
            Ok(()),
            "{scheme:?}"
        );
    }
}

/// Config parsing and checking: any text yields a config or findings, never a panic.
pub fn config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let environment = Environment {
            credentials_dir: None,
            state_directory: None,
            secrets: SecretCheck::CredentialsOptional,
        };
        let _ = crate::config::check(ConfigSource::Embedded, text, &environment);
    }
}

/// Cassette parsing.
pub fn cassette(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::agent::model::parse_cassette(text);
    }
}

/// Request parsing and routing: content types, form payloads and JSON bodies.
pub fn request(data: &[u8]) {
    let (content_type, body) = match data.iter().position(|b| *b == b'\n') {
        Some(split) => (&data[..split], &data[split + 1..]),
        None => (&b"application/json"[..], data),
    };
    let mut headers = http::HeaderMap::new();
    if let Ok(value) = http::HeaderValue::from_bytes(content_type) {
        headers.insert(http::header::CONTENT_TYPE, value);
    }
    crate::ingress::parse_for_fuzzing(&headers, bytes::Bytes::copy_from_slice(body));
}

/// The event markers: whatever the payload, the event message ends the data exactly once, with
/// the closing marker last. The fuzzer is even given the nonce (the first 8 bytes of its input,
/// in hex), which a real payload cannot know, so that payloads containing the closing marker are
/// tried too.
pub fn markers(data: &[u8]) {
    let (nonce, payload) = data.split_at(data.len().min(8));
    let nonce = hex::encode(nonce);
    let payload = String::from_utf8_lossy(payload);
    let message = crate::session::event_message_for_fuzzing(&payload, &nonce);
    let closing = format!("</webhook-event-{nonce}>");
    let (named, data) = message.split_once('\n').unwrap_or_default();
    assert!(named.ends_with(&format!("{closing}.")), "{message:?}");
    assert_eq!(data.matches(closing.as_str()).count(), 1, "{message:?}");
    assert!(data.ends_with(&closing), "{message:?}");
}
