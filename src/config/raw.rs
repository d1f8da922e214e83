//! The config file's shape as serde reads it: every key optional where it has a default, unknown
//! keys refused. `check` turns it into settings.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use crate::secret::SecretSource;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) state_dir: Option<PathBuf>,
    #[serde(default)]
    pub(super) server: RawServer,
    #[serde(default)]
    pub(super) runtime: RawRuntime,
    #[serde(default)]
    pub(super) model: RawModel,
    #[serde(default)]
    pub(super) store: RawStore,
    #[serde(default)]
    pub(super) tools: BTreeMap<String, RawTool>,
    #[serde(default)]
    pub(super) mcp: BTreeMap<String, RawMcp>,
    #[serde(default)]
    pub(super) routes: BTreeMap<String, RawRoute>,
    pub(super) budgets: Option<RawBudgets>,
    #[serde(default)]
    pub(super) telemetry: RawTelemetry,
    #[serde(default)]
    pub(super) console: RawConsole,
}

/// `[telemetry]`: traces over OTLP/HTTP.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    pub(super) otlp_endpoint: Option<String>,
    pub(super) sample_ratio: Option<f64>,
    pub(super) capture_content: Option<bool>,
}

/// `[console]`: the web console.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConsole {
    pub(super) enabled: Option<bool>,
    pub(super) listen: Option<String>,
    pub(super) token: Option<SecretSource>,
    pub(super) tls: Option<RawTls>,
    pub(super) trace_url: Option<String>,
}

/// `[budgets]`, or a route's `budget`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBudgets {
    pub(super) turn_tokens: Option<i64>,
    pub(super) turn_usd: Option<f64>,
    pub(super) session_tokens: Option<i64>,
    pub(super) session_usd: Option<f64>,
    pub(super) daily_tokens: Option<i64>,
    pub(super) daily_usd: Option<f64>,
    pub(super) warn_at: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<String>,
    pub(super) control_socket: Option<PathBuf>,
    pub(super) max_body: Option<String>,
    pub(super) header_timeout: Option<String>,
    pub(super) keepalive_timeout: Option<String>,
    pub(super) max_connections: Option<i64>,
    pub(super) max_connections_per_peer: Option<i64>,
    pub(super) tls: Option<RawTls>,
    pub(super) trusted_proxies: Option<Vec<String>>,
    pub(super) metrics_listen: Option<String>,
    pub(super) public_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub(super) cert: SecretSource,
    pub(super) key: SecretSource,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRuntime {
    pub(super) max_concurrent_turns: Option<i64>,
    pub(super) max_turn_steps: Option<i64>,
    pub(super) drain_timeout: Option<String>,
    pub(super) turn_idle_timeout: Option<String>,
    pub(super) resume_max_attempts: Option<i64>,
    pub(super) resume_window: Option<String>,
    pub(super) dedup_window: Option<String>,
    pub(super) max_queued_events: Option<i64>,
    pub(super) min_free_disk: Option<String>,
    pub(super) max_tool_calls_per_reply: Option<i64>,
    pub(super) max_repeated_tool_calls: Option<i64>,
    pub(super) approval_timeout: Option<String>,
    pub(super) max_background_jobs: Option<i64>,
    pub(super) max_background_jobs_per_session: Option<i64>,
    pub(super) max_internal_turns: Option<i64>,
    pub(super) event_log_level: Option<String>,
    pub(super) event_log_max_per_second: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    pub(super) backend: Option<String>,
    pub(super) base_url: Option<String>,
    pub(super) model: Option<String>,
    pub(super) api_key: Option<SecretSource>,
    pub(super) request_timeout: Option<String>,
    pub(super) max_retries: Option<i64>,
    pub(super) outage_wait: Option<String>,
    pub(super) params: Option<toml::Value>,
    pub(super) tool_calls_in_content: Option<bool>,
    pub(super) price: Option<RawPrice>,
    pub(super) fallback: Option<Vec<RawEndpoint>>,
    pub(super) command: Option<Vec<String>>,
    pub(super) cassette: Option<PathBuf>,
    pub(super) max_concurrent_requests: Option<i64>,
}

/// One of `[model] fallback`: another OpenAI-compatible endpoint.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEndpoint {
    pub(super) base_url: String,
    pub(super) model: String,
    pub(super) api_key: Option<SecretSource>,
}

/// `[model] price`: US dollars per million tokens.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrice {
    pub(super) input_per_mtok: Option<f64>,
    pub(super) cached_input_per_mtok: Option<f64>,
    pub(super) output_per_mtok: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) backend: Option<String>,
    pub(super) url: Option<SecretSource>,
    pub(super) node: Option<String>,
    pub(super) lease_ttl: Option<String>,
    pub(super) pool_size: Option<i64>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) retention: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTool {
    pub(super) description: Option<String>,
    pub(super) command: Vec<String>,
    pub(super) parameters: Option<toml::Value>,
    pub(super) timeout: Option<String>,
    pub(super) idempotent: Option<bool>,
    pub(super) background: Option<bool>,
    pub(super) dedupes: Option<bool>,
    pub(super) approval: Option<bool>,
    pub(super) sandbox: Option<String>,
    pub(super) network: Option<bool>,
    pub(super) writable: Option<Vec<PathBuf>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMcp {
    pub(super) command: Option<Vec<String>>,
    #[serde(default)]
    pub(super) env: BTreeMap<String, SecretSource>,
    pub(super) cwd: Option<PathBuf>,
    pub(super) url: Option<String>,
    #[serde(default)]
    pub(super) headers: BTreeMap<String, SecretSource>,
    pub(super) timeout: Option<String>,
    #[serde(default)]
    pub(super) idempotent: Vec<String>,
    #[serde(default)]
    pub(super) not_idempotent: Vec<String>,
    #[serde(default)]
    pub(super) dedupes: Vec<String>,
    #[serde(default)]
    pub(super) approval: Vec<String>,
    pub(super) sandbox: Option<String>,
    pub(super) network: Option<bool>,
    pub(super) writable: Option<Vec<PathBuf>>,
    pub(super) max_instances: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) path: String,
    pub(super) verify: RawVerify,
    pub(super) events: Option<Vec<String>>,
    pub(super) session: Option<String>,
    pub(super) system: Option<String>,
    pub(super) prompt: Option<String>,
    pub(super) interactive: Option<bool>,
    #[serde(default)]
    pub(super) tools: Vec<String>,
    pub(super) on_busy: Option<String>,
    pub(super) deliver: Option<RawDeliver>,
    pub(super) rate_limit: Option<String>,
    pub(super) max_queued_events: Option<i64>,
    pub(super) priority: Option<i64>,
    pub(super) coalesce: Option<String>,
    pub(super) max_body: Option<String>,
    pub(super) event_type: Option<String>,
    pub(super) delivery_id: Option<String>,
    pub(super) history: Option<RawHistory>,
    #[serde(default)]
    pub(super) hidden_headers: Vec<String>,
    pub(super) budget: Option<RawBudgets>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHistory {
    pub(super) max_turns: Option<i64>,
    pub(super) max_bytes: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawVerify {
    pub(super) scheme: String,
    pub(super) secret: Option<SecretSource>,
    pub(super) secrets: Option<Vec<SecretSource>>,
    pub(super) header: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDeliver {
    pub(super) kind: String,
    pub(super) url: Option<SecretSource>,
    pub(super) secret: Option<SecretSource>,
    pub(super) command: Option<Vec<String>>,
    pub(super) concurrency: Option<i64>,
    pub(super) sandbox: Option<String>,
    pub(super) network: Option<bool>,
    pub(super) writable: Option<Vec<PathBuf>>,
}
