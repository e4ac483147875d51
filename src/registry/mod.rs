//! The models and datasets a binary can train, by name. `ddpjob` itself is built with
//! [`Registry::builtin`]; a user's own binary adds its networks and data sets to it and hands it
//! to [`crate::cli::main_with`], which installs it for the launcher and every worker (workers
//! re-execute the same binary, so they see the same registry).
//!
//! A builder receives its own sub-table of the job file (`[model]` without `arch`, or `[data]`
//! without `dataset` and `drop_last`) deserialised into the user's serde struct. The struct's
//! field names are read from its `Deserialize` impl, so unknown keys are refused with the file,
//! line and a did-you-mean, as built-in keys are.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::Precision;
use crate::data::DataError;
use crate::models::Model;
use crate::task::{ModelInput, Task};

mod fields;
pub use fields::struct_fields;

/// An error a user's builder returned (any error type converts into it).
pub type BuildError = Box<dyn std::error::Error + Send + Sync>;

/// What a model builder gets besides its options.
#[derive(Debug, Clone)]
pub struct ModelContext {
    /// The shape of the data the model learns from (images and classes, or token windows).
    pub input: ModelInput,
    /// The job's seed: initialise from it (see [`crate::models::ParamStore`]) so every run
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
}

impl ModelContext {
    pub(crate) fn new(
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
            compute_dtype: precision.compute_dtype(),
            restoring,
        }
    }
}

/// What a dataset opener gets besides its options. Relative paths in the options are read
/// from the working directory, as `data.root` and `data.path` are.
#[derive(Debug, Clone)]
pub struct DataContext {
    /// The job's seed (for data made up or split at random).
    pub seed: u64,
}

type ModelFn =
    dyn Fn(&toml::Table, &ModelContext) -> Result<Box<dyn Model>, BuildError> + Send + Sync;
type DataFn = dyn Fn(&toml::Table, &DataContext) -> Result<Box<dyn Task>, BuildError> + Send + Sync;
type ResolveFn = fn(&toml::Table) -> Result<toml::Table, String>;
type LanguageFn = fn(&toml::Table) -> Result<LanguageModelSpec, String>;
type HfExportFn = fn(
    &toml::Table,
    std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<crate::hf::HfParts, String>;

/// One documented option key of a built-in model: what `ddpjob keys` and the README's config
/// table show (a test keeps the list equal to the options struct's fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyDoc {
    pub key: &'static str,
    /// Markdown, as the schema's defaults are shown.
    pub default: &'static str,
    /// Markdown, one line.
    pub doc: &'static str,
}

/// What [`Registry::model_docs`] says of one model.
pub(crate) struct ModelDocs<'a> {
    pub arch: &'a str,
    pub keys: &'static [KeyDoc],
    pub fields: &'static [&'static str],
}

/// How a model family meets Hugging Face checkpoints: the `model_type`s of `config.json` it
/// reads (`init_from` of such a directory picks this arch), and how `export --hf` writes it.
#[derive(Clone, Copy)]
struct HfFamily {
    model_types: &'static [&'static str],
    export: HfExportFn,
}

/// The options of a model that learns from token windows: registered with
/// [`Registry::language_model`], it trains on the built-in `text` and `tokens` data, which cut
/// windows of its `block_size` and tokenise with its tokenizer unless the job names another.
pub trait LanguageModelOptions: DeserializeOwned + Serialize + 'static {
    /// The options with what they leave to be derived filled in (sizes read from a pretrained
    /// checkpoint's config, defaults), or why that fails: `job.toml` holds the result, so a
    /// resumed job builds the same model.
    fn complete(self) -> Result<Self, String> {
        Ok(self)
    }
    /// Tokens per window.
    fn block_size(&self) -> usize;
    /// The vocabulary size, when the model fixes it (`None`: the data's).
    fn vocab_size(&self) -> Option<usize>;
    /// The checkpoint the weights start from: a Hugging Face directory, another job, or a
    /// checkpoint of one (`model.init_from`). Its tokenizer and vocabulary are the defaults of
    /// [`Self::tokenizer`] and [`Self::vocabulary`].
    fn init_from(&self) -> Option<&str> {
        None
    }
    /// A `tokenizer.json` that comes with the model (a pretrained checkpoint's).
    fn tokenizer(&self) -> Option<std::path::PathBuf> {
        crate::models::pretrained_tokenizer(self.init_from()?)
    }
    /// A ddpjob `vocab.json` the weights were trained with (another job's, when the model
    /// starts from it): text is encoded with it rather than with a vocabulary of its own.
    fn vocabulary(&self) -> Option<std::path::PathBuf> {
        crate::models::pretrained_vocabulary(self.init_from()?)
    }
}

/// What token data needs to know of a language model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LanguageModelSpec {
    /// Tokens per window.
    pub block_size: usize,
    /// The model's vocabulary size, when it fixes one.
    pub vocab_size: Option<usize>,
    /// The model's own `tokenizer.json`, the default of `data.tokenizer`.
    pub tokenizer: Option<std::path::PathBuf>,
    /// The `vocab.json` the model's weights were trained with, if another job trained them.
    pub vocabulary: Option<std::path::PathBuf>,
}

/// One registered name: its option keys, how to read them, and how to build it.
struct Entry<F: ?Sized> {
    /// The option keys; `None` when the options are not a struct (any key is taken).
    fields: Option<&'static [&'static str]>,
    resolve: ResolveFn,
    /// For a language model: its window and tokenizer, from its resolved options.
    language: Option<LanguageFn>,
    /// `None` for the built-in datasets, which the data module loads from the validated spec.
    build: Option<Arc<F>>,
    builtin: bool,
    hf: Option<HfFamily>,
    docs: &'static [KeyDoc],
}

impl<F: ?Sized> Clone for Entry<F> {
    fn clone(&self) -> Self {
        Entry {
            fields: self.fields,
            resolve: self.resolve,
            language: self.language,
            build: self.build.clone(),
            builtin: self.builtin,
            hf: self.hf,
            docs: self.docs,
        }
    }
}

/// The models and datasets a binary knows, by name.
#[derive(Clone, Default)]
pub struct Registry {
    models: BTreeMap<String, Entry<ModelFn>>,
    datasets: BTreeMap<String, Entry<DataFn>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("models", &self.model_names())
            .field("datasets", &self.dataset_names())
            .finish()
    }
}

/// What a name refers to, for the config's checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    /// Built into ddpjob: its keys are the config schema's.
    Builtin,
    /// Registered (ddpjob's own models, or the binary's author's): its keys are its options
    /// struct's fields (`None`: not a struct, any key is taken).
    Custom {
        fields: Option<&'static [&'static str]>,
    },
    Unknown,
}

impl Registry {
    /// No models and no datasets.
    pub fn empty() -> Self {
        Registry::default()
    }

    /// ddpjob's own models (`mlp`, `cnn`, `gpt`, `llama`) and datasets (`mnist`,
    /// `fashion-mnist`, `synthetic`, `text`, `tokens`).
    pub fn builtin() -> Self {
        let mut registry = crate::models::register_builtin(Registry::empty());
        for name in crate::data::BUILTIN_DATASETS {
            registry.datasets.insert(
                name.to_string(),
                Entry {
                    fields: None,
                    resolve: |t| Ok(t.clone()),
                    language: None,
                    build: None,
                    builtin: true,
                    hf: None,
                    docs: &[],
                },
            );
        }
        registry
    }

    /// Registers the model `name` (`model.arch = "name"`): `build` receives the rest of
    /// `[model]` deserialised into `O` (serde defaults apply) and the [`ModelContext`].
    pub fn model<O, M, E, F>(mut self, name: &str, build: F) -> Self
    where
        O: DeserializeOwned + Serialize + 'static,
        M: Model + 'static,
        E: Into<BuildError>,
        F: Fn(&O, &ModelContext) -> Result<M, E> + Send + Sync + 'static,
    {
        let entry = Entry {
            fields: struct_fields::<O>(),
            resolve: resolve::<O>,
            language: None,
            build: Some(Arc::new(move |table: &toml::Table, cx: &ModelContext| {
                let options: O = parse(table).map_err(BuildError::from)?;
                build(&options, cx)
                    .map(|m| Box::new(m) as Box<dyn Model>)
                    .map_err(Into::into)
            }) as Arc<ModelFn>),
            builtin: false,
            hf: None,
            docs: &[],
        };
        self.models.insert(name.to_string(), entry);
        self
    }

    /// Registers the language model `name`: as [`Registry::model`], and its options say its
    /// window and tokenizer (see [`LanguageModelOptions`]), so jobs train it on the built-in
    /// `text` and `tokens` data. The options are completed once, at `validate`/`run`.
    pub fn language_model<O, M, E, F>(self, name: &str, build: F) -> Self
    where
        O: LanguageModelOptions,
        M: Model + 'static,
        E: Into<BuildError>,
        F: Fn(&O, &ModelContext) -> Result<M, E> + Send + Sync + 'static,
    {
        let mut registry = self.model(name, build);
        if let Some(entry) = registry.models.get_mut(name) {
            entry.resolve = resolve_language::<O>;
            entry.language = Some(language_of::<O>);
        }
        registry
    }

    /// Says that the model `name` reads Hugging Face directories of `model_types` and
    /// exports as one of them.
    pub(crate) fn hf_family(
        mut self,
        name: &str,
        model_types: &'static [&'static str],
        export: HfExportFn,
    ) -> Self {
        if let Some(entry) = self.models.get_mut(name) {
            entry.hf = Some(HfFamily {
                model_types,
                export,
            });
        }
        self
    }

    /// Documents the option keys of the model `name`.
    pub(crate) fn documented(mut self, name: &str, docs: &'static [KeyDoc]) -> Self {
        if let Some(entry) = self.models.get_mut(name) {
            entry.docs = docs;
        }
        self
    }

    /// Each model's documented keys and its options struct's fields, by arch.
    pub(crate) fn model_docs(&self) -> Vec<ModelDocs<'_>> {
        let docs = self.models.iter().map(|(name, e)| ModelDocs {
            arch: name,
            keys: e.docs,
            fields: e.fields.unwrap_or_default(),
        });
        docs.collect()
    }

    /// The arch that reads Hugging Face checkpoints of `model_type`.
    pub(crate) fn arch_for_model_type(&self, model_type: &str) -> Option<&str> {
        self.models
            .iter()
            .find(|(_, e)| e.hf.is_some_and(|hf| hf.model_types.contains(&model_type)))
            .map(|(name, _)| name.as_str())
    }

    /// Every (`model_type`, arch) this binary reads, for messages.
    pub(crate) fn hf_model_types(&self) -> Vec<(&'static str, &str)> {
        let mut types = Vec::new();
        for (name, entry) in &self.models {
            for t in entry.hf.map_or(&[][..], |hf| hf.model_types) {
                types.push((*t, name.as_str()));
            }
        }
        types
    }

    /// `config.json` and tensors of a Hugging Face export of the model `name` with resolved
    /// `options` and trained `tensors`.
    pub(crate) fn export_hf(
        &self,
        name: &str,
        options: &toml::Table,
        tensors: std::collections::HashMap<String, candle_core::Tensor>,
    ) -> Result<crate::hf::HfParts, String> {
        match self.models.get(name).and_then(|e| e.hf) {
            Some(hf) => (hf.export)(options, tensors),
            None => {
                let archs: Vec<String> = self
                    .models
                    .iter()
                    .filter(|(_, e)| e.hf.is_some())
                    .map(|(n, _)| format!("\"{n}\""))
                    .collect();
                Err(format!(
                    "export --hf writes the models that have a Hugging Face format \
                     (model.arch = {}); this job's model is \"{name}\", which has none",
                    archs.join(" or ")
                ))
            }
        }
    }

    /// Registers the dataset `name` (`data.dataset = "name"`): `open` receives the rest of
    /// `[data]` (all but `dataset` and `drop_last`) deserialised into `O`.
    pub fn dataset<O, T, E, F>(mut self, name: &str, open: F) -> Self
    where
        O: DeserializeOwned + Serialize + 'static,
        T: Task + 'static,
        E: Into<BuildError>,
        F: Fn(&O, &DataContext) -> Result<T, E> + Send + Sync + 'static,
    {
        let entry = Entry {
            fields: struct_fields::<O>(),
            resolve: resolve::<O>,
            language: None,
            build: Some(Arc::new(move |table: &toml::Table, cx: &DataContext| {
                let options: O = parse(table).map_err(BuildError::from)?;
                open(&options, cx)
                    .map(|t| Box::new(t) as Box<dyn Task>)
                    .map_err(Into::into)
            }) as Arc<DataFn>),
            builtin: false,
            hf: None,
            docs: &[],
        };
        self.datasets.insert(name.to_string(), entry);
        self
    }

    /// The registered model names (`model.arch` values), sorted.
    pub fn model_names(&self) -> Vec<&str> {
        self.models.keys().map(String::as_str).collect()
    }

    /// The registered dataset names (`data.dataset` values), sorted.
    pub fn dataset_names(&self) -> Vec<&str> {
        self.datasets.keys().map(String::as_str).collect()
    }

    pub(crate) fn model_kind(&self, name: &str) -> Known {
        known(self.models.get(name))
    }

    pub(crate) fn dataset_kind(&self, name: &str) -> Known {
        known(self.datasets.get(name))
    }

    /// `options` with the defaults of the model's options struct written out, or why they
    /// do not deserialise.
    pub(crate) fn resolve_model(
        &self,
        name: &str,
        options: &toml::Table,
    ) -> Result<toml::Table, String> {
        match self.models.get(name) {
            Some(e) => (e.resolve)(options),
            None => Err(format!("no model is registered as \"{name}\"")),
        }
    }

    /// The window and tokenizer of the language model `name` with resolved `options`; `None`
    /// for a model that is not one (or not registered).
    pub(crate) fn language(
        &self,
        name: &str,
        options: &toml::Table,
    ) -> Option<Result<LanguageModelSpec, String>> {
        let language = self.models.get(name)?.language?;
        Some(language(options))
    }

    pub(crate) fn resolve_dataset(
        &self,
        name: &str,
        options: &toml::Table,
    ) -> Result<toml::Table, String> {
        match self.datasets.get(name) {
            Some(e) => (e.resolve)(options),
            None => Err(format!("no dataset is registered as \"{name}\"")),
        }
    }

    pub(crate) fn build_model(
        &self,
        name: &str,
        options: &toml::Table,
        cx: &ModelContext,
    ) -> Result<Box<dyn Model>, BuildError> {
        let build = self.models.get(name).and_then(|e| e.build.as_ref());
        let build = build.ok_or_else(|| {
            format!(
                "no model is registered as \"{name}\"; this binary has {}",
                self.model_names().join(", ")
            )
        })?;
        build(options, cx)
    }

    pub(crate) fn open_dataset(
        &self,
        name: &str,
        options: &toml::Table,
        cx: &DataContext,
    ) -> Result<Box<dyn Task>, DataError> {
        let build = self.datasets.get(name).and_then(|e| e.build.as_ref());
        let build = build.ok_or_else(|| {
            DataError::Mismatch(format!(
                "no dataset is registered as \"{name}\" with an opener; this binary has {}",
                self.dataset_names().join(", ")
            ))
        })?;
        build(options, cx)
            .map_err(|e| DataError::Mismatch(format!("data.dataset = \"{name}\": {e}")))
    }

    /// Makes `self` the registry of this process: what the config, the launcher and the
    /// workers consult. Only once, before anything reads it ([`Registry::current`] installs
    /// the built-in one); a later call returns `self` back as the error.
    pub fn install(self) -> Result<(), Registry> {
        INSTALLED.set(self)
    }

    /// The installed registry, or the built-in one when none was installed.
    pub fn current() -> &'static Registry {
        INSTALLED.get_or_init(Registry::builtin)
    }
}

static INSTALLED: OnceLock<Registry> = OnceLock::new();

fn known<F: ?Sized>(entry: Option<&Entry<F>>) -> Known {
    match entry {
        None => Known::Unknown,
        Some(e) if e.builtin => Known::Builtin,
        Some(e) => Known::Custom { fields: e.fields },
    }
}

fn parse<O: DeserializeOwned>(table: &toml::Table) -> Result<O, String> {
    O::deserialize(toml::Value::Table(table.clone())).map_err(|e| e.to_string())
}

fn resolve<O: DeserializeOwned + Serialize>(table: &toml::Table) -> Result<toml::Table, String> {
    write_back(&parse::<O>(table)?)
}

fn resolve_language<O: LanguageModelOptions>(table: &toml::Table) -> Result<toml::Table, String> {
    write_back(&parse::<O>(table)?.complete()?)
}

fn language_of<O: LanguageModelOptions>(table: &toml::Table) -> Result<LanguageModelSpec, String> {
    let options: O = parse(table)?;
    Ok(LanguageModelSpec {
        block_size: options.block_size(),
        vocab_size: options.vocab_size(),
        tokenizer: options.tokenizer(),
        vocabulary: options.vocabulary(),
    })
}

fn write_back<O: Serialize>(options: &O) -> Result<toml::Table, String> {
    match toml::Value::try_from(options) {
        Ok(toml::Value::Table(t)) => Ok(t),
        Ok(other) => Err(format!("the options serialise to {other}, not a table")),
        Err(e) => Err(format!("the options cannot be written back as TOML: {e}")),
    }
}
