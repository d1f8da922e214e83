//! Least privilege for what a payload can drive: command tools, stdio MCP servers and command
//! deliveries run in a bubblewrap sandbox unless the operator says `sandbox = "none"`
//! (docs/tools.md, "Sandbox").
//!
//! A webhook payload reaches the model, and the model chooses the calls: so a tool must reach
//! only what the operator meant it to. In the sandbox a process sees the file system read-only
//! (but for its `writable` paths), none of [`HiddenPaths`] (the state with every session's
//! payloads, the credentials, secret files, the config, agentgate's runtime directory and its
//! sockets), a private `/tmp`, its own process, IPC and host name namespaces, no capabilities,
//! and, unless `network = true`, neither the network nor the host's `/run` with its service
//! sockets (a network namespace of its own, with only a loopback that is not the host's).
//! bubblewrap is Debian's `bubblewrap`, the sandbox Flatpak uses; it needs no privilege, only
//! user namespaces.
//!
//! Under the packaged units every sandbox is set up in a systemd unit of its own
//! (`agent/unit.rs`), which systemd accounts for, limits and stops, and which adds its own
//! layer: no network and no Unix sockets for a strict call, and agentgate's state and sockets
//! out of reach. The service itself then creates no namespace and mounts nothing, and gives up
//! the privileges to. Elsewhere the daemon starts bubblewrap itself.
//!
//! Where no sandbox can be set up (bubblewrap missing, user namespaces refused, tool units that
//! fail their trial), a strict child does not start: the call fails with the reason, and
//! `check-config` and `status` say so. It is never run unconfined instead.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use super::confinement::Confinement;
use super::process::Child;
use super::unit::{self, UnitSockets};
use crate::config::{Config, HiddenPaths, Sandboxing};

/// Where Debian installs bubblewrap; `PATH` is searched when it is not there.
const BWRAP: &str = "/usr/bin/bwrap";
/// Names the bubblewrap program to use instead (one installed elsewhere).
const BWRAP_VARIABLE: &str = "AGENTGATE_BWRAP";

/// Whether bubblewrap can set up a sandbox on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Availability {
    /// It can: the program and its version line, and whether each child runs in a systemd unit
    /// of its own.
    Ready {
        program: PathBuf,
        version: String,
        units: ToolUnits,
    },
    /// It cannot, and why.
    Unavailable(String),
}

/// Whether sandboxed children run in tool units (`agent/unit.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToolUnits {
    /// Not under the packaged units: the daemon starts bubblewrap itself.
    NotConfigured,
    /// Each child runs in a unit started through one of these sockets.
    Ready(UnitSockets),
}

static AVAILABILITY: OnceLock<Availability> = OnceLock::new();
/// What the start found of strict children's `writable` paths that their tool units cannot
/// write, one line each.
static UNWRITABLE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Whether strict children can run here, probed once per process (a sandbox that starts
/// `/bin/true`, in each tool unit template when there are any). Call it before the async runtime
/// runs: the probe waits for a process.
pub(crate) fn availability() -> &'static Availability {
    AVAILABILITY.get_or_init(probe)
}

/// The mechanism a sandboxing uses, for journal lines and `status`.
pub(crate) fn mechanism(sandboxing: &Sandboxing) -> &'static str {
    match (sandboxing, availability()) {
        (Sandboxing::Off, _) => "none",
        (
            Sandboxing::Strict { .. },
            Availability::Ready {
                units: ToolUnits::Ready(_),
                ..
            },
        ) => "systemd unit, bubblewrap",
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
    #[error(
        "not run: network = true needs agentgate-tool-network.socket, and the service names \
         none (AGENTGATE_TOOL_NETWORK_SOCKET)"
    )]
    NoNetworkUnits,
}

/// `child` as it is started under `sandboxing`, with `hidden` out of its sight (and, whatever
/// `hidden` says, the sockets of the tool units and the service's runtime directory).
pub(crate) fn confine(
    child: Child,
    sandboxing: &Sandboxing,
    hidden: &HiddenPaths,
) -> Result<Child, NotConfined> {
    let Sandboxing::Strict { network, writable } = sandboxing else {
        return Ok(child.unconfined());
    };
    let (program, units) = match availability() {
        Availability::Ready { program, units, .. } => (program, units),
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
    let confinement = Confinement::new(*network, writable, &with_runtime(hidden, units));
    match units {
        ToolUnits::Ready(sockets) => {
            let socket = sockets
                .for_network(*network)
                .ok_or(NotConfined::NoNetworkUnits)?;
            Ok(child.in_unit(socket.to_path_buf(), confinement))
        }
        ToolUnits::NotConfigured => {
            let wrapper = confinement.wrapper(program, child.working_dir());
            Ok(child.within(wrapper))
        }
    }
}

/// `hidden`, and what only the running daemon knows: the tool units' sockets and its runtime
/// directory (`$RUNTIME_DIRECTORY`, when its unit has one).
fn with_runtime(hidden: &HiddenPaths, units: &ToolUnits) -> HiddenPaths {
    let mut all = hidden.clone();
    all.dirs.extend(
        std::env::var_os("RUNTIME_DIRECTORY")
            .into_iter()
            .flat_map(|dirs| std::env::split_paths(&dirs).collect::<Vec<_>>()),
    );
    if let ToolUnits::Ready(sockets) = units {
        all.files.extend(sockets.files());
    }
    all
}

/// The bubblewrap program: `AGENTGATE_BWRAP`, else Debian's, else the first in `PATH`.
pub(crate) fn bubblewrap() -> Result<PathBuf, String> {
    if let Some(chosen) = std::env::var_os(BWRAP_VARIABLE).map(PathBuf::from) {
        return match executable(&chosen.display().to_string()) {
            Ok(()) => Ok(chosen),
            Err(reason) => Err(format!("{BWRAP_VARIABLE}={}: {reason}", chosen.display())),
        };
    }
    if Path::new(BWRAP).exists() {
        return Ok(PathBuf::from(BWRAP));
    }
    find_in_path("bwrap").ok_or_else(|| "bubblewrap (bwrap) is not installed".to_string())
}

/// Finds bubblewrap and starts `/bin/true` in a sandbox like the ones children get: in each
/// tool unit template under the packaged units (the service itself may not create namespaces
/// there), else here.
fn probe() -> Availability {
    let program = match bubblewrap() {
        Ok(program) => program,
        Err(reason) => return Availability::Unavailable(reason),
    };
    let version = std::process::Command::new(&program)
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_default();
    let always = HiddenPaths {
        dirs: crate::config::ALWAYS_HIDDEN
            .iter()
            .map(PathBuf::from)
            .collect(),
        files: Vec::new(),
    };
    if let Some(sockets) = unit::configured_sockets() {
        let units = ToolUnits::Ready(sockets.clone());
        let hidden = with_runtime(&always, &units);
        let networks = [false]
            .into_iter()
            .chain(sockets.network.iter().map(|_| true));
        for network in networks {
            let Some(socket) = sockets.for_network(network) else {
                continue;
            };
            if let Err(reason) = unit::trial(socket, Confinement::new(network, &[], &hidden)) {
                return Availability::Unavailable(format!(
                    "the tool units of {} cannot run a sandbox: {reason}",
                    socket.display()
                ));
            }
        }
        return Availability::Ready {
            program,
            version,
            units,
        };
    }
    let trial = std::process::Command::new(&program)
        .args(Confinement::new(false, &[], &always).options(None))
        .arg("--")
        .arg("/bin/true")
        .env_clear()
        .output();
    match trial {
        Ok(out) if out.status.success() => Availability::Ready {
            program,
            version,
            units: ToolUnits::NotConfigured,
        },
        Ok(out) => Availability::Unavailable(format!(
            "{} cannot start a sandbox: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(err) => Availability::Unavailable(format!("cannot run {}: {err}", program.display())),
    }
}

/// Under the packaged units, asks each tool unit template whether it can write the `writable`
/// paths of the strict children that run there (a path outside its `ReadWritePaths=` is
/// read-only in the unit, and a call that writes there would fail only once it runs, perhaps
/// after a person approved it). Returns a warning for each path it cannot write, and keeps
/// them for `status`. Blocking.
pub(crate) fn check_writable(config: &Config) -> Vec<String> {
    let Availability::Ready {
        units: ToolUnits::Ready(sockets),
        ..
    } = availability()
    else {
        return Vec::new();
    };
    let mut warnings = Vec::new();
    for network in [false, true] {
        let children: Vec<_> = crate::config::strict_children(config)
            .into_iter()
            .filter(|child| child.network == network && !child.writable.is_empty())
            .collect();
        let (Some(socket), false) = (sockets.for_network(network), children.is_empty()) else {
            continue;
        };
        let template = if network {
            "agentgate-tool-network@.service"
        } else {
            "agentgate-tool@.service"
        };
        let paths: Vec<PathBuf> = children
            .iter()
            .flat_map(|child| {
                child
                    .writable
                    .iter()
                    .map(|path| crate::config::resolved(path))
            })
            .collect();
        let unwritable = match unit::unwritable(socket, &paths) {
            Ok(unwritable) => unwritable,
            Err(reason) => {
                warnings.push(format!(
                    "cannot check the writable paths in {template}: {reason}"
                ));
                continue;
            }
        };
        for (path, reason) in unwritable {
            for child in children.iter().filter(|child| {
                child
                    .writable
                    .iter()
                    .any(|writable| crate::config::resolved(writable) == path)
            }) {
                warnings.push(format!(
                    "{}.writable: {} is not writable in {template} ({reason}); its calls will \
                     fail there: add ReadWritePaths={} with `systemctl edit {template}`",
                    child.key,
                    path.display(),
                    path.display()
                ));
            }
        }
    }
    crate::locks::lock(&UNWRITABLE).clone_from(&warnings);
    warnings
}

/// What the last [`check_writable`] found, for `status`.
pub(crate) fn unwritable_paths() -> Vec<String> {
    crate::locks::lock(&UNWRITABLE).clone()
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
