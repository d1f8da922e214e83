//! What a reload changes, and what it reports back to `agentgate reload`.
//!
//! A reload applies routes and tools at once (a running turn keeps the snapshot it started with)
//! but some settings are fixed for the daemon's life: the state directory and store, the
//! listeners, the model backend, the drain and resume settings. The report names both kinds, so
//! an operator knows whether a restart is still needed.

use serde::Serialize;

use super::Config;

/// The answer to a reload request.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct ReloadReport {
    /// The new config is in effect.
    pub(crate) applied: bool,
    /// Every finding of the new config, one line each (`file:line: severity: key: message`).
    pub(crate) findings: Vec<String>,
    /// Why the new config was refused (`applied` is false).
    #[serde(skip_serializing_if = "Option::is_none")]
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
    compare("store.retention", old.retention != new.retention, true);
    let (was, now) = (&old.runtime, &new.runtime);
    compare(
        "runtime.max_turn_steps",
        was.max_turn_steps != now.max_turn_steps,
        true,
    );
    compare(
        "runtime.turn_idle_timeout",
        was.turn_idle_timeout != now.turn_idle_timeout,
        true,
    );
    compare(
        "runtime.dedup_window",
        was.dedup_window != now.dedup_window,
        true,
    );
    let mut restart_only = was.clone();
    restart_only.max_turn_steps = now.max_turn_steps;
    restart_only.turn_idle_timeout = now.turn_idle_timeout;
    restart_only.dedup_window = now.dedup_window;
    compare(
        "runtime (max_concurrent_turns, drain_timeout, resume_*)",
        restart_only != *now,
        false,
    );
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
