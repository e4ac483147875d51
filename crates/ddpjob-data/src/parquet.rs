//! Instruction data in parquet, `data.dataset = "parquet"`: the Hub's format. Everything but
//! the reading is `jsonl`'s (examples, conversations through the chat template, masks,
//! packing, truncation, the job's stored copy), with a row for a line and a column for a
//! field; `train_path` and `val_path` may name a file, a directory of shards or a glob (see
//! `parquet_rows`).

use std::path::PathBuf;
use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

use super::DataError;
use super::jsonl::{Format, JSONL_KEYS, JsonlOptions};
use ddpjob_seam::task::Task;
use ddpjob_seam::{BuildError, DatasetOptions, JobFile};
use ddpjob_spec::{DataContext, KeyDoc};

/// `data.dataset = "parquet"`: jsonl's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(transparent)]
pub struct ParquetOptions(pub JsonlOptions);

/// jsonl's keys, with the paths and the bad records said for parquet.
pub static PARQUET_KEYS: LazyLock<Vec<KeyDoc>> = LazyLock::new(|| {
    JSONL_KEYS
        .iter()
        .map(|k| {
            let doc = match k.key {
                "train_path" => {
                    "a parquet file, a directory of `*.parquet` shards, or a glob of them \
                     (`data/train-*.parquet`): a column `messages` (a conversation: \
                     `list<struct<role, content>>`), `prompt` and `completion`, or `text`; read \
                     one row group at a time"
                }
                "val_path" => {
                    "the validation rows, the same way; without it the last `val_fraction` of \
                     `train_path`'s examples"
                }
                "skip_bad_lines" => {
                    "count and skip rows that lack the columns or hold a bad conversation, \
                     instead of refusing the file"
                }
                _ => k.doc,
            };
            KeyDoc { doc, ..*k }
        })
        .collect()
});

impl ParquetOptions {
    /// The options, read as parquet.
    fn inner(&self) -> JsonlOptions {
        JsonlOptions {
            format: Format::Parquet,
            ..self.0.clone()
        }
    }

    pub fn open(&self, cx: &DataContext) -> Result<Box<dyn Task>, DataError> {
        self.inner().open(cx)
    }
}

impl DatasetOptions for ParquetOptions {
    const PATHS: &'static [&'static str] = JsonlOptions::PATHS;

    fn end_of_example(&self) -> Option<String> {
        self.0.end_of_example()
    }

    fn complete(self, cx: &DataContext) -> Result<Self, String> {
        self.inner().complete(cx).map(ParquetOptions)
    }

    fn prepare(&self, cx: &DataContext) -> Result<Vec<JobFile>, BuildError> {
        self.inner().prepare(cx)
    }

    fn train_samples(&self) -> Option<(usize, String)> {
        self.inner().train_samples()
    }

    fn describe(&self) -> Option<String> {
        self.inner().describe()
    }

    fn tokenizer_file(&self) -> Option<PathBuf> {
        self.0.tokenizer_file()
    }
}
