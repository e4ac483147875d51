//! Reads a job file into a `toml::Table`, remembering where every key was written, applies
//! `--set` overrides typed by the schema, and checks every key against the schema.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use toml_edit::TableLike;

use super::error::{ConfigError, Hint, Origin};
use super::schema::{self, Kind};

/// The merged config document and where each of its keys came from.
#[derive(Debug)]
pub struct Source {
    pub path: PathBuf,
    pub table: toml::Table,
    /// Byte offset of each key (dotted path) in the file, and of its value.
    key_offsets: HashMap<String, usize>,
    value_offsets: HashMap<String, usize>,
    text: String,
    /// `--set` argument that last set each dotted path.
    overrides: HashMap<String, String>,
    /// Set when `text` was put together from other files: what every origin names instead
    /// of a line of `text`.
    composed: Option<String>,
}

/// How the `job.toml` that `run` freezes begins.
pub const STORED_JOB_HEADER: &str = "# Resolved config of job `";

impl Source {
    /// Whether this is a job's own `job.toml` (beside its `state.json`, or headed as `run`
    /// writes it when that is lost or not there, as on a node without the shared job
    /// directory): what an earlier version wrote, read again to resume, restart, export or
    /// show the job.
    pub fn is_stored_job(&self) -> bool {
        self.path.file_name().is_some_and(|n| n == "job.toml")
            && (self.path.with_file_name("state.json").exists()
                || self.text.starts_with(STORED_JOB_HEADER))
    }

    /// Parses `text` (read from `path`) and applies `overrides` (`key.path=value`).
    pub fn parse(path: &Path, text: String, overrides: &[String]) -> Result<Self, ConfigError> {
        let syntax = |span: Option<std::ops::Range<usize>>, message: &str| ConfigError::Syntax {
            at: file_origin(path, &text, span.map_or(0, |s| s.start)),
            message: message.trim().to_string(),
        };
        let doc =
            toml_edit::Document::parse(text.as_str()).map_err(|e| syntax(e.span(), e.message()))?;
        let table: toml::Table =
            toml::from_str(&text).map_err(|e| syntax(e.span(), e.message()))?;
        let (mut key_offsets, mut value_offsets) = (HashMap::new(), HashMap::new());
        record_offsets("", doc.as_table(), &mut key_offsets, &mut value_offsets);
        drop(doc);
        let mut source = Source {
            path: path.to_path_buf(),
            table,
            key_offsets,
            value_offsets,
            text,
            overrides: HashMap::new(),
            composed: None,
        };
        for arg in overrides {
            source.apply_override(arg)?;
        }
        Ok(source)
    }

    /// Marks the text as put together from the files `label` names: origins name that, not
    /// lines of the text.
    pub fn composed_of(mut self, label: String) -> Self {
        self.composed = Some(label);
        self
    }

    /// Moves the value at the dotted `from` to `to` in the same table, with where it was set
    /// (a key another tool names otherwise, read under ddpjob's name). `Err` with both
    /// origins when `to` is set too.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), (Origin, Origin)> {
        let (parent, from_leaf) = from.rsplit_once('.').expect("a dotted key");
        let to_leaf = to.rsplit_once('.').map_or(to, |(_, leaf)| leaf);
        let Some(toml::Value::Table(table)) = value_at(&self.table, parent) else {
            return Ok(());
        };
        match (table.contains_key(from_leaf), table.contains_key(to_leaf)) {
            (false, _) => return Ok(()),
            (true, true) => return Err((self.key_origin(from), self.key_origin(to))),
            (true, false) => {}
        }
        if let Some(toml::Value::Table(table)) = value_at_mut(&mut self.table, parent)
            && let Some(value) = table.remove(from_leaf)
        {
            table.insert(to_leaf.to_string(), value);
        }
        for offsets in [&mut self.key_offsets, &mut self.value_offsets] {
            if let Some(at) = offsets.remove(from) {
                offsets.insert(to.to_string(), at);
            }
        }
        if let Some(arg) = self.overrides.remove(from) {
            self.overrides.insert(to.to_string(), arg);
        }
        Ok(())
    }

    /// Where the key `path` was set (its key, for unknown-key errors).
    pub fn key_origin(&self, path: &str) -> Origin {
        self.origin(path, &self.key_offsets)
    }

    /// Where the value of `path` was set (for type and value errors).
    pub fn value_origin(&self, path: &str) -> Origin {
        self.origin(path, &self.value_offsets)
    }

    fn origin(&self, path: &str, offsets: &HashMap<String, usize>) -> Origin {
        if let Some(arg) = self.overrides.get(path) {
            return Origin::Override(arg.clone());
        }
        match offsets.get(path).or_else(|| self.key_offsets.get(path)) {
            Some(_) if let Some(label) = &self.composed => Origin::Composed(label.clone()),
            Some(&offset) => file_origin(&self.path, &self.text, offset),
            None => Origin::Defaulted(self.path.clone()),
        }
    }

    /// Applies `--set key=value`, or a command-line flag that stands for a key (`--name x`, as
    /// [`flag_override`] writes it), named as the user typed it in messages.
    fn apply_override(&mut self, arg: &str) -> Result<(), ConfigError> {
        let assignment = from_flag(arg).unwrap_or_else(|| arg.to_string());
        let bad = |problem: String| ConfigError::BadOverride {
            arg: arg.to_string(),
            problem,
        };
        let (path, raw_value) = assignment
            .split_once('=')
            .ok_or_else(|| bad("expected key.path=value, e.g. --set train.lr=0.01".into()))?;
        let path = path.trim();
        if schema::lookup(path).is_none() && is_option_key(path) {
            // Possibly an option of a registered model or dataset: typed by its own struct
            // later; an unknown key is reported then, naming this argument.
            let value = parse_literal(raw_value.trim())
                .map_err(|problem| bad(format!("`{path}`: {problem}")))?;
            self.insert_at(path, value).map_err(bad)?;
            self.overrides
                .insert(key_segments(path).join("."), arg.to_string());
            return Ok(());
        }
        let Some(spec) = schema::lookup(path) else {
            let (table, leaf) = path.rsplit_once('.').unwrap_or(("", path));
            let suggestion = schema::closest(leaf, schema::children(table)).map(|s| join(table, s));
            let hint = suggestion.map_or(String::new(), |s| format!("; did you mean `{s}`?"));
            return Err(bad(format!("unknown key `{path}`{hint}")));
        };
        if spec.kind == Kind::Table {
            let example = schema::children(path).next().map_or(String::new(), |key| {
                format!(", e.g. --set {path}.{key}=...")
            });
            return Err(bad(format!(
                "`{path}` is a section, not a value: set its keys one by one{example}"
            )));
        }
        let value = parse_override_value(spec.kind, raw_value.trim()).map_err(|problem| {
            bad(format!(
                "`{path}` must be {}: {problem}",
                spec.kind.describe()
            ))
        })?;
        self.insert_at(path, value).map_err(bad)?;
        // Keyed as the file's keys are (`data.checksums.input.txt`, not its quoted form), so
        // the override is found as the origin of what it set.
        self.overrides
            .insert(key_segments(path).join("."), arg.to_string());
        Ok(())
    }

    /// Puts `value` at the dotted `path`, making the tables on the way.
    fn insert_at(&mut self, path: &str, value: toml::Value) -> Result<(), String> {
        let mut table = &mut self.table;
        let mut segments = key_segments(path);
        let leaf = segments.pop().unwrap_or_else(|| path.to_string());
        for (i, segment) in segments.iter().enumerate() {
            let entry = table
                .entry(segment.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = entry.as_table_mut().ok_or_else(|| {
                format!(
                    "`{}` is not a table in the config file",
                    segments[..=i].join(".")
                )
            })?;
        }
        table.insert(leaf.to_string(), value);
        Ok(())
    }

    /// Every key known to the schema, with a value of the right type; all problems at once.
    pub fn check_keys(&self) -> Result<(), ConfigError> {
        let mut errors = Vec::new();
        self.check_table("", &self.table, &mut errors);
        ConfigError::collect(errors)
    }

    fn check_table(&self, prefix: &str, table: &toml::Table, errors: &mut Vec<ConfigError>) {
        for (name, value) in table {
            let path = join(prefix, name);
            let Some(spec) = schema::lookup(&path) else {
                errors.push(ConfigError::UnknownKey {
                    key: name.clone(),
                    table: if prefix.is_empty() {
                        "the top level".into()
                    } else {
                        format!("[{prefix}]")
                    },
                    at: self.key_origin(&path),
                    hint: Hint::closest(name, schema::children(prefix)),
                });
                continue;
            };
            if !kind_matches(spec.kind, value) {
                errors.push(ConfigError::WrongType {
                    key: path.clone(),
                    at: self.value_origin(&path),
                    expected: spec.kind.describe(),
                    found: describe_value(value),
                });
            } else if spec.kind == Kind::Table
                && let Some(inner) = value.as_table()
            {
                self.check_table(&path, inner, errors);
            }
        }
    }
}

/// `model.KEY` or `data.KEY` (or deeper, `data.synthetic.shape`): a key a registered model's
/// or dataset's options may have.
fn is_option_key(path: &str) -> bool {
    matches!(path.split_once('.'), Some(("model" | "data", leaf)) if !leaf.is_empty())
}

/// The command-line flags that set a config key, for [`flag_override`].
const FLAGS: &[(&str, &str)] = &[
    ("--name", "name"),
    ("--nproc-per-node", "distributed.nproc_per_node"),
];

/// An override for flag `flag` (`--name`, `--nproc-per-node`) given `value`: applied as
/// `--set key=value`, named in messages as `--name value`.
pub fn flag_override(flag: &str, value: &str) -> String {
    format!("{flag} {value}")
}

/// `key=value` for an override [`flag_override`] wrote.
fn from_flag(arg: &str) -> Option<String> {
    let (flag, value) = arg.split_once(' ')?;
    let (_, key) = FLAGS.iter().find(|(f, _)| *f == flag)?;
    Some(format!("{key}={value}"))
}

/// A `--set` value for a key the schema does not type: a TOML value (`8`, `0.5`, `true`,
/// `[1, 2]`, `"x"`), else the text as a string.
fn parse_literal(raw: &str) -> Result<toml::Value, String> {
    if let Some(string) = quoted(raw) {
        return string.map(toml::Value::String);
    }
    Ok(toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string())))
}

/// A value in double quotes, read as TOML reads a string (escapes and all, as in the file);
/// `None` for any other value.
fn quoted(raw: &str) -> Option<Result<String, String>> {
    if !(raw.len() >= 2 && raw.starts_with('"') && raw.ends_with('"')) {
        return None;
    }
    let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}")).map(|mut t| t.remove("v"));
    Some(match parsed {
        Ok(Some(toml::Value::String(s))) => Ok(s),
        _ => Err(format!(
            "`{raw}` is not a TOML string (in double quotes a backslash starts an escape, as in \
             the file); in single quotes it is taken as written"
        )),
    })
}

/// Byte offsets of every key and value in the parsed file, by dotted path.
fn record_offsets(
    prefix: &str,
    table: &dyn TableLike,
    keys: &mut HashMap<String, usize>,
    values: &mut HashMap<String, usize>,
) {
    for (name, item) in table.iter() {
        let path = join(prefix, name);
        if let Some(span) = table.key(name).and_then(|k| k.span()) {
            keys.insert(path.clone(), span.start);
        }
        if let Some(span) = item.span() {
            values.insert(path.clone(), span.start);
        }
        if let Some(inner) = item.as_table_like() {
            record_offsets(&path, inner, keys, values);
        }
    }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

fn file_origin(path: &Path, text: &str, offset: usize) -> Origin {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    Origin::File {
        path: path.to_path_buf(),
        line,
        col,
    }
}

fn kind_matches(kind: Kind, value: &toml::Value) -> bool {
    use toml::Value as V;
    let all = |items: &Vec<V>, f: fn(&V) -> bool| items.iter().all(f);
    match (kind, value) {
        (Kind::Table, V::Table(_)) => true,
        (Kind::StrMap, V::Table(t)) => t.values().all(|v| v.is_str()),
        (Kind::Str, V::String(_)) | (Kind::Int, V::Integer(_)) | (Kind::Bool, V::Boolean(_)) => {
            true
        }
        (Kind::Float, V::Float(_) | V::Integer(_)) => true,
        (Kind::IntList, V::Array(a)) => all(a, |v| v.is_integer()),
        (Kind::FloatList, V::Array(a)) => all(a, |v| v.is_float() || v.is_integer()),
        (Kind::StrList, V::Array(a)) => all(a, |v| v.is_str()),
        (Kind::AutoOrInt, V::Integer(_)) => true,
        (Kind::AutoOrInt, V::String(s)) => s == "auto",
        (Kind::StrListOrStr, V::String(_)) => true,
        (Kind::StrListOrStr, V::Array(a)) => all(a, |v| v.is_str()),
        _ => false,
    }
}

fn describe_value(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => format!("the string \"{s}\""),
        toml::Value::Integer(i) => format!("the integer {i}"),
        toml::Value::Float(x) => format!("the number {x}"),
        toml::Value::Boolean(b) => format!("{b}"),
        toml::Value::Datetime(d) => format!("the date {d}"),
        toml::Value::Array(_) => "a list with other types".into(),
        toml::Value::Table(_) => "a table".into(),
    }
}

/// A `--set` integer, TOML's 64-bit kind; one too large for it is said to be, not "not one".
fn parse_int(raw: &str) -> Result<i64, String> {
    use std::num::IntErrorKind::{NegOverflow, PosOverflow};
    raw.parse()
        .map_err(|e: std::num::ParseIntError| match e.kind() {
            PosOverflow | NegOverflow => format!("`{raw}` is out of range (at most {})", i64::MAX),
            _ => format!("`{raw}` is not one"),
        })
}

/// Types a `--set` value by the key's schema kind: `--set data.root=x` needs no quotes. A
/// string in double quotes is read as TOML reads it, escapes and all (`"a\\.b"` is `a\.b`, as
/// in the file); unquoted or in single quotes, as written.
fn parse_override_value(kind: Kind, raw: &str) -> Result<toml::Value, String> {
    let unquoted = raw.trim_matches(|c| c == '"' || c == '\'');
    let string = || match quoted(raw) {
        Some(string) => string.map(toml::Value::String),
        None => Ok(toml::Value::String(unquoted.to_string())),
    };
    let value = match kind {
        Kind::Str => string()?,
        Kind::Int => toml::Value::Integer(parse_int(raw)?),
        Kind::Float => toml::Value::Float(raw.parse().map_err(|_| format!("`{raw}` is not one"))?),
        Kind::Bool => toml::Value::Boolean(raw.parse().map_err(|_| format!("`{raw}` is not one"))?),
        Kind::AutoOrInt if unquoted == "auto" => toml::Value::String("auto".into()),
        Kind::AutoOrInt => toml::Value::Integer(parse_int(raw)?),
        Kind::StrListOrStr if !raw.trim_start().starts_with('[') => string()?,
        Kind::Table => return Err("a section is set key by key".into()),
        Kind::StrMap | Kind::IntList | Kind::FloatList | Kind::StrList | Kind::StrListOrStr => {
            let mut t: toml::Table = toml::from_str(&format!("v = {raw}"))
                .map_err(|_| format!("`{raw}` is not TOML (e.g. [1, 2])"))?;
            t.remove("v").ok_or("no value")?
        }
    };
    if kind_matches(kind, &value) {
        Ok(value)
    } else {
        Err(format!("`{raw}` has the wrong type"))
    }
}

/// The keys of a dotted TOML key path, a quoted key kept whole: `data.checksums."a.txt"` is
/// `data`, `checksums`, `a.txt`, as TOML reads it.
fn key_segments(path: &str) -> Vec<String> {
    let mut segments = vec![String::new()];
    let mut quote = None;
    for c in path.chars() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '.') => segments.push(String::new()),
            (_, c) => segments.last_mut().expect("one segment").push(c),
        }
    }
    segments.into_iter().map(|s| s.trim().to_string()).collect()
}

/// The value at the dotted `path` of `table` (no quoted keys), if there is one.
pub(super) fn value_at<'a>(table: &'a toml::Table, path: &str) -> Option<&'a toml::Value> {
    let (first, rest) = path.split_once('.').unwrap_or((path, ""));
    let value = table.get(first)?;
    match rest {
        "" => Some(value),
        rest => value_at(value.as_table()?, rest),
    }
}

/// As [`value_at`], to change it.
pub(super) fn value_at_mut<'a>(
    table: &'a mut toml::Table,
    path: &str,
) -> Option<&'a mut toml::Value> {
    let (first, rest) = path.split_once('.').unwrap_or((path, ""));
    let value = table.get_mut(first)?;
    match rest {
        "" => Some(value),
        rest => value_at_mut(value.as_table_mut()?, rest),
    }
}
