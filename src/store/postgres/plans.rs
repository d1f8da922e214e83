//! The accept and claim paths on PostgreSQL keep their plans over a deep backlog: each
//! statement's `EXPLAIN` is pinned here against a database holding 100,000 queued events, both
//! as the events arrived (no statistics yet: autovacuum is off for the test's tables) and after
//! `ANALYZE`. A plan that walks the backlog (a sequential scan, an index read for its order
//! over every queued event) would read every row the backlog holds.
//!
//! PostgreSQL takes no hints, so each statement is written in a shape whose only cheap plan is
//! the intended one (see the statements' own comments). The queue's counts (by route, once a
//! second, and for `STATUS=`) are not pinned: they read every queued event by nature, from the
//! table or an index as the planner finds cheaper.

use tokio_postgres::types::ToSql;

use super::PostgresStore;
use super::accepting::{
    FIRST_ACCEPTED_SQL, INSERT_EVENTS_SQL, INSERT_SESSIONS_SQL, REMEMBER_DELIVERY_SQL,
};
use super::connect::Cached;
use super::turns::{
    ALONE_SESSIONS_SQL, ALONE_WAITING_SQL, HEAD_EVENT_SQL, JOIN_QUEUED_SQL, PRIORITY_SESSIONS_SQL,
    RUNNABLE_SESSIONS_SQL, START_SESSION_SQL, START_TURN_SQL,
};
use crate::config::PostgresSettings;
use crate::secret::Secret;
use crate::store::Coordination;
use crate::store::contract::postgres_server::Postgres;
use crate::store::sql::START_EVENT_SQL;

/// The backlog of the SQLite plan test (`sqlite/plans.rs`), written in one transaction: the
/// running session `deep` with 20,000 completed events and 50,000 queued behind them, and
/// 50,000 sessions with one queued event each.
const BACKLOG_SQL: &str = "
ALTER TABLE events SET (autovacuum_enabled = false);
ALTER TABLE sessions SET (autovacuum_enabled = false);
ALTER TABLE dedup SET (autovacuum_enabled = false);
BEGIN;
INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                    received_at, status, updated_at, node)
SELECT 'e' || i, CASE WHEN i <= 20000 OR i % 2 = 0 THEN 'other' ELSE 'hooks' END,
       CASE WHEN i <= 20000 OR i % 2 = 0 THEN 'deep' ELSE 'solo-' || i END,
       'push', 'd' || i, '{}', '\\x7b7d'::bytea, i,
       CASE WHEN i <= 20000 THEN 'completed' ELSE 'queued' END, i, 'plans'
FROM generate_series(1, 120000) AS i;
INSERT INTO dedup (route, delivery_id, event_id, seen_at)
SELECT route, delivery_id, id, seq FROM events;
INSERT INTO sessions (key, route, state, created_at, updated_at)
SELECT DISTINCT session_key, route,
       CASE session_key WHEN 'deep' THEN 'running' ELSE 'idle' END, 0, 0
FROM events;
COMMIT;";

/// The query of the queue-head trigger (`agentgate_queue_head`, schema version 13) when an
/// event leaves or is deleted from the queue: `$1` its session.
const NEXT_HEAD_SQL: &str = "SELECT seq + 0 FROM events WHERE status = 'queued' AND session_key = $1 ORDER BY seq + 0 LIMIT 1";

/// `EXPLAIN (COSTS OFF)` of `sql` with `params`, one line per plan line.
async fn plan(store: &PostgresStore, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<String> {
    let client = store.client().await.expect("client");
    client
        .rows(&format!("EXPLAIN (COSTS OFF) {sql}"), params)
        .await
        .unwrap_or_else(|err| panic!("{err}: {sql}"))
        .iter()
        .map(|row| row.get::<_, String>(0))
        .collect()
}

/// The plan a statement must keep.
enum Plan {
    /// With statistics or without.
    Same(&'static [&'static str]),
    /// One plan without statistics, another after `ANALYZE` (each of them bounded).
    ByStatistics {
        none: &'static [&'static str],
        analyzed: &'static [&'static str],
    },
    /// Without statistics, either of two plans that read the same rows: PostgreSQL's default
    /// estimates put them too close to call, and it was seen taking each. One after `ANALYZE`.
    EitherWithout {
        none: [&'static [&'static str]; 2],
        analyzed: &'static [&'static str],
    },
}

impl Plan {
    /// The plans the statement may take.
    fn expected(&self, analyzed: bool) -> Vec<&'static [&'static str]> {
        match (self, analyzed) {
            (Plan::Same(plan), _) => vec![plan],
            (Plan::ByStatistics { none, .. }, false) => vec![none],
            (Plan::EitherWithout { none, .. }, false) => none.to_vec(),
            (Plan::ByStatistics { analyzed, .. } | Plan::EitherWithout { analyzed, .. }, true) => {
                vec![analyzed]
            }
        }
    }
}

/// A statement of the hot paths, the plan it must keep, and parameters to explain it with.
struct Pinned<'a> {
    name: &'static str,
    sql: &'static str,
    params: Vec<&'a (dyn ToSql + Sync)>,
    plan: Plan,
}

/// The values the pinned statements are asked with, over the 100,000-event backlog.
struct Values {
    limit: i64,
    one: i64,
    step: i64,
    now: i64,
    priorities: &'static str,
    ids: Vec<&'static str>,
    routes: Vec<&'static str>,
    keys: Vec<&'static str>,
    texts: Vec<&'static str>,
    delivery_ids: Vec<Option<&'static str>>,
    parents: Vec<Option<&'static str>>,
    payloads: Vec<&'static [u8]>,
    node: &'static str,
    head: (&'static str, &'static str, &'static str),
    deep_head: i64,
}

impl Values {
    fn new() -> Self {
        Values {
            limit: 16,
            one: 1,
            step: 60_000,
            now: 200_000,
            priorities: r#"{"other":10}"#,
            ids: vec!["new"],
            routes: vec!["hooks"],
            keys: vec!["solo-new"],
            texts: vec!["push"],
            delivery_ids: vec![None],
            parents: vec![None],
            payloads: vec![b"{}"],
            node: "plans",
            head: ("e20001", "solo-20001", "hooks"),
            deep_head: 20_002,
        }
    }
}

/// The accept path: a delivery id remembered, the events and their sessions inserted.
fn accept_statements(v: &Values) -> Vec<Pinned<'_>> {
    vec![
        Pinned {
            name: "remember a delivery id",
            sql: REMEMBER_DELIVERY_SQL,
            params: vec![&v.routes[0], &"d-new", &v.ids[0], &v.now, &v.now],
            plan: Plan::Same(&[
                "Insert on dedup",
                "  Conflict Resolution: UPDATE",
                "  Conflict Arbiter Indexes: dedup_pkey",
                "  Conflict Filter: (dedup.seen_at < '200000'::bigint)",
                "  ->  Result",
            ]),
        },
        Pinned {
            name: "the first accepted",
            sql: FIRST_ACCEPTED_SQL,
            params: vec![&v.routes[0], &"d1"],
            plan: Plan::Same(&[
                "Index Scan using dedup_pkey on dedup",
                "  Index Cond: ((route = 'hooks'::text) AND (delivery_id = 'd1'::text))",
            ]),
        },
        Pinned {
            name: "insert the events",
            sql: INSERT_EVENTS_SQL,
            params: vec![
                &v.ids,
                &v.routes,
                &v.keys,
                &v.texts,
                &v.delivery_ids,
                &v.texts,
                &v.payloads,
                &v.now,
                &v.node,
                &v.parents,
            ],
            plan: Plan::Same(&[
                "Insert on events",
                "  ->  Subquery Scan on \"*SELECT*\"",
                "        ->  Function Scan on e",
            ]),
        },
        Pinned {
            name: "insert their sessions",
            sql: INSERT_SESSIONS_SQL,
            params: vec![&v.keys, &v.routes, &v.now],
            plan: Plan::Same(&[
                "Insert on sessions",
                "  Conflict Resolution: NOTHING",
                "  Conflict Arbiter Indexes: sessions_pkey",
                "  ->  Subquery Scan on \"*SELECT*\"",
                "        ->  Unique",
                "              ->  Sort",
                "                    Sort Key: s.key",
                "                    ->  Function Scan on s",
            ]),
        },
    ]
}

/// What the scheduler asks to pick the next turns.
fn claim_statements(v: &Values) -> Vec<Pinned<'_>> {
    vec![
        Pinned {
            name: "what must run alone",
            sql: ALONE_SESSIONS_SQL,
            params: vec![&v.one],
            plan: Plan::ByStatistics {
                none: &[
                    "Limit",
                    "  InitPlan 1 (returns $0)",
                    "    ->  Bitmap Heap Scan on events e",
                    "          Recheck Cond: ((status = 'queued'::text) AND run_alone)",
                    "          ->  Bitmap Index Scan on events_to_run_alone",
                    "  ->  LockRows",
                    "        ->  Index Scan using sessions_runnable on sessions s",
                    "              Index Cond: (queue_head = ANY ($0))",
                    "              Filter: (state = 'idle'::text)",
                ],
                analyzed: &[
                    "Limit",
                    "  InitPlan 1 (returns $0)",
                    "    ->  Index Only Scan using events_to_run_alone on events e",
                    "  ->  LockRows",
                    "        ->  Index Scan using sessions_runnable on sessions s",
                    "              Index Cond: (queue_head = ANY ($0))",
                    "              Filter: (state = 'idle'::text)",
                ],
            },
        },
        Pinned {
            name: "whether anything must run alone",
            sql: ALONE_WAITING_SQL,
            params: vec![],
            plan: Plan::ByStatistics {
                none: &[
                    "Result",
                    "  InitPlan 2 (returns $1)",
                    "    ->  Index Only Scan using sessions_runnable on sessions s",
                    "          Index Cond: (queue_head = ANY ($0))",
                    "          InitPlan 1 (returns $0)",
                    "            ->  Bitmap Heap Scan on events e",
                    "                  Recheck Cond: ((status = 'queued'::text) AND run_alone)",
                    "                  ->  Bitmap Index Scan on events_to_run_alone",
                ],
                analyzed: &[
                    "Result",
                    "  InitPlan 2 (returns $1)",
                    "    ->  Index Only Scan using sessions_runnable on sessions s",
                    "          Index Cond: (queue_head = ANY ($0))",
                    "          InitPlan 1 (returns $0)",
                    "            ->  Index Only Scan using events_to_run_alone on events e",
                ],
            },
        },
        Pinned {
            name: "the runnable sessions",
            sql: RUNNABLE_SESSIONS_SQL,
            params: vec![&v.limit],
            plan: Plan::Same(&[
                "Limit",
                "  ->  LockRows",
                "        ->  Index Scan using sessions_runnable on sessions s",
                "              Index Cond: (queue_head IS NOT NULL)",
                "              Filter: (state = 'idle'::text)",
            ]),
        },
        priority_claim(v),
        Pinned {
            name: "a session's head",
            sql: HEAD_EVENT_SQL,
            params: vec![&v.deep_head],
            plan: Plan::Same(&[
                "Index Scan using events_pkey on events",
                "  Index Cond: (seq = '20002'::bigint)",
                "  Filter: (status = 'queued'::text)",
            ]),
        },
        Pinned {
            name: "the next head of a session (its queue-head trigger's query)",
            sql: NEXT_HEAD_SQL,
            params: vec![&"deep"],
            plan: Plan::Same(&[
                "Limit",
                "  ->  Index Scan using events_queued on events",
                "        Index Cond: (session_key = 'deep'::text)",
            ]),
        },
        Pinned {
            name: "the next head of a session of its own",
            sql: NEXT_HEAD_SQL,
            params: vec![&v.head.1],
            plan: Plan::Same(&[
                "Limit",
                "  ->  Index Scan using events_queued on events",
                "        Index Cond: (session_key = 'solo-20001'::text)",
            ]),
        },
    ]
}

/// The runnable sessions by priority: the claim when some route has a priority.
fn priority_claim(v: &Values) -> Pinned<'_> {
    Pinned {
        name: "the runnable sessions by priority",
        sql: PRIORITY_SESSIONS_SQL,
        params: vec![&v.limit, &v.priorities, &v.step],
        // Without statistics, the idle sessions from the partial index of the runnable ones,
        // or from the retention's index by state: both read the idle sessions only, never
        // the queued events (CI saw the second once in several runs).
        plan: Plan::EitherWithout {
            none: [
                &[
                    "Limit",
                    "  ->  LockRows",
                    "        ->  Sort",
                    "              Sort Key: ((SubPlan 1)), s.queue_head",
                    "              ->  Bitmap Heap Scan on sessions s",
                    "                    Recheck Cond: ((queue_head IS NOT NULL) AND (state = 'idle'::text))",
                    "                    ->  Bitmap Index Scan on sessions_runnable",
                    "                          Index Cond: (queue_head IS NOT NULL)",
                    "                    SubPlan 1",
                    "                      ->  Index Scan using events_pkey on events e",
                    "                            Index Cond: (seq = s.queue_head)",
                ],
                &[
                    "Limit",
                    "  ->  LockRows",
                    "        ->  Sort",
                    "              Sort Key: ((SubPlan 1)), s.queue_head",
                    "              ->  Bitmap Heap Scan on sessions s",
                    "                    Recheck Cond: (state = 'idle'::text)",
                    "                    Filter: (queue_head IS NOT NULL)",
                    "                    ->  Bitmap Index Scan on sessions_by_age",
                    "                          Index Cond: (state = 'idle'::text)",
                    "                    SubPlan 1",
                    "                      ->  Index Scan using events_pkey on events e",
                    "                            Index Cond: (seq = s.queue_head)",
                ],
            ],
            analyzed: &[
                "Limit",
                "  ->  LockRows",
                "        ->  Sort",
                "              Sort Key: ((SubPlan 1)), s.queue_head",
                "              ->  Seq Scan on sessions s",
                "                    Filter: ((queue_head IS NOT NULL) AND (state = 'idle'::text))",
                "                    SubPlan 1",
                "                      ->  Index Scan using events_pkey on events e",
                "                            Index Cond: (seq = s.queue_head)",
            ],
        },
    }
}

/// A claimed turn's start, and an event coalesced into its session's head.
fn start_statements(v: &Values) -> Vec<Pinned<'_>> {
    vec![
        Pinned {
            name: "start the event",
            sql: START_EVENT_SQL,
            params: vec![&v.head.0, &v.now],
            plan: Plan::Same(&[
                "Update on events",
                "  ->  Index Scan using events_id_key on events",
                "        Index Cond: (id = 'e20001'::text)",
            ]),
        },
        Pinned {
            name: "start the turn",
            sql: START_TURN_SQL,
            params: vec![&"t-new", &v.head.1, &v.head.0, &v.now, &v.node],
            plan: Plan::Same(&["Insert on turns", "  ->  Result"]),
        },
        Pinned {
            name: "start the session",
            sql: START_SESSION_SQL,
            params: vec![&v.head.1, &"t-new", &v.now, &v.node, &v.step],
            plan: Plan::Same(&[
                "Update on sessions",
                "  ->  Index Scan using sessions_pkey on sessions",
                "        Index Cond: (key = 'solo-20001'::text)",
            ]),
        },
        Pinned {
            name: "coalesce into the head",
            sql: JOIN_QUEUED_SQL,
            params: vec![&v.head.0, &v.head.1, &v.head.2, &v.now, &v.step],
            plan: Plan::Same(&[
                "Update on events",
                "  InitPlan 1 (returns $0)",
                "    ->  Index Scan using events_id_key on events h",
                "          Index Cond: (id = 'e20001'::text)",
                "  ->  Index Scan using events_queued on events",
                "        Index Cond: (session_key = 'solo-20001'::text)",
                "        Filter: ((id <> 'e20001'::text) AND (route = 'hooks'::text) AND (status = 'queued'::text) AND (received_at <= ($0 + '60000'::bigint)))",
            ]),
        },
    ]
}

#[test]
fn the_accept_and_claim_paths_keep_their_plans_over_a_deep_backlog() {
    let Some(server) = Postgres::start("postgres_plans") else {
        return;
    };
    let settings = PostgresSettings {
        url: Secret::for_tests(server.url().as_bytes()),
        node: "plans".into(),
        lease_ttl: std::time::Duration::from_secs(30),
        pool_size: 2,
        ca_file: None,
    };
    crate::store::contract::runtime().block_on(async {
        let store = PostgresStore::open(&settings, true).await.expect("open");
        server.value(BACKLOG_SQL);
        assert_eq!(
            server.value("SELECT count(*) FROM events WHERE status = 'queued'"),
            "100000"
        );
        let v = Values::new();
        let pinned: Vec<Pinned> = [
            accept_statements(&v),
            claim_statements(&v),
            start_statements(&v),
        ]
        .into_iter()
        .flatten()
        .collect();
        for analyzed in [false, true] {
            if analyzed {
                server.value("ANALYZE");
            }
            for pinned in &pinned {
                let taken = plan(&store, pinned.sql, &pinned.params).await;
                let expected = pinned.plan.expected(analyzed);
                assert!(
                    expected.iter().any(|plan| *plan == taken.as_slice()),
                    "{} (statistics: {analyzed}): the plan changed to {taken:#?}, not one of \
                     {expected:#?}",
                    pinned.name
                );
            }
        }
        store.release().await;
    });
}
