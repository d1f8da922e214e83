//! Reads an `strace -f -yy` log and reports acknowledgements (an HTTP 2xx that answers a webhook,
//! written to a TCP socket) made while some file still had unsynced writes or some directory an unsynced entry, and
//! renames of files whose data was never synced.
//!
//! Only the state directory is watched (its files, itself, and its entry in its parent): logs and
//! other files are not state. The check is global within it: any dirty file blocks any ack. Drive
//! the traced daemon with one request at a time and keep background writes quiet, and every
//! finding is real.

use std::collections::{BTreeSet, HashMap};

#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<String>,
    pub acks: usize,
    pub syncs: usize,
}

/// `7</var/lib/x/agentgate.db-wal>` -> `/var/lib/x/agentgate.db-wal`;
/// `9<TCP:[127.0.0.1:8787->127.0.0.1:5555]>` -> `TCP:[127.0.0.1:8787->127.0.0.1:5555]`.
fn fd_target(argument: &str) -> Option<&str> {
    let start = argument.find('<')? + 1;
    let rest = &argument[start..];
    // Socket descriptions contain "->"; they end at "]>".
    let end = match rest.find(":[") {
        Some(_) => rest.find("]>")? + 1,
        None => rest.find('>')?,
    };
    Some(&rest[..end])
}

fn ignored(path: &str) -> bool {
    // SQLite's shared-memory index is mmap'd and rebuilt from the WAL; it carries no durability.
    path.ends_with("-shm")
        // Unix sockets are runtime objects, bound anew at every start.
        || path.ends_with(".sock")
}

fn parent(path: &str) -> String {
    match path.trim_end_matches('/').rfind('/') {
        Some(0) => "/".to_string(),
        Some(index) => path[..index].to_string(),
        None => ".".to_string(),
    }
}

/// Whether a write to a TCP socket answers a webhook with a 2xx: `/healthz` and `/readyz` answer
/// 200 too (`{"status":"ok"}`), but acknowledge nothing, and a daemon's own background writes
/// (a start's retry ledger) may race them.
fn is_acknowledgement(arguments: &str) -> bool {
    arguments.contains("HTTP/1.1 2") && !arguments.contains(r#"{\"status\":\"ok\"}"#)
}

/// The syscall name and its argument text of one strace line (after the pid).
fn split_call(line: &str) -> Option<(&str, &str)> {
    let open = line.find('(')?;
    Some((line[..open].trim(), &line[open + 1..]))
}

/// Checks `trace` for the state directory `state_dir`.
pub fn check(trace: &str, state_dir: &str) -> Report {
    let state_parent = parent(state_dir);
    let watched = |path: &str| {
        (path == state_dir || path == state_parent || path.starts_with(&format!("{state_dir}/")))
            && !ignored(path)
    };
    let mut report = Report::default();
    let mut dirty_files: BTreeSet<String> = BTreeSet::new();
    // Directory -> the entry that made it dirty (for the finding's text).
    let mut dirty_dirs: std::collections::BTreeMap<String, String> = Default::default();
    // Paths opened with O_CREAT before: only the first such open is taken to create the file.
    let mut created: BTreeSet<String> = BTreeSet::new();
    // pid -> the fsync'd path whose completion is still pending ("<unfinished ...>").
    let mut pending_sync: HashMap<String, String> = HashMap::new();
    for (number, raw) in trace.lines().enumerate() {
        let line_no = number + 1;
        let (pid, rest) = raw.split_once(char::is_whitespace).unwrap_or(("", raw));
        let rest = rest.trim_start();
        if let Some(resumed) = rest.strip_prefix("<... ") {
            let succeeded = resumed.trim_end().ends_with("= 0");
            if (resumed.starts_with("fsync resumed") || resumed.starts_with("fdatasync resumed"))
                && let Some(path) = pending_sync.remove(pid)
                && succeeded
            {
                report.syncs += 1;
                dirty_files.remove(&path);
                dirty_dirs.remove(&path);
            }
            continue;
        }
        let Some((call, arguments)) = split_call(rest) else {
            continue;
        };
        if rest
            .rsplit_once(" = ")
            .is_some_and(|(_, result)| result.trim_start().starts_with("-1"))
        {
            continue; // a failed call changed nothing
        }
        let unfinished = rest.contains("<unfinished ...>");
        let first = arguments.split(", ").next().unwrap_or("");
        match call {
            "write" | "pwrite64" | "writev" | "pwritev" | "pwritev2" | "sendto" | "sendmsg" => {
                let Some(target) = fd_target(first) else {
                    continue;
                };
                if target.starts_with("TCP:") || target.starts_with("TCPv6:") {
                    if is_acknowledgement(arguments) {
                        report.acks += 1;
                        if let Some(file) = dirty_files.iter().next() {
                            report.findings.push(format!(
                                "line {line_no}: ACK-BEFORE-DURABLE: 2xx written while {file} has unsynced data"
                            ));
                        } else if let Some((dir, entry)) = dirty_dirs.iter().next() {
                            report.findings.push(format!(
                                "line {line_no}: ACK-BEFORE-DURABLE: 2xx written while directory {dir} has an unsynced entry ({entry})"
                            ));
                        }
                    }
                } else if watched(target) {
                    dirty_files.insert(target.to_string());
                }
            }
            "fsync" | "fdatasync" => {
                let Some(target) = fd_target(first) else {
                    continue;
                };
                if unfinished {
                    pending_sync.insert(pid.to_string(), target.to_string());
                } else if rest.trim_end().ends_with("= 0") {
                    report.syncs += 1;
                    dirty_files.remove(target);
                    dirty_dirs.remove(target);
                }
            }
            "openat" | "creat" if arguments.contains("O_CREAT") => {
                if let Some(path) = arguments.split('"').nth(1)
                    && watched(path)
                    && created.insert(path.to_string())
                {
                    dirty_dirs.insert(parent(path), path.to_string());
                }
            }
            "rename" | "renameat" | "renameat2" | "unlink" | "unlinkat" | "mkdir" | "mkdirat" => {
                let paths: Vec<&str> = arguments.split('"').skip(1).step_by(2).collect();
                if call.starts_with("rename")
                    && let (Some(source), Some(target)) = (paths.first(), paths.get(1))
                    && dirty_files.remove(*source)
                {
                    report.findings.push(format!(
                        "line {line_no}: RENAME-UNSYNCED-SRC: {source} renamed before its data was synced"
                    ));
                    dirty_files.insert(target.to_string());
                }
                for path in paths.iter().filter(|p| watched(p)) {
                    dirty_dirs.insert(parent(path), (*path).to_string());
                }
            }
            _ => {}
        }
    }
    report
}
