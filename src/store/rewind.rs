//! `sessions rewind` and `sessions fork`, decided here once for both backends.
//!
//! docs/reference.md ("Rewind and fork"): a rewind runs a session again from transcript entry N,
//! an event entry (its turn runs again from the event) or an assistant message (the model is
//! asked again with the history before it). Entries N and after are marked superseded by the
//! new turn, never deleted, and the turns that read the transcript skip them. The new turn is
//! an ordinary queued event, a copy of the event whose turn recorded entry N, marked with what
//! it rewinds and with the id its first turn takes, so that a crash in it is resumed like any
//! other and its delivery says what it rewound. A fork does the same in a new session that gets
//! copies of the entries before N, leaving the original as it was.
//!
//! The backends only read and write: each implements [`RewindSteps`] inside one transaction
//! (SQLite: on the writer; PostgreSQL: with the session's row locked), so the checks and the
//! writes cannot be separated by a turn that starts in between.

use serde::{Deserialize, Serialize};

use super::StoreError;
use super::row::StoredRow;
use super::states::SessionState;
use super::tx::Param;

/// Where a rewound turn starts (the `rewind_from` column of its event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RewindFrom {
    /// From the event: the turn records the event again and runs as a new turn.
    Event,
    /// From a model reply: the turn continues the turn of entry N, whose entries before N stand,
    /// and asks the model again.
    Reply,
}

impl RewindFrom {
    pub(crate) const fn sql(self) -> &'static str {
        match self {
            RewindFrom::Event => "event",
            RewindFrom::Reply => "reply",
        }
    }

    pub(crate) fn from_sql(text: &str) -> Option<RewindFrom> {
        [RewindFrom::Event, RewindFrom::Reply]
            .into_iter()
            .find(|from| from.sql() == text)
    }
}

/// What a rewound (or forked) turn's result says it reran: the session and the entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RewindOf {
    pub session: String,
    pub entry: i64,
}

/// A rewind (`fork_as: None`) or a fork into `fork_as`.
#[derive(Debug, Clone)]
pub(crate) struct RewindRequest {
    pub session: String,
    pub entry: i64,
    pub fork_as: Option<String>,
}

/// A queued rewind: the new turn's id and its event's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Rewound {
    pub turn_id: String,
    pub event_id: String,
    /// The session the turn runs in (the new one, for a fork).
    pub session: String,
    /// How many entries the rewind superseded (none for a fork).
    pub superseded: u64,
}

/// Why a rewind or fork was refused; each says so in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RewindRefusal {
    #[error("no session {0:?}")]
    NoSession(String),
    #[error(
        "session {session:?} is {state}: a rewind waits until no turn of it runs or waits for approval"
    )]
    Busy {
        session: String,
        state: SessionState,
    },
    #[error("session {0:?} has queued events: rewind it once they have run")]
    Queued(String),
    #[error("session {session:?} has no transcript entry {entry}")]
    NoEntry { session: String, entry: i64 },
    #[error(
        "entry {entry} of session {session:?} is {what}: only an event entry or an assistant message can be rerun"
    )]
    NotRerunnable {
        session: String,
        entry: i64,
        what: String,
    },
    #[error("entry {entry} of session {session:?} was superseded by turn {turn_id}")]
    Superseded {
        session: String,
        entry: i64,
        turn_id: String,
    },
    #[error("the event of entry {entry} of session {session:?} is no longer stored")]
    EventGone { session: String, entry: i64 },
    #[error("session {0:?} exists already: a fork needs a new key")]
    Exists(String),
}

/// A session as a rewind checks it.
pub(super) struct SessionFacts {
    pub route: String,
    pub state: SessionState,
    /// Whether events of it are queued.
    pub queued: bool,
}

/// A transcript entry as a rewind checks it.
pub(super) struct EntryFacts {
    pub kind: String,
    pub body: String,
    pub superseded_by: Option<String>,
    /// The event of the turn that recorded it (gone once retention deleted it).
    pub event_id: Option<String>,
}

/// The new event of a rewind or fork: a copy of `original` in `session`.
pub(super) struct RewindEvent<'a> {
    pub original: &'a str,
    pub id: &'a str,
    pub session: &'a str,
    pub of: &'a RewindOf,
    /// Where its turn starts (`RewindFrom::sql`).
    pub from: &'static str,
    pub turn_id: &'a str,
}

impl RewindEvent<'_> {
    /// The parameters of `sql::REWIND_EVENT_SQL`, queued at `now`.
    pub(super) fn values<'v>(&'v self, now: &'v i64) -> [&'v (dyn Param + Sync); 8] {
        [
            &self.original,
            &self.id,
            now,
            &self.session,
            &self.of.session,
            &self.of.entry,
            &self.from,
            &self.turn_id,
        ]
    }
}

/// The reads and writes a rewind needs, all in one transaction.
pub(super) trait RewindSteps {
    /// The session (PostgreSQL: locked until the transaction ends), `None` if unknown.
    async fn session(&mut self, key: &str) -> Result<Option<SessionFacts>, StoreError>;
    /// Entry `n` of the session's transcript.
    async fn entry(&mut self, key: &str, n: i64) -> Result<Option<EntryFacts>, StoreError>;
    /// Creates the idle session `key` on `route`; `false` when it exists already.
    async fn create_session(&mut self, key: &str, route: &str) -> Result<bool, StoreError>;
    /// Copies the entries of `from` before `before` into `to`, with their numbers.
    async fn copy_entries(&mut self, from: &str, to: &str, before: i64) -> Result<(), StoreError>;
    /// Marks the entries from `from` on superseded by `turn_id` (those not superseded yet);
    /// returns how many.
    async fn supersede(&mut self, key: &str, from: i64, turn_id: &str) -> Result<u64, StoreError>;
    /// Queues the event of the rewound turn.
    async fn queue(&mut self, event: RewindEvent<'_>) -> Result<(), StoreError>;
}

/// Carries out `request` by the rule above, or says why not.
pub(super) async fn apply(
    steps: &mut impl RewindSteps,
    request: &RewindRequest,
) -> Result<Result<Rewound, RewindRefusal>, StoreError> {
    let key = request.session.as_str();
    let Some(session) = steps.session(key).await? else {
        return Ok(Err(RewindRefusal::NoSession(key.to_string())));
    };
    if request.fork_as.is_none() {
        match session.state {
            SessionState::Idle => {}
            SessionState::Running
            | SessionState::ResumePending
            | SessionState::Suspended
            | SessionState::AwaitingApproval => {
                return Ok(Err(RewindRefusal::Busy {
                    session: key.to_string(),
                    state: session.state,
                }));
            }
        }
        if session.queued {
            return Ok(Err(RewindRefusal::Queued(key.to_string())));
        }
    }
    let (from, original) = match rerunnable(steps, key, request.entry).await? {
        Ok(found) => found,
        Err(refusal) => return Ok(Err(refusal)),
    };
    let turn_id = uuid::Uuid::now_v7().to_string();
    let event_id = uuid::Uuid::now_v7().to_string();
    let (runs_in, superseded) = match &request.fork_as {
        Some(new_key) => {
            if !steps.create_session(new_key, &session.route).await? {
                return Ok(Err(RewindRefusal::Exists(new_key.clone())));
            }
            steps.copy_entries(key, new_key, request.entry).await?;
            (new_key.as_str(), 0)
        }
        None => (key, steps.supersede(key, request.entry, &turn_id).await?),
    };
    let of = RewindOf {
        session: key.to_string(),
        entry: request.entry,
    };
    steps
        .queue(RewindEvent {
            original: &original,
            id: &event_id,
            session: runs_in,
            of: &of,
            from: from.sql(),
            turn_id: &turn_id,
        })
        .await?;
    Ok(Ok(Rewound {
        turn_id,
        event_id,
        session: runs_in.to_string(),
        superseded,
    }))
}

/// Where a rerun from entry `n` starts, and the event it copies; why it cannot be rerun.
async fn rerunnable(
    steps: &mut impl RewindSteps,
    key: &str,
    n: i64,
) -> Result<Result<(RewindFrom, String), RewindRefusal>, StoreError> {
    let Some(entry) = steps.entry(key, n).await? else {
        return Ok(Err(RewindRefusal::NoEntry {
            session: key.to_string(),
            entry: n,
        }));
    };
    if let Some(turn_id) = entry.superseded_by {
        return Ok(Err(RewindRefusal::Superseded {
            session: key.to_string(),
            entry: n,
            turn_id,
        }));
    }
    let from = match what_entry_is(&entry) {
        Ok(from) => from,
        Err(what) => {
            return Ok(Err(RewindRefusal::NotRerunnable {
                session: key.to_string(),
                entry: n,
                what,
            }));
        }
    };
    Ok(match entry.event_id {
        Some(event_id) => Ok((from, event_id)),
        None => Err(RewindRefusal::EventGone {
            session: key.to_string(),
            entry: n,
        }),
    })
}

/// Where a rerun from `entry` starts, or what the entry is instead (for the refusal).
fn what_entry_is(entry: &EntryFacts) -> Result<RewindFrom, String> {
    #[derive(Deserialize)]
    struct Said {
        message: Spoken,
    }
    #[derive(Deserialize)]
    struct Spoken {
        role: String,
    }
    let role = serde_json::from_str::<Said>(&entry.body).map(|said| said.message.role);
    rerun_start(&entry.kind, role.as_deref().ok())
}

/// Where a rerun from an entry of `kind` starts (its message's `role`, when it is one), or what
/// the entry is instead: only an event entry or an assistant message can be rerun.
pub(crate) fn rerun_start(kind: &str, role: Option<&str>) -> Result<RewindFrom, String> {
    if kind == super::EVENT_ENTRY {
        return Ok(RewindFrom::Event);
    }
    if kind != "message" {
        return Err(format!("an entry of kind {kind}"));
    }
    match role {
        Some("assistant") => Ok(RewindFrom::Reply),
        Some("tool") => Err("a tool result".to_string()),
        Some(role) => Err(format!("a {role} message")),
        None => Err("not a message this agentgate reads".to_string()),
    }
}

impl SessionFacts {
    /// A row of `sql::REWIND_SESSION_SQL`.
    pub(super) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<SessionFacts, StoreError> {
        Ok(SessionFacts {
            route: row.column("route")?,
            state: row.column("state")?,
            queued: row.column("queued")?,
        })
    }
}

impl EntryFacts {
    /// A row of `sql::REWIND_ENTRY_SQL`.
    pub(super) fn decode<R: StoredRow + ?Sized>(row: &R) -> Result<EntryFacts, StoreError> {
        Ok(EntryFacts {
            kind: row.column("kind")?,
            body: row.column("body")?,
            superseded_by: row.column("superseded_by")?,
            event_id: row.column("event_id")?,
        })
    }
}
