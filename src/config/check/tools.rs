//! `[tools.NAME]` and `[mcp.NAME]`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::sandbox::RawSandbox;
use super::{Checker, valid_name};
use crate::config::raw::{RawMcp, RawTool};
use crate::config::settings::{McpServerSettings, McpTransport, ToolSettings};

impl Checker<'_> {
    pub(super) fn tool(&mut self, name: String, raw: RawTool) -> Option<ToolSettings> {
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
        self.parameter_schema(&format!("{prefix}.parameters"), &parameters);
        let sandbox = self.sandboxing(
            &prefix,
            RawSandbox {
                sandbox: raw.sandbox,
                network: raw.network,
                writable: raw.writable,
            },
        );
        self.private_tmp(
            &prefix,
            &sandbox,
            raw.command.iter().map(PathBuf::from).collect(),
        );
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
            sandbox,
            dedupes: raw.dedupes.unwrap_or(false),
            approval: raw.approval.unwrap_or(false),
            name,
        })
    }

    /// A command tool's `parameters`: a valid draft 2020-12 schema (an error otherwise), whose
    /// strings are bounded. A free string parameter reaches the tool as whatever the model
    /// (and so a payload) puts there; `enum`, `pattern`, `maxLength`, `const` or `format` bound
    /// it, and one with none of them is a warning.
    fn parameter_schema(&mut self, key: &str, parameters: &serde_json::Value) {
        if let Err(err) = crate::schema::compile(parameters) {
            self.error(
                key,
                format!("not a valid JSON Schema (draft 2020-12): {err}"),
            );
            return;
        }
        for path in crate::schema::unbounded_strings(parameters) {
            self.warn(
                &format!("{key}{path}"),
                "a string parameter with no enum, pattern, maxLength, const or format: \
                 the tool receives any text the model writes; bound it",
            );
        }
    }

    /// A stdio server's transport: its argv, its environment (plain values or secrets), its
    /// working directory and its sandboxing.
    fn stdio_transport(
        &mut self,
        prefix: &str,
        command: Vec<String>,
        raw: &mut RawMcp,
    ) -> McpTransport {
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
        let sandbox = self.sandboxing(
            prefix,
            RawSandbox {
                sandbox: raw.sandbox.take(),
                network: raw.network,
                writable: raw.writable.take(),
            },
        );
        let cwd = raw.cwd.take();
        let paths = command.iter().map(PathBuf::from).chain(cwd.clone());
        self.private_tmp(prefix, &sandbox, paths.collect());
        let max_instances = self.positive(
            &format!("{prefix}.max_instances"),
            raw.max_instances,
            DEFAULT_MAX_INSTANCES,
        );
        McpTransport::Stdio {
            command,
            env,
            cwd,
            sandbox,
            max_instances: usize::try_from(max_instances).unwrap_or(usize::MAX),
        }
    }

    /// `[mcp.NAME]`: exactly one transport, secrets for its environment or headers.
    pub(super) fn mcp_server(
        &mut self,
        name: String,
        mut raw: RawMcp,
    ) -> Option<McpServerSettings> {
        let prefix = format!("mcp.{name}");
        if !valid_name(&name) || name.contains("__") {
            self.error(
                &prefix,
                "MCP server names may use letters, digits, '_' and '-', but not \"__\" \
                 (the model calls its tools NAME__tool)",
            );
        }
        let transport = match (raw.command.take(), raw.url.take()) {
            (Some(command), None) => self.stdio_transport(&prefix, command, &mut raw),
            (None, Some(url)) => {
                for (key, set) in [
                    ("env", !raw.env.is_empty()),
                    ("cwd", raw.cwd.is_some()),
                    ("sandbox", raw.sandbox.is_some()),
                    ("network", raw.network.is_some()),
                    ("writable", raw.writable.is_some()),
                    ("max_instances", raw.max_instances.is_some()),
                ] {
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
                        format!(
                            "{} is not an http:// or https:// URL",
                            super::redacted_url(&url)
                        ),
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
        for pattern in &raw.approval {
            let name = pattern.strip_suffix('*').unwrap_or(pattern);
            if pattern.is_empty() || name.contains('*') {
                self.error(
                    &format!("{prefix}.approval"),
                    format!("{pattern:?} is not a tool name or a \"prefix*\" pattern"),
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
            approval: raw.approval,
            name,
        })
    }
}

/// `[mcp.NAME] max_instances` by default: as many as turns run at once by default
/// (`runtime.max_concurrent_turns`).
const DEFAULT_MAX_INSTANCES: u32 = 16;

/// The longest MCP server name: with `__` it leaves room in the model's 64 characters for the
/// tool's own name, so that no two servers' tools are cut to the same name.
const MAX_SERVER_NAME: usize = 40;

impl Checker<'_> {
    /// The model calls an MCP server's tool `SERVER__tool`; no two tools may come out with one
    /// name, or the model could not tell them apart (and one would silently stand in for the
    /// other). Names that could are errors, each naming both: a server whose name is another's
    /// with `_` added (`a` with tool `_x`, `a_` with tool `x`: both `a___x`), a command tool
    /// named like a server's tool, and a server name so long that its tools' names are cut.
    pub(super) fn tool_names_apart(
        &mut self,
        tools: &BTreeMap<String, ToolSettings>,
        servers: &BTreeMap<String, McpServerSettings>,
    ) {
        for server in servers.keys() {
            let prefix = format!("mcp.{server}");
            if server.len() > MAX_SERVER_NAME {
                self.error(
                    &prefix,
                    format!(
                        "an MCP server name may have at most {MAX_SERVER_NAME} characters: the \
                         model's names for its tools ({server}__tool) are cut at 64"
                    ),
                );
            }
            if let Some(shorter) = server
                .strip_suffix('_')
                .filter(|shorter| servers.contains_key(*shorter))
            {
                self.error(
                    &prefix,
                    format!(
                        "its tools' names can be the same as those of mcp.{shorter} ({server}__x \
                         and {shorter}___x are both {server}__x to the model); rename one"
                    ),
                );
            }
            for tool in tools
                .keys()
                .filter(|tool| tool.starts_with(&format!("{server}__")))
            {
                self.error(
                    &format!("tools.{tool}"),
                    format!(
                        "the model calls mcp.{server}'s tool {:?} by this name too; rename the tool",
                        &tool[server.len() + 2..]
                    ),
                );
            }
        }
    }
}
