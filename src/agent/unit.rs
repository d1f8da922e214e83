//! A sandboxed call in a systemd unit of its own (docs/tools.md, "Sandbox").
//!
//! Under the packaged units each sandboxed run (a command tool's call, a command delivery, the
//! command model) is an instance of `agentgate-tool@.service`, which systemd starts for each
//! connection to `agentgate-tool.socket` (`Accept=yes`). So systemd accounts for every call, the
//! template's limits apply to each (`MemoryMax=`, `TasksMax=`, … by `systemctl edit`), and
//! whatever a call leaves running is killed with its unit. The daemon needs no privilege for
//! that beyond its own socket: starting transient units through the manager would need a
//! polkit grant, and polkit cannot restrict the units so started, so the daemon's user would
//! become root-equivalent. The template is fixed; a tool cannot ask for a laxer one.
//!
//! The exchange on one connection: the daemon sends a [`Request`] (a big-endian `u32` length,
//! then JSON) with the child's stdin, stdout and stderr as descriptors (`SCM_RIGHTS`), so output
//! is read and capped exactly as for a local child; the instance (`agentgate tool-exec`) starts
//! the argv in its bubblewrap sandbox, in a process group of its own, and answers
//! with one [`Reply`] line. When the daemon shuts its end first (timeout, cancellation, its own
//! death), the instance stops the group and exits, and systemd stops the unit.

use std::ffi::OsString;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::confinement::Confinement;

/// The environment variable (set by the packaged service) that names the socket whose
/// connections systemd runs as tool units.
pub(crate) const SOCKET_VARIABLE: &str = "AGENTGATE_TOOL_SOCKET";
/// The largest request: an argv and environment, not data (stdin goes through its pipe).
const MAX_REQUEST: usize = 4 * 1024 * 1024;
/// How long the start's trial call may take.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Between SIGTERM and SIGKILL of the call's process group.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// What to start, as the daemon's [`super::process::Child`] would start it locally.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Request {
    pub program: String,
    pub args: Vec<String>,
    /// Names and values as bytes: the complete environment of the child.
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    pub cwd: Option<PathBuf>,
    /// The sandbox to start it in, set up here (a path is hidden where it exists in the unit).
    pub confinement: Option<Confinement>,
}

/// How the call ended, as the instance saw it.
#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    /// The leader's raw wait status.
    Exited(i32),
    /// It could not be started.
    NotStarted(String),
}

/// The socket named by [`SOCKET_VARIABLE`], if the daemon runs under the packaged units.
pub(crate) fn configured_socket() -> Option<PathBuf> {
    std::env::var_os(SOCKET_VARIABLE)
        .filter(|value| !value.is_empty())
        .map(PathBuf::from)
}

/// Connects to `socket` and hands it the call, with `stdio` (stdin, stdout, stderr) as the
/// child's. The connection is the call: closing it stops the call.
pub(crate) fn start(
    socket: &Path,
    request: &Request,
    stdio: [OwnedFd; 3],
) -> std::io::Result<UnixStream> {
    let json = serde_json::to_vec(request).map_err(std::io::Error::other)?;
    let length = u32::try_from(json.len())
        .ok()
        .filter(|length| (*length as usize) <= MAX_REQUEST)
        .ok_or_else(|| std::io::Error::other("the call's argv and environment are too large"))?;
    let mut frame = length.to_be_bytes().to_vec();
    frame.extend_from_slice(&json);
    let mut connection = UnixStream::connect(socket)?;
    let fds: [RawFd; 3] = [
        stdio[0].as_raw_fd(),
        stdio[1].as_raw_fd(),
        stdio[2].as_raw_fd(),
    ];
    let sent = sendmsg::<()>(
        connection.as_raw_fd(),
        &[IoSlice::new(&frame)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    connection.write_all(&frame[sent..])?;
    // The instance holds the child's ends now; ours close here.
    drop(stdio);
    Ok(connection)
}

/// Reads the instance's answer: the child's exit status, or why it did not start. An instance
/// that ended without answering (stopped by systemd, say) is an error.
pub(crate) fn read_reply(answer: &[u8]) -> Result<ExitStatus, String> {
    let line = answer
        .split(|byte| *byte == b'\n')
        .next()
        .unwrap_or_default();
    match serde_json::from_slice::<Reply>(line) {
        Ok(Reply::Exited(raw)) => Ok(ExitStatus::from_raw(raw)),
        Ok(Reply::NotStarted(reason)) => Err(reason),
        Err(_) => Err("its tool unit ended without an answer".to_string()),
    }
}

/// `agentgate tool-exec`: runs the one call on the connection systemd passed as stdin. An error
/// is a request that could not be read; the call's own failure is in the answer.
pub(crate) fn serve_connection() -> Result<(), String> {
    use std::os::fd::AsFd;
    let connection = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map(UnixStream::from)
        .map_err(|err| format!("no connection on stdin: {err}"))?;
    let (request, stdio) =
        receive(&connection).map_err(|err| format!("cannot read the call: {err}"))?;
    run(connection, request, stdio)
}

/// The request and its three descriptors.
fn receive(connection: &UnixStream) -> std::io::Result<(Request, [OwnedFd; 3])> {
    let mut head = vec![0u8; 64 * 1024];
    let mut space = nix::cmsg_space!([RawFd; 3]);
    let (read, fds) = {
        let mut slices = [IoSliceMut::new(&mut head)];
        let message = recvmsg::<()>(
            connection.as_raw_fd(),
            &mut slices,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for control in message.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = control {
                fds.extend(
                    received
                        .into_iter()
                        .map(crate::sys::adopt_received_descriptor),
                );
            }
        }
        (message.bytes, fds)
    };
    let stdio: [OwnedFd; 3] = fds
        .try_into()
        .map_err(|_| std::io::Error::other("a request must carry three descriptors"))?;
    head.truncate(read);
    let (length, body) = head
        .split_first_chunk::<4>()
        .ok_or_else(|| std::io::Error::other("a request too short for its length"))?;
    let length = u32::from_be_bytes(*length) as usize;
    if length > MAX_REQUEST {
        return Err(std::io::Error::other("a request over the size limit"));
    }
    let mut json = body.to_vec();
    if json.len() < length {
        let mut rest = vec![0u8; length - json.len()];
        (&*connection).read_exact(&mut rest)?;
        json.extend_from_slice(&rest);
    }
    json.truncate(length);
    let request = serde_json::from_slice(&json).map_err(std::io::Error::other)?;
    Ok((request, stdio))
}

/// What the instance waits for: the call's end, or the daemon closing the connection.
enum Ending {
    Exited(std::io::Result<ExitStatus>),
    Hangup,
}

/// Starts the request and answers when it ends, or stops it when the daemon hangs up.
fn run(mut connection: UnixStream, request: Request, stdio: [OwnedFd; 3]) -> Result<(), String> {
    let [stdin, stdout, stderr] = stdio;
    let mut argv = match &request.confinement {
        Some(confinement) => confinement.wrapper(request.cwd.as_deref()),
        None => Vec::new(),
    };
    argv.push(request.program.clone());
    argv.extend(request.args);
    let mut command = std::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .env_clear()
        .envs(
            request
                .env
                .into_iter()
                .map(|(name, value)| (OsString::from_vec(name), OsString::from_vec(value))),
        )
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr));
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    if let Some(cwd) = &request.cwd {
        command.current_dir(cwd);
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            let reason = format!("cannot start {}: {err}", request.program);
            answer(&mut connection, &Reply::NotStarted(reason));
            return Ok(());
        }
    };
    let group = i32::try_from(child.id()).ok().map(Pid::from_raw);
    let (events, ending) = mpsc::channel();
    let exits = events.clone();
    std::thread::spawn(move || {
        let _ = exits.send(Ending::Exited(child.wait()));
    });
    let signal_group = |signal: Signal| {
        if let Some(group) = group {
            let _ = killpg(group, signal);
        }
    };
    match connection.try_clone() {
        Ok(mut hangup) => {
            std::thread::spawn(move || {
                // The daemon writes nothing after the request: a read that ends means it hung
                // up.
                let _ = hangup.read(&mut [0u8; 1]);
                let _ = events.send(Ending::Hangup);
            });
        }
        Err(err) => {
            signal_group(Signal::SIGKILL);
            return Err(format!("cannot watch the connection: {err}"));
        }
    }
    let status = match ending.recv() {
        Ok(Ending::Exited(status)) => status,
        Ok(Ending::Hangup) | Err(_) => {
            signal_group(Signal::SIGTERM);
            let waited = wait_for_exit(&ending, KILL_GRACE);
            signal_group(Signal::SIGKILL);
            match waited {
                Some(status) => status,
                None => return Ok(()),
            }
        }
    };
    // Whatever the leader left running in its group goes with it (and the unit's end takes
    // anything that left the group).
    signal_group(Signal::SIGKILL);
    match status {
        Ok(status) => answer(&mut connection, &Reply::Exited(status.into_raw())),
        Err(err) => answer(&mut connection, &Reply::NotStarted(err.to_string())),
    }
    Ok(())
}

/// The call's exit status, if it comes within `grace`.
fn wait_for_exit(
    ending: &mpsc::Receiver<Ending>,
    grace: Duration,
) -> Option<std::io::Result<ExitStatus>> {
    let deadline = std::time::Instant::now() + grace;
    loop {
        let left = deadline.checked_duration_since(std::time::Instant::now())?;
        match ending.recv_timeout(left) {
            Ok(Ending::Exited(status)) => return Some(status),
            Ok(Ending::Hangup) => {}
            Err(_) => return None,
        }
    }
}

fn answer(connection: &mut UnixStream, reply: &Reply) {
    if let Ok(mut line) = serde_json::to_vec(reply) {
        line.push(b'\n');
        // A daemon that is gone has no use for the answer.
        let _ = connection.write_all(&line);
    }
}

/// The environment entry as the request carries it.
pub(crate) fn env_entry(name: &std::ffi::OsStr, value: &std::ffi::OsStr) -> (Vec<u8>, Vec<u8>) {
    (name.as_bytes().to_vec(), value.as_bytes().to_vec())
}

/// Runs `/bin/true` (stdin empty, output discarded) in a tool unit, confined, and says whether
/// it succeeded:
/// the start's check that tool units work. Blocking, bounded by a timeout.
pub(crate) fn trial(socket: &Path, confinement: Confinement) -> Result<(), String> {
    let request = Request {
        program: "/bin/true".to_string(),
        args: Vec::new(),
        env: Vec::new(),
        cwd: None,
        confinement: Some(confinement),
    };
    let null = |write: bool| {
        std::fs::OpenOptions::new()
            .read(!write)
            .write(write)
            .open("/dev/null")
            .map(OwnedFd::from)
    };
    let stdio = [null(false), null(true), null(true)];
    let [Ok(stdin), Ok(stdout), Ok(stderr)] = stdio else {
        return Err("cannot open /dev/null".to_string());
    };
    let mut connection = start(socket, &request, [stdin, stdout, stderr]).map_err(|err| {
        format!(
            "cannot start a tool unit through {}: {err}",
            socket.display()
        )
    })?;
    connection
        .set_read_timeout(Some(TRIAL_TIMEOUT))
        .map_err(|err| err.to_string())?;
    let mut answer = Vec::new();
    let _ = connection.read_to_end(&mut answer);
    match read_reply(&answer)? {
        status if status.success() => Ok(()),
        status => Err(format!(
            "a trial sandbox in a tool unit ended with {status}"
        )),
    }
}
