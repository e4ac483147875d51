//! The `[data]` keys of a language model's data: `text` (a UTF-8 file, tokenised at load
//! time) and `tokens` (pre-tokenised files, memory-mapped). Registered in `builtin.rs`; what
//! they read and how windows are cut is `text.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::DataError;
use super::builtin::sha256_digests;
use super::download::download;
use super::text::{TextSource, TextTask};
use super::vocab::Vocab;
use ddpjob_seam::{BuildError, DatasetOptions, JobFile};
use ddpjob_spec::{DataContext, KeyDoc};
use ddpjob_spec::{TokenDtype, TokenizerKind};

/// `data.dataset = "text"` as the data module reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct TextSpec {
    pub path: PathBuf,
    pub tokenizer: TokenizerKind,
    /// The last fraction of the tokens, kept for validation.
    pub val_fraction: f64,
}

/// `data.dataset = "tokens"` as the data module reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokensSpec {
    pub train_path: PathBuf,
    pub val_path: PathBuf,
    pub dtype: TokenDtype,
}

/// `data.dataset = "text"`: its keys. `tokenizer` is written out by `complete` (the model's
/// own `tokenizer.json` when it has one, else `"char"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    #[serde(default = "a_tenth")]
    pub val_fraction: f64,
    #[serde(default)]
    pub download: bool,
    #[serde(default)]
    pub mirrors: Vec<String>,
    #[serde(default)]
    pub checksums: BTreeMap<String, String>,
}

fn a_tenth() -> f64 {
    0.1
}

pub const TEXT_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "path",
        default: "required",
        doc: "the UTF-8 file; relative to the working directory; fetched from `data.mirrors` \
              when missing and `data.download = true`",
    },
    KeyDoc {
        key: "tokenizer",
        default: "the model's `tokenizer.json`, else `\"char\"`",
        doc: "`\"char\"` (the file's distinct characters, sorted, as nanoGPT's `prepare.py`), \
              `\"byte\"` (256 symbols) or the path of a Hugging Face `tokenizer.json` (GPT-2's \
              BPE, a WordPiece, a Unigram...; relative to the working directory)",
    },
    KeyDoc {
        key: "val_fraction",
        default: "`0.1`",
        doc: "the last fraction of the tokens is the validation split",
    },
    KeyDoc {
        key: "download",
        default: "`false`",
        doc: "download `path` when it is missing",
    },
    KeyDoc {
        key: "mirrors",
        default: "none",
        doc: "base URLs tried in order for the file's name",
    },
    KeyDoc {
        key: "checksums",
        default: "none",
        doc: "table: SHA-256 per file name, checked when the file is downloaded (a file \
              already at `path` is read as it is)",
    },
];

impl TextOptions {
    /// What the data module reads (the options are complete).
    pub fn spec(&self) -> TextSpec {
        TextSpec {
            path: PathBuf::from(self.path.clone().unwrap_or_default()),
            tokenizer: self
                .tokenizer
                .as_deref()
                .and_then(|t| tokenizer_kind(t).ok())
                .unwrap_or(TokenizerKind::Char),
            val_fraction: self.val_fraction,
        }
    }

    pub fn open(&self, cx: &DataContext) -> Result<TextTask, DataError> {
        let spec = self.spec();
        if !spec.path.is_file() {
            return Err(self.absent(&spec.path));
        }
        if let TokenizerKind::HuggingFace(tokenizer) = &spec.tokenizer {
            let fix = "name the Hugging Face tokenizer.json the text is to be encoded with";
            named_file("tokenizer", tokenizer, fix)?;
        }
        TextTask::open(&TextSource::Text(spec), cx)
    }

    /// Makes sure the file is on disk (downloading it into place if allowed; SHA-256 checked
    /// when `checksums` names it).
    fn ensure_present(&self) -> Result<(), DataError> {
        let path = self.spec().path;
        if path.is_file() {
            return Ok(());
        }
        if path.is_dir() || !self.download || self.mirrors.is_empty() {
            return Err(self.absent(&path));
        }
        let file = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let digest = self.checksums.get(&file).map(String::as_str);
        download(&self.mirrors, &file, digest, &path)
    }

    /// Why the text file at `path` (not a file) cannot be read, and the fix.
    fn absent(&self, path: &Path) -> DataError {
        if path.is_dir() {
            return DataError::Mismatch(format!(
                "data.path `{}` is a directory; name the text file in it (e.g. `{}`)",
                path.display(),
                path.join("input.txt").display()
            ));
        }
        let file = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let fix = match self.download && !self.mirrors.is_empty() {
            true => "`ddpjob run` downloads it from data.mirrors".to_string(),
            false => format!(
                "put the text there, or set data.download = true and data.mirrors to where \
                 `{file}` can be fetched (with its SHA-256 in data.checksums)"
            ),
        };
        DataError::Mismatch(format!(
            "data.path `{}` does not exist; {fix}",
            path.display()
        ))
    }
}

impl DatasetOptions for TextOptions {
    const PATHS: &'static [&'static str] = &["path", "tokenizer"];

    fn complete(mut self, cx: &DataContext) -> Result<Self, String> {
        tokens_for("text", cx)?;
        match self.path.as_deref() {
            Some(p) if !p.is_empty() => {}
            _ => {
                return Err("data.path is required for data.dataset = \"text\", e.g. \
                            path = \"data/shakespeare/input.txt\""
                    .into());
            }
        }
        // A pretrained model's own tokenizer unless the job names another.
        let own = cx.language.as_ref().and_then(|l| l.tokenizer.clone());
        let tokenizer = match self.tokenizer.take() {
            Some(t) => t,
            None => match own.clone() {
                Some(path) if !path.is_file() => return Err(missing_tokenizer(&path)),
                Some(path) => path.display().to_string(),
                None => "char".into(),
            },
        };
        // A pretrained model's embeddings are its tokenizer's ids: characters or bytes
        // numbered afresh would train it on nonsense, silently. (A job that did is kept.)
        if let (Some(own), "char" | "byte", false) = (
            own.filter(|o| o.is_file()),
            tokenizer.as_str(),
            cx.stored_job,
        ) {
            return Err(format!(
                "data.tokenizer = \"{tokenizer}\" numbers the text afresh, but the pretrained \
                 model (model.init_from) learnt the ids of its own tokenizer `{}`: leave \
                 data.tokenizer out to use that one",
                own.display()
            ));
        }
        tokenizer_kind(&tokenizer)?;
        self.tokenizer = Some(tokenizer);
        let present = Path::new(self.path.as_deref().unwrap_or_default()).is_file();
        if self.download && self.mirrors.is_empty() && !present {
            return Err(
                "data.download = true needs data.mirrors: text data has no mirror of \
                        its own; list the base URLs its file can be fetched from, or put the \
                        file at data.path and leave data.download out"
                    .into(),
            );
        }
        if !(self.val_fraction > 0.0 && self.val_fraction < 1.0) {
            return Err(format!(
                "data.val_fraction = {}: must be in (0, 1); 0.1 keeps the last 10% for validation",
                self.val_fraction
            ));
        }
        let file = Path::new(self.path.as_deref().unwrap_or_default()).file_name();
        let files: Vec<String> = file
            .map(|f| f.to_string_lossy().into_owned())
            .into_iter()
            .collect();
        sha256_digests(&self.checksums, &files)?;
        Ok(self)
    }

    /// Downloads the file if it may, then reads and encodes it (with the job's stored
    /// vocabulary once it has one): bad text creates no job. The vocabulary is kept.
    fn prepare(&self, cx: &DataContext) -> Result<Vec<JobFile>, BuildError> {
        self.ensure_present()?;
        let task = self.open(cx)?;
        let kept = task
            .vocab
            .as_ref()
            .map(|vocab| JobFile::bytes(Vocab::FILE, vocab.to_json().into_bytes()));
        let path = self.spec().path;
        let record = super::fingerprint::keep_or_compare(&[&path], cx.job.as_deref())?;
        Ok(kept.into_iter().chain(record).collect())
    }

    fn train_samples(&self) -> Option<(usize, String)> {
        let path = self.spec().path;
        (!path.is_file() && self.download)
            .then(|| (0, format!("`{}` not downloaded yet", path.display())))
    }

    fn describe(&self) -> Option<String> {
        Some(format!("text {}", self.spec().path.display()))
    }

    fn tokenizer_file(&self) -> Option<PathBuf> {
        match self.spec().tokenizer {
            TokenizerKind::HuggingFace(path) => Some(path),
            TokenizerKind::Char | TokenizerKind::Byte => None,
        }
    }
}

/// `data.dataset = "tokens"`: its keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokensOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<String>,
    #[serde(default = "u16_tokens")]
    pub token_dtype: String,
}

fn u16_tokens() -> String {
    "u16".into()
}

pub const TOKENS_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "train_path",
        default: "required",
        doc: "training tokens, flat little-endian, memory-mapped",
    },
    KeyDoc {
        key: "val_path",
        default: "required",
        doc: "validation tokens, same format",
    },
    KeyDoc {
        key: "token_dtype",
        default: "`\"u16\"`",
        doc: "`\"u16\"` (nanoGPT, llm.c) or `\"u32\"`",
    },
];

impl TokensOptions {
    /// What the data module reads (the options are complete).
    pub fn spec(&self) -> TokensSpec {
        let path = |p: &Option<String>| PathBuf::from(p.clone().unwrap_or_default());
        TokensSpec {
            train_path: path(&self.train_path),
            val_path: path(&self.val_path),
            dtype: token_dtype(&self.token_dtype).unwrap_or(TokenDtype::U16),
        }
    }

    pub fn open(&self, cx: &DataContext) -> Result<TextTask, DataError> {
        let spec = self.spec();
        let fix = "prepare the token files (e.g. nanoGPT's prepare.py) or correct the path";
        named_file("train_path", &spec.train_path, fix)?;
        named_file("val_path", &spec.val_path, fix)?;
        TextTask::open(&TextSource::Tokens(spec), cx)
    }
}

impl DatasetOptions for TokensOptions {
    const PATHS: &'static [&'static str] = &["train_path", "val_path"];

    fn complete(self, cx: &DataContext) -> Result<Self, String> {
        tokens_for("tokens", cx)?;
        for (key, value, example) in [
            ("train_path", &self.train_path, "data/owt/train.bin"),
            ("val_path", &self.val_path, "data/owt/val.bin"),
        ] {
            if value.as_deref().is_none_or(str::is_empty) {
                return Err(format!(
                    "data.{key} is required for data.dataset = \"tokens\", e.g. \
                     {key} = \"{example}\""
                ));
            }
        }
        let dtype = token_dtype(&self.token_dtype)?;
        match cx.language.as_ref().and_then(|l| l.vocab_size) {
            None => Err(
                "data.dataset = \"tokens\" needs model.vocab_size: the files do not say \
                         their vocabulary; e.g. 50304 for GPT-2's tokenizer padded as nanoGPT \
                         pads it"
                    .into(),
            ),
            Some(v) if dtype == TokenDtype::U16 && v > 65536 => Err(format!(
                "model.vocab_size = {v}: so many tokens do not fit data.token_dtype = \"u16\"; \
                 use \"u32\""
            )),
            Some(_) => Ok(self),
        }
    }

    /// Maps the files (cheap: tokens are range-checked as they are read), so a damaged one is
    /// refused before the job exists; keeps (or, resuming, compares) their record.
    fn prepare(&self, cx: &DataContext) -> Result<Vec<JobFile>, BuildError> {
        self.open(cx)?;
        let spec = self.spec();
        let paths = [spec.train_path.as_path(), spec.val_path.as_path()];
        Ok(super::fingerprint::keep_or_compare(
            &paths,
            cx.job.as_deref(),
        )?)
    }

    /// Token files come from the user's own preparation step: not there yet is not an error
    /// for `validate`.
    fn train_samples(&self) -> Option<(usize, String)> {
        let path = self.spec().train_path;
        (!path.is_file()).then(|| {
            let why = "not found: prepare the token files before `run`";
            (0, format!("`{}` {why}", path.display()))
        })
    }

    fn describe(&self) -> Option<String> {
        Some(format!("tokens {}", self.spec().train_path.display()))
    }
}

/// Token data for a model that is not a language model is refused, naming what it needs.
fn tokens_for(dataset: &str, cx: &DataContext) -> Result<(), String> {
    match cx.language {
        Some(_) => Ok(()),
        None => Err(format!(
            "data.dataset = \"{dataset}\" is token sequences: it needs a language model \
             (model.arch = \"gpt\" or \"llama\"), not \"{}\"",
            cx.arch
        )),
    }
}

/// `data.tokenizer`'s value as a kind of tokenizer.
pub fn tokenizer_kind(value: &str) -> Result<TokenizerKind, String> {
    match value {
        "char" => Ok(TokenizerKind::Char),
        "byte" => Ok(TokenizerKind::Byte),
        path if path.ends_with(".json") => Ok(TokenizerKind::HuggingFace(path.into())),
        other => Err(format!(
            "data.tokenizer = \"{other}\": expected \"char\", \"byte\" or the path of a Hugging \
             Face tokenizer file ending in .json (e.g. \"data/gpt2/tokenizer.json\")"
        )),
    }
}

fn token_dtype(value: &str) -> Result<TokenDtype, String> {
    match value {
        "u16" => Ok(TokenDtype::U16),
        "u32" => Ok(TokenDtype::U32),
        other => Err(format!(
            "data.token_dtype = \"{other}\": expected \"u16\" or \"u32\""
        )),
    }
}

/// `data.<key>`'s file is there, or an error (a config error: exit 2) naming the key, the path
/// and what to do.
pub fn named_file(key: &str, path: &Path, fix: &str) -> Result<(), DataError> {
    if path.is_file() {
        return Ok(());
    }
    let problem = if path.is_dir() {
        "is a directory; name the file in it".to_string()
    } else {
        let from = match (path.is_relative(), std::env::current_dir()) {
            (true, Ok(dir)) => format!(" (relative to `{}`)", dir.display()),
            _ => String::new(),
        };
        format!("does not exist{from}; {fix}")
    };
    Err(DataError::Mismatch(format!(
        "data.{key} `{}` {problem}",
        path.display()
    )))
}

/// The tokenizer of the weights `model.init_from` names (a pretrained model's
/// `tokenizer.json`, or the one the job they come from trained with) is missing: those weights
/// index their embeddings by its ids, so ddpjob's own vocabulary (the fallback for a model from
/// scratch) would train them on meaningless ids.
pub fn missing_tokenizer(path: &Path) -> String {
    format!(
        "`{}` does not exist: it is the tokenizer whose ids the weights of model.init_from \
         read; set data.tokenizer to that tokenizer's tokenizer.json (e.g. from the model's \
         repository)",
        path.display()
    )
}
