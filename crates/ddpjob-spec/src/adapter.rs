//! `model.init_from` naming a PEFT adapter directory (`adapter_config.json` +
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes it, or `export --peft`):
//! the job continues that adapter. Read here, before anything else of the config, into what
//! the rest of ddpjob already knows: `model.init_from` becomes the adapter's base (its
//! `base_model_name_or_path`), `[model.lora]` takes its `r`, `lora_alpha`, `lora_dropout` and
//! `target_modules`, and `model.lora.adapter` names the directory its weights come from.
//! `job.toml` holds the result, so a resumed job reads the same base and adapter.

use std::path::Path;

use super::ConfigError;
use super::lora::TargetModules;
use super::peft_adapter::AdapterConfig;
use super::source::Source;

/// Rewrites `source`'s `[model]` when `model.init_from` or `model.lora.adapter` names an
/// adapter directory. Keys the job sets itself must agree with the adapter's (but `dropout`,
/// which training may change).
pub(super) fn resolve(source: &mut Source) -> Result<(), ConfigError> {
    let Some(toml::Value::Table(model)) = source.table.get("model") else {
        return Ok(());
    };
    let lora = model
        .get("lora")
        .and_then(toml::Value::as_table)
        .cloned()
        .unwrap_or_default();
    // The adapter `model.init_from` names (its base becomes init_from), or the one
    // `model.lora.adapter` names over the job's own init_from.
    let init_from = model.get("init_from").and_then(toml::Value::as_str);
    let (dir, key, from_init) = match (init_from, lora.get("adapter").and_then(|v| v.as_str())) {
        (Some(d), _) if AdapterConfig::is_adapter_dir(Path::new(d)) => {
            (d.to_string(), "model.init_from", true)
        }
        // A stored job's `[model.lora]` holds what the adapter said when the job began, and
        // its weights the adapters as trained: the directory may have moved or changed since.
        (_, Some(_)) if source.is_stored_job() => return Ok(()),
        (_, Some(d)) if !d.is_empty() => (d.to_string(), "model.lora.adapter", false),
        _ => return Ok(()),
    };
    let fail = |source: &Source, key: &str, problem: String| ConfigError::Invalid {
        key: key.into(),
        at: source.value_origin(key),
        problem,
    };
    let adapter = AdapterConfig::read(Path::new(&dir)).map_err(|e| fail(source, key, e))?;
    let set: Vec<(&str, toml::Value)> = vec![
        ("r", (adapter.r as i64).into()),
        ("alpha", adapter.alpha.into()),
        (
            "target_modules",
            match &adapter.target_modules {
                TargetModules::Names(names) => names.clone().into(),
                TargetModules::Regex(p) => p.clone().into(),
            },
        ),
    ];
    for (lora_key, value) in &set {
        if let Some(given) = lora.get(*lora_key)
            && !same(given, value)
        {
            return Err(fail(
                source,
                &format!("model.lora.{lora_key}"),
                format!(
                    "is {given}, but the adapter `{dir}` ({key}) has {value}; leave it out to \
                     continue the adapter as it is"
                ),
            ));
        }
    }
    let mut lora = lora;
    for (lora_key, value) in set {
        lora.insert(lora_key.into(), value);
    }
    lora.entry("dropout").or_insert(adapter.dropout.into());
    lora.insert("adapter".into(), dir.clone().into());
    if let Some(toml::Value::Table(model)) = source.table.get_mut("model") {
        if from_init {
            model.insert(
                "init_from".into(),
                adapter.base.display().to_string().into(),
            );
        }
        model.insert("lora".into(), lora.into());
    }
    Ok(())
}

/// Whether a job's value equals the adapter's (integers and floats compared as numbers,
/// lists of names as sets).
fn same(given: &toml::Value, adapter: &toml::Value) -> bool {
    let number = |v: &toml::Value| v.as_float().or(v.as_integer().map(|i| i as f64));
    let names = |v: &toml::Value| -> Option<std::collections::BTreeSet<String>> {
        v.as_array()?
            .iter()
            .map(|n| n.as_str().map(String::from))
            .collect()
    };
    match (number(given), number(adapter)) {
        (Some(a), Some(b)) => a == b,
        _ if given.is_str() => given == adapter,
        _ => names(given).is_some() && names(given) == names(adapter),
    }
}
