//! The command line: parsing (clap), dispatch, and exit statuses.
//!
//! Commands that inspect state (`status`, `sessions`, `ledger`) read the state directory directly,
//! so they work whether or not the daemon runs.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::{self, ConfigError, ConfigSource, LocatedFinding, SecretCheck, Severity};
use crate::exit::Failure;
use crate::ingress::verify;
use crate::lifecycle::{self, journal};
use crate::store::NodeState;
use crate::store::{self, DaemonLock, StatusSummary, Store, StoreError};

#[derive(Debug, Parser)]
#[command(
    name = "agentgate",
    version,
    about = "Turns webhooks into durable AI-agent work",
    long_about = "agentgate accepts webhooks on a systemd-held socket, makes each event durable before \
                  acknowledging it, runs it as a turn of an agent session, and delivers the result. \
                  Interrupted turns resume on the next start."
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct ConfigArg {
    /// Config file [default: $AGENTGATE_CONFIG, else /etc/agentgate/agentgate.toml]
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
}

impl ConfigArg {
    fn source(&self) -> ConfigSource {
        ConfigSource::resolve(self.config.as_deref())
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon in the foreground (under systemd: Type=notify)
    Serve {
        #[command(flatten)]
        config: ConfigArg,
        /// Append every model reply to this cassette file (replay it with backend = "replay")
        #[arg(long, value_name = "CASSETTE")]
        record: Option<PathBuf>,
    },
    /// Repair the state directory before a start
    Reconcile {
        #[command(flatten)]
        config: ConfigArg,
        /// Print what would be done and change nothing
        #[arg(long)]
        dry_run: bool,
    },
    /// Validate the config, print findings, exit 0 or 78
    CheckConfig(ConfigArg),
    /// Summarize the daemon and its state
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// List, show, resume or suspend sessions
    #[command(subcommand)]
    Sessions(SessionsCommand),
    /// Inspect the retry ledger
    #[command(subcommand)]
    Ledger(LedgerCommand),
    /// Generate the man page or shell completions (used by the package build)
    #[command(subcommand, hide = true)]
    Generate(GenerateCommand),
    /// Sign a payload the way ROUTE verifies it and POST it
    Send {
        #[command(flatten)]
        config: ConfigArg,
        /// The route name (a key under [routes])
        route: String,
        /// JSON payload, or @FILE to read it from a file [default: {}]
        #[arg(long, value_name = "JSON|@FILE")]
        data: Option<String>,
        /// Base URL of the listener [default: http://<server.listen>]
        #[arg(long, value_name = "BASE")]
        url: Option<String>,
        /// Delivery id to send [default: a new one]
        #[arg(long, value_name = "ID")]
        delivery_id: Option<String>,
        /// Event type header for schemes that carry one [default: the route's first `events` entry]
        #[arg(long, value_name = "TYPE")]
        event_type: Option<String>,
    },
}

/// Files generated from this command-line definition, for packaging.
#[derive(Debug, Subcommand)]
enum GenerateCommand {
    /// agentgate(1) and a page per subcommand (agentgate-serve(1), ...), written into DIR
    Manpages { dir: PathBuf },
    /// Shell completions on stdout
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
enum SessionsCommand {
    /// List sessions with state, last turn and attempts
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
    /// Show a session and its transcript
    Show {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
        #[arg(long)]
        json: bool,
    },
    /// Clear the session's ledger entry and queue it again
    Resume {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
    },
    /// Stop the session
    Suspend {
        #[command(flatten)]
        config: ConfigArg,
        key: String,
    },
}

#[derive(Debug, Subcommand)]
enum LedgerCommand {
    /// Print the retry ledger
    Show {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
}

/// Parses the command line, runs the command, and maps the outcome to an exit status.
pub(crate) fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return ExitCode::from(if err.use_stderr() { 2 } else { 0 });
        }
    };
    let target = match cli.command {
        Command::Serve { .. } | Command::Reconcile { dry_run: false, .. } => {
            journal::LogTarget::Daemon
        }
        _ => journal::LogTarget::Terminal,
    };
    journal::init(target);
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("agentgate: {failure}");
            ExitCode::from(failure.code)
        }
    }
}

fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Serve { config, record } => lifecycle::serve(&config.source(), record.as_deref()),
        Command::CheckConfig(config) => check_config(&config.source()),
        Command::Status { config, json } => status(&config.source(), json),
        Command::Send {
            config,
            route,
            data,
            url,
            delivery_id,
            event_type,
        } => send(
            &config.source(),
            &SendRequest {
                route,
                data,
                url,
                delivery_id,
                event_type,
            },
        ),
        Command::Reconcile { config, dry_run } => crate::reconcile::run(&config.source(), dry_run),
        Command::Sessions(SessionsCommand::List { config, json }) => {
            sessions_list(&config.source(), json)
        }
        Command::Sessions(SessionsCommand::Show { config, key, json }) => {
            sessions_show(&config.source(), &key, json)
        }
        Command::Sessions(SessionsCommand::Resume { config, key }) => {
            operator_override(&config.source(), &key, Override::Resume)
        }
        Command::Sessions(SessionsCommand::Suspend { config, key }) => {
            operator_override(&config.source(), &key, Override::Suspend)
        }
        Command::Ledger(LedgerCommand::Show { config, json }) => {
            ledger_show(&config.source(), json)
        }
        Command::Generate(what) => generate(what),
    }
}

fn generate(what: GenerateCommand) -> Result<(), Failure> {
    use clap::CommandFactory;
    let mut command = Cli::command();
    let mut stdout = std::io::stdout();
    match what {
        GenerateCommand::Manpages { dir } => {
            clap_mangen::generate_to(command, &dir).map_err(|err| {
                Failure::runtime(format!(
                    "cannot write man pages into {}: {err}",
                    dir.display()
                ))
            })
        }
        GenerateCommand::Completions { shell } => {
            clap_complete::generate(shell, &mut command, "agentgate", &mut stdout);
            Ok(())
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Override {
    Resume,
    Suspend,
}

fn operator_override(source: &ConfigSource, key: &str, what: Override) -> Result<(), Failure> {
    let state = StateAccess::open(source)?;
    let before = state
        .query(async |store| match what {
            Override::Resume => store.operator_resume(key).await,
            Override::Suspend => store.operator_suspend(key).await,
        })?
        .flatten()
        .ok_or_else(|| Failure::runtime(format!("no session {key:?}")))?;
    store::StateDir::new(&state.state_dir)
        .restore_ownership()
        .map_err(|err| {
            Failure::state(format!(
                "{}: cannot restore ownership: {err}",
                state.state_dir.display()
            ))
        })?;
    match what {
        Override::Resume => {
            println!("session {key}: resumed (was {before}); its ledger entry is cleared");
        }
        Override::Suspend => println!("session {key}: suspended (was {before})"),
    }
    Ok(())
}

fn ledger_show(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let ledger = StateAccess::open(source)?
        .query(async |store| store.resume_ledger().await)?
        .unwrap_or_default();
    if json {
        print!("{}", String::from_utf8_lossy(&ledger.to_json()));
        return Ok(());
    }
    println!("{:<48} {:>8}  LAST ATTEMPT", "SESSION", "ATTEMPTS");
    for (key, entry) in &ledger.sessions {
        println!("{key:<48} {:>8}  {}", entry.attempts, entry.last_attempt);
    }
    Ok(())
}

fn check_config(source: &ConfigSource) -> Result<(), Failure> {
    match config::load(source, SecretCheck::CredentialsOptional) {
        Ok(loaded) => {
            for finding in &loaded.warnings {
                println!("{}", LocatedFinding { source, finding });
            }
            println!(
                "{source}: ok ({} route(s), {} tool(s), {} warning(s))",
                loaded.config.routes.len(),
                loaded.config.tools.len(),
                loaded.warnings.len()
            );
            Ok(())
        }
        Err(ConfigError::Invalid {
            source_name,
            findings,
        }) => {
            for finding in &findings {
                println!(
                    "{}",
                    LocatedFinding {
                        source: &source_name,
                        finding
                    }
                );
            }
            let errors = findings
                .iter()
                .filter(|f| f.severity == Severity::Error)
                .count();
            Err(Failure::config(format!(
                "{source_name}: {errors} error(s); not usable"
            )))
        }
        Err(err) => Err(Failure::config(err)),
    }
}

/// Operator access to the configured store, opened as it is: a missing SQLite database is
/// "nothing stored yet", never created by a command that only looks.
struct StateAccess {
    state_dir: PathBuf,
    store: Option<Store>,
    runtime: tokio::runtime::Runtime,
}

impl StateAccess {
    fn open(source: &ConfigSource) -> Result<StateAccess, Failure> {
        let (state_dir, settings) = config::state_location(source).map_err(Failure::config)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|err| Failure::runtime(format!("cannot start the async runtime: {err}")))?;
        let store = runtime
            .block_on(Store::attach(&settings, &state_dir))
            .map_err(Failure::from)?;
        Ok(StateAccess {
            state_dir,
            store,
            runtime,
        })
    }

    /// Runs `query` on the store; `None` when nothing is stored yet.
    fn query<T>(
        &self,
        query: impl AsyncFnOnce(&Store) -> Result<T, StoreError>,
    ) -> Result<Option<T>, Failure> {
        let Some(store) = &self.store else {
            return Ok(None);
        };
        self.runtime
            .block_on(query(store))
            .map(Some)
            .map_err(Failure::from)
    }
}

fn status(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let state = StateAccess::open(source)?;
    let summary = state
        .query(async |store| store.status_summary().await)?
        .unwrap_or_default();
    let running = DaemonLock::is_held(&state.state_dir)
        || summary
            .nodes
            .iter()
            .flatten()
            .any(|node| node.state == NodeState::Running);
    // The ledger as the next resume will see it: a malformed one blocks every resume.
    let ledger = match state.query(async |store| store.resume_ledger().await) {
        Ok(ledger) => serde_json::json!({
            "sessions": ledger.map_or(0, |ledger| ledger.sessions.len()),
            "valid": true
        }),
        Err(err) => serde_json::json!({"valid": false, "error": err.to_string()}),
    };
    if json {
        let document = serde_json::json!({
            "daemon": {"running": running},
            "state_dir": state.state_dir,
            "events": summary.events,
            "sessions": summary.sessions,
            "deliveries": summary.deliveries,
            "ledger": ledger,
            "nodes": summary.nodes,
        });
        println!("{document:#}");
    } else {
        print!("{}", render_status(&state.state_dir, running, &summary));
        match ledger["valid"].as_bool() {
            Some(true) => println!(
                "ledger:     {} session(s) with resume counts",
                ledger["sessions"]
            ),
            _ => println!(
                "ledger:     UNUSABLE, no resume is dispatched: {}",
                ledger["error"].as_str().unwrap_or("")
            ),
        }
        for node in summary.nodes.iter().flatten() {
            println!(
                "node:       {} ({}, pid {}, {}) leases: {}",
                node.name,
                node.id,
                node.pid,
                node.state,
                if node.leases.is_empty() {
                    "none".to_string()
                } else {
                    node.leases.join(", ")
                }
            );
        }
    }
    Ok(())
}

fn render_status(state_dir: &Path, running: bool, summary: &StatusSummary) -> String {
    let breakdown = |counts: &std::collections::BTreeMap<String, i64>| {
        counts
            .iter()
            .map(|(name, n)| format!("{name} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "daemon:     {}\nstate:      {}\nevents:     {} total ({})\nsessions:   {} total ({})\ndeliveries: {} pending, {} failed\n",
        if running { "running" } else { "not running" },
        state_dir.display(),
        summary.events.total,
        breakdown(&summary.events.by_status),
        summary.sessions.total,
        breakdown(&summary.sessions.by_state),
        summary.deliveries.pending,
        summary.deliveries.failed,
    )
}

fn sessions_list(source: &ConfigSource, json: bool) -> Result<(), Failure> {
    let sessions = StateAccess::open(source)?
        .query(async |store| store.sessions().await)?
        .unwrap_or_default();
    if json {
        println!("{:#}", serde_json::json!(sessions));
        return Ok(());
    }
    println!(
        "{:<40} {:<16} {:<15} {:>5} {:>6}  LAST TURN",
        "SESSION", "ROUTE", "STATE", "TURNS", "QUEUED"
    );
    for s in sessions {
        println!(
            "{:<40} {:<16} {:<15} {:>5} {:>6}  {}",
            s.key,
            s.route,
            s.state,
            s.turns,
            s.queued,
            s.last_turn_status.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

fn sessions_show(source: &ConfigSource, key: &str, json: bool) -> Result<(), Failure> {
    let found = StateAccess::open(source)?
        .query(async |store| Ok((store.session(key).await?, store.transcript(key).await?)))?;
    let Some((Some(session), transcript)) = found else {
        return Err(Failure::runtime(format!("no session {key:?}")));
    };
    if json {
        println!(
            "{:#}",
            serde_json::json!({"session": session, "transcript": transcript})
        );
        return Ok(());
    }
    println!(
        "session {}  route {}  state {}{}  turns {}",
        session.key,
        session.route,
        session.state,
        session
            .reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default(),
        session.turns
    );
    for row in transcript {
        println!("{}", render_entry(&row.body));
    }
    Ok(())
}

/// One transcript entry as a readable block: who said what, which tool ran with what.
fn render_entry(body: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
    match body["kind"].as_str() {
        Some("tool_start") => format!(
            "  -> tool {} {} [{}]",
            text(&body["name"]),
            body["arguments"],
            text(&body["call_id"])
        ),
        Some("message") => {
            let message = &body["message"];
            let role = text(&message["role"]);
            let mut block = match role.as_str() {
                "tool" => format!(
                    "  <- tool result [{}]: {}",
                    text(&message["tool_call_id"]),
                    text(&message["content"])
                ),
                _ => format!("{role}: {}", text(&message["content"])),
            };
            for call in message["tool_calls"].as_array().into_iter().flatten() {
                block.push_str(&format!(
                    "\n  assistant calls {}({}) [{}]",
                    text(&call["function"]["name"]),
                    text(&call["function"]["arguments"]),
                    text(&call["id"])
                ));
            }
            block
        }
        _ => body.to_string(),
    }
}

struct SendRequest {
    route: String,
    data: Option<String>,
    url: Option<String>,
    delivery_id: Option<String>,
    event_type: Option<String>,
}

fn send(source: &ConfigSource, request: &SendRequest) -> Result<(), Failure> {
    let config = lifecycle::load_config(source, SecretCheck::Required)?.config;
    let route = config
        .routes
        .iter()
        .find(|r| r.name == request.route)
        .ok_or_else(|| {
            let known: Vec<_> = config.routes.iter().map(|r| r.name.as_str()).collect();
            Failure::config(format!(
                "no route {:?} in {source} (routes: {})",
                request.route,
                known.join(", ")
            ))
        })?;
    let body = match request.data.as_deref() {
        None => b"{}".to_vec(),
        Some(data) => match data.strip_prefix('@') {
            Some(path) => std::fs::read(path)
                .map_err(|err| Failure::runtime(format!("--data @{path}: {err}")))?,
            None => data.as_bytes().to_vec(),
        },
    };
    let base = request
        .url
        .clone()
        .unwrap_or_else(|| format!("http://{}", config.server.listen));
    let url = format!("{}{}", base.trim_end_matches('/'), route.path);
    let delivery_id = request
        .delivery_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut builder = http::Request::post(&url)
        .header("content-type", "application/json")
        .header("idempotency-key", &delivery_id);
    for (name, value) in verify::sign(&route.verify, &body, now, &delivery_id) {
        builder = builder.header(name, value);
    }
    let event_type = request
        .event_type
        .clone()
        .or_else(|| route.events.as_ref().and_then(|e| e.first().cloned()));
    if let (Some(header), Some(event_type)) =
        (verify::event_type_header(route.verify.scheme), event_type)
    {
        builder = builder.header(header, event_type);
    }
    let http_request = builder
        .body(Full::new(Bytes::from(body)))
        .map_err(|err| Failure::config(format!("--url {base}: {err}")))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| Failure::runtime(format!("cannot start the async runtime: {err}")))?;
    let (status, text) = runtime.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let response = client
            .request(http_request)
            .await
            .map_err(|err| Failure::unavailable(format!("POST {url}: {err}")))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|err| Failure::unavailable(format!("POST {url}: reading the answer: {err}")))?
            .to_bytes();
        Ok::<_, Failure>((status, String::from_utf8_lossy(&bytes).into_owned()))
    })?;
    println!("{} {}", status.as_u16(), text.trim_end());
    if status.is_success() {
        Ok(())
    } else {
        Err(Failure::runtime(format!(
            "POST {url} answered {}",
            status.as_u16()
        )))
    }
}
