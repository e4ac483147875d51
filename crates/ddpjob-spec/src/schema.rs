//! The table of every config key (made from the declarations in `keys.rs`): its type, default
//! and meaning. One source of truth for unknown-key detection ("did you mean"), type checks,
//! `--set` typing, `ddpjob keys` and the book's config reference.

use std::sync::LazyLock;

use super::builders::{Builders, KeyDoc};
use super::declare::ValueKind;

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
    /// A list of strings, or one string.
    StrListOrStr,
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
            Kind::StrListOrStr => "a list of strings, or a string",
        }
    }
}

/// One known key: dotted path from the document root, its kind, its default as the config
/// reference shows it, and what it does. The book's config table is generated from these (a test
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

/// The book's config table (`docs/src/reference/config.md`): every key that is not a section,
/// in this table's order, with each registered model's own keys after `model.arch` and each
/// dataset's after `data.dataset`.
pub fn markdown_table(registry: &dyn Builders) -> String {
    let mut out = String::from("| key | default | meaning |\n|---|---|---|\n");
    for k in KEYS.iter().filter(|k| k.kind != Kind::Table) {
        out += &format!("| `{}` | {} | {} |\n", k.path, k.default, k.doc);
        if let Some(section) = OptionSection::selected_by(&k.path) {
            for (owner, key) in section.keys(registry) {
                out += &format!(
                    "| `{}.{}` | {} | {owner}: {} |\n",
                    section.name, key.key, key.default, key.doc
                );
            }
        }
    }
    out
}

/// A section whose other keys belong to the registered name its selector picks.
#[derive(Clone, Copy)]
struct OptionSection {
    name: &'static str,
    selector: &'static str,
}

const OPTION_SECTIONS: [OptionSection; 2] = [
    OptionSection {
        name: "model",
        selector: "arch",
    },
    OptionSection {
        name: "data",
        selector: "dataset",
    },
];

impl OptionSection {
    fn selected_by(path: &str) -> Option<OptionSection> {
        OPTION_SECTIONS
            .into_iter()
            .find(|s| path == format!("{}.{}", s.name, s.selector))
    }

    /// Every registered name's option keys, by name (undocumented fields of a user's
    /// options struct included). Keys several names read alike are listed once, for the names
    /// together (`mnist, fashion-mnist: root`).
    fn keys(self, registry: &dyn Builders) -> Vec<(String, KeyDoc)> {
        let docs: Vec<(&str, &[KeyDoc], &[&str])> = match self.name {
            "model" => registry
                .model_docs()
                .into_iter()
                .map(|m| (m.arch, m.keys, m.fields))
                .collect(),
            _ => registry
                .dataset_docs()
                .into_iter()
                .map(|d| (d.dataset, d.keys, d.fields))
                .collect(),
        };
        let mut keys: Vec<(String, KeyDoc)> = Vec::new();
        for (owner, documented, fields) in docs {
            let listed = documented.iter().copied();
            let undocumented = fields
                .iter()
                .filter(|f| {
                    let nested = format!("{f}.");
                    !documented
                        .iter()
                        .any(|k| k.key == **f || k.key.starts_with(&nested))
                })
                .map(|field| KeyDoc {
                    key: field,
                    default: "its options struct's",
                    doc: "an option of this registered name",
                });
            for doc in listed.chain(undocumented) {
                match keys.iter_mut().find(|(_, k)| *k == doc) {
                    Some((owners, _)) => *owners += &format!(", {owner}"),
                    None => keys.push((owner.to_string(), doc)),
                }
            }
        }
        keys
    }
}

/// `ddpjob keys [PREFIX]`: the keys under `prefix` (all without one) with their type, default
/// and meaning, as plain text (backticks dropped). `None` when no key matches.
pub fn reference(prefix: Option<&str>, registry: &dyn Builders) -> Option<String> {
    let plain = |s: &str| s.replace('`', "");
    let matches =
        |k: &&KeySpec| prefix.is_none_or(|p| k.path == p || k.path.starts_with(&format!("{p}.")));
    let keys: Vec<&KeySpec> = KEYS.iter().filter(matches).collect();
    // `model.gpt` (or `model.gpt.n_layer`) picks one arch's keys, `data.text` one dataset's.
    let option_lines = |section: OptionSection| {
        let name = section.name;
        let lines = section.keys(registry).into_iter().filter(|(owners, k)| {
            let plain_path = format!("{name}.{}", k.key);
            prefix.is_none_or(|p| {
                p == name
                    || p == plain_path
                    || owners.split(", ").any(|owner| {
                        let owner_path = format!("{name}.{owner}");
                        p == owner_path || p == format!("{owner_path}.{}", k.key)
                    })
            })
        });
        let lines = lines.map(|(owners, key)| {
            format!(
                "  {name}.{}  ({owners}, default {})\n      {}\n",
                key.key,
                plain(key.default),
                plain(key.doc)
            )
        });
        lines.collect::<String>()
    };
    let options: Vec<(OptionSection, String)> = OPTION_SECTIONS
        .into_iter()
        .map(|s| (s, option_lines(s)))
        .collect();
    if keys.is_empty() && options.iter().all(|(_, lines)| lines.is_empty()) {
        return None;
    }
    let mut out = String::new();
    let mut listed = [false; 2];
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
        for (i, (section, lines)) in options.iter().enumerate() {
            if OptionSection::selected_by(&k.path).is_some_and(|s| s.name == section.name) {
                out += lines;
                listed[i] = true;
            }
        }
    }
    for (i, (_, lines)) in options.iter().enumerate() {
        if !listed[i] {
            out += lines;
        }
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
