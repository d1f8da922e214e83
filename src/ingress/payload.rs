//! A verified body as the JSON payload agentgate stores: its content encoding removed (gzip,
//! bounded by `max_body` after inflating) and its JSON found (a form's `payload` field, a Slack
//! slash command's fields), or the refusal to answer.

#![expect(
    clippy::result_large_err,
    reason = "a refusal here is the HTTP response itself (see `http.rs`)"
)]

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, StatusCode};

use super::response::{HttpResponse, error};
use crate::sender;
use crate::signature::VerifyScheme;

/// Decodes the body as JSON: `application/json` (or `+json`, or no content type), or a form with a
/// `payload` field holding JSON (GitHub's form-encoded deliveries). Returns the value and its bytes.
/// The body with its `Content-Encoding` removed: each `gzip` layer is inflated (a body a proxy
/// compressed again says `gzip, gzip`, in the order they were applied, and is inflated in the
/// reverse order), at most `MAX_CODINGS` of them, with `max_body` applied to each inflated size
/// (413), so a small compressed body cannot expand without bound.
pub(super) fn decode_content(
    headers: &HeaderMap,
    body: &Bytes,
    max_body: u64,
) -> Result<Bytes, HttpResponse> {
    let codings: Vec<String> = headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|coding| coding.trim().to_ascii_lowercase())
        .filter(|coding| !coding.is_empty() && coding != "identity")
        .collect();
    if codings.len() > MAX_CODINGS {
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_encoding",
            &format!(
                "{} content codings; at most {MAX_CODINGS} are inflated",
                codings.len()
            ),
        ));
    }
    let mut decoded = body.clone();
    for coding in codings.iter().rev() {
        decoded = match coding.as_str() {
            "gzip" | "x-gzip" => inflate(&decoded, max_body)?,
            other => {
                return Err(error(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_encoding",
                    &format!("content encoding {other} is not supported (gzip is)"),
                ));
            }
        };
    }
    Ok(decoded)
}

/// Content codings inflated at most (`gzip, gzip`: a sender's and a proxy's).
const MAX_CODINGS: usize = 2;

/// One gzip layer, inflated to at most `max_body` bytes.
fn inflate(body: &[u8], max_body: u64) -> Result<Bytes, HttpResponse> {
    use std::io::Read;
    let mut inflated = Vec::new();
    // Every member: a gzip file may be several concatenated (RFC 1952 §2.2), and what a sender
    // compressed that way is what it signed.
    let read = flate2::read::MultiGzDecoder::new(body)
        .take(max_body.saturating_add(1))
        .read_to_end(&mut inflated);
    match read {
        Ok(_) if inflated.len() as u64 > max_body => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            &format!("the inflated body is larger than the route's limit of {max_body} bytes"),
        )),
        Ok(_) => Ok(Bytes::from(inflated)),
        Err(err) => Err(error(
            StatusCode::BAD_REQUEST,
            "bad_encoding",
            &format!("the gzip body cannot be inflated: {err}"),
        )),
    }
}

/// How a sender encoded its payload, which decides how Slack is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Encoding {
    /// A JSON body.
    Json,
    /// A form whose `payload` field holds the JSON (GitHub's form deliveries, Slack
    /// interactivity).
    FormPayload,
    /// A form whose fields are the payload (a Slack slash command).
    FormFields,
}

/// The JSON payload of a body. Form bodies carry it in a `payload` field (GitHub, Slack
/// interactivity); where the scheme's profile says so (Slack) a form without one is a slash
/// command, whose fields become the payload object.
pub(super) fn parse_payload(
    headers: &HeaderMap,
    body: Bytes,
    scheme: VerifyScheme,
) -> Result<(serde_json::Value, Bytes, Encoding), HttpResponse> {
    let content_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default();
    let (json_bytes, encoding) = if content_type.is_empty()
        || content_type == "application/json"
        || content_type.ends_with("+json")
    {
        (body, Encoding::Json)
    } else if content_type == "application/x-www-form-urlencoded" {
        let payload = form_urlencoded::parse(&body)
            .find(|(name, _)| name == "payload")
            .map(|(_, value)| value.into_owned());
        match payload {
            Some(payload) => (Bytes::from(payload), Encoding::FormPayload),
            None if sender::profile(scheme).form_fields_are_payload => {
                let fields: serde_json::Map<String, serde_json::Value> =
                    form_urlencoded::parse(&body)
                        .map(|(name, value)| {
                            (
                                name.into_owned(),
                                serde_json::Value::String(value.into_owned()),
                            )
                        })
                        .collect();
                let value = serde_json::Value::Object(fields);
                return Ok((
                    value.clone(),
                    Bytes::from(value.to_string()),
                    Encoding::FormFields,
                ));
            }
            None => {
                return Err(error(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    "a form-encoded body must carry JSON in a payload field",
                ));
            }
        }
    } else {
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            &format!("content type {content_type} is not JSON"),
        ));
    };
    let value = serde_json::from_slice(&json_bytes).map_err(|err| {
        error(
            StatusCode::BAD_REQUEST,
            "malformed_json",
            &format!("body is not valid JSON: {err}"),
        )
    })?;
    Ok((value, json_bytes, encoding))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(text: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let _ = encoder.write_all(text);
        encoder.finish().unwrap_or_default()
    }

    #[test]
    fn every_member_of_a_gzip_body_is_inflated() {
        let mut body = gzip(b"{\"first\":");
        body.extend(gzip(b"\"and second\"}"));
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_ENCODING,
            http::HeaderValue::from_static("gzip"),
        );
        let inflated = decode_content(&headers, &Bytes::from(body), 1 << 20).ok();
        assert_eq!(
            inflated.as_deref(),
            Some(&b"{\"first\":\"and second\"}"[..])
        );
    }

    #[test]
    fn a_body_compressed_twice_is_inflated_twice_and_three_times_is_refused() {
        let twice = gzip(&gzip(b"{\"twice\":true}"));
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_ENCODING,
            http::HeaderValue::from_static("gzip, gzip"),
        );
        let inflated = decode_content(&headers, &Bytes::from(twice.clone()), 1 << 20).ok();
        assert_eq!(inflated.as_deref(), Some(&b"{\"twice\":true}"[..]));
        // The same as two header lines.
        let mut lines = HeaderMap::new();
        for _ in 0..2 {
            lines.append(
                http::header::CONTENT_ENCODING,
                http::HeaderValue::from_static("gzip"),
            );
        }
        assert!(decode_content(&lines, &Bytes::from(twice.clone()), 1 << 20).is_ok());
        // Each layer is bounded by max_body.
        let large = gzip(&gzip(&vec![b' '; 4096]));
        let refused = decode_content(&headers, &Bytes::from(large), 1024).err();
        assert_eq!(
            refused.map(|answer| answer.status()),
            Some(StatusCode::PAYLOAD_TOO_LARGE)
        );
        headers.insert(
            http::header::CONTENT_ENCODING,
            http::HeaderValue::from_static("gzip, gzip, gzip"),
        );
        let refused = decode_content(&headers, &Bytes::from(gzip(&twice)), 1 << 20).err();
        assert_eq!(
            refused.map(|answer| answer.status()),
            Some(StatusCode::UNSUPPORTED_MEDIA_TYPE)
        );
    }
}
