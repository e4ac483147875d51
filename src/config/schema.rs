//! The table of every config key: its type and what it means. One source of truth for unknown-key
//! detection ("did you mean"), type checks, `--set` typing and the README reference.

/// What a key's value must look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A `[section]`.
    Table,
    /// A table whose keys are free-form strings mapping to strings (e.g. checksums by file name).
    StrMap,
    Str,
    Int,
    /// A float; an integer is accepted too (`lr = 1` means 1.0).
    Float,
    Bool,
    IntList,
    FloatList,
    StrList,
    /// The string `"auto"` or a positive integer.
    AutoOrInt,
}

impl Kind {
    /// How the expected type reads in an error message.
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Table | Kind::StrMap => "a table",
            Kind::Str => "a string",
            Kind::Int => "an integer",
            Kind::Float => "a number",
            Kind::Bool => "true or false",
            Kind::IntList => "a list of integers",
            Kind::FloatList => "a list of numbers",
            Kind::StrList => "a list of strings",
            Kind::AutoOrInt => "\"auto\" or an integer",
        }
    }
}

/// One known key: dotted path from the document root, its kind, and a one-line meaning.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub path: &'static str,
    pub kind: Kind,
    #[expect(
        dead_code,
        reason = "each key's reference text, kept beside it for the generated README table"
    )]
    pub doc: &'static str,
}

const fn key(path: &'static str, kind: Kind, doc: &'static str) -> KeySpec {
    KeySpec { path, kind, doc }
}

/// Every key a job file may contain. Defaults live in `raw.rs` (serde `Default`s).
pub const KEYS: &[KeySpec] = &[
    key(
        "name",
        Kind::Str,
        "job name: the run lives in <jobs-dir>/<name>/ (default: the config file's stem)",
    ),
    key(
        "seed",
        Kind::Int,
        "seeds initialisation, synthetic data and the sampler's shuffle",
    ),
    key("model", Kind::Table, "the network"),
    key(
        "model.arch",
        Kind::Str,
        "\"mlp\", \"cnn\" (the pytorch/examples MNIST net without dropout) or \"gpt\" (a GPT-2-style decoder, nanoGPT's parameter names)",
    ),
    key("model.hidden", Kind::IntList, "mlp hidden layer sizes"),
    key(
        "model.n_layer",
        Kind::Int,
        "gpt: transformer blocks (default 4)",
    ),
    key(
        "model.n_head",
        Kind::Int,
        "gpt: attention heads; must divide n_embd (default 4)",
    ),
    key("model.n_embd", Kind::Int, "gpt: channels (default 128)"),
    key(
        "model.block_size",
        Kind::Int,
        "gpt: context length in tokens (default 64)",
    ),
    key(
        "model.dropout",
        Kind::Float,
        "gpt: dropout on embeddings, attention and MLP outputs, in [0, 1) (default 0)",
    ),
    key(
        "model.bias",
        Kind::Bool,
        "gpt: biases in Linear and LayerNorm layers (default true)",
    ),
    key(
        "model.vocab_size",
        Kind::Int,
        "gpt: vocabulary size; required for \"tokens\" data (e.g. 50304), \"text\" data knows its own",
    ),
    key("data", Kind::Table, "where the samples come from"),
    key(
        "data.dataset",
        Kind::Str,
        "\"mnist\", \"fashion-mnist\", \"synthetic\", \"text\" (a UTF-8 file) or \"tokens\" (pre-tokenised .bin files)",
    ),
    key(
        "data.path",
        Kind::Str,
        "text: the text file (downloaded from data.mirrors if missing and data.download is set)",
    ),
    key(
        "data.tokenizer",
        Kind::Str,
        "text: \"char\" (the file's distinct characters, sorted, as nanoGPT) or \"byte\" (256 symbols)",
    ),
    key(
        "data.val_fraction",
        Kind::Float,
        "text: the last fraction of the tokens kept for validation (default 0.1)",
    ),
    key(
        "data.train_path",
        Kind::Str,
        "tokens: training tokens, flat little-endian (memory-mapped)",
    ),
    key(
        "data.val_path",
        Kind::Str,
        "tokens: validation tokens, same format",
    ),
    key(
        "data.token_dtype",
        Kind::Str,
        "tokens: \"u16\" (nanoGPT, llm.c; default) or \"u32\"",
    ),
    key(
        "data.root",
        Kind::Str,
        "directory holding the IDX files (default data/<dataset>); searched first",
    ),
    key(
        "data.download",
        Kind::Bool,
        "download missing files from data.mirrors (SHA-256 checked)",
    ),
    key(
        "data.drop_last",
        Kind::Bool,
        "drop the tail that does not divide among the workers instead of padding (DistributedSampler's drop_last)",
    ),
    key(
        "data.mirrors",
        Kind::StrList,
        "base URLs tried in order for downloads (default: the dataset's known mirrors)",
    ),
    key(
        "data.checksums",
        Kind::StrMap,
        "SHA-256 per file name, overriding the built-in ones (for private mirrors)",
    ),
    key(
        "data.mean",
        Kind::FloatList,
        "per-channel mean for normalisation after scaling to [0,1] (empty: none)",
    ),
    key(
        "data.std",
        Kind::FloatList,
        "per-channel std for normalisation (same length as data.mean)",
    ),
    key(
        "data.synthetic",
        Kind::Table,
        "shape of the synthetic dataset",
    ),
    key(
        "data.synthetic.train_samples",
        Kind::Int,
        "training samples",
    ),
    key("data.synthetic.test_samples", Kind::Int, "test samples"),
    key(
        "data.synthetic.shape",
        Kind::IntList,
        "image shape [channels, height, width]",
    ),
    key("data.synthetic.classes", Kind::Int, "number of classes"),
    key(
        "data.synthetic.noise",
        Kind::Float,
        "std of the Gaussian noise added to each class pattern",
    ),
    key("train", Kind::Table, "the optimisation"),
    key("train.epochs", Kind::Int, "passes over the training set"),
    key(
        "train.batch_size",
        Kind::Int,
        "samples per worker per micro-batch",
    ),
    key(
        "train.accumulation",
        Kind::Int,
        "micro-batches per optimizer step",
    ),
    key("train.lr", Kind::Float, "peak learning rate"),
    key(
        "train.optimizer",
        Kind::Str,
        "\"sgd\", \"adam\" or \"adamw\"",
    ),
    key("train.momentum", Kind::Float, "sgd momentum"),
    key(
        "train.nesterov",
        Kind::Bool,
        "sgd Nesterov momentum (needs momentum > 0)",
    ),
    key("train.betas", Kind::FloatList, "adam/adamw [beta1, beta2]"),
    key("train.eps", Kind::Float, "adam/adamw epsilon"),
    key(
        "train.weight_decay",
        Kind::Float,
        "L2 penalty (sgd, adam) or decoupled decay (adamw)",
    ),
    key(
        "train.grad_clip_norm",
        Kind::Float,
        "clip the global L2 norm of the gradients to this (0: off)",
    ),
    key(
        "train.max_steps",
        Kind::Int,
        "stop after this many optimizer steps (0: no cap)",
    ),
    key(
        "train.eval_batch_size",
        Kind::Int,
        "batch size for evaluation on the test split",
    ),
    key(
        "train.eval_every",
        Kind::Int,
        "also evaluate every N optimizer steps (0: at the end of each epoch only)",
    ),
    key(
        "train.eval_batches",
        Kind::Int,
        "every evaluation uses this many batches of train.eval_batch_size, spread evenly over the split, the same ones each time (0: the whole split)",
    ),
    key(
        "train.log_every",
        Kind::Int,
        "optimizer steps between metric lines",
    ),
    key(
        "train.precision",
        Kind::Str,
        "\"f32\" or \"bf16\" (bf16 forward and backward, f32 weights, optimizer and all-reduce)",
    ),
    key(
        "train.flush_denormals",
        Kind::Bool,
        "CPU workers flush subnormal floats to zero (FTZ/DAZ), as torch.set_flush_denormal(True); false keeps IEEE subnormals, which x86 computes many times slower",
    ),
    key("train.scheduler", Kind::Table, "learning-rate schedule"),
    key(
        "train.scheduler.kind",
        Kind::Str,
        "\"constant\", \"step\" or \"cosine\"",
    ),
    key(
        "train.scheduler.step_size",
        Kind::Int,
        "step: epochs between decays",
    ),
    key("train.scheduler.gamma", Kind::Float, "step: decay factor"),
    key(
        "train.scheduler.min_lr",
        Kind::Float,
        "cosine: learning rate at the last step",
    ),
    key(
        "train.scheduler.warmup_steps",
        Kind::Int,
        "linear warm-up from 0 over this many optimizer steps",
    ),
    key("checkpoint", Kind::Table, "when checkpoints are written"),
    key(
        "checkpoint.every_epochs",
        Kind::Int,
        "checkpoint every N epochs (0: off)",
    ),
    key(
        "checkpoint.every_steps",
        Kind::Int,
        "also every N optimizer steps, mid-epoch (0: off)",
    ),
    key(
        "checkpoint.keep_last",
        Kind::Int,
        "checkpoints kept; older ones are pruned (0: keep all)",
    ),
    key(
        "checkpoint.keep_best",
        Kind::Bool,
        "keep the weights with the lowest evaluation loss as checkpoints/best (never pruned)",
    ),
    key(
        "checkpoint.on_write_error",
        Kind::Str,
        "\"fail\" (stop the job, previous checkpoint intact) or \"warn\" (log and train on)",
    ),
    key("distributed", Kind::Table, "workers and gradient averaging"),
    key(
        "distributed.nproc_per_node",
        Kind::AutoOrInt,
        "workers on this node: \"auto\" or a number",
    ),
    key(
        "distributed.backend",
        Kind::Str,
        "\"auto\" (nccl for GPU workers, tcp for CPU ones), \"tcp\" or \"nccl\"",
    ),
    key(
        "distributed.max_restarts",
        Kind::Int,
        "restarts of the worker group after a failure",
    ),
    key(
        "distributed.timeout_s",
        Kind::Int,
        "seconds a collective may wait before the job fails",
    ),
    key(
        "distributed.bucket_mb",
        Kind::Float,
        "gradient bucket size in MB for all-reduce",
    ),
    key(
        "distributed.device",
        Kind::Str,
        "\"auto\" (a GPU per worker if the build has CUDA and one is visible), \"cpu\" or \"cuda\"",
    ),
    key(
        "distributed.devices",
        Kind::IntList,
        "GPU ordinals to use, one per worker on each node (default: every visible GPU)",
    ),
    key(
        "logging",
        Kind::Table,
        "where metrics go besides metrics.jsonl",
    ),
    key(
        "logging.tensorboard",
        Kind::Bool,
        "also write TensorBoard event files under <job>/tensorboard/ (default false)",
    ),
    key(
        "expect",
        Kind::Table,
        "checks after the run (CI smoke jobs): any unmet one makes the run exit 1",
    ),
    key(
        "expect.min_test_accuracy",
        Kind::Float,
        "lowest acceptable final test accuracy, a fraction in [0, 1]",
    ),
    key(
        "expect.max_test_loss",
        Kind::Float,
        "highest acceptable final test loss",
    ),
    key(
        "expect.max_final_loss",
        Kind::Float,
        "highest acceptable training loss of the last epoch",
    ),
    key(
        "expect.max_wall_s",
        Kind::Float,
        "longest acceptable wall time of the command, in seconds",
    ),
    key(
        "expect.min_train_samples_per_s",
        Kind::Float,
        "lowest acceptable training throughput (samples of all workers per second)",
    ),
];

/// The spec of a dotted key path, if known.
pub fn lookup(path: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|k| k.path == path)
}

/// Known keys directly inside `table` ("" for the root), as their last path segment.
pub fn children(table: &str) -> impl Iterator<Item = &'static str> + '_ {
    KEYS.iter().filter_map(move |k| {
        let rest = if table.is_empty() {
            Some(k.path)
        } else {
            k.path.strip_prefix(table).and_then(|r| r.strip_prefix('.'))
        }?;
        (!rest.contains('.')).then_some(rest)
    })
}

/// The closest known sibling of an unknown key, if one is close enough to be a typo.
pub fn closest<'a>(unknown: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let unknown_lower = unknown.to_ascii_lowercase();
    candidates
        .map(|c| (levenshtein(&unknown_lower, c), c))
        .filter(|(d, c)| *d <= (c.len().max(unknown.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_the_nearest_sibling_for_a_typo() {
        assert_eq!(closest("batchsize", children("train")), Some("batch_size"));
        assert_eq!(closest("learning_rate_x", children("train")), None);
        assert_eq!(closest("EPOCHS", children("train")), Some("epochs"));
    }

    #[test]
    fn children_lists_direct_keys_only() {
        let root: Vec<_> = children("").collect();
        assert!(root.contains(&"train") && root.contains(&"seed"));
        assert!(!root.iter().any(|k| k.contains('.')));
        assert!(children("train").any(|k| k == "scheduler"));
    }
}
