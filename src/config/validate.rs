//! Turns the raw config into a [`JobSpec`], checking every value; all problems are reported at
//! once, each with its key and where it was written (file:line:col or the `--set` argument).

use std::path::PathBuf;

use super::custom::CustomParts;
use super::error::ConfigError;
use super::raw::RawConfig;
use super::source::Source;
use super::spec::{
    Backend, Check, CheckpointSpec, DataSpec, DatasetKind, DeviceChoice, DistributedSpec,
    Expectation, GptSpec, JobSpec, LoggingSpec, ModelSpec, OnWriteError, OptimizerSpec, Precision,
    ScheduleKind, ScheduleSpec, SyntheticSpec, TextSpec, TokenDtype, TokenizerKind, TokensSpec,
    TrainSpec,
};
use crate::registry::Registry;

/// How to get GPU workers, for messages of a build without them.
const GPU_BUILD: &str = "this ddpjob was built without GPU support; build it with `cargo build \
     --release --features cuda` (needs the CUDA toolkit; see the README's GPU section)";

/// A week: longer than any collective should stall, and safe to add to a clock.
const MAX_TIMEOUT_S: i64 = 7 * 24 * 3600;

/// Collects every invalid value instead of stopping at the first.
struct Checker<'a> {
    source: &'a Source,
    errors: Vec<ConfigError>,
}

impl Checker<'_> {
    fn fail(&mut self, key: &str, problem: impl Into<String>) {
        self.errors.push(ConfigError::Invalid {
            key: key.to_string(),
            at: self.source.value_origin(key),
            problem: problem.into(),
        });
    }

    fn at_least(&mut self, key: &str, value: i64, min: i64) -> usize {
        if value < min {
            self.fail(key, format!("must be at least {min}, got {value}"));
        }
        value.max(min).max(0) as usize
    }

    fn in_int_range(&mut self, key: &str, value: i64, min: i64, max: i64) -> usize {
        if !(min..=max).contains(&value) {
            self.fail(key, format!("must be between {min} and {max}, got {value}"));
        }
        value.clamp(min, max).max(0) as usize
    }

    fn positive(&mut self, key: &str, value: f64) -> f64 {
        if !(value.is_finite() && value > 0.0) {
            self.fail(key, format!("must be a number greater than 0, got {value}"));
        }
        value
    }

    fn in_range(&mut self, key: &str, value: f64, lo: f64, hi_exclusive: f64) -> f64 {
        if !(value >= lo && value < hi_exclusive) {
            self.fail(
                key,
                format!("must be in [{lo}, {hi_exclusive}), got {value}"),
            );
        }
        value
    }

    fn one_of(&mut self, key: &str, value: &str, choices: &[&str]) {
        if !choices.contains(&value) {
            let quoted: Vec<String> = choices.iter().map(|c| format!("\"{c}\"")).collect();
            self.fail(
                key,
                format!(
                    "unknown value \"{value}\"; expected one of {}",
                    quoted.join(", ")
                ),
            );
        }
    }
}

impl JobSpec {
    /// Validates `raw`; `default_name` (the config file's stem) is used when `name` is absent.
    /// `custom` holds the options of a registered model or dataset, already read.
    pub fn from_raw(
        raw: &RawConfig,
        source: &Source,
        default_name: &str,
        custom: CustomParts,
        registry: &Registry,
    ) -> Result<Self, ConfigError> {
        let mut c = Checker {
            source,
            errors: Vec::new(),
        };
        let name = raw.name.clone().unwrap_or_else(|| default_name.to_string());
        if name.is_empty()
            || name.starts_with('.')
            || !name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
        {
            c.fail("name", format!("\"{name}\" is not a usable directory name; use letters, digits, '-', '_' or '.'"));
        }
        let seed = c.at_least("seed", raw.seed, 0) as u64;

        c.one_of("model.arch", &raw.model.arch, &registry.model_names());
        let hidden = raw
            .model
            .hidden
            .iter()
            .map(|&h| c.at_least("model.hidden", h, 1))
            .collect();
        let model = match (custom.model, raw.model.arch.as_str()) {
            (Some((arch, options)), _) => ModelSpec::Custom { arch, options },
            (None, "cnn") => ModelSpec::Cnn,
            (None, "gpt") => ModelSpec::Gpt(check_gpt(&mut c, raw)),
            (None, _) => ModelSpec::Mlp { hidden },
        };
        if !matches!(model, ModelSpec::Gpt(_)) {
            let m = &raw.model;
            let given = [
                ("n_layer", m.n_layer.is_some()),
                ("n_head", m.n_head.is_some()),
                ("n_embd", m.n_embd.is_some()),
                ("block_size", m.block_size.is_some()),
                ("dropout", m.dropout.is_some()),
                ("bias", m.bias.is_some()),
                ("vocab_size", m.vocab_size.is_some()),
            ];
            for (key, _) in given.iter().filter(|(_, set)| *set) {
                c.fail(
                    &format!("model.{key}"),
                    format!(
                        "applies to model.arch = \"gpt\" only, but the arch is \"{}\"; remove it",
                        raw.model.arch
                    ),
                );
            }
        }

        let data = check_data(&mut c, raw, &model, custom.data, registry);
        let train = check_train(&mut c, raw);

        let ck = &raw.checkpoint;
        let nonzero = |v: usize| (v > 0).then_some(v);
        let checkpoint = CheckpointSpec {
            every_epochs: nonzero(c.at_least("checkpoint.every_epochs", ck.every_epochs, 0)),
            every_steps: nonzero(c.at_least("checkpoint.every_steps", ck.every_steps, 0)),
            keep_last: nonzero(c.at_least("checkpoint.keep_last", ck.keep_last, 0)),
            keep_best: ck.keep_best,
            on_write_error: {
                c.one_of(
                    "checkpoint.on_write_error",
                    &ck.on_write_error,
                    &["fail", "warn"],
                );
                if ck.on_write_error == "warn" {
                    OnWriteError::Warn
                } else {
                    OnWriteError::Fail
                }
            },
        };

        let d = &raw.distributed;
        let nproc_per_node = match &d.nproc_per_node {
            toml::Value::Integer(n) => Some(c.at_least("distributed.nproc_per_node", *n, 1)),
            _ => None,
        };
        let (device, devices, backend) = check_devices(&mut c, raw);
        let distributed = DistributedSpec {
            nproc_per_node,
            timeout_s: c.in_int_range("distributed.timeout_s", d.timeout_s, 1, MAX_TIMEOUT_S)
                as u64,
            max_restarts: c.at_least("distributed.max_restarts", d.max_restarts, 0),
            bucket_bytes: (c.positive("distributed.bucket_mb", d.bucket_mb) * 1e6) as usize,
            device,
            devices,
            backend,
        };

        let expect = check_expect(&mut c, raw);

        ConfigError::collect(c.errors)?;
        Ok(JobSpec {
            name,
            seed,
            model,
            data,
            train,
            checkpoint,
            distributed,
            logging: LoggingSpec {
                tensorboard: raw.logging.tensorboard,
            },
            expect,
        })
    }
}

fn check_expect(c: &mut Checker, raw: &RawConfig) -> Vec<Expectation> {
    let e = &raw.expect;
    let values = [
        e.min_test_accuracy,
        e.max_test_loss,
        e.max_final_loss,
        e.max_wall_s,
        e.min_train_samples_per_s,
    ];
    Check::ALL
        .into_iter()
        .zip(values)
        .filter_map(|(check, value)| {
            let threshold = value?;
            let key = format!("expect.{}", check.key());
            if check == Check::MinTestAccuracy {
                if threshold > 1.0 && threshold <= 100.0 {
                    let fraction = threshold / 100.0;
                    c.fail(
                        &key,
                        format!("is a fraction in [0, 1], got {threshold}; write {fraction} for {threshold}%"),
                    );
                } else if !(0.0..=1.0).contains(&threshold) {
                    c.fail(&key, format!("must be a fraction in [0, 1], got {threshold}"));
                }
            } else {
                c.positive(&key, threshold);
            }
            Some(Expectation { check, threshold })
        })
        .collect()
}

/// `model.*` of a gpt.
fn check_gpt(c: &mut Checker, raw: &RawConfig) -> GptSpec {
    let mut m = raw.model.clone();
    m.resolve_gpt();
    let n_head = c.at_least("model.n_head", m.n_head.unwrap_or(4), 1);
    let n_embd = c.at_least("model.n_embd", m.n_embd.unwrap_or(128), 1);
    if n_head > 0 && n_embd % n_head != 0 {
        c.fail(
            "model.n_embd",
            format!(
                "must be divisible by model.n_head = {n_head} (each head takes n_embd / n_head \
                 channels), got {n_embd}; e.g. {}",
                (n_embd / n_head).max(1) * n_head
            ),
        );
    }
    let dropout = m.dropout.unwrap_or(0.0);
    if !(0.0..1.0).contains(&dropout) {
        c.fail("model.dropout", format!("must be in [0, 1), got {dropout}"));
    }
    GptSpec {
        n_layer: c.at_least("model.n_layer", m.n_layer.unwrap_or(4), 1),
        n_head,
        n_embd,
        block_size: c.at_least("model.block_size", m.block_size.unwrap_or(64), 1),
        dropout,
        bias: m.bias.unwrap_or(true),
        vocab_size: m
            .vocab_size
            .map(|v| c.in_int_range("model.vocab_size", v, 1, 1 << 31)),
    }
}

/// `data.*` of `text` and `tokens` data, and how they fit the model.
fn check_text_data(c: &mut Checker, raw: &RawConfig, model: &ModelSpec) -> Option<DatasetKind> {
    let d = &raw.data;
    let is_text = matches!(d.dataset.as_str(), "text" | "tokens");
    let is_gpt = matches!(model, ModelSpec::Gpt(_));
    if is_gpt && !is_text {
        c.fail(
            "data.dataset",
            format!(
                "model.arch = \"gpt\" learns from token sequences: use \"text\" or \"tokens\", not \"{}\"",
                d.dataset
            ),
        );
    } else if is_text && !is_gpt {
        c.fail(
            "model.arch",
            format!(
                "data.dataset = \"{}\" is token sequences: it needs model.arch = \"gpt\", not \"{}\"",
                d.dataset, raw.model.arch
            ),
        );
    }
    let text_keys = [
        ("path", d.path.is_some(), "text"),
        ("tokenizer", d.tokenizer.is_some(), "text"),
        ("val_fraction", d.val_fraction.is_some(), "text"),
        ("train_path", d.train_path.is_some(), "tokens"),
        ("val_path", d.val_path.is_some(), "tokens"),
        ("token_dtype", d.token_dtype.is_some(), "tokens"),
    ];
    for (key, _, kind) in text_keys
        .iter()
        .filter(|(_, set, kind)| *set && *kind != d.dataset)
    {
        c.fail(
            &format!("data.{key}"),
            format!(
                "applies to data.dataset = \"{kind}\" only, but the dataset is \"{}\"; remove it",
                d.dataset
            ),
        );
    }
    let required = |c: &mut Checker, key: &str, value: &Option<String>, example: &str| match value
        .as_deref()
    {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => {
            c.fail(
                key,
                format!(
                    "is required for data.dataset = \"{}\", e.g. {key} = \"{example}\"",
                    d.dataset
                ),
            );
            PathBuf::new()
        }
    };
    match d.dataset.as_str() {
        "text" => {
            let path = required(c, "data.path", &d.path, "data/shakespeare/input.txt");
            let tokenizer = d.tokenizer.as_deref().unwrap_or("char");
            if !matches!(tokenizer, "char" | "byte") {
                c.fail(
                    "data.tokenizer",
                    format!("unknown tokenizer \"{tokenizer}\"; expected \"char\" or \"byte\""),
                );
            }
            let val_fraction = d.val_fraction.unwrap_or(0.1);
            if !(val_fraction > 0.0 && val_fraction < 1.0) {
                c.fail(
                    "data.val_fraction",
                    format!("must be in (0, 1), got {val_fraction}; 0.1 keeps the last 10% for validation"),
                );
            }
            Some(DatasetKind::Text(TextSpec {
                path,
                tokenizer: if tokenizer == "byte" {
                    TokenizerKind::Byte
                } else {
                    TokenizerKind::Char
                },
                val_fraction,
            }))
        }
        "tokens" => {
            let train_path = required(c, "data.train_path", &d.train_path, "data/owt/train.bin");
            let val_path = required(c, "data.val_path", &d.val_path, "data/owt/val.bin");
            let dtype = d.token_dtype.as_deref().unwrap_or("u16");
            c.one_of("data.token_dtype", dtype, &["u16", "u32"]);
            if let ModelSpec::Gpt(g) = model {
                match g.vocab_size {
                    None => c.fail(
                        "model.vocab_size",
                        "is required for data.dataset = \"tokens\": the files do not say their \
                         vocabulary; e.g. 50304 for GPT-2's tokenizer padded as nanoGPT pads it",
                    ),
                    Some(v) if dtype == "u16" && v > 65536 => c.fail(
                        "model.vocab_size",
                        format!("{v} tokens do not fit data.token_dtype = \"u16\"; use \"u32\""),
                    ),
                    _ => {}
                }
            }
            Some(DatasetKind::Tokens(TokensSpec {
                train_path,
                val_path,
                dtype: if dtype == "u32" {
                    TokenDtype::U32
                } else {
                    TokenDtype::U16
                },
            }))
        }
        _ => None,
    }
}

fn check_data(
    c: &mut Checker,
    raw: &RawConfig,
    model: &ModelSpec,
    custom: Option<(String, toml::Table)>,
    registry: &Registry,
) -> DataSpec {
    let d = &raw.data;
    if let Some((name, options)) = custom {
        // A registered dataset's own keys were read by its options struct; a gpt on it is
        // checked when the model is built (the dataset says what it yields).
        return DataSpec {
            dataset: DatasetKind::Custom { name, options },
            root: PathBuf::from("."),
            download: false,
            drop_last: d.drop_last,
            mirrors: Vec::new(),
            checksums: Default::default(),
            normalize: None,
        };
    }
    c.one_of("data.dataset", &d.dataset, &registry.dataset_names());
    let text = check_text_data(c, raw, model);
    let s = &d.synthetic;
    let shape: Vec<usize> = s
        .shape
        .iter()
        .map(|&v| c.at_least("data.synthetic.shape", v, 1))
        .collect();
    let shape = match shape.as_slice() {
        &[ch, h, w] => [ch, h, w],
        _ => {
            c.fail(
                "data.synthetic.shape",
                format!(
                    "must have 3 entries [channels, height, width], got {}",
                    shape.len()
                ),
            );
            [1, 28, 28]
        }
    };
    let dataset = match (text, d.dataset.as_str()) {
        (Some(text), _) => text,
        (None, "fashion-mnist") => DatasetKind::FashionMnist,
        (None, "synthetic") => DatasetKind::Synthetic(SyntheticSpec {
            train_samples: c.at_least("data.synthetic.train_samples", s.train_samples, 1),
            test_samples: c.at_least("data.synthetic.test_samples", s.test_samples, 1),
            shape,
            classes: c.at_least("data.synthetic.classes", s.classes, 2),
            noise: {
                if !(s.noise.is_finite() && s.noise >= 0.0) {
                    c.fail(
                        "data.synthetic.noise",
                        format!("must be 0 or more, got {}", s.noise),
                    );
                }
                s.noise as f32
            },
        }),
        (None, _) => DatasetKind::Mnist,
    };
    let channels = if matches!(dataset, DatasetKind::Synthetic(_)) {
        shape[0]
    } else {
        1
    };
    let (height, width) = if matches!(dataset, DatasetKind::Synthetic(_)) {
        (shape[1], shape[2])
    } else {
        (28, 28)
    };
    if *model == ModelSpec::Cnn && (height < 6 || width < 6) {
        c.fail(
            "data.synthetic.shape",
            format!("the cnn needs images of at least 6x6, got {height}x{width}"),
        );
    }
    let normalize = if d.mean.is_empty() && d.std.is_empty() {
        None
    } else {
        if d.mean.len() != channels {
            c.fail(
                "data.mean",
                format!(
                    "needs one value per channel ({channels}), got {}",
                    d.mean.len()
                ),
            );
        }
        if d.std.len() != d.mean.len() {
            c.fail(
                "data.std",
                format!(
                    "needs as many values as data.mean ({}), got {}",
                    d.mean.len(),
                    d.std.len()
                ),
            );
        }
        for &v in &d.std {
            c.positive("data.std", v);
        }
        Some((
            d.mean.iter().map(|&v| v as f32).collect(),
            d.std.iter().map(|&v| v as f32).collect(),
        ))
    };
    for (file, digest) in &d.checksums {
        if digest.len() != 64 || !digest.chars().all(|ch| ch.is_ascii_hexdigit()) {
            c.fail(
                &format!("data.checksums.{file}"),
                "must be a SHA-256 digest: 64 hex digits",
            );
        }
    }
    let root = d.root.clone().unwrap_or_else(|| match &dataset {
        DatasetKind::Text(t) => t
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or(".".into(), |p| p.display().to_string()),
        _ => format!("data/{}", d.dataset),
    });
    DataSpec {
        dataset,
        root: PathBuf::from(root),
        download: d.download,
        drop_last: d.drop_last,
        mirrors: d.mirrors.clone(),
        checksums: d.checksums.clone(),
        normalize,
    }
}

fn check_train(c: &mut Checker, raw: &RawConfig) -> TrainSpec {
    let t = &raw.train;
    c.one_of("train.optimizer", &t.optimizer, &["sgd", "adam", "adamw"]);
    let weight_decay = t.weight_decay;
    if !(weight_decay.is_finite() && weight_decay >= 0.0) {
        c.fail(
            "train.weight_decay",
            format!("must be 0 or more, got {weight_decay}"),
        );
    }
    let (beta1, beta2) = match t.betas.as_slice() {
        &[b1, b2] => (
            c.in_range("train.betas", b1, 0.0, 1.0),
            c.in_range("train.betas", b2, 0.0, 1.0),
        ),
        other => {
            c.fail(
                "train.betas",
                format!("must be two numbers [beta1, beta2], got {}", other.len()),
            );
            (0.9, 0.999)
        }
    };
    let eps = c.positive("train.eps", t.eps);
    let momentum = c.in_range("train.momentum", t.momentum, 0.0, 1.0);
    if t.nesterov && momentum == 0.0 {
        c.fail(
            "train.nesterov",
            "Nesterov momentum needs train.momentum > 0",
        );
    }
    let optimizer = match t.optimizer.as_str() {
        "sgd" => OptimizerSpec::Sgd {
            momentum,
            nesterov: t.nesterov,
            weight_decay,
        },
        "adamw" => OptimizerSpec::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        },
        _ => OptimizerSpec::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
        },
    };
    if !(t.grad_clip_norm.is_finite() && t.grad_clip_norm >= 0.0) {
        c.fail(
            "train.grad_clip_norm",
            format!("must be 0 (off) or more, got {}", t.grad_clip_norm),
        );
    }
    let lr = c.positive("train.lr", t.lr);
    let s = &t.scheduler;
    c.one_of(
        "train.scheduler.kind",
        &s.kind,
        &["constant", "step", "cosine"],
    );
    let kind = match s.kind.as_str() {
        "step" => ScheduleKind::Step {
            step_size: c.at_least("train.scheduler.step_size", s.step_size, 1),
            gamma: c.positive("train.scheduler.gamma", s.gamma),
        },
        "cosine" => {
            if !(s.min_lr >= 0.0 && s.min_lr <= lr) {
                c.fail(
                    "train.scheduler.min_lr",
                    format!("must be in [0, train.lr = {lr}], got {}", s.min_lr),
                );
            }
            ScheduleKind::Cosine { min_lr: s.min_lr }
        }
        _ => ScheduleKind::Constant,
    };
    let precision = check_precision(c, raw);
    TrainSpec {
        precision,
        flush_denormals: t.flush_denormals,
        epochs: c.at_least("train.epochs", t.epochs, 1),
        batch_size: c.at_least("train.batch_size", t.batch_size, 1),
        accumulation: c.at_least("train.accumulation", t.accumulation, 1),
        lr,
        optimizer,
        grad_clip_norm: (t.grad_clip_norm > 0.0).then_some(t.grad_clip_norm),
        max_steps: Some(c.at_least("train.max_steps", t.max_steps, 0)).filter(|&m| m > 0),
        eval_batch_size: c.at_least("train.eval_batch_size", t.eval_batch_size, 1),
        eval_every: Some(c.at_least("train.eval_every", t.eval_every, 0)).filter(|&n| n > 0),
        eval_batches: Some(c.at_least("train.eval_batches", t.eval_batches, 0)).filter(|&n| n > 0),
        log_every: c.at_least("train.log_every", t.log_every, 1),
        schedule: ScheduleSpec {
            kind,
            warmup_steps: c.at_least("train.scheduler.warmup_steps", s.warmup_steps, 0),
        },
    }
}

/// `distributed.device`, `devices` and `backend`, and how they fit together and with this build.
/// Whether there are enough GPUs for the workers is the launcher's to say (`device::place`).
fn check_devices(c: &mut Checker, raw: &RawConfig) -> (DeviceChoice, Option<Vec<usize>>, Backend) {
    let d = &raw.distributed;
    let gpu_build = cfg!(feature = "cuda");
    c.one_of("distributed.device", &d.device, &["auto", "cpu", "cuda"]);
    let device = match d.device.as_str() {
        "cpu" => DeviceChoice::Cpu,
        "cuda" => DeviceChoice::Cuda,
        _ => DeviceChoice::Auto,
    };
    if device == DeviceChoice::Cuda && !gpu_build {
        c.fail(
            "distributed.device",
            format!("\"cuda\" needs GPU workers: {GPU_BUILD}"),
        );
    }
    c.one_of("distributed.backend", &d.backend, &["auto", "tcp", "nccl"]);
    let backend = match d.backend.as_str() {
        "tcp" => Backend::Tcp,
        "nccl" => Backend::Nccl,
        _ => Backend::Auto,
    };
    if backend == Backend::Nccl && !gpu_build {
        c.fail(
            "distributed.backend",
            format!("\"nccl\" needs GPU workers: {GPU_BUILD}; or use \"auto\""),
        );
    } else if backend == Backend::Nccl && device == DeviceChoice::Cpu {
        c.fail(
            "distributed.backend",
            "\"nccl\" reduces on GPUs, but distributed.device = \"cpu\"; use backend \"tcp\" (or \"auto\") for CPU workers",
        );
    }
    let devices = d.devices.as_ref().map(|list| {
        let ordinals: Vec<usize> = list
            .iter()
            .map(|&v| c.at_least("distributed.devices", v, 0))
            .collect();
        if ordinals.is_empty() {
            c.fail(
                "distributed.devices",
                "must name at least one GPU, e.g. [0]; leave it out to use every visible GPU",
            );
        }
        let mut sorted = ordinals.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ordinals.len() {
            c.fail(
                "distributed.devices",
                format!("names a GPU twice: {list:?}; one worker per GPU"),
            );
        }
        if !gpu_build {
            c.fail("distributed.devices", format!("picks GPUs: {GPU_BUILD}"));
        } else if device == DeviceChoice::Cpu {
            c.fail(
                "distributed.devices",
                "picks GPUs, but distributed.device = \"cpu\"; remove one of them",
            );
        }
        ordinals
    });
    (device, devices, backend)
}

/// `train.precision`.
fn check_precision(c: &mut Checker, raw: &RawConfig) -> Precision {
    c.one_of("train.precision", &raw.train.precision, &["f32", "bf16"]);
    match raw.train.precision.as_str() {
        "bf16" => Precision::Bf16,
        _ => Precision::F32,
    }
}
