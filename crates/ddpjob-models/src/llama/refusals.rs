//! What a `config.json` asks for that the llama family does not compute, named by key with
//! what to do, before the generic "model_type is not supported": a newer family's linear
//! attention or multi-latent attention, multi-token-prediction heads, a multimodal checkpoint's
//! vision or audio tower. Read before any weight.

use serde_json::Value;

/// Why `config` (of `model_type`) cannot be read as a llama, when a key says so.
pub fn refusal(config: &serde_json::Map<String, Value>, model_type: &str) -> Option<String> {
    let has = |key: &str| !matches!(config.get(key), None | Some(Value::Null));
    let positive = |key: &str| {
        config
            .get(key)
            .and_then(Value::as_u64)
            .is_some_and(|n| n > 0)
    };
    let layer_types = config
        .get("layer_types")
        .and_then(Value::as_array)
        .map(|types| types.iter().filter_map(Value::as_str).collect::<Vec<_>>())
        .unwrap_or_default();
    if layer_types.iter().any(|t| t.contains("linear")) || has("linear_num_value_heads") {
        return Some(format!(
            "model_type \"{model_type}\" has linear-attention layers (`layer_types` holds \
             \"linear_attention\"; Qwen3-Next's Gated DeltaNet, `linear_*` keys), which ddpjob \
             does not compute; only softmax attention is supported"
        ));
    }
    if has("kv_lora_rank") || has("q_lora_rank") {
        return Some(format!(
            "model_type \"{model_type}\" uses multi-latent attention (`kv_lora_rank`, DeepSeek's \
             MLA), which ddpjob does not compute"
        ));
    }
    for key in [
        "num_nextn_predict_layers",
        "mtp_num_hidden_layers",
        "num_mtp_modules",
    ] {
        if positive(key) {
            return Some(format!(
                "model_type \"{model_type}\" has multi-token-prediction heads (`{key}` = {}), \
                 which ddpjob neither trains nor exports; they cannot be left out without \
                 changing the checkpoint",
                config[key]
            ));
        }
    }
    for (key, tower) in [
        ("vision_config", "a vision tower"),
        ("audio_config", "an audio tower"),
        ("vision_tower", "a vision tower"),
    ] {
        if has(key) {
            let text = match config.get("text_config") {
                Some(Value::Object(_)) => {
                    " Its text model (`text_config`) is stored under the multimodal model's \
                     prefixes, so it is not separable as it is: use the text-only release of the \
                     model if there is one (e.g. a `gemma3_text` checkpoint)"
                }
                _ => "",
            };
            return Some(format!(
                "model_type \"{model_type}\" is multimodal: `{key}` describes {tower}, which \
                 ddpjob does not compute.{text}"
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::refusal;

    fn config(json: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        json.as_object().unwrap().clone()
    }

    #[test]
    fn features_not_computed_are_named_by_key() {
        let next = config(serde_json::json!({
            "layer_types": ["linear_attention", "full_attention"],
            "num_nextn_predict_layers": 1
        }));
        assert!(
            refusal(&next, "qwen3_next")
                .unwrap()
                .contains("linear_attention")
        );
        let mtp = config(serde_json::json!({"num_nextn_predict_layers": 1}));
        assert!(
            refusal(&mtp, "x")
                .unwrap()
                .contains("`num_nextn_predict_layers` = 1")
        );
        let vl = config(serde_json::json!({"vision_config": {}, "text_config": {}}));
        let why = refusal(&vl, "gemma3").unwrap();
        assert!(
            why.contains("vision tower") && why.contains("not separable"),
            "{why}"
        );
        let mla = config(serde_json::json!({"kv_lora_rank": 512}));
        assert!(
            refusal(&mla, "deepseek_v3")
                .unwrap()
                .contains("kv_lora_rank")
        );
        let plain = config(
            serde_json::json!({"layer_types": ["full_attention"], "num_nextn_predict_layers": 0}),
        );
        assert_eq!(refusal(&plain, "qwen3"), None);
    }
}
