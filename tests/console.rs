//! The web console on the control socket, against the real binary: every page answers, with
//! the headers that keep it to itself, and a payload's, a header's and a session key's markup
//! reaches the page as text.

mod common;

use common::*;
use serde_json::json;

const PLANTED: &str = "<script>alert('x')</script>";

fn get(workspace: &Workspace, target: &str) -> HttpResponse {
    control_request(&workspace.path().join("control.sock"), "GET", target)
}

fn header<'a>(response: &'a HttpResponse, name: &str) -> &'a str {
    response
        .headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map_or("", |(_, v)| v.as_str())
}

fn config(extra: &str) -> String {
    format!(
        "[routes.alerts]\npath = \"/hooks/alerts\"\nverify = {{ scheme = \"none\" }}\n\
         session = \"{{{{ payload.session }}}}\"\n{extra}"
    )
}

#[test]
fn every_page_shows_a_stranger_s_markup_as_text() {
    let workspace = Workspace::new();
    workspace.write_config(&config(""));
    let daemon = workspace.start();
    let session = format!("db-1 {PLANTED}");
    let response = daemon.post_json(
        "/hooks/alerts",
        &[("x-planted", PLANTED)],
        &json!({"session": session, "alert": PLANTED}).to_string(),
    );
    assert_eq!(response.status, 202, "{response:?}");
    let event_id = response.event_id();
    assert_eq!(
        workspace.wait_terminal(&event_id, std::time::Duration::from_secs(30)),
        "completed"
    );
    let encoded: String = session
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let pages = [
        "/console/".to_string(),
        "/console/sessions".to_string(),
        "/console/sessions?state=idle&route=alerts".to_string(),
        format!("/console/sessions/{encoded}"),
        format!("/console/events/{event_id}"),
        "/console/approvals".to_string(),
    ];
    for page in &pages {
        let answer = get(&workspace, page);
        assert_eq!(answer.status, 200, "{page}: {answer:?}");
        assert_eq!(header(&answer, "content-type"), "text/html; charset=utf-8");
        assert!(header(&answer, "content-security-policy").contains("default-src 'none'"));
        assert_eq!(header(&answer, "x-content-type-options"), "nosniff");
        assert!(
            !answer.body.contains("<script"),
            "{page} holds markup it was sent: {}",
            answer.body
        );
    }
    let listed = get(&workspace, "/console/sessions?state=idle&route=alerts").body;
    assert!(
        listed.contains(&format!("/console/sessions/{encoded}")),
        "{listed}"
    );
    assert!(listed.contains("db-1 &lt;script&gt;"), "{listed}");
    let event = get(&workspace, &format!("/console/events/{event_id}")).body;
    assert!(event.contains("&lt;script&gt;alert("), "{event}");
    let transcript = get(&workspace, &format!("/console/sessions/{encoded}")).body;
    assert!(transcript.contains("Transcript"), "{transcript}");
    assert!(transcript.contains("&lt;script&gt;"), "{transcript}");
    let style = get(&workspace, "/console/style.css");
    assert_eq!(header(&style, "content-type"), "text/css; charset=utf-8");
    assert_eq!(get(&workspace, "/console/events/no-such-event").status, 404);
    assert_eq!(get(&workspace, "/console/nothing-here").status, 404);
    drop(daemon);
}

#[test]
fn a_disabled_console_is_not_served() {
    let workspace = Workspace::new();
    workspace.write_config(&config("\n[console]\nenabled = false\n"));
    let _daemon = workspace.start();
    assert_eq!(get(&workspace, "/console/").status, 404);
    assert_eq!(get(&workspace, "/v1/status").status, 200);
}
