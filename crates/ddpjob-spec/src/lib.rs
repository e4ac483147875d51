//! Job files: TOML → raw serde structs (unknown keys rejected) → a validated [`JobSpec`].
//! Errors name the file, line and column (or the `--set` argument), the key, and the fix.
//!
//! Every key is declared once (`keys.rs`): its meaning, type, default and check, which make
//! the typed value, `ddpjob keys`, `--set` typing and the book's config reference. The
//! registered models' and datasets' own keys are read through [`Builders`], which the
//! registry above implements.
//!
//! This crate is the ground floor of the job types: it imports no other ddpjob crate, nor
//! candle (a clean build compiles it beside candle, off the critical path), so everything that
//! runs a job can depend on the spec, and the spec on nothing that runs one.

mod adapter;
mod builders;
mod checks;
mod custom;
mod declare;
mod error;
mod keys;
mod lora;
mod peft_adapter;
mod quantize;
mod saved_quantization;
pub mod schema;
mod source;
mod spec;
mod validate;

use std::path::Path;

use serde::Deserialize;

pub use builders::{
    Builders, DataContext, DatasetDocs, KeyDoc, Known, LanguageModelSpec, ModelDocs,
};
pub use error::{ConfigError, Origin};
pub use keys::RawConfig;
pub use lora::{LoraSpec, TargetModules, is_adapter};
pub use peft_adapter::AdapterConfig;
pub use quantize::{BLOCK_SIZES as QUANTIZE_BLOCK_SIZES, QuantType, QuantizeSpec};
pub use source::{STORED_JOB_HEADER, Source, flag_override};
pub use spec::Backend;
pub use spec::{
    Check, CheckpointSpec, DataSpec, DeviceChoice, DistributedSpec, DpoLoss, Expectation, JobSpec,
    ModelSpec, Monitor, Objective, OnWriteError, OptimizerSpec, Precision, ScheduleKind,
    ScheduleSpec, Sharding, TokenDtype, TokenizerKind, TrainSpec,
};

/// A validated job and the fully resolved config it came from (every default written out).
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub spec: JobSpec,
    pub resolved: RawConfig,
    /// What the loading decided for the user that they should hear (keys left out), for the
    /// command to print.
    pub notes: Vec<String>,
}

impl LoadedConfig {
    /// Prints [`Self::notes`] on stderr, each as `note: ...`.
    pub fn print_notes(&self) {
        use std::io::Write as _;
        for note in &self.notes {
            let _ = writeln!(std::io::stderr(), "note: {note}");
        }
    }

    /// The resolved config as TOML: what `validate` prints and `run` freezes into `job.toml`.
    /// The model's and the dataset's sections hold their selector and options only.
    pub fn resolved_toml(&self) -> String {
        self.render(None)
    }

    /// [`Self::resolved_toml`] with the paths a job reads relative to the working directory
    /// (`data.path`, `model.init_from`, ...) made absolute against `base`: what `run` freezes
    /// into `job.toml`, so that `resume`, `eval` or a requeue started elsewhere read the same
    /// files.
    pub fn frozen_toml(&self, base: &Path) -> String {
        self.render(Some(base))
    }

    fn render(&self, base: Option<&Path>) -> String {
        let render = || -> Result<String, toml::ser::Error> {
            let mut doc = match toml::Value::try_from(&self.resolved)? {
                toml::Value::Table(t) => t,
                _ => toml::Table::new(),
            };
            let mut model = toml::Table::new();
            model.insert("arch".into(), self.spec.model.arch().into());
            if !self.spec.model.freeze().is_empty() {
                model.insert("freeze".into(), self.spec.model.freeze().to_vec().into());
            }
            if let Some(toml::Value::Table(raw)) = doc.get("model") {
                for key in ["lora", "quantize", "revision"] {
                    if let Some(value) = raw.get(key) {
                        model.insert(key.into(), value.clone());
                    }
                }
            }
            model.extend(self.spec.model.options().clone());
            doc.insert("model".into(), model.into());
            let mut data = toml::Table::new();
            data.insert("dataset".into(), self.spec.data.name().into());
            data.insert("drop_last".into(), self.spec.data.drop_last.into());
            data.extend(self.spec.data.options().clone());
            doc.insert("data".into(), data.into());
            // The global batch is what was asked for: each world size derives its own batch.
            if self.spec.train.global_batch_size.is_some()
                && let Some(toml::Value::Table(train)) = doc.get_mut("train")
            {
                train.remove("batch_size");
            }
            if let Some(base) = base {
                self.make_paths_absolute(&mut doc, base);
            }
            toml::to_string_pretty(&doc)
        };
        render().unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// The relative paths of [`MODEL_PATH_KEYS`] and of the dataset's path keys (its
    /// `DatasetOptions::PATHS`) in `doc` joined onto `base`.
    fn make_paths_absolute(&self, doc: &mut toml::Table, base: &Path) {
        let data_keys = self.spec.data.paths.iter().map(|key| format!("data.{key}"));
        let keys = MODEL_PATH_KEYS.iter().map(|key| key.to_string());
        for key in keys.chain(data_keys) {
            if let Some(toml::Value::String(path)) = source::value_at_mut(doc, &key)
                && !path.is_empty()
                && !["char", "byte"].contains(&path.as_str())
                && Path::new(path.as_str()).is_relative()
            {
                *path = base.join(path.as_str()).display().to_string();
            }
        }
    }
}

/// The `[model]` keys whose values are paths read relative to the working directory (a
/// dataset's are its `DatasetOptions::PATHS`).
const MODEL_PATH_KEYS: &[&str] = &["model.init_from", "model.lora.adapter"];

/// `model.init_from` naming a Hub model (`"Qwen/Qwen3-0.6B"`, where no such path is) becomes
/// the cache's directory of the commit `model.revision` (default `main`) is, downloaded when
/// missing, and `model.revision` that commit: `job.toml` records it, so `resume` reads the
/// same files again (a newer upload never replaces them). A path wins over an id, and so does
/// a path whose first folder exists here (`models/...` of a `models/` folder).
fn init_from_hub(source: &mut Source, registry: &dyn Builders) -> Result<(), ConfigError> {
    let Some(toml::Value::Table(model)) = source.table.get("model") else {
        return Ok(());
    };
    let revision = model.get("revision").and_then(toml::Value::as_str);
    let invalid = |key: &str, problem: String| ConfigError::Invalid {
        key: key.into(),
        at: source.value_origin(key),
        problem,
    };
    let Some(init) = model.get("init_from").and_then(toml::Value::as_str) else {
        return match revision {
            Some(_) => Err(invalid(
                "model.revision",
                "a revision is of a Hub model named by model.init_from, and there is none".into(),
            )),
            None => Ok(()),
        };
    };
    let path = Path::new(init);
    let local = path.exists()
        || path
            .components()
            .next()
            .is_some_and(|first| Path::new(first.as_os_str()).is_dir());
    let hub = match local {
        true => None,
        false => registry.hub_model(init, revision.unwrap_or("main")),
    };
    let Some(resolved) = hub else {
        // A path: a revision beside it is the commit its cache directory was resolved to.
        return match revision {
            Some(r) if path.file_name().is_none_or(|name| name != r) => Err(invalid(
                "model.revision",
                format!(
                    "\"{r}\" is a revision of a Hub model, and model.init_from = \"{init}\" is a \
                     path; leave model.revision out, or name the model by its Hub id"
                ),
            )),
            _ => Ok(()),
        };
    };
    let (dir, commit) = resolved.map_err(|problem| {
        invalid(
            "model.init_from",
            format!("\"{init}\" is no path here, so it names a Hub model: {problem}"),
        )
    })?;
    if let Some(toml::Value::Table(model)) = source.table.get_mut("model") {
        model.insert("init_from".into(), dir.into());
        model.insert("revision".into(), commit.into());
    }
    Ok(())
}

/// `model.arch` from `model.init_from` when the job leaves it out: a pretrained checkpoint's
/// `config.json`, or the `job.toml` of the ddpjob job whose weights it names, says what it is.
fn arch_from_init(source: &mut Source, registry: &dyn Builders) -> Result<(), ConfigError> {
    let Some(toml::Value::Table(model)) = source.table.get("model") else {
        return Ok(());
    };
    let Some(dir) = model.get("init_from").and_then(toml::Value::as_str) else {
        return Ok(());
    };
    if model.contains_key("arch") {
        return Ok(());
    }
    let arch = registry
        .arch_of_init(Path::new(dir))
        .map_err(|problem| ConfigError::Invalid {
            key: "model.init_from".into(),
            at: source.value_origin("model.init_from"),
            problem,
        })?;
    if let Some(toml::Value::Table(model)) = source.table.get_mut("model") {
        model.insert("arch".into(), arch.into());
    }
    Ok(())
}

/// Reads and validates the job file at `path`, with `--set key.path=value` overrides applied,
/// its model and dataset those `registry` has.
pub fn load_with(
    path: &Path,
    overrides: &[String],
    registry: &dyn Builders,
) -> Result<LoadedConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
        path: path.into(),
        cause,
    })?;
    load_str_with(path, text, overrides, registry)
}

/// As [`load_with`], from text already read (`path` is used for messages and the default name).
pub fn load_str_with(
    path: &Path,
    text: String,
    overrides: &[String],
    registry: &dyn Builders,
) -> Result<LoadedConfig, ConfigError> {
    load_source(Source::parse(path, text, overrides)?, registry)
}

/// As [`load_str_with`], for `text` put together from the files `label` names (`path` is the
/// file it stands for): messages name `label` rather than lines of `text`.
pub fn load_composed_with(
    path: &Path,
    label: String,
    text: String,
    overrides: &[String],
    registry: &dyn Builders,
) -> Result<LoadedConfig, ConfigError> {
    let source = Source::parse(path, text, overrides)?.composed_of(label);
    load_source(source, registry)
}

fn load_source(mut source: Source, registry: &dyn Builders) -> Result<LoadedConfig, ConfigError> {
    let path = source.path.clone();
    keys::read_peft_names(&mut source)?;
    let mut notes = keys::leave_other_choices(&mut source);
    notes.extend(keys::leave_stale_checksums(&mut source));
    init_from_hub(&mut source, registry)?;
    adapter::resolve(&mut source)?;
    saved_quantization::resolve(&mut source)?;
    arch_from_init(&mut source, registry)?;
    let custom = custom::extract(&mut source, registry, &mut notes)?;
    source.check_keys()?;
    let mut resolved =
        RawConfig::deserialize(toml::Value::Table(source.table.clone())).map_err(|e| {
            ConfigError::Invalid {
                key: "(document)".into(),
                at: Origin::Defaulted(path.clone()),
                problem: e.to_string(),
            }
        })?;
    let default_name = path
        .file_stem()
        .map_or("job".into(), |s| s.to_string_lossy().into_owned());
    let spec = JobSpec::from_raw(&resolved, &source, &default_name, custom, registry)?;
    resolved.name = Some(spec.name.clone());
    Ok(LoadedConfig {
        spec,
        resolved,
        notes,
    })
}

/// Numbers derived from the spec and the training-set size: what `validate` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub world_size: usize,
    pub train_samples: usize,
    /// Samples each rank sees per epoch (the sampler pads to a multiple of the world size).
    pub samples_per_rank: usize,
    pub global_batch: usize,
    pub micro_batches_per_epoch: usize,
    pub steps_per_epoch: usize,
    pub total_steps: usize,
}

impl JobSpec {
    /// The spec as `world_size` workers run it: with `train.global_batch_size`, each worker's
    /// `batch_size` is its share of one micro-batch, global / (accumulation × workers); the
    /// reason, with the world sizes that would do, when that is not a whole number.
    pub fn for_world_size(&self, world_size: usize) -> Result<JobSpec, String> {
        let t = &self.train;
        let d = &self.distributed;
        if d.world_size_invariant
            && (!world_size.is_power_of_two() || !d.virtual_shards.is_multiple_of(world_size))
        {
            let v = d.virtual_shards;
            let fits: Vec<String> = (0..=v.trailing_zeros())
                .map(|b| (1 << b).to_string())
                .collect();
            return Err(format!(
                "distributed.deterministic = \"world-size-invariant\" cuts each step's batch into \
                 virtual_shards = {v} pieces, which {world_size} workers cannot share evenly: run \
                 on {} worker(s), or change distributed.virtual_shards",
                fits.join(", ")
            ));
        }
        let Some(global) = t.global_batch_size else {
            return Ok(self.clone());
        };
        let accumulation = t.accumulation.max(1);
        if global % accumulation != 0 {
            return Err(format!(
                "train.global_batch_size = {global} does not divide into train.accumulation = \
                 {accumulation} micro-batches: use a multiple of {accumulation}"
            ));
        }
        let micro = global / accumulation;
        if world_size == 0 || !micro.is_multiple_of(world_size) {
            let fits: Vec<String> = (1..=micro.min(1024))
                .filter(|w| micro.is_multiple_of(*w))
                .map(|w| w.to_string())
                .collect();
            return Err(format!(
                "train.global_batch_size = {global} over train.accumulation = {} micro-batches \
                 is {micro} samples each, which {world_size} workers cannot share evenly: run \
                 on {} worker(s), or change train.global_batch_size",
                t.accumulation,
                fits.join(", ")
            ));
        }
        let mut spec = self.clone();
        spec.train.batch_size = micro / world_size;
        Ok(spec)
    }

    /// What the trainer is given of it (see [`TrainPlan`]).
    pub fn train_plan(&self) -> TrainPlan<'_> {
        TrainPlan {
            seed: self.seed,
            train: &self.train,
            checkpoint: &self.checkpoint,
            distributed: &self.distributed,
            drop_last: self.data.drop_last,
            model: self.model.arch(),
        }
    }

    /// `distributed.virtual_shards` when training is world-size-invariant.
    pub fn virtual_shards(&self) -> Option<usize> {
        self.train_plan().virtual_shards()
    }

    /// Micro-batches an epoch's `samples` make on each of `world_size` ranks (see
    /// [`TrainPlan::micro_batches_for`]).
    pub fn micro_batches_for(&self, samples: usize, world_size: usize) -> usize {
        self.train_plan().micro_batches_for(samples, world_size)
    }

    /// The steps of `train_samples` on `world_size` ranks (see [`TrainPlan::plan`]).
    pub fn plan(&self, train_samples: usize, world_size: usize) -> Plan {
        self.train_plan().plan(train_samples, world_size)
    }

    /// Why a job would take no optimizer step (see [`TrainPlan::no_steps`]).
    pub fn no_steps(&self, train_samples: usize, world_size: usize) -> Option<String> {
        self.train_plan().no_steps(train_samples, world_size)
    }

    /// Optimizer steps that `samples` samples of one epoch take on `world_size` ranks.
    pub fn steps_for(&self, samples: usize, world_size: usize) -> usize {
        self.train_plan().steps_for(samples, world_size)
    }
}

/// What the trainer needs of a job, and all it is given: its `[train]`, `[checkpoint]` and
/// `[distributed]`, the seed, whether the sampler drops the tail, and the model's name for its
/// messages. The data's and the model's own keys, logging and `[expect]` are not its business.
#[derive(Debug, Clone, Copy)]
pub struct TrainPlan<'a> {
    pub seed: u64,
    pub train: &'a TrainSpec,
    pub checkpoint: &'a CheckpointSpec,
    pub distributed: &'a DistributedSpec,
    /// `data.drop_last`.
    pub drop_last: bool,
    /// `model.arch`.
    pub model: &'a str,
}

impl TrainPlan<'_> {
    /// `distributed.virtual_shards` when training is world-size-invariant.
    pub fn virtual_shards(&self) -> Option<usize> {
        let d = &self.distributed;
        d.world_size_invariant.then_some(d.virtual_shards)
    }

    /// Micro-batches an epoch's `samples` make on each of `world_size` ranks: world-size-
    /// invariant training takes whole global batches only.
    pub fn micro_batches_for(&self, samples: usize, world_size: usize) -> usize {
        let t = &self.train;
        if self.distributed.world_size_invariant {
            return samples / (t.batch_size * t.accumulation * world_size).max(1) * t.accumulation;
        }
        samples_per_rank(samples, world_size, self.drop_last).div_ceil(t.batch_size)
    }

    pub fn plan(&self, train_samples: usize, world_size: usize) -> Plan {
        let t = &self.train;
        let samples_per_rank = samples_per_rank(train_samples, world_size, self.drop_last);
        let micro_batches_per_epoch = self.micro_batches_for(train_samples, world_size);
        let steps_per_epoch = micro_batches_per_epoch.div_ceil(t.accumulation);
        let uncapped = steps_per_epoch * t.epochs;
        Plan {
            world_size,
            train_samples,
            samples_per_rank,
            global_batch: t.batch_size * t.accumulation * world_size,
            micro_batches_per_epoch,
            steps_per_epoch,
            total_steps: t.max_steps.map_or(uncapped, |m| m.min(uncapped)),
        }
    }

    /// Why a job of `train_samples` samples on `world_size` ranks would take no optimizer step
    /// (each rank's share of the data is empty); `None` when it takes some.
    pub fn no_steps(&self, train_samples: usize, world_size: usize) -> Option<String> {
        if self.plan(train_samples, world_size).total_steps > 0 {
            return None;
        }
        let global = self.train.batch_size * self.train.accumulation * world_size;
        Some(match (train_samples, self.drop_last) {
            (0, _) => "the training split has no samples: give the job data".into(),
            (n, _) if self.distributed.world_size_invariant && n < global => {
                invariant_needs_a_batch(n, global)
            }
            (n, true) => format!(
                "no optimizer step to take: data.drop_last = true drops the {n} training \
                 sample(s), fewer than the {world_size} ranks, leaving each rank none; set \
                 drop_last = false (the tail padded, as torch's DistributedSampler does) or use \
                 fewer workers"
            ),
            (n, false) => format!("no optimizer step to take over {n} training sample(s)"),
        })
    }

    /// Optimizer steps that `samples` samples of one epoch take on `world_size` ranks.
    pub fn steps_for(&self, samples: usize, world_size: usize) -> usize {
        self.micro_batches_for(samples, world_size)
            .div_ceil(self.train.accumulation)
    }
}

/// World-size-invariant training trains on whole global batches: `train_samples` fewer than
/// one (`global`) leave it nothing.
fn invariant_needs_a_batch(train_samples: usize, global: usize) -> String {
    format!(
        "distributed.deterministic = \"world-size-invariant\" trains on whole global batches, but \
         the {train_samples} training samples are fewer than train.global_batch_size = {global}: \
         lower it (a multiple of distributed.virtual_shards) or give more data"
    )
}

/// Samples each rank sees per epoch, as torch's `DistributedSampler` computes `num_samples`:
/// the index list padded by wrapping around to a multiple of `world`, or cut to one with
/// `drop_last`.
pub fn samples_per_rank(len: usize, world: usize, drop_last: bool) -> usize {
    if drop_last && !len.is_multiple_of(world) {
        len.saturating_sub(world).div_ceil(world)
    } else {
        len.div_ceil(world)
    }
}
