//! The image models' options and builders (`model.arch = "mlp"` and `"cnn"`), registered
//! through the same `Registry::model` a user's binary calls: each builder takes its options
//! struct and the [`ModelContext`].

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::{Cnn, Mlp, Model, with_precision};
use ddpjob_seam::{BuildError, ModelContext, ModelInput};
use ddpjob_spec::{KeyDoc, Precision};

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

/// The documented `[model]` keys of `mlp`.
pub const MLP_KEYS: &[KeyDoc] = &[KeyDoc {
    key: "hidden",
    default: "`[256, 256]`",
    doc: "the hidden layers' widths",
}];

/// `model.arch = "cnn"` has no options.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CnnOptions {}

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

/// `model.arch = "mlp"` for an image task.
pub fn build_mlp(o: &MlpOptions, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    let (shape, classes) = images("mlp", cx)?;
    let mlp = Mlp::new(shape, &o.hidden, classes, cx.seed, &cx.device)?;
    Ok(with_precision(Box::new(mlp), precision(cx)))
}

/// `model.arch = "cnn"` for an image task.
pub fn build_cnn(_: &CnnOptions, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    let (shape, classes) = images("cnn", cx)?;
    let cnn = Cnn::new(shape, classes, cx.seed, &cx.device)?;
    Ok(with_precision(Box::new(cnn), precision(cx)))
}
