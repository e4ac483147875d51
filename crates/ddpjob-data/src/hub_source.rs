//! `data.hub = "org/name"` for parquet data: the Hub dataset's split files found (and downloaded)
//! in the Hugging Face cache once, when a new job's options are completed, and written into
//! them as `train_path` / `val_path` with `revision` pinned to the commit and `config` to the
//! one read, so the job's `job.toml` says exactly which files it trained on and a resumed job
//! reads its stored examples without asking the Hub again. The resolving itself is
//! `ddpjob_storage::hf::hub_dataset`'s.

use ddpjob_spec::{DataContext, KeyDoc};
use ddpjob_storage::hf::hub::{HubEnv, looks_like_id};
use ddpjob_storage::hf::hub_dataset::{DatasetQuery, EXPORT, resolve_dataset};

use super::jsonl::{Format, JsonlOptions};

/// The keys, after the rows' own (documented for jsonl too, where they are refused).
pub const HUB_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "hub",
        default: "none",
        doc: "instead of paths (`data.dataset = \"parquet\"` only): a Hub dataset id \
              (`HuggingFaceH4/ultrachat_200k`), its split files found in the Hugging Face cache \
              or downloaded (`HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` as `datasets` reads \
              them); a dataset not stored as parquet is read through the Hub's parquet export \
              (`refs/convert/parquet`)",
    },
    KeyDoc {
        key: "config",
        default: "the only one, or `default`",
        doc: "with `hub`: the dataset's config (subset)",
    },
    KeyDoc {
        key: "split",
        default: "\"train\" (with `hub`)",
        doc: "with `hub`: the split trained on (`train_sft`, ...)",
    },
    KeyDoc {
        key: "val_split",
        default: "none",
        doc: "with `hub`: the split validated on (`test`); without it the last `val_fraction` \
              of `split`'s examples",
    },
    KeyDoc {
        key: "revision",
        default: "\"main\" (with `hub`)",
        doc: "with `hub`: a branch, tag or commit; `job.toml` records the commit the files \
              were of",
    },
];

/// With `hub` set, `train_path` (and `val_path` for `val_split`) become its split files in the
/// cache; a stored job keeps the ones it was made with.
pub fn resolve(options: &mut JsonlOptions, cx: &DataContext) -> Result<(), String> {
    let Some(id) = options.hub.clone() else {
        for key in ["config", "split", "val_split", "revision"] {
            let set = match key {
                "config" => options.config.is_some(),
                "split" => options.split.is_some(),
                "val_split" => options.val_split.is_some(),
                _ => options.revision.is_some(),
            };
            if set {
                return Err(format!(
                    "data.{key} says which part of a Hub dataset to read, and data.hub names \
                     none: set data.hub = \"org/name\", or drop data.{key}"
                ));
            }
        }
        return Ok(());
    };
    if options.format != Format::Parquet {
        return Err(format!(
            "data.hub = \"{id}\" reads the Hub's parquet files: set data.dataset = \"parquet\" \
             (a dataset stored as jsonl is read through the Hub's parquet export)"
        ));
    }
    if !looks_like_id(&id) {
        return Err(format!(
            "data.hub = \"{id}\" is not a Hub dataset id (`org/name`); name a local file, \
             directory or glob with data.train_path instead"
        ));
    }
    // A stored job's paths are the files it was made with.
    if cx.stored_job && options.train_path.is_some() {
        return Ok(());
    }
    for (key, set) in [
        ("train_path", options.train_path.is_some()),
        ("val_path", options.val_path.is_some()),
    ] {
        if set {
            return Err(format!(
                "data.hub and data.{key} both name the data: keep data.hub (with data.split \
                 and data.val_split), or the paths"
            ));
        }
    }
    let split = options.split.clone().unwrap_or_else(|| "train".into());
    let revision = options.revision.clone().unwrap_or_else(|| "main".into());
    let mut splits = vec![split.as_str()];
    if let Some(val) = &options.val_split {
        if *val == split {
            return Err(format!(
                "data.val_split = \"{val}\" is data.split too: validate on another split, or \
                 leave data.val_split out to keep the last data.val_fraction of \"{split}\""
            ));
        }
        splits.push(val);
    }
    let query = DatasetQuery {
        id: &id,
        config: options.config.as_deref(),
        revision: &revision,
        splits: &splits,
    };
    let found = resolve_dataset(&query, &HubEnv::from_env()).map_err(|e| e.to_string())?;
    if let Some(why) = &found.unchecked {
        eprintln!("warning: {why}");
    }
    let export = match found.branch == EXPORT {
        true => format!(" (its parquet export, {EXPORT})"),
        false => String::new(),
    };
    if found.downloaded {
        eprintln!(
            "downloaded dataset {id}{export} (commit {}) into the Hugging Face cache",
            found.commit
        );
    }
    options.train_path = Some(found.splits[0].path.clone());
    options.val_path = found.splits.get(1).map(|s| s.path.clone());
    options.revision = Some(found.commit);
    options.config = Some(found.config);
    options.split = Some(split);
    Ok(())
}
