//! Runs a configured tool: argv only (never a shell), the call's JSON arguments on stdin, its own
//! process group, a timeout, and capped output.
//!
//! On timeout or cancellation the whole process group gets SIGTERM, then SIGKILL after a grace
//! period, so a tool's children die with it. Tools get a clean environment: nothing of the daemon's
//! own (credentials, notify and activation variables) leaks into them.

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::config::ToolSettings;

/// Output kept per stream, counted in stored bytes (`untrusted::tool_output`); the rest is read
/// and discarded, and the truncation is marked.
pub(crate) const OUTPUT_CAP: usize = 64 * 1024;
/// Between SIGTERM and SIGKILL of a tool's process group.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// Environment variables a tool inherits from the daemon.
const INHERITED_ENVIRONMENT: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME"];

/// How a tool run ended, as recorded in the transcript and shown to the model.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct ToolOutcome {
    /// The exit code, if the tool exited on its own.
    pub exit_status: Option<i32>,
    /// The signal that ended it, if any.
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stdout_truncated: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stderr_truncated: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ToolOutcome {
    fn failed_to_start(message: String) -> ToolOutcome {
        ToolOutcome {
            exit_status: None,
            signal: None,
            stdout: String::new(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            timed_out: false,
            error: Some(message),
        }
    }
}

impl ToolOutcome {
    /// How the call ended, as the `result` label of `agentgate_tool_calls_total`.
    pub(crate) fn result(&self) -> &'static str {
        if self.timed_out {
            "timeout"
        } else if self.exit_status == Some(0) {
            "ok"
        } else {
            "error"
        }
    }
}

/// Why a tool did not produce an outcome.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ToolAbort {
    /// The turn was cancelled; the process group was killed.
    Cancelled,
}

async fn read_capped<R: AsyncRead + Unpin>(mut reader: R) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buffer = [0u8; 16 * 1024];
    loop {
        match reader.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = OUTPUT_CAP.saturating_sub(kept.len());
                kept.extend_from_slice(&buffer[..n.min(room)]);
                truncated |= n > room;
            }
        }
    }
    (kept, truncated)
}

fn signal_group(pgid: i32, signal: Signal) {
    // A group that is already gone (ESRCH) is what we wanted.
    let _ = killpg(Pid::from_raw(pgid), signal);
}

fn marked(bytes: &[u8], truncated: bool) -> (String, bool) {
    crate::untrusted::tool_output(&String::from_utf8_lossy(bytes), truncated, OUTPUT_CAP)
}

/// A command for a tool process (a command tool, an MCP server): a clean environment with only
/// `INHERITED_ENVIRONMENT` and the daemon's `OWNER_VARIABLE`, a process group of its own, and
/// death with the daemon.
pub(crate) fn isolated_command(program: &str, args: &[String]) -> Command {
    let mut command = Command::new(program);
    command
        .args(args)
        .env_clear()
        .envs(
            INHERITED_ENVIRONMENT
                .iter()
                .filter_map(|name| std::env::var_os(name).map(|value| (*name, value))),
        )
        .process_group(0)
        .kill_on_drop(true);
    if let Some(owner) = OWNER.get() {
        command.env(OWNER_VARIABLE, owner);
    }
    crate::sys::die_with_daemon(&mut command);
    command
}

/// Names the daemon that started a tool process, in its environment (and, unless a tool clears
/// it, in that of everything the tool starts): the state directory, which one daemon at a time
/// holds.
const OWNER_VARIABLE: &str = "AGENTGATE_STATE_DIRECTORY";

static OWNER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// At start, before any tool runs: marks this daemon's tool processes, and kills what an
/// earlier run of it left behind. `PR_SET_PDEATHSIG` takes a tool itself down with a daemon
/// killed outside systemd, but not the tool's own children, and an idempotent re-run of the call
/// must not race them. A process is killed only if its environment names this state directory,
/// and only if its start time did not change while it was checked (a reused pid is never
/// killed). Returns how many processes were killed.
pub(crate) fn claim_and_reap_leftovers(state_dir: &std::path::Path) -> usize {
    let owner = state_dir.display().to_string();
    let _ = OWNER.set(owner.clone());
    let wanted = format!("{OWNER_VARIABLE}={owner}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let own = std::process::id();
    let mut killed = 0;
    for pid in entries.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
        if pid == own {
            continue;
        }
        let Some(started) = start_time(pid) else {
            continue;
        };
        // Another user's processes are not readable, and not ours.
        let Ok(environment) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let ours = environment
            .split(|byte| *byte == 0)
            .any(|variable| variable == wanted.as_bytes());
        let Ok(raw_pid) = i32::try_from(pid) else {
            continue;
        };
        if ours
            && start_time(pid) == Some(started)
            && nix::sys::signal::kill(Pid::from_raw(raw_pid), Signal::SIGKILL).is_ok()
        {
            killed += 1;
        }
    }
    killed
}

/// A process's start time (clock ticks after boot), field 22 of `/proc/PID/stat`.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its closing one.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// The environment variable that carries a call's idempotency key: the same when an interrupted
/// call is run again, different for every other call.
pub(crate) const CALL_KEY_VARIABLE: &str = "AGENTGATE_TOOL_CALL_ID";

/// Runs `tool` with `arguments` on stdin and the call's `key` in `AGENTGATE_TOOL_CALL_ID`.
/// Resolves when the tool exits, is killed at its timeout, or `cancel` fires (then its process
/// group is killed and `Cancelled` returned).
pub(crate) async fn run(
    tool: &ToolSettings,
    arguments: &serde_json::Value,
    key: &str,
    cancel: &CancellationToken,
) -> Result<ToolOutcome, ToolAbort> {
    let Some((program, rest)) = tool.command.split_first() else {
        return Ok(ToolOutcome::failed_to_start(
            "the tool has no command".into(),
        ));
    };
    let mut command = isolated_command(program, rest);
    command
        .env(CALL_KEY_VARIABLE, key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            return Ok(ToolOutcome::failed_to_start(format!(
                "cannot start {program}: {err}"
            )));
        }
    };
    let pgid = child.id().map_or(0, |pid| pid as i32);
    if let Some(mut stdin) = child.stdin.take() {
        let input = arguments.to_string();
        // A tool that does not read stdin closes it early; that is not an error.
        tokio::spawn(async move {
            let _ = stdin.write_all(input.as_bytes()).await;
        });
    }
    let stdout = child.stdout.take().map(|s| tokio::spawn(read_capped(s)));
    let stderr = child.stderr.take().map(|s| tokio::spawn(read_capped(s)));
    let mut timed_out = false;
    let status = tokio::select! {
        status = child.wait() => {
            // The tool is done: whatever it left running in its group goes with it, so that a
            // later re-run never races a leftover of this one.
            if pgid > 0 {
                signal_group(pgid, Signal::SIGKILL);
            }
            status
        }
        () = tokio::time::sleep(tool.timeout) => {
            timed_out = true;
            terminate_group(&mut child, pgid).await
        }
        () = cancel.cancelled() => {
            let _ = terminate_group(&mut child, pgid).await;
            return Err(ToolAbort::Cancelled);
        }
    };
    // Children that escaped may still hold the pipes; do not wait on them forever.
    let collect = |handle: Option<tokio::task::JoinHandle<(Vec<u8>, bool)>>| async move {
        match handle {
            Some(handle) => tokio::time::timeout(KILL_GRACE, handle)
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default(),
            None => Default::default(),
        }
    };
    let (stdout, stdout_truncated) = collect(stdout).await;
    let (stdout, stdout_truncated) = marked(&stdout, stdout_truncated);
    let (stderr, stderr_truncated) = collect(stderr).await;
    let (stderr, stderr_truncated) = marked(&stderr, stderr_truncated);
    let (exit_status, signal, error) = match status {
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt;
            (status.code(), status.signal(), None)
        }
        Err(err) => (
            None,
            None,
            Some(format!("waiting for the tool failed: {err}")),
        ),
    };
    Ok(ToolOutcome {
        exit_status,
        signal,
        stdout,
        stderr,
        stdout_truncated,
        stderr_truncated,
        timed_out,
        error: error.or_else(|| {
            timed_out.then(|| format!("killed after its timeout of {:?}", tool.timeout))
        }),
    })
}

/// SIGTERM to the group, SIGKILL after the grace period; returns the leader's exit status.
async fn terminate_group(
    child: &mut tokio::process::Child,
    pgid: i32,
) -> std::io::Result<std::process::ExitStatus> {
    if pgid > 0 {
        signal_group(pgid, Signal::SIGTERM);
    }
    let waited = tokio::time::timeout(KILL_GRACE, child.wait()).await;
    // Whether the leader left within the grace period or not, no member of its group outlives it.
    if pgid > 0 {
        signal_group(pgid, Signal::SIGKILL);
    }
    match waited {
        Ok(status) => status,
        Err(_) => child.wait().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn what_a_tool_leaves_running_is_killed_when_it_exits() {
        let spawner = tool(
            &["/bin/sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
            Duration::from_secs(10),
        );
        let outcome = run_alone(&spawner).await;
        let pid: u32 = outcome.stdout.trim().parse().expect("the background pid");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        // Killed, then reaped by init: its /proc entry goes (a zombie's says "Z").
        loop {
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if state.is_empty() || state.split(' ').nth(2) == Some("Z") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "sleep {pid} still runs"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs `tool` with no arguments and nothing cancelling it.
    async fn run_alone(tool: &ToolSettings) -> ToolOutcome {
        run(tool, &serde_json::json!({}), "k", &CancellationToken::new())
            .await
            .expect("the tool ran")
    }

    fn tool(command: &[&str], timeout: Duration) -> ToolSettings {
        ToolSettings {
            name: "t".into(),
            description: String::new(),
            command: command
                .iter()
                .map(std::string::ToString::to_string)
                .collect(),
            parameters: serde_json::json!({"type": "object"}),
            timeout,
            idempotent: false,
            background: false,
            dedupes: false,
        }
    }

    #[tokio::test]
    async fn arguments_arrive_on_stdin_and_status_is_recorded() {
        let cat = tool(
            &[
                "/bin/sh",
                "-c",
                "cat; echo \" $AGENTGATE_TOOL_CALL_ID\"; exit 3",
            ],
            Duration::from_secs(5),
        );
        let outcome = run(
            &cat,
            &serde_json::json!({"x": 1}),
            "turn.1",
            &CancellationToken::new(),
        )
        .await
        .expect("runs");
        assert_eq!(outcome.stdout, "{\"x\":1} turn.1\n");
        assert_eq!(outcome.exit_status, Some(3));
    }

    #[tokio::test]
    async fn output_is_capped_and_marked() {
        let flood = tool(
            &["/bin/sh", "-c", "head -c 10000000 /dev/zero | tr '\\0' a"],
            Duration::from_secs(20),
        );
        let outcome = run_alone(&flood).await;
        assert!(outcome.stdout_truncated);
        assert!(outcome.stdout.len() < OUTPUT_CAP + 100);
        assert!(outcome.stdout.ends_with("bytes]"));
        assert_eq!(outcome.exit_status, Some(0));
    }

    #[tokio::test]
    async fn a_hung_tool_and_its_children_are_killed_at_the_timeout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("child.pid");
        let script = format!("sleep 300 & echo $! > {}; wait", pid_file.display());
        let hang = tool(&["/bin/sh", "-c", &script], Duration::from_millis(300));
        let outcome = run_alone(&hang).await;
        assert!(outcome.timed_out);
        let child: i32 = std::fs::read_to_string(&pid_file)
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid");
        // Dead means gone or a zombie waiting for its new parent to reap it.
        let alive = || {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .map(|stat| {
                    stat.rsplit(')')
                        .next()
                        .and_then(|rest| rest.split_whitespace().next())
                        != Some("Z")
                })
                .unwrap_or(false)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while alive() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!alive(), "the tool's child survived the timeout");
    }

    #[tokio::test]
    async fn cancellation_kills_the_tool() {
        let hang = tool(&["/bin/sleep", "300"], Duration::from_secs(300));
        let cancel = CancellationToken::new();
        let trigger = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            trigger.cancel();
        });
        let started = std::time::Instant::now();
        assert_eq!(
            run(&hang, &serde_json::json!({}), "k", &cancel).await,
            Err(ToolAbort::Cancelled)
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_missing_program_is_an_error_outcome() {
        let missing = tool(&["/nonexistent/tool"], Duration::from_secs(1));
        let outcome = run_alone(&missing).await;
        assert!(outcome.error.is_some_and(|e| e.contains("cannot start")));
    }
}
