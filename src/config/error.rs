//! Config errors: each names the file (with line and column) or the `--set` argument, the key,
//! what is wrong and, where one exists, the fix.

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

/// Where a config value came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    File {
        path: PathBuf,
        line: usize,
        col: usize,
    },
    Override(String),
    /// Not written anywhere: a default, or a combination of keys. Names the file only.
    Defaulted(PathBuf),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, line, col } => write!(f, "{}:{line}:{col}", path.display()),
            Origin::Override(arg) => write!(f, "--set {arg}"),
            Origin::Defaulted(path) => write!(f, "{}, default value", path.display()),
        }
    }
}

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file `{}`: {cause}", path.display())]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },

    #[error("TOML syntax error in {at}: {message}")]
    Syntax { at: Origin, message: String },

    #[error("unknown key `{key}` in {table} ({at}){}", suggestion_text(suggestion))]
    UnknownKey {
        key: String,
        table: String,
        at: Origin,
        suggestion: Option<String>,
    },

    #[error("`{key}` ({at}) must be {expected}, found {found}")]
    WrongType {
        key: String,
        at: Origin,
        expected: &'static str,
        found: String,
    },

    #[error("invalid `{key}` ({at}): {problem}")]
    Invalid {
        key: String,
        at: Origin,
        problem: String,
    },

    #[error("bad override `--set {arg}`: {problem}")]
    BadOverride { arg: String, problem: String },

    #[error("{}", list(.0))]
    Many(Vec<ConfigError>),
}

fn suggestion_text(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(s) => format!("; did you mean `{s}`?"),
        None => String::new(),
    }
}

fn list(errors: &[ConfigError]) -> String {
    let lines: Vec<String> = errors.iter().map(|e| format!("  - {e}")).collect();
    format!(
        "{} problems in the config:\n{}",
        errors.len(),
        lines.join("\n")
    )
}

impl ConfigError {
    /// One error stays itself; several become [`ConfigError::Many`].
    pub fn collect(mut errors: Vec<ConfigError>) -> Result<(), ConfigError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Many(errors)),
        }
    }
}
