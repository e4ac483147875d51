//! What a model or dataset builder is handed and may return: the [`ModelContext`] a model is
//! built in, the error a builder gives ([`BuildError`]), the files a dataset keeps in the job
//! directory ([`JobFile`]) and the hooks of a dataset's options ([`DatasetOptions`]). The
//! registry (in `ddpjob`) calls them; the families and datasets implement them.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::task::ModelInput;
use ddpjob_spec::{DataContext, LoraSpec, Precision, QuantizeSpec};

/// The dtype the forward and backward passes compute in for `precision` (the parameters
/// stay f32).
pub fn compute_dtype(precision: Precision) -> DType {
    match precision.computes_in_bf16() {
        true => DType::BF16,
        false => DType::F32,
    }
}

/// An error a user's builder returned (any error type converts into it).
pub type BuildError = Box<dyn std::error::Error + Send + Sync>;

/// What a model builder gets besides its options.
#[derive(Debug, Clone)]
pub struct ModelContext {
    /// The shape of the data the model learns from (images and classes, or token windows).
    pub input: ModelInput,
    /// The job's seed: initialise from it (see [`crate::ParamStore`]) so every run
    /// and every rank starts from the same weights.
    pub seed: u64,
    /// Where the parameters live (the worker's CPU or GPU).
    pub device: Device,
    /// `train.precision`: the dtype the forward pass should compute in (the parameters stay
    /// f32; casting is the model's business).
    pub compute_dtype: DType,
    /// A checkpoint's weights will replace the ones built (resume, restart): a builder may
    /// skip loading pretrained weights, and must not fail because they are gone.
    pub restoring: bool,
    /// `[model.lora]`, when on: the adapters `gpt` and `llama` put beside their linear layers
    /// (a model of your own without linear layers that take them is refused).
    pub lora: Option<LoraSpec>,
    /// `[model.quantize]`, when on: the frozen decoder linear layers kept in 4 bits (a family
    /// that cannot is refused).
    pub quantize: Option<QuantizeSpec>,
}

impl ModelContext {
    /// The context of a model built for `input` on `device`, computing as `precision` says.
    pub fn new(
        input: ModelInput,
        seed: u64,
        device: &Device,
        precision: Precision,
        restoring: bool,
    ) -> Self {
        ModelContext {
            input,
            seed,
            device: device.clone(),
            compute_dtype: compute_dtype(precision),
            restoring,
            lora: None,
            quantize: None,
        }
    }
}

/// A file a dataset keeps in the job directory (text data's `vocab.json`, instruction data's
/// tokens): written when the job is created, found there by every later open.
#[derive(Debug, PartialEq, Eq)]
pub struct JobFile {
    /// Its name in the job directory.
    pub name: String,
    pub contents: Contents,
}

/// What a kept file holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Contents {
    /// Bytes in memory: a small file.
    Bytes(Vec<u8>),
    /// A file `prepare` already wrote (in [`DataContext::staging_dir`], beside where the job
    /// will be), moved into the job directory: data larger than memory is never held whole.
    /// Removed when the `JobFile` is dropped without being kept (a job refused after its data
    /// was prepared leaves nothing behind).
    Staged(PathBuf),
}

impl JobFile {
    /// A file of `bytes`.
    pub fn bytes(name: impl Into<String>, bytes: Vec<u8>) -> JobFile {
        JobFile {
            name: name.into(),
            contents: Contents::Bytes(bytes),
        }
    }

    /// The file `prepare` wrote at `path`, to be moved into the job as `name`.
    pub fn staged(name: impl Into<String>, path: PathBuf) -> JobFile {
        JobFile {
            name: name.into(),
            contents: Contents::Staged(path),
        }
    }

    /// Its contents (a staged file's read from disk).
    pub fn read(&self) -> std::io::Result<Cow<'_, [u8]>> {
        match &self.contents {
            Contents::Bytes(bytes) => Ok(Cow::Borrowed(bytes)),
            Contents::Staged(path) => std::fs::read(path).map(Cow::Owned),
        }
    }

    /// Puts it at `dest` (in the job directory): a staged file is renamed there (copied when
    /// it is on another file system), bytes are handed to `write` (the job's atomic write).
    pub fn keep_at(
        &self,
        dest: &Path,
        write: impl FnOnce(&Path, &[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        match &self.contents {
            Contents::Bytes(bytes) => write(dest, bytes),
            Contents::Staged(path) => {
                if std::fs::rename(path, dest).is_ok() {
                    return Ok(());
                }
                let partial = dest.with_extension("partial");
                let copied =
                    std::fs::copy(path, &partial).and_then(|_| std::fs::rename(&partial, dest));
                if copied.is_err() {
                    let _ = std::fs::remove_file(&partial);
                }
                copied?;
                std::fs::remove_file(path)
            }
        }
    }
}

impl Drop for JobFile {
    fn drop(&mut self) {
        if let Contents::Staged(path) = &self.contents {
            // Gone already when it was kept.
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The options of a dataset that does more than open: registered with
/// `ddpjob::Registry::dataset_with`, its hooks run where ddpjob needs them. Every method has
/// a default, so `impl DatasetOptions for MyOptions {}` is the plain `Registry::dataset`.
pub trait DatasetOptions: DeserializeOwned + Serialize + 'static {
    /// The option keys whose values are file or directory paths, read relative to the working
    /// directory `run` started in (`["train_path", "test_path"]`). `run` writes them into
    /// `job.toml` made absolute, so `resume`, `eval` or a requeue started from another
    /// directory reads the same files, as it does ddpjob's own `data.path`.
    const PATHS: &'static [&'static str] = &[];

    /// The options with what they derive filled in (from the model: `cx.language`), or why the
    /// data cannot feed that model; at `validate`/`run`, before anything exists (`job.toml`
    /// holds the result, so a resumed job opens the same data). `cx.job` is `None` here.
    fn complete(self, cx: &DataContext) -> Result<Self, String> {
        let _ = cx;
        Ok(self)
    }
    /// In the launcher, before the workers start (and before a new job's directory exists):
    /// find or download the files and check them, so bad data creates nothing. Returns the
    /// files the job keeps (see [`JobFile`]).
    fn prepare(&self, cx: &DataContext) -> Result<Vec<JobFile>, BuildError> {
        let _ = cx;
        Ok(Vec::new())
    }
    /// The number of training samples and where it comes from, known without opening the data
    /// (`validate`); `None`: `validate` opens it to count.
    fn train_samples(&self) -> Option<(usize, String)> {
        None
    }
    /// What a model of this data takes, when known without reading it (`bench step` makes
    /// random batches of it); `None`: it is opened to find out.
    fn input(&self) -> Option<ModelInput> {
        None
    }
    /// A few words for `show` and `list` (`text data/input.txt`); `None`: the dataset's name.
    fn describe(&self) -> Option<String> {
        None
    }
    /// The `tokenizer.json` the data is encoded with, which `export --hf` writes beside the
    /// weights.
    fn tokenizer_file(&self) -> Option<std::path::PathBuf> {
        None
    }
    /// The token the data ends every example with (instruction data's `eos_token`): what a
    /// model trained on it learnt to end an answer with, which `sample` stops at and
    /// `export --hf` writes as the model's end of sequence.
    fn end_of_example(&self) -> Option<String> {
        None
    }
}
