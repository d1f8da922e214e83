//! The checker: turns raw values into settings, collecting every problem as a finding with its
//! key path and line, so an operator fixes all of them in one edit. This file holds the checker
//! and its helpers; each section of the config is checked in a file of its own.

mod budgets;
mod model;
mod routes;
mod sandbox;
mod server;
mod telemetry;
mod tools;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use super::locate::Locator;
use super::raw::RawConfig;
use super::units::parse_duration;
use super::{
    Config, ConfigError, ConfigSource, Environment, Finding, Loaded, SecretCheck, Severity,
    count_errors, resolve_state_dir,
};
use crate::secret::{Secret, SecretReference, SecretSource};

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
        secret_files: Vec::new(),
    };
    let mut config = checker.config(raw);
    if let (Some(config), ConfigSource::File(path)) = (config.as_mut(), &source) {
        config.hidden.files.extend(super::leash::config_files(path));
    }
    if let Some(config) = &config {
        for (key, message) in super::writable_holding_hidden(config) {
            checker.error(&key, message);
        }
        for (key, message, severity) in super::plantable(config) {
            checker.report(severity, &key, message);
        }
    }
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
    /// Every `{ file = PATH }` secret seen so far: sandboxed processes never see them.
    pub(super) secret_files: Vec<std::path::PathBuf>,
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
        if let SecretSource::Reference(SecretReference::File(path)) = source {
            self.secret_files.push(path.clone());
        }
        if self.environment.secrets == SecretCheck::CredentialsOptional
            && self.environment.credentials_dir.is_none()
            && let Some(unloaded) = source.unloaded_credential()
        {
            self.warn(
                key,
                "cannot be read here ($CREDENTIALS_DIRECTORY is not set), so it is not checked; \
                 the service loads it at start",
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
            Some(program) if !program.contains('/') => self.warn(
                key,
                format!("{program:?} is not an absolute path; it is looked up in PATH"),
            ),
            Some(program) if !Path::new(program).is_absolute() => self.warn(
                key,
                format!(
                    "{program:?} is not an absolute path; it is found from the working \
                     directory (`cwd`, else / in a sandbox and the daemon's own without one)"
                ),
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
        self.tool_names_apart(&tools, &mcp);
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
        let budgets = self.budget_limits("budgets", raw.budgets);
        let telemetry = self.telemetry(raw.telemetry);
        let console = self.console(raw.console);
        let model = model?;
        self.dollar_budgets_need_a_price(&budgets, &routes, model.price.as_ref());
        let server = server?;
        let hidden = self.hidden_paths(&state_dir, Some(&server.control_socket), store.as_ref());
        Some(Config {
            hidden,
            state_dir,
            server,
            runtime,
            model,
            store: store?,
            budgets,
            telemetry,
            console,
            retention,
            tools,
            mcp,
            routes,
        })
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
