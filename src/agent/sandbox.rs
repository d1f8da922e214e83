//! Least privilege for what a payload can drive: command tools, stdio MCP servers and command
//! deliveries run in a bubblewrap sandbox unless the operator says `sandbox = "none"`
//! (docs/tools.md, "Sandbox").
//!
//! A webhook payload reaches the model, and the model chooses the calls: so a tool must reach
//! only what the operator meant it to. In the sandbox a process sees the file system read-only
//! (but for its `writable` paths), none of [`HiddenPaths`] (the state with every session's
//! payloads, the credentials, secret files, the config and the control socket), a private
//! `/tmp`, its own process, IPC and host name namespaces, no capabilities, and no network unless
//! `network = true` (a network namespace of its own, with only a loopback that is not the
//! host's). bubblewrap is Debian's `bubblewrap`, the sandbox Flatpak uses; it needs no
//! privilege, only user namespaces. Under the packaged units each call's sandbox also runs in
//! a systemd unit of its own (`agent/unit.rs`), which systemd accounts for, limits and stops;
//! MCP servers, which live as long as the daemon, stay in the service's cgroup.
//!
//! Where bubblewrap cannot set up a sandbox (missing, or user namespaces refused), a strict
//! child does not start: the call fails with the reason, and `check-config` and `status` say
//! so. It is never run unconfined instead.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::confinement::Confinement;
use super::process::Child;
use crate::config::{HiddenPaths, Sandboxing};

/// Where Debian installs bubblewrap; `PATH` is searched when it is not there.
const BWRAP: &str = "/usr/bin/bwrap";
/// Names the bubblewrap program to use instead (one installed elsewhere).
const BWRAP_VARIABLE: &str = "AGENTGATE_BWRAP";

/// Whether bubblewrap can set up a sandbox on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Availability {
    /// It can: the program and its version line, and whether each call runs in a systemd unit
    /// of its own.
    Ready {
        program: PathBuf,
        version: String,
        units: ToolUnits,
    },
    /// It cannot, and why.
    Unavailable(String),
}

/// Whether sandboxed calls run in tool units (`agent/unit.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToolUnits {
    /// Not under the packaged units: calls run in the daemon's own cgroup.
    NotConfigured,
    /// Each call runs in a unit started through this socket.
    Ready(PathBuf),
    /// The socket is configured but a trial call failed there: calls run in the daemon's own
    /// cgroup (still sandboxed), and the start says why.
    Failed { socket: PathBuf, reason: String },
}

static AVAILABILITY: OnceLock<Availability> = OnceLock::new();

/// Whether strict children can run here, probed once per process (a sandbox that starts
/// `/bin/true`). Call it before the async runtime runs: the probe waits for a process.
pub(crate) fn availability() -> &'static Availability {
    AVAILABILITY.get_or_init(probe)
}

/// The mechanism a sandboxing uses, for journal lines and `status`: `per_call` for a run that
/// [`Child::run`] drives (it can go to a tool unit), not for an MCP server.
pub(crate) fn mechanism(sandboxing: &Sandboxing, per_call: bool) -> &'static str {
    match (sandboxing, availability()) {
        (Sandboxing::Off, _) => "none",
        (
            Sandboxing::Strict { .. },
            Availability::Ready {
                units: ToolUnits::Ready(_),
                ..
            },
        ) if per_call => "systemd unit, bubblewrap",
        (Sandboxing::Strict { .. }, _) => "bubblewrap",
    }
}

/// Why a strict child cannot start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NotConfined {
    #[error(
        "not run: the sandbox cannot be set up on this machine ({0}); install bubblewrap, or \
         set sandbox = \"none\" to run it unconfined as the daemon's user"
    )]
    Unavailable(String),
    /// As a spawn outside a sandbox would say it (inside one, bubblewrap would only say that it
    /// could not start something).
    #[error("cannot start {program}: {reason}")]
    ProgramNotFound { program: String, reason: String },
}

/// `child` as it is started under `sandboxing`, with `hidden` out of its sight.
pub(crate) fn confine(
    child: Child,
    sandboxing: &Sandboxing,
    hidden: &HiddenPaths,
) -> Result<Child, NotConfined> {
    let Sandboxing::Strict { network, writable } = sandboxing else {
        return Ok(child);
    };
    let (program, units) = match availability() {
        Availability::Ready { program, units, .. } => (program.clone(), units),
        Availability::Unavailable(reason) => {
            return Err(NotConfined::Unavailable(reason.clone()));
        }
    };
    if let Err(reason) = executable(child.program()) {
        return Err(NotConfined::ProgramNotFound {
            program: child.program().to_string(),
            reason,
        });
    }
    let confinement = Confinement::new(program, *network, writable, hidden);
    Ok(match units {
        ToolUnits::Ready(socket) => child.in_unit(socket.clone(), confinement),
        ToolUnits::NotConfigured | ToolUnits::Failed { .. } => {
            let wrapper = confinement.wrapper(child.working_dir());
            child.within(wrapper)
        }
    })
}

/// Finds bubblewrap and starts `/bin/true` in a sandbox like the ones children get.
fn probe() -> Availability {
    let chosen = std::env::var_os(BWRAP_VARIABLE).map(PathBuf::from);
    let program = if let Some(chosen) = chosen {
        if let Err(reason) = executable(&chosen.display().to_string()) {
            return Availability::Unavailable(format!(
                "{BWRAP_VARIABLE}={}: {reason}",
                chosen.display()
            ));
        }
        chosen
    } else if Path::new(BWRAP).exists() {
        PathBuf::from(BWRAP)
    } else {
        match find_in_path("bwrap") {
            Some(program) => program,
            None => {
                return Availability::Unavailable(
                    "bubblewrap (bwrap) is not installed".to_string(),
                );
            }
        }
    };
    let version = std::process::Command::new(&program)
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_default();
    let confinement = Confinement::new(program.clone(), false, &[], &HiddenPaths::default());
    let trial = std::process::Command::new(&program)
        .args(confinement.wrapper(None).iter().skip(1))
        .arg("/bin/true")
        .env_clear()
        .output();
    match trial {
        Ok(out) if out.status.success() => {
            let units = probe_units(confinement);
            Availability::Ready {
                program,
                version,
                units,
            }
        }
        Ok(out) => Availability::Unavailable(format!(
            "{} cannot start a sandbox: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(err) => Availability::Unavailable(format!("cannot run {}: {err}", program.display())),
    }
}

/// Under the packaged units, starts the same trial sandbox in a tool unit.
fn probe_units(confinement: Confinement) -> ToolUnits {
    let Some(socket) = super::unit::configured_socket() else {
        return ToolUnits::NotConfigured;
    };
    match super::unit::trial(&socket, confinement) {
        Ok(()) => ToolUnits::Ready(socket),
        Err(reason) => ToolUnits::Failed { socket, reason },
    }
}

/// Whether `program` names an executable file, found as `execvp` would find it.
fn executable(program: &str) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let path = if program.contains('/') {
        PathBuf::from(program)
    } else {
        find_in_path(program).ok_or_else(|| "not found in PATH".to_string())?
    };
    let metadata = std::fs::metadata(&path).map_err(|err| err.to_string())?;
    if metadata.is_file() && metadata.permissions().mode() & 0o111 != 0 {
        Ok(())
    } else {
        Err("not an executable file".to_string())
    }
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}
