//! The validated job: what the rest of the program sees. Built once from the raw config by
//! `validate.rs`; nothing here can hold an invalid value.

use std::path::PathBuf;

pub use super::builders::LanguageModelSpec;
use super::lora::LoraSpec;
use super::quantize::QuantizeSpec;

// The sections whose checked keys are the spec itself, declared in `keys.rs`.
pub use super::keys::{CheckpointSpec, DistributedSpec, LoggingSpec, ScheduleSpec, TrainSpec};

#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    pub name: String,
    pub seed: u64,
    pub model: ModelSpec,
    pub data: DataSpec,
    pub train: TrainSpec,
    pub checkpoint: CheckpointSpec,
    pub distributed: DistributedSpec,
    pub logging: LoggingSpec,
    /// `[expect]`, in the order of [`Check::ALL`].
    pub expect: Vec<Expectation>,
}

/// `[model]`: a registered model (ddpjob's own `mlp`, `cnn`, `gpt`, `llama`, or one the
/// binary's author registered) and its keys but `arch`, with the defaults of its options
/// struct written out.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub arch: String,
    pub options: toml::Table,
    /// `model.freeze`: names, module prefixes or globs of the parameters that do not train.
    pub freeze: Vec<String>,
    /// `[model.lora]`, when `r` > 0.
    pub lora: Option<LoraSpec>,
    /// `[model.quantize]`, when `bits` is 4 (QLoRA's 4-bit base).
    pub quantize: Option<QuantizeSpec>,
    /// For a language model: its window and tokenizer.
    pub language: Option<LanguageModelSpec>,
}

impl ModelSpec {
    /// `cnn`, `mlp (hidden = [256, 256])`, `gpt (n_layer = 4, ...)`.
    pub fn describe(&self) -> String {
        let pairs: Vec<String> = self
            .options
            .iter()
            .map(|(k, v)| format!("{k} = {v}"))
            .collect();
        let mut described = match pairs.is_empty() {
            true => self.arch.clone(),
            false => format!("{} ({})", self.arch, pairs.join(", ")),
        };
        if let Some(l) = &self.lora {
            described += &format!(", LoRA r = {} alpha = {}", l.r, l.alpha);
        }
        if let Some(q) = &self.quantize {
            described += &format!(", base in {}", q.describe());
        }
        if !self.freeze.is_empty() {
            described += &format!(", frozen {:?}", self.freeze);
        }
        described
    }

    /// The `model.arch` value.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// `model.freeze`: the patterns of the parameters that do not train.
    pub fn freeze(&self) -> &[String] {
        &self.freeze
    }

    /// `[model.lora]`, when on.
    pub fn lora(&self) -> Option<&LoraSpec> {
        self.lora.as_ref()
    }

    /// `[model.quantize]`, when on.
    pub fn quantize(&self) -> Option<&QuantizeSpec> {
        self.quantize.as_ref()
    }

    /// This model without the PEFT adapter its LoRA layers start from: built to load weights
    /// of the job that hold the adapters as trained (a checkpoint, the final weights), which
    /// need the adapter's directory no more.
    pub fn without_adapter(&self) -> ModelSpec {
        let mut spec = self.clone();
        if let Some(lora) = &mut spec.lora {
            lora.adapter = None;
        }
        spec
    }

    /// The window and tokenizer of a language model; `None` for a classifier.
    pub fn language(&self) -> Option<LanguageModelSpec> {
        self.language.clone()
    }

    /// The options its registered builder receives: `[model]` without `arch`.
    pub fn options(&self) -> &toml::Table {
        &self.options
    }

    /// `model.init_from`, for a model that starts from another checkpoint.
    pub fn init_from(&self) -> Option<&str> {
        self.options.get("init_from")?.as_str()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerKind {
    /// The file's distinct characters in sorted order (nanoGPT's `prepare.py`).
    Char,
    /// The 256 byte values.
    Byte,
    /// A Hugging Face `tokenizer.json` (BPE, WordPiece, Unigram...): the file's path.
    HuggingFace(PathBuf),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    pub fn bytes(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }
}

/// `[data]`: a registered dataset (ddpjob's own `mnist`, `fashion-mnist`, `synthetic`,
/// `text`, `tokens`, or one the binary's author registered) and its keys but `dataset` and
/// `drop_last`, with the defaults of its options struct written out and completed for the
/// model.
#[derive(Debug, Clone, PartialEq)]
pub struct DataSpec {
    pub dataset: String,
    pub options: toml::Table,
    /// The keys of `options` that hold paths relative to the working directory
    /// (`DatasetOptions::PATHS`).
    pub paths: &'static [&'static str],
    /// DistributedSampler's `drop_last`: drop the tail instead of padding it by wrap-around.
    pub drop_last: bool,
}

impl DataSpec {
    /// The `data.dataset` value.
    pub fn name(&self) -> &str {
        &self.dataset
    }

    /// The options its registered opener receives: `[data]` without `dataset` and
    /// `drop_last`.
    pub fn options(&self) -> &toml::Table {
        &self.options
    }
}

impl OptimizerSpec {
    /// The `train.optimizer` value.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerSpec::Sgd { .. } => "sgd",
            OptimizerSpec::Adam { .. } => "adam",
            OptimizerSpec::AdamW { .. } => "adamw",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerSpec {
    Sgd {
        momentum: f64,
        nesterov: bool,
        weight_decay: f64,
    },
    Adam {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
}

impl OptimizerSpec {
    /// The same optimiser with weight decay 0, for parameters exempt from it.
    pub fn without_weight_decay(self) -> Self {
        match self {
            OptimizerSpec::Sgd {
                momentum, nesterov, ..
            } => OptimizerSpec::Sgd {
                momentum,
                nesterov,
                weight_decay: 0.0,
            },
            OptimizerSpec::Adam {
                beta1, beta2, eps, ..
            } => OptimizerSpec::Adam {
                beta1,
                beta2,
                eps,
                weight_decay: 0.0,
            },
            OptimizerSpec::AdamW {
                beta1, beta2, eps, ..
            } => OptimizerSpec::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay: 0.0,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScheduleKind {
    Constant,
    /// Multiply by `gamma` every `step_size` epochs (torch's StepLR stepped once per epoch).
    Step {
        step_size: usize,
        gamma: f64,
    },
    /// Cosine from the peak to `min_lr` over the run.
    Cosine {
        min_lr: f64,
    },
}

/// What a failed checkpoint write does to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnWriteError {
    /// Stop the job (the previous checkpoint is intact), so it never trains on unprotected.
    Fail,
    /// Log the error and keep training; the previous checkpoint stays the newest.
    Warn,
}

/// `distributed.device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// A GPU per worker when the build has CUDA and a GPU is visible, else the CPU.
    Auto,
    Cpu,
    /// GPUs, or fail: never silently slower.
    Cuda,
}

/// `distributed.backend`: the collectives between workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// NCCL for GPU workers, the tcp ring for CPU ones.
    Auto,
    Tcp,
    Nccl,
}

impl Backend {
    /// Its name as the key says it (`ddpjob_comm::choose` picks the backend by it).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Tcp => "tcp",
            Backend::Nccl => "nccl",
        }
    }
}

/// `distributed.sharding`: what each worker keeps of the training state (ZeRO's stages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Everything, on every worker (DDP).
    None,
    /// Each worker keeps the optimizer state of its 1/W of the parameters (ZeRO-1).
    Optimizer,
    /// As `Optimizer`, the gradients reduce-scattered while backward runs, so a model that
    /// hands them over block by block never holds the whole gradient (ZeRO-2).
    Gradients,
    /// As `Gradients`, the parameters sharded too: each block's gathered only while a pass
    /// reads it (ZeRO-3, FSDP's FULL_SHARD).
    Full,
}

impl DistributedSpec {
    /// The pieces each step's batch is cut into under world-size-invariant training (whose
    /// tree sets every sum); `None` for ordinary training.
    pub fn invariant_shards(&self) -> Option<usize> {
        self.world_size_invariant.then_some(self.virtual_shards)
    }
}

impl Sharding {
    /// Whether the optimizer state is sharded (every mode but `None`).
    pub fn shards_optimizer(self) -> bool {
        self != Sharding::None
    }
}

/// `train.objective`: what a job learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Objective {
    /// The task's own loss: next-token cross-entropy, a classifier's labels.
    #[default]
    Lm,
    /// Direct Preference Optimization on pairs of completions (`[train.dpo]`).
    Dpo,
}

/// `train.dpo.loss`: how a pair's reward difference d is scored (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DpoLoss {
    /// −log σ(d), with label smoothing ε: −(1−ε)·log σ(d) − ε·log σ(−d).
    #[default]
    Sigmoid,
    /// IPO: per-token mean log-probabilities, (d/β − 1/(2β))².
    Ipo,
    /// SLiC's hinge: max(0, 1 − d).
    Hinge,
}

impl DpoLoss {
    /// Its `train.dpo.loss` name.
    pub fn name(self) -> &'static str {
        match self {
            DpoLoss::Sigmoid => "sigmoid",
            DpoLoss::Ipo => "ipo",
            DpoLoss::Hinge => "hinge",
        }
    }
}

/// `train.early_stopping.monitor`: the evaluation figure early stopping watches, as
/// Lightning's `monitor` with the `mode` that fits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Monitor {
    /// The evaluation loss, which must fall (`mode = "min"`).
    #[default]
    Loss,
    /// The evaluation accuracy (a classifier's, a language model's next-token one), which
    /// must rise (`mode = "max"`).
    Accuracy,
}

impl Monitor {
    /// Whether `value` improves on `best` by more than `min_delta`.
    pub fn improves(self, value: f64, best: f64, min_delta: f64) -> bool {
        match self {
            Monitor::Loss => value < best - min_delta,
            Monitor::Accuracy => value > best + min_delta,
        }
    }

    /// The name of the evaluation metric it watches (see the task seam's `Metric`).
    pub fn metric(self) -> &'static str {
        match self {
            Monitor::Loss => "loss",
            Monitor::Accuracy => "accuracy",
        }
    }
}

/// `train.precision`: the dtype of the forward and backward passes. Weights, optimizer state
/// and gradient averaging stay f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    /// f32 everywhere, with a GPU's f32 matrix products on TF32 tensor cores (torch's
    /// `allow_tf32`); the same as f32 on the CPU, which has no TF32.
    Tf32,
    /// f32 everywhere, with the f32 matrix products computed from bf16-rounded inputs with f32
    /// sums (torch's `set_float32_matmul_precision("medium")`): on a CPU with AVX512_BF16
    /// (see `kernels::bf16_products`); on a GPU as `Tf32` (at least that precision); f32 on
    /// other CPUs.
    Bf16Matmul,
}

impl Precision {
    /// Whether the forward and backward passes compute in bf16 (else in f32).
    pub fn computes_in_bf16(self) -> bool {
        self == Precision::Bf16
    }
}

/// One `[expect]` threshold, checked against the run's summary when it ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Expectation {
    pub check: Check,
    pub threshold: f64,
}

/// What an expectation compares, and in which direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    MinTestAccuracy,
    MaxTestLoss,
    /// A language model's: its task declares perplexity.
    MaxTestPerplexity,
    MaxFinalLoss,
    MaxWallS,
    MinTrainSamplesPerS,
    /// A DPO job's: its task declares `rewards/accuracies`.
    MinRewardsAccuracies,
    /// A DPO job's `rewards/margins`.
    MinRewardsMargins,
}

impl Check {
    pub const ALL: [Check; 8] = [
        Check::MinTestAccuracy,
        Check::MaxTestLoss,
        Check::MaxTestPerplexity,
        Check::MaxFinalLoss,
        Check::MaxWallS,
        Check::MinTrainSamplesPerS,
        Check::MinRewardsAccuracies,
        Check::MinRewardsMargins,
    ];

    /// The key under `[expect]`.
    pub fn key(self) -> &'static str {
        match self {
            Check::MinTestAccuracy => "min_test_accuracy",
            Check::MaxTestLoss => "max_test_loss",
            Check::MaxTestPerplexity => "max_test_perplexity",
            Check::MaxFinalLoss => "max_final_loss",
            Check::MaxWallS => "max_wall_s",
            Check::MinTrainSamplesPerS => "min_train_samples_per_s",
            Check::MinRewardsAccuracies => "min_rewards_accuracies",
            Check::MinRewardsMargins => "min_rewards_margins",
        }
    }

    /// The `summary.json` field it reads.
    pub fn metric(self) -> &'static str {
        match self {
            Check::MinTestAccuracy => "test_accuracy",
            Check::MaxTestLoss => "test_loss",
            Check::MaxTestPerplexity => "test_perplexity",
            Check::MaxFinalLoss => "final_train_loss",
            Check::MaxWallS => "wall_s",
            Check::MinTrainSamplesPerS => "train_samples_per_s",
            Check::MinRewardsAccuracies => "test_rewards/accuracies",
            Check::MinRewardsMargins => "test_rewards/margins",
        }
    }

    /// A lower bound (`min_*`) rather than an upper one.
    pub fn is_minimum(self) -> bool {
        matches!(
            self,
            Check::MinTestAccuracy
                | Check::MinTrainSamplesPerS
                | Check::MinRewardsAccuracies
                | Check::MinRewardsMargins
        )
    }
}
