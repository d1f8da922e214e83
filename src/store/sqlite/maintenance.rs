//! Work on the state database outside the daemon's writer: `agentgate backup`, and the checks
//! and reads of `agentgate reconcile`, which runs before the daemon starts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use const_format::concatcp;

use super::{open_reader, query, value};
use crate::store::ledger::Ledger;
use crate::store::states::{RESUME_PENDING, TURN_RUNNING};
use crate::store::{StateDir, StoreError, state_dir};

/// `agentgate backup`: a consistent copy of the database (SQLite's online backup of every page
/// in one step, so one read transaction: the daemon keeps writing meanwhile, and the copy is
/// the state when it began) and of the ledger (a whole version: it is only ever replaced by a
/// rename; an empty ledger when there is none yet, so that a restore also replaces a newer
/// ledger) into `target`, a new directory (0700, files 0600). Returns the files written.
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
    copy_database(&source, &database).map_err(|err| fail("cannot copy the database", &err))?;
    let mut written = vec![database];
    let ledger = state
        .read(&state.ledger())
        .map_err(|err| fail("cannot read the ledger", &err))?
        .unwrap_or_else(|| Ledger::default().to_json());
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

/// Copies every page of `source` into the new database file `copy` in one backup step. The
/// backup API's usual small steps each take a read transaction of their own, and a write to
/// the source between two steps starts the copy over: under a daemon that commits every few
/// milliseconds a copy of a large database took minutes instead of a second.
#[expect(
    clippy::wildcard_enum_match_arm,
    reason = "StepResult is open-ended; only Done, Busy and Locked change what happens"
)]
fn copy_database(source: &rusqlite::Connection, copy: &Path) -> Result<(), rusqlite::Error> {
    use rusqlite::backup::{Backup, StepResult};
    let mut destination = rusqlite::Connection::open(copy)?;
    let backup = Backup::new(source, &mut destination)?;
    let mut busy = 0;
    loop {
        match backup.step(-1)? {
            StepResult::Done => return Ok(()),
            // Locked by another writer for a moment (a checkpoint): the whole step again.
            StepResult::Busy | StepResult::Locked if busy < BACKUP_BUSY_RETRIES => {
                busy += 1;
                std::thread::sleep(BACKUP_BUSY_PAUSE);
            }
            StepResult::Busy | StepResult::Locked => {
                return Err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
                    Some("the database stayed locked".into()),
                ));
            }
            // `More` is not answered to a step of every page (-1); it would only mean another
            // step is needed.
            _ => {}
        }
    }
}

/// How often, and how long apart, a backup step that found the database locked is tried again.
const BACKUP_BUSY_RETRIES: u32 = 100;
const BACKUP_BUSY_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

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
        Ok(query(&connection, sql, &[], |row| value(row, "key"))?
            .into_iter()
            .collect())
    };
    Ok((
        keys(concatcp!(
            "SELECT key FROM sessions WHERE state = ",
            RESUME_PENDING,
            " UNION SELECT session_key AS key FROM turns WHERE status = ",
            TURN_RUNNING
        ))?,
        keys("SELECT key FROM sessions")?,
    ))
}
