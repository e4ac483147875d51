//! The models a job builds: ddpjob's own families and kit (`ddpjob-models`), and building the
//! model a job's spec names through the installed [`Registry`], with its LoRA, freezing and
//! precision applied.

#[cfg(test)]
mod tests;

use candle_core::{Device, Result, Tensor};

use crate::config::{ModelSpec, Precision};
use crate::registry::{ModelContext, Registry};
use crate::task::ModelInput;

pub use ddpjob_models::*;

/// The model blank (nothing drawn; zero pages never touched), its `init_from` weights checked
/// against it from their files' headers (names, shapes, types), not loaded: what the launcher
/// and `validate` build to refuse weights that do not fit, and to estimate memory, before
/// anything exists. A model to be trained: a 4-bit base without adapters is refused.
pub(crate) fn checked_blank(
    spec: &ModelSpec,
    input: ModelInput,
    seed: u64,
    device: &Device,
    precision: Precision,
) -> Result<Box<dyn Model>> {
    // Scoring or sampling a 4-bit model needs no adapters; training one does (as
    // transformers refuses to fine-tune a purely quantised model).
    if spec.quantize().is_some() && spec.lora().is_none() {
        return Err(candle_core::Error::Msg(
            "model.quantize: a 4-bit base is frozen and cannot train by itself: QLoRA trains \
             LoRA adapters on top of it, so add [model.lora] (e.g. r = 16, target_modules = \
             \"all-linear\")"
                .into(),
        ));
    }
    // A model with a Hugging Face family reads its weights through `hf`, which honours
    // `checking`; a registered model's own loading would read them all: left blank.
    let through_hf = Registry::current().reads_hf_weights(spec.arch());
    match spec.init_from() {
        Some(_) if through_hf => {
            crate::hf::checking(|| build(spec, input, seed, device, precision, false))
        }
        _ => build(spec, input, seed, device, precision, true),
    }
}

/// Builds the model of `spec` for `input` through the installed [`Registry`], computing in
/// `precision` (f32 master weights either way). `restoring`: a checkpoint will replace the
/// weights, so pretrained ones need not be loaded. A mismatch of model and data (a gpt on
/// images) is an error; validation refuses such configs first.
pub fn build(
    spec: &ModelSpec,
    input: ModelInput,
    seed: u64,
    device: &Device,
    precision: Precision,
    restoring: bool,
) -> Result<Box<dyn Model>> {
    let mut cx = ModelContext::new(input, seed, device, precision, restoring);
    cx.lora = spec.lora().cloned();
    cx.quantize = spec.quantize().copied();
    let fail =
        |e: String| candle_core::Error::Msg(format!("model.arch = \"{}\": {e}", spec.arch()));
    let model = Registry::current()
        .build_model(spec.arch(), spec.options(), &cx)
        .map_err(|e| fail(e.to_string()))?;
    let (lora, quantize) = (spec.lora(), spec.quantize());
    ddpjob_models::adapt(model, spec.arch(), lora, quantize, spec.freeze(), restoring)
}

/// `config.json` and tensors of a Hugging Face export of a job's model: `spec`'s options and
/// its trained `tensors` (as `model.safetensors` holds them), as the model's family writes
/// them; a model without a Hugging Face format is refused with the reason.
pub(crate) fn hf_export_parts(
    spec: &ModelSpec,
    tensors: std::collections::HashMap<String, Tensor>,
) -> std::result::Result<crate::hf::HfParts, String> {
    Registry::current().export_hf(spec.arch(), spec.options(), tensors)
}
