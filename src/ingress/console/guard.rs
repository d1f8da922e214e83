//! Who may use the console, and how its forms stay its own (docs/reference.md, "Console").
//!
//! The console acts as the operator, and the operator's browser also visits other sites. Three
//! things keep those sites out:
//! - On the control socket, reached through `ssh -L`, only a loopback `Host` is served, so a page
//!   whose name an attacker re-points at 127.0.0.1 (DNS rebinding) reads nothing.
//! - On `[console] listen`, a browser must have logged in with the token: it holds a cookie
//!   naming a login of this run (a random id, kept in memory and forgotten at logout), which no
//!   other site's requests carry. Failed logins are throttled per address.
//! - Every `POST` carries the form token of this daemon's run, which only a page of the console
//!   shows, and must come from the console's own origin (`Origin`, `Sec-Fetch-Site`).
//!
//! Each refusal is logged (at most one line a minute per reason) and counted in
//! `agentgate_console_refusals_total`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::locks::lock;
use crate::logging::OneLineEvery;
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
    /// A login from an address whose failed logins are throttled.
    Throttled,
}

impl Refusal {
    pub(crate) const ALL: [Refusal; 7] = [
        Refusal::Host,
        Refusal::CrossSite,
        Refusal::FormToken,
        Refusal::NotLoggedIn,
        Refusal::WrongToken,
        Refusal::Tls,
        Refusal::Throttled,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Refusal::Host => "host",
            Refusal::CrossSite => "cross_site",
            Refusal::FormToken => "form_token",
            Refusal::NotLoggedIn => "not_logged_in",
            Refusal::WrongToken => "wrong_token",
            Refusal::Tls => "tls",
            Refusal::Throttled => "throttled",
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
            Refusal::Throttled => {
                "too many wrong tokens from this address: wait before the next try"
            }
        }
    }
}

/// This run's secret for form tokens: random at every start, so a form of a page from before a
/// restart is refused (and the operator loads the page again).
pub(crate) struct ConsoleKey {
    key: [u8; 32],
    /// Each reason's refusal lines.
    lines: Mutex<[OneLineEvery; Refusal::ALL.len()]>,
}

impl ConsoleKey {
    pub(crate) fn generate() -> Result<ConsoleKey, getrandom::Error> {
        let mut key = [0; 32];
        getrandom::fill(&mut key)?;
        Ok(ConsoleKey {
            key,
            lines: Mutex::new([OneLineEvery::new(REFUSAL_LINE_EVERY); Refusal::ALL.len()]),
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
        let due = lock(&self.lines)[index].due();
        if due.is_some() {
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

/// Failed logins an address may make before it must wait.
const FREE_FAILURES: u32 = 5;
/// The first wait after them; each further failure doubles it, up to the last.
const FIRST_WAIT: Duration = Duration::from_secs(1);
const LONGEST_WAIT: Duration = Duration::from_secs(15 * 60);
/// Addresses whose failures are remembered (the oldest are forgotten past it).
const MAX_THROTTLED: usize = 4096;
/// Logins held at once (the oldest ends past it), and how long one lasts.
const MAX_LOGINS: usize = 256;
const LOGIN_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// The logins of this run on `[console] listen`, and the failed ones by address. A login is a
/// random id in the browser's cookie, held here by its digest with the token it was made with:
/// a logout ends it, a new token ends all, and so does a restart (the browser logs in again).
#[derive(Default)]
pub(crate) struct Logins {
    held: Mutex<HashMap<[u8; 32], Login>>,
    failures: Mutex<HashMap<IpAddr, Failures>>,
}

struct Login {
    since: Instant,
    /// Which token it was made with (its digest under the login's own id).
    token: [u8; 32],
}

struct Failures {
    count: u32,
    last: Instant,
    /// No login is tried from the address before this.
    wait_until: Option<Instant>,
}

impl Logins {
    /// How long `peer` must wait before its next login, if it must.
    pub(super) fn throttled(&self, peer: Option<IpAddr>) -> Option<Duration> {
        let peer = peer?;
        let failures = lock(&self.failures);
        let until = failures.get(&peer)?.wait_until?;
        until.checked_duration_since(Instant::now())
    }

    /// A wrong token from `peer`: past [`FREE_FAILURES`], it waits, twice as long each time.
    pub(super) fn failed(&self, peer: Option<IpAddr>) {
        let Some(peer) = peer else {
            return;
        };
        let mut failures = lock(&self.failures);
        if failures.len() >= MAX_THROTTLED && !failures.contains_key(&peer) {
            let oldest = failures.iter().min_by_key(|(_, f)| f.last).map(|(a, _)| *a);
            if let Some(oldest) = oldest {
                failures.remove(&oldest);
            }
        }
        let now = Instant::now();
        let entry = failures.entry(peer).or_insert(Failures {
            count: 0,
            last: now,
            wait_until: None,
        });
        entry.count += 1;
        entry.last = now;
        if let Some(over) = entry.count.checked_sub(FREE_FAILURES + 1) {
            let wait = FIRST_WAIT
                .saturating_mul(1u32 << over.min(20))
                .min(LONGEST_WAIT);
            entry.wait_until = Some(now + wait);
        }
    }

    /// A new login with `token` (its failures forgotten): the cookie value to give.
    pub(super) fn logged_in_with(
        &self,
        token: &Secret,
        peer: Option<IpAddr>,
    ) -> Result<String, getrandom::Error> {
        if let Some(peer) = peer {
            lock(&self.failures).remove(&peer);
        }
        let mut id = [0u8; 32];
        getrandom::fill(&mut id)?;
        let id = hex::encode(id);
        let mut held = lock(&self.held);
        held.retain(|_, login| login.since.elapsed() < LOGIN_LIFETIME);
        if held.len() >= MAX_LOGINS {
            let oldest = held.iter().min_by_key(|(_, l)| l.since).map(|(d, _)| *d);
            if let Some(oldest) = oldest {
                held.remove(&oldest);
            }
        }
        held.insert(
            digest(&id),
            Login {
                since: Instant::now(),
                token: token_digest(token, &id),
            },
        );
        Ok(id)
    }

    /// Ends the logins the request's cookies name.
    pub(super) fn log_out(&self, headers: &HeaderMap) {
        let mut held = lock(&self.held);
        for value in cookies(headers, COOKIE) {
            held.remove(&digest(value));
        }
    }

    /// Whether the request is logged in on `[console] listen`: a cookie of a login of this run
    /// made with `token`, or the token as a bearer credential (for `curl`).
    pub(super) fn logged_in(&self, token: &Secret, headers: &HeaderMap) -> bool {
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        if bearer.is_some_and(|presented| is_token(token, presented)) {
            return true;
        }
        let held = lock(&self.held);
        cookies(headers, COOKIE).any(|value| {
            held.get(&digest(value)).is_some_and(|login| {
                login.since.elapsed() < LOGIN_LIFETIME
                    && bool::from(login.token.ct_eq(&token_digest(token, value)))
            })
        })
    }
}

fn digest(text: &str) -> [u8; 32] {
    use sha2::Digest;
    Sha256::digest(text.as_bytes()).into()
}

/// The token's digest under a login's id: which token the login was made with.
fn token_digest(token: &Secret, id: &str) -> [u8; 32] {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(id.as_bytes()) else {
        return [0; 32];
    };
    mac.update(token.expose());
    mac.finalize().into_bytes().into()
}

/// Whether `presented` is the console token.
pub(super) fn is_token(token: &Secret, presented: &str) -> bool {
    bool::from(token.expose().ct_eq(presented.trim().as_bytes()))
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
    fn a_login_is_a_cookie_of_this_run_or_the_bearer_token_and_a_logout_ends_it() {
        let logins = Logins::default();
        let token = Secret::for_tests(b"s3cret");
        let id = logins.logged_in_with(&token, None).expect("random bytes");
        let cookie = format!("other=1; {COOKIE}={id}");
        let with_cookie = headers(&[("cookie", &cookie)]);
        assert!(logins.logged_in(&token, &with_cookie));
        assert!(logins.logged_in(&token, &headers(&[("authorization", "Bearer s3cret")])));
        assert!(!logins.logged_in(&token, &headers(&[("authorization", "Bearer s3cre")])));
        let forged = format!("{COOKIE}=s3cret");
        assert!(!logins.logged_in(&token, &headers(&[("cookie", &forged)])));
        assert!(!logins.logged_in(&token, &HeaderMap::new()));
        let rotated = Secret::for_tests(b"n3w");
        assert!(
            !logins.logged_in(&rotated, &with_cookie),
            "a new token ends it"
        );
        logins.log_out(&with_cookie);
        assert!(!logins.logged_in(&token, &with_cookie), "a logout ends it");
        assert!(
            !Logins::default().logged_in(&token, &with_cookie),
            "a restart ends it"
        );
    }

    #[test]
    fn failed_logins_from_an_address_wait_longer_each_time_past_five() {
        let logins = Logins::default();
        let peer: IpAddr = [192, 0, 2, 7].into();
        for _ in 0..FREE_FAILURES {
            logins.failed(Some(peer));
        }
        assert_eq!(logins.throttled(Some(peer)), None);
        logins.failed(Some(peer));
        let first = logins.throttled(Some(peer)).expect("throttled");
        logins.failed(Some(peer));
        let second = logins.throttled(Some(peer)).expect("throttled");
        assert!(second > first, "{first:?} then {second:?}");
        assert_eq!(logins.throttled(Some([192, 0, 2, 8].into())), None);
        let token = Secret::for_tests(b"s3cret");
        logins
            .logged_in_with(&token, Some(peer))
            .expect("random bytes");
        assert_eq!(logins.throttled(Some(peer)), None, "a login forgets them");
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
