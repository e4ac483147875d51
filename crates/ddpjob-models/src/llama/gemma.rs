//! Gemma 3's text model (`gemma3_text`, `Gemma3ForCausalLM`) as a member of the llama family:
//! what `config.json` says of it, in transformers 4.x's layout (`sliding_window_pattern`,
//! `rope_theta`, `rope_local_base_freq`, `rope_scaling`) and 5.x's (`layer_types`,
//! `rope_parameters.{sliding_attention,full_attention}`), checked, made into the model's
//! [`GemmaConfig`] and written back for `export --hf`. The model's side (the (1 + w) norms,
//! four per layer, the scaled embedding, GeGLU, the query scale, a RoPE table per layer type)
//! is in the llama's own code, switched by [`GemmaConfig`].

use serde_json::{Map, Value};

use super::LlamaConfig;
use super::options::{LlamaOptions, RopeScalingOptions, RopeType, rope_scaling_of};
use ddpjob_storage::hf::HfDir;

/// What makes a llama a Gemma 3 (see [`LlamaConfig::gemma`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaConfig {
    /// Scores scaled by `query_pre_attn_scalar`^-½.
    pub query_pre_attn_scalar: f64,
    /// Per layer: `"sliding_attention"` (within `sliding_window`, the local RoPE base).
    pub sliding: Vec<bool>,
    /// The sliding layers' RoPE base (`rope_local_base_freq`).
    pub local_rope_theta: f64,
}

const SLIDING: &str = "sliding_attention";
const FULL: &str = "full_attention";

/// The full layers' RoPE base and scaling: `rope_parameters.full_attention` (5.x), else
/// `rope_theta` (default 1,000,000) and `rope_scaling` (4.x).
pub(super) fn full_rope(dir: &HfDir) -> Result<(f64, Option<RopeScalingOptions>), String> {
    let where_ = dir.root.join("config.json");
    let full = dir
        .config
        .get("rope_parameters")
        .and_then(|p| p.get(FULL))
        .and_then(Value::as_object);
    match full {
        Some(full) => {
            let theta = full
                .get("rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or(1e6);
            Ok((theta, rope_scaling_of(full, &where_)?))
        }
        None => {
            let theta = dir.f64_or("rope_theta", 1e6).map_err(|e| e.to_string())?;
            let scaling = match dir.config.get("rope_scaling").and_then(Value::as_object) {
                Some(s) => rope_scaling_of(s, &where_)?,
                None => None,
            };
            Ok((theta, scaling))
        }
    }
}

/// `options` (read as any llama's) with Gemma 3's own keys of `dir`'s `config.json`; what
/// ddpjob does not compute refused by key.
pub(super) fn gemma_from_hf(
    dir: &HfDir,
    options: LlamaOptions,
    layers: usize,
) -> Result<LlamaOptions, String> {
    let s = |e: ddpjob_storage::hf::HfError| e.to_string();
    let file = dir.root.join("config.json");
    let refuse = |key: &str, why: &str| Err(format!("`{}`: {key}: {why}", file.display()));
    let fallback = dir.str_or("hidden_act", "gelu_pytorch_tanh").map_err(s)?;
    let act = dir.str_or("hidden_activation", fallback).map_err(s)?;
    if !matches!(act, "gelu_pytorch_tanh" | "gelu_new") {
        return refuse(
            "hidden_activation",
            &format!("\"{act}\" is not supported (Gemma 3's GeGLU is \"gelu_pytorch_tanh\")"),
        );
    }
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if !matches!(dir.config.get(key), None | Some(Value::Null)) {
            return refuse(
                key,
                "tanh soft-capping (Gemma 2's) is not supported; Gemma 3 has none",
            );
        }
    }
    if dir
        .bool_or("use_bidirectional_attention", false)
        .map_err(s)?
    {
        return refuse(
            "use_bidirectional_attention",
            "bidirectional attention (EmbeddingGemma's) is not supported: ddpjob trains causal \
             language models",
        );
    }
    let layer_types = match dir.config.get("layer_types") {
        Some(Value::Array(types)) => types
            .iter()
            .map(|t| match t.as_str() {
                Some(t @ (SLIDING | FULL)) => Ok(t.to_string()),
                _ => Err(format!(
                    "`{}`: layer_types holds {t}; \"{SLIDING}\" and \"{FULL}\" are read",
                    file.display()
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => {
            // 4.x: every `sliding_window_pattern`-th layer full (default 6).
            let pattern = dir
                .usize_or("sliding_window_pattern", Some(6))
                .map_err(s)?
                .max(1);
            (0..layers)
                .map(|i| {
                    if (i + 1) % pattern == 0 {
                        FULL
                    } else {
                        SLIDING
                    }
                    .to_string()
                })
                .collect()
        }
    };
    let local = match dir
        .config
        .get("rope_parameters")
        .and_then(|p| p.get(SLIDING))
        .and_then(Value::as_object)
    {
        Some(p) => {
            if rope_scaling_of(p, &file)?.is_some() {
                return refuse(
                    "rope_parameters.sliding_attention",
                    "a scaled RoPE on the sliding layers is not supported",
                );
            }
            p.get("rope_theta").and_then(Value::as_f64).unwrap_or(1e4)
        }
        None => dir.f64_or("rope_local_base_freq", 1e4).map_err(s)?,
    };
    let head_dim = options.head_dim.unwrap_or(256) as f64;
    Ok(LlamaOptions {
        query_pre_attn_scalar: Some(dir.f64_or("query_pre_attn_scalar", head_dim).map_err(s)?),
        layer_types: Some(layer_types),
        rope_local_base_freq: Some(local),
        sliding_window: match dir.config.get("sliding_window") {
            Some(Value::Number(n)) => n.as_u64().map(|n| n as usize),
            _ => Some(4096),
        },
        tie_word_embeddings: Some(dir.bool_or("tie_word_embeddings", true).map_err(s)?),
        ..options
    })
}

/// The model's Gemma part, from the completed options (`None` for another family).
pub(super) fn gemma_config(o: &LlamaOptions) -> Option<GemmaConfig> {
    if o.model_type.as_deref() != Some("gemma3_text") {
        return None;
    }
    let layers = o.num_hidden_layers.unwrap_or(0);
    let sliding = match &o.layer_types {
        Some(types) => types.iter().map(|t| t == SLIDING).collect(),
        None => (0..layers).map(|i| (i + 1) % 6 != 0).collect(),
    };
    Some(GemmaConfig {
        query_pre_attn_scalar: o
            .query_pre_attn_scalar
            .unwrap_or(o.head_dim.unwrap_or(256) as f64),
        sliding,
        local_rope_theta: o.rope_local_base_freq.unwrap_or(1e4),
    })
}

/// Gemma 3's keys into an export's `config.json`, in transformers 5.x's layout (which 4.x's
/// newer releases read too), replacing the llama's RoPE and activation keys.
pub(super) fn write_gemma(o: &LlamaOptions, c: &LlamaConfig, m: &mut Map<String, Value>) {
    let Some(g) = &c.gemma else { return };
    for key in ["hidden_act", "rope_theta", "rope_scaling"] {
        m.remove(key);
    }
    m.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
    // An integer in Gemma3TextConfig (transformers 5 refuses 24.0).
    let scalar = g.query_pre_attn_scalar;
    let scalar = match scalar.fract() == 0.0 && scalar >= 0.0 {
        true => Value::from(scalar as u64),
        false => Value::from(scalar),
    };
    m.insert("query_pre_attn_scalar".into(), scalar);
    let types: Vec<&str> = g
        .sliding
        .iter()
        .map(|&s| if s { SLIDING } else { FULL })
        .collect();
    m.insert("layer_types".into(), serde_json::json!(types));
    let window = c.sliding_window.map_or(Value::Null, Value::from);
    m.insert("sliding_window".into(), window);
    let mut full = serde_json::json!({"rope_type": "default", "rope_theta": c.rope_theta});
    if let Some(s) = o.rope_scaling.filter(|s| s.rope_type == RopeType::Linear) {
        full = serde_json::json!({"rope_type": "linear", "rope_theta": c.rope_theta, "factor": s.factor});
    }
    let local = serde_json::json!({"rope_type": "default", "rope_theta": g.local_rope_theta});
    m.insert(
        "rope_parameters".into(),
        serde_json::json!({ SLIDING: local, FULL: full }),
    );
    m.insert("attention_bias".into(), c.o_bias.into());
    m.insert("attn_logit_softcapping".into(), Value::Null);
    m.insert("final_logit_softcapping".into(), Value::Null);
    m.insert("use_bidirectional_attention".into(), false.into());
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        m.insert(key.into(), Value::Null);
    }
}

/// Gemma's keys fit together, and are not given to another family.
pub(super) fn check_gemma(o: &LlamaOptions) -> Result<(), String> {
    let gemma = o.model_type.as_deref() == Some("gemma3_text");
    let keys = [
        ("query_pre_attn_scalar", o.query_pre_attn_scalar.is_some()),
        ("layer_types", o.layer_types.is_some()),
        ("rope_local_base_freq", o.rope_local_base_freq.is_some()),
    ];
    if !gemma {
        if let Some((key, _)) = keys.iter().find(|(_, on)| *on) {
            return Err(format!(
                "model.{key} is Gemma 3's (model_type = \"gemma3_text\"), not {:?}'s",
                o.model_type.as_deref().unwrap_or("llama")
            ));
        }
        return Ok(());
    }
    let layers = o.num_hidden_layers.unwrap_or(0);
    if let Some(types) = &o.layer_types
        && (types.len() != layers || types.iter().any(|t| t != SLIDING && t != FULL))
    {
        return Err(format!(
            "model.layer_types must hold one \"{SLIDING}\" or \"{FULL}\" per layer \
             (num_hidden_layers = {layers}), got {types:?}"
        ));
    }
    for (key, v) in [
        ("query_pre_attn_scalar", o.query_pre_attn_scalar),
        ("rope_local_base_freq", o.rope_local_base_freq),
    ] {
        if let Some(v) = v
            && !(v.is_finite() && v > 0.0)
        {
            return Err(format!(
                "model.{key} must be a finite number above 0, got {v}"
            ));
        }
    }
    Ok(())
}
