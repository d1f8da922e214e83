//! A long session's transcript is read from its end: the console's session page reads the
//! latest entries (and one more, to know there are earlier ones), never the whole transcript,
//! whatever its length; an event's page reads its turns' entries through the turns; a turn
//! finds where the turns its history may show start from their own index (the plans are
//! pinned on a deep table, on both backends).

use crate::store::Store;
use crate::store::sql::{
    EVENT_TRANSCRIPT_SQL, HISTORY_TURN_START_SQL, HISTORY_TURNS_SQL, TRANSCRIPT_TAIL_SQL,
};

/// Entries of the deep session: months of a busy one.
const DEEP: i64 = 50_000;
const SHOWN: i64 = 500;

/// `run` executes SQL on the backend's database and returns what it printed (for `EXPLAIN`, the
/// plan, one line per step); `index_read` is how the backend's plan says it reads the transcript
/// backwards along its primary key; `node` is the turns' node column and its value, where the
/// backend has one.
pub(super) async fn a_deep_transcript_is_read_from_its_end(
    store: &Store,
    run: impl Fn(&str) -> String,
    explain: &str,
    index_read: &str,
    node: Option<(&str, &str)>,
) {
    plant_deep_session(&run);
    the_tail_is_the_latest_entries(store).await;
    let tail_sql = TRANSCRIPT_TAIL_SQL
        .replace("$1", "'deep'")
        .replace("$2", "'event'")
        .replace("$3", &SHOWN.to_string());
    let tail_plan = run(&format!("{explain} {tail_sql}"));
    assert!(tail_plan.contains(index_read), "{tail_plan}");
    assert!(!reads_all_or_sorts(&tail_plan), "{tail_plan}");
    an_event_s_entries_are_read_through_its_turns(store, &run, explain, node).await;
    the_history_s_turns_are_found_in_their_own_index(store, &run, explain).await;
}

/// The body of the deep session's entry `i`, as SQL: a message whose content says `entry i`.
const DEEP_ENTRY_BODY: &str =
    r#"'{"kind":"message","message":{"role":"assistant","content":"entry ' || i || '"}}'"#;

/// The body of an event entry, as SQL.
const EVENT_ENTRY_BODY: &str = r#"'{"kind":"event"}'"#;

/// Writes the session `deep`: `DEEP` entries of one old turn, then fresh statistics.
fn plant_deep_session(run: &impl Fn(&str) -> String) {
    run(&format!(
        "INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at)
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {DEEP})
         SELECT 'deep', i, 'old-turn', 'message', {DEEP_ENTRY_BODY}, 0
         FROM n"
    ));
    run("ANALYZE");
}

/// The tail holds the latest `SHOWN` entries, oldest first, and says whether earlier ones
/// exist; an unknown session's is empty.
async fn the_tail_is_the_latest_entries(store: &Store) {
    let tail = store
        .transcript_tail("deep", SHOWN)
        .await
        .expect("the tail");
    let seqs: Vec<i64> = tail.rows.iter().map(|row| row.seq).collect();
    let latest: Vec<i64> = (DEEP - SHOWN + 1..=DEEP).collect();
    assert_eq!(seqs, latest, "the latest entries, oldest first");
    assert!(tail.earlier);
    assert_eq!(tail.rows[0].body["message"]["content"], "entry 49501");
    let none = store.transcript_tail("none", SHOWN).await.expect("empty");
    assert!(none.rows.is_empty() && !none.earlier);
    let all = store.transcript_tail("deep", DEEP).await.expect("all");
    assert_eq!(all.rows.len(), usize::try_from(DEEP).unwrap_or(0));
    assert!(
        !all.earlier,
        "a tail as long as the transcript leaves nothing out"
    );
}

/// The entries of a late event's turn in the deep session, after many turns: only they are
/// read, through the turns' index by event and the entries' by turn.
async fn an_event_s_entries_are_read_through_its_turns(
    store: &Store,
    run: &impl Fn(&str) -> String,
    explain: &str,
    node: Option<(&str, &str)>,
) {
    let (column, value) = node.map_or((String::new(), String::new()), |(column, value)| {
        (format!(", {column}"), format!(", '{value}'"))
    });
    run(&format!(
        "INSERT INTO turns (id, session_key, event_id, status, started_at{column})
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {DEEP})
         SELECT 'turn-' || i, 'deep', 'event-' || i, 'completed', i{value} FROM n;
         INSERT INTO turns (id, session_key, event_id, status, started_at{column})
         VALUES ('late-turn', 'deep', 'late-event', 'completed', 0{value});
         INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at)
         SELECT 'deep', {DEEP} + i, 'late-turn', 'message', '{{\"kind\":\"message\"}}', i
         FROM (SELECT 1 AS i UNION ALL SELECT 2 UNION ALL SELECT 3) n"
    ));
    run("ANALYZE");
    let rows = store
        .event_transcript("late-event", 2)
        .await
        .expect("the event's entries");
    let seqs: Vec<i64> = rows.iter().map(|row| row.seq).collect();
    assert_eq!(
        seqs,
        [DEEP + 1, DEEP + 2],
        "the first entries, oldest first"
    );
    let sql = EVENT_TRANSCRIPT_SQL
        .replace("$1", "'late-event'")
        .replace("$2", "'event'")
        .replace("$3", "2");
    let plan = run(&format!("{explain} {sql}"));
    assert!(plan.contains("transcript_by_turn"), "{plan}");
    assert!(plan.contains("turns_by_event"), "{plan}");
    let scans = plan.lines().any(|line| {
        let step = line.trim().trim_start_matches("->").trim().to_lowercase();
        step == "scan t" || step.starts_with("seq scan on transcript")
    });
    assert!(!scans, "{plan}");
}

/// The turns a history counts are the event entries no rewind superseded, found without
/// walking the deep session's other entries: `TURNS` of them after its `DEEP` messages, one
/// more superseded.
async fn the_history_s_turns_are_found_in_their_own_index(
    store: &Store,
    run: &impl Fn(&str) -> String,
    explain: &str,
) {
    const TURNS: i64 = 100;
    run(&format!(
        "INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at, superseded_by)
         WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {TURNS})
         SELECT 'deep', {start} + 10 * i, 'history-turn', 'event', {EVENT_ENTRY_BODY}, 0,
                CASE WHEN i = 1 THEN 'rewinding-turn' END
         FROM n;
         ANALYZE",
        start = 2 * DEEP
    ));
    assert_eq!(store.history_turns("deep").await.expect("count"), TURNS);
    assert_eq!(store.history_turns("none").await.expect("count"), 0);
    for (nth, seq) in [(0, Some(2 * DEEP)), (1, Some(2 * DEEP + 20)), (TURNS, None)] {
        let start = store.history_turn_start("deep", nth).await.expect("start");
        assert_eq!(start, seq, "turn {nth}");
    }
    for sql in [HISTORY_TURNS_SQL, HISTORY_TURN_START_SQL] {
        let sql = sql.replace("$1", "'deep'").replace("$2", "50");
        let plan = run(&format!("{explain} {sql}"));
        assert!(plan.contains("transcript_events"), "{plan}");
        assert!(!reads_all_or_sorts(&plan), "{plan}");
    }
}

/// Whether a plan (SQLite's or PostgreSQL's) scans the whole transcript or sorts what it read.
fn reads_all_or_sorts(plan: &str) -> bool {
    plan.lines().any(|line| {
        let step = line.trim().trim_start_matches("->").trim().to_lowercase();
        step == "scan t"
            || step.starts_with("scan transcript")
            || step.starts_with("seq scan on transcript")
            || step.contains("temp b-tree")
            || step.starts_with("sort")
    })
}
