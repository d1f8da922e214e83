//! `agentgate what-if` against the real binary: events recorded by a serving daemon are run again
//! under another config with a stub model, and nothing runs, is written or is delivered.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::stub::{Received, Reply, Stub};
use common::*;
use serde_json::{Value, json};

const TURN_LIMIT: Duration = Duration::from_secs(30);
const BRIEF: &str = "Be brief.";

/// The tool messages of a model request.
fn tool_results(request: &Received) -> Vec<String> {
    request.json()["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or("").to_string())
        .collect()
}

fn system_text(request: &Received) -> String {
    request.json()["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// A model that looks up the host named in the event, then answers; told to be brief, it also
/// looks up db-2 and asks for a restart (a gated tool) before a shorter answer. Offered the MCP
/// tool `web__shout`, it calls that after the lookup.
fn model() -> Stub {
    Stub::start(|request, _| {
        let results = tool_results(request).len();
        let brief = system_text(request).contains(BRIEF);
        let offers_shout = request.json()["tools"]
            .as_array()
            .is_some_and(|tools| tools.iter().any(|t| t["function"]["name"] == "web__shout"));
        let reply = match (brief, results) {
            (_, 0) => Reply::tool_call("c1", "lookup", json!({"host": "db-1"})),
            (_, 1) if offers_shout => Reply::tool_call("c4", "web__shout", json!({"text": "hi"})),
            (false, _) => Reply::answer("db-1: the disk is full of old WAL segments."),
            (true, 1) => Reply::tool_call("c2", "lookup", json!({"host": "db-2"})),
            (true, 2) => Reply::tool_call("c3", "restart", json!({"service": "postgres"})),
            (true, _) => Reply::answer("Disk full."),
        };
        reply.with_usage(100, 0, 10)
    })
}

struct Setup {
    workspace: Workspace,
    model: Stub,
    _receiver: Stub,
    daemon: Daemon,
}

impl Setup {
    fn start() -> Setup {
        let workspace = Workspace::new();
        let model = model();
        let receiver = Stub::start(|_, _| Reply::raw(204, ""));
        let runs = workspace.path().join("runs.log");
        workspace.write_config(&format!(
            r#"[runtime]
max_turn_steps = 6

[model]
backend = "openai"
base_url = "{model}/v1"
model = "stub-model"
request_timeout = "5s"
max_retries = 0
price = {{ input_per_mtok = 1.0, cached_input_per_mtok = 0.5, output_per_mtok = 2.0 }}

[tools.lookup]
description = "Look a host up"
command = ["/bin/sh", "-c", "cat >> {runs}; echo >> {runs}; echo looked-up"]
parameters = {{ type = "object", properties = {{ host = {{ type = "string" }} }}, required = ["host"] }}
sandbox = "none"

[tools.restart]
description = "Restart a service"
command = ["/bin/sh", "-c", "cat >> {runs}; echo >> {runs}; echo restarted"]
parameters = {{ type = "object", properties = {{ service = {{ type = "string" }} }}, required = ["service"] }}
approval = true
sandbox = "none"

[routes.alerts]
path = "/hooks/alerts"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
system = "You investigate alerts."
tools = ["lookup", "restart"]
deliver = {{ kind = "http", url = "{receiver}/results" }}
"#,
            model = model.url(),
            receiver = receiver.url(),
            runs = runs.display(),
        ));
        let daemon = workspace.start();
        Setup {
            workspace,
            model,
            _receiver: receiver,
            daemon,
        }
    }

    /// Posts an event of `session` and waits until its turn completed.
    fn event(&self, session: &str) -> String {
        let response = self.daemon.post_json(
            "/hooks/alerts",
            &[],
            &json!({"session": session, "alert": "disk full"}).to_string(),
        );
        assert_eq!(response.status, 202, "{response:?}");
        let id = response.event_id();
        assert_eq!(self.workspace.wait_terminal(&id, TURN_LIMIT), "completed");
        wait_until("the delivery", TURN_LIMIT, || {
            let sql = format!("SELECT status FROM deliveries WHERE event_id = '{id}'");
            self.workspace.query(&sql, |row| row.get::<_, String>(0)) == ["delivered"]
        });
        id
    }

    /// The tool runs logged so far.
    fn tool_runs(&self) -> usize {
        std::fs::read_to_string(self.workspace.path().join("runs.log"))
            .map(|text| text.lines().filter(|line| !line.is_empty()).count())
            .unwrap_or(0)
    }

    /// Writes the config to try: the live one, with `system` changed by `edit`.
    fn new_config(&self, edit: impl Fn(&str) -> String) -> std::path::PathBuf {
        let live = std::fs::read_to_string(self.workspace.config_path()).expect("the config");
        let path = self.workspace.path().join("new.toml");
        std::fs::write(&path, edit(&live)).expect("write the new config");
        path
    }

    /// `agentgate what-if --config NEW ARGS`, the live config in `$AGENTGATE_CONFIG`.
    fn what_if(&self, new: &std::path::Path, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("what-if")
            .arg("--config")
            .arg(new)
            .args(args)
            .env("AGENTGATE_CONFIG", self.workspace.config_path())
            .env_remove("NOTIFY_SOCKET")
            .output()
            .expect("run agentgate what-if")
    }

    /// The bytes of the live database and its write-ahead log.
    fn state_bytes(&self) -> Vec<Vec<u8>> {
        ["agentgate.db", "agentgate.db-wal"]
            .iter()
            .map(|name| std::fs::read(self.workspace.state_dir().join(name)).unwrap_or_default())
            .collect()
    }
}

fn brief(live: &str) -> String {
    live.replace(
        "system = \"You investigate alerts.\"",
        &format!("system = \"You investigate alerts. {BRIEF}\""),
    )
}

fn json_of(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|err| panic!("what-if --json prints JSON ({err}): {output:?}"))
}

fn calls(run: &Value) -> Vec<(String, Value, String)> {
    run["tool_calls"]
        .as_array()
        .expect("tool_calls")
        .iter()
        .map(|call| {
            (
                call["name"].as_str().unwrap_or("").to_string(),
                call["arguments"].clone(),
                call["result"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

#[test]
fn a_changed_prompt_is_compared_without_running_tools_or_writing_state() {
    let setup = Setup::start();
    let event_id = setup.event("db-1");
    assert_eq!(setup.tool_runs(), 1);
    let recorded_requests = setup.model.requests().len();
    let new = setup.new_config(brief);
    let before = setup.state_bytes();

    let output = setup.what_if(&new, &["--event", &event_id, "--json"]);
    assert!(output.status.success(), "{output:?}");
    let report = json_of(&output);

    // No tool process started, and the live state is as it was while the daemon serves.
    assert_eq!(setup.tool_runs(), 1, "what-if ran a tool");
    let after = setup.state_bytes();
    assert!(after[0] == before[0], "what-if changed the live database");
    assert!(
        after[1] == before[1],
        "what-if changed the live database's log"
    );
    let health = try_request(setup.workspace.addr(), "GET", "/healthz", &[], b"");
    assert!(
        health.is_ok_and(|r| r.status == 200),
        "the daemon stopped serving"
    );

    let event = &report["events"][0];
    assert_eq!(event["event_id"], event_id.as_str());
    assert_eq!(event["changed"], true);
    let (recorded, rerun) = (&event["recorded"], &event["new"]);
    assert_eq!(recorded["status"], "completed");
    assert_eq!(
        recorded["answer"],
        "db-1: the disk is full of old WAL segments."
    );
    assert_eq!(
        calls(recorded),
        [("lookup".into(), json!({"host": "db-1"}), "ran".into())]
    );
    assert_eq!(recorded["steps"], 2);
    assert_eq!(recorded["usage"]["input_tokens"], 200);
    assert_eq!(rerun["status"], "completed");
    assert_eq!(rerun["answer"], "Disk full.");
    assert_eq!(
        calls(rerun),
        [
            ("lookup".into(), json!({"host": "db-1"}), "recorded".into()),
            ("lookup".into(), json!({"host": "db-2"}), "not_run".into()),
            (
                "restart".into(),
                json!({"service": "postgres"}),
                "not_run".into()
            ),
        ]
    );
    assert_eq!(rerun["steps"], 4);
    assert_eq!(rerun["usage"]["output_tokens"], 40);
    let summary = &report["summary"];
    assert_eq!(summary["events"], 1);
    assert_eq!(summary["changed"], 1);
    assert_eq!(summary["calls_not_run"], 2);
    assert_eq!(summary["tokens_delta"], 220);
    let cost = summary["cost_delta_usd"].as_f64().expect("a cost delta");
    assert!((cost - 0.00024).abs() < 1e-9, "{cost}");

    // The model got the recorded result of the same call, and was told the others did not run.
    let requests = setup.model.requests();
    let last = requests.last().expect("what-if asked the model");
    assert!(system_text(last).contains(BRIEF));
    let results = tool_results(last);
    let recorded_result = tool_results(&requests[recorded_requests - 1]);
    assert_eq!(results[0], recorded_result[0]);
    assert!(results[0].contains("looked-up"), "{results:?}");
    for result in &results[1..] {
        assert!(
            result.contains("not run") && result.contains("unknown"),
            "{result}"
        );
    }

    text_report_and_exit(&setup, &new, &event_id);
    saved_report_in_the_console(&setup, &new, &event_id, &before[0]);
}

/// The text report shows the diff and what would have been called; `--fail-on-change` exits 1.
fn text_report_and_exit(setup: &Setup, new: &std::path::Path, event_id: &str) {
    let text = setup.what_if(new, &["--event", event_id, "--fail-on-change"]);
    assert_eq!(text.status.code(), Some(1), "{text:?}");
    let shown = String::from_utf8_lossy(&text.stdout);
    assert!(shown.contains("- db-1: the disk is full"), "{shown}");
    assert!(shown.contains("+ Disk full."), "{shown}");
    assert!(
        shown.contains(r#"would call lookup with {"host":"db-2"}"#),
        "{shown}"
    );
    assert!(
        shown.contains("1 event(s) under")
            && shown.contains("1 changed (1 answer(s)), 2 call(s) not run, tokens +220"),
        "{shown}"
    );
    assert_eq!(setup.tool_runs(), 1);
}

/// `--save` keeps the report beside the database, and the console lists and shows it.
fn saved_report_in_the_console(
    setup: &Setup,
    new: &std::path::Path,
    event_id: &str,
    database: &[u8],
) {
    let saved = setup.what_if(new, &["--event", event_id, "--save"]);
    assert!(saved.status.success(), "{saved:?}");
    let names: Vec<String> = std::fs::read_dir(setup.workspace.state_dir().join("what-if"))
        .expect("the reports directory")
        .map(|entry| {
            entry
                .expect("an entry")
                .file_name()
                .into_string()
                .expect("a name")
        })
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let socket = setup.workspace.path().join("control.sock");
    let list = control_request(&socket, "GET", "/console/what-if");
    assert_eq!(list.status, 200, "{list:?}");
    assert!(list.body.contains(&names[0]), "{}", list.body);
    let page = control_request(&socket, "GET", &format!("/console/what-if/{}", names[0]));
    assert_eq!(page.status, 200, "{page:?}");
    for shown in [
        event_id,
        "Disk full.",
        "would call, not run",
        r#"{"host":"db-2"}"#,
    ] {
        assert!(page.body.contains(shown), "{shown}: {}", page.body);
    }
    let outside = control_request(&socket, "GET", "/console/what-if/..%2Fagentgate.db");
    assert_eq!(outside.status, 404, "{outside:?}");
    assert!(
        setup.state_bytes()[0] == database,
        "--save changed the live database"
    );
}

#[test]
fn a_route_and_a_limit_pick_the_latest_events() {
    let setup = Setup::start();
    let ids: Vec<String> = ["a", "b", "c"].iter().map(|s| setup.event(s)).collect();
    let same = setup.new_config(str::to_string);

    let output = setup.what_if(
        &same,
        &[
            "--route",
            "alerts",
            "--limit",
            "2",
            "--json",
            "--fail-on-change",
        ],
    );
    assert!(output.status.success(), "{output:?}");
    let report = json_of(&output);
    let picked: Vec<&str> = report["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|event| event["event_id"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(picked, [ids[2].as_str(), ids[1].as_str()]);
    for event in report["events"].as_array().expect("events") {
        assert_eq!(event["changed"], false, "{event}");
        assert_eq!(
            calls(&event["new"]),
            [("lookup".into(), json!({"host": "db-1"}), "recorded".into())]
        );
    }
    assert_eq!(report["summary"]["changed"], 0);
    assert_eq!(report["summary"]["tokens_delta"], 0);
    assert_eq!(setup.tool_runs(), 3);

    // An event that is not recorded is a runtime failure, named.
    let unknown = setup.what_if(&same, &["--event", "no-such-event"]);
    assert_eq!(unknown.status.code(), Some(1), "{unknown:?}");
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no-such-event"));

    // Usage errors exit 2; a NEW config that is not valid exits 78 with its findings.
    let neither = setup.what_if(&same, &["--json"]);
    assert_eq!(neither.status.code(), Some(2), "{neither:?}");
    let bad = setup.new_config(|live| format!("{live}\n[nonsense]\nkey = 1\n"));
    let refused = setup.what_if(&bad, &["--event", &ids[0]]);
    assert_eq!(refused.status.code(), Some(78), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("nonsense"),
        "{refused:?}"
    );

    // With PostgreSQL there is no snapshot to read: refused in one line.
    let postgres = setup.workspace.path().join("postgres.toml");
    std::fs::write(
        &postgres,
        "[store]\nbackend = \"postgres\"\nurl = \"postgres://agentgate@127.0.0.1:1/agentgate\"\n",
    )
    .expect("write a PostgreSQL config");
    let refused = Command::new(BIN)
        .args(["what-if", "--config"])
        .arg(&same)
        .arg("--live-config")
        .arg(&postgres)
        .args(["--event", &ids[0]])
        .output()
        .expect("run agentgate what-if");
    assert_eq!(refused.status.code(), Some(78), "{refused:?}");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("postgres") && said.lines().count() == 1,
        "{said}"
    );
}

/// MCP servers over HTTP are asked for their tools, which are offered but never called; a server
/// that is a process is not started, and the report says its tools were left out.
#[test]
fn mcp_tools_over_http_are_offered_and_never_called() {
    if !common::mcp::servers_or_skip("mcp_tools_over_http_are_offered_and_never_called") {
        return;
    }
    let setup = Setup::start();
    let event_id = setup.event("db-1");
    let web = common::mcp::PythonServer::start(&setup.workspace);
    // A stdio server that says when it is started.
    let started = setup.workspace.path().join("local-started");
    let servers = format!(
        "{}\n[mcp.local]\ncommand = [\"/bin/sh\", \"-c\", \"echo started >> {}\"]\nsandbox = \"none\"\n",
        web.config(&setup.workspace),
        started.display()
    );
    let new = setup.new_config(|live| {
        let tools = "tools = [\"lookup\", \"restart\", \"web.shout\", \"local.*\"]";
        format!(
            "{}\n{servers}",
            live.replace("tools = [\"lookup\", \"restart\"]", tools)
        )
    });
    let recorded_requests = setup.model.requests().len();

    let output = setup.what_if(&new, &["--event", &event_id]);
    assert!(output.status.success(), "{output:?}");
    let shown = String::from_utf8_lossy(&output.stdout);
    assert!(
        shown.contains(r#"would call web__shout with {"text":"hi"}"#),
        "{shown}"
    );
    assert!(
        shown.contains(r#"MCP server "local" are not offered"#),
        "{shown}"
    );
    assert!(web.calls().is_empty(), "what-if called the MCP tool");
    assert!(!started.exists(), "what-if started the stdio server");
    let requests = setup.model.requests();
    let offered: Vec<String> = requests[recorded_requests].json()["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|tool| tool["function"]["name"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(offered, ["lookup", "restart", "web__shout"]);
}
