//! The configuration file: strict TOML in, typed settings and findings out.
//!
//! Parsing is two passes. serde rejects unknown keys and wrong types; then `check` turns the raw
//! values into typed settings, collecting every problem as a [`Finding`] that names the key path and
//! the line it is on, so an operator fixes all of them in one edit instead of one per restart.

mod secret;
mod units;

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub(crate) use secret::{Secret, SecretSource};
pub(crate) use units::Rate;
use units::{parse_duration, parse_rate, parse_size};

/// The default location of the config file.
pub(crate) const DEFAULT_CONFIG_PATH: &str = "/etc/agentgate/agentgate.toml";
/// Used when no config file is named and the default file does not exist: a loopback demo route
/// with the bundled replay cassette as the model, state under `./agentgate-state`.
pub(crate) const EMBEDDED_DEFAULTS: &str = include_str!("../examples/quickstart.toml");

/// Where the config came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConfigSource {
    File(PathBuf),
    Embedded,
}

impl ConfigSource {
    /// `--config`, else `$AGENTGATE_CONFIG`, else the default path, else the embedded defaults.
    pub(crate) fn resolve(explicit: Option<&Path>) -> ConfigSource {
        if let Some(path) = explicit {
            return ConfigSource::File(path.to_path_buf());
        }
        if let Some(path) = std::env::var_os("AGENTGATE_CONFIG").filter(|p| !p.is_empty()) {
            return ConfigSource::File(PathBuf::from(path));
        }
        let default = Path::new(DEFAULT_CONFIG_PATH);
        if default.exists() {
            ConfigSource::File(default.to_path_buf())
        } else {
            ConfigSource::Embedded
        }
    }
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigSource::File(path) => write!(f, "{}", path.display()),
            ConfigSource::Embedded => f.write_str("<embedded defaults>"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Severity {
    Warning,
    Error,
}

/// One problem in the config, located by key path and line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Finding {
    pub severity: Severity,
    pub key: String,
    pub line: Option<usize>,
    pub message: String,
}

/// A finding together with the file it is in, ready to print on one line.
pub(crate) struct LocatedFinding<'a> {
    pub source: &'a ConfigSource,
    pub finding: &'a Finding,
}

impl fmt::Display for LocatedFinding<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let finding = self.finding;
        let severity = match finding.severity {
            Severity::Warning => "warning",
            Severity::Error => "error",
        };
        match finding.line {
            Some(line) => write!(f, "{}:{line}: {severity}", self.source)?,
            None => write!(f, "{}: {severity}", self.source)?,
        }
        if !finding.key.is_empty() {
            write!(f, ": {}", finding.key)?;
        }
        write!(f, ": {}", finding.message)
    }
}

/// Why a config could not be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {source_name} has {} error(s)", count_errors(.findings))]
    Invalid {
        source_name: ConfigSource,
        findings: Vec<Finding>,
    },
}

fn count_errors(findings: &[Finding]) -> usize {
    findings
        .iter()
        .filter(|f| f.severity == Severity::Error)
        .count()
}

// ---------------------------------------------------------------------------------------------
// Raw shape (serde)
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    state_dir: Option<PathBuf>,
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    runtime: RawRuntime,
    #[serde(default)]
    model: RawModel,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    tools: BTreeMap<String, RawTool>,
    #[serde(default)]
    routes: BTreeMap<String, RawRoute>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    control_socket: Option<PathBuf>,
    max_body: Option<String>,
    header_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuntime {
    max_concurrent_turns: Option<i64>,
    max_turn_steps: Option<i64>,
    drain_timeout: Option<String>,
    turn_idle_timeout: Option<String>,
    resume_max_attempts: Option<i64>,
    resume_window: Option<String>,
    dedup_window: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    backend: Option<String>,
    base_url: Option<String>,
    model: Option<String>,
    api_key: Option<SecretSource>,
    request_timeout: Option<String>,
    max_retries: Option<i64>,
    command: Option<Vec<String>>,
    cassette: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    backend: Option<String>,
    url: Option<SecretSource>,
    node: Option<String>,
    lease_ttl: Option<String>,
    pool_size: Option<i64>,
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    description: Option<String>,
    command: Vec<String>,
    parameters: Option<toml::Value>,
    timeout: Option<String>,
    idempotent: Option<bool>,
    background: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    path: String,
    verify: RawVerify,
    events: Option<Vec<String>>,
    session: Option<String>,
    system: Option<String>,
    prompt: Option<String>,
    interactive: Option<bool>,
    #[serde(default)]
    tools: Vec<String>,
    on_busy: Option<String>,
    deliver: Option<RawDeliver>,
    rate_limit: Option<String>,
    max_body: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVerify {
    scheme: String,
    secret: Option<SecretSource>,
    header: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeliver {
    kind: String,
    url: Option<String>,
    secret: Option<SecretSource>,
    command: Option<Vec<String>>,
}

// ---------------------------------------------------------------------------------------------
// Typed settings
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub state_dir: PathBuf,
    pub server: ServerSettings,
    pub runtime: RuntimeSettings,
    pub model: ModelSettings,
    pub store: StoreSettings,
    pub tools: BTreeMap<String, ToolSettings>,
    pub routes: Vec<RouteSettings>,
}

#[derive(Debug, Clone)]
pub(crate) struct ServerSettings {
    pub listen: SocketAddr,
    pub control_socket: PathBuf,
    pub max_body: u64,
    pub header_timeout: Duration,
}

#[derive(Debug, Clone)]
pub(crate) struct RuntimeSettings {
    pub max_concurrent_turns: usize,
    pub max_turn_steps: u32,
    pub drain_timeout: Duration,
    pub turn_idle_timeout: Duration,
    pub resume_max_attempts: u32,
    pub resume_window: Duration,
    pub dedup_window: Duration,
}

/// Where the state lives: SQLite in `state_dir` (one node), or PostgreSQL shared by many nodes.
#[derive(Debug, Clone)]
pub(crate) enum StoreSettings {
    Sqlite,
    Postgres(PostgresSettings),
}

#[derive(Debug, Clone)]
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

#[derive(Debug, Clone)]
pub(crate) enum ModelBackend {
    OpenAi {
        base_url: String,
        model: String,
        api_key: Option<Secret>,
    },
    Command {
        argv: Vec<String>,
    },
    /// `None`: the bundled demo cassette.
    Replay {
        cassette: Option<PathBuf>,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct ModelSettings {
    pub backend: ModelBackend,
    pub request_timeout: Duration,
    pub max_retries: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct ToolSettings {
    pub name: String,
    pub description: String,
    pub command: Vec<String>,
    pub parameters: serde_json::Value,
    pub timeout: Duration,
    pub idempotent: bool,
    pub background: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VerifyScheme {
    Github,
    Standard,
    Stripe,
    Slack,
    Gitlab,
    Bearer,
    HmacSha256,
    None,
}

impl VerifyScheme {
    fn parse(name: &str) -> Option<VerifyScheme> {
        Some(match name {
            "github" => VerifyScheme::Github,
            "standard" => VerifyScheme::Standard,
            "stripe" => VerifyScheme::Stripe,
            "slack" => VerifyScheme::Slack,
            "gitlab" => VerifyScheme::Gitlab,
            "bearer" => VerifyScheme::Bearer,
            "hmac-sha256" => VerifyScheme::HmacSha256,
            "none" => VerifyScheme::None,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
pub(crate) struct VerifySettings {
    pub scheme: VerifyScheme,
    /// The key bytes as the scheme uses them (`standard`: the decoded `whsec_` key).
    pub key: Option<Secret>,
    /// `hmac-sha256`: the header that carries the signature.
    pub header: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnBusy {
    Queue,
    Interrupt,
}

#[derive(Debug, Clone)]
pub(crate) enum DeliverSettings {
    Log,
    Http { url: String, key: Option<Secret> },
    Command { argv: Vec<String> },
}

#[derive(Debug, Clone)]
pub(crate) struct RouteSettings {
    pub name: String,
    pub path: String,
    pub verify: VerifySettings,
    pub events: Option<Vec<String>>,
    pub session: Option<String>,
    pub system: String,
    pub prompt: String,
    pub interactive: bool,
    pub tools: Vec<String>,
    pub on_busy: OnBusy,
    pub deliver: DeliverSettings,
    pub rate_limit: Option<Rate>,
    pub max_body: u64,
}

/// The system text every route gets before its own: the payload is data, never instructions.
pub(crate) const DEFAULT_SYSTEM: &str = "You are an operations agent run by agentgate.";
/// The prompt when a route sets none.
pub(crate) const DEFAULT_PROMPT: &str = "A {{ event_type or \"webhook\" }} event arrived on route {{ route }}:\n{{ payload | tojson(indent=2) }}";

/// A config with its compiled route templates: what a reload swaps as one unit.
pub(crate) struct Settings {
    pub config: Config,
    pub templates: crate::template::RouteTemplates,
}

impl Settings {
    pub(crate) fn new(config: Config) -> Result<Settings, String> {
        let templates = crate::template::RouteTemplates::compile(&config.routes)?;
        Ok(Settings { config, templates })
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
        match self.0.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub(crate) fn replace(&self, value: T) {
        let value = std::sync::Arc::new(value);
        match self.0.write() {
            Ok(mut guard) => *guard = value,
            Err(poisoned) => *poisoned.into_inner() = value,
        }
    }
}

/// A successfully loaded config plus the warnings found on the way.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub config: Config,
    pub warnings: Vec<Finding>,
}

fn read_source(source: &ConfigSource) -> Result<String, ConfigError> {
    match source {
        ConfigSource::File(path) => {
            std::fs::read_to_string(path).map_err(|err| ConfigError::Unreadable {
                path: path.clone(),
                source: err,
            })
        }
        ConfigSource::Embedded => Ok(EMBEDDED_DEFAULTS.to_string()),
    }
}

/// Whether every secret must load, or credentials may be left for the service to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SecretCheck {
    /// `serve`, `send`: a secret that cannot be loaded is an error.
    Required,
    /// `check-config`, `reconcile`: outside the service there may be no `$CREDENTIALS_DIRECTORY`;
    /// credentials are then checked when the service starts, and said so in a warning.
    CredentialsOptional,
}

/// Reads and checks the config from `source`.
pub(crate) fn load(source: &ConfigSource, secrets: SecretCheck) -> Result<Loaded, ConfigError> {
    let text = read_source(source)?;
    with_process_environment(secrets, |environment| {
        check(source.clone(), &text, environment)
    })
}

/// Runs `use_it` with the environment systemd gives the process ($CREDENTIALS_DIRECTORY,
/// $STATE_DIRECTORY).
fn with_process_environment<T>(
    secrets: SecretCheck,
    use_it: impl FnOnce(&Environment<'_>) -> T,
) -> T {
    let credentials = std::env::var_os("CREDENTIALS_DIRECTORY").map(PathBuf::from);
    let state_directory = std::env::var_os("STATE_DIRECTORY").map(PathBuf::from);
    use_it(&Environment {
        credentials_dir: credentials.as_deref(),
        state_directory: state_directory.as_deref(),
        secrets,
    })
}

/// Only the state directory of the config at `source`, for commands that inspect state: they
/// must work where the route secrets (systemd credentials of the service) are not readable.
/// Where the state is, for the operator commands (`status`, `sessions`, `ledger`): only
/// `state_dir` and `[store]` are read, so a config with errors elsewhere does not hide the state.
pub(crate) fn state_location(
    source: &ConfigSource,
) -> Result<(PathBuf, StoreSettings), ConfigError> {
    #[derive(Deserialize)]
    struct StateOnly {
        state_dir: Option<PathBuf>,
        #[serde(default)]
        store: RawStore,
    }
    let text = read_source(source)?;
    let locator = Locator::new(&text);
    let parsed: StateOnly = toml::from_str(&text).map_err(|err| ConfigError::Invalid {
        source_name: source.clone(),
        findings: vec![syntax_finding(&err, &locator)],
    })?;
    with_process_environment(SecretCheck::Required, |environment| {
        let mut checker = Checker {
            locator: &locator,
            findings: Vec::new(),
            environment,
        };
        // An operator command runs no turns: the default pool for max_concurrent_turns = 16
        // is plenty.
        match checker.store(parsed.store, 16) {
            Some(store) if count_errors(&checker.findings) == 0 => Ok((
                resolve_state_dir(parsed.state_dir, environment.state_directory),
                store,
            )),
            _ => Err(ConfigError::Invalid {
                source_name: source.clone(),
                findings: checker.findings,
            }),
        }
    })
}

/// `state_dir`, else the first of `$STATE_DIRECTORY`, else /var/lib/agentgate.
fn resolve_state_dir(configured: Option<PathBuf>, state_directory: Option<&Path>) -> PathBuf {
    configured
        .or_else(|| {
            state_directory.and_then(|dirs| {
                dirs.to_str()
                    .and_then(|s| s.split(':').next())
                    .map(PathBuf::from)
            })
        })
        .unwrap_or_else(|| PathBuf::from("/var/lib/agentgate"))
}

/// The process environment that config checking depends on, passed in for testability.
pub(crate) struct Environment<'a> {
    pub credentials_dir: Option<&'a Path>,
    /// `$STATE_DIRECTORY`, colon-separated when several.
    pub state_directory: Option<&'a Path>,
    pub secrets: SecretCheck,
}

/// Parses and validates config text. Errors make the whole config unusable; warnings do not.
pub(crate) fn check(
    source: ConfigSource,
    text: &str,
    environment: &Environment<'_>,
) -> Result<Loaded, ConfigError> {
    let locator = Locator::new(text);
    let raw: RawConfig = match toml::from_str(text) {
        Ok(raw) => raw,
        Err(err) => {
            return Err(ConfigError::Invalid {
                source_name: source,
                findings: vec![syntax_finding(&err, &locator)],
            });
        }
    };
    let mut checker = Checker {
        locator: &locator,
        findings: Vec::new(),
        environment,
    };
    let config = checker.config(raw);
    let mut findings = checker.findings;
    findings.sort_by_key(|f| (f.line.unwrap_or(0), f.severity));
    match config {
        Some(config) if count_errors(&findings) == 0 => Ok(Loaded {
            config,
            warnings: findings,
        }),
        _ => Err(ConfigError::Invalid {
            source_name: source,
            findings,
        }),
    }
}

/// A TOML syntax or shape error (unknown key, wrong type) as a finding on its line.
fn syntax_finding(err: &toml::de::Error, locator: &Locator) -> Finding {
    Finding {
        severity: Severity::Error,
        key: String::new(),
        line: err.span().map(|span| locator.line_of_offset(span.start)),
        message: err.message().replace('\n', " "),
    }
}

struct Checker<'a> {
    locator: &'a Locator,
    findings: Vec<Finding>,
    environment: &'a Environment<'a>,
}

impl Checker<'_> {
    fn report(&mut self, severity: Severity, key: &str, message: impl Into<String>) {
        self.findings.push(Finding {
            severity,
            key: key.to_string(),
            line: self.locator.line_of_key(key),
            message: message.into(),
        });
    }

    fn error(&mut self, key: &str, message: impl Into<String>) {
        self.report(Severity::Error, key, message);
    }

    fn warn(&mut self, key: &str, message: impl Into<String>) {
        self.report(Severity::Warning, key, message);
    }

    /// Applies `parse` to an optional value; records an error and returns the default on failure.
    fn value<T, R>(
        &mut self,
        key: &str,
        raw: Option<R>,
        default: T,
        parse: impl FnOnce(R) -> Result<T, String>,
    ) -> T {
        match raw.map(parse) {
            None => default,
            Some(Ok(value)) => value,
            Some(Err(message)) => {
                self.error(key, message);
                default
            }
        }
    }

    fn duration(&mut self, key: &str, raw: Option<String>, default: Duration) -> Duration {
        self.value(key, raw, default, |text| {
            let value = parse_duration(&text)?;
            if value.is_zero() {
                return Err(format!("{text:?} is zero; it must be positive"));
            }
            Ok(value)
        })
    }

    fn positive(&mut self, key: &str, raw: Option<i64>, default: u32) -> u32 {
        self.value(key, raw, default, |n| match u32::try_from(n) {
            Ok(value) if value > 0 => Ok(value),
            _ => Err(format!("{n} must be a positive whole number")),
        })
    }

    fn secret(&mut self, key: &str, source: &SecretSource) -> Option<Secret> {
        if source.is_literal() {
            self.warn(
                key,
                "a literal secret in the config file; prefer { credential = \"NAME\" }",
            );
        }
        if self.environment.secrets == SecretCheck::CredentialsOptional
            && self.environment.credentials_dir.is_none()
            && let Some(unloaded) = source.unloaded_credential()
        {
            self.warn(
                key,
                "not checked here ($CREDENTIALS_DIRECTORY is not set); the service loads it at start",
            );
            return Some(unloaded);
        }
        match source.load(self.environment.credentials_dir) {
            Ok(secret) => Some(secret),
            Err(message) => {
                self.error(key, message);
                None
            }
        }
    }

    fn argv(&mut self, key: &str, argv: &[String]) {
        match argv.first() {
            None => self.error(key, "the command is empty; give an argv list"),
            Some(program) if !Path::new(program).is_absolute() => self.warn(
                key,
                format!("{program:?} is not an absolute path; it is looked up in PATH"),
            ),
            Some(_) => {}
        }
    }

    fn config(&mut self, raw: RawConfig) -> Option<Config> {
        let state_dir = resolve_state_dir(raw.state_dir, self.environment.state_directory);
        let server = self.server(raw.server);
        let runtime = self.runtime(raw.runtime);
        let model = self.model(raw.model);
        let store = self.store(raw.store, runtime.max_concurrent_turns);
        let tools = raw
            .tools
            .into_iter()
            .filter_map(|(name, tool)| self.tool(name, tool))
            .map(|tool| (tool.name.clone(), tool))
            .collect::<BTreeMap<_, _>>();
        let mut paths = HashSet::new();
        let mut routes = Vec::new();
        for (name, route) in raw.routes {
            if let Some(route) = self.route(name, route, &server, &tools) {
                if !paths.insert(route.path.clone()) {
                    self.error(
                        &format!("routes.{}.path", route.name),
                        format!("path {} is used by another route", route.path),
                    );
                }
                routes.push(route);
            }
        }
        Some(Config {
            state_dir,
            server: server?,
            runtime,
            model: model?,
            store: store?,
            tools,
            routes,
        })
    }

    fn store(&mut self, raw: RawStore, max_concurrent_turns: usize) -> Option<StoreSettings> {
        let backend = raw.backend.as_deref().unwrap_or("sqlite");
        if backend == "sqlite" {
            for (key, set) in [
                ("store.url", raw.url.is_some()),
                ("store.node", raw.node.is_some()),
                ("store.lease_ttl", raw.lease_ttl.is_some()),
                ("store.pool_size", raw.pool_size.is_some()),
                ("store.ca_file", raw.ca_file.is_some()),
            ] {
                if set {
                    self.warn(key, "only used with backend = \"postgres\"");
                }
            }
            return Some(StoreSettings::Sqlite);
        }
        if backend != "postgres" {
            self.error(
                "store.backend",
                format!("{backend:?} is not a store backend; use \"sqlite\" or \"postgres\""),
            );
            return None;
        }
        let Some(source) = raw.url else {
            self.error(
                "store.url",
                "backend = \"postgres\" needs url, e.g. { credential = \"pg-url\" }",
            );
            return None;
        };
        let url = self.secret("store.url", &source)?;
        let node = match raw.node {
            Some(node) if valid_name(&node) => node,
            Some(node) => {
                self.error(
                    "store.node",
                    format!("{node:?} is not a name (letters, digits, '-', '_')"),
                );
                return None;
            }
            None => host_name(),
        };
        let lease_ttl = self.duration("store.lease_ttl", raw.lease_ttl, Duration::from_secs(15));
        if lease_ttl < Duration::from_secs(1) {
            self.error("store.lease_ttl", "must be at least 1s");
        }
        let default_pool = u32::try_from(max_concurrent_turns + 8).unwrap_or(u32::MAX);
        let pool_size = self.positive("store.pool_size", raw.pool_size, default_pool) as usize;
        if let Some(path) = &raw.ca_file
            && let Err(err) = std::fs::metadata(path)
        {
            self.error("store.ca_file", format!("{}: {err}", path.display()));
        }
        Some(StoreSettings::Postgres(PostgresSettings {
            url,
            node,
            lease_ttl,
            pool_size,
            ca_file: raw.ca_file,
        }))
    }

    fn server(&mut self, raw: RawServer) -> Option<ServerSettings> {
        let listen = match raw.listen {
            None => SocketAddr::from(([127, 0, 0, 1], 8787)),
            Some(text) => {
                if let Ok(addr) = text.parse::<SocketAddr>() {
                    addr
                } else {
                    self.error(
                        "server.listen",
                        format!("{text:?} is not an address:port such as \"127.0.0.1:8787\""),
                    );
                    return None;
                }
            }
        };
        let max_body = self.value("server.max_body", raw.max_body, 1 << 20, |t| parse_size(&t));
        Some(ServerSettings {
            listen,
            control_socket: raw
                .control_socket
                .unwrap_or_else(|| PathBuf::from("/run/agentgate/control.sock")),
            max_body,
            header_timeout: self.duration(
                "server.header_timeout",
                raw.header_timeout,
                Duration::from_secs(5),
            ),
        })
    }

    fn runtime(&mut self, raw: RawRuntime) -> RuntimeSettings {
        RuntimeSettings {
            max_concurrent_turns: self.positive(
                "runtime.max_concurrent_turns",
                raw.max_concurrent_turns,
                16,
            ) as usize,
            max_turn_steps: self.positive("runtime.max_turn_steps", raw.max_turn_steps, 40),
            drain_timeout: self.duration(
                "runtime.drain_timeout",
                raw.drain_timeout,
                Duration::from_secs(20),
            ),
            turn_idle_timeout: self.duration(
                "runtime.turn_idle_timeout",
                raw.turn_idle_timeout,
                Duration::from_secs(300),
            ),
            resume_max_attempts: self.positive(
                "runtime.resume_max_attempts",
                raw.resume_max_attempts,
                3,
            ),
            resume_window: self.duration(
                "runtime.resume_window",
                raw.resume_window,
                Duration::from_secs(6 * 3600),
            ),
            dedup_window: self.duration(
                "runtime.dedup_window",
                raw.dedup_window,
                Duration::from_secs(7 * 86_400),
            ),
        }
    }

    fn model(&mut self, raw: RawModel) -> Option<ModelSettings> {
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
        })
    }

    fn tool(&mut self, name: String, raw: RawTool) -> Option<ToolSettings> {
        let prefix = format!("tools.{name}");
        if !valid_name(&name) {
            self.error(
                &prefix,
                "tool names may use letters, digits, '_' and '-' (the model calls them by name)",
            );
        }
        self.argv(&format!("{prefix}.command"), &raw.command);
        let parameters = match raw.parameters {
            None => serde_json::json!({"type": "object", "properties": {}}),
            Some(value) => match serde_json::to_value(value) {
                Ok(json) if json.get("type").and_then(|t| t.as_str()) == Some("object") => json,
                _ => {
                    self.error(
                        &format!("{prefix}.parameters"),
                        "parameters must be a JSON schema with type = \"object\"",
                    );
                    return None;
                }
            },
        };
        Some(ToolSettings {
            description: raw.description.unwrap_or_default(),
            command: raw.command,
            parameters,
            timeout: self.duration(
                &format!("{prefix}.timeout"),
                raw.timeout,
                Duration::from_secs(30),
            ),
            idempotent: raw.idempotent.unwrap_or(false),
            background: raw.background.unwrap_or(false),
            name,
        })
    }

    fn route(
        &mut self,
        name: String,
        raw: RawRoute,
        server: &Option<ServerSettings>,
        tools: &BTreeMap<String, ToolSettings>,
    ) -> Option<RouteSettings> {
        let prefix = format!("routes.{name}");
        if !valid_name(&name) {
            self.error(
                &prefix,
                "route names may use letters, digits, '_' and '-' (they appear in session keys and on the command line)",
            );
        }
        if !raw.path.starts_with('/') || raw.path.contains(char::is_whitespace) {
            self.error(
                &format!("{prefix}.path"),
                format!(
                    "{:?} must be an absolute URL path such as /hooks/github",
                    raw.path
                ),
            );
        } else if matches!(raw.path.as_str(), "/healthz" | "/readyz") {
            self.error(
                &format!("{prefix}.path"),
                format!("{} is reserved for health checks", raw.path),
            );
        }
        let verify = self.verify(&prefix, raw.verify, server.as_ref())?;
        if let Some(events) = &raw.events
            && events.is_empty()
        {
            self.error(
                &format!("{prefix}.events"),
                "an empty events list ignores everything; remove the key to accept all",
            );
        }
        for (key, template) in [
            ("session", raw.session.as_deref()),
            ("system", raw.system.as_deref()),
            ("prompt", raw.prompt.as_deref()),
        ] {
            if let Some(template) = template
                && let Err(err) = crate::template::validate(template)
            {
                self.error(&format!("{prefix}.{key}"), format!("template error: {err}"));
            }
        }
        for tool in &raw.tools {
            if !tools.contains_key(tool) {
                self.error(
                    &format!("{prefix}.tools"),
                    format!("tool {tool:?} is not defined under [tools]"),
                );
            }
        }
        let on_busy = match raw.on_busy.as_deref() {
            None | Some("queue") => OnBusy::Queue,
            Some("interrupt") => OnBusy::Interrupt,
            Some(other) => {
                self.error(
                    &format!("{prefix}.on_busy"),
                    format!("{other:?} is not queue or interrupt"),
                );
                OnBusy::Queue
            }
        };
        let deliver = match raw.deliver {
            None => DeliverSettings::Log,
            Some(raw) => self.deliver(&prefix, raw)?,
        };
        let rate_limit = self.value(
            &format!("{prefix}.rate_limit"),
            raw.rate_limit.map(Some),
            None,
            |t| t.map(|t| parse_rate(&t)).transpose(),
        );
        let default_max_body = server.as_ref().map_or(1 << 20, |s| s.max_body);
        let max_body = self.value(
            &format!("{prefix}.max_body"),
            raw.max_body,
            default_max_body,
            |t| parse_size(&t),
        );
        Some(RouteSettings {
            path: raw.path,
            verify,
            events: raw.events,
            session: raw.session,
            system: raw.system.unwrap_or_default(),
            prompt: raw.prompt.unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
            interactive: raw.interactive.unwrap_or(false),
            tools: raw.tools,
            on_busy,
            deliver,
            rate_limit,
            max_body,
            name,
        })
    }

    fn verify(
        &mut self,
        prefix: &str,
        raw: RawVerify,
        server: Option<&ServerSettings>,
    ) -> Option<VerifySettings> {
        let key_path = format!("{prefix}.verify");
        let Some(scheme) = VerifyScheme::parse(&raw.scheme) else {
            self.error(
                &format!("{key_path}.scheme"),
                format!(
                    "unknown scheme {:?}; use github, standard, stripe, slack, gitlab, bearer, hmac-sha256 or none",
                    raw.scheme
                ),
            );
            return None;
        };
        if raw.header.is_some() && scheme != VerifyScheme::HmacSha256 {
            self.error(
                &format!("{key_path}.header"),
                "header applies only to scheme hmac-sha256",
            );
        }
        let header = raw.header.unwrap_or_else(|| "X-Signature".to_string());
        if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
            self.error(
                &format!("{key_path}.header"),
                format!("{header:?} is not a valid header name"),
            );
        }
        let secret_key = format!("{key_path}.secret");
        let key = match (scheme, raw.secret) {
            (VerifyScheme::None, None) => {
                let listen = server.map(|s| s.listen);
                let message = "verify = none accepts unsigned webhooks; it is refused unless every webhook listener is on a loopback address";
                match listen {
                    Some(addr) if !addr.ip().is_loopback() => self.warn(
                        &format!("{key_path}.scheme"),
                        format!("{message} (server.listen is {addr})"),
                    ),
                    _ => self.warn(&format!("{key_path}.scheme"), message),
                }
                None
            }
            (VerifyScheme::None, Some(_)) => {
                self.error(&secret_key, "scheme none takes no secret");
                None
            }
            (_, None) => {
                self.error(&secret_key, format!("scheme {} needs a secret", raw.scheme));
                return None;
            }
            (scheme, Some(source)) => {
                let secret = self.secret(&secret_key, &source)?;
                if scheme == VerifyScheme::Standard {
                    Some(self.standard_key(&secret_key, secret)?)
                } else {
                    Some(secret)
                }
            }
        };
        Some(VerifySettings {
            scheme,
            key,
            header,
        })
    }

    /// Standard Webhooks secrets are `whsec_<base64>`; the decoded bytes are the HMAC key.
    fn standard_key(&mut self, key: &str, secret: Secret) -> Option<Secret> {
        if secret.expose().is_empty() {
            return Some(secret); // a credential left for the service to load
        }
        match crate::ingress::verify::decode_standard_secret(&secret) {
            Ok(decoded) => Some(decoded),
            Err(message) => {
                self.error(key, message);
                None
            }
        }
    }

    fn deliver(&mut self, prefix: &str, raw: RawDeliver) -> Option<DeliverSettings> {
        let key_path = format!("{prefix}.deliver");
        match raw.kind.as_str() {
            "log" => Some(DeliverSettings::Log),
            "http" => {
                let url = raw.url.unwrap_or_default();
                match url::Url::parse(&url) {
                    Ok(parsed) if matches!(parsed.scheme(), "http" | "https") => {}
                    _ => self.error(
                        &format!("{key_path}.url"),
                        format!("{url:?} is not an http(s) URL"),
                    ),
                }
                let key = match raw.secret {
                    None => None,
                    Some(source) => {
                        let secret_key = format!("{key_path}.secret");
                        let secret = self.secret(&secret_key, &source)?;
                        Some(self.standard_key(&secret_key, secret)?)
                    }
                };
                Some(DeliverSettings::Http { url, key })
            }
            "command" => {
                let argv = raw.command.unwrap_or_default();
                self.argv(&format!("{key_path}.command"), &argv);
                Some(DeliverSettings::Command { argv })
            }
            other => {
                self.error(
                    &format!("{key_path}.kind"),
                    format!("unknown deliver kind {other:?}; use log, http or command"),
                );
                None
            }
        }
    }
}

/// The kernel's host name, the default node name of a PostgreSQL-backed daemon.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "agentgate".to_string())
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Maps key paths such as `routes.github.verify.secret` to line numbers in the source text.
struct Locator {
    text: String,
    document: Option<toml_edit::ImDocument<String>>,
}

impl Locator {
    fn new(text: &str) -> Locator {
        Locator {
            text: text.to_string(),
            document: toml_edit::ImDocument::parse(text.to_string()).ok(),
        }
    }

    fn line_of_offset(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|b| **b == b'\n')
            .count()
            + 1
    }

    /// The line of the deepest existing key along `path` (a missing key points at its table).
    fn line_of_key(&self, path: &str) -> Option<usize> {
        let document = self.document.as_ref()?;
        let mut table: &dyn toml_edit::TableLike = document.as_table();
        let mut span = None;
        for part in path.split('.') {
            let Some((key, item)) = table.get_key_value(part) else {
                break;
            };
            span = key.span().or_else(|| item.span()).or(span);
            match item.as_table_like() {
                Some(next) => table = next,
                None => break,
            }
        }
        span.map(|s| self.line_of_offset(s.start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_text(text: &str) -> Result<Loaded, ConfigError> {
        let environment = Environment {
            credentials_dir: None,
            state_directory: None,
            secrets: SecretCheck::Required,
        };
        check(ConfigSource::File("test.toml".into()), text, &environment)
    }

    fn findings(text: &str) -> Vec<Finding> {
        match check_text(text) {
            Ok(loaded) => loaded.warnings,
            Err(ConfigError::Invalid { findings, .. }) => findings,
            Err(other) => panic!("{other}"),
        }
    }

    #[test]
    fn embedded_defaults_are_valid() {
        let loaded = check(
            ConfigSource::Embedded,
            EMBEDDED_DEFAULTS,
            &Environment {
                credentials_dir: None,
                state_directory: None,
                secrets: SecretCheck::Required,
            },
        )
        .expect("embedded defaults must load");
        assert!(!loaded.config.routes.is_empty());
    }

    #[test]
    fn unknown_key_is_an_error_with_its_line() {
        let found = findings("[server]\nlisten = \"127.0.0.1:1\"\nlisen = \"x\"\n");
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].line, Some(3));
        assert!(found[0].message.contains("lisen"), "{}", found[0].message);
    }

    #[test]
    fn semantic_errors_name_key_and_line() {
        let text = "[runtime]\ndrain_timeout = \"forever\"\n\n[routes.gh]\npath = \"hooks\"\nverify = { scheme = \"github\" }\n";
        let found = findings(text);
        let keys: Vec<_> = found.iter().map(|f| (f.key.as_str(), f.line)).collect();
        assert!(
            keys.contains(&("runtime.drain_timeout", Some(2))),
            "{keys:?}"
        );
        assert!(keys.contains(&("routes.gh.path", Some(5))), "{keys:?}");
        assert!(
            keys.contains(&("routes.gh.verify.secret", Some(6))),
            "{keys:?}"
        );
    }

    #[test]
    fn literal_secret_is_a_warning_and_template_errors_are_errors() {
        let text = "[routes.a]\npath = \"/a\"\nverify = { scheme = \"github\", secret = \"x\" }\nsession = \"{{ payload.x \"\n";
        let found = findings(text);
        assert!(
            found
                .iter()
                .any(|f| f.severity == Severity::Warning && f.key == "routes.a.verify.secret")
        );
        assert!(
            found
                .iter()
                .any(|f| f.severity == Severity::Error && f.key == "routes.a.session"),
            "{found:?}"
        );
    }

    #[test]
    fn standard_secret_must_be_whsec_base64() {
        let text =
            "[routes.a]\npath = \"/a\"\nverify = { scheme = \"standard\", secret = \"nope\" }\n";
        assert!(
            findings(text)
                .iter()
                .any(|f| f.severity == Severity::Error && f.key == "routes.a.verify.secret")
        );
    }

    #[test]
    fn store_backend_is_checked_with_its_keys() {
        let has = |text: &str, severity: Severity, key: &str| {
            findings(text)
                .iter()
                .any(|f| f.severity == severity && f.key == key && f.line.is_some())
        };
        assert!(has(
            "[store]\nbackend = \"postgres\"\n",
            Severity::Error,
            "store.url"
        ));
        assert!(has(
            "[store]\nbackend = \"mysql\"\n",
            Severity::Error,
            "store.backend"
        ));
        assert!(has(
            "[store]\nlease_ttl = \"5s\"\n",
            Severity::Warning,
            "store.lease_ttl"
        ));
        assert!(has(
            "[store]\nbackend = \"postgres\"\nurl = \"postgres://x@db/a\"\nlease_ttl = \"100ms\"\n",
            Severity::Error,
            "store.lease_ttl"
        ));
        let loaded = check_text(
            "[store]\nbackend = \"postgres\"\nurl = \"postgres://u:pw@db/agentgate\"\nnode = \"web-1\"\n",
        )
        .expect("valid");
        match loaded.config.store {
            StoreSettings::Postgres(postgres) => {
                assert_eq!(postgres.node, "web-1");
                assert_eq!(postgres.lease_ttl, Duration::from_secs(15));
                assert_eq!(postgres.pool_size, 24);
                assert!(
                    !format!("{postgres:?}").contains("pw@"),
                    "the URL is a secret"
                );
            }
            StoreSettings::Sqlite => panic!("backend = postgres"),
        }
    }
}
