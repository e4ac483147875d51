//! `[model]` of `arch = "llama"`: the keys are `transformers`' `config.json` names, so a job
//! file reads like the config of the checkpoint it starts from. With `init_from`, every size
//! comes from the directory's `config.json` (a key the job restates must agree); without it,
//! the defaults make a small model that trains from scratch in minutes on a CPU.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::rope::Llama3Scaling;
use super::{Llama, LlamaConfig, QkNorm};
use crate::LanguageModelOptions;
use crate::Model;
use crate::kit::{Reading, WeightSource};
use ddpjob_seam::{BuildError, ModelContext};
use ddpjob_spec::KeyDoc;
use ddpjob_storage::checkpoint::Trained;
use ddpjob_storage::hf::{HfDir, SameLayout};

/// The `model_type`s read as `arch = "llama"`.
pub const MODEL_TYPES: [&str; 9] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gemma3_text",
];

/// `model.arch = "llama"`. Every key but `init_from` has a default or comes from
/// `init_from`'s `config.json`; `job.toml` holds them all written out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LlamaOptions {
    /// A Hugging Face model directory (`config.json`, `model.safetensors`, `tokenizer.json`)
    /// whose weights the job starts from, e.g. `"models/SmolLM2-135M"` (a Hub id is resolved
    /// to its cache directory before the options are read), or another llama job
    /// (`"jobs/NAME"`, or a checkpoint directory of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<String>,
    /// `"llama"`, `"mistral"`, `"qwen2"` (q/k/v biases), `"qwen3"` (each head's q and k
    /// RMS-normed) or `"smollm3"` (layers without positions, `no_rope_layers`): what
    /// `export --hf` writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    /// Context length in tokens (the window length of the data); at most
    /// `max_position_embeddings`, which it defaults to with `init_from`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_position_embeddings: Option<usize>,
    /// Required for `tokens` data; `text` data knows its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_hidden_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_attention_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Default `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rms_norm_eps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// `rope_type = "llama3"` with `factor`, `low_freq_factor`, `high_freq_factor`,
    /// `original_max_position_embeddings` (Llama 3.1/3.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScalingOptions>,
    /// SmolLM3: per layer, 1 where the layer rotates q and k, 0 where it has no positional
    /// encoding at all (NoPE).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_rope_layers: Option<Vec<usize>>,
    /// Mistral: each position attends to itself and the `sliding_window - 1` before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_word_embeddings: Option<bool>,
    /// Biases on q, k, v and o (Llama's `attention_bias`; Qwen2 has q/k/v biases always).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initializer_range: Option<f64>,
    /// Mixtures of experts (`qwen3_moe`, `mixtral`, `olmoe`): the experts of a sparse layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    /// The experts each token is routed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    /// Qwen3-MoE: each expert's width (Mixtral's and OLMoE's is `intermediate_size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    /// The chosen experts' weights renormalised to sum 1 (Mixtral: always).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    /// Qwen3-MoE: every `decoder_sparse_step`-th layer is sparse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder_sparse_step: Option<usize>,
    /// Qwen3-MoE: layers with a dense MLP of `intermediate_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_only_layers: Option<Vec<usize>>,
    /// The load-balancing loss's weight in the objective.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_aux_loss_coef: Option<f64>,
    /// Whether the load-balancing loss is in the training objective (as transformers adds it
    /// with `output_router_logits`); it is logged as `aux_loss` either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_router_logits: Option<bool>,
    /// Gemma 3: attention scores scaled by `query_pre_attn_scalar`^-½, not `head_dim`^-½.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 3: each layer's `"sliding_attention"` (within `sliding_window`, RoPE base
    /// `rope_local_base_freq`) or `"full_attention"` (`rope_theta`, `rope_scaling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3: the sliding layers' RoPE base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeScalingOptions {
    pub rope_type: RopeType,
    pub factor: f64,
    /// Llama 3's alone (0 for `"linear"`).
    #[serde(default)]
    pub low_freq_factor: f64,
    #[serde(default)]
    pub high_freq_factor: f64,
    #[serde(default)]
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeType {
    Llama3,
    /// Every frequency divided by `factor` (positions interpolated; Gemma 3's full layers).
    Linear,
}

/// The keys as `ddpjob keys` and the config reference show them, in the struct's order. Their
/// names and meanings are `config.json`'s; with `init_from` each defaults to the checkpoint's.
pub const KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "init_from",
        default: "none (random weights)",
        doc: "a Hugging Face `llama`, `mistral`, `qwen2`, `qwen3`, `smollm3`, `gemma3_text`, \
              `qwen3_moe`, `mixtral` or `olmoe` directory \
              (`config.json`, `model.safetensors` or an index's shards, `tokenizer.json`), or its \
              Hub id (`\"Qwen/Qwen3-0.6B\"`: the HF cache, downloaded if missing), or another \
              llama job",
    },
    KeyDoc {
        key: "model_type",
        default: "`\"llama\"`",
        doc: "`\"llama\"`, `\"mistral\"`, `\"qwen2\"` (q/k/v biases), `\"qwen3\"` (each \
              head's q and k RMS-normed), `\"smollm3\"` (layers without positions), \
              `\"gemma3_text\"` (Gemma 3) or the mixtures of experts `\"qwen3_moe\"`, \
              `\"mixtral\"`, `\"olmoe\"`: what `export --hf` writes",
    },
    KeyDoc {
        key: "block_size",
        default: "`64`; `max_position_embeddings`",
        doc: "context length in tokens (the window length of the data)",
    },
    KeyDoc {
        key: "max_position_embeddings",
        default: "`block_size`",
        doc: "the longest context the model is for (`block_size` at most this)",
    },
    KeyDoc {
        key: "vocab_size",
        default: "from the data",
        doc: "vocabulary size; required for `tokens` data",
    },
    KeyDoc {
        key: "hidden_size",
        default: "`128`",
        doc: "channels",
    },
    KeyDoc {
        key: "intermediate_size",
        default: "`384`",
        doc: "the SwiGLU MLP's width",
    },
    KeyDoc {
        key: "num_hidden_layers",
        default: "`4`",
        doc: "decoder layers",
    },
    KeyDoc {
        key: "num_attention_heads",
        default: "`4`",
        doc: "query heads",
    },
    KeyDoc {
        key: "num_key_value_heads",
        default: "`2`",
        doc: "key/value heads; must divide `num_attention_heads` (grouped-query attention)",
    },
    KeyDoc {
        key: "head_dim",
        default: "`hidden_size / num_attention_heads`",
        doc: "channels per head (even)",
    },
    KeyDoc {
        key: "rms_norm_eps",
        default: "`1e-5`",
        doc: "RMSNorm's epsilon",
    },
    KeyDoc {
        key: "rope_theta",
        default: "`10000.0`",
        doc: "the rotary embeddings' base",
    },
    KeyDoc {
        key: "rope_scaling",
        default: "none",
        doc: "`{ rope_type = \"llama3\", factor, low_freq_factor, high_freq_factor, \
              original_max_position_embeddings }` (Llama 3.1/3.2), or `{ rope_type = \
              \"linear\", factor }` (positions interpolated; Gemma 3's full layers)",
    },
    KeyDoc {
        key: "no_rope_layers",
        default: "none (every layer rotates)",
        doc: "`model_type = \"smollm3\"`: one entry per layer, 1 where it rotates q and k, 0 \
              where it has no positional encoding (NoPE)",
    },
    KeyDoc {
        key: "sliding_window",
        default: "none (the whole context)",
        doc: "`mistral`, `mixtral` (every layer) and `gemma3_text` (its sliding layers): each \
              position attends to itself and the `sliding_window - 1` positions before it",
    },
    KeyDoc {
        key: "tie_word_embeddings",
        default: "`true`",
        doc: "the output projection is the token embedding",
    },
    KeyDoc {
        key: "attention_bias",
        default: "`false`",
        doc: "biases on q, k, v and o",
    },
    KeyDoc {
        key: "initializer_range",
        default: "`0.02`",
        doc: "std of the normal initialisation from scratch",
    },
    KeyDoc {
        key: "num_experts",
        default: "the checkpoint's (`num_experts`, 5.x `num_local_experts`)",
        doc: "`qwen3_moe`, `mixtral`, `olmoe`: experts per sparse layer",
    },
    KeyDoc {
        key: "num_experts_per_tok",
        default: "the checkpoint's",
        doc: "experts each token is routed to (top k of the router's softmax)",
    },
    KeyDoc {
        key: "moe_intermediate_size",
        default: "the checkpoint's",
        doc: "`qwen3_moe`: each expert's SwiGLU width (Mixtral's and OLMoE's experts are \
              `intermediate_size` wide)",
    },
    KeyDoc {
        key: "norm_topk_prob",
        default: "the checkpoint's (`false`; Mixtral: always)",
        doc: "the chosen experts' weights renormalised to sum 1",
    },
    KeyDoc {
        key: "decoder_sparse_step",
        default: "`1`",
        doc: "`qwen3_moe`: layer i is sparse when (i + 1) is a multiple of it",
    },
    KeyDoc {
        key: "mlp_only_layers",
        default: "`[]`",
        doc: "`qwen3_moe`: layers with a dense MLP of `intermediate_size`",
    },
    KeyDoc {
        key: "router_aux_loss_coef",
        default: "the checkpoint's (`0.001`; OLMoE `0.01`)",
        doc: "the load-balancing loss's weight in the objective",
    },
    KeyDoc {
        key: "output_router_logits",
        default: "the checkpoint's (`false`)",
        doc: "`true`: the load-balancing loss (times `router_aux_loss_coef`) is trained on, as \
              transformers adds it; it is logged as `aux_loss` (`train/aux_loss`) either way, \
              per sequence (see the open-models chapter)",
    },
    KeyDoc {
        key: "query_pre_attn_scalar",
        default: "the checkpoint's",
        doc: "`gemma3_text`: attention scores scaled by its inverse square root (not \
              `head_dim`'s)",
    },
    KeyDoc {
        key: "layer_types",
        default: "the checkpoint's (4.x: every `sliding_window_pattern`-th layer full)",
        doc: "`gemma3_text`: one `\"sliding_attention\"` or `\"full_attention\"` per layer",
    },
    KeyDoc {
        key: "rope_local_base_freq",
        default: "the checkpoint's (`10000.0`)",
        doc: "`gemma3_text`: the sliding layers' RoPE base (the full layers': `rope_theta`, \
              `rope_scaling`)",
    },
];

/// The defaults of a model trained from scratch: 4 layers of 128 channels, 4 query and 2
/// key/value heads, SwiGLU of 384, context 64 (the size of the `gpt` recipe's model).
fn scratch_defaults() -> LlamaOptions {
    LlamaOptions {
        model_type: Some("llama".into()),
        block_size: Some(64),
        hidden_size: Some(128),
        intermediate_size: Some(384),
        num_hidden_layers: Some(4),
        num_attention_heads: Some(4),
        num_key_value_heads: Some(2),
        rms_norm_eps: Some(1e-5),
        rope_theta: Some(10_000.0),
        tie_word_embeddings: Some(true),
        attention_bias: Some(false),
        initializer_range: Some(0.02),
        ..LlamaOptions::default()
    }
}

impl LanguageModelOptions for LlamaOptions {
    /// Packed rows restart their positions (and the rotary angles or position embeddings
    /// with them) and attend within their example only.
    fn reads_packed_rows(&self) -> bool {
        true
    }

    /// Fills every key: from `init_from`'s `config.json` (refusing one the job restates
    /// differently), else from the scratch defaults. A resumed job's `job.toml` has them all
    /// already; its `init_from` is then not read again when it is gone.
    fn complete(self) -> Result<Self, String> {
        // The base options, and what to call their source in a conflict's message.
        let (base, source) = match &self.init_from {
            Some(dir) => {
                // What is wrong with the directory is `init_from`'s problem (named first, so
                // the config error points at it).
                let unreadable = |e: String| format!("model.init_from = \"{dir}\": {e}");
                match Trained::find(Path::new(dir)) {
                    Some(trained) => (
                        trained.and_then(|t| from_trained(&t)).map_err(unreadable)?,
                        format!("{dir}/job.toml"),
                    ),
                    None if self.is_complete() && !Path::new(dir).join("config.json").is_file() => {
                        return Ok(self);
                    }
                    None => {
                        let hf =
                            HfDir::open(Path::new(dir)).map_err(|e| unreadable(e.to_string()))?;
                        let options = from_hf(&hf, self.block_size).map_err(unreadable)?;
                        hf.check_weight_files()
                            .map_err(|e| unreadable(e.to_string()))?;
                        (options, format!("{dir}/config.json"))
                    }
                }
            }
            None => (scratch_defaults(), "the default".into()),
        };
        let merged = merge(self, base, &source)?;
        check(&merged)?;
        Ok(merged)
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

impl LlamaOptions {
    fn is_complete(&self) -> bool {
        let sizes = [
            self.block_size,
            self.max_position_embeddings,
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        ];
        sizes.iter().all(Option::is_some) && self.model_type.is_some()
    }

    /// The model's shape; `vocab_size` and `block_size` are the data's when not set.
    pub fn config(&self, vocab_size: usize, block_size: usize) -> LlamaConfig {
        let d = scratch_defaults();
        let pick = |a: Option<usize>, b: Option<usize>| a.or(b).unwrap_or(1);
        let hidden = pick(self.hidden_size, d.hidden_size);
        let heads = pick(self.num_attention_heads, d.num_attention_heads);
        let qwen = self.model_type.as_deref() == Some("qwen2");
        let qk_norm = match self.model_type.as_deref() {
            Some("qwen3" | "qwen3_moe" | "gemma3_text") => QkNorm::PerHead,
            Some("olmoe") => QkNorm::Whole,
            _ => QkNorm::None,
        };
        let attention_bias = self.attention_bias.unwrap_or(false);
        LlamaConfig {
            vocab_size: self.vocab_size.unwrap_or(vocab_size),
            block_size,
            hidden_size: hidden,
            intermediate_size: pick(self.intermediate_size, d.intermediate_size),
            num_hidden_layers: pick(self.num_hidden_layers, d.num_hidden_layers),
            num_attention_heads: heads,
            num_key_value_heads: pick(self.num_key_value_heads, d.num_key_value_heads),
            head_dim: self.head_dim.unwrap_or(hidden / heads.max(1)),
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-5),
            rope_theta: self.rope_theta.unwrap_or(10_000.0),
            rope_scaling: self
                .rope_scaling
                .filter(|s| s.rope_type == RopeType::Llama3)
                .map(|s| Llama3Scaling {
                    factor: s.factor,
                    low_freq_factor: s.low_freq_factor,
                    high_freq_factor: s.high_freq_factor,
                    original_max_position_embeddings: s.original_max_position_embeddings,
                }),
            rope_linear: self
                .rope_scaling
                .filter(|s| s.rope_type == RopeType::Linear)
                .map(|s| s.factor),
            gemma: super::gemma::gemma_config(self),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(true),
            qkv_bias: qwen || attention_bias,
            o_bias: !qwen && attention_bias,
            qk_norm,
            rotary: self
                .no_rope_layers
                .as_ref()
                .map(|layers| layers.iter().map(|&r| r != 0).collect()),
            sliding_window: self.sliding_window,
            initializer_range: self.initializer_range.unwrap_or(0.02),
            moe: super::moe_options::moe_config(self),
        }
    }

    /// `config.json` for `transformers`, as its `LlamaConfig` / `MistralConfig` /
    /// `Qwen2Config` / `Qwen3Config` writes it, for a model of `config`.
    pub fn hf_config(&self, config: &LlamaConfig) -> Map<String, Value> {
        let model_type = self.model_type.as_deref().unwrap_or("llama");
        let architecture = match model_type {
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            "smollm3" => "SmolLM3ForCausalLM",
            "qwen3_moe" => "Qwen3MoeForCausalLM",
            "mixtral" => "MixtralForCausalLM",
            "olmoe" => "OlmoeForCausalLM",
            "gemma3_text" => "Gemma3ForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let c = config;
        let mut m = Map::new();
        m.insert("architectures".into(), serde_json::json!([architecture]));
        m.insert("model_type".into(), model_type.into());
        m.insert("vocab_size".into(), c.vocab_size.into());
        m.insert("hidden_size".into(), c.hidden_size.into());
        m.insert("intermediate_size".into(), c.intermediate_size.into());
        m.insert("num_hidden_layers".into(), c.num_hidden_layers.into());
        m.insert("num_attention_heads".into(), c.num_attention_heads.into());
        m.insert("num_key_value_heads".into(), c.num_key_value_heads.into());
        m.insert("head_dim".into(), c.head_dim.into());
        m.insert("hidden_act".into(), "silu".into());
        let max_positions = self
            .max_position_embeddings
            .unwrap_or(c.block_size)
            .max(c.block_size);
        m.insert("max_position_embeddings".into(), max_positions.into());
        m.insert("rms_norm_eps".into(), c.rms_norm_eps.into());
        m.insert("rope_theta".into(), c.rope_theta.into());
        let scaling = self.rope_scaling.map(|s| match s.rope_type {
            RopeType::Llama3 => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
            RopeType::Linear => serde_json::json!({"rope_type": "linear", "factor": s.factor}),
        });
        m.insert("rope_scaling".into(), scaling.unwrap_or(Value::Null));
        m.insert("tie_word_embeddings".into(), c.tie_word_embeddings.into());
        m.insert("initializer_range".into(), c.initializer_range.into());
        m.insert("use_cache".into(), true.into());
        super::moe_options::write_moe(self, &mut m);
        match model_type {
            "qwen2" => {
                m.insert("use_sliding_window".into(), false.into());
            }
            "qwen3" => {
                m.insert("attention_bias".into(), c.qkv_bias.into());
                m.insert("use_sliding_window".into(), false.into());
                m.insert("sliding_window".into(), Value::Null);
            }
            "mistral" | "mixtral" => {
                let window = c.sliding_window.map_or(Value::Null, Value::from);
                m.insert("sliding_window".into(), window);
            }
            "qwen3_moe" => {
                m.insert("attention_bias".into(), c.qkv_bias.into());
                m.insert("use_sliding_window".into(), false.into());
                m.insert("sliding_window".into(), Value::Null);
            }
            "olmoe" => {
                m.insert("attention_bias".into(), c.o_bias.into());
                m.insert("clip_qkv".into(), Value::Null);
            }
            "gemma3_text" => super::gemma::write_gemma(self, c, &mut m),
            "smollm3" => {
                m.insert("attention_bias".into(), c.o_bias.into());
                m.insert("mlp_bias".into(), false.into());
                m.insert("use_sliding_window".into(), false.into());
                m.insert("sliding_window".into(), Value::Null);
                let layers = self
                    .no_rope_layers
                    .clone()
                    .unwrap_or_else(|| vec![1; c.num_hidden_layers]);
                m.insert("no_rope_layers".into(), serde_json::json!(layers));
                // SmolLM3Config's defaults are SmolLM3's own tokenizer's ids (a pad id of
                // 128004, past a smaller vocabulary, is refused by the embedding): none unless
                // the export's tokenizer says (the export fills in the base's).
                for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
                    m.insert(key.into(), Value::Null);
                }
            }
            _ => {
                m.insert("attention_bias".into(), c.o_bias.into());
                m.insert("mlp_bias".into(), false.into());
            }
        }
        m
    }
}

/// The options of the llama another job trained, from its `job.toml` (its vocabulary's size
/// when the data fixed it).
fn from_trained(trained: &Trained) -> Result<LlamaOptions, String> {
    let mut model = trained.model_table()?;
    let file = trained.job.job_toml();
    if model
        .remove("arch")
        .and_then(|a| a.as_str().map(String::from))
        .as_deref()
        != Some("llama")
    {
        return Err(format!("`{}` is not a llama job's", file.display()));
    }
    let mut options = LlamaOptions::deserialize(toml::Value::Table(model))
        .map_err(|e| format!("`{}`: {e}", file.display()))?;
    options.init_from = None;
    if options.vocab_size.is_none() {
        options.vocab_size = trained.vocabulary_size();
    }
    Ok(options)
}

/// The options `config.json` of `dir` describes (`block_size` = its maximum context).
fn from_hf(dir: &HfDir, wanted_block: Option<usize>) -> Result<LlamaOptions, String> {
    let s = |e: ddpjob_storage::hf::HfError| e.to_string();
    let model_type = dir.model_type().map_err(s)?;
    if let Some(why) = super::refusals::refusal(&dir.config, model_type) {
        return Err(format!(
            "`{}`: {why}",
            dir.root.join("config.json").display()
        ));
    }
    if !MODEL_TYPES.contains(&model_type) {
        return Err(format!(
            "`{}`: model_type \"{model_type}\" is not supported by model.arch = \"llama\"; \
             it reads {}",
            dir.root.display(),
            MODEL_TYPES.map(|t| format!("\"{t}\"")).join(", ")
        ));
    }
    let act = match model_type {
        // Gemma's MLP is GeGLU (`hidden_activation`), read in `gemma`.
        "gemma3_text" => "silu",
        _ => dir.str_or("hidden_act", "silu").map_err(s)?,
    };
    if act != "silu" {
        return Err(format!(
            "`{}`: hidden_act \"{act}\" is not supported (the Llama family's MLP is SwiGLU: \
             \"silu\")",
            dir.root.display()
        ));
    }
    if dir.bool_or("mlp_bias", false).map_err(s)? {
        return Err(format!(
            "`{}`: mlp_bias = true is not supported",
            dir.root.display()
        ));
    }
    let max_positions = dir.usize_or("max_position_embeddings", None).map_err(s)?;
    let sliding = match model_type {
        "qwen2" | "qwen3" | "smollm3" | "qwen3_moe"
            if !dir.bool_or("use_sliding_window", false).map_err(s)? =>
        {
            None
        }
        _ => match dir.config.get("sliding_window") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().unwrap_or(0) as usize),
        },
    };
    let hidden = dir.usize_or("hidden_size", None).map_err(s)?;
    let heads = dir.usize_or("num_attention_heads", None).map_err(s)?;
    let (theta, scaling) = match model_type {
        "gemma3_text" => super::gemma::full_rope(dir)?,
        _ => rope_parameters(dir)?,
    };
    let layers = dir.usize_or("num_hidden_layers", None).map_err(s)?;
    let no_rope_layers = match model_type {
        "smollm3" => Some(no_rope_layers(dir, layers)?),
        _ => None,
    };
    let options = LlamaOptions {
        init_from: None,
        model_type: Some(model_type.into()),
        block_size: Some(max_positions),
        max_position_embeddings: Some(max_positions),
        vocab_size: Some(dir.usize_or("vocab_size", None).map_err(s)?),
        hidden_size: Some(hidden),
        intermediate_size: Some(dir.usize_or("intermediate_size", None).map_err(s)?),
        num_hidden_layers: Some(layers),
        num_attention_heads: Some(heads),
        num_key_value_heads: Some(
            dir.usize_or("num_key_value_heads", Some(heads))
                .map_err(s)?,
        ),
        head_dim: Some(
            dir.usize_or("head_dim", Some(hidden / heads.max(1)))
                .map_err(s)?,
        ),
        rms_norm_eps: Some(dir.f64_or("rms_norm_eps", 1e-6).map_err(s)?),
        rope_theta: Some(theta),
        rope_scaling: scaling,
        no_rope_layers,
        // Mistral's window is computed; the others' (Qwen's `use_sliding_window`) refused below.
        sliding_window: sliding.filter(|_| windowed(model_type)),
        tie_word_embeddings: Some(dir.bool_or("tie_word_embeddings", false).map_err(s)?),
        attention_bias: Some(dir.bool_or("attention_bias", false).map_err(s)?),
        initializer_range: Some(dir.f64_or("initializer_range", 0.02).map_err(s)?),
        ..super::moe_options::moe_from_hf(dir, model_type)?
    };
    let options = match model_type {
        "gemma3_text" => super::gemma::gemma_from_hf(dir, options, layers)?,
        _ => options,
    };
    let block = wanted_block.unwrap_or(max_positions);
    if let Some(window) = sliding.filter(|&w| w < block && !windowed(model_type)) {
        return Err(format!(
            "`{}`: a sliding attention window of {window} positions is in effect for \
             model.block_size = {block}, and ddpjob attends to the whole window; set \
             model.block_size to at most {window}",
            dir.root.display()
        ));
    }
    Ok(options)
}

/// Whether the family attends within `sliding_window` (Mistral's and Mixtral's).
fn windowed(model_type: &str) -> bool {
    matches!(model_type, "mistral" | "mixtral" | "gemma3_text")
}

/// SmolLM3's `no_rope_layers` (one 0 or 1 per layer), or as transformers makes it when the file
/// has none: every `no_rope_layer_interval`-th layer (default 4) without positions.
fn no_rope_layers(dir: &HfDir, layers: usize) -> Result<Vec<usize>, String> {
    let where_ = dir.root.join("config.json");
    match dir.config.get("no_rope_layers") {
        None | Some(Value::Null) => {
            let interval = dir
                .usize_or("no_rope_layer_interval", Some(4))
                .map_err(|e| e.to_string())?
                .max(1);
            Ok((0..layers)
                .map(|i| usize::from((i + 1) % interval != 0))
                .collect())
        }
        Some(Value::Array(values)) => values
            .iter()
            .map(|v| v.as_u64().filter(|&v| v <= 1).map(|v| v as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                format!(
                    "`{}`: no_rope_layers must be a list of 0 and 1, one per layer",
                    where_.display()
                )
            }),
        Some(other) => Err(format!(
            "`{}`: no_rope_layers must be a list of 0 and 1, one per layer, not {other}",
            where_.display()
        )),
    }
}

/// `rope_theta` and `rope_scaling` at the top level (transformers 4.x) or inside
/// `rope_parameters` (5.x).
pub(super) fn rope_parameters(dir: &HfDir) -> Result<(f64, Option<RopeScalingOptions>), String> {
    let where_ = dir.root.join("config.json");
    let nested = dir.config.get("rope_parameters").and_then(Value::as_object);
    let theta = nested
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .map_or_else(
            || {
                dir.f64_or("rope_theta", 10_000.0)
                    .map_err(|e| e.to_string())
            },
            Ok,
        )?;
    let scaling = match nested {
        Some(p) => Some(p),
        None => dir.config.get("rope_scaling").and_then(Value::as_object),
    };
    let Some(scaling) = scaling else {
        return Ok((theta, None));
    };
    Ok((theta, rope_scaling_of(scaling, &where_)?))
}

/// A `rope_scaling` (or `rope_parameters`) object's scaling: `None` for `"default"`.
pub(super) fn rope_scaling_of(
    scaling: &Map<String, Value>,
    where_: &Path,
) -> Result<Option<RopeScalingOptions>, String> {
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "linear" => {
            let factor = scaling
                .get("factor")
                .and_then(Value::as_f64)
                .ok_or_else(|| {
                    format!(
                        "`{}`: rope scaling \"linear\" has no number \"factor\"",
                        where_.display()
                    )
                })?;
            Ok(Some(RopeScalingOptions {
                rope_type: RopeType::Linear,
                factor,
                low_freq_factor: 0.0,
                high_freq_factor: 0.0,
                original_max_position_embeddings: 0,
            }))
        }
        "llama3" => {
            let num = |k: &str| {
                scaling.get(k).and_then(Value::as_f64).ok_or_else(|| {
                    format!(
                        "`{}`: rope scaling \"llama3\" has no number \"{k}\"",
                        where_.display()
                    )
                })
            };
            Ok(Some(RopeScalingOptions {
                rope_type: RopeType::Llama3,
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
            }))
        }
        other => Err(format!(
            "`{}`: rope scaling of type \"{other}\" is not supported (\"default\", \"linear\" \
             and \"llama3\" are)",
            where_.display()
        )),
    }
}

/// `given` with the keys it leaves out taken from `base`; a key both set differently is an
/// error naming both values.
fn merge(given: LlamaOptions, base: LlamaOptions, source: &str) -> Result<LlamaOptions, String> {
    let restated = given.init_from.is_some();
    let mut conflicts = Vec::new();
    macro_rules! take {
        ($field:ident) => {{
            match (&given.$field, &base.$field) {
                (Some(g), Some(b)) if restated && g != b => {
                    conflicts.push(format!(
                        "model.{} = {:?}, but {source} says {:?}",
                        stringify!($field),
                        g,
                        b
                    ));
                    given.$field.clone()
                }
                (Some(_), _) => given.$field.clone(),
                (None, _) => base.$field.clone(),
            }
        }};
    }
    let block_size = given.block_size.or(base.block_size);
    let merged = LlamaOptions {
        init_from: given.init_from.clone(),
        model_type: take!(model_type),
        block_size,
        max_position_embeddings: take!(max_position_embeddings),
        vocab_size: take!(vocab_size),
        hidden_size: take!(hidden_size),
        intermediate_size: take!(intermediate_size),
        num_hidden_layers: take!(num_hidden_layers),
        num_attention_heads: take!(num_attention_heads),
        num_key_value_heads: take!(num_key_value_heads),
        head_dim: take!(head_dim),
        rms_norm_eps: take!(rms_norm_eps),
        rope_theta: take!(rope_theta),
        rope_scaling: take!(rope_scaling),
        no_rope_layers: take!(no_rope_layers),
        sliding_window: take!(sliding_window),
        tie_word_embeddings: take!(tie_word_embeddings),
        attention_bias: take!(attention_bias),
        initializer_range: take!(initializer_range),
        num_experts: take!(num_experts),
        num_experts_per_tok: take!(num_experts_per_tok),
        moe_intermediate_size: take!(moe_intermediate_size),
        norm_topk_prob: take!(norm_topk_prob),
        decoder_sparse_step: take!(decoder_sparse_step),
        mlp_only_layers: take!(mlp_only_layers),
        // How the mixture trains, not what the checkpoint is (transformers takes both as
        // `from_pretrained` arguments): the job's choice wins.
        router_aux_loss_coef: given.router_aux_loss_coef.or(base.router_aux_loss_coef),
        output_router_logits: given.output_router_logits.or(base.output_router_logits),
        query_pre_attn_scalar: take!(query_pre_attn_scalar),
        layer_types: take!(layer_types),
        rope_local_base_freq: take!(rope_local_base_freq),
    };
    if !conflicts.is_empty() {
        return Err(format!(
            "{}; leave the key out to take the checkpoint's value",
            conflicts.join("; ")
        ));
    }
    let (hidden, heads) = (
        merged.hidden_size.unwrap_or(1),
        merged.num_attention_heads.unwrap_or(1),
    );
    Ok(LlamaOptions {
        head_dim: merged.head_dim.or(Some(hidden / heads.max(1))),
        max_position_embeddings: merged.max_position_embeddings.or(merged.block_size),
        ..merged
    })
}

/// How the filled-in keys fit together.
fn check(o: &LlamaOptions) -> Result<(), String> {
    let get = |v: Option<usize>| v.unwrap_or(0);
    let (heads, kv) = (get(o.num_attention_heads), get(o.num_key_value_heads));
    if heads == 0 || kv == 0 || heads % kv != 0 {
        return Err(format!(
            "model.num_attention_heads = {heads} must be a positive multiple of \
             model.num_key_value_heads = {kv} (each key/value head serves a group of query heads)"
        ));
    }
    if let Some(t) = &o.model_type
        && !MODEL_TYPES.contains(&t.as_str())
    {
        return Err(format!(
            "model.model_type = \"{t}\" is not one of {}",
            MODEL_TYPES.map(|t| format!("\"{t}\"")).join(", ")
        ));
    }
    if let Some(layers) = &o.no_rope_layers {
        let depth = get(o.num_hidden_layers);
        if o.model_type.as_deref() != Some("smollm3") {
            return Err(format!(
                "model.no_rope_layers is SmolLM3's (model_type = \"smollm3\"), not {:?}'s: \
                 transformers would rotate every layer of the export",
                o.model_type.as_deref().unwrap_or("llama")
            ));
        }
        if layers.len() != depth || layers.iter().any(|&r| r > 1) {
            return Err(format!(
                "model.no_rope_layers = {layers:?} must hold one 0 or 1 per layer: \
                 num_hidden_layers = {depth}"
            ));
        }
    }
    super::moe_options::check_moe(o)?;
    if let Some(window) = o.sliding_window {
        if !windowed(o.model_type.as_deref().unwrap_or("llama")) {
            return Err(format!(
                "model.sliding_window is Mistral's and Mixtral's (model_type = \"mistral\" or \
                 \"mixtral\"), not {:?}'s: \
                 transformers would attend to the whole context of the export",
                o.model_type.as_deref().unwrap_or("llama")
            ));
        }
        if window == 0 {
            return Err("model.sliding_window must be at least 1 (a position sees itself)".into());
        }
    }
    let (block, max) = (get(o.block_size), get(o.max_position_embeddings));
    if block > max {
        let why = match &o.init_from {
            Some(dir) => format!("what `{dir}` was trained for (or its sliding window)"),
            None => "model.max_position_embeddings".into(),
        };
        return Err(format!(
            "model.block_size = {block} is longer than {why}: {max}; use at most {max}"
        ));
    }
    if get(o.head_dim) % 2 != 0 {
        return Err(format!(
            "model.head_dim = {} must be even (rotary pairs)",
            get(o.head_dim)
        ));
    }
    let sizes = [
        ("hidden_size", o.hidden_size),
        ("intermediate_size", o.intermediate_size),
        ("num_hidden_layers", o.num_hidden_layers),
        ("head_dim", o.head_dim),
        ("vocab_size", o.vocab_size),
        ("block_size", o.block_size),
        ("max_position_embeddings", o.max_position_embeddings),
    ];
    crate::no_zero_size(&sizes)?;
    // Each a number the model divides by, takes a logarithm of or adds to a variance: out of
    // range, it trains on NaN (reported as a diverging loss, with the wrong advice).
    let positive = |key: &str, v: Option<f64>| match v {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(format!(
            "model.{key} must be a finite number above 0, got {x}"
        )),
        _ => Ok(()),
    };
    positive("rope_theta", o.rope_theta)?;
    positive("initializer_range", o.initializer_range)?;
    if let Some(eps) = o.rms_norm_eps
        && !(eps.is_finite() && eps >= 0.0)
    {
        return Err(format!("model.rms_norm_eps must be 0 or more, got {eps}"));
    }
    super::gemma::check_gemma(o)?;
    if let Some(r) = o.rope_scaling.filter(|r| r.rope_type == RopeType::Linear) {
        positive("rope_scaling.factor", Some(r.factor))?;
    }
    if let Some(r) = o.rope_scaling.filter(|r| r.rope_type == RopeType::Llama3) {
        positive("rope_scaling.factor", Some(r.factor))?;
        positive("rope_scaling.low_freq_factor", Some(r.low_freq_factor))?;
        if !(r.high_freq_factor.is_finite() && r.high_freq_factor > r.low_freq_factor) {
            return Err(format!(
                "model.rope_scaling.high_freq_factor = {} must be above low_freq_factor = {} \
                 (the band between them is smoothed)",
                r.high_freq_factor, r.low_freq_factor
            ));
        }
        if r.original_max_position_embeddings == 0 {
            return Err(
                "model.rope_scaling.original_max_position_embeddings must be at least 1".into(),
            );
        }
    }
    Ok(())
}

/// The layers that get LoRA adapters when `[model.lora]` names none: PEFT's for llama.
const LORA_TARGETS: [&str; 2] = ["q_proj", "v_proj"];

/// The registry's builder of `arch = "llama"`: random weights from the job's seed, or
/// `init_from`'s weights (unless a checkpoint will replace them).
pub fn build_llama(o: &LlamaOptions, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    let (vocab_size, block_size) = crate::token_windows("llama", cx)?;
    let config = o.config(vocab_size, block_size);
    let source = WeightSource::for_job(cx, o.init_from.as_deref())?;
    let model = Llama::build(&config, source.builder(cx, &LORA_TARGETS), cx.compute_dtype)?;
    let reading = Reading {
        // Buffers older files carry: rotary inverse frequencies, recomputed here.
        hf: &SameLayout(|name: &str| name.ends_with("rotary_emb.inv_freq")),
        crop: None,
    };
    source.fill(model.params(), reading, cx)?;
    Ok(Box::new(model))
}

/// `config.json` and the tensors of a Hugging Face export of a llama job whose resolved
/// `[model]` options are `options` and whose weights are `tensors` (named as trained; the
/// tied `lm_head.weight` left out, as `save_pretrained` leaves it).
pub fn hf_parts(
    options: &toml::Table,
    mut tensors: std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<ddpjob_storage::hf::HfParts, String> {
    let o: LlamaOptions = LlamaOptions::deserialize(toml::Value::Table(options.clone()))
        .map_err(|e| format!("the job's [model] does not read as llama options: {e}"))?;
    let embed = tensors
        .get("model.embed_tokens.weight")
        .ok_or("the weights have no `model.embed_tokens.weight`: not a llama job's")?;
    let vocab = embed.dims().first().copied().unwrap_or(0);
    let config = o.config(vocab, o.block_size());
    if config.tie_word_embeddings {
        tensors.remove("lm_head.weight");
    }
    Ok((o.hf_config(&config), tensors))
}
