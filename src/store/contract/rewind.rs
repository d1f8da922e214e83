//! Rewind and fork keep the same contract on both backends: refused while a turn of the session
//! runs or is queued and for an entry that cannot be rerun, changing nothing; otherwise the
//! entries from N on are superseded by the new turn, whose id the claim takes; a fork copies the
//! entries before N into a new session and leaves the original as it was.

use super::approvals::claim_in;
use super::{complete, event};
use crate::store::{
    RewindFrom, RewindOf, RewindRefusal, RewindRequest, SessionState, Store, TranscriptRow,
};
use crate::usage::Spent;

fn rerun(entry: i64, fork_as: Option<&str>) -> RewindRequest {
    RewindRequest {
        session: "rw".into(),
        entry,
        fork_as: fork_as.map(str::to_string),
    }
}

async fn rows(store: &Store, key: &str) -> Vec<TranscriptRow> {
    store.transcript(key, i64::MIN).await.expect("transcript")
}

/// What to compare of a row: its number, kind, body and what superseded it.
fn shape(rows: &[TranscriptRow]) -> Vec<(i64, String, String, Option<String>)> {
    rows.iter()
        .map(|row| {
            let body = row.body.to_string();
            (row.n, row.kind.clone(), body, row.superseded_by.clone())
        })
        .collect()
}

pub(super) async fn rewinds_and_forks(store: &Store) {
    a_turn_with_a_call(store).await;
    refusals_change_nothing(store).await;
    a_rewind_supersedes_and_its_claim_takes_its_turn_id(store).await;
    a_fork_leaves_the_original(store).await;
}

/// Session `rw`: a finished turn of five entries (event, call, its start and result, answer);
/// a rewind is refused while it runs.
async fn a_turn_with_a_call(store: &Store) {
    store
        .accept(event("rw-e1", "rw", None))
        .await
        .expect("accept");
    let turn = claim_in(store, "rw").await;
    let entries = vec![
        (
            "event",
            r#"{"kind":"event","event_id":"rw-e1","template":"t"}"#,
        ),
        (
            "message",
            r#"{"kind":"message","message":{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"lookup","arguments":"{}"}}]}}"#,
        ),
        (
            "tool_start",
            r#"{"kind":"tool_start","call_id":"c1","name":"lookup","arguments":{}}"#,
        ),
        (
            "message",
            r#"{"kind":"message","message":{"role":"tool","tool_call_id":"c1","content":"found"}}"#,
        ),
        (
            "message",
            r#"{"kind":"message","message":{"role":"assistant","content":"a1"}}"#,
        ),
    ];
    let entries = entries
        .into_iter()
        .map(|(kind, body)| (kind, body.to_string()))
        .collect();
    store
        .append_transcript("rw", &turn.turn_id, entries, 2, Spent::default())
        .await
        .expect("append");
    let refused = store.rewind(rerun(5, None)).await.expect("rewind");
    assert!(
        matches!(
            refused,
            Err(RewindRefusal::Busy {
                state: SessionState::Running,
                ..
            })
        ),
        "{refused:?}"
    );
    complete(store, &turn).await;
}

async fn refusals_change_nothing(store: &Store) {
    let before = shape(&rows(store, "rw").await);
    for (entry, refusal) in [
        (3, "tool_start"),
        (4, "a tool result"),
        (9, "no transcript entry"),
    ] {
        let refused = store.rewind(rerun(entry, None)).await.expect("rewind");
        let message = refused.expect_err("refused").to_string();
        assert!(message.contains(refusal), "{entry}: {message}");
    }
    let unknown = RewindRequest {
        session: "nobody".into(),
        ..rerun(1, None)
    };
    let refused = store.rewind(unknown).await.expect("rewind");
    assert_eq!(refused, Err(RewindRefusal::NoSession("nobody".into())));
    assert_eq!(
        shape(&rows(store, "rw").await),
        before,
        "refusals change nothing"
    );
}

async fn a_rewind_supersedes_and_its_claim_takes_its_turn_id(store: &Store) {
    let before = shape(&rows(store, "rw").await);
    let rewound = store
        .rewind(rerun(5, None))
        .await
        .expect("rewind")
        .expect("done");
    assert_eq!((rewound.session.as_str(), rewound.superseded), ("rw", 1));
    let after = rows(store, "rw").await;
    assert_eq!(
        shape(&after[..4]),
        before[..4],
        "the entries before 5 stand"
    );
    assert_eq!(
        after[4].superseded_by.as_deref(),
        Some(rewound.turn_id.as_str())
    );
    let queued = store.rewind(rerun(2, None)).await.expect("rewind");
    assert_eq!(queued, Err(RewindRefusal::Queued("rw".into())));
    let rerun_turn = claim_in(store, "rw").await;
    assert_eq!(
        rerun_turn.turn_id, rewound.turn_id,
        "the claim takes the rewind's id"
    );
    assert_eq!(rerun_turn.event.id, rewound.event_id);
    assert_eq!(rerun_turn.rewound, Some(RewindFrom::Reply));
    assert_eq!(rerun_turn.event.payload, br#"{"n":1}"#.to_vec());
    complete(store, &rerun_turn).await;
    let detail = store
        .event(&rewound.event_id)
        .await
        .expect("event")
        .expect("the rerun's event");
    let of = RewindOf {
        session: "rw".into(),
        entry: 5,
    };
    assert_eq!(detail.event.rewind_of, Some(of));
}

async fn a_fork_leaves_the_original(store: &Store) {
    let before = shape(&rows(store, "rw").await);
    let forked = store
        .rewind(rerun(1, Some("rw-copy")))
        .await
        .expect("fork")
        .expect("done");
    assert_eq!((forked.session.as_str(), forked.superseded), ("rw-copy", 0));
    assert_eq!(
        shape(&rows(store, "rw").await),
        before,
        "the original stands"
    );
    let exists = store.rewind(rerun(1, Some("rw-copy"))).await.expect("fork");
    assert_eq!(exists, Err(RewindRefusal::Exists("rw-copy".into())));
    let copy = store
        .session("rw-copy")
        .await
        .expect("session")
        .expect("forked");
    assert_eq!(copy.route, "hooks");
    assert!(
        rows(store, "rw-copy").await.is_empty(),
        "nothing before entry 1"
    );
    let fork_turn = claim_in(store, "rw-copy").await;
    assert_eq!(fork_turn.turn_id, forked.turn_id);
    assert_eq!(fork_turn.rewound, Some(RewindFrom::Event));
    complete(store, &fork_turn).await;
}
