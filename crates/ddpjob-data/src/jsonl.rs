//! Instruction data, `data.dataset = "jsonl"`: prompt/completion (or plain text) examples, one
//! JSON object a line, for supervised fine-tuning. A sample is one example; a batch pads its
//! examples on the right to the longest of them (causal attention never looks right, so the
//! padding changes no real position) and its targets are [`IGNORE_TARGET`] where they do not
//! score: padding, and the prompt's tokens unless `train_on_prompt`. The loss is then the mean
//! over the scored targets of the whole global batch (see `train::step`), so 2 × B/2 is 1 × B.

use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::DataError;
use super::hf_tokenizer::HfTokenizer;
use super::jsonl_index::{Counts, Examples, Indexing, index_file};
use super::text_options::named_file;
use super::vocab::Vocab;
use ddpjob_seam::task::{BatchSource, IGNORE_TARGET, ModelInput, Task};
use ddpjob_seam::{BuildError, DatasetOptions, JobFile};
use ddpjob_spec::{DataContext, KeyDoc};

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
    pub train_on_prompt: bool,
    pub pack: bool,
    pub truncate: bool,
    pub skip_bad_lines: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_token: Option<String>,
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
            train_on_prompt: false,
            pack: false,
            truncate: true,
            skip_bad_lines: false,
            tokenizer: None,
            eos_token: None,
        }
    }
}

pub const JSONL_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "train_path",
        default: "required",
        doc: "JSONL, one object a line: `{\"prompt\": ..., \"completion\": ...}` or \
              `{\"text\": ...}`; read once, streaming",
    },
    KeyDoc {
        key: "val_path",
        default: "none",
        doc: "the validation examples, same format; without it the last `val_fraction` of \
              `train_path`'s",
    },
    KeyDoc {
        key: "val_fraction",
        default: "`0.1`",
        doc: "without `val_path`: this last fraction of the examples is the validation split",
    },
    KeyDoc {
        key: "text_field",
        default: "`\"text\"`",
        doc: "a line without a completion: this field is the example, trained on whole",
    },
    KeyDoc {
        key: "prompt_field",
        default: "`\"prompt\"`",
        doc: "the prompt of a prompt/completion line",
    },
    KeyDoc {
        key: "completion_field",
        default: "`\"completion\"`",
        doc: "the completion; a line that has it is a prompt/completion example",
    },
    KeyDoc {
        key: "train_on_prompt",
        default: "`false`",
        doc: "`false`: the loss is on the completion's tokens only (the SFT default)",
    },
    KeyDoc {
        key: "pack",
        default: "`false`",
        doc: "`true`: several examples a row (in file order, up to `block_size` positions), \
              positions and attention restarted at each; `false`: one example a row, padded to \
              the longest in its batch",
    },
    KeyDoc {
        key: "truncate",
        default: "`true`",
        doc: "cut an example longer than `model.block_size + 1` tokens (counted in the log); \
              `false`: refuse it",
    },
    KeyDoc {
        key: "skip_bad_lines",
        default: "`false`",
        doc: "count and skip lines that are not JSON or lack the fields, instead of refusing \
              the file",
    },
    KeyDoc {
        key: "tokenizer",
        default: "the model's `tokenizer.json`",
        doc: "the Hugging Face `tokenizer.json` the examples are encoded with",
    },
    KeyDoc {
        key: "eos_token",
        default: "the tokenizer's (`tokenizer_config.json`, else `config.json`)",
        doc: "appended to every example, e.g. `\"</s>\"`",
    },
];

/// The stored examples' names in the job directory.
const STORED: [&str; 2] = ["jsonl-train.bin", "jsonl-val.bin"];

impl JsonlOptions {
    fn tokenizer_path(&self) -> PathBuf {
        PathBuf::from(self.tokenizer.clone().unwrap_or_default())
    }

    /// Whether the job in `job` stored its examples from these options (the same files, fields
    /// and tokenizer; `train_on_prompt` and `pack` act when batching, so they may differ): not
    /// when `eval --data` names other data.
    fn stored_in(&self, job: &Path) -> bool {
        let Some(data) = std::fs::read_to_string(job.join("job.toml"))
            .ok()
            .and_then(|t| t.parse::<toml::Table>().ok())
            .and_then(|mut doc| doc.remove("data"))
        else {
            return false;
        };
        let Ok(stored) = data.try_into::<JsonlOptions>() else {
            return false;
        };
        let source = |o: &JsonlOptions| JsonlOptions {
            train_on_prompt: false,
            pack: false,
            ..o.clone()
        };
        job.join(STORED[0]).is_file() && source(&stored) == source(self)
    }

    /// The examples of both splits and the end-of-sequence id: the job's stored ones when it
    /// has them (for these options), else read from the files.
    fn examples(&self, cx: &DataContext) -> Result<(Examples, Examples, u32), DataError> {
        if let Some(job) = &cx.job
            && self.stored_in(job)
        {
            let read = |name: &str| Examples::open(&job.join(name));
            let ((train, eos), (val, _)) = (read(STORED[0])?, read(STORED[1])?);
            return Ok((train, val, eos));
        }
        let train_path = PathBuf::from(self.train_path.clone().unwrap_or_default());
        let fix = "put the examples there (one JSON object a line) or correct the path";
        named_file("train_path", &train_path, fix)?;
        if let Some(val) = &self.val_path {
            named_file("val_path", Path::new(val), fix)?;
        }
        named_file("tokenizer", &self.tokenizer_path(), TOKENIZER_FIX)?;
        let tokenizer = HfTokenizer::load(&self.tokenizer_path())?;
        let eos = eos_id(&tokenizer, self.eos_token.as_deref().unwrap_or_default())?;
        let block = cx.language.as_ref().map_or(0, |l| l.block_size);
        let how = Indexing {
            tokenizer: &tokenizer,
            eos,
            text_field: &self.text_field,
            prompt_field: &self.prompt_field,
            completion_field: &self.completion_field,
            max_tokens: block + 1,
            truncate: self.truncate,
            skip_bad_lines: self.skip_bad_lines,
            train_on_prompt: self.train_on_prompt,
        };
        let mut train = index_file(&train_path, &how)?;
        let val = match &self.val_path {
            Some(path) => index_file(Path::new(path), &how)?,
            None => {
                let n = ((train.len() as f64) * self.val_fraction).ceil() as usize;
                if train.len() < 2 {
                    return Err(DataError::Mismatch(format!(
                        "`{}` has {} usable example(s){}: a validation split needs at least 2, \
                         or data.val_path",
                        train_path.display(),
                        train.len(),
                        left_out(&train.counts, block)
                    )));
                }
                train.split_off_last(n.clamp(1, train.len() - 1))
            }
        };
        let val_file = match &self.val_path {
            Some(path) => format!("data.val_path `{path}`"),
            None => format!("the last data.val_fraction of `{}`", train_path.display()),
        };
        let train_file = format!("data.train_path `{}`", train_path.display());
        for (split, examples, file) in [
            ("training", &train, train_file),
            ("validation", &val, val_file),
        ] {
            if examples.len() == 0 {
                return Err(DataError::Mismatch(format!(
                    "the {split} split of data.dataset = \"jsonl\" ({file}) has no usable \
                     example{}",
                    left_out(&examples.counts, block)
                )));
            }
        }
        Ok((train, val, eos))
    }

    pub fn open(&self, cx: &DataContext) -> Result<JsonlTask, DataError> {
        let Some(lm) = &cx.language else {
            return Err(DataError::Mismatch(format!(
                "jsonl data needs a language model, not \"{}\"",
                cx.arch
            )));
        };
        let (train, val, eos) = self.examples(cx)?;
        // A model that takes its vocabulary from the data (a gpt without model.vocab_size):
        // the tokenizer's, as the job stored it or from its file.
        let vocab_size = match lm.vocab_size {
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
        };
        for (split, examples) in [("training", &train), ("validation", &val)] {
            if let Some(&bad) = examples
                .tokens()
                .iter()
                .find(|&&t| t as usize >= vocab_size)
            {
                return Err(DataError::Mismatch(format!(
                    "the {split} examples hold token {bad}, outside the model's vocabulary of \
                     {vocab_size}: the tokenizer `{}` is not the model's",
                    self.tokenizer_path().display()
                )));
            }
        }
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
        })
    }
}

/// `examples` packed in order into rows of at most `block` positions (an example of L tokens
/// takes L - 1): the next example starts a new row when it does not fit the current one's rest.
fn pack(examples: &Examples, block: usize) -> Vec<Range<usize>> {
    let mut packs = Vec::new();
    let (mut start, mut used) = (0, 0);
    for i in 0..examples.len() {
        let positions = examples.get(i).0.len() - 1;
        if used + positions > block && i > start {
            packs.push(start..i);
            (start, used) = (i, 0);
        }
        used += positions;
    }
    if start < examples.len() {
        packs.push(start..examples.len());
    }
    packs
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
fn eos_beside(tokenizer: &Path) -> Option<String> {
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

impl DatasetOptions for JsonlOptions {
    const PATHS: &'static [&'static str] = &["train_path", "val_path", "tokenizer"];

    fn end_of_example(&self) -> Option<String> {
        self.eos_token.clone()
    }

    fn complete(mut self, cx: &DataContext) -> Result<Self, String> {
        if cx.language.is_none() {
            return Err(format!(
                "data.dataset = \"jsonl\" is token sequences: it needs a language model \
                 (model.arch = \"gpt\" or \"llama\"), not \"{}\"",
                cx.arch
            ));
        }
        if self.train_path.as_deref().is_none_or(str::is_empty) {
            return Err(
                "data.train_path is required for data.dataset = \"jsonl\", e.g. \
                        train_path = \"data/sft/train.jsonl\""
                    .into(),
            );
        }
        if self.pack && !cx.language.as_ref().is_some_and(|l| l.packed_rows) {
            return Err(format!(
                "data.pack = true needs a model that reads packed rows (restarting positions \
                 and attention at each example), and model.arch = \"{}\" does not (its \
                 LanguageModelOptions::reads_packed_rows); use pack = false",
                cx.arch
            ));
        }
        let tokenizer = match self.tokenizer.take() {
            Some(t) => t,
            None => match cx.language.as_ref().and_then(|l| l.tokenizer.clone()) {
                Some(path) if !path.is_file() => {
                    return Err(super::text_options::missing_tokenizer(&path));
                }
                Some(path) => path.display().to_string(),
                None => {
                    return Err("data.dataset = \"jsonl\" is encoded with a Hugging Face \
                                tokenizer: set model.init_from to a model directory that has a \
                                tokenizer.json, or data.tokenizer = \"path/to/tokenizer.json\""
                        .into());
                }
            },
        };
        if !tokenizer.ends_with(".json") {
            return Err(format!(
                "data.tokenizer = \"{tokenizer}\": jsonl data needs the path of a Hugging Face \
                 tokenizer.json"
            ));
        }
        if self.val_path.as_deref() == Some("") {
            return Err(
                "data.val_path is empty: name the validation examples' file, or leave \
                        the key out to keep the last data.val_fraction of train_path's"
                    .into(),
            );
        }
        if self.eos_token.is_none() {
            // Before a job exists (its job.toml has the token): the file must be there.
            named_file("tokenizer", Path::new(&tokenizer), TOKENIZER_FIX)
                .map_err(|e| e.to_string())?;
            self.eos_token = Some(eos_beside(Path::new(&tokenizer)).ok_or_else(|| {
                format!(
                    "cannot tell the end-of-sequence token of `{tokenizer}`: no \
                     tokenizer_config.json `eos_token` or config.json `eos_token_id` beside it; \
                     set data.eos_token (e.g. \"</s>\")"
                )
            })?);
        }
        self.tokenizer = Some(tokenizer);
        if !(self.val_fraction > 0.0 && self.val_fraction < 1.0) {
            return Err(format!(
                "data.val_fraction = {}: must be in (0, 1); 0.1 keeps the last 10% of the \
                 examples for validation",
                self.val_fraction
            ));
        }
        for (key, value) in [
            ("text_field", &self.text_field),
            ("prompt_field", &self.prompt_field),
            ("completion_field", &self.completion_field),
        ] {
            if value.is_empty() {
                return Err(format!("data.{key} is empty: name a field of the lines"));
            }
        }
        Ok(self)
    }

    /// Reads and tokenises both files once (bad lines create no job); the job keeps the
    /// examples and the tokenizer.
    fn prepare(&self, cx: &DataContext) -> Result<Vec<JobFile>, BuildError> {
        named_file("tokenizer", &self.tokenizer_path(), TOKENIZER_FIX)?;
        let task = self.open(cx)?;
        // The stored form counts in u32.
        for (split, examples) in [("training", &task.train), ("validation", &task.val)] {
            if examples.tokens().len() > u32::MAX as usize {
                return Err(format!(
                    "the {split} examples hold {} tokens, more than the {} a job keeps; split \
                     the data over several jobs",
                    examples.tokens().len(),
                    u32::MAX
                )
                .into());
            }
        }
        let tokenizer = HfTokenizer::load(&self.tokenizer_path())?;
        Ok(vec![
            JobFile {
                name: STORED[0].into(),
                bytes: task.train.to_bytes(task.eos),
            },
            JobFile {
                name: STORED[1].into(),
                bytes: task.val.to_bytes(task.eos),
            },
            JobFile {
                name: Vocab::FILE.into(),
                bytes: Vocab::HuggingFace(Box::new(tokenizer))
                    .to_json()
                    .into_bytes(),
            },
        ])
    }

    /// A file not there yet is not an error for `validate` (it is for `run`).
    fn train_samples(&self) -> Option<(usize, String)> {
        let path = PathBuf::from(self.train_path.clone().unwrap_or_default());
        (!path.is_file()).then(|| {
            let why = "not found: put the examples there before `run`";
            (0, format!("`{}` {why}", path.display()))
        })
    }

    fn describe(&self) -> Option<String> {
        Some(format!(
            "jsonl {}",
            self.train_path.as_deref().unwrap_or_default()
        ))
    }

    fn tokenizer_file(&self) -> Option<PathBuf> {
        Some(self.tokenizer_path())
    }
}

const TOKENIZER_FIX: &str =
    "name the Hugging Face tokenizer.json the examples are to be encoded with";

/// Instruction examples of both splits, ready to batch.
pub struct JsonlTask {
    train: Examples,
    val: Examples,
    /// With `data.pack`: the examples of each training and validation row.
    packs: Option<[Vec<Range<usize>>; 2]>,
    /// Appended to every example; also the padding's input (its target is ignored).
    eos: u32,
    block: usize,
    vocab_size: usize,
    train_on_prompt: bool,
}

impl JsonlTask {
    /// The examples of each row of `indices` (samples of `split`, 0 training, 1 validation):
    /// one each, or a packed row's.
    fn rows(&self, split: usize, indices: &[usize]) -> Vec<Range<usize>> {
        match &self.packs {
            Some(packs) => indices.iter().map(|&i| packs[split][i].clone()).collect(),
            None => indices.iter().map(|&i| i..i + 1).collect(),
        }
    }

    /// Inputs and targets [n, t] of rows of `examples`, t the longest row's positions: each
    /// example's tokens but its last as inputs, all but its first as targets (ignored on its
    /// prompt unless `train_on_prompt`), the row padded on the right with `eos`, whose targets
    /// are ignored. Packed rows' inputs are [n, t, 2]: each token and its position within its
    /// example (the padding counted as one more), see `models::packed`.
    fn batch(
        &self,
        examples: &Examples,
        rows: &[Range<usize>],
        device: &Device,
    ) -> Result<(Tensor, Tensor), DataError> {
        let positions =
            |r: &Range<usize>| -> usize { r.clone().map(|i| examples.get(i).0.len() - 1).sum() };
        let longest = rows.iter().map(positions).max().unwrap_or(1);
        let n = rows.len();
        let mut xs = vec![self.eos; n * longest];
        let mut at = vec![0u32; n * longest];
        let mut ys = vec![IGNORE_TARGET; n * longest];
        let count_from_zero = |a: &mut [u32]| {
            a.iter_mut().enumerate().for_each(|(p, a)| *a = p as u32);
        };
        for (row, examples_of_row) in rows.iter().enumerate() {
            let mut start = row * longest;
            for i in examples_of_row.clone() {
                let (tokens, prompt) = examples.get(i);
                let len = tokens.len() - 1;
                xs[start..start + len].copy_from_slice(&tokens[..len]);
                count_from_zero(&mut at[start..start + len]);
                // Target j is token j + 1: a prompt token when j + 1 < prompt.
                let first = if self.train_on_prompt {
                    0
                } else {
                    prompt.max(1) - 1
                };
                ys[start + first..start + len].copy_from_slice(&tokens[first + 1..]);
                start += len;
            }
            count_from_zero(&mut at[start..(row + 1) * longest]);
        }
        let ys = Tensor::from_vec(ys, (n, longest), device)?;
        if self.packs.is_none() {
            return Ok((Tensor::from_vec(xs, (n, longest), device)?, ys));
        }
        let pairs: Vec<u32> = xs.iter().zip(&at).flat_map(|(&x, &p)| [x, p]).collect();
        Ok((Tensor::from_vec(pairs, (n, longest, 2), device)?, ys))
    }

    /// Training (0) or validation (1) samples: examples, or packed rows.
    fn samples(&self, split: usize) -> usize {
        match &self.packs {
            Some(packs) => packs[split].len(),
            None if split == 0 => self.train.len(),
            None => self.val.len(),
        }
    }
}

impl Task for JsonlTask {
    fn train_len(&self) -> usize {
        self.samples(0)
    }

    fn eval_len(&self) -> usize {
        self.samples(1)
    }

    /// The mean sample's positions (an example's tokens but one, or a packed row's), padding
    /// not counted.
    fn targets_per_sample(&self) -> usize {
        let positions = self.train.tokens().len() - self.train.len();
        (positions / self.train_len().max(1)).max(1)
    }

    fn input(&self) -> ModelInput {
        ModelInput::Tokens {
            vocab_size: self.vocab_size,
            block_size: self.block,
        }
    }

    fn masks_targets(&self) -> bool {
        true
    }

    fn batches<'a>(&'a self, device: &Device) -> Result<Box<dyn BatchSource + 'a>, DataError> {
        Ok(Box::new(JsonlBatches {
            task: self,
            device: device.clone(),
        }))
    }
}

struct JsonlBatches<'a> {
    task: &'a JsonlTask,
    device: Device,
}

impl BatchSource for JsonlBatches<'_> {
    fn train(&self, _epoch: usize, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.task;
        t.batch(&t.train, &t.rows(0, indices), &self.device)
    }

    fn eval(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.task;
        t.batch(&t.val, &t.rows(1, indices), &self.device)
    }

    fn note(&self) -> Option<String> {
        let t = self.task;
        let c = t.train.counts;
        let mut parts = vec![format!(
            "jsonl: {} training and {} validation examples, loss on {}",
            t.train.len(),
            t.val.len(),
            match (t.train_on_prompt, t.train.has_prompts()) {
                (true, _) => "prompts and completions",
                // {"text": ...} examples only: nothing is a prompt.
                (false, false) => "every token (text examples)",
                (false, true) => "completions only",
            }
        )];
        if let Some(packs) = &t.packs {
            parts.push(format!(
                "packed into {} training and {} validation rows",
                packs[0].len(),
                packs[1].len()
            ));
        }
        for (n, what) in [
            (c.truncated, "truncated to model.block_size + 1 tokens"),
            (c.bad_lines, "bad lines skipped"),
            (
                c.empty,
                "examples with nothing to predict left out (empty, or a prompt that fills \
                 model.block_size)",
            ),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        Some(parts.join(", "))
    }
}

#[cfg(test)]
#[path = "jsonl_tests.rs"]
mod tests;
