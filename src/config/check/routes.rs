//! `[routes.NAME]`, with their `verify` and `deliver` tables.

use std::collections::BTreeMap;

use super::sandbox::RawSandbox;
use super::{Checker, DEFAULT_DELIVERY_CONCURRENCY, redacted_url, valid_name};
use crate::config::raw::{RawDeliver, RawHistory, RawRoute, RawVerify};
use crate::config::settings::{
    DEFAULT_PROMPT, DeliverSettings, McpServerSettings, OnBusy, RouteSettings, ServerSettings,
    ToolRef, ToolSettings,
};
use crate::config::units::{parse_duration, parse_rate, parse_size};
use crate::secret::{Secret, SecretSource};
use crate::signature::{VerifyScheme, VerifySettings};

/// The longest `coalesce` window: an event that waits longer than this joins nothing more.
const MAX_COALESCE: std::time::Duration = std::time::Duration::from_secs(3600);

impl Checker<'_> {
    pub(super) fn route(
        &mut self,
        name: String,
        raw: RawRoute,
        server: &Option<ServerSettings>,
        tools: &BTreeMap<String, ToolSettings>,
        mcp: &BTreeMap<String, McpServerSettings>,
    ) -> Option<RouteSettings> {
        let prefix = format!("routes.{name}");
        self.route_name_and_path(&prefix, &name, &raw.path);
        self.route_templates(&prefix, &raw);
        let verify = self.verify(&prefix, raw.verify, server.as_ref())?;
        if let Some(events) = &raw.events
            && events.is_empty()
        {
            self.error(
                &format!("{prefix}.events"),
                "an empty events list ignores everything; remove the key to accept all",
            );
        }
        if raw.events.is_some() && raw.event_type.is_none() && !verify.scheme.has_event_type() {
            self.error(
                &format!("{prefix}.events"),
                "this verify scheme carries no event type, so events would filter on \
                 payload.type, which most senders on it never set (Alertmanager does not); add \
                 event_type = \"{{ payload.FIELD }}\" naming where the type is",
            );
        }
        let tool_refs = self.route_tools(&prefix, &raw.tools, tools, mcp);
        let on_busy = self.on_busy(&prefix, raw.on_busy.as_deref());
        let deliver = match raw.deliver {
            None => DeliverSettings::Log,
            Some(raw) => self.deliver(&prefix, raw)?,
        };
        let rate_limit = self.value(
            &format!("{prefix}.rate_limit"),
            raw.rate_limit.map(Some),
            None,
            |t| t.map(|t| parse_rate(&t)).transpose(),
        );
        let max_queued_events = raw.max_queued_events.map(|raw| {
            u64::from(self.positive(&format!("{prefix}.max_queued_events"), Some(raw), 1))
        });
        let priority = self.value(&format!("{prefix}.priority"), raw.priority, 0, |n| {
            i32::try_from(n)
                .ok()
                .filter(|n| (-1000..=1000).contains(n))
                .ok_or_else(|| format!("{n} is not a priority from -1000 to 1000"))
        });
        let coalesce = self.value(&format!("{prefix}.coalesce"), raw.coalesce, None, |text| {
            let window = parse_duration(&text)?;
            if window.is_zero() || window > MAX_COALESCE {
                return Err(format!("{text:?} is not a window from 1ms to 1h"));
            }
            Ok(Some(window))
        });
        let history = self.history(&prefix, raw.history.unwrap_or_default());
        let budget = self.budget_limits(&format!("{prefix}.budget"), raw.budget);
        let default_max_body = server.as_ref().map_or(1 << 20, |s| s.max_body);
        let max_body = self.value(
            &format!("{prefix}.max_body"),
            raw.max_body,
            default_max_body,
            |t| parse_size(&t),
        );
        Some(RouteSettings {
            path: raw.path,
            verify,
            events: raw.events,
            session: raw.session,
            event_type: raw.event_type,
            delivery_id: raw.delivery_id,
            history,
            hidden_headers: raw
                .hidden_headers
                .iter()
                .map(|name| name.to_ascii_lowercase())
                .collect(),
            system: raw.system.unwrap_or_default(),
            prompt: raw.prompt.unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
            interactive: raw.interactive.unwrap_or(false),
            tools: tool_refs,
            on_busy,
            deliver,
            rate_limit,
            max_queued_events,
            priority,
            coalesce,
            max_body,
            budget,
            name,
        })
    }

    fn route_name_and_path(&mut self, prefix: &str, name: &str, path: &str) {
        if !valid_name(name) {
            self.error(
                prefix,
                "route names may use letters, digits, '_' and '-' (they appear in session keys and on the command line)",
            );
        }
        if !path.starts_with('/') || path.contains(char::is_whitespace) {
            self.error(
                &format!("{prefix}.path"),
                format!("{path:?} must be an absolute URL path such as /hooks/github"),
            );
        } else if matches!(path, "/healthz" | "/readyz") {
            self.error(
                &format!("{prefix}.path"),
                format!("{path} is reserved for health checks"),
            );
        }
    }

    /// Every template compiles, and `system` uses no event data: the system text sits outside
    /// the event markers, where event data could instruct the model as the operator does.
    fn route_templates(&mut self, prefix: &str, raw: &RawRoute) {
        for (key, template) in [
            ("session", raw.session.as_deref()),
            ("system", raw.system.as_deref()),
            ("prompt", raw.prompt.as_deref()),
            ("event_type", raw.event_type.as_deref()),
            ("delivery_id", raw.delivery_id.as_deref()),
        ] {
            if let Some(template) = template
                && let Err(err) = crate::template::validate(template)
            {
                self.error(&format!("{prefix}.{key}"), format!("template error: {err}"));
            }
        }
        if let Some(system) = raw.system.as_deref() {
            let used = crate::template::event_data_used(system);
            if !used.is_empty() {
                self.error(
                    &format!("{prefix}.system"),
                    format!(
                        "system may not use event data ({}): it is outside the event markers, \
                         where the model takes it as the operator's instructions; put event data \
                         in prompt",
                        used.join(", ")
                    ),
                );
            }
        }
    }

    /// The route's `tools` entries, each naming a defined tool or MCP server.
    fn route_tools(
        &mut self,
        prefix: &str,
        entries: &[String],
        tools: &BTreeMap<String, ToolSettings>,
        mcp: &BTreeMap<String, McpServerSettings>,
    ) -> Vec<ToolRef> {
        let tool_refs: Vec<ToolRef> = entries.iter().map(|entry| ToolRef::parse(entry)).collect();
        for (entry, tool) in entries.iter().zip(&tool_refs) {
            let problem = match tool {
                ToolRef::Command(name) if !tools.contains_key(name) => {
                    Some(format!("tool {name:?} is not defined under [tools]"))
                }
                ToolRef::Command(_) => None,
                ToolRef::Mcp { server, .. } if !mcp.contains_key(server) => Some(format!(
                    "{entry:?} names the MCP server {server:?}, which has no [mcp.{server}] table"
                )),
                ToolRef::Mcp {
                    tool: Some(tool), ..
                } if tool.is_empty() => Some(format!(
                    "{entry:?} names no tool; use \"SERVER.tool\" or \"SERVER.*\""
                )),
                ToolRef::Mcp { .. } => None,
            };
            if let Some(problem) = problem {
                self.error(&format!("{prefix}.tools"), problem);
            }
        }
        tool_refs
    }

    fn on_busy(&mut self, prefix: &str, raw: Option<&str>) -> OnBusy {
        match raw {
            None | Some("queue") => OnBusy::Queue,
            Some("interrupt") => OnBusy::Interrupt,
            Some(other) => {
                self.error(
                    &format!("{prefix}.on_busy"),
                    format!("{other:?} is not queue or interrupt"),
                );
                OnBusy::Queue
            }
        }
    }

    fn history(&mut self, prefix: &str, raw: RawHistory) -> crate::config::HistoryLimits {
        crate::config::HistoryLimits {
            max_turns: self.positive(&format!("{prefix}.history.max_turns"), raw.max_turns, 20)
                as usize,
            max_bytes: usize::try_from(self.value(
                &format!("{prefix}.history.max_bytes"),
                raw.max_bytes,
                256 << 10,
                |t| parse_size(&t),
            ))
            .unwrap_or(usize::MAX),
        }
    }

    fn verify(
        &mut self,
        prefix: &str,
        raw: RawVerify,
        server: Option<&ServerSettings>,
    ) -> Option<VerifySettings> {
        let key_path = format!("{prefix}.verify");
        let Some(scheme) = VerifyScheme::parse(&raw.scheme) else {
            self.error(
                &format!("{key_path}.scheme"),
                format!(
                    "unknown scheme {:?}; use one of {}",
                    raw.scheme,
                    VerifyScheme::ALL.map(VerifyScheme::name).join(", ")
                ),
            );
            return None;
        };
        if raw.header.is_some() && scheme != VerifyScheme::HmacSha256 {
            self.error(
                &format!("{key_path}.header"),
                "header applies only to scheme hmac-sha256",
            );
        }
        let header = raw.header.unwrap_or_else(|| "X-Signature".to_string());
        if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
            self.error(
                &format!("{key_path}.header"),
                format!("{header:?} is not a valid header name"),
            );
        }
        let secret_key = format!("{key_path}.secret");
        // `secrets = [...]`: every one verifies, for rotating a secret without downtime; the
        // first is the one `send` signs with.
        let sources = match (raw.secret, raw.secrets) {
            (Some(_), Some(_)) => {
                self.error(&secret_key, "give secret or secrets, not both");
                return None;
            }
            (Some(source), None) => vec![source],
            (None, Some(list)) if list.is_empty() => {
                self.error(
                    &format!("{key_path}.secrets"),
                    "an empty list verifies nothing",
                );
                return None;
            }
            (None, Some(list)) => list,
            (None, None) => Vec::new(),
        };
        let mut keys = Vec::new();
        match (scheme, sources.is_empty()) {
            (VerifyScheme::None, true) => {
                let listen = server.map(|s| s.listen);
                let message = "verify = none accepts unsigned webhooks; it is refused unless every webhook listener is on a loopback address";
                match listen {
                    Some(addr) if !addr.ip().is_loopback() => self.warn(
                        &format!("{key_path}.scheme"),
                        format!("{message} (server.listen is {addr})"),
                    ),
                    _ => self.warn(&format!("{key_path}.scheme"), message),
                }
            }
            (VerifyScheme::None, false) => {
                self.error(&secret_key, "scheme none takes no secret");
            }
            (_, true) => {
                self.error(&secret_key, format!("scheme {} needs a secret", raw.scheme));
                return None;
            }
            (scheme, false) => {
                for source in &sources {
                    let secret = self.secret(&secret_key, source)?;
                    keys.push(if scheme == VerifyScheme::Standard {
                        self.standard_key(&secret_key, secret)?
                    } else {
                        secret
                    });
                }
            }
        }
        let mut keys = keys.into_iter();
        let key = keys.next();
        let other_keys = keys.collect();
        Some(VerifySettings {
            scheme,
            key,
            other_keys,
            header,
        })
    }

    /// Standard Webhooks secrets are `whsec_<base64>`; the decoded bytes are the HMAC key.
    fn standard_key(&mut self, key: &str, secret: Secret) -> Option<Secret> {
        if secret.expose().is_empty() {
            return Some(secret); // a credential left for the service to load
        }
        match crate::signature::decode_standard_secret(&secret) {
            Ok(decoded) => Some(decoded),
            Err(message) => {
                self.error(key, message);
                None
            }
        }
    }

    fn deliver(&mut self, prefix: &str, raw: RawDeliver) -> Option<DeliverSettings> {
        let key_path = format!("{prefix}.deliver");
        match raw.kind.as_str() {
            "log" => Some(DeliverSettings::Log),
            "http" => {
                let url_key = format!("{key_path}.url");
                let url = match raw.url {
                    None => {
                        self.error(&url_key, "an http delivery needs url");
                        return None;
                    }
                    // A plain URL is not a secret; one from a credential, file or variable is.
                    Some(SecretSource::Literal(text)) => crate::secret::Secret::plain(text),
                    Some(source) => self.secret(&url_key, &source)?,
                };
                let text = String::from_utf8_lossy(url.expose()).into_owned();
                let parsed = url::Url::parse(&text);
                let usable = parsed
                    .as_ref()
                    .is_ok_and(|parsed| matches!(parsed.scheme(), "http" | "https"));
                // An unloaded credential (checked outside the service) is empty.
                if !usable && !text.is_empty() {
                    self.error(
                        &url_key,
                        format!("{} is not an http(s) URL", redacted_url(&text)),
                    );
                }
                let key = match raw.secret {
                    None => None,
                    Some(source) => {
                        let secret_key = format!("{key_path}.secret");
                        let secret = self.secret(&secret_key, &source)?;
                        Some(self.standard_key(&secret_key, secret)?)
                    }
                };
                let concurrency = self.positive(
                    &format!("{key_path}.concurrency"),
                    raw.concurrency,
                    DEFAULT_DELIVERY_CONCURRENCY,
                ) as usize;
                Some(DeliverSettings::Http {
                    url,
                    key,
                    concurrency,
                })
            }
            "command" => {
                let argv = raw.command.unwrap_or_default();
                self.argv(&format!("{key_path}.command"), &argv);
                let concurrency = self.positive(
                    &format!("{key_path}.concurrency"),
                    raw.concurrency,
                    DEFAULT_DELIVERY_CONCURRENCY,
                ) as usize;
                let sandbox = self.sandboxing(
                    &key_path,
                    RawSandbox {
                        sandbox: raw.sandbox,
                        network: raw.network,
                        writable: raw.writable,
                    },
                );
                Some(DeliverSettings::Command {
                    argv,
                    concurrency,
                    sandbox,
                })
            }
            other => {
                self.error(
                    &format!("{key_path}.kind"),
                    format!("unknown deliver kind {other:?}; use log, http or command"),
                );
                None
            }
        }
    }
}
