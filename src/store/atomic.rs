//! Crash-safe file replacement: a temporary file in the same directory, fsync'd, renamed over the
//! target, then the directory fsync'd. Readers see the old file or the new one, never a mix, and
//! after the final fsync the new one survives a power cut.

use std::io::Write;
use std::path::Path;

/// Temporary files of interrupted replacements start with this prefix (and end in `.tmp`).
pub(crate) const TEMP_PREFIX: &str = ".agentgate-";

/// Replaces `dir/name` with `data`.
pub(crate) fn replace(dir: &Path, name: &str, data: &[u8]) -> std::io::Result<()> {
    let mut temp = tempfile::Builder::new()
        .prefix(&format!("{TEMP_PREFIX}{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)?;
    temp.write_all(data)?;
    temp.as_file().sync_all()?;
    temp.persist(dir.join(name)).map_err(|err| err.error)?;
    std::fs::File::open(dir)?.sync_all()
}

/// Whether `name` is a temporary file left by an interrupted [`replace`].
pub(crate) fn is_stale_temp(name: &str) -> bool {
    name.starts_with(TEMP_PREFIX) && name.ends_with(".tmp")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        replace(dir.path(), "ledger.json", b"one").expect("first");
        replace(dir.path(), "ledger.json", b"two").expect("second");
        assert_eq!(
            std::fs::read(dir.path().join("ledger.json")).expect("read"),
            b"two"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .filter_map(std::result::Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["ledger.json"]);
        assert!(is_stale_temp(".agentgate-ledger.json.Ab12.tmp"));
        assert!(!is_stale_temp("ledger.json"));
    }
}
