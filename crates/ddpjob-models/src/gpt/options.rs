//! `[model]` of `arch = "gpt"`: nanoGPT's `GPTConfig` names. Registered like any language model
//! (this struct declares the keys; `complete` fills the defaults, or with `init_from` a GPT-2
//! directory's or another gpt job's shape, so `job.toml` holds every size), and exported to
//! Hugging Face as `gpt2`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::hf::{Gpt2Export, Gpt2Shape};
use super::{Activation, Gpt, GptConfig};
use crate::LanguageModelOptions;
use crate::kit::{Reading, WeightSource};
use crate::{Model, token_windows};
use ddpjob_seam::{BuildError, ModelContext};
use ddpjob_spec::KeyDoc;
use ddpjob_storage::checkpoint::Trained;
use ddpjob_storage::hf::HfDir;

/// The `model_type` a gpt reads and exports.
pub const MODEL_TYPES: [&str; 1] = ["gpt2"];

/// The layers that get LoRA adapters when `[model.lora]` names none: PEFT's for gpt2.
const LORA_TARGETS: [&str; 1] = ["c_attn"];

/// `model.arch = "gpt"`. Every key but `init_from` and `vocab_size` has a default (nanoGPT's
/// CPU recipe: 4 layers x 4 heads x 128 channels, context 64) or comes from `init_from`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GptOptions {
    /// Transformer blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_layer: Option<usize>,
    /// Attention heads; must divide `n_embd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_head: Option<usize>,
    /// Channels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_embd: Option<usize>,
    /// Context length in tokens (the window length of the data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// Dropout after the embeddings, the attention projection and the MLP, in [0, 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// Biases in Linear and LayerNorm layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias: Option<bool>,
    /// Required for `tokens` data (e.g. 50304); `text` data knows its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<usize>,
    /// The MLP's GELU: `"gelu"` (exact, as nanoGPT) or `"gelu_new"` (GPT-2's tanh form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<Activation>,
    /// A Hugging Face GPT-2 directory (`config.json`, `model.safetensors`, `tokenizer.json`)
    /// to start from, or another gpt job (`"jobs/NAME"`, or a checkpoint directory of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<String>,
}

/// The keys as `ddpjob keys` and the config reference show them, in the struct's order.
pub const KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "n_layer",
        default: "`4`; a checkpoint's own",
        doc: "transformer blocks",
    },
    KeyDoc {
        key: "n_head",
        default: "`4`; a checkpoint's own",
        doc: "attention heads; must divide `n_embd`",
    },
    KeyDoc {
        key: "n_embd",
        default: "`128`; a checkpoint's own",
        doc: "channels",
    },
    KeyDoc {
        key: "block_size",
        default: "`64`; a checkpoint's `n_positions`",
        doc: "context length in tokens (the window length of the data); with `init_from` at \
              most the checkpoint's",
    },
    KeyDoc {
        key: "dropout",
        default: "`0.0`",
        doc: "dropout after the embeddings, the attention projection and the MLP, in [0, 1)",
    },
    KeyDoc {
        key: "bias",
        default: "`true`; a checkpoint's own",
        doc: "biases in Linear and LayerNorm layers",
    },
    KeyDoc {
        key: "vocab_size",
        default: "from the data",
        doc: "vocabulary size; required for `tokens` data (e.g. `50304`); `text` data knows \
              its own",
    },
    KeyDoc {
        key: "activation",
        default: "`\"gelu\"`; a checkpoint's own",
        doc: "the MLP's GELU, `\"gelu\"` (exact, as nanoGPT) or `\"gelu_new\"` (GPT-2's tanh \
              approximation)",
    },
    KeyDoc {
        key: "init_from",
        default: "none (random weights)",
        doc: "a Hugging Face GPT-2 directory (`config.json`, `model.safetensors`, \
              `tokenizer.json`), e.g. `\"models/gpt2\"`, or its Hub id \
              (`\"openai-community/gpt2\"`: the HF cache, downloaded if missing), or another \
              gpt job (`\"jobs/NAME\"` or a checkpoint directory of it); the shape comes from it",
    },
];

/// The shape of a gpt trained from scratch: nanoGPT's CPU recipe.
pub fn scratch_defaults() -> GptOptions {
    GptOptions {
        n_layer: Some(4),
        n_head: Some(4),
        n_embd: Some(128),
        block_size: Some(64),
        dropout: Some(0.0),
        bias: Some(true),
        vocab_size: None,
        activation: Some(Activation::Gelu),
        init_from: None,
    }
}

impl LanguageModelOptions for GptOptions {
    /// Packed rows restart their positions (and the rotary angles or position embeddings
    /// with them) and attend within their example only.
    fn reads_packed_rows(&self) -> bool {
        true
    }

    /// Every key filled: from `init_from` (a key the job restates must agree with it; the
    /// window may be shorter, as nanoGPT's `crop_block_size`), else nanoGPT's defaults. A
    /// resumed job's `job.toml` has them all; its `init_from` is not read again when gone.
    fn complete(self) -> Result<Self, String> {
        let d = match &self.init_from {
            Some(dir) if self.is_complete() && !Path::new(dir).join("config.json").is_file() => {
                scratch_defaults()
            }
            Some(dir) => pretrained(&self, dir)?,
            None => scratch_defaults(),
        };
        let completed = GptOptions {
            n_layer: self.n_layer.or(d.n_layer),
            n_head: self.n_head.or(d.n_head),
            n_embd: self.n_embd.or(d.n_embd),
            block_size: self.block_size.or(d.block_size),
            dropout: self.dropout.or(d.dropout),
            bias: self.bias.or(d.bias),
            vocab_size: self.vocab_size.or(d.vocab_size),
            activation: self.activation.or(d.activation),
            init_from: self.init_from,
        };
        completed.check()?;
        Ok(completed)
    }

    fn block_size(&self) -> usize {
        self.block_size.unwrap_or(64)
    }

    fn vocab_size(&self) -> Option<usize> {
        self.vocab_size
    }

    fn init_from(&self) -> Option<&str> {
        self.init_from.as_deref()
    }
}

impl GptOptions {
    fn is_complete(&self) -> bool {
        self.n_layer.is_some()
            && self.n_head.is_some()
            && self.n_embd.is_some()
            && self.block_size.is_some()
            && self.vocab_size.is_some()
            && self.activation.is_some()
    }

    /// The sizes, each positive, and the heads dividing the channels.
    fn check(&self) -> Result<(), String> {
        let sizes = [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ];
        crate::no_zero_size(&sizes)?;
        if let Some(v) = self.vocab_size.filter(|&v| v > 1 << 31) {
            return Err(format!(
                "model.vocab_size = {v} is more than token ids hold (2^31); use at most {}",
                1u64 << 31
            ));
        }
        let dropout = self.dropout.unwrap_or(0.0);
        if !(0.0..1.0).contains(&dropout) {
            return Err(format!("model.dropout = {dropout} must be in [0, 1)"));
        }
        let (n_head, n_embd) = (self.n_head.unwrap_or(1), self.n_embd.unwrap_or(1));
        if n_embd % n_head != 0 {
            return Err(format!(
                "model.n_embd = {n_embd} must be divisible by model.n_head = {n_head} (each \
                 head takes n_embd / n_head channels); e.g. {}",
                (n_embd / n_head).max(1) * n_head
            ));
        }
        Ok(())
    }

    /// The model's shape; `vocab_size` is the data's when not set.
    pub fn config(&self, vocab_size: usize, block_size: usize) -> GptConfig {
        let d = scratch_defaults();
        let pick = |a: Option<usize>, b: Option<usize>| a.or(b).unwrap_or(1);
        GptConfig {
            vocab_size: self.vocab_size.unwrap_or(vocab_size),
            block_size,
            n_layer: pick(self.n_layer, d.n_layer),
            n_head: pick(self.n_head, d.n_head),
            n_embd: pick(self.n_embd, d.n_embd),
            dropout: self.dropout.unwrap_or(0.0),
            bias: self.bias.unwrap_or(true),
            activation: self.activation.unwrap_or_default(),
        }
    }

    /// `model.*` as `job.toml` holds them.
    pub fn from_table(options: &toml::Table) -> Result<GptOptions, String> {
        GptOptions::deserialize(toml::Value::Table(options.clone()))
            .map_err(|e| format!("the job's [model] does not read as gpt options: {e}"))
    }
}

/// The shape of the checkpoint in `dir` as the defaults (its weights need biases; `dropout`
/// stays the job's), each key `given` restates checked against it.
fn pretrained(given: &GptOptions, dir: &str) -> Result<GptOptions, String> {
    // What is wrong with the directory is `init_from`'s problem (named first, so the config
    // error points at it).
    let unreadable = |e: String| format!("model.init_from = \"{dir}\": {e}");
    let (shape, source) = match Trained::find(Path::new(dir)) {
        Some(trained) => (
            trained
                .and_then(|t| trained_shape(&t))
                .map_err(unreadable)?,
            "job.toml",
        ),
        None => {
            let read = || -> Result<Gpt2Shape, ddpjob_storage::hf::HfError> {
                let hf = HfDir::open(Path::new(dir))?;
                let shape = super::hf::read_shape(&hf)?;
                hf.check_weight_files()?;
                Ok(shape)
            };
            (
                read().map_err(|e| unreadable(e.to_string()))?,
                "config.json",
            )
        }
    };
    let source = format!("{dir}/{source}");
    let mut conflicts = Vec::new();
    let mut agree = |key: &str, given: Option<String>, theirs: String| {
        if let Some(given) = given.filter(|g| *g != theirs) {
            conflicts.push(format!("model.{key} = {given}, but {source} says {theirs}"));
        }
    };
    let text = |v: Option<usize>| v.map(|v| v.to_string());
    agree("n_layer", text(given.n_layer), shape.n_layer.to_string());
    agree("n_head", text(given.n_head), shape.n_head.to_string());
    agree("n_embd", text(given.n_embd), shape.n_embd.to_string());
    let vocab = shape.vocab_size.to_string();
    agree("vocab_size", text(given.vocab_size), vocab);
    agree(
        "activation",
        given.activation.map(|a| format!("\"{}\"", a.name())),
        format!("\"{}\"", shape.activation.name()),
    );
    let bias = given.bias.map(|b| b.to_string());
    agree("bias", bias, shape.bias.to_string());
    if let Some(block) = given.block_size.filter(|&b| b > shape.n_positions) {
        let n = shape.n_positions;
        conflicts.push(format!(
            "model.block_size = {block}, but {source} has position embeddings for {n} tokens; \
             use at most {n}"
        ));
    }
    if !conflicts.is_empty() {
        return Err(format!(
            "{}; leave a key out to take the checkpoint's",
            conflicts.join("; ")
        ));
    }
    Ok(GptOptions {
        n_layer: Some(shape.n_layer),
        n_head: Some(shape.n_head),
        n_embd: Some(shape.n_embd),
        block_size: Some(shape.n_positions),
        dropout: scratch_defaults().dropout,
        bias: Some(shape.bias),
        vocab_size: Some(shape.vocab_size),
        activation: Some(shape.activation),
        init_from: None,
    })
}

/// The shape of the gpt another job trained, from its `job.toml` (its vocabulary's size when
/// the data fixed it).
fn trained_shape(t: &Trained) -> Result<Gpt2Shape, String> {
    let model = t.model_table()?;
    let file = t.job.job_toml();
    if model.get("arch").and_then(toml::Value::as_str) != Some("gpt") {
        return Err(format!("`{}` is not a gpt job's", file.display()));
    }
    let int = |key: &str| {
        model
            .get(key)
            .and_then(toml::Value::as_integer)
            .map(|v| v as usize)
            .ok_or_else(|| format!("`{}` has no model.{key}", file.display()))
    };
    let activation = match model.get("activation").and_then(toml::Value::as_str) {
        Some("gelu_new") => Activation::GeluNew,
        _ => Activation::Gelu,
    };
    let vocab_size = match int("vocab_size") {
        Ok(v) => v,
        Err(e) => t.vocabulary_size().ok_or(e)?,
    };
    Ok(Gpt2Shape {
        n_layer: int("n_layer")?,
        n_head: int("n_head")?,
        n_embd: int("n_embd")?,
        n_positions: int("block_size")?,
        vocab_size,
        activation,
        bias: model
            .get("bias")
            .and_then(toml::Value::as_bool)
            .unwrap_or(true),
    })
}

/// The registry's builder of `arch = "gpt"`: random weights from the job's seed, or
/// `init_from`'s weights (unless a checkpoint will replace them).
pub fn build_gpt(o: &GptOptions, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    let (vocab_size, block_size) = token_windows("gpt", cx)?;
    if cx.quantize.is_some() {
        return Err(
            "model.quantize: a 4-bit base is built for `llama` and its kin (llama, \
                    mistral, qwen2, qwen3, gemma3_text, smollm3) in this version, not `gpt`; \
                    leave [model.quantize] out to train LoRA over the f32 gpt"
                .into(),
        );
    }
    let config = o.config(vocab_size, block_size);
    let source = WeightSource::for_job(cx, o.init_from.as_deref())?;
    // The gpt does its own autocast: its inputs are token ids, not values to cast.
    let gpt = Gpt::build(&config, source.builder(cx, &LORA_TARGETS), cx.compute_dtype)?;
    let reading = Reading {
        hf: &super::hf::Gpt2Layout,
        // Another job's gpt: its position table cut to this job's window.
        crop: Some("transformer.wpe.weight"),
    };
    source.fill(gpt.params(), reading, cx)?;
    Ok(Box::new(gpt))
}

/// `config.json` and tensors of a `gpt2` export of a gpt job whose resolved `[model]` is
/// `options` and whose weights are `tensors`.
pub fn hf_parts(
    options: &toml::Table,
    tensors: HashMap<String, Tensor>,
) -> Result<ddpjob_storage::hf::HfParts, String> {
    let o = GptOptions::from_table(options)?;
    // The vocabulary is the weights' (`hf_parts` reads it from them).
    let c = o.config(0, o.block_size());
    let export = Gpt2Export {
        n_head: c.n_head,
        block_size: c.block_size,
        dropout: c.dropout,
        activation: c.activation,
    };
    super::hf::hf_parts(&export, tensors)
}
