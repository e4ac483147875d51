//! ddpjob's own networks, registered through the same [`Registry::model`] a user's binary
//! calls: each builder takes its options struct and the [`ModelContext`].

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::{Cnn, Mlp, Model, with_precision};
use crate::config::Precision;
use crate::registry::{BuildError, KeyDoc, ModelContext, Registry};
use crate::task::ModelInput;

/// `model.arch = "mlp"`: the hidden layers' widths.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MlpOptions {
    /// The hidden layers' widths, each at least 1.
    #[serde(default = "two_layers_of_256", deserialize_with = "widths")]
    pub hidden: Vec<usize>,
}

fn two_layers_of_256() -> Vec<usize> {
    vec![256, 256]
}

fn widths<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<usize>, D::Error> {
    let widths = Vec::<usize>::deserialize(d)?;
    if widths.contains(&0) {
        return Err(serde::de::Error::custom(format!(
            "`hidden` = {widths:?}: every width must be at least 1"
        )));
    }
    Ok(widths)
}

const MLP_KEYS: &[KeyDoc] = &[KeyDoc {
    key: "hidden",
    default: "`[256, 256]`",
    doc: "the hidden layers' widths",
}];

/// `model.arch = "cnn"` has no options.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CnnOptions {}

/// ddpjob's own models, registered as a user's binary registers its own: each owns its
/// `[model]` keys (its options struct's fields), and the language models their Hugging Face
/// `model_type`s and export.
pub(crate) fn register_builtin(registry: Registry) -> Registry {
    registry
        .model("mlp", build_mlp)
        .model("cnn", build_cnn)
        .language_model("gpt", super::gpt::options::build_gpt)
        // GPT-2's layers are Conv1D, weights stored [in, out]: PEFT's fan_in_fan_out.
        .hf_family(
            "gpt",
            &super::gpt::options::MODEL_TYPES,
            super::gpt::options::hf_parts,
            true,
        )
        .language_model("llama", super::llama::build_llama)
        .hf_family(
            "llama",
            &super::llama::MODEL_TYPES,
            super::llama::hf_parts,
            false,
        )
        .documented("mlp", MLP_KEYS)
        .documented("gpt", super::gpt::options::KEYS)
        .documented("llama", super::llama::KEYS)
        .blocks("mlp", false)
        .blocks("cnn", false)
        .blocks("gpt", true)
        .blocks("llama", true)
        .lora_layers("gpt", GPT_LINEAR_LAYERS)
        .lora_layers("llama", LLAMA_LINEAR_LAYERS)
        // `hidden` is the default model's (mlp) key; job files switching `arch` keep it.
        .model_tolerates("cnn", &["hidden"])
        .model_tolerates("gpt", &["hidden"])
}

/// The linear layers of a `gpt` LoRA adapts (their names' last part), as PEFT names GPT-2's.
const GPT_LINEAR_LAYERS: &[&str] = &["c_attn", "c_proj", "c_fc"];

/// The linear layers of a `llama` LoRA adapts, as PEFT names them.
const LLAMA_LINEAR_LAYERS: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

fn precision(cx: &ModelContext) -> Precision {
    if cx.compute_dtype == DType::BF16 {
        Precision::Bf16
    } else {
        Precision::F32
    }
}

fn images(arch: &str, cx: &ModelContext) -> Result<([usize; 3], usize), BuildError> {
    match cx.input {
        ModelInput::Image { shape, classes } => Ok((shape, classes)),
        other => Err(format!("model.arch = \"{arch}\" learns from images, not {other:?}").into()),
    }
}

fn build_mlp(o: &MlpOptions, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    let (shape, classes) = images("mlp", cx)?;
    let mlp = Mlp::new(shape, &o.hidden, classes, cx.seed, &cx.device)?;
    Ok(with_precision(Box::new(mlp), precision(cx)))
}

fn build_cnn(_: &CnnOptions, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    let (shape, classes) = images("cnn", cx)?;
    let cnn = Cnn::new(shape, classes, cx.seed, &cx.device)?;
    Ok(with_precision(Box::new(cnn), precision(cx)))
}

#[cfg(test)]
mod tests {
    use crate::config::Builders as _;
    use crate::registry::Registry;

    /// `ddpjob keys` and the config reference list what each built-in model's options struct
    /// reads: a field added without its line, or a line for a field that is gone, fails here.
    #[test]
    fn every_builtin_models_keys_are_documented_in_field_order() {
        let registry = Registry::builtin();
        let docs = registry.model_docs();
        let archs: Vec<&str> = docs.iter().map(|m| m.arch).collect();
        assert_eq!(archs, ["cnn", "gpt", "llama", "mlp"]);
        for m in docs {
            let documented: Vec<&str> = m.keys.iter().map(|k| k.key).collect();
            assert_eq!(documented, m.fields, "model.arch = \"{}\"", m.arch);
        }
    }
}
