//! Runs a configured command tool: the call's JSON arguments on stdin, its idempotency key in
//! `AGENTGATE_TOOL_CALL_ID`, its timeout and capped output, through the one process runner
//! (`process.rs`, which says how children are isolated and stopped).

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::process::{Aborted, Child, Limits};
use super::sandbox;
use crate::config::{HiddenPaths, ToolSettings};

/// Output kept per stream, counted in stored bytes (`untrusted::tool_output`); the rest is read
/// and discarded, and the truncation is marked.
pub(crate) const OUTPUT_CAP: usize = 64 * 1024;

/// How a tool run ended, as recorded in the transcript and shown to the model. Fields that say
/// nothing (no signal, an empty stderr) are left out: the model reads a result again in every
/// later request that shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct ToolOutcome {
    /// The exit code, if the tool exited on its own.
    pub exit_status: Option<i32>,
    /// The signal that ended it, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub stdout: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stderr: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stdout_truncated: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stderr_truncated: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ToolOutcome {
    fn failed_to_start(message: String) -> ToolOutcome {
        ToolOutcome {
            exit_status: None,
            signal: None,
            stdout: String::new(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            timed_out: false,
            error: Some(message),
        }
    }
}

impl ToolOutcome {
    /// How the call ended, as the `result` label of `agentgate_tool_calls_total`.
    pub(crate) fn result(&self) -> &'static str {
        if self.timed_out {
            "timeout"
        } else if self.exit_status == Some(0) {
            "ok"
        } else {
            "error"
        }
    }
}

/// Why a tool did not produce an outcome.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ToolAbort {
    /// The turn was cancelled; the process group was killed.
    Cancelled,
}

fn marked(bytes: &[u8], truncated: bool) -> (String, bool) {
    crate::untrusted::tool_output(&String::from_utf8_lossy(bytes), truncated, OUTPUT_CAP)
}

/// The environment variable that carries a call's idempotency key: the same when an interrupted
/// call is run again, different for every other call.
pub(crate) const CALL_KEY_VARIABLE: &str = "AGENTGATE_TOOL_CALL_ID";

/// Runs `tool` with `arguments` on stdin and the call's `key` in `AGENTGATE_TOOL_CALL_ID`.
/// Resolves when the tool exits, is killed at its timeout, or `cancel` fires (then its process
/// group is killed and `Cancelled` returned).
pub(crate) async fn run(
    tool: &ToolSettings,
    hidden: &HiddenPaths,
    arguments: &serde_json::Value,
    key: &str,
    cancel: &CancellationToken,
) -> Result<ToolOutcome, ToolAbort> {
    let Some(child) = Child::new(&tool.command) else {
        return Ok(ToolOutcome::failed_to_start(
            "the tool has no command".into(),
        ));
    };
    let child = match sandbox::confine(child, &tool.sandbox, hidden) {
        Ok(child) => child,
        Err(not_confined) => {
            tracing::error!(tool = %tool.name, error = %not_confined, "tool not run");
            return Ok(ToolOutcome::failed_to_start(not_confined.to_string()));
        }
    };
    tracing::info!(tool = %tool.name, sandbox = sandbox::mechanism(&tool.sandbox), "running the tool");
    let limits = Limits {
        timeout: tool.timeout,
        output_cap: OUTPUT_CAP,
    };
    let input = arguments.to_string().into_bytes();
    let finished = match child
        .env(CALL_KEY_VARIABLE, key)
        .run(input, limits, cancel)
        .await
    {
        Ok(finished) => finished,
        Err(Aborted::NotStarted(message)) => return Ok(ToolOutcome::failed_to_start(message)),
        Err(Aborted::Cancelled) => return Err(ToolAbort::Cancelled),
    };
    let (stdout, stdout_truncated) = marked(&finished.stdout.bytes, finished.stdout.truncated);
    let (stderr, stderr_truncated) = marked(&finished.stderr.bytes, finished.stderr.truncated);
    let (exit_status, signal, error) = match finished.status {
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt;
            (status.code(), status.signal(), None)
        }
        Err(err) => (
            None,
            None,
            Some(format!("waiting for the tool failed: {err}")),
        ),
    };
    let timed_out = finished.timed_out;
    Ok(ToolOutcome {
        exit_status,
        signal,
        stdout,
        stderr,
        stdout_truncated,
        stderr_truncated,
        timed_out,
        error: error.or_else(|| {
            timed_out.then(|| format!("killed after its timeout of {:?}", tool.timeout))
        }),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Runs `tool` with no arguments and nothing cancelling it.
    async fn run_alone(tool: &ToolSettings) -> ToolOutcome {
        run(
            tool,
            &HiddenPaths::default(),
            &serde_json::json!({}),
            "k",
            &CancellationToken::new(),
        )
        .await
        .expect("the tool ran")
    }

    fn tool(command: &[&str], timeout: Duration) -> ToolSettings {
        ToolSettings {
            name: "t".into(),
            description: String::new(),
            command: command
                .iter()
                .map(std::string::ToString::to_string)
                .collect(),
            parameters: serde_json::json!({"type": "object"}),
            timeout,
            idempotent: false,
            background: false,
            dedupes: false,
            approval: false,
            // The runner itself; the sandbox has tests of its own, with the real binary.
            sandbox: crate::config::Sandboxing::Off,
        }
    }

    #[tokio::test]
    async fn a_timeout_is_recorded_as_such() {
        let hang = tool(&["/bin/sleep", "300"], Duration::from_millis(200));
        let outcome = run_alone(&hang).await;
        assert!(outcome.timed_out);
        assert_eq!(outcome.result(), "timeout");
        assert!(outcome.error.is_some_and(|e| e.contains("timeout")));
    }

    #[tokio::test]
    async fn arguments_arrive_on_stdin_and_status_is_recorded() {
        let cat = tool(
            &[
                "/bin/sh",
                "-c",
                "cat; echo \" $AGENTGATE_TOOL_CALL_ID\"; exit 3",
            ],
            Duration::from_secs(5),
        );
        let outcome = run(
            &cat,
            &HiddenPaths::default(),
            &serde_json::json!({"x": 1}),
            "turn.1",
            &CancellationToken::new(),
        )
        .await
        .expect("runs");
        assert_eq!(outcome.stdout, "{\"x\":1} turn.1\n");
        assert_eq!(outcome.exit_status, Some(3));
    }

    #[tokio::test]
    async fn output_is_capped_and_marked() {
        let flood = tool(
            &["/bin/sh", "-c", "head -c 10000000 /dev/zero | tr '\\0' a"],
            Duration::from_secs(20),
        );
        let outcome = run_alone(&flood).await;
        assert!(outcome.stdout_truncated);
        assert!(outcome.stdout.len() < OUTPUT_CAP + 100);
        assert!(outcome.stdout.ends_with("bytes]"));
        assert_eq!(outcome.exit_status, Some(0));
    }

    #[tokio::test]
    async fn a_missing_program_is_an_error_outcome() {
        let missing = tool(&["/nonexistent/tool"], Duration::from_secs(1));
        let outcome = run_alone(&missing).await;
        assert!(outcome.error.is_some_and(|e| e.contains("cannot start")));
    }
}
