//! The Debian package under a real systemd: install, first request, journal and man page,
//! upgrade under load, restarts as installed, remove and purge. Builds the package from this
//! checkout with `packaging/build-deb.sh` (root only; CI runs as root).

mod common;

use std::process::Command;
use std::time::Duration;

use common::load::Load;
use common::machine::{Machine, REPO};
use common::*;

fn build_package() -> std::path::PathBuf {
    let output = Command::new("bash")
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
    let verify = machine.sh("systemd-analyze verify agentgate.socket agentgate-control.socket agentgate-tool.socket agentgate.service agentgate-reconcile.service agentgate-tool@1.service agentgate-schedule@nightly.service agentgate-schedule@nightly.timer");
    let complaints = format!(
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    assert!(
        verify.status.success() && complaints.trim().is_empty(),
        "systemd-analyze verify: {complaints}"
    );
    // 2.7 here, 2.0 before tools were sandboxed: the service may now create the namespaces,
    // mounts and netlink socket its tools' sandboxes need, and keeps /proc uncovered for theirs
    // (systemd/agentgate.service says which settings that costs and why it is worth it).
    let (score, security) = machine.security_score();
    assert!(score <= 2.8, "{security}");

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
    let json_lines = machine.journal("-u agentgate.service -o json SESSION_KEY=first");
    assert!(
        json_lines.contains("\"EVENT_ID\"") && json_lines.contains("\"ROUTE\":\"hook\""),
        "{json_lines}"
    );

    // Upgrade under continuous load: the socket stays, the service is restarted, nothing fails.
    let socket_invocation = machine.show("agentgate.socket", "InvocationID");
    let service_pid = machine.show("agentgate.service", "MainPID");
    let load = Load::start(machine.addr(), 3);
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
    let load = Load::start(machine.addr(), 3);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        machine.ok("systemctl restart agentgate.service");
    }
    let failures = load.finish().failures;
    assert!(failures.is_empty(), "{failures:?}");

    walk_through_readme_debian(&machine);

    // Remove: units stop, config and state stay. Purge: the config goes, the state stays.
    machine.ok("dpkg -r agentgate");
    assert_ne!(machine.show("agentgate.socket", "ActiveState"), "active");
    assert!(
        machine.post("{}").is_err(),
        "the port still answers after remove"
    );
    machine.ok("test -f /etc/agentgate/agentgate.toml && test -f /var/lib/agentgate/agentgate.db");
    machine.ok("dpkg -P agentgate");
    machine
        .ok("test ! -e /etc/agentgate/agentgate.toml && test -f /var/lib/agentgate/agentgate.db");
    // What purge leaves behind, README.Debian says how to remove.
    machine.ok("test -d /etc/agentgate/credentials");
    machine.ok(readme(
        "rm -rf /etc/agentgate/credentials /etc/systemd/system/agentgate.service.d",
    ));
    machine.ok(readme("systemctl daemon-reload"));
    machine.ok("test ! -e /etc/agentgate/credentials");
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
    machine.ok("systemctl restart agentgate.service");
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
