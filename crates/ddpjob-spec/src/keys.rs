//! Every key of a job file, declared once: what it means (the doc comment, which is also its
//! line in the book's config reference and in `ddpjob keys`), its TOML type and default, and its
//! check, which makes the typed value the program sees. Checks that relate keys of different
//! sections (a gpt's data, devices and build) are in `validate.rs`.
//!
//! To add a key: one declaration here, then `DDPJOB_BLESS=1 cargo test config_reference`.

// A check takes a reference to its key's declared type (`&String`, `&Vec<i64>`).
#![allow(clippy::ptr_arg)]

use super::checks::{
    Checker, any, at_least, choice, in_range, non_negative, optional, positive, target_modules,
    zero_is_off, zero_is_off_f64,
};
use super::declare::section;
use super::error::{ConfigError, Origin};
use super::lora::TargetModules;
use super::quantize::{BLOCK_SIZES, QuantType};
use super::source::{Source, value_at, value_at_mut};
use super::spec::{
    Backend, DeviceChoice, DpoLoss, Monitor, Objective, OnWriteError, OptimizerSpec, Precision,
    ScheduleKind, Sharding,
};

/// A week: longer than any collective should stall, and safe to add to a clock.
const MAX_TIMEOUT_S: i64 = 7 * 24 * 3600;

/// How to get GPU workers, for messages of a build without them.
pub(super) const GPU_BUILD: &str = "this ddpjob was built without GPU support; build it with \
     `cargo build --release --features cuda` (needs the CUDA toolkit; see docs/src/gpus.md)";

section! {
    /// A job file.
    RawConfig at "", checked into RootKeys {
        /// job name: the run lives in `<jobs-dir>/<name>/`
        name: Option<String> = None, shown "file stem" => name: Option<String> = any();
        /// initialisation, sampler shuffle, synthetic data
        seed: i64 = 0 => seed: usize = at_least(0);
        /// the network
        model: RawModel = RawModel::default() => model: ModelKeys = nested();
        /// where the samples come from
        data: RawData = RawData::default() => data: DataKeys = nested();
        /// the optimisation
        train: RawTrain = RawTrain::default() => train: TrainSpec = nested();
        /// when checkpoints are written
        checkpoint: RawCheckpoint = RawCheckpoint::default()
            => checkpoint: CheckpointSpec = nested();
        /// workers and gradient averaging
        distributed: RawDistributed = RawDistributed::default()
            => distributed: DistributedSpec = nested();
        /// where metrics go besides metrics.jsonl
        logging: RawLogging = RawLogging::default() => logging: LoggingSpec = nested();
        /// checks after the run (CI smoke jobs): any unmet one makes the run exit 1
        #[serde(skip_serializing_if = "RawExpect::is_empty")]
        expect: RawExpect = RawExpect::default() => expect: ExpectKeys = nested();
    }
}

section! {
    /// `[model]`: the network. Its other keys are the arch's own (its options struct's
    /// fields; `ddpjob keys model.<arch>` lists them).
    RawModel at "model", checked into ModelKeys {
        /// `"mlp"`, `"cnn"`, `"gpt"` or `"llama"`, or a model your own binary registers (see
        /// "Your own model"); with `init_from` a checkpoint's `config.json` picks it
        arch: String = "mlp".into() => arch: String = any();
        /// parameters that do not train (no gradient is averaged, no optimizer state): names,
        /// module prefixes (`"model.layers.0"`) or globs (`"model.layers.*.mlp.*"`)
        freeze: Vec<String> = Vec::new(), shown "none" => freeze: Vec<String> = patterns;
        /// with a Hub id as `init_from` (`"Qwen/Qwen3-0.6B"`): its branch, tag or commit;
        /// `job.toml` records the commit it was, which `resume` reads again
        #[serde(skip_serializing_if = "String::is_empty")]
        revision: String = String::new(), shown "`\"main\"`" => revision: String = any();
        /// low-rank adapters (LoRA)
        #[serde(skip_serializing_if = "RawLora::is_off")]
        lora: RawLora = RawLora::default() => lora: LoraKeys = nested();
        /// the frozen base in 4 bits (QLoRA)
        #[serde(skip_serializing_if = "RawQuantize::is_off")]
        quantize: RawQuantize = RawQuantize::default() => quantize: QuantizeKeys = nested();
    }
}

section! {
    /// `[model.quantize]`: the frozen base's decoder linear layers kept in 4 bits, as
    /// bitsandbytes' `BitsAndBytesConfig(load_in_4bit = True)` keeps them (never embeddings,
    /// norms or the head), with `[model.lora]`'s adapters trained on top (QLoRA).
    RawQuantize at "model.quantize", checked into QuantizeKeys {
        /// `4`; `0` is off
        bits: i64 = 0, shown "`0` (off)" => bits: usize = quantize_bits;
        /// `"nf4"` (QLoRA's NormalFloat) or `"fp4"` (bitsandbytes' `bnb_4bit_quant_type`)
        r#type: String = "nf4".into()
            => kind: QuantType = choice(&[("nf4", QuantType::Nf4), ("fp4", QuantType::Fp4)]);
        /// the blocks' scales quantised again, in 8 bits (`bnb_4bit_use_double_quant`)
        double_quant: bool = false => double_quant: bool = any();
        /// values per scale: 32, 64, 128, ..., 4096 (bitsandbytes' `blocksize`)
        block_size: i64 = 64 => block_size: usize = block_size;
    }
}

impl RawQuantize {
    /// Whether quantisation is off and nothing else of it is set (left out of `job.toml`).
    pub fn is_off(&self) -> bool {
        *self == RawQuantize::default()
    }
}

/// `model.quantize.bits`: 0 (off) or 4.
fn quantize_bits(c: &mut Checker, key: &str, &bits: &i64, _: &RawQuantize) -> usize {
    if bits != 0 && bits != 4 {
        c.fail(
            key,
            format!(
                "is {bits}: the quantised base is bitsandbytes' 4-bit (QLoRA), so bits = 4, or \
                 0 for off (8-bit LLM.int8 is not supported)"
            ),
        );
    }
    bits.clamp(0, 4) as usize
}

/// `model.quantize.block_size`: one bitsandbytes takes.
fn block_size(c: &mut Checker, key: &str, &size: &i64, _: &RawQuantize) -> usize {
    if !BLOCK_SIZES.iter().any(|&b| b as i64 == size) {
        c.fail(
            key,
            format!("is {size}; bitsandbytes' block sizes are {BLOCK_SIZES:?} (64 is QLoRA's)"),
        );
        return 64;
    }
    size as usize
}

section! {
    /// `[model.lora]`: low-rank adapters beside `gpt`'s and `llama`'s linear layers, PEFT's
    /// `LoraConfig` names; only the adapters train.
    RawLora at "model.lora", checked into LoraKeys {
        /// the adapters' rank; `0` is off
        r: i64 = 0, shown "`0` (off)" => r: usize = at_least(0);
        /// adapters add `alpha / r` times their product
        alpha: f64 = 8.0 => alpha: f64 = positive();
        /// dropout on the adapters' input in training (masks keyed by sample and layer)
        dropout: f64 = 0.0 => dropout: f64 = in_range(0.0, 1.0);
        /// the linear layers that get adapters: names or their last dotted parts (`"q_proj"`),
        /// or `"all-linear"`; or one string, a regular expression of whole layer names
        target_modules: TargetModules = TargetModules::default(), shown "PEFT's: `[\"q_proj\", \"v_proj\"]` (llama), `[\"c_attn\"]` (gpt)"
            => target_modules: TargetModules = target_modules();
        /// a PEFT adapter directory the adapters start from (`model.init_from` naming one
        /// sets it, and the base and the other keys from its `adapter_config.json`)
        adapter: String = String::new(), shown "none" => adapter: String = any();
    }
}

impl RawLora {
    /// Whether LoRA is off and nothing else of it is set (left out of `job.toml`).
    pub fn is_off(&self) -> bool {
        *self == RawLora::default()
    }
}

section! {
    /// `[data]`: the dataset. Its other keys are the dataset's own (its options struct's
    /// fields; `ddpjob keys data.<dataset>` lists them).
    RawData at "data", checked into DataKeys {
        /// `"mnist"`, `"fashion-mnist"`, `"synthetic"`, `"text"` (a UTF-8 file), `"tokens"`
        /// (pre-tokenised `.bin` files) or `"jsonl"` (instruction or text examples, one JSON
        /// object a line), or a dataset your own binary registers
        dataset: String = "mnist".into() => dataset: String = any();
        /// drop the tail that does not divide among the workers instead of padding it
        drop_last: bool = false => drop_last: bool = any();
    }
}

section! {
    /// `[train]`: the optimisation.
    RawTrain at "train", checked into TrainSpec {
        /// passes over the training set
        epochs: i64 = 1 => epochs: usize = at_least(1);
        /// samples per worker per micro-batch
        batch_size: i64 = 64 => batch_size: usize = at_least(1);
        /// micro-batches per optimizer step
        accumulation: i64 = 1 => accumulation: usize = at_least(1);
        /// samples per optimizer step over all workers, the same on any world size (instead of
        /// `batch_size`): each worker's micro-batch is global_batch_size / (accumulation ×
        /// workers), which must be a whole number; `resume` on another world size keeps it
        global_batch_size: i64 = 0, shown "`0` (off)"
            => global_batch_size: Option<usize> = zero_is_off();
        /// peak learning rate
        lr: f64 = 1e-3 => lr: f64 = positive();
        /// `"sgd"`, `"adam"` or `"adamw"`
        optimizer: String = "adam".into() => optimizer: OptimizerSpec = optimizer_spec;
        /// sgd momentum
        momentum: f64 = 0.0 => momentum: f64 = sgd_momentum;
        /// sgd Nesterov momentum
        nesterov: bool = false => nesterov: bool = nesterov_needs_momentum;
        /// adam/adamw betas
        betas: Vec<f64> = vec![0.9, 0.999] => betas: (f64, f64) = two_betas;
        /// adam/adamw epsilon
        eps: f64 = 1e-8, shown "`1e-8`" => eps: f64 = adam_eps;
        /// L2 (sgd, adam) or decoupled (adamw)
        weight_decay: f64 = 0.0 => weight_decay: f64 = non_negative();
        /// global gradient norm limit
        grad_clip_norm: f64 = 0.0, shown "`0` (off)"
            => grad_clip_norm: Option<f64> = zero_is_off_f64();
        /// stop after this many optimizer steps
        max_steps: i64 = 0, shown "`0` (none)" => max_steps: Option<usize> = zero_is_off();
        /// evaluation batch size
        eval_batch_size: i64 = 1000 => eval_batch_size: usize = at_least(1);
        /// also evaluate every N optimizer steps (logged as `"kind":"eval"` lines); epoch ends
        /// always evaluate
        eval_every: i64 = 0, shown "`0` (off)" => eval_every: Option<usize> = zero_is_off();
        /// every evaluation (periodic, epoch end, final) uses this many batches of
        /// `eval_batch_size`, spread evenly over the split, the same ones each time; for large
        /// corpora
        eval_batches: i64 = 0, shown "`0` (all)" => eval_batches: Option<usize> = zero_is_off();
        /// optimizer steps between metric lines
        log_every: i64 = 50 => log_every: usize = at_least(1);
        /// `"bf16"`: forward and backward in bfloat16 (autocast-style), with f32 weights,
        /// optimizer state, loss and gradient averaging; `"tf32"`: f32, with a GPU's f32 matrix
        /// products on TF32 tensor cores (as torch's `allow_tf32`; f32 on the CPU);
        /// `"bf16-matmul"`: f32, with the matrix products' inputs rounded to bf16 and summed in
        /// f32 (as torch's `set_float32_matmul_precision("medium")`): on CPUs with AVX512_BF16
        /// about twice the f32 products' speed; TF32 on a GPU; f32 on other CPUs
        precision: String = "f32".into()
            => precision: Precision = choice(&[("f32", Precision::F32), ("bf16", Precision::Bf16), ("tf32", Precision::Tf32), ("bf16-matmul", Precision::Bf16Matmul)]);
        /// CPU workers flush subnormal floats to zero (FTZ and DAZ on every thread that
        /// computes), as `torch.set_flush_denormal(True)`; `false` keeps IEEE subnormals (see
        /// "Subnormal floats")
        flush_denormals: bool = true => flush_denormals: bool = any();
        /// keep only each block's input in a training forward and recompute the block in the
        /// backward: activation memory for about a third more compute, the same weights bit
        /// for bit (the `gpt` and the `llama`, on any device and precision; see "Activation
        /// checkpointing")
        activation_checkpointing: bool = false => activation_checkpointing: bool = any();
        /// learning-rate schedule
        scheduler: RawScheduler = RawScheduler::default() => schedule: ScheduleSpec = nested();
        /// what is learnt: `"lm"`, the task's own loss (next-token prediction, a classifier's
        /// labels); `"dpo"`, Direct Preference Optimization on pairs `{prompt, chosen,
        /// rejected}` against the model as the job started (see "Preference tuning")
        objective: String = "lm".into()
            => objective: Objective = choice(&[("lm", Objective::Lm), ("dpo", Objective::Dpo)]);
        /// `objective = "dpo"`'s settings
        #[serde(skip_serializing_if = "RawDpo::is_default")]
        dpo: RawDpo = RawDpo::default() => dpo: DpoSpec = nested();
        /// stop when the evaluation loss stops improving
        #[serde(skip_serializing_if = "RawEarlyStopping::is_off")]
        early_stopping: RawEarlyStopping = RawEarlyStopping::default()
            => early_stopping: EarlyStoppingSpec = nested();
    }
}

section! {
    /// `[train.dpo]`: Direct Preference Optimization (`train.objective = "dpo"`), as TRL's
    /// `DPOTrainer` computes it: the policy's log-probabilities of each pair's completions
    /// against the reference's (the model as the job started; with LoRA, the base with the
    /// adapters off).
    RawDpo at "train.dpo", checked into DpoSpec + Copy {
        /// the strength of the pull towards the reference (TRL's `beta`)
        beta: f64 = 0.1 => beta: f64 = positive();
        /// `"sigmoid"` (the paper's), `"ipo"` (per-token mean log-probabilities, squared) or
        /// `"hinge"` (SLiC's)
        loss: String = "sigmoid".into()
            => loss: DpoLoss = choice(&[("sigmoid", DpoLoss::Sigmoid), ("ipo", DpoLoss::Ipo), ("hinge", DpoLoss::Hinge)]);
        /// sigmoid: the chance a pair's labels are flipped (cDPO): the loss is
        /// −(1−ε)·log σ(d) − ε·log σ(−d)
        label_smoothing: f64 = 0.0 => label_smoothing: f64 = smoothing_of_sigmoid;
        /// `true`: the reference's log-probabilities computed once, before training, and kept in
        /// the job (`dpo-reference.bin`); training then holds no reference model
        precompute_reference: bool = false => precompute_reference: bool = any();
    }
}

impl RawDpo {
    /// Whether every key is its default (left out of `job.toml`).
    pub fn is_default(&self) -> bool {
        *self == RawDpo::default()
    }
}

fn smoothing_of_sigmoid(c: &mut Checker, key: &str, &v: &f64, d: &RawDpo) -> f64 {
    let v = c.in_range(key, v, 0.0, 0.5);
    if v > 0.0 && d.loss != "sigmoid" {
        c.fail(
            key,
            format!(
                "applies only with train.dpo.loss = \"sigmoid\", and this job's is \"{}\"; \
                 remove the key or use the sigmoid loss",
                d.loss
            ),
        );
    }
    v
}

section! {
    /// `[train.scheduler]`: the learning rate over the run.
    RawScheduler at "train.scheduler", checked into ScheduleSpec + Copy {
        /// `"constant"`, `"step"` or `"cosine"`
        kind: String = "constant".into() => kind: ScheduleKind = schedule_kind;
        /// step: epochs between decays
        step_size: i64 = 1 => step_size: usize = step_size_of_step;
        /// step: decay factor
        gamma: f64 = 0.1 => gamma: f64 = gamma_of_step;
        /// cosine: the rate it decays to, reached one step past the last (as in transformers)
        min_lr: f64 = 0.0 => min_lr: f64 = min_lr_of_cosine;
        /// linear warm-up steps
        warmup_steps: i64 = 0 => warmup_steps: usize = at_least(0);
    }
}

section! {
    /// `[train.early_stopping]`: training ends early when the evaluation loss (a classifier's
    /// test loss, a language model's validation loss), or its accuracy, has not improved for
    /// `patience` evaluations in a row, as Lightning's `EarlyStopping`.
    RawEarlyStopping at "train.early_stopping", checked into EarlyStoppingSpec + Copy {
        /// evaluations in a row (each epoch's end, and every `train.eval_every` steps) without
        /// an improvement after which training ends; `0` is off
        patience: i64 = 0, shown "`0` (off)"
            => patience: Option<usize> = zero_is_off();
        /// an evaluation improves on the best so far only when it is better by more than this
        /// (a loss lower, an accuracy higher; an accuracy is a fraction, 0.01 = 1 point)
        min_delta: f64 = 0.0 => min_delta: f64 = delta_needs_patience;
        /// what is watched: `"loss"` (must fall, Lightning's `mode="min"`) or `"accuracy"`
        /// (test or next-token accuracy; must rise, `mode="max"`)
        monitor: String = "loss".into() => monitor: Monitor = monitor_needs_patience;
    }
}

impl RawEarlyStopping {
    /// Whether early stopping is off and nothing else of it is set (left out of `job.toml`).
    pub fn is_off(&self) -> bool {
        *self == RawEarlyStopping::default()
    }
}

section! {
    /// `[checkpoint]`: when checkpoints are written and how many are kept.
    RawCheckpoint at "checkpoint", checked into CheckpointSpec {
        /// checkpoint every N epochs (0: off)
        every_epochs: i64 = 1 => every_epochs: Option<usize> = zero_is_off();
        /// also every N optimizer steps, mid-epoch
        every_steps: i64 = 0, shown "`0` (off)" => every_steps: Option<usize> = zero_is_off();
        /// checkpoints kept (0: all)
        keep_last: i64 = 3 => keep_last: Option<usize> = zero_is_off();
        /// keep the weights with the lowest evaluation loss as `checkpoints/best` (never
        /// pruned)
        keep_best: bool = false => keep_best: bool = any();
        /// a failed checkpoint write stops the job (`"fail"`, previous checkpoint intact) or
        /// is logged and training goes on (`"warn"`)
        on_write_error: String = "fail".into() => on_write_error: OnWriteError = choice(&[("fail", OnWriteError::Fail), ("warn", OnWriteError::Warn)]);
    }
}

section! {
    /// `[distributed]`: workers, devices and gradient averaging.
    RawDistributed at "distributed", checked into DistributedSpec {
        /// workers per node; `"auto"` is one per GPU in use (see `device`), 1 on CPU; more
        /// workers than GPUs is an error
        nproc_per_node: toml::Value = toml::Value::String("auto".into())
            => nproc_per_node: Option<usize> = auto_or_count;
        /// `"auto"` (NCCL for GPU workers, the tcp ring for CPU ones), `"tcp"`, or `"nccl"`
        /// (GPU builds only)
        backend: String = "auto".into() => backend: Backend = backend_choice;
        /// restarts of the whole worker group (every node's) from the newest good checkpoint
        /// after a worker dies or hangs
        max_restarts: i64 = 0 => max_restarts: usize = at_least(0);
        /// seconds a collective, a rendezvous or a store wait may stall before the job fails
        /// (at most a week)
        timeout_s: i64 = 300 => timeout_s: u64 = |c: &mut Checker, key: &str, &v: &i64, _: &RawDistributed| {
            c.in_int_range(key, v, 1, MAX_TIMEOUT_S) as u64
        };
        /// `"auto"`: a single worker skips collectives (they would change nothing; a GPU job
        /// sets up no NCCL); `"always"`: it runs every all-reduce, broadcast and barrier through
        /// the real backend anyway (NCCL on a GPU), to check that path on one device
        collectives: String = "auto".into()
            => always_collectives: bool = choice(&[("auto", false), ("always", true)]);
        /// `"none"`: every worker keeps the whole optimizer state (DDP); `"optimizer"`
        /// (ZeRO-1): each keeps the optimizer state of its 1/W of the parameters and of the
        /// averaged gradients (reduce-scattered), the updated parameters all-gathered;
        /// `"gradients"` (ZeRO-2): the same, each block's gradients reduce-scattered while
        /// backward runs on the blocks below, so the whole gradient never exists; `"full"`
        /// (ZeRO-3 / FSDP): the parameters sharded too, each block's all-gathered for its
        /// forward and again for its backward, freed after (`gpt`, `llama`, or a model of
        /// your own with blocks; see "Sharded optimizer state")
        sharding: String = "none".into() => sharding: Sharding = sharding_choice;
        /// with `sharding = "full"` on CPU workers (as DeepSpeed's): the collectives run on a
        /// thread of their own while the passes compute, the next block gathered ahead and
        /// each bucket of gradients reduce-scattered as the backward goes on. Pays where they
        /// wait on a network; on one node whose cores the passes already fill it costs time
        /// and memory (see "Sharded optimizer state")
        overlap_comm: bool = false => overlap_comm: bool = any();
        /// `"run"`: bit-exact on the same world size; `"world-size-invariant"`: the same
        /// weights, bit for bit, on any number of workers that divides `virtual_shards` (needs
        /// `train.global_batch_size`; see "World-size-invariant training")
        deterministic: String = "run".into()
            => world_size_invariant: bool = choice(&[("run", false), ("world-size-invariant", true)]);
        /// with `deterministic = "world-size-invariant"`: the fixed pieces each step's global
        /// batch is cut into, a power of two; world sizes that divide it train alike
        virtual_shards: i64 = 8 => virtual_shards: usize = power_of_two;
        /// gradient bucket size for all-reduce
        bucket_mb: f64 = 25.0, shown "`25`"
            => bucket_bytes: usize = |c: &mut Checker, key: &str, &v: &f64, _: &RawDistributed| {
                (c.positive(key, v) * 1e6) as usize
            };
        /// `"auto"`: a GPU per worker in a `--features cuda` build when the driver shows one,
        /// else the CPU (with a note in a cuda build); `"cpu"`; `"cuda"`: GPUs or fail
        device: String = "auto".into() => device: DeviceChoice = device_choice;
        /// GPU ordinals (among those `CUDA_VISIBLE_DEVICES` leaves), one per local rank:
        /// `[0, 2]`; with `backend = "tcp"` workers may share one (`[0, 0]`)
        #[serde(skip_serializing_if = "Option::is_none")]
        devices: Option<Vec<i64>> = None, shown "all visible"
            => devices: Option<Vec<usize>> = optional(gpu_ordinals);
    }
}

section! {
    /// `[logging]`: where rank 0's metrics go besides `metrics.jsonl`.
    RawLogging at "logging", checked into LoggingSpec + Eq {
        /// also write TensorBoard event files (train loss, lr, throughput, test loss and
        /// accuracy by step) under `<job>/tensorboard/`; a resumed job continues the same
        /// curves
        tensorboard: bool = false => tensorboard: bool = any();
        /// also log the job to an MLflow tracking server as it trains: one run per job
        /// (params, every metric by step, `summary.json`, `curves.svg`, `job.toml`, the
        /// status), continued by `resume` and restarts; a job that ran without one is
        /// uploaded by `ddpjob sync NAME`
        mlflow: bool = false => mlflow: bool = any();
        /// the tracking server, `http(s)://host:port` (auth: `MLFLOW_TRACKING_TOKEN`, or
        /// `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD`)
        #[serde(skip_serializing_if = "Option::is_none")]
        mlflow_uri: Option<String> = None, shown "`MLFLOW_TRACKING_URI`"
            => mlflow_uri: Option<String> = optional(tracking_uri);
        /// the MLflow experiment of the run
        #[serde(skip_serializing_if = "Option::is_none")]
        mlflow_experiment: Option<String> = None,
            shown "`MLFLOW_EXPERIMENT_NAME`, else the job's name"
            => mlflow_experiment: Option<String> = any();
        /// upload `model.safetensors` as an artifact of the run too
        mlflow_log_model: bool = false => mlflow_log_model: bool = any();
    }
}

section! {
    /// `[expect]`: thresholds checked after the run; absent keys are not checked.
    RawExpect at "expect", checked into ExpectKeys {
        /// lowest acceptable final test accuracy, a fraction (`0.9`, not `90`)
        #[serde(skip_serializing_if = "Option::is_none")]
        min_test_accuracy: Option<f64> = None
            => min_test_accuracy: Option<f64> = optional(accuracy_fraction);
        /// highest acceptable final test loss
        #[serde(skip_serializing_if = "Option::is_none")]
        max_test_loss: Option<f64> = None => max_test_loss: Option<f64> = optional(positive());
        /// language models: highest acceptable final validation perplexity (e^test_loss)
        #[serde(skip_serializing_if = "Option::is_none")]
        max_test_perplexity: Option<f64> = None
            => max_test_perplexity: Option<f64> = optional(positive());
        /// highest acceptable training loss of the last epoch (`final_train_loss`)
        #[serde(skip_serializing_if = "Option::is_none")]
        max_final_loss: Option<f64> = None => max_final_loss: Option<f64> = optional(positive());
        /// longest acceptable wall time of the `run` (or `resume`) command, seconds
        #[serde(skip_serializing_if = "Option::is_none")]
        max_wall_s: Option<f64> = None => max_wall_s: Option<f64> = optional(positive());
        /// lowest acceptable throughput, samples of all workers per second of training loop
        #[serde(skip_serializing_if = "Option::is_none")]
        min_train_samples_per_s: Option<f64> = None
            => min_train_samples_per_s: Option<f64> = optional(positive());
        /// `train.objective = "dpo"`: lowest acceptable final `rewards/accuracies` on the
        /// validation pairs, a fraction
        #[serde(skip_serializing_if = "Option::is_none")]
        min_rewards_accuracies: Option<f64> = None
            => min_rewards_accuracies: Option<f64> = optional(accuracy_fraction);
        /// `train.objective = "dpo"`: lowest acceptable final `rewards/margins` on the
        /// validation pairs
        #[serde(skip_serializing_if = "Option::is_none")]
        min_rewards_margins: Option<f64> = None
            => min_rewards_margins: Option<f64> = optional(any());
    }
}

impl RawExpect {
    pub fn is_empty(&self) -> bool {
        *self == RawExpect::default()
    }
}

/// A `[section]` key: the section's own checks.
fn nested<R: super::declare::Section, S>() -> impl Fn(&mut Checker, &str, &R, &S) -> R::Checked {
    |c, _, section, _| section.check(c)
}

fn patterns(c: &mut Checker, key: &str, patterns: &Vec<String>, _: &RawModel) -> Vec<String> {
    if patterns.iter().any(|p| p.trim().is_empty()) {
        c.fail(
            key,
            "has an empty pattern; name parameters, modules or globs",
        );
    }
    patterns.clone()
}

fn optimizer_spec(c: &mut Checker, key: &str, name: &String, t: &RawTrain) -> OptimizerSpec {
    c.one_of(key, name, &["sgd", "adam", "adamw"]);
    let (beta1, beta2) = match t.betas.as_slice() {
        &[b1, b2] => (b1, b2),
        _ => (0.9, 0.999),
    };
    let (eps, weight_decay) = (t.eps, t.weight_decay);
    match name.as_str() {
        "sgd" => OptimizerSpec::Sgd {
            momentum: t.momentum,
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
    }
}

fn nesterov_needs_momentum(c: &mut Checker, key: &str, &on: &bool, t: &RawTrain) -> bool {
    if on && t.momentum == 0.0 {
        c.fail(key, "Nesterov momentum needs train.momentum > 0");
    }
    on
}

/// A key set to other than its default where the choice it belongs to was not made: an error,
/// as torch's `Adam(momentum=...)` is, rather than a setting silently without effect.
fn only_with(
    c: &mut Checker,
    key: &str,
    set: bool,
    (choice, needed): (&str, &[&str]),
    chosen: &str,
) {
    // A job an earlier version created with such a key (then ignored) still resumes.
    if set && !needed.contains(&chosen) && !c.source.is_stored_job() {
        let needed: Vec<String> = needed.iter().map(|n| format!("\"{n}\"")).collect();
        let needed = needed.join(" or ");
        c.fail(
            key,
            format!(
                "applies only with {choice} = {needed}, and this job's is \"{chosen}\"; remove \
                 the key or set {choice} = {needed}"
            ),
        );
    }
}

/// The keys that apply with only some values of a choice: (choice, key, those values).
const CHOICE_KEYS: &[(&str, &str, &[&str])] = &[
    ("train.optimizer", "train.momentum", &["sgd"]),
    ("train.optimizer", "train.nesterov", &["sgd"]),
    ("train.optimizer", "train.betas", &["adam", "adamw"]),
    ("train.optimizer", "train.eps", &["adam", "adamw"]),
    (
        "train.scheduler.kind",
        "train.scheduler.step_size",
        &["step"],
    ),
    ("train.scheduler.kind", "train.scheduler.gamma", &["step"]),
    (
        "train.scheduler.kind",
        "train.scheduler.min_lr",
        &["cosine"],
    ),
];

/// A choice switched on the command line (`--set train.optimizer=sgd` on a file tuned for
/// Adam): the file's keys of the other choice are taken out, as a CLI sweep expects (they
/// could not be unset with `--set`), so neither the checks nor `job.toml` see them. Returns a
/// note for each.
pub(super) fn leave_other_choices(source: &mut Source) -> Vec<String> {
    let mut notes = Vec::new();
    for &(choice, key, applies) in CHOICE_KEYS {
        let (by, at) = (source.value_origin(choice), source.value_origin(key));
        if !(matches!(by, Origin::Override(_)) && at.is_written()) {
            continue;
        }
        let chosen = value_at(&source.table, choice).and_then(toml::Value::as_str);
        let Some(chosen) = chosen.filter(|c| !applies.contains(c)).map(str::to_string) else {
            continue;
        };
        let (parent, leaf) = key.rsplit_once('.').expect("a dotted key");
        if let Some(toml::Value::Table(table)) = value_at_mut(&mut source.table, parent) {
            table.remove(leaf);
        }
        notes.push(format!(
            "{key} ({at}) is left out: it applies only with {choice} = \"{}\", and {by} chose \
             \"{chosen}\"",
            applies.join("\" or \"")
        ));
    }
    notes
}

/// PEFT's `LoraConfig` calls two of `[model.lora]`'s keys `lora_alpha` and `lora_dropout`: a
/// config written with those names reads as if it used ddpjob's (`alpha`, `dropout`); both
/// names at once are refused.
pub(super) fn read_peft_names(source: &mut Source) -> Result<(), ConfigError> {
    for (peft, ours) in [("lora_alpha", "alpha"), ("lora_dropout", "dropout")] {
        let (from, to) = (format!("model.lora.{peft}"), format!("model.lora.{ours}"));
        if let Err((at, other)) = source.rename(&from, &to) {
            return Err(ConfigError::Invalid {
                key: from,
                at,
                problem: format!(
                    "PEFT's name for model.lora.{ours}, which is set too ({other}); keep one"
                ),
            });
        }
    }
    Ok(())
}

/// `--set data.path=mine.txt` on a file that checks its own text's download
/// (`configs/shakespeare-char.toml`'s `data.checksums."input.txt"`): the file's digests of
/// files the new path does not name are left out (each said in a note), as they would never be
/// checked.
pub(super) fn leave_stale_checksums(source: &mut Source) -> Vec<String> {
    let by = source.value_origin("data.path");
    let Origin::Override(_) = by else {
        return Vec::new();
    };
    let named = value_at(&source.table, "data.path")
        .and_then(toml::Value::as_str)
        .and_then(|p| std::path::Path::new(p).file_name())
        .map(|f| f.to_string_lossy().into_owned());
    let stale: Vec<(String, Origin)> = value_at(&source.table, "data.checksums")
        .and_then(toml::Value::as_table)
        .into_iter()
        .flat_map(|t| t.keys())
        .filter(|file| Some(*file) != named.as_ref())
        .map(|file| {
            let at = source.key_origin(&format!("data.checksums.{file}"));
            (file.clone(), at)
        })
        .filter(|(_, at)| at.is_written())
        .collect();
    let Some(toml::Value::Table(sums)) = value_at_mut(&mut source.table, "data.checksums") else {
        return Vec::new();
    };
    let notes = stale.into_iter().map(|(file, at)| {
        sums.remove(&file);
        format!(
            "data.checksums.\"{file}\" ({at}) is left out: {by} names another file, so it \
             would never be checked"
        )
    });
    notes.collect()
}

const SGD: (&str, &[&str]) = ("train.optimizer", &["sgd"]);
const ADAM: (&str, &[&str]) = ("train.optimizer", &["adam", "adamw"]);
const STEP: (&str, &[&str]) = ("train.scheduler.kind", &["step"]);
const COSINE: (&str, &[&str]) = ("train.scheduler.kind", &["cosine"]);

fn sgd_momentum(c: &mut Checker, key: &str, &v: &f64, t: &RawTrain) -> f64 {
    only_with(c, key, v != 0.0, SGD, &t.optimizer);
    c.in_range(key, v, 0.0, 1.0)
}

fn adam_eps(c: &mut Checker, key: &str, &v: &f64, t: &RawTrain) -> f64 {
    only_with(c, key, v != RawTrain::default().eps, ADAM, &t.optimizer);
    c.positive(key, v)
}

fn step_size_of_step(c: &mut Checker, key: &str, &v: &i64, s: &RawScheduler) -> usize {
    only_with(
        c,
        key,
        v != RawScheduler::default().step_size,
        STEP,
        &s.kind,
    );
    c.at_least(key, v, 1)
}

fn gamma_of_step(c: &mut Checker, key: &str, &v: &f64, s: &RawScheduler) -> f64 {
    only_with(c, key, v != RawScheduler::default().gamma, STEP, &s.kind);
    c.positive(key, v)
}

fn min_lr_of_cosine(c: &mut Checker, key: &str, &v: &f64, s: &RawScheduler) -> f64 {
    only_with(c, key, v != 0.0, COSINE, &s.kind);
    c.non_negative(key, v, "")
}

fn two_betas(c: &mut Checker, key: &str, betas: &Vec<f64>, t: &RawTrain) -> (f64, f64) {
    only_with(
        c,
        key,
        *betas != RawTrain::default().betas,
        ADAM,
        &t.optimizer,
    );
    match betas.as_slice() {
        &[b1, b2] => (c.in_range(key, b1, 0.0, 1.0), c.in_range(key, b2, 0.0, 1.0)),
        other => {
            c.fail(
                key,
                format!("must be two numbers [beta1, beta2], got {}", other.len()),
            );
            (0.9, 0.999)
        }
    }
}

fn schedule_kind(c: &mut Checker, key: &str, kind: &String, s: &RawScheduler) -> ScheduleKind {
    c.one_of(key, kind, &["constant", "step", "cosine"]);
    match kind.as_str() {
        "step" => ScheduleKind::Step {
            step_size: s.step_size.max(1) as usize,
            gamma: s.gamma,
        },
        "cosine" => ScheduleKind::Cosine { min_lr: s.min_lr },
        _ => ScheduleKind::Constant,
    }
}

fn monitor_needs_patience(c: &mut Checker, key: &str, v: &String, e: &RawEarlyStopping) -> Monitor {
    let monitor = choice(&[("loss", Monitor::Loss), ("accuracy", Monitor::Accuracy)])(c, key, v, e);
    needs_patience(c, key, monitor != Monitor::Loss, e, "monitor");
    monitor
}

fn delta_needs_patience(c: &mut Checker, key: &str, &v: &f64, e: &RawEarlyStopping) -> f64 {
    let delta = c.non_negative(key, v, "");
    needs_patience(c, key, delta > 0.0, e, "min_delta");
    delta
}

/// An early-stopping key `name`, `set`, does nothing without a patience.
fn needs_patience(c: &mut Checker, key: &str, set: bool, e: &RawEarlyStopping, name: &str) {
    if set && e.patience == 0 {
        c.fail(
            key,
            format!(
                "has no effect without train.early_stopping.patience; set patience \
                 (evaluations without improvement before training ends) or remove {name}"
            ),
        );
    }
}

fn auto_or_count(
    c: &mut Checker,
    key: &str,
    value: &toml::Value,
    _: &RawDistributed,
) -> Option<usize> {
    // The file's type was checked when it was read: "auto" or an integer.
    match value {
        toml::Value::Integer(n) => Some(c.at_least(key, *n, 1)),
        _ => None,
    }
}

fn device_choice(c: &mut Checker, key: &str, name: &String, _: &RawDistributed) -> DeviceChoice {
    let device = choice(&[
        ("auto", DeviceChoice::Auto),
        ("cpu", DeviceChoice::Cpu),
        ("cuda", DeviceChoice::Cuda),
    ])(c, key, name, &());
    if device == DeviceChoice::Cuda && !cfg!(feature = "cuda") {
        c.fail(key, format!("\"cuda\" needs GPU workers: {GPU_BUILD}"));
    }
    device
}

fn backend_choice(c: &mut Checker, key: &str, name: &String, d: &RawDistributed) -> Backend {
    let backend = choice(&[
        ("auto", Backend::Auto),
        ("tcp", Backend::Tcp),
        ("nccl", Backend::Nccl),
    ])(c, key, name, &());
    if backend == Backend::Nccl && !cfg!(feature = "cuda") {
        c.fail(
            key,
            format!("\"nccl\" needs GPU workers: {GPU_BUILD}; or use \"auto\""),
        );
    } else if backend == Backend::Nccl && d.device == "cpu" {
        c.fail(
            key,
            "\"nccl\" reduces on GPUs, but distributed.device = \"cpu\"; use backend \"tcp\" (or \"auto\") for CPU workers",
        );
    }
    backend
}

fn sharding_choice(c: &mut Checker, key: &str, name: &String, _: &RawDistributed) -> Sharding {
    choice(&[
        ("none", Sharding::None),
        ("optimizer", Sharding::Optimizer),
        ("gradients", Sharding::Gradients),
        ("full", Sharding::Full),
    ])(c, key, name, &())
}

fn power_of_two(c: &mut Checker, key: &str, &v: &i64, _: &RawDistributed) -> usize {
    let n = c.in_int_range(key, v, 1, 1 << 20);
    if !n.is_power_of_two() {
        c.fail(
            key,
            format!(
                "must be a power of two (pieces summed pairwise in a fixed tree), got {v}; \
                 e.g. {}",
                n.next_power_of_two()
            ),
        );
    }
    n
}

fn gpu_ordinals(c: &mut Checker, key: &str, list: &Vec<i64>, d: &RawDistributed) -> Vec<usize> {
    let ordinals: Vec<usize> = list.iter().map(|&v| c.at_least(key, v, 0)).collect();
    if ordinals.is_empty() {
        c.fail(
            key,
            "must name at least one GPU, e.g. [0]; leave it out to use every visible GPU",
        );
    }
    let mut sorted = ordinals.clone();
    sorted.sort_unstable();
    sorted.dedup();
    // NCCL cannot hold two ranks on one GPU; the tcp ring can (each worker's gradients cross
    // the host), which is how one GPU runs a multi-worker job.
    if sorted.len() != ordinals.len() && d.backend != "tcp" {
        c.fail(
            key,
            format!(
                "names a GPU twice: {list:?}; NCCL needs one worker per GPU (with \
                 distributed.backend = \"tcp\" workers may share one)"
            ),
        );
    }
    if !cfg!(feature = "cuda") {
        c.fail(key, format!("picks GPUs: {GPU_BUILD}"));
    } else if d.device == "cpu" {
        c.fail(
            key,
            "picks GPUs, but distributed.device = \"cpu\"; remove one of them",
        );
    }
    ordinals
}

fn accuracy_fraction(c: &mut Checker, key: &str, &threshold: &f64, _: &RawExpect) -> f64 {
    if threshold > 1.0 && threshold <= 100.0 {
        let fraction = threshold / 100.0;
        c.fail(
            key,
            format!("is a fraction in [0, 1], got {threshold}; write {fraction} for {threshold}%"),
        );
    } else if !(0.0..=1.0).contains(&threshold) {
        c.fail(
            key,
            format!("must be a fraction in [0, 1], got {threshold}"),
        );
    }
    threshold
}

fn tracking_uri(c: &mut Checker, key: &str, uri: &String, _: &RawLogging) -> String {
    if !(uri.starts_with("http://") || uri.starts_with("https://")) {
        c.fail(
            key,
            format!(
                "\"{uri}\" is not an http(s) tracking server; ddpjob logs to a server (`mlflow \
                 server --host 127.0.0.1 --port 5000`): e.g. \"http://127.0.0.1:5000\""
            ),
        );
    }
    uri.clone()
}
