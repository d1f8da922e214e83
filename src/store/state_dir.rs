//! The state directory: the one place that knows its file names and opens its files.
//!
//! Operator commands (`reconcile`, `sessions`, `backup`) often run as root in a directory that the
//! daemon's user owns. Anyone who can write there could plant a symbolic link named like a state
//! file and make a root-run command truncate, overwrite or create the link's target. So every
//! state file is opened here, never through a symbolic link (`O_NOFOLLOW`, or `O_EXCL` for a new
//! file), new files get mode 0600 whatever the umask, and what a root-run command created is
//! handed back to the directory's owner. The file names are the ones docs/reference.md lists.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The SQLite database (and, beside it, its `-wal` and `-shm` files).
pub(crate) const DATABASE_FILE: &str = "agentgate.db";
/// The retry ledger, replaced only by atomic renames.
pub(crate) const LEDGER_FILE: &str = "ledger.json";
/// The fs4 lock guarding the ledger (a file of its own: a rename replaces the ledger's inode).
pub(crate) const LEDGER_LOCK_FILE: &str = "ledger.lock";
/// Held by `serve` for its lifetime.
pub(crate) const DAEMON_LOCK_FILE: &str = "agentgate.lock";
/// Where `reconcile` moves malformed files; never emptied.
pub(crate) const QUARANTINE_DIR: &str = "quarantine";
/// The console's charts of the last day, kept across a restart (`lifecycle::periodic`).
const ACTIVITY_FILE: &str = "activity.json";
/// Created and removed by `reconcile` to prove the directory is writable.
const WRITE_PROBE_FILE: &str = ".agentgate-write-probe";
/// Mode of every state file agentgate creates.
const FILE_MODE: u32 = 0o600;
/// Mode of the state directory and the quarantine directory.
const DIR_MODE: u32 = 0o750;

/// A state directory. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct StateDir {
    path: PathBuf,
}

impl StateDir {
    pub(crate) fn new(path: &Path) -> StateDir {
        StateDir {
            path: path.to_path_buf(),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn database(&self) -> PathBuf {
        self.path.join(DATABASE_FILE)
    }

    pub(crate) fn ledger(&self) -> PathBuf {
        self.path.join(LEDGER_FILE)
    }

    pub(crate) fn daemon_lock(&self) -> PathBuf {
        self.path.join(DAEMON_LOCK_FILE)
    }

    pub(crate) fn ledger_lock(&self) -> PathBuf {
        self.path.join(LEDGER_LOCK_FILE)
    }

    pub(crate) fn activity(&self) -> PathBuf {
        self.path.join(ACTIVITY_FILE)
    }

    /// Replaces the activity file with `data`, crash-safe (see `store::atomic`).
    pub(crate) fn replace_activity(&self, data: &[u8]) -> std::io::Result<()> {
        super::atomic::replace(&self.path, ACTIVITY_FILE, data)
    }

    /// Where `quarantine()` keeps malformed files (the directory may not exist yet).
    pub(crate) fn quarantine_path(&self) -> PathBuf {
        self.path.join(QUARANTINE_DIR)
    }

    /// Creates the directory (0750) if it is missing, durably (its parent is synced).
    pub(crate) fn ensure(&self) -> std::io::Result<()> {
        if self.path.is_dir() {
            return Ok(());
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(&self.path)?;
        let parent = self
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        File::open(parent)?.sync_all()
    }

    /// fsyncs the directory, so that names created or renamed in it survive a power cut.
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        File::open(&self.path)?.sync_all()
    }

    /// Opens (creating if missing) a lock file for reading and writing.
    pub(crate) fn open_lock_file(&self, path: &Path) -> std::io::Result<File> {
        match create_new(path) {
            Ok(file) => return Ok(file),
            Err(err) if err.kind() == ErrorKind::AlreadyExists => {}
            Err(err) => return Err(err),
        }
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
            .map_err(|err| explain(path, err))
    }

    /// Opens an existing state file for reading; `Ok(None)` if there is none.
    pub(crate) fn open_for_reading(&self, path: &Path) -> std::io::Result<Option<File>> {
        match OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
        {
            Ok(file) => Ok(Some(file)),
            Err(err) if err.kind() == ErrorKind::NotFound => Ok(None),
            Err(err) => Err(explain(path, err)),
        }
    }

    /// Reads a whole state file; `Ok(None)` if there is none.
    pub(crate) fn read(&self, path: &Path) -> std::io::Result<Option<Vec<u8>>> {
        use std::io::Read;
        let Some(mut file) = self.open_for_reading(path)? else {
            return Ok(None);
        };
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(Some(bytes))
    }

    /// Before SQLite opens the database: none of its files may be a symbolic link, and a new
    /// database file is created here, 0600, so that SQLite's `-wal` and `-shm` (which copy the
    /// database's mode) are 0600 too.
    pub(crate) fn prepare_database(&self) -> std::io::Result<()> {
        refuse_linked_database(&self.database())?;
        match create_new(&self.database()) {
            Ok(_) => Ok(()),
            Err(err) if err.kind() == ErrorKind::AlreadyExists => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// Proves the directory writable by creating and removing a probe file.
    pub(crate) fn probe_writable(&self) -> std::io::Result<()> {
        let probe = self.path.join(WRITE_PROBE_FILE);
        refuse_symbolic_link(&probe)?;
        // A probe left by an interrupted run is a plain file of ours.
        match std::fs::remove_file(&probe) {
            Ok(()) => {}
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
        create_new(&probe)?;
        std::fs::remove_file(&probe)
    }

    /// The quarantine directory, created (0750) if missing. It must be a real directory: a
    /// symbolic link there would carry quarantined files anywhere.
    pub(crate) fn quarantine(&self) -> std::io::Result<PathBuf> {
        let dir = self.quarantine_path();
        match std::fs::symlink_metadata(&dir) {
            Ok(metadata) if metadata.file_type().is_symlink() => {
                return Err(symbolic_link_error(&dir));
            }
            Ok(metadata) if metadata.is_dir() => return Ok(dir),
            Ok(_) => {
                return Err(std::io::Error::other(format!(
                    "{} is not a directory",
                    dir.display()
                )));
            }
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
        std::fs::DirBuilder::new().mode(DIR_MODE).create(&dir)?;
        self.sync()?;
        Ok(dir)
    }

    /// After an operator command run as root wrote state, gives what it may have created back to
    /// the directory's owner, the daemon's user: a root-owned lock or ledger would otherwise make
    /// the daemon exit 73 or fail every resume closed. Symbolic links are never followed.
    pub(crate) fn restore_ownership(&self) -> std::io::Result<()> {
        let Some(owner) = self.owner_other_than_root() else {
            return Ok(());
        };
        let [database, wal, shm] = database_files(&self.database());
        for path in [
            database,
            wal,
            shm,
            self.ledger(),
            self.ledger_lock(),
            self.daemon_lock(),
            self.quarantine_path(),
        ] {
            if let Ok(metadata) = std::fs::symlink_metadata(&path)
                && !metadata.file_type().is_symlink()
                && metadata.uid() != owner.uid()
            {
                std::os::unix::fs::lchown(&path, Some(owner.uid()), Some(owner.gid()))?;
            }
        }
        Ok(())
    }
}

impl StateDir {
    /// The directory's metadata when this process runs as root and the directory belongs to
    /// another user (the daemon's): what root creates there must be that user's, or the daemon
    /// cannot open it.
    pub(crate) fn owner_other_than_root(&self) -> Option<std::fs::Metadata> {
        if !nix::unistd::geteuid().is_root() {
            return None;
        }
        std::fs::metadata(&self.path)
            .ok()
            .filter(|owner| owner.uid() != 0)
    }
}

/// `database` and the `-wal` and `-shm` files beside it.
fn database_files(database: &Path) -> [PathBuf; 3] {
    let beside = |suffix: &str| PathBuf::from(format!("{}{suffix}", database.display()));
    [database.to_path_buf(), beside("-wal"), beside("-shm")]
}

/// Refuses a database whose file, WAL or SHM is a symbolic link (the directory above may be one).
pub(crate) fn refuse_linked_database(database: &Path) -> std::io::Result<()> {
    database_files(database)
        .iter()
        .try_for_each(|path| refuse_symbolic_link(path))
}

/// Creates `path` exclusively (`O_EXCL` never follows a symbolic link) with mode 0600.
fn create_new(path: &Path) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .open(path)
        .map_err(|err| explain(path, err))?;
    // The umask may have taken bits away; the mode is exactly 0600 either way.
    file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    Ok(file)
}

fn refuse_symbolic_link(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if metadata.file_type().is_symlink() => Err(symbolic_link_error(path)),
        _ => Ok(()),
    }
}

fn symbolic_link_error(path: &Path) -> std::io::Error {
    std::io::Error::other(format!(
        "{} is a symbolic link; agentgate never opens state files through one (remove it, and find out who put it there)",
        path.display()
    ))
}

/// `O_NOFOLLOW` on a symbolic link fails with ELOOP; say what that means.
fn explain(path: &Path, err: std::io::Error) -> std::io::Error {
    let is_link = err.raw_os_error() == Some(nix::libc::ELOOP)
        || (err.kind() == ErrorKind::AlreadyExists
            && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()));
    if is_link {
        symbolic_link_error(path)
    } else {
        err
    }
}
