//! `[telemetry]` and `[console]`: where traces go, and where the web console is served.

use super::Checker;
use crate::config::raw::{RawConsole, RawTelemetry};
use crate::config::settings::{ConsoleSettings, TRACE_ID, TelemetrySettings};

/// A console token shorter than this is warned about.
const MIN_TOKEN_BYTES: usize = 16;

impl Checker<'_> {
    /// The collector must be an `http` or `https` URL; the share of traces kept is between 0
    /// and 1.
    pub(super) fn telemetry(&mut self, raw: RawTelemetry) -> TelemetrySettings {
        let otlp_endpoint = raw
            .otlp_endpoint
            .and_then(|text| match url::Url::parse(&text) {
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {
                    Some(text.trim_end_matches('/').to_string())
                }
                _ => {
                    self.error(
                        "telemetry.otlp_endpoint",
                        format!(
                            "{:?} is not the URL of an OTLP/HTTP collector such as \
                             \"http://127.0.0.1:4318\"",
                            crate::config::redacted_url(&text)
                        ),
                    );
                    None
                }
            });
        let sample_ratio = self.value("telemetry.sample_ratio", raw.sample_ratio, 1.0, |ratio| {
            if (0.0..=1.0).contains(&ratio) {
                Ok(ratio)
            } else {
                Err(format!("{ratio} must be a share from 0 to 1"))
            }
        });
        let capture_content = raw.capture_content.unwrap_or(false);
        if capture_content && otlp_endpoint.is_none() {
            self.warn(
                "telemetry.capture_content",
                "has no effect without telemetry.otlp_endpoint",
            );
        }
        TelemetrySettings {
            otlp_endpoint,
            sample_ratio,
            capture_content,
        }
    }

    /// The console (docs/reference.md, "Console"): on the control socket unless `enabled` is
    /// false, and on TCP at `listen` only with a `token`, since anyone who reaches that address
    /// would otherwise act as the operator. A trace link must be an `http(s)` URL that names
    /// `{trace_id}`.
    pub(super) fn console(&mut self, raw: RawConsole) -> ConsoleSettings {
        let token = raw
            .token
            .as_ref()
            .and_then(|token| self.secret("console.token", token));
        let listen = raw
            .listen
            .as_ref()
            .and_then(|text| self.address("console.listen", text, "127.0.0.1:8788"));
        if listen.is_some() && raw.token.is_none() {
            self.error(
                "console.listen",
                "the console is served on TCP only with console.token",
            );
        }
        // A credential not read here (no $CREDENTIALS_DIRECTORY) is an empty placeholder, and
        // `secret` has said so: its length says nothing. A loaded secret is never empty.
        if token.as_ref().is_some_and(|token| {
            !token.expose().is_empty() && token.expose().len() < MIN_TOKEN_BYTES
        }) {
            self.warn(
                "console.token",
                format!(
                    "is shorter than {MIN_TOKEN_BYTES} bytes: whoever reaches console.listen may \
                     guess it (`openssl rand -hex 32` makes a good one)"
                ),
            );
        }
        let tls = raw
            .tls
            .as_ref()
            .and_then(|tls| self.tls("console.tls", tls));
        if raw.tls.is_some() && listen.is_none() {
            self.warn("console.tls", "has no effect without console.listen");
        }
        if let Some(addr) = listen.filter(|addr| !addr.ip().is_loopback() && raw.tls.is_none()) {
            self.warn(
                "console.listen",
                format!(
                    "{addr} is not a loopback address and there is no console.tls: the token \
                     and the pages would cross the network in plain HTTP"
                ),
            );
        }
        let trace_url = raw.trace_url.and_then(|text| match url::Url::parse(&text) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && text.contains(TRACE_ID) => {
                Some(text)
            }
            _ => {
                self.error(
                    "console.trace_url",
                    format!(
                        "{text:?} is not an http(s) URL with {TRACE_ID} in it, such as \
                         \"http://127.0.0.1:16686/trace/{TRACE_ID}\""
                    ),
                );
                None
            }
        });
        ConsoleSettings {
            enabled: raw.enabled.unwrap_or(true),
            listen,
            token,
            tls,
            trace_url,
        }
    }
}
