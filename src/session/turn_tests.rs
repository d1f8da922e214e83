//! The turn state machine's cases, one decision each.

use super::super::transcript::unfinished_calls;
use super::*;
use serde_json::json;

fn machine(max_steps: u32) -> TurnMachine {
    let tools = BTreeMap::from([(
        "df".to_string(),
        schema::Parameters::compile(
            &json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
        ),
    )]);
    TurnMachine::new(max_steps, vec![Message::text(Role::User, "go")], tools)
}

fn call(id: &str, name: &str, arguments: &str) -> Message {
    Message::asking_for(id, name, arguments)
}

/// The mark of a recorded message, if it has one.
fn mark(action: &Action) -> Option<Mark> {
    match action {
        Action::Record(Entry::Message { mark, .. }) => *mark,
        Action::Record(_)
        | Action::CallModel { .. }
        | Action::RunTool { .. }
        | Action::AwaitApproval(_)
        | Action::Refused(_)
        | Action::Finish(_) => None,
    }
}

fn kinds(actions: &[Action]) -> Vec<&'static str> {
    actions
        .iter()
        .map(|a| match a {
            Action::Record(e) => e.kind(),
            Action::CallModel { last_step: false } => "call_model",
            Action::CallModel { last_step: true } => "last_call",
            Action::RunTool { .. } => "run_tool",
            Action::Finish(Outcome::Completed { .. }) => "completed",
            Action::Finish(Outcome::Failed { .. }) => "failed",
            Action::Finish(Outcome::NoFinalAnswer { .. }) => "no_answer",
            Action::Refused(_) => "refused",
            Action::AwaitApproval(_) => "await_approval",
        })
        .collect()
}

#[test]
fn tool_call_then_answer() {
    let mut m = machine(5);
    assert_eq!(m.start(), vec![Action::CallModel { last_step: false }]);
    let actions = m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
    assert_eq!(kinds(&actions), ["message", "tool_start", "run_tool"]);
    let actions = m.on(Input::ToolFinished {
        call_id: "c1".into(),
        result: "ok".into(),
    });
    assert_eq!(kinds(&actions), ["message", "call_model"]);
    let actions = m.on(Input::ModelReplied(Message::text(Role::Assistant, "done")));
    assert_eq!(kinds(&actions), ["message", "completed"]);
    assert_eq!(m.steps(), 2);
    assert_eq!(m.messages().len(), 4);
}

#[test]
fn unknown_tool_and_bad_arguments_become_tool_errors_the_model_sees() {
    let refused = |actions: &[Action]| -> Vec<(String, CallRefusal)> {
        actions
            .iter()
            .filter_map(|action| {
                let Action::Refused(r) = action else {
                    return None;
                };
                Some((r.tool.clone(), r.reason))
            })
            .collect()
    };
    let mut m = machine(5);
    let actions = m.on(Input::ModelReplied(call("c1", "rm_rf", "{}")));
    assert_eq!(
        kinds(&actions),
        ["message", "message", "refused", "call_model"]
    );
    assert_eq!(
        refused(&actions),
        [(NOT_OFFERED.to_string(), CallRefusal::UnknownTool)],
        "a name the model made up is no metric label"
    );
    assert!(
        m.messages()[2]
            .content
            .as_deref()
            .is_some_and(|c| c.contains(r#"tool "rm_rf" is not available"#))
    );
    // However long the made-up name, the model and the journal get a bounded quote of it.
    let long = format!("x{}\n", "y".repeat(100_000));
    let actions = machine(5).on(Input::ModelReplied(call("c1b", &long, "{}")));
    let Some(Action::Refused(refusal)) = actions.get(2) else {
        panic!("{actions:?}");
    };
    assert!(refusal.detail.len() < 300, "{}", refusal.detail);
    assert!(
        refusal.detail.contains("(100002 bytes)"),
        "{}",
        refusal.detail
    );
    let actions = m.on(Input::ModelReplied(call("c2", "df", "{not json")));
    assert_eq!(
        refused(&actions),
        [("df".to_string(), CallRefusal::NotJson)]
    );
    let actions = m.on(Input::ModelReplied(call("c3", "df", r#"{"path": 3}"#)));
    assert_eq!(
        kinds(&actions),
        ["message", "message", "refused", "call_model"]
    );
    assert_eq!(
        refused(&actions),
        [("df".to_string(), CallRefusal::InvalidArguments)]
    );
    assert!(
        m.messages()
            .last()
            .and_then(|x| x.content.clone())
            .is_some_and(|c| c.contains("not run") && c.contains("is not of type \"string\""))
    );
}

#[test]
fn empty_and_malformed_replies_are_recoverable_until_the_step_limit() {
    let mut m = machine(3);
    let actions = m.on(Input::ModelReplied(Message::text(Role::Assistant, "  ")));
    assert_eq!(kinds(&actions), ["message", "message", "call_model"]);
    assert_eq!(mark(&actions[0]), None, "the model's reply");
    assert_eq!(mark(&actions[1]), Some(Mark::Note));
    let actions = m.on(Input::ModelMalformed("not JSON".into()));
    // The third request is the turn's last: a note, and no call may be made.
    assert_eq!(kinds(&actions), ["message", "message", "last_call"]);
    let actions = m.on(Input::ModelMalformed("not JSON".into()));
    assert_eq!(kinds(&actions), ["message", "no_answer"]);
    assert!(
        matches!(actions.last(), Some(Action::Finish(Outcome::NoFinalAnswer { error, .. }))
            if error == "no final answer within max_turn_steps: not JSON"),
        "an unusable last reply says why: {actions:?}"
    );
}

#[test]
fn the_last_step_offers_no_tools_and_its_answer_ends_the_turn() {
    let mut m = machine(2);
    m.start();
    let actions = m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
    assert_eq!(kinds(&actions), ["message", "tool_start", "run_tool"]);
    let actions = m.on(Input::ToolFinished {
        call_id: "c1".into(),
        result: "42%".into(),
    });
    assert_eq!(kinds(&actions), ["message", "message", "last_call"]);
    assert_eq!(mark(&actions[0]), None, "the tool's result");
    assert_eq!(mark(&actions[1]), Some(Mark::LastStep));
    assert!(
        m.messages()
            .last()
            .and_then(|note| note.content.as_deref())
            .is_some_and(|note| note.contains("Last step of this turn"))
    );
    let actions = m.on(Input::ModelReplied(Message::text(
        Role::Assistant,
        "42% used",
    )));
    assert_eq!(kinds(&actions), ["message", "completed"]);
}

#[test]
fn a_last_reply_that_still_calls_tools_runs_none_and_each_call_gets_a_result() {
    let mut m = machine(1);
    assert_eq!(kinds(&m.start()), ["message", "last_call"]);
    let actions = m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
    assert_eq!(
        kinds(&actions),
        ["message", "message", "refused", "no_answer"]
    );
    assert!(
        matches!(&actions[2], Action::Refused(r) if r.reason == CallRefusal::LastStep && r.tool == "df")
    );
    assert_eq!(
        m.messages().last().and_then(|r| r.tool_call_id.as_deref()),
        Some("c1")
    );
}

/// The step limit reached with only tool calls (structured, or written as text of any tool),
/// or with nothing, is no answer: the turn fails with what its tools found, and never completes
/// with the reply. Text beside a call is an answer; the call still does not run.
#[test]
fn a_last_step_without_an_answer_fails_with_what_the_tools_found() {
    let last_replies = [
        ("structured", call("c9", "df", r#"{"path":"/"}"#)),
        (
            "written",
            Message::text(
                Role::Assistant,
                "```json\n{\"name\": \"df\", \"arguments\": {\"path\": \"/\"}}\n```",
            ),
        ),
        (
            "unknown tool",
            Message::text(Role::Assistant, r#"{"name": "du", "arguments": {}}"#),
        ),
        ("empty", Message::text(Role::Assistant, " ")),
    ];
    for (case, last) in last_replies {
        let mut m = machine(2).turn_starts_at(0);
        m.start();
        m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
        m.on(Input::ToolFinished {
            call_id: "c1".into(),
            result: r#"{"stdout":"/dev/sda1 93%"}"#.into(),
        });
        let actions = m.on(Input::ModelReplied(last));
        let Some(Action::Finish(Outcome::NoFinalAnswer { error, found, why })) = actions.last()
        else {
            panic!("{case}: {actions:?}");
        };
        assert_eq!(error, NO_FINAL_ANSWER, "{case}");
        let found = found.as_deref().unwrap_or_default();
        assert!(found.contains(NO_FINAL_ANSWER), "{case}: {found}");
        assert!(
            found.contains(r#"- df({"path":"/"}): {"stdout":"/dev/sda1 93%"}"#),
            "{case}: {found}"
        );
        assert!(!found.contains("not run"), "{case}: {found}");
        assert!(why.contains("max_turn_steps = 2"), "{case}: {why}");
        assert_eq!(
            Outcome::NoFinalAnswer {
                error: error.clone(),
                why: why.clone(),
                found: None
            }
            .statuses(None),
            (TurnStatus::Failed, Terminal::Failed)
        );
    }

    let mut m = machine(1);
    m.start();
    let mut reply = call("c1", "df", r#"{"path":"/"}"#);
    reply.content = Some("The disk is 93% full.".into());
    let actions = m.on(Input::ModelReplied(reply));
    assert_eq!(
        kinds(&actions),
        ["message", "message", "refused", "completed"]
    );
}

/// Only this turn's tool results are what it found: the history's are not, and each result is
/// cut, so the delivery stays bounded.
#[test]
fn what_a_turn_found_is_its_own_and_bounded() {
    let history = vec![
        Message::text(Role::User, "old event"),
        call("old", "df", r#"{"path":"/old"}"#),
        Message::tool_result("old", "from an earlier turn"),
        Message::text(Role::User, "new event"),
    ];
    let tools = BTreeMap::from([(
        "df".to_string(),
        schema::Parameters::compile(&json!({"type": "object"})),
    )]);
    let mut m = TurnMachine::new(2, history, tools).turn_starts_at(3);
    m.start();
    m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
    m.on(Input::ToolFinished {
        call_id: "c1".into(),
        result: "x".repeat(100_000),
    });
    let actions = m.on(Input::ModelReplied(Message::text(Role::Assistant, "")));
    let Some(Action::Finish(Outcome::NoFinalAnswer {
        found: Some(found), ..
    })) = actions.last()
    else {
        panic!("{actions:?}");
    };
    assert!(!found.contains("earlier turn"), "{found}");
    assert!(found.len() < FOUND_RESULT_MAX + 300, "{}", found.len());
    assert!(found.contains("more bytes]"), "{found}");
}

#[test]
fn an_identical_call_past_the_limit_is_not_run() {
    let mut m = machine(10).limit_repeated_calls(2);
    m.start();
    for n in 0..2 {
        let id = format!("c{n}");
        let actions = m.on(Input::ModelReplied(call(&id, "df", r#"{"path":"/"}"#)));
        assert_eq!(
            kinds(&actions),
            ["message", "tool_start", "run_tool"],
            "call {n}"
        );
        m.on(Input::ToolFinished {
            call_id: id,
            result: "42%".into(),
        });
    }
    // The same arguments written differently are the same call.
    let actions = m.on(Input::ModelReplied(call("c2", "df", r#"{ "path" : "/" }"#)));
    assert_eq!(
        kinds(&actions),
        ["message", "message", "refused", "call_model"]
    );
    assert!(matches!(&actions[2], Action::Refused(r) if r.reason == CallRefusal::Repeated));
    let actions = m.on(Input::ModelReplied(call("c3", "df", r#"{"path":"/var"}"#)));
    assert_eq!(kinds(&actions), ["message", "tool_start", "run_tool"]);
}

#[test]
fn a_reply_runs_at_most_the_limit_of_tool_calls() {
    let mut m = machine(5).limit_tool_calls(2);
    let reply = Message {
        tool_calls: (0..5)
            .flat_map(|n| call(&format!("c{n}"), "df", r#"{"path":"/"}"#).tool_calls)
            .collect(),
        ..call("x", "df", "{}")
    };
    let actions = m.on(Input::ModelReplied(reply));
    let told = actions
        .iter()
        .filter(|action| {
            matches!(action, Action::Record(Entry::Message { message, .. })
                if message.content.as_deref().is_some_and(|c| c.contains("max_tool_calls_per_reply")))
        })
        .count();
    assert_eq!(told, 3);
    let refused = actions
        .iter()
        .filter(|action| {
            matches!(action, Action::Refused(r) if r.reason == CallRefusal::TooManyInReply)
        })
        .count();
    assert_eq!(refused, 3, "each call not run is logged and counted");
    let mut ran = actions
        .iter()
        .filter(|action| matches!(action, Action::RunTool { .. }))
        .count();
    for n in 0..2 {
        ran += m
            .on(Input::ToolFinished {
                call_id: format!("c{n}"),
                result: "ok".into(),
            })
            .iter()
            .filter(|action| matches!(action, Action::RunTool { .. }))
            .count();
    }
    assert_eq!(ran, 2);
}

#[test]
fn step_limit_stops_a_model_that_only_calls_tools() {
    let mut m = machine(1);
    m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
    let actions = m.on(Input::ToolFinished {
        call_id: "c1".into(),
        result: "ok".into(),
    });
    assert!(
        matches!(actions.last(), Some(Action::Finish(Outcome::NoFinalAnswer { why, .. })) if why.contains("max_turn_steps"))
    );
}

#[test]
fn resume_settles_unfinished_calls_without_rerunning_side_effects() {
    let transcript = vec![
        Entry::message(Message::text(Role::User, "go")),
        Entry::message(Message {
            tool_calls: [
                call("a", "df", r#"{"path":"/"}"#),
                call("b", "restart", "{}"),
                call("c", "df", r#"{"path":"/x"}"#),
            ]
            .into_iter()
            .flat_map(|m| m.tool_calls)
            .collect(),
            ..call("x", "df", "{}")
        }),
        Entry::ToolStart {
            call_id: "a".into(),
            name: "df".into(),
            arguments: json!({"path": "/"}),
            key: Some("t0.1".into()),
            mcp_server: None,
        },
        Entry::message(Message::tool_result("a", "ok")),
        Entry::ToolStart {
            call_id: "b".into(),
            name: "restart".into(),
            arguments: json!({}),
            key: Some("t0.2".into()),
            mcp_server: None,
        },
    ];
    let unfinished = unfinished_calls(&transcript);
    let names: Vec<_> = unfinished
        .iter()
        .map(|c| (c.call_id.as_str(), c.started))
        .collect();
    assert_eq!(names, [("b", true), ("c", false)]);

    let mut m = machine(5);
    m.tools.insert(
        "restart".into(),
        schema::Parameters::compile(&json!({"type": "object"})),
    );
    let note = Message::text(Role::User, "continue");
    let actions = m.start_resumed(unfinished, |name| name == "df", Some(note));
    // b (started, not idempotent): recorded as interrupted; c (never started): runs.
    assert_eq!(kinds(&actions), ["message", "tool_start", "run_tool"]);
    assert!(
        matches!(&actions[0], Action::Record(Entry::Message { message, .. })
        if message.content.as_deref().is_some_and(|c| c.contains("interrupted") && c.contains("unknown")))
    );
    let actions = m.on(Input::ToolFinished {
        call_id: "c".into(),
        result: "ok".into(),
    });
    // The note comes after every tool result, right before the model is asked again.
    assert_eq!(kinds(&actions), ["message", "message", "call_model"]);
    assert_eq!(mark(&actions[1]), Some(Mark::Resumed));
    assert_eq!(
        m.messages()
            .last()
            .and_then(|x| x.content.clone())
            .as_deref(),
        Some("continue")
    );
}

#[test]
fn resume_reruns_a_started_idempotent_call_with_its_key() {
    let unfinished = vec![UnfinishedCall {
        call_id: "a".into(),
        name: "df".into(),
        arguments: r#"{"path":"/"}"#.into(),
        started: true,
        key: Some("t0.3".into()),
    }];
    let mut m = machine(5).call_keys("t1");
    let actions = m.start_resumed(
        unfinished,
        |_| true,
        Some(Message::text(Role::User, "go on")),
    );
    assert_eq!(kinds(&actions), ["tool_start", "run_tool"]);
    assert!(matches!(&actions[1], Action::RunTool { key, .. } if key == "t0.3"));
}

#[test]
fn every_new_call_gets_its_own_key_and_mcp_calls_name_their_server() {
    let mut m = machine(5)
        .call_keys("turn-9")
        .mcp_servers(BTreeMap::from([("df".to_string(), "disks".to_string())]));
    m.start();
    let reply = Message {
        tool_calls: [
            call("same", "df", r#"{"path":"/"}"#),
            call("same", "df", r#"{"path":"/x"}"#),
        ]
        .into_iter()
        .flat_map(|m| m.tool_calls)
        .collect(),
        ..call("x", "df", "{}")
    };
    let mut actions = m.on(Input::ModelReplied(reply));
    actions.extend(m.on(Input::ToolFinished {
        call_id: "same".into(),
        result: "ok".into(),
    }));
    let keys: Vec<&str> = actions
        .iter()
        .filter_map(|action| {
            let Action::RunTool { key, .. } = action else {
                return None;
            };
            Some(key.as_str())
        })
        .collect();
    assert_eq!(keys, ["turn-9.1", "turn-9.2"]);
    assert!(actions.iter().any(|action| matches!(action,
        Action::Record(Entry::ToolStart { mcp_server: Some(server), .. }) if server == "disks")));
}

#[test]
fn unavailable_model_fails_the_turn() {
    let mut m = machine(3);
    let actions = m.on(Input::ModelUnavailable("down".into()));
    assert_eq!(
        actions,
        vec![Action::Finish(Outcome::Failed {
            error: "down".into()
        })]
    );
}

fn decision(call_id: &str, status: ApprovalStatus, target: &str) -> ApprovalEntry {
    ApprovalEntry {
        approval_id: format!("ap-{call_id}"),
        call_id: call_id.into(),
        tool: "df".into(),
        arguments: json!({"path": target}),
        status,
        by: Some("alice".into()),
        note: Some("not now".into()),
        expires_at: 0,
    }
}

fn gated(decided: Vec<ApprovalEntry>) -> TurnMachine {
    machine(6).approvals(BTreeSet::from(["df".to_string()]), decided)
}

fn unfinished(call_id: &str, target: &str) -> UnfinishedCall {
    UnfinishedCall {
        call_id: call_id.into(),
        name: "df".into(),
        arguments: json!({"path": target}).to_string(),
        started: false,
        key: None,
    }
}

/// A gated call pauses the turn; a decision lets exactly the call it was taken on run (same
/// id, tool and arguments), once, when the turn continues; a denial or expiry is a result
/// the model sees; and a new call of the tool asks again.
#[test]
fn a_gated_call_waits_and_only_its_own_decision_lets_it_run() {
    let mut m = gated(Vec::new());
    let actions = m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
    assert_eq!(kinds(&actions), ["message", "await_approval"]);

    let approved = vec![decision("c1", ApprovalStatus::Approved, "/")];
    let mut m = gated(approved.clone());
    let actions = m.start_resumed(vec![unfinished("c1", "/")], |_| false, None);
    assert_eq!(kinds(&actions), ["tool_start", "run_tool"]);
    let actions = m.on(Input::ToolFinished {
        call_id: "c1".into(),
        result: "ok".into(),
    });
    assert_eq!(kinds(&actions), ["message", "call_model"]);
    let actions = m.on(Input::ModelReplied(call("c1", "df", r#"{"path":"/"}"#)));
    assert_eq!(
        kinds(&actions),
        ["message", "await_approval"],
        "the same call again needs a decision of its own"
    );

    let mut m = gated(approved);
    let actions = m.start_resumed(vec![unfinished("c1", "/etc")], |_| false, None);
    assert_eq!(
        kinds(&actions),
        ["await_approval"],
        "a decision on other arguments does not count"
    );

    for (status, says) in [
        (
            ApprovalStatus::Denied,
            "denied by operator (alice): not now",
        ),
        (ApprovalStatus::Expired, "expired"),
    ] {
        let mut m = gated(vec![decision("c1", status, "/")]);
        let actions = m.start_resumed(vec![unfinished("c1", "/")], |_| false, None);
        assert_eq!(kinds(&actions), ["message", "refused", "call_model"]);
        assert!(
            matches!(&actions[0], Action::Record(Entry::Message { message, .. })
                if message.content.as_deref().is_some_and(|c| c.contains(says))),
            "{actions:?}"
        );
    }
}

/// Two identical gated calls under one id in one reply: the decision taken on the first lets
/// only the first run; the second, renumbered, asks for a decision of its own.
#[test]
fn one_approval_runs_one_call_when_a_reply_repeats_an_id() {
    let mut m = gated(vec![decision("c1", ApprovalStatus::Approved, "/")]);
    m.start();
    let reply = Message {
        tool_calls: [
            call("c1", "df", r#"{"path":"/"}"#),
            call("c1", "df", r#"{"path":"/"}"#),
        ]
        .into_iter()
        .flat_map(|m| m.tool_calls)
        .collect(),
        ..call("x", "df", "{}")
    };
    let actions = m.on(Input::ModelReplied(reply));
    assert_eq!(kinds(&actions), ["message", "tool_start", "run_tool"]);
    assert!(
        matches!(&actions[0], Action::Record(Entry::Message { message, .. })
            if message.tool_calls.iter().map(|c| c.id.as_str()).eq(["c1", "c1-2"])),
        "{actions:?}"
    );
    let actions = m.on(Input::ToolFinished {
        call_id: "c1".into(),
        result: "ok".into(),
    });
    assert_eq!(kinds(&actions), ["message", "await_approval"]);
}
