//! Turns the raw config into a [`JobSpec`]: every key's own check (declared with the key in
//! `keys.rs`), then what relates keys to each other (a schedule and the learning rate, the
//! expectations and the task). A model's and a dataset's own keys, and how the data fits the
//! model, are their options structs' checks (`custom.rs`). All problems are reported at once,
//! each with its key and where it was written (file:line:col or `--set`).

use super::builders::Builders;
use super::checks::Checker;
use super::custom::CustomParts;
use super::declare::Section;
use super::error::{ConfigError, Origin};
use super::keys::{DataKeys, ExpectKeys, ModelKeys, RawConfig};
use super::lora::{LoraSpec, TargetModules};
use super::quantize::{QuantType, QuantizeSpec};
use super::source::Source;
use super::spec::{Check, DataSpec, Expectation, JobSpec, ModelSpec, ScheduleKind};

/// The longest job name: a directory name, with room for the temporary names beside it.
const MAX_NAME_LEN: usize = 200;

impl JobSpec {
    /// Validates `raw`; `default_name` (the config file's stem) is used when `name` is absent.
    /// `custom` holds the options of a registered model or dataset, already read.
    pub fn from_raw(
        raw: &RawConfig,
        source: &Source,
        default_name: &str,
        custom: CustomParts,
        registry: &dyn Builders,
    ) -> Result<Self, ConfigError> {
        let mut c = Checker {
            source,
            errors: Vec::new(),
        };
        let keys = raw.check(&mut c);
        let name = keys.name.unwrap_or_else(|| default_name.to_string());
        if name.is_empty()
            || name.starts_with(['.', '-'])
            || !name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
        {
            c.fail("name", format!("\"{name}\" is not a usable directory name (nor a command-line argument); use letters, digits, '-', '_' or '.', beginning with a letter, digit or '_'"));
        } else if name.len() > MAX_NAME_LEN {
            // Past a file system's 255-byte limit once `checkpoints/` files sit beside it.
            c.fail(
                "name",
                format!(
                    "is {} characters long; a job name may have at most {MAX_NAME_LEN}",
                    name.len()
                ),
            );
        }
        let model = check_model(&mut c, &keys.model, custom.model, registry);
        let data = check_data(&mut c, &keys.data, custom.data, registry);
        if keys.expect.max_test_perplexity.is_some() && model.language().is_none() {
            c.fail(
                "expect.max_test_perplexity",
                format!(
                    "applies to language models, whose evaluations report perplexity; \
                     model.arch = \"{}\" is a classifier (use min_test_accuracy or \
                     max_test_loss)",
                    model.arch()
                ),
            );
        }
        let train = keys.train;
        objective_problems(&mut c, raw, &model, &data, &keys.expect);
        if model.quantize.is_some() {
            quantize_problems(&mut c, &keys.distributed);
        }
        if raw.train.objective == "dpo" && keys.distributed.sharding == super::spec::Sharding::Full
        {
            c.fail(
                "distributed.sharding",
                "\"full\" gathers the parameters block by block inside a model's own training \
                 pass, and train.objective = \"dpo\" differentiates its loss over the whole \
                 model at once; use sharding = \"optimizer\" or \"gradients\"",
            );
        }
        if let ScheduleKind::Cosine { min_lr } = train.schedule.kind
            && min_lr > train.lr
        {
            c.fail(
                "train.scheduler.min_lr",
                format!("must be in [0, train.lr = {}], got {min_lr}", train.lr),
            );
        }
        if let Some(global) = train.global_batch_size {
            if !matches!(
                source.value_origin("train.batch_size"),
                Origin::Defaulted(_)
            ) {
                c.fail(
                    "train.batch_size",
                    format!(
                        "train.global_batch_size = {global} sets each worker's batch; remove \
                         train.batch_size (or train.global_batch_size to give the per-worker \
                         batch)"
                    ),
                );
            }
            if global % train.accumulation != 0 {
                c.fail(
                    "train.global_batch_size",
                    format!(
                        "{global} samples do not divide into train.accumulation = {} \
                         micro-batches: use a multiple of {}",
                        train.accumulation, train.accumulation
                    ),
                );
            }
        }
        invariance_problems(&mut c, &train, &keys.distributed);
        let blockless = registry.has_blocks(model.arch()) == Some(false);
        if let Some(why) = checkpointing_problem(&model, &train, blockless) {
            c.fail("train.activation_checkpointing", why);
        }
        let sharding = keys.distributed.sharding;
        if blockless && sharding == super::spec::Sharding::Full {
            c.fail(
                "distributed.sharding",
                format!(
                    "\"full\" gathers a model's parameters block by block (the gpt and the \
                     llama have blocks), but model.arch = \"{}\" has none: use \"gradients\"",
                    model.arch()
                ),
            );
        }
        ConfigError::collect(c.errors)?;
        Ok(JobSpec {
            name,
            seed: keys.seed as u64,
            model,
            data,
            train,
            checkpoint: keys.checkpoint,
            distributed: keys.distributed,
            logging: keys.logging,
            expect: expectations(&keys.expect),
        })
    }
}

/// What `distributed.deterministic = "world-size-invariant"` needs of the other keys: a fixed
/// global batch that the pieces divide, no accumulation (the pieces are computed one after
/// another already) and no sharded optimizer (its reduce-scatter sums in the ring's order).
fn invariance_problems(
    c: &mut Checker,
    train: &super::spec::TrainSpec,
    distributed: &super::spec::DistributedSpec,
) {
    if !distributed.world_size_invariant {
        return;
    }
    let v = distributed.virtual_shards;
    match train.global_batch_size {
        None => c.fail(
            "distributed.deterministic",
            format!(
                "\"world-size-invariant\" keeps the global batch whatever the world size: give \
                 train.global_batch_size (a multiple of distributed.virtual_shards = {v}) \
                 instead of train.batch_size"
            ),
        ),
        Some(global) if global % v != 0 => c.fail(
            "train.global_batch_size",
            format!(
                "{global} samples cannot be cut into distributed.virtual_shards = {v} equal \
                 pieces: use a multiple of {v}"
            ),
        ),
        Some(_) => {}
    }
    if train.accumulation != 1 {
        c.fail(
            "train.accumulation",
            "with distributed.deterministic = \"world-size-invariant\" each worker computes its \
             pieces of the batch one after another already (one piece's activations at a \
             time): set it to 1 and size the pieces with distributed.virtual_shards",
        );
    }
    if distributed.sharding != super::spec::Sharding::None {
        c.fail(
            "distributed.sharding",
            "a sharded optimizer reduce-scatters gradients in the ring's order, not in \
             distributed.deterministic = \"world-size-invariant\"'s fixed tree: use \"none\"",
        );
    }
}

/// Why `train.activation_checkpointing` cannot apply to the model as configured, if its
/// registration says it has no blocks to recompute (`blockless`); a model whose registration
/// does not say (a user's) says so itself when it is built.
fn checkpointing_problem(
    model: &ModelSpec,
    train: &super::spec::TrainSpec,
    blockless: bool,
) -> Option<String> {
    (train.activation_checkpointing && blockless).then(|| {
        format!(
            "model.arch = \"{}\" does not recompute its activations (the gpt and the llama \
             do); set it to false",
            model.arch()
        )
    })
}

/// The model: its registered options, already read, and for a language model its window and
/// tokenizer.
fn check_model(
    c: &mut Checker,
    m: &ModelKeys,
    custom: Option<(String, toml::Table)>,
    registry: &dyn Builders,
) -> ModelSpec {
    c.one_of("model.arch", &m.arch, &registry.model_names());
    let (arch, options) = custom.unwrap_or_else(|| (m.arch.clone(), toml::Table::new()));
    let language = match registry.language(&arch, &options) {
        Some(Ok(language)) => Some(language),
        Some(Err(problem)) => {
            c.fail("model", problem);
            None
        }
        None => None,
    };
    let l = &m.lora;
    let lora = (l.r > 0).then(|| LoraSpec {
        r: l.r,
        alpha: l.alpha,
        dropout: l.dropout,
        target_modules: l.target_modules.clone(),
        adapter: (!l.adapter.is_empty()).then(|| l.adapter.clone().into()),
    });
    if let Some(lora) = &lora
        && !c.source.is_stored_job()
    {
        unmatched_targets(c, &m.arch, lora, registry);
    }
    let others = !l.target_modules.is_default() || !l.adapter.is_empty();
    if l.r == 0 && (l.dropout != 0.0 || others || l.alpha != 8.0) {
        c.fail(
            "model.lora.r",
            "is 0 (LoRA off), but other [model.lora] keys are set: give the adapters' rank, \
             e.g. r = 16",
        );
    }
    let q = &m.quantize;
    let quantize = (q.bits == 4).then_some(QuantizeSpec {
        kind: q.kind,
        block_size: q.block_size,
        double_quant: q.double_quant,
    });
    // Anything but the keys' defaults (nf4, single quantisation, blocks of 64).
    let others = q.kind != QuantType::Nf4 || q.double_quant || q.block_size != 64;
    if q.bits == 0 && others {
        c.fail(
            "model.quantize.bits",
            "is 0 (off), but other [model.quantize] keys are set: set bits = 4 for a 4-bit base",
        );
    }
    ModelSpec {
        arch,
        options,
        freeze: m.freeze.clone(),
        lora,
        quantize,
        language,
    }
}

/// What a 4-bit base (`[model.quantize]`) cannot go with in this version.
fn quantize_problems(c: &mut Checker, d: &super::spec::DistributedSpec) {
    if d.sharding == super::spec::Sharding::Full {
        c.fail(
            "distributed.sharding",
            "\"full\" shards parameters, and a 4-bit base is no parameter (every worker keeps \
             it whole, about an eighth of its f32 size); use sharding = \"optimizer\" or \
             \"gradients\" with [model.quantize]",
        );
    }
    if d.device == super::spec::DeviceChoice::Cuda {
        c.fail(
            "distributed.device",
            "\"cuda\": the 4-bit layers of [model.quantize] run on CPU workers in this \
             version (their CUDA kernels are not built yet); set device = \"cpu\", or leave \
             [model.quantize] out to train LoRA over the 16-bit base on the GPU",
        );
    }
}

/// What `train.objective` needs of the rest: DPO trains a language model on pairs of
/// instruction data; its keys and expectations are refused without it.
fn objective_problems(
    c: &mut Checker,
    raw: &RawConfig,
    model: &ModelSpec,
    data: &DataSpec,
    expect: &ExpectKeys,
) {
    let dpo = raw.train.objective == "dpo";
    let stored = c.source.is_stored_job();
    if !dpo && !raw.train.dpo.is_default() && !stored {
        c.fail(
            "train.dpo",
            format!(
                "applies only with train.objective = \"dpo\", and this job's is \"{}\"; set \
                 train.objective = \"dpo\" or remove [train.dpo]",
                raw.train.objective
            ),
        );
    }
    let dpo_expect = [
        ("min_rewards_accuracies", expect.min_rewards_accuracies),
        ("min_rewards_margins", expect.min_rewards_margins),
    ];
    for (key, value) in dpo_expect {
        if value.is_some() && !dpo {
            c.fail(
                &format!("expect.{key}"),
                "applies to train.objective = \"dpo\", whose evaluations report rewards",
            );
        }
    }
    if !dpo {
        return;
    }
    if model.language().is_none() {
        c.fail(
            "train.objective",
            format!(
                "\"dpo\" tunes a language model, and model.arch = \"{}\" is not one",
                model.arch()
            ),
        );
    }
    if !["jsonl", "parquet", "arrow"].contains(&data.dataset.as_str()) {
        c.fail(
            "train.objective",
            format!(
                "\"dpo\" trains on pairs {{\"prompt\", \"chosen\", \"rejected\"}}: set \
                 data.dataset = \"jsonl\", \"parquet\" or \"arrow\" (this job's is \"{}\")",
                data.dataset
            ),
        );
    }
    if expect.max_test_perplexity.is_some() {
        c.fail(
            "expect.max_test_perplexity",
            "a DPO job's evaluations report rewards, not perplexity; use \
             min_rewards_accuracies or max_test_loss",
        );
    }
}

/// The expectations that are set, in the order of [`Check::ALL`].
fn expectations(e: &ExpectKeys) -> Vec<Expectation> {
    let values = [
        e.min_test_accuracy,
        e.max_test_loss,
        e.max_test_perplexity,
        e.max_final_loss,
        e.max_wall_s,
        e.min_train_samples_per_s,
        e.min_rewards_accuracies,
        e.min_rewards_margins,
    ];
    Check::ALL
        .into_iter()
        .zip(values)
        .filter_map(|(check, threshold)| {
            Some(Expectation {
                check,
                threshold: threshold?,
            })
        })
        .collect()
}

/// The data: its registered options, already read and completed for the model.
fn check_data(
    c: &mut Checker,
    d: &DataKeys,
    custom: Option<(String, toml::Table)>,
    registry: &dyn Builders,
) -> DataSpec {
    c.one_of("data.dataset", &d.dataset, &registry.dataset_names());
    let (dataset, options) = custom.unwrap_or_else(|| (d.dataset.clone(), toml::Table::new()));
    DataSpec {
        paths: registry.dataset_paths(&dataset),
        dataset,
        options,
        drop_last: d.drop_last,
    }
}

/// A listed `target_modules` name whose last part is none of the arch's linear layers: PEFT
/// adapts the names that match and ignores the others, so a misspelt `v_prj` beside `q_proj`
/// would adapt less, silently. Checked for a new job only (an older job's `job.toml` keeps
/// what it trained with), and not for a PEFT adapter's list (one list may serve several
/// architectures).
fn unmatched_targets(c: &mut Checker, arch: &str, lora: &LoraSpec, registry: &dyn Builders) {
    let (TargetModules::Names(names), None) = (&lora.target_modules, &lora.adapter) else {
        return;
    };
    let Some(kinds) = registry.lora_layers(arch) else {
        return;
    };
    let unmatched = names.iter().find(|name| {
        let last = name.rsplit('.').next().unwrap_or(name);
        *name != "all-linear" && !kinds.contains(&last)
    });
    if let Some(name) = unmatched {
        let mut sorted = kinds.to_vec();
        sorted.sort();
        let hint = super::schema::closest(name, kinds.iter().copied())
            .map_or(String::new(), |k| format!(" (did you mean \"{k}\"?)"));
        c.fail(
            "model.lora.target_modules",
            format!(
                "names \"{name}\"{hint}, which matches none of the model's linear layers: {}, \
                 or \"all-linear\"",
                sorted.join(", ")
            ),
        );
    }
}
