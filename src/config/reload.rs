//! What a reload changes, and what it reports back to `agentgate reload`.
//!
//! A reload applies routes, tools and every `[runtime]` key at once (a running turn keeps the
//! snapshot it started with), but some settings are fixed for the daemon's life: the state
//! directory and store, the listeners, the model backend. The report names both kinds, so an
//! operator knows whether a restart is still needed.

use serde::{Deserialize, Serialize};

use super::{Config, RuntimeSettings};

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

/// Lists the settings that differ between `old` and `new` into `report`: routes and tools by
/// name and the runtime settings that turns read apply now; everything else waits for a restart.
pub(crate) fn list_changes(old: &Config, new: &Config, report: &mut ReloadReport) {
    let mut changed = Vec::new();
    let mut at_restart = Vec::new();
    let mut compare = |name: &str, differs: bool, live: bool| {
        if differs {
            if live {
                changed.push(name.to_string());
            } else {
                at_restart.push(name.to_string());
            }
        }
    };
    compare("state_dir", old.state_dir != new.state_dir, false);
    // `server.max_body` is each route's default, so it shows up as changed routes.
    let mut server = old.server.clone();
    server.max_body = new.server.max_body;
    server.tls.clone_from(&new.server.tls);
    server
        .trusted_proxies
        .clone_from(&new.server.trusted_proxies);
    compare(
        "server (listen, control_socket, header_timeout)",
        server != new.server,
        false,
    );
    compare("server.tls", old.server.tls != new.server.tls, true);
    compare(
        "server.trusted_proxies",
        old.server.trusted_proxies != new.server.trusted_proxies,
        true,
    );
    compare("store", old.store != new.store, false);
    compare("model", old.model != new.model, false);
    // The exporter is set up once per process.
    compare("telemetry", old.telemetry != new.telemetry, false);
    // The console's listener is bound once per process; its pages read the rest live.
    compare(
        "console (listen, tls)",
        (&old.console.listen, &old.console.tls) != (&new.console.listen, &new.console.tls),
        false,
    );
    compare(
        "console (enabled, token, trace_url)",
        (
            old.console.enabled,
            &old.console.token,
            &old.console.trace_url,
        ) != (
            new.console.enabled,
            &new.console.token,
            &new.console.trace_url,
        ),
        true,
    );
    compare("store.retention", old.retention != new.retention, true);
    // Every `[runtime]` key is read from the settings in effect where it is used (the
    // scheduler's claim, the drain, the resumes, each turn and request), never kept from the
    // start: each one that differs applies now.
    for key in runtime_keys_that_differ(&old.runtime, &new.runtime) {
        compare(&format!("runtime.{key}"), true, true);
    }
    for (name, tool) in &old.tools {
        compare(
            &format!("tools.{name}"),
            new.tools.get(name) != Some(tool),
            true,
        );
    }
    for name in new
        .tools
        .keys()
        .filter(|name| !old.tools.contains_key(*name))
    {
        compare(&format!("tools.{name}"), true, true);
    }
    for (name, server) in &old.mcp {
        compare(
            &format!("mcp.{name}"),
            new.mcp.get(name) != Some(server),
            true,
        );
    }
    for name in new.mcp.keys().filter(|name| !old.mcp.contains_key(*name)) {
        compare(&format!("mcp.{name}"), true, true);
    }
    for route in &old.routes {
        let now = new.routes.iter().find(|r| r.name == route.name);
        compare(&format!("routes.{}", route.name), now != Some(route), true);
    }
    for route in &new.routes {
        let added = !old.routes.iter().any(|r| r.name == route.name);
        compare(&format!("routes.{}", route.name), added, true);
    }
    report.changed = changed;
    report.at_restart = at_restart;
}

/// The names of the `[runtime]` keys whose values differ, as serde names them (the config's
/// names): a key added to `RuntimeSettings` is listed without an edit here.
fn runtime_keys_that_differ(old: &RuntimeSettings, new: &RuntimeSettings) -> Vec<String> {
    let fields = |runtime: &RuntimeSettings| match serde_json::to_value(runtime) {
        Ok(serde_json::Value::Object(fields)) => fields,
        Ok(_) | Err(_) => serde_json::Map::new(),
    };
    let (old, new) = (fields(old), fields(new));
    new.iter()
        .filter(|(key, value)| old.get(*key) != Some(value))
        .map(|(key, _)| key.clone())
        .collect()
}
