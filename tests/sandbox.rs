//! Tools run least-privileged (docs/tools.md, "Sandbox"): the real binary runs a tool that tries
//! every escape a prompt-injected model could ask of it, and each fails while the same tool's
//! legitimate work succeeds. The same probe with `sandbox = "none"` escapes each time, which shows
//! that the probe can see an escape.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::stub::{Reply, Stub};
use common::*;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);
const TOKEN: &str = "bearer-token-7d1c";
const DELIVER_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

/// Tries each escape and each legitimate action (tests/common/escape-probe.py).
const PROBE: &str = include_str!("common/escape-probe.py");

/// A file on the host's disk (not under `/tmp`, which a sandbox replaces) that no tool may write.
fn outside(workspace: &Workspace, name: &str) -> std::path::PathBuf {
    let unique = workspace
        .path()
        .file_name()
        .expect("a name")
        .to_string_lossy()
        .to_string();
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("outside-{unique}-{name}.txt"))
}

/// The probe tool's table: `name`, with `extra` keys (sandbox, network). Its writable path is the
/// whole workspace, which holds the state, the credentials, the secret file and the control
/// socket: what is hidden stays hidden inside a writable path.
fn probe_tool(workspace: &Workspace, name: &str, extra: &str, port: u16) -> String {
    let path = workspace.path();
    let work = path.join("work");
    let args = [
        workspace.state_dir().join("agentgate.db"),
        path.join("credentials").join("token"),
        path.join("deliver.secret"),
        path.join("control.sock"),
        outside(workspace, name),
        work.clone(),
        port.to_string().into(),
        work.join(format!("{name}.json")),
    ];
    let argv: Vec<String> = ["/usr/bin/python3".into(), work.join("probe.py")]
        .iter()
        .chain(&args)
        .map(|arg| format!("{:?}", arg.display().to_string()))
        .collect();
    format!(
        "[tools.{name}]\ndescription = \"Probes what it can reach\"\ncommand = [{}]\nwritable = [{:?}]\ntimeout = \"20s\"\n{extra}\n",
        argv.join(", "),
        path.display().to_string()
    )
}

fn report(workspace: &Workspace, name: &str) -> BTreeMap<String, String> {
    let path = workspace.path().join("work").join(format!("{name}.json"));
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{name}'s report: {err}"));
    let value: Value = serde_json::from_str(&text).expect("a JSON report");
    value
        .as_object()
        .expect("an object")
        .iter()
        .map(|(key, value)| (key.clone(), value.as_str().unwrap_or("").to_string()))
        .collect()
}

fn escapes(report: &BTreeMap<String, String>) -> Vec<&str> {
    [
        "read_database",
        "read_credential",
        "read_secret_file",
        "connect_control_socket",
        "write_outside_writable",
        "reach_loopback",
    ]
    .into_iter()
    .filter(|escape| report.get(*escape).map(String::as_str) == Some("done"))
    .collect()
}

fn prepare(workspace: &Workspace) {
    let path = workspace.path();
    std::fs::create_dir_all(path.join("work")).expect("work dir");
    std::fs::write(path.join("work").join("probe.py"), PROBE).expect("probe");
    std::fs::create_dir_all(path.join("credentials")).expect("credentials dir");
    std::fs::write(path.join("credentials").join("token"), TOKEN).expect("credential");
    std::fs::write(path.join("deliver.secret"), DELIVER_SECRET).expect("secret file");
}

#[test]
fn a_sandboxed_tool_reaches_only_what_the_operator_allowed() {
    let workspace = Workspace::new();
    prepare(&workspace);
    let model = Stub::scripted(vec![
        Reply::tool_call("c1", "strict", json!({})),
        Reply::tool_call("c2", "networked", json!({})),
        Reply::tool_call("c3", "unconfined", json!({})),
        Reply::answer("probed"),
    ]);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let port = model
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let tools = [
        probe_tool(&workspace, "strict", "", port),
        probe_tool(&workspace, "networked", "network = true", port),
        probe_tool(&workspace, "unconfined", "sandbox = \"none\"", port),
    ]
    .concat();
    workspace.write_config(&format!(
        r#"{model}
{tools}
[routes.hook]
path = "/hook"
verify = {{ scheme = "bearer", secret = {{ credential = "token" }} }}
tools = ["strict", "networked", "unconfined"]
deliver = {{ kind = "http", url = "{receiver}/results", secret = {{ file = {secret:?} }} }}
"#,
        model = model.model_section(),
        receiver = receiver.url(),
        secret = workspace
            .path()
            .join("deliver.secret")
            .display()
            .to_string(),
    ));
    let credentials = workspace.path().join("credentials");
    let daemon = workspace.start_with_env(&[(
        "CREDENTIALS_DIRECTORY",
        credentials.to_str().expect("utf-8"),
    )]);
    let posted = daemon.post_json(
        "/hook",
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "{}",
    );
    assert_eq!(posted.status, 202, "{posted:?}");
    assert_eq!(
        workspace.wait_terminal(&posted.event_id(), LIMIT),
        "completed"
    );

    let strict = report(&workspace, "strict");
    assert_eq!(escapes(&strict), Vec::<&str>::new(), "{strict:#?}");
    for legitimate in ["write_in_writable", "read_system_file", "write_private_tmp"] {
        assert_eq!(strict[legitimate], "done", "{legitimate}: {strict:#?}");
    }
    assert!(!outside(&workspace, "strict").exists());
    assert!(
        !Path::new("/tmp/agentgate-probe-strict.json").exists(),
        "its /tmp is its own"
    );

    let networked = report(&workspace, "networked");
    assert_eq!(escapes(&networked), ["reach_loopback"], "{networked:#?}");

    // The same probe, unconfined, escapes every time: the probe sees escapes.
    let unconfined = report(&workspace, "unconfined");
    assert_eq!(escapes(&unconfined).len(), 6, "{unconfined:#?}");
    let _ = std::fs::remove_file("/tmp/agentgate-probe-unconfined.json");
    for name in ["strict", "networked", "unconfined"] {
        let _ = std::fs::remove_file(outside(&workspace, name));
    }
    let log = daemon.log();
    assert!(log.contains("sandbox=\"bubblewrap\""), "{log}");
}

/// A strict tool whose sandbox cannot be set up does not run, and never runs unconfined: the
/// model is told why, and `status` and the journal say so. (Here bubblewrap is named by
/// AGENTGATE_BWRAP as a program that does not exist.)
#[test]
fn a_strict_tool_without_a_sandbox_fails_and_says_why() {
    let workspace = Workspace::new();
    prepare(&workspace);
    let marker = workspace.path().join("work").join("ran");
    let model = Stub::scripted(vec![
        Reply::tool_call("c1", "touch", json!({})),
        Reply::answer("done"),
    ]);
    workspace.write_config(&format!(
        r#"{model}
[tools.touch]
command = ["/usr/bin/touch", {marker:?}]
writable = [{work:?}]

[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
tools = ["touch"]
"#,
        model = model.model_section(),
        marker = marker.display().to_string(),
        work = workspace.path().join("work").display().to_string(),
    ));
    let daemon = workspace.start_with_env(&[("AGENTGATE_BWRAP", "/nonexistent/bwrap")]);
    let posted = daemon.post_json("/hook", &[], "{}");
    assert_eq!(
        workspace.wait_terminal(&posted.event_id(), LIMIT),
        "completed"
    );
    assert!(!marker.exists(), "the tool ran without a sandbox");
    let requests = model.requests();
    let last = requests.last().expect("a request").json().to_string();
    assert!(
        last.contains("not run: the sandbox cannot be set up"),
        "{last}"
    );
    let status = workspace.status();
    assert_eq!(status["sandbox"]["available"], false, "{status}");
    assert!(daemon.log().contains("no tool sandbox"), "{}", daemon.log());
}

/// The agent cannot loosen its own leash: `check-config` flags a config file others may write,
/// and a tool whose writable path holds what configures agentgate.
#[test]
fn check_config_flags_what_a_tool_or_another_user_could_rewrite() {
    use std::os::unix::fs::PermissionsExt;
    let workspace = Workspace::new();
    let config = format!(
        "[tools.editor]\ncommand = [\"/bin/true\"]\nwritable = [{:?}]\n\n[routes.hook]\npath = \"/hook\"\nverify = {{ scheme = \"none\" }}\ntools = [\"editor\"]\n",
        workspace.path().display().to_string()
    );
    workspace.write_config(&config);
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout).into_owned();
    assert!(checked.status.success(), "{checked:?}");
    assert!(
        said.contains("tools.editor.writable includes")
            && said.contains(&workspace.config_path().display().to_string()),
        "{said}"
    );
    if is_root() {
        // Written by root, 0644: nobody else may rewrite it.
        assert!(
            !said.contains("is writable by a user other than root"),
            "{said}"
        );
    }
    std::fs::set_permissions(
        workspace.config_path(),
        std::fs::Permissions::from_mode(0o666),
    )
    .expect("chmod");
    let said = String::from_utf8_lossy(&workspace.cli(&["check-config"]).stdout).into_owned();
    assert!(
        said.contains("is writable by a user other than root"),
        "{said}"
    );
}

/// A strict tool or stdio MCP server whose program or working directory is under /tmp would not
/// find it in its private /tmp: `check-config` says so, and does not for `sandbox = "none"`.
#[test]
fn check_config_warns_of_programs_the_private_tmp_hides() {
    let workspace = Workspace::new();
    let config = "[tools.script]\ncommand = [\"/bin/sh\", \"/tmp/tools/run.sh\"]\n\n\
        [tools.open]\ncommand = [\"/tmp/tools/open\"]\nsandbox = \"none\"\n\n\
        [mcp.local]\ncommand = [\"/usr/bin/node\", \"server.js\"]\ncwd = \"/tmp/mcp\"\n\n\
        [routes.hook]\npath = \"/hook\"\nverify = { scheme = \"none\" }\ntools = [\"script\", \"open\", \"local.*\"]\n";
    workspace.write_config(config);
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout).into_owned();
    assert!(checked.status.success(), "{checked:?}");
    assert!(
        said.contains("tools.script: /tmp/tools/run.sh is under /tmp"),
        "{said}"
    );
    assert!(said.contains("mcp.local: /tmp/mcp is under /tmp"), "{said}");
    assert!(!said.contains("/tmp/tools/open is under /tmp"), "{said}");
}

/// Where systemd's `agentgate-tool.socket` would run each call in an `agentgate-tool@.service`
/// instance, `systemd-socket-activate --accept --inetd` starts `agentgate tool-exec` for each
/// connection the same way. Each sandboxed call goes there: its output reaches the model, and a
/// call past its timeout is stopped with everything it started.
#[test]
fn each_sandboxed_call_runs_in_a_tool_unit_of_its_own() {
    let workspace = Workspace::new();
    let socket = workspace.path().join("tool.sock");
    let units_log = workspace.path().join("units.log");
    let activator = std::process::Command::new("systemd-socket-activate")
        .args(["--accept", "--inetd", "-l"])
        .arg(&socket)
        .args([BIN, "tool-exec"])
        .stderr(std::fs::File::create(&units_log).expect("log"))
        .spawn()
        .expect("systemd-socket-activate");
    let _activator = KillOnDrop(activator);
    wait_until("the tool socket", LIMIT, || socket.exists());
    let pid_file = workspace.path().join("work").join("sleeper.pid");
    std::fs::create_dir_all(pid_file.parent().expect("dir")).expect("work dir");
    let model = Stub::scripted(vec![
        Reply::tool_call("c1", "greet", json!({})),
        Reply::tool_call("c2", "sleeper", json!({})),
        Reply::answer("done"),
    ]);
    workspace.write_config(&format!(
        r#"{model}
[tools.greet]
description = "Says hello"
command = ["/bin/echo", "hello from a unit"]

[tools.sleeper]
description = "Starts a grandchild and outlives its timeout"
command = ["/bin/sh", "-c", "sleep 300 & echo $$ > {pid}; wait"]
writable = [{work:?}]
timeout = "1s"

[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
tools = ["greet", "sleeper"]
"#,
        model = model.model_section(),
        pid = pid_file.display(),
        work = pid_file.parent().expect("dir").display().to_string(),
    ));
    let daemon =
        workspace.start_with_env(&[("AGENTGATE_TOOL_SOCKET", socket.to_str().expect("utf-8"))]);
    daemon.wait_for_log("each call runs in a unit of its own");
    let id = daemon.post_json("/hook", &[], "{}").event_id();
    assert_eq!(workspace.wait_terminal(&id, LIMIT), "completed");
    let requests = model.requests();
    let results = requests
        .last()
        .expect("the last request")
        .json()
        .to_string();
    assert!(results.contains("hello from a unit"), "{results}");
    assert!(results.contains("timed_out"), "{results}");
    let log = std::fs::read_to_string(&units_log).expect("units log");
    // The start's trial, then one unit per call.
    assert_eq!(log.matches("Spawned ").count(), 3, "{log}");
    let log = daemon.log();
    assert!(
        log.contains("sandbox=\"systemd unit, bubblewrap\""),
        "{log}"
    );
    // The sleeper's shell ran in a pid namespace; nothing named sleep 300 is left on the host.
    wait_until("the timed-out call's processes to be gone", LIMIT, || {
        !std::process::Command::new("pgrep")
            .args(["-f", "^sleep 300$"])
            .status()
            .is_ok_and(|status| status.success())
    });
}
