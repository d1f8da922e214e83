//! A real systemd as PID 1 of a private namespace, booted by the harness in `tests/systemd/`
//! (root; see `can_run`), with helpers to run commands inside it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::{BIN, HttpResponse, free_port, try_request};

pub const HARNESS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/systemd");
pub const REPO: &str = env!("CARGO_MANIFEST_DIR");
const STATUS_JSON: &str = "agentgate status --json --config /etc/agentgate/agentgate.toml";

/// A booted systemd with agentgate's units installed; powered off on drop.
pub struct Machine {
    name: String,
    state: tempfile::TempDir,
    /// Bind-mounted at the same path inside (the namespace's /tmp is its own).
    pub share: tempfile::TempDir,
    pub port: u16,
}

impl Machine {
    /// Boots a namespace; without root, see [`super::can_run`].
    pub fn boot(test: &str) -> Option<Machine> {
        if !super::root_or_skip(test) {
            return None;
        }
        let name = format!(
            "ag-{}-{}",
            test.chars().take(20).collect::<String>(),
            std::process::id()
        );
        let name = name.replace('_', "-");
        let state = tempfile::tempdir().expect("state dir");
        let share = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("share dir");
        let output = Command::new(format!("{HARNESS}/boot.sh"))
            .arg(&name)
            .env("AGTEST_STATE", state.path())
            // The checkout too: the namespace has its own /tmp, where a checkout may live.
            .env("AGTEST_SHARE", format!("{}:{REPO}", share.path().display()))
            .output()
            .expect("boot.sh");
        assert!(
            output.status.success(),
            "boot failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Some(Machine {
            name,
            state,
            share,
            port: free_port(),
        })
    }

    /// Runs a shell script inside the namespace.
    pub fn sh(&self, script: &str) -> Output {
        Command::new(format!("{HARNESS}/ns.sh"))
            .arg(&self.name)
            .args(["sh", "-c", script])
            .env("AGTEST_STATE", self.state.path())
            .output()
            .expect("ns.sh")
    }

    /// Runs a script that must succeed; returns its stdout.
    pub fn ok(&self, script: &str) -> String {
        let output = self.sh(script);
        assert!(
            output.status.success(),
            "`{script}` failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    }

    pub fn show(&self, unit: &str, property: &str) -> String {
        self.ok(&format!("systemctl show -P {property} {unit}"))
    }

    /// Installs the binary, the system user, the units (webhook socket on 127.0.0.1:port), the
    /// catalog, `config`, and any drop-in for agentgate.service, then enables the sockets.
    pub fn install(&self, config: &str, service_dropin: &str) {
        let share = self.share.path();
        let config_file = write(share, "agentgate.toml", config);
        let dropin = write(
            share,
            "service.conf",
            &format!("[Service]\n{service_dropin}\n"),
        );
        let script = format!(
            r#"set -e
install -m 0755 {bin} /usr/bin/agentgate
install -m 0644 {repo}/packaging/agentgate.sysusers /usr/lib/sysusers.d/agentgate.conf
systemd-sysusers agentgate.conf
install -m 0644 {repo}/systemd/*.socket {repo}/systemd/*.service {repo}/systemd/*.timer {repo}/systemd/*.slice /etc/systemd/system/
mkdir -p /etc/systemd/system/agentgate.socket.d /etc/systemd/system/agentgate.service.d /etc/agentgate
printf '[Socket]\nListenStream=\nListenStream=127.0.0.1:{port}\n' > /etc/systemd/system/agentgate.socket.d/test.conf
install -m 0644 {dropin} /etc/systemd/system/agentgate.service.d/test.conf
install -m 0644 {config_file} /etc/agentgate/agentgate.toml
install -D -m 0644 {repo}/packaging/agentgate.catalog /usr/lib/systemd/catalog/agentgate.catalog
journalctl --update-catalog
systemctl daemon-reload
sockets="agentgate.socket agentgate-control.socket agentgate-tool.socket agentgate-tool-network.socket"
systemctl enable --now $sockets || {{ systemctl status --no-pager --full $sockets; exit 1; }}
"#,
            bin = BIN,
            repo = REPO,
            port = self.port,
            dropin = dropin.display(),
            config_file = config_file.display(),
        );
        self.ok(&script);
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn post(&self, body: &str) -> std::io::Result<HttpResponse> {
        self.post_with(body, &[])
    }

    /// `post` with `headers` besides its content type.
    pub fn post_with(&self, body: &str, headers: &[(&str, &str)]) -> std::io::Result<HttpResponse> {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        try_request(self.addr(), "POST", "/hook", &all, body.as_bytes())
    }

    pub fn status_json(&self) -> serde_json::Value {
        let text = self.ok(STATUS_JSON);
        serde_json::from_str(&text).expect("status json")
    }

    /// `status --json`, or `None` when it fails: a daemon that crashes (or is restarted) while
    /// it answers closes the control connection in the middle of the answer.
    pub fn try_status_json(&self) -> Option<serde_json::Value> {
        let output = self.sh(STATUS_JSON);
        if !output.status.success() {
            return None;
        }
        serde_json::from_slice(&output.stdout).ok()
    }

    /// `systemd-analyze security` of the loaded agentgate.service: the exposure score and the line.
    pub fn security_score(&self) -> (f64, String) {
        let line = self.ok("systemd-analyze security agentgate.service --no-pager | tail -n 1");
        let score = line
            .split("agentgate.service: ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(99.0);
        (score, line)
    }

    pub fn journal(&self, args: &str) -> String {
        self.ok(&format!("journalctl --no-pager -o cat {args}"))
    }

    /// How many times `agentgate reconcile` finished, by its syslog identifier rather than
    /// `-u`: journald learns a line's unit from /proc, and a oneshot that exits right after its
    /// last line can be gone before journald looks, leaving the line without `_SYSTEMD_UNIT`.
    /// `--sync` makes every line written so far readable first.
    pub fn reconcile_runs(&self) -> usize {
        self.ok("journalctl --sync");
        self.journal("SYSLOG_IDENTIFIER=agentgate")
            .matches("reconcile finished")
            .count()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let _ = Command::new(format!("{HARNESS}/stop.sh"))
            .arg(&self.name)
            .env("AGTEST_STATE", self.state.path())
            .status();
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path
}
