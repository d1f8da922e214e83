//! `[server]`, `[store]` and `[runtime]`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{Checker, host_name, valid_name};
use crate::config::raw::{RawRuntime, RawServer, RawStore, RawTls};
use crate::config::settings::{PostgresSettings, RuntimeSettings, ServerSettings, StoreSettings};
use crate::config::units::parse_size;
use crate::logging::{DEFAULT_EVENT_LINES_PER_SECOND, EventLogLevel};
use crate::tls::TlsSettings;

impl Checker<'_> {
    pub(in crate::config) fn store(
        &mut self,
        raw: RawStore,
        max_concurrent_turns: usize,
    ) -> Option<StoreSettings> {
        let backend = raw.backend.as_deref().unwrap_or("sqlite");
        if backend == "sqlite" {
            for (key, set) in [
                ("store.url", raw.url.is_some()),
                ("store.node", raw.node.is_some()),
                ("store.lease_ttl", raw.lease_ttl.is_some()),
                ("store.pool_size", raw.pool_size.is_some()),
                ("store.ca_file", raw.ca_file.is_some()),
            ] {
                if set {
                    self.warn(key, "only used with backend = \"postgres\"");
                }
            }
            return Some(StoreSettings::Sqlite);
        }
        if backend != "postgres" {
            self.error(
                "store.backend",
                format!("{backend:?} is not a store backend; use \"sqlite\" or \"postgres\""),
            );
            return None;
        }
        let Some(source) = raw.url else {
            self.error(
                "store.url",
                "backend = \"postgres\" needs url, e.g. { credential = \"pg-url\" }",
            );
            return None;
        };
        let url = self.secret("store.url", &source)?;
        let node = match raw.node {
            Some(node) if valid_name(&node) => node,
            Some(node) => {
                self.error(
                    "store.node",
                    format!("{node:?} is not a name (letters, digits, '-', '_')"),
                );
                return None;
            }
            None => host_name(),
        };
        let lease_ttl = self.duration("store.lease_ttl", raw.lease_ttl, Duration::from_secs(15));
        if lease_ttl < Duration::from_secs(1) {
            self.error("store.lease_ttl", "must be at least 1s");
        }
        let default_pool = u32::try_from(max_concurrent_turns + 8).unwrap_or(u32::MAX);
        let pool_size = self.positive("store.pool_size", raw.pool_size, default_pool) as usize;
        if let Some(path) = &raw.ca_file
            && let Err(err) = std::fs::metadata(path)
        {
            self.error("store.ca_file", format!("{}: {err}", path.display()));
        }
        Some(StoreSettings::Postgres(PostgresSettings {
            url,
            node,
            lease_ttl,
            pool_size,
            ca_file: raw.ca_file,
        }))
    }

    /// `server.listen`: the address bound when not socket-activated.
    fn listen(&mut self, raw: Option<String>) -> Option<SocketAddr> {
        let Some(text) = raw else {
            return Some(SocketAddr::from(([127, 0, 0, 1], 8787)));
        };
        self.address("server.listen", &text, "127.0.0.1:8787")
    }

    /// `text` as an address:port, or `None` with an error on `key` that shows `example`.
    pub(super) fn address(&mut self, key: &str, text: &str, example: &str) -> Option<SocketAddr> {
        let parsed = text.parse::<SocketAddr>().ok();
        if parsed.is_none() {
            self.error(
                key,
                format!("{text:?} is not an address:port such as \"{example}\""),
            );
        }
        parsed
    }

    /// `KEY = { cert, key }`: a certificate chain and its key, which rustls must take; `None`
    /// (with an error) when it does not.
    pub(super) fn tls(&mut self, key: &str, raw: &RawTls) -> Option<TlsSettings> {
        let cert = self.secret(&format!("{key}.cert"), &raw.cert);
        let private = self.secret(&format!("{key}.key"), &raw.key);
        let tls = TlsSettings {
            cert: cert?,
            key: private?,
        };
        // Credentials are only there under systemd; what cannot be read here is checked when
        // the service loads it.
        if !tls.cert.expose().is_empty()
            && !tls.key.expose().is_empty()
            && let Err(problem) = crate::tls::server_config(&tls)
        {
            self.error(key, problem);
            return None;
        }
        Some(tls)
    }

    pub(super) fn server(&mut self, raw: RawServer) -> Option<ServerSettings> {
        let listen = self.listen(raw.listen)?;
        let max_body = self.value("server.max_body", raw.max_body, 1 << 20, |t| parse_size(&t));
        let tls = match raw.tls {
            None => None,
            Some(tls) => Some(self.tls("server.tls", &tls)?),
        };
        let mut trusted_proxies = Vec::new();
        for entry in raw.trusted_proxies.unwrap_or_default() {
            let parsed = entry
                .parse::<ipnet::IpNet>()
                .or_else(|_| entry.parse::<std::net::IpAddr>().map(ipnet::IpNet::from));
            match parsed {
                Ok(network) => trusted_proxies.push(network),
                Err(_) => self.error(
                    "server.trusted_proxies",
                    format!("{entry:?} is not an address or a network such as \"10.0.0.0/8\""),
                ),
            }
        }
        let metrics_listen = raw
            .metrics_listen
            .and_then(|text| self.address("server.metrics_listen", &text, "127.0.0.1:9464"));
        let public_url = raw
            .public_url
            .and_then(|text| match url::Url::parse(&text) {
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.query().is_none() => {
                    Some(text.trim_end_matches('/').to_string())
                }
                _ => {
                    self.error(
                        "server.public_url",
                        format!("{text:?} is not an http:// or https:// URL without a query"),
                    );
                    None
                }
            });
        Some(ServerSettings {
            listen,
            control_socket: raw
                .control_socket
                .unwrap_or_else(|| PathBuf::from(crate::config::DEFAULT_CONTROL_SOCKET)),
            max_body,
            header_timeout: self.duration(
                "server.header_timeout",
                raw.header_timeout,
                Duration::from_secs(5),
            ),
            keepalive_timeout: self.duration(
                "server.keepalive_timeout",
                raw.keepalive_timeout,
                Duration::from_secs(75),
            ),
            max_connections: self.positive("server.max_connections", raw.max_connections, 4096)
                as usize,
            max_connections_per_peer: self.positive(
                "server.max_connections_per_peer",
                raw.max_connections_per_peer,
                256,
            ) as usize,
            tls,
            trusted_proxies,
            metrics_listen,
            public_url,
        })
    }

    pub(super) fn runtime(&mut self, raw: RawRuntime) -> RuntimeSettings {
        RuntimeSettings {
            max_concurrent_turns: self.positive(
                "runtime.max_concurrent_turns",
                raw.max_concurrent_turns,
                16,
            ) as usize,
            max_turn_steps: self.positive("runtime.max_turn_steps", raw.max_turn_steps, 40),
            drain_timeout: self.duration(
                "runtime.drain_timeout",
                raw.drain_timeout,
                Duration::from_secs(20),
            ),
            turn_idle_timeout: self.duration(
                "runtime.turn_idle_timeout",
                raw.turn_idle_timeout,
                Duration::from_secs(300),
            ),
            resume_max_attempts: self.positive(
                "runtime.resume_max_attempts",
                raw.resume_max_attempts,
                3,
            ),
            resume_window: self.duration(
                "runtime.resume_window",
                raw.resume_window,
                Duration::from_secs(6 * 3600),
            ),
            dedup_window: self.duration(
                "runtime.dedup_window",
                raw.dedup_window,
                Duration::from_secs(7 * 86_400),
            ),
            max_queued_events: u64::from(self.positive(
                "runtime.max_queued_events",
                raw.max_queued_events,
                100_000,
            )),
            min_free_disk: self.value(
                "runtime.min_free_disk",
                raw.min_free_disk,
                512 << 20,
                |text| parse_size(&text),
            ),
            max_tool_calls_per_reply: self.positive(
                "runtime.max_tool_calls_per_reply",
                raw.max_tool_calls_per_reply,
                16,
            ) as usize,
            max_repeated_tool_calls: self.positive(
                "runtime.max_repeated_tool_calls",
                raw.max_repeated_tool_calls,
                2,
            ),
            approval_timeout: self.duration(
                "runtime.approval_timeout",
                raw.approval_timeout,
                Duration::from_secs(24 * 3600),
            ),
            max_background_jobs: self.positive(
                "runtime.max_background_jobs",
                raw.max_background_jobs,
                16,
            ) as usize,
            max_background_jobs_per_session: self.positive(
                "runtime.max_background_jobs_per_session",
                raw.max_background_jobs_per_session,
                4,
            ) as usize,
            max_internal_turns: self.positive(
                "runtime.max_internal_turns",
                raw.max_internal_turns,
                8,
            ),
            event_log_level: self.value(
                "runtime.event_log_level",
                raw.event_log_level,
                EventLogLevel::Info,
                |level| match level.as_str() {
                    "info" => Ok(EventLogLevel::Info),
                    "debug" => Ok(EventLogLevel::Debug),
                    other => Err(format!("{other:?} is not info or debug")),
                },
            ),
            event_log_max_per_second: self.value(
                "runtime.event_log_max_per_second",
                raw.event_log_max_per_second,
                DEFAULT_EVENT_LINES_PER_SECOND,
                |n| u32::try_from(n).map_err(|_| format!("{n} must be a whole number, 0 or more")),
            ),
        }
    }
}
