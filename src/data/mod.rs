//! The data a job learns from: ddpjob's data sets and sampler (`ddpjob-data`), registered with
//! the registry (`register_builtin`).

use crate::registry::Registry;
pub use ddpjob_data::*;

/// ddpjob's data sets, registered as a user's binary registers its own.
pub(crate) fn register_builtin(registry: Registry) -> Registry {
    registry
        .dataset_with("mnist", IdxOptions::<Mnist>::open)
        .dataset_with("fashion-mnist", IdxOptions::<FashionMnist>::open)
        .dataset_with("synthetic", SyntheticOptions::open)
        .dataset_with("text", TextOptions::open)
        .dataset_with("tokens", TokensOptions::open)
        .dataset_with("jsonl", JsonlOptions::open)
        .documented_dataset("mnist", IDX_KEYS)
        .documented_dataset("fashion-mnist", IDX_KEYS)
        .documented_dataset("synthetic", SYNTHETIC_KEYS)
        .documented_dataset("text", TEXT_KEYS)
        .documented_dataset("tokens", TOKENS_KEYS)
        .documented_dataset("jsonl", JSONL_KEYS)
        .dataset_tolerates("mnist", IDX_TOLERATES, &[])
        .dataset_tolerates("fashion-mnist", IDX_TOLERATES, &[])
        .dataset_tolerates("synthetic", SYNTHETIC_TOLERATES, &[])
        .dataset_tolerates("text", &[], TEXT_TOLERATES_IN_STORED_JOBS)
        .dataset_tolerates("tokens", &[], TOKENS_TOLERATES_IN_STORED_JOBS)
}

/// The image datasets' keys dropped beside the image dataset that does not read them: a job
/// file switches `dataset` between them and keeps the others' keys (as `configs/mnist.toml`
/// shows every key), and older versions wrote them into every `job.toml`.
const IDX_TOLERATES: &[&str] = &["synthetic"];
const SYNTHETIC_TOLERATES: &[&str] = &["root", "download", "mirrors", "checksums"];

/// The `[data]` keys older versions wrote into every `job.toml` whatever the dataset: dropped
/// beside a text dataset in a stored job's `job.toml`, so those jobs still resume; a job file
/// is told of them (a tokens job's `download = true` would download nothing).
const TEXT_TOLERATES_IN_STORED_JOBS: &[&str] = &["root", "mean", "std", "synthetic"];
const TOKENS_TOLERATES_IN_STORED_JOBS: &[&str] = &[
    "root",
    "download",
    "mirrors",
    "checksums",
    "mean",
    "std",
    "synthetic",
];

#[cfg(test)]
mod tests {
    use crate::config::Builders as _;
    use crate::registry::Registry;

    /// `ddpjob keys` and the config reference list what each built-in dataset's options struct
    /// reads (a table's keys as `table.key`), and show its real defaults.
    #[test]
    fn every_builtin_datasets_keys_are_documented_with_their_defaults() {
        let registry = Registry::builtin();
        let docs = registry.dataset_docs();
        let names: Vec<&str> = docs.iter().map(|d| d.dataset).collect();
        assert_eq!(
            names,
            [
                "fashion-mnist",
                "jsonl",
                "mnist",
                "synthetic",
                "text",
                "tokens"
            ]
        );
        let mut compared = 0;
        for d in docs {
            let mut tops: Vec<&str> = Vec::new();
            for k in d.keys {
                let top = k.key.split('.').next().unwrap();
                if tops.last() != Some(&top) {
                    tops.push(top);
                }
            }
            assert_eq!(tops, d.fields, "data.dataset = \"{}\"", d.dataset);
            let defaults = registry
                .resolve_dataset_keys(d.dataset, &toml::Table::new())
                .unwrap();
            for k in d.keys {
                // `"data/<dataset>"` names a pattern, not a value.
                let literal = k
                    .default
                    .strip_prefix('`')
                    .and_then(|s| s.strip_suffix('`'));
                let Some(literal) = literal.filter(|l| !l.contains('<')) else {
                    continue;
                };
                let Ok(mut shown) = toml::from_str::<toml::Table>(&format!("v = {literal}")) else {
                    continue;
                };
                let (parent, leaf) = k.key.rsplit_once('.').unwrap_or(("", k.key));
                let table = if parent.is_empty() {
                    Some(&defaults)
                } else {
                    parent
                        .split('.')
                        .try_fold(&defaults, |t, part| t.get(part)?.as_table())
                };
                let value = table.and_then(|t| t.get(leaf));
                let value =
                    value.unwrap_or_else(|| panic!("{}: no default for {}", d.dataset, k.key));
                let shown = shown.remove("v").unwrap();
                let same = match (&shown, value) {
                    (toml::Value::Integer(a), toml::Value::Float(b)) => *a as f64 == *b,
                    (a, b) => a == b,
                };
                assert!(
                    same,
                    "data.{} of {}: shown {shown}, default {value}",
                    k.key, d.dataset
                );
                compared += 1;
            }
        }
        assert!(compared >= 10, "only {compared} defaults compared");
    }
}
