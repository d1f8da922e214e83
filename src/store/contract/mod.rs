//! The store's contract, one suite run against both backends: SQLite in a temporary directory,
//! and PostgreSQL on a throwaway server (Debian's binaries, which `tests/setup` installs; without
//! them the PostgreSQL half fails, unless `AGENTGATE_TEST_SKIP` lists `postgres`). The server
//! harness is the integration tests' own (`tests/common/postgres.rs`).

#[path = "../../../tests/common/basics.rs"]
#[expect(
    dead_code,
    reason = "the integration tests' helpers; the contract uses a few"
)]
mod basics;
#[path = "../../../tests/common/postgres.rs"]
#[expect(
    dead_code,
    reason = "the integration tests' server harness; the contract uses a part"
)]
pub(in crate::store) mod postgres_server;

mod approvals;
mod rewind;
mod transcript;

use approvals::approvals_pause_and_continue;

use std::sync::Arc;
use std::time::Duration;

use super::model::{
    Claim, DedupWindow, DeliveryAttempt, Event, Fits, InterruptedSession, NewEvent, Reservation,
    Reserving, TurnEnd,
};
use super::states::{
    Continuation, DeliveryState, EventStatus, SessionState, StopReason, Terminal, TurnStatus,
};
use super::{
    AcceptOutcome, ClaimedTurn, ErrorKind, EventFilter, RenderDelivery, ResumeReason, RetryTarget,
    SessionFilter, Settled, Settlement, Store, StoreError,
};
use crate::config::{PostgresSettings, StoreSettings};
use crate::secret::Secret;
use crate::usage::{Counted, Spending, Spent, Usage, UsageReport};

fn event(id: &str, session: &str, delivery_id: Option<&str>) -> NewEvent {
    NewEvent {
        event: Event {
            id: id.to_string(),
            route: "hooks".into(),
            session_key: session.to_string(),
            event_type: "push".into(),
            delivery_id: delivery_id.map(str::to_string),
            headers: r#"{"x-test":"1"}"#.into(),
            trace_parent: None,
            payload: br#"{"n":1}"#.to_vec(),
        },
        dedup_window: DedupWindow(Duration::MAX),
    }
}

fn render_body(end: &TurnEnd, usage: &UsageReport) -> serde_json::Result<String> {
    serde_json::to_string(
        &serde_json::json!({"event_id": end.event_id, "status": end.terminal,
        "usage": usage}),
    )
}

const RENDER: RenderDelivery = RenderDelivery {
    render: render_body,
    price: None,
};

fn ended(turn: &ClaimedTurn, terminal: Terminal, turn_status: TurnStatus) -> TurnEnd {
    TurnEnd {
        turn_id: turn.turn_id.clone(),
        event_id: turn.event.id.clone(),
        session_key: turn.event.session_key.clone(),
        route: turn.event.route.clone(),
        turn_status,
        terminal,
        reason: None,
        output: Some("done".into()),
        error: None,
        steps: 2,
        rewind_of: None,
    }
}

async fn assert_nothing_to_claim(store: &Store) {
    let claimed = store.claim_turns(Claim::Beside(10)).await.expect("claim");
    assert!(claimed.is_empty(), "{claimed:?}");
}

/// Ends `turn` completed.
async fn complete(store: &Store, turn: &ClaimedTurn) {
    store
        .finish_turn(
            ended(turn, Terminal::Completed, TurnStatus::Completed),
            RENDER,
        )
        .await
        .expect("finish");
}

async fn claim_one(store: &Store) -> ClaimedTurn {
    let mut claimed = store.claim_turns(Claim::Beside(10)).await.expect("claim");
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    claimed.remove(0)
}

async fn event_status(store: &Store, id: &str) -> EventStatus {
    store
        .event(id)
        .await
        .expect("event")
        .expect("the event exists")
        .event
        .status
}

async fn session_state(store: &Store, key: &str) -> SessionState {
    store
        .session(key)
        .await
        .expect("session")
        .expect("the session exists")
        .state
}

/// Accept, dedup, claim (one turn per session), steps, end, outbox.
async fn accept_claim_finish_deliver(store: &Store) {
    accepted_once_then_a_duplicate(store).await;
    let turn = claim_one(store).await;
    assert_eq!(turn.event.id, "e1");
    assert_eq!(turn.event.payload, br#"{"n":1}"#);
    assert!(turn.continues.is_none() && !turn.internal);
    // The session is busy: its second event waits.
    assert_nothing_to_claim(store).await;
    assert_eq!(session_state(store, "s1").await, SessionState::Running);
    the_turn_s_steps_are_committed(store, &turn).await;
    complete(store, &turn).await;
    assert_eq!(event_status(store, "e1").await, EventStatus::Completed);
    the_result_is_delivered_with_what_it_spent(store).await;
    the_session_s_next_event_runs_after_it(store).await;
}

/// e1 is accepted, its delivery id makes a copy a duplicate of it, and e2 waits behind it.
async fn accepted_once_then_a_duplicate(store: &Store) {
    assert_eq!(
        store
            .accept(event("e1", "s1", Some("d1")))
            .await
            .expect("accept"),
        AcceptOutcome::Accepted
    );
    assert_eq!(
        store
            .accept(event("e1-again", "s1", Some("d1")))
            .await
            .expect("accept"),
        AcceptOutcome::Duplicate {
            original: "e1".into()
        }
    );
    assert_eq!(
        store
            .original_of("hooks", "d1", DedupWindow(Duration::MAX))
            .await
            .expect("original"),
        Some("e1".to_string())
    );
    store.accept(event("e2", "s1", None)).await.expect("accept");
}

/// The turn's event entry, then three replies' usage (one without figures), are committed; the
/// transcript reads from its end.
async fn the_turn_s_steps_are_committed(store: &Store, turn: &ClaimedTurn) {
    store
        .append_transcript(
            "s1",
            &turn.turn_id,
            vec![("event", "{}".into())],
            1,
            Spent::default(),
        )
        .await
        .expect("append");
    let reply = Spent::of_reply(
        Some(Usage {
            input_tokens: 100,
            cached_input_tokens: 60,
            output_tokens: 7,
        }),
        0,
    );
    for spent in [reply, reply, Spent::of_reply(None, 4000)] {
        store
            .append_transcript("s1", &turn.turn_id, Vec::new(), 2, spent)
            .await
            .expect("append usage");
    }
    assert!(store.event_has_transcript("e1").await.expect("has"));
    let transcript = store.transcript("s1", i64::MIN).await.expect("transcript");
    assert_eq!(transcript.len(), 1);
    assert_eq!(
        transcript[0].event.as_ref().map(|e| e.id.as_str()),
        Some("e1")
    );
    let after_first = store
        .transcript("s1", transcript[0].seq)
        .await
        .expect("transcript after the first entry");
    assert!(after_first.is_empty(), "{after_first:?}");
}

/// e1's result is due with the usage its steps added up to, not for a skipped route, and once
/// delivered the event shows its one turn and its delivery.
async fn the_result_is_delivered_with_what_it_spent(store: &Store) {
    let due = store.due_deliveries(10, Vec::new()).await.expect("due");
    assert_eq!(due.len(), 1);
    assert!(due[0].body.contains("completed"), "{}", due[0].body);
    let body: serde_json::Value = serde_json::from_str(&due[0].body).expect("JSON body");
    assert_eq!(
        body["usage"],
        serde_json::json!({"input_tokens": 200, "cached_input_tokens": 120,
            "output_tokens": 14, "cost_usd": null, "unknown_steps": 1}),
        "the delivery has what the event's steps spent"
    );
    assert!(
        store
            .due_deliveries(10, vec!["hooks".into()])
            .await
            .expect("due")
            .is_empty(),
        "a skipped route's deliveries are not due"
    );
    store
        .record_delivery_attempt("e1", DeliveryAttempt::Delivered)
        .await
        .expect("record");
    let detail = store.event("e1").await.expect("event").expect("e1");
    assert_eq!(detail.turns.len(), 1);
    assert_eq!(detail.turns[0].status, TurnStatus::Completed);
    assert_eq!(
        detail.delivery.map(|d| d.status),
        Some(DeliveryState::Delivered)
    );
    assert_eq!(detail.headers["x-test"], "1");
}

/// After e1's turn, s1's queued e2 is claimed; the counts say so; it ends.
async fn the_session_s_next_event_runs_after_it(store: &Store) {
    let next = claim_one(store).await;
    assert_eq!(next.event.id, "e2");
    let summary = store.status_summary().await.expect("summary");
    assert_eq!(summary.events.total, 2);
    assert_eq!(
        summary.events.by_status.get(&EventStatus::Running),
        Some(&1)
    );
    assert_eq!(
        summary.sessions.by_state.get(&SessionState::Running),
        Some(&1)
    );
    let queued = store
        .events(EventFilter {
            status: Some(EventStatus::Completed),
            limit: 10,
            ..EventFilter::default()
        })
        .await
        .expect("events");
    assert_eq!(
        queued.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
        ["e1"]
    );
    complete(store, &next).await;
}

/// The count of `key`'s resumes in the retry ledger, if it has an entry.
async fn resumes_counted(store: &Store, key: &str) -> Option<u64> {
    let ledger = store.resume_ledger().await.expect("ledger");
    ledger.sessions.get(key).map(|entry| entry.attempts)
}

/// Interrupts the running `turn` and settles its session with a limit of one resume.
/// A resume window of an hour, and one counted resume before a session is suspended.
const ADMIT_ONCE: Settlement = Settlement {
    resume_window: Duration::from_secs(3600),
    max_attempts: 1,
};

/// `session` as if its turn had started a day ago: outside `ADMIT_ONCE`'s window.
fn long_ago(session: &InterruptedSession) -> InterruptedSession {
    InterruptedSession {
        started_at: session.started_at - 86_400_000,
        ..session.clone()
    }
}

async fn interrupt_and_settle(store: &Store, turn: &ClaimedTurn, reason: ResumeReason) -> Settled {
    let key = &turn.event.session_key;
    store
        .interrupt_for_resume(&turn.turn_id, key, reason, 1)
        .await
        .expect("interrupt");
    let interrupted = store.interrupted_sessions().await.expect("interrupted");
    assert_eq!(interrupted.len(), 1, "{interrupted:?}");
    assert_eq!(interrupted[0].reason, reason);
    store
        .settle_interrupted(&interrupted[0], ADMIT_ONCE, RENDER)
        .await
        .expect("settle")
}

/// An interrupted session is resumed (counted first), then suspended past its limit.
async fn interrupted_sessions_are_admitted_then_suspended(store: &Store) {
    store
        .accept(event("r1", "resumed", None))
        .await
        .expect("accept");
    let turn = claim_one(store).await;
    let first_span = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let earlier = store
        .record_turn_span("r1", &turn.turn_id, first_span)
        .await;
    assert_eq!(earlier.expect("record a turn's span"), None);
    let settled = interrupt_and_settle(store, &turn, ResumeReason::ShutdownTimeout).await;
    assert!(
        matches!(settled, Settled::Resumed { attempt: 1 }),
        "{settled:?}"
    );
    assert_eq!(resumes_counted(store, "resumed").await, Some(1));
    let again = claim_one(store).await;
    assert_eq!(again.event.id, "r1");
    assert_eq!(
        again.continues,
        Some(Continuation::Resumed(ResumeReason::ShutdownTimeout))
    );
    let earlier = store
        .record_turn_span("r1", &again.turn_id, "00-x-y-01")
        .await;
    assert_eq!(
        earlier.expect("record").as_deref(),
        Some(first_span),
        "a resumed turn finds the span of the run it continues"
    );
    let settled = interrupt_and_settle(store, &again, ResumeReason::Crashed).await;
    assert!(matches!(settled, Settled::Suspended), "{settled:?}");
    assert_eq!(event_status(store, "r1").await, EventStatus::Suspended);
    assert_eq!(
        session_state(store, "resumed").await,
        SessionState::Suspended
    );
    assert_eq!(
        resumes_counted(store, "resumed").await,
        None,
        "the suspended session's count goes"
    );
}

/// Outside the resume window the event ends abandoned, with its delivery.
async fn old_interruptions_are_abandoned(store: &Store) {
    store
        .accept(event("a1", "abandoned", None))
        .await
        .expect("accept");
    let turn = claim_one(store).await;
    store
        .interrupt_for_resume(&turn.turn_id, "abandoned", ResumeReason::Crashed, 0)
        .await
        .expect("interrupt");
    let interrupted = store.interrupted_sessions().await.expect("interrupted");
    let settled = store
        .settle_interrupted(&long_ago(&interrupted[0]), ADMIT_ONCE, RENDER)
        .await
        .expect("settle");
    assert!(matches!(settled, Settled::Abandoned), "{settled:?}");
    assert_eq!(event_status(store, "a1").await, EventStatus::Abandoned);
    let detail = store.event("a1").await.expect("event").expect("a1");
    assert_eq!(
        detail.turns[0].reason.as_deref(),
        Some(StopReason::Resume(ResumeReason::Crashed).sql())
    );
    assert_eq!(
        detail.delivery.map(|d| d.status),
        Some(DeliveryState::Pending)
    );
}

/// Suspend, resume, replay and retry, as the operator commands use them.
async fn operator_overrides(store: &Store) {
    store
        .accept(event("o1", "operated", None))
        .await
        .expect("accept");
    assert_eq!(
        store.operator_suspend("operated").await.expect("suspend"),
        Some(SessionState::Idle)
    );
    assert_nothing_to_claim(store).await;
    assert_eq!(
        store.operator_resume("operated").await.expect("resume"),
        Some(SessionState::Suspended)
    );
    assert_eq!(store.operator_resume("nobody").await.expect("resume"), None);
    let turn = claim_one(store).await;
    store
        .finish_turn(ended(&turn, Terminal::Failed, TurnStatus::Failed), RENDER)
        .await
        .expect("finish");
    store
        .record_delivery_attempt(
            "o1",
            DeliveryAttempt::GaveUp {
                error: "refused".into(),
            },
        )
        .await
        .expect("record");
    assert_eq!(
        store
            .deliveries(Some(DeliveryState::Failed), 10)
            .await
            .expect("failed")
            .len(),
        1,
        "one failed delivery"
    );
    assert_eq!(
        store
            .retry_deliveries(RetryTarget::AllFailed)
            .await
            .expect("retry"),
        1
    );
    let copy = store
        .replay_event("o1")
        .await
        .expect("replay")
        .expect("o1 exists");
    let replayed = store.event(&copy).await.expect("event").expect("copy");
    assert_eq!(replayed.event.replay_of.as_deref(), Some("o1"));
    assert_eq!(replayed.event.status, EventStatus::Queued);
    assert_eq!(store.replay_event("missing").await.expect("replay"), None);
}

/// Marks the turns that `crash` left behind and returns the interrupted sessions, oldest first.
async fn crashed(store: &Store, crash: &impl Fn(), cut_off: usize) -> Vec<InterruptedSession> {
    crash();
    assert_eq!(store.mark_crashed_turns().await.expect("mark"), cut_off);
    store.interrupted_sessions().await.expect("interrupted")
}

async fn settle(store: &Store, session: &InterruptedSession) -> Settled {
    store
        .settle_interrupted(session, ADMIT_ONCE, RENDER)
        .await
        .expect("settle")
}

/// A crash that cut off two turns counts against neither: each resumes alone, recorded in the
/// ledger but not counted, and holds back other claims until it runs. A crash while one runs
/// alone is pinned on it and counts, and its counted resume runs alone again.
async fn only_a_crash_of_a_turn_that_ran_alone_counts(store: &Store, crash: &impl Fn()) {
    for (id, key) in [("c1", "crash-a"), ("c2", "crash-b")] {
        store.accept(event(id, key, None)).await.expect("accept");
    }
    assert_eq!(
        store
            .claim_turns(Claim::Beside(10))
            .await
            .expect("claim")
            .len(),
        2
    );
    let interrupted = crashed(store, crash, 2).await;
    assert_eq!(interrupted.len(), 2, "{interrupted:?}");
    for session in &interrupted {
        assert!(!session.is_pinned(), "{session:?}");
        let settled = settle(store, session).await;
        assert!(
            matches!(
                settled,
                Settled::ResumedAlone {
                    attempts: 0,
                    crashed_with: 2
                }
            ),
            "{settled:?}"
        );
        assert_eq!(resumes_counted(store, &session.session_key).await, Some(0));
    }
    assert!(store.waiting_to_run_alone().await.expect("waiting"));
    assert_nothing_to_claim(store).await;
    let alone = store.claim_turns(Claim::Alone).await.expect("claim alone");
    assert_eq!(alone.len(), 1, "{alone:?}");
    assert!(alone[0].alone);
    assert_eq!(alone[0].event.id, "c1");

    let interrupted = crashed(store, crash, 1).await;
    assert_eq!(interrupted[0].session_key, "crash-a");
    assert!(interrupted[0].is_pinned());
    let settled = settle(store, &interrupted[0]).await;
    assert!(
        matches!(settled, Settled::Resumed { attempt: 1 }),
        "{settled:?}"
    );

    // Both run alone, oldest first: crash-a's counted resume, then crash-b.
    for id in ["c1", "c2"] {
        assert!(store.waiting_to_run_alone().await.expect("waiting"));
        assert_nothing_to_claim(store).await;
        let next = store.claim_turns(Claim::Alone).await.expect("claim alone");
        assert_eq!(
            next.iter()
                .map(|t| (t.event.id.as_str(), t.alone))
                .collect::<Vec<_>>(),
            [(id, true)]
        );
        complete(store, &next[0]).await;
    }
    assert!(!store.waiting_to_run_alone().await.expect("waiting"));
}

/// An event of `route` in `session`, accepted.
async fn accept_on(store: &Store, id: &str, route: &str, session: &str) {
    let mut new = event(id, session, None);
    new.event.route = route.to_string();
    assert_eq!(
        store.accept(new).await.expect("accept"),
        AcceptOutcome::Accepted
    );
}

async fn claim_first(store: &Store, claim: &Claim) -> ClaimedTurn {
    let mut claimed = store.claim_turns(claim.clone()).await.expect("claim");
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    let turn = claimed.remove(0);
    complete(store, &turn).await;
    turn
}

/// A route's priority puts its events first, and each step of it is worth a minute of
/// waiting: an event of priority 0 that waited 20 minutes longer goes before one of priority
/// 10. `backdate(id)` moves an event's arrival 20 minutes back.
async fn priority_goes_first_and_waiting_catches_up(store: &Store, backdate: impl Fn(&str)) {
    let by_priority = Claim::BesideByPriority {
        limit: 1,
        priorities: std::sync::Arc::from(r#"{"pager":10}"#),
    };
    accept_on(store, "q1", "hooks", "prio-a").await;
    accept_on(store, "q2", "pager", "prio-b").await;
    assert_eq!(claim_first(store, &by_priority).await.event.id, "q2");
    assert_eq!(claim_first(store, &by_priority).await.event.id, "q1");
    accept_on(store, "q3", "hooks", "prio-c").await;
    accept_on(store, "q4", "pager", "prio-d").await;
    backdate("q3");
    assert_eq!(claim_first(store, &by_priority).await.event.id, "q3");
    assert_eq!(claim_first(store, &by_priority).await.event.id, "q4");
    // Without priorities, the longest waiting first.
    accept_on(store, "q5", "pager", "prio-e").await;
    accept_on(store, "q6", "hooks", "prio-f").await;
    assert_eq!(claim_first(store, &Claim::Beside(1)).await.event.id, "q5");
    assert_eq!(claim_first(store, &Claim::Beside(1)).await.event.id, "q6");
}

/// Coalescing: the queued events of a session that arrived within the window after its claimed
/// event join it, and end with its turn, each with a delivery of its own; an event that
/// arrived later than the window does not join. `backdate(id)` moves an arrival 20 minutes back.
async fn joined_events_end_with_their_turn(store: &Store, backdate: impl Fn(&str)) {
    for id in ["j1", "j2", "j3"] {
        accept_on(store, id, "hooks", "coalesced").await;
    }
    let head = claim_one(store).await;
    assert_eq!(head.event.id, "j1");
    let joined = store.join_queued(&head.event, 60_000).await.expect("join");
    let ids: Vec<&str> = joined.iter().map(|event| event.id.as_str()).collect();
    assert_eq!(ids, ["j2", "j3"]);
    assert_eq!(event_status(store, "j2").await, EventStatus::Joined);
    // Asked again (a run cut off before it recorded anything starts afresh): the same ones.
    let again = store.join_queued(&head.event, 60_000).await.expect("join");
    assert_eq!(again.len(), 2);
    assert_nothing_to_claim(store).await;
    complete(store, &head).await;
    for id in ["j2", "j3"] {
        assert_eq!(event_status(store, id).await, EventStatus::Completed);
    }
    let delivered: Vec<String> = store
        .deliveries(None, 100)
        .await
        .expect("deliveries")
        .into_iter()
        .map(|delivery| delivery.event_id)
        .collect();
    for id in ["j1", "j2", "j3"] {
        assert!(delivered.iter().any(|d| d == id), "{id}: {delivered:?}");
    }
    // Outside the window: the head arrived 20 minutes before the next one.
    accept_on(store, "j4", "hooks", "coalesced").await;
    accept_on(store, "j5", "hooks", "coalesced").await;
    backdate("j4");
    let head = claim_one(store).await;
    assert_eq!(head.event.id, "j4");
    assert!(
        store
            .join_queued(&head.event, 60_000)
            .await
            .expect("join")
            .is_empty()
    );
    complete(store, &head).await;
    assert_eq!(claim_first(store, &Claim::Beside(1)).await.event.id, "j5");
}

/// A reservation of `tokens` (prompt, reply) for a request of `turn`, counting every window
/// from the start of time as its day.
fn reservation(turn: &ClaimedTurn, tokens: (u64, u64), counted: Counted) -> Reservation {
    Reservation {
        turn_id: turn.turn_id.clone(),
        event_id: turn.event.id.clone(),
        session_key: turn.event.session_key.clone(),
        route: turn.event.route.clone(),
        day_start: 0,
        tokens: Usage {
            input_tokens: tokens.0,
            cached_input_tokens: 0,
            output_tokens: tokens.1,
        },
        counted,
    }
}

/// Whether the day's tokens, spent and held, stay below `limit`.
fn day_below(limit: u64) -> Fits {
    Arc::new(move |total: &Spending| total.day.budget_tokens() < limit)
}

async fn reserve(store: &Store, reservation: Reservation, fits: Fits) -> Reserving {
    store
        .reserve_budget(reservation, fits)
        .await
        .expect("reserve")
}

/// Budget reservations: what a request in flight may spend is held against the windows it
/// shares with other turns' requests (the day, the route's day; not another event's or
/// session's) until the step that records its reply settles it, it is released, or its turn
/// ends; a request that does not fit beside them is not reserved; only the windows counted are
/// read; a crash (or, on PostgreSQL, a node that stops renewing them) leaves none held.
async fn reservations_hold_what_requests_in_flight_may_spend(store: &Store, crash: &impl Fn()) {
    let all = Counted {
        turn: true,
        session: true,
        day: true,
        route_day: true,
    };
    accept_on(store, "b1", "hooks", "budget-a").await;
    accept_on(store, "b2", "hooks", "budget-b").await;
    let claimed = store.claim_turns(Claim::Beside(10)).await.expect("claim");
    let [a, b] = claimed.as_slice() else {
        panic!("two turns: {claimed:?}");
    };
    let first = reserve(store, reservation(a, (300, 100), all), day_below(u64::MAX)).await;
    assert!(first.reserved);
    assert_eq!(first.held, Spending::default());
    assert_eq!(first.spent.turn, Spent::default(), "no step of b1 yet");
    let day = first.spent.day.budget_tokens();
    assert!(day > 0, "earlier turns spent today: {first:?}");
    assert_eq!(first.spent.day, first.spent.route_day);

    let refused = reserve(store, reservation(b, (50, 10), all), day_below(day + 400)).await;
    assert!(
        !refused.reserved,
        "b does not fit beside a's 400: {refused:?}"
    );
    assert_eq!(refused.held.day.budget_tokens(), 400);
    assert_eq!(refused.held.route_day.budget_tokens(), 400);
    assert_eq!(refused.held.session, Spent::default(), "another session's");
    assert_eq!(refused.held.turn, Spent::default(), "another event's");
    let granted = reserve(store, reservation(b, (50, 10), all), day_below(day + 401)).await;
    assert!(granted.reserved, "{granted:?}");
    let only_day = Counted {
        day: true,
        ..Counted::default()
    };
    let counted = reserve(
        store,
        reservation(a, (300, 100), only_day),
        day_below(u64::MAX),
    )
    .await;
    assert_eq!(counted.held.day.budget_tokens(), 60, "b's, not a's own");
    assert_eq!(
        counted.spent.session,
        Spent::default(),
        "not counted, not read"
    );
    assert_eq!(counted.held.route_day, Spent::default());

    // a's reply is committed with its step: its reservation is settled by its usage.
    let reply = Spent::of_reply(
        Some(Usage {
            input_tokens: 250,
            cached_input_tokens: 0,
            output_tokens: 20,
        }),
        0,
    );
    store
        .append_transcript("budget-a", &a.turn_id, Vec::new(), 1, reply)
        .await
        .expect("append");
    let settled = reserve(store, reservation(b, (50, 10), all), day_below(u64::MAX)).await;
    assert_eq!(
        settled.held.day,
        Spent::default(),
        "a's reservation is settled"
    );
    assert_eq!(settled.spent.day.budget_tokens(), day + 270);
    // b's request failed: released; then its turn ends holding one: ended with it.
    store.release_budget(&b.turn_id).await.expect("release");
    let released = reserve(store, reservation(a, (1, 1), all), day_below(u64::MAX)).await;
    assert_eq!(
        released.held.day,
        Spent::default(),
        "b's reservation is given back"
    );
    complete(store, a).await;
    let ended = reserve(store, reservation(b, (1, 1), all), day_below(u64::MAX)).await;
    assert_eq!(ended.held.day, Spent::default(), "a's ended with its turn");

    // A crash: nothing the crashed process held counts any more.
    crash();
    store.mark_crashed_turns().await.expect("mark");
    let probe = ClaimedTurn {
        turn_id: "probe".into(),
        ..a.clone()
    };
    let after_crash = reserve(store, reservation(&probe, (1, 1), all), day_below(0)).await;
    assert!(!after_crash.reserved);
    assert_eq!(after_crash.held.day, Spent::default(), "{after_crash:?}");
    let interrupted = store.interrupted_sessions().await.expect("interrupted");
    for session in interrupted {
        store
            .settle_interrupted(&long_ago(&session), ADMIT_ONCE, RENDER)
            .await
            .expect("settle");
    }
}

/// The SQL that moves event `id`'s arrival 20 minutes back.
fn backdate_sql(id: &str) -> String {
    format!("UPDATE events SET received_at = received_at - 1200000 WHERE id = '{id}'")
}

async fn run_contract(store: &Store, crash: impl Fn()) {
    accept_claim_finish_deliver(store).await;
    interrupted_sessions_are_admitted_then_suspended(store).await;
    old_interruptions_are_abandoned(store).await;
    only_a_crash_of_a_turn_that_ran_alone_counts(store, &crash).await;
    reservations_hold_what_requests_in_flight_may_spend(store, &crash).await;
    operator_overrides(store).await;
    approvals_pause_and_continue(store).await;
    rewind::rewinds_and_forks(store).await;
    let page = store
        .sessions_page(SessionFilter {
            limit: 2,
            ..SessionFilter::default()
        })
        .await
        .expect("page");
    assert_eq!(page.len(), 2);
    assert!(page[0].key < page[1].key, "a page is in key order");
    sessions_and_events_are_found_by_what_they_hold(store).await;
}

/// The console's and `/v1`'s search: sessions by text in the key (any case, `%` and `_` as
/// written), route and state; events by delivery id and the time they were received.
async fn sessions_and_events_are_found_by_what_they_hold(store: &Store) {
    for (id, route, session, delivery) in [
        ("find-1", "finders", "Acme/Web%1", "d-find-1"),
        ("find-2", "finders", "acme_web2", "d-find-2"),
        ("find-3", "others", "ACME-other", "d-find-3"),
    ] {
        let mut new = event(id, session, Some(delivery));
        new.event.route = route.to_string();
        assert_eq!(
            store.accept(new).await.expect("accept"),
            AcceptOutcome::Accepted
        );
    }
    let keys = |filter: SessionFilter| async move {
        let rows = store
            .sessions_page(SessionFilter {
                limit: 100,
                ..filter
            })
            .await
            .expect("sessions");
        rows.into_iter().map(|row| row.key).collect::<Vec<_>>()
    };
    let containing = |text: &str| SessionFilter {
        key_contains: Some(text.to_string()),
        ..SessionFilter::default()
    };
    assert_eq!(keys(containing("acme/WEB%")).await, ["Acme/Web%1"]);
    assert_eq!(keys(containing("e_w")).await, ["acme_web2"]);
    assert_eq!(
        keys(SessionFilter {
            route: Some("finders".into()),
            ..containing("ACME")
        })
        .await,
        ["Acme/Web%1", "acme_web2"]
    );
    let state = session_state(store, "acme_web2").await;
    let others = SessionState::ALL.into_iter().find(|other| *other != state);
    assert!(
        keys(SessionFilter {
            state: Some(state),
            ..containing("acme_web2")
        })
        .await
        .len()
            == 1
    );
    assert!(
        keys(SessionFilter {
            state: others,
            ..containing("acme_web2")
        })
        .await
        .is_empty()
    );

    let ids = |filter: EventFilter| async move {
        let rows = store
            .events(EventFilter {
                limit: 100,
                ..filter
            })
            .await
            .expect("events");
        rows.into_iter().map(|row| row.id).collect::<Vec<_>>()
    };
    let delivered = EventFilter {
        delivery_id: Some("d-find-2".into()),
        ..EventFilter::default()
    };
    assert_eq!(ids(delivered).await, ["find-2"]);
    let now = super::now_millis();
    let received = |since: i64, until: i64| EventFilter {
        route: Some("finders".into()),
        since: Some(since),
        until: Some(until),
        ..EventFilter::default()
    };
    let hour = 3_600_000;
    assert_eq!(
        ids(received(now - hour, now + hour)).await,
        ["find-2", "find-1"]
    );
    assert!(ids(received(now + hour, now + 2 * hour)).await.is_empty());
    assert!(ids(received(now - 2 * hour, now - hour)).await.is_empty());
    // Nothing is left for the next scenario to claim.
    let claimed = store.claim_turns(Claim::Beside(10)).await.expect("claim");
    assert_eq!(claimed.len(), 3, "{claimed:?}");
    for turn in &claimed {
        complete(store, turn).await;
    }
    assert_nothing_to_claim(store).await;
}

/// A row that does not read back is an error naming its column, never a panic.
async fn assert_undecodable(store: &Store, column: &str) {
    match store
        .events(EventFilter {
            limit: 100,
            ..EventFilter::default()
        })
        .await
    {
        Err(err @ StoreError::Decode { .. }) => {
            assert!(err.to_string().contains(column), "{err}");
            assert_eq!(err.kind(), ErrorKind::Broken);
        }
        other => panic!("expected a decode error, got {other:?}"),
    }
}

pub(in crate::store) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn sqlite_keeps_the_contract() {
    let dir = tempfile::tempdir().expect("tempdir");
    runtime().block_on(async {
        let store = Store::open(&StoreSettings::Sqlite, dir.path())
            .await
            .expect("open");
        // The next start marks every turn still running: nothing to do to crash.
        run_contract(&store, || {}).await;
        let database = dir.path().join("agentgate.db");
        let connection = rusqlite::Connection::open(database).expect("open");
        let backdate = |id: &str| {
            connection.execute(&backdate_sql(id), []).expect("backdate");
        };
        priority_goes_first_and_waiting_catches_up(&store, backdate).await;
        joined_events_end_with_their_turn(&store, backdate).await;
        let run = |sql: &str| {
            if !sql.starts_with("EXPLAIN") {
                connection.execute_batch(sql).expect("run");
                return String::new();
            }
            let mut statement = connection.prepare(sql).expect("explain");
            let steps = statement
                .query_map([], |row| row.get::<_, String>("detail"))
                .expect("plan");
            steps.map(|step| step.expect("step") + "\n").collect()
        };
        transcript::a_deep_transcript_is_read_from_its_end(
            &store,
            run,
            "EXPLAIN QUERY PLAN",
            "SEARCH t USING PRIMARY KEY (session_key=?)",
            None,
        )
        .await;
        // SQLite keeps a text in an INTEGER column as text: it no longer reads as a number.
        connection
            .execute("UPDATE events SET received_at = 'soon' WHERE id = 'e1'", [])
            .expect("update");
        assert_undecodable(&store, "received_at").await;
    });
}

#[test]
fn postgres_keeps_the_contract() {
    let Some(server) = postgres_server::Postgres::start("postgres_keeps_the_contract") else {
        return;
    };
    let settings = StoreSettings::Postgres(PostgresSettings {
        url: Secret::for_tests(server.url().as_bytes()),
        node: "contract".into(),
        lease_ttl: Duration::from_secs(30),
        pool_size: 4,
        ca_file: None,
    });
    runtime().block_on(async {
        let store = Store::open(&settings, std::path::Path::new("/nonexistent"))
            .await
            .expect("open");
        // Another node's leases expire: its turns were cut off by its crash.
        run_contract(&store, || {
            server.value(
                "UPDATE sessions SET lease_owner = 'dead-node', lease_expires_at = 0 \
                 WHERE state = 'running'",
            );
            // Its heartbeat no longer renews its budget reservations (they are the dead
            // node's: this store's own heartbeat, which keeps running, must not renew them).
            server.value("UPDATE budget_reservations SET expires_at = 0, node = 'dead-node'");
        })
        .await;
        let backdate = |id: &str| {
            server.value(&backdate_sql(id));
        };
        priority_goes_first_and_waiting_catches_up(&store, backdate).await;
        joined_events_end_with_their_turn(&store, backdate).await;
        transcript::a_deep_transcript_is_read_from_its_end(
            &store,
            |sql: &str| server.value(sql),
            "EXPLAIN",
            "Index Scan Backward using transcript_pkey on transcript t",
            Some(("node", "contract")),
        )
        .await;
        // A NULL where a value belongs (the column lost its constraint, say by hand).
        server.value("ALTER TABLE events ALTER COLUMN event_type DROP NOT NULL");
        server.value("UPDATE events SET event_type = NULL WHERE id = 'e1'");
        assert_undecodable(&store, "event_type").await;
        store.release().await;
    });
}
