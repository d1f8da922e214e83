//! A small ext4 file system on a loop device (needs root), for tests that fill the state file
//! system up.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Runs a command and fails the test if it fails.
pub fn run(command: &str, args: &[&str]) {
    let status = Command::new(command)
        .args(args)
        .status()
        .unwrap_or_else(|err| panic!("{command}: {err}"));
    assert!(status.success(), "{command} {args:?} failed: {status}");
}

pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// An ext4 file system on a loop device; unmounted on drop.
pub struct LoopFs {
    pub mount_point: PathBuf,
    _image: tempfile::TempDir,
}

impl LoopFs {
    /// 16 MiB, mounted in a temporary directory of its own.
    pub fn new() -> LoopFs {
        let dir = tempfile::tempdir().expect("tempdir");
        let mount_point = dir.path().join("mnt");
        LoopFs::mounted_at(&mount_point, "16M", dir)
    }

    /// `size` (as `truncate -s` takes it), mounted at `mount_point` (created if missing), e.g.
    /// a workspace's state directory.
    pub fn at(mount_point: &Path, size: &str) -> LoopFs {
        LoopFs::mounted_at(mount_point, size, tempfile::tempdir().expect("tempdir"))
    }

    fn mounted_at(mount_point: &Path, size: &str, image_dir: tempfile::TempDir) -> LoopFs {
        let image = image_dir.path().join("fs.img");
        std::fs::create_dir_all(mount_point).expect("mkdir");
        run("truncate", &["-s", size, path_str(&image)]);
        run(
            "mkfs.ext4",
            &["-q", "-F", "-m", "0", "-b", "4096", path_str(&image)],
        );
        run(
            "mount",
            &["-o", "loop", path_str(&image), path_str(mount_point)],
        );
        LoopFs {
            mount_point: mount_point.to_path_buf(),
            _image: image_dir,
        }
    }

    /// A workspace whose state directory is `state/` on this file system.
    pub fn workspace(&self) -> super::Workspace {
        super::Workspace::with_state_dir(
            tempfile::tempdir().expect("tempdir"),
            self.mount_point.join("state"),
        )
    }

    /// Fills the file system to the last block; `Fill::free` gives the space back. ext4 holds
    /// back blocks for the metadata of data not yet written out, and gives back what it did not
    /// need once it is written: the file is synced and topped up until a round adds nothing, so
    /// no block comes free later. Then one-block files take what is left: a fragmented file
    /// cannot grow into the last free block when that also needs a block for its extent tree,
    /// while a new small file (a ledger, a temporary file) can.
    pub fn fill(&self) -> Fill {
        let dir = self.mount_point.join("fill");
        std::fs::create_dir_all(&dir).expect("mkdir fill");
        let fill = dir.join("bulk");
        let mut filled = 0;
        for round in 0.. {
            assert!(
                round < 10,
                "{} kept gaining free blocks",
                self.mount_point.display()
            );
            let _ = Command::new("dd")
                .args(["if=/dev/zero", "bs=4k", "status=none"])
                .args(["oflag=append", "conv=notrunc"])
                .arg(format!("of={}", fill.display()))
                .stderr(Stdio::null())
                .status();
            run("sync", &["-f", path_str(&fill)]);
            let size = std::fs::metadata(&fill).map_or(0, |meta| meta.len());
            if size == filled {
                break;
            }
            filled = size;
        }
        for block in 0.. {
            assert!(
                block < 1000,
                "{} kept taking one-block files",
                self.mount_point.display()
            );
            let small = dir.join(format!("block-{block}"));
            let written = std::fs::write(&small, [0u8; 4096])
                .and_then(|()| std::fs::File::open(&small)?.sync_all());
            if written.is_err() {
                let _ = std::fs::remove_file(&small);
                run("sync", &["-f", path_str(&fill)]);
                break;
            }
        }
        Fill { dir }
    }
}

/// What `LoopFs::fill` wrote.
pub struct Fill {
    dir: PathBuf,
}

impl Fill {
    /// Gives the space back.
    pub fn free(self) {
        std::fs::remove_dir_all(&self.dir).expect("free the space");
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount_point).status();
    }
}
