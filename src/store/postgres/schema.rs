//! The PostgreSQL schema: versioned migrations, applied under an advisory lock so that nodes
//! starting together migrate once, and refused when the database is newer than this agentgate.

use super::PostgresStore;
use super::connect::Cached;
use crate::store::StoreError;
use crate::store::row::StoredRow;

/// Serializes migrations of concurrently starting nodes.
const MIGRATION_LOCK: i64 = 0x6167_656e_7467_7465;

/// Migration `i` brings the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    "
    CREATE FUNCTION agentgate_now_ms() RETURNS BIGINT LANGUAGE sql VOLATILE
        AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT $$;
    CREATE TABLE events (
        seq            BIGSERIAL PRIMARY KEY,
        id             TEXT NOT NULL UNIQUE,
        route          TEXT NOT NULL,
        session_key    TEXT NOT NULL,
        event_type     TEXT NOT NULL,
        delivery_id    TEXT,
        headers        TEXT NOT NULL,
        payload        BYTEA NOT NULL,
        received_at    BIGINT NOT NULL,
        status         TEXT NOT NULL,
        updated_at     BIGINT NOT NULL,
        resume_reason  TEXT,
        origin         TEXT NOT NULL DEFAULT 'webhook',
        node           TEXT
    );
    CREATE INDEX events_queued ON events (session_key, seq) WHERE status = 'queued';
    CREATE INDEX events_queued_in_order ON events (seq) WHERE status = 'queued';
    CREATE INDEX events_by_status ON events (status);
    CREATE TABLE dedup (
        route        TEXT NOT NULL,
        delivery_id  TEXT NOT NULL,
        event_id     TEXT NOT NULL,
        seen_at      BIGINT NOT NULL,
        PRIMARY KEY (route, delivery_id)
    );
    CREATE INDEX dedup_by_age ON dedup (seen_at);
    CREATE TABLE sessions (
        key               TEXT PRIMARY KEY,
        route             TEXT NOT NULL,
        state             TEXT NOT NULL,
        reason            TEXT,
        last_turn_id      TEXT,
        created_at        BIGINT NOT NULL,
        updated_at        BIGINT NOT NULL,
        lease_owner       TEXT,
        lease_expires_at  BIGINT
    );
    CREATE INDEX sessions_by_state ON sessions (state);
    CREATE INDEX sessions_by_lease ON sessions (lease_owner) WHERE lease_owner IS NOT NULL;
    CREATE TABLE turns (
        id           TEXT PRIMARY KEY,
        session_key  TEXT NOT NULL,
        event_id     TEXT NOT NULL,
        status       TEXT NOT NULL,
        reason       TEXT,
        steps        BIGINT NOT NULL DEFAULT 0,
        output       TEXT,
        error        TEXT,
        started_at   BIGINT NOT NULL,
        finished_at  BIGINT,
        node         TEXT NOT NULL
    );
    CREATE INDEX turns_by_session ON turns (session_key, started_at);
    CREATE INDEX turns_by_event ON turns (event_id);
    CREATE TABLE transcript (
        session_key  TEXT NOT NULL,
        seq          BIGINT NOT NULL,
        turn_id      TEXT NOT NULL,
        kind         TEXT NOT NULL,
        body         TEXT NOT NULL,
        created_at   BIGINT NOT NULL,
        PRIMARY KEY (session_key, seq)
    );
    CREATE INDEX transcript_by_turn ON transcript (turn_id);
    CREATE TABLE deliveries (
        event_id          TEXT PRIMARY KEY,
        route             TEXT NOT NULL,
        session_key       TEXT NOT NULL,
        body              TEXT NOT NULL,
        status            TEXT NOT NULL,
        attempts          BIGINT NOT NULL DEFAULT 0,
        next_attempt_at   BIGINT NOT NULL,
        last_error        TEXT,
        created_at        BIGINT NOT NULL,
        updated_at        BIGINT NOT NULL,
        lease_owner       TEXT,
        lease_expires_at  BIGINT
    );
    CREATE INDEX deliveries_due ON deliveries (next_attempt_at) WHERE status = 'pending';
    CREATE INDEX deliveries_by_status ON deliveries (status);
    CREATE TABLE resume_ledger (
        session_key   TEXT PRIMARY KEY,
        attempts      BIGINT NOT NULL,
        last_attempt  TEXT NOT NULL
    );
    CREATE TABLE nodes (
        id            TEXT PRIMARY KEY,
        name          TEXT NOT NULL,
        pid           BIGINT NOT NULL,
        started_at    BIGINT NOT NULL,
        heartbeat_at  BIGINT NOT NULL,
        stopped_at    BIGINT
    );",
    // 2: on_busy = "interrupt" across nodes: the owner of the running turn is asked through
    // its session row.
    "ALTER TABLE sessions ADD COLUMN interrupt_requested BOOLEAN NOT NULL DEFAULT false;",
    // 3: fair scheduling, as in the SQLite schema: `queue_head` is the seq of the session's
    // oldest queued event, kept in step by triggers; claims read idle sessions with a head from
    // one partial index. Concurrency: a claim locks its session rows before it takes their events
    // off the queue, so an accept that queues an event for the same session waits for the claim
    // to commit and then lowers the head from the committed row (`LEAST` is re-evaluated on the
    // newest row version), never from a stale recomputation.
    "ALTER TABLE sessions ADD COLUMN queue_head BIGINT;
    UPDATE sessions s SET queue_head =
        (SELECT min(seq) FROM events e WHERE e.status = 'queued' AND e.session_key = s.key);
    CREATE INDEX sessions_runnable ON sessions (queue_head)
        WHERE state = 'idle' AND queue_head IS NOT NULL;
    CREATE FUNCTION agentgate_queue_head() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_TABLE_NAME = 'sessions' THEN
            UPDATE sessions SET queue_head =
                (SELECT min(seq) FROM events WHERE status = 'queued' AND session_key = NEW.key)
            WHERE key = NEW.key;
        ELSIF TG_OP = 'INSERT' THEN
            IF NEW.status = 'queued' THEN
                UPDATE sessions SET queue_head = LEAST(queue_head, NEW.seq)
                WHERE key = NEW.session_key;
            END IF;
        ELSIF TG_OP = 'UPDATE' THEN
            IF (OLD.status = 'queued') <> (NEW.status = 'queued') THEN
                UPDATE sessions SET queue_head = (SELECT min(seq) FROM events
                    WHERE status = 'queued' AND session_key = NEW.session_key)
                WHERE key = NEW.session_key;
            END IF;
        ELSIF OLD.status = 'queued' THEN
            UPDATE sessions SET queue_head = (SELECT min(seq) FROM events
                WHERE status = 'queued' AND session_key = OLD.session_key)
            WHERE key = OLD.session_key;
        END IF;
        RETURN NULL;
    END $$;
    CREATE TRIGGER queue_head_of_new_session AFTER INSERT ON sessions
        FOR EACH ROW EXECUTE FUNCTION agentgate_queue_head();
    CREATE TRIGGER queue_head_of_events AFTER INSERT OR UPDATE OF status OR DELETE ON events
        FOR EACH ROW EXECUTE FUNCTION agentgate_queue_head();",
    // 4: `events replay` records what a copy replays.
    "ALTER TABLE events ADD COLUMN replay_of TEXT;",
    // 5: retention deletes old idle sessions by age.
    "CREATE INDEX sessions_by_age ON sessions (state, updated_at);",
    // 6: crash loops pin only what ran alone, and an event's replays are found from it, as in
    // the SQLite schema.
    "ALTER TABLE turns ADD COLUMN crashed_with BIGINT;
    ALTER TABLE events ADD COLUMN run_alone BOOLEAN NOT NULL DEFAULT false;
    CREATE INDEX events_to_run_alone ON events (seq) WHERE status = 'queued' AND run_alone;
    CREATE INDEX events_by_replay_of ON events (replay_of) WHERE replay_of IS NOT NULL;",
    // 7: what model replies spent, as in the SQLite schema.
    "ALTER TABLE turns ADD COLUMN input_tokens BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN cached_input_tokens BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN output_tokens BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN unknown_usage_steps BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN estimated_tokens BIGINT NOT NULL DEFAULT 0;
    CREATE INDEX turns_by_start ON turns (started_at);",
    // 8: approval requests, as in the SQLite schema.
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
        requested_at  BIGINT NOT NULL,
        expires_at    BIGINT NOT NULL,
        decided_at    BIGINT,
        decided_by    TEXT,
        note          TEXT,
        link_secret   TEXT NOT NULL
    );
    CREATE INDEX approvals_by_event ON approvals (event_id);
    CREATE INDEX approvals_pending ON approvals (expires_at) WHERE status = 'pending';
    CREATE INDEX approvals_pending_by_session ON approvals (session_key) WHERE status = 'pending';
    CREATE INDEX approvals_by_request ON approvals (requested_at);",
    // 9: each route's share of max_queued_events, as in the SQLite schema.
    "CREATE INDEX events_queued_by_route ON events (route) WHERE status = 'queued';",
    // 10: coalescing, as in the SQLite schema.
    "ALTER TABLE events ADD COLUMN joined_to TEXT;
    CREATE INDEX events_joined ON events (joined_to) WHERE joined_to IS NOT NULL;",
    // 11: traces, as in the SQLite schema.
    "ALTER TABLE events ADD COLUMN trace_parent TEXT;
    ALTER TABLE turns ADD COLUMN trace_span TEXT;",
    // 12: budget reservations, as in the SQLite schema; a node's expire unless its heartbeat
    // renews them, so a node that is gone holds none for longer than lease_ttl.
    "CREATE TABLE budget_reservations (
        turn_id        TEXT PRIMARY KEY,
        event_id       TEXT NOT NULL,
        session_key    TEXT NOT NULL,
        route          TEXT NOT NULL,
        made_at        BIGINT NOT NULL,
        input_tokens   BIGINT NOT NULL,
        output_tokens  BIGINT NOT NULL,
        node           TEXT NOT NULL,
        expires_at     BIGINT NOT NULL
    );
    CREATE INDEX budget_reservations_by_node ON budget_reservations (node);",
    // 13: no query of the accept or claim path can walk the queue, whatever the statistics say.
    // Two indexes of queued events go, which no query needs and which offered the planner such
    // walks: in seq order (claims take a session's head by its seq, kept in `sessions.queue_head`)
    // and by route (the queue's count by route reads the events either way, to see which are
    // visible; coalescing finds a session's queued events by session). And a session's next
    // head, asked as `min(seq)`, could be answered by walking the primary key in seq order until
    // a queued event of the session turns up: statistics that find one session holding much of
    // the queue make that walk look cheap, while it reads every older event of every session. So
    // the triggers ask for the first queued event by `seq + 0`, an order that only the index of
    // the session's queued events has (any other plan reads all of them, which is dearer).
    "DROP INDEX events_queued_in_order;
    DROP INDEX events_queued_by_route;
    DROP INDEX events_queued;
    CREATE INDEX events_queued ON events (session_key, (seq + 0)) WHERE status = 'queued';
    CREATE OR REPLACE FUNCTION agentgate_queue_head() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_TABLE_NAME = 'sessions' THEN
            UPDATE sessions SET queue_head =
                (SELECT seq + 0 FROM events WHERE status = 'queued' AND session_key = NEW.key
                 ORDER BY seq + 0 LIMIT 1)
            WHERE key = NEW.key;
        ELSIF TG_OP = 'INSERT' THEN
            IF NEW.status = 'queued' THEN
                UPDATE sessions SET queue_head = LEAST(queue_head, NEW.seq)
                WHERE key = NEW.session_key;
            END IF;
        ELSIF TG_OP = 'UPDATE' THEN
            IF (OLD.status = 'queued') <> (NEW.status = 'queued') THEN
                UPDATE sessions SET queue_head = (SELECT seq + 0 FROM events
                    WHERE status = 'queued' AND session_key = NEW.session_key
                    ORDER BY seq + 0 LIMIT 1)
                WHERE key = NEW.session_key;
            END IF;
        ELSIF OLD.status = 'queued' THEN
            UPDATE sessions SET queue_head = (SELECT seq + 0 FROM events
                WHERE status = 'queued' AND session_key = OLD.session_key
                ORDER BY seq + 0 LIMIT 1)
            WHERE key = OLD.session_key;
        END IF;
        RETURN NULL;
    END $$;",
    // 14: rewind and fork, as in the SQLite schema.
    "ALTER TABLE transcript ADD COLUMN superseded_by TEXT;
    ALTER TABLE events ADD COLUMN rewind_session TEXT;
    ALTER TABLE events ADD COLUMN rewind_entry BIGINT;
    ALTER TABLE events ADD COLUMN rewind_from TEXT;
    ALTER TABLE events ADD COLUMN rewind_turn TEXT;",
    // 15: the turns a session's history counts, as in the SQLite schema.
    "CREATE INDEX transcript_events ON transcript (session_key, seq)
        WHERE kind = 'event' AND superseded_by IS NULL;",
];

impl PostgresStore {
    pub(super) async fn migrate(&self) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        tx.run("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        tx.batch_execute("CREATE TABLE IF NOT EXISTS agentgate_schema (version INTEGER NOT NULL)")
            .await?;
        let found: i32 = tx
            .row(
                "SELECT COALESCE(max(version), 0) AS version FROM agentgate_schema",
                &[],
            )
            .await?
            .column("version")?;
        let current = MIGRATIONS.len() as i32;
        if found > current {
            return Err(StoreError::Setup(format!(
                "the database is at schema version {found}, newer than this agentgate ({current}); upgrade agentgate"
            )));
        }
        let done = usize::try_from(found).map_err(|_| {
            StoreError::Setup(format!(
                "the database says it is at schema version {found}, which no agentgate writes"
            ))
        })?;
        for (index, sql) in MIGRATIONS.iter().enumerate().skip(done) {
            let version = index as i32 + 1;
            tx.batch_execute(sql).await.map_err(|err| {
                StoreError::ServerUnavailable(format!(
                    "migration to schema version {version}: {err}"
                ))
            })?;
            tx.run(
                "INSERT INTO agentgate_schema (version) VALUES ($1)",
                &[&version],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
