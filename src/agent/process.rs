//! The one way agentgate starts a child process: command tools, MCP servers on stdio, the
//! command model backend and command deliveries all go through [`Child`].
//!
//! Why one runner: each of those runs text that a webhook payload may have shaped, so each gets
//! the same guarantees, and a guarantee added here (the tool sandbox) reaches all of them:
//! - argv only, never a shell;
//! - a clean environment: only `INHERITED_ENVIRONMENT`, the daemon's owner mark and what the
//!   caller adds (a call's idempotency key, an MCP server's configured `env`); nothing of the
//!   daemon's own (credentials, notify and activation variables) leaks in;
//! - a process group of its own, so that its children go with it; death with the daemon
//!   (`PR_SET_PDEATHSIG`, `sys.rs`), and a mark that lets the next start reap what a killed
//!   daemon left behind ([`claim_and_reap_leftovers`]); an unconfined child (`sandbox =
//!   "none"`), which no sandbox or tool unit outlives, also carries a mark of its run, and what
//!   still carries it when the run ends is killed ([`RunMark`]);
//! - one stop policy: on timeout or cancellation SIGTERM to the group, SIGKILL after
//!   `KILL_GRACE`; when the leader exits, whatever it left running in its group is killed;
//! - capped output: what is over the cap is read and discarded, at most [`DISCARD_RATE`], and
//!   the truncation is marked.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

use super::confinement::Confinement;
use super::unit;

/// Between SIGTERM and SIGKILL of a process group.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// Environment variables a child inherits from the daemon.
const INHERITED_ENVIRONMENT: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME"];
/// Names the daemon that started a child process, in its environment (and, unless the child
/// clears it, in that of everything it starts): the state directory, which one daemon at a time
/// holds.
const OWNER_VARIABLE: &str = "AGENTGATE_STATE_DIRECTORY";

/// Marks what one unconfined run started (`NAME=<daemon pid>-<run>`), in its environment and
/// that of everything it starts: whatever still carries it when the run ends is killed.
const RUN_VARIABLE: &str = "AGENTGATE_RUN";

static OWNER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An unconfined run's mark (`None` for a sandboxed one, whose sandbox takes what it leaves):
/// when it is dropped, every process that carries it is killed.
pub(crate) struct RunMark(Option<String>);

impl RunMark {
    fn new(unconfined: bool) -> RunMark {
        RunMark(unconfined.then(|| {
            let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            format!("{}-{run}", std::process::id())
        }))
    }
}

impl Drop for RunMark {
    fn drop(&mut self) {
        if let Some(run) = &self.0 {
            let killed = kill_marked(&format!("{RUN_VARIABLE}={run}"));
            if killed > 0 {
                tracing::info!(
                    killed,
                    "killed what an unconfined child left running after it ended"
                );
            }
        }
    }
}

/// A child process to start: its argv and what is added to its clean environment.
#[derive(Debug, Clone)]
pub(crate) struct Child {
    program: String,
    args: Vec<String>,
    env: Vec<(String, OsString)>,
    cwd: Option<PathBuf>,
    /// The program errors name, when `program` is a sandbox that starts it.
    shown_as: Option<String>,
    /// When it runs in a tool unit of its own (`agent/unit.rs`): the socket whose connections
    /// systemd runs as units, and the sandbox the unit sets up for it.
    unit: Option<(PathBuf, Confinement)>,
    /// It runs unconfined (`sandbox = "none"`): no sandbox's pid namespace or unit takes what
    /// it leaves running, so whatever carries its run's mark is killed when it ends.
    unconfined: bool,
}

/// What a run may take: how long, and how much of each output stream is kept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub timeout: Duration,
    pub output_cap: usize,
}

/// One output stream as kept: at most the cap, and whether more was written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Captured {
    pub bytes: Vec<u8>,
    pub truncated: bool,
}

/// How a run ended.
#[derive(Debug)]
pub(crate) struct Finished {
    /// The leader's exit status (`Err` if waiting for it failed).
    pub status: std::io::Result<ExitStatus>,
    pub stdout: Captured,
    pub stderr: Captured,
    /// It ran past `Limits::timeout` and was killed.
    pub timed_out: bool,
}

/// Why a run did not finish.
#[derive(Debug)]
pub(crate) enum Aborted {
    /// It could not be started (the message says why, naming the program).
    NotStarted(String),
    /// The caller cancelled it; its process group was killed.
    Cancelled,
}

impl Child {
    /// `argv[0]` with the rest as its arguments; `None` for an empty argv.
    pub(crate) fn new(argv: &[String]) -> Option<Child> {
        let (program, args) = argv.split_first()?;
        Some(Child {
            program: program.clone(),
            args: args.to_vec(),
            env: Vec::new(),
            cwd: None,
            shown_as: None,
            unit: None,
            unconfined: false,
        })
    }

    pub(crate) fn program(&self) -> &str {
        self.shown_as.as_deref().unwrap_or(&self.program)
    }

    /// The directory it starts in, if not the daemon's.
    pub(crate) fn working_dir(&self) -> Option<&std::path::Path> {
        self.cwd.as_deref()
    }

    /// The same child, started through `wrapper` (a sandbox's argv, ending where the child's
    /// own argv begins). Errors still name the child's own program.
    pub(crate) fn within(self, wrapper: Vec<String>) -> Child {
        let mut wrapper = wrapper.into_iter();
        let Some(program) = wrapper.next() else {
            return self;
        };
        let mut args: Vec<String> = wrapper.collect();
        args.push(self.program.clone());
        args.extend(self.args);
        Child {
            program,
            args,
            shown_as: self.shown_as.or(Some(self.program)),
            ..self
        }
    }

    /// Adds `name=value` to the child's environment.
    pub(crate) fn env(mut self, name: impl Into<String>, value: impl Into<OsString>) -> Child {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Starts the child in `dir`.
    pub(crate) fn current_dir(mut self, dir: PathBuf) -> Child {
        self.cwd = Some(dir);
        self
    }

    /// The command as it is started here, with `mark` (an unconfined run's) in its environment.
    fn command(&self, mark: &RunMark) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.program);
        command
            .args(&self.args)
            .env_clear()
            .envs(self.environment(mark))
            .process_group(0)
            .kill_on_drop(true);
        if let Some(cwd) = &self.cwd {
            command.current_dir(cwd);
        }
        crate::sys::die_with_daemon(&mut command);
        command
    }

    /// The same child, run in a systemd unit of its own through `socket`, confined there.
    pub(crate) fn in_unit(self, socket: PathBuf, confinement: Confinement) -> Child {
        Child {
            unit: Some((socket, confinement)),
            ..self
        }
    }

    /// The same child, run without a sandbox: what it leaves running is found by its run's mark
    /// and killed when the run ends ([`Child::run`], or the drop of what [`Child::start`]
    /// returned), even if it left the child's process group or session.
    pub(crate) fn unconfined(self) -> Child {
        Child {
            unconfined: true,
            ..self
        }
    }

    /// Its whole environment: the inherited part, the owner mark, the run's mark (unconfined
    /// runs) and what the caller added.
    fn environment(&self, mark: &RunMark) -> Vec<(OsString, OsString)> {
        let mut environment: Vec<(OsString, OsString)> = INHERITED_ENVIRONMENT
            .iter()
            .filter_map(|name| std::env::var_os(name).map(|value| (OsString::from(name), value)))
            .collect();
        environment.extend(
            self.env
                .iter()
                .map(|(name, value)| (OsString::from(name), value.clone())),
        );
        if let Some(owner) = OWNER.get() {
            environment.push((OWNER_VARIABLE.into(), owner.into()));
        }
        if let Some(run) = &mark.0 {
            environment.push((RUN_VARIABLE.into(), run.into()));
        }
        environment
    }

    /// Starts the child, for a caller that drives it through its stdio (an MCP server): here or
    /// in its tool unit. Dropping what it returns stops the child and everything it started.
    pub(crate) async fn start(&self) -> Result<Started, String> {
        let mark = RunMark::new(self.unconfined);
        if let Some((socket, confinement)) = &self.unit {
            let not_started = |err: std::io::Error| self.not_started_in_unit(socket, &err);
            let (connection, stdin, stdout, stderr) = self
                .start_in_unit(socket, confinement)
                .await
                .map_err(not_started)?;
            let connection = connection.into_std().map_err(not_started)?;
            return Ok(Started {
                stdin: Either::Right(stdin),
                stdout: Either::Right(stdout),
                stderr: Either::Right(stderr),
                running: Running::Unit(connection),
            });
        }
        let mut command = self.command(&mark);
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|err| format!("cannot start {}: {err}", self.program()))?;
        let group = ProcessGroup::of(&child);
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            group.kill();
            return Err(format!("cannot start {}: no stdio", self.program()));
        };
        Ok(Started {
            stdin: Either::Left(stdin),
            stdout: Either::Left(Either::Left(stdout)),
            stderr: Either::Left(Either::Right(stderr)),
            running: Running::Local {
                _child: Box::new(child),
                group,
                _mark: mark,
            },
        })
    }

    /// Runs the child with `input` on its stdin until it exits, `limits.timeout` passes (then it
    /// is stopped and `timed_out` set) or `cancel` fires (then it is stopped and `Cancelled`
    /// returned).
    pub(crate) async fn run(
        &self,
        input: Vec<u8>,
        limits: Limits,
        cancel: &CancellationToken,
    ) -> Result<Finished, Aborted> {
        if let Some((socket, confinement)) = &self.unit {
            return self
                .run_in_unit(socket, confinement, input, limits, cancel)
                .await;
        }
        // Dropped when this returns, however it returns: what the run left running goes.
        let mark = RunMark::new(self.unconfined);
        let mut command = self.command(&mark);
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().map_err(|err| {
            Aborted::NotStarted(format!("cannot start {}: {err}", self.program()))
        })?;
        let group = ProcessGroup::of(&child);
        let streams = Streams::start(
            child.stdin.take(),
            child.stdout.take(),
            child.stderr.take(),
            input,
            limits.output_cap,
        );
        let mut timed_out = false;
        let status = tokio::select! {
            status = child.wait() => {
                // Done: whatever it left running in its group goes with it, so that a later
                // re-run never races a leftover of this one.
                group.kill();
                status
            }
            () = tokio::time::sleep(limits.timeout) => {
                timed_out = true;
                group.terminate(&mut child).await
            }
            () = cancel.cancelled() => {
                let _ = group.terminate(&mut child).await;
                return Err(Aborted::Cancelled);
            }
        };
        Ok(streams.finished(status, timed_out).await)
    }
}

/// The pipes of a child started in a tool unit: the connection (closing it stops the child),
/// and the child's stdin, stdout and stderr.
type UnitPipes = (
    tokio::net::UnixStream,
    tokio::net::unix::pipe::Sender,
    tokio::net::unix::pipe::Receiver,
    tokio::net::unix::pipe::Receiver,
);

impl Child {
    fn not_started_in_unit(&self, socket: &std::path::Path, err: &std::io::Error) -> String {
        format!(
            "cannot start {} in a tool unit ({}): {err}",
            self.program(),
            socket.display()
        )
    }

    /// Asks for the child in a tool unit through `socket`, in `confinement`, and takes the
    /// pipes the unit created for it. A refusal is the error.
    async fn start_in_unit(
        &self,
        socket: &std::path::Path,
        confinement: &Confinement,
    ) -> std::io::Result<UnitPipes> {
        use std::os::fd::AsRawFd;
        let request = unit::Request::Run(unit::Call {
            program: self.program.clone(),
            args: self.args.clone(),
            env: self
                .environment(&RunMark(None))
                .iter()
                .map(|(name, value)| unit::env_entry(name, value))
                .collect(),
            cwd: self.cwd.clone(),
            confinement: Some(confinement.clone()),
        });
        // Connected and written without blocking a runtime thread: a unit socket whose backlog
        // is full makes this wait, within the call's deadline (see `run_in_unit`).
        let mut connection = tokio::net::UnixStream::connect(socket).await?;
        connection.write_all(&unit::encode(&request)?).await?;
        let fd = connection.as_raw_fd();
        let opening = connection
            .async_io(tokio::io::Interest::READABLE, || unit::opening(fd))
            .await?;
        let [stdin, stdout, stderr] = match opening {
            unit::Opening::Stdio(stdio) => stdio,
            unit::Opening::Answer(mut answer) => {
                let _ = tokio::time::timeout(KILL_GRACE, connection.read_to_end(&mut answer)).await;
                return Err(std::io::Error::other(
                    unit::read_reply(&answer)
                        .err()
                        .unwrap_or_else(|| "its tool unit answered before the call".to_string()),
                ));
            }
        };
        Ok((
            connection,
            tokio::net::unix::pipe::Sender::from_owned_fd(stdin)?,
            tokio::net::unix::pipe::Receiver::from_owned_fd(stdout)?,
            tokio::net::unix::pipe::Receiver::from_owned_fd(stderr)?,
        ))
    }

    /// [`Child::run`] in a tool unit: the same pipes, caps and deadlines; stopping it is
    /// closing the connection, after which the unit stops the call's whole process tree.
    async fn run_in_unit(
        &self,
        socket: &std::path::Path,
        confinement: &Confinement,
        input: Vec<u8>,
        limits: Limits,
        cancel: &CancellationToken,
    ) -> Result<Finished, Aborted> {
        let not_started =
            |err: std::io::Error| Aborted::NotStarted(self.not_started_in_unit(socket, &err));
        // The timeout counts from the request: a unit that is slow to start the call (or never
        // does) takes from the call's time, and a cancellation is not kept waiting by it.
        let deadline = tokio::time::Instant::now() + limits.timeout;
        let (mut connection, stdin, stdout, stderr) = tokio::select! {
            started = self.start_in_unit(socket, confinement) => started.map_err(not_started)?,
            () = tokio::time::sleep_until(deadline) => {
                // Timed out as any call is: the unit may have been about to start it.
                return Ok(Finished {
                    status: Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("its tool unit did not start it within {:?}", limits.timeout),
                    )),
                    stdout: Captured::default(),
                    stderr: Captured::default(),
                    timed_out: true,
                });
            }
            () = cancel.cancelled() => return Err(Aborted::Cancelled),
        };
        let streams = Streams::start(
            Some(stdin),
            Some(stdout),
            Some(stderr),
            input,
            limits.output_cap,
        );
        let mut answer = Vec::new();
        let mut timed_out = false;
        tokio::select! {
            _ = connection.read_to_end(&mut answer) => {}
            () = tokio::time::sleep_until(deadline) => timed_out = true,
            () = cancel.cancelled() => {
                hang_up(&mut connection, &mut answer).await;
                return Err(Aborted::Cancelled);
            }
        }
        if timed_out {
            hang_up(&mut connection, &mut answer).await;
        }
        let status = match unit::read_reply(&answer) {
            Ok(status) => Ok(status),
            Err(reason) if !timed_out => {
                return Err(Aborted::NotStarted(format!("{}: {reason}", self.program())));
            }
            Err(reason) => Err(std::io::Error::other(reason)),
        };
        Ok(streams.finished(status, timed_out).await)
    }
}

/// A started child's stdin: a pipe to a child here or in a tool unit.
pub(crate) type Input =
    tokio_util::either::Either<tokio::process::ChildStdin, tokio::net::unix::pipe::Sender>;
/// A started child's stdout or stderr.
pub(crate) type Output = tokio_util::either::Either<
    tokio_util::either::Either<tokio::process::ChildStdout, tokio::process::ChildStderr>,
    tokio::net::unix::pipe::Receiver,
>;

/// A child started by [`Child::start`], with its stdio.
pub(crate) struct Started {
    pub stdin: Input,
    pub stdout: Output,
    pub stderr: Output,
    pub running: Running,
}

/// A started child as long as it may run: dropping it stops the child, and whatever it started.
pub(crate) enum Running {
    /// Here: its process group is killed (and, unconfined, what carries its run's mark).
    Local {
        _child: Box<tokio::process::Child>,
        group: ProcessGroup,
        _mark: RunMark,
    },
    /// In a tool unit: closing the connection makes the unit stop it.
    Unit(std::os::unix::net::UnixStream),
}

impl Drop for Running {
    fn drop(&mut self) {
        match self {
            Running::Local { group, .. } => group.kill(),
            Running::Unit(connection) => {
                let _ = connection.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// Tells a tool unit to stop its call (the end of the request stream), and waits a bounded time
/// for its answer, which comes once the call's processes are gone.
async fn hang_up(connection: &mut tokio::net::UnixStream, answer: &mut Vec<u8>) {
    let _ = connection.shutdown().await;
    let _ = tokio::time::timeout(KILL_GRACE * 2, connection.read_to_end(answer)).await;
}

/// A child's stdio being served: `input` written to its stdin (a child that does not read it
/// closes it early; that is not an error), each output read up to the cap.
struct Streams {
    stdout: Option<tokio::task::JoinHandle<Captured>>,
    stderr: Option<tokio::task::JoinHandle<Captured>>,
}

impl Streams {
    fn start<W, R, E>(
        stdin: Option<W>,
        stdout: Option<R>,
        stderr: Option<E>,
        input: Vec<u8>,
        cap: usize,
    ) -> Streams
    where
        W: AsyncWrite + Unpin + Send + 'static,
        R: AsyncRead + Unpin + Send + 'static,
        E: AsyncRead + Unpin + Send + 'static,
    {
        if let Some(mut stdin) = stdin {
            tokio::spawn(async move {
                let _ = stdin.write_all(&input).await;
            });
        }
        Streams {
            stdout: stdout.map(|s| tokio::spawn(read_capped(s, cap))),
            stderr: stderr.map(|s| tokio::spawn(read_capped(s, cap))),
        }
    }

    /// The run's outcome, with what the outputs kept.
    async fn finished(self, status: std::io::Result<ExitStatus>, timed_out: bool) -> Finished {
        Finished {
            status,
            stdout: collect(self.stdout).await,
            stderr: collect(self.stderr).await,
            timed_out,
        }
    }
}

/// What a stream reader kept. Children that escaped the group may still hold the pipe; it is
/// not waited on forever.
async fn collect(reader: Option<tokio::task::JoinHandle<Captured>>) -> Captured {
    match reader {
        Some(reader) => tokio::time::timeout(KILL_GRACE, reader)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default(),
        None => Captured::default(),
    }
}

/// How fast output over the cap is read and discarded. The output must still be read, or a tool
/// that writes more than the cap would block on its full pipe until its timeout; but read as
/// fast as a tool can write (`yes`, a `cat` of `/dev/zero`), it costs the daemon most of a core
/// for the whole call. Paced, a flood is slowed to this rate instead, and a tool with large
/// output (a `find /`) still finishes: 1 GiB over the cap takes 16 s.
const DISCARD_RATE: u64 = 64 * 1024 * 1024;

async fn read_capped<R: AsyncRead + Unpin>(mut reader: R, cap: usize) -> Captured {
    let mut kept = Captured::default();
    let mut buffer = [0u8; 16 * 1024];
    // No burst: a tool's output over the cap is read at the rate from the first byte.
    let mut discarded = super::pace::Pace::new(DISCARD_RATE, 0);
    loop {
        match reader.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = cap.saturating_sub(kept.bytes.len());
                kept.bytes.extend_from_slice(&buffer[..n.min(room)]);
                if n > room {
                    kept.truncated = true;
                    discarded.take(n - room).await;
                }
            }
        }
    }
    kept
}

/// A child's process group (its leader's pid), stopped as a whole.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcessGroup(Option<i32>);

impl ProcessGroup {
    /// The group of a child started by [`Child::command`] (it leads a group of its own).
    pub(crate) fn of(child: &tokio::process::Child) -> ProcessGroup {
        ProcessGroup::led_by(child.id())
    }

    /// The group led by `pid` (`None`: the child is already gone).
    fn led_by(pid: Option<u32>) -> ProcessGroup {
        ProcessGroup(
            pid.and_then(|pid| i32::try_from(pid).ok())
                .filter(|pid| *pid > 0),
        )
    }

    fn signal(self, signal: Signal) {
        if let Some(group) = self.0 {
            // A group that is already gone (ESRCH) is what we wanted.
            let _ = killpg(Pid::from_raw(group), signal);
        }
    }

    /// SIGKILL to every member.
    pub(crate) fn kill(self) {
        self.signal(Signal::SIGKILL);
    }

    /// SIGTERM to the group, SIGKILL after the grace period; returns the leader's exit status.
    async fn terminate(self, child: &mut tokio::process::Child) -> std::io::Result<ExitStatus> {
        self.signal(Signal::SIGTERM);
        let waited = tokio::time::timeout(KILL_GRACE, child.wait()).await;
        // Whether the leader left within the grace period or not, no member outlives it.
        self.kill();
        match waited {
            Ok(status) => status,
            Err(_) => child.wait().await,
        }
    }
}

/// At start, before any child runs: marks this daemon's children, and kills what an earlier
/// run of it left behind. `PR_SET_PDEATHSIG` takes a child itself down with a daemon killed
/// outside systemd, but not the child's own children, and an idempotent re-run of a call must
/// not race them. Returns how many processes were killed.
pub(crate) fn claim_and_reap_leftovers(state_dir: &std::path::Path) -> usize {
    let owner = state_dir.display().to_string();
    let _ = OWNER.set(owner.clone());
    kill_marked(&format!("{OWNER_VARIABLE}={owner}"))
}

/// Kills every process whose environment holds `wanted` (`NAME=value`), this one excepted. A
/// process is killed only if its start time did not change while it was checked (a reused pid
/// is never killed); another user's processes are not readable, and not ours. A process caught
/// in the middle of an `execve` shows an empty environment for a moment (its new memory is in
/// place, its environment not yet): it is looked at again, every [`UNSETTLED_PAUSE`], until it
/// shows one or [`UNSETTLED_LOOKS`] have passed. Returns how many were killed.
fn kill_marked(wanted: &str) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let own = std::process::id();
    let mut killed = 0;
    let mut unsettled: Vec<u32> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != own)
        .collect();
    for look in 0..=UNSETTLED_LOOKS {
        if look > 0 {
            std::thread::sleep(UNSETTLED_PAUSE);
        }
        unsettled.retain(|pid| match marked(*pid, wanted) {
            Mark::Carries(started) => {
                if Stat::read(*pid).is_some_and(|stat| stat.start_time == started) && kill(*pid) {
                    killed += 1;
                }
                false
            }
            Mark::Without => false,
            Mark::Unsettled => true,
        });
        if unsettled.is_empty() {
            break;
        }
    }
    killed
}

/// How often, and how long apart, a process whose environment reads empty is looked at again.
const UNSETTLED_LOOKS: usize = 10;
const UNSETTLED_PAUSE: Duration = Duration::from_millis(2);

/// Whether a process carries a mark in its environment.
enum Mark {
    /// It does; it started at this time.
    Carries(u64),
    /// It does not, or it is gone, or it is not ours to read.
    Without,
    /// Its environment reads empty: a process in the middle of an `execve`, or one started
    /// with none.
    Unsettled,
}

fn marked(pid: u32, wanted: &str) -> Mark {
    let Some(stat) = Stat::read(pid) else {
        return Mark::Without;
    };
    let Ok(environment) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return Mark::Without;
    };
    if environment.is_empty() {
        return if stat.is_kernel_thread() {
            Mark::Without
        } else {
            Mark::Unsettled
        };
    }
    if environment
        .split(|byte| *byte == 0)
        .any(|variable| variable == wanted.as_bytes())
    {
        Mark::Carries(stat.start_time)
    } else {
        Mark::Without
    }
}

fn kill(pid: u32) -> bool {
    i32::try_from(pid)
        .is_ok_and(|raw| nix::sys::signal::kill(Pid::from_raw(raw), Signal::SIGKILL).is_ok())
}

/// What is read of `/proc/PID/stat`, in one read.
struct Stat {
    /// The kernel's flags (field 9).
    flags: u64,
    /// When it started, in clock ticks after boot (field 22).
    start_time: u64,
}

impl Stat {
    fn read(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name (field 2) may hold spaces and parentheses: count from its closing
        // one. `field` counts from 1, as proc(5) does; the first after the name is field 3.
        let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
        let field = |number: usize| fields.get(number.checked_sub(3)?)?.parse().ok();
        Some(Self {
            flags: field(9)?,
            start_time: field(22)?,
        })
    }

    /// A kernel thread (`PF_KTHREAD`): no environment, ever.
    fn is_kernel_thread(&self) -> bool {
        const PF_KTHREAD: u64 = 0x0020_0000;
        self.flags & PF_KTHREAD != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn child(argv: &[&str]) -> Child {
        Child::new(&argv.iter().map(|a| (*a).to_string()).collect::<Vec<_>>()).expect("argv")
    }

    fn limits(timeout: Duration) -> Limits {
        Limits {
            timeout,
            output_cap: 64 * 1024,
        }
    }

    /// Output over the cap is read no faster than `DISCARD_RATE` (on the test's paused clock,
    /// which moves only when the reader waits): 64 MiB over it take a second.
    #[tokio::test(start_paused = true)]
    async fn output_over_the_cap_is_discarded_at_a_bounded_rate() {
        let flood = tokio::io::repeat(b'y').take(DISCARD_RATE + 10);
        let started = tokio::time::Instant::now();
        let kept = read_capped(flood, 10).await;
        assert_eq!((kept.bytes.len(), kept.truncated), (10, true));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(999), "{took:?}");
        assert!(took < Duration::from_millis(1100), "{took:?}");
    }

    /// A process with an empty environment looks like one caught in an `execve`: it is looked at
    /// again a few times, briefly, and then left alone; one that carries the mark is killed.
    #[test]
    fn a_marked_process_is_killed_and_one_without_an_environment_is_left_alone() {
        let mut bare = std::process::Command::new("/bin/sleep")
            .arg("30")
            .env_clear()
            .spawn()
            .expect("sleep");
        let mut carrier = std::process::Command::new("/bin/sleep")
            .arg("30")
            .env_clear()
            .env("AGENTGATE_RUN", "test-carrier")
            .spawn()
            .expect("sleep");
        let started = std::time::Instant::now();
        assert_eq!(kill_marked("AGENTGATE_RUN=test-carrier"), 1);
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(carrier.wait().is_ok_and(|status| !status.success()));
        assert!(bare.try_wait().is_ok_and(|status| status.is_none()));
        let _ = bare.kill();
        let _ = bare.wait();
    }

    /// Dead means gone, or a zombie waiting for its new parent to reap it.
    fn alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next())
                != Some("Z")
        })
    }

    async fn wait_dead(pid: u32) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while alive(pid) {
            assert!(std::time::Instant::now() < deadline, "{pid} still runs");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn what_a_child_leaves_running_is_killed_when_it_exits() {
        let spawner = child(&["/bin/sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"]);
        let finished = spawner
            .run(
                Vec::new(),
                limits(Duration::from_secs(10)),
                &CancellationToken::new(),
            )
            .await
            .expect("ran");
        let pid: u32 = String::from_utf8_lossy(&finished.stdout.bytes)
            .trim()
            .parse()
            .expect("the background pid");
        wait_dead(pid).await;
    }

    #[tokio::test]
    async fn a_hung_child_and_its_children_are_killed_at_the_timeout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("child.pid");
        let script = format!("sleep 300 & echo $! > {}; wait", pid_file.display());
        let hang = child(&["/bin/sh", "-c", &script]);
        let finished = hang
            .run(
                Vec::new(),
                limits(Duration::from_millis(300)),
                &CancellationToken::new(),
            )
            .await
            .expect("ran");
        assert!(finished.timed_out);
        let pid: u32 = std::fs::read_to_string(&pid_file)
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid");
        wait_dead(pid).await;
    }

    #[tokio::test]
    async fn cancellation_stops_the_child() {
        let hang = child(&["/bin/sleep", "300"]);
        let cancel = CancellationToken::new();
        let trigger = cancel.clone();
        let started = std::time::Instant::now();
        let run = hang.run(Vec::new(), limits(Duration::from_secs(300)), &cancel);
        let (outcome, ()) = tokio::join!(run, async move { trigger.cancel() });
        assert!(matches!(outcome, Err(Aborted::Cancelled)), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn output_is_capped_and_input_arrives_on_stdin() {
        let flood = child(&["/bin/sh", "-c", "cat; head -c 100000 /dev/zero"]);
        let finished = flood
            .run(
                b"in".to_vec(),
                Limits {
                    timeout: Duration::from_secs(10),
                    output_cap: 10,
                },
                &CancellationToken::new(),
            )
            .await
            .expect("ran");
        assert_eq!(&finished.stdout.bytes[..2], b"in");
        assert_eq!(finished.stdout.bytes.len(), 10);
        assert!(finished.stdout.truncated);
    }

    #[tokio::test]
    async fn the_environment_is_clean_but_for_what_is_added() {
        let echo = child(&["/usr/bin/env"]).env("ADDED", "yes");
        let finished = echo
            .run(
                Vec::new(),
                limits(Duration::from_secs(10)),
                &CancellationToken::new(),
            )
            .await
            .expect("ran");
        let environment = String::from_utf8_lossy(&finished.stdout.bytes).into_owned();
        assert!(environment.contains("ADDED=yes"), "{environment}");
        for line in environment.lines() {
            let name = line.split('=').next().unwrap_or_default();
            assert!(
                name == "ADDED" || name == OWNER_VARIABLE || INHERITED_ENVIRONMENT.contains(&name),
                "{line} leaked into the child"
            );
        }
    }

    #[tokio::test]
    async fn a_missing_program_is_not_started() {
        let missing = child(&["/nonexistent/program"]);
        let outcome = missing
            .run(
                Vec::new(),
                limits(Duration::from_secs(1)),
                &CancellationToken::new(),
            )
            .await;
        assert!(
            matches!(&outcome, Err(Aborted::NotStarted(message)) if message.contains("/nonexistent/program")),
            "{outcome:?}"
        );
    }
}
