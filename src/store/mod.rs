//! Durable state: the SQLite database, and (with it) the lock files of the state directory.
//!
//! Only this module touches state files. Every write goes through one writer thread that takes all
//! pending writes, applies them in one transaction and commits once (group commit): under load one
//! fdatasync covers many events, and a caller's future resolves only after the commit that holds
//! its write has returned. That is what lets the listener answer 202 only for durable events.

mod atomic;
mod deliveries;
mod events;
pub(crate) mod ledger;
mod lock;
mod schema;
mod turns;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

pub(crate) use atomic::is_stale_temp;
pub(crate) use deliveries::{DeliveryAttempt, DeliveryCounts, PendingDelivery};
pub(crate) use events::{AcceptOutcome, LiveCounts, NewEvent, StatusSummary};
pub(crate) use lock::{DAEMON_LOCK_FILE, DaemonLock, LockError};
pub(crate) use turns::{
    ClaimedTurn, InterruptedSession, TurnEnd, operator_resume, operator_suspend, session, sessions,
    transcript_of,
};

pub(crate) const DATABASE_FILE: &str = "agentgate.db";

/// The most writes that share one transaction.
const MAX_BATCH: usize = 1024;
/// Batches take the write lock up front, so a concurrent reader never turns a batch into a retry.
const BEGIN_BATCH: &str = "BEGIN IMMEDIATE;";
/// How often an unhealthy store probes whether writes work again.
const PROBE_INTERVAL: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    #[error("state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("database {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("database {path}: {source}")]
    Migration {
        path: PathBuf,
        source: schema::MigrationError,
    },
    #[error("state cannot be written durably: {0}")]
    Unavailable(String),
    #[error("database query failed: {0}")]
    Query(#[from] rusqlite::Error),
}

/// Unix time in milliseconds.
pub(crate) fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// One queued write: applied inside the batch transaction, then told whether the batch committed.
trait WriteJob: Send {
    fn apply(&mut self, connection: &Connection);
    fn finish(self: Box<Self>, committed: Result<(), String>);
}

struct Job<T, F> {
    work: Option<F>,
    outcome: Option<rusqlite::Result<T>>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> WriteJob for Job<T, F>
where
    T: Send,
    F: FnOnce(&Connection) -> rusqlite::Result<T> + Send,
{
    fn apply(&mut self, connection: &Connection) {
        if let Some(work) = self.work.take() {
            // A savepoint per job: one failing write does not undo the others in the batch.
            let outcome = connection
                .execute_batch("SAVEPOINT job")
                .and_then(|()| work(connection));
            let end = if outcome.is_ok() {
                "RELEASE job"
            } else {
                "ROLLBACK TO job; RELEASE job"
            };
            let ended = connection.execute_batch(end);
            self.outcome = Some(ended.and(outcome));
        }
    }

    fn finish(self: Box<Self>, committed: Result<(), String>) {
        let result = match (committed, self.outcome) {
            (Err(message), _) => Err(StoreError::Unavailable(message)),
            (Ok(()), Some(Ok(value))) => Ok(value),
            (Ok(()), Some(Err(err))) => Err(StoreError::Query(err)),
            (Ok(()), None) => Err(StoreError::Unavailable("write was not applied".into())),
        };
        // The caller may have gone away (client disconnected); its write is committed regardless.
        let _ = self.reply.send(result);
    }
}

/// A handle to the state database. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Store {
    writer: mpsc::Sender<Box<dyn WriteJob>>,
    writable: Arc<AtomicBool>,
    database: PathBuf,
    /// Idle read-only connections, reused by `read` (opening one costs more than most queries).
    readers: Arc<std::sync::Mutex<Vec<Connection>>>,
}

/// Read connections kept open for reuse.
const IDLE_READERS: usize = 4;

fn open_connection(path: &Path, flags: OpenFlags) -> rusqlite::Result<Connection> {
    let connection = Connection::open_with_flags(path, flags)?;
    connection.busy_timeout(Duration::from_secs(5))?;
    connection.execute_batch(
        "PRAGMA journal_mode = WAL;
         PRAGMA synchronous = FULL;
         PRAGMA cache_size = -2000;",
    )?;
    Ok(connection)
}

/// Creates the state directory (0750) if it is missing, durably (its parent is synced).
pub(crate) fn ensure_state_dir(state_dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::DirBuilderExt;
    if state_dir.is_dir() {
        return Ok(());
    }
    let failed = |source| StoreError::StateDir {
        path: state_dir.to_path_buf(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(state_dir)
        .map_err(failed)?;
    match state_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => std::fs::File::open(parent).and_then(|dir| dir.sync_all()),
        None => std::fs::File::open(".").and_then(|dir| dir.sync_all()),
    }
    .map_err(failed)
}

impl Store {
    /// Opens (creating and migrating if needed) the database and starts the writer thread.
    pub(crate) fn open(state_dir: &Path) -> Result<Store, StoreError> {
        ensure_state_dir(state_dir)?;
        let database = state_dir.join(DATABASE_FILE);
        let open_error = |source| StoreError::Open {
            path: database.clone(),
            source,
        };
        let mut connection = open_connection(
            &database,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
        )
        .map_err(open_error)?;
        schema::migrate(&mut connection).map_err(|source| StoreError::Migration {
            path: database.clone(),
            source,
        })?;
        // The database and its WAL now exist; make their directory entries durable.
        std::fs::File::open(state_dir)
            .and_then(|dir| dir.sync_all())
            .map_err(|source| StoreError::StateDir {
                path: state_dir.to_path_buf(),
                source,
            })?;
        let (sender, receiver) = mpsc::channel::<Box<dyn WriteJob>>();
        let writable = Arc::new(AtomicBool::new(true));
        let writer = Writer {
            connection: Some(connection),
            database: database.clone(),
            writable: writable.clone(),
        };
        std::thread::Builder::new()
            .name("agentgate-writer".into())
            .spawn(move || writer.run(receiver))
            .map_err(|source| StoreError::StateDir {
                path: state_dir.to_path_buf(),
                source,
            })?;
        Ok(Store {
            writer: sender,
            writable,
            database,
            readers: Arc::new(std::sync::Mutex::new(Vec::new())),
        })
    }

    /// Whether the last commit (or probe) succeeded.
    pub(crate) fn is_writable(&self) -> bool {
        self.writable.load(Ordering::Acquire)
    }

    /// Runs `work` in the next group-commit transaction; resolves after that transaction committed.
    pub(crate) async fn write<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            work: Some(work),
            outcome: None,
            reply,
        };
        self.writer
            .send(Box::new(job))
            .map_err(|_| StoreError::Unavailable("the writer thread has stopped".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Unavailable("the writer thread has stopped".into()))?
    }

    /// Runs a read-only query on a connection of its own, off the async threads.
    pub(crate) async fn read<T, F>(&self, query: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let database = self.database.clone();
        let readers = self.readers.clone();
        tokio::task::spawn_blocking(move || {
            let pooled = readers.lock().ok().and_then(|mut idle| idle.pop());
            let connection = match pooled {
                Some(connection) => connection,
                None => open_reader(&database)?,
            };
            let result = query(&connection).map_err(StoreError::from);
            if let Ok(mut idle) = readers.lock()
                && idle.len() < IDLE_READERS
            {
                idle.push(connection);
            }
            result
        })
        .await
        .map_err(|err| StoreError::Unavailable(format!("reader task failed: {err}")))?
    }
}

fn open_reader(database: &Path) -> Result<Connection, StoreError> {
    let connection = Connection::open_with_flags(
        database,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|source| StoreError::Open {
        path: database.to_path_buf(),
        source,
    })?;
    connection.busy_timeout(Duration::from_secs(5))?;
    Ok(connection)
}

/// Opens the database read-only and runs `query` (for the CLI, which must work with no daemon).
pub(crate) fn read_database<T>(
    database: &Path,
    query: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> Result<T, StoreError> {
    Ok(query(&open_reader(database)?)?)
}

/// Opens the database read-write and runs `change` in one transaction (for operator commands;
/// SQLite serializes them with the daemon's writer).
pub(crate) fn change_database<T>(
    database: &Path,
    change: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> Result<T, StoreError> {
    let mut connection =
        open_connection(database, OpenFlags::SQLITE_OPEN_READ_WRITE).map_err(|source| {
            StoreError::Open {
                path: database.to_path_buf(),
                source,
            }
        })?;
    let tx = connection.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let value = change(&tx)?;
    tx.commit()?;
    Ok(value)
}

/// After an operator command run as root wrote state, gives the files it may have created (the
/// WAL, the ledger and its lock) back to the state directory's owner, the daemon's user: a
/// root-owned ledger would otherwise fail every resume closed, and a root-owned WAL the daemon.
pub(crate) fn restore_ownership(state_dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    let owner = std::fs::metadata(state_dir)?;
    if owner.uid() == 0 {
        return Ok(());
    }
    for name in [
        DATABASE_FILE,
        "agentgate.db-wal",
        "agentgate.db-shm",
        ledger::LEDGER_FILE,
        ledger::LEDGER_LOCK_FILE,
    ] {
        let path = state_dir.join(name);
        if let Ok(metadata) = std::fs::symlink_metadata(&path)
            && metadata.uid() != owner.uid()
        {
            std::os::unix::fs::chown(&path, Some(owner.uid()), Some(owner.gid()))?;
        }
    }
    Ok(())
}

struct Writer {
    connection: Option<Connection>,
    database: PathBuf,
    writable: Arc<AtomicBool>,
}

impl Writer {
    fn run(mut self, receiver: mpsc::Receiver<Box<dyn WriteJob>>) {
        let mut batch: Vec<Box<dyn WriteJob>> = Vec::with_capacity(MAX_BATCH);
        loop {
            let first = if self.writable.load(Ordering::Acquire) {
                match receiver.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                }
            } else {
                match receiver.recv_timeout(PROBE_INTERVAL) {
                    Ok(job) => job,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.probe();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            };
            batch.push(first);
            while batch.len() < MAX_BATCH {
                match receiver.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            let committed = self.commit_batch(&mut batch);
            self.writable.store(committed.is_ok(), Ordering::Release);
            if let Err(message) = &committed {
                tracing::error!(database = %self.database.display(), error = %message,
                    "commit failed; answering 503 until writes succeed again");
                // Start from a fresh connection: after an I/O error SQLite's state is suspect.
                self.connection = None;
            }
            for job in batch.drain(..) {
                job.finish(committed.clone());
            }
        }
    }

    fn connection(&mut self) -> Result<&Connection, String> {
        if self.connection.is_none() {
            let connection = open_connection(&self.database, OpenFlags::SQLITE_OPEN_READ_WRITE)
                .map_err(|err| err.to_string())?;
            self.connection = Some(connection);
        }
        self.connection
            .as_ref()
            .ok_or_else(|| "no database connection".to_string())
    }

    fn commit_batch(&mut self, batch: &mut [Box<dyn WriteJob>]) -> Result<(), String> {
        let connection = self.connection()?;
        connection
            .execute_batch(BEGIN_BATCH)
            .map_err(|err| err.to_string())?;
        for job in batch.iter_mut() {
            job.apply(connection);
        }
        match connection.execute_batch("COMMIT") {
            Ok(()) => Ok(()),
            Err(err) => {
                let _ = connection.execute_batch("ROLLBACK");
                Err(err.to_string())
            }
        }
    }

    /// Checks whether a durable write works again (after a full or read-only disk).
    fn probe(&mut self) {
        let result = self.connection().and_then(|connection| {
            connection
                .execute_batch(&format!(
                    "{} CREATE TABLE IF NOT EXISTS probe (at INTEGER); DELETE FROM probe; INSERT INTO probe VALUES ({}); COMMIT;",
                    BEGIN_BATCH,
                    now_millis()
                ))
                .map_err(|err| {
                    let _ = connection.execute_batch("ROLLBACK");
                    err.to_string()
                })
        });
        match result {
            Ok(()) => {
                tracing::info!(database = %self.database.display(), "writes succeed again; accepting events");
                self.writable.store(true, Ordering::Release);
            }
            Err(_) => self.connection = None,
        }
    }
}
