//! Typed settings: what the rest of agentgate reads, after `check` validated the raw values.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::units::Rate;
use crate::logging::EventLogLevel;
use crate::secret::Secret;
use crate::signature::VerifySettings;
use crate::tls::TlsSettings;
pub(crate) use crate::usage::BudgetLimits;
use crate::usage::Price;

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Config {
    pub state_dir: PathBuf,
    pub server: ServerSettings,
    pub runtime: RuntimeSettings,
    pub model: ModelSettings,
    pub store: StoreSettings,
    /// `[store] retention`: finished work older than this is deleted.
    pub retention: Duration,
    pub tools: BTreeMap<String, ToolSettings>,
    /// `[mcp.NAME]`: MCP servers whose tools routes may offer.
    pub mcp: BTreeMap<String, McpServerSettings>,
    pub routes: Vec<RouteSettings>,
    /// What no sandboxed process may see.
    pub hidden: HiddenPaths,
    /// `[budgets]`: caps on what model replies spend, for every route (`daily_*`: all routes
    /// together).
    pub budgets: BudgetLimits,
    /// `[telemetry]`: where traces go.
    pub telemetry: TelemetrySettings,
    /// `[console]`: the web console.
    pub console: ConsoleSettings,
}

/// `[console]` (docs/reference.md, "Console").
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ConsoleSettings {
    /// The pages are served (on the control socket, and on `listen`).
    pub enabled: bool,
    /// Also served on this TCP address, to a browser that presents `token`.
    pub listen: Option<SocketAddr>,
    /// What a browser presents on `listen`; never needed on the control socket.
    pub token: Option<Secret>,
    /// HTTPS on `listen` with this certificate and key.
    pub tls: Option<TlsSettings>,
    /// Where an event's trace is shown: a URL with `{trace_id}` in it.
    pub trace_url: Option<String>,
}

/// What `console.trace_url` has replaced by an event's trace id.
pub(crate) const TRACE_ID: &str = "{trace_id}";

impl ConsoleSettings {
    /// The link to the trace `trace_id` (W3C: hex digits), when `trace_url` is set.
    pub(crate) fn trace_link(&self, trace_id: &str) -> Option<String> {
        let template = self.trace_url.as_ref()?;
        let hex = !trace_id.is_empty() && trace_id.bytes().all(|b| b.is_ascii_hexdigit());
        hex.then(|| template.replace(TRACE_ID, trace_id))
    }
}

/// `[telemetry]` (docs/reference.md, "Traces").
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TelemetrySettings {
    /// The OTLP/HTTP collector (`http://host:4318`); no traces without one.
    pub otlp_endpoint: Option<String>,
    /// The share of new traces recorded; a trace that arrives with a parent follows the
    /// parent's decision.
    pub sample_ratio: f64,
    /// Messages, tool arguments and results become span attributes.
    pub capture_content: bool,
}

/// What a child process (a command tool, a stdio MCP server, a command delivery) may reach:
/// `sandbox`, `network` and `writable` (docs/tools.md, "Sandbox").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Sandboxing {
    /// In a bubblewrap sandbox: nothing of [`HiddenPaths`], a private `/tmp`, the rest of the
    /// file system read-only but for `writable`, no privileges, and no network unless `network`.
    Strict {
        network: bool,
        writable: Vec<PathBuf>,
    },
    /// As the daemon's user, with everything it can reach (`sandbox = "none"`).
    Off,
}

/// A child of the config that runs only sandboxed: its config key and its sandbox's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StrictChild {
    pub key: String,
    pub network: bool,
    pub writable: Vec<PathBuf>,
}

/// The children of `config` that run only sandboxed (command tools, stdio MCP servers, command
/// deliveries with `sandbox = "strict"`).
pub(crate) fn strict_children(config: &Config) -> Vec<StrictChild> {
    let strict = |key: String, sandbox: &Sandboxing| match sandbox {
        Sandboxing::Strict { network, writable } => Some(StrictChild {
            key,
            network: *network,
            writable: writable.clone(),
        }),
        Sandboxing::Off => None,
    };
    let tools = config
        .tools
        .values()
        .filter_map(|tool| strict(format!("tools.{}", tool.name), &tool.sandbox));
    let servers = config
        .mcp
        .values()
        .filter_map(|server| match &server.transport {
            McpTransport::Stdio { sandbox, .. } => strict(format!("mcp.{}", server.name), sandbox),
            McpTransport::Http { .. } => None,
        });
    let deliveries = config
        .routes
        .iter()
        .filter_map(|route| match &route.deliver {
            DeliverSettings::Command { sandbox, .. } => {
                strict(format!("routes.{}.deliver", route.name), sandbox)
            }
            DeliverSettings::Log | DeliverSettings::Http { .. } => None,
        });
    tools.chain(servers).chain(deliveries).collect()
}

/// The paths a sandboxed process never sees, whatever its `writable` says: the state directory
/// (every session's transcript and payload), the credentials directory, the control socket, the
/// config file and every secret file the config names. Paths that do not exist are skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HiddenPaths {
    pub dirs: Vec<PathBuf>,
    pub files: Vec<PathBuf>,
}

/// How much of a session's earlier turns a route shows the model (`history = { max_turns,
/// max_bytes }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HistoryLimits {
    pub max_turns: usize,
    pub max_bytes: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServerSettings {
    pub listen: SocketAddr,
    pub control_socket: PathBuf,
    pub max_body: u64,
    pub header_timeout: Duration,
    /// How long an idle keep-alive connection stays open.
    pub keepalive_timeout: Duration,
    /// Open webhook connections at most; further ones wait in the kernel's backlog.
    pub max_connections: usize,
    /// Open webhook connections from one peer address at most (trusted proxies exempt).
    pub max_connections_per_peer: usize,
    /// HTTPS on the webhook socket.
    pub tls: Option<TlsSettings>,
    /// Reverse proxies whose `X-Forwarded-For` names the client.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// A TCP address that serves `GET /metrics` alone, for Prometheus.
    pub metrics_listen: Option<SocketAddr>,
    /// How senders and people reach the webhook listener (`[server] public_url`, no trailing
    /// slash): approval links are built on it.
    pub public_url: Option<String>,
}

/// `[runtime]`. Every key applies at once on a reload: code reads these from the settings in
/// effect where it uses them, and keeps no copy from the start (the reload report,
/// `config::list_changes`, says so for each).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RuntimeSettings {
    pub max_concurrent_turns: usize,
    pub max_turn_steps: u32,
    pub drain_timeout: Duration,
    pub turn_idle_timeout: Duration,
    pub resume_max_attempts: u32,
    pub resume_window: Duration,
    pub dedup_window: Duration,
    /// Accepted but not yet run; past it new webhooks get 503.
    pub max_queued_events: u64,
    /// Free bytes the state file system keeps; below it new webhooks get 503.
    pub min_free_disk: u64,
    /// Tool calls of one model reply that run; the rest get an error result.
    pub max_tool_calls_per_reply: usize,
    /// Identical calls (same tool, same arguments) one turn runs; later ones are not run.
    pub max_repeated_tool_calls: u32,
    /// A tool call waiting for an operator's decision longer than this does not run.
    pub approval_timeout: Duration,
    /// Background jobs running at once, in all and per session.
    pub max_background_jobs: usize,
    pub max_background_jobs_per_session: usize,
    /// Internal turns (background job results) one external event may cause in a row; the
    /// next one ends `failed` instead of running.
    pub max_internal_turns: u32,
    /// The level of per-event log lines, and how many a second are written at most (0: all).
    pub event_log_level: EventLogLevel,
    pub event_log_max_per_second: u32,
}

/// Where the state lives: SQLite in `state_dir` (one node), or PostgreSQL shared by many nodes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StoreSettings {
    Sqlite,
    Postgres(PostgresSettings),
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PostgresSettings {
    /// A libpq connection string or `postgres://` URL; it may hold a password.
    pub url: Secret,
    /// This node's name in `status` and the journal (default: the host name).
    pub node: String,
    /// How long a session or delivery stays owned by a node that stopped renewing it.
    pub lease_ttl: Duration,
    pub pool_size: usize,
    /// PEM certificates that sign the server's certificate, for `sslmode=require`; without it
    /// the public web roots are used.
    pub ca_file: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ModelBackend {
    OpenAi {
        base_url: String,
        model: String,
        api_key: Option<Secret>,
        /// `fallback`: tried in order when this endpoint fails after its retries.
        fallback: Vec<FallbackEndpoint>,
    },
    Command {
        argv: Vec<String>,
    },
    /// `None`: the bundled demo cassette.
    Replay {
        cassette: Option<PathBuf>,
    },
}

/// One of `[model] fallback`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FallbackEndpoint {
    pub base_url: String,
    pub model: String,
    pub api_key: Option<Secret>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ModelSettings {
    pub backend: ModelBackend,
    pub request_timeout: Duration,
    pub max_retries: u32,
    /// How long a turn waits for a model that is unavailable after its retries.
    pub outage_wait: Duration,
    /// Merged into every chat request (`[model] params`): temperature, max_tokens and the like.
    pub params: serde_json::Map<String, serde_json::Value>,
    /// A reply whose whole content is one JSON call of an offered tool is taken as that call.
    pub tool_calls_in_content: bool,
    /// What tokens cost (`[model] price`), for cost figures and dollar budgets.
    pub price: Option<Price>,
    /// Requests in flight to the model at most, whatever the number of running turns.
    pub max_concurrent_requests: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolSettings {
    pub name: String,
    pub description: String,
    pub command: Vec<String>,
    pub parameters: serde_json::Value,
    pub timeout: Duration,
    pub idempotent: bool,
    pub background: bool,
    pub sandbox: Sandboxing,
    /// The tool honours its call's key (`AGENTGATE_TOOL_CALL_ID`), so a re-run after an
    /// interruption has no second effect.
    pub dedupes: bool,
    /// Every call waits for an operator's decision before it runs.
    pub approval: bool,
}

/// `[mcp.NAME]`: an MCP server and what agentgate may assume about its tools.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct McpServerSettings {
    pub name: String,
    pub transport: McpTransport,
    /// How long one tool call may take.
    pub timeout: Duration,
    /// Tools re-run after an interruption, whatever their annotations say.
    pub idempotent: Vec<String>,
    /// Tools never re-run after an interruption, whatever their annotations say.
    pub not_idempotent: Vec<String>,
    /// Tools that honour the call key in `_meta`, so a re-run has no second effect.
    pub dedupes: Vec<String>,
    /// Tools whose calls wait for an operator's decision: names, or `prefix*` patterns.
    pub approval: Vec<String>,
}

impl McpServerSettings {
    /// Whether calls of the server's tool `tool` wait for an operator's decision.
    pub(crate) fn needs_approval(&self, tool: &str) -> bool {
        self.approval
            .iter()
            .any(|pattern| match pattern.strip_suffix('*') {
                Some(prefix) => tool.starts_with(prefix),
                None => pattern == tool,
            })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum McpTransport {
    /// A child process speaking MCP on its stdin and stdout.
    Stdio {
        command: Vec<String>,
        env: BTreeMap<String, Secret>,
        cwd: Option<PathBuf>,
        sandbox: Sandboxing,
        /// Processes of it running at once: each turn that calls it has one of its own.
        max_instances: usize,
    },
    /// The streamable HTTP transport.
    Http {
        url: String,
        headers: BTreeMap<String, Secret>,
    },
}

/// A route's `tools` entry: a command tool by name, or tools of an MCP server
/// (`"NAME.tool"`, or `"NAME.*"` for all of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToolRef {
    Command(String),
    Mcp {
        server: String,
        tool: Option<String>,
    },
}

impl std::fmt::Display for ToolRef {
    /// As a route's `tools` names it: `name`, `server.tool` or `server.*`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ToolRef::Command(name) => f.write_str(name),
            ToolRef::Mcp { server, tool } => {
                write!(f, "{server}.{}", tool.as_deref().unwrap_or("*"))
            }
        }
    }
}

impl ToolRef {
    pub(crate) fn parse(entry: &str) -> ToolRef {
        match entry.split_once('.') {
            Some((server, "*")) => ToolRef::Mcp {
                server: server.to_string(),
                tool: None,
            },
            Some((server, tool)) => ToolRef::Mcp {
                server: server.to_string(),
                tool: Some(tool.to_string()),
            },
            None => ToolRef::Command(entry.to_string()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnBusy {
    Queue,
    Interrupt,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum DeliverSettings {
    Log,
    /// `url` may itself be a secret (Slack, Discord and Teams incoming-webhook URLs are): logs and
    /// errors show only its scheme and host.
    Http {
        url: Secret,
        key: Option<Secret>,
        concurrency: usize,
    },
    Command {
        argv: Vec<String>,
        concurrency: usize,
        sandbox: Sandboxing,
    },
}

impl DeliverSettings {
    /// How many deliveries to this target may be in flight at once.
    pub(crate) fn concurrency(&self) -> usize {
        match self {
            DeliverSettings::Log => usize::MAX,
            DeliverSettings::Http { concurrency, .. }
            | DeliverSettings::Command { concurrency, .. } => *concurrency,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RouteSettings {
    pub name: String,
    pub path: String,
    pub verify: VerifySettings,
    pub events: Option<Vec<String>>,
    pub session: Option<String>,
    pub system: String,
    pub prompt: String,
    /// Template of the event type; overrides the scheme's.
    pub event_type: Option<String>,
    /// Template of the dedup key; overrides the scheme's.
    pub delivery_id: Option<String>,
    /// What of the session's earlier turns the model sees.
    pub history: HistoryLimits,
    /// Request headers kept out of storage beyond the built-in list (lower case).
    pub hidden_headers: Vec<String>,
    pub interactive: bool,
    pub tools: Vec<ToolRef>,
    pub on_busy: OnBusy,
    pub deliver: DeliverSettings,
    pub rate_limit: Option<Rate>,
    /// Events of this route queued at most; `None`: an even share of `runtime.max_queued_events`
    /// (docs/reference.md, "Routes").
    pub max_queued_events: Option<u64>,
    /// Higher runs first when turns wait for a slot, each step worth a minute of waiting
    /// (docs/reference.md, "Priority"); -1000 to 1000, default 0.
    pub priority: i32,
    /// Events of a session that arrive while one of it is queued join it, up to this long after
    /// it arrived (docs/reference.md, "Coalescing"); at most an hour.
    pub coalesce: Option<Duration>,
    pub max_body: u64,
    /// `budget`: this route's caps (see [`BudgetLimits`]).
    pub budget: BudgetLimits,
}

/// The system text every route gets before its own: the payload is data, never instructions.
pub(crate) const DEFAULT_SYSTEM: &str = "You are an operations agent run by agentgate.";
/// The prompt when a route sets none.
pub(crate) const DEFAULT_PROMPT: &str = "A {{ event_type or \"webhook\" }} event arrived on route {{ route }}:\n{{ payload | tojson(indent=2) }}";

/// A config with its compiled route templates: what a reload swaps as one unit.
pub(crate) struct Settings {
    pub config: Config,
    pub templates: crate::template::RouteTemplates,
    /// The routes' `priority`, as the store's claims take them: a JSON object of route name to
    /// priority, of the routes whose priority is not 0; `None` when every route is at 0.
    /// Made once per config, since the scheduler reads it at every claim.
    pub priorities: Option<std::sync::Arc<str>>,
}

impl Settings {
    pub(crate) fn new(config: Config) -> Result<Settings, String> {
        let templates =
            crate::template::RouteTemplates::compile(config.routes.iter().map(|route| {
                crate::template::TemplateSources {
                    route: &route.name,
                    session: route.session.as_deref(),
                    system: &route.system,
                    prompt: &route.prompt,
                    event_type: route.event_type.as_deref(),
                    delivery_id: route.delivery_id.as_deref(),
                }
            }))?;
        let priorities: serde_json::Map<String, serde_json::Value> = config
            .routes
            .iter()
            .filter(|route| route.priority != 0)
            .map(|route| (route.name.clone(), route.priority.into()))
            .collect();
        let priorities = (!priorities.is_empty())
            .then(|| serde_json::Value::Object(priorities).to_string().into());
        Ok(Settings {
            config,
            templates,
            priorities,
        })
    }

    pub(crate) fn route(&self, name: &str) -> Option<&RouteSettings> {
        self.config.routes.iter().find(|route| route.name == name)
    }
}

/// A value that a reload replaces while readers keep the snapshot they took.
pub(crate) struct Shared<T>(std::sync::RwLock<std::sync::Arc<T>>);

impl<T> Shared<T> {
    pub(crate) fn new(value: T) -> Shared<T> {
        Shared(std::sync::RwLock::new(std::sync::Arc::new(value)))
    }

    pub(crate) fn get(&self) -> std::sync::Arc<T> {
        crate::locks::read(&self.0).clone()
    }

    pub(crate) fn replace(&self, value: T) {
        *crate::locks::write(&self.0) = std::sync::Arc::new(value);
    }
}
