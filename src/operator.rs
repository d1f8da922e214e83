//! What an operator can do to a session: the one list that the command line, the control
//! socket, the sessions and the metrics share (each names an action the same way), and who
//! the operator is.

/// What an operator can do to a session (`agentgate sessions resume|suspend|cancel`, and the
/// control socket's `POST /v1/sessions/{key}/{action}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OperatorAction {
    /// Clear the ledger entry and let the session run again, its interrupted event first.
    Resume,
    /// No further turn starts until it is resumed.
    Suspend,
    /// Stop the running turn: its tools are killed and its event ends `failed`.
    Cancel,
}

impl OperatorAction {
    pub(crate) const ALL: [OperatorAction; 3] = [
        OperatorAction::Resume,
        OperatorAction::Suspend,
        OperatorAction::Cancel,
    ];

    /// The name in commands, control paths, log lines and metric labels.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            OperatorAction::Resume => "resume",
            OperatorAction::Suspend => "suspend",
            OperatorAction::Cancel => "cancel",
        }
    }

    /// The reason a session's pending approval requests are denied with when this action is
    /// taken on it (docs/reference.md, "Approvals"); resuming denies nothing.
    pub(crate) const fn denial(self) -> Option<&'static str> {
        match self {
            OperatorAction::Resume => None,
            OperatorAction::Suspend => Some("session suspended by operator"),
            OperatorAction::Cancel => Some("session cancelled by operator"),
        }
    }

    pub(crate) fn from_name(name: &str) -> Option<OperatorAction> {
        OperatorAction::ALL
            .into_iter()
            .find(|action| action.name() == name)
    }
}

/// What an operator can do to rerun a session from one of its transcript entries (`agentgate
/// sessions rewind|fork`, `POST /v1/sessions/{key}/{rewind|fork}`): unlike the actions above,
/// each names an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rerun {
    /// Rerun the session itself from the entry; the entries from it on are superseded.
    Rewind,
    /// Rerun it in a new session that gets copies of the entries before it.
    Fork,
}

impl Rerun {
    pub(crate) const ALL: [Rerun; 2] = [Rerun::Rewind, Rerun::Fork];

    /// The name in commands, control paths, log lines and metric labels.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Rerun::Rewind => "rewind",
            Rerun::Fork => "fork",
        }
    }

    /// The metric label of a refused one.
    pub(crate) const fn refused(self) -> &'static str {
        match self {
            Rerun::Rewind => "rewind_refused",
            Rerun::Fork => "fork_refused",
        }
    }
}

/// The Unix user `uid` by name, else `uid N`: who took an operator's action, as recorded.
pub(crate) fn user_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(user)) => user.name,
        Ok(None) | Err(_) => format!("uid {uid}"),
    }
}
