//! `model.init_from` naming a model that transformers + bitsandbytes saved in 4 bits (its
//! `config.json`'s `quantization_config`, as the Hub's `*-bnb-4bit` checkpoints have): the job
//! takes the base as saved, as `from_pretrained` does, so `[model.quantize]` is filled in from
//! that config (`bits = 4`, `type` from `bnb_4bit_quant_type`, `double_quant` from
//! `bnb_4bit_use_double_quant`; each layer's block size is checked as it loads). Keys the job
//! sets itself must agree. Read before the rest of the config, after a Hub id and a PEFT
//! adapter's base are resolved; `job.toml` holds the result. Other quantisations (GPTQ, AWQ,
//! 8-bit) are left to the loader, which refuses them by name.

use std::path::Path;

use super::ConfigError;
use super::source::Source;

/// Fills in `[model.quantize]` when `model.init_from` is a directory bitsandbytes saved in 4
/// bits.
pub(super) fn resolve(source: &mut Source) -> Result<(), ConfigError> {
    let Some(toml::Value::Table(model)) = source.table.get("model") else {
        return Ok(());
    };
    let Some(dir) = model.get("init_from").and_then(toml::Value::as_str) else {
        return Ok(());
    };
    let Some((kind, double_quant)) = saved_in_four_bits(Path::new(dir)) else {
        return Ok(());
    };
    let mut quantize = model
        .get("quantize")
        .and_then(toml::Value::as_table)
        .cloned()
        .unwrap_or_default();
    let saved = [
        ("bits", toml::Value::from(4)),
        ("type", kind.into()),
        ("double_quant", double_quant.into()),
    ];
    for (key, value) in &saved {
        if let Some(given) = quantize.get(*key)
            && given != value
        {
            let key = format!("model.quantize.{key}");
            return Err(ConfigError::Invalid {
                at: source.value_origin(&key),
                key,
                problem: format!(
                    "is {given}, but `{dir}` (model.init_from) was saved in 4 bits by \
                     bitsandbytes with {value} (its config.json's quantization_config); leave \
                     it out to train over the base as saved"
                ),
            });
        }
    }
    for (key, value) in saved {
        quantize.insert(key.into(), value);
    }
    if let Some(toml::Value::Table(model)) = source.table.get_mut("model") {
        model.insert("quantize".into(), quantize.into());
    }
    Ok(())
}

/// The 4-bit type and double quantisation of a directory whose `config.json` says bitsandbytes
/// saved it in 4 bits; `None` for anything else (no such file, or another quantisation).
fn saved_in_four_bits(dir: &Path) -> Option<(String, bool)> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    let q = config.get("quantization_config")?;
    let four_bit = q.get("quant_method")?.as_str()? == "bitsandbytes"
        && q.get("load_in_4bit").and_then(serde_json::Value::as_bool) == Some(true);
    if !four_bit {
        return None;
    }
    // BitsAndBytesConfig's defaults: fp4, no double quantisation.
    let kind = q
        .get("bnb_4bit_quant_type")
        .and_then(serde_json::Value::as_str);
    let double_quant = q
        .get("bnb_4bit_use_double_quant")
        .and_then(serde_json::Value::as_bool);
    Some((
        kind.unwrap_or("fp4").to_string(),
        double_quant.unwrap_or(false),
    ))
}
