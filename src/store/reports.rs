//! Saved what-if reports: `what-if --save` keeps its report in the state directory's `what-if/`
//! directory, where the console reads it. They are the operator's documents, not state the daemon
//! goes by, so they are files beside the database, never rows in it, and nothing prunes them.
//!
//! A report is written once, atomically (a reader sees all of it or none), 0600, under a name
//! of a fixed shape that the console's URLs carry: a name of any other shape, a symbolic link or
//! a file larger than [`MAX_REPORT_BYTES`] is never read.

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use super::StateDir;

/// The directory of saved reports, in the state directory.
pub(crate) const REPORTS_DIR: &str = "what-if";
/// The largest report read back.
const MAX_REPORT_BYTES: u64 = 16 * 1024 * 1024;
/// Mode of the reports directory (as the state directory's).
const REPORTS_DIR_MODE: u32 = 0o750;

/// Whether `name` is one `save_report` gives: `YYYYMMDDTHHMMSSZ-` then 8 hex digits, `.json`.
pub(crate) fn is_report_name(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".json") else {
        return false;
    };
    let bytes = stem.as_bytes();
    bytes.len() == 25
        && bytes.iter().enumerate().all(|(index, byte)| match index {
            8 => *byte == b'T',
            15 => *byte == b'Z',
            16 => *byte == b'-',
            0..8 | 9..15 => byte.is_ascii_digit(),
            _ => byte.is_ascii_digit() || (b'a'..=b'f').contains(byte),
        })
}

impl StateDir {
    fn reports_dir(&self) -> PathBuf {
        self.path().join(REPORTS_DIR)
    }

    /// Keeps `report` as a new saved report, created at `now_ms`; returns its path. Run as root
    /// in a directory another user owns, what it creates is given to that user.
    pub(crate) fn save_report(&self, report: &[u8], now_ms: i64) -> std::io::Result<PathBuf> {
        let dir = self.reports_dir();
        if std::fs::symlink_metadata(&dir).is_err() {
            std::fs::DirBuilder::new()
                .mode(REPORTS_DIR_MODE)
                .create(&dir)?;
        }
        if !std::fs::symlink_metadata(&dir)?.is_dir() {
            return Err(std::io::Error::other(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        let stamp = super::rfc3339(now_ms).replace(['-', ':'], "");
        let random = uuid::Uuid::new_v4();
        let name = format!("{stamp}-{}.json", hex::encode(&random.as_bytes()[..4]));
        super::atomic::replace(&dir, &name, report)?;
        let path = dir.join(&name);
        if let Some(owner) = self.owner_other_than_root() {
            for created in [&dir, &path] {
                if std::fs::symlink_metadata(created)?.uid() != owner.uid() {
                    std::os::unix::fs::lchown(created, Some(owner.uid()), Some(owner.gid()))?;
                }
            }
        }
        Ok(path)
    }

    /// The names of the saved reports, newest first, at most `limit`.
    pub(crate) fn saved_reports(&self, limit: usize) -> std::io::Result<Vec<String>> {
        let entries = match std::fs::read_dir(self.reports_dir()) {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(err),
        };
        let mut names: Vec<String> = entries
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| is_report_name(name))
            .collect();
        names.sort_unstable_by(|a, b| b.cmp(a));
        names.truncate(limit);
        Ok(names)
    }

    /// The saved report `name`; `Ok(None)` when there is none of that name.
    pub(crate) fn saved_report(&self, name: &str) -> std::io::Result<Option<Vec<u8>>> {
        if !is_report_name(name) {
            return Ok(None);
        }
        let path = self.reports_dir().join(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path);
        let file = match file {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err),
        };
        let mut bytes = Vec::new();
        file.take(MAX_REPORT_BYTES + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > MAX_REPORT_BYTES {
            return Err(std::io::Error::other(format!(
                "{} is larger than {MAX_REPORT_BYTES} bytes",
                path.display()
            )));
        }
        Ok(Some(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_the_saved_shape_are_read() {
        assert!(is_report_name("20261205T071608Z-0a1b2c3d.json"));
        for name in [
            "../agentgate.db",
            "20261205T071608Z-0a1b2c3d.json.tmp",
            "20261205T071608Z-0A1B2C3D.json",
            "20261205-071608Z-0a1b2c3d.json",
            ".agentgate-x.tmp",
        ] {
            assert!(!is_report_name(name), "{name}");
        }
    }

    #[test]
    fn a_saved_report_reads_back_by_its_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = StateDir::new(dir.path());
        let path = state.save_report(b"{}", 0).expect("saved");
        let name = path.file_name().and_then(|n| n.to_str()).expect("a name");
        assert!(name.starts_with("19700101T000000Z-"), "{name}");
        assert_eq!(state.saved_reports(10).expect("listed"), [name]);
        assert_eq!(
            state.saved_report(name).expect("read"),
            Some(b"{}".to_vec())
        );
    }
}
