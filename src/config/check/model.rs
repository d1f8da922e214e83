//! `[model]`.

use std::time::Duration;

use super::Checker;
use crate::config::raw::RawModel;
use crate::config::settings::{ModelBackend, ModelSettings};
use crate::config::units::parse_duration;

impl Checker<'_> {
    pub(super) fn model(&mut self, raw: RawModel) -> Option<ModelSettings> {
        let backend_name = raw.backend.as_deref().unwrap_or("replay");
        let api_key = raw
            .api_key
            .as_ref()
            .and_then(|s| self.secret("model.api_key", s));
        let backend = match backend_name {
            "openai" => {
                let base_url = raw.base_url.clone().unwrap_or_default();
                if url::Url::parse(&base_url).is_err() {
                    self.error(
                        "model.base_url",
                        format!("{base_url:?} is not a URL such as \"http://127.0.0.1:8000/v1\""),
                    );
                }
                let Some(model) = raw.model.clone().filter(|m| !m.is_empty()) else {
                    self.error("model.model", "the openai backend needs a model name");
                    return None;
                };
                ModelBackend::OpenAi {
                    base_url: base_url.trim_end_matches('/').to_string(),
                    model,
                    api_key,
                }
            }
            "command" => {
                let argv = raw.command.clone().unwrap_or_default();
                self.argv("model.command", &argv);
                ModelBackend::Command { argv }
            }
            "replay" => {
                if let Some(path) = &raw.cassette
                    && !path.is_file()
                {
                    self.error(
                        "model.cassette",
                        format!("cassette {} does not exist", path.display()),
                    );
                }
                ModelBackend::Replay {
                    cassette: raw.cassette.clone(),
                }
            }
            other => {
                self.error(
                    "model.backend",
                    format!("unknown backend {other:?}; use openai, command or replay"),
                );
                return None;
            }
        };
        Some(ModelSettings {
            backend,
            request_timeout: self.duration(
                "model.request_timeout",
                raw.request_timeout,
                Duration::from_secs(120),
            ),
            max_retries: self.value("model.max_retries", raw.max_retries, 4, |n| {
                u32::try_from(n).map_err(|_| format!("{n} must be zero or more"))
            }),
            // Zero is allowed: the turn fails as soon as the retries are spent.
            outage_wait: self.value(
                "model.outage_wait",
                raw.outage_wait,
                Duration::from_secs(600),
                |text| parse_duration(&text),
            ),
            max_concurrent_requests: self.positive(
                "model.max_concurrent_requests",
                raw.max_concurrent_requests,
                16,
            ) as usize,
        })
    }
}
