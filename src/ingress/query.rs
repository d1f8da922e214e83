//! What the control socket's answers and its clients share: a request's query parameters, pages
//! of rows with their next cursor, and path segments encoded and decoded.

use http::StatusCode;

use super::response::{HttpResponse, error};

/// Rows in one page of `/v1/sessions` and `/v1/events`: the default, and the most a request
/// may ask for. A page is built in memory, so this bounds what one request costs.
const PAGE_DEFAULT: i64 = 100;
const PAGE_MAX: i64 = 1000;

/// A request's query parameters.
pub(super) struct Query(Vec<(String, String)>);

impl Query {
    pub(super) fn parse(query: Option<&str>) -> Query {
        Query(
            form_urlencoded::parse(query.unwrap_or_default().as_bytes())
                .into_owned()
                .collect(),
        )
    }

    pub(super) fn get(&self, name: &str) -> Option<String> {
        self.0
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    }

    /// `limit`, 1 to `PAGE_MAX`; else the `400` to answer.
    pub(super) fn limit(&self) -> Result<i64, Box<HttpResponse>> {
        match self.get("limit") {
            None => Ok(PAGE_DEFAULT),
            Some(text) => match text.parse::<i64>() {
                Ok(limit) if (1..=PAGE_MAX).contains(&limit) => Ok(limit),
                _ => Err(Box::new(error(
                    StatusCode::BAD_REQUEST,
                    "bad_limit",
                    &format!("limit must be a whole number from 1 to {PAGE_MAX}"),
                ))),
            },
        }
    }
}

/// A page of `rows`, fetched with one more than `limit` (which tells whether there is a next
/// page), and the cursor of the next page (`None` on the last one).
pub(super) fn page<T>(
    mut rows: Vec<T>,
    limit: i64,
    cursor: impl Fn(&T) -> String,
) -> (Vec<T>, Option<String>) {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let next = if rows.len() > limit {
        rows.truncate(limit);
        rows.last().map(cursor)
    } else {
        None
    };
    (rows, next)
}

/// `%XX`-encodes a session key for a control path segment (`acme/web#7` → `acme%2Fweb%237`):
/// every byte but the unreserved ones; [`percent_decode`] reads it back.
pub(crate) fn path_segment(text: &str) -> String {
    text.bytes()
        .map(|byte| {
            if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
                char::from(byte).to_string()
            } else {
                format!("%{byte:02X}")
            }
        })
        .collect()
}

/// Decodes `%XX` escapes (session keys such as `acme/web#7` travel as `acme%2Fweb%237`).
pub(super) fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escaped = (bytes[index] == b'%')
            .then(|| bytes.get(index + 1..index + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        if let Some(byte) = escaped {
            decoded.push(byte);
            index += 3;
        } else {
            decoded.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_key_is_one_path_segment() {
        assert_eq!(path_segment("acme/web#7"), "acme%2Fweb%237");
        assert_eq!(path_segment("a b"), "a%20b");
    }
}
