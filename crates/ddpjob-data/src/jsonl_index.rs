//! Reading instruction data: a JSONL file streamed once, line by line (never held whole), each
//! line made an example: `{"text"}` trained whole, `{"prompt", "completion"}` tokenised apart
//! so the boundary between them is exact, a conversation (`{"messages"}`, or a conversational
//! prompt/completion) through the model's chat template (see `conversation`), each kept as
//! token ids with the ranges its loss is on (see `examples`). The result is stored in the job
//! directory: every worker, `resume` and `eval` read the examples exactly as the job first
//! made them, without the tokenizer, whatever happened to the file since.

use std::io::{BufRead, BufReader};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::DataError;
use super::chat::ChatTemplate;
use super::conversation;
pub use super::examples::{Counts, Examples};
use super::hf_tokenizer::HfTokenizer;
use super::pairs::{Pair, PairFields};
use super::record_batches::Records;

/// How lines become examples.
pub struct Indexing<'a> {
    pub tokenizer: &'a HfTokenizer,
    /// Appended to every text and prompt/completion example (the model learns where a
    /// completion ends); a conversation's end is what its template writes.
    pub eos: u32,
    pub text_field: &'a str,
    pub prompt_field: &'a str,
    pub completion_field: &'a str,
    pub messages_field: &'a str,
    /// The model's chat template (or `data.chat_template`), for conversations; `Err`: why
    /// there is none, for the error a conversation gets.
    pub chat: Result<&'a ChatTemplate, &'a str>,
    /// The most tokens an example may have: `block_size + 1` (its inputs and targets).
    pub max_tokens: usize,
    /// Cut longer examples to `max_tokens` (counted) instead of refusing them.
    pub truncate: bool,
    /// Count and skip lines that are not JSON or lack the fields, instead of refusing them.
    pub skip_bad_lines: bool,
    /// The loss is on prompts too (else an example whose completion truncation cut away has
    /// nothing to predict).
    pub train_on_prompt: bool,
    /// Where the tokens go as they are made, a chunk of records at a time, instead of
    /// staying in the examples (a corpus larger than memory, see `corpus`); the examples'
    /// counts are kept either way.
    pub sink: Option<&'a Sink<'a>>,
    /// With a sink: keep the examples' layout (lengths, trained spans) as their tokens go, for
    /// a stored file of examples; without, a corpus keeps nothing but the counts.
    pub keep_layout: bool,
    /// Each record a preference pair (`train.objective = "dpo"`): two examples, side by side
    /// (see `pairs`).
    pub pairs: Option<PairFields<'a>>,
}

impl Indexing<'_> {
    /// The columns a parquet or Arrow row is read from: the fields a record may have.
    fn columns(&self) -> Vec<&str> {
        let mut wanted = vec![
            self.messages_field,
            self.text_field,
            self.prompt_field,
            self.completion_field,
        ];
        if let Some(pair) = self.pairs {
            wanted.extend([pair.chosen, pair.rejected]);
        }
        wanted
    }
}

/// Takes the tokens of the records made so far, in order.
pub type Sink<'a> = dyn Fn(Vec<u32>) -> Result<(), DataError> + Sync + 'a;

/// Streams `path` once, one example a line (blank lines skipped; see [`example`]), made on
/// every core a chunk at a time (see `record_batches`).
pub fn index_file(path: &Path, how: &Indexing) -> Result<Examples, DataError> {
    let io = |cause| DataError::Io {
        path: path.into(),
        cause,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_or(0, |m| m.len());
    let mut reader = BufReader::new(file);
    let mut records = Records::new(how, "line", size, true);
    records.file(path)?;
    let (mut bytes, mut number) = (Vec::new(), 0);
    loop {
        bytes.clear();
        let read = reader.read_until(b'\n', &mut bytes).map_err(io)?;
        if read == 0 {
            break;
        }
        number += 1;
        // A byte-order mark (Windows editors write one) is not part of the first line.
        let text = match bytes.strip_prefix(b"\xEF\xBB\xBF") {
            Some(rest) if number == 1 => rest,
            _ => &bytes[..],
        };
        // Line by line, so bad bytes are a bad line: named, or skipped with skip_bad_lines.
        let record = match std::str::from_utf8(text) {
            Ok(line) if line.trim().is_empty() => continue,
            Ok(line) => serde_json::from_str::<Value>(line)
                .map_err(|e| format!("it is not a JSON object ({e})"))
                .and_then(|value| match value {
                    Value::Object(object) => Ok(object),
                    _ => Err("it is not a JSON object".into()),
                }),
            Err(e) => Err(format!(
                "it is not UTF-8 text (a byte that UTF-8 does not allow at byte {} of the \
                 line); save the file as UTF-8",
                e.valid_up_to() + 1
            )),
        };
        records.push(number, record, read as u64)?;
    }
    records.finish()
}

/// Reads parquet `files` in order, one example a row (columns: as [`example`] reads a line's
/// fields; a null value is a column the row does not have), made as `index_file`'s lines are.
pub fn index_parquet(files: &[PathBuf], how: &Indexing) -> Result<Examples, DataError> {
    let wanted = how.columns();
    let wanted: Vec<&str> = wanted.iter().map(|s| &**s).collect();
    let mut total = 0;
    for file in files {
        total += super::parquet_rows::row_count(file)?;
    }
    let mut records = Records::new(how, "row", total, false);
    for file in files {
        records.file(file)?;
        super::parquet_rows::for_each_row(file, &wanted, |row, mut object| {
            object.retain(|_, v| !v.is_null());
            records.push(row, Ok(object), 1)
        })?;
    }
    records.finish()
}

/// Reads Arrow IPC `files` in order (`datasets`' `save_to_disk`), one example a row, as
/// `index_parquet` reads parquet's.
pub fn index_arrow(files: &[PathBuf], how: &Indexing) -> Result<Examples, DataError> {
    let wanted = how.columns();
    let wanted: Vec<&str> = wanted.iter().map(|s| &**s).collect();
    let total = files.iter().map(|f| super::arrow_rows::size(f)).sum();
    let mut records = Records::new(how, "row", total, true);
    for file in files {
        records.file(file)?;
        super::arrow_rows::for_each_row(file, &wanted, |row, mut object, bytes| {
            object.retain(|_, v| !v.is_null());
            records.push(row, Ok(object), bytes)
        })?;
    }
    records.finish()
}

impl Examples {
    /// Adds a record's pair (`made`, or what is wrong with it) as [`Examples::add`] adds an
    /// example, the two as one: both cut to `max_tokens`, both left out (counted as
    /// `empty`) when either has nothing left to train or the two are the same tokens (a pair
    /// that teaches nothing), so examples 2i and 2i + 1 are always a pair's.
    pub fn add_pair(
        &mut self,
        made: Result<Pair, String>,
        how: &Indexing,
        record: &str,
        bad: impl Fn(&str, &str) -> DataError,
    ) -> Result<(), DataError> {
        let mut one = Examples::default();
        let (truncated, empty) = (self.counts.truncated, self.counts.empty);
        let bad_lines = self.counts.bad_lines;
        let [chosen, rejected] = match made {
            Ok(pair) => pair.map(Ok),
            Err(problem) => [Err(problem.clone()), Err(problem)],
        };
        // The first error (or skip) is the pair's.
        one.add(chosen, how, record, &bad)?;
        if one.counts.bad_lines > 0 {
            self.counts.bad_lines = bad_lines + 1;
            return Ok(());
        }
        one.add(rejected, how, record, &bad)?;
        let cut = one.counts.truncated > 0;
        let same = one.len() == 2 && one.get(0).0 == one.get(1).0;
        self.counts.truncated = truncated + usize::from(cut);
        if one.len() < 2 || same {
            self.counts.empty = empty + 1;
            return Ok(());
        }
        for i in 0..2 {
            let (tokens, spans) = one.get(i);
            let spans: Vec<Range<usize>> =
                spans.iter().map(|&[a, b]| a as usize..b as usize).collect();
            self.push(tokens, &spans);
        }
        Ok(())
    }

    /// Adds what a record made (`made`: its tokens and trained token ranges, or what is wrong
    /// with it) as `how` says: cut to `max_tokens` (or refused), left out when nothing is
    /// left to train, a bad record counted with `skip_bad_lines`. `bad` makes the error that
    /// names the record, a `record` ("line", "row").
    pub fn add(
        &mut self,
        made: Result<(Vec<u32>, Vec<Range<usize>>), String>,
        how: &Indexing,
        record: &str,
        bad: impl Fn(&str, &str) -> DataError,
    ) -> Result<(), DataError> {
        let (mut tokens, spans) = match made {
            Ok(made) => made,
            Err(_) if how.skip_bad_lines => {
                self.counts.bad_lines += 1;
                return Ok(());
            }
            Err(problem) => {
                return Err(bad(
                    &problem,
                    &format!(
                        "; fix the {record}, or set data.skip_bad_lines = true to count and skip \
                         such {record}s"
                    ),
                ));
            }
        };
        if tokens.len() > how.max_tokens {
            if !how.truncate {
                return Err(bad(
                    &format!(
                        "the example has {} tokens, more than model.block_size + 1 = {}; set \
                         data.truncate = true to cut such examples, or raise model.block_size",
                        tokens.len(),
                        how.max_tokens
                    ),
                    "",
                ));
            }
            tokens.truncate(how.max_tokens);
            self.counts.truncated += 1;
        }
        // A target is a token after the first; with the loss on completions only, a trained
        // one. An example without one would score nothing.
        let scores = match how.train_on_prompt {
            true => tokens.len() >= 2,
            false => spans
                .iter()
                .any(|s| s.end.min(tokens.len()) > s.start.max(1)),
        };
        if tokens.len() < 2 || !scores {
            self.counts.empty += 1;
            return Ok(());
        }
        self.push(&tokens, &spans);
        Ok(())
    }
}

/// One record's example: its tokens and the token ranges its loss is on, or what is wrong
/// with it. A conversation (`messages_field`, or a prompt and completion that are lists of
/// messages) goes through the chat template; `{"text"}` is trained whole and a string prompt
/// and completion on the completion, each the tokenizer's encoding (with the special tokens
/// its template adds to the text or prompt, e.g. a Llama's `<s>`) and then `eos`.
pub fn example(
    object: &serde_json::Map<String, Value>,
    how: &Indexing,
) -> Result<(Vec<u32>, Vec<Range<usize>>), String> {
    let chat = || {
        how.chat
            .map_err(|why| format!("it is a conversation, but {why}"))
    };
    if let Some(messages) = object.get(how.messages_field) {
        let messages = conversation::messages_of(messages, how.messages_field)?;
        return conversation::encode(chat()?, how.tokenizer, &messages);
    }
    let completion = object.get(how.completion_field);
    if let Some(Value::Array(_)) = completion {
        let Some(prompt) = object.get(how.prompt_field) else {
            return Err(format!(
                "it has \"{}\" but no \"{}\" (data.prompt_field)",
                how.completion_field, how.prompt_field
            ));
        };
        let prompt = conversation::messages_of(prompt, how.prompt_field)?;
        let completion =
            conversation::messages_of(&object[how.completion_field], how.completion_field)?;
        return conversation::encode_pair(chat()?, how.tokenizer, &prompt, &completion);
    }
    let field = |name: &str| -> Result<Option<&str>, String> {
        match object.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(format!("field \"{name}\" is not a string but {other}")),
        }
    };
    let encode = |text: &str, special: bool| how.tokenizer.encode_one(text, special);
    let (mut tokens, prompt) = match field(how.completion_field)? {
        Some(completion) => {
            let Some(prompt) = field(how.prompt_field)? else {
                return Err(format!(
                    "it has \"{}\" but no \"{}\" (data.prompt_field)",
                    how.completion_field, how.prompt_field
                ));
            };
            let mut tokens = encode(prompt, true)?;
            let prompt = tokens.len();
            tokens.extend(encode(completion, false)?);
            (tokens, prompt)
        }
        None => match field(how.text_field)? {
            Some(text) => (encode(text, true)?, 0),
            None => {
                let keys: Vec<&str> = object.keys().map(String::as_str).collect();
                return Err(format!(
                    "it has neither \"{}\" (data.messages_field), \"{}\" (data.text_field) \
                     nor \"{}\" and \"{}\" (data.prompt_field, data.completion_field); its \
                     fields: {}",
                    how.messages_field,
                    how.text_field,
                    how.prompt_field,
                    how.completion_field,
                    keys.join(", ")
                ));
            }
        },
    };
    tokens.push(how.eos);
    let trained = prompt..tokens.len();
    Ok((tokens, vec![trained]))
}
