//! Secrets named in the config: where they come from and how they are kept out of sight.
//!
//! A [`Secret`] never prints its bytes: its `Debug` and `Display` show only where it came from, so a
//! secret that ends up in a log line, an error or `status` output reveals nothing.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Where a secret is read from, as written in the config.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub(crate) enum SecretSource {
    /// A literal string in the config file (accepted, with a warning).
    Literal(String),
    Reference(SecretReference),
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub(crate) enum SecretReference {
    /// `$CREDENTIALS_DIRECTORY/NAME` (systemd `LoadCredential=`).
    Credential(String),
    File(PathBuf),
    Env(String),
}

/// Secret bytes, loaded once at config load.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret {
    bytes: Vec<u8>,
    origin: String,
}

impl Secret {
    pub(crate) fn expose(&self) -> &[u8] {
        &self.bytes
    }

    /// A secret computed from this one (a decoded key), keeping the origin for messages.
    /// A value written in the config that is not secret (a plain delivery URL), kept as a
    /// `Secret` so it is handled like one that is.
    pub(crate) fn plain(text: String) -> Secret {
        Secret {
            bytes: text.into_bytes(),
            origin: "the config".to_string(),
        }
    }

    pub(crate) fn derive(&self, bytes: Vec<u8>) -> Secret {
        Secret {
            bytes,
            origin: self.origin.clone(),
        }
    }

    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn for_tests(bytes: &[u8]) -> Secret {
        Secret {
            bytes: bytes.to_vec(),
            origin: "test".into(),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({}, redacted)", self.origin)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<secret from {}>", self.origin)
    }
}

impl SecretSource {
    pub(crate) fn is_literal(&self) -> bool {
        matches!(self, SecretSource::Literal(_))
    }

    /// For a credential reference: an empty placeholder, for checks made outside the service.
    pub(crate) fn unloaded_credential(&self) -> Option<Secret> {
        match self {
            SecretSource::Reference(SecretReference::Credential(_)) => Some(self.unloaded()),
            SecretSource::Literal(_)
            | SecretSource::Reference(SecretReference::File(_) | SecretReference::Env(_)) => None,
        }
    }

    /// An empty placeholder, for commands that show the config's shape and use no secret.
    pub(crate) fn unloaded(&self) -> Secret {
        let origin = match self {
            SecretSource::Literal(_) => "a literal".to_string(),
            SecretSource::Reference(SecretReference::Credential(name)) => {
                format!("credential {name}")
            }
            SecretSource::Reference(SecretReference::File(path)) => {
                format!("file {}", path.display())
            }
            SecretSource::Reference(SecretReference::Env(var)) => {
                format!("environment variable {var}")
            }
        };
        Secret {
            bytes: Vec::new(),
            origin: format!("{origin} (not loaded)"),
        }
    }

    /// Reads the secret. The error says where it looked, never what it found.
    #[expect(
        clippy::wildcard_enum_match_arm,
        reason = "io::ErrorKind is open-ended: every kind but NotFound reads the same"
    )]
    pub(crate) fn load(&self, credentials_dir: Option<&Path>) -> Result<Secret, String> {
        let (bytes, origin) = match self {
            SecretSource::Literal(text) => (text.as_bytes().to_vec(), "a literal".to_string()),
            SecretSource::Reference(SecretReference::Credential(name)) => {
                if name.is_empty() || name.contains('/') || name.starts_with('.') {
                    return Err(format!("credential name {name:?} is not a plain file name"));
                }
                let dir = credentials_dir.ok_or_else(|| {
                    format!(
                        "credential {name:?} is needed but $CREDENTIALS_DIRECTORY is not set; {}",
                        load_credential_hint(name)
                    )
                })?;
                let path = dir.join(name);
                let bytes = std::fs::read(&path).map_err(|err| match err.kind() {
                    // systemd fills the directory at a start: a LoadCredential= line added since
                    // takes a restart, which a reload is not.
                    std::io::ErrorKind::NotFound => format!(
                        "credential {name:?} is not among the service's credentials ({}); {}",
                        path.display(),
                        load_credential_hint(name)
                    ),
                    _ => format!("credential {name:?} ({}): {err}", path.display()),
                })?;
                (bytes, format!("credential {name}"))
            }
            SecretSource::Reference(SecretReference::File(path)) => {
                let bytes = std::fs::read(path)
                    .map_err(|err| format!("secret file {}: {err}", path.display()))?;
                (bytes, format!("file {}", path.display()))
            }
            SecretSource::Reference(SecretReference::Env(var)) => {
                let value = std::env::var_os(var)
                    .ok_or_else(|| format!("environment variable {var} is not set"))?;
                (
                    value.into_encoded_bytes(),
                    format!("environment variable {var}"),
                )
            }
        };
        let bytes = trim_one_trailing_newline(bytes);
        if bytes.is_empty() {
            return Err(format!("the secret from {origin} is empty"));
        }
        Ok(Secret { bytes, origin })
    }
}

/// How a credential reaches the service. systemd fills `$CREDENTIALS_DIRECTORY` at a start: a
/// `LoadCredential=` line added since takes a restart, which a reload is not.
fn load_credential_hint(name: &str) -> String {
    format!(
        "add LoadCredential={name}:/etc/agentgate/credentials/{name} to the unit, then systemctl \
         restart agentgate.service (a reload cannot load a credential)"
    )
}

fn trim_one_trailing_newline(mut bytes: Vec<u8>) -> Vec<u8> {
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_hide_the_bytes() {
        let secret = Secret::for_tests(b"hunter2");
        assert!(!format!("{secret:?}").contains("hunter2"));
        assert!(!format!("{secret}").contains("hunter2"));
    }

    #[test]
    fn credential_file_has_its_newline_trimmed() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("gh"), b"s3cret\n").expect("write");
        let source = SecretSource::Reference(SecretReference::Credential("gh".into()));
        let secret = source.load(Some(dir.path())).expect("load");
        assert_eq!(secret.expose(), b"s3cret");
    }

    #[test]
    fn missing_credential_names_the_credential_not_a_value() {
        let source = SecretSource::Reference(SecretReference::Credential("gh".into()));
        let err = source.load(None).expect_err("no credentials dir");
        assert!(err.contains("gh"), "{err}");
        let escape = SecretSource::Reference(SecretReference::Credential("../x".into()));
        assert!(escape.load(Some(Path::new("/tmp"))).is_err());
    }
}
