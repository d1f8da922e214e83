//! Tools that record each run in a file of the workspace (`marks/NAME.runs`, one line a run),
//! for the tests that count how often a call ran across interruptions and reruns
//! (tests/resume.rs, tests/rewind.rs).

use std::path::PathBuf;
use std::time::Duration;

use super::Workspace;
use super::basics::wait_until;

/// Where the tools record their runs (created; the tools may write only there).
pub fn marks(workspace: &Workspace) -> PathBuf {
    let marks = workspace.path().join("marks");
    std::fs::create_dir_all(&marks).expect("the tools' directory");
    marks
}

/// How often the tool recording in `name` ran.
pub fn runs(workspace: &Workspace, name: &str) -> usize {
    std::fs::read_to_string(marks(workspace).join(name))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

pub fn wait_for_runs(workspace: &Workspace, name: &str, count: usize, limit: Duration) {
    wait_until(&format!("{name} to run {count} time(s)"), limit, || {
        runs(workspace, name) >= count
    });
}

/// `slow_side_effect` (not idempotent; records in `side_effect.runs`, then hangs for 30 s) and
/// `slow_lookup` (idempotent; records in `lookup.runs` and hangs on its first run only).
pub fn slow_tools(workspace: &Workspace) -> String {
    let marks = marks(workspace);
    let marks = marks.display();
    format!(
        r#"[tools.slow_side_effect]
description = "Changes something, slowly"
command = ["/bin/sh", "-c", "echo ran >> {marks}/side_effect.runs; sleep 30"]
writable = ["{marks}"]
timeout = "60s"

[tools.slow_lookup]
description = "Reads something, slowly"
command = ["/bin/sh", "-c", "echo ran >> {marks}/lookup.runs; [ $(wc -l < {marks}/lookup.runs) -ge 2 ] || sleep 30"]
writable = ["{marks}"]
timeout = "60s"
idempotent = true
"#
    )
}
