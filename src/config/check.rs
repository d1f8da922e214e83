//! The checker: turns raw values into settings, collecting every problem as a finding with its
//! key path and line, so an operator fixes all of them in one edit.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::locate::Locator;
use super::raw::*;
use super::*;
use crate::logging::{DEFAULT_EVENT_LINES_PER_SECOND, EventLogLevel};

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
pub(super) fn syntax_finding(err: &toml::de::Error, locator: &Locator) -> Finding {
    Finding {
        severity: Severity::Error,
        key: String::new(),
        line: err.span().map(|span| locator.line_of_offset(span.start)),
        message: err.message().replace('\n', " "),
    }
}

pub(super) struct Checker<'a> {
    pub(super) locator: &'a Locator,
    pub(super) findings: Vec<Finding>,
    pub(super) environment: &'a Environment<'a>,
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
        if self.environment.secrets == SecretCheck::NotRead {
            return Some(source.unloaded());
        }
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
        let mut raw_store = raw.store;
        let retention = self.duration(
            "store.retention",
            raw_store.retention.take(),
            Duration::from_secs(30 * 86_400),
        );
        let store = self.store(raw_store, runtime.max_concurrent_turns);
        let tools = raw
            .tools
            .into_iter()
            .filter_map(|(name, tool)| self.tool(name, tool))
            .map(|tool| (tool.name.clone(), tool))
            .collect::<BTreeMap<_, _>>();
        let mcp = raw
            .mcp
            .into_iter()
            .filter_map(|(name, server)| self.mcp_server(name, server))
            .map(|server| (server.name.clone(), server))
            .collect::<BTreeMap<_, _>>();
        let mut paths = HashSet::new();
        let mut routes = Vec::new();
        for (name, route) in raw.routes {
            if let Some(route) = self.route(name, route, &server, &tools, &mcp) {
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
            retention,
            tools,
            mcp,
            routes,
        })
    }

    pub(super) fn store(
        &mut self,
        raw: RawStore,
        max_concurrent_turns: usize,
    ) -> Option<StoreSettings> {
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
        let tls = match raw.tls {
            None => None,
            Some(tls) => {
                let cert = self.secret("server.tls.cert", &tls.cert);
                let key = self.secret("server.tls.key", &tls.key);
                let tls = TlsSettings {
                    cert: cert?,
                    key: key?,
                };
                // Credentials are only there under systemd; what cannot be read here is checked
                // when the service loads it.
                if !tls.cert.expose().is_empty()
                    && !tls.key.expose().is_empty()
                    && let Err(problem) = crate::tls::server_config(&tls)
                {
                    self.error("server.tls", problem);
                    return None;
                }
                Some(tls)
            }
        };
        let mut trusted_proxies = Vec::new();
        for entry in raw.trusted_proxies.unwrap_or_default() {
            let parsed = entry
                .parse::<ipnet::IpNet>()
                .or_else(|_| entry.parse::<std::net::IpAddr>().map(ipnet::IpNet::from));
            match parsed {
                Ok(network) => trusted_proxies.push(network),
                Err(_) => self.error(
                    "server.trusted_proxies",
                    format!("{entry:?} is not an address or a network such as \"10.0.0.0/8\""),
                ),
            }
        }
        let metrics_listen = raw.metrics_listen.and_then(|text| {
            let parsed = text.parse::<SocketAddr>().ok();
            if parsed.is_none() {
                self.error(
                    "server.metrics_listen",
                    format!("{text:?} is not an address:port such as \"127.0.0.1:9464\""),
                );
            }
            parsed
        });
        Some(ServerSettings {
            listen,
            control_socket: raw
                .control_socket
                .unwrap_or_else(|| PathBuf::from(super::DEFAULT_CONTROL_SOCKET)),
            max_body,
            header_timeout: self.duration(
                "server.header_timeout",
                raw.header_timeout,
                Duration::from_secs(5),
            ),
            keepalive_timeout: self.duration(
                "server.keepalive_timeout",
                raw.keepalive_timeout,
                Duration::from_secs(75),
            ),
            max_connections: self.positive("server.max_connections", raw.max_connections, 4096)
                as usize,
            tls,
            trusted_proxies,
            metrics_listen,
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
            max_queued_events: u64::from(self.positive(
                "runtime.max_queued_events",
                raw.max_queued_events,
                100_000,
            )),
            min_free_disk: self.value(
                "runtime.min_free_disk",
                raw.min_free_disk,
                512 << 20,
                |text| parse_size(&text),
            ),
            max_tool_calls_per_reply: self.positive(
                "runtime.max_tool_calls_per_reply",
                raw.max_tool_calls_per_reply,
                16,
            ) as usize,
            max_background_jobs: self.positive(
                "runtime.max_background_jobs",
                raw.max_background_jobs,
                16,
            ) as usize,
            max_background_jobs_per_session: self.positive(
                "runtime.max_background_jobs_per_session",
                raw.max_background_jobs_per_session,
                4,
            ) as usize,
            max_internal_turns: self.positive(
                "runtime.max_internal_turns",
                raw.max_internal_turns,
                8,
            ),
            event_log_level: self.value(
                "runtime.event_log_level",
                raw.event_log_level,
                EventLogLevel::Info,
                |level| match level.as_str() {
                    "info" => Ok(EventLogLevel::Info),
                    "debug" => Ok(EventLogLevel::Debug),
                    other => Err(format!("{other:?} is not info or debug")),
                },
            ),
            event_log_max_per_second: self.value(
                "runtime.event_log_max_per_second",
                raw.event_log_max_per_second,
                DEFAULT_EVENT_LINES_PER_SECOND,
                |n| u32::try_from(n).map_err(|_| format!("{n} must be a whole number, 0 or more")),
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
            max_concurrent_requests: self.positive(
                "model.max_concurrent_requests",
                raw.max_concurrent_requests,
                16,
            ) as usize,
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
            dedupes: raw.dedupes.unwrap_or(false),
            name,
        })
    }

    /// `[mcp.NAME]`: exactly one transport, secrets for its environment or headers.
    fn mcp_server(&mut self, name: String, raw: RawMcp) -> Option<McpServerSettings> {
        let prefix = format!("mcp.{name}");
        if !valid_name(&name) || name.contains("__") {
            self.error(
                &prefix,
                "MCP server names may use letters, digits, '_' and '-', but not \"__\" \
                 (the model calls its tools NAME__tool)",
            );
        }
        let transport = match (raw.command, raw.url) {
            (Some(command), None) => {
                if !raw.headers.is_empty() {
                    self.error(
                        &format!("{prefix}.headers"),
                        "headers are for the HTTP transport (url); this server uses command",
                    );
                }
                self.argv(&format!("{prefix}.command"), &command);
                let mut env = BTreeMap::new();
                for (variable, source) in &raw.env {
                    let key = format!("{prefix}.env.{variable}");
                    // A plain value is a setting, not a secret: no warning for it.
                    let value = if source.is_literal() {
                        source.load(None).ok()
                    } else {
                        self.secret(&key, source)
                    };
                    if let Some(value) = value {
                        env.insert(variable.clone(), value);
                    }
                }
                McpTransport::Stdio {
                    command,
                    env,
                    cwd: raw.cwd,
                }
            }
            (None, Some(url)) => {
                for (key, set) in [("env", !raw.env.is_empty()), ("cwd", raw.cwd.is_some())] {
                    if set {
                        self.error(
                            &format!("{prefix}.{key}"),
                            format!(
                                "{key} is for the stdio transport (command); this server uses url"
                            ),
                        );
                    }
                }
                match url::Url::parse(&url) {
                    Ok(parsed) if matches!(parsed.scheme(), "http" | "https") => {}
                    _ => self.error(
                        &format!("{prefix}.url"),
                        format!("{url:?} is not an http:// or https:// URL"),
                    ),
                }
                let mut headers = BTreeMap::new();
                for (header, source) in &raw.headers {
                    let key = format!("{prefix}.headers.{header}");
                    if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                        self.error(&key, format!("{header:?} is not a valid header name"));
                    }
                    if let Some(value) = self.secret(&key, source) {
                        headers.insert(header.clone(), value);
                    }
                }
                McpTransport::Http { url, headers }
            }
            _ => {
                self.error(
                    &prefix,
                    "give exactly one transport: command (stdio) or url (streamable HTTP)",
                );
                return None;
            }
        };
        for (list, tools) in [("idempotent", &raw.idempotent), ("dedupes", &raw.dedupes)] {
            if let Some(both) = tools.iter().find(|tool| raw.not_idempotent.contains(tool)) {
                self.error(
                    &format!("{prefix}.not_idempotent"),
                    format!("{both:?} is in both {list} and not_idempotent"),
                );
            }
        }
        Some(McpServerSettings {
            transport,
            timeout: self.duration(
                &format!("{prefix}.timeout"),
                raw.timeout,
                Duration::from_secs(30),
            ),
            idempotent: raw.idempotent,
            not_idempotent: raw.not_idempotent,
            dedupes: raw.dedupes,
            name,
        })
    }

    fn route(
        &mut self,
        name: String,
        raw: RawRoute,
        server: &Option<ServerSettings>,
        tools: &BTreeMap<String, ToolSettings>,
        mcp: &BTreeMap<String, McpServerSettings>,
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
            ("event_type", raw.event_type.as_deref()),
            ("delivery_id", raw.delivery_id.as_deref()),
        ] {
            if let Some(template) = template
                && let Err(err) = crate::template::validate(template)
            {
                self.error(&format!("{prefix}.{key}"), format!("template error: {err}"));
            }
        }
        if raw.events.is_some() && raw.event_type.is_none() && !verify.scheme.has_event_type() {
            self.error(
                &format!("{prefix}.events"),
                "this verify scheme carries no event type, so events would filter on \
                 payload.type, which most senders on it never set (Alertmanager does not); add \
                 event_type = \"{{ payload.FIELD }}\" naming where the type is",
            );
        }
        // The system text sits outside the event markers: event data there could instruct the
        // model as the operator does.
        if let Some(system) = raw.system.as_deref() {
            let used = crate::template::event_data_used(system);
            if !used.is_empty() {
                self.error(
                    &format!("{prefix}.system"),
                    format!(
                        "system may not use event data ({}): it is outside the event markers, \
                         where the model takes it as the operator's instructions; put event data \
                         in prompt",
                        used.join(", ")
                    ),
                );
            }
        }
        let tool_refs: Vec<ToolRef> = raw
            .tools
            .iter()
            .map(|entry| ToolRef::parse(entry))
            .collect();
        for (entry, tool) in raw.tools.iter().zip(&tool_refs) {
            match tool {
                ToolRef::Command(name) if !tools.contains_key(name) => self.error(
                    &format!("{prefix}.tools"),
                    format!("tool {name:?} is not defined under [tools]"),
                ),
                ToolRef::Mcp { server, tool } if !mcp.contains_key(server) => self.error(
                    &format!("{prefix}.tools"),
                    format!("{entry:?} names the MCP server {server:?}, which has no [mcp.{server}] table"),
                ),
                ToolRef::Mcp { tool: Some(tool), .. } if tool.is_empty() => self.error(
                    &format!("{prefix}.tools"),
                    format!("{entry:?} names no tool; use \"SERVER.tool\" or \"SERVER.*\""),
                ),
                _ => {}
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
        let raw_history = raw.history.unwrap_or_default();
        let history = super::HistoryLimits {
            max_turns: self.positive(
                &format!("{prefix}.history.max_turns"),
                raw_history.max_turns,
                20,
            ) as usize,
            max_bytes: usize::try_from(self.value(
                &format!("{prefix}.history.max_bytes"),
                raw_history.max_bytes,
                256 << 10,
                |t| parse_size(&t),
            ))
            .unwrap_or(usize::MAX),
        };
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
            event_type: raw.event_type,
            delivery_id: raw.delivery_id,
            history,
            hidden_headers: raw
                .hidden_headers
                .iter()
                .map(|name| name.to_ascii_lowercase())
                .collect(),
            system: raw.system.unwrap_or_default(),
            prompt: raw.prompt.unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
            interactive: raw.interactive.unwrap_or(false),
            tools: tool_refs,
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
                    "unknown scheme {:?}; use one of {}",
                    raw.scheme,
                    VerifyScheme::ALL.map(VerifyScheme::name).join(", ")
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
        // `secrets = [...]`: every one verifies, for rotating a secret without downtime; the
        // first is the one `send` signs with.
        let sources = match (raw.secret, raw.secrets) {
            (Some(_), Some(_)) => {
                self.error(&secret_key, "give secret or secrets, not both");
                return None;
            }
            (Some(source), None) => vec![source],
            (None, Some(list)) if list.is_empty() => {
                self.error(
                    &format!("{key_path}.secrets"),
                    "an empty list verifies nothing",
                );
                return None;
            }
            (None, Some(list)) => list,
            (None, None) => Vec::new(),
        };
        let mut keys = Vec::new();
        match (scheme, sources.is_empty()) {
            (VerifyScheme::None, true) => {
                let listen = server.map(|s| s.listen);
                let message = "verify = none accepts unsigned webhooks; it is refused unless every webhook listener is on a loopback address";
                match listen {
                    Some(addr) if !addr.ip().is_loopback() => self.warn(
                        &format!("{key_path}.scheme"),
                        format!("{message} (server.listen is {addr})"),
                    ),
                    _ => self.warn(&format!("{key_path}.scheme"), message),
                }
            }
            (VerifyScheme::None, false) => {
                self.error(&secret_key, "scheme none takes no secret");
            }
            (_, true) => {
                self.error(&secret_key, format!("scheme {} needs a secret", raw.scheme));
                return None;
            }
            (scheme, false) => {
                for source in &sources {
                    let secret = self.secret(&secret_key, source)?;
                    keys.push(if scheme == VerifyScheme::Standard {
                        self.standard_key(&secret_key, secret)?
                    } else {
                        secret
                    });
                }
            }
        }
        let mut keys = keys.into_iter();
        let key = keys.next();
        let other_keys = keys.collect();
        Some(VerifySettings {
            scheme,
            key,
            other_keys,
            header,
        })
    }

    /// Standard Webhooks secrets are `whsec_<base64>`; the decoded bytes are the HMAC key.
    fn standard_key(&mut self, key: &str, secret: Secret) -> Option<Secret> {
        if secret.expose().is_empty() {
            return Some(secret); // a credential left for the service to load
        }
        match crate::signature::decode_standard_secret(&secret) {
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
                let url_key = format!("{key_path}.url");
                let url = match raw.url {
                    None => {
                        self.error(&url_key, "an http delivery needs url");
                        return None;
                    }
                    // A plain URL is not a secret; one from a credential, file or variable is.
                    Some(SecretSource::Literal(text)) => crate::secret::Secret::plain(text),
                    Some(source) => self.secret(&url_key, &source)?,
                };
                let text = String::from_utf8_lossy(url.expose()).into_owned();
                let parsed = url::Url::parse(&text);
                let usable = parsed
                    .as_ref()
                    .is_ok_and(|parsed| matches!(parsed.scheme(), "http" | "https"));
                // An unloaded credential (checked outside the service) is empty.
                if !usable && !text.is_empty() {
                    self.error(
                        &url_key,
                        format!("{} is not an http(s) URL", redacted_url(&text)),
                    );
                }
                let key = match raw.secret {
                    None => None,
                    Some(source) => {
                        let secret_key = format!("{key_path}.secret");
                        let secret = self.secret(&secret_key, &source)?;
                        Some(self.standard_key(&secret_key, secret)?)
                    }
                };
                let concurrency = self.positive(
                    &format!("{key_path}.concurrency"),
                    raw.concurrency,
                    DEFAULT_DELIVERY_CONCURRENCY,
                ) as usize;
                Some(DeliverSettings::Http {
                    url,
                    key,
                    concurrency,
                })
            }
            "command" => {
                let argv = raw.command.unwrap_or_default();
                self.argv(&format!("{key_path}.command"), &argv);
                let concurrency = self.positive(
                    &format!("{key_path}.concurrency"),
                    raw.concurrency,
                    DEFAULT_DELIVERY_CONCURRENCY,
                ) as usize;
                Some(DeliverSettings::Command { argv, concurrency })
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

/// Deliveries in flight to one target at most, unless `deliver.concurrency` says otherwise.
const DEFAULT_DELIVERY_CONCURRENCY: u32 = 8;

/// A URL as logs and errors show it: scheme and host only (the path or user info of an
/// incoming-webhook URL is its secret).
pub(crate) fn redacted_url(text: &str) -> String {
    match url::Url::parse(text) {
        Ok(parsed) => format!(
            "{}://{}{}/…",
            parsed.scheme(),
            parsed.host_str().unwrap_or("?"),
            parsed
                .port()
                .map(|port| format!(":{port}"))
                .unwrap_or_default()
        ),
        Err(_) => "the URL".to_string(),
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
