//! Reload: SIGHUP or `agentgate reload` applies a changed config without a restart.
//!
//! A reload runs every check a start runs (config findings, secrets, the unsigned-off-loopback
//! rule for the listener already bound), and a config that fails one is refused while the old one
//! keeps serving, so a typo in production never takes the gateway down.

use std::sync::Arc;

use super::notify;
use crate::agent::mcp::McpServers;
use crate::config::{
    self, ConfigError, ConfigSource, LocatedFinding, ReloadReport, RuntimeSettings, SecretCheck,
    Settings, Shared,
};
use crate::ingress::{self, Ingress};
use crate::logging;

/// What a reload changes in the running daemon.
pub(super) struct Reloader {
    pub source: ConfigSource,
    pub settings: Arc<Shared<Settings>>,
    pub ingress: Arc<Ingress>,
    /// The MCP servers, which a reload adds, removes and restarts.
    pub mcp: Arc<McpServers>,
    /// The webhook listener's address, for the checks a reload repeats.
    pub webhook_addr: Option<std::net::SocketAddr>,
}

impl Reloader {
    /// SIGHUP or `agentgate reload`: re-reads the config and runs every check a start runs. A
    /// config that fails one is refused and the old one stays.
    pub(super) fn reload(&self) -> ReloadReport {
        notify::reloading();
        let mut report = ReloadReport::default();
        match self.checked_settings(&mut report) {
            Ok(settings) => {
                config::list_changes(&self.settings.get().config, &settings.config, &mut report);
                self.settings.replace(settings);
                apply_log_settings(&self.settings.get().config.runtime);
                self.ingress.reload(self.settings.get());
                let config = &self.settings.get().config;
                self.mcp.apply(&config.mcp, &config.hidden);
                report.applied = true;
                tracing::info!(
                    routes = self.settings.get().config.routes.len(),
                    changed = %report.changed.join(", "),
                    "config reloaded"
                );
                if !report.at_restart.is_empty() {
                    tracing::warn!(at_restart = %report.at_restart.join(", "),
                        "these changed settings take effect at the next restart");
                }
            }
            Err(reason) => {
                tracing::error!(reason = %reason, "config reload refused; still serving on the previous config");
                report.refused = Some(reason);
            }
        }
        notify::ready(if report.applied {
            "reloaded"
        } else {
            "reload refused; serving on the previous config"
        });
        report
    }

    /// The new config's settings, if it passes every start-time check; its findings go into
    /// `report` either way.
    fn checked_settings(&self, report: &mut ReloadReport) -> Result<Settings, String> {
        let loaded = match config::load(&self.source, SecretCheck::Required) {
            Ok(loaded) => loaded,
            Err(ConfigError::Invalid {
                source_name,
                findings,
            }) => {
                for finding in &findings {
                    let line = LocatedFinding {
                        source: &source_name,
                        finding,
                    }
                    .to_string();
                    tracing::error!("{line}");
                    report.findings.push(line);
                }
                return Err(format!("{source_name} has errors"));
            }
            Err(unreadable) => return Err(unreadable.to_string()),
        };
        for finding in &loaded.warnings {
            let line = LocatedFinding {
                source: &self.source,
                finding,
            }
            .to_string();
            tracing::warn!("{line}");
            report.findings.push(line);
        }
        if let Some(addr) = self.webhook_addr {
            ingress::refuse_unsigned_off_loopback(&loaded.config, addr)
                .map_err(|err| err.to_string())?;
        }
        Settings::new(loaded.config)
    }
}

/// Applies the settings that take effect at once: which event lines are written, and how many.
pub(super) fn apply_log_settings(runtime: &RuntimeSettings) {
    logging::configure_event_lines(runtime.event_log_level, runtime.event_log_max_per_second);
}
