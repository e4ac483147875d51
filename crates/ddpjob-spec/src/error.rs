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
    /// A config put together from several files (`eval JOB --data FILE`): what it was made
    /// of, with no line (the text read was not any one file's).
    Composed(String),
}

impl Origin {
    /// Written in the config's text (not an override, not a default).
    pub fn is_written(&self) -> bool {
        matches!(self, Origin::File { .. } | Origin::Composed(_))
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, line, col } => write!(f, "{}:{line}:{col}", path.display()),
            // A flag that stands for a key is named as typed (`--name x`).
            Origin::Override(arg) if arg.starts_with("--") => write!(f, "{arg}"),
            Origin::Override(arg) => write!(f, "--set {arg}"),
            Origin::Defaulted(path) => write!(f, "{}, default value", path.display()),
            Origin::Composed(label) => write!(f, "{label}"),
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

    #[error("unknown key `{key}` in {table} ({at}){}", hint_text(hint))]
    UnknownKey {
        key: String,
        table: String,
        at: Origin,
        hint: Option<Hint>,
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

    #[error("bad override `{}`: {problem}", Origin::Override(arg.clone()))]
    BadOverride { arg: String, problem: String },

    #[error("{}", list(.0))]
    Many(Vec<ConfigError>),
}

/// What an unknown key may have been meant as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hint {
    /// The closest known key (a typo).
    Closest(String),
    /// The other choice it is a key of (`data.dataset = "text"`): left behind when a job
    /// switched models or datasets.
    BelongsTo(String),
    /// As `BelongsTo`, with the choice itself left at its default (`eval DIR --set
    /// data.path=...`): the fix is to make it. The owner, then the selector and its default.
    Unchosen(String),
}

impl Hint {
    /// The closest of `candidates`, if one is close enough to be a typo.
    pub fn closest<'a>(key: &str, candidates: impl Iterator<Item = &'a str>) -> Option<Hint> {
        super::schema::closest(key, candidates).map(|c| Hint::Closest(c.to_string()))
    }
}

fn hint_text(hint: &Option<Hint>) -> String {
    match hint {
        Some(Hint::BelongsTo(owner)) => format!("; it is a key of {owner}: remove it"),
        Some(Hint::Unchosen(owner_and_default)) => {
            format!("; it is a key of {owner_and_default}: set it")
        }
        Some(Hint::Closest(s)) => format!("; did you mean `{s}`?"),
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
