//! The retry ledger (`ledger.json`): how many times each session has been resumed at startup.
//!
//! It is the admission gate for every resume: the count is incremented and made durable (under the
//! `ledger.lock` fs4 lock, by atomic replacement) *before* the resume is dispatched, so a session
//! that kills the process is counted even though it never gets to say so. It fails closed: a
//! malformed ledger is left untouched and admits nothing, and a failed write admits nothing.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fs4::{FileExt, TryLockError};
use serde_json::{Map, Value, json};

use super::atomic;
use super::state_dir::{LEDGER_FILE, StateDir};
const LOCK_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub(crate) enum LedgerError {
    #[error("{path} is malformed: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} stayed locked for {LOCK_WAIT:?}")]
    LockTimeout { path: PathBuf },
}

/// One session's entry; unknown keys are kept as they were.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LedgerEntry {
    pub attempts: u64,
    pub last_attempt: String,
    extra: Map<String, Value>,
}

/// The parsed ledger. Unknown top-level keys are preserved on write.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Ledger {
    pub sessions: BTreeMap<String, LedgerEntry>,
    extra: Map<String, Value>,
}

/// Parses `text`; any deviation from the format in docs/reference.md ("Retry ledger") is `Err(reason)`.
pub(crate) fn parse(text: &[u8]) -> Result<Ledger, String> {
    let value: Value = serde_json::from_slice(text).map_err(|err| format!("not JSON ({err})"))?;
    let Value::Object(mut top) = value else {
        return Err("not a JSON object".into());
    };
    match top.remove("version") {
        Some(Value::Number(n)) if n.as_u64() == Some(1) => {}
        Some(other) => return Err(format!("version {other} is not 1")),
        None => return Err("no version".into()),
    }
    let Some(Value::Object(raw_sessions)) = top.remove("sessions") else {
        return Err("no sessions object".into());
    };
    let mut sessions = BTreeMap::new();
    for (key, entry) in raw_sessions {
        sessions.insert(
            key.clone(),
            parse_entry(entry).map_err(|reason| format!("session {key:?}: {reason}"))?,
        );
    }
    Ok(Ledger {
        sessions,
        extra: top,
    })
}

fn parse_entry(entry: Value) -> Result<LedgerEntry, String> {
    let Value::Object(mut fields) = entry else {
        return Err("entry is not an object".into());
    };
    let attempts = match fields.remove("attempts") {
        Some(Value::Number(n)) => n
            .as_u64()
            .ok_or_else(|| format!("attempts {n} is not a non-negative integer"))?,
        Some(other) => return Err(format!("attempts {other} is not an integer")),
        None => return Err("no attempts".into()),
    };
    let last_attempt = match fields.remove("last_attempt") {
        Some(Value::String(text)) => text,
        Some(other) => return Err(format!("last_attempt {other} is not a string")),
        None => String::new(),
    };
    Ok(LedgerEntry {
        attempts,
        last_attempt,
        extra: fields,
    })
}

/// Salvages what parses from a malformed ledger: every session entry that is valid on its own.
pub(crate) fn salvage(text: &[u8]) -> Ledger {
    let Ok(Value::Object(top)) = serde_json::from_slice::<Value>(text) else {
        return Ledger::default();
    };
    let sessions = match top.get("sessions") {
        Some(Value::Object(entries)) => entries
            .iter()
            .filter_map(|(key, entry)| parse_entry(entry.clone()).ok().map(|e| (key.clone(), e)))
            .collect(),
        _ => BTreeMap::new(),
    };
    Ledger {
        sessions,
        extra: Map::new(),
    }
}

impl Ledger {
    pub(crate) fn to_json(&self) -> Vec<u8> {
        let mut top = self.extra.clone();
        top.insert("version".into(), json!(1));
        let sessions: Map<String, Value> = self
            .sessions
            .iter()
            .map(|(key, entry)| {
                let mut fields = entry.extra.clone();
                fields.insert("attempts".into(), json!(entry.attempts));
                fields.insert("last_attempt".into(), json!(entry.last_attempt));
                (key.clone(), Value::Object(fields))
            })
            .collect();
        top.insert("sessions".into(), Value::Object(sessions));
        let mut text = serde_json::to_vec_pretty(&Value::Object(top)).unwrap_or_default();
        text.push(b'\n');
        text
    }

    /// Sets a session's count (creating its entry) with the current time.
    pub(crate) fn set(&mut self, session: &str, attempts: u64) {
        self.insert(session, attempts, now_rfc3339());
    }

    /// Sets a session's count and time of its last attempt (creating its entry).
    pub(crate) fn insert(&mut self, session: &str, attempts: u64, last_attempt: String) {
        let entry = self
            .sessions
            .entry(session.to_string())
            .or_insert(LedgerEntry {
                attempts: 0,
                last_attempt: String::new(),
                extra: Map::new(),
            });
        entry.attempts = attempts;
        entry.last_attempt = last_attempt;
    }
}

/// The time of an attempt as the ledger records it.
pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// The ledger files of one state directory.
pub(crate) struct LedgerFile {
    dir: StateDir,
}

/// The held `ledger.lock`; released on drop.
struct LedgerLock {
    _file: File,
}

impl LedgerFile {
    pub(crate) fn new(state_dir: &Path) -> LedgerFile {
        LedgerFile {
            dir: StateDir::new(state_dir),
        }
    }

    pub(crate) fn path(&self) -> PathBuf {
        self.dir.ledger()
    }

    fn io(&self, path: PathBuf) -> impl FnOnce(std::io::Error) -> LedgerError {
        move |source| LedgerError::Io { path, source }
    }

    fn lock(&self) -> Result<LedgerLock, LedgerError> {
        let path = self.dir.ledger_lock();
        let file = self
            .dir
            .open_lock_file(&path)
            .map_err(self.io(path.clone()))?;
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            match FileExt::try_lock(&file) {
                Ok(()) => return Ok(LedgerLock { _file: file }),
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(TryLockError::WouldBlock) => return Err(LedgerError::LockTimeout { path }),
                Err(TryLockError::Error(source)) => return Err(LedgerError::Io { path, source }),
            }
        }
    }

    /// Reads the ledger; a missing file is an empty ledger.
    fn read(&self) -> Result<Ledger, LedgerError> {
        let path = self.path();
        match self.dir.read(&path) {
            Ok(Some(bytes)) => {
                parse(&bytes).map_err(|reason| LedgerError::Malformed { path, reason })
            }
            Ok(None) => Ok(Ledger::default()),
            Err(source) => Err(LedgerError::Io { path, source }),
        }
    }

    /// Reads the ledger without the lock, for `ledger show` and `status`: every replacement is an
    /// atomic rename, so a reader sees one whole version, and a reader takes no lock file (one
    /// created by root would lock the daemon's user out).
    pub(crate) fn load(&self) -> Result<Ledger, LedgerError> {
        self.read()
    }

    /// Under the lock: reads, lets `change` edit, and durably replaces the ledger if `change`
    /// returned `true`. Nothing is written when the ledger is malformed.
    pub(crate) fn update<T>(
        &self,
        change: impl FnOnce(&mut Ledger) -> (bool, T),
    ) -> Result<T, LedgerError> {
        let _lock = self.lock()?;
        let mut ledger = self.read()?;
        let (changed, value) = change(&mut ledger);
        if changed {
            atomic::replace(self.dir.path(), LEDGER_FILE, &ledger.to_json())
                .map_err(self.io(self.path()))?;
        }
        Ok(value)
    }

    /// Replaces the ledger with `ledger`, under the lock, whatever the file held (reconcile).
    pub(crate) fn replace(&self, ledger: &Ledger) -> std::io::Result<()> {
        let _lock = self.lock().map_err(std::io::Error::other)?;
        atomic::replace(self.dir.path(), LEDGER_FILE, &ledger.to_json())
    }

    /// Records one more resume of `session`, durably, adding it to the count when `counts`,
    /// and returns the count.
    pub(crate) fn record_resume(&self, session: &str, counts: bool) -> Result<u64, LedgerError> {
        self.update(|ledger| {
            let attempts = (ledger.sessions.get(session))
                .map_or(0, |e| e.attempts)
                .saturating_add(u64::from(counts));
            ledger.set(session, attempts);
            (true, attempts)
        })
    }

    /// Removes `session`'s entry, if it has one.
    pub(crate) fn clear(&self, session: &str) -> Result<(), LedgerError> {
        self.update(|ledger| (ledger.sessions.remove(session).is_some(), ()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_ledgers_are_refused_with_a_reason() {
        for (text, reason) in [
            ("garbage", "not JSON"),
            ("[]", "not a JSON object"),
            (r#"{"version":2,"sessions":{}}"#, "version 2"),
            (r#"{"version":1}"#, "no sessions"),
            (
                r#"{"version":1,"sessions":{"a":{"attempts":-1}}}"#,
                "non-negative",
            ),
            (
                r#"{"version":1,"sessions":{"a":{"attempts":1.5}}}"#,
                "non-negative",
            ),
            (
                r#"{"version":1,"sessions":{"a":{"attempts":"2"}}}"#,
                "not an integer",
            ),
            ("", "not JSON"),
        ] {
            let err = parse(text.as_bytes()).expect_err(text);
            assert!(err.contains(reason), "{text}: {err}");
        }
    }

    #[test]
    fn unknown_keys_survive_a_rewrite() {
        let text = br#"{"version":1,"owner":"ops","sessions":{"a":{"attempts":2,"last_attempt":"x","note":"n"}}}"#;
        let mut ledger = parse(text).expect("valid");
        ledger.set("b", 1);
        let again: Value = serde_json::from_slice(&ledger.to_json()).expect("json");
        assert_eq!(again["owner"], "ops");
        assert_eq!(again["sessions"]["a"]["note"], "n");
        assert_eq!(again["sessions"]["a"]["attempts"], 2);
        assert_eq!(again["sessions"]["b"]["attempts"], 1);
    }

    #[test]
    fn salvage_keeps_the_valid_entries() {
        let text = br#"{"version":7,"sessions":{"good":{"attempts":2},"bad":{"attempts":-3}}}"#;
        let salvaged = salvage(text);
        assert_eq!(salvaged.sessions.len(), 1);
        assert_eq!(salvaged.sessions["good"].attempts, 2);
        assert!(salvage(b"\x00\x01").sessions.is_empty());
    }

    #[test]
    fn counting_is_durable_and_refused_on_a_malformed_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = LedgerFile::new(dir.path());
        assert_eq!(file.record_resume("s", true).expect("count"), 1);
        assert_eq!(file.record_resume("s", true).expect("count"), 2);
        // A resume that does not count is still written (and so refused on a bad file).
        assert_eq!(file.record_resume("s", false).expect("record"), 2);
        assert_eq!(file.load().expect("load").sessions["s"].attempts, 2);
        file.clear("s").expect("clear");
        assert!(file.load().expect("load").sessions.is_empty());
        // A count at its largest stays there: it never wraps to a session that may run again.
        std::fs::write(
            file.path(),
            format!(
                r#"{{"version":1,"sessions":{{"s":{{"attempts":{}}}}}}}"#,
                u64::MAX
            ),
        )
        .expect("planted");
        assert_eq!(file.record_resume("s", true).expect("count"), u64::MAX);
        std::fs::write(file.path(), b"{oops").expect("corrupt");
        assert!(matches!(
            file.record_resume("s", false),
            Err(LedgerError::Malformed { .. })
        ));
        assert_eq!(
            std::fs::read(file.path()).expect("read"),
            b"{oops",
            "left untouched"
        );
    }
}
