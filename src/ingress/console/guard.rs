//! Who may use the console, and how its forms stay its own (docs/reference.md, "Console").
//!
//! The console acts as the operator, and the operator's browser also visits other sites. Three
//! things keep those sites out:
//! - On the control socket, reached through `ssh -L`, only a loopback `Host` is served, so a page
//!   whose name an attacker re-points at 127.0.0.1 (DNS rebinding) reads nothing.
//! - On `[console] listen`, a browser must have logged in with the token: it holds a cookie
//!   derived from the token, which no other site's requests carry.
//! - Every `POST` carries the form token of this daemon's run, which only a page of the console
//!   shows, and must come from the console's own origin (`Origin`, `Sec-Fetch-Site`).
//!
//! Each refusal is logged (at most one line a minute per reason) and counted in
//! `agentgate_console_refusals_total`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::secret::Secret;

/// The cookie a browser holds after logging in on `[console] listen`.
pub(super) const COOKIE: &str = "agentgate_console";
/// The form field that carries the form token.
pub(super) const FORM_TOKEN_FIELD: &str = "csrf";
/// Refusal lines of one reason are written at most this often.
const REFUSAL_LINE_EVERY: Duration = Duration::from_secs(60);

/// Where a console request came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Door {
    /// The control socket: who may connect is the socket file's permissions.
    Socket,
    /// `[console] listen`: whoever reaches the address, so a login with the token is needed.
    Listen,
}

/// Why a console request was refused: the `reason` label of
/// `agentgate_console_refusals_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A `Host` that is not a loopback name on the control socket.
    Host,
    /// A `POST` from another origin.
    CrossSite,
    /// A `POST` without this run's form token.
    FormToken,
    /// No login (or a stale one) on `[console] listen`.
    NotLoggedIn,
    /// A login with a wrong token.
    WrongToken,
    /// A connection to `[console] listen` whose TLS handshake failed or did not come in time.
    Tls,
}

impl Refusal {
    pub(crate) const ALL: [Refusal; 6] = [
        Refusal::Host,
        Refusal::CrossSite,
        Refusal::FormToken,
        Refusal::NotLoggedIn,
        Refusal::WrongToken,
        Refusal::Tls,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Refusal::Host => "host",
            Refusal::CrossSite => "cross_site",
            Refusal::FormToken => "form_token",
            Refusal::NotLoggedIn => "not_logged_in",
            Refusal::WrongToken => "wrong_token",
            Refusal::Tls => "tls",
        }
    }

    /// What the refused browser is told.
    pub(super) fn message(self) -> &'static str {
        match self {
            Refusal::Host => {
                "the console on the control socket answers only to a loopback host name \
                 (open it as http://localhost:PORT/console/ through ssh -L)"
            }
            Refusal::CrossSite => "a console form may be sent only from the console's own pages",
            Refusal::FormToken => {
                "the form is not from this run of the daemon (it restarted since the page was \
                 loaded): load the page again and repeat"
            }
            Refusal::NotLoggedIn => "log in with the console token first",
            Refusal::WrongToken => "that is not the console token",
            Refusal::Tls => "the TLS handshake failed or did not come within server.header_timeout",
        }
    }
}

/// This run's secret for form tokens: random at every start, so a form of a page from before a
/// restart is refused (and the operator loads the page again).
pub(crate) struct ConsoleKey {
    key: [u8; 32],
    /// When the last refusal line of each reason was written.
    lines: Mutex<[Option<Instant>; Refusal::ALL.len()]>,
}

impl ConsoleKey {
    pub(crate) fn generate() -> Result<ConsoleKey, getrandom::Error> {
        let mut key = [0; 32];
        getrandom::fill(&mut key)?;
        Ok(ConsoleKey {
            key,
            lines: Mutex::new([None; Refusal::ALL.len()]),
        })
    }

    /// The form token every page of this run carries in its forms.
    pub(super) fn form_token(&self) -> String {
        keyed_digest(&self.key, b"agentgate console form")
    }

    /// Whether `form` (a `POST`'s decoded fields) carries this run's form token.
    pub(super) fn form_is_ours(&self, presented: Option<&str>) -> bool {
        presented.is_some_and(|presented| same(presented, &self.form_token()))
    }

    /// Counts the refusal and logs it, at most one line a minute per reason.
    pub(super) fn refused(&self, refusal: Refusal, door: Door, path: &str) {
        crate::metrics::console_refusal(refusal.label());
        let index = refusal as usize;
        let due = {
            let mut lines = self
                .lines
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = Instant::now();
            let due =
                lines[index].is_none_or(|last| now.duration_since(last) >= REFUSAL_LINE_EVERY);
            if due {
                lines[index] = Some(now);
            }
            due
        };
        if due {
            let mut path = path.to_string();
            crate::untrusted::cut(&mut path, 200);
            tracing::warn!(
                reason = refusal.label(), door = ?door, path = %path,
                "console request refused: {} (further refusals for this reason within a minute are only counted)",
                refusal.message()
            );
        }
    }
}

/// The cookie value a browser holds after logging in with `token`: derived from the token, so
/// it survives restarts and stops working when the token changes, and the token itself is
/// never stored in the browser.
pub(super) fn login_cookie(token: &Secret) -> String {
    keyed_digest(token.expose(), b"agentgate console login")
}

/// Whether `presented` is the console token.
pub(super) fn is_token(token: &Secret, presented: &str) -> bool {
    bool::from(token.expose().ct_eq(presented.trim().as_bytes()))
}

/// Whether the request is logged in on `[console] listen`: the login cookie, or the token as a
/// bearer credential (for `curl`).
pub(super) fn logged_in(token: &Secret, headers: &HeaderMap) -> bool {
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    if bearer.is_some_and(|presented| is_token(token, presented)) {
        return true;
    }
    let expected = login_cookie(token);
    cookies(headers, COOKIE).any(|value| same(value, &expected))
}

/// The values of the cookie `name` the request carries.
fn cookies<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = &'a str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(move |pair| {
            let (key, value) = pair.trim().split_once('=')?;
            (key == name).then_some(value)
        })
}

/// On the control socket, whether `Host` names this machine's loopback (`localhost`, a name
/// under `.localhost`, 127.0.0.0/8 or `[::1]`), with any port. A request without `Host` is an
/// HTTP/1.0 client on the socket itself, not a browser, and is served.
pub(super) fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(http::header::HOST) else {
        return true;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    let name = name.to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a `POST` comes from the console's own pages: its `Origin` (when the browser sent
/// one) names the host the request is addressed to, and `Sec-Fetch-Site` (when sent) says
/// same-origin or a typed address.
pub(super) fn same_origin(headers: &HeaderMap) -> bool {
    let text = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    let fetch_site_ok =
        text("sec-fetch-site").is_none_or(|site| site == "same-origin" || site == "none");
    let origin_ok = match text("origin") {
        None => true,
        Some(origin) => {
            let host = text("host").unwrap_or_default();
            url::Url::parse(origin).is_ok_and(|origin| {
                let port = origin
                    .port()
                    .map(|port| format!(":{port}"))
                    .unwrap_or_default();
                origin
                    .host_str()
                    .is_some_and(|name| format!("{name}{port}").eq_ignore_ascii_case(host))
            })
        }
    };
    fetch_site_ok && origin_ok
}

/// A hex HMAC-SHA256 of `message` under `key`.
fn keyed_digest(key: &[u8], message: &[u8]) -> String {
    // HMAC takes a key of any length.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return String::new();
    };
    mac.update(message);
    hex::encode(mac.finalize().into_bytes())
}

/// Constant-time equality of two tokens.
fn same(presented: &str, expected: &str) -> bool {
    !expected.is_empty() && bool::from(presented.as_bytes().ct_eq(expected.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, value.parse().expect("a header value"));
        }
        map
    }

    #[test]
    fn only_loopback_names_reach_the_console_on_the_socket() {
        for host in [
            "localhost:8788",
            "127.0.0.1:8788",
            "[::1]:8788",
            "app.localhost",
            "127.3.2.1",
        ] {
            assert!(loopback_host(&headers(&[("host", host)])), "{host}");
        }
        for host in [
            "evil.example:8788",
            "localhost.evil.example",
            "10.0.0.1",
            "[::2]:80",
        ] {
            assert!(!loopback_host(&headers(&[("host", host)])), "{host}");
        }
        assert!(loopback_host(&HeaderMap::new()));
    }

    #[test]
    fn a_post_from_another_origin_is_not_ours() {
        let ours = headers(&[
            ("host", "localhost:8788"),
            ("origin", "http://localhost:8788"),
        ]);
        assert!(same_origin(&ours));
        let theirs = headers(&[
            ("host", "localhost:8788"),
            ("origin", "https://evil.example"),
        ]);
        assert!(!same_origin(&theirs));
        let other_port = headers(&[
            ("host", "localhost:8788"),
            ("origin", "http://localhost:9999"),
        ]);
        assert!(!same_origin(&other_port));
        let opaque = headers(&[("host", "localhost:8788"), ("origin", "null")]);
        assert!(!same_origin(&opaque));
        let cross = headers(&[("host", "localhost:8788"), ("sec-fetch-site", "cross-site")]);
        assert!(!same_origin(&cross));
        assert!(same_origin(&headers(&[("host", "localhost:8788")])));
    }

    #[test]
    fn a_login_is_the_cookie_or_the_bearer_token() {
        let token = Secret::for_tests(b"s3cret");
        let cookie = format!("other=1; {COOKIE}={}", login_cookie(&token));
        assert!(logged_in(&token, &headers(&[("cookie", &cookie)])));
        assert!(logged_in(
            &token,
            &headers(&[("authorization", "Bearer s3cret")])
        ));
        assert!(!logged_in(
            &token,
            &headers(&[("authorization", "Bearer s3cre")])
        ));
        let forged = format!("{COOKIE}=s3cret");
        assert!(!logged_in(&token, &headers(&[("cookie", &forged)])));
        assert!(!logged_in(&token, &HeaderMap::new()));
    }

    #[test]
    fn the_form_token_is_this_runs_own() {
        let key = ConsoleKey::generate().expect("random bytes");
        assert!(key.form_is_ours(Some(&key.form_token())));
        let other = ConsoleKey::generate().expect("random bytes");
        assert!(!key.form_is_ours(Some(&other.form_token())));
        assert!(!key.form_is_ours(None));
        assert!(!key.form_is_ours(Some("")));
    }
}
