//! The `[model]` keys of the llama's mixtures of experts (`qwen3_moe`, `mixtral`, `olmoe`):
//! read from `config.json` as transformers 4.x and 5.x write it (the expert count is
//! `num_experts` in 4.x files and Qwen3-MoE's 5.x `num_local_experts`), checked, turned into
//! the model's [`MoeConfig`] and written back for `export --hf`.

use serde_json::{Map, Value};

use super::moe::{ExpertNames, MoeConfig};
use super::options::LlamaOptions;
use ddpjob_storage::hf::HfDir;

/// Whether `model_type` is a mixture of experts.
pub(super) fn is_moe(model_type: &str) -> bool {
    matches!(model_type, "qwen3_moe" | "mixtral" | "olmoe")
}

/// The mixture's keys of `dir`'s `config.json` (none for a dense family); the features
/// ddpjob does not compute are refused, by key.
pub(super) fn moe_from_hf(dir: &HfDir, model_type: &str) -> Result<LlamaOptions, String> {
    if !is_moe(model_type) {
        return Ok(LlamaOptions::default());
    }
    let s = |e: ddpjob_storage::hf::HfError| e.to_string();
    let file = dir.root.join("config.json");
    let refuse = |key: &str, why: &str| Err(format!("`{}`: {key}: {why}", file.display()));
    match dir
        .config
        .get("router_jitter_noise")
        .and_then(Value::as_f64)
    {
        Some(j) if j != 0.0 => {
            return refuse(
                "router_jitter_noise",
                &format!(
                    "{j} multiplies the router's input by random noise in training, which ddpjob \
                     does not do; set it to 0.0 in a copy of the config"
                ),
            );
        }
        _ => {}
    }
    if !matches!(dir.config.get("clip_qkv"), None | Some(Value::Null)) {
        return refuse(
            "clip_qkv",
            "clamping q, k and v is not supported (OLMoE's released checkpoints leave it null)",
        );
    }
    let experts = match dir.config.get("num_experts") {
        Some(Value::Number(_)) => dir.usize_or("num_experts", None),
        _ => dir.usize_or("num_local_experts", None),
    }
    .map_err(s)?;
    let layers = dir.usize_or("num_hidden_layers", None).map_err(s)?;
    let only: Vec<usize> = match dir.config.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(values)) => values
            .iter()
            .map(|v| v.as_u64().map(|v| v as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                format!(
                    "`{}`: mlp_only_layers must list layer indices",
                    file.display()
                )
            })?,
        Some(other) => return refuse("mlp_only_layers", &format!("{other} is not a list")),
    };
    let qwen = model_type == "qwen3_moe";
    Ok(LlamaOptions {
        num_experts: Some(experts),
        num_experts_per_tok: Some(dir.usize_or("num_experts_per_tok", None).map_err(s)?),
        moe_intermediate_size: match qwen {
            true => Some(dir.usize_or("moe_intermediate_size", None).map_err(s)?),
            false => None,
        },
        norm_topk_prob: Some(match model_type {
            "mixtral" => true,
            _ => dir.bool_or("norm_topk_prob", false).map_err(s)?,
        }),
        decoder_sparse_step: qwen
            .then(|| dir.usize_or("decoder_sparse_step", Some(1)))
            .transpose()
            .map_err(s)?,
        mlp_only_layers: qwen.then_some(only).filter(|_| layers > 0),
        router_aux_loss_coef: Some(
            dir.f64_or(
                "router_aux_loss_coef",
                if model_type == "olmoe" { 0.01 } else { 0.001 },
            )
            .map_err(s)?,
        ),
        output_router_logits: Some(dir.bool_or("output_router_logits", false).map_err(s)?),
        ..LlamaOptions::default()
    })
}

/// The model's mixture, from the completed options (`None` for a dense family).
pub(super) fn moe_config(o: &LlamaOptions) -> Option<MoeConfig> {
    let model_type = o.model_type.as_deref().unwrap_or("llama");
    if !is_moe(model_type) {
        return None;
    }
    let layers = o.num_hidden_layers.unwrap_or(0);
    let step = o.decoder_sparse_step.unwrap_or(1).max(1);
    let only = o.mlp_only_layers.clone().unwrap_or_default();
    let sparse = (0..layers)
        .map(|i| !only.contains(&i) && (i + 1) % step == 0)
        .collect();
    Some(MoeConfig {
        num_experts: o.num_experts.unwrap_or(8),
        top_k: o.num_experts_per_tok.unwrap_or(2),
        norm_topk_prob: model_type == "mixtral" || o.norm_topk_prob.unwrap_or(false),
        expert_size: match model_type {
            "qwen3_moe" => o.moe_intermediate_size,
            _ => o.intermediate_size,
        }
        .unwrap_or(1),
        sparse,
        aux_coef: o.router_aux_loss_coef.unwrap_or(0.001),
        aux_in_loss: o.output_router_logits.unwrap_or(false),
        names: match model_type {
            "mixtral" => ExpertNames::Mixtral,
            _ => ExpertNames::Qwen,
        },
    })
}

/// The mixture's keys into an export's `config.json`, as transformers writes them.
pub(super) fn write_moe(o: &LlamaOptions, m: &mut Map<String, Value>) {
    let model_type = o.model_type.as_deref().unwrap_or("llama");
    let Some(c) = moe_config(o) else { return };
    // Both names of the count: 4.x reads `num_experts` (Mixtral: `num_local_experts`), 5.x
    // maps one onto the other.
    let count = match model_type {
        "mixtral" => "num_local_experts",
        _ => "num_experts",
    };
    m.insert(count.into(), c.num_experts.into());
    m.insert("num_experts_per_tok".into(), c.top_k.into());
    m.insert("router_aux_loss_coef".into(), c.aux_coef.into());
    m.insert("output_router_logits".into(), c.aux_in_loss.into());
    match model_type {
        "qwen3_moe" => {
            m.insert("moe_intermediate_size".into(), c.expert_size.into());
            m.insert("norm_topk_prob".into(), c.norm_topk_prob.into());
            let step = o.decoder_sparse_step.unwrap_or(1);
            m.insert("decoder_sparse_step".into(), step.into());
            let only = o.mlp_only_layers.clone().unwrap_or_default();
            m.insert("mlp_only_layers".into(), serde_json::json!(only));
        }
        "olmoe" => {
            m.insert("norm_topk_prob".into(), c.norm_topk_prob.into());
        }
        _ => {
            m.insert("router_jitter_noise".into(), 0.0.into());
        }
    }
}

/// How the mixture's keys fit together (and that a dense family has none).
pub(super) fn check_moe(o: &LlamaOptions) -> Result<(), String> {
    let model_type = o.model_type.as_deref().unwrap_or("llama");
    let set = [
        ("num_experts", o.num_experts.is_some()),
        ("num_experts_per_tok", o.num_experts_per_tok.is_some()),
        ("moe_intermediate_size", o.moe_intermediate_size.is_some()),
        ("decoder_sparse_step", o.decoder_sparse_step.is_some()),
        ("mlp_only_layers", o.mlp_only_layers.is_some()),
    ];
    if !is_moe(model_type) {
        if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
            return Err(format!(
                "model.{key} is a mixture of experts' key (model_type = \"qwen3_moe\", \
                 \"mixtral\" or \"olmoe\"), not {model_type:?}'s"
            ));
        }
        return Ok(());
    }
    let experts = o.num_experts.unwrap_or(0);
    let k = o.num_experts_per_tok.unwrap_or(0);
    if experts == 0 || k == 0 || k > experts {
        return Err(format!(
            "model.num_experts_per_tok = {k} must be between 1 and model.num_experts = {experts}"
        ));
    }
    if model_type == "qwen3_moe" && o.moe_intermediate_size.unwrap_or(0) == 0 {
        return Err("model.moe_intermediate_size must be at least 1 (each expert's width)".into());
    }
    if o.decoder_sparse_step == Some(0) {
        return Err("model.decoder_sparse_step must be at least 1".into());
    }
    let layers = o.num_hidden_layers.unwrap_or(0);
    if let Some(i) = o.mlp_only_layers.iter().flatten().find(|&&i| i >= layers) {
        return Err(format!(
            "model.mlp_only_layers names layer {i}, but there are {layers} (0 to {})",
            layers.saturating_sub(1)
        ));
    }
    match o.router_aux_loss_coef {
        Some(c) if !(c.is_finite() && c >= 0.0) => Err(format!(
            "model.router_aux_loss_coef must be a finite number of 0 or more, got {c}"
        )),
        _ => Ok(()),
    }
}
