//! MCP servers as tool providers, through the official SDK (`rmcp`) as a client.
//!
//! Each `[mcp.NAME]` server has one supervisor task. It connects (a child process on stdio, or
//! the streamable HTTP transport), lists the server's tools, and keeps the connection until the
//! server goes away; then it reconnects with a backoff. A server that cannot start is logged and
//! shown by `status`, and its tools are simply not offered: it never stops the daemon from
//! serving webhooks.
//!
//! Servers start with the daemon rather than at their first use: the first webhook then does not
//! pay for listing a server's tools (seconds, for an `npx` server), a server that cannot start is
//! reported at start rather than in the middle of a turn, and `status` can show every server's
//! state.
//!
//! A stdio server's calls never go to the supervisor's process, which only lists its tools: a
//! turn that calls the server starts a process of its own ([`TurnServers`]), within the server's
//! `max_instances`, and it is stopped when the turn ends. A server that remembers what one call
//! gave it, or runs what its arguments say, thus never carries one session's payload into
//! another session's calls. An HTTP server is remote: every turn shares its one connection.
//!
//! A turn takes the server it starts with (an `Arc`) and keeps it until it ends, so a reload
//! that replaces a server does not cut off a call in flight. A process is stopped when the last
//! holder lets go: its whole process group is killed, or, under the packaged units, where it
//! runs in a tool unit of its own like any sandboxed child, its unit is stopped; either way it
//! dies with the daemon (`PR_SET_PDEATHSIG`, or the unit's connection closing).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, ContentBlock,
    Implementation, MetaObject, PaginatedRequestParams, RequestMetaObject, ResourceContents,
    ServerNotification, SubscriptionFilter,
};
use rmcp::service::{NotificationContext, RunningService, serve_client_with_ct};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, Peer, RoleClient};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::mcp_bounds::{CutOff, MESSAGE_MAX, ServerPaces, Watched};
use super::mcp_stdio::bounded;
use super::pace::{Paced, PacedRead};
use super::process::{Child, Running};
use super::tools::OUTPUT_CAP;
use crate::config::{HiddenPaths, McpServerSettings, McpTransport};
use crate::logging::OneLineEvery;
use crate::metrics::OverBound;

/// How long a server may take to start and answer `initialize` and `tools/list`.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Restart backoff: doubles from the first to the last; a server that ran this long before it
/// went away starts again from the first.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_LAST: Duration = Duration::from_secs(60);
/// Between closing a server's stdin and killing its process group.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// A server's stderr lines are logged up to this length.
const STDERR_LINE_CAP: usize = 512;
/// A server's tools are listed again at most this often, however often it says they changed.
const RELIST_EVERY: Duration = Duration::from_secs(1);
/// A server that keeps saying its tools changed and then cannot list them: one line this often.
const RELIST_FAILURE_LINE_EVERY: Duration = Duration::from_secs(60);
/// The `_meta` key that carries a call's idempotency key.
pub(crate) const CALL_KEY_META: &str = "agentgate/tool_call_id";

/// A tool an MCP server offers, as its server describes it.
#[derive(Clone)]
pub(crate) struct McpTool {
    /// The server's own name for it.
    pub name: String,
    pub description: String,
    pub input_schema: serde_json::Value,
    /// `input_schema`, compiled once when the server lists its tools, for every turn's calls.
    pub checked: crate::schema::Parameters,
    /// What the annotations say: `readOnlyHint` or `idempotentHint`, and not `destructiveHint`.
    pub annotated_idempotent: bool,
}

/// Two listings of a tool are the same when the server said the same of it: `checked` is
/// compiled from `input_schema`. Every field is named, so a new one must be placed here.
impl PartialEq for McpTool {
    fn eq(&self, other: &Self) -> bool {
        let McpTool {
            name,
            description,
            input_schema,
            checked: _,
            annotated_idempotent,
        } = self;
        *name == other.name
            && *description == other.description
            && *input_schema == other.input_schema
            && *annotated_idempotent == other.annotated_idempotent
    }
}

/// Where a server stands.
#[derive(Clone)]
pub(crate) enum ServerState {
    Starting,
    Ready {
        server: Arc<Server>,
        tools: Arc<Vec<McpTool>>,
    },
    /// It could not start, or went away; the supervisor tries again after a backoff.
    Down {
        error: String,
    },
}

/// An MCP server as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub(crate) enum McpServerStatus {
    Starting,
    Ready {
        tools: usize,
    },
    /// Its tools are not offered; the supervisor tries again after a backoff.
    Down {
        error: String,
    },
}

/// A ready server as turns reach it.
pub(crate) struct Server {
    pub name: String,
    timeout: Duration,
    reach: Reach,
}

enum Reach {
    /// Over HTTP: one connection for every turn. The server is remote; what it keeps between
    /// calls is its own affair.
    Shared(Arc<Connection>),
    /// Over stdio: a process for each turn that calls it.
    PerTurn(Arc<Instances>),
}

/// How a stdio server's per-turn processes start, and how many may run at once.
struct Instances {
    settings: McpServerSettings,
    hidden: HiddenPaths,
    /// `max_instances` permits; a process holds one until it is stopped.
    slots: Arc<Semaphore>,
    max_instances: usize,
    /// The drain's token: it closes every process still running.
    drain: CancellationToken,
    /// The server's paces, which its listing connection shares.
    paces: ServerPaces,
}

/// A stdio server's process slots: `max` permits, each held by a running process.
struct Slots {
    permits: Arc<Semaphore>,
    max: Mutex<usize>,
}

impl Slots {
    fn new(max: usize) -> Slots {
        Slots {
            permits: Arc::new(Semaphore::new(max)),
            max: Mutex::new(max),
        }
    }

    /// Sets the bound to `max`. A larger one frees slots at once. A smaller one takes the
    /// slots it drops as processes stop: the semaphore is fair, so starts queue behind that
    /// (until `stop`, the drain).
    fn resize(&self, max: usize, tracker: &TaskTracker, stop: &CancellationToken) {
        let mut current = crate::locks::lock(&self.max);
        if max > *current {
            self.permits.add_permits(max - *current);
        } else if let Ok(fewer) = u32::try_from(*current - max)
            && fewer > 0
        {
            let permits = self.permits.clone();
            let stop = stop.clone();
            tracker.spawn(async move {
                tokio::select! {
                    taken = permits.acquire_many_owned(fewer) => {
                        if let Ok(taken) = taken {
                            taken.forget();
                        }
                    }
                    () = stop.cancelled() => {}
                }
            });
        }
        *current = max;
    }
}

/// One turn's own processes of stdio servers, by server name. Each is started at the turn's
/// first call to its server and stopped (its process group killed) when the turn ends and drops
/// this; no other turn, of this session or any other, ever reaches it.
#[derive(Default)]
pub(crate) struct TurnServers {
    started: tokio::sync::Mutex<HashMap<String, Arc<Instance>>>,
}

/// A turn's process of a server, holding its slot until it is stopped.
struct Instance {
    connection: Connection,
    // Declared after the connection: the slot is free only once the process is gone.
    _slot: OwnedSemaphorePermit,
}

/// A live connection to one server. Dropping the last reference stops the server.
pub(crate) struct Connection {
    peer: Peer<RoleClient>,
    /// Fires when the connection ends (the server exited or closed it).
    closed: CancellationToken,
    /// Cancels the client's service loop, which closes the transport.
    service: CancellationToken,
    /// A stdio server's process: dropping it stops the server and whatever it left running.
    _process: Option<Running>,
    timeout: Duration,
    /// An HTTP server's `url`, which may hold a token: never shown ([`without`]).
    url: Option<String>,
    /// Why agentgate cut the connection, if it did.
    cut_off: CutOff,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.service.cancel();
    }
}

/// How an MCP call ended, as the model sees it.
#[derive(Debug)]
pub(crate) enum CallOutcome {
    /// The server answered; `is_error` is the tool's own verdict.
    Answered { is_error: bool, text: String },
    /// No answer: the server went away, the call timed out, or the request failed.
    Failed(String),
}

impl CallOutcome {
    /// The `result` label of `agentgate_tool_calls_total`.
    pub(crate) fn result(&self) -> &'static str {
        match self {
            CallOutcome::Answered {
                is_error: false, ..
            } => "ok",
            CallOutcome::Answered { is_error: true, .. } | CallOutcome::Failed(_) => "error",
        }
    }

    /// The tool result recorded in the transcript.
    pub(crate) fn into_result(self, server: &str) -> String {
        match self {
            CallOutcome::Answered { is_error, text } => {
                serde_json::json!({"mcp_server": server, "is_error": is_error, "content": text})
                    .to_string()
            }
            CallOutcome::Failed(error) => format!("error: MCP server {server:?}: {error}"),
        }
    }
}

impl Server {
    /// How long one call may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Calls `tool` with `arguments` on this server: over its shared connection (HTTP), or on
    /// the process of `turn` (stdio), started at the turn's first call to it.
    pub(crate) async fn call(
        &self,
        turn: &TurnServers,
        tool: &str,
        arguments: &serde_json::Value,
        key: &str,
        traceparent: Option<String>,
    ) -> CallOutcome {
        match &self.reach {
            Reach::Shared(connection) => connection.call(tool, arguments, key, traceparent).await,
            Reach::PerTurn(instances) => match turn.instance(instances).await {
                Ok(instance) => {
                    let connection = &instance.connection;
                    connection.call(tool, arguments, key, traceparent).await
                }
                Err(why) => CallOutcome::Failed(why),
            },
        }
    }
}

impl TurnServers {
    /// The turn's process of the server of `instances`: the one it started, unless that one
    /// went away, else a new one.
    async fn instance(&self, instances: &Instances) -> Result<Arc<Instance>, String> {
        let name = &instances.settings.name;
        let mut started = self.started.lock().await;
        if let Some(instance) = started.get(name)
            && !instance.connection.closed.is_cancelled()
        {
            return Ok(instance.clone());
        }
        // One that went away is stopped (what it left running goes) before another starts.
        started.remove(name);
        let instance = Arc::new(instances.start().await?);
        started.insert(name.clone(), instance.clone());
        Ok(instance)
    }
}

impl Instances {
    /// Starts a process of the server for one turn, once one of its `max_instances` slots is
    /// free. A call that finds them all taken waits up to the server's `timeout`, then is
    /// refused; either way a warning and `agentgate_mcp_over_bound_total` say so.
    async fn start(&self) -> Result<Instance, String> {
        let name = &self.settings.name;
        let max = self.max_instances;
        let slot = match self.slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => {
                let wait = self.settings.timeout;
                tracing::warn!(
                    max_instances = max,
                    "MCP server {name}: all {max} of its processes (max_instances) run for other turns; the call waits up to {wait:?} for one to end"
                );
                let waited = tokio::time::timeout(wait, self.slots.clone().acquire_owned()).await;
                let Ok(Ok(slot)) = waited else {
                    crate::metrics::mcp_over_bound(name, OverBound::Refused);
                    tracing::warn!(
                        max_instances = max,
                        "MCP server {name}: the call was refused: no process of it ended within {wait:?}"
                    );
                    return Err(format!(
                        "not called: all {max} processes of the server (max_instances) run \
                         for other turns, and none ended within {wait:?}"
                    ));
                };
                crate::metrics::mcp_over_bound(name, OverBound::Waited);
                slot
            }
        };
        let opened = open(
            &self.settings,
            &self.hidden,
            self.drain.child_token(),
            Arc::new(Notify::new()),
            &self.paces,
        );
        let connection = tokio::time::timeout(STARTUP_TIMEOUT, opened)
            .await
            .unwrap_or_else(|_| Err(format!("it did not answer within {STARTUP_TIMEOUT:?}")))
            .map_err(|error| {
                tracing::warn!(error = %error,
                    "MCP server {name}: its process for this turn did not start; the call fails");
                format!("its process for this turn did not start: {error}")
            })?;
        Ok(Instance {
            connection,
            _slot: slot,
        })
    }
}

impl Connection {
    /// Why a call or a listing failed when the connection ended under it.
    fn went_away(&self) -> String {
        match self.cut_off.why() {
            Some(what) => format!("agentgate cut the server off: it {what}"),
            None => "the server went away".to_string(),
        }
    }

    /// Why a call failed when the connection ended under it.
    fn went_away_during_call(&self) -> String {
        format!(
            "{} during the call; its outcome is unknown",
            self.went_away()
        )
    }

    /// Calls `tool` with `arguments`, carrying `key` in `_meta`. Fails at once if the server
    /// goes away, and after the server's `timeout`.
    pub(crate) async fn call(
        &self,
        tool: &str,
        arguments: &serde_json::Value,
        key: &str,
        traceparent: Option<String>,
    ) -> CallOutcome {
        let mut params = CallToolRequestParams::new(tool.to_string());
        params.arguments = arguments.as_object().cloned();
        let mut meta = serde_json::Map::new();
        meta.insert(CALL_KEY_META.to_string(), key.into());
        if let Some(traceparent) = traceparent {
            // The call's span, as MCP's trace context convention carries it.
            meta.insert(
                crate::telemetry::TRACEPARENT.to_string(),
                traceparent.into(),
            );
        }
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
        tokio::select! {
            answer = self.peer.call_tool(params) => match answer {
                Ok(result) => CallOutcome::Answered {
                    is_error: result.is_error.unwrap_or(false),
                    text: result_text(&result),
                },
                // The connection ended first (the process exited, or sent what it may not):
                // the same as the arm below, whichever of the two is polled first.
                Err(rmcp::ServiceError::TransportClosed) => CallOutcome::Failed(self.went_away_during_call()),
                Err(err) => CallOutcome::Failed(without(
                    self.url.as_deref(),
                    format!("the call failed: {err}"),
                )),
            },
            () = self.closed.cancelled() => CallOutcome::Failed(self.went_away_during_call()),
            () = tokio::time::sleep(self.timeout) => CallOutcome::Failed(format!(
                "no answer within its timeout of {:?}; its outcome is unknown", self.timeout)),
        }
    }
}

/// The text of a `tools/call` result: its text blocks, a note for each block of another kind
/// (an image is no use to a text model), else its structured content; capped like a command
/// tool's output, and read only up to the cap (the blocks after it are not looked at).
fn result_text(result: &CallToolResult) -> String {
    let mut text = String::new();
    let mut cut = false;
    for (index, block) in result.content.iter().enumerate() {
        if text.len() > OUTPUT_CAP {
            cut = true;
            break;
        }
        if index > 0 {
            text.push('\n');
        }
        match block {
            ContentBlock::Text(content) => text.push_str(&content.text),
            ContentBlock::Resource(embedded) => match &embedded.resource {
                ResourceContents::TextResourceContents { text: resource, .. } => {
                    text.push_str(resource);
                }
                ResourceContents::BlobResourceContents { .. } | _ => {
                    text.push_str("[resource content omitted]");
                }
            },
            ContentBlock::ResourceLink(link) => {
                text.push_str(&format!("[resource link: {}]", link.uri));
            }
            ContentBlock::Image(_) => text.push_str("[image content omitted]"),
            ContentBlock::Audio(_) => text.push_str("[audio content omitted]"),
            // A kind of block the MCP SDK adds later.
            _ => text.push_str("[unknown content omitted]"),
        }
    }
    if result.content.is_empty()
        && let Some(structured) = &result.structured_content
    {
        text = structured.to_string();
    }
    crate::untrusted::tool_output(&text, cut, OUTPUT_CAP).0
}

/// Servers of protocol version 2026-07-28 and later announce a changed tool list only to a
/// `subscriptions/listen` subscriber; older ones send the notification to every client, and
/// `Listener` hears it. A server that does not know the method refuses it, which is fine.
async fn subscribe_to_tool_changes(peer: Peer<RoleClient>, tools_changed: Arc<Notify>) {
    let filter = SubscriptionFilter::builder().tools_list_changed().build();
    let Ok(mut subscription) = peer.listen(filter).await else {
        return;
    };
    while let Ok(Some(notification)) = subscription.next().await {
        if matches!(
            notification,
            ServerNotification::ToolListChangedNotification(_)
        ) {
            tools_changed.notify_one();
        }
    }
}

/// The client side's handler: it only listens for a changed tool list.
struct Listener {
    tools_changed: Arc<Notify>,
}

impl ClientHandler for Listener {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.tools_changed.notify_one();
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("agentgate", crate::VERSION),
        )
    }
}

/// Every configured server, each with its supervisor.
pub(crate) struct McpServers {
    servers: Mutex<HashMap<String, Supervised>>,
    /// Each stdio server's process slots, by name, kept while the daemon runs (one entry per
    /// name the configuration ever had).
    slots: Mutex<HashMap<String, Arc<Slots>>>,
    tracker: TaskTracker,
    /// The drain's token for background tasks: it stops every supervisor.
    stop: CancellationToken,
}

struct Supervised {
    settings: McpServerSettings,
    state: watch::Receiver<ServerState>,
    stop: CancellationToken,
}

impl McpServers {
    pub(crate) fn new(tracker: TaskTracker, stop: CancellationToken) -> McpServers {
        McpServers {
            servers: Mutex::new(HashMap::new()),
            slots: Mutex::new(HashMap::new()),
            tracker,
            stop,
        }
    }

    fn servers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Supervised>> {
        crate::locks::lock(&self.servers)
    }

    /// Starts the servers of `config` that are not running, stops those it no longer has, and
    /// restarts those whose settings changed. Turns keep the connections they hold.
    pub(crate) fn apply(&self, config: &BTreeMap<String, McpServerSettings>, hidden: &HiddenPaths) {
        let mut servers = self.servers();
        servers.retain(|name, supervised| {
            let keep = config.get(name) == Some(&supervised.settings);
            if !keep {
                supervised.stop.cancel();
            }
            keep
        });
        for (name, settings) in config {
            if servers.contains_key(name) {
                continue;
            }
            let (state, watcher) = watch::channel(ServerState::Starting);
            let stop = self.stop.child_token();
            let span = tracing::info_span!("mcp", mcp_server = %name);
            let paces = ServerPaces::default();
            let instances = match &settings.transport {
                McpTransport::Stdio { max_instances, .. } => Some(Arc::new(Instances {
                    settings: settings.clone(),
                    hidden: hidden.clone(),
                    slots: self.slots_of(name, *max_instances),
                    max_instances: *max_instances,
                    drain: self.stop.clone(),
                    paces: paces.clone(),
                })),
                McpTransport::Http { .. } => None,
            };
            let supervisor = Supervisor {
                settings: settings.clone(),
                hidden: hidden.clone(),
                instances,
                state,
                paces,
            };
            self.tracker
                .spawn(supervisor.run(stop.clone()).instrument(span));
            servers.insert(
                name.clone(),
                Supervised {
                    settings: settings.clone(),
                    state: watcher,
                    stop,
                },
            );
        }
    }

    /// The process slots of stdio server `name`, bounded to `max` from now on. A reload that
    /// replaces the server keeps them: the processes turns still hold count against the new
    /// bound, so a reload never lets more than `max_instances` run.
    fn slots_of(&self, name: &str, max: usize) -> Arc<Semaphore> {
        let mut slots = crate::locks::lock(&self.slots);
        let pool = slots
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(Slots::new(max)));
        pool.resize(max, &self.tracker, &self.stop);
        pool.permits.clone()
    }

    /// The server's connection and tools once it has started, waiting up to `wait` while it
    /// is starting; else why not.
    pub(crate) async fn ready(
        &self,
        name: &str,
        wait: Duration,
    ) -> Result<(Arc<Server>, Arc<Vec<McpTool>>), String> {
        let watcher = self.servers().get(name).map(|s| s.state.clone());
        let Some(mut watcher) = watcher else {
            return Err(format!("MCP server {name:?} is not configured"));
        };
        let settled = tokio::time::timeout(
            wait,
            watcher.wait_for(|state| !matches!(state, ServerState::Starting)),
        )
        .await;
        let state = match settled {
            Ok(Ok(state)) => state.clone(),
            Ok(Err(_)) => return Err(format!("MCP server {name:?} was stopped")),
            Err(_) => return Err(format!("MCP server {name:?} is still starting")),
        };
        match state {
            ServerState::Ready { server, tools } => Ok((server, tools)),
            ServerState::Down { error } => Err(format!("MCP server {name:?} is down: {error}")),
            ServerState::Starting => Err(format!("MCP server {name:?} is still starting")),
        }
    }

    /// Each server's state, for `status`.
    pub(crate) fn status(&self) -> BTreeMap<String, McpServerStatus> {
        self.servers()
            .iter()
            .map(|(name, supervised)| {
                let state = match &*supervised.state.borrow() {
                    ServerState::Starting => McpServerStatus::Starting,
                    ServerState::Ready { tools, .. } => {
                        McpServerStatus::Ready { tools: tools.len() }
                    }
                    ServerState::Down { error } => McpServerStatus::Down {
                        error: error.clone(),
                    },
                };
                (name.clone(), state)
            })
            .collect()
    }
}

/// One server's supervisor: what it starts the server with, and where it tells its state.
struct Supervisor {
    settings: McpServerSettings,
    hidden: HiddenPaths,
    /// A stdio server's per-turn processes; `None` over HTTP.
    instances: Option<Arc<Instances>>,
    state: watch::Sender<ServerState>,
    /// The server's paces, shared by all its connections.
    paces: ServerPaces,
}

impl Supervisor {
    /// Keeps the server connected until `stop`: connect, list its tools, serve them, and after
    /// the server goes away (or cannot start), try again after a backoff.
    async fn run(self, stop: CancellationToken) {
        let settings = &self.settings;
        let mut backoff = BACKOFF_FIRST;
        loop {
            self.state.send_replace(ServerState::Starting);
            let tools_changed = Arc::new(Notify::new());
            let started = Instant::now();
            let connecting = connect(settings, &self.hidden, tools_changed.clone(), &self.paces);
            let connected = tokio::select! {
                connected = tokio::time::timeout(STARTUP_TIMEOUT, connecting) => {
                    connected.unwrap_or_else(|_| Err(format!("it did not answer within {STARTUP_TIMEOUT:?}")))
                }
                () = stop.cancelled() => return,
            };
            let error = match connected {
                Ok((connection, tools)) => {
                    tracing::info!(
                        tools = tools.len(),
                        "MCP server {} is ready with {} tools",
                        settings.name,
                        tools.len()
                    );
                    let connection = Arc::new(connection);
                    let server = Arc::new(self.server(&connection));
                    self.state.send_replace(ServerState::Ready {
                        server: server.clone(),
                        tools: Arc::new(tools),
                    });
                    let served = self
                        .serve(&connection, &server, &tools_changed, &stop)
                        .await;
                    let Some(error) = served else {
                        // Stopped: close its stdin, give it a moment to exit, then the group goes.
                        connection.service.cancel();
                        let _ =
                            tokio::time::timeout(STOP_GRACE, connection.closed.cancelled()).await;
                        self.state.send_replace(ServerState::Down {
                            error: "stopped".to_string(),
                        });
                        return;
                    };
                    error
                }
                Err(error) => error,
            };
            if started.elapsed() > BACKOFF_LAST {
                backoff = BACKOFF_FIRST;
            }
            tracing::error!(
                error = %error,
                retry_in = ?backoff,
                "MCP server {} is down; its tools are not offered until it is back",
                settings.name
            );
            self.state.send_replace(ServerState::Down { error });
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = stop.cancelled() => return,
            }
            backoff = (backoff * 2).min(BACKOFF_LAST);
        }
    }

    /// The server as turns reach it once `connection` is up: through that connection (HTTP),
    /// or through processes of their own (stdio), never through the one that listed the tools.
    fn server(&self, connection: &Arc<Connection>) -> Server {
        let reach = match &self.instances {
            Some(instances) => Reach::PerTurn(instances.clone()),
            None => Reach::Shared(connection.clone()),
        };
        Server {
            name: self.settings.name.clone(),
            timeout: self.settings.timeout,
            reach,
        }
    }

    /// Serves a connected server until it goes away (`Some(why)`) or `stop` fires (`None`),
    /// re-listing its tools when it says they changed: at most once every [`RELIST_EVERY`],
    /// however often it says so (a server that says it without end costs a listing a second,
    /// and a line only when the tools did change).
    async fn serve(
        &self,
        connection: &Connection,
        server: &Arc<Server>,
        tools_changed: &Notify,
        stop: &CancellationToken,
    ) -> Option<String> {
        let name = &self.settings.name;
        // The tools were listed when the connection came up.
        let mut next_listing = tokio::time::Instant::now() + RELIST_EVERY;
        let mut failures = OneLineEvery::new(RELIST_FAILURE_LINE_EVERY);
        loop {
            tokio::select! {
                why = ended(connection, stop) => return why,
                () = tools_changed.notified() => {}
            }
            tokio::select! {
                why = ended(connection, stop) => return why,
                () = tokio::time::sleep_until(next_listing) => {}
            }
            next_listing = tokio::time::Instant::now() + RELIST_EVERY;
            let offered = self.offered();
            match list_tools(connection, offered.as_deref().map(Vec::as_slice)).await {
                Ok(tools) => {
                    if offered.is_none_or(|offered| *offered != tools) {
                        tracing::info!(tools = tools.len(), "MCP server {name} changed its tools");
                    }
                    self.state.send_replace(ServerState::Ready {
                        server: server.clone(),
                        tools: Arc::new(tools),
                    });
                }
                Err(error) => {
                    if let Some(left_out) = failures.due() {
                        tracing::warn!(error = %error, left_out,
                            "MCP server {name} said its tools changed, but cannot list them");
                    }
                }
            }
        }
    }

    /// The tools the server offers now, if it is ready.
    fn offered(&self) -> Option<Arc<Vec<McpTool>>> {
        match &*self.state.borrow() {
            ServerState::Ready { tools, .. } => Some(tools.clone()),
            ServerState::Starting | ServerState::Down { .. } => None,
        }
    }
}

/// `Some(why)` once the server's connection ends, `None` once `stop` fires.
async fn ended(connection: &Connection, stop: &CancellationToken) -> Option<String> {
    tokio::select! {
        () = connection.closed.cancelled() => {
            Some("the server closed the connection or exited".to_string())
        }
        () = stop.cancelled() => None,
    }
}

/// The most tools one server may list, and the most pages it may list them in: a server that
/// pages on and on, or lists without end, is not a catalog to offer a model.
const MAX_TOOLS: usize = 512;
const MAX_TOOL_PAGES: usize = 32;

/// The most JSON objects and arrays the input schemas of one server's tools may hold in all:
/// each is compiled into a validator of tens of times its size, and the tools are listed
/// again whenever the server says they changed.
const SCHEMA_OBJECTS_MAX: usize = super::mcp_bounds::CONTAINERS_MAX;

/// How many JSON objects and arrays `schema` holds, itself included.
fn objects_in(schema: &serde_json::Map<String, serde_json::Value>) -> usize {
    use serde_json::Value;
    let mut count = 1;
    let mut to_visit: Vec<&Value> = schema.values().collect();
    while let Some(value) = to_visit.pop() {
        match value {
            Value::Object(object) => {
                count += 1;
                to_visit.extend(object.values());
            }
            Value::Array(items) => {
                count += 1;
                to_visit.extend(items);
            }
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
        }
    }
    count
}

/// How long listing a server's tools may take, all pages together.
const LIST_TIMEOUT: Duration = Duration::from_secs(30);

/// The server's tools, every page of them, within [`MAX_TOOLS`], [`MAX_TOOL_PAGES`] and
/// [`LIST_TIMEOUT`]. A tool listed in `offered` with the same input schema keeps the validator
/// compiled then: a server that says its tools changed when they did not (or without end)
/// costs a listing, not a compilation of every schema.
async fn list_tools(
    connection: &Connection,
    offered: Option<&[McpTool]>,
) -> Result<Vec<McpTool>, String> {
    let peer = &connection.peer;
    let listing = async {
        let mut tools = Vec::new();
        let mut schema_objects = 0;
        let mut cursor = None;
        for _ in 0..MAX_TOOL_PAGES {
            let params = PaginatedRequestParams::default().with_cursor(cursor);
            let page = (peer.list_tools(Some(params)).await).map_err(|err| {
                if matches!(err, rmcp::ServiceError::TransportClosed) {
                    format!("tools/list failed: {}", connection.went_away())
                } else {
                    without(
                        connection.url.as_deref(),
                        format!("tools/list failed: {err}"),
                    )
                }
            })?;
            schema_objects += page
                .tools
                .iter()
                .map(|tool| objects_in(&tool.input_schema))
                .sum::<usize>();
            tools.extend(page.tools);
            if tools.len() > MAX_TOOLS {
                return Err(format!("it lists more than {MAX_TOOLS} tools"));
            }
            if schema_objects > SCHEMA_OBJECTS_MAX {
                return Err(format!(
                    "its tools' input schemas hold more than {SCHEMA_OBJECTS_MAX} JSON objects \
                     and arrays in all"
                ));
            }
            cursor = page.next_cursor;
            if cursor.is_none() {
                return Ok(tools);
            }
        }
        Err(format!(
            "it lists its tools in more than {MAX_TOOL_PAGES} pages"
        ))
    };
    // A connection that ends fails the listing at once: the SDK answers a request in flight
    // only once it has let the connection go, which a server that does not read delays.
    let tools = tokio::select! {
        listed = tokio::time::timeout(LIST_TIMEOUT, listing) => listed
            .map_err(|_| format!("tools/list did not end within {LIST_TIMEOUT:?}"))??,
        () = connection.closed.cancelled() => {
            return Err(format!("tools/list failed: {}", connection.went_away()));
        }
    };
    Ok(described(tools, offered))
}

/// `listed`, as the server described them, each with its input schema compiled: reused from
/// the tool of the same name in `offered` when its schema is the same.
fn described(listed: Vec<rmcp::model::Tool>, offered: Option<&[McpTool]>) -> Vec<McpTool> {
    let compiled: HashMap<&str, &McpTool> = offered
        .unwrap_or_default()
        .iter()
        .map(|tool| (tool.name.as_str(), tool))
        .collect();
    listed
        .into_iter()
        .map(|tool| {
            let annotations = tool.annotations.as_ref();
            let hint = |get: fn(&rmcp::model::ToolAnnotations) -> Option<bool>| {
                annotations.and_then(get).unwrap_or(false)
            };
            let read_only = hint(|a| a.read_only_hint);
            let idempotent = hint(|a| a.idempotent_hint);
            let destructive = hint(|a| a.destructive_hint);
            let input_schema = serde_json::Value::Object((*tool.input_schema).clone());
            let checked = match compiled.get(tool.name.as_ref()) {
                Some(offered) if offered.input_schema == input_schema => offered.checked.clone(),
                Some(_) | None => crate::schema::Parameters::compile(&input_schema),
            };
            McpTool {
                name: tool.name.to_string(),
                description: tool.description.as_deref().unwrap_or_default().to_string(),
                checked,
                input_schema,
                annotated_idempotent: read_only || (idempotent && !destructive),
            }
        })
        .collect()
}

/// Starts (stdio) or reaches (HTTP) the server and lists its tools; a changed list is told to
/// `tools_changed`.
async fn connect(
    settings: &McpServerSettings,
    hidden: &HiddenPaths,
    tools_changed: Arc<Notify>,
    paces: &ServerPaces,
) -> Result<(Connection, Vec<McpTool>), String> {
    let connection = open(
        settings,
        hidden,
        CancellationToken::new(),
        tools_changed.clone(),
        paces,
    )
    .await?;
    // A server that does not get as far as its tools is stopped with `connection`.
    let tools = list_tools(&connection, None).await?;
    // Ends with the connection: `next` fails once the transport is gone.
    tokio::spawn(
        subscribe_to_tool_changes(connection.peer.clone(), tools_changed).in_current_span(),
    );
    Ok((connection, tools))
}

/// Starts (stdio) or reaches (HTTP) the server and initializes the session with it; `service`
/// closes the connection when cancelled. What it reads goes through `paces`.
async fn open(
    settings: &McpServerSettings,
    hidden: &HiddenPaths,
    service: CancellationToken,
    tools_changed: Arc<Notify>,
    paces: &ServerPaces,
) -> Result<Connection, String> {
    let listener = Listener { tools_changed };
    let closed = CancellationToken::new();
    let cut_off = CutOff::new(&settings.name, closed.clone());
    let (running, process) = match &settings.transport {
        McpTransport::Stdio {
            command,
            env,
            cwd,
            sandbox,
            max_instances: _,
        } => {
            let Some(mut child) = Child::new(command) else {
                return Err("the command is empty".to_string());
            };
            for (name, value) in env {
                child = child.env(name, String::from_utf8_lossy(value.expose()).into_owned());
            }
            if let Some(cwd) = cwd {
                child = child.current_dir(cwd.clone());
            }
            let child = super::sandbox::confine(child, sandbox, hidden)
                .map_err(|not_confined| not_confined.to_string())?;
            tracing::info!(
                sandbox = super::sandbox::mechanism(sandbox),
                "starting the MCP server"
            );
            let started = child.start().await?;
            tokio::spawn(
                log_stderr(started.stderr, settings.name.clone(), paces.clone()).in_current_span(),
            );
            // A server that does not answer `initialize` is stopped with `started.running`.
            let output = bounded(started.stdout, cut_off.clone(), paces);
            let transport = AsyncRwTransport::new_client(output, started.stdin)
                .with_max_line_length(MESSAGE_MAX);
            let transport = Watched::new(transport, cut_off.clone());
            let running = serve_client_with_ct(listener, transport, service.clone())
                .await
                .map_err(|err| format!("initialize failed: {err}"))?;
            (running, Some(started.running))
        }
        McpTransport::Http { url, headers } => {
            let mut default_headers = http::HeaderMap::new();
            for (name, value) in headers {
                let name = http::HeaderName::from_bytes(name.as_bytes())
                    .map_err(|err| format!("header {name:?}: {err}"))?;
                let mut value = http::HeaderValue::from_bytes(value.expose())
                    .map_err(|_| format!("header {name}: the value is not a valid header value"))?;
                value.set_sensitive(true);
                default_headers.insert(name, value);
            }
            let client = crate::tls::http_client()?
                .default_headers(default_headers)
                .build()
                .map_err(|err| format!("cannot build the HTTP client: {err}"))?;
            let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
            config.max_json_response_size = MESSAGE_MAX;
            config.max_sse_event_size = MESSAGE_MAX;
            let transport = StreamableHttpClientTransport::with_client(
                super::mcp_http::TracedClient {
                    client,
                    paces: paces.clone(),
                },
                config,
            );
            let transport = Watched::new(transport, cut_off.clone());
            let running = serve_client_with_ct(listener, transport, service.clone())
                .await
                .map_err(|err| without(Some(url), format!("initialize failed: {err}")))?;
            (running, None)
        }
    };
    let peer = running.peer().clone();
    tokio::spawn(watch_service(running, closed.clone()));
    Ok(Connection {
        peer,
        closed,
        service,
        _process: process,
        cut_off,
        timeout: settings.timeout,
        url: match &settings.transport {
            McpTransport::Http { url, .. } => Some(url.clone()),
            McpTransport::Stdio { .. } => None,
        },
    })
}

/// `text` with `url` (as written, and as a URL library prints it) shown as scheme and host:
/// an error from the HTTP layer may repeat the URL of the request that failed.
fn without(url: Option<&str>, text: String) -> String {
    let Some(url) = url else {
        return text;
    };
    let shown = crate::config::redacted_url(url);
    let printed = url::Url::parse(url).map(String::from).unwrap_or_default();
    [url, printed.as_str()]
        .into_iter()
        .filter(|form| !form.is_empty())
        .fold(text, |text, form| text.replace(form, &shown))
}

/// Fires `closed` when the client's service loop ends.
async fn watch_service(running: RunningService<RoleClient, Listener>, closed: CancellationToken) {
    let _ = running.waiting().await;
    closed.cancel();
}

/// Logs what the server writes to stderr, a line at a time, each cut at `STDERR_LINE_CAP`, as
/// lines from outside: within `[runtime] event_log_max_per_second` of their own (so that they
/// never push out an event's own lines), the rest counted in
/// `agentgate_log_lines_skipped_total`. A server that writes without end costs neither memory
/// nor the journal's allowance, and is read at the server's stderr paces (`mcp_bounds.rs`): a
/// flood is slowed (the server waits on its stderr), not lost.
async fn log_stderr<R: tokio::io::AsyncRead + Unpin>(
    stderr: R,
    server: String,
    paces: ServerPaces,
) {
    let mut reader = BufReader::new(PacedRead::sharing(stderr, &paces.stderr_bytes));
    let mut lines = Paced::sharing(&paces.stderr_lines);
    while let Some(line) = read_capped_line(&mut reader, STDERR_LINE_CAP).await {
        crate::logging::event_line!(from_outside; stderr = %crate::untrusted::for_terminal(&line), "MCP server {server} says");
        lines.count(1);
        lines.ready().await;
    }
}

/// The next line of `reader` (without its newline), cut at `cap` bytes: the rest of a longer
/// line is read and dropped, never held. `None` at the end of the stream.
async fn read_capped_line<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
    cap: usize,
) -> Option<String> {
    let mut line: Vec<u8> = Vec::new();
    loop {
        let buffer = reader.fill_buf().await.ok()?;
        if buffer.is_empty() {
            return (!line.is_empty()).then(|| String::from_utf8_lossy(&line).into_owned());
        }
        let newline = buffer.iter().position(|byte| *byte == b'\n');
        let content = &buffer[..newline.unwrap_or(buffer.len())];
        let room = cap.saturating_sub(line.len());
        line.extend_from_slice(&content[..content.len().min(room)]);
        let used = newline.map_or(buffer.len(), |at| at + 1);
        reader.consume(used);
        if newline.is_some() {
            return Some(String::from_utf8_lossy(&line).into_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn listed(tools: serde_json::Value) -> Vec<rmcp::model::Tool> {
        serde_json::from_value(tools).expect("tools")
    }

    /// On the test's paused clock, which moves only when something waits: a line without end
    /// is read at the byte pace, and short lines at the line pace.
    #[tokio::test(start_paused = true)]
    async fn a_server_s_stderr_is_read_at_the_pace() {
        use crate::agent::mcp_bounds::{STDERR_BYTES_PER_SECOND, STDERR_LINES_PER_SECOND};
        use tokio::io::AsyncReadExt;
        let endless = tokio::io::repeat(b'x').take(3 * STDERR_BYTES_PER_SECOND);
        let started = tokio::time::Instant::now();
        log_stderr(endless, "test".to_string(), ServerPaces::default()).await;
        let took = started.elapsed().as_millis();
        assert!((1_998..=2_001).contains(&took), "{took} ms");

        let lines = tokio::io::repeat(b'\n').take(3 * STDERR_LINES_PER_SECOND);
        let started = tokio::time::Instant::now();
        log_stderr(lines, "test".to_string(), ServerPaces::default()).await;
        let took = started.elapsed().as_millis();
        assert!((1_998..=2_001).contains(&took), "{took} ms");
    }

    /// A listing again (the server said its tools changed) compiles only the schemas that did
    /// change: a server that says so without end costs no compilation.
    #[test]
    fn a_tool_listed_again_with_the_same_schema_keeps_its_compiled_schema() {
        let object = json!({"type": "object"});
        let first = described(
            listed(json!([
                {"name": "kept", "inputSchema": object},
                {"name": "changed", "inputSchema": object},
            ])),
            None,
        );
        let strict = json!({"type": "object", "required": ["path"]});
        let again = described(
            listed(json!([
                {"name": "kept", "inputSchema": object, "description": "now described"},
                {"name": "changed", "inputSchema": strict},
                {"name": "new", "inputSchema": object},
            ])),
            Some(&first),
        );
        assert!(again[0].checked.is(&first[0].checked));
        assert!(!again[1].checked.is(&first[1].checked));
        assert!(again[1].checked.validate(&json!({})).is_err());
        assert!(!again[2].checked.is(&first[0].checked));
    }

    /// An error's text never shows an HTTP server's URL, as written or as a URL library
    /// prints it (here with a default port it leaves out and a path it normalizes).
    #[test]
    fn errors_show_a_server_s_url_as_scheme_and_host() {
        let url = "HTTPS://Host.example:443/s3cr3t/../mcp?token=t0ken";
        let printed = url::Url::parse(url).map(String::from).unwrap_or_default();
        assert_ne!(printed, url);
        for text in [format!("for url ({url})"), format!("for url ({printed})")] {
            let shown = without(Some(url), text);
            assert!(
                !shown.contains("t0ken") && !shown.contains("mcp?"),
                "{shown}"
            );
            assert!(shown.contains("https://host.example/"), "{shown}");
        }
        assert_eq!(without(None, "as is".into()), "as is");
    }

    #[test]
    fn text_blocks_are_joined_and_other_kinds_noted() {
        let result = json!({"content": [
            {"type": "text", "text": "one"},
            {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            {"type": "text", "text": "two"},
        ]});
        assert_eq!(
            result_text(&typed(result)),
            "one\n[image content omitted]\ntwo"
        );
    }

    #[test]
    fn structured_content_is_used_when_there_is_no_block() {
        let result = json!({"content": [], "structuredContent": {"temperature": 21}});
        assert_eq!(result_text(&typed(result)), r#"{"temperature":21}"#);
    }

    fn typed(result: serde_json::Value) -> CallToolResult {
        serde_json::from_value(result).unwrap_or_else(|err| panic!("a result: {err}"))
    }

    #[test]
    fn a_result_of_many_blocks_is_read_up_to_the_cap() {
        let blocks = vec![json!({"type": "text", "text": ""}); 200_000];
        let text = result_text(&typed(json!({"content": blocks})));
        assert!(text.len() < OUTPUT_CAP + 100, "{}", text.len());
        assert!(text.ends_with(&format!("[output truncated at {OUTPUT_CAP} bytes]")));
    }

    #[test]
    fn long_results_are_capped_and_marked() {
        let result = json!({"content": [{"type": "text", "text": "é".repeat(OUTPUT_CAP)}]});
        let text = result_text(&typed(result));
        assert!(text.len() < OUTPUT_CAP + 100);
        assert!(text.ends_with(&format!("[output truncated at {OUTPUT_CAP} bytes]")));
    }

    #[tokio::test]
    async fn a_line_without_end_is_cut_and_never_held() {
        use tokio::io::AsyncReadExt;
        let endless = tokio::io::repeat(b'x').take(8 * 1024 * 1024);
        let input = endless.chain(&b"\nnext\n"[..]);
        let mut reader = BufReader::new(input);
        let first = read_capped_line(&mut reader, 512).await;
        assert_eq!(first.map(|line| line.len()), Some(512));
        assert_eq!(
            read_capped_line(&mut reader, 512).await.as_deref(),
            Some("next")
        );
        assert_eq!(read_capped_line(&mut reader, 512).await, None);
    }
}
