//! Rows of text as one corpus, `data.text_rows = "windows"`: the rows of jsonl or parquet data
//! tokenised as `jsonl` tokenises them, each whole and ended by the end-of-sequence token (as
//! nanoGPT's `prepare.py` ends each document with `<|endoftext|>`), laid end to end and cut
//! into windows exactly as `data.dataset = "text"` cuts a file (see `text`). It is what a Hub
//! dataset of documents (`{"text"}` rows: wikitext, fineweb) is for: language modelling, every
//! position a target, no padding. Parquet with a text column and none of the example columns
//! defaults to it; anything else to one example a row.
//!
//! The job keeps both splits' tokens (`rows-train.tokens`, `rows-val.tokens`: little-endian
//! u32, as `data.dataset = "tokens"` reads them) and its workers, `resume` and `eval` map them,
//! never reading the rows again. How rows are read is `jsonl_index`'s, how windows are batched
//! `text`'s; this module only joins the two.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::DataError;
use super::jsonl::{Format, JsonlOptions};
use super::kept::Staged;
use super::text::{TextTask, Tokens};
use ddpjob_seam::JobFile;
use ddpjob_seam::task::Task;
use ddpjob_spec::{DataContext, KeyDoc, TokenDtype};

/// How the rows become samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextRows {
    /// One example a row: masks, padding or packing, truncation.
    Examples,
    /// The rows as one corpus, cut into windows.
    Windows,
}

pub const TEXT_ROWS_KEY: KeyDoc = KeyDoc {
    key: "text_rows",
    default: "`\"windows\"` for parquet with a `text_field` column and none of the \
              example columns, else `\"examples\"`",
    doc: "`\"windows\"`: the rows tokenised whole, each ended by `eos_token`, laid end to end \
          and cut into windows of `model.block_size` as `data.dataset = \"text\"` cuts a file \
          (without `val_path`, the last `val_fraction` of the tokens validates); \
          `\"examples\"`: one example a row (`pack`, `truncate`, the prompt's mask)",
};

/// The stored tokens' names in the job directory.
pub const STORED: [&str; 2] = ["rows-train.tokens", "rows-val.tokens"];

/// What `options` that leave `text_rows` out read their rows as: windows for parquet (or
/// Arrow) whose first training file has the text column and none of the example columns.
pub fn default_rows(options: &JsonlOptions) -> Result<TextRows, DataError> {
    if options.format == Format::Jsonl {
        return Ok(TextRows::Examples);
    }
    let path = options.train_path.as_deref().unwrap_or_default();
    let Some(first) = options
        .format
        .sources(path, "train_path")?
        .into_iter()
        .next()
    else {
        return Ok(TextRows::Examples);
    };
    let Some(columns) = options.format.columns(&first)? else {
        return Ok(TextRows::Examples);
    };
    let has = |name: &String| columns.contains(name);
    let examples = [
        &options.messages_field,
        &options.prompt_field,
        &options.completion_field,
    ];
    Ok(
        match has(&options.text_field) && !examples.into_iter().any(has) {
            true => TextRows::Windows,
            false => TextRows::Examples,
        },
    )
}

/// The windows task over the job's stored tokens, or over the files' rows when the job has
/// none of its own (`eval --data`, `preview`): staged in a temporary file and mapped, never
/// held whole.
pub fn open(
    options: &JsonlOptions,
    cx: &DataContext,
    vocab_size: usize,
) -> Result<TextTask, DataError> {
    if let Some(job) = cx
        .job
        .as_deref()
        .filter(|job| options.stored_in(job, STORED[0]))
    {
        let names = STORED.map(|name| job.join(name));
        let [train, val] = [&names[0], &names[1]].map(|p| Tokens::map(p, TokenDtype::U32));
        return TextTask::from_splits(train?, val?, vocab_size, names, cx);
    }
    // The files are removed when `staged` drops; the maps keep their pages.
    let mut staged = stage(options, cx, vocab_size)?;
    task_of(options, cx, vocab_size, &mut staged)
}

/// The files the job keeps: both splits' tokens, read from the rows and checked (every token in
/// the vocabulary, a window in each split); none when the job has them already (a resumed job
/// never reads its rows again).
pub fn job_files(
    options: &JsonlOptions,
    cx: &DataContext,
    vocab_size: usize,
) -> Result<Vec<JobFile>, DataError> {
    if let Some(job) = cx.job.as_deref()
        && options.stored_in(job, STORED[0])
    {
        return Ok(Vec::new());
    }
    let mut staged = stage(options, cx, vocab_size)?;
    let task = task_of(options, cx, vocab_size, &mut staged)?;
    eprintln!(
        "data: the rows of {} as {} training and {} validation windows of {} tokens",
        options.train_path.as_deref().unwrap_or_default(),
        task.train_len(),
        task.eval_len(),
        cx.language.as_ref().map_or(0, |l| l.block_size),
    );
    drop(task);
    let [train, val] = staged;
    Ok(vec![train.keep()?, val.keep()?])
}

/// The task over `staged` tokens, mapped.
fn task_of(
    options: &JsonlOptions,
    cx: &DataContext,
    vocab_size: usize,
    staged: &mut [Staged; 2],
) -> Result<TextTask, DataError> {
    let mut maps = Vec::new();
    for file in staged.iter_mut() {
        file.flush()?;
        maps.push(Tokens::map(file.path(), TokenDtype::U32)?);
    }
    let val = maps.pop().expect("two splits");
    let train = maps.pop().expect("two splits");
    TextTask::from_splits(train, val, vocab_size, names(options), cx)
}

/// Both splits' tokens, written as they are made: the training rows', and `val_path`'s or
/// the training tokens' last `val_fraction` (cut where `data.dataset = "text"` cuts).
fn stage(
    options: &JsonlOptions,
    cx: &DataContext,
    vocab_size: usize,
) -> Result<[Staged; 2], DataError> {
    let ([mut train, mut val], _) =
        options.read_to_files(cx, TextRows::Windows, STORED, vocab_size)?;
    if options.val_path.is_none() {
        let tokens = train.len / 4;
        let split = ((tokens as f64) * (1.0 - options.val_fraction)) as u64;
        train.split_off_into(split * 4, &mut val)?;
    }
    Ok([train, val])
}

/// The splits' names in errors.
fn names(options: &JsonlOptions) -> [PathBuf; 2] {
    let train = PathBuf::from(options.train_path.clone().unwrap_or_default());
    let val = options
        .val_path
        .as_deref()
        .map_or(train.clone(), PathBuf::from);
    [train, val]
}
