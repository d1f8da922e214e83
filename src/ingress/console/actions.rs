//! The console's actions: the operator overrides of `agentgate sessions` (rewind and fork
//! included), `events replay`,
//! `deliveries retry` and `approvals`, each a form `POST` that carries this run's form token,
//! recorded with "console" as the actor. A done action answers `303 See Other` to the page that
//! shows what it did; one that could not be done shows why, with the control API's status.

use http::{Request, StatusCode};
use http_body_util::BodyExt;

use super::Console;
use super::guard::{self, FORM_TOKEN_FIELD, Refusal};
use super::{Door, login_cookie_header, see_other};
use crate::config::ConsoleSettings;
use crate::ingress::api::RerunRequest;
use crate::ingress::approvals::MAX_NOTE;
use crate::ingress::connection::RequestBody;
use crate::ingress::control::{ControlError, no_event, not_found};
use crate::ingress::query::{Query, path_segment, percent_decode};
use crate::ingress::response::HttpResponse;
use crate::operator::{OperatorAction, Rerun};
use crate::session::approval::Outcome;
use crate::store::approval::Verdict;
use crate::store::{Decided, RetryTarget};

/// Who the console's actions are recorded as (docs/reference.md, "Approvals").
pub(crate) const CONSOLE: &str = "console";

impl Console {
    /// `POST /console/...`: the action at `segments`, once its form proves it is the console's.
    pub(super) async fn act(
        &self,
        segments: &[&str],
        request: Request<RequestBody>,
        door: Door,
    ) -> HttpResponse {
        let path = request.uri().path().to_string();
        let form = match self.form(request).await {
            Ok(Some(form)) => form,
            Ok(None) => {
                return self.refused_page(
                    StatusCode::BAD_REQUEST,
                    "the form is too long or not text",
                    door,
                );
            }
            Err(timed_out) => return timed_out,
        };
        if !self.key.form_is_ours(form.get(FORM_TOKEN_FIELD).as_deref()) {
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
            ["sessions", key, rerun @ ("rewind" | "fork")] => {
                let rerun = if *rerun == "fork" {
                    Rerun::Fork
                } else {
                    Rerun::Rewind
                };
                self.console_rerun(&percent_decode(key), rerun, &form).await
            }
            ["sessions", key, action] => match OperatorAction::from_name(action) {
                Some(action) => {
                    self.ops
                        .operator_action(&percent_decode(key), action, CONSOLE)
                        .await
                }
                None => Ok(not_found(&http::Method::POST, &path)),
            },
            ["events", id, "replay"] => self.console_replay(&percent_decode(id)).await,
            ["deliveries", id, "retry"] => self.console_retry(&percent_decode(id)).await,
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
    async fn console_replay(&self, id: &str) -> Result<HttpResponse, ControlError> {
        Ok(match self.ops.replay(id, CONSOLE).await? {
            Some(copy) => see_other(&format!("/console/events/{}", path_segment(&copy))),
            None => no_event(id),
        })
    }

    /// A rewind or fork from the session page's form (`to`, or `at` and `as`); the browser goes
    /// to the session the new turn runs in.
    async fn console_rerun(
        &self,
        key: &str,
        rerun: Rerun,
        form: &Query,
    ) -> Result<HttpResponse, ControlError> {
        let entry = |name| form.get(name).and_then(|n| n.trim().parse::<i64>().ok());
        let asked = RerunRequest {
            to: entry("to"),
            at: entry("at"),
            as_key: form.get("as").map(|key| key.trim().to_string()),
        };
        let request = match asked.of(key, rerun) {
            Ok(request) => request,
            Err(message) => {
                return Ok(crate::ingress::response::error(
                    StatusCode::BAD_REQUEST,
                    "bad_rerun",
                    &message,
                ));
            }
        };
        let runs_in = request.fork_as.clone().unwrap_or_else(|| key.to_string());
        let answer = self.ops.rerun(request, CONSOLE).await?;
        Ok(if answer.status().is_success() {
            see_other(&format!("/console/sessions/{}", path_segment(&runs_in)))
        } else {
            answer
        })
    }

    /// A failed delivery sent again with a fresh attempt budget.
    async fn console_retry(&self, id: &str) -> Result<HttpResponse, ControlError> {
        if self
            .ops
            .retry(RetryTarget::One(id.to_string()), CONSOLE)
            .await?
            == 0
        {
            return Ok(crate::ingress::response::error(
                StatusCode::CONFLICT,
                "not_failed",
                &format!("no failed delivery for event {id:?}"),
            ));
        }
        Ok(see_other("/console/deliveries"))
    }

    /// Approves or denies a request; the browser goes to its session, where the turn goes on.
    async fn console_decide(
        &self,
        id: &str,
        verdict: Verdict,
        note: Option<String>,
    ) -> Result<HttpResponse, ControlError> {
        let outcome = self.ops.take_decision(id, verdict, CONSOLE, note).await?;
        Ok(match outcome {
            Outcome::Decided(Decided::Taken(row)) => {
                see_other(&format!("/console/sessions/{}", path_segment(&row.session)))
            }
            outcome @ (Outcome::Decided(
                Decided::Already(_) | Decided::Expired(_) | Decided::Unknown,
            )
            | Outcome::ToolGone(_)) => crate::ingress::approvals::answer(id, outcome),
        })
    }

    /// `POST /console/login` on `[console] listen`: the token gives the browser the cookie of a
    /// new login. A wrong one counts against `peer`'s address, which past five of them waits
    /// longer after each (`429` with `Retry-After`, counted as `throttled`).
    pub(super) async fn login(
        &self,
        request: Request<RequestBody>,
        door: Door,
        peer: Option<std::net::IpAddr>,
        console: &ConsoleSettings,
    ) -> HttpResponse {
        let token = console.token.as_ref().filter(|_| door == Door::Listen);
        let Some(token) = token else {
            return see_other("/console/");
        };
        let logins = &self.logins;
        if let Some(wait) = logins.throttled(peer) {
            let mut answer = self.refuse(Refusal::Throttled, door, "/console/login");
            let seconds = wait.as_secs() + 1;
            if let Ok(value) = seconds.to_string().parse() {
                answer
                    .headers_mut()
                    .insert(http::header::RETRY_AFTER, value);
            }
            return answer;
        }
        let presented = match self.form(request).await {
            Ok(form) => form.and_then(|form| form.get("token")),
            Err(timed_out) => return timed_out,
        };
        if !presented.is_some_and(|presented| guard::is_token(token, &presented)) {
            logins.failed(peer);
            return self.refuse(Refusal::WrongToken, door, "/console/login");
        }
        let Ok(login) = logins.logged_in_with(token, peer) else {
            return self.refused_page(
                StatusCode::SERVICE_UNAVAILABLE,
                "no random bytes for a login; try again",
                door,
            );
        };
        let mut answer = see_other("/console/");
        let cookie = login_cookie_header(Some(&login), console.tls.is_some());
        if let Ok(cookie) = cookie.parse() {
            answer
                .headers_mut()
                .insert(http::header::SET_COOKIE, cookie);
        }
        answer
    }
}

/// `POST /console/logout`: the login has ended; the cookie is cleared.
pub(super) fn logged_out(secure: bool) -> HttpResponse {
    let mut answer = see_other("/console/login");
    if let Ok(cookie) = login_cookie_header(None, secure).parse() {
        answer
            .headers_mut()
            .insert(http::header::SET_COOKIE, cookie);
    }
    answer
}
