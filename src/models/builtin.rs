//! ddpjob's own networks, registered through the same [`Registry::model`] a user's binary
//! calls: each builder takes its options struct and the [`ModelContext`].

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::{Cnn, Gpt, GptConfig, Mlp, Model, with_precision};
use crate::config::{GptSpec, Precision};
use crate::registry::{BuildError, ModelContext, Registry};
use crate::task::ModelInput;

/// `model.arch = "mlp"`: the hidden layers' widths.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MlpOptions {
    pub hidden: Vec<usize>,
}

/// `model.arch = "cnn"` has no options.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CnnOptions {}

/// Adds `mlp`, `cnn` and `gpt`, marked as built in (their keys are checked by the config
/// schema), and `llama`, whose keys its options struct declares.
pub(crate) fn register_builtin(registry: Registry) -> Registry {
    registry
        .model("mlp", build_mlp)
        .model("cnn", build_cnn)
        .model("gpt", build_gpt)
        .into_builtin()
        // Its `[model]` keys are its options struct's (`transformers`' config names), read
        // as a registered model's are.
        .language_model("llama", super::llama::build_llama)
}

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

/// (vocab_size, block_size) of a language model's input.
pub(super) fn token_windows(arch: &str, cx: &ModelContext) -> Result<(usize, usize), BuildError> {
    match cx.input {
        ModelInput::Tokens {
            vocab_size,
            block_size,
        } => Ok((vocab_size, block_size)),
        other => {
            Err(format!("model.arch = \"{arch}\" learns from token windows, not {other:?}").into())
        }
    }
}

fn build_gpt(o: &GptSpec, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    let (vocab_size, block_size) = token_windows("gpt", cx)?;
    let config = GptConfig {
        vocab_size,
        block_size,
        n_layer: o.n_layer,
        n_head: o.n_head,
        n_embd: o.n_embd,
        dropout: o.dropout,
        bias: o.bias,
        activation: o.activation,
    };
    // The gpt does its own autocast: its inputs are token ids, not values to cast.
    let (device, dtype) = (&cx.device, cx.compute_dtype);
    if cx.restoring {
        // A checkpoint's weights replace these: nothing to draw or read.
        return Ok(Box::new(Gpt::for_loading(&config, device, dtype)?));
    }
    let Some(dir) = &o.init_from else {
        return Ok(Box::new(Gpt::new(&config, cx.seed, device, dtype)?));
    };
    let gpt = Gpt::for_loading(&config, device, dtype)?;
    let dir = std::path::Path::new(dir);
    match crate::checkpoint::Trained::find(dir) {
        // Another job's gpt: its position table cut to this job's window.
        Some(trained) => trained?.load_into(gpt.params(), Some("transformer.wpe.weight"))?,
        None => super::gpt::hf::load(&gpt, &crate::hf::HfDir::open(dir)?)?,
    }
    Ok(Box::new(gpt))
}
