//! `agentgate reconcile` over every malformed state it must survive: the bad file is quarantined
//! byte for byte, what parses is salvaged, reconcile exits 0, and the daemon starts and serves.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

const ROUTE: &str = "[routes.hook]\npath = \"/hook\"\nverify = { scheme = \"none\" }\n";

/// A state directory with a database that knows two sessions: `victim` was interrupted,
/// `known` is idle.
fn prepared_workspace() -> Workspace {
    let workspace = Workspace::new();
    workspace.write_config(ROUTE);
    let daemon = workspace.start();
    drop(daemon);
    let connection =
        rusqlite::Connection::open(workspace.state_dir().join("agentgate.db")).expect("open");
    connection
        .execute_batch(
            "INSERT INTO sessions (key, route, state, reason, created_at, updated_at)
                 VALUES ('victim', 'hook', 'resume_pending', 'crashed', 0, 0),
                        ('known', 'hook', 'idle', NULL, 0, 0);",
        )
        .expect("sessions");
    workspace
}

fn quarantined(state_dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(state_dir.join("quarantine"))
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

fn reconcile(workspace: &Workspace, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["reconcile"];
    args.extend_from_slice(extra);
    workspace.cli(&args)
}

#[test]
fn every_malformed_ledger_is_quarantined_salvaged_and_the_daemon_starts() {
    let cases: [(&str, &[u8]); 6] = [
        ("garbage", b"\x00\x13garbage{{{"),
        (
            "wrong version",
            br#"{"version":2,"sessions":{"known":{"attempts":2}}}"#,
        ),
        (
            "negative count",
            br#"{"version":1,"sessions":{"known":{"attempts":2},"ghost":{"attempts":-1}}}"#,
        ),
        (
            "truncated",
            br#"{"version":1,"sessions":{"known":{"attempts":2},"gho"#,
        ),
        ("empty", b""),
        ("directory", b""),
    ];
    for (name, content) in cases {
        let workspace = prepared_workspace();
        let ledger = workspace.state_dir().join("ledger.json");
        if name == "directory" {
            std::fs::create_dir(&ledger).expect("mkdir");
            std::fs::write(ledger.join("inside"), b"x").expect("file in dir");
        } else {
            std::fs::write(&ledger, content).expect("write ledger");
        }
        let output = reconcile(&workspace, &[]);
        assert_eq!(output.status.code(), Some(0), "{name}: {output:?}");
        let moved = quarantined(&workspace.state_dir());
        assert_eq!(moved.len(), 1, "{name}: {moved:?}");
        let moved_name = moved[0]
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        assert!(moved_name.ends_with("-ledger.json"), "{name}: {moved_name}");
        if name != "directory" {
            assert_eq!(
                std::fs::read(&moved[0]).expect("quarantined file"),
                content,
                "{name}: not byte-identical"
            );
        }
        let repaired: Value = serde_json::from_slice(&std::fs::read(&ledger).expect("new ledger"))
            .expect("valid JSON");
        assert_eq!(repaired["version"], 1, "{name}");
        // The interrupted session whose count was lost gets resume_max_attempts - 1 (one more try).
        assert_eq!(
            repaired["sessions"]["victim"]["attempts"], 2,
            "{name}: {repaired}"
        );
        assert!(
            repaired["sessions"].get("ghost").is_none(),
            "{name}: unknown sessions are dropped"
        );
        if name == "negative count" || name == "wrong version" {
            assert_eq!(
                repaired["sessions"]["known"]["attempts"], 2,
                "{name}: salvage lost an entry"
            );
        }
        let daemon = workspace.start();
        assert_eq!(daemon.post_json("/hook", &[], "{}").status, 202, "{name}");
    }
}

#[test]
fn dry_run_changes_nothing() {
    let workspace = prepared_workspace();
    let ledger = workspace.state_dir().join("ledger.json");
    std::fs::write(&ledger, b"nonsense").expect("write");
    let stale = workspace.state_dir().join(".agentgate-ledger.json.x1.tmp");
    std::fs::write(&stale, b"half").expect("stale");
    let output = reconcile(&workspace, &["--dry-run"]);
    assert_eq!(output.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("would move"), "{stdout}");
    assert!(
        stdout.contains("would remove the stale temporary file"),
        "{stdout}"
    );
    // The report's last line is on standard output (under systemd: the unit's journal stream).
    assert!(
        stdout.trim_end().ends_with("(dry run)") && stdout.contains("reconcile finished"),
        "{stdout}"
    );
    assert_eq!(std::fs::read(&ledger).expect("ledger"), b"nonsense");
    assert!(stale.exists());
    assert!(quarantined(&workspace.state_dir()).is_empty());

    // Without --dry-run the stale file goes.
    assert_eq!(reconcile(&workspace, &[]).status.code(), Some(0));
    assert!(!stale.exists());
}

#[test]
fn a_running_daemon_is_left_alone() {
    let workspace = prepared_workspace();
    let ledger = workspace.state_dir().join("ledger.json");
    let _daemon = workspace.start();
    std::fs::write(&ledger, b"nonsense").expect("write");
    let output = reconcile(&workspace, &[]);
    assert_eq!(output.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("changes nothing"),
        "{output:?}"
    );
    assert_eq!(std::fs::read(&ledger).expect("ledger"), b"nonsense");
}

#[test]
fn a_missing_ledger_is_created_and_a_damaged_database_quarantined() {
    let workspace = prepared_workspace();
    let database = workspace.state_dir().join("agentgate.db");
    std::fs::write(&database, vec![0x5a; 8192]).expect("damage the database");
    let output = reconcile(&workspace, &[]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert!(
        quarantined(&workspace.state_dir())
            .iter()
            .any(|p| p.to_string_lossy().ends_with("-agentgate.db"))
    );
    let ledger: Value = serde_json::from_slice(
        &std::fs::read(workspace.state_dir().join("ledger.json")).expect("ledger created"),
    )
    .expect("json");
    assert_eq!(ledger["version"], 1);
    let daemon = workspace.start();
    assert_eq!(daemon.post_json("/hook", &[], "{}").status, 202);
}

#[test]
fn unusable_state_or_config_are_the_only_failures() {
    let workspace = Workspace::new();
    let not_a_dir = workspace.path().join("file");
    std::fs::write(&not_a_dir, b"x").expect("file");
    workspace.write_config_with_state(ROUTE, &not_a_dir);
    assert_eq!(reconcile(&workspace, &[]).status.code(), Some(73));
    std::fs::write(workspace.config_path(), "[runtime]\nunknown = 1\n").expect("config");
    assert_eq!(reconcile(&workspace, &[]).status.code(), Some(78));
}

/// Whoever can write the state directory could plant a symbolic link named like a state file, so
/// that a command run as root truncates, overwrites or creates the link's target. Every case
/// leaves the target as it was and says why.
#[test]
fn planted_symbolic_links_are_never_followed() {
    struct Case {
        name: &'static str,
        /// Prepares the state so that the command touches `name`.
        prepare: fn(&Path),
    }
    let cases = [
        Case {
            name: ".agentgate-write-probe",
            prepare: |_| {},
        },
        Case {
            name: "agentgate.lock",
            prepare: |_| {},
        },
        Case {
            // A missing ledger is created, under its lock.
            name: "ledger.lock",
            prepare: |state| std::fs::remove_file(state.join("ledger.json")).expect("no ledger"),
        },
        Case {
            // A malformed ledger is moved to quarantine/.
            name: "quarantine",
            prepare: |state| std::fs::write(state.join("ledger.json"), b"{oops").expect("ledger"),
        },
    ];
    for case in cases {
        let workspace = prepared_workspace();
        assert!(reconcile(&workspace, &[]).status.success());
        let state = workspace.state_dir();
        (case.prepare)(&state);
        // The target: an existing file, a path that does not exist yet, and an empty directory.
        let precious = workspace.path().join("precious");
        std::fs::write(&precious, b"keep me").expect("precious");
        let absent = workspace.path().join("absent");
        let elsewhere = workspace.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("elsewhere");
        let target = match case.name {
            "quarantine" => elsewhere.clone(),
            "ledger.lock" => absent.clone(),
            _ => precious.clone(),
        };
        let link = state.join(case.name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).expect("plant the link");

        let output = reconcile(&workspace, &[]);
        let said = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(73), "{}: {said}", case.name);
        assert!(said.contains("symbolic link"), "{}: {said}", case.name);
        assert_eq!(
            std::fs::read(&precious).expect("precious"),
            b"keep me",
            "{}",
            case.name
        );
        assert!(!absent.exists(), "{}: created through the link", case.name);
        assert_eq!(
            std::fs::read_dir(&elsewhere).expect("elsewhere").count(),
            0,
            "{}: quarantined through the link",
            case.name
        );
        if case.name == "agentgate.lock" {
            // The daemon refuses it too, rather than truncating the target to write its pid.
            let serve = workspace
                .serve_command(&[])
                .output()
                .expect("run agentgate serve");
            assert_eq!(serve.status.code(), Some(73));
            assert!(String::from_utf8_lossy(&serve.stderr).contains("symbolic link"));
            assert_eq!(std::fs::read(&precious).expect("precious"), b"keep me");
        }
    }
}

/// Run as root (as the unit's pre-start step, or by an operator), reconcile must leave every file
/// it created to the state directory's owner, or the daemon's user cannot take its own lock and
/// the daemon exits 73.
#[test]
fn reconcile_as_root_gives_created_files_to_the_directory_owner() {
    use std::os::unix::fs::MetadataExt;
    if !root_or_skip("reconcile_as_root_gives_created_files_to_the_directory_owner") {
        return;
    }
    let workspace = prepared_workspace();
    let state = workspace.state_dir();
    let _ = std::fs::remove_file(state.join("ledger.lock"));
    std::fs::remove_file(state.join("agentgate.lock")).expect("no lock");
    // A malformed ledger the daemon wrote: reconcile quarantines it and writes a new one.
    std::fs::write(state.join("ledger.json"), b"{oops").expect("malformed ledger");
    let nobody = 65534;
    give_away(&state, nobody);

    let output = reconcile(&workspace, &[]);
    assert!(output.status.success(), "{output:?}");
    let mut checked = Vec::new();
    for entry in walk(&state) {
        let metadata = std::fs::symlink_metadata(&entry).expect("metadata");
        assert_eq!(
            metadata.uid(),
            nobody,
            "{} is not the owner's",
            entry.display()
        );
        checked.push(
            entry
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
        );
    }
    for name in ["agentgate.lock", "ledger.json", "ledger.lock", "quarantine"] {
        assert!(
            checked.iter().any(|c| c == name),
            "{name} not created: {checked:?}"
        );
    }
}

/// `serve` as root on a state directory that belongs to the service's user would leave files
/// that user cannot open: it does not start (73), and it changes nothing there.
#[test]
fn serve_as_root_refuses_another_users_state_directory() {
    if !root_or_skip("serve_as_root_refuses_another_users_state_directory") {
        return;
    }
    let workspace = prepared_workspace();
    let state = workspace.state_dir();
    let nobody = 65534;
    give_away(&state, nobody);
    let before = walk(&state);
    let mut serve = KillOnDrop(
        workspace
            .serve_command(&[])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("agentgate serve"),
    );
    let mut status = None;
    wait_until("serve to exit", Duration::from_secs(30), || {
        status = serve.0.try_wait().ok().flatten();
        status.is_some()
    });
    assert_eq!(status.and_then(|status| status.code()), Some(73));
    let mut said = String::new();
    if let Some(stderr) = serve.0.stderr.as_mut() {
        let _ = std::io::Read::read_to_string(stderr, &mut said);
    }
    assert!(said.contains("refusing to serve as root"), "{said}");
    assert_eq!(walk(&state), before);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).expect("list").flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        }
        found.push(path);
    }
    found
}

/// State files are 0600 whatever the umask of whoever created them.
#[test]
fn state_files_are_private_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let workspace = Workspace::new();
    workspace.write_config(ROUTE);
    let status = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg("umask 000; exec \"$0\" reconcile --config \"$1\"")
        .arg(BIN)
        .arg(workspace.config_path())
        .status()
        .expect("reconcile under umask 000");
    assert!(status.success());
    for name in ["agentgate.lock", "ledger.json", "ledger.lock"] {
        let mode = std::fs::metadata(workspace.state_dir().join(name))
            .expect(name)
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{name}");
    }
}

/// The state directory itself may be reached through a symbolic link (state on another disk);
/// only links that stand for state files are refused, the database's among them.
#[test]
fn a_linked_state_directory_works_but_a_linked_database_is_refused() {
    let workspace = Workspace::new();
    let real = workspace.path().join("elsewhere");
    std::fs::create_dir(&real).expect("real state directory");
    std::os::unix::fs::symlink(&real, workspace.state_dir()).expect("link the state directory");
    workspace.write_config(ROUTE);
    assert!(reconcile(&workspace, &[]).status.success());
    let daemon = workspace.start();
    assert_eq!(daemon.post_json("/hook", &[], "{}").status, 202);
    assert!(daemon.terminate().success());
    assert!(real.join("agentgate.db").is_file());

    let precious = workspace.path().join("precious.db");
    std::fs::write(&precious, b"keep me").expect("precious");
    std::fs::remove_file(real.join("agentgate.db")).expect("remove the database");
    std::os::unix::fs::symlink(&precious, real.join("agentgate.db")).expect("plant the link");
    let serve = workspace
        .serve_command(&[])
        .output()
        .expect("run agentgate serve");
    assert_eq!(serve.status.code(), Some(73));
    assert!(String::from_utf8_lossy(&serve.stderr).contains("symbolic link"));
    assert_eq!(std::fs::read(&precious).expect("precious"), b"keep me");
}

/// On a full state file system with nothing to repair, reconcile exits 0 (under systemd a
/// failing reconcile keeps the daemon from starting at all): a missing ledger that cannot be
/// created is a warning, since the daemon reads a missing ledger as empty.
#[test]
fn a_full_disk_does_not_fail_reconcile_when_the_daemon_can_start() {
    if !root_or_skip("a_full_disk_does_not_fail_reconcile_when_the_daemon_can_start") {
        return;
    }
    let filesystem = common::loopfs::LoopFs::new();
    let workspace = filesystem.workspace();
    workspace.write_config(&format!("[runtime]\nmin_free_disk = \"0\"\n{ROUTE}"));
    let daemon = workspace.start();
    assert_eq!(daemon.post_json("/hook", &[], "{}").status, 202);
    daemon.kill9();
    let _ = std::fs::remove_file(workspace.state_dir().join("ledger.json"));

    let fill = filesystem.fill();
    let output = reconcile(&workspace, &[]);
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{said}");
    assert!(
        said.contains("cannot create an empty retry ledger"),
        "{said}"
    );

    fill.free();
    let daemon = workspace.start();
    assert_eq!(daemon.post_json("/hook", &[], "{}").status, 202);
}

/// Whoever can write the database could plant a trigger for an operator's command, run as root,
/// to fire: a database holding a trigger or view agentgate did not create is refused, by the
/// commands and the daemon alike, naming what was planted.
#[test]
fn a_planted_trigger_is_refused_and_never_runs() {
    let workspace = prepared_workspace();
    let connection =
        rusqlite::Connection::open(workspace.state_dir().join("agentgate.db")).expect("open");
    connection
        .execute_batch(
            "CREATE TABLE fired (at INTEGER);
             CREATE TRIGGER planted AFTER UPDATE ON sessions BEGIN
                 INSERT INTO fired VALUES (1);
             END;",
        )
        .expect("plant");
    drop(connection);
    let resumed = workspace.cli(&["sessions", "resume", "victim"]);
    assert!(!resumed.status.success(), "{resumed:?}");
    let said = String::from_utf8_lossy(&resumed.stderr).to_string();
    assert!(said.contains("trigger planted"), "{said}");
    let listed = workspace.cli(&["sessions", "list"]);
    assert!(!listed.status.success(), "{listed:?}");
    let fired: Vec<i64> = workspace.query("SELECT count(*) FROM fired", |row| row.get(0));
    assert_eq!(fired, [0]);
}

/// Gives the state directory and what is directly in it to `owner`, as the service's user owns
/// them.
fn give_away(state: &Path, owner: u32) {
    for entry in std::fs::read_dir(state).expect("state").flatten() {
        std::os::unix::fs::chown(entry.path(), Some(owner), Some(owner)).expect("chown");
    }
    std::os::unix::fs::chown(state, Some(owner), Some(owner)).expect("chown state");
}
