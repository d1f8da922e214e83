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
//! privilege, only user namespaces. Under systemd the sandboxed process stays in the service's
//! cgroup, so systemd accounts for it and stops it with the service.
//!
//! Where bubblewrap cannot set up a sandbox (missing, or user namespaces refused), a strict
//! child does not start: the call fails with the reason, and `check-config` and `status` say
//! so. It is never run unconfined instead.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::process::Child;
use crate::config::{HiddenPaths, Sandboxing};

/// Where Debian installs bubblewrap; `PATH` is searched when it is not there.
const BWRAP: &str = "/usr/bin/bwrap";
/// Names the bubblewrap program to use instead (one installed elsewhere).
const BWRAP_VARIABLE: &str = "AGENTGATE_BWRAP";

/// Whether bubblewrap can set up a sandbox on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Availability {
    /// It can: the program and its version line.
    Ready { program: PathBuf, version: String },
    /// It cannot, and why.
    Unavailable(String),
}

static AVAILABILITY: OnceLock<Availability> = OnceLock::new();

/// Whether strict children can run here, probed once per process (a sandbox that starts
/// `/bin/true`). Call it before the async runtime runs: the probe waits for a process.
pub(crate) fn availability() -> &'static Availability {
    AVAILABILITY.get_or_init(probe)
}

/// The mechanism a sandboxing uses, for journal lines and `status`.
pub(crate) fn mechanism(sandboxing: &Sandboxing) -> &'static str {
    match sandboxing {
        Sandboxing::Strict { .. } => "bubblewrap",
        Sandboxing::Off => "none",
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
    let program = match availability() {
        Availability::Ready { program, .. } => program.clone(),
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
    let mut wrapper = vec![program.display().to_string()];
    wrapper.extend(bwrap_arguments(
        *network,
        writable,
        hidden,
        child.working_dir(),
    ));
    Ok(child.within(wrapper))
}

/// bubblewrap's arguments, up to and including the `--` before the child's argv. Mounts are
/// applied in order, each over the ones before: the read-only root, a fresh `/dev`, `/proc` and
/// `/tmp`, the writable paths, and last what is hidden, so that nothing writable can uncover it.
fn bwrap_arguments(
    network: bool,
    writable: &[PathBuf],
    hidden: &HiddenPaths,
    working_dir: Option<&Path>,
) -> Vec<String> {
    let mut args: Vec<String> = [
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--setenv",
        "HOME",
        "/tmp",
    ]
    .map(String::from)
    .to_vec();
    if network {
        args.push("--share-net".into());
    }
    let existing = |path: &&PathBuf| path.exists();
    for path in writable.iter().filter(existing) {
        let path = path.display().to_string();
        args.extend(["--bind".into(), path.clone(), path]);
    }
    for dir in hidden.dirs.iter().filter(existing) {
        args.extend(["--tmpfs".into(), dir.display().to_string()]);
    }
    for file in hidden.files.iter().filter(existing) {
        args.extend([
            "--ro-bind".into(),
            "/dev/null".into(),
            file.display().to_string(),
        ]);
    }
    let chdir = working_dir.map_or_else(|| "/".to_string(), |dir| dir.display().to_string());
    args.extend(["--chdir".into(), chdir, "--".into()]);
    args
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
    let trial = std::process::Command::new(&program)
        .args(bwrap_arguments(false, &[], &HiddenPaths::default(), None))
        .arg("/bin/true")
        .env_clear()
        .output();
    match trial {
        Ok(out) if out.status.success() => Availability::Ready { program, version },
        Ok(out) => Availability::Unavailable(format!(
            "{} cannot start a sandbox: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(err) => Availability::Unavailable(format!("cannot run {}: {err}", program.display())),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_paths_are_mounted_after_writable_ones_and_missing_ones_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let work = dir.path().join("work");
        let state = work.join("state");
        let secret = work.join("secret");
        std::fs::create_dir_all(&state).expect("state");
        std::fs::write(&secret, "s").expect("secret");
        let hidden = HiddenPaths {
            dirs: vec![state.clone(), dir.path().join("missing")],
            files: vec![secret.clone()],
        };
        let args = bwrap_arguments(false, std::slice::from_ref(&work), &hidden, None);
        let at = |flag: &str, path: &Path| {
            args.windows(2)
                .position(|pair| pair[0] == flag && pair[1] == path.display().to_string())
        };
        let bound = at("--bind", &work).expect("writable bound");
        let over = at("--tmpfs", &state).expect("state hidden");
        assert!(bound < over, "{args:?}");
        assert!(args.contains(&secret.display().to_string()), "{args:?}");
        assert!(!args.iter().any(|a| a.contains("missing")), "{args:?}");
        assert!(!args.contains(&"--share-net".to_string()));
        assert_eq!(args.last().map(String::as_str), Some("--"));
        let networked = bwrap_arguments(true, &[], &hidden, None);
        assert!(networked.contains(&"--share-net".to_string()));
    }
}
