//! What the control socket's answers and its clients share: a request's query parameters, pages
//! of rows with their next cursor, and path segments encoded and decoded.

use http::StatusCode;

use super::response::{HttpResponse, error};
use crate::store::{EventFilter, EventStatus, SessionFilter, SessionState};

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

    /// The parameters among `names` that are given, encoded again: what a page's link to the
    /// next page keeps of the filter.
    pub(super) fn kept(&self, names: &[&str]) -> String {
        let mut kept = form_urlencoded::Serializer::new(String::new());
        for name in names {
            if let Some(value) = self.given(name) {
                kept.append_pair(name, &value);
            }
        }
        kept.finish()
    }

    /// `name`, unless it is absent or empty (a form's field left blank).
    pub(super) fn given(&self, name: &str) -> Option<String> {
        self.get(name).filter(|value| !value.is_empty())
    }

    /// The sessions a request asks for (`/v1/sessions`, the console's list): `after` (the
    /// cursor), `state`, `route` and `key` (text the key holds, whatever its case).
    pub(super) fn session_filter(&self, limit: i64) -> Result<SessionFilter, BadParameter> {
        Ok(SessionFilter {
            after: self.given("after"),
            state: self.named(
                "state",
                SessionState::from_name,
                ("bad_state", "session state"),
            )?,
            route: self.given("route"),
            key_contains: self.given("key"),
            limit,
        })
    }

    /// The events a request asks for (`/v1/events`, the console's list): `status`, `route`,
    /// `session`, `before` (the cursor), `delivery_id`, and `since` and `until`, each a time
    /// in unix milliseconds or in UTC as `2026-12-06T14:05[:30]` (what a form's
    /// `datetime-local` field sends).
    pub(super) fn event_filter(&self, limit: i64) -> Result<EventFilter, BadParameter> {
        Ok(EventFilter {
            status: self.named(
                "status",
                EventStatus::from_name,
                ("bad_status", "event status"),
            )?,
            route: self.given("route"),
            session: self.given("session"),
            limit,
            before: self.given("before"),
            since: self.time("since")?,
            until: self.time("until")?,
            delivery_id: self.given("delivery_id"),
        })
    }

    /// The state or status `name` gives, read by `from_name`; one that does not exist is
    /// refused with `code`.
    fn named<T>(
        &self,
        name: &str,
        from_name: fn(&str) -> Option<T>,
        (code, what): (&'static str, &str),
    ) -> Result<Option<T>, BadParameter> {
        let Some(given) = self.given(name) else {
            return Ok(None);
        };
        match from_name(&given) {
            Some(value) => Ok(Some(value)),
            None => Err(BadParameter {
                code,
                message: format!("unknown {what} {given:?}"),
            }),
        }
    }

    /// The time `name` gives, in unix milliseconds (see [`Query::event_filter`]).
    fn time(&self, name: &'static str) -> Result<Option<i64>, BadParameter> {
        let Some(text) = self.given(name) else {
            return Ok(None);
        };
        if let Ok(millis) = text.parse::<i64>() {
            return Ok(Some(millis));
        }
        let full = if text.len() == "2026-12-06T14:05".len() {
            format!("{text}:00Z")
        } else {
            format!("{text}Z")
        };
        humantime::parse_rfc3339(&full)
            .ok()
            .and_then(|time| time.duration_since(std::time::UNIX_EPOCH).ok())
            .and_then(|since_epoch| i64::try_from(since_epoch.as_millis()).ok())
            .map(Some)
            .ok_or_else(|| BadParameter {
                code: "bad_time",
                message: format!(
                    "{name} must be a time in unix milliseconds or in UTC as 2026-12-06T14:05"
                ),
            })
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

/// A query parameter that names nothing there is: the API answers it `400`, the console shows
/// it on the page.
#[derive(Debug)]
pub(super) struct BadParameter {
    pub code: &'static str,
    pub message: String,
}

impl BadParameter {
    pub(super) fn response(&self) -> HttpResponse {
        error(StatusCode::BAD_REQUEST, self.code, &self.message)
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
    fn times_read_as_unix_milliseconds_or_utc() {
        let query = Query::parse(Some(
            "since=2026-12-06T14:05&until=2026-12-06T14:05:30&status=&route=a%26b",
        ));
        let filter = query.event_filter(10).expect("a filter");
        assert_eq!(filter.since, Some(1_796_565_900_000));
        assert_eq!(filter.until, Some(1_796_565_930_000));
        assert_eq!(filter.status, None, "a field left blank filters nothing");
        assert_eq!(
            query.kept(&["status", "route", "since"]),
            "route=a%26b&since=2026-12-06T14%3A05"
        );
        let millis = Query::parse(Some("since=1796565900000")).event_filter(1);
        assert_eq!(millis.expect("a filter").since, Some(1_796_565_900_000));
        for bad in [
            "since=yesterday",
            "until=2026-13-01T00:00",
            "since=1796565900000.5",
        ] {
            let refused = Query::parse(Some(bad)).event_filter(1).expect_err(bad);
            assert_eq!(refused.code, "bad_time");
        }
    }

    #[test]
    fn a_session_key_is_one_path_segment() {
        assert_eq!(path_segment("acme/web#7"), "acme%2Fweb%237");
        assert_eq!(path_segment("a b"), "a%20b");
    }
}
