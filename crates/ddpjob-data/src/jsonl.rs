//! Instruction data, `data.dataset = "jsonl"` (and, read from parquet or Arrow files,
//! `"parquet"` and `"arrow"`): its options, and how they read the files: the model's tokenizer
//! and chat template found, the records tokenised (one example a row, or a corpus of windows,
//! see `corpus`), the job's stored examples read back, the task that batches them (see
//! `examples_task`). Its keys' words are `jsonl_keys`'; its checks and what it keeps in the job
//! are `jsonl_hooks`'. Prompt/completion, plain text or conversations, one JSON object a line,
//! for supervised fine-tuning.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::DataError;
use super::arrow_rows;
use super::chat::ChatTemplate;
use super::corpus::{self, TextRows};
pub use super::examples_task::JsonlTask;
use super::examples_task::pack;
use super::hf_tokenizer::HfTokenizer;
use super::jsonl_index::{
    Counts, Examples, Indexing, Sink, index_arrow, index_file, index_parquet,
};
use super::kept::Staged;
use super::pairs::PairFields;
use super::pairs_task::PairsTask;
use super::parquet_rows;
use super::text_options::named_file;
use super::vocab::Vocab;
use ddpjob_seam::task::Task;
use ddpjob_spec::DataContext;

/// `data.dataset = "jsonl"`: its keys. `tokenizer` and `eos_token` are written out by
/// `complete` (the model's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct JsonlOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_path: Option<String>,
    pub val_fraction: f64,
    pub text_field: String,
    pub prompt_field: String,
    pub completion_field: String,
    pub messages_field: String,
    /// A preference pair's completions (`train.objective = "dpo"`).
    pub chosen_field: String,
    pub rejected_field: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    pub train_on_prompt: bool,
    pub pack: bool,
    pub truncate: bool,
    pub skip_bad_lines: bool,
    /// Rows as examples or as one corpus of windows (see `corpus`); `complete` writes out
    /// the default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_rows: Option<TextRows>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_token: Option<String>,
    /// A Hub dataset instead of paths, and which part of it (see `hub_source`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_split: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// What the files are: JSON Lines, or parquet (`data.dataset = "parquet"`, see
    /// `ParquetOptions`); not a key.
    #[serde(skip)]
    pub(crate) format: Format,
}

/// What [`JsonlOptions::read_to_files`] gives: the staged files (training's, validation's),
/// the training records, `val_path`'s and the end-of-sequence id.
pub(crate) type ReadToFiles = ([Staged; 2], (Examples, Option<Examples>, u32));

/// The files' format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Jsonl,
    Parquet,
    /// Arrow IPC files, `datasets`' `save_to_disk` (see `arrow_rows`).
    Arrow,
}

impl Format {
    /// Its `data.dataset` name.
    pub fn name(self) -> &'static str {
        match self {
            Format::Jsonl => "jsonl",
            Format::Parquet => "parquet",
            Format::Arrow => "arrow",
        }
    }

    /// The files `path` (the option `key`) names: a jsonl file is itself; parquet and Arrow
    /// paths may be directories and globs.
    pub(crate) fn sources(self, path: &str, key: &str) -> Result<Vec<PathBuf>, DataError> {
        match self {
            Format::Jsonl => Ok(vec![PathBuf::from(path)]),
            Format::Parquet => parquet_rows::sources(path, key),
            Format::Arrow => arrow_rows::sources(path, key),
        }
    }

    /// The columns of `file`; `None` for jsonl, whose lines each say their own fields.
    pub(crate) fn columns(self, file: &Path) -> Result<Option<Vec<String>>, DataError> {
        match self {
            Format::Jsonl => Ok(None),
            Format::Parquet => parquet_rows::columns(file).map(Some),
            Format::Arrow => arrow_rows::columns(file).map(Some),
        }
    }
}

impl Default for JsonlOptions {
    fn default() -> Self {
        JsonlOptions {
            train_path: None,
            val_path: None,
            val_fraction: 0.1,
            text_field: "text".into(),
            prompt_field: "prompt".into(),
            completion_field: "completion".into(),
            messages_field: "messages".into(),
            chosen_field: "chosen".into(),
            rejected_field: "rejected".into(),
            chat_template: None,
            train_on_prompt: false,
            pack: false,
            truncate: true,
            skip_bad_lines: false,
            text_rows: None,
            tokenizer: None,
            eos_token: None,
            hub: None,
            config: None,
            split: None,
            val_split: None,
            revision: None,
            format: Format::Jsonl,
        }
    }
}

pub use super::jsonl_keys::JSONL_KEYS;

/// The stored examples' names in the job directory.
pub(crate) const STORED: [&str; 2] = ["jsonl-train.bin", "jsonl-val.bin"];

impl JsonlOptions {
    pub(crate) fn tokenizer_path(&self) -> PathBuf {
        PathBuf::from(self.tokenizer.clone().unwrap_or_default())
    }

    /// The chat template conversations are rendered with: `chat_template`'s file, else the
    /// model's beside its tokenizer; `None` when there is none.
    fn template(&self) -> Result<Option<ChatTemplate>, DataError> {
        let path = self.chat_template.as_deref().map(Path::new);
        ChatTemplate::for_tokenizer(&self.tokenizer_path(), path).map_err(DataError::Mismatch)
    }

    /// Whether the job in `job` stored its examples (or windows' tokens, `file`) from these
    /// options (the same files, fields and tokenizer; `train_on_prompt` and `pack` act when
    /// batching, so they may differ): not when `eval --data` names other data.
    pub(crate) fn stored_in(&self, job: &Path, file: &str) -> bool {
        let Some(data) = std::fs::read_to_string(job.join("job.toml"))
            .ok()
            .and_then(|t| t.parse::<toml::Table>().ok())
            .and_then(|mut doc| doc.remove("data"))
        else {
            return false;
        };
        let Ok(mut stored) = data.try_into::<JsonlOptions>() else {
            return false;
        };
        stored.format = self.format;
        // A job stored before `text_rows` existed made examples of every row.
        let source = |o: &JsonlOptions| JsonlOptions {
            train_on_prompt: false,
            pack: false,
            text_rows: o.text_rows.or(Some(TextRows::Examples)),
            ..o.clone()
        };
        job.join(file).is_file() && source(&stored) == source(self)
    }

    /// How the rows become samples: `text_rows`, else as [`corpus::default_rows`] decides.
    pub(crate) fn rows(&self) -> Result<TextRows, DataError> {
        match self.text_rows {
            Some(rows) => Ok(rows),
            None => corpus::default_rows(self),
        }
    }

    /// [`JsonlOptions::read`], the tokens of each split written as they are made into a staged
    /// file named as in `names` (training's, validation's), each checked against the model's
    /// vocabulary of `vocab_size`: the files, then what `read` returns.
    pub(crate) fn read_to_files(
        &self,
        cx: &DataContext,
        rows: TextRows,
        names: [&'static str; 2],
        vocab_size: usize,
    ) -> Result<ReadToFiles, DataError> {
        let files = [
            Mutex::new(Staged::create(cx, names[0])?),
            Mutex::new(Staged::create(cx, names[1])?),
        ];
        let read = {
            let sink = |i: usize, split: &'static str| {
                let file = &files[i];
                move |tokens: Vec<u32>| -> Result<(), DataError> {
                    self.check_vocabulary(split, &tokens, vocab_size)?;
                    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
                    file.lock().unwrap_or_else(|e| e.into_inner()).write(&bytes)
                }
            };
            let (train, val) = (sink(0, "training"), sink(1, "validation"));
            self.read(cx, rows, [Some(&train), Some(&val)])?
        };
        let files = files.map(|f| f.into_inner().unwrap_or_else(|e| e.into_inner()));
        Ok((files, read))
    }

    /// The records of `train_path` and of `val_path` (`None` without it) as `rows` says (one
    /// example a record, or each whole for a corpus), and the end-of-sequence id.
    /// With `sinks` (training's, validation's), the tokens go there as they are made.
    pub(crate) fn read(
        &self,
        cx: &DataContext,
        rows: TextRows,
        sinks: [Option<&Sink>; 2],
    ) -> Result<(Examples, Option<Examples>, u32), DataError> {
        let train_path = PathBuf::from(self.train_path.clone().unwrap_or_default());
        if self.format == Format::Jsonl {
            let fix = "put the examples there (one JSON object a line) or correct the path";
            named_file("train_path", &train_path, fix)?;
            if let Some(val) = &self.val_path {
                named_file("val_path", Path::new(val), fix)?;
            }
        }
        named_file("tokenizer", &self.tokenizer_path(), TOKENIZER_FIX)?;
        let tokenizer = HfTokenizer::load(&self.tokenizer_path())?;
        let eos = eos_id(&tokenizer, self.eos_token.as_deref().unwrap_or_default())?;
        let block = cx.language.as_ref().map_or(0, |l| l.block_size);
        let template = self.template()?;
        let no_template = format!(
            "the model has no chat template (no chat_template.jinja or tokenizer_config.json \
             chat_template beside `{}`): set data.chat_template = \"path/to/template.jinja\"",
            self.tokenizer_path().display()
        );
        let how = Indexing {
            tokenizer: &tokenizer,
            eos,
            text_field: &self.text_field,
            prompt_field: &self.prompt_field,
            completion_field: &self.completion_field,
            messages_field: &self.messages_field,
            chat: template.as_ref().ok_or(no_template.as_str()),
            max_tokens: match rows {
                TextRows::Examples => block + 1,
                TextRows::Windows => usize::MAX,
            },
            truncate: self.truncate,
            skip_bad_lines: self.skip_bad_lines,
            train_on_prompt: self.train_on_prompt || rows == TextRows::Windows,
            sink: None,
            keep_layout: rows == TextRows::Examples,
            pairs: cx.pairs.then_some(PairFields {
                chosen: &self.chosen_field,
                rejected: &self.rejected_field,
            }),
        };
        let read = |path: &str, key: &str, sink| {
            let how = Indexing { sink, ..how };
            match self.format {
                Format::Jsonl => index_file(Path::new(path), &how),
                Format::Parquet => index_parquet(&parquet_rows::sources(path, key)?, &how),
                Format::Arrow => index_arrow(&arrow_rows::sources(path, key)?, &how),
            }
        };
        let train = read(
            self.train_path.as_deref().unwrap_or_default(),
            "train_path",
            sinks[0],
        )?;
        let val = match &self.val_path {
            Some(path) => Some(read(path, "val_path", sinks[1])?),
            None => None,
        };
        Ok((train, val, eos))
    }

    /// The examples of both splits and the end-of-sequence id: the job's stored ones when it
    /// has them (for these options), else read from the files.
    fn examples(&self, cx: &DataContext) -> Result<(Examples, Examples, u32), DataError> {
        if let Some(job) = &cx.job
            && self.stored_in(job, STORED[0])
        {
            let read = |name: &str| Examples::open(&job.join(name));
            let ((train, eos), (val, _)) = (read(STORED[0])?, read(STORED[1])?);
            return Ok((train, val, eos));
        }
        let (mut train, val, eos) = self.read(cx, TextRows::Examples, [None, None])?;
        let val = self.validation(&mut train, val, cx, |train, n| Ok(train.split_off_last(n)))?;
        Ok((train, val, eos))
    }

    /// The validation examples: `val_path`'s (`val`), or the last `val_fraction` of the
    /// training examples, cut off by `split` (in memory, or where their tokens went); refused
    /// when a split has no usable example.
    pub(crate) fn validation(
        &self,
        train: &mut Examples,
        val: Option<Examples>,
        cx: &DataContext,
        split: impl FnOnce(&mut Examples, usize) -> Result<Examples, DataError>,
    ) -> Result<Examples, DataError> {
        let train_path = PathBuf::from(self.train_path.clone().unwrap_or_default());
        let block = cx.language.as_ref().map_or(0, |l| l.block_size);
        // A pair's two examples stay together: the split is in pairs.
        let (unit, what) = match cx.pairs {
            true => (2, "pair"),
            false => (1, "example"),
        };
        let val = match val {
            Some(val) => val,
            None => {
                let records = train.len() / unit;
                let n = ((records as f64) * self.val_fraction).ceil() as usize;
                if records < 2 {
                    return Err(DataError::Mismatch(format!(
                        "`{}` has {records} usable {what}(s){}: a validation split needs at \
                         least 2, or data.val_path",
                        train_path.display(),
                        left_out(&train.counts, block)
                    )));
                }
                split(train, unit * n.clamp(1, records - 1))?
            }
        };
        let val_file = match &self.val_path {
            Some(path) => format!("data.val_path `{path}`"),
            None => format!("the last data.val_fraction of `{}`", train_path.display()),
        };
        let train_file = format!("data.train_path `{}`", train_path.display());
        for (split, examples, file) in [
            ("training", &*train, train_file),
            ("validation", &val, val_file),
        ] {
            if examples.len() == 0 {
                return Err(DataError::Mismatch(format!(
                    "the {split} split of data.dataset = \"{}\" ({file}) has no usable \
                     example{}",
                    self.format.name(),
                    left_out(&examples.counts, block)
                )));
            }
        }
        Ok(val)
    }

    /// The task: one example a row, a preference pair a sample (see `pairs_task`), or the
    /// rows' windows (see `corpus`).
    pub fn open(&self, cx: &DataContext) -> Result<Box<dyn Task>, DataError> {
        if cx.pairs {
            return Ok(Box::new(PairsTask::new(self.open_examples(cx)?)));
        }
        Ok(match self.rows()? {
            TextRows::Examples => Box::new(self.open_examples(cx)?),
            TextRows::Windows => Box::new(corpus::open(self, cx, self.vocab_size(cx)?)?),
        })
    }

    /// The model's vocabulary; for a model that takes it from the data (a gpt without
    /// model.vocab_size), the tokenizer's, as the job stored it or from its file.
    pub(crate) fn vocab_size(&self, cx: &DataContext) -> Result<usize, DataError> {
        let Some(lm) = &cx.language else {
            return Err(DataError::Mismatch(format!(
                "{} data needs a language model, not \"{}\"",
                self.format.name(),
                cx.arch
            )));
        };
        Ok(match lm.vocab_size {
            Some(v) => v,
            None => match cx
                .job
                .as_deref()
                .map(Vocab::path_in)
                .filter(|p| p.is_file())
            {
                Some(stored) => Vocab::load(&stored)?.size(),
                None => HfTokenizer::load(&self.tokenizer_path())?.size(),
            },
        })
    }

    /// Refuses a `split`'s tokens outside the model's vocabulary: the tokenizer is not the
    /// model's.
    pub(crate) fn check_vocabulary(
        &self,
        split: &str,
        tokens: &[u32],
        vocab_size: usize,
    ) -> Result<(), DataError> {
        match tokens.iter().find(|&&t| t as usize >= vocab_size) {
            Some(bad) => Err(DataError::Mismatch(format!(
                "the {split} data holds token {bad}, outside the model's vocabulary of \
                 {vocab_size}: the tokenizer `{}` is not the model's",
                self.tokenizer_path().display()
            ))),
            None => Ok(()),
        }
    }

    /// One example a row.
    pub(crate) fn open_examples(&self, cx: &DataContext) -> Result<JsonlTask, DataError> {
        let vocab_size = self.vocab_size(cx)?;
        let (train, val, eos) = self.examples(cx)?;
        for (split, examples) in [("training", &train), ("validation", &val)] {
            self.check_vocabulary(split, examples.tokens(), vocab_size)?;
        }
        let lm = cx.language.as_ref().expect("vocab_size checked it");
        let packs = self
            .pack
            .then(|| [&train, &val].map(|examples| pack(examples, lm.block_size)));
        Ok(JsonlTask {
            train,
            val,
            packs,
            eos,
            block: lm.block_size,
            vocab_size,
            train_on_prompt: self.train_on_prompt,
            format: self.format,
        })
    }
}

/// Why examples of a split were not used, for an error about too few: empty when none was
/// left out.
fn left_out(counts: &Counts, block_size: usize) -> String {
    let mut why = Vec::new();
    if counts.empty > 0 {
        why.push(format!(
            "{} left out with nothing to predict (empty, or a prompt that fills \
             model.block_size = {block_size}: raise it, or shorten the prompts)",
            counts.empty
        ));
    }
    if counts.bad_lines > 0 {
        why.push(format!(
            "{} bad lines skipped (data.skip_bad_lines)",
            counts.bad_lines
        ));
    }
    match why.is_empty() {
        true => String::new(),
        false => format!(" ({})", why.join("; ")),
    }
}

/// The id of `token`, the end-of-sequence token, in `tokenizer`.
fn eos_id(tokenizer: &HfTokenizer, token: &str) -> Result<u32, DataError> {
    tokenizer.token_id(token).ok_or_else(|| {
        DataError::Mismatch(format!(
            "data.eos_token = \"{token}\" is not a token of the tokenizer; name its \
             end-of-sequence token (e.g. \"</s>\" or \"<|endoftext|>\")"
        ))
    })
}

/// The end-of-sequence token the files beside `tokenizer` name: `tokenizer_config.json`'s
/// `eos_token`, else `config.json`'s `eos_token_id` (the first, when a list).
pub(crate) fn eos_beside(tokenizer: &Path) -> Option<String> {
    let dir = tokenizer.parent()?;
    let read = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    if let Some(config) = read("tokenizer_config.json") {
        match config.get("eos_token") {
            Some(serde_json::Value::String(s)) => return Some(s.clone()),
            Some(object) => {
                if let Some(s) = object.get("content").and_then(|c| c.as_str()) {
                    return Some(s.into());
                }
            }
            None => {}
        }
    }
    let config = read("config.json")?;
    let id = match config.get("eos_token_id")? {
        serde_json::Value::Array(ids) => ids.first()?.as_u64()?,
        other => other.as_u64()?,
    };
    let loaded = HfTokenizer::load(tokenizer).ok()?;
    loaded.id_to_token(u32::try_from(id).ok()?)
}

pub(crate) const TOKENIZER_FIX: &str =
    "name the Hugging Face tokenizer.json the examples are to be encoded with";

#[cfg(test)]
#[path = "jsonl_tests.rs"]
mod tests;
