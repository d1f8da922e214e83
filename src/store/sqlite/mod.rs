//! The SQLite backend: one node, state in `state_dir/agentgate.db`.
//!
//! Every write goes through one writer thread that takes all
//! pending writes, applies them in one transaction and commits once (group commit): under load one
//! fdatasync covers many events, and a caller's future resolves only after the commit that holds
//! its write has returned. That is what lets the listener answer 202 only for durable events.

mod accept;
mod inspect;
mod outbox;
mod schema;
mod turns;

pub(crate) use schema::MigrationError;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

use crate::store::ledger::LedgerFile;
use const_format::concatcp;

use crate::store::state_dir;
use crate::store::states::{RESUME_PENDING, TURN_RUNNING};
use crate::store::{
    Accepting, Coordination, DeliveryRow, EventDetail, EventFilter, EventRow, Inspection, Ledger,
    LiveCounts, Operator, Outbox, Recovery, RetryTarget, SessionRow, Settled, Settlement, StateDir,
    StatusSummary, StoreError, Turns, ensure_state_dir, now_millis,
};
use turns::{session_in, sessions_in, sessions_page_in};

/// The most writes that share one transaction.
const MAX_BATCH: usize = 1024;
/// Batches take the write lock up front, so a concurrent reader never turns a batch into a retry.
const BEGIN_BATCH: &str = "BEGIN IMMEDIATE;";
/// How often an unhealthy store probes whether writes work again.
const PROBE_INTERVAL: Duration = Duration::from_millis(500);

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
pub(crate) struct SqliteStore {
    writer: mpsc::Sender<Box<dyn WriteJob>>,
    writable: Arc<AtomicBool>,
    database: PathBuf,
    /// Idle read-only connections, reused by `read` (opening one costs more than most queries).
    readers: Arc<std::sync::Mutex<Vec<Connection>>>,
    /// The retry ledger, `ledger.json` beside the database.
    ledger: Arc<LedgerFile>,
}

/// Read connections kept open for reuse.
const IDLE_READERS: usize = 4;

/// Every connection refuses a database, WAL or SHM file that is a symbolic link (see
/// `StateDir`). SQLite's own `SQLITE_OPEN_NOFOLLOW` is not used: it also refuses a state
/// directory reached through a link, which operators use to put state on another disk.
fn open_connection(path: &Path, flags: OpenFlags) -> rusqlite::Result<Connection> {
    refuse_linked_database(path)?;
    let connection = Connection::open_with_flags(path, flags)?;
    connection.busy_timeout(Duration::from_secs(5))?;
    connection.execute_batch(
        "PRAGMA journal_mode = WAL;
         PRAGMA synchronous = FULL;
         PRAGMA cache_size = -2000;",
    )?;
    Ok(connection)
}

impl SqliteStore {
    /// Opens (creating and migrating if needed) the database and starts the writer thread.
    pub(crate) fn open(state_dir: &Path) -> Result<SqliteStore, StoreError> {
        ensure_state_dir(state_dir)?;
        let files = StateDir::new(state_dir);
        files
            .prepare_database()
            .map_err(|source| StoreError::StateDir {
                path: state_dir.to_path_buf(),
                source,
            })?;
        let database = files.database();
        let mut connection = open_connection(
            &database,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
        )
        .map_err(|source| StoreError::Open {
            path: database.clone(),
            source,
        })?;
        schema::migrate(&mut connection).map_err(|source| StoreError::Migration {
            path: database.clone(),
            source,
        })?;
        // The database and its WAL now exist; make their directory entries durable.
        files.sync().map_err(|source| StoreError::StateDir {
            path: state_dir.to_path_buf(),
            source,
        })?;
        SqliteStore::start(state_dir, Some(connection))
    }

    /// For operator commands: the existing database, as it is (no migration; the writer
    /// connection opens at the first write). `None` when there is no database yet.
    pub(crate) fn attach(state_dir: &Path) -> Result<Option<SqliteStore>, StoreError> {
        if !StateDir::new(state_dir).database().exists() {
            return Ok(None);
        }
        SqliteStore::start(state_dir, None).map(Some)
    }

    fn start(state_dir: &Path, connection: Option<Connection>) -> Result<SqliteStore, StoreError> {
        let database = StateDir::new(state_dir).database();
        let (sender, receiver) = mpsc::channel::<Box<dyn WriteJob>>();
        let writable = Arc::new(AtomicBool::new(true));
        let writer = Writer {
            connection,
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
        Ok(SqliteStore {
            writer: sender,
            writable,
            database,
            readers: Arc::new(std::sync::Mutex::new(Vec::new())),
            ledger: Arc::new(LedgerFile::new(state_dir)),
        })
    }

    /// Runs `work` in the next group-commit transaction; resolves after that transaction committed.
    async fn write<T, F>(&self, work: F) -> Result<T, StoreError>
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
            .map_err(|_| StoreError::Stopped("the writer thread".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Stopped("the writer thread".into()))?
    }

    /// Runs a read-only query on a connection of its own, off the async threads.
    async fn read<T, F>(&self, query: F) -> Result<T, StoreError>
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
        .map_err(|err| StoreError::Stopped(format!("a reader task ({err})")))?
    }
}

/// See [`open_connection`] on symbolic links.
fn refuse_linked_database(database: &Path) -> rusqlite::Result<()> {
    state_dir::refuse_linked_database(database).map_err(|err| {
        rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
            Some(err.to_string()),
        )
    })
}

fn open_reader(database: &Path) -> Result<Connection, StoreError> {
    let open = |database: &Path| {
        refuse_linked_database(database)?;
        Connection::open_with_flags(
            database,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
    };
    let connection = open(database).map_err(|source| StoreError::Open {
        path: database.to_path_buf(),
        source,
    })?;
    connection.busy_timeout(Duration::from_secs(5))?;
    Ok(connection)
}

/// `agentgate backup`: a consistent copy of the database (SQLite's online backup, one read
/// transaction, so the daemon keeps writing meanwhile) and of the ledger (a whole version: it is
/// only ever replaced by a rename; an empty ledger when there is none yet, so that a restore
/// also replaces a newer ledger) into `target`, a new directory (0700, files 0600). Returns the
/// files written.
pub(crate) fn backup(state_dir: &Path, target: &Path) -> Result<Vec<PathBuf>, String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let fail = |what: &str, err: &dyn std::fmt::Display| format!("{what}: {err}");
    let state = StateDir::new(state_dir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(target)
        .map_err(|err| fail(&format!("cannot create {}", target.display()), &err))?;
    let database = target.join(state_dir::DATABASE_FILE);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&database)
        .map_err(|err| fail(&database.display().to_string(), &err))?;
    let source = open_reader(&state.database()).map_err(|err| err.to_string())?;
    source
        .backup(rusqlite::DatabaseName::Main, &database, None)
        .map_err(|err| fail("cannot copy the database", &err))?;
    let mut written = vec![database];
    let ledger = state
        .read(&state.ledger())
        .map_err(|err| fail("cannot read the ledger", &err))?
        .unwrap_or_else(|| super::ledger::Ledger::default().to_json());
    let copy = target.join(state_dir::LEDGER_FILE);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&copy)
        .map_err(|err| fail(&copy.display().to_string(), &err))?;
    std::io::Write::write_all(&mut file, &ledger)
        .and_then(|()| file.sync_all())
        .map_err(|err| fail(&copy.display().to_string(), &err))?;
    written.push(copy);
    StateDir::new(target)
        .sync()
        .map_err(|err| fail(&format!("cannot sync {}", target.display()), &err))?;
    Ok(written)
}

/// `PRAGMA quick_check` of a database no daemon uses (reconcile): `Err` says what is wrong.
pub(crate) fn check_database(database: &Path) -> Result<(), String> {
    let answer = open_reader(database)
        .and_then(|connection| {
            Ok(connection.query_row("PRAGMA quick_check", [], |row| row.get::<_, String>(0))?)
        })
        .map_err(|err| err.to_string())?;
    if answer == "ok" { Ok(()) } else { Err(answer) }
}

/// For reconcile's ledger repair: the sessions that were interrupted (waiting to resume, or with
/// a turn left running) and every known session.
pub(crate) fn session_keys(
    database: &Path,
) -> Result<(BTreeSet<String>, BTreeSet<String>), StoreError> {
    let connection = open_reader(database)?;
    let keys = |sql: &str| -> Result<BTreeSet<String>, StoreError> {
        Ok(connection
            .prepare(sql)?
            .query_map([], |row| row.get::<_, String>(0))?
            .collect::<rusqlite::Result<BTreeSet<String>>>()?)
    };
    Ok((
        keys(concatcp!(
            "SELECT key FROM sessions WHERE state = ",
            RESUME_PENDING,
            " UNION SELECT session_key FROM turns WHERE status = ",
            TURN_RUNNING
        ))?,
        keys("SELECT key FROM sessions")?,
    ))
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

/// Runs a ledger operation (file I/O under an fs4 lock) off the async threads.
async fn with_ledger<T: Send + 'static>(
    ledger: &Arc<LedgerFile>,
    operation: impl FnOnce(&LedgerFile) -> Result<T, super::ledger::LedgerError> + Send + 'static,
) -> Result<T, StoreError> {
    let ledger = ledger.clone();
    tokio::task::spawn_blocking(move || operation(&ledger))
        .await
        .map_err(|err| StoreError::Stopped(format!("a ledger task ({err})")))?
        .map_err(|err| StoreError::Ledger(err.to_string()))
}

#[async_trait::async_trait]
impl Inspection for SqliteStore {
    async fn live_counts(&self) -> Result<LiveCounts, StoreError> {
        self.read(LiveCounts::query).await
    }

    async fn status_summary(&self) -> Result<StatusSummary, StoreError> {
        self.read(StatusSummary::query).await
    }

    async fn sessions(&self) -> Result<Vec<SessionRow>, StoreError> {
        self.read(sessions_in).await
    }

    async fn sessions_page(
        &self,
        after: Option<String>,
        limit: i64,
    ) -> Result<Vec<SessionRow>, StoreError> {
        self.read(move |connection| sessions_page_in(connection, after.as_deref(), limit))
            .await
    }

    async fn session(&self, key: &str) -> Result<Option<SessionRow>, StoreError> {
        let key = key.to_string();
        self.read(move |connection| session_in(connection, &key))
            .await
    }

    async fn events(&self, filter: EventFilter) -> Result<Vec<EventRow>, StoreError> {
        self.read(move |connection| inspect::events_in(connection, &filter))
            .await
    }

    async fn event(&self, id: &str) -> Result<Option<EventDetail>, StoreError> {
        let id = id.to_string();
        self.read(move |connection| inspect::event_in(connection, &id))
            .await
    }

    async fn deliveries(
        &self,
        failed_only: bool,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, StoreError> {
        self.read(move |connection| inspect::deliveries_in(connection, failed_only, limit))
            .await
    }
}

#[async_trait::async_trait]
impl Coordination for SqliteStore {
    async fn answers(&self) -> bool {
        self.write(|_| Ok(())).await.is_ok()
    }

    async fn request_interrupt(&self, _session_key: &str) -> Result<(), StoreError> {
        Ok(())
    }

    async fn interrupts_requested(&self) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }

    async fn release(&self) {}

    fn is_writable(&self) -> bool {
        self.writable.load(Ordering::Acquire)
    }

    fn failover_interval(&self) -> Option<Duration> {
        None
    }
}
