//! The OpenAI-compatible endpoints of `[model]`: the primary, then the `fallback` ones in order,
//! each behind a circuit breaker, so that a dead endpoint is skipped for a while instead of
//! costing every step of every turn its retries (docs/reference.md, "Fallback endpoints").

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::Secret;

/// How long an endpoint is skipped after it failed (after its retries), doubling with each
/// failure in a row up to `BREAKER_LONGEST_OPEN`.
const BREAKER_FIRST_OPEN: Duration = Duration::from_secs(30);
const BREAKER_LONGEST_OPEN: Duration = Duration::from_secs(300);

pub(super) struct Endpoint {
    pub client: reqwest::Client,
    /// `{base_url}/chat/completions`.
    pub url: String,
    /// The base URL as logs and transcripts show it: scheme and host only.
    pub shown: String,
    /// The host and port requests go to, as spans name the server.
    pub server: Option<Server>,
    pub model: String,
    pub api_key: Option<Secret>,
    /// One of `fallback`, not the primary.
    pub fallback: bool,
    breaker: Mutex<Breaker>,
}

#[derive(Debug, Default)]
struct Breaker {
    failures_in_a_row: u32,
    open_until: Option<Instant>,
}

/// The host and port of an endpoint (`server.address`, `server.port` in traces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Server {
    pub address: String,
    pub port: u16,
}

impl Server {
    /// The host and port of `url` (the scheme's default port when it names none).
    fn of(url: &str) -> Option<Server> {
        let parsed = url::Url::parse(url).ok()?;
        Some(Server {
            address: parsed.host_str()?.trim_matches(['[', ']']).to_string(),
            port: parsed.port_or_known_default()?,
        })
    }
}

/// Which endpoint answered a reply, as the transcript records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AnsweredBy {
    /// The endpoint's base URL, scheme and host only.
    pub endpoint: String,
    /// The model the server says answered (its reply's `model`), else the one asked for.
    pub model: String,
    /// The model asked for, when the server named another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_model: Option<String>,
    /// A `fallback` endpoint answered, not the primary.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fallback: bool,
}

impl Endpoint {
    pub(super) fn new(
        client: reqwest::Client,
        base_url: &str,
        model: &str,
        api_key: Option<Secret>,
        fallback: bool,
    ) -> Endpoint {
        Endpoint {
            client,
            url: format!("{base_url}/chat/completions"),
            shown: crate::config::redacted_url(base_url),
            server: Server::of(base_url),
            model: model.to_string(),
            api_key,
            fallback,
            breaker: Mutex::new(Breaker::default()),
        }
    }

    fn is_open(&self, now: Instant) -> bool {
        self.breaker
            .lock()
            .map(|breaker| breaker.open_until.is_some_and(|until| now < until))
            .unwrap_or(false)
    }

    /// The endpoint failed after its retries: it is skipped for a while.
    pub(super) fn failed(&self) {
        if let Ok(mut breaker) = self.breaker.lock() {
            breaker.failures_in_a_row = breaker.failures_in_a_row.saturating_add(1);
            let open = BREAKER_FIRST_OPEN
                .saturating_mul(1 << (breaker.failures_in_a_row - 1).min(8))
                .min(BREAKER_LONGEST_OPEN);
            breaker.open_until = Some(Instant::now() + open);
            tracing::warn!(endpoint = %self.shown, skipped_for_s = open.as_secs(),
                "model endpoint failed after its retries; it is skipped for a while (circuit breaker)");
        }
    }

    /// The endpoint answered: it is tried first again.
    pub(super) fn answered(&self) {
        if let Ok(mut breaker) = self.breaker.lock() {
            *breaker = Breaker::default();
        }
    }

    /// What the transcript records of a reply from this endpoint, whose server named `served`.
    pub(super) fn answered_by(&self, served: Option<String>) -> AnsweredBy {
        let model = served.unwrap_or_else(|| self.model.clone());
        AnsweredBy {
            requested_model: (model != self.model).then(|| self.model.clone()),
            endpoint: self.shown.clone(),
            model,
            fallback: self.fallback,
        }
    }
}

/// The endpoints to try, in order: those whose breaker is closed, primary first; when every
/// breaker is open, all of them in order, so a request is never given up without a try.
pub(super) fn in_order(endpoints: &[Endpoint]) -> Vec<&Endpoint> {
    let now = Instant::now();
    let closed: Vec<&Endpoint> = endpoints.iter().filter(|e| !e.is_open(now)).collect();
    if closed.is_empty() {
        endpoints.iter().collect()
    } else {
        closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(fallback: bool) -> Endpoint {
        let client = crate::tls::http_client()
            .and_then(|builder| builder.build().map_err(|err| err.to_string()))
            .unwrap_or_else(|err| panic!("client: {err}"));
        Endpoint::new(client, "http://127.0.0.1:1/v1", "m", None, fallback)
    }

    #[test]
    fn a_failed_endpoint_is_skipped_until_every_one_has_failed() {
        let endpoints = [endpoint(false), endpoint(true)];
        assert_eq!(in_order(&endpoints).len(), 2);
        endpoints[0].failed();
        let order = in_order(&endpoints);
        assert_eq!(order.len(), 1);
        assert!(order[0].fallback, "the failed primary is skipped");
        endpoints[1].failed();
        assert_eq!(in_order(&endpoints).len(), 2, "all open: all tried");
        endpoints[0].answered();
        assert!(!in_order(&endpoints)[0].fallback);
    }

    #[test]
    fn the_server_is_a_host_and_a_port() {
        let server = |url: &str| Server::of(url).map(|s| (s.address, s.port));
        assert_eq!(
            server("http://127.0.0.1:31501/v1"),
            Some(("127.0.0.1".into(), 31501))
        );
        assert_eq!(
            server("https://api.openai.com/v1"),
            Some(("api.openai.com".into(), 443))
        );
        assert_eq!(server("http://[::1]/v1"), Some(("::1".into(), 80)));
        assert_eq!(server("not a url"), None);
    }

    #[test]
    fn another_model_name_is_recorded_as_such() {
        let answered = endpoint(true).answered_by(Some("other-model".into()));
        assert_eq!(answered.model, "other-model");
        assert_eq!(answered.requested_model.as_deref(), Some("m"));
        assert!(endpoint(false).answered_by(None).requested_model.is_none());
    }
}
