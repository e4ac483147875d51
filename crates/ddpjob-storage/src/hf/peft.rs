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
use ddpjob_spec::{LoraSpec, is_adapter};

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

/// `target_modules` for the adapted `layers` (sorted) of a model whose weights are `tensors`:
/// their last components, which PEFT matches by suffix, when those name no layer left
/// unadapted (`q_proj` when every `q_proj` has an adapter); else the layers' full names.
fn target_names(layers: &[String], tensors: &HashMap<String, Tensor>) -> Vec<String> {
    let short: BTreeSet<&str> = layers.iter().filter_map(|l| l.rsplit('.').next()).collect();
    let named = |module: &str| {
        short
            .iter()
            .any(|m| module == *m || module.ends_with(&format!(".{m}")))
    };
    let others_named = tensors
        .keys()
        .filter(|n| !is_adapter(n))
        .filter_map(|n| n.strip_suffix(".weight"))
        .any(|module| {
            named(module) && layers.binary_search_by(|l| l.as_str().cmp(module)).is_err()
        });
    match others_named {
        true => layers.to_vec(),
        false => short.into_iter().map(String::from).collect(),
    }
}

/// `tensors` with every adapter folded into its layer's weight and removed, scaled by `scale`
/// (`alpha / r` of the LoRA that trained them).
pub fn merge_lora(
    mut tensors: HashMap<String, Tensor>,
    scale: f64,
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
            .and_then(|delta| delta.affine(scale, 0.0))
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
    let modules = target_names(&layers, &tensors);
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
        // A local directory named relative to where the job ran means nothing elsewhere.
        "base_model_name_or_path": base.map(|b| match std::fs::canonicalize(b) {
            Ok(dir) if dir.is_dir() => dir.display().to_string(),
            _ => b.to_string(),
        }),
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        // A regular expression names the layers it named; names, by their last parts.
        "target_modules": match &lora.target_modules {
            ddpjob_spec::TargetModules::Regex(pattern) => json!(pattern),
            ddpjob_spec::TargetModules::Names(_) => json!(modules),
        },
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
    // An adapter's files only: a base model kept beside it stays.
    let written = [
        "adapter_model.safetensors".into(),
        "adapter_config.json".into(),
    ];
    super::export::remove_stale(dir, &written, |name| name.starts_with("adapter_"))?;
    Ok(layers.len())
}

pub use ddpjob_spec::AdapterConfig;

/// Sets the adapters of `params` from the PEFT adapter in `dir` (`adapter_model.safetensors`,
/// keys `base_model.model.<layer>.lora_A.weight`): every adapter of the model must be there
/// with its shape, and nothing else. Returns how many tensors were set.
pub fn load_adapter(dir: &Path, params: &ddpjob_seam::Params) -> Result<usize, String> {
    let path = dir.join("adapter_model.safetensors");
    if !path.is_file() && dir.join("adapter_model.bin").is_file() {
        return Err(format!(
            "`{}` holds the adapter as adapter_model.bin, which ddpjob does not read (a pickle): \
             save it with `model.save_pretrained(dir, safe_serialization=True)` for \
             adapter_model.safetensors",
            dir.display()
        ));
    }
    let saved = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
        .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let mut saved: HashMap<String, Tensor> = saved
        .into_iter()
        .map(|(k, t)| (k.strip_prefix(PEFT_PREFIX).unwrap_or(&k).to_string(), t))
        .collect();
    let mut set = 0;
    for (name, var) in params.iter().filter(|(n, _)| is_adapter(n)) {
        let tensor = saved.remove(name).ok_or_else(|| {
            format!(
                "`{}` has no `{PEFT_PREFIX}{name}`: the adapter was not made for this model \
                 and [model.lora] (its base or target_modules differ)",
                path.display()
            )
        })?;
        ddpjob_seam::set_parameter(name, var, &tensor).map_err(|e| {
            format!(
                "`{}`: {e}: the adapter's base is another model",
                path.display()
            )
        })?;
        set += 1;
    }
    if let Some(extra) = saved.keys().min() {
        return Err(format!(
            "`{}` holds `{extra}`, which this model has no place for: the adapter was made for \
             another base or other target_modules",
            path.display()
        ));
    }
    Ok(set)
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
            target_modules: Default::default(),
            adapter: None,
        };
        let merged = merge_lora(tensors, lora.scale()).unwrap();
        assert_eq!(merged.len(), 1);
        // W + 2·[[0.5], [-1]]·[[1, 1]] = [[2, 3], [1, 2]].
        let w = merged["l.weight"].to_vec2::<f32>().unwrap();
        assert_eq!(w, vec![vec![2.0, 3.0], vec![1.0, 2.0]]);
    }

    #[test]
    fn adapter_settings_ddpjob_does_not_train_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let read = |extra: &str| {
            let config = format!(
                r#"{{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                    "base_model_name_or_path": "nowhere"{extra}}}"#
            );
            std::fs::write(dir.path().join("adapter_config.json"), config).unwrap();
            AdapterConfig::read(dir.path()).unwrap_err()
        };
        // Empty or off, they are PEFT's defaults: only the base is missing here.
        let plain = read(
            r#", "exclude_modules": null, "trainable_token_indices": [], "task_type": "CAUSAL_LM""#,
        );
        assert!(plain.contains("base_model_name_or_path"), "{plain}");
        for (setting, key) in [
            (r#", "exclude_modules": ["down_proj"]"#, "exclude_modules"),
            (r#", "target_parameters": ["experts"]"#, "target_parameters"),
            (
                r#", "trainable_token_indices": [5]"#,
                "trainable_token_indices",
            ),
            (r#", "rank_pattern": {"q_proj": 8}"#, "rank_pattern"),
            (r#", "use_dora": true"#, "use_dora"),
        ] {
            let err = read(setting);
            assert!(err.contains(&format!("it sets {key}")), "{err}");
        }
        let err = read(r#", "task_type": "SEQ_CLS""#);
        assert!(err.contains("task_type \"SEQ_CLS\""), "{err}");
    }

    #[test]
    fn target_modules_are_short_names_only_when_they_name_no_layer_left_unadapted() {
        let t = || Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let mut tensors = HashMap::new();
        for layer in [
            "model.layers.0.self_attn.q_proj",
            "model.layers.1.self_attn.q_proj",
        ] {
            tensors.insert(format!("{layer}.weight"), t());
        }
        tensors.insert("model.embed_tokens.weight".into(), t());
        let adapt = |tensors: &mut HashMap<String, Tensor>, layer: &str| {
            for part in ["lora_A", "lora_B"] {
                tensors.insert(format!("{layer}.{part}.weight"), t());
            }
        };
        adapt(&mut tensors, "model.layers.0.self_attn.q_proj");
        // `q_proj` would also name layer 1's, which has no adapter: the full name.
        let layers = adapted_layers(&tensors);
        assert_eq!(
            target_names(&layers, &tensors),
            ["model.layers.0.self_attn.q_proj"]
        );
        adapt(&mut tensors, "model.layers.1.self_attn.q_proj");
        let layers = adapted_layers(&tensors);
        assert_eq!(target_names(&layers, &tensors), ["q_proj"]);
    }

    #[test]
    fn an_adapter_targeted_by_a_regular_expression_is_exported_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("adapter");
        let t = |shape: (usize, usize)| Tensor::zeros(shape, candle_core::DType::F32, &Device::Cpu);
        let mut tensors = HashMap::new();
        let layer = "model.layers.1.self_attn.q_proj";
        tensors.insert(format!("{layer}.weight"), t((2, 2)).unwrap());
        tensors.insert(format!("{layer}.lora_A.weight"), t((1, 2)).unwrap());
        tensors.insert(format!("{layer}.lora_B.weight"), t((2, 1)).unwrap());
        let pattern = r".*\.1\.self_attn\.q_proj";
        let lora = LoraSpec {
            r: 1,
            alpha: 2.0,
            dropout: 0.0,
            target_modules: ddpjob_spec::TargetModules::Regex(pattern.into()),
            adapter: None,
        };
        write_adapter(&out, tensors, &lora, false, None, ExportDtype::F32, false).unwrap();
        let config = AdapterConfig::read(&out).err().unwrap();
        // No base here; what it wrote is the pattern itself.
        assert!(config.contains("base_model_name_or_path"), "{config}");
        let text = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
        let written: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(written["target_modules"], json!(pattern));
    }
}
