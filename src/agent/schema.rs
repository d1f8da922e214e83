//! Checks a tool call's arguments against the tool's `parameters` schema before anything runs.
//!
//! This covers the JSON Schema subset that tool definitions use in practice: `type`, `properties`,
//! `required`, `additionalProperties: false`, `enum` and `items`. A call that fails is not run; the
//! model gets the reason as the tool's result and can correct itself.

use serde_json::Value;

/// Validates `value` against `schema`; the error names the offending path.
pub(crate) fn validate(schema: &Value, value: &Value) -> Result<(), String> {
    check(schema, value, "arguments")
}

fn type_matches(expected: &str, value: &Value) -> bool {
    match expected {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "number" => value.is_number(),
        "integer" => value.as_i64().is_some() || value.as_u64().is_some(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        _ => true,
    }
}

fn check(schema: &Value, value: &Value, path: &str) -> Result<(), String> {
    let Some(schema) = schema.as_object() else {
        return Ok(());
    };
    match schema.get("type") {
        Some(Value::String(expected)) if !type_matches(expected, value) => {
            return Err(format!("{path} must be of type {expected}"));
        }
        Some(Value::Array(options))
            if !options
                .iter()
                .filter_map(Value::as_str)
                .any(|t| type_matches(t, value)) =>
        {
            return Err(format!("{path} has none of the allowed types"));
        }
        _ => {}
    }
    if let Some(Value::Array(allowed)) = schema.get("enum")
        && !allowed.contains(value)
    {
        return Err(format!(
            "{path} must be one of {}",
            Value::Array(allowed.clone())
        ));
    }
    if let Value::Object(object) = value {
        let properties = schema.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = schema.get("required") {
            for name in required.iter().filter_map(Value::as_str) {
                if !object.contains_key(name) {
                    return Err(format!("{path}.{name} is required"));
                }
            }
        }
        for (name, item) in object {
            match properties.and_then(|p| p.get(name)) {
                Some(property) => check(property, item, &format!("{path}.{name}"))?,
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return Err(format!("{path}.{name} is not an allowed property"));
                }
                None => {}
            }
        }
    }
    if let (Value::Array(items), Some(item_schema)) = (value, schema.get("items")) {
        for (index, item) in items.iter().enumerate() {
            check(item_schema, item, &format!("{path}[{index}]"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn accepts_valid_and_names_what_is_wrong() {
        let schema = json!({
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "depth": {"type": "integer"},
                "mode": {"enum": ["fast", "full"]},
                "tags": {"type": "array", "items": {"type": "string"}}
            },
            "required": ["path"],
            "additionalProperties": false
        });
        assert_eq!(validate(&schema, &json!({"path": "/", "depth": 2})), Ok(()));
        let errors = [
            (json!({"depth": 2}), "arguments.path is required"),
            (json!({"path": 1}), "arguments.path must be of type string"),
            (
                json!({"path": "/", "depth": 1.5}),
                "arguments.depth must be of type integer",
            ),
            (
                json!({"path": "/", "mode": "slow"}),
                "arguments.mode must be one of",
            ),
            (
                json!({"path": "/", "tags": ["a", 2]}),
                "arguments.tags[1] must be of type string",
            ),
            (
                json!({"path": "/", "x": 1}),
                "arguments.x is not an allowed property",
            ),
            (json!([1]), "arguments must be of type object"),
        ];
        for (value, expected) in errors {
            let err = validate(&schema, &value).expect_err("invalid");
            assert!(err.starts_with(expected), "{err} vs {expected}");
        }
    }
}
