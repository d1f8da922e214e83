//! The tools one turn offers: the route's command tools and its MCP servers' tools, under the
//! names the model calls them by, with how each one runs and whether a call that was cut off may
//! run again.
//!
//! A turn builds its catalog once, when it starts, and keeps it: a reload or a server that
//! changes its tools affects the next turn, never a call in flight.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::mcp::{McpServers, Server, TurnServers};
use crate::config::{Config, McpServerSettings, RouteSettings, ToolRef, ToolSettings};
use crate::schema;

/// OpenAI function names: letters, digits, '_' and '-', at most 64.
const MAX_FUNCTION_NAME: usize = 64;

/// Whether a call that started and has no recorded result may run again at a resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Rerun {
    /// Running it again has no further effect (`idempotent`, or MCP `readOnlyHint` /
    /// `idempotentHint`).
    Idempotent,
    /// It has effects, but honours its call key, so a second run with the same key is a no-op.
    Dedupes,
    /// It is not run again; the model gets "interrupted, outcome unknown".
    Never,
}

impl Rerun {
    pub(crate) fn is_safe(self) -> bool {
        self != Rerun::Never
    }

    /// As `tools list` shows it (and its JSON spells it).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Rerun::Idempotent => "idempotent",
            Rerun::Dedupes => "dedupes",
            Rerun::Never => "never",
        }
    }

    fn of_command(tool: &ToolSettings) -> Rerun {
        if tool.idempotent {
            Rerun::Idempotent
        } else if tool.dedupes {
            Rerun::Dedupes
        } else {
            Rerun::Never
        }
    }

    /// The operator's lists first, then the tool's own annotations.
    pub(crate) fn of_mcp(server: &McpServerSettings, tool: &str, annotated: bool) -> Rerun {
        let listed = |list: &[String]| list.iter().any(|name| name == tool);
        if listed(&server.not_idempotent) {
            Rerun::Never
        } else if listed(&server.idempotent) {
            Rerun::Idempotent
        } else if listed(&server.dedupes) {
            Rerun::Dedupes
        } else if annotated {
            Rerun::Idempotent
        } else {
            Rerun::Never
        }
    }
}

/// How an offered tool runs.
#[derive(Clone)]
pub(crate) enum Runs {
    Command(ToolSettings),
    Mcp {
        server: Arc<Server>,
        /// The server's own name for the tool.
        tool: String,
    },
}

/// One tool as the model sees it.
#[derive(Clone)]
pub(crate) struct OfferedTool {
    /// The name the model calls it by.
    pub name: String,
    pub description: String,
    pub parameters: serde_json::Value,
    /// `parameters`, compiled: what each call's arguments are checked against.
    pub checked: schema::Parameters,
    pub rerun: Rerun,
    /// Every call waits for an operator's decision before it runs.
    pub approval: bool,
    pub runs: Runs,
}

impl OfferedTool {
    /// Whether a route's `tools` entry names this tool.
    fn is_named_by(&self, entry: &ToolRef) -> bool {
        match (entry, &self.runs) {
            (ToolRef::Command(name), Runs::Command(settings)) => *name == settings.name,
            (
                ToolRef::Mcp { server, tool },
                Runs::Mcp {
                    server: offered,
                    tool: name,
                },
            ) => *server == offered.name && tool.as_deref().is_none_or(|wanted| wanted == name),
            (ToolRef::Command(_), Runs::Mcp { .. }) | (ToolRef::Mcp { .. }, Runs::Command(_)) => {
                false
            }
        }
    }

    /// What it is, for a problem line: `tools.NAME`, or `MCP server S's tool T`.
    fn described(&self) -> String {
        match &self.runs {
            Runs::Command(settings) => format!("tools.{}", settings.name),
            Runs::Mcp { server, tool } => {
                format!("MCP server {:?}'s tool {tool:?}", server.name)
            }
        }
    }

    /// The MCP server it comes from, if any.
    pub(crate) fn mcp_server(&self) -> Option<&str> {
        match &self.runs {
            Runs::Command(_) => None,
            Runs::Mcp { server, .. } => Some(&server.name),
        }
    }
}

/// The name the model calls an MCP server's tool by: `SERVER__tool`, with every character a
/// function name cannot have replaced by '_'.
pub(crate) fn model_name(server: &str, tool: &str) -> String {
    let mut name: String = format!("{server}__{tool}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(MAX_FUNCTION_NAME);
    name
}

/// A turn's tools, in the route's order, and the processes of stdio servers the turn started
/// to call them (stopped when the turn drops its catalog).
#[derive(Clone, Default)]
pub(crate) struct Catalog {
    tools: Vec<OfferedTool>,
    servers: Arc<TurnServers>,
}

impl Catalog {
    /// The tools `route` offers now. An MCP server still starting is waited for up to `wait`; a
    /// server that is down, or a tool it does not have, is left out and reported in the second
    /// value, one line each.
    pub(crate) async fn for_route(
        route: &RouteSettings,
        config: &Config,
        servers: &McpServers,
        wait: Duration,
    ) -> (Catalog, Vec<String>) {
        Catalog::of(&route.tools, config, servers, wait).await
    }

    async fn of(
        entries: &[ToolRef],
        config: &Config,
        servers: &McpServers,
        wait: Duration,
    ) -> (Catalog, Vec<String>) {
        let mut catalog = Catalog::default();
        let mut problems = Vec::new();
        for entry in entries {
            match entry {
                ToolRef::Command(name) => {
                    if let Some(tool) = config.tools.get(name) {
                        problems.extend(catalog.add(OfferedTool {
                            name: tool.name.clone(),
                            description: tool.description.clone(),
                            parameters: tool.parameters.clone(),
                            checked: schema::Parameters::compile(&tool.parameters),
                            rerun: Rerun::of_command(tool),
                            approval: tool.approval,
                            runs: Runs::Command(tool.clone()),
                        }));
                    }
                }
                ToolRef::Mcp { server, tool } => {
                    let Some(settings) = config.mcp.get(server) else {
                        continue;
                    };
                    let (reached, tools) = match servers.ready(server, wait).await {
                        Ok(ready) => ready,
                        Err(problem) => {
                            problems.push(problem);
                            continue;
                        }
                    };
                    let mut found = false;
                    for offered in tools
                        .iter()
                        .filter(|t| tool.as_deref().is_none_or(|wanted| t.name == wanted))
                    {
                        found = true;
                        problems.extend(catalog.add(OfferedTool {
                            name: model_name(server, &offered.name),
                            description: offered.description.clone(),
                            parameters: offered.input_schema.clone(),
                            checked: offered.checked.clone(),
                            rerun: Rerun::of_mcp(
                                settings,
                                &offered.name,
                                offered.annotated_idempotent,
                            ),
                            approval: settings.needs_approval(&offered.name),
                            runs: Runs::Mcp {
                                server: reached.clone(),
                                tool: offered.name.clone(),
                            },
                        }));
                    }
                    if let (Some(tool), false) = (tool, found) {
                        problems.push(format!("MCP server {server:?} has no tool {tool:?}"));
                    }
                }
            }
        }
        (catalog, problems)
    }

    /// Adds `tool`, unless the route names it twice, or another tool already goes by its name
    /// (two of a server's tools whose names differ only in characters a function name cannot
    /// have, say): then it is left out, and the problem names both.
    fn add(&mut self, tool: OfferedTool) -> Option<String> {
        let Some(first) = self.tools.iter().find(|t| t.name == tool.name) else {
            self.tools.push(tool);
            return None;
        };
        let same = match (&first.runs, &tool.runs) {
            (Runs::Command(a), Runs::Command(b)) => a.name == b.name,
            (Runs::Mcp { server: a, tool: x }, Runs::Mcp { server: b, tool: y }) => {
                a.name == b.name && x == y
            }
            (Runs::Command(_), Runs::Mcp { .. }) | (Runs::Mcp { .. }, Runs::Command(_)) => false,
        };
        (!same).then(|| {
            format!(
                "{} and {} are both called {:?} by the model; only the first is offered",
                first.described(),
                tool.described(),
                tool.name
            )
        })
    }

    pub(crate) fn get(&self, name: &str) -> Option<&OfferedTool> {
        self.tools.iter().find(|tool| tool.name == name)
    }

    /// Each tool's compiled parameter schema, by the name the model calls it.
    pub(crate) fn schemas(&self) -> BTreeMap<String, schema::Parameters> {
        self.tools
            .iter()
            .map(|tool| (tool.name.clone(), tool.checked.clone()))
            .collect()
    }

    /// The tools whose calls wait for an operator's decision, by the name the model calls them.
    pub(crate) fn gated(&self) -> std::collections::BTreeSet<String> {
        self.tools
            .iter()
            .filter(|tool| tool.approval)
            .map(|tool| tool.name.clone())
            .collect()
    }

    /// The MCP server of each tool that has one, by the name the model calls it.
    pub(crate) fn mcp_servers(&self) -> BTreeMap<String, String> {
        self.tools
            .iter()
            .filter_map(|tool| Some((tool.name.clone(), tool.mcp_server()?.to_string())))
            .collect()
    }

    pub(crate) fn tools(&self) -> &[OfferedTool] {
        &self.tools
    }

    /// The turn's own processes of the stdio servers it calls.
    pub(crate) fn servers(&self) -> &TurnServers {
        &self.servers
    }
}

/// Whether route `route` still offers the tool the model calls `name` (a reload may have
/// removed it). An MCP server's tool counts as offered while the route names the server for it;
/// whether the server still has it is known only when a turn lists its tools.
pub(crate) fn still_offered(config: &Config, route: &str, name: &str) -> bool {
    let Some(route) = config.routes.iter().find(|r| r.name == route) else {
        return false;
    };
    route.tools.iter().any(|entry| match entry {
        ToolRef::Command(tool) => tool == name && config.tools.contains_key(tool),
        ToolRef::Mcp { server, tool } => {
            config.mcp.contains_key(server)
                && match tool {
                    Some(tool) => model_name(server, tool) == name,
                    None => name.starts_with(&model_name(server, "")),
                }
        }
    })
}

/// How a listed tool runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ListedKind {
    Command,
    Mcp,
}

/// One tool of `tools list`, as the daemon sends it (`GET /v1/tools`) and the CLI reads and
/// prints it. The fields are in alphabetical order, the order `tools list --json` prints them in.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ListedTool {
    pub approval: bool,
    pub background: bool,
    /// A command tool's argv; `null` for an MCP server's tool.
    pub command: Option<Vec<String>>,
    pub description: String,
    pub idempotent: bool,
    pub kind: ListedKind,
    pub mcp_server: Option<String>,
    pub name: String,
    pub parameters: serde_json::Value,
    pub rerun: Rerun,
    pub routes: Vec<String>,
    pub timeout_seconds: u64,
}

/// `tools list`: every tool `route` offers (or, without a route, every tool of the config),
/// with its schema, whether it may run again after an interruption, and the routes that offer
/// it; then the problems met (a server that is down), one line each.
pub(crate) async fn listing(
    config: &Config,
    servers: &McpServers,
    route: Option<&str>,
    wait: Duration,
) -> Result<(Vec<ListedTool>, Vec<String>), String> {
    let entries: Vec<ToolRef> = match route {
        Some(name) => config
            .routes
            .iter()
            .find(|r| r.name == name)
            .ok_or_else(|| format!("no route {name:?} in the config"))?
            .tools
            .clone(),
        None => config
            .tools
            .keys()
            .map(|name| ToolRef::Command(name.clone()))
            .chain(config.mcp.keys().map(|server| ToolRef::Mcp {
                server: server.clone(),
                tool: None,
            }))
            .collect(),
    };
    let (catalog, problems) = Catalog::of(&entries, config, servers, wait).await;
    let tools = catalog
        .tools()
        .iter()
        .map(|tool| {
            let routes = config
                .routes
                .iter()
                .filter(|route| route.tools.iter().any(|entry| tool.is_named_by(entry)))
                .map(|route| route.name.clone())
                .collect();
            let (kind, command, background, timeout) = match &tool.runs {
                Runs::Command(settings) => (
                    ListedKind::Command,
                    Some(settings.command.clone()),
                    settings.background,
                    settings.timeout,
                ),
                Runs::Mcp { server, .. } => (ListedKind::Mcp, None, false, server.timeout()),
            };
            ListedTool {
                approval: tool.approval,
                background,
                command,
                description: tool.description.clone(),
                idempotent: tool.rerun.is_safe(),
                kind,
                mcp_server: tool.mcp_server().map(str::to_string),
                name: tool.name.clone(),
                parameters: tool.parameters.clone(),
                rerun: tool.rerun,
                routes,
                timeout_seconds: timeout.as_secs(),
            }
        })
        .collect();
    Ok((tools, problems))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rerun_is_labelled_as_its_json_spells_it() {
        for rerun in [Rerun::Idempotent, Rerun::Dedupes, Rerun::Never] {
            assert_eq!(
                serde_json::to_value(rerun).expect("serializes"),
                rerun.label()
            );
        }
    }

    #[test]
    fn model_names_are_valid_function_names() {
        assert_eq!(model_name("github", "create_issue"), "github__create_issue");
        assert_eq!(model_name("fs", "read.file/v2"), "fs__read_file_v2");
        assert_eq!(model_name("s", &"x".repeat(100)).len(), MAX_FUNCTION_NAME);
    }

    #[test]
    fn the_operator_overrides_annotations_both_ways() {
        let server = McpServerSettings {
            name: "s".into(),
            transport: crate::config::McpTransport::Http {
                url: "http://127.0.0.1:1/mcp".into(),
                headers: Default::default(),
            },
            timeout: Duration::from_secs(1),
            idempotent: vec!["sync".into()],
            not_idempotent: vec!["read".into()],
            dedupes: vec!["pay".into()],
            approval: vec!["merge_*".into(), "create_issue".into()],
        };
        assert!(server.needs_approval("merge_pr") && server.needs_approval("create_issue"));
        assert!(!server.needs_approval("create_issue_comment") && !server.needs_approval("read"));
        assert_eq!(Rerun::of_mcp(&server, "read", true), Rerun::Never);
        assert_eq!(Rerun::of_mcp(&server, "sync", false), Rerun::Idempotent);
        assert_eq!(Rerun::of_mcp(&server, "pay", false), Rerun::Dedupes);
        assert_eq!(Rerun::of_mcp(&server, "other", true), Rerun::Idempotent);
        assert_eq!(Rerun::of_mcp(&server, "other", false), Rerun::Never);
    }
}
