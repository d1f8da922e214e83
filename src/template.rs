//! Route templates (minijinja): session keys, system text and prompts.
//!
//! Templates are compiled once per config load. Session keys render strictly, so a payload that
//! lacks a field the key needs is refused (400) instead of silently merging unrelated events into
//! one session; prompt and system text render leniently, since a missing field there only makes
//! the text shorter.

use std::collections::BTreeMap;

use minijinja::{Environment, UndefinedBehavior};
use serde::Serialize;

/// What a template can refer to.
#[derive(Debug, Serialize)]
pub(crate) struct EventContext<'a> {
    pub payload: &'a serde_json::Value,
    pub headers: &'a BTreeMap<String, String>,
    pub event_type: &'a str,
    pub route: &'a str,
    pub event_id: &'a str,
    pub delivery_id: Option<&'a str>,
}

/// Checks that a template compiles.
pub(crate) fn validate(source: &str) -> Result<(), String> {
    let mut environment = Environment::new();
    environment
        .add_template("check", source)
        .map_err(|err| one_line(&err))
}

fn one_line(err: &minijinja::Error) -> String {
    let mut message = err.to_string();
    if let Some(line) = err.line() {
        message = format!("{message} (template line {line})");
    }
    message.replace('\n', " ")
}

/// One route's template texts, as its config gives them.
pub(crate) struct TemplateSources<'a> {
    pub route: &'a str,
    pub session: Option<&'a str>,
    pub system: &'a str,
    pub prompt: &'a str,
}

/// Compiled templates of every route.
pub(crate) struct RouteTemplates {
    strict: Environment<'static>,
    lenient: Environment<'static>,
}

impl RouteTemplates {
    /// Compiles every route's templates. The config was validated, so errors are not expected;
    /// if one occurs anyway it is returned with the route and key named.
    pub(crate) fn compile<'a>(
        routes: impl IntoIterator<Item = TemplateSources<'a>>,
    ) -> Result<RouteTemplates, String> {
        let mut strict = Environment::new();
        strict.set_undefined_behavior(UndefinedBehavior::Strict);
        let mut lenient = Environment::new();
        lenient.set_undefined_behavior(UndefinedBehavior::Lenient);
        for route in routes {
            let name = route.route;
            if let Some(session) = route.session {
                strict
                    .add_template_owned(format!("{name}.session"), session.to_string())
                    .map_err(|e| format!("routes.{name}.session: {}", one_line(&e)))?;
            }
            for (key, source) in [("system", route.system), ("prompt", route.prompt)] {
                lenient
                    .add_template_owned(format!("{name}.{key}"), source.to_string())
                    .map_err(|e| format!("routes.{name}.{key}: {}", one_line(&e)))?;
            }
        }
        Ok(RouteTemplates { strict, lenient })
    }

    /// The session key of an event: the route's `session` template, else `<route>:<event_id>`.
    pub(crate) fn session_key(&self, context: &EventContext<'_>) -> Result<String, String> {
        let name = format!("{}.session", context.route);
        let Ok(template) = self.strict.get_template(&name) else {
            return Ok(format!("{}:{}", context.route, context.event_id));
        };
        let key = template
            .render(context)
            .map_err(|err| format!("routes.{}.session: {}", context.route, one_line(&err)))?;
        let key = key.trim();
        if key.is_empty() {
            return Err(format!(
                "routes.{}.session rendered an empty session key",
                context.route
            ));
        }
        if key.len() > 512 || key.chars().any(char::is_control) {
            return Err(format!(
                "routes.{}.session rendered a session key that is too long or has control characters",
                context.route
            ));
        }
        Ok(key.to_string())
    }

    /// Renders the route's `system` or `prompt` text.
    pub(crate) fn text(&self, key: &str, context: &EventContext<'_>) -> Result<String, String> {
        let name = format!("{}.{key}", context.route);
        self.lenient
            .get_template(&name)
            .and_then(|template| template.render(context))
            .map_err(|err| format!("routes.{}.{key}: {}", context.route, one_line(&err)))
    }
}
