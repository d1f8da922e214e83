//! fsync discipline, observed with strace: no 2xx is written before the fdatasync that makes its
//! event durable, and no state file is renamed into place before its data is synced. Covers the
//! accept path and the retry ledger's atomic replacement at a resume.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::fsync_lint;
use common::*;

const TRACED: &str = "openat,creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,mkdir,mkdirat,sendto,sendmsg";

/// A model that never answers: turns stay in their first model call, so after their first commits
/// the daemon writes nothing in the background and every finding is about an ack.
const CONFIG: &str = r#"[runtime]
max_concurrent_turns = 1
drain_timeout = "1s"
[model]
backend = "command"
command = ["/bin/sleep", "3600"]
request_timeout = "2h"
[routes.hook]
path = "/hook"
verify = { scheme = "none" }
session = "{{ payload.session }}"
"#;

fn traced(workspace: &Workspace, trace: &std::path::Path) -> Child {
    let log = std::fs::File::create(trace.with_extension("log")).expect("daemon log");
    let filter = format!("trace={TRACED}");
    let trace = trace.display().to_string();
    workspace
        .serve_command(&[
            "strace", "-f", "-yy", "-s", "64", "-e", &filter, "-o", &trace,
        ])
        .env("AGENTGATE_LOG", "info")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("JOURNAL_STREAM")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("strace (package strace)")
}

fn wait_healthy(workspace: &Workspace) {
    wait_until(
        "the traced daemon to serve",
        Duration::from_secs(30),
        || {
            try_request(workspace.addr(), "GET", "/healthz", &[], b"")
                .is_ok_and(|r| r.status == 200)
        },
    );
}

fn post(workspace: &Workspace, session: &str) -> u16 {
    try_request(
        workspace.addr(),
        "POST",
        "/hook",
        &[
            ("content-type", "application/json"),
            ("idempotency-key", session),
        ],
        format!(r#"{{"session":"{session}"}}"#).as_bytes(),
    )
    .expect("POST")
    .status
}

/// Waits until the turn's model command runs, a child of the daemon: the turn is in its model
/// call, where the kill below is meant to find it.
fn wait_for_model_process(workspace: &Workspace) {
    let pid = daemon_pid(workspace);
    wait_until("the model process", Duration::from_secs(10), || {
        Command::new("pgrep")
            .args(["-P", &pid, "sleep"])
            .output()
            .is_ok_and(|output| output.status.success())
    });
}

fn daemon_pid(workspace: &Workspace) -> String {
    let output = Command::new("pgrep")
        .args([
            "-f",
            &format!(
                "^{BIN} serve --config {}",
                workspace.config_path().display()
            ),
        ])
        .output()
        .expect("pgrep");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::trim)
        .find(|pid| !pid.is_empty())
        .map(str::to_string)
        .expect("the daemon's pid")
}

#[test]
fn the_checker_flags_an_ack_before_the_sync() {
    let bad = "1 pwrite64(7</s/agentgate.db-wal>, \"x\", 1, 0) = 1\n2 write(9<TCP:[1->2]>, \"HTTP/1.1 202 Accepted\", 21) = 21\n1 fdatasync(7</s/agentgate.db-wal>) = 0\n";
    assert_eq!(fsync_lint::check(bad, "/s").findings.len(), 1);
    let renamed = "1 openat(AT_FDCWD</s>, \"/s/.t.tmp\", O_RDWR|O_CREAT|O_EXCL, 0600) = 3</s/.t.tmp>\n1 write(3</s/.t.tmp>, \"{}\", 2) = 2\n1 rename(\"/s/.t.tmp\", \"/s/ledger.json\") = 0\n";
    assert!(fsync_lint::check(renamed, "/s").findings[0].contains("RENAME-UNSYNCED-SRC"));
    let good = "1 pwrite64(7</s/agentgate.db-wal>, \"x\", 1, 0) = 1\n1 fdatasync(7</s/agentgate.db-wal> <unfinished ...>\n2 futex() = 0\n1 <... fdatasync resumed>) = 0\n2 write(9<TCP:[1->2]>, \"HTTP/1.1 202 Accepted\", 21) = 21\n";
    let report = fsync_lint::check(good, "/s");
    assert!(report.findings.is_empty(), "{:?}", report.findings);
    assert_eq!((report.acks, report.syncs), (1, 1));
}

#[test]
fn no_acknowledgement_precedes_its_fdatasync() {
    let workspace = Workspace::new();
    workspace.write_config(CONFIG);

    // Accepts, a duplicate, and a turn started.
    let first_trace = workspace.path().join("first.trace");
    let mut strace = traced(&workspace, &first_trace);
    wait_healthy(&workspace);
    assert_eq!(post(&workspace, "busy"), 202);
    wait_until("the turn to start", Duration::from_secs(10), || {
        workspace.query("SELECT count(*) FROM turns", |r| r.get::<_, i64>(0))[0] == 1
    });
    wait_for_model_process(&workspace);
    for n in 0..20 {
        assert_eq!(post(&workspace, &format!("s{n}")), 202);
    }
    assert_eq!(post(&workspace, "s0"), 200, "the duplicate");
    // strace waits for every tracee: the model process goes first, then the daemon, as a crash.
    // The daemon is stopped first, so that it cannot commit the turn's failure in between.
    let pid = daemon_pid(&workspace);
    signal(pid.parse().expect("pid"), "STOP");
    let _ = Command::new("pkill").args(["-KILL", "-P", &pid]).status();
    signal(pid.parse().expect("pid"), "KILL");
    let _ = strace.wait();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the first daemon survived its kill"
    );

    // The next start resumes the crashed turn through the ledger, then accepts again.
    let second_trace = workspace.path().join("second.trace");
    let mut strace = traced(&workspace, &second_trace);
    wait_healthy(&workspace);
    let second_log = workspace.path().join("second.log");
    let counted = || {
        std::fs::read_to_string(workspace.state_dir().join("ledger.json"))
            .is_ok_and(|t| t.contains("\"busy\""))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !counted() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        counted(),
        "the resume was not counted; the daemon said:\n{}",
        std::fs::read_to_string(&second_log).unwrap_or_default()
    );
    wait_until("the resumed turn to start", Duration::from_secs(10), || {
        workspace.query("SELECT count(*) FROM turns", |r| r.get::<_, i64>(0))[0] == 2
    });
    wait_for_model_process(&workspace);
    for n in 20..30 {
        assert_eq!(post(&workspace, &format!("s{n}")), 202);
    }
    signal(daemon_pid(&workspace).parse().expect("pid"), "TERM");
    let _ = strace.wait();

    for (trace, acks) in [(first_trace, 21), (second_trace, 10)] {
        let text = std::fs::read_to_string(&trace).expect("trace");
        let report = fsync_lint::check(&text, &workspace.state_dir().display().to_string());
        let namespace_changes: Vec<&str> = text
            .lines()
            .filter(|l| {
                ["mkdir", "rename", "unlink", "O_CREAT", "sync("]
                    .iter()
                    .any(|k| l.contains(k))
            })
            .collect();
        // The 40 trace lines before the first finding, for whoever reads a failure.
        let context = report
            .findings
            .first()
            .and_then(|finding| finding.strip_prefix("line "))
            .and_then(|rest| rest.split(':').next())
            .and_then(|number| number.parse::<usize>().ok())
            .map(|line| {
                text.lines()
                    .skip(line.saturating_sub(40))
                    .take(40)
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default();
        assert!(
            report.findings.is_empty(),
            "{}: {:#?}\nfile system changes in the trace:\n{}\nbefore the first finding:\n{context}",
            trace.display(),
            &report.findings[..report.findings.len().min(3)],
            namespace_changes.join("\n")
        );
        assert!(
            report.acks >= acks,
            "{}: only {} acks seen",
            trace.display(),
            report.acks
        );
        assert!(
            report.syncs >= acks,
            "{}: only {} syncs seen",
            trace.display(),
            report.syncs
        );
    }
    let ledger_writes = std::fs::read_to_string(workspace.path().join("second.trace"))
        .expect("trace")
        .lines()
        .filter(|l| l.contains("rename") && l.contains("ledger.json"))
        .count();
    assert!(ledger_writes >= 1, "the resume did not replace the ledger");
}
