//! LoRA adapters in and out of PEFT's format: `export --peft` writes `adapter_config.json` and
//! `adapter_model.safetensors` (keys `base_model.model.<module>.lora_A.weight`, as
//! `PeftModel.save_pretrained` writes them), and `export --hf --merge-lora` folds each adapter
//! into its layer's weight, `W + (alpha / r)·B·A`, as `merge_and_unload` does.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::Tensor;
use serde_json::{Value, json};

use super::HfError;
use super::export::{ExportDtype, prepare_dir, save_weights, write_atomically};
use crate::models::{LoraSpec, is_adapter};

/// The prefix PEFT gives a causal language model's modules in its files.
const PEFT_PREFIX: &str = "base_model.model.";

/// The adapted layers of `tensors` (each with its `lora_A` and `lora_B`), sorted.
fn adapted_layers(tensors: &HashMap<String, Tensor>) -> Vec<String> {
    let layers: BTreeSet<String> = tensors
        .keys()
        .filter_map(|n| n.strip_suffix(".lora_A.weight"))
        .map(String::from)
        .collect();
    layers.into_iter().collect()
}

/// `tensors` with every adapter folded into its layer's weight and removed.
pub fn merge_lora(
    mut tensors: HashMap<String, Tensor>,
    lora: &LoraSpec,
) -> Result<HashMap<String, Tensor>, String> {
    for layer in adapted_layers(&tensors) {
        let take = |tensors: &mut HashMap<String, Tensor>, part: &str| {
            let name = format!("{layer}.{part}.weight");
            tensors
                .remove(&name)
                .ok_or_else(|| format!("the weights have `{layer}.lora_A.weight` but no `{name}`"))
        };
        let (a, b) = (take(&mut tensors, "lora_A")?, take(&mut tensors, "lora_B")?);
        let name = format!("{layer}.weight");
        let w = tensors
            .get(&name)
            .ok_or_else(|| format!("an adapter of `{layer}`, whose weight `{name}` is missing"))?;
        let merged = b
            .matmul(&a)
            .and_then(|delta| delta.affine(lora.scale(), 0.0))
            .and_then(|delta| w.add(&delta))
            .map_err(|e| format!("merging the adapter of `{layer}`: {e}"))?;
        tensors.insert(name, merged);
    }
    Ok(tensors)
}

/// Writes the adapters of `tensors` into `dir` in PEFT's format (see the module docs).
/// `fan_in_fan_out`: the base stores the layers' weights `[in, out]` (GPT-2's `Conv1D`);
/// `base`: the base model's directory or name, as the job's `init_from` gave it.
pub fn write_adapter(
    dir: &Path,
    tensors: HashMap<String, Tensor>,
    lora: &LoraSpec,
    fan_in_fan_out: bool,
    base: Option<&str>,
    dtype: ExportDtype,
    force: bool,
) -> Result<usize, HfError> {
    let layers = adapted_layers(&tensors);
    if layers.is_empty() {
        return Err(HfError::Invalid(
            "the job's weights hold no LoRA adapters ([model.lora] was off): export --hf writes \
             the whole model"
                .into(),
        ));
    }
    // The module names PEFT matches by suffix: the layers' last components.
    let modules: BTreeSet<&str> = layers.iter().filter_map(|l| l.rsplit('.').next()).collect();
    let adapters: HashMap<String, Tensor> = tensors
        .into_iter()
        .filter(|(n, _)| is_adapter(n))
        .map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t))
        .collect();
    prepare_dir(dir, force, "--peft")?;
    save_weights(dir, "adapter_model.safetensors", adapters, dtype)?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules.into_iter().collect::<Vec<_>>(),
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": Value::Null,
        "use_rslora": false,
        "use_dora": false,
    });
    let text = serde_json::to_string_pretty(&config).unwrap_or_default();
    write_atomically(&dir.join("adapter_config.json"), text.as_bytes())?;
    Ok(layers.len())
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn merging_adds_the_scaled_product_and_drops_the_adapter() {
        let t =
            |v: &[f32], shape: (usize, usize)| Tensor::from_slice(v, shape, &Device::Cpu).unwrap();
        let mut tensors = HashMap::new();
        tensors.insert("l.weight".to_string(), t(&[1.0, 2.0, 3.0, 4.0], (2, 2)));
        tensors.insert("l.lora_A.weight".to_string(), t(&[1.0, 1.0], (1, 2)));
        tensors.insert("l.lora_B.weight".to_string(), t(&[0.5, -1.0], (2, 1)));
        let lora = LoraSpec {
            r: 1,
            alpha: 2.0,
            dropout: 0.0,
            target_modules: vec![],
        };
        let merged = merge_lora(tensors, &lora).unwrap();
        assert_eq!(merged.len(), 1);
        // W + 2·[[0.5], [-1]]·[[1, 1]] = [[2, 3], [1, 2]].
        let w = merged["l.weight"].to_vec2::<f32>().unwrap();
        assert_eq!(w, vec![vec![2.0, 3.0], vec![1.0, 2.0]]);
    }
}
