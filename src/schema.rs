//! Checks a tool call's arguments against the tool's full JSON Schema (draft 2020-12) before
//! anything runs.
//!
//! A tool's schema is the operator's statement of what may reach it; the arguments are the
//! model's, and the model reads payloads that strangers wrote. So the whole vocabulary is
//! enforced, with the `jsonschema` crate: types, `required`, `enum`, `const`, `pattern`,
//! lengths, ranges, `additionalProperties`, `format` (asserted, not just annotated), and the
//! combinators. A call that fails is not run; the model gets the reasons as the tool's result
//! and can correct itself, and the journal gets them without the argument values. The crate is
//! built without remote references: a schema whose `$ref` would need a fetch is not valid, and
//! nothing is fetched because of one (docs/tools.md, "Arguments").

use std::sync::Arc;

use serde_json::Value;

/// At most this many of a call's problems are reported.
const MAX_PROBLEMS: usize = 5;

/// Why a call's arguments were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mismatch {
    /// For the model: each problem with the value at fault.
    pub for_model: String,
    /// For the journal: each problem's location and rule, without values.
    pub for_log: String,
}

/// The validator for `schema`, or why `schema` is not a valid draft 2020-12 schema.
pub(crate) fn compile(schema: &Value) -> Result<jsonschema::Validator, String> {
    jsonschema::draft202012::options()
        .should_validate_formats(true)
        .build(schema)
        .map_err(|err| err.to_string())
}

/// A tool's parameter schema, compiled once (a command tool's when a turn's catalog is built, an
/// MCP tool's when its server lists it) for every call; or why it is not a valid schema, which each call of the tool is then told.
#[derive(Clone)]
pub(crate) struct Parameters(Arc<Result<jsonschema::Validator, String>>);

impl Parameters {
    pub(crate) fn compile(schema: &Value) -> Parameters {
        Parameters(Arc::new(compile(schema)))
    }

    /// Whether `other` is this very compilation, not another of the same schema.
    #[cfg(test)]
    pub(crate) fn is(&self, other: &Parameters) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Validates a call's arguments, `value`.
    pub(crate) fn validate(&self, value: &Value) -> Result<(), Mismatch> {
        let validator = self.0.as_ref().as_ref().map_err(|err| Mismatch {
            for_model: format!(
                "the tool's parameter schema is not valid ({err}); it cannot be called"
            ),
            for_log: format!("the tool's parameter schema is not valid: {err}"),
        })?;
        validate(validator, value)
    }
}

/// Validates `value` with `validator`.
fn validate(validator: &jsonschema::Validator, value: &Value) -> Result<(), Mismatch> {
    let problems: Vec<_> = validator.iter_errors(value).take(MAX_PROBLEMS).collect();
    if problems.is_empty() {
        return Ok(());
    }
    let list = |describe: &dyn Fn(&jsonschema::ValidationError<'_>) -> String| {
        problems
            .iter()
            .map(|problem| format!("at {}: {}", location(problem), describe(problem)))
            .collect::<Vec<_>>()
            .join("; ")
    };
    Err(Mismatch {
        for_model: list(&|problem| problem.to_string()),
        for_log: list(&|problem| problem.masked().to_string()),
    })
}

/// The properties of `schema` (at any depth) that accept any string: typed `string` with none
/// of `enum`, `const`, `pattern`, `maxLength` or `format`. Each as a path of property names
/// (`.properties.path`, `.properties.options.properties.mode`).
pub(crate) fn unbounded_strings(schema: &Value) -> Vec<String> {
    let mut found = Vec::new();
    collect_unbounded(schema, "", &mut found);
    found
}

fn collect_unbounded(schema: &Value, path: &str, found: &mut Vec<String>) {
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (name, property) in properties {
        let here = format!("{path}.properties.{name}");
        let is_string = match property.get("type") {
            Some(Value::String(kind)) => kind == "string",
            Some(Value::Array(kinds)) => kinds.iter().any(|kind| kind == "string"),
            _ => false,
        };
        let bounded = ["enum", "const", "pattern", "maxLength", "format"]
            .iter()
            .any(|keyword| property.get(*keyword).is_some());
        if is_string && !bounded {
            found.push(here.clone());
        }
        collect_unbounded(property, &here, found);
    }
}

/// Where in the arguments a problem is: `arguments` for the whole, `arguments/path` below it.
fn location(problem: &jsonschema::ValidationError<'_>) -> String {
    let path = problem.instance_path().to_string();
    format!("arguments{path}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_whole_schema_is_enforced_and_what_is_wrong_is_named() {
        let schema = json!({
            "type": "object",
            "properties": {
                "path": {"type": "string", "pattern": "^/srv/reports/[a-z0-9-]+\\.txt$", "maxLength": 64},
                "depth": {"type": "integer", "minimum": 1, "maximum": 3},
                "mode": {"enum": ["fast", "full"]},
                "since": {"type": "string", "format": "date"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}
            },
            "required": ["path"],
            "additionalProperties": false
        });
        let valid = json!({"path": "/srv/reports/q3.txt", "depth": 2, "since": "2026-12-01"});
        assert_eq!(Parameters::compile(&schema).validate(&valid), Ok(()));
        let refused = [
            (json!({"depth": 2}), "\"path\" is a required property"),
            (json!({"path": "/etc/shadow"}), "does not match"),
            (
                json!({"path": format!("/srv/reports/{}.txt", "a".repeat(80))}),
                "is longer than 64 characters",
            ),
            (
                json!({"path": "/srv/reports/a.txt", "depth": 9}),
                "is greater than the maximum of 3",
            ),
            (
                json!({"path": "/srv/reports/a.txt", "mode": "slow"}),
                "is not one of",
            ),
            (
                json!({"path": "/srv/reports/a.txt", "since": "yesterday"}),
                "is not a \"date\"",
            ),
            (
                json!({"path": "/srv/reports/a.txt", "tags": ["a", "b", "c"]}),
                "has more than 2 items",
            ),
            (
                json!({"path": "/srv/reports/a.txt", "x": 1}),
                "Additional properties are not allowed",
            ),
            (json!([1]), "is not of type \"object\""),
        ];
        for (value, expected) in refused {
            let mismatch = Parameters::compile(&schema)
                .validate(&value)
                .expect_err("invalid");
            assert!(
                mismatch.for_model.contains(expected),
                "{} vs {expected}",
                mismatch.for_model
            );
        }
    }

    #[test]
    fn the_journal_line_names_the_rule_but_not_the_value() {
        let schema = json!({"type": "object", "properties": {"path": {"type": "string", "pattern": "^/srv/"}}});
        let mismatch = Parameters::compile(&schema)
            .validate(&json!({"path": "/etc/shadow"}))
            .expect_err("invalid");
        assert!(mismatch.for_model.contains("/etc/shadow"), "{mismatch:?}");
        assert!(
            mismatch.for_log.starts_with("at arguments/path"),
            "{mismatch:?}"
        );
        assert!(!mismatch.for_log.contains("/etc/shadow"), "{mismatch:?}");
    }

    #[test]
    fn free_strings_are_found_at_any_depth() {
        let schema = json!({"type": "object", "properties": {
            "path": {"type": "string"},
            "mode": {"type": "string", "enum": ["a", "b"]},
            "name": {"type": ["string", "null"], "maxLength": 20},
            "options": {"type": "object", "properties": {"note": {"type": "string"}}},
            "count": {"type": "integer"}
        }});
        assert_eq!(
            unbounded_strings(&schema),
            [".properties.options.properties.note", ".properties.path"]
        );
    }

    #[test]
    fn schemas_that_are_not_valid_or_would_fetch_are_refused() {
        assert!(
            compile(&json!({"type": "object", "properties": {"n": {"type": "integer"}}})).is_ok()
        );
        assert!(compile(&json!({"type": "nonsense"})).is_err());
        assert!(compile(&json!({"type": "string", "pattern": "(unclosed"})).is_err());
        assert!(compile(&json!({"$ref": "https://example.com/schema.json"})).is_err());
        assert!(compile(&json!({"$ref": "file:///etc/passwd"})).is_err());
    }
}
