//! `[model]`.

use std::time::Duration;

use super::Checker;
use crate::config::raw::{RawEndpoint, RawModel, RawPrice};
use crate::config::settings::{FallbackEndpoint, ModelBackend, ModelSettings};
use crate::config::units::parse_duration;
use crate::usage::Price;

/// Keys of a chat request that agentgate sets itself: `[model] params` may not change them.
const OWN_REQUEST_KEYS: [&str; 5] = ["model", "messages", "tools", "tool_choice", "stream"];

/// `[model] params` keys whose type servers check, and what it must be.
const TYPED_PARAMS: [(&str, ParamType); 6] = [
    ("temperature", ParamType::Number),
    ("top_p", ParamType::Number),
    ("presence_penalty", ParamType::Number),
    ("frequency_penalty", ParamType::Number),
    ("max_tokens", ParamType::Count),
    ("seed", ParamType::Count),
];

#[derive(Clone, Copy)]
enum ParamType {
    Number,
    /// A whole number, zero or more.
    Count,
}

impl Checker<'_> {
    /// `[model] params`: a table of JSON values merged into every chat request, none of them a
    /// key agentgate sets, the well-known ones of their type.
    fn model_params(
        &mut self,
        raw: Option<toml::Value>,
    ) -> serde_json::Map<String, serde_json::Value> {
        let Some(raw) = raw else {
            return serde_json::Map::new();
        };
        let Ok(serde_json::Value::Object(params)) = serde_json::to_value(raw) else {
            self.error("model.params", "params must be a table of request fields");
            return serde_json::Map::new();
        };
        for key in params.keys() {
            if OWN_REQUEST_KEYS.contains(&key.as_str()) {
                self.error(
                    &format!("model.params.{key}"),
                    format!("{key} is set by agentgate and cannot be overridden"),
                );
            }
        }
        for (key, kind) in TYPED_PARAMS {
            let Some(value) = params.get(key) else {
                continue;
            };
            let fits = match kind {
                ParamType::Number => value.is_number(),
                ParamType::Count => value.as_u64().is_some(),
            };
            if !fits {
                let expected = match kind {
                    ParamType::Number => "a number",
                    ParamType::Count => "a whole number, zero or more",
                };
                self.error(
                    &format!("model.params.{key}"),
                    format!("{key} must be {expected}, not {value}"),
                );
            }
        }
        params
    }

    /// `[model] price`: every rate given, none negative. Cached input is priced as input when
    /// its rate is not given (servers without a cache discount).
    pub(in crate::config) fn price(&mut self, raw: RawPrice) -> Option<Price> {
        let mut rate = |key: &str, value: Option<f64>| -> Option<f64> {
            let path = format!("model.price.{key}");
            match value {
                None => None,
                Some(value) if value.is_finite() && value >= 0.0 => Some(value),
                Some(value) => {
                    self.error(
                        &path,
                        format!("{value} must be a number of dollars, zero or more"),
                    );
                    None
                }
            }
        };
        let input = rate("input_per_mtok", raw.input_per_mtok);
        let cached = rate("cached_input_per_mtok", raw.cached_input_per_mtok);
        let output = rate("output_per_mtok", raw.output_per_mtok);
        let (Some(input_per_mtok), Some(output_per_mtok)) = (input, output) else {
            if raw.input_per_mtok.is_none() || raw.output_per_mtok.is_none() {
                self.error(
                    "model.price",
                    "a price needs input_per_mtok and output_per_mtok (US dollars per million tokens)",
                );
            }
            return None;
        };
        Some(Price {
            input_per_mtok,
            cached_input_per_mtok: cached.unwrap_or(input_per_mtok),
            output_per_mtok,
        })
    }

    /// An endpoint's `base_url`, without its trailing `/`.
    fn base_url(&mut self, key: &str, raw: Option<&str>) -> String {
        let base_url = raw.unwrap_or_default();
        if url::Url::parse(base_url).is_err() {
            self.error(
                key,
                format!(
                    "{} is not a URL such as \"http://127.0.0.1:8000/v1\"",
                    super::redacted_url(base_url)
                ),
            );
        }
        base_url.trim_end_matches('/').to_string()
    }

    /// `[model] fallback`: endpoints tried in order after the primary.
    fn fallback(&mut self, raw: Vec<RawEndpoint>) -> Vec<FallbackEndpoint> {
        raw.into_iter()
            .enumerate()
            .map(|(index, endpoint)| {
                let key = format!("model.fallback.{index}");
                if endpoint.model.is_empty() {
                    self.error(
                        &format!("{key}.model"),
                        "a fallback endpoint needs a model name",
                    );
                }
                FallbackEndpoint {
                    base_url: self.base_url(&format!("{key}.base_url"), Some(&endpoint.base_url)),
                    api_key: endpoint
                        .api_key
                        .as_ref()
                        .and_then(|secret| self.secret(&format!("{key}.api_key"), secret)),
                    model: endpoint.model,
                }
            })
            .collect()
    }

    pub(super) fn model(&mut self, mut raw: RawModel) -> Option<ModelSettings> {
        let backend_name = raw.backend.as_deref().unwrap_or("replay");
        let api_key = raw
            .api_key
            .as_ref()
            .and_then(|s| self.secret("model.api_key", s));
        let backend = match backend_name {
            "openai" => {
                let base_url = self.base_url("model.base_url", raw.base_url.as_deref());
                let Some(model) = raw.model.clone().filter(|m| !m.is_empty()) else {
                    self.error("model.model", "the openai backend needs a model name");
                    return None;
                };
                let fallback = raw.fallback.take().unwrap_or_default();
                ModelBackend::OpenAi {
                    base_url,
                    model,
                    api_key,
                    fallback: self.fallback(fallback),
                }
            }
            "command" | "replay" if raw.fallback.is_some() => {
                self.error(
                    "model.fallback",
                    "fallback endpoints are for the openai backend",
                );
                return None;
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
            params: self.model_params(raw.params),
            tool_calls_in_content: raw.tool_calls_in_content.unwrap_or(false),
            price: raw.price.and_then(|price| self.price(price)),
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
