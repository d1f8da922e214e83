//! The accept and claim paths cost the same however deep the backlog: each statement's plan is
//! pinned here against a store holding 100,000 queued events, and each is run there and must
//! finish within a fixed number of SQLite VM steps (triggers included), which a walk over the
//! backlog would exceed a hundredfold.
//!
//! SQLite keeps no statistics here (nothing runs `ANALYZE`), so its plans follow from the
//! schema and the query text alone; where it would choose an index that walks the backlog, the
//! statement names its index (`INDEXED BY`) and its join order (`CROSS JOIN`).

use rusqlite::{Connection, StatementStatus, ToSql};

use super::accepting::{INSERT_EVENT_SQL, INSERT_SESSION_SQL, REMEMBER_DELIVERY_SQL};
use super::inspection::QUEUED_BY_ROUTE_SQL;
use super::turns::{
    ALONE_CANDIDATES_SQL, CANDIDATES_SQL, CLAIMED_EVENT_SQL, JOIN_QUEUED_SQL,
    PRIORITY_CANDIDATES_SQL, START_SESSION_SQL, START_TURN_SQL, STILL_FIRST_SQL,
};
use super::{SqliteStore, statement};
use crate::store::sql::{
    FINISH_EVENT_SQL, FINISH_JOINED_SQL, JOINED_EVENTS_SQL, LIVE_COUNTS_SQL, ORIGINAL_SQL,
    PRUNABLE_EVENTS_SQL, PRUNE_BATCH, RELEASE_SQL, START_EVENT_SQL,
};

/// Queued events in the backlog.
const BACKLOG: i64 = 100_000;

/// The backlog, written in one transaction (about a second), every event with a delivery id:
/// the session `deep`, running, with 20,000 completed events and 50,000 queued behind them on
/// route `other`, and 50,000 sessions `solo-N` with one queued event each on route `hooks`.
const BACKLOG_SQL: &str = "
BEGIN;
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 120000)
INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                    received_at, status, updated_at)
SELECT 'e' || i, CASE WHEN i <= 20000 OR i % 2 = 0 THEN 'other' ELSE 'hooks' END,
       CASE WHEN i <= 20000 OR i % 2 = 0 THEN 'deep' ELSE 'solo-' || i END,
       'push', 'd' || i, '{}', x'7b7d', i,
       CASE WHEN i <= 20000 THEN 'completed' ELSE 'queued' END, i
FROM n;
INSERT INTO dedup (route, delivery_id, event_id, seen_at)
SELECT route, delivery_id, id, seq FROM events;
INSERT INTO sessions (key, route, state, created_at, updated_at)
SELECT DISTINCT session_key, route, CASE session_key WHEN 'deep' THEN 'running' ELSE 'idle' END,
       0, 0
FROM events;
COMMIT;";

/// A store at the current schema holding the backlog, and a connection to it.
fn deep_backlog() -> (tempfile::TempDir, Connection) {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(SqliteStore::open(dir.path()).expect("open"));
    let connection = Connection::open(dir.path().join("agentgate.db")).expect("connect");
    connection.execute_batch(BACKLOG_SQL).expect("backlog");
    let queued: i64 = connection
        .query_row(
            "SELECT count(*) FROM events WHERE status = 'queued'",
            [],
            |row| row.get(0),
        )
        .expect("count");
    assert_eq!(queued, BACKLOG);
    (dir, connection)
}

/// `EXPLAIN QUERY PLAN` of `sql`, one line per step, indented by depth.
fn plan(connection: &Connection, sql: &str) -> Vec<String> {
    let mut explain = connection
        .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
        .unwrap_or_else(|err| panic!("{err}: {sql}"));
    let mut rows = explain.raw_query();
    let mut steps: Vec<(i64, i64, String)> = Vec::new();
    while let Some(row) = rows.next().expect("plan") {
        steps.push((
            row.get(0).expect("id"),
            row.get(1).expect("parent"),
            row.get(3).expect("detail"),
        ));
    }
    let depth = |mut parent: i64| {
        let mut depth = 0;
        while let Some(step) = steps.iter().find(|(id, _, _)| *id == parent) {
            parent = step.1;
            depth += 1;
        }
        depth
    };
    steps
        .iter()
        .map(|(_, parent, detail)| format!("{}{detail}", "  ".repeat(depth(*parent))))
        .collect()
}

/// Runs `sql` with `values` (in a savepoint that is rolled back) and returns its VM steps.
fn vm_steps(connection: &Connection, sql: &str, values: &[&dyn ToSql]) -> i32 {
    connection
        .execute_batch("SAVEPOINT probe")
        .expect("savepoint");
    let mut run = statement(connection, sql, values).unwrap_or_else(|err| panic!("{err}: {sql}"));
    {
        let mut rows = run.raw_query();
        while rows.next().expect("step").is_some() {}
    }
    let steps = run.get_status(StatementStatus::VmStep);
    drop(run);
    connection
        .execute_batch("ROLLBACK TO probe; RELEASE probe")
        .expect("rollback");
    steps
}

/// The most VM steps one statement of these paths takes: a few index lookups and row writes
/// (the heaviest, an event insert with its indexes and trigger, takes about 150). A walk over
/// the backlog takes at least one step per queued event.
const MOST_STEPS: i32 = 1_000;

/// Whether a candidate is still first: the session's queued events before it, from their own
/// index, however long the session's history.
const STILL_FIRST_PLAN: &[&str] = &[
    "SCAN CONSTANT ROW",
    "SCALAR SUBQUERY 1",
    "  SEARCH events USING COVERING INDEX events_queued_by_session (session_key=? AND seq<?)",
    "SCALAR SUBQUERY 2",
    "  SEARCH events USING INDEX sqlite_autoindex_events_1 (id=?)",
    "SCALAR SUBQUERY 3",
    "  SEARCH sessions USING PRIMARY KEY (key=?)",
];

/// A statement of the hot paths, the plan it must keep, and parameters to run it with.
struct Pinned {
    name: &'static str,
    sql: &'static str,
    plan: &'static [&'static str],
}

fn check(connection: &Connection, pinned: &Pinned, values: &[&dyn ToSql], bounded: bool) {
    assert_eq!(
        plan(connection, pinned.sql),
        pinned.plan,
        "{}: the plan changed",
        pinned.name
    );
    let steps = vm_steps(connection, pinned.sql, values);
    eprintln!("{}: {steps} VM steps", pinned.name);
    if bounded {
        assert!(
            steps < MOST_STEPS,
            "{}: {steps} VM steps with {BACKLOG} events queued",
            pinned.name
        );
    }
}

/// The values the pinned statements are asked with, over [`deep_backlog`]'s store.
struct Values {
    priorities: &'static str,
    id: &'static str,
    route: &'static str,
    session: &'static str,
    now: i64,
    since: i64,
    limit: i64,
    step: i64,
    /// The oldest queued event of a session of its own, and of the session with a long history.
    solo_seq: i64,
    deep_seq: i64,
    head: (&'static str, &'static str, &'static str),
}

const VALUES: Values = Values {
    priorities: r#"{"other":10}"#,
    id: "new",
    route: "hooks",
    session: "solo-new",
    now: 200_000,
    since: 0,
    limit: 16,
    step: 60_000,
    solo_seq: 20_001,
    deep_seq: 20_002,
    head: ("e20001", "solo-20001", "hooks"),
};

#[test]
fn the_accept_and_claim_paths_cost_the_same_over_a_deep_backlog() {
    let (_dir, db) = deep_backlog();
    the_accept_path(&db, &VALUES);
    the_claim_path(&db, &VALUES);
    the_start_of_a_turn(&db, &VALUES);
    the_end_of_a_turn(&db, &VALUES);
    the_counts_and_retention(&db, &VALUES);
}

/// A redelivery's lookup and an event's insert.
fn the_accept_path(db: &Connection, v: &Values) {
    let accept: [(Pinned, Vec<&dyn ToSql>); 4] = [
        (
            Pinned {
                name: "a redelivery's original",
                sql: ORIGINAL_SQL,
                plan: &["SEARCH dedup USING PRIMARY KEY (route=? AND delivery_id=?)"],
            },
            vec![&v.route, &"d1", &v.since],
        ),
        (
            Pinned {
                name: "remember a delivery id",
                sql: REMEMBER_DELIVERY_SQL,
                plan: &[],
            },
            vec![&v.route, &"d-new", &v.id, &v.now],
        ),
        (
            Pinned {
                name: "insert an event",
                sql: INSERT_EVENT_SQL,
                plan: &[],
            },
            vec![
                &v.id,
                &v.route,
                &v.session,
                &"push",
                &"d-new",
                &"{}",
                &"{}",
                &v.now,
                &None::<String>,
            ],
        ),
        (
            Pinned {
                name: "insert its session",
                sql: INSERT_SESSION_SQL,
                plan: &[],
            },
            vec![&v.session, &v.route, &v.now, &v.now],
        ),
    ];
    for (pinned, values) in &accept {
        check(db, pinned, values, true);
    }
}

/// What the scheduler asks to pick the next turns, bounded however deep the backlog.
fn the_claim_path(db: &Connection, v: &Values) {
    let claim: [(Pinned, Vec<&dyn ToSql>, bool); 5] = [
        (
            Pinned {
                name: "what must run alone",
                sql: ALONE_CANDIDATES_SQL,
                plan: &[
                    "SCAN e USING INDEX events_to_run_alone",
                    "SEARCH s USING COVERING INDEX sessions_runnable (state=? AND queue_head=? AND key=?)",
                ],
            },
            vec![&v.limit],
            true,
        ),
        (
            Pinned {
                name: "the runnable heads",
                sql: CANDIDATES_SQL,
                plan: &[
                    "SEARCH s USING COVERING INDEX sessions_runnable (state=? AND queue_head>?)",
                    "SEARCH e USING INTEGER PRIMARY KEY (rowid=?)",
                ],
            },
            vec![&v.limit],
            true,
        ),
        (
            Pinned {
                name: "the runnable heads by priority",
                sql: PRIORITY_CANDIDATES_SQL,
                plan: &[
                    "SEARCH s USING COVERING INDEX sessions_runnable (state=? AND queue_head>?)",
                    "SEARCH e USING INTEGER PRIMARY KEY (rowid=?)",
                    "USE TEMP B-TREE FOR ORDER BY",
                ],
            },
            vec![&v.limit, &v.priorities, &v.step],
            false,
        ),
        (
            Pinned {
                name: "still first",
                sql: STILL_FIRST_SQL,
                plan: STILL_FIRST_PLAN,
            },
            vec![&v.head.1, &v.solo_seq, &v.head.0],
            true,
        ),
        (
            Pinned {
                name: "still first, after a long history",
                sql: STILL_FIRST_SQL,
                plan: STILL_FIRST_PLAN,
            },
            vec![&"deep", &v.deep_seq, &"e20002"],
            true,
        ),
    ];
    for (pinned, values, bounded) in &claim {
        check(db, pinned, values, *bounded);
    }
}

/// What starting a claimed turn asks: its event, the turn and session rows, and the events that
/// join it.
fn the_start_of_a_turn(db: &Connection, v: &Values) {
    let start: [(Pinned, Vec<&dyn ToSql>, bool); 7] = [
        (
            Pinned {
                name: "the claimed event",
                sql: CLAIMED_EVENT_SQL,
                plan: &["SEARCH events USING INDEX sqlite_autoindex_events_1 (id=?)"],
            },
            vec![&v.head.0],
            true,
        ),
        (
            Pinned {
                name: "start the event",
                sql: START_EVENT_SQL,
                plan: &["SEARCH events USING INDEX sqlite_autoindex_events_1 (id=?)"],
            },
            vec![&v.head.0, &v.now],
            true,
        ),
        (
            Pinned {
                name: "start the event of a long history",
                sql: START_EVENT_SQL,
                plan: &["SEARCH events USING INDEX sqlite_autoindex_events_1 (id=?)"],
            },
            vec![&"e20002", &v.now],
            true,
        ),
        (
            Pinned {
                name: "start the turn",
                sql: START_TURN_SQL,
                plan: &[],
            },
            vec![&"t-new", &v.head.1, &v.head.0, &v.now],
            true,
        ),
        (
            Pinned {
                name: "start the session",
                sql: START_SESSION_SQL,
                plan: &["SEARCH sessions USING PRIMARY KEY (key=?)"],
            },
            vec![&v.head.1, &"t-new", &v.now],
            true,
        ),
        (
            Pinned {
                name: "coalesce into the head",
                sql: JOIN_QUEUED_SQL,
                plan: &[
                    "SEARCH events USING INDEX events_queued_by_session (session_key=?)",
                    "SCALAR SUBQUERY 1",
                    "  SEARCH h USING INDEX sqlite_autoindex_events_1 (id=?)",
                ],
            },
            vec![&v.head.0, &v.head.1, &v.head.2, &v.now, &v.step],
            true,
        ),
        (
            Pinned {
                name: "the joined events",
                sql: JOINED_EVENTS_SQL,
                plan: &["SEARCH events USING INDEX events_joined (joined_to=?)"],
            },
            vec![&v.head.0],
            true,
        ),
    ];
    for (pinned, values, bounded) in &start {
        check(db, pinned, values, *bounded);
    }
}

/// A turn's end: its reservation, its event and the events that joined it.
fn the_end_of_a_turn(db: &Connection, v: &Values) {
    let end: [(Pinned, Vec<&dyn ToSql>); 3] = [
        (
            Pinned {
                name: "release the turn's budget reservation",
                sql: RELEASE_SQL,
                plan: &["SEARCH budget_reservations USING PRIMARY KEY (turn_id=?)"],
            },
            vec![&"t-new"],
        ),
        (
            Pinned {
                name: "end the event",
                sql: FINISH_EVENT_SQL,
                plan: &["SEARCH events USING INDEX sqlite_autoindex_events_1 (id=?)"],
            },
            vec![&v.head.0, &"completed", &v.now],
        ),
        (
            Pinned {
                name: "end the joined events",
                sql: FINISH_JOINED_SQL,
                plan: &["SEARCH events USING COVERING INDEX events_joined (joined_to=?)"],
            },
            vec![&v.head.0, &"completed", &v.now],
        ),
    ];
    for (pinned, values) in &end {
        check(db, pinned, values, true);
    }
}

/// The periodic counts, and retention.
fn the_counts_and_retention(db: &Connection, v: &Values) {
    // Counted once a second and every few seconds: in covering indexes, never an event's row.
    let counts = [
        Pinned {
            name: "queued by route",
            sql: QUEUED_BY_ROUTE_SQL,
            plan: &["SCAN events USING COVERING INDEX events_queued_by_route"],
        },
        Pinned {
            name: "the live counts",
            sql: LIVE_COUNTS_SQL,
            plan: &[
                "SCAN CONSTANT ROW",
                "SCALAR SUBQUERY 1",
                // Either partial index of queued events holds them all and nothing else.
                "  SCAN events USING COVERING INDEX events_queued_by_session",
                "SCALAR SUBQUERY 2",
                "  SEARCH sessions USING COVERING INDEX sessions_by_age (state=?)",
                "SCALAR SUBQUERY 3",
                "  SEARCH sessions USING COVERING INDEX sessions_by_age (state=?)",
                "SCALAR SUBQUERY 4",
                "  SCAN approvals USING COVERING INDEX approvals_pending",
            ],
        },
    ];
    for pinned in &counts {
        check(db, pinned, &[], false);
    }
    // Retention reads finished events only, oldest first, however many are queued.
    let prunable = Pinned {
        name: "finished events to prune",
        sql: PRUNABLE_EVENTS_SQL,
        plan: &[
            "SCAN e USING INDEX events_finished",
            "CORRELATED SCALAR SUBQUERY 1",
            "  SEARCH d USING PRIMARY KEY (event_id=?)",
        ],
    };
    check(db, &prunable, &[&v.now, &PRUNE_BATCH], true);
}
