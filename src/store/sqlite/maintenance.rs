//! Work on the state database outside the daemon's writer: `agentgate backup`, and the checks
//! and reads of `agentgate reconcile`, which runs before the daemon starts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use const_format::concatcp;

use super::{open_reader, query, value};
use crate::store::ledger::Ledger;
use crate::store::states::{RESUME_PENDING, TURN_RUNNING};
use crate::store::{StateDir, StoreError, state_dir};

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
