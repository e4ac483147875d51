//! What the config asks of the models and datasets a binary registers, and the plain types it
//! hands them. The job types sit below the registry: the registry implements [`Builders`] and
//! the config reads the registered names, options, capabilities and docs only through it, so
//! validating a job file needs no model, no data and no checkpoint code.

use std::path::{Path, PathBuf};

use super::JobSpec;

/// The registered models and datasets, as validation sees them. `ddpjob`'s `Registry`
/// implements it; a test may implement it with a handful of names.
pub trait Builders {
    /// The registered model names (`model.arch` values), sorted.
    fn model_names(&self) -> Vec<&str>;
    /// The registered dataset names (`data.dataset` values), sorted.
    fn dataset_names(&self) -> Vec<&str>;
    /// What the model `name` is, for the key checks.
    fn model_kind(&self, name: &str) -> Known;
    /// What the dataset `name` is, for the key checks.
    fn dataset_kind(&self, name: &str) -> Known;
    /// `options` with the defaults of the model's options struct written out, or why they do
    /// not deserialise.
    fn resolve_model(&self, name: &str, options: &toml::Table) -> Result<toml::Table, String>;
    /// The window and tokenizer of the language model `name` with resolved `options`; `None`
    /// for a model that is not one (or not registered).
    fn language(
        &self,
        name: &str,
        options: &toml::Table,
    ) -> Option<Result<LanguageModelSpec, String>>;
    /// The dataset's resolved options, completed for the model in `cx` when it has hooks.
    fn resolve_dataset(
        &self,
        name: &str,
        options: &toml::Table,
        cx: &DataContext,
    ) -> Result<toml::Table, String>;
    /// The dataset's options read, not completed (when there is no model to complete them for).
    fn resolve_dataset_keys(
        &self,
        name: &str,
        options: &toml::Table,
    ) -> Result<toml::Table, String>;
    /// The dataset `name`'s option keys that hold paths (`DatasetOptions::PATHS`).
    fn dataset_paths(&self, name: &str) -> &'static [&'static str];
    /// The kinds of linear layer (a layer name's last part) LoRA can adapt in the model `arch`;
    /// `None` for a model that declares none.
    fn lora_layers(&self, arch: &str) -> Option<&'static [&'static str]>;
    /// Whether the model `arch` is made of blocks it can gather one at a time (for
    /// `distributed.sharding = "full"`) and recompute (for `train.activation_checkpointing`),
    /// when its registration says; `None`: known only once it is built.
    fn has_blocks(&self, arch: &str) -> Option<bool>;
    /// `model.arch` of the weights `model.init_from` names when the job leaves it out: another
    /// job's `job.toml`, or a Hugging Face `config.json`'s `model_type`; or why it is not known.
    fn arch_of_init(&self, dir: &Path) -> Result<String, String>;
    /// `model.init_from`'s value as a Hugging Face Hub model id, at `revision`: `None` when it
    /// is not one (a path), else the cache's directory of the commit it is (downloaded when
    /// missing) and that commit, or why it cannot be had. No Hub unless the builders say.
    fn hub_model(&self, id: &str, revision: &str) -> Option<Result<(String, String), String>> {
        let _ = (id, revision);
        None
    }
    /// Each model's documented keys and its options struct's fields, by arch.
    fn model_docs(&self) -> Vec<ModelDocs<'_>>;
    /// Each dataset's documented keys and its options struct's fields.
    fn dataset_docs(&self) -> Vec<DatasetDocs<'_>>;
}

/// What a name refers to, for the config's checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    /// Registered (ddpjob's own models and datasets, or the binary's author's): its keys are
    /// its options struct's fields (`None`: not a struct, any key is taken).
    Registered {
        fields: Option<&'static [&'static str]>,
        /// Keys of the section it does not read that are dropped beside it rather than
        /// refused: the default builder's keys beside the builders that always took them (job
        /// files switch the selector and keep them; older `job.toml`s write them).
        tolerated: &'static [&'static str],
        /// More such keys, dropped only in a stored job's `job.toml` (an older version wrote
        /// them); a job file is told of them.
        tolerated_in_stored_jobs: &'static [&'static str],
    },
    Unknown,
}

/// What token data needs to know of a language model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LanguageModelSpec {
    /// Tokens per window.
    pub block_size: usize,
    /// The model's vocabulary size, when it fixes one.
    pub vocab_size: Option<usize>,
    /// The model's own `tokenizer.json`, the default of `data.tokenizer`.
    pub tokenizer: Option<PathBuf>,
    /// The `vocab.json` the model's weights were trained with, if another job trained them.
    pub vocabulary: Option<PathBuf>,
    /// The model reads packed rows (`data.pack`): each position's token id with its position
    /// in its example, restarting positions and attention where an example starts.
    pub packed_rows: bool,
}

/// What a dataset opener (and a `DatasetOptions` hook) gets besides its options. Relative
/// paths in the options are read from the working directory, as `data.root` and `data.path`
/// are.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DataContext {
    /// The job's seed (for data made up or split at random).
    pub seed: u64,
    /// `model.arch`: the model the data feeds.
    pub arch: String,
    /// The model's window and tokenizer, when it is a language model.
    pub language: Option<LanguageModelSpec>,
    /// The job's directory once it exists: where the files `DatasetOptions::prepare`
    /// returned are kept (a resumed job reads its data as it first did).
    pub job: Option<PathBuf>,
    /// The options are read again from an existing job's `job.toml` (to resume, score or
    /// show it): what a new job is refused for, an existing one keeps.
    pub stored_job: bool,
    /// Where `DatasetOptions::prepare` writes large files the job will keep (the jobs
    /// directory, so they move in without a copy); `None`: the system's temporary directory.
    pub staging: Option<PathBuf>,
    /// `train.objective = "dpo"`: each record is a pair of completions of one prompt
    /// (`{prompt, chosen, rejected}`), kept side by side.
    pub pairs: bool,
}

impl DataContext {
    /// A new job's data (no directory yet) feeding the model `arch`, its `language` when it
    /// is a language model.
    pub fn new(seed: u64, arch: &str, language: Option<LanguageModelSpec>) -> Self {
        DataContext {
            seed,
            arch: arch.to_string(),
            language,
            job: None,
            stored_job: false,
            staging: None,
            pairs: false,
        }
    }

    /// The context of the job `spec` describes, in its directory `job` when it has one.
    pub fn of(spec: &JobSpec, job: Option<&Path>) -> Self {
        DataContext {
            seed: spec.seed,
            arch: spec.model.arch().to_string(),
            language: spec.model.language(),
            job: job.map(Path::to_path_buf),
            stored_job: job.is_some(),
            staging: job.and_then(Path::parent).map(Path::to_path_buf),
            pairs: spec.train.objective == super::spec::Objective::Dpo,
        }
    }

    /// Where large kept files are written before the job exists (see `staging`): while the
    /// jobs directory is not there yet (bad data must create nothing), the nearest directory
    /// above it that is, on the same file system as it will be, unlike a temporary directory
    /// that may be memory.
    pub fn staging_dir(&self) -> PathBuf {
        let mut dir = self.staging.clone();
        while let Some(d) = dir.take() {
            let d = if d.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                d
            };
            if d.is_dir() {
                return d;
            }
            dir = d.parent().map(Path::to_path_buf);
        }
        std::env::temp_dir()
    }
}

/// One documented option key of a built-in model or dataset: what `ddpjob keys` and the book's
/// config table show (a test keeps the list equal to the options struct's fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyDoc {
    pub key: &'static str,
    /// Markdown, as the schema's defaults are shown.
    pub default: &'static str,
    /// Markdown, one line.
    pub doc: &'static str,
}

/// What [`Builders::model_docs`] says of one model.
pub struct ModelDocs<'a> {
    pub arch: &'a str,
    pub keys: &'static [KeyDoc],
    pub fields: &'static [&'static str],
}

/// What [`Builders::dataset_docs`] says of one dataset.
pub struct DatasetDocs<'a> {
    pub dataset: &'a str,
    pub keys: &'static [KeyDoc],
    pub fields: &'static [&'static str],
}
