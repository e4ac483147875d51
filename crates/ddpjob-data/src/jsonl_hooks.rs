//! How ddpjob uses `data.dataset = "jsonl"`'s options ([`DatasetOptions`]): checked once
//! against the model into complete options (the model's tokenizer, end-of-sequence token and
//! the default `text_rows` written out, a Hub dataset resolved), and the data tokenised once in
//! the launcher into the files the job keeps. What the options read and how is `jsonl`'s.

use std::path::{Path, PathBuf};

use super::DataError;
use super::corpus::{self, TextRows};
use super::hf_tokenizer::HfTokenizer;
use super::hub_source;
use super::jsonl::{Format, JsonlOptions, STORED, TOKENIZER_FIX, eos_beside};
use super::kept::Staged;
use super::text_options::named_file;
use super::vocab::Vocab;
use ddpjob_seam::{BuildError, DatasetOptions, JobFile};
use ddpjob_spec::DataContext;

impl DatasetOptions for JsonlOptions {
    const PATHS: &'static [&'static str] =
        &["train_path", "val_path", "tokenizer", "chat_template"];

    fn end_of_example(&self) -> Option<String> {
        self.eos_token.clone()
    }

    fn complete(mut self, cx: &DataContext) -> Result<Self, String> {
        if cx.language.is_none() {
            return Err(format!(
                "data.dataset = \"{}\" is token sequences: it needs a language model \
                 (model.arch = \"gpt\" or \"llama\"), not \"{}\"",
                self.format.name(),
                cx.arch
            ));
        }
        hub_source::resolve(&mut self, cx)?;
        if self.train_path.as_deref().is_none_or(str::is_empty) {
            return Err(format!(
                "data.train_path is required for data.dataset = \"{}\", e.g. train_path \
                     = \"data/sft/train.{}\"{}",
                self.format.name(),
                self.format.name(),
                match self.format {
                    Format::Parquet => ", or a Hub dataset: hub = \"org/name\"",
                    Format::Jsonl | Format::Arrow => "",
                }
            ));
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
                    return Err("instruction data is encoded with a Hugging Face \
                                tokenizer: set model.init_from to a model directory that has a \
                                tokenizer.json, or data.tokenizer = \"path/to/tokenizer.json\""
                        .into());
                }
            },
        };
        if !tokenizer.ends_with(".json") {
            return Err(format!(
                "data.tokenizer = \"{tokenizer}\": instruction data needs the path of a Hugging Face \
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
        if let Some(path) = &self.chat_template {
            named_file(
                "chat_template",
                Path::new(path),
                "name the Jinja file conversations are rendered with, or leave the key out to \
                 use the model's own template",
            )
            .map_err(|e| e.to_string())?;
        }
        for (key, value) in [
            ("text_field", &self.text_field),
            ("prompt_field", &self.prompt_field),
            ("completion_field", &self.completion_field),
            ("messages_field", &self.messages_field),
        ] {
            if value.is_empty() {
                return Err(format!("data.{key} is empty: name a field of the lines"));
            }
        }
        if cx.pairs {
            if self.pack {
                return Err(
                    "data.pack = true packs examples into rows, but train.objective = \
                            \"dpo\" scores each pair's two completions side by side, one a \
                            row: drop pack"
                        .into(),
                );
            }
            if self.train_on_prompt {
                return Err("data.train_on_prompt = true scores the prompts, but \
                            train.objective = \"dpo\" compares the two completions of a pair \
                            alone (TRL's DPOTrainer): drop train_on_prompt"
                    .into());
            }
            if self.text_rows == Some(TextRows::Windows) {
                return Err(
                    "data.text_rows = \"windows\" lays the rows end to end, but \
                            train.objective = \"dpo\" reads each row as a pair: drop text_rows"
                        .into(),
                );
            }
            self.text_rows = Some(TextRows::Examples);
        }
        for (key, value) in [
            ("chosen_field", &self.chosen_field),
            ("rejected_field", &self.rejected_field),
        ] {
            if value.is_empty() {
                return Err(format!("data.{key} is empty: name a field of the lines"));
            }
        }
        if self.text_rows.is_none() {
            // Written into job.toml, so the job keeps reading its rows one way; files not
            // there yet (`validate`) are decided when the job is made. A job stored before the
            // key existed read every row as an example, and keeps doing so.
            self.text_rows = match cx.stored_job {
                true => Some(TextRows::Examples),
                false => corpus::default_rows(&self).ok(),
            };
        }
        if self.text_rows == Some(TextRows::Windows) && self.pack {
            return Err(format!(
                "data.pack = true packs examples into rows, but data.text_rows = \"windows\"{} \
                 lays the rows end to end already: drop pack, or set text_rows = \"examples\" \
                 for one example a row",
                match self.format {
                    Format::Parquet | Format::Arrow => " (the default for a text column alone)",
                    Format::Jsonl => "",
                }
            ));
        }
        Ok(self)
    }

    /// Reads and tokenises both files once (bad lines create no job); the job keeps the
    /// examples and the tokenizer.
    fn prepare(&self, cx: &DataContext) -> Result<Vec<JobFile>, BuildError> {
        named_file("tokenizer", &self.tokenizer_path(), TOKENIZER_FIX)?;
        let tokenizer = HfTokenizer::load(&self.tokenizer_path())?;
        let vocab = JobFile::bytes(
            Vocab::FILE,
            Vocab::HuggingFace(Box::new(tokenizer))
                .to_json()
                .into_bytes(),
        );
        if self.rows()? == TextRows::Windows {
            let mut files = corpus::job_files(self, cx, self.vocab_size(cx)?)?;
            files.push(vocab);
            return Ok(files);
        }
        if let Some(job) = cx.job.as_deref()
            && self.stored_in(job, STORED[0])
        {
            // A resumed job keeps what it has; its examples are checked as they are mapped.
            self.open_examples(cx)?;
            return Ok(vec![vocab]);
        }
        self.stream_examples(cx, vocab).map_err(Into::into)
    }

    /// A file not there yet is not an error for `validate` (it is for `run`).
    fn train_samples(&self) -> Option<(usize, String)> {
        let path = self.train_path.clone().unwrap_or_default();
        let found = match self.format {
            Format::Jsonl => Path::new(&path).is_file(),
            Format::Parquet | Format::Arrow => self.format.sources(&path, "train_path").is_ok(),
        };
        (!found).then(|| {
            let why = "not found: put the examples there before `run`";
            (0, format!("`{path}` {why}"))
        })
    }

    fn describe(&self) -> Option<String> {
        let source = match &self.hub {
            Some(id) => format!(
                "{id} (Hub; config {}, split {}{}, commit {})",
                self.config.as_deref().unwrap_or("default"),
                self.split.as_deref().unwrap_or("train"),
                self.val_split
                    .as_deref()
                    .map_or(String::new(), |v| format!(", validation {v}")),
                self.revision.as_deref().unwrap_or("main")
            ),
            None => self.train_path.clone().unwrap_or_default(),
        };
        Some(format!("{} {source}", self.format.name()))
    }

    fn tokenizer_file(&self) -> Option<PathBuf> {
        Some(self.tokenizer_path())
    }
}

impl JsonlOptions {
    /// The job's examples, their tokens written to staged files as they are made (only the
    /// examples' lengths and trained spans stay in memory, so a set larger than memory is
    /// never held), checked as `examples` checks them, then each split's stored form written
    /// around its tokens.
    fn stream_examples(&self, cx: &DataContext, vocab: JobFile) -> Result<Vec<JobFile>, DataError> {
        let vocab_size = self.vocab_size(cx)?;
        let names = ["jsonl-train.tokens", "jsonl-val.tokens"];
        let ([mut train_tokens, mut val_tokens], (mut train, val, eos)) =
            self.read_to_files(cx, TextRows::Examples, names, vocab_size)?;
        let val = self.validation(&mut train, val, cx, |train, n| {
            let (val, cut) = train.split_off_last_layout(n);
            train_tokens.split_off_into(cut as u64 * 4, &mut val_tokens)?;
            Ok(val)
        })?;
        let mut kept = Vec::new();
        for (split, name, examples, tokens) in [
            ("training", STORED[0], &train, &mut train_tokens),
            ("validation", STORED[1], &val, &mut val_tokens),
        ] {
            // The stored form counts in u32.
            if examples.token_count() > u32::MAX as usize {
                return Err(DataError::Mismatch(format!(
                    "the {split} examples hold {} tokens, more than the {} a job keeps; split \
                     the data over several jobs",
                    examples.token_count(),
                    u32::MAX
                )));
            }
            tokens.flush()?;
            let mut file = Staged::create(cx, name)?;
            let from = tokens.path().to_path_buf();
            file.write_with(|out| {
                examples.write_layout(out, eos)?;
                std::io::copy(&mut std::fs::File::open(&from)?, out).map(drop)
            })?;
            kept.push(file.keep()?);
        }
        kept.push(vocab);
        Ok(kept)
    }
}
