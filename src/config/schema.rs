//! The table of every config key (made from the declarations in `keys.rs`): its type, default
//! and meaning. One source of truth for unknown-key detection ("did you mean"), type checks,
//! `--set` typing, `ddpjob keys` and the README reference.

use std::sync::LazyLock;

use super::declare::ValueKind;
use crate::registry::KeyDoc;

/// What a key's value must look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A `[section]`.
    Table,
    /// A table whose keys are free-form strings mapping to strings (e.g. checksums by file name).
    StrMap,
    Str,
    Int,
    /// A float; an integer is accepted too (`lr = 1` means 1.0).
    Float,
    Bool,
    IntList,
    FloatList,
    StrList,
    /// The string `"auto"` or a positive integer.
    AutoOrInt,
}

impl Kind {
    /// How the expected type reads in an error message.
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Table | Kind::StrMap => "a table",
            Kind::Str => "a string",
            Kind::Int => "an integer",
            Kind::Float => "a number",
            Kind::Bool => "true or false",
            Kind::IntList => "a list of integers",
            Kind::FloatList => "a list of numbers",
            Kind::StrList => "a list of strings",
            Kind::AutoOrInt => "\"auto\" or an integer",
        }
    }
}

/// One known key: dotted path from the document root, its kind, its default as the README
/// shows it, and what it does. The README's config table is generated from these (a test
/// fails when it differs).
#[derive(Debug, Clone)]
pub struct KeySpec {
    pub path: String,
    pub kind: Kind,
    /// Markdown: a TOML value in backticks (`` `"mlp"` ``), possibly with a remark, or words.
    pub default: String,
    /// Markdown, one line.
    pub doc: String,
}

/// Every key a job file may contain, in the order of their declarations in `keys.rs`.
pub static KEYS: LazyLock<Vec<KeySpec>> =
    LazyLock::new(|| <super::keys::RawConfig as ValueKind>::keys_under(""));

/// The README's config table: every key that is not a section, in this table's order, with
/// each built-in model's own keys after `model.arch`.
#[cfg(test)]
pub fn markdown_table() -> String {
    let mut out = String::from("| key | default | meaning |\n|---|---|---|\n");
    for k in KEYS.iter().filter(|k| k.kind != Kind::Table) {
        out += &format!("| `{}` | {} | {} |\n", k.path, k.default, k.doc);
        if k.path == "model.arch" {
            for (arch, key) in model_keys(&crate::registry::Registry::builtin()) {
                out += &format!(
                    "| `model.{}` | {} | {arch}: {} |\n",
                    key.key, key.default, key.doc
                );
            }
        }
    }
    out
}

/// Every model's option keys, by arch (a registered model's undocumented fields included).
fn model_keys(registry: &crate::registry::Registry) -> Vec<(String, KeyDoc)> {
    let mut keys = Vec::new();
    for m in registry.model_docs() {
        for field in m.fields {
            let doc = m.keys.iter().find(|k| k.key == *field).copied();
            let doc = doc.unwrap_or(KeyDoc {
                key: field,
                default: "its options struct's",
                doc: "an option of this registered model",
            });
            keys.push((m.arch.to_string(), doc));
        }
    }
    keys
}

/// `ddpjob keys [PREFIX]`: the keys under `prefix` (all without one) with their type, default
/// and meaning, as plain text (backticks dropped). `None` when no key matches.
pub fn reference(prefix: Option<&str>) -> Option<String> {
    let plain = |s: &str| s.replace('`', "");
    let matches =
        |k: &&KeySpec| prefix.is_none_or(|p| k.path == p || k.path.starts_with(&format!("{p}.")));
    let keys: Vec<&KeySpec> = KEYS.iter().filter(matches).collect();
    // `model.gpt` (or `model.gpt.n_layer`) picks one arch's keys.
    let model_keys = model_keys(crate::registry::Registry::current());
    let model_keys: Vec<&(String, KeyDoc)> = model_keys
        .iter()
        .filter(|(arch, k)| {
            let (plain_path, arch_path) = (format!("model.{}", k.key), format!("model.{arch}"));
            prefix.is_none_or(|p| {
                p == "model"
                    || p == plain_path
                    || p == arch_path
                    || p == format!("{arch_path}.{}", k.key)
            })
        })
        .collect();
    if keys.is_empty() && model_keys.is_empty() {
        return None;
    }
    let model_lines = || {
        let lines = model_keys.iter().map(|(arch, key)| {
            format!(
                "  model.{}  ({arch}, default {})\n      {}\n",
                key.key,
                plain(key.default),
                plain(key.doc)
            )
        });
        lines.collect::<String>()
    };
    let mut out = String::new();
    let mut models_listed = false;
    for k in keys {
        if k.kind == Kind::Table {
            out += &format!("[{}]  {}\n", k.path, plain(&k.doc));
        } else {
            out += &format!(
                "  {}  ({}, default {})\n      {}\n",
                k.path,
                k.kind.describe(),
                plain(&k.default),
                plain(&k.doc)
            );
        }
        if k.path == "model.arch" {
            out += &model_lines();
            models_listed = true;
        }
    }
    if !models_listed {
        out += &model_lines();
    }
    Some(out)
}

/// The spec of a dotted key path, if known.
pub fn lookup(path: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|k| k.path == path)
}

/// Known keys directly inside `table` ("" for the root), as their last path segment.
pub fn children(table: &str) -> impl Iterator<Item = &'static str> + '_ {
    KEYS.iter().filter_map(move |k| {
        let rest = if table.is_empty() {
            Some(k.path.as_str())
        } else {
            k.path.strip_prefix(table).and_then(|r| r.strip_prefix('.'))
        }?;
        (!rest.contains('.')).then_some(rest)
    })
}

/// The closest known sibling of an unknown key, if one is close enough to be a typo.
pub fn closest<'a>(unknown: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let unknown_lower = unknown.to_ascii_lowercase();
    candidates
        .map(|c| (levenshtein(&unknown_lower, c), c))
        .filter(|(d, c)| *d <= (c.len().max(unknown.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_the_nearest_sibling_for_a_typo() {
        assert_eq!(closest("batchsize", children("train")), Some("batch_size"));
        assert_eq!(closest("learning_rate_x", children("train")), None);
        assert_eq!(closest("EPOCHS", children("train")), Some("epochs"));
    }

    #[test]
    fn children_lists_direct_keys_only() {
        let root: Vec<_> = children("").collect();
        assert!(root.contains(&"train") && root.contains(&"seed"));
        assert!(!root.iter().any(|k| k.contains('.')));
        assert!(children("train").any(|k| k == "scheduler"));
    }
}
