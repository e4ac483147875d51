//! A PEFT adapter directory's `adapter_config.json`, read and checked to be an adapter ddpjob
//! trains as PEFT does: what `model.init_from` or `model.lora.adapter` naming one puts in
//! `[model.lora]`. Reading the adapter's weights is the storage's (`hf::peft`).

use std::path::Path;

use serde_json::Value;

use super::lora::TargetModules;

/// What a PEFT adapter directory's `adapter_config.json` says, once checked to be an adapter
/// ddpjob trains as PEFT does.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    /// `base_model_name_or_path`, resolved to a directory here.
    pub base: std::path::PathBuf,
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub target_modules: TargetModules,
}

impl AdapterConfig {
    /// Whether `dir` holds a PEFT adapter (an `adapter_config.json`).
    pub fn is_adapter_dir(dir: &Path) -> bool {
        dir.join("adapter_config.json").is_file()
    }

    /// Reads `dir/adapter_config.json`: a LoRA adapter of plain linear layers (no DoRA,
    /// rsLoRA, per-layer ranks, extra trained modules or biases), whose base is a directory on
    /// this machine (`base_model_name_or_path` as written, else relative to the adapter).
    pub fn read(dir: &Path) -> Result<AdapterConfig, String> {
        let path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        let c: Value = serde_json::from_str(&text)
            .map_err(|e| format!("`{}` is not JSON: {e}", path.display()))?;
        let bad = |problem: String| format!("`{}`: {problem}", path.display());
        if c["peft_type"] != "LORA" {
            return Err(bad(format!(
                "peft_type {}: ddpjob continues LoRA adapters only",
                c["peft_type"]
            )));
        }
        let unsupported = [
            ("use_dora", c["use_dora"] == true),
            ("use_rslora", c["use_rslora"] == true),
            ("lora_bias", c["lora_bias"] == true),
            ("bias", !c["bias"].is_null() && c["bias"] != "none"),
            ("modules_to_save", !is_empty(&c["modules_to_save"])),
            ("rank_pattern", !is_empty(&c["rank_pattern"])),
            ("alpha_pattern", !is_empty(&c["alpha_pattern"])),
            ("layers_to_transform", !is_empty(&c["layers_to_transform"])),
            ("layer_replication", !is_empty(&c["layer_replication"])),
            ("exclude_modules", !is_empty(&c["exclude_modules"])),
            ("target_parameters", !is_empty(&c["target_parameters"])),
            (
                "trainable_token_indices",
                !is_empty(&c["trainable_token_indices"]),
            ),
            (
                "alora_invocation_tokens",
                !is_empty(&c["alora_invocation_tokens"]),
            ),
            ("use_qalora", c["use_qalora"] == true),
        ];
        if !c["task_type"].is_null() && c["task_type"] != "CAUSAL_LM" {
            return Err(bad(format!(
                "task_type {}: ddpjob continues causal language models' adapters \
                 (\"CAUSAL_LM\")",
                c["task_type"]
            )));
        }
        if let Some((key, _)) = unsupported.iter().find(|(_, on)| *on) {
            return Err(bad(format!(
                "it sets {key}, which ddpjob's LoRA does not train (it trains PEFT's plain \
                 LoRA: one r and alpha, linear layers, no biases)"
            )));
        }
        let target_modules: TargetModules = serde_json::from_value(c["target_modules"].clone())
            .map_err(|_| bad(format!("target_modules {}", c["target_modules"])))?;
        target_modules.check().map_err(bad)?;
        let number = |key: &str| {
            c[key]
                .as_f64()
                .ok_or_else(|| bad(format!("it has no number {key}")))
        };
        let named = c["base_model_name_or_path"].as_str().unwrap_or_default();
        let base = [Path::new(named).to_path_buf(), dir.join(named)]
            .into_iter()
            .find(|p| !named.is_empty() && p.join("config.json").is_file())
            // Not through the adapter's directory (`adapter/../base`), which may move.
            .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
            .ok_or_else(|| {
                bad(format!(
                    "its base_model_name_or_path \"{named}\" is not a model directory here \
                     (neither from the working directory nor from the adapter's); download the \
                     base and set model.init_from to it and model.lora.adapter to `{}`",
                    dir.display()
                ))
            })?;
        Ok(AdapterConfig {
            base,
            r: number("r")? as usize,
            alpha: number("lora_alpha")?,
            dropout: number("lora_dropout").unwrap_or(0.0),
            target_modules,
        })
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}
