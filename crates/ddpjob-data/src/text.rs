//! Language-model data: a token sequence per split, cut into windows of `block_size + 1` tokens
//! (inputs, and the same shifted by one as targets). `text` data is a UTF-8 file tokenised at
//! load time; `tokens` data is pre-tokenised files (flat little-endian u16 or u32, as nanoGPT's
//! and llm.c's `.bin` files) that are memory-mapped, never read whole.
//!
//! How an epoch is laid out: the training split is cut into non-overlapping windows that start
//! every `block_size` tokens from a phase drawn from (seed, epoch) in `0..block_size`; the
//! DistributedSampler shuffles and deals out these windows. An epoch is thus a real pass over
//! the corpus (every token is a target once, but for at most one window's worth at the ends),
//! and different epochs cut the text at different places. Validation windows start at 0, every
//! `block_size` tokens, as `gpt_ref.py` and nanoGPT's full-split evaluation take them.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use memmap2::Mmap;

use super::DataError;
use super::text_options::{TextSpec, TokensSpec};
use super::vocab::{Vocab, read_text};
use ddpjob_seam::task::{BatchSource, ModelInput, Task};
use ddpjob_spec::DataContext;
use ddpjob_spec::TokenDtype;

/// Where a language model's tokens come from.
pub enum TextSource {
    /// `data.dataset = "text"`.
    Text(TextSpec),
    /// `data.dataset = "tokens"`.
    Tokens(TokensSpec),
}

/// One split's tokens: in memory (text data) or mapped from a file (tokens data).
pub enum Tokens {
    Owned(Vec<u32>),
    Mapped {
        map: Mmap,
        dtype: TokenDtype,
        path: PathBuf,
    },
}

impl Tokens {
    /// Maps `path`, checking only its length: tokens are range-checked as windows are read.
    pub fn map(path: &Path, dtype: TokenDtype) -> Result<Tokens, DataError> {
        let file = std::fs::File::open(path).map_err(|cause| DataError::Io {
            path: path.into(),
            cause,
        })?;
        // SAFETY: the file is opened read-only and ddpjob never writes it; like every reader of
        // memory-mapped data, a training run assumes nobody truncates it while it trains.
        let map = unsafe { Mmap::map(&file) }.map_err(|cause| DataError::Io {
            path: path.into(),
            cause,
        })?;
        if map.len() % dtype.bytes() != 0 {
            return Err(DataError::Corrupt {
                path: path.into(),
                problem: format!(
                    "its length, {} bytes, is not a multiple of {} (data.token_dtype = \"{}\"); \
                     is it a token file, and of that dtype?",
                    map.len(),
                    dtype.bytes(),
                    if dtype == TokenDtype::U16 {
                        "u16"
                    } else {
                        "u32"
                    }
                ),
            });
        }
        let path = path.to_path_buf();
        Ok(Tokens::Mapped { map, dtype, path })
    }

    /// Whether it holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> usize {
        match self {
            Tokens::Owned(v) => v.len(),
            Tokens::Mapped { map, dtype, .. } => map.len() / dtype.bytes(),
        }
    }

    /// Appends tokens `start..start + len` to `out`, each checked against `vocab`.
    fn read(
        &self,
        start: usize,
        len: usize,
        vocab: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), DataError> {
        let from = out.len();
        match self {
            Tokens::Owned(v) => out.extend_from_slice(&v[start..start + len]),
            Tokens::Mapped { map, dtype, .. } => {
                let b = dtype.bytes();
                let bytes = &map[start * b..(start + len) * b];
                match dtype {
                    TokenDtype::U16 => out.extend(
                        bytes
                            .chunks_exact(2)
                            .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
                    ),
                    TokenDtype::U32 => out.extend(
                        bytes
                            .chunks_exact(4)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    ),
                }
            }
        }
        if let Some(bad) = out[from..].iter().position(|&t| t as usize >= vocab) {
            let index = start + bad;
            let (path, bytes) = match self {
                Tokens::Mapped { path, dtype, .. } => (path.clone(), dtype.bytes()),
                Tokens::Owned(_) => (PathBuf::from("(text)"), 4),
            };
            return Err(DataError::Corrupt {
                path,
                problem: format!(
                    "token {} at byte offset {} (token {index}) is outside the vocabulary of \
                     model.vocab_size = {vocab}; set model.vocab_size to the tokenizer's size \
                     (a pretrained model's is its checkpoint's: make the ids with its tokenizer)",
                    out[from + bad],
                    index * bytes
                ),
            });
        }
        Ok(())
    }
}

/// Training windows of a split of `n` tokens: every `block` tokens from a phase, each needing
/// `block + 1` tokens; one window if only one fits.
fn train_windows(n: usize, block: usize) -> usize {
    if n < block + 1 {
        0
    } else {
        ((n - block) / block).max(1)
    }
}

/// A language-modelling task over two token splits.
pub struct TextTask {
    train: Tokens,
    val: Tokens,
    block: usize,
    vocab_size: usize,
    seed: u64,
    /// Text data's vocabulary (None for pre-tokenised data).
    pub vocab: Option<Vocab>,
}

impl TextTask {
    /// Loads the splits of `source` for the language model of `cx`; the vocabulary stored in
    /// `cx.job` is used when there is one.
    pub fn open(source: &TextSource, cx: &DataContext) -> Result<TextTask, DataError> {
        let Some(lm) = &cx.language else {
            return Err(DataError::Mismatch(format!(
                "text and tokens data need a language model (model.arch = \"gpt\" or \"llama\"), \
                 not \"{}\"",
                cx.arch
            )));
        };
        let (train, val, vocab, vocab_size, names) = match source {
            TextSource::Text(t) => {
                // The job's own vocabulary once it has one, else the one the model's weights
                // were trained with (`init_from` another job).
                let stored = cx
                    .job
                    .as_deref()
                    .map(Vocab::path_in)
                    .filter(|p| p.is_file())
                    .or_else(|| lm.vocabulary.clone());
                let (ids, vocab) = encode_file(t, stored.as_deref())?;
                let size = vocab.size();
                if let Some(v) = lm.vocab_size.filter(|&v| v < size) {
                    // A pretrained model's size is its checkpoint's: no key can change it.
                    let fix = match (&lm.tokenizer, &t.tokenizer) {
                        (Some(own), ddpjob_spec::TokenizerKind::HuggingFace(used))
                            if own == used =>
                        {
                            format!(
                                "the model directory's `{}` does not belong to its weights (their \
                                 vocabulary, config.json's vocab_size: {v}); put the tokenizer \
                                 the model was trained with there",
                                own.display()
                            )
                        }
                        (Some(own), ddpjob_spec::TokenizerKind::HuggingFace(used)) => format!(
                            "the tokenizer `{}` does not belong to this model (its checkpoint's \
                             vocabulary: {v}; its own tokenizer: `{}`); encode with the \
                             tokenizer the model was trained with",
                            used.display(),
                            own.display()
                        ),
                        _ => format!("leave it out for text data, or make it at least {size}"),
                    };
                    return Err(DataError::Mismatch(format!(
                        "model.vocab_size = {v} is smaller than the vocabulary of `{}` ({size} \
                         symbols); {fix}",
                        t.path.display()
                    )));
                }
                let split = ((ids.len() as f64) * (1.0 - t.val_fraction)) as usize;
                let val = ids[split..].to_vec();
                let mut train = ids;
                train.truncate(split);
                let size = lm.vocab_size.unwrap_or(size);
                let names = [t.path.clone(), t.path.clone()];
                (
                    Tokens::Owned(train),
                    Tokens::Owned(val),
                    Some(vocab),
                    size,
                    names,
                )
            }
            TextSource::Tokens(t) => {
                let size = lm.vocab_size.unwrap_or(0);
                let train = Tokens::map(&t.train_path, t.dtype)?;
                let val = Tokens::map(&t.val_path, t.dtype)?;
                let names = [t.train_path.clone(), t.val_path.clone()];
                (train, val, None, size, names)
            }
        };
        let task = TextTask {
            train,
            val,
            block: lm.block_size,
            vocab_size,
            seed: cx.seed,
            vocab,
        };
        task.check_lengths(&names)?;
        if let TextSource::Tokens(_) = source {
            // The validation split is read by every evaluation (all of it unless
            // train.eval_batches): a token outside the vocabulary there is found now, not at
            // the first evaluation after hours of training. Its first 256 M tokens at most (a
            // validation split is seldom more); the training split, possibly many GB, is
            // checked as it is read.
            let mut buf = Vec::new();
            let chunk = 1 << 20;
            let checked = task.val.len().min(1 << 28);
            for start in (0..checked).step_by(chunk) {
                buf.clear();
                let len = chunk.min(checked - start);
                task.val.read(start, len, task.vocab_size, &mut buf)?;
            }
        }
        Ok(task)
    }

    /// A task over splits tokenised elsewhere (the text rows of jsonl or parquet, see
    /// `corpus`), named `names` in errors; `vocab_size` bounds every token read.
    pub fn from_splits(
        train: Tokens,
        val: Tokens,
        vocab_size: usize,
        names: [PathBuf; 2],
        cx: &DataContext,
    ) -> Result<TextTask, DataError> {
        let block = cx.language.as_ref().map_or(0, |l| l.block_size);
        let task = TextTask {
            train,
            val,
            block,
            vocab_size,
            seed: cx.seed,
            vocab: None,
        };
        task.check_lengths(&names)?;
        Ok(task)
    }

    fn check_lengths(&self, names: &[PathBuf; 2]) -> Result<(), DataError> {
        let need = self.block + 1;
        for (split, tokens, path) in [
            ("training", &self.train, &names[0]),
            ("validation", &self.val, &names[1]),
        ] {
            if tokens.len() < need {
                // Not damage: the text and model.block_size disagree (exit 2).
                return Err(DataError::Mismatch(format!(
                    "`{}`: its {split} split has {} tokens, fewer than one window of \
                     model.block_size + 1 = {need}; use more text or a smaller block_size",
                    path.display(),
                    tokens.len()
                )));
            }
        }
        Ok(())
    }

    /// Where epoch `epoch`'s training windows start (see the module doc).
    fn phase(&self, epoch: usize) -> usize {
        let n = self.train.len();
        let windows = train_windows(n, self.block);
        let slack = n - 1 - windows * self.block;
        let phases = slack.min(self.block - 1) + 1;
        (ddpjob_seam::task::sample_seed(self.seed ^ 0x0070_6861_7365, epoch, usize::MAX)
            % phases as u64) as usize
    }

    /// Inputs and targets [n, block] (u32) for windows starting at `starts` of `tokens`.
    fn windows(
        &self,
        tokens: &Tokens,
        starts: impl Iterator<Item = usize>,
        device: &Device,
    ) -> Result<(Tensor, Tensor), DataError> {
        let b = self.block;
        let (mut xs, mut ys, mut buf) = (Vec::new(), Vec::new(), Vec::with_capacity(b + 1));
        let mut n = 0;
        for start in starts {
            buf.clear();
            tokens.read(start, b + 1, self.vocab_size, &mut buf)?;
            xs.extend_from_slice(&buf[..b]);
            ys.extend_from_slice(&buf[1..]);
            n += 1;
        }
        Ok((
            Tensor::from_vec(xs, (n, b), device)?,
            Tensor::from_vec(ys, (n, b), device)?,
        ))
    }
}

impl Task for TextTask {
    fn train_len(&self) -> usize {
        train_windows(self.train.len(), self.block)
    }

    fn eval_len(&self) -> usize {
        (self.val.len() - 1) / self.block
    }

    fn targets_per_sample(&self) -> usize {
        self.block
    }

    fn input(&self) -> ModelInput {
        ModelInput::Tokens {
            vocab_size: self.vocab_size,
            block_size: self.block,
        }
    }

    fn batches<'a>(&'a self, device: &Device) -> Result<Box<dyn BatchSource + 'a>, DataError> {
        Ok(Box::new(TextBatches {
            task: self,
            device: device.clone(),
        }))
    }
}

struct TextBatches<'a> {
    task: &'a TextTask,
    device: Device,
}

impl BatchSource for TextBatches<'_> {
    fn train(&self, epoch: usize, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let (t, phase) = (self.task, self.task.phase(epoch));
        let starts = indices.iter().map(|&i| phase + i * t.block);
        t.windows(&t.train, starts, &self.device)
    }

    fn eval(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.task;
        let starts = indices.iter().map(|&i| i * t.block);
        t.windows(&t.val, starts, &self.device)
    }
}

/// Reads and encodes a text file with the stored vocabulary (resume, sample) or a new one.
fn encode_file(t: &TextSpec, stored: Option<&Path>) -> Result<(Vec<u32>, Vocab), DataError> {
    let vocab = match stored {
        Some(path) => {
            let vocab = Vocab::load(path)?;
            if !vocab.is_kind(&t.tokenizer) {
                return Err(DataError::Mismatch(format!(
                    "the job's vocabulary (`{}`) is {}, but data.tokenizer names another kind; \
                     a job keeps the tokenizer it started with: put data.tokenizer back, or \
                     start a new job",
                    path.display(),
                    vocab.kind_name()
                )));
            }
            Some(vocab)
        }
        None => None,
    };
    if t.tokenizer == ddpjob_spec::TokenizerKind::Byte {
        let bytes = std::fs::read(&t.path).map_err(|cause| DataError::Io {
            path: t.path.clone(),
            cause,
        })?;
        return Ok((bytes.into_iter().map(u32::from).collect(), Vocab::Byte));
    }
    let text = read_text(&t.path)?;
    let built_fresh = vocab.is_none();
    let vocab = match vocab {
        Some(vocab) => vocab,
        None => Vocab::build(&t.tokenizer, &text)?,
    };
    let what = format!("`{}`", t.path.display());
    let ids = vocab.encode(&text, &what).map_err(|e| match built_fresh {
        true => e,
        false => DataError::Mismatch(format!(
            "{e}. The job's vocabulary (vocab.json in its directory, made from the text it \
             trained on) does not cover this text: if it is the job's own text, it changed since \
             the job started (restore it, or start a new job); other text to score with the \
             job must use only the job's characters"
        )),
    })?;
    Ok((ids, vocab))
}

#[cfg(test)]
#[path = "text_tests.rs"]
mod tests;
