//! MCP tools against MCP servers that nobody here wrote: the reference servers from npm
//! (`@modelcontextprotocol/server-everything` and `server-filesystem`, over stdio) and a server
//! of the official Python SDK (over streamable HTTP), driven by a scripted model. `tests/setup`
//! installs them under `tests/mcp/` (`npm ci`, and a venv with the pinned `mcp` package).

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::mcp::{
    PythonServer, children_of, memo_server, node_server, processes_with, servers_or_skip,
};
use common::stub::{Received, Reply, Stub};
use common::*;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(60);

fn messages(request: &Received) -> Vec<Value> {
    request.json()["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The results of tool calls the model was shown, oldest first.
fn tool_results(request: &Received) -> Vec<String> {
    messages(request)
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// A model that calls `tool` with `arguments` once, then answers `answer`.
fn calls_once(tool: &'static str, arguments: Value, answer: &'static str) -> Stub {
    Stub::start(move |request, _| {
        if tool_results(request).is_empty() {
            Reply::tool_call("call_1", tool, arguments.clone())
        } else {
            Reply::answer(answer)
        }
    })
}

/// Configures the Python SDK's HTTP server as `[mcp.web]`, its `tools` offered to the route.
fn with_python_server(workspace: &Workspace, server: &PythonServer, model: &Stub, tools: &str) {
    workspace.write_config(&format!(
        "{}\n{}\n{}",
        model.model_section(),
        server.config(workspace),
        route(tools),
    ));
}

fn offered_tools(request: &Received) -> Vec<String> {
    request.json()["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|tool| tool["function"]["name"].as_str().map(str::to_string))
        .collect()
}

fn post(daemon: &Daemon, payload: Value) -> String {
    let response = daemon.post_json("/hook", &[], &payload.to_string());
    assert_eq!(response.status, 202, "{response:?}");
    response.event_id()
}

fn route(tools: &str) -> String {
    format!(
        r#"[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
tools = {tools}
deliver = {{ kind = "log" }}
"#
    )
}

/// The tool starts recorded for `session`, in order: (name, key, MCP server).
fn tool_starts(workspace: &Workspace, session: &str) -> Vec<(String, String, Option<String>)> {
    let bodies: Vec<String> = workspace.query(
        &format!(
            "SELECT body FROM transcript WHERE session_key = '{session}' AND kind = 'tool_start' ORDER BY seq"
        ),
        |row| row.get(0),
    );
    bodies
        .iter()
        .map(|body| {
            let entry: Value = serde_json::from_str(body).expect("entry");
            (
                entry["name"].as_str().unwrap_or_default().to_string(),
                entry["key"].as_str().unwrap_or_default().to_string(),
                entry["mcp_server"].as_str().map(str::to_string),
            )
        })
        .collect()
}

/// The tool results recorded for `session`, oldest first.
fn recorded_results(workspace: &Workspace, session: &str) -> Vec<String> {
    let bodies: Vec<String> = workspace.query(
        &format!(
            "SELECT body FROM transcript WHERE session_key = '{session}' AND kind = 'message' ORDER BY seq"
        ),
        |row| row.get(0),
    );
    bodies
        .iter()
        .filter_map(|body| {
            let entry: Value = serde_json::from_str(body).ok()?;
            (entry["message"]["role"] == "tool").then(|| {
                entry["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
        })
        .collect()
}

fn log_count(daemon: &Daemon, line: &str) -> usize {
    daemon.log().matches(line).count()
}

/// A directory with `notes.txt` in `workspace`, and the config lines of the filesystem server
/// over it (`extra` in its table). The directory is under the host's /tmp, which the sandbox
/// replaces with a private one: it is shared with the server as a writable path.
fn files_server(workspace: &Workspace, extra: &str) -> (std::path::PathBuf, String) {
    let files = workspace.path().join("files");
    std::fs::create_dir(&files).expect("files dir");
    std::fs::write(files.join("notes.txt"), "the answer is needle-4711\n").expect("file");
    let dir = files.display().to_string();
    let section = format!(
        "[mcp.fs]\ncommand = [{:?}, {dir:?}]\nwritable = [{dir:?}]\n{extra}\n",
        node_server("mcp-server-filesystem"),
    );
    (files, section)
}

#[test]
fn a_filesystem_tool_reads_a_file_and_its_result_reaches_the_model_and_the_transcript() {
    if !servers_or_skip(
        "a_filesystem_tool_reads_a_file_and_its_result_reaches_the_model_and_the_transcript",
    ) {
        return;
    }
    let workspace = Workspace::new();
    let (files, server) = files_server(&workspace, "");
    let path = files.join("notes.txt").display().to_string();
    let model = Stub::start(move |request, _| {
        if tool_results(request).is_empty() {
            Reply::tool_call("call_1", "fs__read_text_file", json!({"path": path}))
        } else {
            Reply::answer("read it")
        }
    });
    workspace.write_config(&format!(
        "{}\n{server}\n{}",
        model.model_section(),
        route(r#"["fs.read_text_file", "fs.list_directory"]"#),
    ));
    let daemon = workspace.start();
    let event_id = post(&daemon, json!({"session": "notes"}));
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");

    let requests = model.requests();
    // The route's two tools and no other, under the names the model can call.
    let mut offered = offered_tools(&requests[0]);
    offered.sort();
    assert_eq!(offered, ["fs__list_directory", "fs__read_text_file"]);
    let schema = requests[0].json()["tools"]
        .as_array()
        .and_then(|tools| {
            tools
                .iter()
                .find(|t| t["function"]["name"] == "fs__read_text_file")
                .cloned()
        })
        .expect("read_text_file offered");
    assert_eq!(
        schema["function"]["parameters"]["properties"]["path"]["type"],
        "string"
    );
    let results = tool_results(&requests[1]);
    assert!(results[0].contains("needle-4711"), "{results:?}");

    let starts = tool_starts(&workspace, "notes");
    assert_eq!(starts.len(), 1);
    assert_eq!(starts[0].2.as_deref(), Some("fs"));
    let shown = workspace.cli(&["sessions", "show", "notes"]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("mcp tool (server fs) fs__read_text_file") && shown.contains("needle-4711"),
        "{shown}"
    );

    // While the daemon runs, `tools list` and `status` show its servers.
    let listed = workspace.cli(&["tools", "list", "--route", "hook", "--json"]);
    assert!(listed.status.success(), "{listed:?}");
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("tools list JSON");
    let read = listed
        .as_array()
        .and_then(|tools| tools.iter().find(|t| t["name"] == "fs__read_text_file"))
        .expect("listed");
    assert_eq!(read["kind"], "mcp");
    assert_eq!(read["mcp_server"], "fs");
    assert_eq!(read["idempotent"], true, "read_text_file is readOnlyHint");
    assert_eq!(workspace.status()["mcp"]["fs"]["state"], "ready");

    // The drain stops the server with the daemon.
    let servers = children_of(daemon.pid(), "server-filesystem");
    assert_eq!(servers.len(), 1, "{servers:?}");
    assert!(daemon.terminate().success());
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next())
                != Some("Z")
        })
    };
    assert!(!alive(servers[0]), "the MCP server outlived the daemon");
}

#[test]
fn a_server_killed_mid_call_fails_the_call_with_a_recorded_error_and_the_next_turn_starts_another()
{
    if !servers_or_skip(
        "a_server_killed_mid_call_fails_the_call_with_a_recorded_error_and_the_next_turn_starts_another",
    ) {
        return;
    }
    let workspace = Workspace::new();
    let model = Stub::start(|request, _| {
        let body = request.json().to_string();
        if !tool_results(request).is_empty() {
            Reply::answer("noted")
        } else if body.contains("echo-me") {
            Reply::tool_call(
                "call_1",
                "everything__echo",
                json!({"message": "hello-again"}),
            )
        } else {
            Reply::tool_call(
                "call_1",
                "everything__trigger-long-running-operation",
                json!({"duration": 120, "steps": 2}),
            )
        }
    });
    workspace.write_config(&format!(
        "{}\n[mcp.everything]\ncommand = [{:?}, \"stdio\"]\n\n{}",
        model.model_section(),
        node_server("mcp-server-everything"),
        route(r#"["everything.*"]"#),
    ));
    let daemon = workspace.start();
    wait_until("the server to list its tools", LIMIT, || {
        workspace.status()["mcp"]["everything"]["state"] == "ready"
    });
    let lister = children_of(daemon.pid(), "server-everything");
    assert_eq!(lister.len(), 1, "{lister:?}");
    let first = post(&daemon, json!({"session": "slow"}));
    wait_until("the slow call to start", LIMIT, || {
        !tool_starts(&workspace, "slow").is_empty()
    });
    // The call runs in a process of the turn's own, not in the one that listed the tools.
    let mut servers = Vec::new();
    wait_until("the turn's process", LIMIT, || {
        servers = children_of(daemon.pid(), "server-everything");
        servers.retain(|pid| !lister.contains(pid));
        servers.len() == 1
    });
    // Kill the process's whole group (it leads its own), as a crash of it would.
    let killed = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", servers[0])])
        .status()
        .expect("kill");
    assert!(killed.success());
    assert_eq!(workspace.wait_terminal(&first, LIMIT), "completed");
    let results = recorded_results(&workspace, "slow");
    assert!(
        results.len() == 1 && results[0].starts_with("error: MCP server \"everything\""),
        "{results:?}"
    );
    // The server's tools are still offered, and the next turn's call starts another process.
    assert_eq!(workspace.status()["mcp"]["everything"]["state"], "ready");
    let second = post(&daemon, json!({"session": "echo", "text": "echo-me"}));
    assert_eq!(workspace.wait_terminal(&second, LIMIT), "completed");
    let results = recorded_results(&workspace, "echo");
    assert!(results[0].contains("hello-again"), "{results:?}");
    assert!(results[0].contains(r#""is_error":false"#), "{results:?}");
}

#[test]
fn after_a_sigkill_a_read_only_call_runs_again_with_its_key_and_a_side_effect_does_not() {
    if !servers_or_skip(
        "after_a_sigkill_a_read_only_call_runs_again_with_its_key_and_a_side_effect_does_not",
    ) {
        return;
    }
    let workspace = Workspace::new();
    // Two servers of the same program: "slow" is declared not idempotent, overriding the
    // tool's readOnlyHint; "reader" keeps it.
    let model = Stub::start(|request, _| {
        let body = request.json().to_string();
        if !tool_results(request).is_empty() {
            Reply::answer("finished")
        } else if body.contains("side-effect") {
            Reply::tool_call(
                "call_1",
                "slow__trigger-long-running-operation",
                json!({"duration": 3, "steps": 1}),
            )
        } else {
            Reply::tool_call(
                "call_1",
                "reader__trigger-long-running-operation",
                json!({"duration": 3, "steps": 1}),
            )
        }
    });
    let server = node_server("mcp-server-everything");
    workspace.write_config(&format!(
        "{}\n[mcp.slow]\ncommand = [{server:?}, \"stdio\"]\nnot_idempotent = [\"trigger-long-running-operation\"]\n\n\
         [mcp.reader]\ncommand = [{server:?}, \"stdio\"]\n\n{}",
        model.model_section(),
        route(r#"["slow.*", "reader.*"]"#),
    ));
    let daemon = workspace.start();
    let side_effect = post(&daemon, json!({"session": "write", "kind": "side-effect"}));
    let read_only = post(&daemon, json!({"session": "read", "kind": "lookup"}));
    wait_until("both calls to start", LIMIT, || {
        !tool_starts(&workspace, "write").is_empty() && !tool_starts(&workspace, "read").is_empty()
    });
    let servers = children_of(daemon.pid(), "server-everything");
    let daemon_pid = daemon.pid();
    daemon.kill9();
    // The servers die with the daemon.
    wait_until("the servers to die with the daemon", LIMIT, || {
        servers.iter().all(|pid| !process_alive(*pid as u32))
    });
    assert!(children_of(daemon_pid, "server-everything").is_empty());

    let _daemon = workspace.start();
    assert_eq!(workspace.wait_terminal(&side_effect, LIMIT), "completed");
    assert_eq!(workspace.wait_terminal(&read_only, LIMIT), "completed");

    // Not idempotent: one start only, and the model was told its outcome is unknown.
    let writes = tool_starts(&workspace, "write");
    assert_eq!(writes.len(), 1, "{writes:?}");
    let results = recorded_results(&workspace, "write");
    assert!(
        results.len() == 1 && results[0].contains("interrupted") && results[0].contains("unknown"),
        "{results:?}"
    );
    // Read-only: run again, with the key of the interrupted run, and it completed.
    let reads = tool_starts(&workspace, "read");
    assert_eq!(reads.len(), 2, "{reads:?}");
    assert_eq!(reads[0].1, reads[1].1, "the re-run carries the same key");
    assert_eq!(reads[1].2.as_deref(), Some("reader"));
    let results = recorded_results(&workspace, "read");
    assert!(
        results.len() == 1 && results[0].contains(r#""is_error":false"#),
        "{results:?}"
    );
}

#[test]
fn the_streamable_http_transport_carries_headers_from_secrets_and_the_call_key() {
    if !servers_or_skip(
        "the_streamable_http_transport_carries_headers_from_secrets_and_the_call_key",
    ) {
        return;
    }
    let workspace = Workspace::new();
    let server = PythonServer::start(&workspace);
    let model = calls_once("web__shout", json!({"text": "quiet words"}), "shouted");
    with_python_server(&workspace, &server, &model, r#"["web.shout"]"#);
    let daemon = workspace.start();
    let event_id = post(&daemon, json!({"session": "loud"}));
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    let results = recorded_results(&workspace, "loud");
    assert!(results[0].contains("QUIET WORDS"), "{results:?}");
    // The server saw the key that the transcript recorded for the call.
    let starts = tool_starts(&workspace, "loud");
    assert_eq!(
        server.calls(),
        [(starts[0].1.clone(), "quiet words".to_string())],
        "the _meta key"
    );
    assert!(!daemon.log().contains(PythonServer::TOKEN));
}

/// An HTTP server's answer over the 1 MiB bound on an MCP message is not read: the call fails
/// with the MCP SDK's response limit, which the model sees, and the daemon serves on.
#[test]
fn an_http_server_s_answer_over_the_bound_fails_the_call() {
    if !servers_or_skip("an_http_server_s_answer_over_the_bound_fails_the_call") {
        return;
    }
    let workspace = Workspace::new();
    let server = PythonServer::start(&workspace);
    let model = calls_once("web__wide", json!({}), "too wide");
    with_python_server(&workspace, &server, &model, r#"["web.wide"]"#);
    let daemon = workspace.start();
    let event_id = post(&daemon, json!({"session": "wide"}));
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    let results = recorded_results(&workspace, "wide");
    assert!(
        results.len() == 1
            && results[0].starts_with("error: MCP server \"web\"")
            && !results[0].contains("xxxx"),
        "{:?}",
        results
            .iter()
            .map(|result| result.chars().take(200).collect::<String>())
            .collect::<Vec<_>>()
    );
    memory_stayed_small(&daemon);
}

#[test]
fn a_server_that_changes_its_tools_has_them_offered_in_the_next_turn() {
    if !servers_or_skip("a_server_that_changes_its_tools_has_them_offered_in_the_next_turn") {
        return;
    }
    let workspace = Workspace::new();
    let server = PythonServer::start(&workspace);
    let model = Stub::start(|request, _| {
        if !tool_results(request).is_empty() {
            Reply::answer("done")
        } else if request.json().to_string().contains("grow-now") {
            Reply::tool_call("call_1", "web__grow", json!({"name": "fresh"}))
        } else {
            Reply::answer("just looking")
        }
    });
    workspace.write_config(&format!(
        "{}\n{}\n{}",
        model.model_section(),
        server.config(&workspace),
        route(r#"["web.*"]"#),
    ));
    let daemon = workspace.start();
    let first = post(&daemon, json!({"session": "a", "do": "grow-now"}));
    assert_eq!(workspace.wait_terminal(&first, LIMIT), "completed");
    assert!(!offered_tools(&model.requests()[0]).contains(&"web__fresh".to_string()));
    wait_until("the changed tool list to be read", LIMIT, || {
        daemon.log().contains("MCP server web changed its tools")
    });
    let second = post(&daemon, json!({"session": "b"}));
    assert_eq!(workspace.wait_terminal(&second, LIMIT), "completed");
    let last = model.requests().last().cloned().expect("a request");
    assert!(
        offered_tools(&last).contains(&"web__fresh".to_string()),
        "{:?}",
        offered_tools(&last)
    );
}

/// Configures tests/mcp/flood_server.py as `[mcp.NAME]` (with `more_args` after its own, and
/// `runtime` before the model), offered whole to the route; the file its listings go to.
fn flood_server(
    workspace: &Workspace,
    model: &Stub,
    name: &str,
    more_args: &str,
    runtime: &str,
) -> std::path::PathBuf {
    let dir = workspace.path().join(name);
    std::fs::create_dir(&dir).expect("the server's dir");
    let listings = dir.join("listings");
    workspace.write_config(&format!(
        "{runtime}\n{}\n[mcp.{name}]\ncommand = [\"python3\", {:?}, {:?}{more_args}]\n\
         writable = [{:?}]\n\n{}",
        model.model_section(),
        format!("{}/tests/mcp/flood_server.py", common::machine::REPO),
        listings.display().to_string(),
        dir.display().to_string(),
        route(&format!(r#"["{name}.*"]"#)),
    ));
    listings
}

/// A server that says without end that its tools changed, and writes to stderr without end
/// (tests/mcp/flood_server.py): its tools are listed again at most once a second, no line says
/// they changed (they did not), and its stderr cannot push an event's own lines out of the
/// per-event budget (20 lines a second here, which the flood alone would use up in a few ms).
#[test]
fn a_server_that_floods_is_listed_once_a_second_and_cannot_push_out_an_event_s_lines() {
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("done"));
    let listings = flood_server(
        &workspace,
        &model,
        "flood",
        "",
        "[runtime]\nevent_log_max_per_second = 20\n",
    );
    let daemon = workspace.start();
    let listed_at = || -> Vec<f64> {
        std::fs::read_to_string(&listings)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.parse().ok())
            .collect()
    };
    wait_until("the server's tools to be listed 3 times", LIMIT, || {
        listed_at().len() >= 3
    });
    let times = listed_at();
    assert!(times[2] - times[0] >= 1.9, "listed at {times:?}");
    wait_until("the server's stderr to be logged", LIMIT, || {
        daemon.log().contains("MCP server flood says")
    });
    let event = post(&daemon, json!({"session": "a"}));
    assert_eq!(workspace.wait_terminal(&event, LIMIT), "completed");
    for line in ["event accepted", "turn started", "turn completed"] {
        wait_until(&format!("the event's line {line:?}"), LIMIT, || {
            daemon
                .log()
                .lines()
                .any(|logged| logged.contains(line) && logged.contains(&event))
        });
    }
    assert_eq!(log_count(&daemon, "MCP server flood changed its tools"), 0);
}

/// A server that lists its tools in pages without end (each naming a next one) is not read
/// without end: past 32 pages its listing fails, it is reported down with why, and its tools
/// are not offered; the daemon serves anyway.
#[test]
fn a_server_that_pages_its_tools_without_end_is_not_offered() {
    let (workspace, _daemon) = a_listing_refused(
        "pages",
        "it lists its tools in more than 32 pages".to_string(),
    );
    let listings = workspace.path().join("pages").join("listings");
    let pages = std::fs::read_to_string(&listings).unwrap_or_default();
    assert!(pages.lines().count() >= 32, "{pages}");
}

/// Starts tests/mcp/flood_server.py in `mode` (as MCP server `mode`), waits until `status`
/// reports it down with an error that contains `error`, and checks that a turn then runs
/// without its tools.
fn a_listing_refused(mode: &'static str, error: String) -> (Workspace, Daemon) {
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("done"));
    flood_server(&workspace, &model, mode, &format!(", {mode:?}"), "");
    let daemon = workspace.start();
    wait_until("the server to be reported down", LIMIT, || {
        workspace.status()["mcp"][mode]["error"]
            .as_str()
            .is_some_and(|reported| reported.contains(&error))
    });
    let event = post(&daemon, json!({"session": mode}));
    assert_eq!(workspace.wait_terminal(&event, LIMIT), "completed");
    assert!(offered_tools(&model.requests()[0]).is_empty());
    (workspace, daemon)
}

/// A server that lists a tool whose schema holds more objects than a message may (20,000
/// properties, under 1 MiB, which the MCP SDK would parse into tens of MB per listing) is cut
/// off at its listing: it is reported down, its tools are not offered, and the daemon serves
/// anyway with its memory small.
#[test]
fn a_server_whose_listing_holds_too_many_objects_is_not_offered() {
    let (_workspace, daemon) = a_listing_refused(
        "schema",
        format!("tools/list failed: agentgate cut the server off: it {TOO_LARGE}"),
    );
    memory_stayed_small(&daemon);
}

/// A server whose tools' schemas hold more objects in all than a listing may (four pages of
/// 9,000 properties each, every page under the bounds of a message), which would be compiled
/// into hundreds of MB and again at every change, is not offered, and `status` says why.
#[test]
fn a_server_whose_schemas_hold_too_many_objects_in_all_is_not_offered() {
    a_listing_refused(
        "schemas",
        "input schemas hold more than 16384 JSON objects and arrays in all".to_string(),
    );
}

/// Runs one turn whose only call goes to tests/mcp/flood_server.py in `mode` (as MCP server
/// `mode`, tool `noop`), and checks that agentgate cut the server off for `why`: the call
/// failed with it, and the journal says it.
fn a_call_cut_off(mode: &'static str, tool: &'static str, why: &str) -> (Workspace, Daemon) {
    a_call_cut_off_from(mode, tool, why, |workspace, model| {
        flood_server(workspace, model, mode, &format!(", {mode:?}"), "");
    })
}

/// As [`a_call_cut_off`], with the server `configure` writes into the config beside `model`.
fn a_call_cut_off_from(
    session: &str,
    tool: &'static str,
    why: &str,
    configure: impl FnOnce(&Workspace, &Stub),
) -> (Workspace, Daemon) {
    let workspace = Workspace::new();
    let model = calls_once(tool, json!({}), "done");
    configure(&workspace, &model);
    let daemon = workspace.start();
    let event = post(&daemon, json!({"session": session}));
    assert_eq!(workspace.wait_terminal(&event, LIMIT), "completed");
    let results = tool_results(&model.requests()[1]);
    assert!(
        results.len() == 1
            && results[0].contains(&format!("agentgate cut the server off: it {why}"))
            && results[0].contains("during the call; its outcome is unknown"),
        "{results:?}"
    );
    daemon.wait_for_log(&format!("the MCP server {why}: its connection is closed"));
    (workspace, daemon)
}

/// The daemon's peak RSS stayed under 150 MiB.
fn memory_stayed_small(daemon: &Daemon) {
    let peak_mib = daemon.peak_rss_kib() / 1024;
    assert!(peak_mib < 150, "the daemon's peak RSS was {peak_mib} MiB");
}

/// The daemon's metrics hold `line`.
fn counted(workspace: &Workspace, line: &str) {
    let metrics = workspace.metrics();
    assert!(metrics.contains(line), "{metrics}");
}

/// What a server did when it sent a message over the bounds.
const TOO_LARGE: &str =
    "sent a message larger than 1024 KiB or of more than 16384 JSON objects and arrays";

/// A server that answers a call with one line of 10 MB of empty content blocks (which the MCP
/// SDK would parse into hundreds of MB, and which is below its own line limit) is cut off
/// unread: the call fails at once with an error the model sees, the journal says why, it is
/// counted, and the daemon's memory stays small.
#[test]
fn a_server_that_answers_with_a_huge_message_is_cut_off_unread() {
    let (workspace, daemon) = a_call_cut_off("wide", "wide__noop", TOO_LARGE);
    counted(
        &workspace,
        "agentgate_mcp_messages_too_large_total{mcp_server=\"wide\"} 1",
    );
    memory_stayed_small(&daemon);
}

/// A message under 1 MiB of objects nested deep (a log notification sent before the answer),
/// which the MCP SDK would parse into hundreds of MB, is not read either: the connection ends,
/// the call fails, and the daemon's memory stays small.
#[test]
fn a_server_that_sends_a_message_of_too_many_objects_is_cut_off_unread() {
    let (_workspace, daemon) = a_call_cut_off("deep", "deep__noop", TOO_LARGE);
    memory_stayed_small(&daemon);
}

/// What a server did when it sent requests and read none of the replies.
const NOT_READING: &str = "sent requests without reading the replies (more than 1024 replies, \
                           or 4096 KiB of them, waited for it)";

/// A server that sends requests (200,000 pings) without reading the replies, which the MCP SDK
/// would queue in memory without end, is cut off: the call fails, the journal says why, it is
/// counted, and the daemon's memory stays small.
#[test]
fn a_server_that_sends_without_reading_is_cut_off() {
    let (workspace, daemon) = a_call_cut_off("pings", "pings__noop", NOT_READING);
    counted(
        &workspace,
        "agentgate_mcp_servers_not_reading_total{mcp_server=\"pings\"} 1",
    );
    memory_stayed_small(&daemon);
}

/// An HTTP MCP server (tests/mcp/flood_http_server.py) started with `args`, and the config
/// section that names it `name`.
fn flood_http_server(name: &str, args: &[&str]) -> (KillOnDrop, String) {
    let port = common::free_port();
    let server = std::process::Command::new("python3")
        .arg(format!(
            "{}/tests/mcp/flood_http_server.py",
            common::machine::REPO
        ))
        .arg(port.to_string())
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the HTTP flood server");
    let server = KillOnDrop(server);
    wait_until("the HTTP flood server to listen", LIMIT, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    (
        server,
        format!("[mcp.{name}]\nurl = \"http://127.0.0.1:{port}/mcp\"\n"),
    )
}

/// The same over HTTP: 200,000 pings on a call's event stream, and every POST that carries a
/// reply held open unanswered, where the MCP SDK sends one reply at a time and queues the rest
/// in memory.
#[test]
fn an_http_server_that_sends_without_reading_is_cut_off() {
    let (_server, section) = flood_http_server("hang", &[]);
    let (workspace, daemon) =
        a_call_cut_off_from("hang", "hang__noop", NOT_READING, |workspace, model| {
            workspace.write_config(&format!(
                "{}\n{section}\n{}",
                model.model_section(),
                route(r#"["hang.*"]"#),
            ));
        });
    counted(
        &workspace,
        "agentgate_mcp_servers_not_reading_total{mcp_server=\"hang\"} 1",
    );
    memory_stayed_small(&daemon);
}

/// The error `status` reports for server `name`, once it reports one (within `limit`).
fn reported_error(workspace: &Workspace, name: &str, limit: Duration) -> String {
    let mut error = String::new();
    wait_until("the server to be reported down", limit, || {
        error = workspace.status()["mcp"][name]["error"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        !error.is_empty()
    });
    error
}

/// A server cut off while its tools are being listed (pings on the session's stream, the
/// listing never answered) is down at once, and `status` says why: not after the listing's
/// 30 s timeout, which the MCP SDK would otherwise make it wait.
#[test]
fn a_server_cut_off_while_listed_is_down_at_once() {
    let (_server, section) = flood_http_server("hang", &["listing"]);
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("no tools"));
    workspace.write_config(&format!(
        "{}\n{section}\n{}",
        model.model_section(),
        route(r#"["hang.*"]"#),
    ));
    let daemon = workspace.start();
    // Well under the listing's timeout of 30 s.
    let error = reported_error(&workspace, "hang", Duration::from_secs(15));
    assert!(
        error.contains(&format!("agentgate cut the server off: it {NOT_READING}")),
        "{error}"
    );
    daemon.wait_for_log(&format!(
        "the MCP server {NOT_READING}: its connection is closed"
    ));
}

/// An MCP server's `url` may hold a token: when the server cannot be reached, `status` and the
/// journal say so without it.
#[test]
fn an_unreachable_http_server_is_reported_without_its_url() {
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("no tools needed"));
    let closed = common::free_port();
    workspace.write_config(&format!(
        "{}\n[mcp.remote]\nurl = \"http://127.0.0.1:{closed}/s3cr3t-path/mcp?token=s3cr3t\"\n\n{}",
        model.model_section(),
        route(r#"["remote.*"]"#),
    ));
    let daemon = workspace.start();
    let error = reported_error(&workspace, "remote", LIMIT);
    assert!(!error.contains("s3cr3t"), "{error}");
    daemon.wait_for_log("MCP server remote is down");
    assert!(!daemon.log().contains("s3cr3t"), "{}", daemon.log());
}

#[test]
fn a_server_that_cannot_start_is_reported_and_the_daemon_serves_anyway() {
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("no tools needed"));
    workspace.write_config(&format!(
        "{}\n[mcp.broken]\ncommand = [\"/nonexistent/mcp-server\"]\n\n{}",
        model.model_section(),
        route(r#"["broken.*"]"#),
    ));
    let check = workspace.cli(&["check-config"]);
    assert!(check.status.success(), "{check:?}");
    let daemon = workspace.start();
    let event_id = post(&daemon, json!({"session": "s"}));
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    assert!(offered_tools(&model.requests()[0]).is_empty());
    let status = workspace.status();
    assert_eq!(status["mcp"]["broken"]["state"], "down", "{status}");
    assert!(
        status["mcp"]["broken"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("cannot start /nonexistent/mcp-server")),
        "{status}"
    );
    let text = workspace.cli(&["status"]);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("mcp:        broken DOWN"),
        "{text:?}"
    );
    assert!(daemon.log().contains("MCP server broken is down"));
}

#[test]
fn check_config_refuses_bad_mcp_tables() {
    let workspace = Workspace::new();
    workspace.write_config(
        r#"[model]
backend = "replay"

[mcp.both]
command = ["/bin/true"]
url = "http://127.0.0.1:1/mcp"

[mcp.web]
url = "ftp://example.com"
cwd = "/tmp"
max_instances = 2

[mcp.ok]
command = ["/bin/true"]
idempotent = ["x"]
not_idempotent = ["x"]
max_instances = 0

[routes.hook]
path = "/hook"
verify = { scheme = "none" }
tools = ["missing.*", "ok."]
"#,
    );
    let check = workspace.cli(&["check-config"]);
    assert_eq!(check.status.code(), Some(78), "{check:?}");
    let text = String::from_utf8_lossy(&check.stdout).to_string()
        + &String::from_utf8_lossy(&check.stderr);
    for expected in [
        "mcp.both: give exactly one transport",
        "mcp.web.url: ftp://example.com/… is not an http:// or https:// URL",
        "mcp.web.cwd: cwd is for the stdio transport",
        "mcp.web.max_instances: max_instances is for the stdio transport",
        "mcp.ok.max_instances: 0 must be a positive whole number",
        "\"x\" is in both idempotent and not_idempotent",
        "names the MCP server \"missing\", which has no [mcp.missing] table",
        "\"ok.\" names no tool",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

#[test]
fn reload_adds_and_removes_servers() {
    if !servers_or_skip("reload_adds_and_removes_servers") {
        return;
    }
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("fine"));
    let files = workspace.path().display().to_string();
    let without = format!("{}\n{}", model.model_section(), route("[]"));
    let with = format!(
        "{}\n[mcp.fs]\ncommand = [{:?}, {files:?}]\n\n{}",
        model.model_section(),
        node_server("mcp-server-filesystem"),
        route(r#"["fs.list_directory"]"#),
    );
    // Without a daemon, `tools list` starts the servers for the listing.
    workspace.write_config(&with);
    let listed = workspace.cli(&["tools", "list", "--route", "hook", "--json"]);
    assert!(listed.status.success(), "{listed:?}");
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("tools list JSON");
    assert_eq!(listed[0]["name"], "fs__list_directory", "{listed}");

    workspace.write_config(&without);
    let daemon = workspace.start();
    assert!(children_of(daemon.pid(), "server-filesystem").is_empty());

    workspace.write_config(&with);
    let reload = workspace.cli(&["reload"]);
    assert!(reload.status.success(), "{reload:?}");
    assert!(
        String::from_utf8_lossy(&reload.stdout).contains("mcp.fs"),
        "{reload:?}"
    );
    let listed = workspace.cli(&["tools", "list", "--route", "hook", "--json"]);
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("tools list JSON");
    assert_eq!(listed[0]["name"], "fs__list_directory", "{listed}");
    assert_eq!(children_of(daemon.pid(), "server-filesystem").len(), 1);

    workspace.write_config(&without);
    let reload = workspace.cli(&["reload"]);
    assert!(reload.status.success(), "{reload:?}");
    wait_until("the removed server to stop", LIMIT, || {
        children_of(daemon.pid(), "server-filesystem").is_empty()
    });
    assert!(
        workspace.status()["mcp"]
            .as_object()
            .is_some_and(serde_json::Map::is_empty)
    );
}

/// `[mcp.NAME] approval` gates a server's tools by name or prefix: the call waits for a
/// decision (nothing reaches the server), the model cannot reach it under another name, and once
/// approved it runs with the arguments shown. A tool the list does not name runs at once.
#[test]
fn an_mcp_tool_named_in_approval_waits_for_a_decision() {
    if !servers_or_skip("an_mcp_tool_named_in_approval_waits_for_a_decision") {
        return;
    }
    let workspace = Workspace::new();
    let (files, server) = files_server(&workspace, "approval = [\"read_*\"]");
    let path = files.join("notes.txt").display().to_string();
    let dir = files.display().to_string();
    let model = Stub::start(move |request, _| match tool_results(request).len() {
        0 => Reply::tool_call("call_1", "fs__list_directory", json!({"path": dir})),
        1 => Reply::tool_call("call_2", "fs__read_text_file", json!({"path": path})),
        _ => Reply::answer("read it"),
    });
    workspace.write_config(&format!(
        "{}\n{server}\n{}",
        model.model_section(),
        route(r#"["fs.read_text_file", "fs.list_directory"]"#),
    ));
    let daemon = workspace.start();
    let event_id = post(&daemon, json!({"session": "gated"}));
    wait_until("the read to await approval", LIMIT, || {
        workspace.event_status(&event_id) == "awaiting_approval"
    });
    let pending = workspace.cli_json(&["approvals", "list", "--json"]);
    let approvals = pending["approvals"].as_array().cloned().unwrap_or_default();
    assert_eq!(approvals.len(), 1, "{pending}");
    assert_eq!(approvals[0]["tool"], "fs__read_text_file", "{pending}");
    let starts = tool_starts(&workspace, "gated");
    assert_eq!(starts.len(), 1, "only the ungated listing ran: {starts:?}");
    let id = approvals[0]["id"].as_str().unwrap_or_default().to_string();
    let approved = workspace.cli(&["approvals", "approve", &id]);
    assert!(approved.status.success(), "{approved:?}");
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    let last = model.requests().pop().expect("requests");
    assert!(
        tool_results(&last)
            .iter()
            .any(|r| r.contains("needle-4711")),
        "the approved read ran"
    );
}

/// Holds the model's answers of a turn until the test opens it, so that the turn (and the
/// processes it started) stays running meanwhile.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn wait(&self) {
        let (open, opened) = &*self.0;
        let guard = open.lock().expect("gate");
        let _ = opened
            .wait_timeout_while(guard, LIMIT, |open| !*open)
            .expect("gate");
    }

    fn open(&self) {
        let (open, opened) = &*self.0;
        *open.lock().expect("gate") = true;
        opened.notify_all();
    }
}

/// A test of the memo server: its workspace, the tag of its processes, and a closed gate; `None`
/// when the servers are not installed and the test is skipped.
fn memo_test(test: &str) -> Option<(Workspace, String, Gate)> {
    if !servers_or_skip(test) {
        return None;
    }
    let workspace = Workspace::new();
    let tag = format!("memo-{}", workspace.path().display());
    Some((workspace, tag, Gate::default()))
}

/// The memo server's Python processes of this test (tagged `tag`), not the sandbox's.
fn memo_processes(tag: &str) -> Vec<i32> {
    processes_with(&["memo_server.py", tag])
        .into_iter()
        .filter(|(_, program)| program.contains("python"))
        .map(|(pid, _)| pid)
        .collect()
}

/// A stdio server that remembers what a call gives it: each turn that calls it gets a process of
/// its own, so what one session stores another cannot read. The process starts at the turn's
/// first call, keeps what the turn gave it for the rest of the turn, and is gone when the turn
/// ends; one still running at a drain is gone with the daemon, none left behind.
#[test]
fn a_stdio_server_is_a_process_per_turn_and_no_session_reads_what_another_stored() {
    let Some((workspace, tag, gate)) =
        memo_test("a_stdio_server_is_a_process_per_turn_and_no_session_reads_what_another_stored")
    else {
        return;
    };
    let held = gate.clone();
    let model = Stub::start(move |request, _| {
        let body = request.json().to_string();
        let done = tool_results(request).len();
        let remember =
            |value: &str| Reply::tool_call("call_r", "memo__remember", json!({"value": value}));
        let recall = Reply::tool_call("call_q", "memo__recall", json!({}));
        if body.contains("store-it") {
            match done {
                0 => remember("secret-4711"),
                1 => recall,
                _ => Reply::answer("stored"),
            }
        } else if body.contains("ask-for-it") {
            match done {
                0 => recall,
                _ => Reply::answer("asked"),
            }
        } else {
            if done > 0 {
                held.wait();
            }
            match done {
                0 => remember("held"),
                _ => Reply::answer("held"),
            }
        }
    });
    workspace.write_config(&format!(
        "{}\n[runtime]\ndrain_timeout = \"2s\"\n\n{}\n{}",
        model.model_section(),
        memo_server("memo", &tag, ""),
        route(r#"["memo.*"]"#),
    ));
    let daemon = workspace.start();
    wait_until("the server to list its tools", LIMIT, || {
        workspace.status()["mcp"]["memo"]["state"] == "ready"
    });
    // The process that listed the tools gets no call.
    let lister = memo_processes(&tag);
    assert_eq!(lister.len(), 1, "{lister:?}");
    // With its sandbox's processes.
    let listing = processes_with(&["memo_server.py", &tag]);

    let stored = post(&daemon, json!({"session": "alice", "do": "store-it"}));
    assert_eq!(workspace.wait_terminal(&stored, LIMIT), "completed");
    let results = recorded_results(&workspace, "alice");
    assert!(
        results.len() == 2 && results[1].contains("secret-4711"),
        "the turn's process keeps what the turn gave it: {results:?}"
    );
    // The turn ended: its process is gone.
    wait_until("alice's process to stop", LIMIT, || {
        memo_processes(&tag) == lister && processes_with(&["memo_server.py", &tag]) == listing
    });

    let asked = post(&daemon, json!({"session": "bob", "do": "ask-for-it"}));
    assert_eq!(workspace.wait_terminal(&asked, LIMIT), "completed");
    let results = recorded_results(&workspace, "bob");
    assert!(
        results.len() == 1 && results[0].contains("nothing"),
        "{results:?}"
    );
    assert!(!results[0].contains("secret-4711"), "{results:?}");
    assert_eq!(log_count(&daemon, "starting the MCP server"), 3);

    // A turn that still runs at the drain: its process goes with the daemon.
    let _held = post(&daemon, json!({"session": "carol", "do": "hold"}));
    wait_until("carol's call to be answered", LIMIT, || {
        recorded_results(&workspace, "carol").len() == 1
    });
    let running = memo_processes(&tag);
    assert_eq!(running.len(), 2, "{running:?}");
    let everything = processes_with(&["memo_server.py", &tag]);
    assert!(daemon.terminate().success());
    // A sandbox's processes die with the one the daemon killed, a moment after it.
    wait_until("every process of the server to exit", LIMIT, || {
        everything
            .iter()
            .all(|(pid, _)| !process_alive(*pid as u32))
    });
    gate.open();
}

/// `max_instances` bounds a stdio server's processes: a call that finds them all running
/// waits up to the server's `timeout` for one to end, then fails visibly (a warning, the
/// counter, an error result); one that gets a process in time runs in it, fresh.
#[test]
fn a_stdio_server_runs_at_most_max_instances_processes_and_calls_past_it_wait_or_are_refused() {
    let Some((workspace, tag, gate)) = memo_test(
        "a_stdio_server_runs_at_most_max_instances_processes_and_calls_past_it_wait_or_are_refused",
    ) else {
        return;
    };
    let held = gate.clone();
    let model = Stub::start(move |request, _| {
        let body = request.json().to_string();
        let done = tool_results(request).len();
        if body.contains("hold-both") {
            match done {
                0 => Reply::tool_call("call_1", "quick__remember", json!({"value": "first"})),
                1 => Reply::tool_call("call_2", "patient__remember", json!({"value": "first"})),
                _ => {
                    held.wait();
                    Reply::answer("held")
                }
            }
        } else if done > 0 {
            Reply::answer("asked")
        } else if body.contains("ask-quick") {
            Reply::tool_call("call_1", "quick__recall", json!({}))
        } else {
            Reply::tool_call("call_1", "patient__recall", json!({}))
        }
    });
    let config = |quick_timeout: &str| {
        format!(
            "{}\n{}\n{}\n{}",
            model.model_section(),
            memo_server(
                "quick",
                &tag,
                &format!("max_instances = 1\ntimeout = \"{quick_timeout}\"")
            ),
            memo_server("patient", &tag, "max_instances = 1\ntimeout = \"60s\""),
            route(r#"["quick.*", "patient.*"]"#),
        )
    };
    workspace.write_config(&config("1s"));
    let daemon = workspace.start();
    // Each server's process that lists its tools, and the holder's own process of each.
    let holder = post(&daemon, json!({"session": "holder", "do": "hold-both"}));
    wait_until("the holder's calls to be answered", LIMIT, || {
        recorded_results(&workspace, "holder").len() == 2
    });
    assert_eq!(memo_processes(&tag).len(), 4);

    // quick's one process is the holder's: the call waits its timeout, then is refused.
    let refused = post(&daemon, json!({"session": "second", "do": "ask-quick"}));
    assert_eq!(workspace.wait_terminal(&refused, LIMIT), "completed");
    let results = recorded_results(&workspace, "second");
    assert!(
        results.len() == 1
            && results[0].starts_with("error: MCP server \"quick\": not called: all 1 processes")
            && results[0].contains("max_instances"),
        "{results:?}"
    );
    assert!(
        daemon
            .log()
            .contains("MCP server quick: the call was refused")
    );

    // A reload that replaces quick (its timeout changed) keeps its bound: the holder's process
    // still counts against it, so the next call is refused too.
    workspace.write_config(&config("2s"));
    let reload = workspace.cli(&["reload"]);
    assert!(reload.status.success(), "{reload:?}");
    wait_until("the replaced server to list its tools", LIMIT, || {
        workspace.status()["mcp"]["quick"]["state"] == "ready"
            && log_count(&daemon, "starting the MCP server") == 5
            && memo_processes(&tag).len() == 4
    });
    let refused = post(&daemon, json!({"session": "fourth", "do": "ask-quick"}));
    assert_eq!(workspace.wait_terminal(&refused, LIMIT), "completed");
    let results = recorded_results(&workspace, "fourth");
    assert!(
        results.len() == 1 && results[0].contains("not called: all 1 processes"),
        "the reload gave quick no fresh bound: {results:?}"
    );

    // patient's call waits; once the holder's turn ends, it gets a fresh process.
    let waited = post(&daemon, json!({"session": "third", "do": "ask-patient"}));
    wait_until("the call to wait for a process", LIMIT, || {
        daemon.log().contains(
            "MCP server patient: all 1 of its processes (max_instances) run for other turns",
        )
    });
    assert_eq!(memo_processes(&tag).len(), 4, "no process past the bound");
    gate.open();
    assert_eq!(workspace.wait_terminal(&holder, LIMIT), "completed");
    assert_eq!(workspace.wait_terminal(&waited, LIMIT), "completed");
    let results = recorded_results(&workspace, "third");
    assert!(
        results.len() == 1 && results[0].contains("nothing"),
        "{results:?}"
    );
    let metrics = workspace.metrics();
    for line in [
        r#"agentgate_mcp_over_bound_total{mcp_server="quick",outcome="refused"} 2"#,
        r#"agentgate_mcp_over_bound_total{mcp_server="patient",outcome="waited"} 1"#,
    ] {
        assert!(metrics.contains(line), "missing {line} in:\n{metrics}");
    }
    wait_until("the turns' processes to stop", LIMIT, || {
        memo_processes(&tag).len() == 2
    });
}
