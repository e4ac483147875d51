//! Instruction data in columnar files: `data.dataset = "parquet"` (the Hub's format) and
//! `"arrow"` (`datasets`' `save_to_disk`). Everything but the reading is `jsonl`'s (examples,
//! conversations through the chat template, masks, packing, truncation, rows as windows, the
//! job's stored copy), with a row for a line and a column for a field; `train_path` and
//! `val_path` may name a file, a directory of shards or a glob (see `parquet_rows` and
//! `arrow_rows`).

use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

use super::DataError;
use super::jsonl::{Format, JSONL_KEYS, JsonlOptions};
use ddpjob_seam::task::Task;
use ddpjob_seam::{BuildError, DatasetOptions, JobFile};
use ddpjob_spec::{DataContext, KeyDoc};

/// A columnar file format: which one.
pub trait Columnar: 'static {
    const FORMAT: Format;
}

/// `data.dataset = "parquet"`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parquet;
impl Columnar for Parquet {
    const FORMAT: Format = Format::Parquet;
}

/// `data.dataset = "arrow"`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Arrow;
impl Columnar for Arrow {
    const FORMAT: Format = Format::Arrow;
}

/// `data.dataset = "parquet"` or `"arrow"`: jsonl's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(transparent, bound = "")]
pub struct ColumnarOptions<F: Columnar>(pub JsonlOptions, #[serde(skip)] PhantomData<F>);

pub type ParquetOptions = ColumnarOptions<Parquet>;
pub type ArrowOptions = ColumnarOptions<Arrow>;

/// jsonl's keys, with the paths and the bad records said for parquet.
pub static PARQUET_KEYS: LazyLock<Vec<KeyDoc>> = LazyLock::new(|| {
    keys(
        "a parquet file, a directory of `*.parquet` shards, or a glob of them \
         (`data/train-*.parquet`): a column `messages` (a conversation: \
         `list<struct<role, content>>`), `prompt` and `completion`, or `text`; read one row \
         group at a time",
    )
});

/// jsonl's keys, with the paths and the bad records said for Arrow files.
pub static ARROW_KEYS: LazyLock<Vec<KeyDoc>> = LazyLock::new(|| {
    keys(
        "a directory `datasets`' `save_to_disk` wrote (its `state.json` names the \
         `data-0000x-of-0000N.arrow` files; for a `DatasetDict`, one split's directory), an \
         `.arrow` file (IPC stream or file), a directory of them, or a glob: the columns as \
         parquet's; read one record batch at a time",
    )
});

fn keys(train_path: &'static str) -> Vec<KeyDoc> {
    (JSONL_KEYS.iter())
        .map(|k| {
            let doc = match k.key {
                "train_path" => train_path,
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
}

impl<F: Columnar> ColumnarOptions<F> {
    /// The options, read as `F`'s files.
    fn inner(&self) -> JsonlOptions {
        JsonlOptions {
            format: F::FORMAT,
            ..self.0.clone()
        }
    }

    pub fn open(&self, cx: &DataContext) -> Result<Box<dyn Task>, DataError> {
        self.inner().open(cx)
    }
}

impl<F: Columnar> DatasetOptions for ColumnarOptions<F> {
    const PATHS: &'static [&'static str] = JsonlOptions::PATHS;

    fn end_of_example(&self) -> Option<String> {
        self.0.end_of_example()
    }

    fn complete(self, cx: &DataContext) -> Result<Self, String> {
        (self.inner().complete(cx)).map(|o| ColumnarOptions(o, PhantomData))
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
