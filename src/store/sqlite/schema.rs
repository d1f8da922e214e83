//! The SQLite schema and its migrations, versioned by `PRAGMA user_version`.
//!
//! Each migration is applied once, in order, inside one transaction together with the version
//! bump, so a crash mid-migration leaves the previous version intact.

use rusqlite::Connection;

/// Migration `i` brings the database from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 1: durable accept.
    "CREATE TABLE events (
        seq          INTEGER PRIMARY KEY,
        id           TEXT NOT NULL UNIQUE,
        route        TEXT NOT NULL,
        session_key  TEXT NOT NULL,
        event_type   TEXT NOT NULL,
        delivery_id  TEXT,
        headers      TEXT NOT NULL,
        payload      BLOB NOT NULL,
        received_at  INTEGER NOT NULL,
        status       TEXT NOT NULL,
        updated_at   INTEGER NOT NULL
    );
    CREATE INDEX events_by_status ON events(status, seq);
    CREATE INDEX events_by_session ON events(session_key, seq);
    CREATE TABLE dedup (
        route        TEXT NOT NULL,
        delivery_id  TEXT NOT NULL,
        event_id     TEXT NOT NULL,
        seen_at      INTEGER NOT NULL,
        PRIMARY KEY (route, delivery_id)
    ) WITHOUT ROWID;
    CREATE INDEX dedup_by_age ON dedup(seen_at);
    CREATE TABLE sessions (
        key          TEXT PRIMARY KEY,
        route        TEXT NOT NULL,
        state        TEXT NOT NULL,
        reason       TEXT,
        created_at   INTEGER NOT NULL,
        updated_at   INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 2: agent turns, their transcript, and the outbox.
    "CREATE TABLE turns (
        id           TEXT PRIMARY KEY,
        session_key  TEXT NOT NULL,
        event_id     TEXT NOT NULL,
        status       TEXT NOT NULL,
        reason       TEXT,
        steps        INTEGER NOT NULL DEFAULT 0,
        output       TEXT,
        error        TEXT,
        started_at   INTEGER NOT NULL,
        finished_at  INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX turns_by_session ON turns(session_key, started_at);
    CREATE INDEX turns_by_status ON turns(status);
    CREATE TABLE transcript (
        session_key  TEXT NOT NULL,
        seq          INTEGER NOT NULL,
        turn_id      TEXT NOT NULL,
        kind         TEXT NOT NULL,
        body         TEXT NOT NULL,
        created_at   INTEGER NOT NULL,
        PRIMARY KEY (session_key, seq)
    ) WITHOUT ROWID;
    CREATE TABLE deliveries (
        event_id         TEXT PRIMARY KEY,
        route            TEXT NOT NULL,
        session_key      TEXT NOT NULL,
        body             TEXT NOT NULL,
        status           TEXT NOT NULL,
        attempts         INTEGER NOT NULL DEFAULT 0,
        next_attempt_at  INTEGER NOT NULL,
        last_error       TEXT,
        created_at       INTEGER NOT NULL,
        updated_at       INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX deliveries_due ON deliveries(status, next_attempt_at);
    ALTER TABLE sessions ADD COLUMN last_turn_id TEXT;
    CREATE INDEX events_queued_by_session ON events(status, session_key, seq);",
    // 3: resumes re-queue the interrupted event itself, marked with why it was interrupted.
    "ALTER TABLE events ADD COLUMN resume_reason TEXT;",
    // 4: internal events (background job completions) are events too, but not accepted webhooks.
    "ALTER TABLE events ADD COLUMN origin TEXT NOT NULL DEFAULT 'webhook';",
    // 5: the live counts for STATUS= read indexes, never whole tables.
    "CREATE INDEX sessions_by_state ON sessions(state);",
    // 6: fair scheduling. Each session carries the seq of its oldest queued event (`queue_head`,
    // NULL when nothing is queued), kept in step by triggers on every write that queues an event,
    // takes one off the queue or deletes one. The scheduler reads the runnable sessions (idle,
    // with a head) oldest head first from one index, however many events wait behind sessions
    // that cannot run.
    "ALTER TABLE sessions ADD COLUMN queue_head INTEGER;
    UPDATE sessions SET queue_head =
        (SELECT min(seq) FROM events WHERE status = 'queued' AND session_key = sessions.key);
    CREATE INDEX sessions_runnable ON sessions(state, queue_head);
    CREATE TRIGGER queue_head_of_new_session AFTER INSERT ON sessions BEGIN
        UPDATE sessions SET queue_head =
            (SELECT min(seq) FROM events WHERE status = 'queued' AND session_key = NEW.key)
        WHERE key = NEW.key;
    END;
    CREATE TRIGGER queue_head_on_queued_event AFTER INSERT ON events WHEN NEW.status = 'queued'
    BEGIN
        UPDATE sessions SET queue_head = min(coalesce(queue_head, NEW.seq), NEW.seq)
        WHERE key = NEW.session_key;
    END;
    CREATE TRIGGER queue_head_on_status AFTER UPDATE OF status ON events
        WHEN (OLD.status = 'queued') <> (NEW.status = 'queued')
    BEGIN
        UPDATE sessions SET queue_head =
            (SELECT min(seq) FROM events WHERE status = 'queued' AND session_key = NEW.session_key)
        WHERE key = NEW.session_key;
    END;
    CREATE TRIGGER queue_head_on_deleted_event AFTER DELETE ON events WHEN OLD.status = 'queued'
    BEGIN
        UPDATE sessions SET queue_head =
            (SELECT min(seq) FROM events WHERE status = 'queued' AND session_key = OLD.session_key)
        WHERE key = OLD.session_key;
    END;",
    // 7: `events replay` records what a copy replays; `events show` finds an event's turns.
    "ALTER TABLE events ADD COLUMN replay_of TEXT;
    CREATE INDEX turns_by_event ON turns(event_id);",
    // 8: retention deletes an event's transcript steps by turn, and old idle sessions by age.
    "CREATE INDEX transcript_by_turn ON transcript(turn_id);
    CREATE INDEX sessions_by_age ON sessions(state, updated_at);",
    // 9: crash loops pin only what ran alone. A crashed turn records how many turns the crash
    // cut off (NULL for turns marked before: counted, as they were); a resume after a crash that
    // cut off several runs alone, found through a small partial index. An event's replays are
    // found from it (`events show`).
    "ALTER TABLE turns ADD COLUMN crashed_with INTEGER;
    ALTER TABLE events ADD COLUMN run_alone INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX events_to_run_alone ON events(seq) WHERE status = 'queued' AND run_alone = 1;
    CREATE INDEX events_by_replay_of ON events(replay_of) WHERE replay_of IS NOT NULL;",
    // 10: what model replies spent, committed with each step and summed on its turn (replies
    // without usage: counted, and estimated for token budgets); days and budgets sum turns by
    // when they started.
    "ALTER TABLE turns ADD COLUMN input_tokens INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN cached_input_tokens INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN output_tokens INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN unknown_usage_steps INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN estimated_tokens INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX turns_by_start ON turns(started_at);",
    // 11: approval requests: a tool call waiting for an operator's decision, with the decision.
    // Pending ones are found by session, by event and by when they expire.
    "CREATE TABLE approvals (
        id            TEXT PRIMARY KEY,
        event_id      TEXT NOT NULL,
        session_key   TEXT NOT NULL,
        route         TEXT NOT NULL,
        turn_id       TEXT NOT NULL,
        call_id       TEXT NOT NULL,
        tool          TEXT NOT NULL,
        arguments     TEXT NOT NULL,
        status        TEXT NOT NULL,
        requested_at  INTEGER NOT NULL,
        expires_at    INTEGER NOT NULL,
        decided_at    INTEGER,
        decided_by    TEXT,
        note          TEXT,
        link_secret   TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX approvals_by_event ON approvals(event_id);
    CREATE INDEX approvals_pending ON approvals(expires_at) WHERE status = 'pending';
    CREATE INDEX approvals_pending_by_session ON approvals(session_key) WHERE status = 'pending';
    CREATE INDEX approvals_by_request ON approvals(requested_at);",
    // 11: each route's share of max_queued_events counts its queued events once a second.
    "CREATE INDEX events_queued_by_route ON events(route) WHERE status = 'queued';",
    // 12: coalescing: an event that joined a queued event of its session (`joined`) is handled
    // by that event's turn and ends with it.
    "ALTER TABLE events ADD COLUMN joined_to TEXT;
    CREATE INDEX events_joined ON events(joined_to) WHERE joined_to IS NOT NULL;",
    // 13: traces: the request span's `traceparent`, the parent of the event's later spans, and
    // each turn's own span, which a resumed turn links to.
    "ALTER TABLE events ADD COLUMN trace_parent TEXT;
    ALTER TABLE turns ADD COLUMN trace_span TEXT;",
    // 14: budget reservations: what each model request in flight may spend, one row per turn
    // (docs/reference.md, "Budgets"). Only this process makes them: a start clears them.
    "CREATE TABLE budget_reservations (
        turn_id        TEXT PRIMARY KEY,
        event_id       TEXT NOT NULL,
        session_key    TEXT NOT NULL,
        route          TEXT NOT NULL,
        made_at        INTEGER NOT NULL,
        input_tokens   INTEGER NOT NULL,
        output_tokens  INTEGER NOT NULL,
        node           TEXT NOT NULL,
        expires_at     INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 15: an accept writes fewer index entries, and a claim or an end of a turn touches only
    // the indexes its change concerns. Queued events are found by session in a partial index
    // that holds only them (an event leaves it when it is claimed), finished ones for retention
    // in another (an event enters it when it ends); events by status (every event, moved on
    // every change of status) and sessions by state (which `sessions_runnable` and
    // `sessions_by_age` both lead with) go. A session is inserted with its queue head, so the
    // trigger that finds it runs only for a session inserted without one. The queue-head
    // triggers name their index: a session's queued events, never all its events.
    "DROP INDEX events_by_status;
    DROP INDEX sessions_by_state;
    DROP INDEX events_queued_by_session;
    CREATE INDEX events_queued_by_session ON events(session_key, seq) WHERE status = 'queued';
    CREATE INDEX events_finished ON events(seq)
        WHERE status IN ('completed', 'failed', 'abandoned');
    DROP TRIGGER queue_head_of_new_session;
    DROP TRIGGER queue_head_on_status;
    DROP TRIGGER queue_head_on_deleted_event;
    CREATE TRIGGER queue_head_of_new_session AFTER INSERT ON sessions
        WHEN NEW.queue_head IS NULL
    BEGIN
        UPDATE sessions SET queue_head =
            (SELECT min(seq) FROM events INDEXED BY events_queued_by_session
             WHERE status = 'queued' AND session_key = NEW.key)
        WHERE key = NEW.key;
    END;
    CREATE TRIGGER queue_head_on_status AFTER UPDATE OF status ON events
        WHEN (OLD.status = 'queued') <> (NEW.status = 'queued')
    BEGIN
        UPDATE sessions SET queue_head =
            (SELECT min(seq) FROM events INDEXED BY events_queued_by_session
             WHERE status = 'queued' AND session_key = NEW.session_key)
        WHERE key = NEW.session_key;
    END;
    CREATE TRIGGER queue_head_on_deleted_event AFTER DELETE ON events WHEN OLD.status = 'queued'
    BEGIN
        UPDATE sessions SET queue_head =
            (SELECT min(seq) FROM events INDEXED BY events_queued_by_session
             WHERE status = 'queued' AND session_key = OLD.session_key)
        WHERE key = OLD.session_key;
    END;",
    // 16: rewind and fork (docs/reference.md, "Rewind and fork"). A transcript entry that a
    // rewind superseded names the turn that did; the event a rewind or fork queued says which
    // session and entry it reruns, where its turn starts, and the id its first turn takes.
    "ALTER TABLE transcript ADD COLUMN superseded_by TEXT;
    ALTER TABLE events ADD COLUMN rewind_session TEXT;
    ALTER TABLE events ADD COLUMN rewind_entry INTEGER;
    ALTER TABLE events ADD COLUMN rewind_from TEXT;
    ALTER TABLE events ADD COLUMN rewind_turn TEXT;",
    // 17: a turn reads only the entries of the turns its history may show: the turns a
    // session's history counts (its event entries no rewind superseded) have an index of their
    // own (`store::sql::HISTORY_TURNS_SQL`).
    "CREATE INDEX transcript_events ON transcript(session_key, seq)
        WHERE kind = 'event' AND superseded_by IS NULL;",
];

/// The schema version this build writes.
pub(crate) const CURRENT_VERSION: i64 = MIGRATIONS.len() as i64;

/// The triggers the migrations create, by name. Any other trigger or view in a database was
/// planted (by whoever could write the state, the service's user included), and a connection
/// refuses such a database: an operator's command run as root would otherwise run it.
pub(crate) const TRIGGERS: &[&str] = &[
    "queue_head_of_new_session",
    "queue_head_on_queued_event",
    "queue_head_on_status",
    "queue_head_on_deleted_event",
];

#[derive(Debug, thiserror::Error)]
pub(crate) enum MigrationError {
    #[error(
        "the database is at schema version {found}, newer than this agentgate ({CURRENT_VERSION}); upgrade agentgate"
    )]
    TooNew { found: i64 },
    #[error("the database says it is at schema version {found}, which no agentgate writes")]
    Unknown { found: i64 },
    #[error("migration to schema version {version} failed: {source}")]
    Failed {
        version: i64,
        source: rusqlite::Error,
    },
}

pub(crate) fn migrate(connection: &mut Connection) -> Result<(), MigrationError> {
    let found: i64 = connection
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|source| MigrationError::Failed { version: 0, source })?;
    if found > CURRENT_VERSION {
        return Err(MigrationError::TooNew { found });
    }
    let Ok(done) = usize::try_from(found) else {
        return Err(MigrationError::Unknown { found });
    };
    if found == 0 {
        // Set while the database is still empty (the VACUUM makes it take effect on a file
        // already in WAL mode, and costs nothing here): retention's deletes then give pages back
        // to the file system (`PRAGMA incremental_vacuum`) instead of only reusing them.
        connection
            .execute_batch("PRAGMA auto_vacuum = INCREMENTAL; VACUUM;")
            .map_err(|source| MigrationError::Failed { version: 1, source })?;
    }
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(done) {
        let version = index as i64 + 1;
        let failed = |source| MigrationError::Failed { version, source };
        let tx = connection.transaction().map_err(failed)?;
        tx.execute_batch(sql).map_err(failed)?;
        tx.pragma_update(None, "user_version", version)
            .map_err(failed)?;
        tx.commit().map_err(failed)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database that says it is at a negative version is refused, not taken as migrated.
    #[test]
    fn a_negative_schema_version_is_refused() {
        let mut connection = Connection::open_in_memory().expect("memory");
        connection
            .execute_batch("PRAGMA user_version = -1")
            .expect("plant");
        assert!(matches!(
            migrate(&mut connection),
            Err(MigrationError::Unknown { found: -1 })
        ));
    }

    /// A migration that adds a trigger must name it in [`TRIGGERS`], or every connection would
    /// refuse the database as planted.
    #[test]
    fn the_migrations_create_exactly_the_listed_triggers() {
        let mut connection = Connection::open_in_memory().expect("memory");
        assert!(migrate(&mut connection).is_ok());
        let mut statement = connection
            .prepare("SELECT name FROM sqlite_master WHERE type = 'trigger' ORDER BY name")
            .expect("prepare");
        let created: Vec<String> = statement
            .query_map([], |row| row.get(0))
            .expect("query")
            .filter_map(Result::ok)
            .collect();
        let mut listed: Vec<String> = TRIGGERS.iter().map(|name| (*name).to_string()).collect();
        listed.sort();
        assert_eq!(created, listed);
        let views: i64 = connection
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'view'",
                [],
                |row| row.get(0),
            )
            .expect("views");
        assert_eq!(views, 0);
    }
}
