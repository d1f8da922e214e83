//! The SQLite backend: one node, state in `state_dir/agentgate.db`.
//!
//! Every write goes through one writer thread that takes all
//! pending writes, applies them in one transaction and commits once (group commit): under load one
//! fdatasync covers many events, and a caller's future resolves only after the commit that holds
//! its write has returned. That is what lets the listener answer 202 only for durable events.

mod accepting;
mod approvals;
mod coordination;
mod inspection;
mod maintenance;
mod operator;
mod outbox;
#[cfg(test)]
mod plans;
mod recovery;
mod schema;
mod turns;

pub(crate) use maintenance::{backup, check_database, session_keys};
pub(crate) use schema::MigrationError;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::types::ToSql;
use rusqlite::{CachedStatement, Connection, OpenFlags, Row};
use tokio::sync::oneshot;

use super::ledger::{LedgerError, LedgerFile};
use super::row::StoredRow;
use super::tx::{Tx, Values};
use super::{StateDir, StoreError, ensure_state_dir, now_millis, state_dir};

/// The most writes that share one transaction.
const MAX_BATCH: usize = 1024;
/// Batches take the write lock up front, so a concurrent reader never turns a batch into a retry.
const BEGIN_BATCH: &str = "BEGIN IMMEDIATE";
/// How often an unhealthy store probes whether writes work again.
const PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// One queued write: applied inside the batch transaction, then told whether the batch committed.
trait WriteJob: Send {
    /// Applies the job; with `guarded`, in a savepoint of its own, which a failure rolls back.
    /// Returns whether it succeeded. A job may be applied again (in a new transaction).
    fn apply(&mut self, connection: &Connection, guarded: Guarded) -> bool;
    fn finish(self: Box<Self>, committed: Result<(), String>);
}

/// Whether a job runs in a savepoint of its own (see [`Writer::commit_batch`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Guarded {
    Yes,
    No,
}

struct Job<T, F> {
    work: F,
    outcome: Option<Result<T, StoreError>>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> WriteJob for Job<T, F>
where
    T: Send,
    F: Fn(&Connection) -> Result<T, StoreError> + Send,
{
    fn apply(&mut self, connection: &Connection, guarded: Guarded) -> bool {
        let outcome = match guarded {
            Guarded::No => (self.work)(connection),
            Guarded::Yes => {
                // Both statements are prepared once per connection, as every statement of a
                // job is.
                let outcome =
                    run_cached(connection, "SAVEPOINT job").and_then(|()| (self.work)(connection));
                let ended = if outcome.is_ok() {
                    run_cached(connection, "RELEASE job")
                } else {
                    connection
                        .execute_batch("ROLLBACK TO job; RELEASE job")
                        .map_err(StoreError::from)
                };
                ended.and(outcome)
            }
        };
        let succeeded = outcome.is_ok();
        self.outcome = Some(outcome);
        succeeded
    }

    fn finish(self: Box<Self>, committed: Result<(), String>) {
        let result = match (committed, self.outcome) {
            (Err(message), _) => Err(StoreError::Unavailable(message)),
            (Ok(()), Some(Ok(value))) => Ok(value),
            (Ok(()), Some(Err(err))) => Err(err),
            (Ok(()), None) => Err(StoreError::Unavailable("write was not applied".into())),
        };
        // The caller may have gone away (client disconnected); its write is committed regardless.
        let _ = self.reply.send(result);
    }
}

/// Runs a statement without parameters, prepared once per connection.
fn run_cached(connection: &Connection, sql: &str) -> Result<(), StoreError> {
    connection.prepare_cached(sql)?.raw_execute()?;
    Ok(())
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
    distrust_the_schema(&connection)?;
    // `temp_store = MEMORY`: the statement journals of a transaction (the pages a statement
    // changes, kept so that it can be undone alone) stay in memory; spilled to a temporary file
    // past 64 KiB, as SQLite does by default, they cost a batch of accepts more system time
    // than its commit.
    connection.execute_batch(
        "PRAGMA journal_mode = WAL;
         PRAGMA synchronous = FULL;
         PRAGMA temp_store = MEMORY;
         PRAGMA cache_size = -2000;",
    )?;
    Ok(connection)
}

/// Whoever can write the database (the service's user, a tool that escaped) could plant a
/// trigger or view that an operator's command, run as root, would then run. So no function with
/// side effects runs from the schema (`trusted_schema = OFF`), and a database with a trigger or
/// view the migrations did not create is refused, naming it.
fn distrust_the_schema(connection: &Connection) -> rusqlite::Result<()> {
    connection.execute_batch("PRAGMA trusted_schema = OFF;")?;
    let mut statement = connection
        .prepare("SELECT type, name FROM sqlite_master WHERE type IN ('trigger', 'view')")?;
    let planted: Vec<String> = statement
        .query_map([], |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
        })?
        .filter_map(Result::ok)
        .filter(|(kind, name)| kind != "trigger" || !schema::TRIGGERS.contains(&name.as_str()))
        .map(|(kind, name)| format!("{kind} {name}"))
        .collect();
    if planted.is_empty() {
        return Ok(());
    }
    Err(rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
        Some(format!(
            "the database holds what agentgate did not create ({}): refused; remove it or restore a backup",
            planted.join(", ")
        )),
    ))
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
        F: Fn(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            work,
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
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let database = self.database.clone();
        let readers = self.readers.clone();
        tokio::task::spawn_blocking(move || {
            let pooled = readers.lock().ok().and_then(|mut idle| idle.pop());
            let connection = match pooled {
                Some(connection) => connection,
                None => open_reader(&database)?,
            };
            let result = query(&connection);
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
    let connection = open(database)
        .and_then(|connection| {
            connection.busy_timeout(Duration::from_secs(5))?;
            distrust_the_schema(&connection)?;
            Ok(connection)
        })
        .map_err(|source| StoreError::Open {
            path: database.to_path_buf(),
            source,
        })?;
    Ok(connection)
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

    /// Applies the batch in one transaction and commits it. One failing job must not undo the
    /// others, yet a savepoint per job would copy every page it touches into SQLite's statement
    /// journal (most of an accept's cost). So the jobs first run one after another with none;
    /// if every one succeeds, that is the batch. If one fails (rare: its writes may be half
    /// done), the transaction is rolled back and the batch runs again with a savepoint per job.
    fn commit_batch(&mut self, batch: &mut [Box<dyn WriteJob>]) -> Result<(), String> {
        let connection = self.connection()?;
        run_cached(connection, BEGIN_BATCH).map_err(|err| err.to_string())?;
        if !batch
            .iter_mut()
            .all(|job| job.apply(connection, Guarded::No))
        {
            connection
                .execute_batch("ROLLBACK")
                .map_err(|err| err.to_string())?;
            run_cached(connection, BEGIN_BATCH).map_err(|err| err.to_string())?;
            for job in batch.iter_mut() {
                job.apply(connection, Guarded::Yes);
            }
        }
        match run_cached(connection, "COMMIT") {
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

impl SqliteStore {
    /// Runs a ledger operation (file I/O under an fs4 lock) off the async threads; the inner
    /// `Err` is the ledger's own refusal (malformed, unwritable).
    async fn with_ledger<T: Send + 'static>(
        &self,
        operation: impl FnOnce(&LedgerFile) -> Result<T, LedgerError> + Send + 'static,
    ) -> Result<Result<T, LedgerError>, StoreError> {
        let ledger = self.ledger.clone();
        tokio::task::spawn_blocking(move || operation(&ledger))
            .await
            .map_err(|err| StoreError::Stopped(format!("a ledger task ({err})")))
    }
}

/// A prepared statement of `sql`, which numbers its parameters `$N` as the shared SQL does
/// (`store::sql`), with `values` bound: SQLite takes `$N` as a name and numbers names by first
/// appearance, so each value is bound to its name, never by position.
fn statement<'c, V: ToSql + ?Sized>(
    connection: &'c Connection,
    sql: &str,
    values: &[&V],
) -> Result<CachedStatement<'c>, StoreError> {
    let mut statement = connection.prepare_cached(sql)?;
    for (position, value) in values.iter().enumerate() {
        let index = match PARAMETER_NAMES.get(position) {
            Some(name) => statement.parameter_index(name)?,
            None => statement.parameter_index(&format!("${}", position + 1))?,
        };
        if let Some(index) = index {
            statement.raw_bind_parameter(index, value)?;
        }
    }
    Ok(statement)
}

/// The names of the first parameters, so that binding them allocates nothing.
const PARAMETER_NAMES: [&str; 16] = [
    "$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8", "$9", "$10", "$11", "$12", "$13", "$14", "$15",
    "$16",
];

/// Runs a statement; the number of rows it changed.
fn execute(connection: &Connection, sql: &str, values: &[&dyn ToSql]) -> Result<usize, StoreError> {
    Ok(statement(connection, sql, values)?.raw_execute()?)
}

/// Runs a query and decodes every row.
fn query<T>(
    connection: &Connection,
    sql: &str,
    values: &[&dyn ToSql],
    decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    every_row(statement(connection, sql, values)?, decode)
}

/// Every row of a bound statement, decoded.
fn every_row<T>(
    mut statement: CachedStatement<'_>,
    decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let mut rows = statement.raw_query();
    let mut decoded = Vec::new();
    while let Some(row) = rows.next()? {
        decoded.push(decode(row)?);
    }
    Ok(decoded)
}

/// Runs a query and decodes its first row, if any.
fn query_optional<T>(
    connection: &Connection,
    sql: &str,
    values: &[&dyn ToSql],
    decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
) -> Result<Option<T>, StoreError> {
    first_row(statement(connection, sql, values)?, decode)
}

/// The first row of a bound statement, if any, decoded.
fn first_row<T>(
    mut statement: CachedStatement<'_>,
    decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
) -> Result<Option<T>, StoreError> {
    let mut rows = statement.raw_query();
    rows.next()?.map(decode).transpose()
}

/// Runs a query that answers one row.
fn query_one<T>(
    connection: &Connection,
    sql: &str,
    values: &[&dyn ToSql],
    decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    query_optional(connection, sql, values, decode)?
        .ok_or(StoreError::Query(rusqlite::Error::QueryReturnedNoRows))
}

/// One column of a row, by name.
fn value<T: super::row::Column>(row: &Row<'_>, name: &'static str) -> Result<T, StoreError> {
    row.column(name)
}

/// The writer's transaction, as the scripts written once for both backends run it
/// (`store::turns`).
struct OnWriter<'c> {
    connection: &'c Connection,
}

impl Tx for OnWriter<'_> {
    type Row<'r> = Row<'r>;

    async fn run(&self, sql: &str, values: &Values<'_>) -> Result<u64, StoreError> {
        let changed = statement(self.connection, sql, values)?.raw_execute()?;
        Ok(changed as u64)
    }

    async fn rows<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        every_row(statement(self.connection, sql, values)?, decode)
    }

    async fn maybe_row<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Option<T>, StoreError> {
        first_row(statement(self.connection, sql, values)?, decode)
    }

    async fn row<T>(
        &self,
        sql: &str,
        values: &Values<'_>,
        decode: impl Fn(&Row<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.maybe_row(sql, values, decode)
            .await?
            .ok_or(StoreError::Query(rusqlite::Error::QueryReturnedNoRows))
    }
}

/// Runs `script` on the writer's transaction. Its statements run on the writer thread one after
/// another, and none of them waits for anything else, so it is run to its end in place.
fn on_writer<T>(
    connection: &Connection,
    script: impl AsyncFnOnce(&OnWriter<'_>) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    futures::executor::block_on(script(&OnWriter { connection }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job whose work inserts `value` into `t`, then fails if `fails`.
    fn insert(
        value: i64,
        fails: bool,
    ) -> (Box<dyn WriteJob>, oneshot::Receiver<Result<(), StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let work = move |connection: &Connection| {
            execute(connection, "INSERT INTO t (x) VALUES ($1)", &[&value])?;
            if fails {
                return Err(StoreError::Render("refused after its insert".into()));
            }
            Ok(())
        };
        let job = Job {
            work,
            outcome: None,
            reply,
        };
        (Box::new(job), answer)
    }

    /// The writer applies a batch without a savepoint per job; a job that fails after writing
    /// makes it run the batch again with one, so that its own writes are undone and no other's.
    #[test]
    fn a_failing_job_undoes_its_own_writes_and_no_other_job_s() {
        let dir = tempfile::tempdir().expect("tempdir");
        drop(SqliteStore::open(dir.path()).expect("open"));
        let database = StateDir::new(dir.path()).database();
        let connection = Connection::open(&database).expect("connect");
        connection
            .execute_batch("CREATE TABLE t (x INTEGER)")
            .expect("table");
        let mut writer = Writer {
            connection: None,
            database,
            writable: Arc::new(AtomicBool::new(true)),
        };
        let (mut batch, answers): (Vec<_>, Vec<_>) = [(1, false), (2, true), (3, false)]
            .into_iter()
            .map(|(value, fails)| insert(value, fails))
            .unzip();
        let committed = writer.commit_batch(&mut batch);
        assert_eq!(committed, Ok(()));
        for job in batch {
            job.finish(committed.clone());
        }
        let outcomes: Vec<bool> = answers
            .into_iter()
            .map(|mut answer| answer.try_recv().expect("answered").is_ok())
            .collect();
        assert_eq!(outcomes, [true, false, true]);
        let mut rows = connection
            .prepare("SELECT x FROM t ORDER BY x")
            .expect("prepare");
        let stored: Vec<i64> = rows
            .query_map([], |row| row.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(stored, [1, 3]);
    }
}
