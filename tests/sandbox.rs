//! Tools run least-privileged (docs/tools.md, "Sandbox"): the real binary runs a tool that tries
//! every way out a prompt-injected model could ask of it, and each fails while the same tool's
//! legitimate work succeeds. The same probe with `sandbox = "none"` gets out each time, which
//! shows that the probe can see a way out. Under the packaged units the same probe runs in
//! tests/package.rs.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::stub::{Reply, Stub};
use common::*;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);
const TOKEN: &str = "bearer-token-7d1c";
const DELIVER_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

/// Tries each way out and each legitimate action (tests/common/escape-probe.py).
const PROBE: &str = include_str!("common/escape-probe.py");

/// A workspace on the host's disk rather than under `/tmp`, which a sandbox replaces: what stays
/// out of a tool's sight there does so because it is hidden, not because `/tmp` is private.
fn disk_workspace() -> Workspace {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a workspace");
    let state = dir.path().join("state");
    Workspace::with_state_dir(dir, state)
}

/// The probe tool's table: `name`, with `extra` keys (sandbox, network), trying what `plan`
/// says. Its writable path is the workspace's `work` directory, next to the state, the
/// credentials, the secret file, the config and the control socket.
fn probe_tool(workspace: &Workspace, name: &str, extra: &str, plan: &Value) -> String {
    let work = probe_dir(workspace, name);
    let plan_file = work.join(format!("{name}.plan.json"));
    let mut plan = plan.clone();
    plan["write"]["write_outside_writable"] = json!(outside(workspace, name));
    plan["legit"]["write_private_tmp"] = json!(["write", private_tmp_file(name)]);
    std::fs::write(&plan_file, plan.to_string()).expect("the plan");
    let argv = [
        "/usr/bin/python3".to_string(),
        work.join("probe.py").display().to_string(),
        plan_file.display().to_string(),
        work.join(format!("{name}.json")).display().to_string(),
    ];
    format!(
        "[tools.{name}]\ndescription = \"Probes what it can reach\"\ncommand = {argv:?}\nwritable = [{:?}]\ntimeout = \"20s\"\n{extra}\n",
        work.display().to_string()
    )
}

/// Where a probe's script, plan and report are: the strict tools' writable `work`, and a
/// directory apart for the unconfined one, since nothing that runs as the daemon's user may
/// read what a tool may write (check-config refuses it).
fn probe_dir(workspace: &Workspace, name: &str) -> PathBuf {
    match name {
        "unconfined" => workspace.path().join("work-unconfined"),
        _ => workspace.path().join("work"),
    }
}

/// A file in the workspace, outside the probe's writable path.
fn outside(workspace: &Workspace, name: &str) -> PathBuf {
    workspace.path().join(format!("outside-{name}.txt"))
}

/// Where the probe writes in its private `/tmp`: on the host, nothing should appear there.
fn private_tmp_file(name: &str) -> PathBuf {
    PathBuf::from(format!(
        "/tmp/agentgate-probe-{}-{name}.txt",
        std::process::id()
    ))
}

/// The probe's report: each way out, and each legitimate action.
fn report(
    workspace: &Workspace,
    name: &str,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let path = probe_dir(workspace, name).join(format!("{name}.json"));
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{name}'s report: {err}"));
    let value: Value = serde_json::from_str(&text).expect("a JSON report");
    let part = |key: &str| {
        value[key]
            .as_object()
            .expect("an object")
            .iter()
            .map(|(key, value)| (key.clone(), value.as_str().unwrap_or("").to_string()))
            .collect()
    };
    (part("escapes"), part("legit"))
}

/// The ways out that worked.
fn escapes(report: &BTreeMap<String, String>) -> Vec<&str> {
    report
        .iter()
        .filter(|(_, outcome)| *outcome == "done")
        .map(|(escape, _)| escape.as_str())
        .collect()
}

fn prepare(workspace: &Workspace) {
    let path = workspace.path();
    for work in ["work", "work-unconfined"] {
        std::fs::create_dir_all(path.join(work)).expect("work dir");
        std::fs::write(path.join(work).join("probe.py"), PROBE).expect("probe");
    }
    std::fs::create_dir_all(path.join("credentials")).expect("credentials dir");
    std::fs::write(path.join("credentials").join("token"), TOKEN).expect("credential");
    std::fs::write(path.join("deliver.secret"), DELIVER_SECRET).expect("secret file");
}

/// A Unix socket listening under `/run` (root only): where the host's services keep theirs.
struct RunSocket {
    path: PathBuf,
    _listener: std::os::unix::net::UnixListener,
}

impl RunSocket {
    /// `None` when not root and `AGENTGATE_TEST_SKIP` lists `root` (see [`can_run`]).
    fn bind(test: &str, name: &str) -> Option<RunSocket> {
        if !can_run(test, Need::Root, is_root()) {
            return None;
        }
        let path = PathBuf::from(format!(
            "/run/agentgate-probe-{}-{name}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("a socket under /run");
        Some(RunSocket {
            path,
            _listener: listener,
        })
    }
}

impl Drop for RunSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What the probe tries from each tool: the state, a credential, a secret file, the config, the
/// control socket, an abstract socket, the host's loopback (`port`), a service's socket under
/// `/run` and the host's cgroup tree (v2, or v1's hierarchies: every service's name and use);
/// and the legitimate work.
fn escape_plan(
    workspace: &Workspace,
    port: u16,
    abstract_name: &str,
    service_socket: Option<&RunSocket>,
) -> Value {
    let path = workspace.path();
    let mut plan = json!({
        "read": {
            "read_database": workspace.state_dir().join("agentgate.db"),
            "read_credential": path.join("credentials").join("token"),
            "read_secret_file": path.join("deliver.secret"),
            "read_config": workspace.config_path(),
        },
        "stream": {"connect_control_socket": path.join("control.sock")},
        "abstract": {"connect_abstract_socket": abstract_name},
        "tcp": {"reach_loopback": port},
        "legit": {
            "write_in_writable": ["write", path.join("work").join("legit.txt")],
            "read_system_file": ["read", "/etc/os-release"],
        },
    });
    if let Some(socket) = service_socket {
        plan["stream"]["connect_service_socket_under_run"] = json!(socket.path);
    }
    if let Some(cgroups) = [
        "/sys/fs/cgroup/cgroup.procs",
        "/sys/fs/cgroup/systemd/cgroup.procs",
    ]
    .into_iter()
    .find(|file| Path::new(file).exists())
    {
        plan["read"]["read_the_cgroup_tree"] = json!(cgroups);
    }
    plan
}

#[test]
fn a_sandboxed_tool_reaches_only_what_the_operator_allowed() {
    let workspace = disk_workspace();
    prepare(&workspace);
    let model = Stub::scripted(vec![
        Reply::tool_call("c1", "strict", json!({})),
        Reply::tool_call("c2", "networked", json!({})),
        Reply::tool_call("c3", "unconfined", json!({})),
        Reply::answer("probed"),
    ]);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let port: u16 = model
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let service_socket = RunSocket::bind(
        "a_sandboxed_tool_reaches_only_what_the_operator_allowed (a service's socket under /run)",
        "service",
    );
    let abstract_name = format!("agentgate-probe-{}", std::process::id());
    let abstract_listener = {
        use std::os::linux::net::SocketAddrExt;
        let address = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .expect("an abstract address");
        std::os::unix::net::UnixListener::bind_addr(&address).expect("an abstract socket")
    };
    let plan = escape_plan(&workspace, port, &abstract_name, service_socket.as_ref());
    let path = workspace.path();
    let tools = [
        probe_tool(&workspace, "strict", "", &plan),
        probe_tool(&workspace, "networked", "network = true", &plan),
        probe_tool(&workspace, "unconfined", "sandbox = \"none\"", &plan),
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
        secret = path.join("deliver.secret").display().to_string(),
    ));
    let credentials = path.join("credentials");
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
    drop(abstract_listener);

    let (strict, legit) = report(&workspace, "strict");
    assert_eq!(escapes(&strict), Vec::<&str>::new(), "{strict:#?}");
    assert_eq!(escapes(&legit).len(), legit.len(), "{legit:#?}");
    assert!(!outside(&workspace, "strict").exists());
    assert!(!private_tmp_file("strict").exists(), "its /tmp is its own");

    // With the network: the host's loopback, abstract sockets and service sockets, nothing else.
    let (networked, _) = report(&workspace, "networked");
    let mut reached = vec!["connect_abstract_socket", "reach_loopback"];
    if service_socket.is_some() {
        reached.insert(1, "connect_service_socket_under_run");
    }
    assert_eq!(escapes(&networked), reached, "{networked:#?}");

    // The same probe, unconfined, gets out every time: the probe sees a way out.
    let (unconfined, _) = report(&workspace, "unconfined");
    assert_eq!(
        escapes(&unconfined).len(),
        unconfined.len(),
        "{unconfined:#?}"
    );
    let _ = std::fs::remove_file(private_tmp_file("unconfined"));
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

/// Runs `agentgate ARGS --config CONFIG`, which must exit within a few seconds.
fn exits(workspace: &Workspace, args: &[&str]) -> std::process::Output {
    let mut child = std::process::Command::new(BIN)
        .args(args)
        .arg("--config")
        .arg(workspace.config_path())
        .env_remove("AGENTGATE_CONFIG")
        .env_remove("NOTIFY_SOCKET")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("agentgate");
    let deadline = std::time::Instant::now() + LIMIT;
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("agentgate {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

/// The agent cannot loosen its own leash: a tool whose writable path holds what configures
/// agentgate (here the config, the state and the control socket) could rename it and plant its
/// own for the next reload, so `check-config`, `serve` and `reload` refuse the config; and
/// `check-config` flags a config file others may write.
#[test]
fn a_writable_path_that_holds_the_config_or_the_state_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let workspace = Workspace::new();
    let work = workspace.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    let config = |writable: &Path| {
        format!(
            "[model]\nbackend = \"replay\"\n\n[tools.editor]\ncommand = [\"/bin/true\"]\nwritable = [{:?}]\n\n[routes.hook]\npath = \"/hook\"\nverify = {{ scheme = \"none\" }}\ntools = [\"editor\"]\n",
            writable.display().to_string()
        )
    };
    workspace.write_config(&config(workspace.path()));
    let refused = |output: &std::process::Output, workspace: &Workspace| {
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(output.status.code(), Some(78), "{said}");
        assert!(
            said.contains("tools.editor.writable")
                && said.contains(&format!("{} holds", workspace.path().display())),
            "{said}"
        );
    };
    refused(&workspace.cli(&["check-config"]), &workspace);
    workspace.release_port();
    refused(&exits(&workspace, &["serve"]), &workspace);

    // A daemon on a config that keeps it apart refuses the same change at a reload.
    let workspace = Workspace::new();
    let work = workspace.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    workspace.write_config(&config(&work));
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout).into_owned();
    assert!(checked.status.success(), "{checked:?}");
    if is_root() {
        // Written by root, 0644: nobody else may rewrite it.
        assert!(
            !said.contains("is writable by a user other than root"),
            "{said}"
        );
    }
    let _daemon = workspace.start();
    workspace.write_config(&config(workspace.path()));
    refused(&workspace.cli(&["reload"]), &workspace);
    std::fs::set_permissions(
        workspace.config_path(),
        std::fs::Permissions::from_mode(0o666),
    )
    .expect("chmod");
    workspace.write_config(&config(&work));
    let said = String::from_utf8_lossy(&workspace.cli(&["check-config"]).stdout).into_owned();
    assert!(
        said.contains("is writable by a user other than root"),
        "{said}"
    );
}

/// Whether a line of `said` holds every one of `parts`.
fn has_line(said: &str, parts: &[&str]) -> bool {
    said.lines()
        .any(|line| parts.iter().all(|part| line.contains(part)))
}

/// What one tool may write, no other child may run and no other tool may be given: a program
/// inside a tool's writable path, or a writable path inside another's, makes the config invalid;
/// a script there is a warning. A writable path that is a symbolic link to the state (as a
/// tool could plant one) is refused with an error that says it is a link.
#[test]
fn a_tool_cannot_plant_what_another_child_runs_or_is_given_to_write() {
    let workspace = Workspace::new();
    let shared = workspace.path().join("shared");
    std::fs::create_dir_all(shared.join("inner")).expect("dirs");
    for file in ["run.sh", "script.sh"] {
        std::fs::write(shared.join(file), "#!/bin/sh\n").expect("write");
    }
    let at = |name: &str| shared.join(name).display().to_string();
    let config = format!(
        "[model]\nbackend = \"replay\"\n\n\
         [tools.writer]\ncommand = [\"/bin/true\"]\nwritable = [{shared:?}]\n\n\
         [tools.runner]\ncommand = [{run:?}]\nnetwork = true\n\n\
         [tools.inner]\ncommand = [\"/bin/true\"]\nwritable = [{inner:?}]\n\n\
         [tools.script]\ncommand = [\"/bin/sh\", {script:?}]\n\n\
         [mcp.local]\ncommand = [\"python3\", \"script.sh\"]\ncwd = {shared:?}\n\n\
         [routes.hook]\npath = \"/hook\"\nverify = {{ scheme = \"none\" }}\n\
         tools = [\"writer\", \"runner\", \"inner\", \"script\"]\n",
        shared = shared.display().to_string(),
        run = at("run.sh"),
        inner = at("inner"),
        script = at("script.sh"),
    );
    workspace.write_config(&config);
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout).into_owned();
    assert_eq!(checked.status.code(), Some(78), "{said}");
    let says = |parts: &[&str]| has_line(&said, parts);
    let program = format!(
        "its program {} is in a path tools.writer may write",
        at("run.sh")
    );
    assert!(says(&["error: tools.runner:", &program]), "{said}");
    assert!(
        says(&[
            "error: tools.inner.writable:",
            "is inside tools.writer.writable"
        ]),
        "{said}"
    );
    assert!(
        says(&[
            "warning: tools.script:",
            &format!("{} (a file or directory its command names", at("script.sh"))
        ]),
        "{said}"
    );
    // A program named without a slash is found in PATH, not in its working directory; a script
    // named relative to that directory is found there; the directory itself is refused, since
    // interpreters load modules from it.
    assert!(!says(&["mcp.local:", "its program"]), "{said}");
    assert!(says(&["warning: mcp.local:", &at("script.sh")]), "{said}");
    assert!(
        says(&["error: mcp.local:", "its working directory"]),
        "{said}"
    );
    // Two tools may share a directory.
    let sharing = config.replace(&at("inner"), &shared.display().to_string());
    let sharing = sharing.replace(
        &format!("command = [{:?}]", at("run.sh")),
        "command = [\"/bin/true\"]",
    );
    let sharing = sharing.replace(
        &format!("cwd = {:?}", shared.display().to_string()),
        "cwd = \"/\"",
    );
    workspace.write_config(&sharing);
    let checked = workspace.cli(&["check-config"]);
    assert!(checked.status.success(), "{checked:?}");

    // A writable path that has become a link to the state directory.
    let state = workspace.state_dir();
    std::fs::create_dir_all(&state).expect("state dir");
    let link = workspace.path().join("out");
    std::os::unix::fs::symlink(&state, &link).expect("symlink");
    workspace.write_config(&format!(
        "[model]\nbackend = \"replay\"\n\n\
         [tools.victim]\ncommand = [\"/bin/true\"]\nwritable = [{:?}]\n\n\
         [routes.hook]\npath = \"/hook\"\nverify = {{ scheme = \"none\" }}\ntools = [\"victim\"]\n",
        link.display().to_string(),
    ));
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout).into_owned();
    assert_eq!(checked.status.code(), Some(78), "{said}");
    assert!(
        said.contains(&format!("{} is a symbolic link", link.display())),
        "{said}"
    );
}

/// The ways around the plant check that a hostile tool found on a packaged install, each
/// refused or warned of: a program reached through a link inside a writable path, a relative
/// program, a program looked up in a PATH directory a tool may write, an MCP server's working
/// directory there, a repository or a script not yet written there, a writable path nested
/// inside another through a link, a writable path in the system's own directories (systemd
/// reads a template's new drop-in at the next call), and the replay cassette the daemon reads.
#[test]
fn a_tool_cannot_plant_through_links_search_paths_working_directories_or_system_directories() {
    let workspace = Workspace::new();
    let root = workspace.path().canonicalize().expect("workspace");
    let srv = root.join("srv");
    let release = root.join("opt/v1");
    for dir in [
        srv.join("bin"),
        srv.join("repo"),
        release.join("bin"),
        release.join("data"),
    ] {
        std::fs::create_dir_all(&dir).expect("dirs");
    }
    std::fs::write(release.join("bin/status"), "#!/bin/sh\n").expect("program");
    std::os::unix::fs::symlink(&release, srv.join("current")).expect("link");
    let cassette = srv.join("cassette.jsonl");
    std::fs::copy("examples/triage.cassette.jsonl", &cassette).expect("cassette");
    let at = |path: &Path| path.display().to_string();
    let relative = at(&srv.join("bin/rel"));
    let config = format!(
        "[model]\nbackend = \"replay\"\ncassette = {cassette:?}\n\n\
         [tools.deploy]\ncommand = [\"/bin/true\"]\nwritable = [{srv:?}]\n\n\
         [tools.installer]\ncommand = [\"/bin/true\"]\nwritable = [\"/usr/local\"]\n\n\
         [tools.status]\ncommand = [{status:?}]\nnetwork = true\n\n\
         [tools.rel]\ncommand = [{relative:?}]\n\n\
         [tools.bare]\ncommand = [\"planted-tool\"]\n\n\
         [tools.git]\ncommand = [\"/usr/bin/git\", \"-C\", {repo:?}, \"status\"]\n\n\
         [tools.job]\ncommand = [\"/usr/bin/python3\", {job:?}]\n\n\
         [tools.inner]\ncommand = [\"/bin/true\"]\nwritable = [{data:?}]\n\n\
         [mcp.demo]\ncommand = [\"/usr/bin/python3\", \"-m\", \"demo_mcp\"]\ncwd = {srv:?}\n\n\
         [routes.hook]\npath = \"/hook\"\nverify = {{ scheme = \"none\" }}\n\
         tools = [\"deploy\", \"installer\", \"status\", \"rel\", \"bare\", \"git\", \"job\", \"inner\"]\n",
        cassette = at(&cassette),
        srv = at(&srv),
        status = at(&srv.join("current/bin/status")),
        relative = relative.trim_start_matches('/'),
        repo = at(&srv.join("repo")),
        job = at(&srv.join("job.py")),
        data = at(&srv.join("current/data")),
    );
    workspace.write_config(&config);
    let path = format!("{}:/usr/bin:/bin", at(&srv.join("bin")));
    let checked = std::process::Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(workspace.config_path())
        .env("PATH", &path)
        .env_remove("AGENTGATE_CONFIG")
        .output()
        .expect("check-config");
    let said = String::from_utf8_lossy(&checked.stdout).into_owned();
    assert_eq!(checked.status.code(), Some(78), "{said}");
    let says = |parts: &[&str]| has_line(&said, parts);
    let expected: [&[&str]; 9] = [
        &[
            "error: tools.status:",
            "its program",
            "tools.deploy may write",
        ],
        &["error: tools.rel:", "its program", "tools.deploy may write"],
        &[
            "error: tools.bare:",
            "looked up in PATH",
            "tools.deploy may write",
        ],
        &[
            "error: mcp.demo:",
            "its working directory",
            "tools.deploy may write",
        ],
        &[
            "warning: tools.git:",
            &at(&srv.join("repo")),
            "tools.deploy may write",
        ],
        &["warning: tools.job:", "job.py", "tools.deploy may write"],
        &[
            "error: tools.inner.writable:",
            "inside tools.deploy.writable",
        ],
        &[
            "error: tools.installer.writable:",
            "/usr/local",
            "where the system keeps",
        ],
        &[
            "error: model.cassette:",
            "tools.deploy may write",
            "the daemon reads it",
        ],
    ];
    for parts in expected {
        assert!(says(parts), "{parts:?} in:\n{said}");
    }
    // PATH directories after the one that holds the program are never looked in.
    assert!(!says(&["tools.installer:", "looked up in PATH"]), "{said}");
}

/// What the second-round test's config names: a secret behind a link in the writable `srv`,
/// a link from `srv` back to itself, and scripts in `real` whose `#!` lines lead into `srv`.
fn lay_out_planting_ground(srv: &Path, real: &Path) {
    for dir in [srv.join("bin"), real.join("bin")] {
        std::fs::create_dir_all(&dir).expect("dirs");
    }
    std::fs::write(real.join("hmac"), "a-secret-of-32-bytes-at-least-00").expect("secret");
    std::os::unix::fs::symlink(real, srv.join("secrets")).expect("link");
    std::os::unix::fs::symlink(srv, srv.join("self")).expect("self link");
    std::fs::write(
        real.join("bin/tool"),
        format!("#!{}/bin/interp\n", srv.display()),
    )
    .expect("script");
    // A script whose interpreter is a script whose `#!` line names a file a tool may write, and
    // one whose `env` runs a program looked up in a PATH a tool may write.
    std::fs::write(
        real.join("bin/chained"),
        "#!/usr/bin/env -S python3 -X dev\n",
    )
    .expect("chained");
    std::fs::write(
        real.join("bin/middle"),
        format!("#!/usr/bin/node --require {}/evil.js\n", srv.display()),
    )
    .expect("middle");
    std::fs::write(
        real.join("bin/outer"),
        format!("#!{}/bin/middle\n", real.display()),
    )
    .expect("outer");
}

/// The second round of ways around the plant check: a secret reached through a link a tool may
/// re-point, a child's environment that names a writable path (PATH, PYTHONPATH, quoted,
/// relative to its cwd), a script or argument file given to an unconfined child, a path inside
/// an option (`--require=…`), a program whose `#!` line (or its interpreter's, or `env`'s
/// program) leads there, and a writable path that is a link to another's.
#[test]
fn a_tool_cannot_plant_through_secrets_environments_options_or_interpreters() {
    let workspace = Workspace::new();
    let root = workspace.path().canonicalize().expect("workspace");
    let (srv, real) = (root.join("srv"), root.join("real"));
    lay_out_planting_ground(&srv, &real);
    let at = |path: &Path| path.display().to_string();
    let config = format!(
        "[model]\nbackend = \"replay\"\n\n\
         [tools.deploy]\ncommand = [\"/bin/true\"]\nwritable = [{srv:?}]\n\n\
         [tools.inner]\ncommand = [\"/bin/true\"]\nwritable = [{self_link:?}]\n\n\
         [tools.open]\ncommand = [\"/usr/bin/python3\", {job:?}]\nsandbox = \"none\"\n\n\
         [tools.node]\ncommand = [\"/usr/bin/node\", {require:?}, \"/srv/app.js\"]\n\n\
         [tools.shebang]\ncommand = [{shebang:?}]\n\n\
         [mcp.py]\ncommand = [\"/usr/bin/python3\", \"-m\", \"fetch\"]\n\
         env = {{ PYTHONPATH = {py:?} }}\n\n\
         [mcp.npx]\ncommand = [\"npx\", \"server\"]\nenv = {{ PATH = {path:?} }}\n\n\
         [mcp.quoted]\ncommand = [\"/usr/bin/node\", \"/opt/app.js\"]\n\
         env = {{ NODE_OPTIONS = {quoted:?} }}\n\n\
         [mcp.relative]\ncommand = [\"/usr/bin/python3\", \"-m\", \"app\"]\ncwd = {root:?}\n\
         env = {{ PYTHONPATH = \"srv\" }}\n\n\
         [mcp.chained]\ncommand = [{chained:?}]\nenv = {{ PATH = {path:?} }}\n\n\
         [mcp.outer]\ncommand = [{outer:?}]\n\n\
         [tools.java]\ncommand = [\"/usr/bin/java\", {argfile:?}]\nsandbox = \"none\"\n\n\
         [routes.hook]\npath = \"/hook\"\n\
         verify = {{ scheme = \"github\", secret = {{ file = {secret:?} }} }}\n\
         tools = [\"deploy\", \"inner\", \"open\", \"node\", \"shebang\"]\n",
        srv = at(&srv),
        self_link = at(&srv.join("self")),
        job = at(&srv.join("job.py")),
        require = format!("--require={}", srv.join("evil.js").display()),
        shebang = at(&real.join("bin/tool")),
        py = at(&srv.join("py")),
        path = format!("{}:/usr/bin:/bin", srv.join("bin").display()),
        secret = at(&srv.join("secrets/hmac")),
        quoted = format!("--require \"{}\"", srv.join("evil.js").display()),
        root = at(&root),
        chained = at(&real.join("bin/chained")),
        outer = at(&real.join("bin/outer")),
        argfile = format!("@{}", srv.join("jvm.args").display()),
    );
    workspace.write_config(&config);
    let checked = workspace.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stdout).into_owned();
    assert_eq!(checked.status.code(), Some(78), "{said}");
    let says = |parts: &[&str]| has_line(&said, parts);
    let hmac = at(&srv.join("secrets/hmac"));
    let expected: [&[&str]; 12] = [
        &["error: mcp.quoted:", "environment variable NODE_OPTIONS"],
        &["error: mcp.relative:", "environment variable PYTHONPATH"],
        &[
            "error: mcp.chained:",
            "looked up in PATH",
            "tools.deploy may write",
        ],
        &[
            "error: mcp.outer:",
            "the #! line of",
            "tools.deploy may write",
        ],
        &["error: tools.java:", "jvm.args", "tools.deploy may write"],
        &[
            "error: tools.deploy.writable:",
            &hmac,
            "reached through a link",
        ],
        &["error: mcp.py:", "environment variable PYTHONPATH"],
        &[
            "error: mcp.npx:",
            "looked up in PATH",
            "tools.deploy may write",
        ],
        &["error: tools.open:", "job.py", "tools.deploy may write"],
        &["warning: tools.node:", "evil.js", "tools.deploy may write"],
        &["error: tools.shebang:", "#! line", "tools.deploy may write"],
        &[
            "error: tools.inner.writable:",
            "inside tools.deploy.writable",
        ],
    ];
    for parts in expected {
        assert!(says(parts), "{parts:?} in:\n{said}");
    }
    assert!(!said.contains("a-secret-of"), "{said}");
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
/// connection the same way.
struct ToolUnits {
    socket: PathBuf,
    log: PathBuf,
    _activator: KillOnDrop,
}

impl ToolUnits {
    fn start(workspace: &Workspace) -> ToolUnits {
        let socket = workspace.path().join("tool.sock");
        let log = workspace.path().join("units.log");
        let activator = std::process::Command::new("systemd-socket-activate")
            .args(["--accept", "--inetd", "-l"])
            .arg(&socket)
            .args([BIN, "tool-exec"])
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("systemd-socket-activate");
        let units = ToolUnits {
            socket,
            log,
            _activator: KillOnDrop(activator),
        };
        wait_until("the tool socket", LIMIT, || units.socket.exists());
        units
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).expect("units log")
    }
}

/// Each sandboxed call goes to a tool unit: its output reaches the model, and a call past its
/// timeout is stopped with everything it started.
#[test]
fn each_sandboxed_call_runs_in_a_tool_unit_of_its_own() {
    let workspace = Workspace::new();
    let units = ToolUnits::start(&workspace);
    let socket = &units.socket;
    let pid_file = workspace.path().join("work").join("sleeper.pid");
    std::fs::create_dir_all(pid_file.parent().expect("dir")).expect("work dir");
    // A duration no other process on the host sleeps for, so the check below finds this
    // test's sleeper only (another run's, or another test's `sleep 300`, is not it).
    let sleep = format!("300.{}", std::process::id());
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
command = ["/bin/sh", "-c", "sleep {sleep} & echo $$ > {pid}; wait"]
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
    let (daemon, results) = one_event_through_units(&workspace, socket, &model, &[]);
    assert!(results.contains("hello from a unit"), "{results}");
    assert!(results.contains("timed_out"), "{results}");
    let log = units.log();
    // The start's trial and its check of the writable paths, then one unit per call.
    assert_eq!(log.matches("Spawned ").count(), 4, "{log}");
    let log = daemon.log();
    assert!(
        log.contains("sandbox=\"systemd unit, bubblewrap\""),
        "{log}"
    );
    // The sleeper's shell ran in a pid namespace; nothing of it is left on the host.
    let pattern = format!("^sleep {}$", sleep.replace('.', "\\."));
    wait_until("the timed-out call's processes to be gone", LIMIT, || {
        !std::process::Command::new("pgrep")
            .args(["-f", &pattern])
            .status()
            .is_ok_and(|status| status.success())
    });
}

/// A tool unit decides the least a sandbox hides, whatever it is asked: a request with no
/// sandbox, and one that hides nothing and has the network, are refused and logged, though they
/// come from a caller it admits (here, one in its own cgroup).
#[test]
fn a_tool_unit_refuses_a_call_below_its_floor() {
    let workspace = Workspace::new();
    let units = ToolUnits::start(&workspace);
    let plan = workspace.path().join("plan.json");
    std::fs::write(
        &plan,
        json!({"tool_socket": {"tool_socket": units.socket}}).to_string(),
    )
    .expect("plan");
    let probe = workspace.path().join("probe.py");
    std::fs::write(&probe, PROBE).expect("probe");
    let output = std::process::Command::new("/usr/bin/python3")
        .arg(&probe)
        .arg(&plan)
        .output()
        .expect("the probe");
    let report: Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|_| panic!("a report: {output:?}"));
    for attempt in [
        "tool_socket_null_confinement",
        "tool_socket_lax_confinement",
    ] {
        let outcome = report["escapes"][attempt].as_str().unwrap_or_default();
        assert!(outcome.starts_with("refused"), "{attempt}: {report:#}");
    }
    let log = units.log();
    assert!(
        log.contains("<3>refused: a call that asks for no sandbox"),
        "{log}"
    );
    assert!(
        log.contains("<3>refused: a call whose sandbox is below the floor: it does not hide"),
        "{log}"
    );
}

const README: &str = include_str!("../README.md");

/// A command exactly as the README shows it, as this test runs it: `cargo run --release --`
/// is the binary. The test fails if the README stops showing it.
fn readme_command(command: &str) -> String {
    assert!(
        README.lines().any(|line| line.trim() == command),
        "README.md no longer shows `{command}`"
    );
    let args = command
        .strip_prefix("cargo run --release -- ")
        .expect("a cargo run command");
    format!("{BIN} {args}")
}

/// The README's two commands, as a new user runs them from a fresh clone: `serve` on the
/// embedded defaults (a relative state directory), then `send demo`. The demo's turn calls its
/// `disk_usage` tool in the sandbox, and the tool's real output (`df -h`) is in the transcript.
/// (Root: a network and mount namespace of its own, so that the defaults' port and control
/// socket are the test's alone.)
#[test]
fn the_readme_s_two_commands_show_the_tool_s_output() {
    if !root_or_skip("the_readme_s_two_commands_show_the_tool_s_output") {
        return;
    }
    let clone = tempfile::tempdir().expect("a fresh clone's directory");
    let serve = readme_command("cargo run --release -- serve");
    let send = readme_command(
        r#"cargo run --release -- send demo --data '{"alert": "disk full on db-1"}'"#,
    );
    let script = format!(
        r#"set -u
ip link set lo up
mount -t tmpfs tmpfs /run
if [ -d /etc/agentgate ]; then mount -t tmpfs tmpfs /etc/agentgate; fi
cd {clone}
unset AGENTGATE_CONFIG
{serve} 2>serve.log &
daemon=$!
for _ in $(seq 300); do
    {send} >send.out 2>&1 && break
    sleep 0.1
done
id=$(grep -o '"event_id":"[^"]*"' send.out | cut -d'"' -f4)
for _ in $(seq 300); do
    {bin} events show "$id" --json 2>/dev/null | grep -q '"status": "completed"' && break
    sleep 0.1
done
{bin} sessions show "demo:$id" --json
kill -TERM $daemon
wait $daemon
"#,
        clone = clone.path().display(),
        bin = BIN,
    );
    let output = std::process::Command::new("unshare")
        .args(["-n", "-m", "--propagation", "private", "sh", "-c", &script])
        .output()
        .expect("unshare");
    let transcript = String::from_utf8_lossy(&output.stdout);
    let log = std::fs::read_to_string(clone.path().join("serve.log")).unwrap_or_default();
    let sent = std::fs::read_to_string(clone.path().join("send.out")).unwrap_or_default();
    assert!(sent.starts_with("202 "), "{sent}\n{log}");
    assert!(
        transcript.contains("Filesystem") && transcript.contains("Mounted on"),
        "the tool's output is not in the transcript: {transcript}\n{log}"
    );
    assert!(!transcript.contains("bwrap:"), "{transcript}");
    assert!(clone.path().join("agentgate-state").is_dir());
}

/// With `sandbox = "none"` no sandbox takes what a call leaves running, and a child that starts
/// a session of its own leaves the call's process group: it is still killed, when the call ends
/// and when the drain cuts a call short.
#[test]
fn an_unconfined_call_s_children_do_not_outlive_it_or_the_drain() {
    let workspace = Workspace::new();
    let work = workspace.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    let model = Stub::scripted(vec![
        Reply::tool_call("c1", "leave", json!({})),
        Reply::tool_call("c2", "hang", json!({})),
        Reply::answer("done"),
    ]);
    let orphan = |name: &str| {
        format!(
            "[tools.{name}]\ndescription = \"Leaves a child of its own session\"\ncommand = [\"/bin/sh\", \"-c\", \"setsid sleep 299 >/dev/null 2>&1 < /dev/null & echo $! > {pid}; {then}\"]\nsandbox = \"none\"\ntimeout = \"60s\"\n",
            pid = work.join(format!("{name}.pid")).display(),
            then = if name == "hang" { "sleep 60" } else { "true" },
        )
    };
    workspace.write_config(&format!(
        "[runtime]\ndrain_timeout = \"1s\"\n\n{model}\n{leave}\n{hang}\n[routes.hook]\npath = \"/hook\"\nverify = {{ scheme = \"none\" }}\ntools = [\"leave\", \"hang\"]\n",
        model = model.model_section(),
        leave = orphan("leave"),
        hang = orphan("hang"),
    ));
    let daemon = workspace.start();
    daemon.post_json("/hook", &[], "{}");
    let pid = |name: &str| -> u32 {
        let file = work.join(format!("{name}.pid"));
        wait_until(&format!("{name}'s child"), LIMIT, || {
            std::fs::read_to_string(&file).is_ok_and(|pid| pid.ends_with('\n'))
        });
        std::fs::read_to_string(&file)
            .expect("pid")
            .trim()
            .parse()
            .expect("a pid")
    };
    let left = pid("leave");
    let hanging = pid("hang");
    wait_until("the ended call's child to be killed", LIMIT, || {
        !process_alive(left)
    });
    assert!(process_alive(hanging), "the running call's child is alive");
    daemon.terminate();
    wait_until("the drained call's child to be killed", LIMIT, || {
        !process_alive(hanging)
    });
}

/// A call whose tool unit never starts it (a unit that hangs before it hands the call its
/// pipes) ends at the tool's timeout like any call that runs too long, and the turn goes on.
#[test]
fn a_call_its_unit_never_starts_ends_at_its_timeout() {
    let workspace = Workspace::new();
    let units = ToolUnits::start(&workspace);
    let socket = workspace.path().join("stalling.sock");
    let script = workspace.path().join("stalling-units.py");
    std::fs::write(&script, include_str!("common/stalling-units.py")).expect("the relay");
    let _relay = KillOnDrop(
        std::process::Command::new("/usr/bin/python3")
            .arg(&script)
            .arg(&socket)
            .arg(&units.socket)
            .arg("stall-here")
            .spawn()
            .expect("the relay"),
    );
    wait_until("the relay's socket", LIMIT, || socket.exists());
    let model = Stub::scripted(vec![
        Reply::tool_call("c1", "stalled", json!({})),
        Reply::answer("done"),
    ]);
    workspace.write_config(&format!(
        r#"{model}
[tools.stalled]
description = "Never started by its unit"
command = ["/bin/echo", "stall-here"]
timeout = "1s"

[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
tools = ["stalled"]
"#,
        model = model.model_section(),
    ));
    // The tool unit's floor hides its own socket: the relay's directory is the daemon's
    // runtime directory, hidden whole, as /run/agentgate is under the packaged units.
    let (_daemon, result) = one_event_through_units(
        &workspace,
        &socket,
        &model,
        &[("RUNTIME_DIRECTORY", workspace.path())],
    );
    assert!(result.contains("timed_out"), "{result}");
    assert!(
        result.contains("its tool unit did not start it within 1s"),
        "{result}"
    );
}

/// Starts the daemon with `AGENTGATE_TOOL_SOCKET` (the tool units' socket, or what stands in
/// for it) and `env`, waits for its tool units to be ready, and runs one event to completion;
/// the daemon and the model's last request (which carries the tool results).
fn one_event_through_units(
    workspace: &Workspace,
    socket: &Path,
    model: &Stub,
    env: &[(&str, &Path)],
) -> (Daemon, String) {
    let mut all = vec![("AGENTGATE_TOOL_SOCKET", socket.to_str().expect("utf-8"))];
    all.extend(
        env.iter()
            .map(|(name, path)| (*name, path.to_str().expect("utf-8"))),
    );
    let daemon = workspace.start_with_env(&all);
    daemon.wait_for_log("each call runs in a unit of its own");
    let id = daemon.post_json("/hook", &[], "{}").event_id();
    assert_eq!(workspace.wait_terminal(&id, LIMIT), "completed");
    let last = model
        .requests()
        .last()
        .expect("the last request")
        .json()
        .to_string();
    (daemon, last)
}
