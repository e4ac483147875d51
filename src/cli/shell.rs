//! Shell integration from the one CLI definition: completion scripts (clap_complete) and man
//! pages (clap_mangen), so neither can drift from the real flags.

use std::io::Write;
use std::path::Path;

use anyhow::anyhow;
use clap::CommandFactory;
use clap_complete::Shell;

use super::{Cli, CliResult};

pub(super) fn completions(shell: Shell) -> CliResult {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut public_command(), "ddpjob", &mut out);
    write_stdout(&out)
}

/// The CLI without its hidden subcommands (the worker processes `run` starts), which
/// clap_complete would otherwise offer.
fn public_command() -> clap::Command {
    let full = Cli::command();
    let visible: Vec<clap::Command> = full
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let mut public = clap::Command::new("ddpjob")
        .version(env!("CARGO_PKG_VERSION"))
        .subcommands(visible);
    if let Some(about) = full.get_about() {
        public = public.about(about.clone());
    }
    public
}

/// `ddpjob.1` on stdout, or with `dir` that page and one per subcommand (`ddpjob-run.1`, ...).
pub(super) fn man(dir: Option<&Path>) -> CliResult {
    let Some(dir) = dir else {
        let mut out = Vec::new();
        clap_mangen::Man::new(public_command())
            .render(&mut out)
            .map_err(|e| (1, anyhow!("cannot render the man page: {e}")))?;
        return write_stdout(&out);
    };
    std::fs::create_dir_all(dir)
        .and_then(|()| clap_mangen::generate_to(public_command(), dir))
        .map_err(|e| {
            (
                1,
                anyhow!("cannot write man pages to `{}`: {e}", dir.display()),
            )
        })?;
    outln!("man pages written to {}", dir.display());
    Ok(())
}

fn write_stdout(bytes: &[u8]) -> CliResult {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(bytes)
        .and_then(|()| stdout.flush())
        .map_err(|e| (1, anyhow!("cannot write to stdout: {e}")))
}
