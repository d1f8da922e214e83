//! Files generated from the command-line definition for packaging: man pages, completions.

use crate::exit::Failure;

use super::args::*;

pub(super) fn generate(what: GenerateCommand) -> Result<(), Failure> {
    use clap::CommandFactory;
    let mut command = Cli::command();
    let mut stdout = std::io::stdout();
    match what {
        GenerateCommand::Manpages { dir } => {
            clap_mangen::generate_to(command, &dir).map_err(|err| {
                Failure::runtime(format!(
                    "cannot write man pages into {}: {err}",
                    dir.display()
                ))
            })
        }
        GenerateCommand::Completions { shell } => {
            clap_complete::generate(shell, &mut command, "agentgate", &mut stdout);
            Ok(())
        }
    }
}
