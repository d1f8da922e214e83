//! What a reload changes, and what it reports back to `agentgate reload`.
//!
//! A reload applies routes, tools and most settings at once (a running turn keeps the snapshot it
//! started with), but some are fixed for the daemon's life: the state directory and store, the
//! listeners' sockets and connection limits, the model client, the trace exporter. The report
//! names every changed key as one or the other, so an operator knows whether a restart is still
//! needed. Each section below is compared field by field, with each field's nature written next
//! to it; the struct is destructured whole, so a field added to a settings struct does not compile
//! until its line here says when it applies (docs/reference.md, "Reload").

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{
    BudgetLimits, Config, ConsoleSettings, ModelBackend, ModelSettings, PostgresSettings,
    RouteSettings, RuntimeSettings, ServerSettings, StoreSettings, TelemetrySettings,
};

/// The answer to a reload request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ReloadReport {
    /// The new config is in effect.
    pub(crate) applied: bool,
    /// Every finding of the new config, one line each (`file:line: severity: key: message`).
    pub(crate) findings: Vec<String>,
    /// Why the new config was refused (`applied` is false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) refused: Option<String>,
    /// Settings that changed and are in effect now.
    pub(crate) changed: Vec<String>,
    /// Settings that changed but take effect only at the next restart.
    pub(crate) at_restart: Vec<String>,
}

/// When a changed setting takes effect.
#[derive(Debug, Clone, Copy)]
enum Applies {
    /// Read from the settings in effect where it is used: the next request, turn or accept.
    Now,
    /// Read once, when the daemon starts.
    AtRestart,
}

/// The changed keys, by when they apply.
#[derive(Default)]
struct Changes {
    now: Vec<String>,
    at_restart: Vec<String>,
}

impl Changes {
    fn compare(&mut self, key: &str, differs: bool, applies: Applies) {
        if differs {
            match applies {
                Applies::Now => self.now.push(key.to_string()),
                Applies::AtRestart => self.at_restart.push(key.to_string()),
            }
        }
    }
}

/// Compares `old` and `new`, two settings structs of type `$ty`, field by field: each field is
/// the key `$section.field` and applies as its nature says (`Now`, `AtRestart`), or `_` when it is
/// compared key by key elsewhere. The struct is destructured with every field named, so a field
/// added to it does not compile until its nature is written here.
macro_rules! compare_fields {
    ($changes:ident, $section:literal, $old:ident, $new:ident,
        $ty:ident { $($field:ident: $applies:tt),* $(,)? }) => {
        let $ty { $($field: _),* } = $new;
        $(compare_fields!(@field $changes, concat!($section, ".", stringify!($field)),
            $old.$field != $new.$field, $applies);)*
    };
    (@field $changes:ident, $key:expr, $differs:expr, _) => {};
    (@field $changes:ident, $key:expr, $differs:expr, $applies:ident) => {
        $changes.compare($key, $differs, Applies::$applies)
    };
}

/// Lists the settings that differ between `old` and `new` into `report`, each as in effect now
/// or at the next restart.
pub(crate) fn list_changes(old: &Config, new: &Config, report: &mut ReloadReport) {
    let mut changes = Changes::default();
    let Config {
        state_dir,
        server,
        runtime,
        model,
        store,
        retention,
        tools,
        mcp,
        routes,
        // Follows from other keys (the state directory, the control socket, the config and
        // secret files), and applies with them: each child process reads it when it starts.
        hidden: _,
        budgets,
        telemetry,
        console,
    } = new;
    // The database and ledger are opened once per process.
    changes.compare("state_dir", old.state_dir != *state_dir, Applies::AtRestart);
    server_changes(&old.server, server, &mut changes);
    runtime_changes(&old.runtime, runtime, &mut changes);
    model_changes(&old.model, model, &mut changes);
    store_changes(&old.store, store, &mut changes);
    // The pruner reads it at each pass.
    changes.compare("store.retention", old.retention != *retention, Applies::Now);
    budget_changes(&old.budgets, budgets, &mut changes);
    telemetry_changes(&old.telemetry, telemetry, &mut changes);
    console_changes(&old.console, console, &mut changes);
    // Each turn takes its tools, and each request its route, from the settings in effect; MCP
    // servers whose table changed are restarted by the reload.
    keyed_changes("tools", &old.tools, tools, &mut changes);
    keyed_changes("mcp", &old.mcp, mcp, &mut changes);
    keyed_changes(
        "routes",
        &by_name(&old.routes),
        &by_name(routes),
        &mut changes,
    );
    report.changed = changes.now;
    report.at_restart = changes.at_restart;
}

/// Routes by name, as the other named tables are kept.
fn by_name(routes: &[RouteSettings]) -> BTreeMap<String, &RouteSettings> {
    routes
        .iter()
        .map(|route| (route.name.clone(), route))
        .collect()
}

/// The named tables of `section` (`[tools.NAME]`...) that were added, removed or changed; each
/// applies now.
fn keyed_changes<T: PartialEq>(
    section: &str,
    old: &BTreeMap<String, T>,
    new: &BTreeMap<String, T>,
    changes: &mut Changes,
) {
    let names: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for name in names {
        changes.compare(
            &format!("{section}.{name}"),
            old.get(name) != new.get(name),
            Applies::Now,
        );
    }
}

fn server_changes(old: &ServerSettings, new: &ServerSettings, changes: &mut Changes) {
    compare_fields!(
        changes,
        "server",
        old,
        new,
        ServerSettings {
            // Bound once per process (or passed by systemd).
            listen: AtRestart,
            control_socket: AtRestart,
            // Each route's default (so its routes show as changed too), read per request.
            max_body: Now,
            // The listeners' connection timers (and the body timeout, four times it) are set when
            // they start.
            header_timeout: AtRestart,
            keepalive_timeout: AtRestart,
            max_connections: AtRestart,
            // Read at each accept from the settings in effect.
            max_connections_per_peer: Now,
            // Each new connection takes the acceptor of the settings in effect.
            tls: Now,
            // Read at each accept (the per-peer cap) and each request (`X-Forwarded-For`).
            trusted_proxies: Now,
            metrics_listen: AtRestart,
            // Read when an approval request is made and when an approval link is followed.
            public_url: Now,
        }
    );
}

/// Every `[runtime]` key is read from the settings in effect where it is used (the scheduler's
/// claim, the drain, the resumes, each turn and request), never kept from the start.
fn runtime_changes(old: &RuntimeSettings, new: &RuntimeSettings, changes: &mut Changes) {
    compare_fields!(
        changes,
        "runtime",
        old,
        new,
        RuntimeSettings {
            max_concurrent_turns: Now,
            max_turn_steps: Now,
            drain_timeout: Now,
            turn_idle_timeout: Now,
            resume_max_attempts: Now,
            resume_window: Now,
            dedup_window: Now,
            max_queued_events: Now,
            min_free_disk: Now,
            max_tool_calls_per_reply: Now,
            max_repeated_tool_calls: Now,
            approval_timeout: Now,
            max_background_jobs: Now,
            max_background_jobs_per_session: Now,
            max_internal_turns: Now,
            event_log_level: Now,
            event_log_max_per_second: Now,
        }
    );
}

/// The model client is built once per process; what tokens cost is read where it is counted.
fn model_changes(old: &ModelSettings, new: &ModelSettings, changes: &mut Changes) {
    compare_fields!(
        changes,
        "model",
        old,
        new,
        ModelSettings {
            backend: _,
            request_timeout: AtRestart,
            max_retries: AtRestart,
            outage_wait: AtRestart,
            params: AtRestart,
            tool_calls_in_content: AtRestart,
            price: Now,
            max_concurrent_requests: AtRestart,
        }
    );
    backend_changes(&old.backend, &new.backend, changes);
}

/// `[model] backend` and the keys of each backend, all part of the client built at start.
fn backend_changes(old: &ModelBackend, new: &ModelBackend, changes: &mut Changes) {
    let mut compare = |key: &str, differs: bool| {
        changes.compare(&format!("model.{key}"), differs, Applies::AtRestart);
    };
    match (old, new) {
        (
            ModelBackend::OpenAi {
                base_url,
                model,
                api_key,
                fallback,
            },
            ModelBackend::OpenAi {
                base_url: new_base_url,
                model: new_model,
                api_key: new_api_key,
                fallback: new_fallback,
            },
        ) => {
            compare("base_url", base_url != new_base_url);
            compare("model", model != new_model);
            compare("api_key", api_key != new_api_key);
            compare("fallback", fallback != new_fallback);
        }
        (ModelBackend::Command { argv }, ModelBackend::Command { argv: new_argv }) => {
            compare("command", argv != new_argv);
        }
        (
            ModelBackend::Replay { cassette },
            ModelBackend::Replay {
                cassette: new_cassette,
            },
        ) => {
            compare("cassette", cassette != new_cassette);
        }
        (
            ModelBackend::OpenAi { .. }
            | ModelBackend::Command { .. }
            | ModelBackend::Replay { .. },
            _,
        ) => compare("backend", true),
    }
}

/// The store is opened, and its pool and leases set up, once per process.
fn store_changes(old: &StoreSettings, new: &StoreSettings, changes: &mut Changes) {
    match (old, new) {
        (StoreSettings::Sqlite, StoreSettings::Sqlite) => {}
        (StoreSettings::Postgres(old), StoreSettings::Postgres(new)) => {
            compare_fields!(
                changes,
                "store",
                old,
                new,
                PostgresSettings {
                    url: AtRestart,
                    node: AtRestart,
                    lease_ttl: AtRestart,
                    pool_size: AtRestart,
                    ca_file: AtRestart,
                }
            );
        }
        (StoreSettings::Sqlite | StoreSettings::Postgres(_), _) => {
            changes.compare("store.backend", true, Applies::AtRestart);
        }
    }
}

/// Each turn checks its spending against the budgets in effect when it reserves a model call.
fn budget_changes(old: &BudgetLimits, new: &BudgetLimits, changes: &mut Changes) {
    compare_fields!(
        changes,
        "budgets",
        old,
        new,
        BudgetLimits {
            turn_tokens: Now,
            turn_usd: Now,
            session_tokens: Now,
            session_usd: Now,
            daily_tokens: Now,
            daily_usd: Now,
            warn_at: Now,
        }
    );
}

/// The exporter is set up once per process.
fn telemetry_changes(old: &TelemetrySettings, new: &TelemetrySettings, changes: &mut Changes) {
    compare_fields!(
        changes,
        "telemetry",
        old,
        new,
        TelemetrySettings {
            otlp_endpoint: AtRestart,
            sample_ratio: AtRestart,
            capture_content: AtRestart,
        }
    );
}

/// The console's TCP listener is bound once per process; its pages read the rest per request.
fn console_changes(old: &ConsoleSettings, new: &ConsoleSettings, changes: &mut Changes) {
    compare_fields!(
        changes,
        "console",
        old,
        new,
        ConsoleSettings {
            enabled: Now,
            listen: AtRestart,
            token: Now,
            tls: AtRestart,
            trace_url: Now,
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConfigSource, Environment, SecretCheck, check};

    fn config(text: &str) -> Config {
        let environment = Environment {
            credentials_dir: None,
            state_directory: None,
            secrets: SecretCheck::Required,
        };
        match check(ConfigSource::File("test.toml".into()), text, &environment) {
            Ok(loaded) => loaded.config,
            Err(err) => panic!("{text}: {err:?}"),
        }
    }

    /// What a reload from `old` to `new` reports: (changed, at restart).
    fn report(old: &str, new: &str) -> (Vec<String>, Vec<String>) {
        let mut report = ReloadReport::default();
        list_changes(&config(old), &config(new), &mut report);
        (report.changed, report.at_restart)
    }

    /// The keys the test of the real daemon cannot change (it runs on SQLite, with one model
    /// backend): each PostgreSQL key, and each backend's own keys, wait for a restart; so does a
    /// switch of backend.
    #[test]
    fn store_and_model_backend_keys_wait_for_a_restart() {
        let postgres = |keys: &str| {
            format!("[store]\nbackend = \"postgres\"\nurl = \"postgres://u@db/a\"\n{keys}")
        };
        let every = "node = \"n2\"\nlease_ttl = \"20s\"\npool_size = 4\nca_file = \"/etc/ssl/certs/ca-certificates.crt\"\n";
        let moved = postgres(every).replace("@db/a", "@db/b");
        let keys =
            ["url", "node", "lease_ttl", "pool_size", "ca_file"].map(|key| format!("store.{key}"));
        assert_eq!(report(&postgres(""), &moved), (vec![], keys.to_vec()));
        assert_eq!(
            report("", &postgres("")),
            (vec![], vec!["store.backend".to_string()])
        );

        let dir = tempfile::tempdir().expect("tempdir");
        let cassette = |name: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, "").expect("cassette");
            format!("[model]\nbackend = \"replay\"\ncassette = {path:?}\n")
        };
        let command =
            |argv: &str| format!("[model]\nbackend = \"command\"\ncommand = [\"{argv}\"]\n");
        for (old, new, key) in [
            (command("/bin/a"), command("/bin/b"), "model.command"),
            (cassette("a.jsonl"), cassette("b.jsonl"), "model.cassette"),
            (command("/bin/a"), cassette("a.jsonl"), "model.backend"),
        ] {
            assert_eq!(report(&old, &new), (vec![], vec![key.to_string()]), "{new}");
        }
    }
}
