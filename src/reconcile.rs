//! `agentgate reconcile`: the pre-start repair that runs before every start of the daemon.
//!
//! A non-zero exit here takes the socket-activated endpoint offline until someone runs
//! `reset-failed`, so reconcile repairs what it can, keeps evidence of everything (malformed files
//! are moved to `quarantine/`, never deleted), and fails only when the daemon truly cannot run:
//! an invalid config (78) or an unusable state directory (73).

use crate::output::outln;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::config::StoreSettings;
use crate::exit::Failure;
use crate::logging;
use crate::store::ledger::{self, Ledger, LedgerFile};
use crate::store::{self, DaemonLock, LEDGER_FILE, StateDir};

/// What reconcile does, step by step; with `--dry-run` it is printed instead of done.
struct Repair {
    files: StateDir,
    dry_run: bool,
    resume_max_attempts: u32,
}

/// `agentgate reconcile [--dry-run]`.
pub(crate) fn run(config: &Config, dry_run: bool) -> Result<(), Failure> {
    let repair = Repair {
        files: StateDir::new(&config.state_dir),
        dry_run,
        resume_max_attempts: config.runtime.resume_max_attempts,
    };
    repair.state_directory()?;
    if !repair.files.path().exists() {
        return Ok(()); // dry run on a state directory that does not exist yet
    }
    let _lock = match DaemonLock::acquire(repair.files.path()) {
        Ok(lock) => lock,
        Err(store::LockError::Held { holder, .. }) => {
            tracing::warn!(
                "a daemon (pid {holder}) holds {}; reconcile changes nothing",
                repair.files.daemon_lock().display()
            );
            return Ok(());
        }
        Err(err) => return Err(Failure::state(err)),
    };
    repair.stale_temporary_files();
    if matches!(config.store, StoreSettings::Sqlite) {
        repair.database();
        repair.ledger().map_err(Failure::state)?;
    } else {
        // The database server keeps its own integrity, and the retry ledger is a table there.
        tracing::info!("store backend is postgres: no local database or ledger to check");
    }
    if !dry_run {
        // Run as root (as ExecStartPre or by hand), what reconcile created must still be the
        // daemon's, or the daemon cannot take its own lock.
        repair.files.restore_ownership().map_err(|err| {
            Failure::state(format!(
                "{}: cannot give state files back to the directory's owner: {err}",
                repair.files.path().display()
            ))
        })?;
    }
    // The last line goes to standard output, which under systemd is the unit's journal stream:
    // journald ties a stream to its unit when the stream is set up, while a datagram through the
    // native socket is tied to a unit only if the process still exists when journald reads it,
    // and a oneshot exits right after its last line.
    let dry = if dry_run { " (dry run)" } else { "" };
    outln!(
        "reconcile finished: state directory {}{dry}",
        repair.files.path().display()
    );
    Ok(())
}

impl Repair {
    fn act(
        &self,
        description: &str,
        action: impl FnOnce() -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if self.dry_run {
            outln!("would {description}");
            Ok(())
        } else {
            action()
        }
    }

    /// The state directory must exist (created 0750 if missing) and be a writable directory.
    fn state_directory(&self) -> Result<(), Failure> {
        let dir = self.files.path();
        if dir.exists() && !dir.is_dir() {
            return Err(Failure::state(format!(
                "state directory {} is not a directory",
                dir.display()
            )));
        }
        if !dir.exists() {
            self.act(
                &format!("create the state directory {}", dir.display()),
                || self.files.ensure(),
            )
            .map_err(|err| Failure::state(format!("state directory {}: {err}", dir.display())))?;
            return Ok(());
        }
        if self.dry_run {
            return Ok(());
        }
        self.files.probe_writable().map_err(|err| {
            Failure::state(format!(
                "state directory {} is not writable: {err}",
                dir.display()
            ))
        })
    }

    /// Moves `path` to `quarantine/<UTC timestamp>-<name>`; returns the new path.
    fn quarantine(&self, path: &Path) -> std::io::Result<PathBuf> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let dir = self.files.quarantine_path();
        let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
            .to_string()
            .replace([':', '-'], "");
        let mut target = dir.join(format!("{stamp}-{name}"));
        let mut counter = 1;
        while target.exists() {
            target = dir.join(format!("{stamp}-{counter}-{name}"));
            counter += 1;
        }
        if self.dry_run {
            outln!("would move {} to {}", path.display(), target.display());
            return Ok(target);
        }
        let dir = self.files.quarantine()?;
        std::fs::rename(path, &target)?;
        std::fs::File::open(&dir)?.sync_all()?;
        self.files.sync()?;
        Ok(target)
    }

    /// `PRAGMA quick_check`; a damaged database (and its WAL and SHM) goes to quarantine and the
    /// daemon starts a new one.
    fn database(&self) {
        let database = self.files.database();
        if !database.exists() {
            return;
        }
        let problem = match store::check_database(&database) {
            Ok(()) => return,
            Err(problem) => problem,
        };
        for suffix in ["", "-wal", "-shm"] {
            let path = PathBuf::from(format!("{}{suffix}", database.display()));
            if path.exists() {
                match self.quarantine(&path) {
                    Ok(target) => tracing::error!(
                        message_id = logging::MESSAGE_DATABASE_QUARANTINED,
                        file = %path.display(), moved_to = %target.display(), problem = %problem,
                        "the database is damaged and was quarantined; a new, empty one is started and the events in it are LOST to the daemon (the file is kept)"
                    ),
                    Err(err) => tracing::error!(file = %path.display(), error = %err,
                        "cannot quarantine the damaged database"),
                }
            }
        }
    }

    fn stale_temporary_files(&self) {
        let Ok(entries) = std::fs::read_dir(self.files.path()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !store::is_stale_temp(&name) {
                continue;
            }
            let path = entry.path();
            match self.act(
                &format!("remove the stale temporary file {}", path.display()),
                || std::fs::remove_file(&path),
            ) {
                Ok(()) if !self.dry_run => tracing::warn!(file = %path.display(),
                    "removed a temporary file of an interrupted atomic write"),
                Ok(()) => {}
                Err(err) => {
                    tracing::warn!(file = %path.display(), error = %err, "cannot remove a stale temporary file");
                }
            }
        }
    }

    /// Sessions that were interrupted (resume pending, or a turn left running) and all known ones.
    fn sessions(&self) -> (BTreeSet<String>, BTreeSet<String>) {
        let database = self.files.database();
        if !database.exists() {
            return Default::default();
        }
        store::session_keys(&database).unwrap_or_default()
    }

    /// A missing ledger is created empty; a malformed one is quarantined, salvaged and replaced.
    /// The daemon reads a missing ledger as an empty one, so a full disk that keeps it from being
    /// created is a warning, not a reason to keep the daemon from starting. Any other failure (a
    /// planted symbolic link) stops the start.
    fn ledger(&self) -> Result<(), String> {
        let file = LedgerFile::new(self.files.path());
        let path = file.path();
        let bytes = if path.is_dir() {
            None
        } else {
            match self.files.read(&path) {
                Ok(Some(bytes)) => Some(bytes),
                Ok(None) => {
                    let created = self.act(&format!("create an empty {}", path.display()), || {
                        file.replace(&Ledger::default())
                    });
                    match created {
                        Ok(()) => {}
                        Err(err)
                            if matches!(
                                err.kind(),
                                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                            ) =>
                        {
                            tracing::warn!(file = %path.display(), error = %err,
                                "cannot create an empty retry ledger; the daemon reads a missing one as empty");
                        }
                        Err(err) => return Err(format!("cannot create {}: {err}", path.display())),
                    }
                    return Ok(());
                }
                Err(err) => return Err(format!("cannot read {}: {err}", path.display())),
            }
        };
        let problem = match &bytes {
            None => "a directory stands where the file should be".to_string(),
            Some(bytes) => match ledger::parse(bytes) {
                Ok(_) => return Ok(()),
                Err(reason) => reason,
            },
        };
        let salvaged = bytes.as_deref().map(ledger::salvage).unwrap_or_default();
        let (interrupted, known) = self.sessions();
        let mut repaired = Ledger::default();
        for (key, entry) in &salvaged.sessions {
            if interrupted.contains(key) || known.contains(key) {
                repaired.set(key, entry.attempts);
            }
        }
        let lost_count = u64::from(self.resume_max_attempts.saturating_sub(1));
        for key in &interrupted {
            if !repaired.sessions.contains_key(key) {
                repaired.set(key, lost_count);
            }
        }
        let moved_to = self
            .quarantine(&path)
            .map_err(|err| format!("cannot quarantine {}: {err}", path.display()))?;
        if !self.dry_run {
            tracing::warn!(
                message_id = logging::MESSAGE_LEDGER_QUARANTINED,
                file = %path.display(), moved_to = %moved_to.display(), problem = %problem,
                salvaged = salvaged.sessions.len(), kept = repaired.sessions.len(),
                "the retry ledger was malformed: quarantined, salvaged, and replaced"
            );
        }
        self.act(
            &format!(
                "write a new {} with {} session(s) ({} salvaged; interrupted sessions whose count was lost get {lost_count})",
                LEDGER_FILE,
                repaired.sessions.len(),
                salvaged.sessions.len()
            ),
            || file.replace(&repaired),
        )
        .map_err(|err| format!("cannot write {}: {err}", path.display()))
    }
}
