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

/// One known key: dotted path from the document root, its kind, its default as the README
/// shows it, and what it does. The README's config table is generated from these (a test
/// fails when it differs), and the defaults that are TOML values are checked against the raw
/// config's serde defaults.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub path: &'static str,
    pub kind: Kind,
    /// Markdown: a TOML value in backticks (`` `"mlp"` ``), possibly with a remark, or words.
    pub default: &'static str,
    /// Markdown, one line.
    pub doc: &'static str,
}

const fn key(path: &'static str, kind: Kind, default: &'static str, doc: &'static str) -> KeySpec {
    KeySpec {
        path,
        kind,
        default,
        doc,
    }
}

/// A `[section]`: no default, described where its keys are.
const fn table(path: &'static str, doc: &'static str) -> KeySpec {
    key(path, Kind::Table, "", doc)
}

/// Every key a job file may contain. Defaults live in `raw.rs` (serde `Default`s).
pub const KEYS: &[KeySpec] = &[
    key(
        "name",
        Kind::Str,
        "file stem",
        "job name: the run lives in `<jobs-dir>/<name>/`",
    ),
    key(
        "seed",
        Kind::Int,
        "`0`",
        "initialisation, sampler shuffle, synthetic data",
    ),
    table("model", "the network"),
    key(
        "model.arch",
        Kind::Str,
        "`\"mlp\"`",
        "`\"mlp\"`, `\"cnn\"` or `\"gpt\"`, or a model your own binary registers (see \"Your own model\"; its keys are its options struct's)",
    ),
    key(
        "model.hidden",
        Kind::IntList,
        "`[256, 256]`",
        "mlp hidden widths",
    ),
    key("model.n_layer", Kind::Int, "`4`", "gpt: transformer blocks"),
    key(
        "model.n_head",
        Kind::Int,
        "`4`",
        "gpt: attention heads; must divide `n_embd`",
    ),
    key("model.n_embd", Kind::Int, "`128`", "gpt: channels"),
    key(
        "model.block_size",
        Kind::Int,
        "`64`",
        "gpt: context length in tokens (the window length of the data)",
    ),
    key(
        "model.dropout",
        Kind::Float,
        "`0.0`",
        "gpt: dropout after the embeddings, the attention projection and the MLP, in [0, 1)",
    ),
    key(
        "model.bias",
        Kind::Bool,
        "`true`",
        "gpt: biases in Linear and LayerNorm layers",
    ),
    key(
        "model.vocab_size",
        Kind::Int,
        "from the data",
        "gpt: vocabulary size; required for `tokens` data (e.g. `50304`); `text` data knows its own",
    ),
    table("data", "where the samples come from"),
    key(
        "data.dataset",
        Kind::Str,
        "`\"mnist\"`",
        "`\"mnist\"`, `\"fashion-mnist\"`, `\"synthetic\"`, `\"text\"` (a UTF-8 file) or `\"tokens\"` (pre-tokenised `.bin` files), or a dataset your own binary registers",
    ),
    key(
        "data.path",
        Kind::Str,
        "none",
        "text: the UTF-8 file; relative to the working directory; fetched from `data.mirrors` when missing and `data.download = true`",
    ),
    key(
        "data.tokenizer",
        Kind::Str,
        "`\"char\"`",
        "text: `\"char\"` (the file's distinct characters, sorted, as nanoGPT's `prepare.py`) or `\"byte\"` (256 symbols)",
    ),
    key(
        "data.val_fraction",
        Kind::Float,
        "`0.1`",
        "text: the last fraction of the tokens is the validation split",
    ),
    key(
        "data.train_path",
        Kind::Str,
        "none",
        "tokens: training tokens, flat little-endian, memory-mapped",
    ),
    key(
        "data.val_path",
        Kind::Str,
        "none",
        "tokens: validation tokens, same format",
    ),
    key(
        "data.token_dtype",
        Kind::Str,
        "`\"u16\"`",
        "tokens: `\"u16\"` (nanoGPT, llm.c) or `\"u32\"`",
    ),
    key(
        "data.root",
        Kind::Str,
        "`\"data/<dataset>\"`",
        "directory with the IDX files; searched first, downloads go here (text: the directory of `data.path`)",
    ),
    key(
        "data.download",
        Kind::Bool,
        "`false`",
        "download missing files",
    ),
    key(
        "data.drop_last",
        Kind::Bool,
        "`false`",
        "drop the tail that does not divide among the workers instead of padding it",
    ),
    key(
        "data.mirrors",
        Kind::StrList,
        "known mirrors",
        "base URLs tried in order",
    ),
    key(
        "data.checksums",
        Kind::StrMap,
        "built in",
        "table: SHA-256 per file name (for private mirrors)",
    ),
    key(
        "data.mean",
        Kind::FloatList,
        "none",
        "per-channel normalisation after scaling to [0, 1]",
    ),
    key(
        "data.std",
        Kind::FloatList,
        "none",
        "per-channel normalisation after scaling to [0, 1]",
    ),
    table("data.synthetic", "shape of the synthetic dataset"),
    key(
        "data.synthetic.train_samples",
        Kind::Int,
        "`4096`",
        "synthetic training samples",
    ),
    key(
        "data.synthetic.test_samples",
        Kind::Int,
        "`1024`",
        "synthetic test samples",
    ),
    key(
        "data.synthetic.shape",
        Kind::IntList,
        "`[1, 28, 28]`",
        "[channels, height, width]",
    ),
    key(
        "data.synthetic.classes",
        Kind::Int,
        "`10`",
        "number of classes",
    ),
    key(
        "data.synthetic.noise",
        Kind::Float,
        "`0.5`",
        "noise std on each class pattern",
    ),
    table("train", "the optimisation"),
    key(
        "train.epochs",
        Kind::Int,
        "`1`",
        "passes over the training set",
    ),
    key(
        "train.batch_size",
        Kind::Int,
        "`64`",
        "samples per worker per micro-batch",
    ),
    key(
        "train.accumulation",
        Kind::Int,
        "`1`",
        "micro-batches per optimizer step",
    ),
    key("train.lr", Kind::Float, "`0.001`", "peak learning rate"),
    key(
        "train.optimizer",
        Kind::Str,
        "`\"adam\"`",
        "`\"sgd\"`, `\"adam\"` or `\"adamw\"`",
    ),
    key("train.momentum", Kind::Float, "`0.0`", "sgd momentum"),
    key(
        "train.nesterov",
        Kind::Bool,
        "`false`",
        "sgd Nesterov momentum",
    ),
    key(
        "train.betas",
        Kind::FloatList,
        "`[0.9, 0.999]`",
        "adam/adamw betas",
    ),
    key("train.eps", Kind::Float, "`1e-8`", "adam/adamw epsilon"),
    key(
        "train.weight_decay",
        Kind::Float,
        "`0.0`",
        "L2 (sgd, adam) or decoupled (adamw)",
    ),
    key(
        "train.grad_clip_norm",
        Kind::Float,
        "`0` (off)",
        "global gradient norm limit",
    ),
    key(
        "train.max_steps",
        Kind::Int,
        "`0` (none)",
        "stop after this many optimizer steps",
    ),
    key(
        "train.eval_batch_size",
        Kind::Int,
        "`1000`",
        "evaluation batch size",
    ),
    key(
        "train.eval_every",
        Kind::Int,
        "`0` (off)",
        "also evaluate every N optimizer steps (logged as `\"kind\":\"eval\"` lines); epoch ends always evaluate",
    ),
    key(
        "train.eval_batches",
        Kind::Int,
        "`0` (all)",
        "every evaluation (periodic, epoch end, final) uses this many batches of `eval_batch_size`, spread evenly over the split, the same ones each time; for large corpora",
    ),
    key(
        "train.log_every",
        Kind::Int,
        "`50`",
        "optimizer steps between metric lines",
    ),
    key(
        "train.precision",
        Kind::Str,
        "`\"f32\"`",
        "`\"bf16\"`: forward and backward in bfloat16 (autocast-style), with f32 weights, optimizer state, loss and gradient averaging",
    ),
    key(
        "train.flush_denormals",
        Kind::Bool,
        "`true`",
        "CPU workers flush subnormal floats to zero (FTZ and DAZ on every thread that computes), as `torch.set_flush_denormal(True)`; `false` keeps IEEE subnormals (see \"Subnormal floats\")",
    ),
    table("train.scheduler", "learning-rate schedule"),
    key(
        "train.scheduler.kind",
        Kind::Str,
        "`\"constant\"`",
        "`\"constant\"`, `\"step\"` or `\"cosine\"`",
    ),
    key(
        "train.scheduler.step_size",
        Kind::Int,
        "`1`",
        "step: epochs between decays",
    ),
    key(
        "train.scheduler.gamma",
        Kind::Float,
        "`0.1`",
        "step: decay factor",
    ),
    key(
        "train.scheduler.min_lr",
        Kind::Float,
        "`0.0`",
        "cosine: final learning rate",
    ),
    key(
        "train.scheduler.warmup_steps",
        Kind::Int,
        "`0`",
        "linear warm-up steps",
    ),
    table("checkpoint", "when checkpoints are written"),
    key(
        "checkpoint.every_epochs",
        Kind::Int,
        "`1`",
        "checkpoint every N epochs (0: off)",
    ),
    key(
        "checkpoint.every_steps",
        Kind::Int,
        "`0` (off)",
        "also every N optimizer steps, mid-epoch",
    ),
    key(
        "checkpoint.keep_last",
        Kind::Int,
        "`3`",
        "checkpoints kept (0: all)",
    ),
    key(
        "checkpoint.keep_best",
        Kind::Bool,
        "`false`",
        "keep the weights with the lowest evaluation loss as `checkpoints/best` (never pruned)",
    ),
    key(
        "checkpoint.on_write_error",
        Kind::Str,
        "`\"fail\"`",
        "a failed checkpoint write stops the job (`\"fail\"`, previous checkpoint intact) or is logged and training goes on (`\"warn\"`)",
    ),
    table("distributed", "workers and gradient averaging"),
    key(
        "distributed.nproc_per_node",
        Kind::AutoOrInt,
        "`\"auto\"`",
        "workers per node; `\"auto\"` is one per GPU in use (see `device`), 1 on CPU; more workers than GPUs is an error",
    ),
    key(
        "distributed.backend",
        Kind::Str,
        "`\"auto\"`",
        "`\"auto\"` (NCCL for GPU workers, the tcp ring for CPU ones), `\"tcp\"`, or `\"nccl\"` (GPU builds only)",
    ),
    key(
        "distributed.max_restarts",
        Kind::Int,
        "`0`",
        "restarts of the whole worker group (every node's) from the newest good checkpoint after a worker dies or hangs",
    ),
    key(
        "distributed.timeout_s",
        Kind::Int,
        "`300`",
        "seconds a collective, a rendezvous or a store wait may stall before the job fails (at most a week)",
    ),
    key(
        "distributed.bucket_mb",
        Kind::Float,
        "`25`",
        "gradient bucket size for all-reduce",
    ),
    key(
        "distributed.device",
        Kind::Str,
        "`\"auto\"`",
        "`\"auto\"`: a GPU per worker in a `--features cuda` build when the driver shows one, else the CPU (with a note in a cuda build); `\"cpu\"`; `\"cuda\"`: GPUs or fail",
    ),
    key(
        "distributed.devices",
        Kind::IntList,
        "all visible",
        "GPU ordinals (among those `CUDA_VISIBLE_DEVICES` leaves), one per local rank: `[0, 2]`",
    ),
    table("logging", "where metrics go besides metrics.jsonl"),
    key(
        "logging.tensorboard",
        Kind::Bool,
        "`false`",
        "also write TensorBoard event files (train loss, lr, throughput, test loss and accuracy by step) under `<job>/tensorboard/`; a resumed job continues the same curves",
    ),
    table(
        "expect",
        "checks after the run (CI smoke jobs): any unmet one makes the run exit 1",
    ),
    key(
        "expect.min_test_accuracy",
        Kind::Float,
        "none",
        "lowest acceptable final test accuracy, a fraction (`0.9`, not `90`)",
    ),
    key(
        "expect.max_test_loss",
        Kind::Float,
        "none",
        "highest acceptable final test loss",
    ),
    key(
        "expect.max_final_loss",
        Kind::Float,
        "none",
        "highest acceptable training loss of the last epoch (`final_train_loss`)",
    ),
    key(
        "expect.max_wall_s",
        Kind::Float,
        "none",
        "longest acceptable wall time of the `run` (or `resume`) command, seconds",
    ),
    key(
        "expect.min_train_samples_per_s",
        Kind::Float,
        "none",
        "lowest acceptable throughput, samples of all workers per second of training loop",
    ),
];

/// The README's config table: every key that is not a section, in this table's order.
#[cfg(test)]
pub fn markdown_table() -> String {
    let mut out = String::from("| key | default | meaning |\n|---|---|---|\n");
    for k in KEYS.iter().filter(|k| k.kind != Kind::Table) {
        out += &format!("| `{}` | {} | {} |\n", k.path, k.default, k.doc);
    }
    out
}

/// `ddpjob keys [PREFIX]`: the keys under `prefix` (all without one) with their type, default
/// and meaning, as plain text (backticks dropped). `None` when no key matches.
pub fn reference(prefix: Option<&str>) -> Option<String> {
    let plain = |s: &str| s.replace('`', "");
    let matches =
        |k: &&KeySpec| prefix.is_none_or(|p| k.path == p || k.path.starts_with(&format!("{p}.")));
    let keys: Vec<&KeySpec> = KEYS.iter().filter(matches).collect();
    if keys.is_empty() {
        return None;
    }
    let mut out = String::new();
    for k in keys {
        if k.kind == Kind::Table {
            out += &format!("[{}]  {}\n", k.path, plain(k.doc));
        } else {
            out += &format!(
                "  {}  ({}, default {})\n      {}\n",
                k.path,
                k.kind.describe(),
                plain(k.default),
                plain(k.doc)
            );
        }
    }
    Some(out)
}

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
