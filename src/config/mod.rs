//! The configuration file: strict TOML in, typed settings and findings out.
//!
//! Parsing is two passes. serde rejects unknown keys and wrong types; then `check` turns the raw
//! values into typed settings, collecting every problem as a [`Finding`] that names the key path and
//! the line it is on, so an operator fixes all of them in one edit instead of one per restart.

mod check;
mod leash;
mod locate;
mod plant;
mod raw;
mod reload;
mod settings;
mod units;

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

pub(crate) use crate::secret::Secret;
pub(crate) use crate::signature::VerifyScheme;
use check::{Checker, syntax_finding};
pub(crate) use check::{check, redacted_url};
use leash::writable_holding_hidden;
pub(crate) use leash::{ALWAYS_HIDDEN, Writer, floor, loosened, resolved};
use locate::Locator;
use plant::plantable;
use raw::{RawBudgets, RawPrice, RawStore};
pub(crate) use reload::{ReloadReport, list_changes};
pub(crate) use settings::*;
pub(crate) use units::{Rate, parse_duration};

/// The default location of the config file.
pub(crate) const DEFAULT_CONFIG_PATH: &str = "/etc/agentgate/agentgate.toml";
/// `[server] control_socket` when the config names none; the packaged socket unit's path.
pub(crate) const DEFAULT_CONTROL_SOCKET: &str = "/run/agentgate/control.sock";
/// Used when no config file is named and the default file does not exist: a loopback demo route
/// with the bundled replay cassette as the model, state under `./agentgate-state`.
pub(crate) const EMBEDDED_DEFAULTS: &str = include_str!("../../examples/quickstart.toml");

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
    #[error("{}", describe_invalid(.source_name, .findings))]
    Invalid {
        source_name: ConfigSource,
        findings: Vec<Finding>,
    },
}

/// One line for an invalid config: how many errors, and the first in full (file, line, key),
/// so that `STATUS=` and the exit line say what to fix.
fn describe_invalid(source: &ConfigSource, findings: &[Finding]) -> String {
    let count = count_errors(findings);
    match findings.iter().find(|f| f.severity == Severity::Error) {
        Some(finding) if count > 1 => format!(
            "config {source} has {count} errors, the first: {}",
            LocatedFinding { source, finding }
        ),
        Some(finding) => format!("{}", LocatedFinding { source, finding }),
        None => format!("config {source} has {count} error(s)"),
    }
}

fn count_errors(findings: &[Finding]) -> usize {
    findings
        .iter()
        .filter(|f| f.severity == Severity::Error)
        .count()
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
    /// `tools list`: shows the config's shape and uses no secret, so none is read.
    NotRead,
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

/// Where a daemon keeps its state and answers its operator.
#[derive(Debug, Clone)]
pub(crate) struct StateLocation {
    pub(crate) state_dir: PathBuf,
    pub(crate) store: StoreSettings,
    /// `[server] control_socket`, where a running daemon takes operator requests.
    pub(crate) control_socket: PathBuf,
    /// `[model] price`, for the cost of what the state shows.
    pub(crate) price: Option<crate::usage::Price>,
    /// `[budgets]`, for `usage`.
    pub(crate) budgets: BudgetLimits,
    /// Each route's `budget`, for `usage`.
    pub(crate) route_budgets: Vec<(String, BudgetLimits)>,
}

/// Where the state is, for the operator commands (`status`, `sessions`, `ledger`, `reload`): only
/// `state_dir`, `[store]`, `server.control_socket` and `model.price` are read, so a config with errors
/// elsewhere (or route secrets that only the service can read) does not hide the state.
pub(crate) fn state_location(source: &ConfigSource) -> Result<StateLocation, ConfigError> {
    #[derive(Deserialize)]
    struct ServerOnly {
        control_socket: Option<PathBuf>,
    }
    #[derive(Deserialize)]
    struct ModelOnly {
        price: Option<RawPrice>,
    }
    #[derive(Deserialize)]
    struct RouteBudgetOnly {
        budget: Option<RawBudgets>,
    }
    #[derive(Deserialize)]
    struct StateOnly {
        state_dir: Option<PathBuf>,
        #[serde(default)]
        store: RawStore,
        server: Option<ServerOnly>,
        model: Option<ModelOnly>,
        budgets: Option<RawBudgets>,
        #[serde(default)]
        routes: std::collections::BTreeMap<String, RouteBudgetOnly>,
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
            secret_files: Vec::new(),
        };
        // An operator command runs no turns: the default pool for max_concurrent_turns = 16
        // is plenty.
        let store = checker.store(parsed.store, 16);
        let store_errors = count_errors(&checker.findings);
        // A price with an error shows no cost; it does not hide the state.
        let price = parsed
            .model
            .and_then(|model| model.price)
            .and_then(|price| checker.price(price));
        let budgets = checker.budget_limits("budgets", parsed.budgets);
        let route_budgets = parsed
            .routes
            .into_iter()
            .map(|(name, route)| {
                let limits = checker.budget_limits(&format!("routes.{name}.budget"), route.budget);
                (name, limits)
            })
            .collect();
        match store {
            Some(store) if store_errors == 0 => Ok(StateLocation {
                state_dir: resolve_state_dir(parsed.state_dir, environment.state_directory),
                store,
                control_socket: parsed
                    .server
                    .and_then(|server| server.control_socket)
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTROL_SOCKET)),
                price,
                budgets,
                route_budgets,
            }),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
    fn a_postgres_store_s_unix_socket_is_hidden_from_every_sandbox() {
        let loaded = check_text(
            "[store]\nbackend = \"postgres\"\nurl = \"host=/run/postgresql port=5433 dbname=agentgate\"\n",
        )
        .expect("a valid config");
        assert!(
            loaded
                .config
                .hidden
                .files
                .contains(&PathBuf::from("/run/postgresql/.s.PGSQL.5433")),
            "{:?}",
            loaded.config.hidden
        );
    }

    #[test]
    fn tools_the_model_could_not_tell_apart_are_errors_naming_both() {
        let found = findings(
            "[mcp.gh]\nurl = \"http://127.0.0.1:1/mcp\"\n\n[mcp.gh_]\nurl = \"http://127.0.0.1:2/mcp\"\n\n\
             [mcp.a-server-whose-name-is-long-enough-to-be-cut]\nurl = \"http://127.0.0.1:3/mcp\"\n\n\
             [tools.gh__create_issue]\ncommand = [\"/bin/true\"]\n",
        );
        let error = |key: &str, text: &str| {
            found
                .iter()
                .any(|f| f.severity == Severity::Error && f.key == key && f.message.contains(text))
        };
        assert!(error("mcp.gh_", "as those of mcp.gh"), "{found:#?}");
        assert!(
            error("tools.gh__create_issue", "mcp.gh's tool \"create_issue\""),
            "{found:#?}"
        );
        assert!(
            error(
                "mcp.a-server-whose-name-is-long-enough-to-be-cut",
                "at most 40"
            ),
            "{found:#?}"
        );
        assert!(!found.iter().any(|f| f.key == "mcp.gh"), "{found:#?}");
    }

    #[test]
    fn a_tool_schema_must_be_valid_and_its_strings_bounded() {
        let tool = |parameters: &str| {
            findings(&format!(
                "[tools.read]\ncommand = [\"/bin/cat\"]\nparameters = {parameters}\n"
            ))
        };
        let invalid = tool(r#"{ type = "object", properties = { n = { type = "nonsense" } } }"#);
        assert!(
            invalid.iter().any(|f| f.severity == Severity::Error
                && f.key == "tools.read.parameters"
                && f.message.contains("not a valid JSON Schema")),
            "{invalid:?}"
        );
        let free = tool(r#"{ type = "object", properties = { path = { type = "string" } } }"#);
        assert!(
            free.iter().any(|f| f.severity == Severity::Warning
                && f.key == "tools.read.parameters.properties.path"),
            "{free:?}"
        );
        let bounded = tool(
            r#"{ type = "object", properties = { path = { type = "string", pattern = "^/srv/" } } }"#,
        );
        assert!(bounded.is_empty(), "{bounded:?}");
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
    fn a_route_priority_and_coalesce_window_are_bounded() {
        let route = |priority: &str| {
            format!("[routes.a]\npath = \"/a\"\nverify = {{ scheme = \"none\" }}\n{priority}")
        };
        let loaded = check_text(&route("priority = 10")).expect("valid");
        assert_eq!(loaded.config.routes[0].priority, 10);
        let loaded = check_text(&route("")).expect("valid");
        assert_eq!(loaded.config.routes[0].priority, 0);
        let loaded = check_text(&route("coalesce = \"30s\"")).expect("valid");
        assert_eq!(
            loaded.config.routes[0].coalesce,
            Some(Duration::from_secs(30))
        );
        for wrong in ["coalesce = \"0s\"", "coalesce = \"2h\""] {
            assert!(
                findings(&route(wrong))
                    .iter()
                    .any(|f| f.severity == Severity::Error && f.key == "routes.a.coalesce"),
                "{wrong}"
            );
        }
        for wrong in ["priority = 5000", "priority = -1001"] {
            assert!(
                findings(&route(wrong))
                    .iter()
                    .any(|f| f.severity == Severity::Error && f.key == "routes.a.priority"),
                "{wrong}"
            );
        }
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
