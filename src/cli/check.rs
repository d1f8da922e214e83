//! `check-config`.

use crate::agent::sandbox::{self, Availability};
use crate::config::{self, ConfigError, ConfigSource, LocatedFinding, SecretCheck, Severity};
use crate::exit::Failure;
use crate::output::outln;

pub(super) fn check_config(source: &ConfigSource) -> Result<(), Failure> {
    match config::load(source, SecretCheck::CredentialsOptional) {
        Ok(loaded) => {
            for finding in &loaded.warnings {
                outln!("{}", LocatedFinding { source, finding });
            }
            for finding in config::loosened(&loaded.config, source, config::Writer::AnyoneButRoot) {
                outln!("{source}: warning: {finding}");
            }
            // A machine property, not the file's: said after the file's findings.
            let strict: Vec<String> = config::strict_children(&loaded.config)
                .into_iter()
                .map(|child| child.key)
                .collect();
            if let (Availability::Unavailable(reason), false) =
                (sandbox::availability(), strict.is_empty())
            {
                outln!(
                    "{source}: warning: no tool sandbox can be set up here ({reason}); these run \
                     only sandboxed and will fail: {}",
                    strict.join(", ")
                );
            }
            outln!(
                "{source}: ok ({} route(s), {} tool(s), {} MCP server(s), {} warning(s))",
                loaded.config.routes.len(),
                loaded.config.tools.len(),
                loaded.config.mcp.len(),
                loaded.warnings.len()
            );
            Ok(())
        }
        Err(ConfigError::Invalid {
            source_name,
            findings,
        }) => {
            for finding in &findings {
                outln!(
                    "{}",
                    LocatedFinding {
                        source: &source_name,
                        finding
                    }
                );
            }
            let errors = findings
                .iter()
                .filter(|f| f.severity == Severity::Error)
                .count();
            Err(Failure::config(format!(
                "{source_name}: {errors} error(s); not usable"
            )))
        }
        Err(err) => Err(Failure::config(err)),
    }
}
