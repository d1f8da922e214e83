//! `[telemetry]` and `[console]`: where traces go, and the web console's switches.

use super::Checker;
use crate::config::raw::{RawConsole, RawTelemetry};
use crate::config::settings::TelemetrySettings;

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

    /// Whether the console's pages are served on the control socket (by default they are: the
    /// socket is already the operator's). `listen` and `token` are checked and accepted so that a
    /// config written for a console on TCP keeps working, but this version serves it on the
    /// control socket only, and says so (docs/reference.md, "Console").
    pub(super) fn console(&mut self, raw: RawConsole) -> bool {
        if let Some(token) = &raw.token {
            let _ = self.secret("console.token", token);
        }
        if raw.listen.is_some() && raw.token.is_none() {
            self.error(
                "console.listen",
                "the console is served on TCP only with console.token",
            );
        } else if raw.listen.is_some() {
            self.warn(
                "console.listen",
                "this version serves the console on the control socket only, not on TCP",
            );
        }
        raw.enabled.unwrap_or(true)
    }
}
