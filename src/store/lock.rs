//! `agentgate.lock`: one daemon per state directory.
//!
//! The lock is an fs4 (flock) lock on a file of its own, held for the daemon's lifetime. flock dies
//! with the process, so a killed daemon leaves no stale lock behind. The holder writes its pid into
//! the file so that a second daemon can name it.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use fs4::{FileExt, TryLockError};

use super::state_dir::StateDir;

#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    #[error("{path} is held by another agentgate (pid {holder})")]
    Held { path: PathBuf, holder: String },
    #[error("cannot lock {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The held daemon lock; released on drop (or when the process dies).
#[derive(Debug)]
pub(crate) struct DaemonLock {
    _file: File,
}

fn holder_pid(file: &mut File) -> String {
    let mut text = String::new();
    match file.read_to_string(&mut text) {
        Ok(_) if !text.trim().is_empty() => text.trim().to_string(),
        _ => "unknown".to_string(),
    }
}

impl DaemonLock {
    /// Takes the lock without waiting and records this process's pid in it.
    pub(crate) fn acquire(state_dir: &Path) -> Result<DaemonLock, LockError> {
        let state_dir = StateDir::new(state_dir);
        let path = state_dir.daemon_lock();
        let mut file = state_dir
            .open_lock_file(&path)
            .map_err(|source| LockError::Io {
                path: path.clone(),
                source,
            })?;
        let io_error = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        match FileExt::try_lock(&file) {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(LockError::Held {
                    holder: holder_pid(&mut file),
                    path,
                });
            }
            Err(TryLockError::Error(source)) => return Err(io_error(source)),
        }
        file.set_len(0).map_err(io_error)?;
        file.seek(SeekFrom::Start(0)).map_err(io_error)?;
        writeln!(file, "{}", std::process::id()).map_err(io_error)?;
        // Not needed for the lock itself (flock is what excludes); synced so that no state file
        // ever holds unsynced data while events are acknowledged.
        file.sync_data().map_err(io_error)?;
        Ok(DaemonLock { _file: file })
    }

    /// Whether a daemon holds the lock now (checked with a shared try-lock that is released at once).
    pub(crate) fn is_held(state_dir: &Path) -> bool {
        let state_dir = StateDir::new(state_dir);
        let Ok(Some(file)) = state_dir.open_for_reading(&state_dir.daemon_lock()) else {
            return false;
        };
        matches!(
            FileExt::try_lock_shared(&file),
            Err(TryLockError::WouldBlock)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_refused_with_the_first_pid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = DaemonLock::acquire(dir.path()).expect("first lock");
        assert!(DaemonLock::is_held(dir.path()));
        match DaemonLock::acquire(dir.path()) {
            Err(LockError::Held { holder, .. }) => {
                assert_eq!(holder, std::process::id().to_string());
            }
            other => panic!("expected Held, got {other:?}"),
        }
        drop(first);
        assert!(!DaemonLock::is_held(dir.path()));
        DaemonLock::acquire(dir.path()).expect("lock after release");
    }
}
