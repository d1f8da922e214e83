//! The console in a real browser: Debian's Chromium, driven through chromedriver (WebDriver),
//! against the real binary. The browser reaches the control socket the way an operator's does,
//! through a forwarded port (as `ssh -L 8788:/run/agentgate/control.sock` makes one), or
//! `[console] listen` with the token.
//!
//! It loads each page, follows a session's transcript live while its turn runs, approves the
//! call the turn waits for and sees the turn finish, retries a failed delivery, and is refused a
//! cross-site form from another site's page; a payload's `<script>` shows as text and never
//! runs. An event page draws a turn's timeline, a bar for each thing it did in order, and the
//! overview charts a known set of webhooks and turns. The screenshots it takes are the ones in docs/console/ (written there when
//! `AGENTGATE_UPDATE_SCREENSHOTS=1`).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::approving::{approval_config, deploying_model};
use common::stub::{Reply, Stub};
use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

const TURN_LIMIT: Duration = Duration::from_secs(30);
/// What the model answers once the approved call ran.
const ANSWER: &str = "Deployed to prod; the disk alert is handled.";
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// What a stranger's payload carries; the page must show it and never run it.
const PLANTED: &str =
    "<script>window.planted = 1</script><img src=x onerror=\"window.planted = 2\">";

/// Whether the browser is here (see [`common::can_run`]).
fn browser_or_skip(test: &str) -> bool {
    let present = Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists();
    can_run(test, Need::Browser, present)
}

/// chromedriver on a loopback port, and the headless Chromium sessions it starts; killed on
/// drop.
struct Driver {
    child: Child,
    url: String,
    profile: tempfile::TempDir,
}

impl Driver {
    fn start() -> Driver {
        let port = free_port();
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        wait_until("chromedriver to listen", Duration::from_secs(20), || {
            std::net::TcpStream::connect(addr).is_ok()
        });
        Driver {
            child,
            url: format!("http://{addr}"),
            profile: tempfile::tempdir().expect("a browser profile directory"),
        }
    }

    /// A new headless browser window, 1280x900 (as the screenshots are).
    async fn browser(&self) -> Client {
        let arguments = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,900",
            &format!("--user-data-dir={}", self.profile.path().display()),
        ];
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".to_string(),
            json!({"binary": CHROMIUM, "args": arguments}),
        );
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&self.url)
            .await
            .expect("a browser session")
    }
}

/// A chromedriver with one browser window, at `url` (`what` names it in a failure).
async fn open(url: &str, what: &str) -> (Driver, Client) {
    let driver = Driver::start();
    let browser = driver.browser().await;
    browser
        .goto(url)
        .await
        .unwrap_or_else(|err| panic!("{what}: {err}"));
    (driver, browser)
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port forwarded to the control socket, as `ssh -L` forwards one.
fn tunnel(socket: PathBuf) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the tunnel");
    let port = listener.local_addr().expect("its address").port();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = std::os::unix::net::UnixStream::connect(&socket) else {
                continue;
            };
            let (Ok(mut client_in), Ok(mut server_in)) = (client.try_clone(), server.try_clone())
            else {
                continue;
            };
            let (mut client_out, mut server_out) = (client, server);
            std::thread::spawn(move || std::io::copy(&mut client_in, &mut server_out));
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut server_in, &mut client_out);
                let _ = client_out.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    port
}

/// Another site (another origin), whose page posts a form to the console as soon as it loads.
fn attacker_site(console: &str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the attacker's site");
    let addr = listener.local_addr().expect("its address");
    let page = format!(
        "<!doctype html><form id=f method=post action=\"{console}/console/sessions/deploy-1/suspend\">\
         <input name=note value=gotcha></form><script>document.getElementById('f').submit()</script>"
    );
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                page.len()
            );
        }
    });
    format!("http://{addr}/")
}

/// Saves a screenshot of what the browser shows as `name`.png (in the test's target directory,
/// and in docs/console/ with `AGENTGATE_UPDATE_SCREENSHOTS=1`).
async fn screenshot(browser: &Client, name: &str) {
    let png = browser.screenshot().await.expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG"), "{name} is a PNG");
    let mut places = vec![PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console")];
    if std::env::var_os("AGENTGATE_UPDATE_SCREENSHOTS").is_some() {
        places.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/console"));
    }
    for place in places {
        std::fs::create_dir_all(&place).expect("a screenshot directory");
        std::fs::write(place.join(format!("{name}.png")), &png).expect("save the screenshot");
    }
}

async fn text_of(browser: &Client, css: &str) -> String {
    browser
        .wait()
        .at_most(TURN_LIMIT)
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|err| panic!("{css} on the page: {err}"))
        .text()
        .await
        .expect("its text")
}

/// Waits until the element `css` says `text`.
async fn wait_for_text(browser: &Client, css: &str, text: &str) {
    let deadline = std::time::Instant::now() + TURN_LIMIT;
    loop {
        let found = browser.find(Locator::Css(css)).await;
        if let Ok(element) = found
            && element.text().await.is_ok_and(|shown| shown.contains(text))
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{css} never said {text:?}: {}",
            browser.source().await.unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the browser's address holds `part`: the page a form was sent to has loaded.
async fn wait_for_address(browser: &Client, part: &str) {
    let deadline = std::time::Instant::now() + TURN_LIMIT;
    while !browser
        .current_url()
        .await
        .is_ok_and(|address| address.as_str().contains(part))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the address never held {part}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Clicks the element `css`.
async fn click(browser: &Client, css: &str) {
    browser
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|err| panic!("{css} on the page: {err}"))
        .click()
        .await
        .unwrap_or_else(|err| panic!("a click on {css}: {err}"));
}

/// Types `text` into the field `css`.
async fn type_into(browser: &Client, css: &str, text: &str) {
    browser
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|err| panic!("{css} on the page: {err}"))
        .send_keys(text)
        .await
        .unwrap_or_else(|err| panic!("typing into {css}: {err}"));
}

async fn entries(browser: &Client) -> usize {
    browser
        .find_all(Locator::Css("ol.transcript li.entry"))
        .await
        .map_or(0, |found| found.len())
}

#[tokio::test(flavor = "multi_thread")]
#[expect(
    clippy::too_many_lines,
    reason = "one operator's path through the console, step by step"
)]
async fn an_operator_follows_a_turn_approves_its_call_and_retries_its_delivery() {
    if !browser_or_skip("an_operator_follows_a_turn_approves_its_call_and_retries_its_delivery") {
        return;
    }
    let model = deploying_model(ANSWER);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let workspace = Workspace::new();
    workspace.write_config(&approval_config(&model, &receiver, ""));
    let daemon = workspace.start();
    let console = format!(
        "http://localhost:{}",
        tunnel(workspace.path().join("control.sock"))
    );
    let payload =
        json!({"session": "deploy-1", "title": format!("Disk full </details></pre> {PLANTED}")});
    let event_id = daemon
        .post_json(
            "/hooks/ops",
            &[("x-planted", PLANTED)],
            &payload.to_string(),
        )
        .event_id();
    wait_until("the call to wait for approval", TURN_LIMIT, || {
        workspace.event_status(&event_id) == "awaiting_approval"
    });
    let pending = workspace.cli_json(&["approvals", "list", "--json"]);
    let approval = pending["approvals"][0]["id"]
        .as_str()
        .expect("the request")
        .to_string();

    let (_driver, browser) = open(&format!("{console}/console/"), "the overview").await;
    assert!(
        text_of(&browser, "main")
            .await
            .contains("Accepting webhooks")
    );
    screenshot(&browser, "overview").await;
    browser
        .goto(&format!("{console}/console/sessions"))
        .await
        .expect("sessions");
    screenshot(&browser, "sessions").await;
    browser
        .find(Locator::LinkText("deploy-1"))
        .await
        .expect("the session's link")
        .click()
        .await
        .expect("follow it");
    wait_for_text(&browser, "#live-status", "live").await;
    // The payload is folded in its entry; opened, it reads as text, whatever it closes.
    browser
        .find(Locator::Css("li.entry.event details.payload summary"))
        .await
        .expect("the event's payload")
        .click()
        .await
        .expect("open the payload");
    let shown = text_of(&browser, "li.entry.event details.payload").await;
    assert!(
        shown.contains("Disk full </details></pre> <script>window.planted = 1"),
        "{shown}"
    );
    let call = text_of(&browser, "ol.transcript .tool-call .tool-name").await;
    assert_eq!(
        call, "deploy",
        "the model's call is a card with the tool's name"
    );
    let before = entries(&browser).await;
    assert!(before >= 2, "the event and the model's call: {before}");
    // A rewind waits for the session to be idle; a fork is offered at once.
    assert!(!displayed(&browser, "#entry-1 button.rewind").await);
    assert!(displayed(&browser, "#entry-1 button.fork").await);
    // A mark that a reload would erase: the entries below arrive without one.
    browser
        .execute("window.sameVisit = true", Vec::new())
        .await
        .expect("mark the page");
    let session_tab = browser.window().await.expect("this tab");
    screenshot(&browser, "session").await;

    // Approved in another tab, the call runs and the turn finishes, live in the first.
    let approvals_tab = browser.new_window(true).await.expect("a new tab").handle;
    browser
        .switch_to_window(approvals_tab)
        .await
        .expect("to the new tab");
    browser
        .goto(&format!("{console}/console/approvals"))
        .await
        .expect("approvals");
    assert!(
        text_of(&browser, "main")
            .await
            .contains("\"target\": \"prod\"")
    );
    screenshot(&browser, "approvals").await;
    browser
        .find(Locator::Css("tr.approval input[name=note]"))
        .await
        .expect("the note field")
        .send_keys("checked the disk graph")
        .await
        .expect("type a note");
    browser
        .find(Locator::Css("button.approve"))
        .await
        .expect("the approve button")
        .click()
        .await
        .expect("approve");
    assert_eq!(workspace.wait_terminal(&event_id, TURN_LIMIT), "completed");
    browser
        .switch_to_window(session_tab)
        .await
        .expect("back to the session");
    wait_for_text(&browser, "ol.transcript", "the disk alert is handled").await;
    wait_for_text(&browser, "#session-state", "idle").await;
    let marked = browser
        .execute("return window.sameVisit === true", Vec::new())
        .await;
    assert_eq!(marked.ok(), Some(json!(true)), "the page was not reloaded");
    assert!(entries(&browser).await > before);
    // The answer came live, with a rewind and a fork for its own number, as a reload would show
    // it; the session idle, every rewind is offered.
    let answer = browser
        .find(Locator::Css("ol.transcript > li:last-child"))
        .await
        .expect("the answer's entry");
    let n = answer
        .attr("value")
        .await
        .expect("its number")
        .unwrap_or_default();
    let rewind = answer
        .find(Locator::Css("button.rewind"))
        .await
        .expect("the live answer's rewind button");
    assert_eq!(
        rewind.text().await.expect("its label"),
        format!("Rewind to #{n}")
    );
    assert!(displayed(&browser, "ol.transcript > li:last-child button.rewind").await);
    assert!(displayed(&browser, "ol.transcript > li:last-child button.fork").await);
    assert!(displayed(&browser, "#entry-1 button.rewind").await);
    let planted = browser
        .execute("return window.planted === undefined", Vec::new())
        .await;
    assert_eq!(
        planted.ok(),
        Some(json!(true)),
        "the payload's markup never ran"
    );
    let decided = workspace.cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(decided["decided_by"], "console", "{decided}");
    assert_eq!(decided["note"], "checked the disk graph", "{decided}");

    // The event page shows the stranger's headers and payload as text.
    browser
        .goto(&format!("{console}/console/events/{event_id}"))
        .await
        .expect("the event");
    assert!(
        text_of(&browser, "main")
            .await
            .contains("<img src=x onerror=")
    );
    let wait = text_of(&browser, "table.timeline tr.bar.approval").await;
    assert!(wait.contains("approval of deploy: approved"), "{wait}");
    screenshot(&browser, "event").await;

    // A delivery that failed for good, retried from the deliveries page.
    wait_until("the delivery", TURN_LIMIT, || {
        !receiver.requests().is_empty()
    });
    workspace.fail_delivery(&event_id);
    browser
        .goto(&format!("{console}/console/deliveries"))
        .await
        .expect("deliveries");
    screenshot(&browser, "deliveries").await;
    browser
        .find(Locator::Css("tr.failed button"))
        .await
        .expect("the retry button")
        .click()
        .await
        .expect("retry");
    wait_until("the retried delivery", TURN_LIMIT, || {
        receiver.requests().len() >= 2
    });
    browser
        .goto(&format!("{console}/console/deliveries"))
        .await
        .expect("deliveries again");
    assert!(
        browser.find(Locator::Css("tr.failed")).await.is_err(),
        "none failed now"
    );

    // Another site's page posts to the console: refused, and the session is as it was.
    browser
        .goto(&attacker_site(&console))
        .await
        .expect("the attacker's page");
    wait_for_text(&browser, "#refusal", "only from the console's own pages").await;
    let session = workspace.cli_json(&["sessions", "show", "deploy-1", "--json"]);
    assert_eq!(session["session"]["state"], "idle", "{session}");

    for page in ["events", "ledger", "what-if"] {
        browser
            .goto(&format!("{console}/console/{page}"))
            .await
            .expect(page);
        assert!(text_of(&browser, "h1").await.len() > 3, "{page}");
    }
    browser.close().await.expect("close the browser");
}

/// On `[console] listen`, the browser is asked for the token, and its login cookie is out of
/// the page's scripts' reach.
#[tokio::test(flavor = "multi_thread")]
async fn the_console_on_tcp_asks_the_browser_for_the_token() {
    if !browser_or_skip("the_console_on_tcp_asks_the_browser_for_the_token") {
        return;
    }
    let model = deploying_model(ANSWER);
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let workspace = Workspace::new();
    let port = workspace.console_addr().port();
    let token = "a-long-console-token-of-the-operator";
    let extra = format!("\n[console]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{token}\"\n");
    workspace.write_config(&approval_config(&model, &receiver, &extra));
    let _daemon = workspace.start();
    let (_driver, browser) = open(
        &format!("http://127.0.0.1:{port}/console/sessions"),
        "the console",
    )
    .await;
    let field = browser
        .wait()
        .at_most(TURN_LIMIT)
        .for_element(Locator::Css("input[name=token]"))
        .await
        .expect("the login page");
    field.send_keys("not the token").await.expect("type");
    login_button(&browser).await;
    wait_for_text(&browser, "#refusal", "not the console token").await;
    browser
        .goto(&format!("http://127.0.0.1:{port}/console/login"))
        .await
        .expect("login again");
    let field = browser
        .find(Locator::Css("input[name=token]"))
        .await
        .expect("the field");
    field.send_keys(token).await.expect("type the token");
    login_button(&browser).await;
    wait_for_text(&browser, "main h1", "Overview").await;
    let cookie = browser.execute("return document.cookie", Vec::new()).await;
    assert_eq!(cookie.ok(), Some(json!("")), "the login cookie is HttpOnly");
    browser.close().await.expect("close the browser");
}

async fn login_button(browser: &Client) {
    browser
        .find(Locator::Css("main form button"))
        .await
        .expect("the login button")
        .click()
        .await
        .expect("log in");
}

/// A daemon whose route `ops` has the model call `check` once and then answer, delivering to
/// `receiver`, and the console's address through a tunnel.
struct Checking {
    daemon: Daemon,
    console: String,
    receiver: Stub,
    _model: Stub,
    workspace: Workspace,
}

impl Checking {
    /// The id of an event of `session`, once its turn completed.
    fn completed(&self, session: &str) -> String {
        let body = json!({"session": session}).to_string();
        let event = self.daemon.post_json("/hooks/ops", &[], &body).event_id();
        assert_eq!(
            self.workspace.wait_terminal(&event, TURN_LIMIT),
            "completed"
        );
        event
    }
}

fn checking() -> Checking {
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let model = Stub::start(|request, _| {
        let answered = request.json()["messages"]
            .as_array()
            .and_then(|messages| messages.last())
            .is_some_and(|message| message["role"] == "tool");
        if answered {
            Reply::answer(ANSWER)
        } else {
            Reply::tool_call("call-1", "check", json!({}))
        }
    });
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        r#"{model}
[tools.check]
description = "Checks the disk"
command = ["/bin/echo", "92% used"]

[routes.ops]
path = "/hooks/ops"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
tools = ["check"]
deliver = {{ kind = "http", url = "{receiver}/results" }}
"#,
        model = model.model_section(),
        receiver = receiver.url(),
    ));
    let daemon = workspace.start();
    let console = format!(
        "http://localhost:{}",
        tunnel(workspace.path().join("control.sock"))
    );
    Checking {
        daemon,
        console,
        receiver,
        _model: model,
        workspace,
    }
}

/// The event page draws each turn of a real turn as a waterfall: one bar per model request,
/// tool call and the delivery, in the order they ran, each drawn by the browser under the
/// page's Content-Security-Policy.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_page_draws_a_turn_as_a_timeline() {
    if !browser_or_skip("an_event_page_draws_a_turn_as_a_timeline") {
        return;
    }
    let checking = checking();
    let (workspace, receiver, console) =
        (&checking.workspace, &checking.receiver, &checking.console);
    let event = checking.completed("disk-2");
    wait_until("the delivery", TURN_LIMIT, || {
        !receiver.requests().is_empty()
    });
    wait_until("the delivery recorded", TURN_LIMIT, || {
        workspace.cli_json(&["events", "show", &event, "--json"])["delivery"]["status"]
            == "delivered"
    });

    let (_driver, browser) = open(&format!("{console}/console/events/{event}"), "the event").await;
    let bars = browser
        .find_all(Locator::Css("section.turn table.timeline rect"))
        .await
        .expect("the timeline's bars");
    let mut kinds = Vec::new();
    let mut last_x = 0.0;
    for bar in &bars {
        kinds.push(
            bar.attr("data-kind")
                .await
                .expect("its kind")
                .unwrap_or_default(),
        );
        let (x, _, width, height) = bar.rectangle().await.expect("where it is drawn");
        assert!(width > 0.0 && height > 0.0, "the bar is drawn");
        assert!(x >= last_x, "bars start in order: {x} after {last_x}");
        last_x = x;
    }
    assert_eq!(kinds, ["model", "tool", "model", "delivery"]);
    let labels = text_of(&browser, "section.turn table.timeline").await;
    assert!(labels.contains("tool check"), "{labels}");
    browser
        .execute(
            "document.querySelector('section.turn').scrollIntoView()",
            Vec::new(),
        )
        .await
        .expect("scroll to the turn");
    screenshot(&browser, "event-timeline").await;
    browser.close().await.expect("close the browser");
}

/// The operator rewinds a finished session to the model's first reply from its page: the
/// browser posts the entry's form, comes back to the session, and sees the entries from that
/// one on marked superseded by the new turn, which runs and is delivered.
#[tokio::test(flavor = "multi_thread")]
async fn an_operator_rewinds_a_session_from_its_page() {
    if !browser_or_skip("an_operator_rewinds_a_session_from_its_page") {
        return;
    }
    let checking = checking();
    let (workspace, receiver, console) =
        (&checking.workspace, &checking.receiver, &checking.console);
    checking.completed("disk-1");

    let (_driver, browser) =
        open(&format!("{console}/console/sessions/disk-1"), "the session").await;
    assert_eq!(
        entries(&browser).await,
        5,
        "event, call, start, result, answer"
    );
    browser
        .find(Locator::Css("#entry-5 button.rewind"))
        .await
        .expect("the answer's rewind button")
        .click()
        .await
        .expect("rewind");
    wait_for_text(&browser, "#entry-5 .meta", "superseded by turn").await;
    assert!(
        browser
            .current_url()
            .await
            .expect("the page's address")
            .as_str()
            .ends_with("/console/sessions/disk-1"),
        "back on the session"
    );
    let superseded = workspace.session_json("disk-1")["transcript"][4]["superseded_by"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!superseded.is_empty());
    wait_until("the rerun's delivery", TURN_LIMIT, || {
        receiver
            .requests()
            .iter()
            .any(|request| request.json()["rewind_of"] == json!({"session": "disk-1", "entry": 5}))
    });
    browser.refresh().await.expect("reload");
    wait_for_text(&browser, "#entry-6", ANSWER).await;
    browser
        .execute(
            "document.getElementById('entry-4').scrollIntoView()",
            Vec::new(),
        )
        .await
        .expect("scroll to the superseded entries");
    screenshot(&browser, "session-rewound").await;
    browser.close().await.expect("close the browser");
}

/// Whether the element `css` is shown (found, and not hidden).
async fn displayed(browser: &Client, css: &str) -> bool {
    let element = browser
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|err| panic!("{css}: {err}"));
    element.is_displayed().await.unwrap_or(false)
}

/// The sum of the `data-value`s of the chart points `css`, and how many there are.
async fn points(browser: &Client, css: &str) -> (usize, f64) {
    let found = browser
        .find_all(Locator::Css(css))
        .await
        .unwrap_or_else(|err| panic!("{css}: {err}"));
    let mut sum = 0.0;
    for point in &found {
        let value = point.attr("data-value").await.expect("its value");
        sum += value
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN);
    }
    (found.len(), sum)
}

/// The overview charts what the daemon did: for three webhooks accepted and answered and two
/// refused, the hour has a point per minute and the day one per hour, summing to them; each
/// minute with turns has their durations; the last days' tokens are held against the daily
/// budgets.
#[tokio::test(flavor = "multi_thread")]
async fn the_overview_charts_the_last_hour_and_day() {
    if !browser_or_skip("the_overview_charts_the_last_hour_and_day") {
        return;
    }
    let model = Stub::start(|_, _| Reply::answer("noted").with_usage(10, 0, 5));
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "{}\n[budgets]\ndaily_tokens = 1000\n\n[routes.ops]\npath = \"/hooks/ops\"\n\
         verify = {{ scheme = \"none\" }}\nsession = \"{{{{ payload.session }}}}\"\n\
         budget = {{ daily_tokens = 500 }}\n",
        model.model_section()
    ));
    let daemon = workspace.start();
    let console = format!(
        "http://localhost:{}",
        tunnel(workspace.path().join("control.sock"))
    );
    for n in 1..=3 {
        let body = json!({"session": format!("s-{n}")}).to_string();
        let event = daemon.post_json("/hooks/ops", &[], &body).event_id();
        assert_eq!(workspace.wait_terminal(&event, TURN_LIMIT), "completed");
    }
    for _ in 0..2 {
        assert_eq!(daemon.post_json("/hooks/nowhere", &[], "{}").status, 404);
    }

    let (_driver, browser) = open(&format!("{console}/console/"), "the overview").await;
    for (css, expected) in [
        ("#webhooks-hour circle.accepted", (60, 3.0)),
        ("#webhooks-hour circle.refused", (60, 2.0)),
        ("#webhooks-day circle.accepted", (24, 3.0)),
        ("#turns-hour circle.completed", (60, 3.0)),
        ("#turns-day circle.failed", (24, 0.0)),
    ] {
        assert_eq!(points(&browser, css).await, expected, "{css}");
    }
    // A duration for each minute that had turns, and none for the others.
    let mut busy = 0;
    for point in browser
        .find_all(Locator::Css("#turns-hour circle.completed"))
        .await
        .expect("the turns")
    {
        let value = point.attr("data-value").await.expect("a value");
        busy += usize::from(value.as_deref() != Some("0"));
    }
    assert!(busy >= 1);
    assert_eq!(points(&browser, "#durations-hour circle.p95").await.0, busy);
    assert!(points(&browser, "#deliveries-hour circle.pending").await.0 >= 1);
    // 15 tokens a turn, today, against both daily budgets.
    let (days, _) = points(&browser, "#tokens-days circle.tokens").await;
    assert_eq!(days, 7);
    let today = text_of(&browser, "#tokens-days .axis-labels").await;
    assert!(today.contains("budgets.daily_tokens: 1000"), "{today}");
    let route = "[id='budget-routes.ops.budget.daily_tokens']";
    assert_eq!(
        points(&browser, &format!("{route} circle.used")).await,
        (7, 45.0)
    );
    let drawn = browser
        .find(Locator::Css("#webhooks-hour circle.accepted"))
        .await
        .expect("a point")
        .rectangle()
        .await
        .expect("where it is drawn");
    assert!(drawn.2 > 0.0 && drawn.3 > 0.0, "drawn: {drawn:?}");
    browser
        .execute(
            "document.getElementById('webhooks-hour').scrollIntoView()",
            Vec::new(),
        )
        .await
        .expect("scroll to the charts");
    screenshot(&browser, "overview-charts").await;
    browser.close().await.expect("close the browser");
}

/// The operator finds sessions by part of their key (in another case) and a route, then an
/// event by its status and session, with the pages' own forms: typed, chosen and submitted in
/// the browser, the address keeping what was asked; then the event's route, from its row, and
/// every page the menu links to.
#[tokio::test(flavor = "multi_thread")]
async fn an_operator_finds_a_session_and_an_event_with_the_forms() {
    if !browser_or_skip("an_operator_finds_a_session_and_an_event_with_the_forms") {
        return;
    }
    let checking = checking();
    let console = &checking.console;
    checking.completed("disk-web-1");
    checking.completed("disk-db-1");
    let id = checking.completed("web-frontend");
    let (_driver, browser) = open(&format!("{console}/console/sessions"), "the sessions").await;
    type_into(&browser, "input[name=key]", "DISK-").await;
    click(&browser, "select[name=route] option[value=ops]").await;
    click(&browser, "form.filter button").await;
    wait_for_address(&browser, "key=DISK-").await;
    let found = text_of(&browser, "main table").await;
    assert!(
        found.contains("disk-web-1") && found.contains("disk-db-1"),
        "{found}"
    );
    assert!(!found.contains("web-frontend"), "{found}");
    let address = browser.current_url().await.expect("the address");
    assert!(address.as_str().contains("route=ops"), "{address}");
    screenshot(&browser, "sessions-found").await;

    browser
        .goto(&format!("{console}/console/events"))
        .await
        .expect("the events");
    click(&browser, "select[name=status] option[value=completed]").await;
    type_into(&browser, "input[name=session]", "web-frontend").await;
    click(&browser, "form.filter button").await;
    wait_for_address(&browser, "session=web-frontend").await;
    wait_for_text(&browser, "main table", &id).await;
    let rows = browser
        .find_all(Locator::Css("main table tr td:first-child a"))
        .await
        .map_or(0, |found| found.len());
    assert_eq!(rows, 1, "only web-frontend's event");

    // The event's route, from its row: its settings, its latest events and what it spent.
    click(&browser, "main table a[href='/console/routes/ops']").await;
    wait_for_text(&browser, "main h1", "Route ops").await;
    let route = text_of(&browser, "main").await;
    for shown in ["/hooks/ops", "check", &id, "Spent since", "Budgets today"] {
        assert!(route.contains(shown), "{shown} in {route}");
    }
    screenshot(&browser, "route").await;

    // Every other page the menu links to, reached through it; the routes page lists the route.
    for (link, heading) in [
        ("/console/ledger", "Retry ledger"),
        ("/console/what-if", "What-if reports"),
        ("/console/", "Overview"),
        ("/console/routes", "Routes"),
    ] {
        click(&browser, &format!("nav a[href='{link}']")).await;
        wait_for_text(&browser, "main h1", heading).await;
    }
    let routes = text_of(&browser, "main table").await;
    assert!(routes.contains("/hooks/ops"), "{routes}");
    browser.close().await.expect("close the browser");
}
