//! The Debian package under a real systemd: install, first request, journal and man page,
//! upgrade under load, restarts as installed, remove and purge. Builds the package from this
//! checkout with `packaging/build-deb.sh` (root; see `common::can_run`).

mod common;

use std::process::Command;
use std::time::Duration;

use common::load::Load;
use common::machine::{Machine, REPO};
use common::*;

fn build_package() -> std::path::PathBuf {
    // From a shell's environment, so that it finds what `tests/run` built ahead of it.
    let output = common::basics::as_from_a_shell(&mut Command::new("bash"))
        .arg(format!("{REPO}/packaging/build-deb.sh"))
        .output()
        .expect("packaging/build-deb.sh");
    assert!(
        output.status.success(),
        "package build failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let path = String::from_utf8_lossy(&output.stdout)
        .trim()
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    std::path::Path::new(REPO).join(path)
}

/// The same package with a higher version: what an upgrade installs.
fn bumped(deb: &std::path::Path, into: &std::path::Path) -> std::path::PathBuf {
    let tree = into.join("tree");
    let run = |args: &[&str]| {
        let status = Command::new(args[0])
            .args(&args[1..])
            .status()
            .expect("command");
        assert!(status.success(), "{args:?}");
    };
    run(&[
        "dpkg-deb",
        "-R",
        deb.to_str().expect("path"),
        tree.to_str().expect("path"),
    ]);
    let control = tree.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control).expect("control");
    let text = text.replace("Version: 0.1.0", "Version: 0.1.0+upgrade1");
    std::fs::write(&control, text).expect("control");
    let out = into.join("agentgate_upgrade.deb");
    run(&[
        "dpkg-deb",
        "--root-owner-group",
        "-b",
        tree.to_str().expect("path"),
        out.to_str().expect("path"),
    ]);
    out
}

const ROUTE_CONFIG: &str = r#"
[routes.hook]
path = "/hook"
verify = { scheme = "none" }
session = "{{ payload.session }}"
tools = ["disk_usage"]

[tools.disk_usage]
description = "Show disk usage of a mount point"
command = ["/usr/bin/df", "-h"]
parameters = { type = "object", properties = { path = { type = "string" } } }
idempotent = true
"#;

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one package's life, install to purge, step by step"
)]
fn install_serve_upgrade_restart_remove_purge() {
    let Some(machine) = Machine::boot("package") else {
        return;
    };
    let deb = build_package();
    let staged = machine.share.path().join("agentgate.deb");
    std::fs::copy(&deb, &staged).expect("stage the package");
    let upgrade = bumped(&staged, machine.share.path());

    // The test's port, set before the package exists (drop-ins for units yet to come apply).
    machine.ok(&format!(
        "mkdir -p /etc/systemd/system/agentgate.socket.d && printf '[Socket]\\nListenStream=\\nListenStream=127.0.0.1:{}\\n' > /etc/systemd/system/agentgate.socket.d/port.conf",
        machine.port
    ));
    machine.ok(&format!("dpkg -i {}", staged.display()));
    // The binary reports the package's version.
    let package_version = machine.ok("dpkg-query -W -f '${Version}' agentgate");
    assert_eq!(
        machine.ok("agentgate --version"),
        format!("agentgate {package_version}")
    );
    assert!(
        machine
            .ok("getent passwd _agentgate")
            .contains("/var/lib/agentgate")
    );
    assert_eq!(machine.show("agentgate.socket", "ActiveState"), "active");
    assert_eq!(
        machine.show("agentgate-control.socket", "ActiveState"),
        "active"
    );
    assert_eq!(
        machine.show("agentgate-tool.socket", "ActiveState"),
        "active"
    );
    assert_eq!(machine.show("agentgate.service", "ActiveState"), "inactive");
    assert!(
        machine
            .ok("agentgate check-config")
            .contains("ok (0 route(s)")
    );
    assert!(
        machine
            .ok("MANPAGER=cat man agentgate 2>/dev/null | head -n 20")
            .contains("AGENTGATE(8)")
    );
    assert!(
        machine
            .ok("MANPAGER=cat man 5 agentgate.toml 2>/dev/null | head -n 20")
            .contains("AGENTGATE.TOML(5)")
    );
    // Every user doc, uncompressed, so that their links to each other work; and the examples.
    machine.ok(
        "cd /usr/share/doc/agentgate && ls reference.md operations.md senders.md tools.md models.md \
         scale-out.md examples/alertmanager.yml examples/grafana-dashboard.json examples/prometheus-rules.yml",
    );
    let verify = machine.sh("systemd-analyze verify agentgate.socket agentgate-control.socket agentgate-tool.socket agentgate.service agentgate-reconcile.service agentgate-tool@1.service agentgate-tool-network@1.service system-agentgate.slice agentgate-schedule@nightly.service agentgate-schedule@nightly.timer");
    let complaints = format!(
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    assert!(
        verify.status.success() && complaints.trim().is_empty(),
        "systemd-analyze verify: {complaints}"
    );
    // Every tool call runs in the one slice that bounds them all together.
    for unit in [
        "agentgate-tool@1.service",
        "agentgate-tool-network@1.service",
    ] {
        assert_eq!(
            machine.show(unit, "Slice"),
            "system-agentgate.slice",
            "{unit}"
        );
    }
    assert_eq!(machine.show("system-agentgate.slice", "TasksMax"), "4096");
    assert_eq!(machine.show("system-agentgate.slice", "CPUWeight"), "50");
    // The service sets up no sandbox itself (its tools' run in tool units), so it keeps every
    // protection (SPEC: at most 2.0).
    let (score, security) = machine.security_score();
    assert!(score <= 2.0, "{security}");

    // The operator adds a route (the conffile is theirs to edit) and sends the first webhook.
    machine.ok(&format!(
        "cat >> /etc/agentgate/agentgate.toml <<'EOF'\n{ROUTE_CONFIG}\nEOF"
    ));
    let first = machine.post(r#"{"session":"first"}"#).expect("first POST");
    assert_eq!(first.status, 202, "{first:?}");
    assert_eq!(machine.show("agentgate.service", "ActiveState"), "active");
    wait_until(
        "the turn to complete via the replay model",
        Duration::from_secs(30),
        || machine.status_json()["events"]["by_status"]["completed"] == 1,
    );
    // The cassette's disk_usage call ran, in a tool unit, and its real output is in the
    // transcript.
    let transcript = machine.ok("agentgate sessions show first --json");
    assert!(
        transcript.contains("Filesystem") && transcript.contains("Mounted on"),
        "{transcript}"
    );
    let json_lines = machine.journal("-u agentgate.service -o json SESSION_KEY=first");
    assert!(
        json_lines.contains("\"EVENT_ID\"") && json_lines.contains("\"ROUTE\":\"hook\""),
        "{json_lines}"
    );

    // Upgrade under continuous load: the socket stays, the service is restarted, nothing fails.
    // Paced: at full speed the clients would fill the route's share of the queue (every turn
    // calls a tool in a unit of its own), and the later steps' webhooks would rightly get 503.
    let socket_invocation = machine.show("agentgate.socket", "InvocationID");
    let service_pid = machine.show("agentgate.service", "MainPID");
    let load = Load::at_rate(machine.addr(), 3, 200);
    load.wait_accepted(20);
    machine.ok(&format!("dpkg -i {}", upgrade.display()));
    // The upgraded daemon takes the load too.
    load.wait_accepted(20);
    let result = load.finish();
    let failures = result.failures;
    assert!(
        failures.is_empty(),
        "{} failed during the upgrade: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(result.accepted > 0);
    assert_eq!(
        machine.show("agentgate.socket", "InvocationID"),
        socket_invocation,
        "the socket was restarted"
    );
    assert_ne!(
        machine.show("agentgate.service", "MainPID"),
        service_pid,
        "the service was not restarted"
    );
    assert!(
        machine
            .ok("dpkg-query -W -f='${Version}' agentgate")
            .contains("upgrade1")
    );

    // Restart cycles as installed.
    let load = Load::at_rate(machine.addr(), 3, 200);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        machine.ok("systemctl restart agentgate.service");
    }
    let failures = load.finish().failures;
    assert!(failures.is_empty(), "{failures:?}");

    walk_through_readme_debian(&machine);
    no_way_out_of_a_tool_unit(&machine);
    remove_and_purge(&machine);
}

/// Remove, then purge, after README.Debian's schedule was added. Remove: the units and the
/// schedule's timer stop, the sockets' files go, config and state stay. Purge: the config goes
/// with everything README.Debian had the operator add for the units (the schedules, the timers'
/// enablement, every drop-in), so no unit is left behind without its file; the state and the
/// credentials stay, and README.Debian says how to remove them.
fn remove_and_purge(machine: &Machine) {
    for line in README_DEBIAN
        .lines()
        .map(str::trim)
        .skip_while(|line| !line.starts_with("printf 'route = \"reports\""))
        .take(3)
    {
        machine.ok(line);
    }
    assert_eq!(
        machine.show("agentgate-schedule@nightly.timer", "ActiveState"),
        "active"
    );
    machine.ok("dpkg -r agentgate");
    assert_ne!(machine.show("agentgate.socket", "ActiveState"), "active");
    assert_ne!(
        machine.show("agentgate-schedule@nightly.timer", "ActiveState"),
        "active"
    );
    assert!(
        machine.post("{}").is_err(),
        "the port still answers after remove"
    );
    machine.ok("test ! -e /run/agentgate");
    machine.ok("test -f /etc/agentgate/agentgate.toml && test -f /var/lib/agentgate/agentgate.db");
    machine.ok("dpkg -P agentgate");
    machine
        .ok("test ! -e /etc/agentgate/agentgate.toml && test -f /var/lib/agentgate/agentgate.db");
    let left = machine.ok(
        "find /etc/systemd /var/lib/systemd/timers -name '*agentgate*'; ls -A /etc/agentgate; \
         systemctl list-unit-files --no-legend 'agentgate*'; systemctl list-units --all --no-legend 'agentgate*'",
    );
    assert_eq!(left, "credentials", "purge left more than the secrets");
    // What purge leaves behind, README.Debian says how to remove.
    machine.ok(readme(
        "rm -rf /etc/agentgate/credentials /var/lib/agentgate",
    ));
    machine.ok("test ! -e /etc/agentgate/credentials && test ! -e /var/lib/agentgate");
}

const README_DEBIAN: &str = include_str!("../packaging/README.Debian");

/// A command exactly as README.Debian shows it; the test fails if the README stops showing it.
fn readme(command: &str) -> &str {
    assert!(
        README_DEBIAN.lines().any(|line| line.trim() == command),
        "README.Debian no longer shows `{command}`"
    );
    command
}

/// README.Debian, followed as written on the installed package: apply a config, add a
/// credential (what `systemctl edit` would write, written directly), a signed webhook verified
/// with it, a backup while the daemon runs, and the restore procedure.
fn walk_through_readme_debian(machine: &Machine) {
    machine.ok(readme("agentgate check-config"));
    machine.ok(readme("systemctl try-reload-or-restart agentgate.service"));

    machine.ok(readme("install -d -m 0700 /etc/agentgate/credentials"));
    machine.ok(&format!(
        "{} && {}",
        readme("printf '%s' 'the-webhook-secret' > /etc/agentgate/credentials/github-secret"),
        readme("chmod 0600 /etc/agentgate/credentials/github-secret")
    ));
    readme("systemctl edit agentgate.service");
    let credential =
        readme("LoadCredential=github-secret:/etc/agentgate/credentials/github-secret");
    machine.ok(&format!(
        "mkdir -p /etc/systemd/system/agentgate.service.d && printf '[Service]\\n{credential}\\n' > /etc/systemd/system/agentgate.service.d/override.conf && systemctl daemon-reload"
    ));
    machine.ok(
        "cat >> /etc/agentgate/agentgate.toml <<'EOF'\n[routes.github]\npath = \"/hooks/github\"\nverify = { scheme = \"github\", secret = { credential = \"github-secret\" } }\nEOF",
    );
    // A reload cannot load a credential added since the start: it fails, and says to restart.
    let reload = machine.sh("systemctl try-reload-or-restart agentgate.service");
    assert!(!reload.status.success(), "{reload:?}");
    assert!(
        machine
            .journal("-u agentgate.service")
            .contains("then systemctl restart agentgate.service"),
        "the refusal names the command that works"
    );
    machine.ok(readme("systemctl restart agentgate.service"));
    let body = r#"{"zen":"Keep it logically awesome.","hook_id":1}"#;
    let signature = format!(
        "sha256={}",
        hmac_sha256_hex(b"the-webhook-secret", body.as_bytes())
    );
    let signed = try_request(
        machine.addr(),
        "POST",
        "/hooks/github",
        &[
            ("content-type", "application/json"),
            ("x-github-event", "ping"),
            ("x-github-delivery", "readme-walk-1"),
            ("x-hub-signature-256", &signature),
        ],
        body.as_bytes(),
    )
    .expect("the signed webhook");
    assert_eq!(
        signed.status, 202,
        "verified with the credential: {signed:?}"
    );

    let events_before = machine.status_json()["events"]["total"].clone();
    machine.ok(readme(
        "agentgate backup /var/backups/agentgate-$(date +%F)",
    ));
    let backup = machine.ok("ls -d /var/backups/agentgate-*");
    assert_eq!(
        machine.ok(&format!("stat -c %a {backup}")),
        "700",
        "the backup is readable by root only"
    );
    machine.ok(readme(
        "systemctl stop agentgate.socket agentgate-control.socket agentgate.service",
    ));
    machine.ok(readme(
        "install -d -o _agentgate -g _agentgate -m 0750 /var/lib/agentgate",
    ));
    readme("cp /var/backups/agentgate-DATE/* /var/lib/agentgate/");
    machine.ok(&format!("cp {backup}/* /var/lib/agentgate/"));
    machine.ok(readme(
        "rm -f /var/lib/agentgate/agentgate.db-wal /var/lib/agentgate/agentgate.db-shm",
    ));
    machine.ok(readme(
        "chown _agentgate:_agentgate /var/lib/agentgate/agentgate.db /var/lib/agentgate/ledger.json",
    ));
    machine.ok(readme(
        "systemctl start agentgate.socket agentgate-control.socket",
    ));
    let after = machine
        .post(r#"{"session":"after-restore"}"#)
        .expect("POST after restore");
    assert_eq!(after.status, 202, "{after:?}");
    let status = machine.status_json();
    assert_eq!(
        status["events"]["total"].as_u64(),
        events_before.as_u64().map(|n| n + 1),
        "the restored state holds every event: {status}"
    );
}

/// A model that calls the first tool its route offers, then answers.
const CALL_THE_FIRST_TOOL: &str = r#"#!/usr/bin/python3
import json, sys
request = json.load(sys.stdin)
if any(m.get("role") == "tool" for m in request["messages"]) or not request.get("tools"):
    print(json.dumps({"role": "assistant", "content": "done"}))
else:
    name = request["tools"][0]["function"]["name"]
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}
    print(json.dumps({"role": "assistant", "content": None, "tool_calls": [call]}))
"#;

/// A stdio MCP server with one tool that says where it runs: its network interfaces.
const MCP_WHERE: &str = r#"#!/usr/bin/python3
# A stdio MCP server with one tool, "where": the cgroup and the network interfaces it runs with.
import json, sys

def reply(id, result=None, error=None):
    message = {"jsonrpc": "2.0", "id": id}
    if error:
        message["error"] = error
    else:
        message["result"] = result
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()

for line in sys.stdin:
    request = json.loads(line)
    method, id = request.get("method"), request.get("id")
    if id is None:
        continue
    if method == "initialize":
        reply(id, {"protocolVersion": request["params"]["protocolVersion"],
                   "capabilities": {"tools": {}},
                   "serverInfo": {"name": "where", "version": "1"}})
    elif method == "tools/list":
        reply(id, {"tools": [{"name": "where", "description": "Where this server runs",
                              "inputSchema": {"type": "object", "properties": {}},
                              "annotations": {"readOnlyHint": True}}]})
    elif method == "tools/call":
        text = open("/proc/self/cgroup").read().strip().splitlines()[-1]
        lines = open("/proc/net/dev").read().splitlines()[2:]
        text += " interfaces=" + ",".join(sorted(l.split(":")[0].strip() for l in lines))
        reply(id, {"content": [{"type": "text", "text": text}]})
    else:
        reply(id, error={"code": -32601, "message": "no such method"})
"#;

// Their turns go ahead of the backlog the load left on route hook (priority).
const ESCAPE_ROUTES: &str = r#"
[mcp.where]
command = ["/usr/bin/python3", "/usr/local/lib/mcp-where.py"]

[routes.mcp]
path = "/mcp"
verify = { scheme = "none" }
session = "mcp"
tools = ["where.*"]
priority = 1000

[tools.probe]
description = "Tries every way out of its sandbox"
command = ["/usr/bin/python3", "/usr/local/lib/escape-probe.py", "/usr/local/lib/escape-probe.json"]
writable = ["/srv/probe"]
timeout = "60s"

[tools.gated]
description = "Runs only once a person approves"
command = ["/usr/bin/touch", "/srv/probe/gated-ran"]
writable = ["/srv/probe"]
approval = true

[tools.unlisted]
description = "Writes where its unit may not"
command = ["/bin/true"]
writable = ["/srv/unlisted"]

[routes.gated]
path = "/gated"
verify = { scheme = "none" }
session = "gated"
tools = ["gated"]
priority = 1000

[routes.probe]
path = "/probe"
verify = { scheme = "none" }
session = "probe"
tools = ["probe"]
priority = 1000

[tools.probe_net]
description = "Tries every way out of its sandbox, with the network"
command = ["/usr/bin/python3", "/usr/local/lib/escape-probe.py", "/usr/local/lib/escape-probe-net.json"]
network = true
timeout = "60s"

[routes.probe-net]
path = "/probe-net"
verify = { scheme = "none" }
session = "probe-net"
tools = ["probe_net"]
priority = 1000
"#;

/// The PostgreSQL socket the probe tries, with peer authentication as the service's user:
/// Debian's cluster, started in the namespace on its Unix socket alone.
fn start_postgres(machine: &Machine) -> bool {
    let Some(version) = machine
        .ok("ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1")
        .lines()
        .next()
        .map(str::to_string)
    else {
        // Debian's postgresql-15 leaves a cluster in /etc/postgresql: the probe cannot try its
        // socket without it.
        let test = "package (the escape probe's login to PostgreSQL's socket)";
        return can_run(test, Need::Postgres, false);
    };
    machine.ok(&format!(
        "echo \"listen_addresses = ''\" >> /etc/postgresql/{version}/main/postgresql.conf && \
         systemctl start postgresql@{version}-main && \
         runuser -u postgres -- psql -qc 'CREATE ROLE \"_agentgate\" LOGIN' && \
         runuser -u _agentgate -- psql -d postgres -Atc 'SELECT current_user' | grep -qx _agentgate"
    ));
    true
}

/// The escape probe (tests/common/escape-probe.py), run as a strict tool of the installed
/// package while another event's call waits for a person: the state, the credentials, the
/// config, the control socket (to approve that call), the tool units' sockets with no sandbox
/// and with one that hides nothing, PostgreSQL's socket as the service's user, D-Bus, journald
/// and the host's loopback; each must fail, while the tool writes its writable path and reads
/// the system's files. Then the tool units' sockets from a process of the service's user in a
/// unit of its own (it is not the daemon), and from one in the daemon's own cgroup (the sandbox
/// it asks for is below the floor). The tool units' journal keeps the refusals and not PID 1's
/// two lines per call, and a writable path its unit cannot write is a warning at start.
#[expect(
    clippy::too_many_lines,
    reason = "one escape attempt after another from the same tool unit"
)]
fn no_way_out_of_a_tool_unit(machine: &Machine) {
    let share = machine.share.path();
    let postgres = start_postgres(machine);
    let mut plan = serde_json::json!({
        "read": {
            "read_database": "/var/lib/agentgate/agentgate.db",
            "read_credential": "/run/credentials/agentgate.service/github-secret",
            "read_credential_store": "/etc/agentgate/credentials/github-secret",
            "read_config": "/etc/agentgate/agentgate.toml",
            "read_config_copy": "/etc/agentgate/agentgate.toml.dpkg-old",
            "read_a_file_only_the_daemon_s_user_may_read": "/srv/daemon-only/note",
            "read_the_daemon_s_cgroup": "/sys/fs/cgroup/system.slice/agentgate.service/memory.current",
        },
        "kernel": ["user_namespace", "io_uring", "keyring"],
        "write": {"write_outside_writable": "/etc/agentgate/written"},
        "stream": {
            "connect_control_socket": "/run/agentgate/control.sock",
            "connect_dbus": "/run/dbus/system_bus_socket",
            "connect_journald_stdout": "/run/systemd/journal/stdout",
        },
        "datagram": {
            "send_to_journald": "/run/systemd/journal/socket",
            "send_to_dev_log": "/dev/log",
        },
        "tcp": {"reach_the_webhook_listener": machine.port},
        "control": "/run/agentgate/control.sock",
        "tool_socket": {
            "tool_socket": "/run/agentgate/tool.sock",
            "tool_network_socket": "/run/agentgate/tool-network.sock",
        },
        "proc_roots": ["/var/lib/agentgate/agentgate.db"],
        "legit": {
            "write_in_writable": ["write", "/srv/probe/legit.txt"],
            "read_system_file": ["read", "/etc/os-release"],
            "write_private_tmp": ["write", "/tmp/probe.txt"],
        },
    });
    if postgres {
        plan["postgres"] = serde_json::json!({
            "log_in_to_postgres_as_the_service": ["/run/postgresql/.s.PGSQL.5432", "_agentgate"],
        });
    }
    let sockets_only = serde_json::json!({"tool_socket": plan["tool_socket"].clone()});
    for (name, text) in [
        (
            "escape-probe.py",
            include_str!("common/escape-probe.py").to_string(),
        ),
        ("escape-probe.json", plan.to_string()),
        ("escape-probe-net.json", network_plan(machine).to_string()),
        ("sockets-only.json", sockets_only.to_string()),
        ("model", CALL_THE_FIRST_TOOL.to_string()),
        ("mcp-where.py", MCP_WHERE.to_string()),
        ("routes.toml", ESCAPE_ROUTES.to_string()),
    ] {
        std::fs::write(share.join(name), text).expect("write into the share");
    }
    machine.ok(&format!(
        "set -e
         install -m 0644 {share}/escape-probe.py {share}/escape-probe.json {share}/escape-probe-net.json {share}/sockets-only.json {share}/mcp-where.py /usr/local/lib/
         cp -p /etc/agentgate/agentgate.toml /etc/agentgate/agentgate.toml.dpkg-old
         install -m 0755 {share}/model /usr/local/bin/call-the-first-tool
         install -d -o _agentgate-tool -g _agentgate-tool /srv/probe /srv/unlisted
         install -d -o _agentgate -g _agentgate -m 0700 /srv/daemon-only
         echo kept | install -o _agentgate -g _agentgate -m 0600 /dev/stdin /srv/daemon-only/note
         mkdir -p /etc/systemd/system/agentgate-tool@.service.d
         printf '[Service]\\nReadWritePaths=/srv/probe\\n' > /etc/systemd/system/agentgate-tool@.service.d/probe.conf
         sed -i 's|^backend = \"replay\"|backend = \"command\"\\ncommand = [\"/usr/local/bin/call-the-first-tool\"]|' /etc/agentgate/agentgate.toml
         cat {share}/routes.toml >> /etc/agentgate/agentgate.toml
         agentgate check-config
         systemctl daemon-reload
         systemctl restart agentgate.service",
        share = share.display()
    ));
    // Another event's call waits for a person.
    let post = |path: &str| {
        try_request(
            machine.addr(),
            "POST",
            path,
            &[("content-type", "application/json")],
            b"{}",
        )
        .expect("POST")
    };
    assert_eq!(post("/gated").status, 202);
    let approvals = || machine.ok("agentgate approvals list --json");
    wait_until(
        "the gated call to wait for a person",
        Duration::from_secs(30),
        || approvals().contains("\"pending\""),
    );
    let probe = post("/probe");
    assert_eq!(probe.status, 202, "{probe:?}");
    let id = probe.event_id();
    wait_until("the probe's turn to end", Duration::from_secs(60), || {
        machine
            .ok(&format!("agentgate events show {id} --json"))
            .contains("\"status\": \"completed\"")
    });
    let report = probe_report(machine, "probe");
    assert_every_escape_refused(&report, 16);
    // A user of its own: not the daemon's, whose files and per-user kernel bounds it never gets.
    assert_eq!(
        report["uid"].to_string(),
        machine.ok("id -u _agentgate-tool"),
        "{report:#}"
    );
    for (action, outcome) in report["legit"].as_object().expect("the legitimate actions") {
        assert_eq!(outcome, "done", "{action} in {report:#}");
    }
    let waiting = approvals();
    assert!(
        waiting.contains("\"pending\"") && !waiting.contains("decided_by\": \""),
        "{waiting}"
    );
    machine.ok("test ! -e /srv/probe/gated-ran");
    a_tool_with_the_network_stays_off_this_machine(machine);

    // The tool units' sockets, reached: by a process of the service's user that is not the
    // daemon, and by one in the daemon's own cgroup asking for too little. (Neither is
    // sandboxed: as the daemon's user, each may use the control socket, as an operator may.)
    let from_a_unit = machine.ok(
        "systemd-run -q --wait --pipe --uid=_agentgate --gid=_agentgate \
         /usr/bin/python3 /usr/local/lib/escape-probe.py /usr/local/lib/sockets-only.json",
    );
    let from_the_daemon_s_cgroup = machine.ok(
        "echo $$ > /sys/fs/cgroup/system.slice/agentgate.service/cgroup.procs && \
         setpriv --reuid=_agentgate --regid=_agentgate --init-groups \
         /usr/bin/python3 /usr/local/lib/escape-probe.py /usr/local/lib/sockets-only.json",
    );
    for output in [&from_a_unit, &from_the_daemon_s_cgroup] {
        let report: serde_json::Value = serde_json::from_str(output).expect("a report");
        assert_every_escape_refused(&report, 0);
    }
    assert!(approvals().contains("\"pending\""));
    let units = machine.journal("-u 'agentgate-tool*'");
    for refusal in [
        "refused: a call from pid",
        "only agentgate.service may start calls here",
        "refused: a call that asks for no sandbox",
        "refused: a call whose sandbox is below the floor",
    ] {
        assert!(units.contains(refusal), "{refusal}: {units}");
    }
    // PID 1's per-call lines stay out: the probe's and every earlier call's unit ended without
    // a word.
    assert!(!units.contains("Deactivated successfully"), "{units}");
    assert!(!units.contains("Started agentgate tool call"), "{units}");

    // The stdio MCP server runs in a tool unit of its own, without the network: the turn's own
    // process for the turn (it answered the call), the one that lists its tools for as long as
    // the server is configured.
    assert_eq!(post("/mcp").status, 202);
    wait_until("the MCP server's answer", Duration::from_secs(60), || {
        machine
            .ok("agentgate sessions show mcp --json")
            .contains("interfaces=lo\\\"")
    });
    // (Other tool units may be running too: the backlog the load left on route hook.) Once the
    // turn has ended, its process's unit is gone.
    wait_until("one MCP server unit", Duration::from_secs(60), || {
        let server = machine.ok("ps -C python3 -o unit:80=,args= | grep mcp-where.py || true");
        let units: std::collections::BTreeSet<String> = server
            .lines()
            .filter_map(|line| line.split_whitespace().next().map(str::to_string))
            .collect();
        units.len() == 1 && units.iter().all(|unit| unit.starts_with("agentgate-tool@"))
    });

    // The start said which writable path a tool's unit cannot write, and status says it.
    let warning =
        "tools.unlisted.writable: /srv/unlisted is not writable in agentgate-tool@.service";
    let journal = machine.journal("-u agentgate.service");
    assert!(journal.contains(warning), "{journal}");
    assert!(!journal.contains("tools.probe.writable"), "{journal}");
    let status = machine.ok("agentgate status");
    assert!(status.contains(warning), "{status}");
}

/// What a `network = true` tool tries: the loopback (the webhook listener, also through
/// systemd-resolved's stub address, where a delivery or an approval link could go), listening
/// on a port a delivery could be sent to, the Unix sockets of D-Bus (where systemd and logind answer any
/// local user) and journald (lines in agentgate's name), the config and its copy, the kernel's
/// user namespaces, io_uring and keyrings, and the tool units' sockets.
fn network_plan(machine: &Machine) -> serde_json::Value {
    serde_json::json!({
        "read": {
            "read_database": "/var/lib/agentgate/agentgate.db",
            "read_config": "/etc/agentgate/agentgate.toml",
            "read_config_copy": "/etc/agentgate/agentgate.toml.dpkg-old",
            "read_credential": "/run/credentials/agentgate.service/github-secret",
            "read_the_daemon_s_cgroup": "/sys/fs/cgroup/system.slice/agentgate.service/memory.current",
        },
        "stream": {
            "connect_dbus": "/run/dbus/system_bus_socket",
            "connect_journald_stdout": "/run/systemd/journal/stdout",
            "connect_control_socket": "/run/agentgate/control.sock",
        },
        "datagram": {"send_to_journald": "/run/systemd/journal/socket"},
        "tcp": {
            "reach_the_webhook_listener": machine.port,
            "reach_it_through_the_resolver_s_stub_address": format!("127.0.0.53:{}", machine.port),
        },
        "bind": {"listen_on_a_delivery_receiver_s_port": 29131},
        "tool_socket": {"tool_network_socket": "/run/agentgate/tool-network.sock"},
        "kernel": ["user_namespace", "io_uring", "keyring"],
        "legit": {"read_system_file": ["read", "/etc/os-release"]},
    })
}

/// The network probe, run as a `network = true` tool: every attempt of [`network_plan`] fails.
/// And the config itself is its group's, not every local user's.
fn a_tool_with_the_network_stays_off_this_machine(machine: &Machine) {
    assert_eq!(
        machine.ok("stat -c '%a %U:%G' /etc/agentgate/agentgate.toml"),
        "640 root:_agentgate"
    );
    let probe = try_request(
        machine.addr(),
        "POST",
        "/probe-net",
        &[("content-type", "application/json")],
        b"{}",
    )
    .expect("POST");
    assert_eq!(probe.status, 202, "{probe:?}");
    let id = probe.event_id();
    wait_until(
        "the network probe's turn to end",
        Duration::from_secs(60),
        || {
            machine
                .ok(&format!("agentgate events show {id} --json"))
                .contains("\"status\": \"completed\"")
        },
    );
    let report = probe_report(machine, "probe-net");
    assert_every_escape_refused(&report, 16);
    // The metadata services that are not link-local are denied by address (a probe would have to
    // send packets off this machine to show it).
    let denied = machine.ok("systemctl show agentgate-tool-network@probe.service -P IPAddressDeny");
    for metadata in ["100.100.100.200/32", "fd00:ec2::254/128", "169.254.0.0/16"] {
        assert!(denied.contains(metadata), "{metadata} in {denied}");
    }
    assert_eq!(report["legit"]["read_system_file"], "done", "{report:#}");
    machine.ok("rm /etc/agentgate/agentgate.toml.dpkg-old");
}

/// The escape probe's report, from the first tool result of `session`'s transcript.
fn probe_report(machine: &Machine, session: &str) -> serde_json::Value {
    let transcript: serde_json::Value =
        serde_json::from_str(&machine.ok(&format!("agentgate sessions show {session} --json")))
            .expect("the transcript");
    tool_stdout(&transcript)
        .and_then(|stdout| serde_json::from_str::<serde_json::Value>(&stdout).ok())
        .unwrap_or_else(|| panic!("no probe report in {transcript:#}"))
}

/// Every escape the probe tried (at least `at_least` of them) was refused.
fn assert_every_escape_refused(report: &serde_json::Value, at_least: usize) {
    let attempts = report["escapes"].as_object().expect("the escapes");
    assert!(attempts.len() >= at_least, "{report:#}");
    for (escape, outcome) in attempts {
        assert!(
            outcome.as_str().is_some_and(|o| o.starts_with("refused")),
            "{escape}: {outcome} in {report:#}"
        );
    }
}

/// The `stdout` of the first tool result anywhere in `value` (a transcript document).
fn tool_stdout(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::Object(fields) => {
            if fields.get("role").and_then(|r| r.as_str()) == Some("tool") {
                let content = fields.get("content")?.as_str()?;
                let outcome: serde_json::Value = serde_json::from_str(content).ok()?;
                return outcome["stdout"].as_str().map(str::to_string);
            }
            fields.values().find_map(tool_stdout)
        }
        serde_json::Value::Array(items) => items.iter().find_map(tool_stdout),
        serde_json::Value::Null
        | serde_json::Value::Bool(_)
        | serde_json::Value::Number(_)
        | serde_json::Value::String(_) => None,
    }
}
