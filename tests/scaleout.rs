//! Several agentgate nodes on one PostgreSQL: every event processed once with sessions never
//! overlapping, failover after kill -9 and after SIGTERM, 503 while the database is down, and a
//! crash-looping session suspended after `resume_max_attempts` resumes cluster-wide; a daily
//! budget that holds with turns running at once on every node, and a killed node's budget
//! reservations that expire.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::postgres::Postgres;
use common::stub::{Received, Reply, Stub};
use common::{Daemon, Workspace, wait_until};

const LIMIT: Duration = Duration::from_secs(60);

/// One node: its own config and state directory, sharing the cluster's database.
struct Node {
    workspace: Workspace,
    daemon: Option<Daemon>,
    name: String,
}

impl Node {
    fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("the node runs")
    }
}

struct Cluster {
    pg: Postgres,
    nodes: Vec<Node>,
}

/// Node settings beyond the store: `[runtime]` lines and extra tools.
struct Shape<'a> {
    nodes: usize,
    lease_ttl: &'a str,
    /// `[runtime] max_concurrent_turns` of each node.
    turns: usize,
    runtime: &'a str,
    /// More `[model]` lines.
    model: &'a str,
    /// Tables after the tools (`[budgets]`).
    tables: &'a str,
    tools: &'a str,
    route_tools: &'a str,
    on_busy: &'a str,
    deliver: &'a str,
    /// Appended to the database URL (e.g. `?sslmode=require`).
    url_suffix: &'a str,
    /// More `[store]` lines.
    store: &'a str,
    /// Each node's database URL, where it is not the server's own (a proxy in between).
    urls: &'a [String],
}

impl<'a> Shape<'a> {
    fn new(nodes: usize, lease_ttl: &'a str) -> Shape<'a> {
        Shape {
            nodes,
            lease_ttl,
            turns: 4,
            runtime: "",
            model: "",
            tables: "",
            tools: "",
            route_tools: "",
            on_busy: "queue",
            deliver: r#"{ kind = "log" }"#,
            url_suffix: "",
            store: "",
            urls: &[],
        }
    }
}

impl Cluster {
    fn start(test: &str, model: &Stub, shape: &Shape<'_>) -> Option<Cluster> {
        Some(Cluster::start_on(Postgres::start(test)?, model, shape))
    }

    fn start_on(pg: Postgres, model: &Stub, shape: &Shape<'_>) -> Cluster {
        let mut nodes = Vec::new();
        for index in 0..shape.nodes {
            let workspace = Workspace::new();
            let name = format!("node-{index}");
            let url_file = workspace.path().join("pg-url");
            let url = shape.urls.get(index).cloned().unwrap_or_else(|| pg.url());
            std::fs::write(&url_file, format!("{url}{}\n", shape.url_suffix))
                .expect("write the URL");
            workspace.write_config(&format!(
                r#"[runtime]
max_concurrent_turns = {turns}
drain_timeout = "1s"
{runtime}

[store]
backend = "postgres"
url = {{ file = "{url_file}" }}
node = "{name}"
lease_ttl = "{ttl}"
{store}

{model}{model_extra}
{tools}
{tables}

[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
prompt = "task {{{{ payload.task }}}} of {{{{ payload.session }}}}"
tools = [{route_tools}]
on_busy = "{on_busy}"
deliver = {deliver}
"#,
                turns = shape.turns,
                runtime = shape.runtime,
                model_extra = shape.model,
                tables = shape.tables,
                url_file = url_file.display(),
                ttl = shape.lease_ttl,
                store = shape.store,
                model = model.model_section(),
                tools = shape.tools,
                route_tools = shape.route_tools,
                on_busy = shape.on_busy,
                deliver = shape.deliver,
            ));
            let daemon = workspace.start();
            nodes.push(Node {
                workspace,
                daemon: Some(daemon),
                name,
            });
        }
        Cluster { pg, nodes }
    }

    fn post(&self, node: usize, session: &str, task: &str) -> String {
        let body = serde_json::json!({"session": session, "task": task}).to_string();
        let response = self.nodes[node].daemon().post_json("/hook", &[], &body);
        assert_eq!(response.status, 202, "node {node}: {:?}", response.body);
        response.event_id()
    }

    fn event_status(&self, id: &str) -> String {
        self.pg
            .value(&format!("SELECT status FROM events WHERE id = '{id}'"))
    }

    fn count(&self, sql: &str) -> i64 {
        self.pg.value(sql).parse().expect("a count")
    }

    fn wait_all_terminal(&self, expected: i64, limit: Duration) {
        wait_until(&format!("{expected} events to end"), limit, || {
            self.count(
                "SELECT count(*) FROM events WHERE status IN ('completed', 'failed', 'abandoned', 'suspended')",
            ) == expected
        });
    }

    /// The node index running `session`'s turn now, once it runs.
    fn wait_running_node(&self, session: &str) -> usize {
        let mut owner = None;
        wait_until(&format!("{session} to run"), LIMIT, || {
            owner = self
                .pg
                .rows(&format!(
                    "SELECT node FROM turns WHERE session_key = '{session}' AND status = 'running'"
                ))
                .pop()
                .and_then(|row| row.first().cloned());
            owner.is_some()
        });
        let owner = owner.unwrap_or_default();
        self.nodes
            .iter()
            .position(|node| node.name == owner)
            .expect("the owner is a node of the cluster")
    }

    /// (status, reason, node) of each turn of `session`, in order.
    fn turns_of(&self, session: &str) -> Vec<(String, String, String)> {
        self.pg
            .rows(&format!(
                "SELECT status, COALESCE(reason, '-'), node FROM turns
                 WHERE session_key = '{session}' ORDER BY started_at"
            ))
            .into_iter()
            .map(|row| (row[0].clone(), row[1].clone(), row[2].clone()))
            .collect()
    }
}

fn mentions(request: &Received, text: &str) -> bool {
    String::from_utf8_lossy(&request.body).contains(text)
}

#[test]
fn three_nodes_process_every_event_once_and_never_overlap_a_session() {
    let model = Stub::start(|_, _| Reply::answer("done").after(Duration::from_millis(30)));
    let shape = Shape::new(3, "5s");
    let Some(cluster) = Cluster::start("three_nodes", &model, &shape) else {
        return;
    };
    let (sessions, per_session) = (15, 6);
    for round in 0..per_session {
        for session in 0..sessions {
            let node = (round * sessions + session) % cluster.nodes.len();
            cluster.post(node, &format!("s{session}"), &format!("t{round}"));
        }
    }
    let total = (sessions * per_session) as i64;
    cluster.wait_all_terminal(total, LIMIT);

    assert_eq!(
        cluster.count("SELECT count(*) FROM events WHERE status = 'completed'"),
        total
    );
    assert_eq!(
        cluster.count(
            "SELECT count(*) FROM (SELECT e.id FROM events e LEFT JOIN turns t ON t.event_id = e.id
             GROUP BY e.id HAVING count(t.id) <> 1) x"
        ),
        0,
        "every event ran exactly one turn"
    );
    // Per session, turns follow the events' arrival order and never overlap.
    let turns = cluster.pg.rows(
        "SELECT t.session_key, t.started_at, t.finished_at, e.seq FROM turns t
         JOIN events e ON e.id = t.event_id ORDER BY t.session_key, t.started_at",
    );
    for pair in turns.windows(2) {
        let (previous, next) = (&pair[0], &pair[1]);
        if previous[0] != next[0] {
            continue;
        }
        let ended: i64 = previous[2].parse().expect("finished_at");
        let started: i64 = next[1].parse().expect("started_at");
        assert!(
            started >= ended,
            "session {} overlaps: a turn started at {started}, the previous ended at {ended}",
            next[0]
        );
        let (earlier, later): (i64, i64) = (
            previous[3].parse().expect("seq"),
            next[3].parse().expect("seq"),
        );
        assert!(later > earlier, "session {} ran out of order", next[0]);
    }
    let spread = cluster.count("SELECT count(DISTINCT node) FROM turns");
    assert!(spread >= 2, "turns ran on {spread} node(s)");
    wait_until("every result to be delivered", LIMIT, || {
        cluster.count("SELECT count(*) FROM deliveries WHERE status = 'delivered'") == total
    });

    // A delivery id accepted by one node is a duplicate on another.
    let key = [("idempotency-key", "delivery-42")];
    let body = r#"{"session": "dedup", "task": "once"}"#;
    let first = cluster.nodes[0].daemon().post_json("/hook", &key, body);
    assert_eq!(first.status, 202);
    let again = cluster.nodes[1].daemon().post_json("/hook", &key, body);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["status"], "duplicate");
    assert_eq!(again.json()["event_id"], first.json()["event_id"]);

    // `status` on any node shows every node.
    let status = cluster.nodes[2].workspace.status();
    let nodes = status["nodes"].as_array().expect("nodes in status");
    let running: Vec<&str> = nodes
        .iter()
        .filter(|node| node["state"] == "running")
        .filter_map(|node| node["name"].as_str())
        .collect();
    assert_eq!(running, ["node-0", "node-1", "node-2"], "{status:#}");
    assert_eq!(status["events"]["total"], total + 1);

    // Operator commands act on the shared database from any node.
    let suspend = cluster.nodes[0]
        .workspace
        .cli(&["sessions", "suspend", "s0"]);
    assert!(suspend.status.success(), "{suspend:?}");
    let held = cluster.post(1, "s0", "held");
    let shown = cluster.nodes[2].workspace.session_json("s0");
    assert_eq!(shown["session"]["state"], "suspended", "{shown:#}");
    assert_eq!(cluster.event_status(&held), "queued");
    let resume = cluster.nodes[1]
        .workspace
        .cli(&["sessions", "resume", "s0"]);
    assert!(resume.status.success(), "{resume:?}");
    cluster.wait_all_terminal(total + 2, LIMIT);
    let ledger = cluster.nodes[2]
        .workspace
        .cli(&["ledger", "show", "--json"]);
    assert!(ledger.status.success(), "{ledger:?}");
    let ledger: serde_json::Value = serde_json::from_slice(&ledger.stdout).expect("JSON");
    assert_eq!(ledger["version"], 1);
}

/// A model whose first call for a `slow` task hangs for `hang` (its node is killed, stopped or
/// frozen meanwhile); every other call answers at once.
struct HangingModel {
    stub: Stub,
    /// Set once the hanging call arrived: the turn is inside its model call.
    hung: Arc<AtomicBool>,
    /// When the second `slow` call (the resumed turn's) arrived.
    resumed_at: Arc<Mutex<Option<Instant>>>,
}

impl HangingModel {
    fn start(hang: Duration) -> HangingModel {
        let hung = Arc::new(AtomicBool::new(false));
        let resumed_at = Arc::new(Mutex::new(None));
        let (first, seen) = (hung.clone(), resumed_at.clone());
        let stub = Stub::start(move |request, _| {
            if !mentions(request, "slow") {
                return Reply::answer("done");
            }
            if !first.swap(true, Ordering::SeqCst) {
                return Reply::answer("too late").after(hang);
            }
            if let Ok(mut at) = seen.lock() {
                at.get_or_insert_with(Instant::now);
            }
            Reply::answer("finished after the takeover")
        });
        HangingModel {
            stub,
            hung,
            resumed_at,
        }
    }

    /// The node running `session`, once its turn is inside the hanging model call.
    fn wait_hanging(&self, cluster: &Cluster, session: &str) -> usize {
        wait_until("the model call to hang", LIMIT, || {
            self.hung.load(Ordering::SeqCst)
        });
        cluster.wait_running_node(session)
    }

    fn resumed_since(&self, start: Instant) -> Duration {
        self.resumed_at
            .lock()
            .ok()
            .and_then(|at| *at)
            .map(|at| at.duration_since(start))
            .expect("the resumed turn called the model")
    }
}

#[test]
fn a_killed_nodes_turn_is_resumed_by_another_within_the_lease() {
    // bench/scaleout.sh varies the lease to measure failover times.
    let lease_text = std::env::var("SCALEOUT_LEASE_TTL").unwrap_or_else(|_| "2s".into());
    let lease = humantime::parse_duration(&lease_text).expect("SCALEOUT_LEASE_TTL is a duration");
    let model = HangingModel::start(Duration::from_secs(40));
    let shape = Shape::new(3, &lease_text);
    let Some(mut cluster) = Cluster::start("kill9_failover", &model.stub, &shape) else {
        return;
    };
    let victim = cluster.post(0, "victim", "slow");
    let mut others = Vec::new();
    for index in 0..12 {
        others.push(cluster.post(index % 3, &format!("other-{index}"), "quick"));
    }
    let owner = model.wait_hanging(&cluster, "victim");
    // `status` on another node names the owner's lease.
    let status = cluster.nodes[(owner + 1) % 3].workspace.status();
    let listed = status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|node| node["name"] == cluster.nodes[owner].name.as_str())
        .expect("the owner is listed");
    assert!(
        listed["leases"]
            .as_array()
            .is_some_and(|leases| leases.iter().any(|key| key == "victim")),
        "{status:#}"
    );
    let killed_at = Instant::now();
    if let Some(daemon) = cluster.nodes[owner].daemon.take() {
        daemon.kill9();
    }
    cluster.wait_all_terminal(13, lease + Duration::from_secs(30));
    let failover = model.resumed_since(killed_at);
    // The lease was last renewed up to 1 s before the kill; after its expiry come at most one
    // sweep interval (≤ 1 s) and the claim: a margin of 4 s.
    assert!(
        failover + Duration::from_secs(1) >= lease && failover <= lease + Duration::from_secs(4),
        "failover took {failover:?} with a {lease_text} lease"
    );
    assert_eq!(cluster.event_status(&victim), "completed");
    for id in &others {
        assert_eq!(cluster.event_status(id), "completed");
    }
    let turns = cluster.turns_of("victim");
    assert_eq!(turns.len(), 2, "{turns:?}");
    assert_eq!(
        (turns[0].0.as_str(), turns[0].1.as_str()),
        ("interrupted", "crashed")
    );
    assert_eq!(turns[0].2, cluster.nodes[owner].name);
    assert_eq!(turns[1].0, "completed");
    assert_ne!(turns[1].2, cluster.nodes[owner].name);
    // The completed resume cleared its count.
    assert_eq!(cluster.count("SELECT count(*) FROM resume_ledger"), 0);
    eprintln!("failover after kill -9 with lease_ttl {lease_text}: {failover:?}");
}

#[test]
fn a_draining_node_hands_its_sessions_over_without_waiting_for_the_lease() {
    let model = HangingModel::start(Duration::from_secs(40));
    let shape = Shape::new(2, "60s");
    let Some(mut cluster) = Cluster::start("sigterm_handover", &model.stub, &shape) else {
        return;
    };
    let victim = cluster.post(0, "victim", "slow");
    let owner = model.wait_hanging(&cluster, "victim");
    let stopped_at = Instant::now();
    let status = cluster.nodes[owner]
        .daemon
        .take()
        .map(Daemon::terminate)
        .expect("the owner runs");
    assert!(status.success(), "the drained node exits 0: {status}");
    cluster.wait_all_terminal(1, Duration::from_secs(20));
    let handover = model.resumed_since(stopped_at);
    assert!(
        handover < Duration::from_secs(10),
        "handover took {handover:?}; the lease is 60s"
    );
    assert_eq!(cluster.event_status(&victim), "completed");
    let turns = cluster.turns_of("victim");
    assert_eq!(turns.len(), 2, "{turns:?}");
    assert_eq!(
        (turns[0].0.as_str(), turns[0].1.as_str()),
        ("interrupted", "shutdown_timeout")
    );
    assert_eq!(turns[1].0, "completed");
    assert_ne!(turns[1].2, cluster.nodes[owner].name);
    eprintln!("handover after SIGTERM (drain_timeout 1s): {handover:?}");
}

/// Two nodes on one database, 16 turns at once on each, one `daily_tokens` budget: what
/// requests in flight on either node may spend is reserved before they are sent, so the day
/// ends within the documented bound (the limit and one reply, reference.md "Budgets"); the
/// events past it end `failed` ("budget exceeded: budgets.daily_tokens ...") and every result
/// is delivered.
#[test]
fn a_daily_budget_holds_with_turns_running_at_once_on_two_nodes() {
    let largest_reply = Arc::new(AtomicU64::new(0));
    let largest = largest_reply.clone();
    // Each reply reports a token for every two bytes of its request and 50 of its own, and
    // takes a while, so that the turns' requests overlap on both nodes.
    let model = Stub::start(move |request, _| {
        let prompt = request.body.len() as u64 / 2;
        largest.fetch_max(prompt + 50, Ordering::SeqCst);
        Reply::answer("looked into it")
            .with_usage(prompt, 0, 50)
            .after(Duration::from_millis(300))
    });
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let deliver = format!(r#"{{ kind = "http", url = "{}/results" }}"#, receiver.url());
    let shape = Shape {
        turns: 16,
        model: "params = { max_tokens = 60 }\n",
        tables: "[budgets]\ndaily_tokens = 5000\n",
        deliver: &deliver,
        ..Shape::new(2, "5s")
    };
    let Some(cluster) = Cluster::start("budget_two_nodes", &model, &shape) else {
        return;
    };
    let events: Vec<String> = std::thread::scope(|scope| {
        let posting: Vec<_> = (0..32)
            .map(|n| {
                let cluster = &cluster;
                scope.spawn(move || cluster.post(n % 2, &format!("s{n}"), "look"))
            })
            .collect();
        posting
            .into_iter()
            .map(|thread| thread.join().expect("posted"))
            .collect()
    });
    wait_until("every result to be delivered", LIMIT, || {
        receiver.requests().len() >= events.len()
    });
    let mut ended = std::collections::BTreeMap::<String, usize>::new();
    for request in receiver.requests() {
        let result = request.json();
        let status = result["status"].as_str().unwrap_or_default().to_string();
        if status == "failed" {
            let error = result["error"].as_str().unwrap_or_default();
            assert!(
                error.starts_with("budget exceeded: budgets.daily_tokens"),
                "{result}"
            );
        }
        *ended.entry(status).or_default() += 1;
    }
    assert_eq!(ended.values().sum::<usize>(), events.len(), "{ended:?}");
    assert!(ended.get("completed").is_some_and(|n| *n > 0), "{ended:?}");
    assert!(ended.get("failed").is_some_and(|n| *n > 0), "{ended:?}");
    // Both nodes took turns. Which of them got their requests under the budget first is a
    // race (a reservation holds the size of a whole request), so it is not asserted.
    let spread = cluster.count("SELECT count(DISTINCT node) FROM turns");
    assert_eq!(spread, 2, "turns ran on both nodes");
    let usage = cluster.nodes[1].workspace.cli_json(&["usage", "--json"]);
    let spent = usage["total"]["input_tokens"].as_u64().unwrap_or(0)
        + usage["total"]["output_tokens"].as_u64().unwrap_or(0);
    let bound = 5000 + largest_reply.load(Ordering::SeqCst);
    assert!(
        spent <= bound,
        "32 turns at once on two nodes spent {spent} tokens of a 5000 budget (bound {bound}): {ended:?}"
    );
    assert_eq!(
        cluster.count("SELECT count(*) FROM budget_reservations"),
        0,
        "every reservation was settled or dropped"
    );
    eprintln!("two nodes, 32 turns at once: {spent} tokens of 5000 (bound {bound}): {ended:?}");
}

/// A node killed -9 inside a model request leaves its budget reservation behind: it expires
/// with the node's lease, so it does not hold the budget forever, and the turn resumed on
/// another node (and an event sent there meanwhile) run.
#[test]
fn a_killed_nodes_budget_reservations_expire_with_its_lease() {
    let model = HangingModel::start(Duration::from_secs(40));
    // Without max_tokens a request reserves 4,096 tokens for its reply: the hanging request
    // alone holds more than the whole budget.
    let shape = Shape {
        tables: "[budgets]\ndaily_tokens = 1000\n",
        ..Shape::new(2, "2s")
    };
    let Some(mut cluster) = Cluster::start("budget_kill9", &model.stub, &shape) else {
        return;
    };
    let victim = cluster.post(0, "victim", "slow");
    let owner = model.wait_hanging(&cluster, "victim");
    let held_by_owner = format!(
        "SELECT count(*) FROM budget_reservations r JOIN nodes n ON n.id = r.node
         WHERE n.name = '{}'",
        cluster.nodes[owner].name
    );
    assert_eq!(
        cluster.count(&held_by_owner),
        1,
        "the hanging request is reserved"
    );
    if let Some(daemon) = cluster.nodes[owner].daemon.take() {
        daemon.kill9();
    }
    let after = cluster.post(1 - owner, "after", "quick");
    cluster.wait_all_terminal(2, LIMIT);
    assert_eq!(cluster.event_status(&victim), "completed");
    assert_eq!(cluster.event_status(&after), "completed");
    assert_eq!(
        cluster.count(&held_by_owner),
        0,
        "the dead node's reservation expired"
    );
}

#[test]
fn with_postgres_down_every_node_answers_503_and_recovers() {
    let model = Stub::start(|_, _| Reply::answer("done"));
    let shape = Shape::new(2, "2s");
    let Some(mut cluster) = Cluster::start("postgres_down", &model, &shape) else {
        return;
    };
    let mut acknowledged = Vec::new();
    for index in 0..10 {
        acknowledged.push(cluster.post(index % 2, &format!("before-{index}"), "quick"));
    }
    cluster.pg.stop();
    for node in &cluster.nodes {
        let daemon = node.daemon();
        wait_until(&format!("{} /readyz to fail", node.name), LIMIT, || {
            daemon.request("GET", "/readyz", &[], b"").status == 503
        });
        let refused = daemon.post_json("/hook", &[], r#"{"session": "down", "task": "t"}"#);
        assert_eq!(refused.status, 503, "{}: {}", node.name, refused.body);
        assert!(refused.header("retry-after").is_some());
        assert_eq!(daemon.request("GET", "/healthz", &[], b"").status, 200);
    }
    // A node that starts while the database is down waits for it, and a stop meanwhile ends it
    // at once, with 0 (nothing was accepted yet).
    let restarted = &mut cluster.nodes[1];
    if let Some(daemon) = restarted.daemon.take() {
        daemon.kill9();
    }
    let waiting = |daemon: &Daemon| {
        daemon
            .log()
            .contains("cannot open the PostgreSQL store yet")
    };
    let stopped = restarted.workspace.start_with(&[], || true);
    wait_until("a start to wait for PostgreSQL", LIMIT, || {
        waiting(&stopped)
    });
    let status = stopped.terminate();
    assert!(status.success(), "a stop while waiting ended {status}");
    let daemon = restarted.workspace.start_with(&[], || true);
    wait_until("a start to wait for PostgreSQL", LIMIT, || waiting(&daemon));
    restarted.daemon = Some(daemon);
    cluster.pg.start_again();
    for node in &cluster.nodes {
        let daemon = node.daemon();
        wait_until(&format!("{} /readyz to recover", node.name), LIMIT, || {
            daemon.request("GET", "/readyz", &[], b"").status == 200
        });
    }
    for index in 0..10 {
        acknowledged.push(cluster.post(index % 2, &format!("after-{index}"), "quick"));
    }
    cluster.wait_all_terminal(20, LIMIT);
    for id in &acknowledged {
        assert_eq!(
            cluster.event_status(id),
            "completed",
            "acknowledged event {id}: turns {:?}",
            cluster.pg.rows(&format!(
                "SELECT status, reason, error, node FROM turns WHERE event_id = '{id}'"
            ))
        );
    }
    assert_eq!(cluster.count("SELECT count(*) FROM events"), 20);
}

#[test]
fn a_session_that_kills_every_node_it_runs_on_is_suspended_cluster_wide() {
    // Every run of the poison session calls a tool that SIGKILLs the agentgate running it.
    let model = Stub::start(|request, _| {
        if mentions(request, "poison") {
            Reply::tool_call("call-crash", "crash", serde_json::json!({}))
        } else {
            Reply::answer("done")
        }
    });
    let shape = Shape {
        runtime: "resume_max_attempts = 2",
        tools: r#"[tools.crash]
description = "Takes the node down"
command = ["/bin/sh", "-c", "kill -9 $PPID"]
timeout = "10s"
# Outside the sandbox: inside one, a tool cannot reach the daemon to kill it.
sandbox = "none""#,
        route_tools: r#""crash""#,
        ..Shape::new(3, "1s")
    };
    let Some(mut cluster) = Cluster::start("poison_cluster", &model, &shape) else {
        return;
    };
    let poison = cluster.post(0, "poison", "poison");
    // A supervisor, as systemd's Restart= would be: nodes that die come back.
    let deadline = Instant::now() + LIMIT;
    let mut restarts = 0;
    loop {
        let status = cluster.event_status(&poison);
        if status == "suspended" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the poison event is still {status}"
        );
        for node in &mut cluster.nodes {
            let exited = node
                .daemon
                .as_mut()
                .is_some_and(|daemon| matches!(daemon.child.try_wait(), Ok(Some(_))));
            if exited {
                node.daemon = Some(node.workspace.start());
                restarts += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let turns = cluster.turns_of("poison");
    // The original run and two resumes, each one interrupted by its node's death.
    assert_eq!(turns.len(), 3, "{turns:?}");
    assert!(
        turns
            .iter()
            .all(|(status, reason, _)| status == "interrupted" && reason == "crashed"),
        "{turns:?}"
    );
    assert!(restarts >= 2, "{restarts} restarts");
    assert_eq!(cluster.count("SELECT count(*) FROM resume_ledger"), 0);
    wait_until("the suspension to be delivered", LIMIT, || {
        cluster.count(&format!(
            "SELECT count(*) FROM deliveries WHERE event_id = '{poison}' AND status = 'delivered'
               AND body LIKE '%\"status\":\"suspended\"%'"
        )) == 1
    });
    // The cluster still works for everyone else.
    for node in &mut cluster.nodes {
        if node.daemon.is_none() {
            node.daemon = Some(node.workspace.start());
        }
    }
    let healthy = cluster.post(1, "healthy", "quick");
    cluster.wait_all_terminal(2, LIMIT);
    assert_eq!(cluster.event_status(&healthy), "completed");
}

/// The operator commands run the same SQL on PostgreSQL: list, show and replay an event, list
/// the outbox, retry a failed delivery.
#[test]
fn operator_commands_work_on_postgres() {
    let model = HangingModel::start(Duration::from_secs(60));
    let Some(cluster) = Cluster::start("pg_operator", &model.stub, &Shape::new(1, "10s")) else {
        return;
    };
    let workspace = &cluster.nodes[0].workspace;
    let json = |args: &[&str]| -> serde_json::Value {
        let output = workspace.cli(args);
        assert!(output.status.success(), "{args:?}: {output:?}");
        serde_json::from_slice(&output.stdout).expect("JSON")
    };
    let id = cluster.post(0, "pg-ops", "quick");
    cluster.wait_all_terminal(1, LIMIT);
    let listed = json(&["events", "list", "--route", "hook", "--json"]);
    assert_eq!(listed[0]["id"], id.as_str(), "{listed}");
    let shown = json(&["events", "show", &id, "--json"]);
    assert_eq!(shown["turns"][0]["status"], "completed", "{shown}");
    let replay = workspace.cli(&["events", "replay", &id]);
    assert!(replay.status.success(), "{replay:?}");
    let copy = String::from_utf8_lossy(&replay.stdout).trim().to_string();
    cluster.wait_all_terminal(2, LIMIT);
    assert_eq!(
        json(&["events", "show", &copy, "--json"])["replay_of"],
        id.as_str()
    );
    cluster.pg.value(&format!(
        "UPDATE deliveries SET status = 'failed' WHERE event_id = '{id}' RETURNING 1"
    ));
    let failed = json(&["deliveries", "list", "--failed", "--json"]);
    assert_eq!(failed[0]["event_id"], id.as_str(), "{failed}");
    let retried = workspace.cli(&["deliveries", "retry", "--failed"]);
    assert!(retried.status.success(), "{retried:?}");
    wait_until("the retried delivery", LIMIT, || {
        cluster.pg.value(&format!(
            "SELECT status FROM deliveries WHERE event_id = '{id}'"
        )) == "delivered"
    });
}

/// Retention runs the same SQL on PostgreSQL: finished, delivered work goes; queued work stays.
#[test]
fn retention_on_postgres_deletes_finished_work_only() {
    let model = HangingModel::start(Duration::from_secs(60));
    let shape = Shape {
        store: "retention = \"2s\"",
        ..Shape::new(1, "10s")
    };
    let Some(cluster) = Cluster::start("pg_retention", &model.stub, &shape) else {
        return;
    };
    let done = cluster.post(0, "finished", "quick");
    cluster.post(0, "held", "slow");
    model.wait_hanging(&cluster, "held");
    let behind = cluster.post(0, "held", "queued");
    wait_until("the finished event to be deleted", LIMIT, || {
        cluster.count(&format!("SELECT count(*) FROM events WHERE id = '{done}'")) == 0
    });
    assert_eq!(
        cluster.count(&format!(
            "SELECT count(*) FROM turns WHERE event_id = '{done}'"
        )),
        0
    );
    assert_eq!(cluster.event_status(&behind), "queued");
    wait_until("the idle session to be deleted", LIMIT, || {
        cluster.count("SELECT count(*) FROM sessions WHERE key = 'finished'") == 0
    });
}

/// Scheduling stays fair on PostgreSQL too: deep queues behind a suspended session and a busy
/// one do not keep another session's event from starting.
#[test]
fn deep_queues_behind_suspended_and_busy_sessions_do_not_starve_others() {
    let model = HangingModel::start(Duration::from_secs(60));
    let Some(cluster) = Cluster::start("fair_claims", &model.stub, &Shape::new(1, "10s")) else {
        return;
    };
    let node = &cluster.nodes[0];
    let first = cluster.post(0, "suspended-hog", "quick");
    wait_until("the first event to end", LIMIT, || {
        cluster.event_status(&first) == "completed"
    });
    let output = node
        .workspace
        .cli(&["sessions", "suspend", "suspended-hog"]);
    assert!(output.status.success(), "{output:?}");
    let addr = node.daemon().addr;
    common::post_many(addr, "/hook", 2100, |n| {
        serde_json::json!({"session": "suspended-hog", "task": format!("queued {n}")}).to_string()
    });
    cluster.post(0, "busy-hog", "slow");
    model.wait_hanging(&cluster, "busy-hog");
    common::post_many(addr, "/hook", 2100, |n| {
        serde_json::json!({"session": "busy-hog", "task": format!("queued {n}")}).to_string()
    });
    let innocent = cluster.post(0, "innocent", "quick");
    wait_until("the innocent event to end", LIMIT, || {
        cluster.event_status(&innocent) == "completed"
    });
    assert_eq!(
        cluster.count("SELECT count(*) FROM events WHERE status = 'queued'"),
        4200
    );
}

#[test]
fn an_interrupting_event_accepted_by_another_node_interrupts_the_running_turn() {
    let model = HangingModel::start(Duration::from_secs(40));
    let shape = Shape {
        on_busy: "interrupt",
        ..Shape::new(2, "10s")
    };
    let Some(cluster) = Cluster::start("cross_node_interrupt", &model.stub, &shape) else {
        return;
    };
    let first = cluster.post(0, "busy", "slow");
    let owner = model.wait_hanging(&cluster, "busy");
    let newer = cluster.post(1 - owner, "busy", "quick");
    cluster.wait_all_terminal(2, Duration::from_secs(15));
    assert_eq!(cluster.event_status(&first), "failed");
    assert_eq!(cluster.event_status(&newer), "completed");
    let turns = cluster.turns_of("busy");
    assert_eq!(
        (turns[0].0.as_str(), turns[0].1.as_str()),
        ("interrupted", "interrupted"),
        "{turns:?}"
    );
}

/// The 202 for an interrupting event does not wait for the request to interrupt the turn on the
/// other node: with that request held up in the database (a trigger makes it wait for a lock the
/// test holds), the event is acknowledged while the request waits; once the lock goes, the
/// request is made and the turn interrupted.
#[test]
fn an_interrupting_event_is_acknowledged_before_the_other_node_is_asked() {
    let model = HangingModel::start(Duration::from_secs(40));
    let shape = Shape {
        on_busy: "interrupt",
        ..Shape::new(2, "10s")
    };
    let Some(cluster) = Cluster::start("interrupt_after_ack", &model.stub, &shape) else {
        return;
    };
    cluster.pg.value(
        "CREATE FUNCTION hold_interrupts() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_advisory_xact_lock(4343); RETURN NEW; END $$;
         CREATE TRIGGER hold_interrupts BEFORE UPDATE OF interrupt_requested ON sessions
         FOR EACH ROW WHEN (NEW.interrupt_requested AND NOT OLD.interrupt_requested)
         EXECUTE FUNCTION hold_interrupts()",
    );
    let first = cluster.post(0, "busy", "slow");
    let owner = model.wait_hanging(&cluster, "busy");
    let held = cluster
        .pg
        .open_transaction("SELECT pg_advisory_xact_lock(4343)");
    let newer = cluster.post(1 - owner, "busy", "quick");
    wait_until("the interrupt request to wait for the lock", LIMIT, || {
        cluster.count(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' \
             AND query LIKE 'UPDATE sessions SET interrupt_requested%'",
        ) == 1
    });
    assert_eq!(cluster.event_status(&first), "running");
    drop(held);
    cluster.wait_all_terminal(2, Duration::from_secs(15));
    assert_eq!(
        cluster.event_status(&first),
        "failed",
        "the request was not made once the lock went (a request the 202 waited for is given up)"
    );
    assert_eq!(cluster.event_status(&newer), "completed");
}

#[test]
fn a_node_that_lost_its_lease_cannot_commit_the_turn_it_was_running() {
    // The owner is frozen (SIGSTOP) past its lease; another node takes the session over and
    // completes it. Thawed, the old owner gets its model reply but may not write it.
    let model = HangingModel::start(Duration::from_secs(4));
    let shape = Shape::new(2, "1s");
    let Some(cluster) = Cluster::start("fencing", &model.stub, &shape) else {
        return;
    };
    let event = cluster.post(0, "fenced", "slow");
    let owner = model.wait_hanging(&cluster, "fenced");
    let frozen = cluster.nodes[owner].daemon();
    common::signal(frozen.pid(), "STOP");
    cluster.wait_all_terminal(1, Duration::from_secs(20));
    common::signal(frozen.pid(), "CONT");
    wait_until("the thawed node to give the turn up", LIMIT, || {
        frozen
            .log()
            .contains("turn stopped: its session was taken over")
    });
    assert_eq!(cluster.event_status(&event), "completed");
    // On a starved machine the owner can miss its own heartbeat before the freeze and take the
    // turn up again itself, so there may be more than one interrupted turn before the one that
    // completes; every one of them ends crashed, and the completing one is another node's.
    let turns = cluster.turns_of("fenced");
    let Some(((last_status, _, last_node), earlier)) = turns.split_last() else {
        panic!("no turns of the session");
    };
    assert!(!earlier.is_empty(), "{turns:?}");
    assert_eq!(earlier[0].2, cluster.nodes[owner].name, "{turns:?}");
    for (status, ending, _) in earlier {
        assert_eq!(
            (status.as_str(), ending.as_str()),
            ("interrupted", "crashed"),
            "{turns:?}"
        );
    }
    assert_eq!(last_status, "completed", "{turns:?}");
    assert_ne!(last_node, &cluster.nodes[owner].name, "{turns:?}");
    // Nothing of the frozen node's late model reply reached the transcript.
    assert_eq!(
        cluster.count(
            "SELECT count(*) FROM transcript WHERE session_key = 'fenced' AND body LIKE '%too late%'"
        ),
        0
    );
}

#[test]
fn a_delivery_is_sent_by_one_node_at_a_time_and_retried_elsewhere_when_it_dies() {
    let model = Stub::start(|_, _| Reply::answer("done"));
    // The first POST of the result hangs (its node is killed meanwhile); later ones succeed.
    let first_seen = Arc::new(AtomicBool::new(false));
    let seen = first_seen.clone();
    let receiver = Stub::start(move |_, _| {
        if seen.swap(true, Ordering::SeqCst) {
            Reply::raw(204, "")
        } else {
            Reply::raw(204, "").after(Duration::from_secs(40))
        }
    });
    let deliver = format!(r#"{{ kind = "http", url = "{}/results" }}"#, receiver.url());
    let shape = Shape {
        deliver: &deliver,
        ..Shape::new(3, "2s")
    };
    let Some(mut cluster) = Cluster::start("delivery_failover", &model, &shape) else {
        return;
    };
    let event = cluster.post(0, "delivered", "quick");
    wait_until("the first delivery attempt", LIMIT, || {
        first_seen.load(Ordering::SeqCst)
    });
    let owner_of = |cluster: &Cluster| {
        cluster.pg.value(&format!(
            "SELECT n.name || ' ' || d.lease_expires_at FROM deliveries d JOIN nodes n ON n.id = d.lease_owner
             WHERE d.event_id = '{event}'"
        ))
    };
    // While its node lives, the lease is renewed and nobody else sends the result.
    let first_lease = owner_of(&cluster);
    wait_until("the delivery lease to be renewed twice", LIMIT, || {
        let now = owner_of(&cluster);
        now.split(' ').nth(1).and_then(|t| t.parse::<i64>().ok())
            > first_lease
                .split(' ')
                .nth(1)
                .and_then(|t| t.parse::<i64>().ok())
                .map(|t| t + 1500)
    });
    assert_eq!(receiver.requests().len(), 1, "one node at a time");
    let owner_name = first_lease
        .split(' ')
        .next()
        .unwrap_or_default()
        .to_string();
    let owner = cluster
        .nodes
        .iter()
        .position(|node| node.name == owner_name)
        .expect("the delivering node");
    if let Some(daemon) = cluster.nodes[owner].daemon.take() {
        daemon.kill9();
    }
    wait_until("another node to deliver the result", LIMIT, || {
        cluster.pg.value(&format!(
            "SELECT status FROM deliveries WHERE event_id = '{event}'"
        )) == "delivered"
    });
    let requests = receiver.requests();
    assert_eq!(requests.len(), 2, "delivered again once, by another node");
    assert_eq!(
        requests[0].body, requests[1].body,
        "the same result both times"
    );
    assert_eq!(requests[1].json()["event_id"], event.as_str());
}

#[test]
fn with_sslmode_require_nodes_use_tls_and_verify_the_server() {
    let Some((pg, ca)) = Postgres::start_with_tls("postgres_tls") else {
        return;
    };
    let model = Stub::start(|_, _| Reply::answer("done"));
    let trusted = format!("ca_file = {:?}", ca.display().to_string());
    let shape = Shape {
        url_suffix: "?sslmode=require",
        store: &trusted,
        ..Shape::new(1, "5s")
    };
    let cluster = Cluster::start_on(pg, &model, &shape);
    let event = cluster.post(0, "tls", "quick");
    cluster.wait_all_terminal(1, LIMIT);
    assert_eq!(cluster.event_status(&event), "completed");
    assert!(
        cluster.count(
            "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
             WHERE ssl AND application_name LIKE 'agentgate%'"
        ) >= 1,
        "the node's connections use TLS"
    );
    // Without the CA that signed the server's certificate, nothing is sent to that server.
    let untrusting = Workspace::new();
    std::fs::write(
        untrusting.path().join("pg-url"),
        format!("{}?sslmode=require", cluster.pg.url()),
    )
    .expect("write the URL");
    untrusting.write_config(&format!(
        "[store]\nbackend = \"postgres\"\nurl = {{ file = {:?} }}\n",
        untrusting.path().join("pg-url").display().to_string()
    ));
    let refused = untrusting.cli(&["status"]);
    assert_eq!(refused.status.code(), Some(69), "{refused:?}");
    let message = String::from_utf8_lossy(&refused.stderr);
    assert!(message.contains("certificate"), "{message}");
}

/// A URL without `sslmode` (libpq's `prefer`) and no `ca_file`: the node's connections are
/// encrypted when the server offers TLS, as libpq's are (the server is not authenticated: only
/// `sslmode=require` with `ca_file` does that), where they were plaintext before.
#[test]
fn without_sslmode_nodes_encrypt_when_the_server_offers_tls() {
    let Some((pg, _ca)) = Postgres::start_with_tls("postgres_prefer") else {
        return;
    };
    let model = Stub::start(|_, _| Reply::answer("done"));
    let cluster = Cluster::start_on(pg, &model, &Shape::new(1, "5s"));
    let event = cluster.post(0, "prefer", "quick");
    cluster.wait_all_terminal(1, LIMIT);
    assert_eq!(cluster.event_status(&event), "completed");
    let count = |ssl: bool| {
        cluster.count(&format!(
            "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
             WHERE ssl = {ssl} AND application_name LIKE 'agentgate%'"
        ))
    };
    assert!(count(true) >= 1, "the node's connections use TLS");
    assert_eq!(count(false), 0, "no plaintext connection");
}

#[test]
fn an_unusable_database_url_is_a_configuration_error_that_keeps_the_url_secret() {
    let workspace = Workspace::new();
    let url_file = workspace.path().join("pg-url");
    std::fs::write(
        &url_file,
        "postgres://agentgate:hunter2@[not-a-host:5432/db\n",
    )
    .expect("url");
    workspace.write_config(&format!(
        "[store]\nbackend = \"postgres\"\nurl = {{ file = {:?} }}\n",
        url_file.display().to_string()
    ));
    let output = workspace
        .serve_command(&[])
        .env_remove("NOTIFY_SOCKET")
        .output()
        .expect("run agentgate serve");
    assert_eq!(output.status.code(), Some(78), "{output:?}");
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("store.url"), "{message}");
    assert!(
        !message.contains("hunter2"),
        "the URL's password leaked: {message}"
    );
}

/// Approvals across nodes: the request is made on the node that ran the turn, approved through
/// another node's control socket, and the turn continues on whichever node claims it, here the
/// one left after the other was killed; the call runs once.
#[test]
fn an_approval_requested_on_one_node_is_decided_through_another() {
    let model = Stub::start(|request, _| {
        let body = request.json();
        let last = body["messages"].as_array().and_then(|m| m.last()).cloned();
        match last {
            Some(message) if message["role"] == "tool" => Reply::answer("deployed"),
            _ => Reply::tool_call("call-1", "deploy", serde_json::json!({"target": "prod"})),
        }
    });
    let runs = tempfile::tempdir().expect("tempdir");
    let log = runs.path().join("runs.log");
    let tools = format!(
        r#"[tools.deploy]
command = ["/bin/sh", "-c", "cat >> {}; echo; echo deployed"]
parameters = {{ type = "object", properties = {{ target = {{ type = "string", enum = ["prod"] }} }} }}
approval = true
sandbox = "none""#,
        log.display()
    );
    let mut shape = Shape::new(2, "10s");
    shape.tools = &tools;
    shape.route_tools = "\"deploy\"";
    let Some(mut cluster) = Cluster::start("pg_approvals", &model, &shape) else {
        return;
    };
    let event = cluster.post(0, "pg-approval", "deploy");
    wait_until("the approval request", LIMIT, || {
        cluster.count("SELECT count(*) FROM approvals WHERE status = 'pending'") == 1
    });
    assert_eq!(cluster.event_status(&event), "awaiting_approval");
    let id = cluster
        .pg
        .value("SELECT id FROM approvals WHERE status = 'pending'");
    let decided =
        cluster.nodes[1]
            .workspace
            .cli(&["approvals", "approve", &id, "--note", "from node 1"]);
    assert!(decided.status.success(), "{decided:?}");
    let again = cluster.nodes[0].workspace.cli(&["approvals", "deny", &id]);
    assert!(
        !again.status.success(),
        "a second decision on another node is refused"
    );
    // The node that asked dies; the other one continues the turn.
    if let Some(daemon) = cluster.nodes[0].daemon.take() {
        daemon.kill9();
    }
    cluster.wait_all_terminal(1, LIMIT);
    assert_eq!(cluster.event_status(&event), "completed");
    let ran = std::fs::read_to_string(&log).unwrap_or_default();
    // Once, or not at all when the killed node had started it (then the turn that continues
    // says its outcome is unknown): never twice.
    assert!(ran.lines().filter(|l| !l.is_empty()).count() <= 1, "{ran}");
    assert_eq!(
        cluster
            .pg
            .value(&format!("SELECT note FROM approvals WHERE id = '{id}'")),
        "from node 1"
    );
}

/// A TCP proxy between one node and PostgreSQL that a test cuts (every connection closed, new
/// ones closed at once) and heals: a network partition of that node from the database.
struct Partition {
    port: u16,
    cut: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<std::net::TcpStream>>>,
}

impl Partition {
    fn start(upstream: u16) -> Partition {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (cut, open) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(Vec::new())),
        );
        let (is_cut, streams) = (cut.clone(), open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if is_cut.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let (Ok(client_copy), Ok(server_copy)) = (client.try_clone(), server.try_clone())
                else {
                    continue;
                };
                if let Ok(mut held) = streams.lock() {
                    held.extend(client.try_clone());
                    held.extend(server.try_clone());
                }
                pump(client, server_copy);
                pump(server, client_copy);
            }
        });
        Partition { port, cut, open }
    }

    fn url(&self) -> String {
        format!("postgres://agentgate@127.0.0.1:{}/agentgate", self.port)
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        if let Ok(mut held) = self.open.lock() {
            for stream in held.drain(..) {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

fn pump(mut from: std::net::TcpStream, mut to: std::net::TcpStream) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
}

/// `[tools.NAME]` running `script` with /bin/sh, unsandboxed (its side effects land where the
/// test looks), within `timeout`.
fn shell_tool(name: &str, script: &str, timeout: &str) -> String {
    format!(
        "[tools.{name}]\ndescription = \"A shell script\"\ncommand = [\"/bin/sh\", \"-c\", {script:?}]\n\
         timeout = \"{timeout}\"\nsandbox = \"none\"\n"
    )
}

/// A model that calls `tool` (no arguments), then answers "done" once it sees a tool result
/// (of the call, or the "interrupted" one a resume records).
fn calls_once(tool: &'static str) -> Stub {
    Stub::start(move |request, _| {
        if mentions(request, "\"role\":\"tool\"") {
            Reply::answer("done")
        } else {
            Reply::tool_call(&format!("call-{tool}"), tool, serde_json::json!({}))
        }
    })
}

/// A node that can reach PostgreSQL but finds its session's lease held by another node (its
/// renewals answer without that session) kills the session's tool as one cut off would, before
/// the lease it last set can expire: no renewal of its other leases stands in for that one.
#[test]
fn a_node_whose_lease_another_holds_stops_its_tool() {
    let Some(pg) = Postgres::start("stolen") else {
        return;
    };
    let pid_dir = tempfile::tempdir().expect("tempdir");
    let pid_file = pid_dir.path().join("pid");
    let model = calls_once("hold");
    let tools = shell_tool(
        "hold",
        &format!("echo $$ > {}; exec sleep 120", pid_file.display()),
        "300s",
    );
    let shape = Shape {
        tools: &tools,
        route_tools: r#""hold""#,
        ..Shape::new(1, "3s")
    };
    let cluster = Cluster::start_on(pg, &model, &shape);
    let event = cluster.post(0, "stolen", "hold");
    let mut pid = String::new();
    wait_until("the tool to start", LIMIT, || {
        pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
        pid.ends_with('\n')
    });
    let stat = format!("/proc/{}/stat", pid.trim());
    assert!(std::path::Path::new(&stat).exists(), "the tool runs");
    // Another node takes the lease (for 5 s: then it is expired, and this node resumes).
    cluster.pg.value(
        "UPDATE sessions SET lease_owner = 'another-node', \
         lease_expires_at = agentgate_now_ms() + 5000 WHERE key = 'stolen' RETURNING key",
    );
    wait_until("the node to kill its tool", Duration::from_secs(20), || {
        std::fs::read_to_string(&stat)
            .map(|fields| fields.contains(") Z "))
            .unwrap_or(true)
    });
    let node = cluster.nodes[0].daemon();
    node.wait_for_log("could not renew the session's lease for most of store.lease_ttl");
    node.wait_for_log("its session was taken over");
    cluster.wait_all_terminal(1, LIMIT);
    assert_eq!(cluster.event_status(&event), "completed");
}

/// A node cut off from PostgreSQL kills the tool it runs before its lease can expire, so that
/// no side effect of it happens after another node resumed the session; once healed, its late
/// commit is refused (the session is the other node's), and the event ends once, there.
#[test]
fn a_node_cut_off_from_postgresql_stops_its_tools_before_another_takes_over() {
    let Some(pg) = Postgres::start("partition") else {
        return;
    };
    let ticks_dir = tempfile::tempdir().expect("tempdir");
    let ticks = ticks_dir.path().join("ticks");
    let model = calls_once("tick");
    let (first, second) = (Partition::start(pg.port), Partition::start(pg.port));
    let urls = [first.url(), second.url()];
    // Writes the time every 50 ms, as a side effect that keeps going.
    let tools = shell_tool(
        "tick",
        &format!(
            "while :; do date +%s%3N >> {}; sleep 0.05; done",
            ticks.display()
        ),
        "60s",
    );
    let shape = Shape {
        tools: &tools,
        route_tools: r#""tick""#,
        urls: &urls,
        ..Shape::new(2, "3s")
    };
    let cluster = Cluster::start_on(pg, &model, &shape);
    // Only the first node can reach the database: the event's turn runs there.
    second.cut();
    let event = cluster.post(0, "partitioned", "tick");
    let read_ticks = || -> Vec<i64> {
        std::fs::read_to_string(&ticks)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    };
    wait_until("the tool to run on the first node", LIMIT, || {
        read_ticks().len() >= 3
    });
    // The partition: the first node loses the database, the second gets it back.
    first.cut();
    second.heal();
    cluster.wait_all_terminal(1, LIMIT);
    assert_eq!(cluster.event_status(&event), "completed");
    let resumed_at: i64 = cluster
        .pg
        .value(&format!(
            "SELECT max(started_at) FROM turns WHERE event_id = '{event}' AND node = 'node-1'"
        ))
        .parse()
        .expect("the second node's turn");
    let last_tick = read_ticks().last().copied().unwrap_or(i64::MAX);
    assert!(
        last_tick < resumed_at,
        "the cut-off node's tool ran {} ms after the other node resumed the session",
        last_tick - resumed_at
    );
    cluster.nodes[0]
        .daemon()
        .wait_for_log("could not renew the session's lease for most of store.lease_ttl");
    // Healed, the first node's late commit is refused: the session is the other node's.
    first.heal();
    cluster.nodes[0]
        .daemon()
        .wait_for_log("its session was taken over");
    assert_eq!(cluster.event_status(&event), "completed");
}
