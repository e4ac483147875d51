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

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use ddpjob_models::LanguageModelOptions;
pub use ddpjob_seam::{BuildError, DatasetOptions, JobFile, ModelContext};
use ddpjob_seam::{DataError, Model, ModelInput, Task};
pub use ddpjob_spec::{
    Builders, DataContext, DatasetDocs, KeyDoc, Known, LanguageModelSpec, ModelDocs,
};

mod builtin;
mod fields;
pub use fields::struct_fields;

type ModelFn =
    dyn Fn(&toml::Table, &ModelContext) -> Result<Box<dyn Model>, BuildError> + Send + Sync;
type DataFn = dyn Fn(&toml::Table, &DataContext) -> Result<Box<dyn Task>, BuildError> + Send + Sync;
type ResolveFn = fn(&toml::Table) -> Result<toml::Table, String>;
type DataResolveFn = fn(&toml::Table, &DataContext) -> Result<toml::Table, String>;
type LanguageFn = fn(&toml::Table) -> Result<LanguageModelSpec, String>;
type HfExportFn = fn(
    &toml::Table,
    std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<ddpjob_storage::hf::HfParts, String>;

/// How a model family meets Hugging Face checkpoints: the `model_type`s of `config.json` it
/// reads (`init_from` of such a directory picks this arch), and how `export --hf` writes it.
#[derive(Clone, Copy)]
struct HfFamily {
    model_types: &'static [&'static str],
    export: HfExportFn,
    /// Its linear layers store weights [in, out] (GPT-2's Conv1D): PEFT's `fan_in_fan_out`.
    fan_in_fan_out: bool,
}

/// A dataset's [`DatasetOptions`] hooks on its resolved options.
#[derive(Clone, Copy)]
struct DataHooks {
    paths: &'static [&'static str],
    complete: DataResolveFn,
    prepare: fn(&toml::Table, &DataContext) -> Result<Vec<JobFile>, BuildError>,
    train_samples: fn(&toml::Table) -> Option<(usize, String)>,
    input: fn(&toml::Table) -> Option<ModelInput>,
    describe: fn(&toml::Table) -> Option<String>,
    tokenizer_file: fn(&toml::Table) -> Option<std::path::PathBuf>,
    end_of_example: fn(&toml::Table) -> Option<String>,
}

impl DataHooks {
    fn of<O: DatasetOptions>() -> Self {
        DataHooks {
            paths: O::PATHS,
            complete: |t, cx| write_back(&parse::<O>(t)?.complete(cx)?),
            prepare: |t, cx| parse::<O>(t)?.prepare(cx),
            train_samples: |t| parse::<O>(t).ok()?.train_samples(),
            input: |t| parse::<O>(t).ok()?.input(),
            describe: |t| parse::<O>(t).ok()?.describe(),
            tokenizer_file: |t| parse::<O>(t).ok()?.tokenizer_file(),
            end_of_example: |t| parse::<O>(t).ok()?.end_of_example(),
        }
    }
}

/// One registered name: its option keys, how to read them, and how to build it.
struct Entry<F: ?Sized> {
    /// The option keys; `None` when the options are not a struct (any key is taken).
    fields: Option<&'static [&'static str]>,
    resolve: ResolveFn,
    /// For a language model: its window and tokenizer, from its resolved options.
    language: Option<LanguageFn>,
    build: Arc<F>,
    hf: Option<HfFamily>,
    /// A dataset's hooks, when registered with [`Registry::dataset_with`].
    data: Option<DataHooks>,
    docs: &'static [KeyDoc],
    /// Keys of its section it does not read, dropped beside it (see [`Known::Registered`]).
    tolerated: &'static [&'static str],
    tolerated_in_stored_jobs: &'static [&'static str],
    /// A model's linear layers LoRA can adapt (their names' last part), when it takes adapters.
    lora_layers: Option<&'static [&'static str]>,
    /// Whether a model is made of blocks (see [`Builders::has_blocks`]), when declared.
    blocks: Option<bool>,
}

impl<F: ?Sized> Clone for Entry<F> {
    fn clone(&self) -> Self {
        Entry {
            fields: self.fields,
            resolve: self.resolve,
            language: self.language,
            build: self.build.clone(),
            hf: self.hf,
            data: self.data,
            docs: self.docs,
            tolerated: self.tolerated,
            tolerated_in_stored_jobs: self.tolerated_in_stored_jobs,
            lora_layers: self.lora_layers,
            blocks: self.blocks,
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

impl Registry {
    /// No models and no datasets.
    pub fn empty() -> Self {
        Registry::default()
    }

    /// ddpjob's own models (`mlp`, `cnn`, `gpt`, `llama`) and datasets (`mnist`,
    /// `fashion-mnist`, `synthetic`, `text`, `tokens`).
    pub fn builtin() -> Self {
        builtin::data(builtin::models(Registry::empty()))
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
            build: Arc::new(move |table: &toml::Table, cx: &ModelContext| {
                let options: O = parse(table).map_err(BuildError::from)?;
                build(&options, cx)
                    .map(|m| Box::new(m) as Box<dyn Model>)
                    .map_err(Into::into)
            }) as Arc<ModelFn>,
            hf: None,
            data: None,
            docs: &[],
            tolerated: &[],
            tolerated_in_stored_jobs: &[],
            lora_layers: None,
            blocks: None,
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
        fan_in_fan_out: bool,
    ) -> Self {
        if let Some(entry) = self.models.get_mut(name) {
            entry.hf = Some(HfFamily {
                model_types,
                export,
                fan_in_fan_out,
            });
        }
        self
    }

    /// Says which linear layers of the model `name` LoRA adapts (their names' last part):
    /// `[model.lora]` on this model is checked against them.
    pub(crate) fn lora_layers(mut self, name: &str, layers: &'static [&'static str]) -> Self {
        if let Some(entry) = self.models.get_mut(name) {
            entry.lora_layers = Some(layers);
        }
        self
    }

    /// Declares whether the model `name` is made of blocks it gathers one at a time and
    /// recomputes: validation then refuses full sharding and activation checkpointing for a
    /// model without them, and takes a model with them without building it.
    pub(crate) fn blocks(mut self, name: &str, blocks: bool) -> Self {
        if let Some(entry) = self.models.get_mut(name) {
            entry.blocks = Some(blocks);
        }
        self
    }

    /// Whether the model `name` reads its weights through [`crate::hf`] (it has a Hugging
    /// Face family), which can check a checkpoint's files against it without loading them.
    pub(crate) fn reads_hf_weights(&self, name: &str) -> bool {
        self.models.get(name).is_some_and(|e| e.hf.is_some())
    }

    /// Whether the adapters of the model `name` are exported with PEFT's `fan_in_fan_out`
    /// (its linear layers store weights [in, out], as GPT-2's Conv1D).
    pub(crate) fn fan_in_fan_out(&self, name: &str) -> bool {
        self.models
            .get(name)
            .and_then(|e| e.hf)
            .is_some_and(|hf| hf.fan_in_fan_out)
    }

    /// The token the data of `spec` ends every example with (instruction data's
    /// `eos_token`), which an exported or sampled model learnt to end an answer with.
    pub(crate) fn data_end_of_example(&self, spec: &ddpjob_spec::DataSpec) -> Option<String> {
        (self.data_hooks(spec.name())?.end_of_example)(spec.options())
    }

    /// Lets a `[model]` beside the model `name` hold `keys` it does not read (the default
    /// model's, which job files switching `arch` keep): dropped, not refused.
    pub(crate) fn model_tolerates(mut self, name: &str, keys: &'static [&'static str]) -> Self {
        if let Some(entry) = self.models.get_mut(name) {
            entry.tolerated = keys;
        }
        self
    }

    /// As [`Registry::model_tolerates`], for the dataset `name`; `in_stored_jobs` are dropped
    /// only from a stored job's `job.toml` (keys older versions wrote there).
    pub(crate) fn dataset_tolerates(
        mut self,
        name: &str,
        keys: &'static [&'static str],
        in_stored_jobs: &'static [&'static str],
    ) -> Self {
        if let Some(entry) = self.datasets.get_mut(name) {
            entry.tolerated = keys;
            entry.tolerated_in_stored_jobs = in_stored_jobs;
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
    ) -> Result<ddpjob_storage::hf::HfParts, String> {
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
            build: Arc::new(move |table: &toml::Table, cx: &DataContext| {
                let options: O = parse(table).map_err(BuildError::from)?;
                open(&options, cx)
                    .map(|t| Box::new(t) as Box<dyn Task>)
                    .map_err(Into::into)
            }) as Arc<DataFn>,
            hf: None,
            data: None,
            docs: &[],
            tolerated: &[],
            tolerated_in_stored_jobs: &[],
            lora_layers: None,
            blocks: None,
        };
        self.datasets.insert(name.to_string(), entry);
        self
    }

    /// Registers the dataset `name` as [`Registry::dataset`] does, with the hooks of its
    /// options (see [`DatasetOptions`]): checked against the model at `validate`, prepared
    /// in the launcher, counted and described without being opened.
    pub fn dataset_with<O, T, E, F>(self, name: &str, open: F) -> Self
    where
        O: DatasetOptions,
        T: Task + 'static,
        E: Into<BuildError>,
        F: Fn(&O, &DataContext) -> Result<T, E> + Send + Sync + 'static,
    {
        let mut registry = self.dataset(name, open);
        if let Some(entry) = registry.datasets.get_mut(name) {
            entry.data = Some(DataHooks::of::<O>());
        }
        registry
    }

    /// Documents the option keys of the dataset `name`.
    pub(crate) fn documented_dataset(mut self, name: &str, docs: &'static [KeyDoc]) -> Self {
        if let Some(entry) = self.datasets.get_mut(name) {
            entry.docs = docs;
        }
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

    fn data_hooks(&self, name: &str) -> Option<DataHooks> {
        self.datasets.get(name)?.data
    }

    /// Finds, downloads and checks the data of `spec` in the launcher (see
    /// [`DatasetOptions::prepare`]): the files the job keeps.
    pub(crate) fn prepare_data(
        &self,
        spec: &ddpjob_spec::DataSpec,
        cx: &DataContext,
    ) -> Result<Vec<JobFile>, DataError> {
        match self.data_hooks(spec.name()) {
            Some(hooks) => (hooks.prepare)(spec.options(), cx).map_err(|e| data_error(spec, e)),
            None => Ok(Vec::new()),
        }
    }

    /// `validate`'s count of `spec`'s training samples, when known without opening it.
    pub(crate) fn train_samples(&self, spec: &ddpjob_spec::DataSpec) -> Option<(usize, String)> {
        (self.data_hooks(spec.name())?.train_samples)(spec.options())
    }

    /// What a model of `spec`'s data takes, when known without opening it.
    pub(crate) fn data_input(&self, spec: &ddpjob_spec::DataSpec) -> Option<ModelInput> {
        (self.data_hooks(spec.name())?.input)(spec.options())
    }

    /// `show`'s and `list`'s words for `spec`'s data.
    pub(crate) fn describe_data(&self, spec: &ddpjob_spec::DataSpec) -> String {
        let described = self
            .data_hooks(spec.name())
            .and_then(|hooks| (hooks.describe)(spec.options()));
        described.unwrap_or_else(|| spec.name().to_string())
    }

    /// The `tokenizer.json` `spec`'s data is encoded with, if any.
    pub(crate) fn data_tokenizer(
        &self,
        spec: &ddpjob_spec::DataSpec,
    ) -> Option<std::path::PathBuf> {
        (self.data_hooks(spec.name())?.tokenizer_file)(spec.options())
    }

    pub(crate) fn build_model(
        &self,
        name: &str,
        options: &toml::Table,
        cx: &ModelContext,
    ) -> Result<Box<dyn Model>, BuildError> {
        let build = self.models.get(name).map(|e| &e.build);
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
        spec: &ddpjob_spec::DataSpec,
        cx: &DataContext,
    ) -> Result<Box<dyn Task>, DataError> {
        let name = spec.name();
        let build = self.datasets.get(name).map(|e| &e.build);
        let build = build.ok_or_else(|| {
            DataError::Mismatch(format!(
                "no dataset is registered as \"{name}\"; this binary has {}",
                self.dataset_names().join(", ")
            ))
        })?;
        build(spec.options(), cx).map_err(|e| data_error(spec, e))
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

/// What validation asks of the registered models and datasets (see [`Builders`]).
impl Builders for Registry {
    fn model_names(&self) -> Vec<&str> {
        Registry::model_names(self)
    }
    fn dataset_names(&self) -> Vec<&str> {
        Registry::dataset_names(self)
    }
    fn model_kind(&self, name: &str) -> Known {
        known(self.models.get(name))
    }
    fn dataset_kind(&self, name: &str) -> Known {
        known(self.datasets.get(name))
    }
    /// `options` with the defaults of the model's options struct written out, or why they
    /// do not deserialise.
    fn resolve_model(&self, name: &str, options: &toml::Table) -> Result<toml::Table, String> {
        match self.models.get(name) {
            Some(e) => (e.resolve)(options),
            None => Err(format!("no model is registered as \"{name}\"")),
        }
    }
    /// The window and tokenizer of the language model `name` with resolved `options`; `None`
    /// for a model that is not one (or not registered).
    fn language(
        &self,
        name: &str,
        options: &toml::Table,
    ) -> Option<Result<LanguageModelSpec, String>> {
        let language = self.models.get(name)?.language?;
        Some(language(options))
    }
    /// As [`Registry::resolve_model`], then completed for the model in `cx` when the dataset
    /// has [`DatasetOptions`] hooks.
    fn resolve_dataset(
        &self,
        name: &str,
        options: &toml::Table,
        cx: &DataContext,
    ) -> Result<toml::Table, String> {
        let Some(e) = self.datasets.get(name) else {
            return Err(format!("no dataset is registered as \"{name}\""));
        };
        let resolved = (e.resolve)(options)?;
        match e.data {
            Some(hooks) => (hooks.complete)(&resolved, cx),
            None => Ok(resolved),
        }
    }
    /// As [`Registry::resolve_model`]: the options read, not completed (when there is no model
    /// to complete them for).
    fn resolve_dataset_keys(
        &self,
        name: &str,
        options: &toml::Table,
    ) -> Result<toml::Table, String> {
        match self.datasets.get(name) {
            Some(e) => (e.resolve)(options),
            None => Err(format!("no dataset is registered as \"{name}\"")),
        }
    }
    /// The dataset `name`'s option keys that hold paths (see [`DatasetOptions::PATHS`]).
    fn dataset_paths(&self, name: &str) -> &'static [&'static str] {
        self.data_hooks(name).map_or(&[], |hooks| hooks.paths)
    }
    fn lora_layers(&self, arch: &str) -> Option<&'static [&'static str]> {
        self.models.get(arch)?.lora_layers
    }
    fn has_blocks(&self, arch: &str) -> Option<bool> {
        self.models.get(arch)?.blocks
    }
    fn arch_of_init(&self, dir: &std::path::Path) -> Result<String, String> {
        if let Some(trained) = ddpjob_storage::checkpoint::Trained::find(dir) {
            return trained.and_then(|t| t.model_table()).and_then(|m| {
                m.get("arch")
                    .and_then(toml::Value::as_str)
                    .map(String::from)
                    .ok_or_else(|| format!("`{}`'s job.toml has no model.arch", dir.display()))
            });
        }
        let hf = ddpjob_storage::hf::HfDir::open(dir).map_err(|e| e.to_string())?;
        let model_type = hf.model_type().map_err(|e| e.to_string())?;
        match self.arch_for_model_type(model_type) {
            Some(arch) => Ok(arch.to_string()),
            None => {
                let readable: Vec<String> = self
                    .hf_model_types()
                    .iter()
                    .map(|(t, arch)| format!("\"{t}\" (model.arch = \"{arch}\")"))
                    .collect();
                // A feature ddpjob does not compute, named by its key, before the list.
                let why = ddpjob_models::llama::unsupported_features(&hf.config, model_type)
                    .map_or_else(String::new, |why| format!("{why}; "));
                Err(format!(
                    "`{}` holds a \"{model_type}\" model: {why}this ddpjob reads {}",
                    dir.display(),
                    readable.join(", ")
                ))
            }
        }
    }
    /// Through the Hugging Face cache, downloading what it lacks (`ddpjob_storage::hf::hub`).
    fn hub_model(&self, id: &str, revision: &str) -> Option<Result<(String, String), String>> {
        use ddpjob_storage::hf::hub;
        if !hub::looks_like_id(id) {
            return None;
        }
        let resolved = hub::resolve(id, revision, &hub::HubEnv::from_env());
        Some(resolved.map_err(|e| e.to_string()).map(|model| {
            if let Some(why) = &model.unchecked {
                errln!("warning: {why}");
            }
            if model.downloaded {
                errln!(
                    "downloaded {id} (revision {revision}, commit {}) into {}",
                    model.commit,
                    model.dir.display()
                );
            }
            (model.dir.display().to_string(), model.commit)
        }))
    }
    /// Each model's documented keys and its options struct's fields, by arch.
    fn model_docs(&self) -> Vec<ModelDocs<'_>> {
        let docs = self.models.iter().map(|(name, e)| ModelDocs {
            arch: name,
            keys: e.docs,
            fields: e.fields.unwrap_or_default(),
        });
        docs.collect()
    }
    /// Each dataset's documented keys and its options struct's fields.
    fn dataset_docs(&self) -> Vec<DatasetDocs<'_>> {
        let docs = self.datasets.iter().map(|(name, e)| DatasetDocs {
            dataset: name,
            keys: e.docs,
            fields: e.fields.unwrap_or_default(),
        });
        docs.collect()
    }
}

fn known<F: ?Sized>(entry: Option<&Entry<F>>) -> Known {
    match entry {
        None => Known::Unknown,
        Some(e) => Known::Registered {
            fields: e.fields,
            tolerated: e.tolerated,
            tolerated_in_stored_jobs: e.tolerated_in_stored_jobs,
        },
    }
}

/// A dataset's error as the data seam's: ddpjob's own as they are (they name their file and
/// fix), a user's opener's under its `data.dataset`.
fn data_error(spec: &ddpjob_spec::DataSpec, e: BuildError) -> DataError {
    match e.downcast::<DataError>() {
        Ok(own) => *own,
        Err(e) => DataError::Mismatch(format!("data.dataset = \"{}\": {e}", spec.name())),
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
        packed_rows: options.reads_packed_rows(),
    })
}

fn write_back<O: Serialize>(options: &O) -> Result<toml::Table, String> {
    match toml::Value::try_from(options) {
        Ok(toml::Value::Table(t)) => Ok(t),
        Ok(other) => Err(format!("the options serialise to {other}, not a table")),
        Err(e) => Err(format!("the options cannot be written back as TOML: {e}")),
    }
}
