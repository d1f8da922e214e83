//! A sandboxed child's bubblewrap settings, as data that can travel: the daemon decides them,
//! and they become bubblewrap's arguments where the child starts, in the daemon or in a tool
//! unit (`agent/unit.rs`). The two see different file systems (a unit has no credentials
//! directory, for one), and a path can be hidden only where it exists, so the arguments are
//! worked out on the spot.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::HiddenPaths;

/// What bubblewrap is told for one child.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Confinement {
    /// The bubblewrap program.
    pub bwrap: PathBuf,
    /// The child may use the host's network.
    pub network: bool,
    /// Paths bound read-write.
    pub writable: Vec<PathBuf>,
    /// Directories covered by an empty tmpfs.
    pub hidden_dirs: Vec<PathBuf>,
    /// Files covered by `/dev/null`.
    pub hidden_files: Vec<PathBuf>,
}

impl Confinement {
    pub(crate) fn new(
        bwrap: PathBuf,
        network: bool,
        writable: &[PathBuf],
        hidden: &HiddenPaths,
    ) -> Confinement {
        Confinement {
            bwrap,
            network,
            writable: writable.to_vec(),
            hidden_dirs: hidden.dirs.clone(),
            hidden_files: hidden.files.clone(),
        }
    }

    /// bubblewrap and its arguments, up to and including the `--` before the child's argv.
    /// Mounts are applied in order, each over the ones before: the read-only root, a fresh
    /// `/dev`, `/proc` and `/tmp`, the writable paths, and last what is hidden, so that nothing
    /// writable can uncover it. Paths that do not exist here are skipped.
    pub(crate) fn wrapper(&self, working_dir: Option<&Path>) -> Vec<String> {
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
        args.insert(0, self.bwrap.display().to_string());
        if self.network {
            args.push("--share-net".into());
        }
        let existing = |path: &&PathBuf| path.exists();
        for path in self.writable.iter().filter(existing) {
            let path = path.display().to_string();
            args.extend(["--bind".into(), path.clone(), path]);
        }
        for dir in self.hidden_dirs.iter().filter(existing) {
            args.extend(["--tmpfs".into(), dir.display().to_string()]);
        }
        for file in self.hidden_files.iter().filter(existing) {
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
        let args = Confinement::new("bwrap".into(), false, std::slice::from_ref(&work), &hidden)
            .wrapper(None);
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
        let networked = Confinement::new("bwrap".into(), true, &[], &hidden).wrapper(None);
        assert!(networked.contains(&"--share-net".to_string()));
    }
}
