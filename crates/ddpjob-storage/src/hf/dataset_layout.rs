//! Which parquet files of a Hub dataset repository are which config's split, from the file
//! names alone, as `datasets.load_dataset` tells them when the repository has no loading
//! script (its `data_files.py`): the layout `push_to_hub` writes
//! (`data/{split}-00000-of-00003-….parquet`, `{config}/{split}-…` for a named config); else
//! split names in the paths (`train.parquet`, `test/0.parquet`, `dev-1.parquet`, with
//! `datasets`' keywords: `validation` is also `valid`, `dev`, `val`), everything else being
//! `train`; and the Hub's own parquet export (`refs/convert/parquet`:
//! `{config}/{split}/0000.parquet`, `{config}/partial-{split}/…` when cut short). It does no
//! I/O; a README's `configs:` table is not read (the export follows it, so a repository laid
//! out otherwise is read through its export).

use std::collections::BTreeMap;

/// A repository's parquet files by config, then by split, in name order.
pub type Splits = BTreeMap<String, BTreeMap<String, Vec<String>>>;

/// How the files were told apart, for the note the user gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `push_to_hub`'s `{dir}/{split}-NNNNN-of-NNNNN….parquet`.
    Sharded,
    /// Split names found in the paths.
    Named,
    /// The Hub's parquet export, `{config}/{split}/NNNN.parquet`.
    Export,
}

/// The config `datasets` calls the one of a repository without named configs.
pub const DEFAULT_CONFIG: &str = "default";

/// `datasets`' words for its three standard splits (`data_files.py`'s `SPLIT_KEYWORDS`).
const KEYWORDS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// What may stand beside a split's keyword in a name (`datasets`' `NON_WORDS_CHARS`).
const SEPARATORS: &str = "-._ 0123456789";

/// `files` (repository paths) sorted into configs and splits, with how.
pub fn splits(files: &[String]) -> (Layout, Splits) {
    let parquet: Vec<&String> = files.iter().filter(|f| f.ends_with(".parquet")).collect();
    let mut found = Splits::new();
    let mut add = |config: &str, split: &str, file: &String| {
        let config = found.entry(config.to_string()).or_default();
        config
            .entry(split.to_string())
            .or_default()
            .push(file.clone());
    };
    if !parquet.is_empty() && parquet.iter().all(|f| export(f).is_some()) {
        for f in &parquet {
            let (config, split) = export(f).unwrap_or_default();
            add(config, split, f);
        }
        return (Layout::Export, sorted(found));
    }
    let sharded: Vec<(&String, (&str, &str))> = (parquet.iter())
        .filter_map(|f| sharded(f).map(|cs| (*f, cs)))
        .collect();
    if !sharded.is_empty() {
        for (f, (config, split)) in sharded {
            add(config, split, f);
        }
        return (Layout::Sharded, sorted(found));
    }
    let mut any = false;
    for f in &parquet {
        for (split, words) in KEYWORDS {
            if words.iter().any(|w| names_split(f, w)) {
                add(DEFAULT_CONFIG, split, f);
                any = true;
                break;
            }
        }
    }
    // No split named anywhere: every file is `train`, as `datasets` has it.
    if !any {
        for f in &parquet {
            add(DEFAULT_CONFIG, "train", f);
        }
    }
    (Layout::Named, sorted(found))
}

/// A split of another name than the standard three, named in the paths (`train_sft` in
/// `sft/train_sft.parquet`): `datasets` finds those only through a README's `configs:` or
/// `push_to_hub`'s layout; the path's own words do here.
pub fn named_split<'a>(files: &'a [String], split: &str) -> Vec<&'a String> {
    (files.iter())
        .filter(|f| f.ends_with(".parquet") && names_split(f, split))
        .collect()
}

fn sorted(mut found: Splits) -> Splits {
    for splits in found.values_mut() {
        for files in splits.values_mut() {
            files.sort();
        }
    }
    found
}

/// `{config}/{split}/NNNN.parquet` or `{config}/partial-{split}/NNNN.parquet`.
fn export(path: &str) -> Option<(&str, &str)> {
    let [config, split, file] = path.split('/').collect::<Vec<_>>()[..] else {
        return None;
    };
    let number = file.strip_suffix(".parquet")?;
    let digits = number.len() >= 4 && number.bytes().all(|b| b.is_ascii_digit());
    digits.then(|| (config, split.strip_prefix("partial-").unwrap_or(split)))
}

/// `{dir}/{split}-NNNNN-of-NNNNN*.parquet`: `data` is the default config, another directory
/// names its config.
fn sharded(path: &str) -> Option<(&str, &str)> {
    let (dir, name) = path.split_once('/')?;
    if name.contains('/') {
        return None;
    }
    let (split, rest) = name.split_once('-')?;
    let rest = rest.as_bytes();
    let shape = rest.len() >= 14
        && rest[..5].iter().all(u8::is_ascii_digit)
        && &rest[5..9] == b"-of-"
        && rest[9..14].iter().all(u8::is_ascii_digit);
    let word = !split.is_empty()
        && split
            .chars()
            .all(|c| c.is_alphanumeric() || "_.".contains(c));
    (shape && word).then(|| (if dir == "data" { DEFAULT_CONFIG } else { dir }, split))
}

/// Whether a part of `path` (a directory, or the file's name without `.parquet`) is `word`,
/// or holds it between separators (`train-00000`, `my_dev.1`).
fn names_split(path: &str, word: &str) -> bool {
    let path = path.strip_suffix(".parquet").unwrap_or(path);
    path.split('/').any(|part| {
        let part = part.to_lowercase();
        part.match_indices(word).any(|(at, _)| {
            let before = part[..at].chars().next_back();
            let after = part[at + word.len()..].chars().next();
            before.is_none_or(|c| SEPARATORS.contains(c))
                && after.is_none_or(|c| SEPARATORS.contains(c))
        })
    })
}

/// A path pattern `parquet_rows::sources` reads that names exactly `files` among `all` (the
/// repository's files, under `root`): the file itself when one, else its directory with a
/// `*` glob of their names' common beginning and end; `None` when no glob can (files in
/// several directories, or a neighbour the glob would take too).
pub fn pattern(files: &[String], all: &[String]) -> Option<String> {
    let dir = |f: &str| f.rsplit_once('/').map_or("", |(d, _)| d).to_string();
    let name = |f: &str| f.rsplit_once('/').map_or(f, |(_, n)| n).to_string();
    let first = files.first()?;
    if files.len() == 1 {
        return Some(first.clone());
    }
    let folder = dir(first);
    if files.iter().any(|f| dir(f) != folder) {
        return None;
    }
    let names: Vec<String> = files.iter().map(|f| name(f)).collect();
    let common = |a: &str, b: &str| a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    let prefix_len = names.iter().map(|n| common(n, &names[0])).min()?;
    let reversed: Vec<String> = names.iter().map(|n| n.chars().rev().collect()).collect();
    let suffix_len = reversed.iter().map(|n| common(n, &reversed[0])).min()?;
    let head: String = names[0].chars().take(prefix_len).collect();
    let tail: String = reversed[0].chars().take(suffix_len).collect::<String>();
    let tail: String = tail.chars().rev().collect();
    if head.contains(['*', '?']) || tail.contains(['*', '?']) {
        return None;
    }
    let glob = format!("{head}*{tail}");
    let taken = (all.iter())
        .filter(|f| dir(f) == folder)
        .filter(|f| {
            let n = name(f);
            n.len() >= head.len() + tail.len() && n.starts_with(&head) && n.ends_with(&tail)
        })
        .count();
    (taken == files.len()).then(|| match folder.is_empty() {
        true => glob,
        false => format!("{folder}/{glob}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(files: &[&str]) -> Vec<String> {
        files.iter().map(|f| f.to_string()).collect()
    }

    #[test]
    fn push_to_hubs_shards_name_their_split_and_config() {
        let files = list(&[
            "README.md",
            "data/train_sft-00000-of-00002-a1.parquet",
            "data/train_sft-00001-of-00002-b2.parquet",
            "data/test_sft-00000-of-00001.parquet",
            "extra/train-00000-of-00001.parquet",
        ]);
        let (layout, found) = splits(&files);
        assert_eq!(layout, Layout::Sharded);
        assert_eq!(found["default"]["train_sft"].len(), 2);
        assert_eq!(
            found["default"]["test_sft"],
            ["data/test_sft-00000-of-00001.parquet"]
        );
        assert_eq!(
            found["extra"]["train"],
            ["extra/train-00000-of-00001.parquet"]
        );
    }

    #[test]
    fn split_keywords_are_datasets_own() {
        let files = list(&[
            "train.parquet",
            "dev-0.parquet",
            "eval/part.parquet",
            "notes/training_data.parquet",
            "develop.parquet",
        ]);
        let (layout, found) = splits(&files);
        assert_eq!(layout, Layout::Named);
        let default = &found["default"];
        assert_eq!(
            default["train"],
            ["notes/training_data.parquet", "train.parquet"]
        );
        assert_eq!(default["validation"], ["dev-0.parquet"]);
        assert_eq!(default["test"], ["eval/part.parquet"]);
        // `develop` is not `dev`, and nothing else names a split: it is nowhere.
        assert!(
            default
                .values()
                .all(|f| !f.contains(&"develop.parquet".into()))
        );
        let (_, alone) = splits(&list(&["corpus.parquet", "more.parquet"]));
        assert_eq!(alone["default"]["train"].len(), 2);
    }

    #[test]
    fn the_hubs_export_has_configs_and_partial_splits() {
        let files = list(&[
            "default/train/0000.parquet",
            "default/train/0001.parquet",
            "default/test/0000.parquet",
            "big/partial-train/0000.parquet",
        ]);
        let (layout, found) = splits(&files);
        assert_eq!(layout, Layout::Export);
        assert_eq!(found["default"]["train"].len(), 2);
        assert_eq!(found["big"]["train"], ["big/partial-train/0000.parquet"]);
    }

    #[test]
    fn patterns_name_exactly_the_splits_files() {
        let all = list(&[
            "data/train-00000-of-00002-a.parquet",
            "data/train-00001-of-00002-b.parquet",
            "data/test-00000-of-00001-c.parquet",
        ]);
        let train = all[..2].to_vec();
        assert_eq!(
            pattern(&train, &all).as_deref(),
            Some("data/train-0000*.parquet")
        );
        assert_eq!(pattern(&all[2..], &all).as_deref(), Some(all[2].as_str()));
        // A neighbour the glob would also take: no pattern.
        let crowded = list(&["d/a1.parquet", "d/a2.parquet", "d/a12.parquet"]);
        assert_eq!(pattern(&crowded[..2], &crowded), None);
        let apart = list(&["x/a.parquet", "y/a.parquet"]);
        assert_eq!(pattern(&apart, &apart), None);
    }
}
