//! The console's actions: the operator overrides of `agentgate sessions`, `events replay`,
//! `deliveries retry` and `approvals`, each a form `POST` that carries this run's form token,
//! recorded with "console" as the actor. A done action answers `303 See Other` to the page that
//! shows what it did; one that could not be done shows why, with the control API's status.

use http::{Request, StatusCode};
use http_body_util::BodyExt;

use super::guard::{self, FORM_TOKEN_FIELD, Refusal};
use super::{Door, form, login_cookie_header, see_other};
use crate::config::ConsoleSettings;
use crate::ingress::approvals::MAX_NOTE;
use crate::ingress::control::{Control, ControlError, no_event, not_found};
use crate::ingress::query::{path_segment, percent_decode};
use crate::ingress::response::HttpResponse;
use crate::operator::OperatorAction;
use crate::session::approval::Outcome;
use crate::store::approval::Verdict;
use crate::store::{Decided, RetryTarget};

/// Who the console's actions are recorded as (docs/reference.md, "Approvals").
pub(crate) const CONSOLE: &str = "console";

impl Control {
    /// `POST /console/...`: the action at `segments`, once its form proves it is the console's.
    pub(super) async fn act(
        &self,
        segments: &[&str],
        request: Request<hyper::body::Incoming>,
        door: Door,
        console: &ConsoleSettings,
    ) -> HttpResponse {
        let path = request.uri().path().to_string();
        let Some(form) = form(request).await else {
            return self.refused_page(
                StatusCode::BAD_REQUEST,
                "the form is too long or not text",
                door,
            );
        };
        match segments {
            ["login"] => return self.login(form.get("token").as_deref(), door, console),
            ["logout"] => return logged_out(console.tls.is_some()),
            _ => {}
        }
        if !self
            .console
            .key
            .form_is_ours(form.get(FORM_TOKEN_FIELD).as_deref())
        {
            return self.refuse(Refusal::FormToken, door, &path);
        }
        let note = form.get("note").filter(|note| !note.trim().is_empty());
        if note
            .as_ref()
            .is_some_and(|note| note.chars().count() > MAX_NOTE)
        {
            let message = format!("the note is longer than {MAX_NOTE} characters");
            return self.refused_page(StatusCode::BAD_REQUEST, &message, door);
        }
        let done = match segments {
            ["sessions", key, action] => match OperatorAction::from_name(action) {
                Some(action) => {
                    self.operator_action(&percent_decode(key), action, CONSOLE)
                        .await
                }
                None => Ok(not_found(&http::Method::POST, &path)),
            },
            ["events", id, "replay"] => self.replay(&percent_decode(id)).await,
            ["deliveries", id, "retry"] => self.retry(&percent_decode(id)).await,
            ["approvals", id, "approve"] => {
                self.console_decide(&percent_decode(id), Verdict::Approve, note)
                    .await
            }
            ["approvals", id, "deny"] => {
                self.console_decide(&percent_decode(id), Verdict::Deny, note)
                    .await
            }
            _ => Ok(not_found(&http::Method::POST, &path)),
        };
        match done {
            Ok(answer) if answer.status() == StatusCode::SEE_OTHER => answer,
            Ok(answer) => self.explained(answer, door).await,
            Err(err) => self.refused_page(StatusCode::SERVICE_UNAVAILABLE, &err.to_string(), door),
        }
    }

    /// The control API's answer to an action (a JSON document), as a page that says what it
    /// says, or `303` back to the session when it was done.
    async fn explained(&self, answer: HttpResponse, door: Door) -> HttpResponse {
        let status = answer.status();
        let body = answer
            .into_body()
            .collect()
            .await
            .map(http_body_util::Collected::to_bytes)
            .unwrap_or_default();
        let document: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        if status.is_success()
            && let Some(key) = document.get("session").and_then(|key| key.as_str())
        {
            return see_other(&format!("/console/sessions/{}", path_segment(key)));
        }
        let message = document
            .get("message")
            .and_then(|message| message.as_str())
            .unwrap_or("the daemon did not say why");
        self.refused_page(status, message, door)
    }

    /// A copy of the event, accepted as a new one; the browser goes to the copy.
    async fn replay(&self, id: &str) -> Result<HttpResponse, ControlError> {
        let Some(copy) = self.store.replay_event(id).await? else {
            return Ok(no_event(id));
        };
        self.sessions.wake();
        tracing::info!(
            event_id = %id, copy = %copy,
            actor = CONSOLE, "event replayed by the operator as a new event"
        );
        Ok(see_other(&format!(
            "/console/events/{}",
            path_segment(&copy)
        )))
    }

    /// A failed delivery sent again with a fresh attempt budget.
    async fn retry(&self, id: &str) -> Result<HttpResponse, ControlError> {
        if self
            .store
            .retry_deliveries(RetryTarget::One(id.to_string()))
            .await?
            == 0
        {
            return Ok(crate::ingress::response::error(
                StatusCode::CONFLICT,
                "not_failed",
                &format!("no failed delivery for event {id:?}"),
            ));
        }
        self.deliveries.result_queued();
        tracing::info!(
            event_id = %id, actor = CONSOLE,
            "failed delivery queued again by the operator with a fresh attempt budget"
        );
        Ok(see_other("/console/deliveries"))
    }

    /// Approves or denies a request; the browser goes to its session, where the turn goes on.
    async fn console_decide(
        &self,
        id: &str,
        verdict: Verdict,
        note: Option<String>,
    ) -> Result<HttpResponse, ControlError> {
        let outcome = self.take_decision(id, verdict, CONSOLE, note).await?;
        Ok(match outcome {
            Outcome::Decided(Decided::Taken(row)) => {
                see_other(&format!("/console/sessions/{}", path_segment(&row.session)))
            }
            outcome => crate::ingress::approvals::answer(id, outcome),
        })
    }

    /// `POST /console/login` on `[console] listen`: the token gives the browser its cookie.
    fn login(
        &self,
        presented: Option<&str>,
        door: Door,
        console: &ConsoleSettings,
    ) -> HttpResponse {
        let token = console.token.as_ref().filter(|_| door == Door::Listen);
        let Some(token) = token else {
            return see_other("/console/");
        };
        if !presented.is_some_and(|presented| guard::is_token(token, presented)) {
            return self.refuse(Refusal::WrongToken, door, "/console/login");
        }
        let mut answer = see_other("/console/");
        let cookie = login_cookie_header(Some(&guard::login_cookie(token)), console.tls.is_some());
        if let Ok(cookie) = cookie.parse() {
            answer
                .headers_mut()
                .insert(http::header::SET_COOKIE, cookie);
        }
        answer
    }
}

/// `POST /console/logout`: the cookie is cleared.
fn logged_out(secure: bool) -> HttpResponse {
    let mut answer = see_other("/console/login");
    if let Ok(cookie) = login_cookie_header(None, secure).parse() {
        answer
            .headers_mut()
            .insert(http::header::SET_COOKIE, cookie);
    }
    answer
}
