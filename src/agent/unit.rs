//! A sandboxed call in a systemd unit of its own (docs/tools.md, "Sandbox").
//!
//! Under the packaged units each sandboxed child (a command tool's call, a command delivery, a
//! stdio MCP server) is an instance of `agentgate-tool@.service`, which systemd
//! starts for each connection to `agentgate-tool.socket` (`Accept=yes`), or, when it may use the
//! network, of `agentgate-tool-network@.service` through `agentgate-tool-network.socket`: the
//! first has no network and no Unix sockets at all, whatever its request says. So systemd
//! accounts for every call, the template's limits apply to each (`MemoryMax=`, `TasksMax=`, …
//! by `systemctl edit`), and whatever a call leaves running is killed with its unit. The daemon
//! needs no privilege for that beyond its own sockets: starting transient units through the
//! manager would need a polkit grant, and polkit cannot restrict the units so started, so the
//! daemon's user would become root-equivalent.
//!
//! The exchange on one connection: the daemon sends a [`Request`] (a big-endian `u32` length,
//! then JSON); the instance (`agentgate tool-exec`) creates the child's stdin, stdout and stderr
//! pipes and sends the daemon its ends (`SCM_RIGHTS`, with one [`STDIO_MARK`] byte), so output is
//! read and capped exactly as for a local child, starts the argv in its bubblewrap sandbox, in a
//! process group of its own, and answers with one [`Reply`] line. The instance creates the pipes
//! because Linux charges a pipe's buffers to the user who created it: a call that grows its
//! pipes (`F_SETPIPE_SZ`) uses up the tool user's allowance (`fs.pipe-user-pages-soft`), never
//! the daemon's. When the daemon shuts its end first (timeout, cancellation, its own death), the
//! instance stops the group and exits, and systemd stops the unit.
//!
//! The instance trusts neither the connection nor the request ([`admit`], [`floor`]): only the
//! daemon's own process (its user or root, in `agentgate.service`'s cgroup, not in a tool
//! unit) may ask, and whatever it asks, the sandbox hides at least what the unit's floor names,
//! from settings no tool can change; a request that asks for less is refused and logged.

use std::io::{IoSlice, IoSliceMut, Read, Seek, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
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
use crate::config::{ConfigSource, HiddenPaths};

/// The environment variable (set by the packaged service) that names the socket whose
/// connections systemd runs as tool units without the network.
pub(crate) const SOCKET_VARIABLE: &str = "AGENTGATE_TOOL_SOCKET";
/// The same for the units of calls that may use the network.
pub(crate) const NETWORK_SOCKET_VARIABLE: &str = "AGENTGATE_TOOL_NETWORK_SOCKET";
/// Set to `no` by a tool unit template whose calls have no network: such an instance refuses a
/// request that asks for it (its unit has none to give in any case).
const UNIT_NETWORK_VARIABLE: &str = "AGENTGATE_TOOL_UNIT_NETWORK";
/// The unit whose process alone may start calls in a tool unit.
const DAEMON_UNIT: &str = "agentgate.service";
/// Set by the tool unit templates: the daemon's user, whose calls (and root's) a unit takes. The
/// unit runs as a user of its own (`_agentgate-tool`), so that what the kernel bounds per user
/// (epoll watches, processes, user namespaces, pipe buffers) a call can use up is never the
/// daemon's, and no file only the daemon's user may read is open to a call.
const DAEMON_USER_VARIABLE: &str = "AGENTGATE_DAEMON_USER";
/// The largest request: an argv and environment, not data (stdin goes through its pipe).
const MAX_REQUEST: usize = 4 * 1024 * 1024;
/// The byte that carries the daemon's ends of a call's stdio: never the first of a [`Reply`]
/// line, which is JSON.
const STDIO_MARK: u8 = 0;
/// How long the start's trial call may take.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Between SIGTERM and SIGKILL of the call's process group.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// What the daemon asks of a tool unit.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Request {
    /// Start a child, as the daemon's [`super::process::Child`] would start it locally.
    Run(Call),
    /// Which of these paths the unit cannot write (the start's check of `writable` paths).
    CheckWritable(Vec<PathBuf>),
}

/// A child to start.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Call {
    pub program: String,
    pub args: Vec<String>,
    /// Names and values as bytes: the complete environment of the child.
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    pub cwd: Option<PathBuf>,
    /// The sandbox to start it in, set up here (a path is hidden where it exists in the unit).
    /// Always given: one without is refused.
    pub confinement: Option<Confinement>,
}

/// How the request ended, as the instance saw it.
#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    /// The leader's raw wait status.
    Exited(i32),
    /// It could not be started, or it was refused.
    NotStarted(String),
    /// The paths of a [`Request::CheckWritable`] this unit cannot write, each with the reason.
    NotWritable(Vec<(PathBuf, String)>),
}

/// The sockets whose connections systemd runs as tool units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnitSockets {
    /// For children without the network.
    pub strict: PathBuf,
    /// For children with it; `None` when the service names none (they cannot run then).
    pub network: Option<PathBuf>,
}

impl UnitSockets {
    /// The socket of a child with or without the network.
    pub(crate) fn for_network(&self, network: bool) -> Option<&Path> {
        if network {
            self.network.as_deref()
        } else {
            Some(&self.strict)
        }
    }

    /// Both sockets, as files no sandboxed process may reach.
    pub(crate) fn files(&self) -> Vec<PathBuf> {
        std::iter::once(self.strict.clone())
            .chain(self.network.clone())
            .collect()
    }
}

/// The sockets named by [`SOCKET_VARIABLE`] and [`NETWORK_SOCKET_VARIABLE`], if the daemon
/// runs under the packaged units.
pub(crate) fn configured_sockets() -> Option<UnitSockets> {
    let named = |variable: &str| {
        std::env::var_os(variable)
            .filter(|value| !value.is_empty())
            .map(PathBuf::from)
    };
    Some(UnitSockets {
        strict: named(SOCKET_VARIABLE)?,
        network: named(NETWORK_SOCKET_VARIABLE),
    })
}

/// The request as a tool unit reads it: its length (4 bytes, big-endian), then its JSON. The
/// daemon connects to the unit's socket and writes this; the connection is the call (closing it
/// stops the call), and what comes back first is its [`Opening`].
pub(crate) fn encode(request: &Request) -> std::io::Result<Vec<u8>> {
    let json = serde_json::to_vec(request).map_err(std::io::Error::other)?;
    let length = u32::try_from(json.len())
        .ok()
        .filter(|length| (*length as usize) <= MAX_REQUEST)
        .ok_or_else(|| std::io::Error::other("the call's argv and environment are too large"))?;
    let mut message = Vec::with_capacity(4 + json.len());
    message.extend_from_slice(&length.to_be_bytes());
    message.extend_from_slice(&json);
    Ok(message)
}

/// What a tool unit sends first.
pub(crate) enum Opening {
    /// The daemon's ends of the call's stdin, stdout and stderr: the call is being started.
    Stdio([OwnedFd; 3]),
    /// No descriptors: the first byte of the answer (a refusal), or nothing (it hung up).
    Answer(Vec<u8>),
}

/// Reads what the tool unit at the other end of `connection` sends first. On a non-blocking
/// socket, `WouldBlock` until it has sent it.
pub(crate) fn opening(connection: RawFd) -> std::io::Result<Opening> {
    let mut first = [0u8; 1];
    let mut space = nix::cmsg_space!([RawFd; 3]);
    let mut slices = [IoSliceMut::new(&mut first)];
    let message = recvmsg::<()>(
        connection,
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
    let read = message.bytes;
    if fds.is_empty() {
        return Ok(Opening::Answer(first[..read].to_vec()));
    }
    match <[OwnedFd; 3]>::try_from(fds) {
        Ok(stdio) if read == 1 && first[0] == STDIO_MARK => Ok(Opening::Stdio(stdio)),
        _ => Err(std::io::Error::other(
            "its tool unit sent something other than the call's three pipes",
        )),
    }
}

/// Reads the instance's answer: the child's exit status, or why it did not start. An instance
/// that ended without answering (stopped by systemd, say) is an error.
pub(crate) fn read_reply(answer: &[u8]) -> Result<ExitStatus, String> {
    match parse_reply(answer) {
        Ok(Reply::Exited(raw)) => Ok(ExitStatus::from_raw(raw)),
        Ok(Reply::NotStarted(reason)) => Err(reason),
        Ok(Reply::NotWritable(_)) => Err("its tool unit answered another request".to_string()),
        Err(reason) => Err(reason),
    }
}

fn parse_reply(answer: &[u8]) -> Result<Reply, String> {
    let line = answer
        .split(|byte| *byte == b'\n')
        .next()
        .unwrap_or_default();
    serde_json::from_slice::<Reply>(line)
        .map_err(|_| "its tool unit ended without an answer".to_string())
}

/// `agentgate tool-exec`: runs the one request on the connection systemd passed as stdin. An
/// error is a request that could not be read or was refused (also logged, and answered); the
/// call's own failure is in the answer.
pub(crate) fn serve_connection() -> Result<(), String> {
    use std::os::fd::AsFd;
    let mut connection = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map(UnixStream::from)
        .map_err(|err| format!("no connection on stdin: {err}"))?;
    if let Err(reason) = admit(&connection) {
        return Err(refuse(&mut connection, &reason));
    }
    let request = receive(&connection).map_err(|err| format!("cannot read the call: {err}"))?;
    match request {
        Request::Run(call) => match confined(&connection, &call) {
            Ok(confinement) => {
                let stdio = hand_over_stdio(&connection)
                    .map_err(|err| format!("cannot hand over the call's stdio: {err}"))?;
                run(connection, call, confinement, stdio)
            }
            Err(reason) => Err(refuse(&mut connection, &reason)),
        },
        Request::CheckWritable(paths) => {
            answer(&mut connection, &Reply::NotWritable(not_writable(&paths)));
            Ok(())
        }
    }
}

/// Logs a refusal (as an error, which the template's `LogLevelMax=` keeps) and answers it.
fn refuse(connection: &mut UnixStream, reason: &str) -> String {
    let line = format!("refused: {reason}");
    eprintln!("<3>{line}");
    answer(
        connection,
        &Reply::NotStarted(format!("its tool unit {line}")),
    );
    line
}

/// Whether the process at the other end may ask for calls: the daemon, that is, a process of
/// the daemon's user ([`DAEMON_USER_VARIABLE`], else this unit's own) or root, in the daemon's
/// unit, `agentgate.service`. Outside a tool unit (a test's `systemd-socket-activate`), a
/// process in this one's own cgroup.
fn admit(connection: &UnixStream) -> Result<(), String> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let peer = getsockopt(connection, PeerCredentials)
        .map_err(|err| format!("the caller cannot be identified: {err}"))?;
    let daemon_user = daemon_user()?;
    let (pid, user) = (peer.pid(), peer.uid());
    let theirs = cgroup_of(&pid.to_string());
    let who = format!(
        "pid {pid}, uid {user}, cgroup {}",
        theirs.as_deref().unwrap_or("unknown")
    );
    if user != daemon_user && user != 0 {
        return Err(format!("a call from {who}: not the daemon's user"));
    }
    let own = cgroup_of("self").ok_or_else(|| format!("a call from {who}: own cgroup unknown"))?;
    let Some(theirs) = theirs else {
        return Err(format!("a call from {who}: its cgroup cannot be read"));
    };
    let leaf = |cgroup: &str| cgroup.rsplit('/').next().unwrap_or_default().to_string();
    let in_tool_unit = leaf(&own).starts_with("agentgate-tool");
    let allowed = if in_tool_unit {
        theirs == daemon_cgroup(&own)
    } else {
        theirs == own
    };
    if allowed {
        Ok(())
    } else {
        Err(format!(
            "a call from {who}: only {DAEMON_UNIT} may start calls here"
        ))
    }
}

/// The uid of the daemon's user: the one [`DAEMON_USER_VARIABLE`] names, else this process's own.
fn daemon_user() -> Result<u32, String> {
    let Some(name) = std::env::var(DAEMON_USER_VARIABLE)
        .ok()
        .filter(|name| !name.is_empty())
    else {
        return Ok(nix::unistd::getuid().as_raw());
    };
    match nix::unistd::User::from_name(&name) {
        Ok(Some(user)) => Ok(user.uid.as_raw()),
        Ok(None) => Err(format!(
            "the daemon's user {name} ({DAEMON_USER_VARIABLE}) does not exist"
        )),
        Err(err) => Err(format!(
            "the daemon's user {name} cannot be looked up: {err}"
        )),
    }
}

/// The daemon's cgroup, seen from a tool unit's (`own`): `agentgate.service` in the system
/// manager's slice that holds the tool units, `/system.slice/agentgate.service`. The whole path,
/// not its last part: a user's manager can run a unit of that name too
/// (`/user.slice/…/user@UID.service/app.slice/agentgate.service`).
fn daemon_cgroup(own: &str) -> String {
    let slice = own
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or_default();
    format!("/{slice}/{DAEMON_UNIT}")
}

/// The cgroup (v2) of process `pid` ("self" for this one), as `/proc` shows it.
fn cgroup_of(pid: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(str::to_string)
}

/// What this unit hides from every call, whatever its request says: the config's floor
/// ([`crate::config::floor`], read here from the file only root may write); and what a request
/// must hide itself: [`crate::config::ALWAYS_HIDDEN`] and the socket the call came in through.
fn floor(connection: &UnixStream) -> Result<(HiddenPaths, HiddenPaths), String> {
    let source = ConfigSource::resolve(None);
    let mut floor = crate::config::floor(&source)
        .map_err(|err| format!("the sandbox's floor cannot be read from {source}: {err}"))?;
    let own_socket =
        nix::sys::socket::getsockname::<nix::sys::socket::UnixAddr>(connection.as_raw_fd())
            .ok()
            .and_then(|address| address.path().map(Path::to_path_buf));
    let required = HiddenPaths {
        dirs: crate::config::ALWAYS_HIDDEN
            .iter()
            .map(PathBuf::from)
            .collect(),
        files: own_socket.clone().into_iter().collect(),
    };
    floor.files.extend(own_socket);
    Ok((floor, required))
}

/// The sandbox a call runs in: its request's, held against this unit's floor. A request that
/// asks for no sandbox, for the network in a unit without one, or for less than the floor (a
/// path of it shown, or writable) is refused; what the config names beyond the request is
/// hidden as well (a daemon that has not reloaded a changed config yet does not know it).
fn confined(connection: &UnixStream, call: &Call) -> Result<Confinement, String> {
    let Some(requested) = &call.confinement else {
        return Err("a call that asks for no sandbox".to_string());
    };
    // bubblewrap reads its options NUL-separated: a NUL would start an option of the request's
    // making.
    let paths = requested
        .writable
        .iter()
        .chain(&requested.hidden_dirs)
        .chain(&requested.hidden_files)
        .chain(&call.cwd);
    let nul = |bytes: &[u8]| bytes.contains(&0);
    if call.env.iter().any(|(name, value)| nul(name) || nul(value))
        || paths
            .into_iter()
            .any(|path| nul(path.as_os_str().as_bytes()))
    {
        return Err("a call with a NUL byte in its environment or its paths".to_string());
    }
    let unit_has_network = std::env::var(UNIT_NETWORK_VARIABLE).as_deref() != Ok("no");
    if requested.network && !unit_has_network {
        return Err("a call that asks for the network in a unit without it".to_string());
    }
    let (floor, required) = floor(connection)?;
    if let Some(why) = requested.falls_short_of(&required) {
        return Err(format!("a call whose sandbox is below the floor: {why}"));
    }
    let raised = requested.clone().hiding(&floor);
    match raised.falls_short_of(&floor) {
        Some(why) => Err(format!("a call whose sandbox is below the floor: {why}")),
        None => Ok(raised),
    }
}

/// Each of `paths` that a call in this unit could not write, with the reason: a path outside
/// the template's `ReadWritePaths=` is on a read-only file system here.
fn not_writable(paths: &[PathBuf]) -> Vec<(PathBuf, String)> {
    use nix::unistd::{AccessFlags, access};
    paths
        .iter()
        .filter_map(|path| {
            let refused = access(path.as_path(), AccessFlags::W_OK).err()?;
            Some((path.clone(), refused.desc().to_string()))
        })
        .collect()
}

/// The request: its length, then its JSON. (Descriptors sent along are discarded unread.)
fn receive(mut connection: &UnixStream) -> std::io::Result<Request> {
    let mut length = [0u8; 4];
    connection.read_exact(&mut length)?;
    let length = u32::from_be_bytes(length) as usize;
    if length > MAX_REQUEST {
        return Err(std::io::Error::other("a request over the size limit"));
    }
    let mut json = vec![0u8; length];
    connection.read_exact(&mut json)?;
    serde_json::from_slice(&json).map_err(std::io::Error::other)
}

/// Creates the call's stdio pipes, here, as this unit's user, and sends the daemon its ends
/// (stdin's write end, the read ends of stdout and stderr); returns the child's.
fn hand_over_stdio(connection: &UnixStream) -> std::io::Result<[OwnedFd; 3]> {
    let (stdin, stdin_daemon) = std::io::pipe()?;
    let (stdout_daemon, stdout) = std::io::pipe()?;
    let (stderr_daemon, stderr) = std::io::pipe()?;
    let daemon: [RawFd; 3] = [
        stdin_daemon.as_raw_fd(),
        stdout_daemon.as_raw_fd(),
        stderr_daemon.as_raw_fd(),
    ];
    sendmsg::<()>(
        connection.as_raw_fd(),
        &[IoSlice::new(&[STDIO_MARK])],
        &[ControlMessage::ScmRights(&daemon)],
        MsgFlags::empty(),
        None,
    )?;
    // The daemon holds its ends now; ours close here, so that its reads end with the child's.
    Ok([stdin.into(), stdout.into(), stderr.into()])
}

/// What the instance waits for: the call's end, or the daemon closing the connection.
enum Ending {
    Exited(std::io::Result<ExitStatus>),
    Hangup,
}

/// Starts the call in its sandbox and answers when it ends, or stops it when the daemon hangs
/// up.
fn run(
    mut connection: UnixStream,
    call: Call,
    confinement: Confinement,
    stdio: [OwnedFd; 3],
) -> Result<(), String> {
    let [stdin, stdout, stderr] = stdio;
    let started = super::sandbox::bubblewrap().and_then(|bwrap| {
        let options = options_file(&confinement, &call)
            .map_err(|err| format!("cannot pass the sandbox's options: {err}"))?;
        let mut command = std::process::Command::new(&bwrap);
        // bubblewrap itself starts with an empty environment (nothing a request says reaches
        // it before the sandbox is set up) and reads its options, the child's environment among
        // them, from a file: an argv would show them to every user on the host.
        command
            .arg("--args")
            .arg(options.as_raw_fd().to_string())
            .arg("--")
            .arg(&call.program)
            .args(&call.args)
            .env_clear()
            .stdin(Stdio::from(stdin))
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr));
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command
            .spawn()
            .map_err(|err| format!("cannot start {}: {err}", bwrap.display()));
        drop(options);
        child
    });
    let mut child = match started {
        Ok(child) => child,
        Err(reason) => {
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

/// bubblewrap's options for `call` as the file its `--args` reads (NUL-separated, in memory,
/// inherited by bubblewrap alone, which closes it): the child's environment first, then this
/// unit's user (`USER`, `LOGNAME`), then the sandbox, whose own settings (`HOME`) come last and
/// win. [`confined`] made sure that no NUL
/// ends an argument early.
fn options_file(confinement: &Confinement, call: &Call) -> std::io::Result<std::fs::File> {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let mut bytes = Vec::new();
    let mut push = |arg: &[u8]| {
        bytes.extend_from_slice(arg);
        bytes.push(0);
    };
    for (name, value) in &call.env {
        push(b"--setenv");
        push(name);
        push(value);
    }
    // The call runs as this unit's user, whatever the daemon's environment named.
    if let Ok(Some(user)) = nix::unistd::User::from_uid(nix::unistd::getuid()) {
        for name in ["USER", "LOGNAME"] {
            push(b"--setenv");
            push(name.as_bytes());
            push(user.name.as_bytes());
        }
    }
    for option in confinement.options(call.cwd.as_deref()) {
        push(option.as_bytes());
    }
    // Without close-on-exec: bubblewrap must inherit it (and closes it once read).
    let mut file = std::fs::File::from(memfd_create(c"agentgate-bwrap-args", MFdFlags::empty())?);
    file.write_all(&bytes)?;
    file.rewind()?;
    Ok(file)
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

/// Runs `/bin/true` in a tool unit, in `confinement`, and says whether it succeeded: the
/// start's check that tool units work. Blocking, bounded by a timeout.
pub(crate) fn trial(socket: &Path, confinement: Confinement) -> Result<(), String> {
    let request = Request::Run(Call {
        program: "/bin/true".to_string(),
        args: Vec::new(),
        env: Vec::new(),
        cwd: None,
        confinement: Some(confinement),
    });
    match ask(socket, &request)? {
        Reply::Exited(raw) if ExitStatus::from_raw(raw).success() => Ok(()),
        Reply::Exited(raw) => Err(format!(
            "a trial sandbox in a tool unit ended with {}",
            ExitStatus::from_raw(raw)
        )),
        Reply::NotStarted(reason) => Err(reason),
        Reply::NotWritable(_) => Err("its tool unit answered another request".to_string()),
    }
}

/// Which of `paths` a call in the units of `socket` could not write, each with the reason.
/// Blocking, bounded by a timeout.
pub(crate) fn unwritable(
    socket: &Path,
    paths: &[PathBuf],
) -> Result<Vec<(PathBuf, String)>, String> {
    match ask(socket, &Request::CheckWritable(paths.to_vec()))? {
        Reply::NotWritable(paths) => Ok(paths),
        Reply::NotStarted(reason) => Err(reason),
        Reply::Exited(_) => Err("its tool unit answered another request".to_string()),
    }
}

/// Sends `request` (stdin empty, output discarded) and waits for the answer.
fn ask(socket: &Path, request: &Request) -> Result<Reply, String> {
    let connect = || -> std::io::Result<UnixStream> {
        let mut connection = UnixStream::connect(socket)?;
        connection.write_all(&encode(request)?)?;
        Ok(connection)
    };
    let mut connection = connect().map_err(|err| {
        format!(
            "cannot start a tool unit through {}: {err}",
            socket.display()
        )
    })?;
    connection
        .set_read_timeout(Some(TRIAL_TIMEOUT))
        .map_err(|err| err.to_string())?;
    let mut answer = match opening(connection.as_raw_fd()).map_err(|err| err.to_string())? {
        // Closed here: the call reads an empty stdin, and what it writes is discarded.
        Opening::Stdio(_) => Vec::new(),
        Opening::Answer(first) => first,
    };
    let _ = connection.read_to_end(&mut answer);
    parse_reply(&answer)
}

#[cfg(test)]
mod tests {
    use super::daemon_cgroup;

    #[test]
    fn only_the_system_manager_s_agentgate_service_is_the_daemon() {
        let own = "/system.slice/system-agentgate\\x2dtool.slice/agentgate-tool@3-1234-0.service";
        assert_eq!(daemon_cgroup(own), "/system.slice/agentgate.service");
        let a_user_s_unit =
            "/user.slice/user-995.slice/user@995.service/app.slice/agentgate.service";
        assert_ne!(daemon_cgroup(own), a_user_s_unit);
    }
}
