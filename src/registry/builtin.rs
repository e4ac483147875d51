//! ddpjob's own models and data sets, registered exactly as a user's binary registers its own
//! (see `examples/custom-model`): each is built by its crate (`ddpjob-models`,
//! `ddpjob-data`); what the registry knows of it (its keys, Hugging Face family, LoRA layers,
//! blocks, the keys it tolerates) is declared here, on its entry, and nowhere else.

use super::Registry;
use ddpjob_data::{
    ARROW_KEYS, ArrowOptions, FashionMnist, IDX_KEYS, IdxOptions, JSONL_KEYS, JsonlOptions, Mnist,
    PARQUET_KEYS, ParquetOptions, SYNTHETIC_KEYS, SyntheticOptions, TEXT_KEYS, TOKENS_KEYS,
    TextOptions, TokensOptions,
};
use ddpjob_models::image::{MLP_KEYS, build_cnn, build_mlp};
use ddpjob_models::{gpt, llama};

/// ddpjob's own models, registered as a user's binary registers its own: each owns its
/// `[model]` keys (its options struct's fields), and the language models their Hugging Face
/// `model_type`s and export.
pub(super) fn models(registry: Registry) -> Registry {
    registry
        .model("mlp", build_mlp)
        .model("cnn", build_cnn)
        .language_model("gpt", gpt::options::build_gpt)
        // GPT-2's layers are Conv1D, weights stored [in, out]: PEFT's fan_in_fan_out.
        .hf_family(
            "gpt",
            &gpt::options::MODEL_TYPES,
            gpt::options::hf_parts,
            true,
        )
        .language_model("llama", llama::build_llama)
        .hf_family("llama", &llama::MODEL_TYPES, llama::hf_parts, false)
        .documented("mlp", MLP_KEYS)
        .documented("gpt", gpt::options::KEYS)
        .documented("llama", llama::KEYS)
        .blocks("mlp", false)
        .blocks("cnn", false)
        .blocks("gpt", true)
        .blocks("llama", true)
        .lora_layers("gpt", GPT_LINEAR_LAYERS)
        .lora_layers("llama", LLAMA_LINEAR_LAYERS)
        // `hidden` is the default model's (mlp) key; job files switching `arch` keep it.
        .model_tolerates("cnn", &["hidden"])
        .model_tolerates("gpt", &["hidden"])
}

/// The linear layers of a `gpt` LoRA adapts (their names' last part), as PEFT names GPT-2's.
const GPT_LINEAR_LAYERS: &[&str] = &["c_attn", "c_proj", "c_fc"];

/// The linear layers of a `llama` LoRA adapts, as PEFT names them.
const LLAMA_LINEAR_LAYERS: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// ddpjob's data sets, registered as a user's binary registers its own.
pub(super) fn data(registry: Registry) -> Registry {
    registry
        .dataset_with("mnist", IdxOptions::<Mnist>::open)
        .dataset_with("fashion-mnist", IdxOptions::<FashionMnist>::open)
        .dataset_with("synthetic", SyntheticOptions::open)
        .dataset_with("text", TextOptions::open)
        .dataset_with("tokens", TokensOptions::open)
        .dataset_with("jsonl", JsonlOptions::open)
        .dataset_with("parquet", ParquetOptions::open)
        .dataset_with("arrow", ArrowOptions::open)
        .documented_dataset("mnist", IDX_KEYS)
        .documented_dataset("fashion-mnist", IDX_KEYS)
        .documented_dataset("synthetic", SYNTHETIC_KEYS)
        .documented_dataset("text", TEXT_KEYS)
        .documented_dataset("tokens", TOKENS_KEYS)
        .documented_dataset("jsonl", JSONL_KEYS.as_slice())
        .documented_dataset("parquet", PARQUET_KEYS.as_slice())
        .documented_dataset("arrow", ARROW_KEYS.as_slice())
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
    use super::*;
    use ddpjob_spec::Builders as _;

    /// `ddpjob keys` and the config reference list what each built-in model's options struct
    /// reads: a field added without its line, or a line for a field that is gone, fails here.
    #[test]
    fn every_builtin_models_keys_are_documented_in_field_order() {
        let registry = Registry::builtin();
        let docs = registry.model_docs();
        let archs: Vec<&str> = docs.iter().map(|m| m.arch).collect();
        assert_eq!(archs, ["cnn", "gpt", "llama", "mlp"]);
        for m in docs {
            let documented: Vec<&str> = m.keys.iter().map(|k| k.key).collect();
            assert_eq!(documented, m.fields, "model.arch = \"{}\"", m.arch);
        }
    }

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
                "arrow",
                "fashion-mnist",
                "jsonl",
                "mnist",
                "parquet",
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
