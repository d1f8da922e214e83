//! The contract's approval case: a request pauses its session and the decision lets the turn go
//! on, on both backends.

use super::{complete, event, event_status, session_state};
use crate::store::approval::APPROVAL_ENTRY;
use crate::store::model::Claim;
use crate::store::now_millis;
use crate::store::states::{Continuation, EventStatus, SessionState};
use crate::store::{
    ApprovalRow, ApprovalStatus, ClaimedTurn, Decided, Decision, NewApproval, Store,
};

fn request(turn: &ClaimedTurn, id: &str, call: &str, expires_at: i64) -> NewApproval {
    NewApproval {
        row: ApprovalRow {
            id: id.to_string(),
            event_id: turn.event.id.clone(),
            session: turn.event.session_key.clone(),
            route: turn.event.route.clone(),
            turn_id: turn.turn_id.clone(),
            call_id: call.to_string(),
            tool: "deploy".into(),
            arguments: serde_json::json!({"target": "prod"}),
            status: ApprovalStatus::Pending,
            requested_at: now_millis(),
            expires_at,
            decided_at: None,
            decided_by: None,
            note: None,
            link_secret: "secret".into(),
        },
        delivery: serde_json::json!({"kind": "approval_request", "approval_id": id}).to_string(),
    }
}

fn decision(status: ApprovalStatus, by: &str) -> Decision {
    Decision {
        status,
        by: by.to_string(),
        note: None,
    }
}

/// A paused turn holds nothing: its session's later events wait behind the request, one
/// decision is taken (a second is refused), the decision queues the event to continue with the
/// decision in the transcript, and a request past its time expires.
/// Claims what may run, and returns the turn of `session`, which must be among it (turns of
/// sessions earlier cases left behind are claimed too, and left running).
pub(super) async fn claim_in(store: &Store, session: &str) -> ClaimedTurn {
    let claimed = store.claim_turns(Claim::Beside(100)).await.expect("claim");
    claimed
        .into_iter()
        .find(|turn| turn.event.session_key == session)
        .unwrap_or_else(|| panic!("nothing of {session} to claim"))
}

pub(super) async fn approvals_pause_and_continue(store: &Store) {
    store
        .accept(event("ap-e1", "sa", None))
        .await
        .expect("accept");
    store
        .accept(event("ap-e2", "sa", None))
        .await
        .expect("accept");
    let turn = claim_in(store, "sa").await;
    assert_eq!(turn.event.id, "ap-e1");
    let far = now_millis() + 3_600_000;
    store
        .await_approval(request(&turn, "ap1", "c1", far), 3)
        .await
        .expect("await");
    assert_eq!(
        event_status(store, "ap-e1").await,
        EventStatus::AwaitingApproval
    );
    assert_eq!(
        session_state(store, "sa").await,
        SessionState::AwaitingApproval
    );
    assert!(
        store
            .claim_turns(Claim::Beside(100))
            .await
            .expect("claim")
            .iter()
            .all(|t| t.event.session_key != "sa"),
        "a session awaiting a decision runs nothing"
    );
    assert_eq!(
        store.live_counts().await.expect("counts").approvals_pending,
        1
    );
    assert_eq!(
        store
            .status_summary()
            .await
            .expect("summary")
            .approvals
            .pending,
        1
    );
    decisions_are_taken_once(store).await;
    let continued = claim_in(store, "sa").await;
    assert_eq!(
        continued.event.id, "ap-e1",
        "the decided event runs before the later one"
    );
    assert_eq!(continued.continues, Some(Continuation::Decided));
    let kinds: Vec<String> = store
        .transcript("sa", i64::MIN)
        .await
        .expect("transcript")
        .into_iter()
        .filter(|row| row.kind == APPROVAL_ENTRY)
        .filter_map(|row| row.body["status"].as_str().map(str::to_string))
        .collect();
    assert_eq!(kinds, ["pending", "approved"]);
    store
        .await_approval(request(&continued, "ap2", "c2", now_millis() - 1), 4)
        .await
        .expect("await again");
    let near = store.approvals_to_warn(10).await.expect("near expiry");
    assert_eq!(near.len(), 1, "only the request near its expiry: {near:?}");
    let expired = store.expire_approvals().await.expect("expire");
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].status, ApprovalStatus::Expired);
    assert!(store.expire_approvals().await.expect("expire").is_empty());
    let continued = claim_in(store, "sa").await;
    assert_eq!(continued.event.id, "ap-e1");
    complete(store, &continued).await;
    let later = claim_in(store, "sa").await;
    assert_eq!(later.event.id, "ap-e2");
    complete(store, &later).await;
    assert!(store.approvals(true, 10).await.expect("list").is_empty());
    assert_eq!(store.approvals(false, 10).await.expect("list").len(), 2);
}

/// The first decision on a request is taken; a second one is refused with the first one's row.
async fn decisions_are_taken_once(store: &Store) {
    let taken = store
        .decide_approval("ap1", decision(ApprovalStatus::Approved, "alice"))
        .await
        .expect("decide");
    assert!(matches!(&taken, Decided::Taken(row) if row.decided_by.as_deref() == Some("alice")));
    let again = store
        .decide_approval("ap1", decision(ApprovalStatus::Denied, "bob"))
        .await
        .expect("decide again");
    assert!(
        matches!(&again, Decided::Already(row) if row.status == ApprovalStatus::Approved),
        "{again:?}"
    );
    assert!(matches!(
        store
            .decide_approval("nope", decision(ApprovalStatus::Approved, "a"))
            .await,
        Ok(Decided::Unknown)
    ));
}
