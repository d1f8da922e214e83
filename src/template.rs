//! Route templates (minijinja): session keys, system text and prompts.
//!
//! Templates are compiled once per config load. Session keys render strictly, so a payload that
//! lacks a field the key needs is refused (400) instead of silently merging unrelated events into
//! one session; prompt and system text render leniently, since a missing field there only makes
//! the text shorter.

use std::collections::BTreeMap;
use std::sync::LazyLock;

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

/// The event data a template refers to (`payload`, `headers`, `event_type`, `event_id`,
/// `delivery_id`); `route` is the operator's own and not listed.
pub(crate) fn event_data_used(source: &str) -> Vec<String> {
    let mut environment = Environment::new();
    if environment.add_template("check", source).is_err() {
        return Vec::new();
    }
    let Ok(template) = environment.get_template("check") else {
        return Vec::new();
    };
    let mut used: Vec<String> = template
        .undeclared_variables(false)
        .into_iter()
        .filter(|name| {
            matches!(
                name.as_str(),
                "payload" | "headers" | "event_type" | "event_id" | "delivery_id"
            )
        })
        .collect();
    used.sort();
    used
}

fn one_line(err: &minijinja::Error) -> String {
    let mut message = err.to_string();
    if let Some(line) = err.line() {
        message = format!("{message} (template line {line})");
    }
    message.replace('\n', " ")
}

/// Session keys longer than this many bytes are shortened (see [`shorten_key`]).
pub(crate) const MAX_SESSION_KEY: usize = 512;

/// A key longer than [`MAX_SESSION_KEY`] becomes its readable beginning and a digest of the
/// whole (`<prefix>…#<sha256, 16 hex digits>`): stable for the same long key, distinct for
/// different ones, and short enough for the journal, the CLI and the ledger. Alertmanager's
/// `group_by: ['...']` keys of every label are the usual case.
fn shorten_key(key: &str) -> String {
    if key.len() <= MAX_SESSION_KEY {
        return key.to_string();
    }
    use sha2::Digest;
    let digest = hex::encode(sha2::Sha256::digest(key.as_bytes()));
    let mut end = MAX_SESSION_KEY - 64;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…#{}", &key[..end], &digest[..16])
}

/// Renders one part of a session key: strings and numbers only. A null (a missing or null
/// field), a boolean, an object or a list would render as `none`, `true` or a repr, and merge
/// unrelated events into one session, so the event is refused instead.
#[expect(
    clippy::wildcard_enum_match_arm,
    reason = "minijinja's ValueKind is open-ended; only strings and numbers make a key"
)]
fn key_part(
    out: &mut minijinja::Output<'_>,
    state: &minijinja::State<'_, '_>,
    value: &minijinja::Value,
) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    match value.kind() {
        ValueKind::String | ValueKind::Number => minijinja::escape_formatter(out, state, value),
        kind => Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!(
                "a session key part is {}; keys take strings and numbers (a missing or null \
                 field, a boolean, an object or a list would merge unrelated events)",
                match kind {
                    ValueKind::None | ValueKind::Undefined => "null",
                    ValueKind::Bool => "a boolean",
                    ValueKind::Seq | ValueKind::Iterable => "a list",
                    _ => "an object",
                }
            ),
        )),
    }
}

/// Renders a prompt again from its stored event: `source` is the `prompt` template that the
/// event's turn recorded (the route's own may have changed since), rendered as route prompts are.
pub(crate) fn render_recorded_prompt(
    source: &str,
    context: &EventContext<'_>,
) -> Result<String, String> {
    static RECORDED: LazyLock<Environment<'static>> = LazyLock::new(|| {
        let mut environment = Environment::new();
        environment.set_undefined_behavior(UndefinedBehavior::Lenient);
        environment
    });
    RECORDED
        .render_str(source, context)
        .map_err(|err| format!("routes.{}.prompt: {}", context.route, one_line(&err)))
}

/// One route's template texts, as its config gives them.
pub(crate) struct TemplateSources<'a> {
    pub route: &'a str,
    pub session: Option<&'a str>,
    pub system: &'a str,
    pub prompt: &'a str,
    pub event_type: Option<&'a str>,
    pub delivery_id: Option<&'a str>,
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
        strict.set_formatter(key_part);
        let mut lenient = Environment::new();
        lenient.set_undefined_behavior(UndefinedBehavior::Lenient);
        for route in routes {
            let name = route.route;
            if let Some(session) = route.session {
                strict
                    .add_template_owned(format!("{name}.session"), session.to_string())
                    .map_err(|e| format!("routes.{name}.session: {}", one_line(&e)))?;
            }
            let optional = [
                ("event_type", route.event_type),
                ("delivery_id", route.delivery_id),
            ];
            let given = [
                ("system", Some(route.system)),
                ("prompt", Some(route.prompt)),
            ];
            for (key, source) in given.into_iter().chain(optional) {
                if let Some(source) = source {
                    lenient
                        .add_template_owned(format!("{name}.{key}"), source.to_string())
                        .map_err(|e| format!("routes.{name}.{key}: {}", one_line(&e)))?;
                }
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
        if key
            .chars()
            .any(|c| c.is_control() || crate::untrusted::is_invisible_format(c))
        {
            return Err(format!(
                "routes.{}.session rendered a session key with control, bidirectional or \
                 zero-width characters",
                context.route
            ));
        }
        Ok(shorten_key(key))
    }

    /// Renders the route's `event_type` or `delivery_id` template, if it has one; an empty
    /// result is `None`.
    pub(crate) fn optional_text(
        &self,
        key: &str,
        context: &EventContext<'_>,
    ) -> Result<Option<String>, String> {
        let name = format!("{}.{key}", context.route);
        let Ok(template) = self.lenient.get_template(&name) else {
            return Ok(None);
        };
        let text = template
            .render(context)
            .map_err(|err| format!("routes.{}.{key}: {}", context.route, one_line(&err)))?;
        let text = text.trim();
        Ok((!text.is_empty()).then(|| text.to_string()))
    }

    /// Renders the route's `prompt` for an event: the only template whose text reaches the
    /// model with the event's data (inside the event markers).
    pub(crate) fn prompt(&self, context: &EventContext<'_>) -> Result<String, String> {
        let name = format!("{}.prompt", context.route);
        self.lenient
            .get_template(&name)
            .and_then(|template| template.render(context))
            .map_err(|err| format!("routes.{}.prompt: {}", context.route, one_line(&err)))
    }

    /// Renders the route's `system` text. It is the operator's own and stands outside the event
    /// markers, so it is rendered with a context that holds `route` and nothing else: no event
    /// data reaches it, whatever the template does (`{{ debug() }}` included).
    pub(crate) fn system(&self, route: &str) -> Result<String, String> {
        let name = format!("{route}.system");
        self.lenient
            .get_template(&name)
            .and_then(|template| template.render(minijinja::context! { route => route }))
            .map_err(|err| format!("routes.{route}.system: {}", one_line(&err)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `system` sees `route` only: a template that dumps its context shows no event data.
    #[test]
    fn the_system_text_sees_no_event_data() {
        let templates = RouteTemplates::compile([TemplateSources {
            route: "hook",
            session: None,
            system: "route {{ route }}; context {{ debug() }}",
            prompt: "{{ payload.secret }}",
            event_type: None,
            delivery_id: None,
        }])
        .unwrap_or_else(|err| panic!("{err}"));
        let payload = serde_json::json!({"secret": "payload-text-4711"});
        let headers = BTreeMap::new();
        let context = EventContext {
            payload: &payload,
            headers: &headers,
            event_type: "push",
            route: "hook",
            event_id: "e1",
            delivery_id: None,
        };
        let system = templates
            .system("hook")
            .unwrap_or_else(|err| panic!("{err}"));
        assert!(system.starts_with("route hook;"), "{system}");
        assert!(
            !system.contains("4711") && !system.contains("payload"),
            "{system}"
        );
        let prompt = templates
            .prompt(&context)
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(prompt, "payload-text-4711");
    }
}
