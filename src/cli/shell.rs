//! Shell integration from the one CLI definition: completion scripts (clap_complete), man
//! pages (clap_mangen) and the book's CLI reference (`docs/src/reference/cli.md`, kept equal to
//! [`markdown_reference`] by a test), so none can drift from the real flags.

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

/// The CLI reference in Markdown: every public command and subcommand with its `--help` text
/// (clap's long help, as `ddpjob <command> --help` prints it), depth first.
#[cfg(test)]
fn markdown_reference() -> String {
    let mut out = String::new();
    let mut root = public_command().bin_name("ddpjob");
    root.build();
    describe(&root, "ddpjob", &mut out);
    out
}

#[cfg(test)]
fn describe(command: &clap::Command, path: &str, out: &mut String) {
    use std::fmt::Write as _;
    let mut command = command.clone().bin_name(path);
    let help = command.render_long_help().to_string();
    let level = "#".repeat(2 + path.matches(' ').count().min(2));
    let _ = write!(
        out,
        "{level} `{path}`\n\n```text\n{}\n```\n\n",
        help.trim_end()
    );
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        describe(sub, &format!("{path} {}", sub.get_name()), out);
    }
}

#[cfg(test)]
mod tests {
    /// The book's CLI reference is generated from the clap definitions: it cannot drift. After
    /// changing a flag or a help text, `DDPJOB_BLESS=1 cargo test cli_reference` rewrites it.
    #[test]
    fn cli_reference_is_the_clis() {
        const START: &str =
            "<!-- cli reference: generated from the clap definitions in src/cli -->\n";
        const END: &str = "<!-- end of cli reference -->";
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/reference/cli.md");
        let page = std::fs::read_to_string(path).unwrap();
        let start = page
            .find(START)
            .expect("docs/src/reference/cli.md lacks the reference's start marker")
            + START.len();
        let end = page[start..]
            .find(END)
            .expect("docs/src/reference/cli.md lacks the reference's end marker")
            + start;
        let reference = super::markdown_reference();
        assert!(reference.contains("## `ddpjob run`"), "{reference}");
        assert!(
            !reference.contains("`ddpjob worker`"),
            "a hidden command is listed"
        );
        if page[start..end] != reference {
            if std::env::var_os("DDPJOB_BLESS").is_some() {
                let page = format!("{}{reference}{}", &page[..start], &page[end..]);
                std::fs::write(path, page).unwrap();
            } else {
                panic!(
                    "docs/src/reference/cli.md differs from the CLI's definitions in src/cli; run \
                     `DDPJOB_BLESS=1 cargo test cli_reference` to regenerate it"
                );
            }
        }
    }
}
