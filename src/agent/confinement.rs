//! A sandboxed child's bubblewrap settings, as data that can travel: the daemon decides them,
//! and they become bubblewrap's arguments where the child starts, in the daemon or in a tool
//! unit (`agent/unit.rs`). The two see different file systems (a unit has no credentials
//! directory, for one), and a path can be hidden only where it exists, so the arguments are
//! worked out on the spot.
//!
//! Every path is made absolute and resolved (`config::resolved`) before it goes in: bubblewrap takes a
//! relative path as relative to the new root, so a relative state directory or config file
//! would be neither hidden nor mountable. In a tool unit the settings are also held against the
//! unit's own floor ([`Confinement::falls_short_of`]), which a request cannot lower.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{HiddenPaths, resolved};

/// Where the host's cgroup tree is mounted: covered in every sandbox.
const CGROUP_TREE: &str = "/sys/fs/cgroup";

/// What bubblewrap is told for one child.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Confinement {
    /// The child may use the host's network (and the host's `/run`, with its sockets).
    pub network: bool,
    /// Paths bound read-write.
    pub writable: Vec<PathBuf>,
    /// Directories covered by an empty tmpfs.
    pub hidden_dirs: Vec<PathBuf>,
    /// Files covered by `/dev/null`.
    pub hidden_files: Vec<PathBuf>,
}

fn all_resolved(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut resolved: Vec<PathBuf> = paths.iter().map(|path| resolved(path)).collect();
    resolved.sort();
    resolved.dedup();
    resolved
}

impl Confinement {
    pub(crate) fn new(network: bool, writable: &[PathBuf], hidden: &HiddenPaths) -> Confinement {
        Confinement {
            network,
            writable: all_resolved(writable),
            hidden_dirs: all_resolved(&hidden.dirs),
            hidden_files: all_resolved(&hidden.files),
        }
    }

    /// Whether `path` is out of sight here: hidden itself, or inside a hidden directory.
    fn hides(&self, path: &Path) -> bool {
        self.hidden_files.iter().any(|file| file == path)
            || self.hidden_dirs.iter().any(|dir| path.starts_with(dir))
    }

    /// Why this confinement gives a child more than `floor` allows, if it does: a path of the
    /// floor it does not hide, or a writable path that is or holds one (whoever may write a
    /// directory may rename what is in it and put something else in its place).
    pub(crate) fn falls_short_of(&self, floor: &HiddenPaths) -> Option<String> {
        let floor_paths: Vec<PathBuf> = floor
            .dirs
            .iter()
            .chain(&floor.files)
            .map(|path| resolved(path))
            .collect();
        if let Some(shown) = floor_paths.iter().find(|path| !self.hides(path)) {
            return Some(format!("it does not hide {}", shown.display()));
        }
        self.writable.iter().find_map(|writable| {
            let held = floor_paths.iter().find(|path| path.starts_with(writable))?;
            Some(format!(
                "its writable path {} holds {}",
                writable.display(),
                held.display()
            ))
        })
    }

    /// The same confinement with everything `also` names hidden as well.
    pub(crate) fn hiding(mut self, also: &HiddenPaths) -> Confinement {
        self.hidden_dirs
            .extend(also.dirs.iter().map(|dir| resolved(dir)));
        self.hidden_files
            .extend(also.files.iter().map(|file| resolved(file)));
        self.hidden_dirs.sort();
        self.hidden_dirs.dedup();
        self.hidden_files.sort();
        self.hidden_files.dedup();
        self
    }

    /// bubblewrap (`bwrap`) and its arguments, up to and including the `--` before the child's
    /// argv.
    pub(crate) fn wrapper(&self, bwrap: &Path, working_dir: Option<&Path>) -> Vec<String> {
        let mut args = vec![bwrap.display().to_string()];
        args.extend(self.options(working_dir));
        args.push("--".into());
        args
    }

    /// bubblewrap's options. Mounts are applied in order, each over the ones before: the
    /// read-only root, a fresh `/dev`, `/proc` and `/tmp`, an empty `/sys/fs/cgroup` (the
    /// host's cgroup tree names every service and tool unit and shows what each uses), and,
    /// without the network, an empty `/run`, which holds the host's service sockets; then the
    /// writable paths, and last what is hidden, so that nothing writable can uncover it. Paths
    /// that do not exist here are skipped.
    pub(crate) fn options(&self, working_dir: Option<&Path>) -> Vec<String> {
        let mut args: Vec<String> = [
            "--unshare-all",
            // A user namespace of its own, in which the child may create no further one (a
            // nested namespace would make it root over mounts and reach the kernel's netfilter).
            "--unshare-user",
            "--disable-userns",
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
        if Path::new(CGROUP_TREE).is_dir() {
            args.extend(["--tmpfs".into(), CGROUP_TREE.into()]);
        }
        if self.network {
            args.push("--share-net".into());
        } else {
            args.extend(["--tmpfs".into(), "/run".into()]);
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
        args.extend(["--chdir".into(), chdir]);
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hidden(dirs: &[&Path], files: &[&Path]) -> HiddenPaths {
        HiddenPaths {
            dirs: dirs.iter().map(|d| d.to_path_buf()).collect(),
            files: files.iter().map(|f| f.to_path_buf()).collect(),
        }
    }

    #[test]
    fn hidden_paths_are_mounted_after_writable_ones_and_missing_ones_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let work = dir.path().join("work");
        let state = work.join("state");
        let secret = work.join("secret");
        std::fs::create_dir_all(&state).expect("state");
        std::fs::write(&secret, "s").expect("secret");
        let missing = dir.path().join("missing");
        let hidden = hidden(&[&state, &missing], &[&secret]);
        let args = Confinement::new(false, std::slice::from_ref(&work), &hidden)
            .wrapper(Path::new("bwrap"), None);
        let at = |flag: &str, path: &Path| {
            let path = resolved(path).display().to_string();
            args.windows(2)
                .position(|pair| pair[0] == flag && pair[1] == path)
        };
        let bound = at("--bind", &work).expect("writable bound");
        let over = at("--tmpfs", &state).expect("state hidden");
        assert!(bound < over, "{args:?}");
        assert!(
            at("--ro-bind", Path::new("/dev/null")).is_some(),
            "{args:?}"
        );
        assert!(!args.iter().any(|a| a.contains("missing")), "{args:?}");
        assert!(!args.contains(&"--share-net".to_string()));
        assert!(at("--tmpfs", Path::new("/run")).is_some(), "{args:?}");
        if Path::new(CGROUP_TREE).is_dir() {
            let cgroups = at("--tmpfs", Path::new(CGROUP_TREE)).expect("cgroup tree hidden");
            assert!(cgroups < bound, "{args:?}");
        }
        assert_eq!(args.last().map(String::as_str), Some("--"));
        let networked = Confinement::new(true, &[], &hidden).wrapper(Path::new("bwrap"), None);
        assert!(networked.contains(&"--share-net".to_string()));
        assert!(!networked.windows(2).any(|pair| pair == ["--tmpfs", "/run"]));
    }

    #[test]
    fn relative_paths_become_absolute_and_links_are_resolved() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("secret");
        std::fs::write(&target, "s").expect("secret");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        let confinement = Confinement::new(
            false,
            &[],
            &hidden(&[Path::new("agentgate-state")], &[&link]),
        );
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(confinement.hidden_dirs, [cwd.join("agentgate-state")]);
        assert_eq!(
            confinement.hidden_files,
            [std::fs::canonicalize(&target).expect("target")]
        );
    }

    #[test]
    fn a_confinement_below_the_floor_is_named_for_what_it_shows() {
        let floor = hidden(
            &[Path::new("/var/lib/agentgate"), Path::new("/run/agentgate")],
            &[Path::new("/etc/agentgate/agentgate.toml")],
        );
        let lax = Confinement::new(true, &[], &HiddenPaths::default());
        assert!(
            lax.falls_short_of(&floor)
                .is_some_and(|why| why.contains("does not hide /var/lib/agentgate")),
            "{lax:?}"
        );
        let full = Confinement::new(false, &[], &floor);
        assert_eq!(full.falls_short_of(&floor), None);
        // A hidden parent directory covers what is in it.
        let parent = Confinement::new(
            false,
            &[],
            &hidden(
                &[
                    Path::new("/var/lib/agentgate"),
                    Path::new("/run"),
                    Path::new("/etc/agentgate"),
                ],
                &[],
            ),
        );
        assert_eq!(parent.falls_short_of(&floor), None);
        let writable_over = Confinement::new(false, &[PathBuf::from("/etc")], &floor);
        assert!(
            writable_over
                .falls_short_of(&floor)
                .is_some_and(|why| why.contains("writable path /etc holds")),
            "{writable_over:?}"
        );
        let raised = lax.hiding(&floor);
        assert_eq!(raised.falls_short_of(&floor), None);
    }
}
